"""Denormal floats flushed to zero for the length of a block, in the calling thread.

x86 CPUs handle a denormal float (magnitude below 2^-126 = 1.2e-38 in float32) some 10 to 100 times
slower than a normal one, in every multiply that reads or makes one. Decaying recurrences make them by
the thousand: a random 125M Qwen3.5 spent a third of its Gated DeltaNet time on them. With the CPU's
flush-to-zero and denormals-are-zero modes on (``torch.set_flush_denormal``), such values count as 0:
a change below 1.2e-38 in absolute value, under float32's rounding of any sum that also holds a normal
term. :func:`flushed_denormals` turns the modes on for a block where torch can
(``torch.set_flush_denormal(True)`` says so), and off again after it, unless they were on before it
(then it leaves them on). The modes are per thread: intra-op worker threads run as they were. The
fallback (``HEADSPACE_FORCE_FALLBACK=denormals``, :mod:`headspace.kernels.cpu`): the block runs with
the modes as they are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from . import cpu

__all__ = ["flushed_denormals", "flushing_denormals"]


def flushing_denormals() -> bool:
    """Whether this thread flushes denormal floats now: ``1e-30 * 1e-9`` (a denormal) comes out 0."""
    return bool(torch.mul(torch.tensor(1e-30), 1e-9).item() == 0.0)


@contextlib.contextmanager
def flushed_denormals() -> Iterator[None]:
    """Run the block with denormal floats flushed to zero in this thread (module docstring)."""
    if cpu.forced("denormals") or flushing_denormals() or not torch.set_flush_denormal(True):
        yield
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(False)
