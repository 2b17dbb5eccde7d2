"""AtP over the circuit graph's edges: ``atp_star(model, task, site="edges", method="atp")``.

The edges are :mod:`.graph`'s (the same as :func:`.circuits.edge_scores`): every sender (the embeddings,
each head's output, each MLP's output) into every later receiver (each head's query, key and value
input, each MLP's input, the logits). The estimate is the denoising convention of :mod:`.atp_star`::

    AtP(u -> v) = mean over pairs of sum over positions of (a_u(clean) - a_u(corrupt)) . dM/dx_v (corrupt)

``a_u`` the sender's output, ``x_v`` the receiver's own input (the sum of the outputs of its senders, which
:func:`.graph.graph_grads` differentiates per receiver), the gradient taken at the corrupt run: the
first-order estimate of ``M(corrupt run, the edge u -> v carrying u's clean output) - M(corrupt run)``.
That is EAP (:func:`.circuits.edge_scores`) with the roles of the runs swapped (EAP takes the gradient at
the clean run and the corrupt-minus-clean change): the same cost, one corrupt forward and backward and one
clean forward per batch of pairs, and the same scoring product.

AtP*'s fixes are not applied to edges: the QK fix would recompute a pattern per edge into a query or key
(hundreds of patterns per receiver), and GradDrop would repeat the scoring product of every edge ``L - 1``
times (one gradient per dropped layer), each far past EAP's cost; ``method="atp*"`` with ``site="edges"``
is refused by name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._common import eval_mode
from ..causal.causal_inputs import stack_of
from .edges import EdgeScores, _accumulate, _check_bounds, _chunks, _device, _metric, task_of
from .graph import graph_grads, graph_of, run_graph

__all__ = ["atp_edges"]


def atp_edges(
    model: Any, task: Any, *, batch_size: int = 32, max_memory: int | str | None = None
) -> EdgeScores:
    """Every edge's AtP estimate on ``task`` (module docstring).

    Args:
        model: a loaded pre-norm decoder or a :class:`~headspace.Decoder`; task: a Task or ``"ioi"``.
        batch_size: at most this many pairs per pass; max_memory: as for :func:`.circuits.edge_scores`.

    Returns:
        :class:`~headspace.analysis.circuits.EdgeScores` with ``method="atp"``: ``scores``
        [n_senders, n_receivers] the estimate of each edge's effect in metric units (mean over pairs;
        0 where no edge), usable wherever EAP's scores are (``circuit_of``, the faithfulness curve).
    """
    module = stack_of(model, "atp_star")
    graph = graph_of(module)
    task = task_of(model, task)
    _check_bounds(module, task, batch_size, "eap", max_memory)
    dev = _device(module)
    scores = torch.zeros(len(graph.senders), len(graph.receivers), dtype=torch.float64)
    clean_m = corrupt_m = 0.0
    weight = 1.0 / len(task)
    with eval_mode(module):
        for part in _chunks(task, batch_size):
            last = part.last.to(dev)
            with torch.no_grad():
                e_clean, e_corrupt = module.embed(part.clean.to(dev)), module.embed(part.corrupt.to(dev))
                clean = run_graph(module, graph, e_clean, last, keep_acts=True)
            clean_m += float(_metric(clean.logits, part).sum()) * weight

            def metric(logits: Tensor, part: Any = part) -> Tensor:
                return _metric(logits, part).sum() * weight

            corrupt = graph_grads(module, graph, e_corrupt, last, metric, keep_acts=True)
            corrupt_m += float(_metric(corrupt.logits, part).sum()) * weight
            delta = clean.acts - corrupt.acts  # (n_senders, B, S, d)
            _accumulate(scores, graph, delta, corrupt.grads)  # grads: (n_receivers, B, S, d)
            del clean, corrupt, delta
    return EdgeScores(
        scores=torch.where(graph.valid, scores, 0.0), valid=graph.valid, senders=graph.senders,
        receivers=graph.receivers, kinds=graph.kinds, method="atp", steps=1, n_pairs=len(task),
        clean_metric=clean_m, corrupt_metric=corrupt_m,
    )  # fmt: skip
