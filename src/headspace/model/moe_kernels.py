"""The routed sum of a mixture of experts, with the tokens sorted by expert once.

For ``N`` positions ``x`` [N, d_model] and the dense routing weights ``W`` [N, E] (0 where a token did
not choose an expert)::

    out[t] = sum over e with W[t, e] != 0, in expert order, of  y_e(x[t]) * W[t, e]
             (scale_input: y_e(x[t] * W[t, e]), Llama 4's form)

:func:`routed_sum` computes exactly the sum of :class:`~headspace.model.moe.MixtureOfExperts`'s loop
(each expert on the rows that chose it, tokens ascending, added with ``index_add_`` in expert order: the
same products and the same additions, so the same bits), but finds the (expert, token) pairs with one
``nonzero`` over ``W`` transposed (expert-major, tokens ascending within an expert), gathers the chosen
rows once, and runs each expert on a contiguous slice: one ``nonzero``, one gather and one host read of
the counts per call instead of a ``nonzero`` and a gather per expert. Experts no token chose are not
visited. It does not produce each expert's dense output (``hook_expert_out``): the module takes its
loop while that hook point has a function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def expert_pairs(weights: Tensor) -> tuple[Tensor, Tensor, list[int]]:
    """The nonzero routing weights of ``weights`` [N, E], sorted by expert, then token: ``(tokens [S],
    experts [S], counts)`` (int64 tensors; ``counts[e]`` the number of tokens of expert ``e``, a list of
    ``E`` ints summing to ``S``)."""
    pairs = torch.nonzero(weights.t())  # (S, 2): (expert, token), expert-major, tokens ascending
    experts, tokens = pairs[:, 0], pairs[:, 1]  # (S,) x 2
    counts = torch.bincount(experts, minlength=weights.shape[1]).tolist()
    return tokens, experts, counts


def routed_sum(
    flat: Tensor,
    weights: Tensor,
    expert: Callable[[int, Tensor], Tensor],
    *,
    scale_input: bool = False,
    fresh: bool = False,
) -> Tensor:
    """``out`` [N, d_model] of the module docstring: ``flat`` [N, d_model], ``weights`` [N, E] (the
    dense routing weights), ``expert(e, rows)`` expert ``e``'s unweighted output [n, d_model] on
    ``rows`` [n, d_model]; ``scale_input``: each row is scaled by its weight before the expert (Llama 4)
    instead of the expert's output after it; ``fresh``: ``expert`` returns a new tensor of its own each
    call (the weight then multiplies it in place where no gradient is taken: the same values)."""
    tokens, experts, counts = expert_pairs(weights)
    out = torch.zeros_like(flat)  # (N, d_model)
    if tokens.numel() == 0:
        return out
    chosen = flat.index_select(0, tokens)  # (S, d_model): the rows, expert by expert
    w = weights[tokens, experts].unsqueeze(-1)  # (S, 1)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        end = start + n
        if scale_input:
            y = expert(e, chosen[start:end] * w[start:end])  # (n, d_model)
        else:
            y = expert(e, chosen[start:end])  # (n, d_model)
            y = y.mul_(w[start:end]) if fresh and not y.requires_grad else y * w[start:end]
        out.index_add_(0, tokens[start:end], y)
        start = end
    return out
