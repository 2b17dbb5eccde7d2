"""Per-head views of an attention layer: :class:`Head` and :class:`HeadList`.

Every tensor a :class:`Head` gives is a view of the layer's fused storage (writing through it changes the
layer). Its circuits (``qk()``, ``ov()``) are :class:`~headspace.circuits.FactoredMatrix` products.
Ablation and pruning live in :mod:`headspace.interventions`.

The dependency runs one way: :mod:`headspace.attention.layer` imports these views; this module knows the layer
only as :class:`HeadedLayer`, the handful of attributes a view reads (a structural protocol that
:class:`~headspace.MultiHeadAttention` satisfies), so it imports nothing from the layer, not even for types.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import Tensor

from ..nn.alibi import head_bias
from .circuits import FactoredMatrix, effective_rank, qk_factors

if TYPE_CHECKING:
    from ..nn.positions import Rotary


@runtime_checkable
class HeadedLayer(Protocol):
    """What a :class:`Head` reads from its layer; :class:`~headspace.MultiHeadAttention` is one.

    Per-head tensors are views of the layer's fused storage: ``W_Q`` [n_heads, d_model, d_head],
    ``W_K`` [n_kv_heads, kdim, d_head], ``W_V`` [n_kv_heads, vdim, d_head], ``W_O`` [n_heads, d_head,
    d_model], ``b_Q`` [n_heads, d_head] and ``b_K``/``b_V`` [n_kv_heads, d_head] (None without bias).
    ``group_size`` = n_heads // n_kv_heads. A layer with rotary positions also has ``rotary``
    (read with ``getattr``, so a layer without it need not declare it).
    """

    n_heads: int
    d_model: int
    d_head: int

    @property
    def group_size(self) -> int: ...

    @property
    def W_Q(self) -> Tensor: ...

    @property
    def W_K(self) -> Tensor: ...

    @property
    def W_V(self) -> Tensor: ...

    @property
    def W_O(self) -> Tensor: ...

    @property
    def b_Q(self) -> Tensor | None: ...

    @property
    def b_K(self) -> Tensor | None: ...

    @property
    def b_V(self) -> Tensor | None: ...


def _head_view(name: str, row: str) -> property:
    """A :class:`Head` property: its row of the layer's per-head tensor ``attn.<name>`` (a view).

    ``row`` is ``"index"`` for the query-side tensors (``W_Q``, ``W_O``, ``b_Q``) and ``"kv_index"`` for
    the key/value ones (``W_K``, ``W_V``, ``b_K``, ``b_V``); None where the layer has none (no bias).
    """

    def view(self: Head) -> Tensor | None:
        t = getattr(self.attn, name)
        return None if t is None else t[getattr(self, row)]

    return property(view, doc=f"This head's row of the layer's ``{name}`` (a view).")


class Head:
    """One head of a :class:`~headspace.MultiHeadAttention`; every tensor is a view of the layer's storage.

    Shapes: ``W_Q`` [d_model, d_head], ``W_K`` [kdim, d_head], ``W_V`` [vdim, d_head],
    ``W_O`` [d_head, d_model], ``b_Q``/``b_K``/``b_V`` [d_head] (None without bias). With grouped-query
    attention, ``W_K``/``W_V`` are those of the key/value head this head reads (``kv_index``), shared
    with the other heads of its group (``kv_group``): the same storage, not a copy, so writing through
    one head's ``W_K`` changes every head of the group. ``b_O`` belongs to the whole layer, not to a head.
    With rotary positions, ``qk(delta)`` is the QK circuit for a query-key offset.
    """

    def __init__(self, attn: HeadedLayer, index: int) -> None:
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
    def kv_group(self) -> list[int]:
        """The query heads (this one included) that read this head's key/value head ``kv_index``."""
        g = self.attn.group_size
        return list(range(self.kv_index * g, (self.kv_index + 1) * g))

    @property
    def shares_kv_with(self) -> list[int]:
        """The other query heads reading the same key/value head (empty without grouped-query attention)."""
        return [h for h in self.kv_group if h != self.index]

    @property
    def rotary(self) -> Rotary | None:
        """The layer's rotary positions (:class:`~headspace.positions.Rotary`), or None."""
        return getattr(self.attn, "rotary", None)

    W_Q = _head_view("W_Q", "index")
    W_K = _head_view("W_K", "kv_index")
    W_V = _head_view("W_V", "kv_index")
    W_O = _head_view("W_O", "index")
    b_Q = _head_view("b_Q", "index")
    b_K = _head_view("b_K", "kv_index")
    b_V = _head_view("b_V", "kv_index")
    #: gated layers only (Qwen3-Next): this head's gate weights [d_model, width] and bias (None without)
    W_G = _head_view("W_G", "index")
    b_G = _head_view("b_G", "index")

    def qk(self, delta: int | Tensor | None = None, *, augmented: bool = False) -> FactoredMatrix:
        """The QK circuit as factors (``.AB`` is the dense product): ``W_Q W_K^T`` [d_model, kdim].

        The (unscaled, bias-free) score of query input ``x_i`` on key input ``c_j`` is
        ``x_i W_Q W_K^T c_j^T``; the layer multiplies it by ``scale``.

        With rotary positions the score of the query at position ``i`` on the key at position
        ``j = i - delta`` is ``x_i W_Q R(delta) W_K^T x_j^T`` (``R`` = :meth:`Rotary.rotation`): ``qk(delta)``
        gives ``A = W_Q R(delta)``, ``B = W_K^T``. ``delta`` may be an int or an integer tensor of offsets
        (then the circuit has those as batch axes: [*delta.shape, d_model, kdim]). ``qk()`` (no delta) is
        ``W_Q W_K^T``, which for a rotary head is the circuit at ``delta = 0`` (a token on itself).
        Without rotary positions the circuit does not depend on the offset: any ``delta`` gives ``qk()``.

        ``augmented=True`` makes the identity exact with the q/k biases: the inputs are ``[x, 1]`` and
        the circuit is [d_model + 1, kdim + 1] (see :func:`headspace.circuits.qk_factors`)::

            [x_i, 1] @ head.qk(i - j, augmented=True).AB @ [x_j, 1]^T == hook_scores[b, h, i, j] / scale

        With QK-norm (``attn.qk_norm``: Qwen3, Gemma 3, OLMo 2) q and k are RMS-normalised before the
        rotation, so no fixed matrix gives the scores: the circuit has the norms' gains ``g_q``, ``g_k``
        (:meth:`MultiHeadAttention.qk_norm_gains`) folded in, ``A = W_Q diag(g_q) R(delta)``, ``B = diag(g_k)
        W_K^T``, and the identity holds only at the run's frozen norm scales ``s_q``, ``s_k``
        (:meth:`MultiHeadAttention.qk_norm_scales` of that run's ``hook_q``, ``hook_k``)::

            x_i @ head.qk(i - j).AB @ x_j^T * s_q[b, i, h] * s_k[b, j, g] == hook_scores[b, h, i, j] / scale

        (``g`` = ``head.kv_index``; ``augmented=True`` with ``[x, 1]`` as above when there are biases).

        Another input changes the scales, so the circuit alone says where a head looks only up to each
        token's scale.

        With ALiBi (BLOOM, MPT, Falcon) the circuit does not depend on ``delta``; the score is the circuit
        plus the head's bias ``-m_h * delta`` (:meth:`alibi_bias`), stated apart.
        """
        rotation = None
        rotary = self.rotary
        if delta is not None:
            ok = isinstance(delta, int) and not isinstance(delta, bool)
            ok = ok or (
                isinstance(delta, Tensor)
                and not (delta.dtype == torch.bool or delta.is_floating_point() or delta.is_complex())
            )
            if not ok:
                got = (
                    f"dtype {delta.dtype}"
                    if isinstance(delta, Tensor)
                    else f"{type(delta).__name__} {delta!r}"
                )
                raise TypeError(
                    f"delta must be None, an int or an integer tensor (query position minus key position); "
                    f"got {got}"
                )
            if rotary is not None:
                W = self.W_Q
                rotation = rotary.rotation(delta, dtype=W.dtype, device=W.device)  # ([*delta], dh, dh)
        W_Q, W_K, b_Q, b_K = self.W_Q, self.W_K, self.b_Q, self.b_K
        gains = getattr(self.attn, "qk_norm_gains", lambda: None)()  # (H, dh), (Hkv, dh) or None
        if gains is not None:  # QK-norm: its gains folded in (its scales are the run's; see above)
            g_q, g_k = gains[0][self.index], gains[1][self.kv_index]  # (dh,), (dh,)
            W_Q, W_K = W_Q * g_q, W_K * g_k  # (d_model, dh), (kdim, dh)
            b_Q = None if b_Q is None else b_Q * g_q  # (dh,)
            b_K = None if b_K is None else b_K * g_k  # (dh,)
        return qk_factors(W_Q, W_K, rotation=rotation, b_Q=b_Q, b_K=b_K, augmented=augmented)

    @property
    def alibi_slope(self) -> float | None:
        """This head's ALiBi slope ``m_h`` (the layer's ``spec.alibi_slopes[h]``), None without ALiBi."""
        slopes = getattr(getattr(self.attn, "spec", None), "alibi_slopes", None)
        return None if slopes is None else float(slopes[self.index])

    def alibi_bias(self, delta: int | Tensor) -> float | Tensor:
        """ALiBi's bias at query-key offset ``delta = i - j``: ``-m_h * delta``, added to the scaled score.

        For an ALiBi head the score is **the circuit plus this bias**, not the circuit alone::

            [x_i, 1] @ head.qk(i - j, augmented=True).AB @ [x_j, 1]^T * scale + head.alibi_bias(i - j)
                == hook_scores[b, h, i, j]

        A head without ALiBi has no bias: ``ValueError``.
        """
        slope = self.alibi_slope
        if slope is None:
            raise ValueError(f"head {self.index} has no ALiBi bias: its layer's spec.bias is None")
        return head_bias(slope, delta)

    def ov(self) -> FactoredMatrix:
        """The OV circuit ``W_V W_O`` [vdim, d_model] as factors.

        What attending to a token writes to the output: ``c_j W_V W_O`` (times the attention weight).
        """
        return FactoredMatrix(self.W_V, self.W_O)

    def __repr__(self) -> str:
        a = self.attn
        dims = f"d_model={a.d_model}, d_head={a.d_head}, kv_head={self.kv_index}"
        if a.group_size > 1:
            dims += f" shared with heads {self.shares_kv_with}"
        if self.rotary is not None:
            dims += f", rotary_dim={self.rotary.rotary_dim}"
        return f"Head({self.index} of {a.n_heads}, {dims})"


class HeadList:
    """Sequence of :class:`Head` views of a layer: ``attn.heads[3]``, ``len(attn.heads)``, iteration."""

    def __init__(self, attn: HeadedLayer) -> None:
        self.attn = attn

    def __len__(self) -> int:
        return self.attn.n_heads

    def __getitem__(self, index: int) -> Head:
        return Head(self.attn, index)

    def __iter__(self) -> Iterator[Head]:
        return (Head(self.attn, i) for i in range(self.attn.n_heads))


__all__ = ["FactoredMatrix", "Head", "HeadList", "HeadedLayer", "effective_rank", "qk_factors"]
