"""bfloat16 linear layers: bfloat16 weights and products, float32 everywhere else (``precision="bfloat16"``).

The maths of one layer ``y = x W^T + b`` at this precision::

    weights, once:     W, b rounded to bfloat16 (round to nearest even)
    per call:          y = float32( bf16(x) bf16(W)^T + bf16(b) )     (the products accumulate in float32)

Everything between the products (embeddings, norms, attention scores, softmax, the residual stream) is
float32, as under ``torch.autocast("cpu", dtype=torch.bfloat16)``: attention patterns, hook points and
every analysis see float32 tensors, and the weights read as float32 tensors holding bfloat16 values.

The product runs on oneDNN with the weight packed once (``torch.ops.mkldnn._reorder_linear_weight``, the
call torch's own CPU inference compiler makes, and ``torch.ops.mkldnn._linear_pointwise``): handed a
plain bfloat16 weight, oneDNN re-lays it out in its blocked format on every call, which at a decoding
step (one row per sequence) reads and writes the whole weight again and costs the bfloat16 step its
advantage over float32. Packed, a one-row product reads half float32's bytes, and its result is bitwise
equal to ``F.linear`` on the plain bfloat16 weight; on many rows (a prefill, an encoder batch) packing
makes no difference. The figures behind this choice are in docs/benchmarks.md ("Figures formerly in
docstrings").

:class:`BF16Weight` is how a model holds such a weight: a float32 tensor of the bfloat16-rounded values
(views, per-head matrices and analyses read it as any float32 tensor) that also keeps the packed
bfloat16 copy; ``F.linear(x, w, b)`` with such a ``w`` runs :func:`bf16_linear` in inference. The model
holds its weights in float32 plus a bfloat16 copy (1.5 times float32's bytes).

On a CPU where oneDNN has no bfloat16 kernel (``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` False:
no AVX512-BW/VL/DQ and no AVX-NE-CONVERT, or ``ONEDNN_MAX_CPU_ISA`` below them), or with the fallback
forced (:mod:`headspace.kernels.cpu`), the same arithmetic runs as a float32 GEMM on the rounded values
(torch's own bfloat16 matmul is much slower than float32 there; see docs/benchmarks.md): the products
are exact in float32 either way, so the two differ only in the order of the float32 sums, by at most one
bfloat16 step of a result (tested). No packed copy is made then.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from . import cpu
from .carrier import ReducedWeight

__all__ = ["BF16Weight", "bf16_linear", "is_bf16", "round_to_bf16"]


def round_to_bf16(t: Tensor) -> Tensor:
    """``t`` rounded to bfloat16 (nearest even), returned as float32."""
    return t.detach().to(torch.bfloat16).to(torch.float32)


class BF16Weight(ReducedWeight):
    """A weight [out, in] held in bfloat16: float32 values (exactly bfloat16 numbers) and the packed copy.

    Attributes:
        packed: oneDNN's packed bfloat16 copy, used by :func:`bf16_linear`; None where oneDNN has no
            bfloat16 kernel or its fallback was forced at conversion (:mod:`headspace.kernels.cpu`).

    ``F.linear(x, self, bias)`` runs :func:`bf16_linear` for a float32 or bfloat16 CPU ``x`` when no
    gradient is recorded; everything else sees the float32 tensor and returns plain tensors. Writing into
    it leaves the packed copy as it was: edit in float32, then convert. Build one with :meth:`from_float`.
    """

    packed: Tensor | None

    @staticmethod
    def __new__(cls, values: Tensor, packed: Tensor | None) -> BF16Weight:
        return cls.carrying(values, packed=packed)

    @classmethod
    def from_float(cls, weight: Tensor) -> BF16Weight:
        """Round a float weight [out, in] to bfloat16 and pack it (its layout chosen for one-row inputs)
        where oneDNN runs bfloat16 products (:func:`headspace.kernels.cpu.use_onednn_bf16`)."""
        if not isinstance(weight, Tensor) or weight.dim() != 2 or not weight.is_floating_point():
            got = (
                f"{weight.dtype} {list(weight.shape)}"
                if isinstance(weight, Tensor)
                else type(weight).__name__
            )
            raise ValueError(f"weight must be a floating-point matrix [out, in]; got {got}")
        w16 = weight.detach().to(torch.bfloat16).contiguous()
        packed = torch.ops.mkldnn._reorder_linear_weight(w16, 1) if cpu.use_onednn_bf16() else None
        return cls(w16.to(torch.float32), packed)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"BF16Weight(shape={list(self.shape)}, bfloat16, read as float32)"

    def _deepcopied(self, values: Tensor) -> BF16Weight:
        return BF16Weight.from_float(values)  # packed afresh

    def _pickled(self, values: Tensor) -> tuple[Any, tuple[Any, ...]]:
        return (BF16Weight.from_float, (values,))

    def _detached(self, values: Tensor) -> BF16Weight:
        return BF16Weight(values, self.packed)

    def _applies(self, x: Any, bias: Any) -> bool:
        return _bf16_applies(x, self, bias)

    def _linear(self, x: Tensor, bias: Tensor | None) -> Tensor:
        return bf16_linear(x, self, bias)


def _bf16_applies(x: Any, w: BF16Weight, bias: Any) -> bool:
    """Whether the packed product may run: a float32 / bfloat16 CPU input [..., in], no gradient."""
    if not isinstance(x, Tensor) or x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        return False
    if x.dim() < 1 or x.shape[-1] != w.shape[1]:
        return False
    grad = torch.is_grad_enabled()
    if grad and x.requires_grad:
        return False
    return bias is None or (isinstance(bias, Tensor) and not (grad and bias.requires_grad))


#: From this many rows on, a product is compute-bound, and :func:`bf16_linear` may run it in float32
#: arithmetic (see :func:`float32_rows`); below, memory-bound, it reads the packed copy.
MANY_ROWS = 128


def float32_rows(weight: BF16Weight) -> int:
    """From how many rows :func:`bf16_linear` runs a product with ``weight`` as a float32 GEMM on the
    rounded values: 0 (every product) without a packed copy or with the fallback forced,
    :data:`MANY_ROWS` where this CPU's float32 arithmetic is the faster
    (:func:`headspace.kernels.cpu.bf16_many_rows_in_float32`), else -1 (never). The native step takes
    the same number."""
    if weight.packed is None or not cpu.use_onednn_bf16():
        return 0
    return MANY_ROWS if cpu.bf16_many_rows_in_float32() else -1


def float32_arithmetic_is_faster() -> bool:
    """Whether many-row products run as float32 GEMMs here
    (:func:`headspace.kernels.cpu.bf16_many_rows_in_float32`)."""
    return cpu.bf16_many_rows_in_float32()


def bf16_linear(x: Tensor, weight: BF16Weight, bias: Tensor | None = None) -> Tensor:
    """``x W^T + b`` in bfloat16 (float32 accumulation): x [..., in] -> [..., out] in ``x``'s dtype.

    The inputs are rounded to bfloat16, the products of two bfloat16 numbers are exact in float32, the
    sums are float32 and the result is rounded to bfloat16. From :func:`float32_rows` rows on (every
    product where oneDNN has no bfloat16 kernel) that same arithmetic runs as a float32 GEMM on the
    rounded values (the weight's float32 values are its bfloat16 numbers); the two ways differ only in
    the order of the float32 sums.
    """
    if not isinstance(weight, BF16Weight):
        raise TypeError(
            f"weight must be a BF16Weight (BF16Weight.from_float(w)); got {type(weight).__name__}"
        )
    with torch._C.DisableTorchFunctionSubclass():
        f32_rows = float32_rows(weight)
        rows = x.numel() // max(1, x.shape[-1]) if x.dim() >= 1 else 1
        if f32_rows >= 0 and rows >= f32_rows:
            xr = x.to(torch.bfloat16).to(torch.float32)  # the input rounded to bfloat16
            b = None if bias is None else bias.detach().to(torch.bfloat16).to(torch.float32)
            y = F.linear(xr, weight, b)  # (..., out): exact products, float32 sums
            y = y.to(torch.bfloat16)  # the result rounded, as the bfloat16 kernel's
            return y if x.dtype == torch.bfloat16 else y.to(x.dtype)
        xb = x.to(torch.bfloat16).contiguous()
        b = None if bias is None else bias.detach().to(torch.bfloat16)
        y = torch.ops.mkldnn._linear_pointwise(xb, weight.packed, b, "none", [], "")  # (..., out) bfloat16
        return y if x.dtype == torch.bfloat16 else y.to(x.dtype)


def is_bf16(t: Any) -> bool:
    """Whether ``t`` is a :class:`BF16Weight`."""
    return isinstance(t, BF16Weight)
