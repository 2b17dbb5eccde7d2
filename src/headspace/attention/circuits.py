"""Circuits as factored matrices: :class:`FactoredMatrix` and :func:`effective_rank`.

A head's QK circuit ``W_Q[h] W_K[h]^T`` and OV circuit ``W_V[h] W_O[h]`` are rank-``d_head`` matrices of
size ``d_model x d_model``; kept as their factors, their norms, SVD and eigenvalues cost
O(d_model d_head^2) instead of O(d_model^2 d_head).

With rotary positions (RoPE) a head has one QK circuit per query-key offset ``delta``:
``W_Q R(delta) W_K^T`` (:func:`qk_factors` with ``rotation``; :meth:`headspace.Head.qk` with ``delta``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..core.checks import nonfinite_count
from ..core.html import factored_html

__all__ = ["FactoredMatrix", "effective_rank", "qk_factors"]


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

    def _repr_html_(self) -> str:
        """In a notebook: the shapes, the rank bound and each matrix's norm and top singular values."""
        return factored_html(self)

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


def qk_factors(
    W_Q: Tensor,
    W_K: Tensor,
    *,
    rotation: Tensor | None = None,
    b_Q: Tensor | None = None,
    b_K: Tensor | None = None,
    augmented: bool = False,
) -> FactoredMatrix:
    r"""The QK circuit ``W_Q R W_K^T`` as factors ``A = W_Q R``, ``B = W_K^T`` (``R = I`` without rotation).

    For a query input row ``x`` and a key input row ``c``, ``x @ M @ c^T`` is the head's score before
    the softmax scale, ``(x W_Q) R (c W_K)^T``, leaving the biases out. With ``augmented=True`` the
    inputs are taken as ``[x, 1]`` and ``[c, 1]`` and the biases enter as one more row of each factor::

        A = [W_Q; b_Q] R   [..., d_model + 1, d_head]      B = [W_K; b_K]^T   [..., d_head, kdim + 1]
        [x, 1] A B [c, 1]^T = (x W_Q + b_Q) R (c W_K + b_K)^T                         (exact)

    (a missing bias is a zero row, so the shapes do not depend on the layer having biases).

    Notation used for tensor shapes:
        ...: batch axes (heads, offsets); d_model, kdim, d_head.

    Args:
        W_Q: [..., d_model, d_head].
        W_K: [..., kdim, d_head].
        rotation: [..., d_head, d_head] (e.g. :meth:`Rotary.rotation` of the offset), or None.
        b_Q: [..., d_head] or None; used only with ``augmented``.
        b_K: [..., d_head] or None; used only with ``augmented``.
        augmented: append the bias rows (see above).

    Returns:
        A :class:`FactoredMatrix` [..., d_model, kdim] ([..., d_model + 1, kdim + 1] augmented).
    """
    if augmented:
        zq = W_Q.new_zeros(*W_Q.shape[:-2], 1, W_Q.shape[-1])  # (..., 1, d_head)
        zk = W_K.new_zeros(*W_K.shape[:-2], 1, W_K.shape[-1])  # (..., 1, d_head)
        rq = zq if b_Q is None else b_Q.unsqueeze(-2).to(W_Q)  # (..., 1, d_head)
        rk = zk if b_K is None else b_K.unsqueeze(-2).to(W_K)  # (..., 1, d_head)
        W_Q = torch.cat((W_Q, rq), dim=-2)  # (..., d_model + 1, d_head)
        W_K = torch.cat((W_K, rk), dim=-2)  # (..., kdim + 1, d_head)
    A = W_Q if rotation is None else W_Q @ rotation.to(W_Q)  # (..., d_model (+1), d_head)
    return FactoredMatrix(A, W_K.transpose(-2, -1))  # B: (..., d_head, kdim (+1))
