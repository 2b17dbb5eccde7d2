"""Matrices held as GGUF Q8_0 blocks: the product by a float32 matrix that is one, reading a quarter of
its bytes.

A float32 matrix W [out, in] (in a multiple of 32) is a Q8_0 matrix when every block of 32 columns of a
row is one scale times 32 integers in [-127, 127]: ``W[o, 32 b + j] = d[o, b] * q[o, 32 b + j]``, as
GGUF's Q8_0 tensors dequantise (Gemma-3-270M's 262,144 x 640 embedding, which is also its unembedding).
:func:`q8_0_blocks` finds that form of a weight exactly (``q * d == W`` for every element, else None),
once per weight and version (an in-place edit finds it again). The product

    (x W^T)[r, o] = sum_k x[r, k] * (d[o, k / 32] * q[o, k])

(the float32 products of W's own values) then reads int8 integers and one scale per 32 of them instead
of float32 values: the decoding step's unembedding at a few rows is bound by reading the matrix
(:func:`headspace.decode.describe`).

Fast path and fallback (:mod:`headspace.kernels.cpu`, name ``q8_0``): ``torch.ops.headspace.q8_0_mm``,
in the native library (:mod:`headspace.kernels.native`, ``q8_0.cpp``), at the vector width torch reports
for this CPU (``torch.backends.cpu.get_cpu_capability()``: AVX512, AVX2 or plain C++); the fallback is
``torch.mm`` on the float32 matrix. Both are the same sum of the same float32 weights; they agree to
float32 rounding (the order of the additions differs), not bit for bit; each output of ``q8_0_mm`` is
one thread's fixed-order sum, so it does not depend on the number of threads.

Notation used for tensor shapes:
    n (rows), out, in (columns, a multiple of 32), blocks (in / 32).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from . import cpu
from . import native as library
from .prepack import packable

BLOCK = 32
"""Columns per Q8_0 block."""
MAX_ROWS = 16
"""The most rows the decoding step multiplies from the blocks (beyond, the GEMM on float32 is faster)."""
_CHECK_ROWS = 8192  # rows of W checked at a time: the temporaries stay ~20 MB

_found: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight -> (its _version, Q8Blocks or None)


@dataclass(frozen=True)
class Q8Blocks:
    """A float32 matrix [out, in] as Q8_0 blocks: ``q`` int8 [out, in] in [-127, 127], ``d`` float32
    [out, blocks] (every ``d[o, b] * q[o, 32 b + j]`` is exactly the matrix's element)."""

    q: Tensor
    d: Tensor


def q8_0_blocks(weight: Tensor) -> Q8Blocks | None:
    """``weight``'s Q8_0 form (:class:`Q8Blocks`), or None where it has none: not a plain float32 CPU
    matrix (a reduced-precision carrier keeps its own product) with a multiple of 32 columns, or some
    block not exactly a scale times integers in [-127, 127]. The answer is kept per weight until its
    values change (its version)."""
    if not packable(weight) or weight.shape[1] % BLOCK or weight.numel() == 0:
        return None
    seen = _found.get(weight)
    if seen is not None and seen[0] == weight._version:
        return seen[1]
    blocks = _blocks_of(weight.detach())
    _found[weight] = (weight._version, blocks)
    return blocks


def _blocks_of(w: Tensor) -> Q8Blocks | None:
    out, n_in = w.shape
    q = torch.empty(out, n_in, dtype=torch.int8)
    d = torch.empty(out, n_in // BLOCK, dtype=torch.float32)
    for lo in range(0, out, _CHECK_ROWS):
        part = w[lo : lo + _CHECK_ROWS].reshape(-1, n_in // BLOCK, BLOCK)  # (rows, blocks, 32)
        scale = part.abs().amax(dim=2) / 127  # (rows, blocks): the integer 127 at each block's largest
        ints = torch.where(scale[..., None] > 0, part / scale[..., None], 0.0).round_()  # (rows, blocks, 32)
        if not bool((ints * scale[..., None] == part).all()) or bool((ints.abs() > 127).any()):
            return None
        q[lo : lo + _CHECK_ROWS] = ints.reshape(-1, n_in).to(torch.int8)
        d[lo : lo + _CHECK_ROWS] = scale
    return Q8Blocks(q, d)


def q8_0_available() -> bool:
    """Whether ``torch.ops.headspace.q8_0_mm`` can run now: the native library loaded, with the op,
    and the ``q8_0`` fallback not forced."""
    if cpu.forced("q8_0") or not library.ready(warn=False):
        return False
    try:
        torch.ops.headspace.q8_0_mm  # noqa: B018 (registered by the library's q8_0.cpp)
    except (AttributeError, RuntimeError):
        return False
    return True


def simd_level() -> int:
    """The vector width ``q8_0_mm`` runs at, from torch's own view of this CPU
    (``torch.backends.cpu.get_cpu_capability()``: ``ATEN_CPU_CAPABILITY`` lowers it): 2 for AVX512,
    1 for AVX2, 0 (plain C++) otherwise."""
    capability = torch.backends.cpu.get_cpu_capability()
    return {"AVX512": 2, "AVX2": 1}.get(capability, 0)


def q8_0_linear_fn(blocks: Q8Blocks) -> Callable[[Tensor], Tensor]:
    """The product x W^T of the rows x float32 [n, in] -> [n, out] from ``blocks``, by
    ``torch.ops.headspace.q8_0_mm`` (:func:`q8_0_available` must hold) at :func:`simd_level`."""
    op = torch.ops.headspace.q8_0_mm
    q, d, level = blocks.q, blocks.d, simd_level()
    return lambda x: op(x, q, d, level)
