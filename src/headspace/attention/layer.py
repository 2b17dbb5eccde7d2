"""MultiHeadAttention: the four projections, per-head views and forward (its KV cache is
:class:`headspace.decode.kv_cache.KVCache`; the rotation is :func:`headspace.positions.rotate_fused`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.checks import check_positive_int, is_number
from ..decode.kv_cache import KVCache
from ..kernels.workspace import THREAD_SCRATCH_MIN_BYTES, Workspace, thread_workspace
from ..nn.hooks import HookPoint, Recomputed, note_source, noting, source_of
from ..nn.masks import CanonicalMask, canonical_mask, check_window
from ..nn.norms import HeadLayerNorm, RMSNorm, rms_inverse, rms_norm
from ..nn.positions import Rotary, rotary_tables, rotate_fused
from ..nn.spec import AttentionSpec
from .described import DescribedAttention
from .functional import DeferredAttention, DeferredResult, get_backend, reference_parts, reference_rows
from .heads import Head, HeadList


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


def _check_finite(name: str, t: Tensor, *, allow_neg_inf: bool = False) -> None:
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


def _check_rotary_positions(positions: Any, batch: int, seq_q: int, device: torch.device) -> None:
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


QK_NORMS = ("head", "all", "head_layernorm")


def _check_qk_norm(qk_norm: Any, softcap: Any) -> None:
    """``qk_norm`` None or one of :data:`QK_NORMS`; ``softcap`` None or a finite number > 0."""
    if qk_norm is not None and qk_norm not in QK_NORMS:
        raise ValueError(
            f"qk_norm must be None, 'head' (RMSNorm over each head's d_head) or 'all' (over all heads at "
            f"once); got {qk_norm!r}"
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


def _last_keys(
    key_padding: Tensor | None, attn_mask: Tensor | None, seq_k: int
) -> tuple[Tensor | None, Tensor | None]:
    """The masks' last ``seq_k`` key columns (a windowed KV cache holds only the newest keys); masks
    already that narrow, or None, are returned as they are."""
    if key_padding is not None and key_padding.dim() == 2 and key_padding.shape[1] > seq_k:
        key_padding = key_padding[:, -seq_k:]  # (batch, seq_k)
    if attn_mask is not None and attn_mask.dim() >= 2 and attn_mask.shape[-1] > seq_k:
        attn_mask = attn_mask[..., -seq_k:]  # (..., seq_q, seq_k)
    return key_padding, attn_mask


@dataclass
class QKVOps:
    """What a fused self-attention layer's traced path computes q, k and v with (:func:`project_stages`):
    the layer's own tensors during its forward, copies of them in a deferred hook value.

    ``q_norm`` / ``k_norm``: (weight, eps, offset) of the QK-norms, or None; ``cos`` / ``sin``: the
    rotary tables of the call (:func:`~headspace.positions.rotary_tables`), or None.
    """

    weight: Tensor
    bias: Tensor | None
    n_heads: int
    n_kv_heads: int
    d_head: int
    qk_norm: str | None = None
    q_norm: tuple[Tensor, float, float] | None = None
    k_norm: tuple[Tensor, float, float] | None = None
    rotary: Rotary | None = None
    cos: Tensor | None = None
    sin: Tensor | None = None


def _norm_params(norm: nn.Module | None, copy: bool) -> tuple[Tensor, float, float] | None:
    if norm is None:
        return None
    w = norm.weight.detach()
    return (w.clone() if copy else w, norm.eps, norm.offset)


def project_stages(x: Tensor, ops: QKVOps) -> dict[str, Tensor]:
    """The traced path's q, k and v from the layer's input x [B, S, d_model], with every stage a hook
    point shows, all [B, heads, S, d_head]: ``"q"``, ``"k"``, ``"v"`` (views of the one projection),
    ``"q_normed"``, ``"k_normed"`` (QK-norm layers), ``"rot_q"``, ``"rot_k"`` (rotary layers), and
    ``"q_att"``, ``"k_att"``, the q and k the scores use. The ops are :meth:`MultiHeadAttention.
    project_qkv`'s, :meth:`~MultiHeadAttention.normed_qk`'s and :func:`~headspace.positions.rotate_fused`,
    in that order, so the values are bit for bit the traced forward's."""
    B, S, _ = x.shape
    H, Hkv, dh = ops.n_heads, ops.n_kv_heads, ops.d_head
    qkv = F.linear(x, ops.weight, ops.bias)  # (B, S, (H + 2 Hkv) dh)
    qkv = qkv.view(B, S, H + 2 * Hkv, dh).transpose(1, 2)  # (B, H + 2 Hkv, S, dh)
    q, k, v = qkv.split([H, Hkv, Hkv], dim=1)  # (B, H, S, dh), (B, Hkv, S, dh) x 2
    stages = {"q": q, "k": k, "v": v}
    if ops.qk_norm is not None:
        assert ops.q_norm is not None and ops.k_norm is not None
        if ops.qk_norm == "head":
            q, k = rms_norm(q, *ops.q_norm), rms_norm(k, *ops.k_norm)  # (B, H, S, dh), (B, Hkv, S, dh)
        else:
            q = rms_norm(q.transpose(1, 2).reshape(B, S, H * dh), *ops.q_norm)  # (B, S, H dh)
            q = q.view(B, S, H, dh).transpose(1, 2)  # (B, H, S, dh)
            k = rms_norm(k.transpose(1, 2).reshape(B, S, Hkv * dh), *ops.k_norm)  # (B, S, Hkv dh)
            k = k.view(B, S, Hkv, dh).transpose(1, 2)  # (B, Hkv, S, dh)
        stages["q_normed"], stages["k_normed"] = q, k
    if ops.rotary is not None:
        assert ops.cos is not None and ops.sin is not None
        q = rotate_fused(q, ops.cos, ops.sin, ops.rotary)  # (B, H, S, dh)
        k = rotate_fused(k, ops.cos, ops.sin, ops.rotary)  # (B, Hkv, S, dh)
        stages["rot_q"], stages["rot_k"] = q, k
    stages["q_att"], stages["k_att"] = q, k
    return stages


def _stage(stages: dict[str, Tensor], name: str) -> Tensor:
    return stages[name]


def _hook_view(stages: dict[str, Tensor], name: str) -> Tensor:
    return stages[name].transpose(1, 2)  # (B, S, heads, dh): the hook point's layout


def output_linear(z: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The attention output from z [B, Sq, H, dh] with the heads concatenated: one GEMM by ``W_O``."""
    B, Sq, H, dh = z.shape
    return F.linear(z.reshape(B, Sq, H * dh), weight, bias)  # (B, Sq, d_model)


def output_sum(result: Tensor, bias: Tensor | None) -> Tensor:
    """The attention output as the sum of the heads' results [B, Sq, H, d_model] (plus ``b_O``)."""
    out = result.sum(dim=2)  # (B, Sq, d_model)
    return out if bias is None else out + bias


def _output_of_heads(z: Tensor, W_O: Tensor, bias: Tensor | None) -> Tensor:
    return output_sum(torch.einsum("bshd,hdm->bshm", z, W_O), bias)  # (B, Sq, d_model)


class MultiHeadAttention(DescribedAttention, nn.Module):
    r"""Multi-head attention with every head's projections in plain sight.

    For each head ``h`` (right-multiplication convention, as in the textbook and TransformerLens)::

        q_h = x W_Q[h] + b_Q[h]            W_Q: [n_heads, d_model, d_head]
        k_h = c W_K[g(h)] + b_K[g(h)]      W_K: [n_kv_heads, kdim, d_head]
        v_h = c W_V[g(h)] + b_V[g(h)]      W_V: [n_kv_heads, vdim, d_head]
        z_h = softmax(q_h k_h^T * scale + mask) v_h          scale = 1 / sqrt(d_head)
        out = concat_h(z_h) W_O + b_O = sum_h z_h W_O[h] + b_O     W_O: [n_heads, d_head, d_model]

    With rotary positions (``rotary``, a :class:`~headspace.positions.Rotary`, RoPE), the query at
    position ``i`` and the key at position ``j`` are turned before the scores::

        q_h(i) = (x_i W_Q[h] + b_Q[h]) R(i)      k_h(j) = (c_j W_K[g(h)] + b_K[g(h)]) R(j)
        q_h(i) k_h(j)^T = (x_i W_Q[h] + b_Q[h]) R(i - j) (c_j W_K[g(h)] + b_K[g(h)])^T

    so a score depends on the positions only through ``i - j`` (:meth:`Head.qk` with ``delta``).

    with ``x`` the query input, ``c`` the key/value input (``x`` itself for self-attention) and
    ``g(h) = h // (n_heads / n_kv_heads)`` the key/value head serving query head ``h`` (grouped-query
    attention; ``n_kv_heads = n_heads`` is ordinary multi-head attention, ``1`` multi-query).

    Paper symbols (Vaswani et al. 2017): ``W_Q[h] = W_i^Q``, ``W_K[h] = W_i^K``, ``W_V[h] = W_i^V``,
    ``W_O = W^O`` split into per-head row blocks ``W_O[h]``. Defaults give the paper's d_model=512,
    8 heads, d_head=64.

    Storage is fused for speed: ``qkv_weight`` [(n_heads + 2 n_kv_heads) d_head, d_model] (or separate
    ``q_weight``/``k_weight``/``v_weight`` when kdim or vdim differ from d_model), ``qkv_bias``,
    ``o_weight`` [d_model, n_heads d_head] and ``o_bias``, in ``nn.Linear``'s [out, in] layout.
    ``bias`` switches both biases; ``qkv_bias`` / ``out_bias`` (default: ``bias``) switch them apart
    (Qwen2 has biases on q, k and v but not on the output projection). The
    properties ``W_Q``, ``W_K``, ``W_V``, ``W_O``, ``b_Q``, ``b_K``, ``b_V``, ``b_O`` and ``heads[h]`` are
    zero-copy views of that storage: writing into them (under ``torch.no_grad()``) changes the layer.

    Masks: bool masks mean True = may attend; ``key_padding`` is True for real tokens; float masks are
    additive. See :mod:`headspace.masks` for the whole convention. A query with nothing to attend to
    gives zeros with finite gradients.

    Rotary positions (``rotary`` given; self-attention only): q and k are rotated after the projections
    (and after ``hook_q``/``hook_k``), before the scores; the rotated values pass the hook points
    ``hook_rot_q`` [batch, seq_q, n_heads, d_head] and ``hook_rot_k`` [batch, seq_k, n_kv_heads, d_head]
    (which exist only on rotary layers). A KV cache stores rotated keys. ``forward``'s ``positions``
    (default ``kv_cache.length + arange(seq_q)``) says where each query (and its key) sits. The untraced
    path rotates q and k together, on the fused projection, in a few elementwise ops.

    Beyond the classic layer (issue #27: Gemma 2 / 3, Qwen3, OLMo 2, Mistral), each off by default:

    * ``window`` (sliding-window attention): key ``j`` is visible from query ``i`` iff
      ``i - window < j <= i``, combined by AND with every other mask, on every path; positions are
      absolute (with a KV cache, the cached keys count: :func:`headspace.masks.window_mask`).
    * ``qk_norm``: ``"head"`` normalises each head's q and k over d_head (one RMSNorm weight [d_head]
      each for q and k: Qwen3, Gemma 3), ``"all"`` all heads' q (k) together (OLMo 2); after
      ``hook_q``/``hook_k``, before the rotation; hook points ``hook_q_normed`` [batch, seq_q, n_heads,
      d_head] and ``hook_k_normed`` [batch, seq_k, n_kv_heads, d_head]. ``qk_norm_offset`` 1 is
      Gemma's ``(1 + w)``. With QK-norm the QK circuit ``W_Q[h] W_K[g]^T`` no longer gives the scores
      alone: they are ``RMSNorm(x W_Q[h]) RMSNorm(c W_K[g])^T``, bilinear in the inputs only at each
      token's frozen norm scale ``1 / rms(x W_Q[h])`` (and likewise for k): :meth:`qk_norm_scales` reads
      those off a run, and :meth:`headspace.Head.qk` folds the norms' gains (:meth:`qk_norm_gains`) in.
    * ``softcap`` (Gemma 2): the scaled scores become ``softcap * tanh(s / softcap)`` before the mask;
      ``hook_scores`` sees the capped, masked scores. Soft-capped layers run the reference maths.
    * ``scale``: Gemma's ``query_pre_attn_scalar`` is ``scale = query_pre_attn_scalar ** -0.5``.

    ``check_finite`` (default False, as checking costs a pass over the inputs): when True, NaN/Inf in
    the inputs (NaN/+inf in a float ``attn_mask``) or the output raise ``ValueError`` naming the tensor
    and the first bad index. With the default, NaN/Inf propagate like in any torch layer.
    """

    #: :func:`headspace.prune_heads` may remove heads of this layer (subclasses with a fixed layout say no).
    prunable: bool = True

    def __init__(
        self,
        d_model: int = 512,
        n_heads: int = 8,
        d_head: int | None = None,
        n_kv_heads: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        *,
        scale: float | None = None,
        check_finite: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        qkv_bias: bool | None = None,
        out_bias: bool | None = None,
        rotary: Rotary | None = None,
        window: int | None = None,
        qk_norm: str | None = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_offset: float = 0.0,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        d_head, n_kv_heads = resolve_head_dims(d_model, n_heads, d_head, n_kv_heads)
        check_window(window)
        _check_qk_norm(qk_norm, softcap)
        _check_layer_args(d_model, d_head, qkv_bias, out_bias, rotary, kdim, vdim, dropout, scale, dtype)
        qkv_bias = bool(bias) if qkv_bias is None else qkv_bias
        out_bias = bool(bias) if out_bias is None else out_bias
        self._spec = AttentionSpec(
            d_model, n_heads, d_head, n_kv_heads, qkv_bias=qkv_bias, out_bias=out_bias, positions=rotary,
            scale=None if scale is None else float(scale), window=window,
            softcap=None if softcap is None else float(softcap), qk_norm=qk_norm, qk_norm_eps=qk_norm_eps,
            qk_norm_offset=qk_norm_offset, dropout=dropout,
        )  # fmt: skip
        self.kdim = d_model if kdim is None else kdim
        self.vdim = d_model if vdim is None else vdim
        self.check_finite = check_finite
        self.fused = self.kdim == d_model and self.vdim == d_model
        f = {"device": device, "dtype": dtype}
        hq, hkv = n_heads * d_head, n_kv_heads * d_head
        if self.fused:
            self.qkv_weight = nn.Parameter(torch.empty(hq + 2 * hkv, d_model, **f))
        else:
            self.q_weight = nn.Parameter(torch.empty(hq, d_model, **f))
            self.k_weight = nn.Parameter(torch.empty(hkv, self.kdim, **f))
            self.v_weight = nn.Parameter(torch.empty(hkv, self.vdim, **f))
        self.qkv_bias = nn.Parameter(torch.empty(hq + 2 * hkv, **f)) if qkv_bias else None
        self.o_weight = nn.Parameter(torch.empty(d_model, hq, **f))
        self.o_bias = nn.Parameter(torch.empty(d_model, **f)) if out_bias else None
        self.register_module("rotary", rotary)  # no parameters, no persistent buffers: no state-dict keys
        self._init_qk_norm(qk_norm, qk_norm_eps, qk_norm_offset, f)

        self.hook_q = HookPoint()  # [batch, seq_q, n_heads, d_head]
        self.hook_k = HookPoint()  # [batch, seq_k, n_kv_heads, d_head]
        self.hook_v = HookPoint()  # [batch, seq_k, n_kv_heads, d_head]
        self.hook_scores = HookPoint()  # [batch, n_heads, seq_q, seq_k]
        self.hook_pattern = HookPoint()  # [batch, n_heads, seq_q, seq_k]
        self.hook_z = HookPoint()  # [batch, seq_q, n_heads, d_head]
        self.hook_result = HookPoint()  # [batch, seq_q, n_heads, d_model]
        # rotary layers only: a layer without rotation has nothing to show there
        self.register_module("hook_rot_q", HookPoint() if rotary is not None else None)  # [b, sq, H, dh]
        self.register_module("hook_rot_k", HookPoint() if rotary is not None else None)  # [b, sk, Hkv, dh]
        self._hook_points = (
            self.hook_q,
            self.hook_k,
            self.hook_v,
            self.hook_scores,
            self.hook_pattern,
            self.hook_z,
            self.hook_result,
        ) + (() if rotary is None else (self.hook_rot_q, self.hook_rot_k))
        self._hook_points += () if qk_norm is None else (self.hook_q_normed, self.hook_k_normed)
        self.reset_parameters()

    def _init_qk_norm(self, qk_norm: str | None, eps: float, offset: float, f: dict[str, Any]) -> None:
        """``q_norm`` / ``k_norm`` (:class:`~headspace.norms.RMSNorm` over d_head for ``"head"``, over
        n_heads d_head / n_kv_heads d_head for ``"all"``) and their hook points, or None each."""
        norms = qk_norm is not None
        hq, hkv = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        width_q, width_k = (self.d_head, self.d_head) if qk_norm == "head" else (hq, hkv)
        if qk_norm == "head_layernorm":  # StableLM / Cohere: a LayerNorm per head, its own weight
            self.register_module("q_norm", HeadLayerNorm(self.n_heads, self.d_head, eps).to(**f))
            self.register_module("k_norm", HeadLayerNorm(self.n_kv_heads, self.d_head, eps).to(**f))
        else:
            self.register_module("q_norm", RMSNorm(width_q, eps, offset=offset).to(**f) if norms else None)
            self.register_module("k_norm", RMSNorm(width_k, eps, offset=offset).to(**f) if norms else None)
        # QK-norm layers only: q and k after their RMSNorm, before any rotation
        self.register_module("hook_q_normed", HookPoint() if norms else None)  # [b, sq, H, dh]
        self.register_module("hook_k_normed", HookPoint() if norms else None)  # [b, sk, Hkv, dh]

    # ------------------------------------------------------------------ parameters and views
    def reset_parameters(self) -> None:
        """Xavier-uniform projections and zero biases (as torch.nn.MultiheadAttention)."""
        hq, hkv = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        with torch.no_grad():
            if self.fused:
                # each of W_Q, W_K, W_V initialised as its own [out, in] matrix
                for rows in (slice(0, hq), slice(hq, hq + hkv), slice(hq + hkv, hq + 2 * hkv)):
                    nn.init.xavier_uniform_(self.qkv_weight[rows])
            else:
                for w in (self.q_weight, self.k_weight, self.v_weight):
                    nn.init.xavier_uniform_(w)
            nn.init.xavier_uniform_(self.o_weight)
            if self.qkv_bias is not None:
                self.qkv_bias.zero_()
            if self.o_bias is not None:
                self.o_bias.zero_()

    def _rows(self, which: str) -> Tensor:
        """The [out, in] weight rows of one projection ('q', 'k' or 'v'), a view of the storage."""
        hq, hkv = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        if not self.fused:
            return {"q": self.q_weight, "k": self.k_weight, "v": self.v_weight}[which]
        start = {"q": 0, "k": hq, "v": hq + hkv}[which]
        return self.qkv_weight[start : start + (hq if which == "q" else hkv)]

    def _bias_rows(self, which: str) -> Tensor | None:
        if self.qkv_bias is None:
            return None
        hq, hkv = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        start = {"q": 0, "k": hq, "v": hq + hkv}[which]
        return self.qkv_bias[start : start + (hq if which == "q" else hkv)]

    def _bias_heads(self, which: str) -> Tensor | None:
        """The bias of one projection ('q', 'k' or 'v') per head, a view, or None without bias."""
        b = self._bias_rows(which)
        heads = self.n_heads if which == "q" else self.n_kv_heads
        return None if b is None else b.view(heads, self.d_head)  # (n_heads | n_kv_heads, d_head)

    @property
    def W_Q(self) -> Tensor:
        """[n_heads, d_model, d_head] view: ``q_h = x @ W_Q[h]``."""
        return self._rows("q").view(self.n_heads, self.d_head, self.d_model).transpose(1, 2)

    @property
    def W_K(self) -> Tensor:
        """[n_kv_heads, kdim, d_head] view: ``k_g = c @ W_K[g]``."""
        return self._rows("k").view(self.n_kv_heads, self.d_head, self.kdim).transpose(1, 2)

    @property
    def W_V(self) -> Tensor:
        """[n_kv_heads, vdim, d_head] view: ``v_g = c @ W_V[g]``."""
        return self._rows("v").view(self.n_kv_heads, self.d_head, self.vdim).transpose(1, 2)

    @property
    def W_O(self) -> Tensor:
        """[n_heads, d_head, d_model] view: ``out = sum_h z_h @ W_O[h] + b_O``."""
        return self.o_weight.view(self.d_model, self.n_heads, self.d_head).permute(1, 2, 0)

    @property
    def b_Q(self) -> Tensor | None:
        """[n_heads, d_head] view, or None without bias."""
        return self._bias_heads("q")

    @property
    def b_K(self) -> Tensor | None:
        """[n_kv_heads, d_head] view, or None without bias."""
        return self._bias_heads("k")

    @property
    def b_V(self) -> Tensor | None:
        """[n_kv_heads, d_head] view, or None without bias."""
        return self._bias_heads("v")

    @property
    def b_O(self) -> Tensor | None:
        """[d_model] (shared by all heads), or None without bias."""
        return self.o_bias

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.n_heads // self.n_kv_heads

    @property
    def heads(self) -> HeadList:
        """``attn.heads[h]``: one head's W_Q, W_K, W_V, W_O and biases (views)."""
        return HeadList(self)

    def head(self, index: int) -> Head:
        return self.heads[index]

    @property
    def hooks_active(self) -> bool:
        return any(h.fns for h in self._hook_points)

    def make_kv_cache(self, batch: int, capacity: int) -> KVCache:
        """A cache for incremental self-attention decoding, in this layer's dtype and device; a
        sliding-window layer's holds only the last ``window`` positions (:class:`KVCache`)."""
        w = self.o_weight
        return KVCache(
            batch, self.n_kv_heads, self.d_head, capacity, dtype=w.dtype, device=w.device, window=self.window
        )

    def extra_repr(self) -> str:
        s = f"d_model={self.d_model}, n_heads={self.n_heads}, d_head={self.d_head}"
        if self.n_kv_heads != self.n_heads:
            s += f", n_kv_heads={self.n_kv_heads}"
        if not self.fused:
            s += f", kdim={self.kdim}, vdim={self.vdim}"
        qkv_bias, out_bias = self.qkv_bias is not None, self.o_bias is not None
        if qkv_bias == out_bias:
            s += f", bias={qkv_bias}"
        else:
            s += f", qkv_bias={qkv_bias}, out_bias={out_bias}"
        s += f", dropout={self.dropout}"
        rotary = getattr(self, "rotary", None)
        if rotary is not None:
            s += f", rotary(rotary_dim={rotary.rotary_dim}, base={rotary.base:g}, {rotary.rope_type})"
        if self.window is not None:
            s += f", window={self.window}"
        if self.qk_norm is not None:
            s += f", qk_norm={self.qk_norm!r}"
        if self.softcap is not None:
            s += f", softcap={self.softcap:g}"
        return s

    # ------------------------------------------------------------------ checks
    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        w = self.o_weight
        check_input_tensor("query", query, self.d_model, "d_model", w)
        check_input_tensor("key", key, self.kdim, "kdim", w)
        check_input_tensor("value", value, self.vdim, "vdim", w)
        if key.shape[0] != query.shape[0] or value.shape[0] != query.shape[0]:
            raise ValueError(
                f"query, key and value must have the same batch size; got query {_shape(query)}, key "
                f"{_shape(key)}, value {_shape(value)}"
            )
        if key.shape[1] != value.shape[1]:
            raise ValueError(
                f"key and value must have the same length seq_k; got key {_shape(key)}, value {_shape(value)}"
            )

    # ------------------------------------------------------------------ forward
    def project_qkv(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        workspace: Workspace | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The per-head projections.

        ``workspace``: self-attention only: write the fused projection into its ``"qkv"`` matrix
        instead of fresh memory; q, k, v are then views of the workspace, valid until its next use.

        Returns q [batch, n_heads, seq_q, d_head] and k, v [batch, n_kv_heads, seq_k, d_head].
        """
        B, Sq, _ = query.shape
        H, Hkv, dh = self.n_heads, self.n_kv_heads, self.d_head
        if key is None and self.fused:
            qkv = self._fused_projection(query, workspace)  # (B, H + 2 Hkv, Sq, dh)
            q, k, v = qkv.split([H, Hkv, Hkv], dim=1)  # (B, H, Sq, dh), (B, Hkv, Sq, dh) x 2
            return q, k, v
        key = query if key is None else key
        value = key if value is None else value
        q = F.linear(query, self._rows("q"), self._bias_rows("q"))  # (B, Sq, H dh)
        q = q.view(B, Sq, H, dh).transpose(1, 2)  # (B, H, Sq, dh)
        Sk = key.shape[1]
        if self.fused and key is value:
            hq = H * dh
            b = None if self.qkv_bias is None else self.qkv_bias[hq:]
            kv = F.linear(key, self.qkv_weight[hq:], b)  # (B, Sk, 2 Hkv dh)
            kv = kv.view(B, Sk, 2 * Hkv, dh).transpose(1, 2)  # (B, 2 Hkv, Sk, dh)
            k, v = kv.split([Hkv, Hkv], dim=1)  # (B, Hkv, Sk, dh) x 2
            return q, k, v
        k = F.linear(key, self._rows("k"), self._bias_rows("k"))  # (B, Sk, Hkv dh)
        k = k.view(B, Sk, Hkv, dh).transpose(1, 2)  # (B, Hkv, Sk, dh)
        v = F.linear(value, self._rows("v"), self._bias_rows("v"))  # (B, Sk, Hkv dh)
        v = v.view(B, Sk, Hkv, dh).transpose(1, 2)  # (B, Hkv, Sk, dh)
        return q, k, v

    def _fused_projection(self, query: Tensor, workspace: Workspace | None) -> Tensor:
        """Self-attention's one QKV GEMM: query [B, Sq, d_model] -> [B, H + 2 Hkv, Sq, dh] (a view)."""
        B, Sq, _ = query.shape
        H, Hkv, dh = self.n_heads, self.n_kv_heads, self.d_head
        if workspace is None:
            qkv = F.linear(query, self.qkv_weight, self.qkv_bias)  # (B, Sq, (H + 2 Hkv) dh)
        else:
            x2 = query.reshape(B * Sq, query.shape[-1])  # (B Sq, d_model)
            qkv = workspace.linear("qkv", x2, self.qkv_weight, self.qkv_bias)  # (B Sq, (H + 2 Hkv) dh)
        return qkv.view(B, Sq, H + 2 * Hkv, dh).transpose(1, 2)  # (B, H + 2 Hkv, Sq, dh)

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        key_padding: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        kv_cache: KVCache | None = None,
        positions: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``query`` to ``key``/``value`` (self-attention when both are None).

        Notation used for tensor shapes:
            batch, seq_q, seq_k, d_model, kdim, vdim, n_heads, n_kv_heads, d_head.

        Args:
            query: [batch, seq_q, d_model].
            key: [batch, seq_k, kdim] or None (self-attention).
            value: [batch, seq_k, vdim] or None (= key).
            key_padding: bool [batch, seq_k], True for real tokens (with a KV cache, seq_k counts every
                cached position).
            attn_mask: bool (True = may attend) or float (additive) [seq_q, seq_k], [batch, seq_q, seq_k]
                or [batch, n_heads, seq_q, seq_k].
            is_causal: combine (AND) a causal mask aligned bottom-right with any other mask.
            need_weights: also return the per-head pattern [batch, n_heads, seq_q, seq_k] (never averaged;
                the softmax itself, before dropout: rows sum to 1, rows with nothing to attend to are 0).
            kv_cache: a :class:`KVCache` from :meth:`make_kv_cache`; the new keys and values are appended
                and the queries attend to every cached position (self-attention only).
            positions: rotary layers only: int [seq_q] or [batch, seq_q], the position of each query and
                of its key (None: ``kv_cache.length + arange(seq_q)``, or ``arange(seq_q)`` without a
                cache). Left-padded rows may count from their first real token; only differences of
                positions reach the scores.

        Returns:
            out [batch, seq_q, d_model], or (out, pattern) with ``need_weights=True``.
        """
        self_attention, k_in, v_in = self._checked_call(query, key, value, attn_mask, kv_cache, positions)
        B, Sq, _ = query.shape
        H, dh = self.n_heads, self.d_head
        seq_k = k_in.shape[1] + (kv_cache.held if kv_cache is not None else 0)
        if kv_cache is not None:
            # checked before anything is appended, so a refused call leaves the cache as it was
            kv_cache.check(B, Sq, self.o_weight.dtype, self.o_weight.device)
            if kv_cache.held < kv_cache.length:
                # a windowed cache dropped its oldest keys: the masks, given over every position, lose
                # those columns (the window mask is bottom-right aligned, so it needs no offset)
                key_padding, attn_mask = _last_keys(key_padding, attn_mask, seq_k)
        mask = canonical_mask(
            batch=B,
            n_heads=H,
            seq_q=Sq,
            seq_k=seq_k,
            key_padding=key_padding,
            attn_mask=attn_mask,
            is_causal=is_causal,
            dtype=query.dtype,
            device=query.device,
            window=self.window,
        )
        if B == 0 or Sq == 0:
            z = query.new_zeros(B, Sq, H * dh)  # (B, Sq, H dh)
            out = F.linear(z, self.o_weight, self.o_bias)  # (B, Sq, d_model)
            if need_weights:
                return out, query.new_zeros(B, H, Sq, seq_k)
            return out

        traced = self.hooks_active
        scratch = None
        if not need_weights and self._may_use_thread_workspace(query, self_attention, traced, kv_cache):
            scratch = thread_workspace()  # q, k, v below are views of it, dead before this call returns
        q, k, v, qk = self._heads_qkv(query, k_in, v_in, self_attention, traced, scratch, positions, kv_cache)
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)  # (B, Hkv, Sk, dh) x 2
        dropout_p = self.dropout if self.training else 0.0

        if traced or self.softcap is not None:  # (soft-capping: the reference maths, no fused kernel has it)
            z, pattern, _ = self.traced_attention(
                q, k, v, mask, dropout_p, need_pattern=need_weights, qk_sources=qk
            )
            out = self.output_from_heads(z)  # (B, Sq, d_model)
        else:
            backend = get_backend("explicit" if need_weights else "sdpa")
            z, pattern = backend(q, k, v, mask, scale=self.scale, dropout_p=dropout_p)  # (B, H, Sq, dh)
            # (bench helper) drop our references to the fused projection before W_O allocates the
            # output: without grad this frees [B, S, 3 d_model] early and lowers the peak memory.
            del q, k, v
            z = z.transpose(1, 2).reshape(B, Sq, H * dh)  # (B, Sq, H dh): heads concatenated
            out = F.linear(z, self.o_weight, self.o_bias)  # (B, Sq, d_model)
        if self.check_finite:
            _check_finite("attention output (inputs were finite: check the weights)", out)
        if need_weights:
            return out, pattern
        return out

    def _checked_call(
        self,
        query: Tensor,
        key: Tensor | None,
        value: Tensor | None,
        attn_mask: Tensor | None,
        kv_cache: KVCache | None,
        positions: Tensor | None,
    ) -> tuple[bool, Tensor, Tensor]:
        """:meth:`forward`'s argument checks (masks are checked by ``canonical_mask``).

        Returns (self-attention?, the key input, the value input).
        """
        self_attention = key is None and value is None
        if key is None and value is not None:
            raise ValueError("value was given without key; pass key too (value defaults to key)")
        if self_attention and not self.fused:
            raise ValueError(
                f"self-attention needs kdim == vdim == d_model; this layer has d_model={self.d_model}, "
                f"kdim={self.kdim}, vdim={self.vdim}: pass key and value"
            )
        k_in = query if key is None else key
        v_in = k_in if value is None else value
        self._check_inputs(query, k_in, v_in)
        if kv_cache is not None and not isinstance(kv_cache, KVCache):
            raise TypeError(
                f"kv_cache must be a KVCache (from make_kv_cache) or None; got {type(kv_cache).__name__}"
            )
        if kv_cache is not None and not self_attention:
            raise ValueError("kv_cache is for self-attention decoding; pass key=None and value=None with it")
        rotary = self._modules.get("rotary")  # (a dict lookup: the untraced path stays cheap)
        if rotary is None and positions is not None:
            raise ValueError(
                "positions were given but this layer has no rotary positions (rotary=None); positions are "
                "used only to rotate queries and keys (learned positions are added to the input instead)"
            )
        if rotary is not None and not self_attention:
            raise ValueError(
                "this layer has rotary positions, which are defined for self-attention only; pass key=None "
                "and value=None (or build the layer without rotary for cross-attention)"
            )
        if self.check_finite:
            _check_finite("query", query)
            if not self_attention:
                _check_finite("key", k_in)
                if v_in is not k_in:
                    _check_finite("value", v_in)
            if isinstance(attn_mask, Tensor) and attn_mask.is_floating_point():
                _check_finite("attn_mask", attn_mask, allow_neg_inf=True)
        if not self_attention and k_in.shape[1] == 0:
            # (self-attention on an empty sequence is the seq_q == 0 case of forward: an empty output)
            raise ValueError(f"key length seq_k must be at least 1; got key of shape {_shape(k_in)}")
        return self_attention, k_in, v_in

    def _heads_qkv(
        self,
        query: Tensor,
        k_in: Tensor,
        v_in: Tensor,
        self_attention: bool,
        traced: bool,
        scratch: Workspace | None,
        positions: Tensor | None,
        kv_cache: KVCache | None,
    ) -> tuple[Tensor, Tensor, Tensor, tuple[Recomputed, Recomputed] | None]:
        """The new queries, keys and values per head, rotated on rotary layers, through their hook points.

        Returns q [B, H, Sq, dh] and k, v [B, Hkv, Sk_new, dh] (views of ``scratch`` when given), and the
        deferred q and k of :meth:`_lazy_heads_qkv` (else None). Untraced rotary layers rotate q and k
        together on the fused projection; traced ones fire ``hook_q``, ``hook_k``, ``hook_v``, then
        rotate and fire ``hook_rot_q``, ``hook_rot_k``.
        """
        if traced and self._defers_projection(query, self_attention, kv_cache):
            return self._lazy_heads_qkv(query, positions)
        rotary = self._modules.get("rotary")
        B, Sq, _ = query.shape
        H = self.n_heads
        if rotary is not None:
            if positions is None:
                start = 0 if kv_cache is None else kv_cache.length
                positions = torch.arange(start, start + Sq, device=query.device)  # (Sq,)
            else:
                _check_rotary_positions(positions, B, Sq, query.device)
            cos, sin = rotary_tables(rotary, positions, query.dtype, query.device)  # (B|1, 1, Sq, rd) x 2
        qk_norm = self.qk_norm is not None
        if rotary is not None and not traced and not qk_norm:
            # q and k rotated together: they are neighbouring heads of the fused projection
            Hkv = self.n_kv_heads
            qkv = self._fused_projection(query, scratch)  # (B, H + 2 Hkv, Sq, dh)
            qk = rotate_fused(qkv[:, : H + Hkv], cos, sin, rotary)  # (B, H + Hkv, Sq, dh), fresh
            q, k = qk.split([H, Hkv], dim=1)  # (B, H, Sq, dh), (B, Hkv, Sq, dh)
            return q, k, qkv[:, H + Hkv :], None  # v: (B, Hkv, Sq, dh)
        q, k, v = self.project_qkv(
            query,
            None if self_attention else k_in,
            None if self_attention else v_in,
            workspace=scratch,
        )
        if traced:
            q = self.hook_q(q.transpose(1, 2)).transpose(1, 2)  # (B, H, Sq, dh)
            k = self.hook_k(k.transpose(1, 2)).transpose(1, 2)  # (B, Hkv, Sk_new, dh)
            v = self.hook_v(v.transpose(1, 2)).transpose(1, 2)  # (B, Hkv, Sk_new, dh)
        if qk_norm:
            q, k = self.normed_qk(q, k)  # (B, H, Sq, dh), (B, Hkv, Sk_new, dh)
        if rotary is not None and (traced or qk_norm):
            q = rotate_fused(q, cos, sin, rotary)  # (B, H, Sq, dh)
            k = rotate_fused(k, cos, sin, rotary)  # (B, Hkv, Sk_new, dh)
            if traced:
                if self.hook_rot_q is not None:  # (None if rotary was attached after construction)
                    q = self.hook_rot_q(q.transpose(1, 2)).transpose(1, 2)  # (B, H, Sq, dh)
                    k = self.hook_rot_k(k.transpose(1, 2)).transpose(1, 2)  # (B, Hkv, Sk_new, dh)
        return q, k, v, None

    def _stage_points(self) -> tuple[tuple[str, HookPoint | None], ...]:
        """The hook points of :func:`project_stages`' stages, by stage name (None: the layer has none)."""
        return (
            ("q", self.hook_q),
            ("k", self.hook_k),
            ("v", self.hook_v),
            ("q_normed", self.hook_q_normed),
            ("k_normed", self.hook_k_normed),
            ("rot_q", self.hook_rot_q),
            ("rot_k", self.hook_rot_k),
        )

    def _defers_projection(self, query: Tensor, self_attention: bool, kv_cache: KVCache | None) -> bool:
        """Whether the q/k/v stages may be handed to their recorders as values recomputed from what
        ``query`` is recomputed from (:func:`~headspace.hooks.source_of`): only inside a fully recorded
        block (which noted it), for fused self-attention without a KV cache, with nothing but
        recorders on the stages' hook points and the standard QK-norms."""
        if not noting() or not (self_attention and self.fused) or kv_cache is not None:
            return False
        if source_of(query) is None:
            return False
        if self.qk_norm is not None and not (type(self.q_norm) is RMSNorm and type(self.k_norm) is RMSNorm):
            return False
        return all(p is None or p.defers for _, p in self._stage_points())

    def _qkv_ops(self, cos: Tensor | None, sin: Tensor | None, *, copy: bool) -> QKVOps:
        """:class:`QKVOps` of this layer: its own weights (``copy=False``) or copies of them."""
        w = self.qkv_weight.detach()
        b = None if self.qkv_bias is None else self.qkv_bias.detach()
        rotary = self._modules.get("rotary")
        return QKVOps(
            weight=w.clone() if copy else w,
            bias=None if b is None else (b.clone() if copy else b),
            n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, d_head=self.d_head,
            qk_norm=self.qk_norm,
            q_norm=_norm_params(self.q_norm, copy), k_norm=_norm_params(self.k_norm, copy),
            rotary=rotary, cos=cos, sin=sin,
        )  # fmt: skip

    def _lazy_heads_qkv(
        self, query: Tensor, positions: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor, tuple[Recomputed, Recomputed]]:
        """:meth:`_heads_qkv` of a traced layer whose stages only recorders watch: the same values by
        :func:`project_stages`, each stage's hook point handed a :class:`~headspace.hooks.Recomputed`
        that computes it again from what the input is recomputed from and copies of the weights.

        Returns q [B, H, Sq, dh], k, v [B, Hkv, Sq, dh] and the deferred q and k the scores use."""
        rotary = self._modules.get("rotary")
        B, Sq, _ = query.shape
        cos = sin = None
        if rotary is not None:
            if positions is None:
                positions = torch.arange(Sq, device=query.device)  # (Sq,)
            else:
                _check_rotary_positions(positions, B, Sq, query.device)
            cos, sin = rotary_tables(rotary, positions, query.dtype, query.device)  # (B|1, 1, Sq, rd) x 2
        stages = project_stages(query, self._qkv_ops(cos, sin, copy=False))
        node = Recomputed(project_stages, source_of(query), self._qkv_ops(cos, sin, copy=True))
        for name, point in self._stage_points():
            if point is not None and point.active:
                shape = stages[name].transpose(1, 2).shape
                point.fire_deferred(Recomputed(_hook_view, node, name, shape=shape, head_axis=2))
        q_src = Recomputed(_stage, node, "q_att", shape=stages["q_att"].shape, head_axis=1)
        k_src = Recomputed(_stage, node, "k_att", shape=stages["k_att"].shape, head_axis=1)
        return stages["q_att"], stages["k_att"], stages["v"], (q_src, k_src)

    def normed_qk(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """QK-norm: q [B, H, Sq, dh] and k [B, Hkv, Sk, dh] through ``q_norm`` / ``k_norm``, firing
        ``hook_q_normed`` / ``hook_k_normed`` ([B, S, heads, dh]) while they are active.

        ``qk_norm="head"`` (Qwen3, Gemma 3): ``q_h <- RMSNorm(q_h)`` over each head's d_head features,
        one weight [d_head] shared by every head; ``"all"`` (OLMo 2): one RMSNorm over the
        concatenated heads' n_heads * d_head (n_kv_heads * d_head for k) features.
        """
        B, H, Sq, dh = q.shape
        Hkv, Sk = k.shape[1], k.shape[2]
        if self.qk_norm in ("head", "head_layernorm"):
            q, k = self.q_norm(q), self.k_norm(k)  # (B, H, Sq, dh), (B, Hkv, Sk, dh)
        else:
            q = self.q_norm(q.transpose(1, 2).reshape(B, Sq, H * dh))  # (B, Sq, H dh)
            q = q.view(B, Sq, H, dh).transpose(1, 2)  # (B, H, Sq, dh)
            k = self.k_norm(k.transpose(1, 2).reshape(B, Sk, Hkv * dh))  # (B, Sk, Hkv dh)
            k = k.view(B, Sk, Hkv, dh).transpose(1, 2)  # (B, Hkv, Sk, dh)
        if self.hook_q_normed.fns or self.hook_k_normed.fns:
            q = self.hook_q_normed(q.transpose(1, 2)).transpose(1, 2)  # (B, H, Sq, dh)
            k = self.hook_k_normed(k.transpose(1, 2)).transpose(1, 2)  # (B, Hkv, Sk, dh)
        return q, k

    def qk_norm_gains(self) -> tuple[Tensor, Tensor] | None:
        """QK-norm's per-feature gains ``offset + weight`` of ``q_norm`` / ``k_norm`` per head: (``g_q``
        [n_heads, d_head], ``g_k`` [n_kv_heads, d_head]); None without QK-norm. ``"head"``: the one
        [d_head] weight repeated for every head; ``"all"``: each head's slice of the [heads d_head] weight.
        :meth:`headspace.Head.qk` folds them into the QK circuit."""
        if self.qk_norm is None:
            return None
        if self.qk_norm == "head_layernorm":  # centring per head and token: no fixed gain makes it
            raise ValueError(
                "qk_norm_gains: the attention field 'qk_norm' ('head_layernorm', a LayerNorm per head) "
                "centres q and k per token: no fixed circuit gives the scores"
            )
        H, Hkv, dh = self.n_heads, self.n_kv_heads, self.d_head
        g_q = self.q_norm.weight + self.q_norm.offset  # (dh,) or (H dh,)
        g_k = self.k_norm.weight + self.k_norm.offset  # (dh,) or (Hkv dh,)
        if self.qk_norm == "head":
            return g_q.expand(H, dh), g_k.expand(Hkv, dh)  # (H, dh), (Hkv, dh)
        return g_q.view(H, dh), g_k.view(Hkv, dh)  # (H, dh), (Hkv, dh)

    def qk_norm_scales(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """QK-norm's scales ``1 / sqrt(mean(q^2) + eps)`` of one run, per token and head, from
        ``hook_q`` q [batch, seq_q, n_heads, d_head] and ``hook_k`` k [batch, seq_k, n_kv_heads, d_head]
        (before the norm): (``s_q`` [batch, seq_q, n_heads], ``s_k`` [batch, seq_k, n_kv_heads]); the
        mean is over each head's d_head (``"head"``) or over all heads' features (``"all"``, the same
        scale for every head of a token). Frozen at these values the norm is linear, ``hook_q_normed =
        hook_q * s_q[..., None] * g_q`` (:meth:`qk_norm_gains`), and so are the scores in the inputs (see
        :meth:`headspace.Head.qk`)."""
        if self.qk_norm is None:
            raise ValueError("qk_norm_scales: this layer has no QK-norm (qk_norm=None)")
        if self.qk_norm == "head_layernorm":
            raise ValueError(
                "qk_norm_scales: the attention field 'qk_norm' ('head_layernorm') centres q and k per "
                "token: no per-token scale makes it linear"
            )
        over = (-1,) if self.qk_norm == "head" else (-2, -1)
        s_q = rms_inverse(q.float(), self.q_norm.eps, over)  # (B, Sq, H|1, 1)
        s_k = rms_inverse(k.float(), self.k_norm.eps, over)  # (B, Sk, Hkv|1, 1)
        s_q = s_q.expand(*q.shape[:-1], 1)[..., 0]  # (B, Sq, H)
        s_k = s_k.expand(*k.shape[:-1], 1)[..., 0]  # (B, Sk, Hkv)
        return s_q, s_k

    def _may_use_thread_workspace(
        self, query: Tensor, self_attention: bool, traced: bool, kv_cache: KVCache | None
    ) -> bool:
        """Whether the fused QKV projection may go to the thread's workspace (see :mod:`headspace.workspace`).

        Only when nothing can keep a reference to it past this call: self-attention on the CPU, no
        autograd graph (it would save the projection for backward), no hook (a hook may keep q, k or
        v), no KV cache (it may keep the new keys and values); and only when large enough to gain.
        The caller also leaves it out with ``need_weights=True``: there the projection is freed before
        the output GEMM, which keeps that path's peak memory below torch MHA's (kept in the workspace,
        it would rise above it: docs/benchmarks.md).
        """
        if not (self_attention and self.fused) or traced or kv_cache is not None:
            return False
        if query.device.type != "cpu":
            return False
        if torch.is_grad_enabled() and (
            query.requires_grad
            or self.qkv_weight.requires_grad
            or (self.qkv_bias is not None and self.qkv_bias.requires_grad)
        ):
            return False
        n_out = self.qkv_weight.shape[0]
        return query.numel() // query.shape[-1] * n_out * query.element_size() >= THREAD_SCRATCH_MIN_BYTES

    def traced_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: CanonicalMask,
        dropout_p: float,
        *,
        need_pattern: bool = True,
        qk_sources: tuple[Any, Any] | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The traced path: the reference backend with ``hook_scores``, ``hook_pattern`` and ``hook_z`` fired.

        Used while any hook point of the layer is active (here and in :mod:`headspace.compat`).
        q [B, H, Sq, dh], k, v [B, Hkv, Sk, dh] (after ``hook_q``/``hook_k``/``hook_v``) ->
        (z [B, Sq, H, dh] after ``hook_z``, pattern [B, H, Sq, Sk], weights after dropout).

        ``need_pattern=False`` lets the layer skip the pattern when nothing can replace it (every function
        on ``hook_scores`` and ``hook_pattern`` only records, :attr:`HookPoint.defers`): the recorders get
        a :class:`~headspace.functional.DeferredAttention` of q and k, z is
        :func:`~headspace.functional.reference_rows` (the same values, a block of queries at a time), and
        pattern and weights are None. ``qk_sources``: deferred values that compute q and k again (a
        fully recorded block's, :class:`~headspace.hooks.Recomputed`), kept by the deferred scores and
        pattern instead of q and k themselves.
        """
        deferrable = self.hook_scores.defers and self.hook_pattern.defers
        if need_pattern or self.softcap is not None or not deferrable:
            # (soft-capped layers keep the pattern: the deferred forms have no cap)
            z, pattern, weights = reference_parts(
                q, k, v, mask, scale=self.scale, dropout_p=dropout_p,
                on_scores=self.hook_scores, on_pattern=self.hook_pattern, softcap=self.softcap,
            )  # fmt: skip
            return self.hook_z(z.transpose(1, 2)), pattern, weights  # (B, Sq, H, dh), ...
        q_kept, k_kept = (q.detach(), k.detach()) if qk_sources is None else qk_sources
        for point, which in ((self.hook_scores, "scores"), (self.hook_pattern, "pattern")):
            if point.active:
                point.fire_deferred(DeferredAttention(q_kept, k_kept, mask, self.scale, which))
        z = reference_rows(q, k, v, mask, scale=self.scale, dropout_p=dropout_p)  # (B, H, Sq, dh)
        return self.hook_z(z.transpose(1, 2)), None, None  # (B, Sq, H, dh)

    def output_from_heads(self, z: Tensor) -> Tensor:
        """``out = sum_h z_h W_O[h] + b_O`` from z [B, Sq, H, dh], firing ``hook_result`` while it is active.

        ``hook_result`` sees each head's part ``z_h W_O[h]`` [B, Sq, H, d_model]; without it the heads are
        concatenated and multiplied by ``W_O`` in one GEMM. Returns [B, Sq, d_model]. Inside a fully
        recorded block (``hook_z`` records z, ``hook_result`` only records), the output is noted as
        recomputed from z and the copy of W_O (:func:`~headspace.hooks.note_source`), so that the
        block's ``hook_attn_out`` keeps those instead of the output.
        """
        if not self.hook_result.active:
            return output_linear(z, self.o_weight, self.o_bias)  # (B, Sq, d_model)
        result = torch.einsum("bshd,hdm->bshm", z, self.W_O)  # (B, Sq, H, d_model)
        if self.hook_result.defers:  # only recorders: they keep z and W_O, not the [.., H, d_model] result
            W_O = self.W_O.detach().clone()
            self.hook_result.fire_deferred(DeferredResult(z.detach(), W_O))
            out = output_sum(result, self.o_bias)  # (B, Sq, d_model)
            if noting() and self.hook_z.active and self.hook_z.defers:  # z is recorded: kept anyway
                node = Recomputed(_output_of_heads, z.detach(), W_O, _copy(self.o_bias), shape=out.shape)
                note_source(out, node)
            return out
        return output_sum(self.hook_result(result), self.o_bias)  # (B, Sq, d_model)


def _copy(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().clone()
