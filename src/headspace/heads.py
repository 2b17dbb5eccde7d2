"""Per-head views of an attention layer, its circuits as factored matrices, ablation and pruning.

* :class:`Head`: one head's W_Q, W_K, W_V, W_O and biases, views of the layer's fused storage.
* :class:`FactoredMatrix`: a product ``A @ B`` kept as its factors (QK and OV circuits are rank
  ``d_head`` matrices of size ``d_model x d_model``): norms, SVD and eigenvalues computed through the
  factors, never through the dense product.
* :func:`ablate`: a context manager that zero- or mean-ablates heads (through ``hook_z``).
* :func:`prune_heads`: removes heads for good, shrinking the fused weights.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from .checks import nonfinite_count

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


# ---------------------------------------------------------------------------------------------- factored


def effective_rank(singular_values: Tensor, kind: str = "entropy") -> Tensor:
    """Effective rank of a matrix from its singular values ``[..., k]`` -> ``[...]``.

    ``kind="entropy"`` (Roy & Vetterli, 2007): ``exp(H(p))`` with ``p = s / sum(s)``, between 1 (one
    direction) and k (all singular values equal). ``kind="stable"``: ``sum(s^2) / max(s)^2``
    (the stable rank). A zero matrix has effective rank 0 for both.
    """
    if not isinstance(singular_values, Tensor) or singular_values.dim() < 1:
        raise TypeError(f"singular_values must be a tensor [..., k]; got {singular_values!r}")
    s = singular_values.clamp_min(0)
    total = s.sum(-1, keepdim=True)  # (..., 1)
    if kind == "entropy":
        p = s / total.clamp_min(torch.finfo(s.dtype).tiny)  # (..., k)
        h = -(p * torch.log(p.clamp_min(torch.finfo(s.dtype).tiny))).sum(-1)  # (...)
        return torch.where(total.squeeze(-1) > 0, torch.exp(h), torch.zeros_like(h))
    if kind == "stable":
        top = s.amax(-1)  # (...)
        return torch.where(top > 0, (s**2).sum(-1) / top.clamp_min(torch.finfo(s.dtype).tiny) ** 2, top * 0)
    raise ValueError(f"kind must be 'entropy' or 'stable'; got {kind!r}")


class FactoredMatrix:
    r"""A matrix ``M = A B`` kept as its factors: ``A`` [..., m, r], ``B`` [..., r, n] -> ``M`` [..., m, n].

    Leading axes are batch axes (e.g. one circuit per head: ``A`` [n_heads, d_model, d_head]).
    The dense product is ``.AB`` (or ``.dense()``). Everything else goes through the factors, costing
    O((m + n) r^2) instead of O(m n r):

    * ``svd()``: with thin QR factorisations ``A = Q_A R_A`` and ``B^T = Q_B R_B``,
      ``M = Q_A (R_A R_B^T) Q_B^T``; the SVD of the small core ``R_A R_B^T = U_c S V_c^T`` gives
      ``M = (Q_A U_c) S (Q_B V_c)^T``.
    * ``norm()``: Frobenius, nuclear or spectral norm from those singular values.
    * ``eigenvalues()`` (square ``M``): the nonzero eigenvalues of ``A B`` are those of ``B A`` [r, r].
    * ``M @ X``, ``X @ M``, ``M1 @ M2``, ``.T`` and ``M[h]`` (indexing the batch axes) stay factored.

    Example: ``attn.heads[3].qk()`` is ``W_Q[3] W_K[3]^T`` and ``attn.heads[3].ov()`` is ``W_V[3] W_O[3]``.
    """

    def __init__(self, A: Tensor, B: Tensor) -> None:
        for name, t in (("A", A), ("B", B)):
            if not isinstance(t, Tensor):
                raise TypeError(f"FactoredMatrix {name} must be a tensor; got {type(t).__name__}")
            if t.dim() < 2:
                raise ValueError(
                    f"FactoredMatrix {name} must have at least 2 dims [..., rows, cols]; got {list(t.shape)}"
                )
            if not t.is_floating_point():
                raise TypeError(f"FactoredMatrix {name} must be a floating-point tensor; got dtype {t.dtype}")
        if A.dtype != B.dtype or A.device != B.device:
            raise TypeError(
                f"FactoredMatrix A and B must share dtype and device; got A {A.dtype} on {A.device}, "
                f"B {B.dtype} on {B.device}"
            )
        if A.shape[-1] != B.shape[-2]:
            raise ValueError(
                f"FactoredMatrix needs A [..., m, r] and B [..., r, n] with the same r; "
                f"got A {list(A.shape)}, B {list(B.shape)}"
            )
        try:
            torch.broadcast_shapes(A.shape[:-2], B.shape[:-2])
        except RuntimeError:
            raise ValueError(
                f"FactoredMatrix batch axes of A {list(A.shape)} and B {list(B.shape)} do not broadcast"
            ) from None
        self.A = A
        self.B = B

    # -- shape
    @property
    def shape(self) -> torch.Size:
        """[..., m, n], the shape of the dense product."""
        batch = torch.broadcast_shapes(self.A.shape[:-2], self.B.shape[:-2])
        return torch.Size((*batch, self.A.shape[-2], self.B.shape[-1]))

    @property
    def inner_dim(self) -> int:
        """r, the inner dimension (an upper bound on the rank)."""
        return self.A.shape[-1]

    def __repr__(self) -> str:
        return f"FactoredMatrix(shape={list(self.shape)}, inner_dim={self.inner_dim})"

    # -- products
    @property
    def AB(self) -> Tensor:
        """The dense product ``A @ B`` [..., m, n]."""
        return self.A @ self.B

    def dense(self) -> Tensor:
        """The dense product ``A @ B`` [..., m, n] (same as ``.AB``)."""
        return self.AB

    @property
    def BA(self) -> Tensor:
        """``B @ A`` [..., r, r] (for square ``M``: same nonzero eigenvalues as ``A @ B``)."""
        if self.A.shape[-2] != self.B.shape[-1]:
            raise ValueError(f"BA needs a square matrix (m == n); this one has shape {list(self.shape)}")
        return self.B @ self.A

    @property
    def T(self) -> FactoredMatrix:
        """The transpose ``B^T A^T``, still factored."""
        return FactoredMatrix(self.B.transpose(-2, -1), self.A.transpose(-2, -1))

    def _check_product(self, left: tuple[int, ...], right: tuple[int, ...], what: str) -> None:
        if left[-1] != right[-2]:
            raise ValueError(
                f"cannot multiply {what}: inner sizes differ ({list(left)} @ {list(right)}, "
                f"{left[-1]} != {right[-2]})"
            )

    def __matmul__(self, other: Tensor | FactoredMatrix) -> FactoredMatrix:
        if isinstance(other, (FactoredMatrix, Tensor)) and len(other.shape) >= 2:
            self._check_product(tuple(self.shape), tuple(other.shape), "FactoredMatrix @ other")
        if isinstance(other, FactoredMatrix):
            if self.inner_dim <= other.inner_dim:
                return FactoredMatrix(self.A, (self.B @ other.A) @ other.B)
            return FactoredMatrix(self.A @ (self.B @ other.A), other.B)
        if isinstance(other, Tensor) and other.dim() >= 2:
            return FactoredMatrix(self.A, self.B @ other)
        return NotImplemented

    def __rmatmul__(self, other: Tensor) -> FactoredMatrix:
        if isinstance(other, Tensor) and other.dim() >= 2:
            self._check_product(tuple(other.shape), tuple(self.shape), "other @ FactoredMatrix")
            return FactoredMatrix(other @ self.A, self.B)
        return NotImplemented

    def __getitem__(self, index: Any) -> FactoredMatrix:
        """Index the batch axes only: ``circuits[h]`` is head ``h``'s matrix."""
        batch = self.shape[:-2]
        if not batch:
            raise IndexError(f"this FactoredMatrix has no batch axes to index (shape {list(self.shape)})")
        A = self.A.expand(*batch, *self.A.shape[-2:])  # (..., m, r)
        B = self.B.expand(*batch, *self.B.shape[-2:])  # (..., r, n)
        return FactoredMatrix(A[index], B[index])

    # -- spectra
    def _check_finite(self) -> None:
        """Decompositions of NaN/Inf factors fail inside LAPACK: name the factor instead."""
        for name, t in (("A", self.A), ("B", self.B)):
            bad = nonfinite_count(t)
            if bad:
                raise ValueError(
                    f"FactoredMatrix {name} has {bad} NaN/Inf values of {t.numel()} "
                    f"(shape {list(t.shape)}); its singular values are undefined"
                )

    def svd(self) -> tuple[Tensor, Tensor, Tensor]:
        """Thin SVD through the factors: ``U`` [..., m, k], ``S`` [..., k] (descending), ``Vh`` [..., k, n].

        ``k = min(m, n, r)`` and ``U diag(S) Vh == A @ B``. NaN/Inf in a factor raise ``ValueError``.
        """
        self._check_finite()
        Qa, Ra = torch.linalg.qr(self.A)  # (..., m, ka), (..., ka, r)
        Qb, Rb = torch.linalg.qr(self.B.transpose(-2, -1))  # (..., n, kb), (..., kb, r)
        core = Ra @ Rb.transpose(-2, -1)  # (..., ka, kb)
        Uc, S, Vch = torch.linalg.svd(core, full_matrices=False)  # (..., ka, k), (..., k), (..., k, kb)
        U = Qa @ Uc  # (..., m, k)
        Vh = Vch @ Qb.transpose(-2, -1)  # (..., k, n)
        return U, S, Vh

    @property
    def singular_values(self) -> Tensor:
        """[..., k] in descending order, through the factors."""
        self._check_finite()
        Ra = torch.linalg.qr(self.A, mode="r")[1]  # (..., ka, r)
        Rb = torch.linalg.qr(self.B.transpose(-2, -1), mode="r")[1]  # (..., kb, r)
        return torch.linalg.svdvals(Ra @ Rb.transpose(-2, -1))  # (..., k)

    def norm(self, kind: str = "fro") -> Tensor:
        """Norm [...]: ``"fro"`` (Frobenius), ``"nuc"`` (sum of singular values) or ``"spectral"``."""
        s = self.singular_values
        if kind == "fro":
            return s.pow(2).sum(-1).sqrt()
        if kind == "nuc":
            return s.sum(-1)
        if kind == "spectral":
            return s[..., 0]
        raise ValueError(f"kind must be 'fro', 'nuc' or 'spectral'; got {kind!r}")

    def effective_rank(self, kind: str = "entropy") -> Tensor:
        """:func:`effective_rank` of this matrix's singular values -> [...]."""
        return effective_rank(self.singular_values, kind)

    def eigenvalues(self) -> Tensor:
        """Complex eigenvalues [..., r] of a square ``A @ B``, via the small ``B @ A`` (the rest are 0)."""
        return torch.linalg.eigvals(self.BA)  # (..., r)


# ---------------------------------------------------------------------------------------------- ablation

ABLATION_MODES = ("zero", "mean")


def _layers(model: Any) -> list[MultiHeadAttention]:
    from .trace import attention_layers  # deferred: trace imports attention, which imports this module

    layers = [m for _, m in attention_layers(model)]
    if not layers:
        raise ValueError(f"model has no MultiHeadAttention layer; got {type(model).__name__}")
    return layers


def _check_layer_head(layers: Sequence[MultiHeadAttention], layer: Any, head: Any, arg: str) -> None:
    n = len(layers)
    if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < n:
        raise ValueError(f"{arg}: layer must be an int in [0, {n}) for this model; got {layer!r}")
    h = layers[layer].n_heads
    if not isinstance(head, int) or isinstance(head, bool) or not 0 <= head < h:
        raise ValueError(f"{arg}: head must be an int in [0, {h}) for layer {layer}; got {head!r}")


@contextmanager
def ablate(
    model: Any,
    heads: Mapping[tuple[int, int], str] | Sequence[tuple[int, int]],
    *,
    means: Mapping[tuple[int, int], Tensor] | None = None,
) -> Iterator[None]:
    """Ablate heads while the block runs: ``with ablate(model, {(0, 3): "zero", (2, 1): "mean"}): model(x)``.

    A head is ablated by replacing its ``z_h`` (``hook_z``, [batch, seq_q, n_heads, d_head]) before
    ``W_O``, so its contribution ``z_h W_O[h]`` to the layer output changes and ``b_O`` stays:

    * ``"zero"``: ``z_h = 0`` (the head writes nothing).
    * ``"mean"``: ``z_h`` is replaced by ``means[(layer, head)]`` (any shape broadcasting to
      [batch, seq_q, d_head], e.g. a [d_head] mean over a reference set, see
      :func:`headspace.analysis.ablation.mean_z`) or, without ``means``, by its mean over the batch and
      positions of the current input (padding positions included).

    Args:
        model: a :class:`~headspace.MultiHeadAttention` (layer 0), a model with attention layers, or a
            pretrained wrapper with a ``.model``. Layer ``i`` is the ``i``-th attention layer in module
            order (``blocks.i.attn``).
        heads: ``{(layer, head): "zero" | "mean"}``, or a sequence of ``(layer, head)`` (all zeroed).
        means: optional reference means for ``"mean"`` ablation, by ``(layer, head)``.
    """
    from .trace import attention_layers, hooked

    layers = _layers(model)
    if isinstance(heads, Mapping):
        spec = dict(heads)
    elif isinstance(heads, Sequence) and not isinstance(heads, str):
        spec = {}
        for item in heads:
            if not isinstance(item, tuple) or len(item) != 2:
                raise TypeError(f"heads must hold (layer, head) pairs; got {item!r}")
            spec[item] = "zero"
    else:
        raise TypeError(
            f"heads must be a dict {{(layer, head): 'zero' | 'mean'}}; got {type(heads).__name__}"
        )
    per_layer: dict[int, dict[int, str]] = {}
    for key, mode in spec.items():
        if not isinstance(key, tuple) or len(key) != 2:
            raise TypeError(f"heads keys must be (layer, head) pairs; got {key!r}")
        _check_layer_head(layers, key[0], key[1], "heads")
        if mode not in ABLATION_MODES:
            raise ValueError(f"heads[{key}] must be one of {ABLATION_MODES}; got {mode!r}")
        per_layer.setdefault(key[0], {})[key[1]] = mode
    means = dict(means or {})
    for key in means:
        if not isinstance(key, tuple) or len(key) != 2:
            raise TypeError(f"means keys must be (layer, head) pairs; got {key!r}")
        _check_layer_head(layers, key[0], key[1], "means")
        m, dh = means[key], layers[key[0]].d_head
        if not isinstance(m, Tensor) or not m.is_floating_point():
            got = f"dtype {m.dtype}" if isinstance(m, Tensor) else type(m).__name__
            raise TypeError(
                f"means[{key}] must be a float tensor broadcasting to [batch, seq_q, d_head={dh}]; got {got}"
            )
        if m.dim() > 3 or (m.dim() and m.shape[-1] not in (1, dh)):
            raise ValueError(
                f"means[{key}] must broadcast to [batch, seq_q, d_head={dh}] (e.g. [{dh}]); "
                f"got shape {list(m.shape)}"
            )

    def make_fn(layer: int, modes: dict[int, str]) -> Callable[[Tensor, Any], Tensor]:
        def fn(z: Tensor, point: Any) -> Tensor:  # z: (batch, seq_q, n_heads, d_head)
            z = z.clone()
            for h, mode in modes.items():
                if mode == "zero":
                    z[:, :, h] = 0.0
                elif (layer, h) in means:
                    z[:, :, h] = means[(layer, h)].to(z)
                else:
                    z[:, :, h] = z[:, :, h].mean(dim=(0, 1), keepdim=True)  # (1, 1, d_head)
            return z

        return fn

    hooks = {}
    paths = [p for p, _ in attention_layers(model)]
    for layer, modes in per_layer.items():
        name = f"{paths[layer]}.hook_z" if paths[layer] else "hook_z"
        hooks[name] = make_fn(layer, modes)
    with hooked(model, hooks):
        yield


# ---------------------------------------------------------------------------------------------- pruning


def _kept_rows(weight: Tensor, keep: Sequence[int], width: int) -> Tensor:
    """Rows ``[i * width, (i + 1) * width)`` of ``weight`` for each ``i`` in ``keep``, concatenated."""
    if not keep:
        return weight[:0]
    return torch.cat([weight[i * width : (i + 1) * width] for i in keep], dim=0)


def kept_kv_heads(n_heads: int, n_kv_heads: int, keep: Sequence[int], arg: str) -> list[int]:
    """The key/value heads that serve some kept query head; refuses unequal group sizes (GQA).

    Query head ``h`` is served by key/value head ``h // (n_heads // n_kv_heads)``. Pure arithmetic on the
    counts, so :class:`~headspace.ModelConfig` checks ``pruned_heads`` with it before any layer exists.
    """
    g = n_heads // n_kv_heads
    counts = [sum(1 for h in keep if h // g == j) for j in range(n_kv_heads)]
    kept_kv = [j for j in range(n_kv_heads) if counts[j] > 0]
    if len({counts[j] for j in kept_kv}) > 1:
        raise ValueError(
            f"{arg}: pruning would leave key/value heads serving unequal numbers of query heads (kept query "
            f"heads per kv head: {dict(enumerate(counts))}, group size {g}); with grouped-query attention "
            "prune whole groups or the same number of heads from every surviving group"
        )
    return kept_kv


def _kept_kv_heads(attn: MultiHeadAttention, keep: Sequence[int], arg: str) -> list[int]:
    return kept_kv_heads(attn.n_heads, attn.n_kv_heads, keep, arg)


def shrink_attention(attn: MultiHeadAttention, keep: Sequence[int]) -> None:
    """Rebuild ``attn``'s fused storage with only the query heads ``keep`` (in place).

    Grouped-query attention: a key/value head is removed when none of its query heads is kept; every
    surviving key/value head must keep the same number of query heads (the layer's group size), else
    ``ValueError`` lists the counts. Biases of kept heads and ``b_O`` are kept.
    """
    H, Hkv, dh = attn.n_heads, attn.n_kv_heads, attn.d_head
    keep = sorted(set(keep))
    if not keep:
        raise ValueError(
            f"keep: cannot prune all {H} heads of a layer (a layer needs at least one head); zero-ablate "
            "them with headspace.ablate instead, or remove the block"
        )
    kept_kv = _kept_kv_heads(attn, keep, "keep")
    hq, hkv = H * dh, Hkv * dh

    def param(t: Tensor, like: nn.Parameter) -> nn.Parameter:
        return nn.Parameter(t.detach().clone(), requires_grad=like.requires_grad)

    def split_kept(t: Tensor) -> Tensor:
        """Kept rows of a stacked [q; k; v] tensor (weight or bias)."""
        q, k, v = t[:hq], t[hq : hq + hkv], t[hq + hkv :]
        parts = [_kept_rows(q, keep, dh), _kept_rows(k, kept_kv, dh), _kept_rows(v, kept_kv, dh)]
        return torch.cat(parts, dim=0)  # ((H' + 2 Hkv') dh, ...)

    with torch.no_grad():
        if attn.fused:
            attn.qkv_weight = param(split_kept(attn.qkv_weight), attn.qkv_weight)
        else:
            attn.q_weight = param(_kept_rows(attn.q_weight, keep, dh), attn.q_weight)
            attn.k_weight = param(_kept_rows(attn.k_weight, kept_kv, dh), attn.k_weight)
            attn.v_weight = param(_kept_rows(attn.v_weight, kept_kv, dh), attn.v_weight)
        if attn.qkv_bias is not None:
            attn.qkv_bias = param(split_kept(attn.qkv_bias), attn.qkv_bias)
        o = attn.o_weight  # (d_model, H dh)
        new_o = _kept_rows(o.T, keep, dh).T  # (d_model, H' dh)
        attn.o_weight = param(new_o.contiguous(), o)
    attn.n_heads = len(keep)
    attn.n_kv_heads = len(kept_kv)


def prune_heads(model: Any, heads: Mapping[int, Sequence[int]]) -> dict[int, list[int]]:
    """Remove heads for good: ``prune_heads(model, {0: [3, 5], 2: [1]})``.

    Each named layer's fused weights are rebuilt without the pruned heads' rows of ``W_Q``/``b_Q`` and
    columns of ``W_O`` (so ``n_heads`` and the parameter count drop); the layer then computes exactly
    what the unpruned layer computes with those heads zero-ablated (``b_O`` is kept). Layer indices are
    those of :func:`headspace.trace.attention_layers`; head indices are the layer's current ones.

    Grouped-query attention: a key/value head (its ``W_K``, ``W_V``, biases) goes when all its query
    heads go. Pruning that would leave surviving key/value heads with unequal numbers of query heads is
    refused with ``ValueError`` (a layer has one group size). Pruning every head of a layer is refused.

    An :class:`~headspace.Encoder` or :class:`~headspace.Decoder` (or a loaded model wrapping one) gets a
    new ``config`` whose ``pruned_heads`` lists, per layer, the *original* indices of every head pruned
    so far, so ``type(model)(model.config)`` builds the pruned shapes and the pruned weights load into it
    (checkpoints round-trip). ``n_heads`` in the config stays the unpruned count; read a layer's current
    count from the layer. Other models have no config to update. Optimisers and KV caches made before
    pruning are stale.

    Returns:
        ``{layer: [original indices of the kept heads]}`` for each pruned layer.
    """
    layers = _layers(model)
    if not isinstance(heads, Mapping):
        raise TypeError(f"heads must be a dict {{layer: [head, ...]}}; got {type(heads).__name__}")
    plans: dict[int, list[int]] = {}
    for layer, drop in heads.items():
        if isinstance(drop, int) or not isinstance(drop, Sequence):
            raise TypeError(f"heads[{layer!r}] must be a list of head indices; got {drop!r}")
        for h in drop:
            _check_layer_head(layers, layer, h, "heads")
        attn = layers[layer]
        if not attn.prunable:
            kind = f"{type(attn).__module__}.{type(attn).__name__}"
            raise ValueError(
                f"heads[{layer}]: layer {layer} is a {kind}, which keeps torch.nn.MultiheadAttention's layout"
                " (num_heads * head_dim == embed_dim) and so cannot lose heads; zero-ablate with "
                "headspace.ablate, or convert it to a headspace.MultiHeadAttention "
                "(headspace.layouts.from_torch_mha) and prune that"
            )
        keep = [h for h in range(attn.n_heads) if h not in set(drop)]
        if not keep:
            raise ValueError(
                f"heads[{layer}] would prune all {attn.n_heads} heads of layer {layer}; a layer needs at "
                "least one head (zero-ablate with headspace.ablate instead)"
            )
        plans[layer] = keep
    for layer, keep in plans.items():  # check every layer before changing any (GQA group sizes)
        _kept_kv_heads(layers[layer], keep, f"heads[{layer}]")
    owner = _config_owner(model, layers)
    if owner is not None:  # original indices before any layer changes
        config = owner.config
        pruned = dict(config.pruned_heads)
        for layer, keep in plans.items():
            before = config.kept_heads(layer)  # original index of each current head
            kept = {before[h] for h in keep}
            pruned[layer] = [h for h in range(config.n_heads) if h not in kept]
    for layer, keep in plans.items():
        shrink_attention(layers[layer], keep)
    if owner is not None:
        owner.config = dataclasses.replace(config, pruned_heads=pruned)
    return plans


def _config_owner(model: Any, layers: Sequence[MultiHeadAttention]) -> Any:
    """The Encoder/Decoder behind ``model`` whose config describes exactly ``layers``, else None."""
    from .models import _Stack  # deferred: models imports this module
    from .trace import as_module

    module = as_module(model)
    if not isinstance(module, _Stack) or [b.attn for b in module.blocks] != list(layers):
        return None
    config = module.config
    if any(len(config.kept_heads(i)) != a.n_heads for i, a in enumerate(layers)):
        return None  # layers changed behind the config's back (shrink_attention): nothing to record
    return module
