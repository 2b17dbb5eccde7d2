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
step (one row per sequence) reads and writes the whole weight again, so that a bfloat16 step measured no
faster than a float32 one (53 against 51 ms per SmolLM2 token, one thread). Packed, a one-row product
takes half the float32 time (59 against 122 us for [1, 576] x [576, 1536]; 2.3 against 4.2 ms for
SmolLM2's [576 -> 49152] unembedding), bitwise equal to ``F.linear`` on the plain bfloat16 weight; on
many rows (a prefill, an encoder batch) packed and plain take the same time.

:class:`BF16Weight` is how a model holds such a weight: a float32 tensor of the bfloat16-rounded values
(views, per-head matrices and analyses read it as any float32 tensor) that also keeps the packed
bfloat16 copy; ``F.linear(x, w, b)`` with such a ``w`` runs :func:`bf16_linear` in inference. The model
holds its weights in float32 plus a bfloat16 copy (1.5 times float32's bytes).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .carrier import ReducedWeight

__all__ = ["BF16Weight", "bf16_linear", "is_bf16", "round_to_bf16"]


def round_to_bf16(t: Tensor) -> Tensor:
    """``t`` rounded to bfloat16 (nearest even), returned as float32."""
    return t.detach().to(torch.bfloat16).to(torch.float32)


class BF16Weight(ReducedWeight):
    """A weight [out, in] held in bfloat16: float32 values (exactly bfloat16 numbers) and the packed copy.

    Attributes:
        packed: oneDNN's packed bfloat16 copy, used by :func:`bf16_linear`.

    ``F.linear(x, self, bias)`` runs :func:`bf16_linear` for a float32 or bfloat16 CPU ``x`` when no
    gradient is recorded; everything else sees the float32 tensor and returns plain tensors. Writing into
    it leaves the packed copy as it was: edit in float32, then convert. Build one with :meth:`from_float`.
    """

    packed: Tensor

    @staticmethod
    def __new__(cls, values: Tensor, packed: Tensor) -> BF16Weight:
        return cls.carrying(values, packed=packed)

    @classmethod
    def from_float(cls, weight: Tensor) -> BF16Weight:
        """Round a float weight [out, in] to bfloat16 and pack it (its layout chosen for one-row inputs)."""
        if not isinstance(weight, Tensor) or weight.dim() != 2 or not weight.is_floating_point():
            got = (
                f"{weight.dtype} {list(weight.shape)}"
                if isinstance(weight, Tensor)
                else type(weight).__name__
            )
            raise ValueError(f"weight must be a floating-point matrix [out, in]; got {got}")
        w16 = weight.detach().to(torch.bfloat16).contiguous()
        return cls(w16.to(torch.float32), torch.ops.mkldnn._reorder_linear_weight(w16, 1))

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
#: arithmetic (see :func:`float32_arithmetic_is_faster`); below, memory-bound, it reads the packed copy.
MANY_ROWS = 128


@functools.lru_cache(maxsize=1)
def float32_arithmetic_is_faster() -> bool:
    """Whether this CPU multiplies bfloat16 numbers faster with float32 FMAs than with its bfloat16 ones.

    True on Intel CPUs that report AVX512-BF16 without AMX (Sapphire / Emerald Rapids with AMX hidden, as
    in this project's KVM guest): there ``vdpbf16ps`` measured 88 GFLOP/s on one core against 174 for
    ``vfmadd231ps``, and oneDNN's bfloat16 GEMM ran at 0.6x float32's speed ([4096, 384] x [384, 1536]:
    88 against 55 ms). On AMD Zen 4 and later, and with AMX, the bfloat16 instructions are the faster ones.
    """
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            info = f.read(1 << 16)
    except OSError:
        return False
    flags = next((line for line in info.splitlines() if line.startswith("flags")), "").split()
    return "GenuineIntel" in info and "avx512_bf16" in flags and "amx_bf16" not in flags


def bf16_linear(x: Tensor, weight: BF16Weight, bias: Tensor | None = None) -> Tensor:
    """``x W^T + b`` in bfloat16 (float32 accumulation): x [..., in] -> [..., out] in ``x``'s dtype.

    The inputs are rounded to bfloat16, the products of two bfloat16 numbers are exact in float32, the
    sums are float32 and the result is rounded to bfloat16. A product of :data:`MANY_ROWS` rows or more,
    on a CPU where :func:`float32_arithmetic_is_faster`, runs that same arithmetic as a float32 GEMM on
    the rounded values (the weight's float32 values are its bfloat16 numbers); the two ways differ only
    in the order of the float32 sums.
    """
    if not isinstance(weight, BF16Weight):
        raise TypeError(
            f"weight must be a BF16Weight (BF16Weight.from_float(w)); got {type(weight).__name__}"
        )
    with torch._C.DisableTorchFunctionSubclass():
        many = x.dim() >= 1 and x.numel() >= MANY_ROWS * x.shape[-1]
        if x.dtype == torch.float32 and many and float32_arithmetic_is_faster():
            xr = x.to(torch.bfloat16).to(torch.float32)  # the input rounded to bfloat16
            b = None if bias is None else bias.detach().to(torch.bfloat16).to(torch.float32)
            y = F.linear(xr, weight, b)  # (..., out): exact products, float32 sums
            return y.to(torch.bfloat16).to(torch.float32)  # the result rounded, as the bfloat16 kernel's
        xb = x.to(torch.bfloat16).contiguous()
        b = None if bias is None else bias.detach().to(torch.bfloat16)
        y = torch.ops.mkldnn._linear_pointwise(xb, weight.packed, b, "none", [], "")  # (..., out) bfloat16
        return y if x.dtype == torch.bfloat16 else y.to(x.dtype)


def is_bf16(t: Any) -> bool:
    """Whether ``t`` is a :class:`BF16Weight`."""
    return isinstance(t, BF16Weight)
