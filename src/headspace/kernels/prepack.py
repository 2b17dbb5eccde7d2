"""Weights prepacked for MKL's GEMM: batched decoding steps without the per-call weight repack.

A decoding step multiplies a few rows (the batch) by every weight matrix. For one row MKL runs a
matrix-vector kernel that streams the weight once, at the memory bandwidth. For 2 rows and more it
runs its GEMM, which first packs the weight into its blocked layout on every call: the weight is read,
written and read again. Packing each weight once beforehand
(``torch.ops.mkl._mkl_reorder_linear_weight``, the packing torch's inductor uses for float32 linears
on CPU) saves that work on every step of a batched decode (docs/benchmarks.md, "Decode"). The packed
copy is a second copy of the weight (MKL's opaque layout, not a view), so
:func:`headspace.decode.describe` packs only for the duration of one
:meth:`headspace.Decoder.generate` call, and only where :func:`should_prepack` says it pays and fits.

The products agree with ``torch.mm`` to float32 rounding (the packed kernel may sum in another order:
measured up to 7e-5 on outputs of magnitude ~40, against 2e-4 allowed against transformers), not bit
for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from . import cpu

#: Pack only when the weights to pack hold at least this many bytes: below it the weights stay in the
#: CPU's caches and the per-call repack costs next to nothing (and tiny models keep bit-for-bit steps).
MIN_PACK_BYTES = 32 * 2**20


def prepack_available() -> bool:
    """Whether this torch has MKL's packed linear (x86 builds with MKL;
    :func:`headspace.kernels.cpu.mkl_packed_linear_available`)."""
    return cpu.mkl_packed_linear_available()


def packable(weight: Tensor) -> bool:
    """A plain float32 CPU matrix (int8 / bfloat16 carriers run their own kernels)."""
    return (
        type(weight) in (nn.Parameter, Tensor)
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.dim() == 2
    )


def available_memory_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo (Linux), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def pays_to_pack(nbytes: int) -> bool:
    """Whether packing ``nbytes`` of float32 weights pays and fits: MKL's packed linear exists, the
    ``prepack`` fallback is not forced (:mod:`headspace.kernels.cpu`), ``nbytes`` is at least
    :data:`MIN_PACK_BYTES` and the copy fits in half the memory available. What
    :mod:`headspace.kernels.policy` decides the decoding step's packing by."""
    if not prepack_available() or cpu.forced("prepack") or nbytes < MIN_PACK_BYTES:
        return False
    free = available_memory_bytes()
    return free is not None and 2 * nbytes <= free


def should_prepack(weights: Iterable[Tensor], rows: int) -> bool:
    """The automatic choice: pack for ``rows`` >= 2 where the packable ``weights`` pay to pack
    (:func:`pays_to_pack` of their bytes)."""
    if rows < 2:
        return False
    return pays_to_pack(sum(w.numel() * w.element_size() for w in weights if packable(w)))


def should_pack_unembedding(weight: Tensor) -> bool:
    """The automatic choice at one row, for the unembedding alone: pack it where it is a plain float32
    matrix that pays to pack (:func:`pays_to_pack`). (At one row MKL's plain product of a tall
    [vocab_size, d_model] weight ran on about one core, its packed one on all of them:
    docs/benchmarks.md, "Gemma 3"; the blocks' smaller weights stay plain.)"""
    return packable(weight) and pays_to_pack(weight.numel() * weight.element_size())


def pack_weight(weight: Tensor, rows: int) -> Tensor:
    """``weight`` [out, in] packed for MKL's GEMM at ``rows`` rows: MKL's opaque layout, a copy."""
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)


def packed_linear_fn(
    weight: Tensor, bias: Tensor | None, rows: int, packed: Tensor | None = None
) -> Callable[[Tensor], Tensor]:
    """``F.linear(x, weight, bias)`` of ``rows`` rows as a callable, with ``weight`` packed once for
    MKL's GEMM at ``rows`` rows (other row counts fall back to the plain product inside the op); a
    ``packed`` copy made already (:func:`pack_weight`) is used instead of a new one."""
    if packed is None:
        packed = pack_weight(weight, rows)
    linear = torch.ops.mkl._mkl_linear
    return lambda x: linear(x, packed, weight, bias, rows)
