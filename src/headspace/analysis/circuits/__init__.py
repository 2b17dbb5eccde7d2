"""Circuits: the head/MLP graph of a pre-norm decoder, its edges scored and kept; weight-space composition.

* :mod:`.edges`: :func:`edge_scores` (EAP, EAP-IG), :func:`find_circuit` (the top edges),
  :func:`faithfulness` and :func:`faithfulness_curve`.
* :mod:`.graph`: one batched run of the graph with edges masked (:func:`run_graph`) and its gradients
  (:func:`graph_grads`), over:
  * :mod:`.nodes`: the graph itself, heads and MLPs as nodes (:class:`Graph`, :func:`graph_of`);
  * :mod:`.head_maths`: the attention maths of all or some of a layer's heads (projection, mixing);
  * :mod:`.plan`: what a patched run computes, from the edge masks alone (:func:`~.plan.plan_run`);
  * :mod:`.patched`: the patched run itself (:func:`~.patched.patched_run`).
* :mod:`.atp_star`: AtP* over a task's pairs (heads, positions, MLPs, queries, keys), held to exact
  patching (:func:`atp_star`, :func:`exact_effects`, :func:`atp_star_diagnostic`); :mod:`.atp_edges`: AtP
  over the graph's edges.
* :mod:`.tasks`: clean/corrupt prompt pairs as token ids (:func:`ioi_task`, :func:`load_task`,
  :func:`make_task`).
* :mod:`.decomposition`: one head's score split over (query part) x (key part), and Q/K/V composition
  of every head pair (:func:`score_decomposition`, :func:`composition_scores`).

``headspace.analysis.circuits`` was the module :mod:`.edges` before it became this package: it re-exports
that module's public names. (Not :mod:`headspace.attention.circuits`, the QK/OV FactoredMatrix module.)
"""

from .atp_star import AtPStarResult, Diagnostic, atp_star, atp_star_diagnostic, exact_effects
from .decomposition import CompositionScores, ScoreDecomposition, composition_scores, score_decomposition
from .edges import (
    METHODS,
    MIB_FRACTIONS,
    Circuit,
    EdgeScores,
    Faithfulness,
    FaithfulnessCurve,
    curve_and_faithfulness,
    edge_scores,
    faithfulness,
    faithfulness_curve,
    find_circuit,
    task_of,
)
from .graph import Graph, graph_grads, graph_of, run_graph
from .tasks import Task, ioi_task, load_task, make_task

__all__ = [
    "METHODS",
    "MIB_FRACTIONS",
    "AtPStarResult",
    "Circuit",
    "CompositionScores",
    "Diagnostic",
    "EdgeScores",
    "Faithfulness",
    "FaithfulnessCurve",
    "Graph",
    "ScoreDecomposition",
    "Task",
    "atp_star",
    "atp_star_diagnostic",
    "composition_scores",
    "curve_and_faithfulness",
    "edge_scores",
    "exact_effects",
    "faithfulness",
    "faithfulness_curve",
    "find_circuit",
    "graph_grads",
    "graph_of",
    "ioi_task",
    "load_task",
    "make_task",
    "run_graph",
    "score_decomposition",
    "task_of",
]
