"""The lesson: what each head does, read from a real model (roles, subspaces, one token's journey).

* :mod:`.explain`: :func:`explain`, one token's journey through one head, in words and numbers.
* :mod:`.delta_walk`: the same journey through a Gated DeltaNet head (Qwen3-Next, Qwen3.5), by the
  delta rule's exact effective weights ``o_t = sum_j w_tj v_j``.
* :mod:`.cross`: the same journey through one cross-attention head of an encoder-decoder
  (:func:`~.cross.explain_encdec`; a T5 head's bucket bias as its own step).
* :mod:`.alignment`: which cross-attention heads align text with audio (:func:`~.alignment.alignment_heads`,
  by dynamic time warping) and the word timings they give (:func:`~.alignment.word_timings`).
* :mod:`.dtw`: the dynamic time warping under it, a batch of cost matrices one anti-diagonal at a
  time (the scalar loop's paths, identical).
* :mod:`.content_tokens`: the words a relational head can send a token to (explain's head choice).
* :mod:`.roles`: head roles (mass on previous / next / current / first / last token, entropy, a label)
  and induction scores.
* :mod:`.chunked`: pattern rows and per-query statistics from q and k, a block of queries at a time.
* :mod:`.pattern_blocks`: the machinery under it: the pattern's softmax, one block of query rows at a
  time.
* :mod:`.subspaces`: weight-space circuits (QK, OV), their spectra and the heads' subspaces; no inputs.
* :mod:`.rotary`: each rotary head's score split by RoPE frequency plane.
* :mod:`.mixing`: each head's share of the attention output (how W_O weighs the heads).
* :mod:`.expert_step`: the walked token's mixture of experts at the walked block (router logits, the
  chosen experts and their weights, each one's output), the lesson's step after the attention.
"""

from .chunked import LayerQK, PatternSummary, each_layer_qk, pattern_rows, summaries
from .explain import Explanation, explain
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
    "CircuitSpectra",
    "Explanation",
    "HeadMixing",
    "HeadRoles",
    "LayerQK",
    "PatternSummary",
    "RotaryPlanes",
    "SubspaceOverlaps",
    "circuit_spectra",
    "each_layer_qk",
    "explain",
    "head_angles",
    "head_mixing",
    "head_roles",
    "head_subspaces",
    "induction_scores",
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
    "shares_from_result",
    "subspace_overlap",
    "subspace_overlaps",
    "summaries",
    "wo_norms",
]
