"""DeepSeek's expert routing (V2 and V3), as transformers' ``DeepseekV{2,3}TopkRouter`` computes it.

``E`` experts in ``G = n_group`` groups of ``E / G``; ``r = x W_R`` the router logits (float32)::

    V3 ("sigmoid_group_topk"):
        s      = sigmoid(r);   c = s + b                  b: e_score_correction_bias [E]
        g_j    = sum of the 2 largest c in group j         group scores [G]
        keep the topk_group best groups; c = -inf in the others
        i      = topk(c, k);   w = s[i]                   the bias moves the choice, not the weights
        w      = w / (sum(w) + 1e-20)                     only with norm_topk
        w      = w * routed_scale

    V2 ("softmax_group_topk", group_limited_greedy):
        s      = softmax(r);   g_j = max of s in group j
        keep the topk_group best groups; s = 0 in the others
        w, i   = topk(s, k);   w = w * routed_scale
    V2 greedy is ``"softmax_topk"`` (no renormalisation) with ``routed_scale``.

Ties are broken as ``torch.topk`` breaks them (transformers calls it with ``sorted=False``; the chosen
set is the same, the order of the k may differ: the weighted sum is taken in expert order either way).
"""

from __future__ import annotations

import torch
from torch import Tensor

#: The routings of this module (:data:`headspace.nn.spec.ROUTINGS`).
GROUP_ROUTINGS = ("sigmoid_group_topk", "softmax_group_topk")


def _group_mask(group_scores: Tensor, topk_group: int, n_experts: int) -> Tensor:
    """bool [N, E]: True on the experts of each row's ``topk_group`` best groups; group_scores [N, G]."""
    n, g = group_scores.shape
    chosen = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False).indices  # (N, topk_group)
    mask = torch.zeros_like(group_scores).scatter_(1, chosen, 1.0)  # (N, G)
    return mask.unsqueeze(-1).expand(n, g, n_experts // g).reshape(n, n_experts).bool()  # (N, E)


def group_topk(
    logits: Tensor,
    routing: str,
    top_k: int,
    n_group: int,
    topk_group: int,
    *,
    score_bias: Tensor | None = None,
    norm_topk: bool = False,
) -> tuple[Tensor, Tensor]:
    """The chosen experts and their weights before ``routed_scale`` (module docstring):
    logits [N, E] (float32) -> (indices [N, k] int64, weights [N, k] float32)."""
    n, e = logits.shape
    if routing == "sigmoid_group_topk":
        scores = logits.sigmoid()  # (N, E)
        choice = scores if score_bias is None else scores + score_bias  # (N, E)
        if topk_group < n_group:  # (every group kept: the mask is all True, nothing to fill)
            groups = choice.view(n, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)  # (N, G)
            choice = choice.masked_fill(~_group_mask(groups, topk_group, e), float("-inf"))  # (N, E)
        indices = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]  # (N, k)
        weights = scores.gather(1, indices)  # (N, k)
        if norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return indices, weights
    if routing == "softmax_group_topk":
        scores = logits.softmax(dim=-1, dtype=torch.float32)  # (N, E)
        if topk_group < n_group:  # (every group kept: the mask is all True, nothing to fill)
            groups = scores.view(n, n_group, e // n_group).max(dim=-1).values  # (N, G)
            scores = scores.masked_fill(~_group_mask(groups, topk_group, e), 0.0)  # (N, E)
        weights, indices = torch.topk(scores, k=top_k, dim=-1, sorted=False)  # (N, k) x 2
        return indices, weights
    raise ValueError(f"routing must be one of {list(GROUP_ROUTINGS)}; got {routing!r}")
