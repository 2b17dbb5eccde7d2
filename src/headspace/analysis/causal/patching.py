"""What a head causes: activation patching, attribution patching and path patching.

**Activation patching.** Run the *corrupt* prompt, replace one site's activation by the *clean* run's,
read the metric (default: ``logit(answer) - logit(other)`` at the last position). The effect is
normalised, ``(patched - corrupt) / (clean - corrupt)``: 0 = no effect, 1 = the clean behaviour fully
restored. Sites (``site=``):

* ``"heads"``: each head's output ``hook_z`` (the input of its rows of W_O), all positions -> [layer, head];
  a gated head's ``hook_z`` is the gated z (the gate as on the run it came from), a Gated DeltaNet
  head's its gated norm's output (hybrids: layers keep their own head counts, padded to the widest);
* ``"heads_pos"``: the same per position -> [layer, head, position];
* ``"resid"``: the residual stream entering each block, per position -> [layer, position];
* ``"mlp"``: each MLP's output, all positions -> [layer].

**How the sweep is fast** (the numbers are those of one full forward per site):

1. a patch at layer ``l`` leaves the layers below ``l`` as in the corrupt run: a site's run starts at its
   layer from the corrupt residual stream, and all sites travel up the stack together, one batched pass
   over the layers, the sites of layer ``l`` joining the batch there;
2. in a causal model, positions before the first token where the prompts differ are the same in every
   run (clean, corrupt, patched): their keys and values are computed once (a KV cache of the corrupt
   prefix) and only the later positions are run;
3. only the last position is unembedded.

**Attribution patching** estimates every effect to first order from two forwards and one backward:
``effect ~ (a_clean - a_corrupt) . d metric / d a`` at the corrupt run, normalised the same way.

**Path patching** measures a set of sender heads' effect on the metric only through chosen receiver
heads' query, key or value inputs: (1) a corrupt run where the senders' ``z`` are the clean run's and
every other head is frozen to its corrupt ``z`` records the receivers' inputs; (2) a corrupt run with
only those receiver inputs replaced gives the metric.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ...core.progress import progress_bar
from .._common import JsonResult, eval_mode
from ..trace.trace import hooked, trace
from .budget import check_backward, fit_runs, shape_of
from .causal_inputs import (
    Prompts,
    check_distinct_answers,
    is_decoder,
    last_resid,
    prompts_of,
    stack_of,
    token_id,
    token_str,
)
from .engine import FullRun, corrupt_stream, full_run, model_output, sites_of, sweep
from .engine import run_from_layers as run_from_layers  # its old home: head importance imports it here

#: site -> the axes of its effect tensor
SITES: dict[str, tuple[str, ...]] = {
    "heads": ("layer", "head"),
    "heads_pos": ("layer", "head", "position"),
    "resid": ("layer", "position"),
    "mlp": ("layer",),
}
#: site -> the hook point (in each block) whose activation attribution patching reads
_HOOKS = {
    "heads": "attn.hook_z",
    "heads_pos": "attn.hook_z",
    "resid": "hook_resid_pre",
    "mlp": "hook_mlp_out",
}
#: site -> the JSON key of its effect
EFFECT_KEYS = {
    "heads": "head_patch_effect",
    "heads_pos": "head_position_patch_effect",
    "resid": "resid_patch_effect",
    "mlp": "mlp_patch_effect",
}

Metric = Callable[[Tensor], Tensor]


@dataclass
class PatchResult(JsonResult):
    """The normalised effect of each site, with its axes, and the metric of each run.

    * ``effect``: [*axes] (``axes`` names them: e.g. ("layer", "head")), ``(patched - corrupt) /
      (clean - corrupt)``; 0 everywhere when clean and corrupt give the same metric;
    * ``patched_metric``: [*axes], the raw metric of each patched run;
    * ``clean_metric``, ``corrupt_metric``: the two unpatched runs;
    * ``method``: "activation" (real patching) or "attribution" (the first-order estimate);
    * ``tokens``: the clean prompt's tokens (position labels); ``first_difference``: the first position
      where the prompts differ.
    """

    kind = "patching"

    site: str
    axes: tuple[str, ...]
    effect: Tensor
    patched_metric: Tensor
    clean_metric: float
    corrupt_metric: float
    method: str = "activation"
    tokens: list[str] | None = None
    first_difference: int = 0
    metric_name: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d[EFFECT_KEYS[self.site]] = d["effect"]  # the key names what it holds
        return d

    def top(self, k: int = 10) -> list[tuple[tuple[int, ...], float]]:
        """The ``k`` sites with the largest absolute effect: ``[((layer, head), effect), ...]``."""
        flat = self.effect.flatten()
        order = flat.abs().argsort(descending=True)[:k]
        return [
            (tuple(int(i) for i in torch.unravel_index(j, self.effect.shape)), float(flat[j])) for j in order
        ]


# ---------------------------------------------------------------------------------------------- inputs
def _pair(model: Any, clean: Any, corrupt: Any) -> tuple[Prompts, Prompts]:
    c = prompts_of(model, clean, "clean")
    k = prompts_of(model, corrupt, "corrupt")
    if c.batch != 1 or k.batch != 1:
        raise ValueError(f"clean and corrupt must be one prompt each; got {c.batch} and {k.batch}")
    lc, lk = int(c.last[0]) + 1, int(k.last[0]) + 1
    if lc != lk:
        tokenizer = getattr(model, "tokenizer", None)
        show = ""
        if tokenizer is not None and c.texts and k.texts:
            show = f": clean {tokenizer.tokens(c.texts[0])}, corrupt {tokenizer.tokens(k.texts[0])}"
        raise ValueError(
            f"clean and corrupt must have the same number of tokens (patching swaps activations position by "
            f"position); clean has {lc} tokens and corrupt {lk}{show}. Use same-length prompts, e.g. swap "
            "one name for another name of one token"
        )
    if torch.equal(c.tokens, k.tokens):
        texts = f" ({c.texts[0]!r} and {k.texts[0]!r})" if c.texts and k.texts else ""
        raise ValueError(
            f"clean and corrupt are the same prompt{texts}: the same {lc} tokens, so patching one into the "
            "other changes nothing and every effect would be 0; give a corrupt prompt that differs from the "
            "clean one (e.g. one name swapped for another)"
        )
    return c, k


def _metric_fn(
    model: Any, module: nn.Module, metric: Metric | None, answer: Any, other: Any, clean_output: Tensor | None
) -> tuple[Metric, str]:
    """The metric and its name: the caller's, else a decoder's logit(answer) - logit(other), else (an
    encoder) the cosine of the sentence embedding with the clean one (``clean_output`` [1, d_model])."""
    if metric is not None:
        if not callable(metric):
            raise TypeError(f"metric must be callable(output [runs, ...]) -> [runs]; got {metric!r}")
        return metric, getattr(metric, "__name__", "metric")
    if not is_decoder(module):
        if clean_output is None:
            raise ValueError("an encoder's default metric needs the clean embedding")
        target = clean_output.detach()[0]  # (d_model,), L2-normalised

        def cosine_to_clean(emb: Tensor) -> Tensor:  # (runs, d_model) -> (runs,)
            return emb @ target

        return cosine_to_clean, "cosine to the clean embedding"
    if answer is None:
        raise ValueError("the default metric is logit(answer) - logit(other): pass answer (and other)")
    a = token_id(model, answer, "answer")
    b = None if other is None else token_id(model, other, "other")
    check_distinct_answers(model, a, b)
    name = f"logit({token_str(model, a)!r})" + ("" if b is None else f" - logit({token_str(model, b)!r})")

    def logit_difference(logits: Tensor) -> Tensor:  # (runs, vocab) -> (runs,)
        return logits[:, a] if b is None else logits[:, a] - logits[:, b]

    return logit_difference, name


def _checked(values: Any, runs: int, name: str) -> Tensor:
    """The metric's output as [runs]; anything else is an error naming what came."""
    if not isinstance(values, Tensor):
        values = torch.as_tensor(values) if isinstance(values, (int, float)) else values
    if not isinstance(values, Tensor) or not (values.is_floating_point() or values.dtype == torch.int64):
        raise TypeError(f"metric {name} must return a float tensor [runs]; got {type(values).__name__}")
    if values.numel() == runs and values.dim() <= 1:
        return values.reshape(runs).float()
    raise ValueError(
        f"metric {name} must return one number per run (a tensor of shape [{runs}]); got shape "
        f"{list(values.shape)}"
    )


def _first_difference(a: Tensor, b: Tensor) -> int:
    diff = (a[0] != b[0]).nonzero()
    return int(diff[0, 0]) if len(diff) else a.shape[1]


def _normalise(patched: Tensor, clean: float, corrupt: float) -> Tensor:
    denom = clean - corrupt
    if abs(denom) <= 1e-12 * max(1.0, abs(clean)):
        return torch.zeros_like(patched)
    return (patched - corrupt) / denom


@torch.no_grad()
def patch(
    model: Any,
    clean: Any,
    corrupt: Any,
    metric: Metric | None = None,
    *,
    site: str = "heads",
    answer: Any = None,
    other: Any = None,
    max_runs: int = 1024,
    max_memory: int | str | None = None,
) -> PatchResult:
    """Activation patching of every ``site`` from the clean run into the corrupt run (see the module doc).

    Args:
        model: a loaded model (``headspace.load(...)``) or a bare Decoder/Encoder with token ids.
        clean, corrupt: one prompt each (text or int64 ids [1, seq]) of the same number of tokens, not
            the same tokens (patching a prompt into itself changes nothing: refused, ``ValueError``).
        metric: ``fn(output) -> [runs]`` on the output of a batch of runs: a decoder's logits at the last
            position [runs, vocab], an encoder's sentence embeddings [runs, d_model]. Default: decoders
            ``logit(answer) - logit(other)``; encoders the cosine of the embedding with the clean one.
        site: "heads", "heads_pos", "resid" or "mlp".
        answer, other: the answer token (and the other token) of the default decoder metric; two
            different tokens (``answer == other`` makes the metric 0 in every run: ``ValueError``).
        max_runs: how many patched runs go through the stack in one batch at most (fewer where the
            estimated peak memory of a batch is above ``max_memory``: the same runs in smaller batches).
        max_memory: the memory limit (bytes or a size such as ``"8G"``; default ``$HEADSPACE_MAX_MEMORY``,
            else the memory available); a single patched run estimated above it is refused before
            anything runs (:mod:`.budget`).

    Returns:
        :class:`PatchResult` with ``effect`` [*axes], ``clean_metric`` and ``corrupt_metric``.
    """
    if site not in SITES:
        raise ValueError(f"unknown site {site!r}; sites: {list(SITES)}")
    module = stack_of(model, "patch")
    decoder = is_decoder(module)
    if isinstance(max_runs, bool) or not isinstance(max_runs, int) or max_runs < 1:
        raise ValueError(f"max_runs must be a positive int; got {max_runs!r}")
    c, k = _pair(model, clean, corrupt)
    seq = c.tokens.shape[1]
    p = _first_difference(c.tokens, k.tokens) if decoder else 0
    n_heads = [b.attn.n_heads for b in module.blocks]
    sites, where = sites_of(site, len(module.blocks), n_heads, seq, p)
    dev = c.tokens.device
    max_runs = fit_runs(shape_of(module), min(max_runs, len(sites)), seq, seq - p, max_memory, dev)
    with eval_mode(module):
        clean_run = full_run(module, c.tokens, decoder)
        fn, name = _metric_fn(model, module, metric, answer, other, clean_run.output)
        clean_metric = float(_checked(fn(clean_run.output), 1, name)[0])
        shape = _effect_shape(site, n_heads, seq, len(module.blocks))
        # p < seq: _pair refused identical prompts
        resid, prefix, corrupt_out = corrupt_stream(module, k.tokens, p, decoder)
        corrupt_metric = float(_checked(fn(corrupt_out), 1, name)[0])
        patched = torch.full(shape, corrupt_metric)
        # a sweep of several batches shows its patched runs as each batch ends (one batch: nothing to show)
        bar = progress_bar(
            total=len(sites), desc=f"patching {site}", unit="run", disable=len(sites) <= max_runs
        )
        for start in range(0, len(sites), max_runs):
            chunk = sites[start : start + max_runs]
            out = sweep(module, site, chunk, clean_run, resid, prefix, p, decoder)
            values = _checked(fn(out), len(chunk), name)
            for idx, v in zip(where[start : start + max_runs], values.tolist()):
                patched[idx] = v
            bar.update(len(chunk))
        bar.close()
    return PatchResult(
        site=site, axes=SITES[site], effect=_normalise(patched, clean_metric, corrupt_metric),
        patched_metric=patched, clean_metric=clean_metric, corrupt_metric=corrupt_metric,
        tokens=_tokens(model, c), first_difference=p, metric_name=name,
    )  # fmt: skip


def _effect_shape(site: str, n_heads: list[int], seq: int, n_layers: int) -> tuple[int, ...]:
    H = max(n_heads)
    return {
        "heads": (n_layers, H),
        "heads_pos": (n_layers, H, seq),
        "resid": (n_layers, seq),
        "mlp": (n_layers,),
    }[site]


def _tokens(model: Any, prompts: Prompts) -> list[str] | None:
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        return None
    return [tokenizer.decode([int(t)], skip_special_tokens=False) for t in prompts.tokens[0]]


@torch.no_grad()
def patch_activations(
    model: Any,
    clean: Any,
    corrupt: Any,
    names: str | Sequence[str],
    metric: Metric | None = None,
    *,
    answer: Any = None,
    other: Any = None,
) -> float:
    """The metric of one corrupt run with the clean run's whole activations at ``names`` (names or globs of
    hook points, e.g. ``"blocks.3.hook_resid_pre"`` or ``"blocks.*.attn.hook_z"``) put in: one forward, the
    plain definition the batched :func:`patch` is tested against."""
    module = stack_of(model, "patch_activations")
    decoder = is_decoder(module)
    c, k = _pair(model, clean, corrupt)
    patterns = [names] if isinstance(names, str) else list(names)
    last = last_resid(module)
    with eval_mode(module):
        with trace(module, names=patterns) as t:
            module(c.tokens)
        stored = dict(t)
        final: dict[str, Tensor] = {}
        hooks: dict[str, Callable] = {name: (lambda v, pt, name=name: stored[name]) for name in stored}
        hooks[last] = lambda v, pt: final.__setitem__("x", v)
        with hooked(module, hooks):
            module(k.tokens)
        out = model_output(module, final["x"], decoder)
        clean_out = None
        if metric is None and not decoder:  # the embedding metric needs the clean embedding
            with trace(module, names=[last]) as tc:
                module(c.tokens)
            clean_out = model_output(module, tc[last], decoder)
        fn, name = _metric_fn(model, module, metric, answer, other, clean_out)
        return float(_checked(fn(out), 1, name)[0])


# ---------------------------------------------------------------------------------------------- attribution
def attribution_patching(
    model: Any,
    clean: Any,
    corrupt: Any,
    metric: Metric | None = None,
    *,
    site: str = "heads",
    answer: Any = None,
    other: Any = None,
    max_memory: int | str | None = None,
) -> PatchResult:
    """The first-order estimate of :func:`patch`'s effects from two forwards and one backward.

    ``patched - corrupt ~ (a_clean - a_corrupt) . d metric / d a`` at the corrupt run, for each site's
    activation ``a`` (summed over the site's positions and features), normalised by
    ``clean - corrupt``. Exact for a metric linear in the activations; a good guide where a patch
    moves the metric a little, a poor one where it saturates a softmax. ``max_memory``: as for :func:`patch`.
    """
    if site not in SITES:
        raise ValueError(f"unknown site {site!r}; sites: {list(SITES)}")
    module = stack_of(model, "attribution_patching")
    decoder = is_decoder(module)
    c, k = _pair(model, clean, corrupt)
    check_backward(shape_of(module), c.tokens, site in ("heads", "heads_pos"), max_memory)
    hook = _HOOKS[site]
    L = len(module.blocks)
    with eval_mode(module):
        with torch.no_grad():
            clean_run = full_run(module, c.tokens, decoder)
        fn, name = _metric_fn(model, module, metric, answer, other, clean_run.output)
        clean_metric = float(_checked(fn(clean_run.output), 1, name)[0])
        acts: dict[int, Tensor] = {}

        def keep(layer: int) -> Callable:
            def fn_(value: Tensor, point: Any) -> None:  # recorded in the graph, not replaced
                acts[layer] = value

            return fn_

        # the embeddings become a leaf that needs a gradient, so every later activation is in the graph
        # (whatever the parameters' requires_grad); the recorded activations are never cut from it
        hooks: dict[str, Callable] = {"hook_embed": lambda v, pt: v.detach().requires_grad_(True)}
        hooks.update({f"blocks.{i}.{hook}": keep(i) for i in range(L)})
        final: dict[str, Tensor] = {}
        hooks[last_resid(module)] = lambda v, pt: final.__setitem__("x", v)
        with torch.enable_grad(), hooked(module, hooks):
            module(k.tokens)
            out = model_output(module, final["x"], decoder)
            value = _checked(fn(out), 1, name)[0]
            grads = torch.autograd.grad(value, [acts[i] for i in range(L)], allow_unused=True)
    corrupt_metric = float(value.detach())
    clean_acts = {
        "heads": clean_run.z,
        "heads_pos": clean_run.z,
        "resid": clean_run.resid_pre,
        "mlp": clean_run.mlp_out,
    }[site]
    rows = []
    for i in range(L):
        g = torch.zeros_like(acts[i]) if grads[i] is None else grads[i]
        delta = (clean_acts[i] - acts[i].detach()) * g  # (1, seq, ...)
        if site == "heads":
            rows.append(delta[0].sum(dim=(0, 2)))  # (n_heads,)
        elif site == "heads_pos":
            rows.append(delta[0].sum(dim=2).T)  # (n_heads, seq)
        elif site == "resid":
            rows.append(delta[0].sum(dim=1))  # (seq,)
        else:
            rows.append(delta.sum().reshape(()))
    estimate = _stack_rows(rows, site)
    patched = corrupt_metric + estimate
    return PatchResult(
        site=site, axes=SITES[site], effect=_normalise(patched, clean_metric, corrupt_metric),
        patched_metric=patched, clean_metric=clean_metric, corrupt_metric=corrupt_metric,
        method="attribution", tokens=_tokens(model, c),
        first_difference=_first_difference(c.tokens, k.tokens), metric_name=name,
    )  # fmt: skip


def _stack_rows(rows: list[Tensor], site: str) -> Tensor:
    """Per-layer rows (heads may differ in count after pruning) -> one NaN-padded tensor."""
    if site == "mlp":
        return torch.stack(rows)
    width = max(r.shape[0] for r in rows)
    out = torch.full((len(rows), width, *rows[0].shape[1:]), float("nan"))
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


def correlation(a: PatchResult, b: PatchResult) -> float:
    """Pearson correlation of two results' effects over the sites both define (e.g. attribution vs real)."""
    x, y = a.effect.flatten().double(), b.effect.flatten().double()
    ok = torch.isfinite(x) & torch.isfinite(y)
    x, y = x[ok] - x[ok].mean(), y[ok] - y[ok].mean()
    denom = float(x.norm() * y.norm())
    return float((x * y).sum()) / denom if denom > 0 else float("nan")


# ---------------------------------------------------------------------------------------------- paths
@torch.no_grad()
def _check_pairs(module: nn.Module, **named: Sequence[tuple[int, int]]) -> None:
    """Each of ``named`` (senders, receivers) a non-empty sequence of (layer, head) pairs of ``module``."""
    L = len(module.blocks)
    for what, pairs in named.items():
        if not pairs:
            raise ValueError(f"{what} must name at least one (layer, head)")
        for pair in pairs:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise TypeError(f"{what} must hold (layer, head) pairs; got {pair!r}")
            layer, head = pair
            if not isinstance(layer, int) or not 0 <= layer < L:
                raise ValueError(f"{what}: layer must be in [0, {L}); got {layer!r}")
            n = module.blocks[layer].attn.n_heads
            if not isinstance(head, int) or not 0 <= head < n:
                raise ValueError(f"{what}: head must be in [0, {n}) for layer {layer}; got {head!r}")


def _frozen_z(
    n_layers: int, clean_run: FullRun, corrupt_run: FullRun, senders: Sequence[tuple[int, int]]
) -> dict:
    """Hook functions on every layer's ``hook_z`` [1, seq, n_heads, d_head] that hold it at the corrupt
    run's values, the ``senders``' heads at the clean run's."""
    send: dict[int, list[int]] = {}
    for layer, head in senders:
        send.setdefault(layer, []).append(head)

    def frozen_z(layer: int) -> Callable:
        def fn_(z: Tensor, point: Any) -> Tensor:  # (1, seq, n_heads, d_head)
            out = corrupt_run.z[layer].clone()
            for h in send.get(layer, []):
                out[:, :, h] = clean_run.z[layer][:, :, h]
            return out

        return fn_

    return {f"blocks.{i}.attn.hook_z": frozen_z(i) for i in range(n_layers)}


def path_patch(
    model: Any,
    clean: Any,
    corrupt: Any,
    senders: Sequence[tuple[int, int]],
    receivers: Sequence[tuple[int, int]],
    *,
    receiver_input: str = "q",
    metric: Metric | None = None,
    answer: Any = None,
    other: Any = None,
) -> dict[str, float]:
    """The effect of ``senders`` (clean) on the metric only through ``receivers``' q, k or v inputs.

    Returns ``{"effect", "patched_metric", "clean_metric", "corrupt_metric"}``; ``effect`` is normalised
    as in :func:`patch`. Senders and receivers are ``(layer, head)`` pairs; only senders below a
    receiver's layer can reach it. With grouped-query attention, a receiver's k/v input is its key/value
    head's (shared by its group).
    """
    if receiver_input not in ("q", "k", "v"):
        raise ValueError(f"receiver_input must be 'q', 'k' or 'v'; got {receiver_input!r}")
    module = stack_of(model, "path_patch")
    decoder = is_decoder(module)
    _check_pairs(module, senders=senders, receivers=receivers)
    c, k = _pair(model, clean, corrupt)
    with eval_mode(module):
        clean_run = full_run(module, c.tokens, decoder)
        corrupt_run = full_run(module, k.tokens, decoder)
        fn, name = _metric_fn(model, module, metric, answer, other, clean_run.output)
        clean_metric = float(_checked(fn(clean_run.output), 1, name)[0])
        corrupt_metric = float(_checked(fn(corrupt_run.output), 1, name)[0])
        point = f"hook_{receiver_input}"
        by_layer: dict[int, list[int]] = {}
        for layer, head in receivers:
            attn = module.blocks[layer].attn
            index = head if receiver_input == "q" else head // attn.group_size
            by_layer.setdefault(layer, []).append(index)
        recorded: dict[int, Tensor] = {}
        hooks = _frozen_z(len(module.blocks), clean_run, corrupt_run, senders)
        for layer in by_layer:
            hooks[f"blocks.{layer}.attn.{point}"] = lambda v, pt, layer=layer: recorded.__setitem__(
                layer, v.clone()
            )
        with hooked(module, hooks):
            module(k.tokens)

        def replace(layer: int) -> Callable:
            def fn_(v: Tensor, pt: Any) -> Tensor:  # (1, seq, heads, d_head)
                v = v.clone()
                for i in by_layer[layer]:
                    v[:, :, i] = recorded[layer][:, :, i]
                return v

            return fn_

        final: dict[str, Tensor] = {}
        hooks = {f"blocks.{layer}.attn.{point}": replace(layer) for layer in by_layer}
        hooks[last_resid(module)] = lambda v, pt: final.__setitem__("x", v)
        with hooked(module, hooks):
            module(k.tokens)
        patched = float(_checked(fn(model_output(module, final["x"], decoder)), 1, name)[0])
    effect = float(_normalise(torch.tensor([patched]), clean_metric, corrupt_metric)[0])
    return {
        "effect": effect,
        "patched_metric": patched,
        "clean_metric": clean_metric,
        "corrupt_metric": corrupt_metric,
    }
