"""AtP*: attribution patching with the QK fix and GradDrop, over a task's pairs (Kramár et al. 2024).

**What is estimated.** The convention of :func:`.patching.patch` (denoising): the effect of a component
``n`` is ``c(n) = M(corrupt run, n's activation from the clean run) - M(corrupt run)``, with ``M`` the
task metric ``logit(answer) - logit(other)`` at each pair's last position, averaged over the pairs (each
pair patched with its own clean activation). ``effect = c / (M(clean) - M(corrupt))``: 1 = the clean
behaviour restored, 0 = nothing.

Sites (``site=``; every layer the same head counts, as for :mod:`.graph`):

* ``"heads"``: each head's ``z`` (its mixed values, the input of its rows of W_O), all positions
  -> [layer, head];
* ``"heads_pos"``: the same per (absolute) position -> [layer, head, position];
* ``"mlp"``: each MLP's output -> [layer];
* ``"queries"``: each query head's ``q`` (after its bias and rotary), all positions -> [layer, head];
* ``"keys"``: each key/value head's ``k`` (after bias and rotary; under grouped-query attention shared by
  its group's query heads) -> [layer, kv_head];
* ``"edges"``: the circuit graph's edges (:mod:`.atp_edges`; plain AtP only, ``method="atp"``) -> an
  :class:`~headspace.analysis.circuits.EdgeScores` [sender, receiver].

**AtP** (first order, one clean forward, one corrupt forward and backward per batch of pairs)::

    AtP(n) = mean over pairs of (a_n(clean) - a_n(corrupt)) . dM/da_n (corrupt)

**The QK fix** (queries and keys). A query or key reaches ``M`` only through its head's attention
pattern ``A = softmax(q k^T scale + causal mask)``, which a patch may move from saturation, where the
gradient is ~0. AtP* computes the patched pattern exactly, ``A' = softmax(q' k'^T ...)`` with the node's
clean ``q`` (or ``k``, for every query head of its group) and every other input corrupt, and linearises
from the pattern onward::

    QK(n) = mean over pairs of sum over heads, queries, keys of (A' - A) . dM/dA (corrupt)

A head's ``z`` (and an MLP's output) is already downstream of its own softmax: ``z(clean) - z(corrupt)``
is exact, so for those sites the fix changes nothing (AtP* = AtP + GradDrop there).

**GradDrop** (cancellation between paths). For each layer ``l`` the same estimate ``c_l(n)`` is taken with
the gradient through block ``l``'s residual contribution (its attention output plus its MLP output) set
to zero in the backward pass. For a node below ``l`` that is the gradient of ``M`` at block ``l``'s input
through the skip connection only: ``dM/dresid_post(l)`` pulled back from ``resid_pre(l)`` (one backward
from ``resid_pre(l)`` down, ``L - 1`` of them, the ``l``-th through ``l`` blocks); for a node in block
``l`` it is 0; above ``l`` it is the plain estimate. The AtP* score (a magnitude, what it ranks by)::

    AtP*(n) = 1 / (L - 1) * sum over l of |c_l(n)|

so a node without cancellation keeps ``|c(n)|`` (``L - 1`` terms equal ``|c(n)|``, one is 0) and a node whose
direct and indirect paths cancel scores by the size of the paths. The signed estimate (AtP with the QK
fix) is ``estimate``; ``score`` ranks. The means over pairs are taken before the absolute values.

**The diagnostic** (:func:`atp_star_diagnostic`): exact patching (:func:`exact_effects`) of a uniform
random subset of the components ranked below the top ``k``; the number ``x`` of them whose exact
``|effect|`` exceeds ``threshold`` bounds the fraction ``p`` of false negatives among all those below the
top ``k`` by the one-sided Clopper-Pearson bound: ``P(X <= x; m, p_upper) = 1 - confidence`` (conservative
for sampling without replacement). ``p_upper`` bounds the probability that a component below the top
``k``, drawn at random, has an exact effect above the threshold; ``p_upper * n_below`` the expected count.

The forward here is the decoder's own maths written out (the attention pattern explicit; pre-norm
decoders of :func:`.graph.graph_of`, no QK-norm, soft-cap or sliding window): a test holds it to the
model's logits.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ...core.checks import is_int
from ...nn.spec import features_of
from .._common import JsonResult, eval_mode
from ..causal.causal_inputs import stack_of
from .edges import task_of
from .graph import RotaryTables, frozen_parameters, graph_of, project_qkv
from .tasks import Task

__all__ = [
    "METHODS",
    "SITES",
    "AtPStarResult",
    "Diagnostic",
    "atp_star",
    "atp_star_diagnostic",
    "binomial_upper_bound",
    "exact_effects",
]

#: site -> the axes of its result
SITES: dict[str, tuple[str, ...]] = {
    "heads": ("layer", "head"),
    "heads_pos": ("layer", "head", "position"),
    "mlp": ("layer",),
    "queries": ("layer", "head"),
    "keys": ("layer", "kv_head"),
}
#: the estimators of :func:`atp_star`
METHODS = ("atp", "atp*")
#: the activation each site patches, as named in :class:`_Run`
_NODE = {"heads": "z", "heads_pos": "z", "mlp": "mlp", "queries": "q", "keys": "k"}


@dataclass
class AtPStarResult(JsonResult):
    """Per component of ``site``: ``estimate`` [*axes], the signed estimate of ``c(n)`` (metric units, mean
    over pairs; exact for ``method="exact"``); ``score`` [*axes] >= 0, what ranks the components
    (``|estimate|``, or GradDrop's mean of ``|c_l(n)|`` for AtP*); ``effect`` = estimate / (clean_metric -
    corrupt_metric). ``clean_metric``/``corrupt_metric``: M of the unpatched runs. ``diagnostic``: the
    dict of :class:`Diagnostic` once one was run."""

    kind = "atp_star"

    site: str
    axes: tuple[str, ...]
    method: str
    estimate: Tensor
    score: Tensor
    effect: Tensor
    clean_metric: float
    corrupt_metric: float
    n_pairs: int
    qk_fix: bool = False
    graddrop: bool = False
    diagnostic: dict[str, Any] | None = None

    def ranking(self) -> list[tuple[int, ...]]:
        """Every component's index, largest ``score`` first."""
        order = self.score.flatten().argsort(descending=True, stable=True).tolist()
        return [tuple(int(i) for i in torch.unravel_index(torch.tensor(j), self.score.shape)) for j in order]

    def top(self, k: int = 10) -> list[tuple[tuple[int, ...], float]]:
        """The ``k`` best-ranked components with their normalised effect: ``[((layer, head), effect)]``."""
        return [(idx, float(self.effect[idx])) for idx in self.ranking()[:k]]


@dataclass
class Diagnostic(JsonResult):
    """:func:`atp_star_diagnostic`'s bound (module docstring): of the ``n_below`` components ranked below
    the top ``k``, ``n_sampled`` drawn at random were patched exactly; ``hits`` those with exact
    ``|effect| > threshold`` (index, exact effect); ``p_upper`` the upper confidence bound on the fraction
    of false negatives below the top ``k`` (at ``confidence``), ``expected_false_negatives_upper`` =
    ``p_upper * n_below``; ``sampled``/``sampled_effects`` every drawn component and its exact effect."""

    kind = "atp_star_diagnostic"

    k: int
    threshold: float
    confidence: float
    n_below: int
    n_sampled: int
    hits: list[tuple[tuple[int, ...], float]]
    p_upper: float
    expected_false_negatives_upper: float
    sampled: list[tuple[int, ...]] = field(default_factory=list)
    sampled_effects: list[float] = field(default_factory=list)


# ------------------------------------------------------------------------------------------ the forward
@dataclass
class _Run:
    """One batched run: per layer (from the first run) the stream entering it ``resid`` [B, S, d] (one more
    at the end: the final stream), ``q`` [B, H, S, dh], ``k`` [B, Hkv, S, dh], pattern ``A`` [B, H, S, S],
    ``z`` [B, H, S, dh], ``mlp`` [B, S, d]; ``metric`` [B] per row."""

    resid: list[Tensor] = field(default_factory=list)
    q: list[Tensor] = field(default_factory=list)
    k: list[Tensor] = field(default_factory=list)
    A: list[Tensor] = field(default_factory=list)
    z: list[Tensor] = field(default_factory=list)
    mlp: list[Tensor] = field(default_factory=list)
    metric: Tensor | None = None


Patch = Callable[[int, str, Tensor], Tensor]


def _pattern(attn: Any, q: Tensor, k: Tensor) -> Tensor:
    """softmax(q k^T scale + causal mask) [B, H, S, S] from q [B, H, S, dh], k [B, Hkv, S, dh]."""
    H, Hkv, S = q.shape[1], k.shape[1], q.shape[2]
    if Hkv != H:
        k = k.repeat_interleave(H // Hkv, dim=1)  # (B, H, S, dh)
    s = (q @ k.transpose(-1, -2)) * attn.scale  # (B, H, S, S)
    mask = torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1)  # (S, S), True above the diagonal
    return s.masked_fill(mask, float("-inf")).softmax(-1)


def _block(block: Any, resid: Tensor, tables: Any, layer: int, run: _Run, patch: Patch | None) -> Tensor:
    """One pre-norm block written out, recording into ``run``; ``patch(layer, name, value)`` may replace
    q, k, z or the MLP's output."""
    attn = block.attn
    run.resid.append(resid)  # the stream entering the block
    q, k, v = project_qkv(attn, block.ln1(resid))  # (B, H, S, dh), (B, Hkv, S, dh) x 2
    if attn.b_Q is not None:
        q = q + attn.b_Q[None, :, None, :]  # (B, H, S, dh)
        k = k + attn.b_K[None, :, None, :]  # (B, Hkv, S, dh)
        v = v + attn.b_V[None, :, None, :]  # (B, Hkv, S, dh)
    if attn.rotary is not None:
        q, k = tables.rotate(attn, q, k)
    if patch is not None:
        q, k = patch(layer, "q", q), patch(layer, "k", k)
    A = _pattern(attn, q, k)  # (B, H, S, S)
    if attn.n_kv_heads != attn.n_heads:
        v = v.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=1)  # (B, H, S, dh)
    z = A @ v  # (B, H, S, dh)
    if patch is not None:
        z = patch(layer, "z", z)
    out = z.transpose(1, 2).flatten(2) @ attn.W_O.flatten(0, 1)  # (B, S, H dh) @ (H dh, d) -> (B, S, d)
    if attn.b_O is not None:
        out = out + attn.b_O
    resid = resid + out
    m = block.mlp(block.ln2(resid))  # (B, S, d)
    if patch is not None:
        m = patch(layer, "mlp", m)
    run.q.append(q)
    run.k.append(k)
    run.A.append(A)
    run.z.append(z)
    run.mlp.append(m)
    return resid + m


def _forward(module: nn.Module, x: Tensor, part: Task, *, start: int = 0, patch: Patch | None = None) -> _Run:
    """The run from the stream ``x`` [B, S, d] entering block ``start`` (the embeddings for 0) to ``M``
    per row [B] (rows ``B`` a multiple of the pairs: pair ``r % n_pairs``)."""
    run = _Run()
    tables = RotaryTables(torch.arange(x.shape[1], device=x.device))  # positions (S,)
    resid = x
    for layer in range(start, len(module.blocks)):
        resid = _block(module.blocks[layer], resid, tables, layer, run, patch)
    run.resid.append(resid)
    reps = x.shape[0] // len(part)
    last = part.last.to(x.device).repeat(reps)  # (B,)
    rows = resid[torch.arange(x.shape[0], device=x.device), last]  # (B, d)
    if module.ln_final is not None:
        rows = module.ln_final(rows)
    W_U = module.W_U  # (d, vocab)
    a = W_U[:, part.answer.to(x.device).repeat(reps)].T  # (B, d)
    b = W_U[:, part.other.to(x.device).repeat(reps)].T  # (B, d)
    run.metric = (rows * a).sum(-1) - (rows * b).sum(-1)  # (B,)
    return run


def _check_model(model: Any, what: str) -> nn.Module:
    module = stack_of(model, what)
    graph_of(module)  # pre-norm decoder blocks, one head count: refused by name otherwise
    for i, block in enumerate(module.blocks):
        # the block's description says what its attention adds to plain softmax attention
        used = features_of(block.spec)
        if used:
            raise TypeError(f"{what} writes out plain softmax attention; block {i} has {', '.join(used)}")
    return module


def _check_site(site: Any) -> str:
    if site not in SITES:
        raise ValueError(f"site must be one of {list(SITES)}; got {site!r}")
    return site


def _chunks(task: Task, batch_size: Any) -> list[Task]:
    if not is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int; got {batch_size!r}")
    return [task.subset(slice(i, i + batch_size)) for i in range(0, len(task), batch_size)]


def _shape(site: str, module: nn.Module, seq: int) -> tuple[int, ...]:
    attn = module.blocks[0].attn
    L = len(module.blocks)
    return {
        "heads": (L, attn.n_heads),
        "heads_pos": (L, attn.n_heads, seq),
        "mlp": (L,),
        "queries": (L, attn.n_heads),
        "keys": (L, attn.n_kv_heads),
    }[site]


# ----------------------------------------------------------------------------------------- estimates
def _contribution(site: str, delta: Tensor, grad: Tensor | None, attn: Any) -> Tensor:
    """sum over pairs of delta . grad, reduced to one layer's row of the result: delta and grad are [B, H,
    S, dh] (z), [B, S, d] (mlp), [B, H, S, S] (a pattern change), [B, H|Hkv, S, dh] (q, k)."""
    if site == "mlp":
        return torch.zeros(()) if grad is None else (delta * grad).sum()
    if grad is None:
        grad = torch.zeros_like(delta)
    prod = delta * grad  # (B, H, S, *)
    if site == "heads_pos":
        return prod.sum(dim=(0, 3))  # (H, S)
    per_head = prod.sum(dim=(0, 2, 3))  # (H,) or (Hkv,)
    if site == "keys" and per_head.shape[0] != attn.n_kv_heads:  # pattern changes of the group's heads
        return per_head.reshape(attn.n_kv_heads, -1).sum(-1)  # (Hkv, group) -> (Hkv,)
    return per_head


def _deltas(module: nn.Module, site: str, clean: _Run, corrupt: _Run, qk_fix: bool) -> list[Tensor]:
    """Per layer the change the estimate multiplies by a gradient (detached): the activation's clean
    minus corrupt, or (the QK fix) the exact pattern change ``A' - A`` [B, H, S, S]."""
    out = []
    for layer, block in enumerate(module.blocks):
        node = _NODE[site]
        if qk_fix and site == "queries":
            A2 = _pattern(block.attn, clean.q[layer], corrupt.k[layer])  # (B, H, S, S)
            out.append((A2 - corrupt.A[layer]).detach())
        elif qk_fix and site == "keys":
            A2 = _pattern(block.attn, corrupt.q[layer], clean.k[layer])  # (B, H, S, S)
            out.append((A2 - corrupt.A[layer]).detach())
        else:
            out.append((getattr(clean, node)[layer] - getattr(corrupt, node)[layer]).detach())
    return out


def _graddrop_terms(
    module: nn.Module, site: str, run: _Run, nodes: list[Tensor], deltas: list[Tensor], base: list[Tensor],
    resid_grads: list[Tensor],
) -> Tensor:  # fmt: skip
    """c_l(n) for every dropped layer l [L, L, *row] (dim 0: l, dim 1: the node's layer): the plain
    estimate above l, 0 at l, below l the pullback from ``resid_pre(l)`` of ``dM/dresid_post(l)``
    (``resid_grads[l]``)."""
    L = len(module.blocks)
    terms = torch.zeros(L, *torch.stack(base).shape)  # (L, L, *row)
    for l in range(L):
        terms[l, l + 1 :] = torch.stack(base[l + 1 :]) if l + 1 < L else 0
        if l == 0:
            continue
        grads = torch.autograd.grad(
            run.resid[l], nodes[:l], grad_outputs=resid_grads[l], retain_graph=True, allow_unused=True
        )
        for j in range(l):
            terms[l, j] = _contribution(site, deltas[j], grads[j], module.blocks[j].attn)
    return terms


def _estimate_part(
    module: nn.Module, part: Task, site: str, qk_fix: bool, graddrop: bool
) -> tuple[Tensor, Tensor | None, float, float]:
    """One batch of pairs: (sum over pairs of the estimate [*shape], GradDrop's c_l summed over pairs
    [L, *shape] or None, sum of M clean, sum of M corrupt)."""
    dev = next(module.parameters()).device
    with torch.no_grad():
        clean = _forward(module, module.embed(part.clean.to(dev)), part)
        x = module.embed(part.corrupt.to(dev))  # (B, S, d)
    with torch.enable_grad(), frozen_parameters(module):
        run = _forward(module, x.detach().requires_grad_(True), part)
        M = run.metric.sum()
        fix = qk_fix and site in ("queries", "keys")
        nodes = run.A if fix else getattr(run, _NODE[site])
        deltas = _deltas(module, site, clean, run, qk_fix)
        L = len(module.blocks)
        got = torch.autograd.grad(M, list(nodes) + run.resid[1:], retain_graph=graddrop, allow_unused=True)
        base = [_contribution(site, deltas[j], got[j], module.blocks[j].attn) for j in range(L)]
        terms = None
        if graddrop:  # got[L + l] = dM at the stream leaving block l (entering l + 1, or the final one)
            terms = _graddrop_terms(module, site, run, list(nodes), deltas, base, list(got[L:]))
    return torch.stack(base), terms, float(clean.metric.sum()), float(run.metric.detach().sum())


def _place(total: Tensor, value: Tensor) -> None:
    """Add a batch's sums into the task's: a heads_pos batch is [.., S_batch], the task's [.., S]
    (positions beyond a batch's width get nothing from it)."""
    total[..., : value.shape[-1]] += value


def atp_star(
    model: Any, task: Any, site: str = "heads", *, method: str = "atp*", qk_fix: bool | None = None,
    graddrop: bool | None = None, batch_size: int = 32,
) -> Any:  # fmt: skip
    """AtP* (or plain AtP) estimates of every component's patching effect on ``task`` (module docstring).

    Args:
        model: a loaded pre-norm decoder (``headspace.load("smollm2")``) or a bare Decoder.
        task: a :class:`~headspace.analysis.tasks.Task` or ``"ioi"`` (the built-in task, 256 pairs).
        site: "heads", "heads_pos", "mlp", "queries", "keys" or "edges" (with ``method="atp"``).
        method: "atp*" (QK fix and GradDrop) or "atp" (neither); ``qk_fix``/``graddrop`` override one fix.
        batch_size: at most this many pairs per forward pass.

    Returns:
        :class:`AtPStarResult`: ``estimate`` [*axes] (signed, metric units), ``score`` [*axes] (the ranking:
        GradDrop's ``1/(L-1) sum_l |c_l|`` with ``graddrop``, else ``|estimate|``), ``effect`` normalised;
        for ``site="edges"`` an :class:`~headspace.analysis.circuits.EdgeScores` (:mod:`.atp_edges`).
    """
    if site == "edges":
        return _edges(model, task, method, qk_fix, graddrop, batch_size)
    site = _check_site(site)
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}; got {method!r}")
    star = method == "atp*"
    qk_fix = star if qk_fix is None else bool(qk_fix)
    graddrop = star if graddrop is None else bool(graddrop)
    module = _check_model(model, "atp_star")
    task = task_of(model, task)
    L = len(module.blocks)
    shape = _shape(site, module, task.clean.shape[1])
    est = torch.zeros(shape, dtype=torch.float64)
    terms = torch.zeros(L, *shape, dtype=torch.float64) if graddrop else None
    clean_m = corrupt_m = 0.0
    with eval_mode(module):
        for part in _chunks(task, batch_size):
            e, t, c, k = _estimate_part(module, part, site, qk_fix, graddrop)
            _place(est, e.double())
            if terms is not None and t is not None:
                _place(terms, t.double())
            clean_m, corrupt_m = clean_m + c, corrupt_m + k
    n = len(task)
    est, clean_m, corrupt_m = est / n, clean_m / n, corrupt_m / n
    if terms is not None and L > 1:
        score = (terms / n).abs().sum(0) / (L - 1)  # GradDrop: 1/(L-1) sum_l |c_l(n)|
    else:
        score = est.abs()
    return AtPStarResult(
        site=site, axes=SITES[site], method=_method_name(qk_fix, graddrop), estimate=est.float(),
        score=score.float(), effect=_normalised(est, clean_m, corrupt_m).float(), clean_metric=clean_m,
        corrupt_metric=corrupt_m, n_pairs=n, qk_fix=qk_fix, graddrop=graddrop,
    )  # fmt: skip


def _edges(model: Any, task: Any, method: Any, qk_fix: Any, graddrop: Any, batch_size: int) -> Any:
    """``site="edges"``: plain AtP over the graph's edges; the fixes refused by name (:mod:`.atp_edges`)."""
    from .atp_edges import atp_edges  # beside this module; it imports the circuits' scoring

    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}; got {method!r}")
    star = method == "atp*"
    if (star if qk_fix is None else bool(qk_fix)) or (star if graddrop is None else bool(graddrop)):
        raise ValueError(
            "site 'edges' takes method='atp' (plain AtP, EAP's cost): the QK fix and GradDrop per edge are "
            f"not implemented; got method={method!r}, qk_fix={qk_fix!r}, graddrop={graddrop!r}"
        )
    return atp_edges(model, task, batch_size=batch_size)


def _method_name(qk_fix: bool, graddrop: bool) -> str:
    if qk_fix and graddrop:
        return "atp*"
    return "atp" + ("+qk" if qk_fix else "") + ("+graddrop" if graddrop else "")


def _normalised(values: Tensor, clean: float, corrupt: float) -> Tensor:
    denom = clean - corrupt
    if abs(denom) <= 1e-12 * max(1.0, abs(clean)):
        return torch.zeros_like(values)
    return values / denom


# ------------------------------------------------------------------------------------------ exact
def _replacer(site: str, comps: list[tuple[int, ...]], clean: _Run, B: int) -> Patch:
    """``patch`` for a batch of ``len(comps)`` x ``B`` rows (component-major), all of one layer: each block
    of ``B`` rows gets its component's clean activation."""
    layer = comps[0][0]
    node = _NODE[site]

    def fn(at: int, name: str, value: Tensor) -> Tensor:
        if at != layer or name != node:
            return value
        value = value.clone()
        src = getattr(clean, node)[layer]  # (B, ...)
        for r, c in enumerate(comps):
            rows = slice(r * B, (r + 1) * B)
            if site == "mlp":
                value[rows] = src
            elif site == "heads_pos":
                if c[2] < value.shape[2]:  # beyond this batch's width: padding, no effect
                    value[rows, c[1], c[2]] = src[:, c[1], c[2]]
            else:
                value[rows, c[1]] = src[:, c[1]]
        return value

    return fn


@torch.no_grad()
def exact_effects(
    model: Any, task: Any, site: str = "heads", components: Sequence[tuple[int, ...]] | None = None, *,
    batch_size: int = 32, max_rows: int = 2048,
) -> AtPStarResult:  # fmt: skip
    """Exact patching, batched over the pairs: ``c(n) = mean over pairs of M(corrupt, n clean) - M(corrupt)``
    for each component (every one of ``site``, or ``components``: index tuples such as ``(layer, head)``;
    the others NaN). Each patched run starts at its component's layer from the corrupt stream; runs of one
    layer travel together, at most ``max_rows`` rows (components x pairs) per pass.

    Returns:
        :class:`AtPStarResult` with ``method="exact"``, ``score = |estimate|``.
    """
    site = _check_site(site)
    module = _check_model(model, "exact_effects")
    task = task_of(model, task)
    shape = _shape(site, module, task.clean.shape[1])
    if components is None:
        comps = list(itertools.product(*(range(n) for n in shape)))
    else:
        comps = [_checked_index(c, shape, site) for c in components]
    total = torch.full(shape, float("nan"), dtype=torch.float64)
    for c in comps:
        total[c] = 0.0
    clean_m = corrupt_m = 0.0
    dev = next(module.parameters()).device
    with eval_mode(module):
        for part in _chunks(task, batch_size):
            B = len(part)
            clean = _forward(module, module.embed(part.clean.to(dev)), part)
            corrupt = _forward(module, module.embed(part.corrupt.to(dev)), part)
            clean_m += float(clean.metric.sum())
            corrupt_m += float(corrupt.metric.sum())
            by_layer: dict[int, list[tuple[int, ...]]] = {}
            for c in comps:
                by_layer.setdefault(c[0], []).append(c)
            per = max(1, max_rows // B)
            for layer, group in by_layer.items():
                for i in range(0, len(group), per):
                    chunk = group[i : i + per]
                    x = corrupt.resid[layer].repeat(len(chunk), 1, 1)  # (n B, S, d)
                    out = _forward(module, x, part, start=layer, patch=_replacer(site, chunk, clean, B))
                    diff = (out.metric - corrupt.metric.repeat(len(chunk))).reshape(len(chunk), B)  # (n, B)
                    for c, d in zip(chunk, diff.sum(1).tolist()):
                        total[c] += d
    n = len(task)
    est, clean_m, corrupt_m = total / n, clean_m / n, corrupt_m / n
    return AtPStarResult(
        site=site, axes=SITES[site], method="exact", estimate=est.float(), score=est.abs().float(),
        effect=_normalised(est, clean_m, corrupt_m).float(), clean_metric=clean_m, corrupt_metric=corrupt_m,
        n_pairs=n,
    )  # fmt: skip


def _checked_index(c: Any, shape: tuple[int, ...], site: str) -> tuple[int, ...]:
    idx = (c,) if is_int(c) else tuple(c) if isinstance(c, (tuple, list)) else None
    if idx is None or len(idx) != len(shape) or not all(is_int(i) and 0 <= i < n for i, n in zip(idx, shape)):
        raise ValueError(f"a {site} component is an index into {list(shape)} ({SITES[site]}); got {c!r}")
    return tuple(int(i) for i in idx)


# ------------------------------------------------------------------------------------------ diagnostic
def binomial_upper_bound(hits: int, n: int, confidence: float = 0.95) -> float:
    """The one-sided Clopper-Pearson upper bound on a proportion ``p`` after ``hits`` of ``n`` draws: the
    ``p`` where ``P(X <= hits; n, p) = 1 - confidence`` (1.0 when ``hits == n``; by bisection on the exact
    binomial CDF)."""
    if not (is_int(n) and n >= 1 and is_int(hits) and 0 <= hits <= n):
        raise ValueError(f"need 0 <= hits <= n, n >= 1; got hits={hits!r}, n={n!r}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1); got {confidence!r}")
    if hits == n:
        return 1.0
    alpha = 1.0 - confidence

    def cdf(p: float) -> float:
        return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(hits + 1))

    lo, hi = 0.0, 1.0
    for _ in range(60):  # cdf falls as p grows
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) > alpha else (lo, mid)
    return hi


def atp_star_diagnostic(
    model: Any, task: Any, result: AtPStarResult, *, k: int, threshold: float, samples: int = 32,
    confidence: float = 0.95, seed: int = 0, batch_size: int = 32,
) -> Diagnostic:  # fmt: skip
    """Bound the false negatives of ``result``'s ranking (module docstring): ``samples`` components drawn
    uniformly (``seed``) from those ranked below the top ``k`` are patched exactly; ``threshold`` is on
    the normalised ``|effect|``. The diagnostic is also stored in ``result.diagnostic``."""
    if not isinstance(result, AtPStarResult):
        raise TypeError(f"result must be an AtPStarResult (from atp_star); got {type(result).__name__}")
    order = result.ranking()
    if not is_int(k) or not 0 <= k < len(order):
        raise ValueError(f"k must be an int in [0, {len(order)}) (components ranked); got {k!r}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold >= 0:
        raise ValueError(f"threshold must be a number >= 0 (an |effect|); got {threshold!r}")
    if not is_int(samples) or samples < 1:
        raise ValueError(f"samples must be a positive int; got {samples!r}")
    below = order[k:]
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(len(below), generator=g)[: min(samples, len(below))].tolist()
    drawn = [below[i] for i in pick]
    exact = exact_effects(model, task, result.site, drawn, batch_size=batch_size)
    effects = [float(exact.effect[c]) for c in drawn]
    hits = [(c, e) for c, e in zip(drawn, effects) if abs(e) > threshold]
    p_upper = binomial_upper_bound(len(hits), len(drawn), confidence)
    if len(drawn) == len(below):  # every one checked: the count is known, not bounded
        p_upper = len(hits) / len(below)
    diag = Diagnostic(
        k=k, threshold=float(threshold), confidence=confidence, n_below=len(below), n_sampled=len(drawn),
        hits=hits, p_upper=p_upper, expected_false_negatives_upper=p_upper * len(below), sampled=drawn,
        sampled_effects=effects,
    )  # fmt: skip
    result.diagnostic = diag.to_dict()
    return diag
