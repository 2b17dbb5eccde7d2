"""Expert ablation for :func:`headspace.ablate` (``experts={(layer, expert): "zero" | "mean"}``, issue #39).

In a mixture-of-experts layer (:mod:`headspace.model.moe`) each token ``t`` adds
``MoE(x_t) = sum_e c_{t,e} + s_t``: expert ``e``'s weighted contribution ``c_{t,e}`` (``hook_expert_out``;
``w_{t,e} y_e(x_t)``, or Llama 4's ``y_e(w_{t,e} x_t)``; 0 where ``t`` did not take ``e``) and the shared
expert's ``s_t`` (``hook_shared_out``). An ablation changes one term and nothing else: the router logits,
the top-k choice and the other experts' weights are those of the unablated run.

* ``"zero"``: ``c_{t,e} = 0`` for every token (the layer's output minus that expert's term). Done by
  zeroing column ``e`` of ``hook_routing``, so the expert does not run; the same thing as zeroing the
  expert's down-projection (and its bias) in transformers.
* ``"mean"``: for each token routed to ``e`` (routing weight not 0), ``c_{t,e}`` is replaced by the mean
  of ``c_{t',e}`` over the tokens ``t'`` of the current input (every batch row and position, padding
  included) routed to ``e``; tokens not routed to ``e`` keep 0. An expert no token took is unchanged.
  It runs through ``hook_expert_out``, so the layer computes its dense [batch, seq, E, d_model] axis.
* Expert ``"shared"``: the shared expert (Qwen2-MoE's gated one, DeepSeek's, Llama 4's, Qwen3-Next's,
  Gemma 4's dense MLP beside its experts): ``"zero"`` sets ``s_t = 0``; ``"mean"`` replaces ``s_t`` by its
  mean over every token of the current input (every token takes the shared expert).

Gemma 4 sums its experts before a norm (``N_post2``): there the terms are those inside the norm, as
``hook_expert_out`` documents. Layers are block indices (``blocks.<layer>.mlp``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ...core.checks import is_int
from ...model.moe import MixtureOfExperts
from ..trace.trace import as_module

__all__ = ["EXPERT_MODES", "expert_hooks"]

EXPERT_MODES = ("zero", "mean")
SHARED = "shared"

HookFn = Callable[[Tensor, Any], Tensor]


def _moe_blocks(model: Any) -> tuple[list[Any], str]:
    """The model's blocks and the prefix of their hook names (``"blocks."``)."""
    module = as_module(model)
    blocks = getattr(module, "blocks", None)
    if blocks is None:
        raise ValueError(
            f"experts: ablating experts needs a model with blocks (a Decoder or a loaded model); "
            f"got {type(module).__name__}"
        )
    return list(blocks), "blocks."


def _checked(blocks: list[Any], key: Any, mode: Any) -> tuple[int, int | str, str]:
    """``(layer, expert, mode)`` of one ``experts`` entry, or a one-line error naming what was wanted."""
    if not isinstance(key, tuple) or len(key) != 2:
        raise TypeError(f"experts keys must be (layer, expert) pairs; got {key!r}")
    layer, expert = key
    n = len(blocks)
    if not is_int(layer) or not 0 <= layer < n:
        raise ValueError(f"experts: layer must be an int in [0, {n}) for this model; got {layer!r}")
    mlp = getattr(blocks[layer], "mlp", None)
    if not isinstance(mlp, MixtureOfExperts):
        moe = [i for i, b in enumerate(blocks) if isinstance(getattr(b, "mlp", None), MixtureOfExperts)]
        raise ValueError(
            f"experts: layer {layer} has no mixture of experts (its MLP is a {type(mlp).__name__}); "
            f"the layers with experts are {moe}; got {key!r}"
        )
    shared = mlp.shared is not None
    if expert == SHARED and not shared:
        raise ValueError(
            f"experts: layer {layer} has no shared expert: expert must be an int in [0, {mlp.n_experts}); "
            f"got {expert!r}"
        )
    if expert != SHARED and (not is_int(expert) or not 0 <= expert < mlp.n_experts):
        also = " or 'shared'" if shared else ""
        raise ValueError(
            f"experts: expert must be an int in [0, {mlp.n_experts}){also} for layer {layer}; got {expert!r}"
        )
    if mode not in EXPERT_MODES:
        raise ValueError(f"experts[{key!r}] must be one of {EXPERT_MODES}; got {mode!r}")
    return layer, expert, mode


def _spec(experts: Any) -> dict:
    """``experts`` as ``{(layer, expert): mode}`` (a sequence of pairs means every one ``"zero"``)."""
    if isinstance(experts, Mapping):
        return dict(experts)
    if isinstance(experts, Sequence) and not isinstance(experts, str):
        spec = {}
        for item in experts:
            if not isinstance(item, tuple) or len(item) != 2:
                raise TypeError(f"experts must hold (layer, expert) pairs; got {item!r}")
            spec[item] = "zero"
        return spec
    raise TypeError(
        f"experts must be a dict {{(layer, expert): 'zero' | 'mean'}}; got {type(experts).__name__}"
    )


def _routing_fn(zero: list[int], mean: list[int], routed: threading.local) -> HookFn:
    """``hook_routing`` [batch, seq, E]: zero the ``zero`` columns; note the ``mean`` experts' tokens."""

    def fn(w: Tensor, point: Any) -> Tensor:  # w: (batch, seq, E)
        routed.mask = w[..., mean].ne(0) if mean else None  # (batch, seq, n_mean)
        if not zero:
            return w
        w = w.clone()
        w[..., zero] = 0.0
        return w

    return fn


def _expert_out_fn(mean: list[int], routed: threading.local) -> HookFn:
    """``hook_expert_out`` [batch, seq, E, d_model]: each ``mean`` expert's routed rows set to their mean."""

    def fn(c: Tensor, point: Any) -> Tensor:  # c: (batch, seq, E, d_model)
        mask = getattr(routed, "mask", None)  # (batch, seq, n_mean), from this call's hook_routing
        if mask is None:
            raise RuntimeError("experts: hook_expert_out fired without this call's routing")
        c = c.clone()
        for j, e in enumerate(mean):
            rows = mask[..., j]  # (batch, seq) bool
            if bool(rows.any()):
                c[..., e, :][rows] = c[..., e, :][rows].mean(dim=0).to(c.dtype)  # (n_routed, d_model)
        routed.mask = None
        return c

    return fn


def _shared_fn(mode: str) -> HookFn:
    """``hook_shared_out`` [batch, seq, d_model]: zeros, or its mean over the batch and positions."""

    def fn(s: Tensor, point: Any) -> Tensor:  # s: (batch, seq, d_model)
        if mode == "zero":
            return torch.zeros_like(s)
        return s.mean(dim=(0, 1), keepdim=True).expand_as(s).clone()  # (batch, seq, d_model)

    return fn


def expert_hooks(model: Any, experts: Any) -> dict[str, HookFn]:
    """The hook functions (by full hook name) that ablate ``experts`` ({(layer, expert): mode}, module
    docstring) in ``model``; raises a one-line ``ValueError`` / ``TypeError`` for a bad entry."""
    blocks, prefix = _moe_blocks(model)
    per_layer: dict[int, dict[int | str, str]] = {}
    for key, mode in _spec(experts).items():
        layer, expert, mode = _checked(blocks, key, mode)
        per_layer.setdefault(layer, {})[expert] = mode
    hooks: dict[str, HookFn] = {}
    for layer, modes in per_layer.items():
        name = f"{prefix}{layer}.mlp"
        zero = sorted(e for e, m in modes.items() if e != SHARED and m == "zero")
        mean = sorted(e for e, m in modes.items() if e != SHARED and m == "mean")
        routed = threading.local()
        if zero or mean:
            hooks[f"{name}.hook_routing"] = _routing_fn(zero, mean, routed)  # type: ignore[arg-type]
        if mean:
            hooks[f"{name}.hook_expert_out"] = _expert_out_fn(mean, routed)  # type: ignore[arg-type]
        if SHARED in modes:
            hooks[f"{name}.hook_shared_out"] = _shared_fn(modes[SHARED])
    return hooks
