"""The KV cache: each layer's keys and values of the positions decoded so far (torchtune keeps it in a
file of its own, and so does headspace).

Notation used for tensor shapes:
    batch, n_kv_heads, capacity (positions the cache can hold), d_head, layers, window.

A sliding-window layer's cache (``window=``) holds only the last ``window`` positions: key j is visible
from query i iff i - window < j <= i, so a key older than the window is never read again. Its buffers
are [batch, n_kv_heads, min(capacity, window), d_head], kept in position order (the oldest first);
``length`` still counts every position appended (RoPE and the next position read it) and ``held`` how
many the buffers hold.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..core.checks import check_positive_int


def _shape(t: Tensor) -> list[int]:
    return list(t.shape)


#: Byte alignment of every layer's slice of :meth:`KVCache.stacked` buffers (torch's CPU allocator's).
_ALIGN_BYTES = 64


def _aligned_layers(
    n: int, shape: torch.Size, dtype: torch.dtype, device: torch.device | str | None
) -> Tensor:
    """Zeros [n, *shape], each ``[i]`` contiguous and starting on an :data:`_ALIGN_BYTES` boundary."""
    per = math.prod(shape)  # elements of one layer
    step = max(1, _ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
    stride = -(-per // step) * step  # one layer's elements, padded to the alignment
    flat = torch.zeros(n * stride, dtype=dtype, device=device)
    inner = torch.empty(shape, device="meta").stride()  # a contiguous layer's strides
    return flat.as_strided((n, *shape), (stride, *inner))  # (n, batch, n_kv_heads, capacity, d_head)


class KVCache:
    """A preallocated key/value cache for incremental decoding.

    Holds ``k`` and ``v`` of shape [batch, n_kv_heads, capacity, d_head]; ``length`` positions are filled.
    Appending past ``capacity``, or with another batch size, dtype or device, raises ``ValueError`` and
    leaves the cache as it was.

    The buffers are written without autograd history (they are storage, not part of the graph). When
    the appended keys/values carry gradients (decoding with grad enabled), the cache also keeps the
    appended pieces and returns their concatenation, so that backpropagating through several decoding
    steps gives the same gradients as the full forward instead of an in-place-modification error.
    """

    def __init__(
        self,
        batch: int,
        n_kv_heads: int,
        d_head: int,
        capacity: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        window: int | None = None,
    ) -> None:
        if window is not None:
            check_positive_int("KVCache window", window)
        for name, value in (
            ("batch", batch),
            ("n_kv_heads", n_kv_heads),
            ("d_head", d_head),
            ("capacity", capacity),
        ):
            check_positive_int(f"KVCache {name}", value)
        #: the sliding window this cache keeps (None: every position); ``capacity`` bounds ``length``
        self.window = window
        self._capacity = capacity
        rows = capacity if window is None else min(capacity, window)
        self.k = torch.zeros(batch, n_kv_heads, rows, d_head, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.length = 0
        # pieces with autograd history, kept only while decoding with gradients (see the class docstring)
        self._k_parts: list[Tensor] = []
        self._v_parts: list[Tensor] = []
        #: (k_all, v_all, index) where this cache is slice ``index`` of :meth:`stacked` buffers, else None
        self.stack: tuple[Tensor, Tensor, int] | None = None

    @classmethod
    def stacked(
        cls,
        n: int,
        batch: int,
        n_kv_heads: int,
        d_head: int,
        capacity: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> list[KVCache]:
        """``n`` caches (one per layer) whose ``k`` / ``v`` are the slices ``k_all[i]`` / ``v_all[i]`` of two
        [n, batch, n_kv_heads, capacity, d_head] buffers: each behaves as a cache of its own, and a decoding
        step may take every layer's view of the filled positions in one call
        (:class:`headspace.decoding.DecodePlan`).

        Each layer's slice starts on a 64-byte boundary, as a cache of its own does (the allocator's
        alignment): MKL's products (inside attention too) may sum in another order at another alignment
        (seen on AMD CPUs), so a slice at an odd offset would break the bit-for-bit equality with
        per-layer caches."""
        check_positive_int("KVCache.stacked n", n)
        first = cls(batch, n_kv_heads, d_head, capacity, dtype=dtype, device=device)  # checks the sizes
        k_all, v_all = (
            _aligned_layers(n, first.k.shape, dtype, device),
            _aligned_layers(n, first.k.shape, dtype, device),
        )
        caches = []
        for i in range(n):
            cache = first if i == 0 else cls(1, 1, 1, 1, dtype=dtype, device=device)  # buffers replaced:
            cache.k, cache.v, cache.stack = k_all[i], v_all[i], (k_all, v_all, i)  # (batch, n_kv, cap, dh)
            caches.append(cache)
        return caches

    @property
    def capacity(self) -> int:
        """The most positions the cache accepts (``length`` at most this)."""
        return self._capacity if self.window is not None else self.k.shape[2]

    @property
    def held(self) -> int:
        """Positions the buffers hold: ``length``, or the last ``window`` of them for a windowed cache."""
        return self.length if self.window is None else min(self.length, self.window)

    @property
    def batch(self) -> int:
        return self.k.shape[0]

    def reset(self) -> None:
        self.length = 0
        self._k_parts.clear()
        self._v_parts.clear()

    def check(self, batch: int, new: int, dtype: torch.dtype, device: torch.device) -> None:
        """Raise ``ValueError`` unless ``new`` positions of this batch, dtype and device fit in the cache."""
        if batch != self.batch:
            raise ValueError(
                f"kv_cache was made for batch={self.batch} but the input has batch={batch}; "
                "make a new cache (or reset one of the right batch size)"
            )
        if dtype != self.k.dtype:
            raise ValueError(f"kv_cache holds dtype {self.k.dtype} but the input projects to dtype {dtype}")
        if device != self.k.device:
            raise ValueError(f"kv_cache is on {self.k.device} but the input is on {device}")
        if self.length + new > self.capacity:
            raise ValueError(
                f"kv_cache overflow: {self.length} positions filled + {new} new > capacity {self.capacity}; "
                "make the cache with a larger capacity"
            )

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store new keys/values [batch, n_kv_heads, new, d_head]; return all filled ones so far."""
        fits = k.dim() == 4 and (k.shape[1], k.shape[3]) == (self.k.shape[1], self.k.shape[3])
        if not fits or v.shape != k.shape:
            raise ValueError(
                f"kv_cache holds [batch, n_kv_heads, capacity, d_head] = {_shape(self.k)}; the new keys have "
                f"shape {_shape(k)} and the new values {_shape(v)}"
            )
        new = k.shape[2]
        self.check(k.shape[0], new, k.dtype, k.device)
        if self.window is not None:
            return self._append_windowed(k, v)
        start, end = self.length, self.length + new
        with torch.no_grad():
            self.k[:, :, start:end] = k
            self.v[:, :, start:end] = v
        self.length = end
        tracked = torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)
        if tracked or self._k_parts:
            if not self._k_parts and start > 0:
                # earlier positions were appended without history: they enter as constants
                self._k_parts.append(self.k[:, :, :start].clone())  # (batch, n_kv_heads, start, d_head)
                self._v_parts.append(self.v[:, :, :start].clone())  # (batch, n_kv_heads, start, d_head)
            self._k_parts.append(k)
            self._v_parts.append(v)
            k_all = torch.cat(self._k_parts, dim=2)  # (batch, n_kv_heads, end, d_head)
            v_all = torch.cat(self._v_parts, dim=2)  # (batch, n_kv_heads, end, d_head)
            return k_all, v_all
        return self.k[:, :, :end], self.v[:, :, :end]

    def _append_windowed(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """A windowed cache's :meth:`append`: returns the held positions then the new ones, in position
        order ([batch, n_kv_heads, held + new, d_head]: the keys the new queries may see, the last one the
        newest), and keeps the last ``window`` of them. With gradients tracked, the kept keys keep their
        history (as the full cache's pieces do), so backpropagating through decoding reaches them.
        While the buffers have room for the new positions (nothing drops out of the window yet) they are
        written in place and viewed, as a full cache's, without a copy of the held ones."""
        held, new = self.held, k.shape[2]
        tracked = self._k_parts or (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad))
        if not tracked and held + new <= self.k.shape[2]:
            with torch.no_grad():
                self.k[:, :, held : held + new] = k
                self.v[:, :, held : held + new] = v
            self.length += new
            return self.k[:, :, : held + new], self.v[
                :, :, : held + new
            ]  # (batch, n_kv_heads, held + new, d_head)
        old_k = (
            self._k_parts[0] if self._k_parts else self.k[:, :, :held]
        )  # (batch, n_kv_heads, held, d_head)
        old_v = self._v_parts[0] if self._v_parts else self.v[:, :, :held]
        k_all = torch.cat([old_k, k], dim=2)  # (batch, n_kv_heads, held + new, d_head)
        v_all = torch.cat([old_v, v], dim=2)  # (batch, n_kv_heads, held + new, d_head)
        keep = min(self.k.shape[2], held + new)
        with torch.no_grad():
            self.k[:, :, :keep] = k_all[:, :, held + new - keep :]  # (batch, n_kv_heads, keep, d_head)
            self.v[:, :, :keep] = v_all[:, :, held + new - keep :]
        if tracked:
            self._k_parts[:] = [k_all[:, :, held + new - keep :]]  # the kept keys, with their history
            self._v_parts[:] = [v_all[:, :, held + new - keep :]]
        self.length += new
        return k_all, v_all

    def append_one(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`append` of one position, ``k`` and ``v`` [batch, n_kv_heads, d_head] (or [batch,
        n_kv_heads, 1, d_head]), for a caller that ran :meth:`check` for one new position (a decoding
        step); returns what :meth:`append` returns.

        Without gradients to track, two copies into the buffers and two views of them.
        """
        one = k.dim() == 4  # the position axis kept
        if self.window is not None:
            return self._append_windowed(k if one else k.unsqueeze(2), v if one else v.unsqueeze(2))
        if self._k_parts or (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)):
            return self.append(k if one else k.unsqueeze(2), v if one else v.unsqueeze(2))
        start = self.length
        if one:
            self.k.narrow(2, start, 1).copy_(k)
            self.v.narrow(2, start, 1).copy_(v)
        else:
            self.k.select(2, start).copy_(k)
            self.v.select(2, start).copy_(v)
        self.length = end = start + 1
        return self.k.narrow(2, 0, end), self.v.narrow(2, 0, end)
