"""Direct logit attribution per expert of a mixture-of-experts MLP (issue #39).

:func:`~.attribution.direct_logit_attribution` gives each layer's MLP one part ``m_l``. In a mixture of
experts ``m_l = sum_e w_e y_e + s_l`` (:mod:`headspace.model.moe`): each expert's weighted output
``w_e y_e`` (``hook_expert_out``, zero for an expert the token did not take) and the shared expert's
``s_l`` (``hook_shared_out``). With the final norm's scale frozen from the run, exactly as for the layer
parts, expert ``e`` of layer ``l`` contributes ``(c(w_e y_e) w / sigma) . u`` and the experts with the
shared term add up to the layer's MLP part, so to the model's logit with the other parts.

That split holds where the MLP's output joins the residual stream as it is (the ``pre`` and
``parallel`` layouts). A norm after the MLP (a sandwich block's ``ln_mlp_out``; Gemma 4's MoE, whose
experts sit between their own norms) rescales the sum as a whole; such a layer is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from ...model.moe import MixtureOfExperts
from .._common import JsonResult, eval_mode
from ..trace.trace import trace
from .attribution import _decoder
from .causal_inputs import (
    centered,
    check_distinct_answers,
    frozen_norm,
    gather_last,
    last_resid,
    prompts_of,
    token_id,
    token_str,
)

__all__ = ["ExpertAttribution", "expert_attribution"]

#: The layouts whose MLP output joins the residual stream unnormed (the split is exact there).
SPLIT_LAYOUTS = ("pre", "parallel")


@dataclass
class ExpertAttribution(JsonResult):
    """Each expert's direct contribution to the logit of ``answer`` (minus ``other``), mean over prompts.

    * ``layers``: the blocks with a mixture of experts, in order;
    * ``experts`` [len(layers), n_experts]: expert ``e`` of ``layers[i]`` (0 where no prompt took it);
    * ``shared`` [len(layers)]: the shared expert's part (0 without one);
    * ``mlps`` [len(layers)]: the layer's whole MLP part, ``experts[i].sum() + shared[i]`` (the same
      number as :func:`~.attribution.direct_logit_attribution`'s ``mlps`` at that layer);
    * ``chosen`` [len(layers), n_experts]: how many prompts' last positions took each expert;
    * ``per_prompt``: the same tensors per prompt (``experts`` [P, layers, E], ``shared`` [P, layers]).
    """

    kind: ClassVar[str] = "expert_attribution"
    layers: list[int]
    experts: Tensor
    shared: Tensor
    mlps: Tensor
    chosen: Tensor
    answer: int
    other: int | None
    answer_token: str
    other_token: str | None
    per_prompt: dict[str, Tensor] = field(default_factory=dict, repr=False)

    def top(self, k: int = 10) -> list[tuple[int, int, float]]:
        """The ``k`` experts of largest ``|contribution|``: ``(layer, expert, contribution)``."""
        flat = self.experts.flatten()  # (layers * E,)
        order = flat.abs().argsort(descending=True)[:k].tolist()
        n = self.experts.shape[1]
        return [(self.layers[i // n], i % n, float(flat[i])) for i in order]


def _moe_layers(module: Any) -> list[int]:
    layers = [i for i, block in enumerate(module.blocks) if isinstance(block.mlp, MixtureOfExperts)]
    if not layers:
        raise ValueError(
            "expert_attribution needs a mixture-of-experts MLP (MLPSpec kind 'moe'); this model has none"
        )
    for i in layers:
        layout = module.blocks[i].spec.layout
        if layout not in SPLIT_LAYOUTS or getattr(module.blocks[i], "ln_mlp_out", None) is not None:
            raise ValueError(
                f"expert_attribution does not support the block field 'layout' ({layout!r}, block {i}): "
                "a norm after the MLP rescales the experts' sum as a whole: no expert has a fixed direct path"
            )
    return layers


@torch.no_grad()
def expert_attribution(model: Any, prompts: Any, answer: Any, other: Any = None) -> ExpertAttribution:
    """Direct logit attribution of ``answer`` (minus ``other``) per expert, at each prompt's last position.

    Args: as :func:`~.attribution.direct_logit_attribution` (``model`` a loaded decoder with a mixture of
    experts; ``prompts`` a string, strings or ids [batch, seq]; ``answer`` / ``other`` tokens or ids).

    Returns:
        :class:`ExpertAttribution`; per layer, ``experts.sum() + shared == mlps`` up to float rounding.

    Raises:
        ValueError: no mixture of experts; a layer whose MLP output is normed before the residual add.
    """
    module = _decoder(model, "expert_attribution")
    layers = _moe_layers(module)
    p = prompts_of(model, prompts)
    a = token_id(model, answer, "answer")
    b = None if other is None else token_id(model, other, "other")
    check_distinct_answers(model, a, b)
    last = last_resid(module)
    names = [last]
    for i in layers:
        names += [f"blocks.{i}.mlp.hook_expert_out", f"blocks.{i}.hook_mlp_out", f"blocks.{i}.mlp.hook_top_k"]
        if module.blocks[i].mlp.shared is not None:
            names.append(f"blocks.{i}.mlp.hook_shared_out")
    with eval_mode(module), trace(module, names=names) as t:
        module(p.tokens, p.key_padding)
    W_U = module.W_U.detach()  # (d_model, vocab)
    u = W_U[:, a] if b is None else W_U[:, a] - W_U[:, b]  # (d_model,)
    scale, _ = frozen_norm(module.ln_final, gather_last(t[last], p.last))  # (P, d_model)
    norm = module.ln_final

    def contrib(part: Tensor) -> Tensor:  # part (P, ..., d_model) -> (P, ...)
        s = scale.view(scale.shape[0], *([1] * (part.dim() - 2)), scale.shape[-1])
        return (centered(norm, part) * s) @ u

    experts, shared, mlps, chosen = [], [], [], []
    for i in layers:
        per_expert = gather_last(t[f"blocks.{i}.mlp.hook_expert_out"], p.last)  # (P, E, d_model)
        experts.append(contrib(per_expert))  # (P, E)
        key = f"blocks.{i}.mlp.hook_shared_out"
        shared.append(contrib(gather_last(t[key], p.last)) if key in t else torch.zeros(p.last.shape[0]))
        mlps.append(contrib(gather_last(t[f"blocks.{i}.hook_mlp_out"], p.last)))  # (P,)
        top = gather_last(t[f"blocks.{i}.mlp.hook_top_k"], p.last)  # (P, k)
        counts = torch.zeros(per_expert.shape[1], dtype=torch.long)
        chosen.append(counts.index_add_(0, top.flatten().cpu(), torch.ones(top.numel(), dtype=torch.long)))
    ex, sh, ml = torch.stack(experts, 1), torch.stack(shared, 1), torch.stack(mlps, 1)  # (P, L', E|-)
    return ExpertAttribution(
        layers=layers, experts=ex.mean(0), shared=sh.mean(0), mlps=ml.mean(0), chosen=torch.stack(chosen),
        answer=a, other=b, answer_token=token_str(model, a),
        other_token=None if b is None else token_str(model, b),
        per_prompt={"experts": ex, "shared": sh, "mlps": ml},
    )  # fmt: skip
