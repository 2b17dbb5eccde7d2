"""Per-head views of an attention layer: one head's W_Q, W_K, W_V, W_O and biases, and its circuits."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from .attention import MultiHeadAttention


class Head:
    """One head of a :class:`~headspace.MultiHeadAttention`; every tensor is a view of the layer's storage.

    Shapes: ``W_Q`` [d_model, d_head], ``W_K`` [kdim, d_head], ``W_V`` [vdim, d_head],
    ``W_O`` [d_head, d_model], ``b_Q``/``b_K``/``b_V`` [d_head] (None without bias). With grouped-query
    attention, ``W_K``/``W_V`` are those of the key/value head this head reads (``kv_index``), shared
    with the other heads of its group. ``b_O`` belongs to the whole layer, not to a head.
    """

    def __init__(self, attn: MultiHeadAttention, index: int) -> None:
        n = attn.n_heads
        if not isinstance(index, int) or not -n <= index < n:
            raise IndexError(f"head index must be in [0, {n}) for a layer with n_heads={n}; got {index!r}")
        self.attn = attn
        self.index = index % n

    @property
    def kv_index(self) -> int:
        """The key/value head this query head reads."""
        return self.index // self.attn.group_size

    @property
    def W_Q(self) -> Tensor:
        return self.attn.W_Q[self.index]

    @property
    def W_K(self) -> Tensor:
        return self.attn.W_K[self.kv_index]

    @property
    def W_V(self) -> Tensor:
        return self.attn.W_V[self.kv_index]

    @property
    def W_O(self) -> Tensor:
        return self.attn.W_O[self.index]

    @property
    def b_Q(self) -> Tensor | None:
        b = self.attn.b_Q
        return None if b is None else b[self.index]

    @property
    def b_K(self) -> Tensor | None:
        b = self.attn.b_K
        return None if b is None else b[self.kv_index]

    @property
    def b_V(self) -> Tensor | None:
        b = self.attn.b_V
        return None if b is None else b[self.kv_index]

    def qk(self) -> Tensor:
        """The QK circuit ``W_Q W_K^T`` [d_model, kdim]: bilinear form of the (unscaled) score."""
        return self.W_Q @ self.W_K.T

    def ov(self) -> Tensor:
        """The OV circuit ``W_V W_O`` [vdim, d_model]: what attending to a token writes to the output."""
        return self.W_V @ self.W_O

    def __repr__(self) -> str:
        a = self.attn
        return f"Head({self.index} of {a.n_heads}, d_model={a.d_model}, d_head={a.d_head}, kv_head={self.kv_index})"


class HeadList:
    """Sequence of :class:`Head` views of a layer: ``attn.heads[3]``, ``len(attn.heads)``, iteration."""

    def __init__(self, attn: MultiHeadAttention) -> None:
        self.attn = attn

    def __len__(self) -> int:
        return self.attn.n_heads

    def __getitem__(self, index: int) -> Head:
        return Head(self.attn, index)

    def __iter__(self) -> Iterator[Head]:
        return (Head(self.attn, i) for i in range(self.attn.n_heads))
