"""Interventions on heads and experts: :func:`ablate` (while a block runs) and :func:`prune_heads` (for good).

* :func:`ablate`: a context manager that zero- or mean-ablates heads through their ``hook_z`` (and experts,
  :mod:`.expert_ablation`), in the calls of the thread that opened it (other threads' calls of the
  model are not ablated).
* :func:`prune_heads`: removes heads, shrinking the fused weights (:mod:`headspace.pruning`) and
  recording the original indices in the model's config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from torch import Tensor

from ...attention.layer import MultiHeadAttention
from ...attention.pruning import kept_kv_heads, shrink_attention
from ...core.checks import is_int
from ...model.models import Decoder, Encoder
from ..trace.trace import as_module, attention_layers, hooked
from .expert_ablation import expert_hooks

ABLATION_MODES = ("zero", "mean")


def _layers(model: Any) -> list[MultiHeadAttention]:
    layers = [m for _, m in attention_layers(model)]
    if not layers:
        raise ValueError(f"model has no MultiHeadAttention layer; got {type(model).__name__}")
    return layers


def _check_layer_head(layers: Sequence[MultiHeadAttention], layer: Any, head: Any, arg: str) -> None:
    n = len(layers)
    if not is_int(layer) or not 0 <= layer < n:
        raise ValueError(f"{arg}: layer must be an int in [0, {n}) for this model; got {layer!r}")
    h = layers[layer].n_heads
    if not is_int(head) or not 0 <= head < h:
        raise ValueError(f"{arg}: head must be an int in [0, {h}) for layer {layer}; got {head!r}")


def _checked_means(layers: Sequence[MultiHeadAttention], means: Mapping | None) -> dict:
    """``ablate``'s ``means`` as a dict, each key a (layer, head) of ``layers`` and each value a float
    tensor broadcasting to [batch, seq_q, d_head]."""
    means = dict(means or {})
    for key in means:
        if not isinstance(key, tuple) or len(key) != 2:
            raise TypeError(f"means keys must be (layer, head) pairs; got {key!r}")
        _check_layer_head(layers, key[0], key[1], "means")
        m, dh = means[key], layers[key[0]].d_head
        if not isinstance(m, Tensor) or not m.is_floating_point():
            got = f"dtype {m.dtype}" if isinstance(m, Tensor) else type(m).__name__
            raise TypeError(
                f"means[{key}] must be a float tensor broadcasting to [batch, seq_q, d_head={dh}]; got {got}"
            )
        if m.dim() > 3 or (m.dim() and m.shape[-1] not in (1, dh)):
            raise ValueError(
                f"means[{key}] must broadcast to [batch, seq_q, d_head={dh}] (e.g. [{dh}]); "
                f"got shape {list(m.shape)}"
            )
    return means


def _head_modes(layers: Sequence[MultiHeadAttention], heads: Any) -> dict[int, dict[int, str]]:
    """``ablate``'s ``heads`` as ``{layer: {head: mode}}``, each entry checked against ``layers``."""
    if heads is None:
        spec = {}
    elif isinstance(heads, Mapping):
        spec = dict(heads)
    elif isinstance(heads, Sequence) and not isinstance(heads, str):
        spec = {}
        for item in heads:
            if not isinstance(item, tuple) or len(item) != 2:
                raise TypeError(f"heads must hold (layer, head) pairs; got {item!r}")
            spec[item] = "zero"
    else:
        raise TypeError(
            f"heads must be a dict {{(layer, head): 'zero' | 'mean'}}; got {type(heads).__name__}"
        )
    per_layer: dict[int, dict[int, str]] = {}
    for key, mode in spec.items():
        if not isinstance(key, tuple) or len(key) != 2:
            raise TypeError(f"heads keys must be (layer, head) pairs; got {key!r}")
        _check_layer_head(layers, key[0], key[1], "heads")
        if mode not in ABLATION_MODES:
            raise ValueError(f"heads[{key}] must be one of {ABLATION_MODES}; got {mode!r}")
        per_layer.setdefault(key[0], {})[key[1]] = mode
    return per_layer


@contextmanager
def ablate(
    model: Any,
    heads: Mapping[tuple[int, int], str] | Sequence[tuple[int, int]] | None = None,
    *,
    means: Mapping[tuple[int, int], Tensor] | None = None,
    experts: Mapping[tuple[int, int | str], str] | Sequence[tuple[int, int | str]] | None = None,
    all_threads: bool = False,
) -> Iterator[None]:
    """Ablate heads while the block runs: ``with ablate(model, {(0, 3): "zero", (2, 1): "mean"}): model(x)``.

    A head is ablated by replacing its ``z_h`` (``hook_z``, [batch, seq_q, n_heads, d_head]) before
    ``W_O``, so its contribution ``z_h W_O[h]`` to the layer output changes and ``b_O`` stays:

    * ``"zero"``: ``z_h = 0`` (the head writes nothing).
    * ``"mean"``: ``z_h`` is replaced by ``means[(layer, head)]`` (any shape broadcasting to
      [batch, seq_q, d_head], e.g. a [d_head] mean over a reference set, see
      :func:`headspace.analysis.ablation.mean_z`) or, without ``means``, by its mean over the batch and
      positions of the current input (padding positions included).

    Args:
        model: a :class:`~headspace.MultiHeadAttention` (layer 0), a model with attention layers, or a
            pretrained wrapper with a ``.model``. Layer ``i`` is the ``i``-th attention layer in module
            order (``blocks.i.attn``).
        heads: ``{(layer, head): "zero" | "mean"}``, or a sequence of ``(layer, head)`` (all zeroed).
        means: optional reference means for ``"mean"`` ablation, by ``(layer, head)``.
        experts: ``{(layer, expert): "zero" | "mean"}`` (or a sequence of pairs, all zeroed) for the
            mixtures of experts of a model's blocks (``layer`` a block index, ``expert`` an index or
            ``"shared"``): ``"zero"`` removes the expert's weighted output ``w_e y_e`` from the layer
            for the tokens routed to it (transformers' output minus that expert's term: the same as its
            down-projection zeroed), the routing (top-k choice, the other experts' weights) unchanged;
            ``"mean"`` replaces it, at each token routed to it, by its mean over the tokens of the
            current input routed to it (:mod:`headspace.analysis.causal.expert_ablation`). ``heads``
            may then be omitted.
        all_threads: False (default): the heads are ablated only in calls made by the thread that
            opened the ``with`` block; another thread running the same model meanwhile gets the
            unablated outputs (and its fast path). True: ablated in every thread's calls.
    """
    if not isinstance(all_threads, bool):
        raise TypeError(f"all_threads must be a bool; got {type(all_threads).__name__} {all_threads!r}")
    hooks = {} if experts is None else expert_hooks(model, experts)
    no_heads = heads is None or (isinstance(heads, Mapping | list | tuple) and not heads)
    if no_heads and not means:  # experts only (or nothing)
        with hooked(model, hooks, all_threads=all_threads):
            yield
        return
    layers = _layers(model)
    per_layer = _head_modes(layers, heads)
    means = _checked_means(layers, means)

    def make_fn(layer: int, modes: dict[int, str]) -> Callable[[Tensor, Any], Tensor]:
        def fn(z: Tensor, point: Any) -> Tensor:  # z: (batch, seq_q, n_heads, d_head)
            z = z.clone()
            for h, mode in modes.items():
                if mode == "zero":
                    z[:, :, h] = 0.0
                elif (layer, h) in means:
                    z[:, :, h] = means[(layer, h)].to(z)
                else:
                    z[:, :, h] = z[:, :, h].mean(dim=(0, 1), keepdim=True)  # (1, 1, d_head)
            return z

        return fn

    paths = [p for p, _ in attention_layers(model)]
    for layer, modes in per_layer.items():
        name = f"{paths[layer]}.hook_z" if paths[layer] else "hook_z"
        hooks[name] = make_fn(layer, modes)
    with hooked(model, hooks, all_threads=all_threads):
        yield


def prune_heads(model: Any, heads: Mapping[int, Sequence[int]]) -> dict[int, list[int]]:
    """Remove heads for good: ``prune_heads(model, {0: [3, 5], 2: [1]})``.

    Each named layer's fused weights are rebuilt without the pruned heads' rows of ``W_Q``/``b_Q`` and
    columns of ``W_O`` (so ``n_heads`` and the parameter count drop); the layer then computes exactly
    what the unpruned layer computes with those heads zero-ablated (``b_O`` is kept). Layer indices are
    those of :func:`headspace.trace.attention_layers`; head indices are the layer's current ones.

    Grouped-query attention: a key/value head (its ``W_K``, ``W_V``, biases) goes when all its query
    heads go. Pruning that would leave surviving key/value heads with unequal numbers of query heads is
    refused with ``ValueError`` (a layer has one group size). Pruning every head of a layer is refused.

    An :class:`~headspace.Encoder` or :class:`~headspace.Decoder` (or a loaded model wrapping one) gets a
    new ``config`` whose ``pruned_heads`` lists, per layer, the *original* indices of every head pruned
    so far, so ``type(model)(model.config)`` builds the pruned shapes and the pruned weights load into it
    (checkpoints round-trip). ``n_heads`` in the config stays the unpruned count; read a layer's current
    count from the layer. Other models have no config to update. Optimisers and KV caches made before
    pruning are stale.

    Returns:
        ``{layer: [original indices of the kept heads]}`` for each pruned layer.
    """
    layers = _layers(model)
    if not isinstance(heads, Mapping):
        raise TypeError(f"heads must be a dict {{layer: [head, ...]}}; got {type(heads).__name__}")
    plans: dict[int, list[int]] = {}
    for layer, drop in heads.items():
        if isinstance(drop, int) or not isinstance(drop, Sequence):
            raise TypeError(f"heads[{layer!r}] must be a list of head indices; got {drop!r}")
        for h in drop:
            _check_layer_head(layers, layer, h, "heads")
        attn = layers[layer]
        if not attn.prunable:
            kind = f"{type(attn).__module__}.{type(attn).__name__}"
            raise ValueError(
                f"heads[{layer}]: layer {layer} is a {kind}, which keeps torch.nn.MultiheadAttention's layout"
                " (num_heads * head_dim == embed_dim) and so cannot lose heads; zero-ablate with "
                "headspace.ablate, or convert it to a headspace.MultiHeadAttention "
                "(headspace.layouts.from_torch_mha) and prune that"
            )
        keep = [h for h in range(attn.n_heads) if h not in set(drop)]
        if not keep:
            raise ValueError(
                f"heads[{layer}] would prune all {attn.n_heads} heads of layer {layer}; a layer needs at "
                "least one head (zero-ablate with headspace.ablate instead)"
            )
        plans[layer] = keep
    for layer, keep in plans.items():  # check every layer before changing any (GQA group sizes)
        kept_kv_heads(layers[layer].n_heads, layers[layer].n_kv_heads, keep, f"heads[{layer}]")
    owner = _config_owner(model, layers)
    if owner is not None:  # original indices before any layer changes
        config = owner.config
        pruned = dict(config.pruned_heads)
        for layer, keep in plans.items():
            before = config.kept_heads(layer)  # original index of each current head
            kept = {before[h] for h in keep}
            pruned[layer] = [h for h in range(config.n_heads) if h not in kept]
    for layer, keep in plans.items():
        shrink_attention(layers[layer], keep)
    if owner is not None:
        owner.config = dataclasses.replace(config, pruned_heads=pruned)
    return plans


def _config_owner(model: Any, layers: Sequence[MultiHeadAttention]) -> Any:
    """The Encoder/Decoder behind ``model`` whose config describes exactly ``layers``, else None."""
    module = as_module(model)
    if not isinstance(module, Encoder | Decoder) or [b.attn for b in module.blocks] != list(layers):
        return None
    config = module.config
    if any(len(config.kept_heads(i)) != a.n_heads for i, a in enumerate(layers)):
        return None  # layers changed behind the config's back (shrink_attention): nothing to record
    return module
