"""Circuits of heads and MLPs: edge scores (EAP, EAP-IG), the top edges, and their faithfulness.

(Not :mod:`headspace.circuits`, the QK/OV :class:`~headspace.circuits.FactoredMatrix` module.)

The graph is :mod:`.graph`'s: senders ``embed``, every head, every MLP; receivers every head's query,
key and value inputs (a key/value receiver is the shared key/value head under GQA), every MLP's input
and the logits. A task (:mod:`.tasks`) is clean/corrupt prompt pairs with an answer and another token;
the metric ``M`` is ``logit(answer) - logit(other)`` at the last position, averaged over pairs.

**EAP** (edge attribution patching; Syed et al. 2023): the score of edge ``u -> v`` is the first-order
change of ``M`` when the edge carries the corrupt activation::

    score(u -> v) = sum over pairs, positions of (a_u(corrupt) - a_u(clean)) . dM/dx_v (clean)

from one corrupt forward and one clean forward and backward (``x_v``: receiver ``v``'s own input; see
:func:`.graph.graph_grads`).
**EAP-IG** (Hanna et al. 2024) replaces the clean gradient by its mean over ``steps`` points on the line
between the corrupt and the clean embeddings, ``x_0 = e_corrupt + (k / steps) (e_clean - e_corrupt)``,
``k = 1 .. steps`` (so ``steps=1`` is EAP); the score is linear in the gradient, so the gradients are summed
over the path and multiplied by the deltas once.

**Faithfulness** of a circuit ``C`` (a set of edges) is measured by running it (:func:`.graph.run_graph`):
every edge outside ``C`` carries its corrupt activation, all pairs batched, and::

    f(C) = (M(C) - M(empty)) / (M(full) - M(empty))

with ``M(full)`` (every edge in: the clean run, nothing patched) and ``M(empty)`` (every edge corrupt: the
corrupt run) from the same graph runs, so ``f(full) == 1`` and ``f(empty) == 0`` exactly. A circuit's run
computes only the heads and MLPs that can change ``M`` (see :mod:`.graph`; the same metric, not an
approximation) and reads only the answer's and the other token's logits.
:func:`faithfulness_curve` measures ``f`` at circuit sizes given as fractions of the edges (MIB's 0.1% ..
100% by default) and its areas as MIB (Mueller et al. 2025) defines them, by the trapezoid rule over the
fraction of edges:
``CPR = integral of f`` (higher is better) and ``CMD = integral of |1 - f|`` (lower is better).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor

from ...core.checks import is_int
from ...core.progress import progress_bar
from .._common import JsonResult, eval_mode
from ..causal.budget import check_length, check_memory, circuit_bytes, shape_of
from ..causal.causal_inputs import stack_of
from .graph import Graph, graph_grads, graph_of, run_graph, run_rows
from .plan import plan_run
from .tasks import Task, ioi_task

__all__ = [
    "MIB_FRACTIONS",
    "Circuit",
    "EdgeScores",
    "Faithfulness",
    "FaithfulnessCurve",
    "curve_and_faithfulness",
    "edge_scores",
    "faithfulness",
    "faithfulness_curve",
    "find_circuit",
]

#: MIB's circuit sizes, as fractions of the edges.
MIB_FRACTIONS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
METHODS = ("eap", "eap-ig")


@dataclass
class EdgeScores(JsonResult):
    """Every edge's score: ``scores`` [n_senders, n_receivers] (0 where no edge, see ``valid``), the
    node names, the method and steps, and the metric on the clean and corrupt prompts (model forward)."""

    kind = "edge_scores"

    scores: Tensor
    valid: Tensor
    senders: list[str]
    receivers: list[str]
    kinds: list[str]
    method: str
    steps: int
    n_pairs: int
    clean_metric: float
    corrupt_metric: float

    def top(self, n: int = 10) -> list[tuple[str, str, float]]:
        """The ``n`` edges of largest ``|score|``: ``[(sender, receiver, score), ...]``."""
        flat = torch.where(self.valid, self.scores.abs(), -1.0).flatten()
        R = self.scores.shape[1]
        return [
            (self.senders[i // R], self.receivers[i % R], float(self.scores.flatten()[i]))
            for i in flat.argsort(descending=True)[:n].tolist()
        ]


@dataclass
class Circuit(JsonResult):
    """A set of edges: ``edges`` bool [n_senders, n_receivers], and the list ``[(sender, receiver, score)]``
    in order of ``|score|``."""

    kind = "circuit"

    edges: Tensor
    senders: list[str]
    receivers: list[str]
    kinds: list[str]
    listed: list[tuple[str, str, float]]

    @property
    def n_edges(self) -> int:
        return int(self.edges.sum())

    def heads(self) -> list[str]:
        """The heads with an edge in the circuit (as sender or receiver), ``"L{l}H{h}"``, in graph order."""
        names = {s for s, _, _ in self.listed if s.startswith("L")}
        names |= {r.split(".")[0] for _, r, _ in self.listed if r.startswith("L") and "KV" not in r}
        return sorted(names, key=lambda n: tuple(int(x) for x in n[1:].split("H")))


@dataclass
class Faithfulness(JsonResult):
    """``faithfulness = (metric - corrupt_metric) / (clean_metric - corrupt_metric)``, the metrics from the
    graph run: with the circuit, with every edge (``clean_metric``) and with none (``corrupt_metric``)."""

    kind = "faithfulness"

    faithfulness: float
    metric: float
    clean_metric: float
    corrupt_metric: float
    n_edges: int


@dataclass
class FaithfulnessCurve(JsonResult):
    """``faithfulness[i]`` of the top ``n_edges[i]`` edges (``fractions[i]`` of all ``total_edges``);
    ``cpr`` and ``cmd`` MIB's areas over the fraction of edges (see the module docstring)."""

    kind = "faithfulness_curve"

    fractions: list[float]
    n_edges: list[int]
    faithfulness: list[float]
    metrics: list[float]
    clean_metric: float
    corrupt_metric: float
    total_edges: int
    cpr: float
    cmd: float
    method: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# -------------------------------------------------------------------------------------------- helpers
def task_of(model: Any, task: Any) -> Task:
    """``task`` as a :class:`Task`: a Task, or ``"ioi"`` (the built-in task, 256 pairs)."""
    if isinstance(task, Task):
        if len(task) == 0:
            raise ValueError("task is empty: give at least one clean/corrupt pair")
        return task
    if task == "ioi":
        return ioi_task(model)
    raise TypeError(f"task must be a headspace.analysis.tasks.Task or 'ioi'; got {task!r:.60}")


def _check_bounds(module: Any, task: Task, batch_size: int, method: str, max_memory: Any) -> None:
    """Refuse, before anything runs, prompts longer than the position table and a pass whose estimated
    peak memory (:func:`.budget.circuit_bytes` of the largest part) is above the limit."""
    check_length(module, task.clean, f"the longest prompt of task {task.name!r}")
    m = shape_of(module)
    parts = _chunks(task, batch_size)
    worst = max(parts, key=lambda part: circuit_bytes(m, len(part), part.clean.shape[1], method))
    rows, seq = len(worst), worst.clean.shape[1]
    what = {"run": "a circuit run"}.get(method, f"{method} edge scores")
    check_memory(
        circuit_bytes(m, rows, seq, method), what,
        f"{rows} pair{'s' * (rows != 1)} of {seq} tokens a pass, {m.n_layers} layers, {m.n_heads} heads, "
        f"d_model {m.d_model}",
        "use fewer pairs a pass (batch_size, --batch-size) or shorter prompts", max_memory, _device(module),
    )  # fmt: skip


def _chunks(task: Task, batch_size: int) -> list[Task]:
    if not is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int; got {batch_size!r}")
    # pairs sorted by length (less padding); a part ends at batch_size pairs, or where the length grows
    # once it holds half of them
    order = torch.argsort(task.lengths, stable=True).tolist()
    lengths = task.lengths.tolist()
    parts: list[list[int]] = [[]]
    for i in order:
        part = parts[-1]
        if len(part) == batch_size or (2 * len(part) >= batch_size and lengths[i] > lengths[part[-1]]):
            parts.append(part := [])
        part.append(i)
    return [task.subset(part) for part in parts]


def _metric(logits: Tensor, task: Task) -> Tensor:
    """Per pair ``logit(answer) - logit(other)`` [n] from last-position logits [n, vocab]."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    return logits[rows, task.answer.to(logits.device)] - logits[rows, task.other.to(logits.device)]


def _device(module: Any) -> torch.device:
    return next(module.parameters()).device


# ---------------------------------------------------------------------------------------- edge scores
def _receiver_grads(module: Any, graph: Graph, x: Tensor, part: Task, weight: float) -> Tensor:
    """dM/dx_v for every receiver at embeddings ``x`` [B, S, d] -> [n_receivers, B, S, d] (M: the weighted
    sum of the pairs' metrics)."""
    last = part.last.to(x.device)
    return graph_grads(module, graph, x, last, lambda logits: _metric(logits, part).sum() * weight).grads


#: Receivers per score product in :func:`_accumulate` (whole layers): enough rows that the product
#: reads each sender's delta a few times per pass instead of once per layer.
_ACCUMULATE_ROWS = 96


def _accumulate(scores: Tensor, graph: Graph, delta: Tensor, grads: Tensor) -> None:
    """scores[u, v] += sum over (b, s, d) of delta[u] grads[v] for every edge (and, inside each block of
    a few layers' receivers, some non-edges, which the caller masks out)."""
    U, R = delta.shape[0], grads.shape[0]
    D = delta.reshape(U, -1)  # (n_senders, B S d)
    G = grads.reshape(R, -1)  # (n_receivers, B S d)
    per, L = graph.per_layer, graph.n_layers
    group = max(1, _ACCUMULATE_ROWS // per)
    for lay in range(0, L, group):
        end = min(L, lay + group)
        cols = slice(lay * per, R if end == L else end * per)  # the last block takes the logits too
        n = U if end == L else graph.attn_senders(end - 1) + graph.n_heads
        scores[:n, cols] += (D[:n] @ G[cols].T).to(scores.dtype)


def edge_scores(
    model: Any, task: Any, method: str = "eap", steps: int = 5, *, batch_size: int = 32,
    max_memory: int | str | None = None,
) -> EdgeScores:  # fmt: skip
    """Every edge's EAP or EAP-IG score on ``task`` (see the module docstring).

    Args:
        model: a loaded pre-norm decoder (``headspace.load("smollm2")``) or a :class:`~headspace.Decoder`.
        task: a :class:`~headspace.analysis.tasks.Task` or ``"ioi"``.
        method: ``"eap"`` or ``"eap-ig"``; steps: EAP-IG's points on the path (ignored by EAP).
        batch_size: at most this many pairs per forward pass (pairs of like lengths together).
        max_memory: the memory limit (bytes or a size such as ``"8G"``; default ``$HEADSPACE_MAX_MEMORY``,
            else the memory available): a pass estimated above it is refused before anything runs
            (:mod:`.budget`), and so is a prompt longer than the position table.

    Returns:
        :class:`EdgeScores`; ``scores`` [n_senders, n_receivers], the metric being the mean over pairs.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}; got {method!r}")
    if not is_int(steps) or steps < 1:
        raise ValueError(f"steps must be a positive int; got {steps!r}")
    module = stack_of(model, "edge_scores")
    graph = graph_of(module)
    task = task_of(model, task)
    _check_bounds(module, task, batch_size, method, max_memory)
    dev = _device(module)
    scores = torch.zeros(len(graph.senders), len(graph.receivers), dtype=torch.float64)
    n_steps = 1 if method == "eap" else steps
    clean_m = corrupt_m = 0.0
    weight = 1.0 / (len(task) * n_steps)
    with eval_mode(module):
        parts = _chunks(task, batch_size)
        # one tick per pair and point of the path, as each backward pass ends (not one per part)
        unit = "pair" if n_steps == 1 else "pair-step"
        bar = progress_bar(total=len(task) * n_steps, desc=f"{method} edge scores", unit=unit)
        for part in parts:
            last = part.last.to(dev)
            with torch.no_grad():
                e_clean, e_corrupt = module.embed(part.clean.to(dev)), module.embed(part.corrupt.to(dev))
                corrupt = run_graph(module, graph, e_corrupt, last, keep_acts=True)
            corrupt_m += float(_metric(corrupt.logits, part).sum()) / len(task)

            def metric(logits: Tensor, part: Task = part) -> Tensor:
                return _metric(logits, part).sum() * weight

            # the last point of the path is the clean run: its activations give the deltas
            clean = graph_grads(module, graph, e_clean, last, metric, keep_acts=True)
            bar.update(len(part))
            clean_m += float(_metric(clean.logits, part).sum()) / len(task)
            delta = corrupt.acts - clean.acts  # (n_senders, B, S, d)
            grads = clean.grads  # (n_receivers, B, S, d), summed over the path's points
            del clean, corrupt
            for k in range(1, n_steps):
                x = e_corrupt + (k / n_steps) * (e_clean - e_corrupt)  # (B, S, d)
                graph_grads(module, graph, x, last, metric, out=grads)
                bar.update(len(part))
            _accumulate(scores, graph, delta, grads)  # linear in the gradient: one product per part
            del grads, delta
        bar.close()
    return EdgeScores(
        scores=torch.where(graph.valid, scores, 0.0), valid=graph.valid, senders=graph.senders,
        receivers=graph.receivers, kinds=graph.kinds, method=method, steps=n_steps, n_pairs=len(task),
        clean_metric=clean_m, corrupt_metric=corrupt_m,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------- circuits
def find_circuit(scores: EdgeScores, edges: int | None = None, *, threshold: float | None = None) -> Circuit:
    """The circuit of the top ``edges`` edges by ``|score|``, or of every edge with ``|score| >= threshold``.

    Give exactly one of ``edges`` (a positive int, at most the number of edges) and ``threshold``.
    """
    if not isinstance(scores, EdgeScores):
        raise TypeError(f"scores must be EdgeScores (from edge_scores); got {type(scores).__name__}")
    if (edges is None) == (threshold is None):
        raise ValueError(
            f"give exactly one of edges= and threshold=; got edges={edges!r}, threshold={threshold!r}"
        )
    n_valid = int(scores.valid.sum())
    mag = torch.where(scores.valid, scores.scores.abs(), -1.0)  # (S, R); -1 marks no edge
    if edges is not None:
        if not is_int(edges) or not 1 <= edges <= n_valid:
            raise ValueError(f"edges must be an int in [1, {n_valid}] (the graph's edges); got {edges!r}")
        order = mag.flatten().argsort(descending=True)[:edges]
        mask = torch.zeros(mag.numel(), dtype=torch.bool)
        mask[order] = True
        mask = mask.view_as(mag)
    else:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold >= 0:
            raise ValueError(f"threshold must be a number >= 0 (an |edge score|); got {threshold!r}")
        mask = scores.valid & (mag >= threshold)
    R = mag.shape[1]
    by_size = mag.flatten().argsort(descending=True)
    idx = by_size[mask.flatten()[by_size]].tolist()  # the circuit's edges, largest |score| first
    values = scores.scores.flatten()[idx].tolist()
    listed = [(scores.senders[i // R], scores.receivers[i % R], v) for i, v in zip(idx, values)]
    return Circuit(
        edges=mask, senders=scores.senders, receivers=scores.receivers, kinds=scores.kinds, listed=listed
    )


def _rows_metric(module: Any, rows: Tensor, task: Task) -> Tensor:
    """:func:`_metric` from the final norm's output rows [n, d_model]: only the answer's and the other
    token's columns of the unembedding."""
    W_U = module.W_U  # (d_model, vocab)
    answer = (rows * W_U[:, task.answer.to(rows.device)].T).sum(-1)  # (n,)
    other = (rows * W_U[:, task.other.to(rows.device)].T).sum(-1)  # (n,)
    return answer - other


@torch.no_grad()
def _circuit_metrics(
    module: Any, graph: Graph, task: Task, masks: Sequence[Tensor], batch_size: int
) -> list[float]:
    """Mean metric over pairs of the graph run with each edge mask (True = in the circuit), batched.

    The empty circuit is the corrupt run itself (every receiver reads the corrupt stream), the full one
    the clean run (nothing patched); every other circuit is one patched run from the clean embeddings,
    its plan (which heads and MLPs it computes, which edges each receiver block adds or takes away) made
    once for all batches. The metric reads only the answer's and the other token's logits."""
    dev = _device(module)
    totals = [0.0] * len(masks)
    missing = [graph.valid & ~mask.cpu() for mask in masks]  # (n_senders, n_receivers) each
    ends = ["clean" if not m.any() else "corrupt" if bool(m.equal(graph.valid)) else None for m in missing]
    plans: list[Any] = [None] * len(masks)
    with eval_mode(module):
        parts = _chunks(task, batch_size)
        # one tick per pair and circuit as each batch of patched runs ends (not one per part)
        bar = progress_bar(total=len(task) * len(masks), desc="circuit runs", unit="run")
        for part in parts:
            last = part.last.to(dev)
            e_corrupt = module.embed(part.corrupt.to(dev))
            corrupt = run_rows(module, graph, e_corrupt, last, keep_acts=True)
            e_clean = module.embed(part.clean.to(dev))
            clean = None
            for i, miss in enumerate(missing):
                if ends[i] == "clean":
                    if clean is None:
                        clean = run_rows(module, graph, e_clean, last).rows
                    rows = clean
                elif ends[i] == "corrupt":
                    rows = corrupt.rows
                else:
                    if plans[i] is None:
                        plans[i] = plan_run(
                            module, graph, miss, resids=True, prune=True, full=False, dtype=e_clean.dtype,
                            device=e_clean.device,
                        )  # fmt: skip
                    rows = run_rows(
                        module, graph, e_clean, last, corrupt=corrupt, missing=miss, plan=plans[i]
                    ).rows
                totals[i] += float(_rows_metric(module, rows, part).sum()) / len(task)
                bar.update(len(part))
        bar.close()
    return totals


def _mask_of(circuit: Any, graph: Graph) -> Tensor:
    if isinstance(circuit, Circuit):
        mask = circuit.edges
    elif isinstance(circuit, Tensor) and circuit.dtype == torch.bool:
        mask = circuit
    else:
        raise TypeError(
            f"circuit must be a Circuit (from find_circuit) or a bool edge mask; got {type(circuit).__name__}"
        )
    if tuple(mask.shape) != tuple(graph.valid.shape):
        raise ValueError(
            f"circuit's edge mask must be [n_senders, n_receivers] = {list(graph.valid.shape)}; "
            f"got {list(mask.shape)}"
        )
    return mask.cpu() & graph.valid


def faithfulness(
    model: Any, task: Any, circuit: Any, *, batch_size: int = 32, max_memory: int | str | None = None
) -> Faithfulness:
    """The faithfulness of ``circuit`` on ``task`` by running it (see the module docstring;
    ``max_memory`` as for :func:`edge_scores`)."""
    module = stack_of(model, "faithfulness")
    graph = graph_of(module)
    task = task_of(model, task)
    mask = _mask_of(circuit, graph)
    _check_bounds(module, task, batch_size, "run", max_memory)
    full, empty = graph.valid, torch.zeros_like(graph.valid)
    m, clean_m, corrupt_m = _circuit_metrics(module, graph, task, [mask, full, empty], batch_size)
    return Faithfulness(_normalised(m, clean_m, corrupt_m), m, clean_m, corrupt_m, int(mask.sum()))


def _normalised(m: float, clean_m: float, corrupt_m: float) -> float:
    if clean_m == corrupt_m:
        raise ValueError(
            f"the metric is the same on the clean and corrupt prompts ({clean_m:.6g}): faithfulness is "
            "undefined; "
            "choose a corrupt prompt that changes the answer"
        )
    return (m - corrupt_m) / (clean_m - corrupt_m)


def _trapezoid(x: Sequence[float], y: Sequence[float]) -> float:
    return float(sum((x[i + 1] - x[i]) * (y[i + 1] + y[i]) / 2 for i in range(len(x) - 1)))


def faithfulness_curve(
    model: Any,
    task: Any,
    scores: EdgeScores,
    fractions: Sequence[float] = MIB_FRACTIONS,
    *,
    batch_size: int = 32,
    max_memory: int | str | None = None,
) -> FaithfulnessCurve:
    """Faithfulness of the top-k circuits, ``k = max(1, round(fraction * n_edges))``, and MIB's CPR / CMD.

    The areas are trapezoids over the fractions (sorted; 0 and 1 must be among them or are added: the
    empty circuit has f = 0, the full one f = 1, exactly). ``max_memory`` as for :func:`edge_scores`.
    """
    return _curve(model, task, scores, fractions, batch_size, max_memory, None)[0]


def curve_and_faithfulness(
    model: Any,
    task: Any,
    scores: EdgeScores,
    circuit: Any,
    fractions: Sequence[float] = MIB_FRACTIONS,
    *,
    batch_size: int = 32,
    max_memory: int | str | None = None,
) -> tuple[FaithfulnessCurve, Faithfulness]:
    """:func:`faithfulness_curve` and :func:`faithfulness` of ``circuit``, equal to the two calls, from one
    batched pass: the circuit's run is one more mask beside the curve's, whose empty and full circuits
    (the corrupt and clean runs) give the metrics :func:`faithfulness` normalises by, so the corrupt and
    clean forwards of each batch run once for both (``headspace circuit`` needs both)."""
    curve, faith = _curve(model, task, scores, fractions, batch_size, max_memory, circuit)
    return curve, cast(Faithfulness, faith)  # not None: a circuit was given


def _curve(
    model: Any, task: Any, scores: EdgeScores, fractions: Sequence[float], batch_size: int,
    max_memory: int | str | None, circuit: Any,
) -> tuple[FaithfulnessCurve, Faithfulness | None]:  # fmt: skip
    """The curve of :func:`faithfulness_curve`, and with ``circuit`` (not None) its faithfulness from the
    same :func:`_circuit_metrics` pass (its mask last)."""
    module = stack_of(model, "faithfulness_curve")
    graph = graph_of(module)
    task = task_of(model, task)
    fr = sorted({float(f) for f in fractions} | {0.0, 1.0})
    if any(not 0.0 <= f <= 1.0 for f in fr):
        raise ValueError(f"fractions must lie in [0, 1]; got {list(fractions)}")
    total = graph.n_edges
    counts = [0 if f == 0 else max(1, round(f * total)) for f in fr]
    if not isinstance(scores, EdgeScores):
        raise TypeError(f"scores must be EdgeScores (from edge_scores); got {type(scores).__name__}")
    if tuple(scores.valid.shape) != tuple(graph.valid.shape):
        raise ValueError(
            f"scores are for a graph of {list(scores.valid.shape)} senders x receivers; this model's is "
            f"{list(graph.valid.shape)}"
        )
    _check_bounds(module, task, batch_size, "run", max_memory)
    # find_circuit's top-k edges for every k from one sort (the same order as each of its calls)
    order = torch.where(scores.valid, scores.scores.abs(), -1.0).flatten().argsort(descending=True)
    masks = []
    for k in counts:
        mask = torch.zeros(graph.valid.numel(), dtype=torch.bool)
        mask[order[:k]] = True
        masks.append(mask.view_as(graph.valid))
    mask = None if circuit is None else _mask_of(circuit, graph)
    metrics = _circuit_metrics(module, graph, task, masks + ([] if mask is None else [mask]), batch_size)
    if mask is not None:
        m_circuit = metrics.pop()  # the circuit's own run; metrics: the curve's again
    clean_m, corrupt_m = metrics[-1], metrics[0]  # k = total and k = 0
    f = [_normalised(m, clean_m, corrupt_m) for m in metrics]
    curve = FaithfulnessCurve(
        fractions=fr, n_edges=counts, faithfulness=f, metrics=metrics, clean_metric=clean_m,
        corrupt_metric=corrupt_m, total_edges=total, cpr=_trapezoid(fr, f),
        cmd=_trapezoid(fr, [abs(1 - v) for v in f]), method=scores.method,
    )  # fmt: skip
    if mask is None:
        return curve, None
    faith = _normalised(m_circuit, clean_m, corrupt_m)
    return curve, Faithfulness(faith, m_circuit, clean_m, corrupt_m, int(mask.sum()))
