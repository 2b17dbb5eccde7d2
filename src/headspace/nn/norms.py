"""RMSNorm, computed in float32 with transformers' exact order of operations.

For a vector ``x`` of width d_model::

    RMSNorm(x) = x / sqrt(mean(x ** 2) + eps) * (offset + weight)

``offset = 0`` (Llama, Mistral, Qwen, ...): ``weight * (x_f32 * rsqrt(mean(x_f32 ** 2) + eps)).to(dtype)``,
the operations of transformers' ``LlamaRMSNorm`` (normalise in float32, cast back to the input dtype, then
multiply by the weight). ``offset = 1`` (Gemma): ``(x_f32 * rsqrt(...) * (1 + weight_f32)).to(dtype)``, the
operations of ``GemmaRMSNorm`` (the scale is applied in float32, before the cast). Either way float32
results are bitwise those of transformers. The statistic ``1 / sqrt(mean(x ** 2) + eps)`` is
:func:`rms_inverse`, the one function that derives it (the analyses that freeze a norm call it too).

Notation used for tensor shapes:
    ...: any leading dims (batch, seq); d_model: the normalised width.

    x, output: [..., d_model]
    weight:    [d_model]
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dim, with a learned per-feature scale.

    Notation used for tensor shapes:
        ...: leading dims; d_model.

    Args:
        d_model: width of the last dim (positive int).
        eps: added to the mean square before the square root (finite, >= 0).
        offset: the scale is ``offset + weight``; 0 for Llama-style norms, 1 for Gemma's ``(1 + weight)``.
            The weight starts at ``1 - offset``, so a fresh norm scales by 1 (ones for offset 0, zeros for
            Gemma's offset 1, as transformers initialises them).

    Attributes:
        weight: [d_model] parameter.
    """

    def __init__(self, d_model: int, eps: float = 1e-6, *, offset: float = 0.0) -> None:
        super().__init__()
        if not isinstance(d_model, int) or isinstance(d_model, bool) or d_model <= 0:
            raise ValueError(f"d_model must be a positive int; got {type(d_model).__name__} {d_model!r}")
        if not _is_real(eps) or not math.isfinite(eps) or eps < 0:
            raise ValueError(f"eps must be a finite number >= 0; got {type(eps).__name__} {eps!r}")
        if not _is_real(offset) or not math.isfinite(offset):
            raise ValueError(f"offset must be a finite number; got {type(offset).__name__} {offset!r}")
        self.d_model = d_model
        self.eps = float(eps)
        self.offset = float(offset)
        self.weight = nn.Parameter(torch.full((d_model,), 1.0 - self.offset))

    def forward(self, x: Tensor) -> Tensor:
        """Normalise ``x`` [..., d_model] over its last dim; returns [..., d_model] in ``x``'s dtype
        (for offset 0, the dtype that ``weight * x`` promotes to, as transformers)."""
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a tensor [..., d_model={self.d_model}]; got {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != self.d_model:
            raise ValueError(f"x's last dim must be d_model={self.d_model}; got shape {list(x.shape)}")
        return rms_norm(x, self.weight, self.eps, self.offset)

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}, offset={self.offset}"


def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    """``x / sqrt(mean(x^2) + eps) * (offset + weight)`` over the last dim of ``x`` [..., d_model]: the
    one RMSNorm of headspace (:class:`RMSNorm` and the decoding steps call it; the native step makes
    the same roundings in C++).

    On float32 ``x`` and ``weight`` it is ``F.rms_norm`` with the gain ``offset + weight`` (torch's
    composite: the same roundings as the steps below, in one call); otherwise transformers' order of
    operations: the normalisation in float32, then ``weight * hidden`` in ``x``'s dtype (offset 0) or
    ``hidden * (offset + weight)`` cast back (Gemma's ``1 + weight``). No checks: :class:`RMSNorm` makes
    them.
    """
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # offset != 0: F.rms_norm with the gain (offset + weight) makes Gemma's roundings as well
        gain = weight if offset == 0.0 else offset + weight  # [d_model]
        return F.rms_norm(x, (x.shape[-1],), gain, eps)
    input_dtype = x.dtype
    # float32 for the narrow floats (as transformers); float64 stays float64 (gradcheck, references)
    hidden = x.to(torch.promote_types(x.dtype, torch.float32))  # [..., d_model]
    hidden = hidden * rms_inverse(hidden, eps)  # [..., d_model]
    if offset == 0.0:
        return weight * hidden.to(input_dtype)
    return (hidden * (offset + weight.to(hidden.dtype))).to(input_dtype)


def rms_inverse(x: Tensor, eps: float, dims: tuple[int, ...] = (-1,)) -> Tensor:
    """RMSNorm's statistic ``1 / sqrt(mean(x^2) + eps)`` over ``dims`` of ``x``, the dims kept (size 1).

    The one place headspace derives it: :func:`rms_norm` and every analysis that freezes an RMS norm at
    a run's values (QK-norm's scales, the circuit runner's folded norm and its pullback, the frozen
    final norm) call it; the native step makes the same roundings in C++. Computed in
    ``promote_types(x.dtype, float32)`` (float32 for the narrow floats, float64 stays float64) as
    ``rsqrt(x.pow(2).mean(dims) + eps)``: on float32 these are bitwise ``F.rms_norm``'s roundings, so
    ``x * rms_inverse(x, eps) * w == F.rms_norm(x, (d,), w, eps)`` exactly (tests/nn/test_norms.py).

    Shapes: x [...]; returns [...] with each of ``dims`` of size 1, e.g. [..., 1] for the default.
    """
    hidden = x.to(torch.promote_types(x.dtype, torch.float32))  # [...]
    return torch.rsqrt(hidden.pow(2).mean(dims, keepdim=True) + eps)  # [...] with dims of size 1


class HeadLayerNorm(nn.Module):
    """A LayerNorm per head without bias (StableLM's ``qk_layernorm``, Cohere's ``use_qk_norm``): each
    head's d_head features centred and scaled by their own statistics, times that head's weight.

    Shapes: weight [n_heads, d_head]; x [batch, n_heads, seq, d_head] -> the same:
    ``layer_norm(x[b, h, s], eps) * weight[h]`` (``F.layer_norm`` over d_head, no affine, then the gain).
    """

    def __init__(self, n_heads: int, d_head: int, eps: float = 1e-5) -> None:
        super().__init__()
        if not _is_real(eps) or not math.isfinite(eps) or eps <= 0:
            raise ValueError(f"HeadLayerNorm eps must be a finite number > 0; got {eps!r}")
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(n_heads, d_head))  # [n_heads, d_head]

    def forward(self, x: Tensor) -> Tensor:
        """x [batch, n_heads, seq, d_head] -> [batch, n_heads, seq, d_head]."""
        normed = F.layer_norm(x.float(), (x.shape[-1],), eps=self.eps)  # [batch, n_heads, seq, d_head]
        return (self.weight.float()[:, None, :] * normed).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class L2Norm(nn.Module):
    """An RMSNorm over the last dim without a learned weight (Llama 4's ``L2Norm``, its weightless QK-norm):
    ``x / sqrt(mean(x^2) + eps)``, computed in float32 and cast back (transformers' order).

    No parameter and no buffer (nothing in the state dict); ``weight`` is a fresh ones [d_model] (float32,
    CPU) and ``offset`` 0, so that code reading an RMSNorm's gain ``offset + weight`` reads 1.
    Shapes: x [..., d_model] -> the same.
    """

    def __init__(self, d_model: int, eps: float = 1e-6) -> None:
        super().__init__()
        if not isinstance(d_model, int) or isinstance(d_model, bool) or d_model <= 0:
            raise ValueError(f"d_model must be a positive int; got {type(d_model).__name__} {d_model!r}")
        if not _is_real(eps) or not math.isfinite(eps) or eps < 0:
            raise ValueError(f"eps must be a finite number >= 0; got {type(eps).__name__} {eps!r}")
        self.d_model, self.eps, self.offset = d_model, float(eps), 0.0

    @property
    def weight(self) -> Tensor:
        """The gain 1 of every feature, [d_model] (a fresh tensor: the norm has no weight to edit)."""
        return torch.ones(self.d_model)

    def forward(self, x: Tensor) -> Tensor:
        """x [..., d_model] -> [..., d_model] in x's dtype."""
        hidden = x.to(torch.promote_types(x.dtype, torch.float32))  # [..., d_model]
        return (hidden * rms_inverse(hidden, self.eps)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}"
