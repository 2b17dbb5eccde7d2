"""The latent KV cache of multi-head latent attention (DeepSeek V2 / V3).

Where a classic layer caches each key/value head's keys and values (``2 n_kv_heads d_head`` numbers per
token), a latent layer caches what every head's keys and values are computed from: the normalised
latent ``c`` [kv_lora_rank] and the rotated shared key part ``R(x W_kr)`` [qk_rope_head_dim], so
``kv_lora_rank + qk_rope_head_dim`` numbers per token (:class:`LatentCache`). The heads' keys
``[c W_kb[h], R(x W_kr)]`` and values ``c W_vb[h]`` are expanded from it at each step.

Notation used for tensor shapes: batch, capacity, new (positions appended), kv_lora_rank, rope_dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.checks import check_positive_int
from .kv_cache import KVCache


class LatentCache(KVCache):
    """A :class:`KVCache` whose ``k`` holds the latent ``c`` [batch, 1, capacity, kv_lora_rank] and whose
    ``v`` holds the rotated shared key part [batch, 1, capacity, rope_dim] (module docstring).

    ``length``, ``capacity``, ``check`` and ``reset`` are :class:`KVCache`'s; :meth:`append` takes the
    latent and the rotary key part of the new positions. Gradients: as :class:`KVCache` (the appended
    pieces are kept while they carry history)."""

    def __init__(
        self,
        batch: int,
        kv_lora_rank: int,
        rope_dim: int,
        capacity: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        check_positive_int("LatentCache rope_dim", rope_dim)
        super().__init__(batch, 1, kv_lora_rank, capacity, dtype=dtype, device=device)
        self.v = torch.zeros(batch, 1, capacity, rope_dim, dtype=dtype, device=device)

    @property
    def kv_lora_rank(self) -> int:
        """The latent's width."""
        return self.k.shape[3]

    @property
    def rope_dim(self) -> int:
        """The width of the shared rotary key part."""
        return self.v.shape[3]

    @property
    def numbers_per_token(self) -> int:
        """What one position costs, in numbers: ``kv_lora_rank + rope_dim``."""
        return self.kv_lora_rank + self.rope_dim

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new positions' latent ``k`` [batch, 1, new, kv_lora_rank] and rotary key part ``v``
        [batch, 1, new, rope_dim]; return every filled position's (the same layouts, ``length`` rows)."""
        fits = k.dim() == 4 and v.dim() == 4 and k.shape[1] == 1 and v.shape[:3] == k.shape[:3]
        if not fits or k.shape[3] != self.kv_lora_rank or v.shape[3] != self.rope_dim:
            raise ValueError(
                f"latent cache holds [batch, 1, capacity, kv_lora_rank] = {list(self.k.shape)} and "
                f"[batch, 1, capacity, rope_dim] = {list(self.v.shape)}; got latent {list(k.shape)} and "
                f"rotary key {list(v.shape)}"
            )
        new = k.shape[2]
        self.check(k.shape[0], new, k.dtype, k.device)
        start, end = self.length, self.length + new
        with torch.no_grad():
            self.k[:, :, start:end] = k
            self.v[:, :, start:end] = v
        self.length = end
        tracked = torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)
        if tracked or self._k_parts:
            if not self._k_parts and start > 0:
                self._k_parts.append(self.k[:, :, :start].clone())  # (batch, 1, start, kv_lora_rank)
                self._v_parts.append(self.v[:, :, :start].clone())  # (batch, 1, start, rope_dim)
            self._k_parts.append(k)
            self._v_parts.append(v)
            return torch.cat(self._k_parts, dim=2), torch.cat(self._v_parts, dim=2)  # (batch, 1, end, .)
        return self.k[:, :, :end], self.v[:, :, :end]

    def append_one(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`append` of one position ([batch, 1, width] or [batch, 1, 1, width] each)."""
        one = k.dim() == 4
        return self.append(k if one else k.unsqueeze(2), v if one else v.unsqueeze(2))
