r"""Weight-space analysis, no inputs needed: circuits, their spectra and the heads' subspaces.

Circuits (Elhage et al. 2021), per query head ``h`` of a layer, kept factored (rank <= d_head):

* QK circuit ``W_Q[h] W_K[g(h)]^T`` [d_model, kdim]: the bilinear form of the (unscaled) score
  ``x_i W_Q W_K^T c_j^T``;
* OV circuit ``W_V[g(h)] W_O[h]`` [vdim, d_model]: what attending to ``c_j`` writes to the output.

``g(h)`` is the key/value head serving query head ``h`` (grouped-query attention).

Subspaces: a head *reads* ``x`` only through the column space of ``W_Q[h]`` (``q = x W_Q``), keys and
values through those of ``W_K``/``W_V``, and *writes* into the row space of ``W_O[h]`` (the column space
of ``W_O[h]^T``). The principal angles ``theta_1 <= ... <= theta_k`` between two such subspaces come from
the singular values ``cos theta_i`` of ``Q_A^T Q_B`` (orthonormal bases). Their **overlap** is

    overlap(A, B) = sum_i cos^2 theta_i / min(dim A, dim B)     in [0, 1]

(1: one subspace contains the other; 0: orthogonal). For subspaces of dims ``p`` and ``q`` drawn
uniformly at random in ``R^d``, ``E[sum_i cos^2 theta_i] = p q / d``, so the expected overlap is
``max(p, q) / d`` (``d_head / d_model`` for two heads): the baseline reported beside every overlap matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...attention.circuits import FactoredMatrix, effective_rank
from ...attention.layer import MultiHeadAttention
from ...core.checks import check_tensor_dims, is_int, nonfinite_count
from .._common import JsonResult, html_table, layer_head_table, pad_heads
from ..trace.trace import attention_layers

SUBSPACES = ("q", "k", "v", "o")
"""Which weight's subspace: ``q`` W_Q[h], ``k`` W_K[g], ``v`` W_V[g] (read), ``o`` W_O[h]^T (written)."""


def get_layer(model: Any, layer: int) -> MultiHeadAttention:
    """The ``layer``-th :class:`MultiHeadAttention` of ``model`` (module order; a bare layer is layer 0)."""
    layers = attention_layers(model)
    n = len(layers)
    if n == 0:
        raise ValueError(f"model has no MultiHeadAttention layer; got {type(model).__name__}")
    if not is_int(layer) or not -n <= layer < n:
        raise ValueError(f"layer must be an int in [0, {n}) for this model; got {layer!r}")
    return layers[layer][1]


def qk_circuit(model: Any, layer: int = 0) -> FactoredMatrix:
    """QK circuits of every query head of ``layer``: ``W_Q[h] W_K[g(h)]^T``, [n_heads, d_model, kdim]
    (with QK-norm, its gains folded in: ``W_Q[h] diag(g_q) diag(g_k) W_K[g(h)]^T``, as :meth:`Head.qk`)."""
    attn = get_layer(model, layer)
    W_Q, W_K = attn.W_Q, attn.W_K  # (n_heads, d_model, d_head), (n_kv_heads, kdim, d_head)
    gains = attn.qk_norm_gains()  # (n_heads, d_head), (n_kv_heads, d_head) or None
    if gains is not None:
        W_Q, W_K = W_Q * gains[0][:, None], W_K * gains[1][:, None]
    W_K = W_K.repeat_interleave(attn.group_size, dim=0)  # (n_heads, kdim, d_head)
    W_Kt = W_K.detach().transpose(1, 2)  # (n_heads, d_head, kdim)
    return FactoredMatrix(W_Q.detach(), W_Kt)


def ov_circuit(model: Any, layer: int = 0) -> FactoredMatrix:
    """OV circuits of every query head of ``layer``: ``W_V[g(h)] W_O[h]``, [n_heads, vdim, d_model]."""
    attn = get_layer(model, layer)
    W_V = attn.W_V.repeat_interleave(attn.group_size, dim=0)  # (n_heads, vdim, d_head)
    return FactoredMatrix(W_V.detach(), attn.W_O.detach())  # A (H, vdim, dh), B (H, dh, d_model)


def head_subspaces(attn: MultiHeadAttention, which: str) -> Tensor:
    """The matrices whose column spaces are the heads' subspaces, [n, dim, d_head].

    ``which``: ``"q"`` -> W_Q [n_heads, d_model, d_head]; ``"k"`` -> W_K [n_kv_heads, kdim, d_head];
    ``"v"`` -> W_V [n_kv_heads, vdim, d_head]; ``"o"`` -> W_O^T [n_heads, d_model, d_head].
    """
    if not isinstance(attn, MultiHeadAttention):
        raise TypeError(
            "attn must be one MultiHeadAttention layer (e.g. get_layer(model, 0) or model.blocks[0].attn); "
            f"got {type(attn).__name__} (for every layer of a model use subspace_overlaps(model, which))"
        )
    if which not in SUBSPACES:
        raise ValueError(f"which must be one of {SUBSPACES}; got {which!r}")
    if which == "q":
        return attn.W_Q.detach()
    if which == "k":
        return attn.W_K.detach()
    if which == "v":
        return attn.W_V.detach()
    return attn.W_O.detach().transpose(1, 2)  # (n_heads, d_model, d_head)


def _check_matrix(t: Any, name: str) -> None:
    """``t`` must be a finite floating-point (or complex) tensor [..., d, p]."""
    if not isinstance(t, Tensor) or t.dim() < 2:
        raise ValueError(f"{name} must be a tensor [..., d, p]; got {t!r}")
    if not (t.is_floating_point() or t.is_complex()):
        raise TypeError(
            f"{name} must be a floating-point tensor [..., d, p] (float32 or float64); got dtype {t.dtype} "
            f"(shape {list(t.shape)}); convert with {name}.double()"
        )
    _check_finite_vectors(t, name)


def _check_finite_vectors(t: Tensor, name: str) -> None:
    bad = nonfinite_count(t)
    if bad:
        raise ValueError(
            f"{name} has {bad} non-finite values (NaN/Inf) of {t.numel()} (shape {list(t.shape)}); a "
            "subspace needs finite vectors"
        )


def orthonormal_basis(A: Tensor, rtol: float | None = None) -> tuple[Tensor, Tensor]:
    """Orthonormal bases of the column spaces of ``A`` [..., d, p]: (``U`` [..., d, p], ``rank`` [...]).

    Columns of ``U`` beyond each matrix's rank are zero. Rank: singular values above
    ``rtol * max(s)``, with ``rtol`` defaulting to ``max(d, p) * eps`` (as ``torch.linalg.matrix_rank``).
    Integer/bool matrices are refused (TypeError), and so are NaN/Inf entries (ValueError).
    """
    _check_matrix(A, "A")
    Q, R = torch.linalg.qr(A)  # (..., d, k), (..., k, p): k = min(d, p)
    Ur, S, _ = torch.linalg.svd(R, full_matrices=False)  # (..., k, k), (..., k): the small core only
    U = Q @ Ur  # (..., d, k): A = U diag(S) V^T
    if rtol is None:
        rtol = max(A.shape[-2], A.shape[-1]) * torch.finfo(A.dtype).eps
    keep = S > rtol * S.amax(-1, keepdim=True)  # (..., k)
    keep = keep & (S > 0)
    return U * keep.unsqueeze(-2).to(U.dtype), keep.sum(-1)  # (..., d, k), (...)


def _check_pair(A: Tensor, B: Tensor) -> None:
    for name, t in (("A", A), ("B", B)):
        check_tensor_dims(t, 2, f"{name} must be a matrix [d, p] whose columns span a subspace")
    if A.shape[0] != B.shape[0]:
        raise ValueError(
            f"A and B must live in the same space (same number of rows); "
            f"got A {list(A.shape)}, B {list(B.shape)}"
        )
    for name, t in (("A", A), ("B", B)):
        _check_finite_vectors(t, name)


def principal_angles(A: Tensor, B: Tensor) -> Tensor:
    """Principal angles (radians, ascending) between the column spaces of ``A`` [d, p] and ``B`` [d, q].

    Returns [min(rank A, rank B)] in ``A``'s dtype (computed in float64); 0 means a shared direction,
    pi/2 orthogonal directions.
    """
    _check_pair(A, B)
    # float64 inside: arccos near 1 loses half the digits (a zero angle would come back as ~1e-3 in float32)
    Ua, ra = orthonormal_basis(A.to(torch.float64))
    Ub, rb = orthonormal_basis(B.to(torch.float64))
    k = int(min(ra, rb))
    cos = torch.linalg.svdvals(Ua.transpose(-2, -1) @ Ub)[:k].clamp(0.0, 1.0)  # (k,) descending
    return torch.arccos(cos).to(A.dtype if A.is_floating_point() else torch.float64)  # (k,) ascending


def head_angles(model: Any, a: tuple[int, int], b: tuple[int, int], which: str = "q") -> Tensor:
    """Principal angles (radians, ascending) between two heads' subspaces; ``a``, ``b``: (layer, head).

    Heads are query-head indices; for ``"k"``/``"v"`` each is mapped to the key/value head it reads
    (grouped-query attention), so two heads of one group give angles of 0. Heads may be in different
    layers (the subspaces live in the same residual stream).
    """
    if which not in SUBSPACES:
        raise ValueError(f"which must be one of {SUBSPACES}; got {which!r}")
    mats = []
    for arg, pair in (("a", a), ("b", b)):
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise TypeError(f"{arg} must be a (layer, head) pair; got {pair!r}")
        attn = get_layer(model, pair[0])
        head = pair[1]
        if not is_int(head) or not 0 <= head < attn.n_heads:
            raise ValueError(
                f"{arg}: head must be an int in [0, {attn.n_heads}) for layer {pair[0]}; got {head!r}"
            )
        index = head // attn.group_size if which in ("k", "v") else head
        mats.append(head_subspaces(attn, which)[index])  # (dim, d_head)
    return principal_angles(mats[0], mats[1])


def subspace_overlap(A: Tensor, B: Tensor) -> Tensor:
    """Overlap in [0, 1] of the column spaces of ``A`` [d, p] and ``B`` [d, q]: mean cos^2 of the angles.

    NaN when either matrix is zero (a zero-dimensional subspace).
    """
    _check_pair(A, B)
    Ua, ra = orthonormal_basis(A)
    Ub, rb = orthonormal_basis(B)
    k = torch.minimum(ra, rb)
    num = (Ua.transpose(-2, -1) @ Ub).pow(2).sum()  # sum_i cos^2 theta_i
    return torch.where(k > 0, num / k.clamp_min(1), torch.full_like(num, float("nan")))


def random_overlap(d: int, p: int, q: int) -> float:
    """Expected :func:`subspace_overlap` of uniformly random subspaces of dims ``p``, ``q`` in ``R^d``.

    It is ``max(p, q) / d`` (from ``E[sum_i cos^2 theta_i] = p q / d``).
    """
    for name, v in (("d", d), ("p", p), ("q", q)):
        if not is_int(v) or v <= 0:
            raise ValueError(f"{name} must be a positive int; got {v!r}")
    if p > d or q > d:
        raise ValueError(f"subspace dims p={p}, q={q} cannot exceed the ambient dim d={d}")
    return max(p, q) / d


def _overlaps_and_ranks(attn: MultiHeadAttention, which: str) -> tuple[Tensor, Tensor]:
    W = head_subspaces(attn, which)  # (n, dim, dh)
    bad = nonfinite_count(W)
    if bad:
        weight = {"q": "W_Q", "k": "W_K", "v": "W_V", "o": "W_O"}[which]
        raise ValueError(
            f"the layer's {weight} has {bad} non-finite values (NaN/Inf) of {W.numel()}; "
            "head subspaces need finite weights"
        )
    U, rank = orthonormal_basis(W.to(torch.float64))  # (n, dim, dh), (n,)
    G = torch.einsum("idp,jdq->ijpq", U, U)  # (n, n, dh, dh): Q_i^T Q_j
    num = G.pow(2).sum(dim=(-2, -1))  # (n, n)
    k = torch.minimum(rank[:, None], rank[None, :]).to(num.dtype)  # (n, n)
    out = torch.where(k > 0, num / k.clamp_min(1), torch.full_like(num, float("nan")))
    return out.to(torch.float32), rank


def overlap_matrix(attn: MultiHeadAttention, which: str = "q") -> Tensor:
    """[n, n] overlaps between the heads' subspaces of one layer (n = n_kv_heads for ``"k"``/``"v"``).

    ``attn`` is one :class:`MultiHeadAttention` (a model is refused: see :func:`subspace_overlaps`).
    """
    return _overlaps_and_ranks(attn, which)[0]


@dataclass
class SubspaceOverlaps(JsonResult):
    """Per-layer head x head overlap of one kind of subspace (``which`` in :data:`SUBSPACES`).

    * ``overlap``: [n_layers, n, n] (n = max heads, or kv heads for ``"k"``/``"v"``; NaN-padded);
    * ``rank``: [n_layers, n], the dimension of each head's subspace (usually d_head);
    * ``dim``: [n_layers], the ambient dimension (d_model, kdim or vdim);
    * ``random_expected``: [n_layers], expected overlap of random subspaces of the heads' median rank;
    * ``mean_offdiag``: [n_layers], mean overlap between distinct heads (compare with ``random_expected``).
    """

    kind = "subspace_overlaps"

    which: str
    overlap: Tensor
    rank: Tensor
    dim: Tensor
    random_expected: Tensor
    mean_offdiag: Tensor

    def _html_parts(self) -> list[str]:
        rows = []
        for i in range(self.overlap.shape[0]):
            n = int((~torch.isnan(self.rank[i])).sum())  # heads present in this layer (pruning pads with NaN)
            off = self.overlap[i, :n, :n][~torch.eye(n, dtype=torch.bool)]
            off = off[~torch.isnan(off)]  # a zero head has no subspace: NaN overlaps
            mean, base = float(self.mean_offdiag[i]), float(self.random_expected[i])
            top = float(off.max()) if off.numel() else float("nan")
            rows.append([n, int(self.dim[i]), mean, top, base, mean / base if base > 0 else float("nan")])
        weight = {"q": "W_Q", "k": "W_K", "v": "W_V", "o": "W_O^T"}.get(self.which, self.which)
        table = html_table(
            rows,
            caption=f"head x head overlap of the {weight} subspaces per layer, against random subspaces",
            row_labels=[f"L{i}" for i in range(len(rows))],
            col_labels=["heads", "dim", "mean overlap", "max overlap", "random", "mean / random"],
            corner="layer",
        )
        return [table]


def subspace_overlaps(model: Any, which: str = "q") -> SubspaceOverlaps:
    """Overlap matrices of every attention layer; grouped-query aware (``"k"``/``"v"`` per kv head)."""
    if which not in SUBSPACES:
        raise ValueError(f"which must be one of {SUBSPACES}; got {which!r}")
    layers = attention_layers(model)
    if not layers:
        raise ValueError(f"model has no MultiHeadAttention layer; got {type(model).__name__}")
    mats, ranks, dims, expected, offdiag = [], [], [], [], []
    for _, attn in layers:
        M, rank = _overlaps_and_ranks(attn, which)  # (n, n), (n,)
        n, d = M.shape[0], head_subspaces(attn, which).shape[1]
        mats.append(M)
        ranks.append(rank.to(torch.float32))
        dims.append(d)
        r = max(1, int(rank.median()))
        expected.append(random_overlap(d, min(r, d), min(r, d)))
        off = M[~torch.eye(n, dtype=torch.bool)]
        offdiag.append(float(off.nanmean()) if off.numel() else float("nan"))
    width = max(m.shape[0] for m in mats)
    overlap = torch.full((len(mats), width, width), float("nan"))
    for i, m in enumerate(mats):
        overlap[i, : m.shape[0], : m.shape[1]] = m
    return SubspaceOverlaps(
        which=which,
        overlap=overlap,
        rank=pad_heads(ranks),
        dim=torch.tensor(dims),
        random_expected=torch.tensor(expected),
        mean_offdiag=torch.tensor(offdiag),
    )


@dataclass
class CircuitSpectra(JsonResult):
    """Spectra of every head's QK and OV circuits, computed through the factors (no inputs).

    Shapes (NaN-padded over heads for pruned layers; k = d_head):

    * ``qk_singular_values``, ``ov_singular_values``: [n_layers, max_heads, k], descending;
    * ``qk_norm``, ``ov_norm``: [n_layers, max_heads], Frobenius norms;
    * ``qk_effective_rank``, ``ov_effective_rank``: [n_layers, max_heads], entropy effective rank
      (:func:`headspace.heads.effective_rank`), between 1 and d_head;
    * ``ov_copying``: [n_layers, max_heads], ``sum Re(lambda) / sum |lambda|`` over the OV circuit's
      eigenvalues (1: writes back what it reads, as a copying head; -1: the opposite; NaN when
      vdim != d_model or the circuit is zero).
    """

    kind = "circuit_spectra"

    qk_singular_values: Tensor
    ov_singular_values: Tensor
    qk_norm: Tensor
    ov_norm: Tensor
    qk_effective_rank: Tensor
    ov_effective_rank: Tensor
    ov_copying: Tensor

    def _html_parts(self) -> list[str]:
        return [
            layer_head_table(self.qk_norm, "|W_Q[h] W_K[h]^T|_F, the QK circuit's Frobenius norm"),
            layer_head_table(
                self.ov_copying, "OV copying score (1: writes back what it reads; -1: the opposite)"
            ),
        ]


def circuit_spectra(model: Any) -> CircuitSpectra:
    """Singular values, norms, effective ranks and the copying score of every head's circuits."""
    layers = attention_layers(model)
    if not layers:
        raise ValueError(f"model has no MultiHeadAttention layer; got {type(model).__name__}")
    rows: dict[str, list[Tensor]] = {k: [] for k in CircuitSpectra.__dataclass_fields__}
    for i, (_, attn) in enumerate(layers):
        qk = qk_circuit(model, i)
        ov = ov_circuit(model, i)
        for name, fm in (("qk", qk), ("ov", ov)):
            fm64 = FactoredMatrix(fm.A.to(torch.float64), fm.B.to(torch.float64))
            s = fm64.singular_values  # (n_heads, k)
            rows[f"{name}_singular_values"].append(s.float())
            rows[f"{name}_norm"].append(s.pow(2).sum(-1).sqrt().float())
            rows[f"{name}_effective_rank"].append(effective_rank(s).float())
        if attn.vdim == attn.d_model:
            ev = FactoredMatrix(ov.A.to(torch.float64), ov.B.to(torch.float64)).eigenvalues()  # (H, dh)
            mag = ev.abs().sum(-1)  # (H,)
            copying = torch.where(mag > 0, ev.real.sum(-1) / mag.clamp_min(1e-300), torch.nan)
        else:
            copying = torch.full((attn.n_heads,), float("nan"), dtype=torch.float64)
        rows["ov_copying"].append(copying.float())
    return CircuitSpectra(**{k: pad_heads(v) for k, v in rows.items()})
