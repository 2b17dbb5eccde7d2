"""int8 linear layers: int8 weights per output channel, inputs quantised dynamically (``precision="int8"``).

The maths of one layer ``y = x W^T + b`` (``W`` [out, in], ``nn.Linear``'s layout; ``t`` a token, i.e. a
row of the input, ``o`` an output feature, ``i`` an input feature)::

    weights, once:      s_w[o] = max_i |W[o, i]| / 127        W_q[o, i] = round(W[o, i] / s_w[o])   (int8)
    activations, per call, per token (asymmetric uint8, so a skewed row such as a GELU output keeps
    every level):       lo_t = min(min_i x[t, i], 0)    hi_t = max(max_i x[t, i], 0)
                        s_t = (hi_t - lo_t) / 254       z_t = round(-lo_t / s_t)
                        x_q[t, i] = floor(x[t, i] / s_t + z_t + 1/2)                                (uint8)
    the product:        y[t, o] = s_t s_w[o] sum_i (x_q[t, i] - z_t) W_q[o, i] + b[o]   (int32 sums, exact)
                                = s_t A[t, o] - s_t z_t s_w[o] C[o] + b[o]
                        with A[t, o] = s_w[o] sum_i x_q[t, i] W_q[o, i] and C[o] = sum_i W_q[o, i]

254 steps rather than 255 keep ``x_q`` inside [0, 255] whatever the rounding of ``z_t`` (a value past 255
would wrap); the cost is one level in 256. :func:`int8_linear_reference` writes the same maths out in
float64 and is what the tests hold the kernel to.

Two kernels compute it, with the same int32 sums:

* many rows (an encoder's or a prefill's): ``A`` comes from oneDNN's u8 x s8 kernel
  (``torch.ops.onednn.qlinear_pointwise``, the op torch's own x86 int8 inference uses; VNNI on CPUs that
  have it) with the weight scales fused into its output; the per-token scale, the zero-point term and
  the bias (one rank-2 update) are two passes over the output. A oneDNN call has a fixed cost whatever
  its size (docs/benchmarks.md, "Why this int8 kernel"), so
* few rows (decoding) run on ``torch._int_mm`` (s8 x s8 -> s32) instead, which the asymmetric scheme
  maps onto exactly: ``sum_i (x_q - z_t) W_q[o, i] = sum_i (x_q - 128) W_q[o, i] + (128 - z_t) C[o]``,
  ``x_q - 128`` an int8 (the top bit of the uint8 flipped) and ``W_q^T`` a view of ``W_q`` (no copy; a
  contiguous transpose is slower on one row), the correction an int32 rank-1 update, then
  ``y = s_t s_w[o] (that) + b[o]`` in one float32 pass. The input's scalars (``lo``, ``hi``, ``s_t``,
  ``z_t``) are the same float32 operations done in numpy / Python (five torch ops against seventeen for
  the tensor version), so ``x_q`` is bit for bit the many-row path's; the two paths' outputs differ only
  by float32 rounding of the epilogue (measured <= 1.8e-6 of a call's largest output on SmolLM2's
  activations). When (``_few_rows``; the thresholds sit where one kernel overtook the other on 1 thread,
  docs/benchmarks.md): one row through a weight of up to 2**25 elements, or several through one of up
  to 1.4M elements (~1.4 MB of int8, past which the several-row ``_int_mm`` loses to oneDNN from 2 rows
  on) while rows x elements <= 2**24. So SmolLM2's decoding layers take it at batch 1 and 8, its
  [576 -> 49152] unembedding at batch 1 only (at 8 rows oneDNN is the faster there). On oneDNN whatever
  the rows: one input feature (torch 2.13's ``_int_mm`` gets ``k = 1`` wrong) and an input holding a NaN
  or an infinity.

Both kernels need int8 products that sum in int32. oneDNN's u8 x s8 kernel on a CPU without VNNI (or
under ``ONEDNN_MAX_CPU_ISA=AVX2``) sums neighbouring pairs in saturating int16 and is silently wrong
(off by 2.8 on outputs of ~17, measured), and there ``torch._int_mm`` is no better.
:func:`headspace.kernels.cpu.int8_products_exact` asks each kernel on a worst case; where one is not
exact (or the fallback is forced), the same quantised activations run as a float32 GEMM by the
dequantised weight (:func:`_float32_linear`): the same maths, float32 sums, float32 GEMM speed.
Reduced-range activations (7 bits, as PyTorch's x86 quantisation does) would keep int8 speed but change
the numbers, by a level in 128.

One scale per token rather than one per call: on all-MiniLM-L6-v2, one per call gave a minimum cosine of
0.986 to float32 over 64 sentences, one per token 0.998 (symmetric per token: 0.995). How this kernel
compares with the alternatives (``torch._int_mm`` with symmetric per-token quantisation written as torch
ops, torchao's ``Int8DynamicActivationInt8WeightConfig``, float32 ``F.linear``) per call
(``benchmarks/int8_kernels.py``) and per SmolLM2 token (``benchmarks/decode.py``) is in
docs/benchmarks.md ("Why this int8 kernel", "Figures formerly in docstrings"). The few-row path changes
int8 outputs only by the float32 rounding of the epilogue, which moves SmolLM2's int8 greedy decoding no
more than a change of float32 rounding anywhere else does.

:class:`Int8Weight` is how a model holds such a weight: a float32 tensor whose values are the dequantised
weight ``W_q * s_w`` (what the int8 layer multiplies by, so every per-head view, circuit and analysis reads
the numbers the model really uses, in float32) that also carries ``W_q``, ``s_w`` and oneDNN's packed copy.
``F.linear(x, w, b)`` with such a ``w`` runs :func:`int8_linear` (in inference, for float32 ``x``); every
other operation sees the plain float32 tensor and returns plain tensors. Editing a view of an int8
weight changes those float32 values, not the int8 ones: edit in float32, then convert.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from . import cpu
from .carrier import Carrier, ReducedWeight

__all__ = [
    "Int8Weight",
    "dequantize_weight",
    "int8_linear",
    "int8_linear_reference",
    "is_int8",
    "quantize_activation",
    "quantize_weight",
]

#: Activation levels used: 254 steps keep every quantised value inside uint8's [0, 255] (see above).
ACTIVATION_STEPS = 254


def quantize_weight(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per output channel: ``weight`` [out, in] -> (``W_q`` int8 [out, in], ``s_w`` [out]).

    ``s_w[o] = max_i |weight[o, i]| / 127`` (1 for an all-zero row, so that it stays zero), and
    ``W_q = round(weight / s_w)`` in [-127, 127].
    """
    if not isinstance(weight, Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        got = f"{weight.dtype} {list(weight.shape)}" if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"weight must be a floating-point matrix [out, in]; got {got}")
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0  # (out,)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)  # (out, in)
    return q, scale


def dequantize_weight(q: Tensor, scale: Tensor) -> Tensor:
    """``W_q * s_w`` as float32 [out, in]: the weight an int8 layer multiplies by."""
    return q.float() * scale[:, None].float()


def quantize_activation(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Dynamic asymmetric uint8 quantisation of ``x`` [tokens, in], one scale per token: (x_q, s_t, z_t).

    Returns x_q uint8 [tokens, in], s_t float32 [tokens] and z_t float32 [tokens] (whole numbers in
    [0, 254]); the formula is in the module docstring. A row of zeros gets ``s_t = 1``.
    """
    # amax and amin apart: faster than aminmax(dim=1) on many rows (docs/benchmarks.md)
    lo, hi = x.amin(dim=1).clamp_(max=0.0), x.amax(dim=1).clamp_(min=0.0)  # (tokens,) x 2
    scale = (hi - lo) / ACTIVATION_STEPS  # (tokens,)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale)  # (tokens,)
    # x / s + z + 1/2, truncated by the cast: round half up (a multiply and an add in place: faster than
    # one broadcasting addcmul)
    shifted = torch.mul(x, (1.0 / scale)[:, None]).add_((zero + 0.5)[:, None])  # (tokens, in)
    return shifted.to(torch.uint8), scale, zero


class Int8Weight(ReducedWeight):
    """A weight held in int8: the float32 tensor of its dequantised values, plus the int8 data.

    Attributes:
        q: int8 [out, in], the quantised weight.
        scale: float32 [out], the per-output-channel scale (``self == q * scale[:, None]``).

    ``F.linear(x, self, bias)`` runs :func:`int8_linear` when ``x`` is float32 and no gradient is being
    recorded for it; anything else (views, transposes, norms, ``.float()``) sees the float32 tensor.
    Build one with :meth:`from_float`.
    """

    q: Tensor
    scale: Tensor
    _packed: Tensor | None
    _zero_term: Tensor | None
    _col_sums: Tensor | None

    @staticmethod
    def __new__(cls, values: Tensor, q: Tensor, scale: Tensor) -> Int8Weight:
        return cls.carrying(values, q=q, scale=scale, _packed=None, _zero_term=None, _col_sums=None)

    @classmethod
    def from_float(cls, weight: Tensor) -> Int8Weight:
        """Quantise a float weight [out, in] (:func:`quantize_weight`)."""
        q, scale = quantize_weight(weight)
        return cls(dequantize_weight(q, scale).to(weight.device), q, scale)

    def packed(self) -> Tensor:
        """oneDNN's packed copy of ``q`` (made on first use, kept)."""
        if self._packed is None:
            self._packed = torch.ops.onednn.qlinear_prepack(self.q, None)
        return self._packed

    def zero_term(self) -> Tensor:
        """``s_w[o] * sum_i W_q[o, i]`` [out], float32: what a zero point costs each output (made once)."""
        if self._zero_term is None:
            self._zero_term = self.scale * self.q.sum(dim=1, dtype=torch.int64).float()
        return self._zero_term

    def col_sums(self) -> Tensor:
        """``C[o] = sum_i W_q[o, i]`` [out], int32 (exact: ``|C| <= 127 in``; made once)."""
        if self._col_sums is None:
            self._col_sums = self.q.sum(dim=1, dtype=torch.int32)
        return self._col_sums

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"Int8Weight(shape={list(self.shape)}, int8 per output channel, read as float32)"

    def _deepcopied(self, values: Tensor) -> Int8Weight:
        return Int8Weight(values, self.q.clone(), self.scale.clone())

    def _pickled(self, values: Tensor) -> tuple[Any, tuple[Any, ...]]:
        return (Int8Weight, (values, self.q, self.scale))

    def _detached(self, values: Tensor) -> Int8Weight:
        t = Int8Weight(values, self.q, self.scale)
        t._packed, t._zero_term, t._col_sums = self._packed, self._zero_term, self._col_sums
        return t

    def _applies(self, x: Any, bias: Any) -> bool:
        return not isinstance(x, Int8Weight) and _int8_applies(x, self, bias)

    def _linear(self, x: Tensor, bias: Tensor | None) -> Tensor:
        return int8_linear(x, self, bias)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is Tensor.t and type(args[0]) is cls:  # the transposed weight of addmm / mm (workspaces)
            with torch._C.DisableTorchFunctionSubclass():
                return _Int8WeightT(Tensor.t(args[0]), args[0])
        return super().__torch_function__(func, types, args, kwargs)


class _Int8WeightT(Carrier):
    """``Int8Weight.t()``: the float32 transpose, whose ``mm`` / ``addmm`` (``out=`` included) run int8."""

    source: Int8Weight

    @staticmethod
    def __new__(cls, values: Tensor, source: Int8Weight) -> _Int8WeightT:
        return cls.carrying(values, source=source)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = kwargs.get("out")
        if func in (torch.mm, torch.addmm) and not set(kwargs) - {"out"}:
            if func is torch.mm and len(args) == 2 and type(args[1]) is cls:
                x, wt, bias = args[0], args[1], None
            elif func is torch.addmm and len(args) == 3 and type(args[2]) is cls and args[0].dim() == 1:
                bias, x, wt = args
            else:
                x = wt = bias = None
            if wt is not None and _int8_applies(x, wt.source, bias):
                y = int8_linear(x, wt.source, bias)
                if out is None:
                    return y
                return out.copy_(y)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _int8_applies(x: Any, w: Int8Weight, bias: Any) -> bool:
    """Whether the int8 kernel may run: a float32 CPU input [..., in], no gradient to record, a plain bias."""
    if not isinstance(x, Tensor) or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() < 1:
        return False
    if x.shape[-1] != w.shape[1]:
        return False
    grad = torch.is_grad_enabled()
    if grad and x.requires_grad:
        return False
    if bias is None:
        return True
    return isinstance(bias, Tensor) and bias.dtype == torch.float32 and not (grad and bias.requires_grad)


def int8_linear(x: Tensor, weight: Int8Weight, bias: Tensor | None = None) -> Tensor:
    """``x W^T + b`` with ``W`` in int8 and ``x`` quantised on the fly: x [..., in] -> [..., out], float32.

    The maths is in the module docstring; :func:`int8_linear_reference` is the same in float64.
    """
    if not isinstance(weight, Int8Weight):
        raise TypeError(
            f"weight must be an Int8Weight (Int8Weight.from_float(w)); got {type(weight).__name__}"
        )
    lead = x.shape[:-1]
    n_out, n_in = weight.q.shape
    if x.shape[-1] != n_in:
        raise ValueError(
            f"x must have last dimension {n_in} (the weight is [{n_out}, {n_in}]); got {list(x.shape)}"
        )
    with torch._C.DisableTorchFunctionSubclass():
        x2 = x.reshape(-1, n_in)  # (tokens, in)
        if x2.shape[0] == 0:
            return x2.new_zeros(*lead, n_out)
        onednn, int_mm = cpu.use_onednn_int8()  # each exact on this CPU (and not forced off)
        if int_mm and _few_rows(x2.shape[0], n_out, n_in):
            y = _int_mm_linear(x2, weight, bias)
            if y is not None:
                return y.view(*lead, n_out)
        xq, s_t, z_t = quantize_activation(x2)  # (tokens, in) uint8, (tokens,) x 2
        if not onednn:
            return _float32_linear(xq, s_t, z_t, weight, bias).view(*lead, n_out)
        a = torch.ops.onednn.qlinear_pointwise(
            xq,
            1.0,
            0,
            weight.packed(),
            weight.scale,
            _zeros(n_out),
            None,
            1.0,
            0,
            torch.float32,
            "none",
            [],
            "",
        )  # (tokens, out): A[t, o] = s_w[o] sum_i x_q[t, i] W_q[o, i]
        y = a.mul_(s_t[:, None])  # (tokens, out): s_t A
        if bias is None:
            y.addr_(s_t * z_t, weight.zero_term(), alpha=-1.0)  # - s_t z_t s_w[o] C[o]
        else:
            # - s_t z_t s_w[o] C[o] + b[o] as one rank-2 product: [-s_t z_t, 1] [[s_w C]; [b]]
            u = torch.stack((s_t * z_t, torch.ones_like(s_t)), dim=1)  # (tokens, 2)
            v = torch.stack((-weight.zero_term(), bias.detach().float()))  # (2, out)
            y.addmm_(u, v)
    return y.view(*lead, n_out)


#: When :func:`int8_linear` runs ``torch._int_mm`` rather than oneDNN (chosen on 1 thread; the figures
#: are in docs/benchmarks.md): one row through a weight of up to this many elements (beyond, both are
#: memory-bound and ran level) ...
ONE_ROW_WEIGHT = 1 << 25
#: ... or several rows through a weight of up to this many elements (~1.4 MB of int8: past it the
#: several-row ``_int_mm`` lost to oneDNN from 2 rows on) ...
SMALL_WEIGHT = 1_400_000
#: ... while rows x weight elements stay within this (beyond, oneDNN's fixed cost is paid back).
FEW_ROWS_WORK = 1 << 24


def _few_rows(tokens: int, n_out: int, n_in: int) -> bool:
    """Whether ``tokens`` rows through an [n_out, n_in] weight run on ``torch._int_mm``."""
    size = n_out * n_in
    if n_in == 1:  # torch 2.13's CPU _int_mm reads W_q^T [1, out] (strides 1, 1) wrongly: wrong sums
        return False
    if tokens == 1:
        return size <= ONE_ROW_WEIGHT
    return size <= SMALL_WEIGHT and tokens * size <= FEW_ROWS_WORK


_F32 = np.float32
#: ``torch._int_mm``, bound once (benchmarks/int8_kernels.py's smoke test breaks ``torch._int_mm`` to stand
#: for a failing candidate; this kernel is not that candidate)
_int_mm = torch._int_mm


def _quantize_few(x: Tensor) -> tuple[Tensor, np.ndarray, np.ndarray] | None:
    """:func:`quantize_activation` for few rows, shifted for ``torch._int_mm``: (x_q - 128 as int8, s_t, z_t).

    The same numbers bit for bit: the per-token scalars are the same float32 operations, done in numpy
    (on a handful of values a numpy op costs a fraction of a torch op); s_t and z_t come back as float32
    numpy arrays [tokens]. Five torch ops against quantize_activation's seventeen. None where a row holds
    a NaN or an infinity (the caller takes the oneDNN path, as before).
    """
    # amin and amax apart: faster than aminmax(dim=1) on a few rows (docs/benchmarks.md; aminmax of a
    # whole row is the fastest for one, see _quantize_row)
    lo = np.minimum(x.amin(dim=1).numpy(), _F32(0.0))  # (tokens,)
    hi = np.maximum(x.amax(dim=1).numpy(), _F32(0.0))
    if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
        return None
    scale = (hi - lo) / _F32(ACTIVATION_STEPS)
    scale[~(scale > 0)] = _F32(1.0)
    zero = np.rint(-lo / scale)  # round half to even, as torch.round
    inv = (_F32(1.0) / scale)[:, None]  # (tokens, 1)
    shifted = torch.mul(x, torch.from_numpy(inv)).add_(torch.from_numpy((zero + _F32(0.5))[:, None]))
    # uint8 x_q, then x_q - 128 as int8: flipping the top bit of a uint8 v gives v - 128 read as int8
    return shifted.to(torch.uint8).bitwise_xor_(128).view(torch.int8), scale, zero


def _quantize_row(x: Tensor) -> tuple[Tensor, float, int] | None:
    """:func:`_quantize_few` for one row [1, in], its scalars as Python numbers: (x_q - 128, s_t, z_t).

    Python floats carry the float32 operations exactly: each operand is a float32 value, the float64
    result of ``+ - * /`` rounded once to float32 is float32's own result.
    """
    lo_t, hi_t = torch.aminmax(x)
    lo, hi = min(_F32(lo_t.item()), _F32(0.0)), max(_F32(hi_t.item()), _F32(0.0))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    scale = (hi - lo) / _F32(ACTIVATION_STEPS)
    if not scale > 0:
        scale = _F32(1.0)
    zero = round(float(-lo / scale))  # round half to even, as torch.round
    inv = float(_F32(1.0) / scale)
    shifted = torch.mul(x, inv).add_(zero + 0.5)  # float32 operations: the scalars are float32 values
    return shifted.to(torch.uint8).bitwise_xor_(128).view(torch.int8), float(scale), zero


def _int_mm_linear(x: Tensor, weight: Int8Weight, bias: Tensor | None) -> Tensor | None:
    """:func:`int8_linear` on ``torch._int_mm`` for few rows ``x`` [tokens, in]: the same maths.

    ``sum_i (x_q - z_t) W_q = sum_i (x_q - 128) W_q + (128 - z_t) C[o]``, all in int32 (exact), then
    ``y = s_t s_w[o] (that) + b[o]`` in one float32 pass. None for an input that is not finite.
    """
    if x.shape[0] == 1:
        row = _quantize_row(x)
        if row is None:
            return None
        xs, s_t, z_t = row  # (1, in) int8, two numbers
        acc = _int_mm(xs, weight.q.t())  # (1, out) int32: sum_i (x_q - 128) W_q
        acc.add_(weight.col_sums(), alpha=128 - z_t)  # sum_i (x_q - z_t) W_q
        if bias is None:
            return torch.mul(acc, weight.scale).mul_(s_t)
        return torch.addcmul(bias.detach().float(), acc, weight.scale, value=s_t)
    few = _quantize_few(x)
    if few is None:
        return None
    xs, scale, zero = few  # (tokens, in) int8, (tokens,) x 2
    acc = _int_mm(xs, weight.q.t())  # (tokens, out) int32: sum_i (x_q - 128) W_q
    acc.addr_(torch.from_numpy((128 - zero).astype(np.int32)), weight.col_sums())  # sum_i (x_q - z_t) W_q
    s_ts_w = torch.mul(torch.from_numpy(scale[:, None]), weight.scale)  # (tokens, out)
    if bias is None:
        return torch.mul(acc, s_ts_w)
    return torch.addcmul(bias.detach().float(), acc, s_ts_w)


def _float32_linear(xq: Tensor, s_t: Tensor, z_t: Tensor, weight: Int8Weight, bias: Tensor | None) -> Tensor:
    """The int8 product's maths as a float32 GEMM, for CPUs whose int8 kernels are not exact:
    ``y = s_t ((x_q - z_t) (W_q s_w)^T) + b`` on the same quantised activations ``xq`` [tokens, in].

    ``x_q - z_t`` is a small whole number, exact in float32, and ``W_q s_w`` is the weight's float32
    value, so this is :func:`int8_linear_reference`'s maths with float32 sums: it agrees with the int32
    kernels to float32 rounding (tested), at float32 GEMM speed.
    """
    xd = xq.to(torch.float32).sub_(z_t[:, None])  # (tokens, in): x_q - z_t, whole numbers
    with torch._C.DisableTorchFunctionSubclass():
        values = Tensor.as_subclass(weight, Tensor)  # (out, in): W_q s_w, a plain float32 tensor
        y = torch.mm(xd, values.t()).mul_(s_t[:, None])  # (tokens, out)
    return y if bias is None else y.add_(bias.detach().float())


_ZEROS: dict[int, Tensor] = {}


def _zeros(n: int) -> Tensor:
    """The weight zero points (symmetric: all 0), one int64 tensor per width, made once."""
    z = _ZEROS.get(n)
    if z is None:
        z = _ZEROS[n] = torch.zeros(n, dtype=torch.long)
    return z


def int8_linear_reference(x: Tensor, q: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """:func:`int8_linear` written out by hand in float64: quantise each token, dequantise, multiply.

    Returns float64 [..., out]; the kernel's float32 result equals it to float32 rounding (up to the
    rare input that lies on a rounding boundary of its quantisation, where float32 and float64 may
    round apart by one level).
    """
    x64 = x.detach().double().reshape(-1, x.shape[-1])  # (tokens, in)
    lo = x64.min(dim=1).values.clamp(max=0.0)  # (tokens,)
    hi = x64.max(dim=1).values.clamp(min=0.0)
    s = (hi - lo) / ACTIVATION_STEPS
    s = torch.where(s > 0, s, torch.ones_like(s))[:, None]  # (tokens, 1)
    z = torch.round(-lo[:, None] / s)  # (tokens, 1)
    xq = torch.floor(x64 / s + z + 0.5)  # (tokens, in), whole numbers in [0, 255]
    y = ((xq - z) * s) @ (q.double() * scale.double()[:, None]).T  # (tokens, out)
    if bias is not None:
        y = y + bias.double()
    return y.view(*x.shape[:-1], q.shape[0])


def is_int8(t: Any) -> bool:
    """Whether ``t`` is an :class:`Int8Weight`."""
    return isinstance(t, Int8Weight)
