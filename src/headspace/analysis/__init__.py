"""Head analysis: roles, importance, weight-space circuits and subspaces, and how W_O mixes the heads.

Every result is a dataclass of plain tensors with documented shapes and a ``to_dict()``/``to_json()``
form; layer ``i`` is the ``i``-th attention layer (``blocks.i.attn``).

* :func:`head_roles` (:mod:`.roles`): mean attention mass on the previous / next / current / first /
  last token, pattern entropy and a role label per head, over inputs (long inputs chunk by chunk);
  :func:`induction_scores`: each head's attention to the token after an earlier occurrence.
* :func:`pattern_rows`, :func:`summaries`, :func:`each_layer_qk` (:mod:`.chunked`): pattern rows and
  per-query statistics from q and k, a block of queries at a time (no [seq, seq] pattern).
* :func:`head_importance` (:mod:`.ablation`): change of a metric (sentence-embedding cosine for
  encoders, LM loss for decoders) when each head is ablated.
* :func:`qk_circuit`, :func:`ov_circuit`, :func:`circuit_spectra`, :func:`principal_angles`,
  :func:`head_angles`, :func:`subspace_overlaps` (:mod:`.subspaces`): no inputs needed.
* :func:`head_mixing`, :func:`wo_norms` (:mod:`.mixing`): each head's share of the attention output.
* :func:`atlas` (:mod:`.atlas`, with :mod:`.corpus`, :mod:`.atlas_state`, :mod:`.atlas_measure`,
  :mod:`.atlas_ablation`): every head's statistics over a whole corpus (previous/first/self/entropy,
  duplicate, induction, copying, direct effect, mean-ablation loss change, top examples), streamed,
  resumable from sealed shards, sharded over torch.distributed ranks.
* :func:`rotary_planes`, :func:`plane_scores` (:mod:`.rotary`): each rotary head's score split by RoPE
  frequency plane; which heads attend by content (slow planes) and which by position (fast planes).
* :func:`score_decomposition`, :func:`composition_scores` (:mod:`.decomposition`): one head's score split
  exactly over (query-side part) x (key-side part); Q/K/V composition of every head pair.
* :func:`atp_star` (:mod:`.atp_star`, with :func:`exact_effects` and :func:`atp_star_diagnostic`): AtP*,
  attribution patching with the QK fix and GradDrop, of every head, head and position, MLP, query or key
  over a task's pairs, held to exact patching, and a bound on its false negatives.
* :mod:`.circuits` (``edge_scores``, ``find_circuit``, ``faithfulness``, ``faithfulness_curve``) over the
  head/MLP graph of :mod:`.graph`, on tasks of :mod:`.tasks` (``ioi_task``, ``load_task``).
"""

from . import circuits
from .ablation import HeadImportance, head_importance, mean_z
from .atlas import Atlas, atlas
from .atp_star import AtPStarResult, Diagnostic, atp_star, atp_star_diagnostic, exact_effects
from .chunked import LayerQK, PatternSummary, each_layer_qk, pattern_rows, summaries
from .decomposition import CompositionScores, ScoreDecomposition, composition_scores, score_decomposition
from .mixing import HeadMixing, head_mixing, shares_from_result, wo_norms
from .roles import TARGETS, HeadRoles, head_roles, induction_scores, repeated_tokens, roles_from_patterns
from .rotary import RotaryPlanes, plane_scores, rotary_planes
from .subspaces import (
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
