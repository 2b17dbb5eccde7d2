"""The attention layer's checks of its arguments and inputs, each a one-line error naming what was
expected and what came: the head counts and widths, a sublayer's input tensor, finiteness, rotary
positions, the QK-norm and soft-cap settings and the constructor's other arguments."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..core.checks import check_positive_int, is_number
from ..nn.positions import Rotary


def _shape(t: Tensor) -> list[int]:
    return list(t.shape)


def resolve_head_dims(
    d_model: int, n_heads: int, d_head: int | None, n_kv_heads: int | None
) -> tuple[int, int]:
    """Validate and complete (d_head, n_kv_heads); errors name the numbers that do not fit."""
    for name, value in (("d_model", d_model), ("n_heads", n_heads)):
        check_positive_int(name, value)
    if d_head is None:
        if d_model % n_heads != 0:
            raise ValueError(
                f"d_model={d_model} is not divisible by n_heads={n_heads}; pass d_head explicitly "
                f"(e.g. d_head={max(1, d_model // n_heads)}) or choose n_heads among the divisors of d_model"
            )
        d_head = d_model // n_heads
    else:
        check_positive_int("d_head", d_head)
    if n_kv_heads is None:
        n_kv_heads = n_heads
    else:
        check_positive_int("n_kv_heads", n_kv_heads)
    if n_heads % n_kv_heads != 0:
        raise ValueError(
            f"n_heads={n_heads} is not divisible by n_kv_heads={n_kv_heads}; each key/value head serves a "
            f"group of query heads, so n_kv_heads must divide n_heads"
        )
    return d_head, n_kv_heads


def check_input_tensor(name: str, t: Any, dim: int, dim_name: str, weight: Tensor) -> None:
    """``t`` must be a 3-D tensor [batch, seq, ``dim_name``=``dim``] of ``weight``'s dtype and device.

    The one check behind every sublayer's input (the attention's query, key and value, a block's
    residual stream): errors name ``name``, the expected shape, dtype or device, and what came.
    """
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a tensor [batch, seq, {dim_name}]; got {type(t).__name__}")
    if t.dim() != 3:
        hint = " (for one unbatched sequence use .unsqueeze(0))" if t.dim() == 2 else ""
        raise ValueError(
            f"{name} must be 3-D [batch, seq, {dim_name}={dim}]; got a {t.dim()}-D tensor of shape "
            f"{_shape(t)}{hint}"
        )
    if t.shape[-1] != dim:
        raise ValueError(f"{name} must have last dimension {dim_name}={dim}; got shape {_shape(t)}")
    if t.dtype != weight.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but the layer's weights are {weight.dtype}")
    if t.device != weight.device:
        raise ValueError(f"{name} is on {t.device} but the layer's weights are on {weight.device}")


def refuse_non_finite(name: str, t: Tensor, *, allow_neg_inf: bool = False) -> None:
    """Raise ``ValueError`` naming ``name``, the first bad index and its value if ``t`` has NaN/Inf.

    ``allow_neg_inf``: -inf is legal (an additive mask's "blocked").
    """
    bad = ~torch.isfinite(t)
    if allow_neg_inf:
        bad &= ~torch.isneginf(t)
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        value = t[where].item()
        refused = "NaN/+Inf (-inf blocks)" if allow_neg_inf else "NaN/Inf"
        raise ValueError(
            f"{name} has a non-finite value ({value}) at index {where} (shape {_shape(t)}); "
            f"check_finite=True refuses {refused}"
        )


#: the old private name (the drop-in and ``headspace.attention`` import it)
_check_finite = refuse_non_finite


def check_rotary_positions(positions: Any, batch: int, seq_q: int, device: torch.device) -> None:
    """``positions`` must be an integer tensor [seq_q] or [batch, seq_q] ([1, seq_q]) on ``device``."""
    if not isinstance(positions, Tensor):
        raise TypeError(
            f"positions must be an integer tensor [seq_q] or [batch, seq_q]; got {type(positions).__name__}"
        )
    if positions.dtype == torch.bool or positions.is_floating_point() or positions.is_complex():
        raise TypeError(f"positions must have an integer dtype (int64 or int32); got {positions.dtype}")
    fits = (positions.dim() == 1 and positions.shape[0] == seq_q) or (
        positions.dim() == 2 and positions.shape[1] == seq_q and positions.shape[0] in (1, batch)
    )
    if not fits:
        raise ValueError(
            f"positions must be [seq_q={seq_q}] or [batch={batch}, seq_q={seq_q}] (one per query); got "
            f"shape {_shape(positions)}"
        )
    if positions.device != device:
        raise ValueError(f"positions is on {positions.device} but the query is on {device}")


QK_NORMS = ("head", "all", "head_layernorm", "l2")


def _check_qk_norm(qk_norm: Any, softcap: Any) -> None:
    """``qk_norm`` None or one of :data:`QK_NORMS`; ``softcap`` None or a finite number > 0."""
    if qk_norm is not None and qk_norm not in QK_NORMS:
        raise ValueError(
            f"qk_norm must be None, 'head' (RMSNorm over each head's d_head), 'all' (over all heads at "
            f"once), 'head_layernorm' or 'l2' (weightless, over each head); got {qk_norm!r}"
        )
    if softcap is not None and (not is_number(softcap) or not math.isfinite(softcap) or softcap <= 0):
        raise ValueError(
            f"softcap must be None or a finite number > 0 (cap * tanh(s / cap)); got {softcap!r}"
        )


def _check_layer_args(
    d_model: int, d_head: int, qkv_bias: Any, out_bias: Any, rotary: Any, kdim: Any, vdim: Any, dropout: Any,
    scale: Any, dtype: Any,
) -> None:  # fmt: skip
    """:class:`MultiHeadAttention`'s own checks of its arguments (each a one-line error naming one)."""
    for name, flag in (("qkv_bias", qkv_bias), ("out_bias", out_bias)):
        if flag is not None and not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool or None (= bias); got {type(flag).__name__} {flag!r}")
    if rotary is not None:
        if not isinstance(rotary, Rotary):
            raise TypeError(
                f"rotary must be a headspace.positions.Rotary or None; got {type(rotary).__name__}"
            )
        if rotary.d_head != d_head:
            raise ValueError(f"rotary was made for d_head={rotary.d_head} but this layer has d_head={d_head}")
    for name, dim in (("kdim", kdim), ("vdim", vdim)):
        if dim is not None:
            check_positive_int(name, dim, note=f" (or None for d_model={d_model})")
    if not is_number(dropout):
        raise TypeError(f"dropout must be a float in [0, 1); got {type(dropout).__name__} {dropout!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1); got {dropout}")
    if scale is not None and (not is_number(scale) or not math.isfinite(scale)):
        raise ValueError(f"scale must be a finite float (or None for 1/sqrt(d_head)); got {scale!r}")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype (or None); got {dtype!r}")
