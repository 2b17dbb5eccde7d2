"""The atlas's importance column: each head's mean-ablation loss change, exact or estimated by AtP*.

The quantity (both methods): ``ablation[l, h] = mean over next-token pairs of CE(head (l, h)'s z
replaced by its corpus mean at every position) - mean over pairs of CE(clean)``, CE the next-token
cross-entropy over pairs of real tokens (:func:`.atlas_ablation._pair_loss_sums`).

* ``"exact"``: :func:`.atlas_ablation.ablate_batch`, one replicated run up the stack per layer and head
  (about ``n_heads_total / 2`` forwards per token).
* ``"atp*"`` (the default): the first-order estimate from one forward and one backward of the clean
  run, the model's own forward with its hook points (``hook_z`` fires the traced attention path)::

      ablation[l, h] ~ (1 / n_pairs) sum over sequences, positions s of (mean_h - z_h[s]) . dCE_sum / dz_h[s]

  This is AtP*'s estimate for a head's ``z`` (:mod:`.atp_star`): ``z`` is downstream of its head's own
  softmax, so the change of ``z`` is exact and the QK fix changes nothing there; GradDrop is not applied,
  since it yields a magnitude that ranks (not the signed loss change the column holds) and costs ``L - 1``
  more backward passes. Its cost is about 3 forwards of the corpus.
* ``"none"``: no column (NaN).

:func:`agreement` compares the two on a sample (the ``importance_check`` of :func:`headspace.analysis.atlas`):
Spearman correlation over every head, and the overlap of the top ``k`` heads by ``|ablation|``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ...core.checks import is_int
from ..causal.causal_inputs import last_resid
from ..circuits.graph import frozen_parameters
from ..trace.trace import hooked
from .ablation import _pair_loss_sums
from .state import AtlasState

IMPORTANCE_METHODS = ("atp*", "exact", "none")
"""The atlas's importance methods (``atlas(importance=...)``, ``headspace atlas --importance``)."""

MAX_GRAD_TOKENS = 512
"""Tokens (rows x positions) per forward and backward of the ``atp*`` pass (bounds its saved activations)."""


def check_importance(importance: Any, ablation: Any = True, check: Any = None) -> str:
    """The importance method of an :func:`~headspace.analysis.atlas` call: ``importance`` checked, ``"none"``
    when ``ablation`` is False (the older switch); ``check`` (``importance_check``) a positive int or None,
    and only with a method."""
    if importance not in IMPORTANCE_METHODS:
        raise ValueError(f"importance must be one of {list(IMPORTANCE_METHODS)}; got {importance!r}")
    if not isinstance(ablation, bool):
        raise ValueError(f"ablation must be a bool; got {type(ablation).__name__} {ablation!r}")
    method = importance if ablation else "none"
    if check is not None and (not is_int(check) or check < 1):
        raise ValueError(f"importance_check must be a positive int (tokens) or None; got {check!r}")
    if check is not None and method == "none":
        raise ValueError(
            "importance_check compares atp* with exact: it needs importance 'atp*' or 'exact'; got none"
        )
    return method


def _grad_leaf(x: Tensor, point: Any) -> Tensor:
    """``hook_resid_pre`` of block 0: the embeddings as a leaf that requires grad (the run's graph root)."""
    return x.detach().requires_grad_(True)


def _keeper(into: list[Tensor]) -> Callable[[Tensor, Any], None]:
    def fn(value: Tensor, point: Any) -> None:
        into.append(value)

    return fn


def attribute_batch(
    module: nn.Module, state: AtlasState, tokens: Tensor, real: Tensor, means: Tensor
) -> None:
    """Add one batch's clean loss sums and AtP* mean-ablation loss sums (clean + estimate) to ``state``.

    ``tokens``/``real`` [B, S]; ``means`` float64 [n_layers, max_heads, d_head]: every head's corpus mean
    z. Rows go ``MAX_GRAD_TOKENS // S`` at a time through one forward (the model's own, hooked) and one
    backward.
    """
    B, S = tokens.shape
    per = max(1, MAX_GRAD_TOKENS // S)
    for start in range(0, B, per):
        _attribute_rows(module, state, tokens[start : start + per], real[start : start + per], means)


def _attribute_rows(
    module: nn.Module, state: AtlasState, tokens: Tensor, real: Tensor, means: Tensor
) -> None:
    """:func:`attribute_batch` for rows that fit one pass."""
    kp = None if bool(real.all()) else real
    zs: list[Tensor] = []
    final: list[Tensor] = []
    fns = {
        "blocks.0.hook_resid_pre": _grad_leaf, "blocks.*.attn.hook_z": _keeper(zs),
        last_resid(module): _keeper(final),
    }  # fmt: skip
    with torch.enable_grad(), frozen_parameters(module), hooked(module, fns):
        module.hidden_states(tokens, kp)
        sums, n_pairs = _pair_loss_sums(module, final[0], tokens, real)  # (rows,)
        total = sums.sum()
        grads = torch.autograd.grad(total, zs, allow_unused=True) if total.requires_grad else [None] * len(zs)
    clean = float(total.detach())
    state.clean_sum += clean
    state.n_pairs += n_pairs
    for layer, (z, g) in enumerate(zip(zs, grads)):  # z, g: (rows, S, H, dh)
        H = z.shape[2]
        if g is None:
            est = torch.zeros(H, dtype=torch.float64)
        else:
            change = means[layer, :H].to(z.dtype)[None, None] - z.detach()  # (rows, S, H, dh)
            est = (change * g).sum(dim=(0, 1, 3)).double().cpu()  # (H,)
        state.ablation_sum[layer, :H] += clean + est


def _ranks(x: Tensor) -> Tensor:
    return x.double().argsort(stable=True).argsort(stable=True).double()


def agreement(estimate: Tensor, exact: Tensor, k: int) -> dict[str, Any]:
    """Spearman correlation of ``estimate`` and ``exact`` (each [n_layers, max_heads], NaN where no head,
    ranks by argsort) and the share of the top ``k`` heads by ``|exact|`` that are in the top ``k`` by
    ``|estimate|`` (``top_k_overlap``)."""
    ok = ~(estimate.isnan() | exact.isnan())
    a, b = estimate[ok].double(), exact[ok].double()  # (n,) the heads that exist
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = float(ra.norm() * rb.norm())
    rho = float((ra * rb).sum()) / denom if denom > 0 else float("nan")
    k = max(1, min(int(k), int(a.numel())))
    top_a = set(a.abs().argsort(descending=True, stable=True)[:k].tolist())
    top_b = set(b.abs().argsort(descending=True, stable=True)[:k].tolist())
    return {"spearman": rho, "top_k": k, "top_k_overlap": len(top_a & top_b) / k}
