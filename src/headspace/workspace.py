"""Scratch memory reused across calls instead of allocated afresh: :class:`Workspace`.

Why: a large fresh allocation comes from the operating system untouched, and the first write to each
of its 4 KiB pages faults. glibc maps every block of 32 MiB or more afresh and unmaps it on free (its
adaptive mmap threshold stops there), so an inference loop whose intermediates pass that size pays the
faults on every call: measured on a 2-core EPYC guest, a seq-1024 attention forward (batch 8, d_model
512) spent 11% of its time faulting in the fused [batch * seq, 3 * d_model] QKV projection. Memory that
is reused is faulted in once.

Two owners:

* the caller: :meth:`headspace.Encoder.infer` takes a ``workspace`` that every block shares, and
  :meth:`~headspace.pretrained.PretrainedEncoder.encode` passes one to every batch;
* the thread: :func:`thread_workspace` is one workspace per thread that
  :class:`~headspace.MultiHeadAttention` uses for its QKV projection when no autograd graph is recorded
  and the projection is at least :data:`THREAD_SCRATCH_MIN_BYTES`. It keeps the largest projection seen
  until :func:`release_thread_workspace` (or the thread's end).

Nothing returned to a caller ever lies in a workspace.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

#: The attention layer writes its QKV projection into the thread's workspace only from this size on:
#: glibc's ceiling for serving a block from its reused heap (smaller blocks fault only once).
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


def thread_workspace() -> Workspace:
    """This thread's workspace (created on first use; other threads never see it)."""
    ws = getattr(_local, "workspace", None)
    if ws is None:
        ws = _local.workspace = Workspace()
    return ws


def release_thread_workspace() -> None:
    """Free this thread's workspace memory (the next large inference call allocates it again)."""
    _local.workspace = None
