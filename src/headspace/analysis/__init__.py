"""Head analysis: roles, importance, weight-space circuits and subspaces, and how W_O mixes the heads.

Every result is a dataclass of plain tensors with documented shapes and a ``to_dict()``/``to_json()``
form; layer ``i`` is the ``i``-th attention layer (``blocks.i.attn``).

The rooms, one subpackage per product, each with its map in its ``__init__``:

* :mod:`.lesson`: what each head does, read from a real model: :func:`head_roles` and
  :func:`induction_scores` (:mod:`.lesson.roles`); :func:`pattern_rows`, :func:`summaries`,
  :func:`each_layer_qk` (:mod:`.lesson.chunked`, a block of queries at a time, no [seq, seq] pattern);
  :func:`qk_circuit`, :func:`ov_circuit`, :func:`circuit_spectra`, :func:`principal_angles`,
  :func:`head_angles`, :func:`subspace_overlaps` (:mod:`.lesson.subspaces`, no inputs needed);
  :func:`rotary_planes`, :func:`plane_scores` (:mod:`.lesson.rotary`); :func:`head_mixing`,
  :func:`wo_norms` (:mod:`.lesson.mixing`); ``explain`` (:mod:`.lesson.explain`).
* :mod:`.causal`: what a head or an MLP causes: patching (:mod:`.causal.patching`), :func:`atp_star`
  with :func:`exact_effects` and :func:`atp_star_diagnostic` (:mod:`.circuits.atp_star`), direct logit
  attribution (:mod:`.causal.attribution`), :func:`head_importance` (:mod:`.causal.ablation`), ``ablate``
  and ``prune_heads`` (:mod:`.causal.interventions`), and the memory bounds (:mod:`.causal.budget`).
* :mod:`.circuits`: ``edge_scores``, ``find_circuit``, ``faithfulness``, ``faithfulness_curve``
  (:mod:`.circuits.edges`) over the head/MLP graph of :mod:`.circuits.graph`, on tasks of
  :mod:`.circuits.tasks`; :func:`score_decomposition`, :func:`composition_scores`
  (:mod:`.circuits.decomposition`).
* :mod:`.atlas`: :func:`atlas`, every head's statistics over a whole corpus, streamed, resumable from
  sealed shards, sharded over torch.distributed ranks.
* :mod:`.trace`: ``trace`` and ``hooked``, the hook points a model names, recorded or replaced.

:mod:`._common` holds the helpers every room shares (results as JSON and HTML, batches, eval mode).
The modules' old flat paths (``headspace.analysis.graph``, ``headspace.analysis.patching`` ...) are the
modules in the rooms themselves (``headspace._MOVED``); ``headspace.analysis.atlas``, ``.circuits`` and
``.trace`` are now the rooms, which re-export their old modules' public names.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import circuits
from .atlas.run import Atlas, atlas
from .causal.ablation import HeadImportance, head_importance, mean_z
from .circuits.atp_star import AtPStarResult, Diagnostic, atp_star_diagnostic, exact_effects
from .circuits.decomposition import (
    CompositionScores,
    ScoreDecomposition,
    composition_scores,
    score_decomposition,
)
from .lesson.chunked import LayerQK, PatternSummary, each_layer_qk, pattern_rows, summaries
from .lesson.mixing import HeadMixing, head_mixing, shares_from_result, wo_norms
from .lesson.roles import (
    TARGETS,
    HeadRoles,
    head_roles,
    induction_scores,
    repeated_tokens,
    roles_from_patterns,
)
from .lesson.rotary import RotaryPlanes, plane_scores, rotary_planes
from .lesson.subspaces import (
    SUBSPACES,
    CircuitSpectra,
    SubspaceOverlaps,
    circuit_spectra,
    head_angles,
    head_subspaces,
    orthonormal_basis,
    ov_circuit,
    overlap_matrix,
    principal_angles,
    qk_circuit,
    random_overlap,
    subspace_overlap,
    subspace_overlaps,
)

__all__ = [
    "SUBSPACES",
    "TARGETS",
    "AtPStarResult",
    "Atlas",
    "CircuitSpectra",
    "CompositionScores",
    "Diagnostic",
    "HeadImportance",
    "HeadMixing",
    "HeadRoles",
    "LayerQK",
    "PatternSummary",
    "RotaryPlanes",
    "ScoreDecomposition",
    "SubspaceOverlaps",
    "atlas",
    "atp_star",
    "atp_star_diagnostic",
    "circuit_spectra",
    "circuits",
    "composition_scores",
    "each_layer_qk",
    "exact_effects",
    "head_angles",
    "head_importance",
    "head_mixing",
    "head_roles",
    "head_subspaces",
    "induction_scores",
    "mean_z",
    "orthonormal_basis",
    "ov_circuit",
    "overlap_matrix",
    "pattern_rows",
    "plane_scores",
    "principal_angles",
    "qk_circuit",
    "random_overlap",
    "repeated_tokens",
    "roles_from_patterns",
    "rotary_planes",
    "score_decomposition",
    "shares_from_result",
    "subspace_overlap",
    "subspace_overlaps",
    "summaries",
    "wo_norms",
]


# ``headspace.analysis.atp_star`` is the function (as before the rooms) and the old module path: load that
# path now, while the attribute may be rebound, so that a later ``import headspace.analysis.atp_star``
# finds it loaded and leaves the function in place
atp_star = importlib.import_module(f"{__name__}.atp_star").atp_star


def __getattr__(name: str) -> Any:
    """``headspace.analysis.roles`` and every other old flat module name: the module in its room (loaded
    through ``headspace._MOVED`` on first use, as ``import headspace.analysis.roles`` would)."""
    if not name.startswith("__"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise  # the module exists but something it imports does not
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
