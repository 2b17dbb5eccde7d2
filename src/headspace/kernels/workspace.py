"""Scratch memory reused across calls instead of allocated afresh: :class:`Workspace`.

Why: a large fresh allocation comes from the operating system untouched, and the first write to each
of its 4 KiB pages faults. glibc maps every block of 32 MiB or more afresh and unmaps it on free (its
adaptive mmap threshold stops there), so an inference loop whose intermediates pass that size pays the
faults on every call, a noticeable share of an attention forward's time at long sequences (the figure:
docs/benchmarks.md, "Figures formerly in docstrings"). Memory that is reused is faulted in once.

Two owners:

* the caller: :meth:`headspace.Encoder.infer` takes a ``workspace`` that every block shares, and
  :meth:`~headspace.pretrained.PretrainedEncoder.encode` passes one to every batch;
* the thread: :func:`thread_workspace` is one workspace per thread that
  :class:`~headspace.MultiHeadAttention` uses for its QKV projection when no autograd graph is recorded
  and the projection is at least :data:`THREAD_SCRATCH_MIN_BYTES`. It keeps the largest projection seen
  until :func:`release_thread_workspace` (or the thread's end).

Nothing returned to a caller ever lies in a workspace. Results are a third case,
:func:`recycled_empty`: the attention pattern (``need_weights=True``) is handed to the caller, and once
the caller drops every view of it, its memory serves the next pattern of a similar size in that thread
instead of going back to the OS (after each call at most one idle pattern is kept per thread), so a
large pattern is not faulted in afresh on every call. A pattern too large
for the machine raises :class:`PatternMemoryError` (a ``MemoryError``) that names its shape and size.
"""

from __future__ import annotations

import errno
import math
import mmap
import sys
import threading

import torch
from torch import Tensor

#: The attention layer writes its QKV projection into the thread's workspace, and recycles patterns,
#: only from this size on: glibc's ceiling for serving a block from its reused heap (smaller blocks
#: fault only once).
THREAD_SCRATCH_MIN_BYTES = 32 << 20


class Workspace:
    """Named scratch matrices, reused call after call (see the module docstring for why).

    Each name holds one flat buffer that grows to the largest request and is kept; a request returns a
    [rows, cols] view of its start, uninitialised. Use a name for one live matrix at a time.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}

    def matrix(self, name: str, rows: int, cols: int, like: Tensor) -> Tensor:
        """A [rows, cols] matrix of ``like``'s dtype and device (uninitialised), named ``name``."""
        n = rows * cols
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < n or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(n, dtype=like.dtype, device=like.device)
            self._buffers[name] = buf
        return buf[:n].view(rows, cols)

    def linear(self, name: str, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """``x W^T + b`` ([rows, in] -> [rows, out]) written into the matrix ``name``."""
        out = self.matrix(name, x.shape[0], weight.shape[0], x)  # (rows, out)
        if bias is None:
            return torch.mm(x, weight.t(), out=out)
        return torch.addmm(bias, x, weight.t(), out=out)


_local = threading.local()


class PatternMemoryError(MemoryError):
    """The memory of a ``need_weights=True`` attention pattern (or another recycled result) could not be had.

    The message names the shape ``[batch, heads, seq_q, seq_k]``, the size in GiB and what to do instead.
    """


def _too_large(
    shape: tuple[int, ...], dtype: torch.dtype, n_bytes: int, cause: OSError
) -> PatternMemoryError:
    gib = n_bytes / (1 << 30)
    if len(shape) == 4:
        b, h, sq, sk = shape
        dims = f"[batch, heads, seq_q, seq_k] = [{b}, {h}, {sq}, {sk}]"
        what = f"the attention pattern of need_weights=True, {dims}"
    else:  # pragma: no cover - every caller today asks for a pattern
        what = f"a result of shape {list(shape)}"
    return PatternMemoryError(
        f"cannot allocate {what} ({dtype}, {gib:.2f} GiB): {cause.strerror or cause}. Pass "
        "need_weights=False (the fused path never builds the pattern), or run smaller batches or "
        "shorter sequences (the pattern grows with batch * heads * seq_q * seq_k)"
    )


def thread_workspace() -> Workspace:
    """This thread's workspace (created on first use; other threads never see it)."""
    ws = getattr(_local, "workspace", None)
    if ws is None:
        ws = _local.workspace = Workspace()
    return ws


def release_thread_workspace() -> None:
    """Free this thread's workspace memory and its idle recycled results (see :func:`recycled_empty`)."""
    _local.workspace = None
    _local.recycled = []


def recycled_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``torch.empty(shape)``, but a large CPU tensor reuses the memory of an earlier result since dropped.

    For results handed to the caller (the attention pattern): the memory of a tensor of at least
    :data:`THREAD_SCRATCH_MIN_BYTES` comes from an anonymous mapping that this thread keeps after the
    caller drops every view of it, so the next call of a similar size (at most 2x smaller) writes into
    pages already faulted in. Whether a mapping is still in use is its reference count: every tensor
    storage made by ``torch.frombuffer`` holds one. After each call at most one idle mapping is kept
    per thread; :func:`release_thread_workspace` drops it. Such tensors cannot be resized in place.
    """
    numel = math.prod(shape)
    n_bytes = numel * dtype.itemsize
    if device.type != "cpu" or n_bytes < THREAD_SCRATCH_MIN_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    pool: list[mmap.mmap] = _local.__dict__.setdefault("recycled", [])
    chosen = None
    keep = []
    for i in range(len(pool)):
        in_use = sys.getrefcount(pool[i]) > 2  # the list's reference and getrefcount's argument
        if in_use:
            keep.append(pool[i])
        elif chosen is None and n_bytes <= len(pool[i]) <= 2 * n_bytes:
            chosen = pool[i]
            keep.append(chosen)
        # other idle mappings are dropped here: unmapped once nothing refers to them
    if chosen is None:
        try:
            chosen = mmap.mmap(-1, n_bytes)
        except OSError as e:  # ENOMEM (or EINVAL/EOVERFLOW for a size past the address space)
            if e.errno not in (errno.ENOMEM, errno.EINVAL, errno.EOVERFLOW, errno.EFBIG):
                raise
            pool[:] = keep
            raise _too_large(shape, dtype, n_bytes, e) from None
        except OverflowError as e:  # a size past what mmap can even express
            pool[:] = keep
            raise _too_large(shape, dtype, n_bytes, OSError(errno.EOVERFLOW, str(e))) from None
        keep.append(chosen)
    pool[:] = keep
    return torch.frombuffer(chosen, dtype=dtype, count=numel).view(shape)
