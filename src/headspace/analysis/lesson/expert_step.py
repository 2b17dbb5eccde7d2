r"""The lesson's step for a mixture of experts: what the walked token's block does after its attention.

A block whose MLP is a :class:`~headspace.model.moe.MixtureOfExperts` (Mixtral, Qwen2/3-MoE, OLMoE,
DeepSeek, gpt-oss, Llama 4, Qwen3-Next, Gemma 4's MoE blocks) sends each token to ``k`` of its ``E``
experts. For the explained token ``i`` at the explained block, :func:`expert_step` runs the sentence once
more under :func:`headspace.trace` of that module's hook points and shows, from the module's own values:

* the router's logits ``r = x W_R (+ b_R)`` (``hook_router_logits``), the largest first;
* the chosen experts (``hook_top_k``, as the module chose them, ties as transformers breaks them) and
  their weights ``w_e`` (``hook_routing``: 0 for the others);
* each chosen expert's weighted output ``w_e y_e`` (``hook_expert_out``) by its norm, and the shared
  expert's (``hook_shared_out``) where the block has one;
* two checks, printed as maximum absolute differences: each chosen expert recomputed from the module's
  input and weights (``MixtureOfExperts.expert``) times its weight against ``hook_expert_out``, and
  ``sum_e w_e y_e + shared`` against the module's own output on that token.

The module's input ``x`` is read through the hook machinery's :func:`~headspace.nn.hooks.on_call`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ...model.moe import MixtureOfExperts
from ...nn.hooks import on_call
from .scheme_steps import SchemeStep

__all__ = ["expert_step", "moe_of_block"]


def moe_of_block(block: nn.Module) -> tuple[str, MixtureOfExperts] | None:
    """(its path within ``block``, the module) of the block's mixture of experts, or None."""
    for name, module in block.named_modules():
        if isinstance(module, MixtureOfExperts):
            return name, module
    return None


def _gap(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


@torch.no_grad()
def expert_step(
    model: nn.Module, block: int, ids: Tensor, key_padding: Tensor | None, index: int
) -> SchemeStep | None:
    """The ``"experts"`` step of token ``index`` at block ``block`` of ``model`` (module docstring), or
    None where that block has no mixture of experts. ``ids`` [1, seq] (and its ``key_padding``) is the
    explained sentence."""
    from ..trace.trace import trace

    found = moe_of_block(model.blocks[block])  # type: ignore[index]
    if found is None:
        return None
    name, moe = found
    path = f"blocks.{block}.{name}" if name else f"blocks.{block}"
    inputs: list[Tensor] = []
    remove = on_call(moe, lambda _m, args, _kw: inputs.append(args[0].detach().clone()))
    names = [f"{path}.hook_{n}" for n in ("router_logits", "top_k", "routing", "expert_out", "shared_out")]
    try:
        with trace(model, names=names) as t:
            model(ids) if key_padding is None else model(ids, key_padding)
    finally:
        remove()
    x = inputs[0][0, index]  # (d_model,)
    logits = t[f"{path}.hook_router_logits"][0, index].float()  # (E,)
    chosen = [int(e) for e in t[f"{path}.hook_top_k"][0, index]]  # best first
    weights = t[f"{path}.hook_routing"][0, index].float()  # (E,)
    outs = t[f"{path}.hook_expert_out"][0, index]  # (E, d_model): w_e y_e
    shared = t[f"{path}.hook_shared_out"][0, index] if moe.shared is not None else None  # (d_model,)
    recomputed = torch.stack([_weighted(moe, e, x, weights[e]) for e in chosen])  # (k, d_model)
    own = moe(x.view(1, 1, -1))[0, 0]  # (d_model,): the module's output on this token alone
    total = outs.sum(0) + (0 if shared is None else shared)  # (d_model,)
    numbers: dict[str, Any] = {
        "block": block, "n_experts": moe.n_experts, "top_k": moe.top_k, "routing": moe.routing,
        "router_logits": [float(v) for v in logits], "chosen": chosen,
        "weights": [float(weights[e]) for e in chosen],
        "expert_out_norms": [float(outs[e].norm()) for e in chosen],
        "shared_out_norm": None if shared is None else float(shared.norm()),
        "max_expert_gap": _gap(recomputed, outs[chosen]), "max_sum_gap": _gap(total, own),
    }  # fmt: skip
    order = logits.argsort(descending=True)[: max(moe.top_k + 2, 4)].tolist()
    lines = [
        f"block {block}'s MLP is a mixture of {moe.n_experts} experts ({moe.routing}, top {moe.top_k}):",
        "router logits r = x W_R, the largest: " + ", ".join(f"e{e} {float(logits[e]):.3f}" for e in order),
    ]
    lines += [
        f"expert {e}: weight {float(weights[e]):.4f}, |w_e y_e| = {float(outs[e].norm()):.4f}" for e in chosen
    ]
    if shared is not None:
        lines.append(f"shared expert: |y_shared| = {float(shared.norm()):.4f} (every token takes it)")
    lines += [
        f"each chosen expert recomputed, w_e y_e(x): max gap {numbers['max_expert_gap']:.3g}",
        f"sum of w_e y_e (+ shared) against the MLP's output: max gap {numbers['max_sum_gap']:.3g}",
    ]
    title = f"mixture of experts: token {index} goes to experts {chosen}"
    return SchemeStep("experts", title, lines, numbers)


def _weighted(moe: MixtureOfExperts, e: int, x: Tensor, w: Tensor) -> Tensor:
    """Expert ``e``'s weighted output on one token x [d_model] (Llama 4's weight scales the input)."""
    if moe.routing == "topk_sigmoid":
        return moe.expert(e, x * w.to(x.dtype))  # (d_model,)
    return moe.expert(e, x) * w.to(x.dtype)  # (d_model,)
