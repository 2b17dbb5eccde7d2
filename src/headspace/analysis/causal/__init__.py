"""Causal analysis: what a head or an MLP causes, measured by running the model with it changed.

* :mod:`.patching`: activation patching, attribution patching and path patching (:func:`patch`,
  :func:`attribution_patching`, :func:`path_patch`).
* AtP* (:func:`~headspace.analysis.circuits.atp_star.atp_star`) estimates what patching measures; it lives
  with the circuits, whose graph and tasks it runs on.
* :mod:`.encdec_patching`: patching an encoder-decoder's cross-attention heads between clean and
  corrupt sources (:func:`~.encdec_patching.patch_cross_heads`).
* :mod:`.attribution`: direct logit attribution and the logit lens; :mod:`.expert_attribution`: the same per
  expert of a mixture-of-experts MLP (:func:`expert_attribution`).
* :mod:`.ablation`: head importance, the change of a metric when each head is ablated.
* :mod:`.engine`: the batched patching engine (runs from a layer on, many patched copies at once),
  which patching and head importance share.
* :mod:`.losses`: the language-model loss per position in float64, without a float64 copy of the
  logits (or the logits).
* :mod:`.interventions`: :func:`ablate` (while a block runs) and :func:`prune_heads` (for good).
* :mod:`.causal_inputs`: prompts to tokens, answer tokens, the final norm frozen, the unembedding.
* :mod:`.budget`: prompts inside the position table, and a run's peak memory estimated before it runs.
* :mod:`.targets`: the fields of every positional-target result (mass on five targets, entropy).
"""

from .ablation import HeadImportance, head_importance, mean_z
from .attribution import LogitAttribution, LogitLens, direct_logit_attribution, logit_lens
from .budget import MemoryBudgetError, parse_memory
from .expert_attribution import ExpertAttribution, expert_attribution
from .interventions import ABLATION_MODES, ablate, prune_heads
from .patching import EFFECT_KEYS, PatchResult, attribution_patching, patch, patch_activations, path_patch
from .targets import TargetMasses

__all__ = [
    "ABLATION_MODES",
    "EFFECT_KEYS",
    "ExpertAttribution",
    "HeadImportance",
    "LogitAttribution",
    "LogitLens",
    "MemoryBudgetError",
    "PatchResult",
    "TargetMasses",
    "ablate",
    "attribution_patching",
    "direct_logit_attribution",
    "expert_attribution",
    "head_importance",
    "logit_lens",
    "mean_z",
    "parse_memory",
    "patch",
    "patch_activations",
    "path_patch",
    "prune_heads",
]
