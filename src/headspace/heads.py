"""Per-head views of an attention layer: :class:`Head` and :class:`HeadList`.

Every tensor a :class:`Head` gives is a view of the layer's fused storage (writing through it changes the
layer). Its circuits (``qk()``, ``ov()``) are :class:`~headspace.circuits.FactoredMatrix` products.
Ablation and pruning live in :mod:`headspace.interventions`.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import TYPE_CHECKING

from torch import Tensor

from .circuits import FactoredMatrix, effective_rank

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
        if isinstance(index, bool) or not hasattr(index, "__index__"):
            raise TypeError(
                f"head index must be an int in [0, {n}) for a layer with n_heads={n}; got "
                f"{type(index).__name__} {index!r}"
                + (" (for several heads use list(attn.heads)[a:b])" if isinstance(index, slice) else "")
            )
        index = operator.index(index)
        if not -n <= index < n:
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

    def qk(self) -> FactoredMatrix:
        """The QK circuit ``W_Q W_K^T`` [d_model, kdim] as factors (``.AB`` is the dense product).

        The (unscaled, bias-free) score of query input ``x_i`` on key input ``c_j`` is
        ``x_i W_Q W_K^T c_j^T``; the layer multiplies it by ``scale``.
        """
        return FactoredMatrix(self.W_Q, self.W_K.T)

    def ov(self) -> FactoredMatrix:
        """The OV circuit ``W_V W_O`` [vdim, d_model] as factors.

        What attending to a token writes to the output: ``c_j W_V W_O`` (times the attention weight).
        """
        return FactoredMatrix(self.W_V, self.W_O)

    def __repr__(self) -> str:
        a = self.attn
        dims = f"d_model={a.d_model}, d_head={a.d_head}, kv_head={self.kv_index}"
        return f"Head({self.index} of {a.n_heads}, {dims})"


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


__all__ = ["FactoredMatrix", "Head", "HeadList", "effective_rank"]
