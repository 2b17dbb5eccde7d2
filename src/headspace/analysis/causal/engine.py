"""The batched patching engine: a model run from a layer on, many patched copies of a prompt at once.

:func:`run_from_layers` runs the blocks from each copy's first patched layer on, its residual stream
joined there (the layers below run once, for every copy); :func:`sweep` runs the copies of a site sweep
(one per head, position, or layer) through it, each copy's hook functions patching only its own rows;
:func:`full_run` records a prompt's activations, :func:`corrupt_stream` the corrupt run's stream the
copies start from, and :func:`model_output` turns a final stream into the logits (decoder) or the
sentence embedding (encoder). :mod:`.patching` (``patch``) and head importance (:mod:`.ablation`) share it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..trace.trace import hooked, trace
from .causal_inputs import last_resid
from .hybrid import prefix_cache, prefix_state

__all__ = [
    "FullRun",
    "Site",
    "corrupt_stream",
    "full_run",
    "model_output",
    "run_from_layers",
    "sites_of",
    "sweep",
]


def model_output(module: nn.Module, x: Tensor, decoder: bool) -> Tensor:
    """The final stream [runs, seq, d_model] -> logits at the last position [runs, vocab] (decoder) or the
    sentence embedding [runs, d_model] (encoder: mean over positions, L2-normalised)."""
    if decoder:
        last = x[:, -1]  # (runs, d_model)
        if module.ln_final is not None:
            last = module.ln_final(last)
        return last @ module.W_U  # (runs, vocab)
    if getattr(module, "ln_final", None) is not None:
        x = module.ln_final(x)
    return F.normalize(x.mean(dim=1), dim=-1)  # (runs, d_model)


# ---------------------------------------------------------------------------------------------- runs
@dataclass
class FullRun:
    """One prompt's activations per layer (index 0 = block 0) and its output."""

    resid_pre: list[Tensor]  # [1, seq, d_model] each
    z: list[Tensor]  # [1, seq, n_heads, d_head]
    mlp_out: list[Tensor]  # [1, seq, d_model]
    output: Tensor  # [1, vocab] or [1, d_model]


def full_run(module: nn.Module, tokens: Tensor, decoder: bool) -> FullRun:
    L = len(module.blocks)
    last = last_resid(module)
    names = ["blocks.*.hook_resid_pre", "blocks.*.attn.hook_z", "blocks.*.hook_mlp_out", last]
    with trace(module, names=names) as t:
        module(tokens)
    final = t[last]  # (1, seq, d_model)
    return FullRun(
        resid_pre=[t[f"blocks.{i}.hook_resid_pre"] for i in range(L)],
        z=[t[f"blocks.{i}.attn.hook_z"] for i in range(L)],
        mlp_out=[t[f"blocks.{i}.hook_mlp_out"] for i in range(L)],
        output=model_output(module, final, decoder),
    )


@dataclass
class Site:
    layer: int
    head: int | None = None
    position: int | None = None  # absolute position


def sites_of(
    site: str, n_layers: int, n_heads: list[int], seq: int, p: int
) -> tuple[list[Site], list[tuple[int, ...]]]:
    """The sites to run and the index of each in the effect tensor; positions before ``p`` are skipped
    (their activations are the same in both runs, so their effect is exactly 0)."""
    sites: list[Site] = []
    where: list[tuple[int, ...]] = []
    for layer in range(n_layers):
        if site == "heads":
            for h in range(n_heads[layer]):
                sites.append(Site(layer, head=h))
                where.append((layer, h))
        elif site == "heads_pos":
            for h in range(n_heads[layer]):
                for pos in range(p, seq):
                    sites.append(Site(layer, head=h, position=pos))
                    where.append((layer, h, pos))
        elif site == "resid":
            for pos in range(p, seq):
                sites.append(Site(layer, position=pos))
                where.append((layer, pos))
        else:
            sites.append(Site(layer))
            where.append((layer,))
    return sites, where


def sweep(
    module: nn.Module,
    site: str,
    sites: list[Site],
    clean: FullRun,
    corrupt_resid: list[Tensor],
    prefix: list[tuple[Tensor, Tensor]],
    p: int,
    decoder: bool,
) -> Tensor:
    """The output of every patched run, in the order of ``sites``: [runs, vocab] or [runs, d_model].

    ``corrupt_resid[l]`` is the corrupt stream entering block ``l`` at positions ``p..seq-1``
    [1, seq - p, d_model]; ``prefix[l]`` that block's keys and values of positions ``0..p-1``.
    """
    rotary = getattr(module, "rotary", None)
    seq = p + corrupt_resid[0].shape[1]
    positions = torch.arange(p, seq, device=corrupt_resid[0].device)  # (seq - p,)
    by_layer: dict[int, list[int]] = {}
    for i, s in enumerate(sites):
        by_layer.setdefault(s.layer, []).append(i)
    joins = {layer: corrupt_resid[layer].expand(len(new), -1, -1) for layer, new in by_layer.items()}
    order = [i for layer in sorted(by_layer) for i in by_layer[layer]]  # site index of each run

    def hooks(layer: int, first_new: int, n_new: int) -> dict[str, Callable]:
        new = [sites[i] for i in by_layer.get(layer, [])]
        return _patch_hooks(site, new, first_new, clean, layer, p)

    def block_kwargs(layer: int, runs: int) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if decoder:
            kwargs["is_causal"] = True
            if p:
                kwargs["kv_cache"] = prefix_cache(module.blocks[layer].attn, prefix[layer], runs, seq, p)
            if rotary is not None and getattr(module.blocks[layer].attn, "rotary", None) is not None:
                kwargs["positions"] = positions  # (NoPE layers: none, as the model's forward)
        return kwargs

    x = run_from_layers(module, joins, hooks, block_kwargs)
    assert len(order) == len(sites)
    out = model_output(module, x, decoder)  # (runs, ...)
    result = torch.empty_like(out)
    result[torch.tensor(order, device=out.device)] = out
    return result


def run_from_layers(
    module: nn.Module,
    joins: dict[int, Tensor],
    hooks: Callable[[int, int, int], dict[str, Callable]],
    block_kwargs: Callable[[int, int], dict[str, Any]],
    *,
    separate: bool = False,
) -> Tensor:
    """The batched engine: runs that start at different blocks travel up the stack together.

    ``joins[l]`` [n_l, seq, d_model] is the residual stream entering block ``l`` of the ``n_l`` runs that
    start there (a run that changes only block ``l`` or above equals the unchanged run below ``l``, so
    the blocks below are not run for it). At block ``l`` those runs join the batch as its last rows,
    block ``l`` runs with ``hooks(l, first_new_row, n_l)`` (names relative to ``blocks.l``, e.g.
    ``"attn.hook_z"``) added for the duration of the call, with ``block(x, **block_kwargs(l, runs))``.

    ``separate=True``: at a block where runs join, the rows already in the batch and the joining rows
    run as two calls of the block, the hooks only on the joining rows' call (``hooks(l, 0, n_l)``, rows
    counted in that call; ``block_kwargs(l, runs)`` with each call's rows), and their outputs are stacked
    in the same order. The rows already there keep the block's untraced path (a hook on the attention
    switches a layer to its explicit path); only for blocks whose rows are independent of each other
    (no state shared across the batch, such as a KV cache of ``runs`` rows).

    Returns the stream leaving the last block [sum_l n_l, seq, d_model], rows in order of joining
    (layer by layer; within a layer as in ``joins[l]``).
    """
    x: Tensor | None = None
    for layer, block in enumerate(module.blocks):
        first_new, fresh = (0 if x is None else x.shape[0]), joins.get(layer)
        if separate and fresh is not None and x is not None:
            old = block(x, **block_kwargs(layer, x.shape[0]))  # (runs, seq, d_model)
            fns = hooks(layer, 0, fresh.shape[0])
            with hooked(module, {f"blocks.{layer}.{name}": fn for name, fn in fns.items()}):
                new = block(fresh, **block_kwargs(layer, fresh.shape[0]))  # (n_l, seq, d_model)
            x = torch.cat([old, new], dim=0)  # (runs + n_l, seq, d_model)
            continue
        if fresh is not None:
            x = fresh.clone() if x is None else torch.cat([x, fresh], dim=0)  # (runs, seq, d_model)
        if x is None:
            continue
        n_new = 0 if fresh is None else fresh.shape[0]
        fns = hooks(layer, first_new, n_new) if n_new else {}
        with hooked(module, {f"blocks.{layer}.{name}": fn for name, fn in fns.items()}):
            x = block(x, **block_kwargs(layer, x.shape[0]))  # (runs, seq, d_model)
    if x is None:
        raise ValueError(
            f"joins must name at least one block of the {len(module.blocks)}; got {sorted(joins)}"
        )
    return x


def _patch_hooks(
    site: str, new: list[Site], row0: int, clean: FullRun, layer: int, p: int
) -> dict[str, Callable]:
    """Hook functions (on one block) that put the clean activation into rows ``row0 ..`` of the batch."""
    if not new:
        return {}
    rows = list(range(row0, row0 + len(new)))

    if site in ("heads", "heads_pos"):
        clean_z = clean.z[layer][0, p:]  # (seq - p, n_heads, d_head)

        def patch_z(z: Tensor, point: Any) -> Tensor:  # z (runs, seq - p, n_heads, d_head)
            z = z.clone()
            for r, s in zip(rows, new):
                if s.position is None:
                    z[r, :, s.head] = clean_z[:, s.head]
                else:
                    z[r, s.position - p, s.head] = clean_z[s.position - p, s.head]
            return z

        return {"attn.hook_z": patch_z}
    if site == "resid":
        clean_x = clean.resid_pre[layer][0, p:]  # (seq - p, d_model)

        def patch_resid(x: Tensor, point: Any) -> Tensor:  # x (runs, seq - p, d_model)
            x = x.clone()
            for r, s in zip(rows, new):
                x[r, s.position - p] = clean_x[s.position - p]
            return x

        return {"hook_resid_pre": patch_resid}
    clean_m = clean.mlp_out[layer][0, p:]  # (seq - p, d_model)

    def patch_mlp(m: Tensor, point: Any) -> Tensor:  # m (runs, seq - p, d_model)
        m = m.clone()
        m[rows] = clean_m
        return m

    return {"hook_mlp_out": patch_mlp}


def corrupt_stream(
    module: nn.Module, tokens: Tensor, p: int, decoder: bool
) -> tuple[list[Tensor], list, Tensor]:
    """(the corrupt stream entering each block at positions p.., the prefix K/V, the corrupt output)."""
    L = len(module.blocks)
    last = last_resid(module)
    names = ["blocks.*.hook_resid_pre", last]
    if decoder and p:
        caches = module.make_kv_caches(1, tokens.shape[1])
        module(tokens[:, :p], None, caches)  # the prefix, the same in every run
        prefix = [prefix_state(c, p) for c in caches]  # (1, Hkv, p, dh) x 2 (a DeltaNet: its state)
        with trace(module, names=names) as t:
            module(tokens[:, p:], None, caches)
    else:
        prefix = []
        with trace(module, names=names) as t:
            module(tokens)
    resid = [t[f"blocks.{i}.hook_resid_pre"] for i in range(L)]  # (1, seq - p, d_model) each
    return resid, prefix, model_output(module, t[last], decoder)
