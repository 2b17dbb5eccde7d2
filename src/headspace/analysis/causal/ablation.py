"""Head importance: how much a metric changes when one head is ablated.

For each (layer, head) the model is run with that head ablated (:func:`headspace.ablate`, ``"zero"`` or
``"mean"``) and a metric is compared with the unablated run:

* ``"cosine"`` (encoders): sentence embeddings ``e_i`` (the pretrained wrapper's ``encode()``, or the
  mean of the real tokens' final states) with and without the head; score ``1 - mean_i cos(e_i, e'_i)``.
* ``"loss"`` (decoders): mean next-token cross-entropy over real tokens; score ``loss' - loss``.
* a callable ``metric(model) -> float``: score ``metric under ablation - metric``.

Larger scores mean a more important head for the built-in metrics. Loops over many heads show a
progress bar (rate and ETA; :func:`headspace.progress.progress_bar`: plain lines in a log).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...core.checks import is_int
from ...core.progress import progress_bar
from .._common import Batch, JsonResult, eval_mode, format_number, layer_head_table, make_batches, pad_heads
from ..trace.trace import as_module, attention_layers, hooked, trace
from .interventions import ABLATION_MODES, ablate
from .losses import LOSS_ROWS as LOSS_ROWS  # the names' old home: importable here
from .losses import LOSS_SUM_BLOCK as LOSS_SUM_BLOCK
from .losses import LOSS_VOCAB_TILE as LOSS_VOCAB_TILE
from .losses import next_token_loss as next_token_loss
from .losses import unembedded_loss as unembedded_loss

METRICS = ("auto", "cosine", "loss")


@dataclass
class HeadImportance(JsonResult):
    """Per-head importance.

    * ``scores``: [n_layers, max_heads], the change of the metric when the head is ablated (larger =
      more important for ``"cosine"`` and ``"loss"``); NaN for heads not evaluated or absent (pruned);
    * ``ablated``: [n_layers, max_heads], the metric with the head ablated (mean cosine to the
      unablated embeddings, or the loss);
    * ``baseline``: the metric without ablation (1.0 for ``"cosine"``);
    * ``metric``: ``"cosine"``, ``"loss"`` or the callable's name; ``mode``: ``"zero"`` or ``"mean"``.
    """

    kind = "head_importance"

    scores: Tensor
    ablated: Tensor
    baseline: float
    metric: str
    mode: str

    def ranking(self) -> list[tuple[int, int, float]]:
        """(layer, head, score) of the evaluated heads, most important first."""
        items = [
            (i, h, float(s))
            for i, row in enumerate(self.scores)
            for h, s in enumerate(row)
            if not torch.isnan(s)
        ]
        return sorted(items, key=lambda x: -x[2])

    def _html_parts(self) -> list[str]:
        top = ", ".join(f"L{i}H{h} {format_number(v)}" for i, h, v in self.ranking()[:5])
        caption = (
            f"score per head: change of {self.metric} when the head is {self.mode}-ablated "
            f"(baseline {format_number(self.baseline)}); top: {top}"
        )
        return [layer_head_table(self.scores, caption)]


def mean_z(
    model: Any, inputs: Any, *, key_padding: Tensor | None = None, batch_size: int = 32
) -> dict[tuple[int, int], Tensor]:
    """Mean of every head's ``z`` over the real tokens of ``inputs``: ``{(layer, head): [d_head]}``.

    The reference for ``ablate(model, {...: "mean"}, means=mean_z(model, inputs))``. Raises ValueError
    when ``key_padding`` marks no token as real (there is nothing to average).
    """
    module = as_module(model)
    layers = attention_layers(model)
    batches = make_batches(model, inputs, key_padding, batch_size)
    sums: list[Tensor | None] = [None] * len(layers)
    count = 0
    with eval_mode(module):
        for batch in batches:
            with trace(model, "*hook_z") as t:
                batch.run(module)
            w = batch.real.to(torch.float64)[:, :, None, None]  # (batch, seq, 1, 1)
            for i in range(len(layers)):
                s = (t.z(i).to(torch.float64) * w).sum(dim=(0, 1))  # (n_heads, d_head)
                sums[i] = s if sums[i] is None else sums[i] + s
            count += int(batch.real.sum())
    if count == 0:
        raise ValueError(
            "mean_z needs at least one real token to average over; no real token was given (key_padding is "
            "all False, in every sequence of the inputs)"
        )
    means = {}
    for i, (_, attn) in enumerate(layers):
        m = (sums[i] / max(count, 1)).to(attn.o_weight.dtype)  # (n_heads, d_head)
        for h in range(attn.n_heads):
            means[(i, h)] = m[h]
    return means


def _is_decoder(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    return getattr(config, "arch", None) == "decoder"


def _model_kind(module: nn.Module) -> str:
    """``"Encoder (arch='encoder')"``-style description of a model for error messages."""
    arch = getattr(getattr(module, "config", None), "arch", None)
    return type(module).__name__ + (f" (arch={arch!r})" if arch is not None else "")


def _check_heads(
    heads: Any, all_heads: Sequence[tuple[int, int]], layers: Sequence[Any]
) -> list[tuple[int, int]]:
    """``heads`` as (layer, head) tuples ([layer, head] lists accepted), each a head of the model."""
    if isinstance(heads, (str, bytes)) or not isinstance(heads, Iterable):
        raise TypeError(
            f"heads must be a list of (layer, head) pairs, e.g. [(0, 1), (1, 3)]; got {type(heads).__name__}"
        )
    heads = list(heads)
    valid = set(all_heads)
    todo = []
    for idx, pair in enumerate(heads):
        if isinstance(pair, list):
            pair = tuple(pair)  # [layer, head] is unambiguous: the same pair
        if not isinstance(pair, tuple) or len(pair) != 2 or not all(is_int(v) for v in pair):
            one_pair = len(heads) == 2 and all(is_int(v) for v in heads)
            hint = f" (for one head pass heads=[{tuple(heads)!r}])" if one_pair else ""
            raise TypeError(f"heads[{idx}] must be a (layer, head) pair of ints; got {pair!r}{hint}")
        if pair not in valid:
            raise ValueError(
                f"heads: {pair!r} is not a (layer, head) of this model (layers 0..{len(layers) - 1}, "
                f"heads per layer {[a.n_heads for _, a in layers]})"
            )
        todo.append(pair)
    return todo


def replicate(t: Tensor, n: int) -> Tensor:
    """[b, ...] -> [n b, ...]: ``n`` copies stacked on the batch axis (copy ``r``: rows r b .. r b + b)."""
    return t.repeat(n, *([1] * (t.dim() - 1)))  # (n b, ...)


def replica_hook(heads: Sequence[int], mode: str, means: Tensor | None, b: int) -> Callable:
    """A ``hook_z`` function ablating head ``heads[r]`` in copy ``r`` of a replicated batch."""

    def fn(z: Tensor, point: Any) -> Tensor:  # z: (R b, seq, n_heads, d_head)
        z = z.clone()
        zr = z.view(len(heads), b, *z.shape[1:])  # (R, b, seq, n_heads, d_head), a view of the clone
        for r, h in enumerate(heads):
            zr[r, :, :, h] = 0.0 if mode == "zero" else means[h].to(z)
        return z

    return fn


class _Metric:
    """A built-in metric evaluated on R ablated copies of a batch at once: sums and counts per copy."""

    name = ""

    def __init__(self, model: Any, module: nn.Module, batches: Sequence[Batch]) -> None:
        self.model, self.module, self.batches = model, module, batches
        self._setup()

    def _setup(self) -> None:
        """What a metric prepares (or checks) once, before any ablation; nothing by default."""

    def stats(
        self, batch_index: int, out: Tensor, R: int, *, overwrite: bool = False
    ) -> tuple[Tensor, Tensor]:
        """(sum, count) per copy [R] x 2 of ``out`` [R b, seq, ...]; ``overwrite``: ``out`` may be used
        as scratch memory (the engine's own buffer)."""
        raise NotImplementedError

    def positions_read(self, seq: int) -> int:
        """How many leading positions of the output [rows, seq, ...] :meth:`stats` reads (all of them)."""
        return seq

    def base_stats(self, batch_index: int, out: Tensor) -> tuple[Tensor, Tensor]:
        """(sum, count) [1] x 2 of the unablated output ``out`` of batch ``batch_index``; called once per
        batch, before any :meth:`stats` of its ablated copies."""
        return self.stats(batch_index, out, 1)

    def baseline(self) -> float:
        """The metric without ablation: :meth:`baseline_of` the :meth:`base_stats` of one plain run per
        batch."""
        total, count = torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
        for i, batch in enumerate(self.batches):
            t, c = self.base_stats(i, batch.run(self.module))
            total, count = total + t, count + c
        return self.baseline_of(total, count)

    def baseline_of(self, total: Tensor, count: Tensor) -> float:
        """The baseline from the summed :meth:`stats` [1] x 2 of the unablated runs of every batch."""
        raise NotImplementedError

    def value(self, total: Tensor, count: Tensor) -> Tensor:
        return total / count.clamp_min(1)

    def score(self, value: Tensor, baseline: float) -> Tensor:
        return value - baseline


class _Cosine(_Metric):
    """Mean cosine between sentence embeddings with and without the ablation; score 1 - cosine."""

    name = "cosine"

    def _setup(self) -> None:
        self.reference: list[Tensor | None] = [None] * len(self.batches)  # [(b, d_model)], by base_stats

    def base_stats(self, batch_index: int, out: Tensor) -> tuple[Tensor, Tensor]:
        """Keeps the unablated embeddings of the batch (the reference of :meth:`stats`)."""
        self.reference[batch_index] = self.embed(out, self.batches[batch_index].real)  # (b, d_model)
        return super().base_stats(batch_index, out)

    def embed(self, states: Tensor, real: Tensor) -> Tensor:
        """Sentence embeddings [b, d]: the wrapper's pool() (as its encode()), else the masked mean."""
        pool = getattr(self.model, "pool", None)
        if callable(pool):
            return pool(states, real).to(torch.float64)
        w = real.to(torch.float64)[:, :, None]  # (b, seq, 1)
        return (states.to(torch.float64) * w).sum(1) / w.sum(1).clamp_min(1)  # (b, d_model)

    def stats(
        self, batch_index: int, out: Tensor, R: int, *, overwrite: bool = False
    ) -> tuple[Tensor, Tensor]:
        batch = self.batches[batch_index]
        ref = self.reference[batch_index]  # (b, d)
        if ref is None:
            raise RuntimeError("base_stats(batch) runs before the stats of the batch's ablated copies")
        b = ref.shape[0]
        e = self.embed(out, replicate(batch.real, R)).view(R, b, -1)  # (R, b, d)
        cos = F.cosine_similarity(e, ref[None], dim=-1)  # (R, b)
        return cos.sum(1), torch.full((R,), float(b), dtype=torch.float64)

    def baseline_of(self, total: Tensor, count: Tensor) -> float:
        return 1.0

    def score(self, value: Tensor, baseline: float) -> Tensor:
        return baseline - value


class _Loss(_Metric):
    """Mean next-token cross-entropy over pairs of real tokens; score loss' - loss."""

    name = "loss"

    def _setup(self) -> None:
        for batch in self.batches:
            if batch.tokens is None:
                raise TypeError("metric='loss' needs token ids [batch, seq]; got activations")
        if not any(bool((b.real[:, :-1] & b.real[:, 1:]).any()) for b in self.batches):
            raise ValueError("metric='loss' needs sequences of at least two real tokens")

    def stats(
        self, batch_index: int, out: Tensor, R: int, *, overwrite: bool = False
    ) -> tuple[Tensor, Tensor]:
        batch = self.batches[batch_index]
        tokens, real = replicate(batch.tokens, R), replicate(batch.real, R)  # (R b, seq) x 2
        seq = tokens.shape[1]
        pair = (real[:, :-1] & real[:, 1:]).to(torch.float64)  # (R b, seq - 1): context end and target real
        block = LOSS_SUM_BLOCK if overwrite else None  # the engine's copies: float32 partial sums
        # out: seq or seq - 1 positions (the engine unembeds only those the loss reads)
        ce = next_token_loss(
            out[:, : seq - 1], tokens[:, 1:], overwrite=overwrite, block=block
        )  # (R b, seq - 1)
        b = batch.tokens.shape[0]
        return (ce * pair).view(R, b, -1).sum(dim=(1, 2)), pair.view(R, b, -1).sum(dim=(1, 2))

    def stream_stats(self, batch_index: int, x: Tensor, R: int, weight: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`stats` from the final streams ``x`` [R b, >= seq - 1, d_model] (before LN_f) of the
        copies, for a decoder whose logits are ``F.linear(LN_f(x), weight)``: only the positions of the
        pairs of real tokens are unembedded, through :func:`unembedded_loss`."""
        batch = self.batches[batch_index]
        b = batch.tokens.shape[0]
        pair = batch.real[:, :-1] & batch.real[:, 1:]  # (b, seq - 1)
        row, pos = pair.nonzero(as_tuple=True)  # (P,) x 2: the pairs of one copy
        n = row.shape[0]
        target = batch.tokens[row, pos + 1]  # (P,)
        rows = (torch.arange(R, device=x.device)[:, None] * b + row[None]).reshape(-1)  # (R P,)
        h = x[rows, pos.repeat(R)]  # (R P, d_model): copy r's pairs first, then copy r + 1's
        if self.module.ln_final is not None:
            h = self.module.ln_final(h)
        ce = unembedded_loss(h, weight, target.repeat(R))  # (R P,) float64
        return ce.view(R, n).sum(dim=1), torch.full((R,), float(n), dtype=torch.float64)

    def positions_read(self, seq: int) -> int:
        """The last position predicts no token: only the logits of the first ``seq - 1`` are read."""
        return max(1, seq - 1)

    def baseline_of(self, total: Tensor, count: Tensor) -> float:
        return float(total.sum() / count.sum())


def head_importance(
    model: Any,
    inputs: Any = None,
    *,
    metric: str | Callable[[Any], float] = "auto",
    mode: str = "zero",
    key_padding: Tensor | None = None,
    heads: Sequence[tuple[int, int] | Sequence[int]] | None = None,
    batch_size: int = 32,
    max_rows: int = 256,
    progress: bool = True,
) -> HeadImportance:
    """Ablate each head in turn and measure the change of ``metric`` (see the module docstring).

    Args:
        model: a pretrained wrapper (``headspace.load("minilm")``), an Encoder or a Decoder (or any
            module with attention layers, with a callable metric).
        inputs: sentences (pretrained wrapper), token ids [batch, seq], or a list of tensors; may be
            None with a callable metric and ``mode="zero"``.
        metric: ``"auto"`` (``"loss"`` for a decoder, else ``"cosine"``), ``"cosine"``, ``"loss"`` (a
            decoder only: refused with a ValueError for other models), or a callable
            ``metric(model) -> float`` evaluated under each ablation (one run per head).
        mode: ``"zero"`` or ``"mean"`` (z replaced by its mean over the real tokens of ``inputs``).
        key_padding: bool [batch, seq], True for real tokens, with a single tensor input.
        heads: the (layer, head) pairs to evaluate (default: all); ``[layer, head]`` lists are accepted.
        batch_size: sentences per forward pass of the inputs.
        max_rows: the built-in metrics run many ablations in one pass, each in its own copy of the batch,
            up to ``max_rows`` rows per pass.
        progress: show a progress bar over the heads.

    The built-in metrics on an Encoder or Decoder use the batched engine
    (:func:`headspace.analysis.patching.run_from_layers`): the ablation of a head of layer ``l`` leaves
    the blocks below ``l`` unchanged, so its copy of the batch starts at block ``l`` from the unablated
    stream, and the copies of every layer travel up the stack together (the ablated layer's copies run
    as their own call of that block, so the rows already in the batch keep the fused attention). One
    unablated run per batch gives both the baseline and those streams. A decoder's copies run without
    the last position (causal attention: it reaches no position the loss reads), and the loss of a
    plain float32 unembedding is computed a tile of the vocabulary at a time (:func:`unembedded_loss`:
    no [copies, seq, vocab] logits, only the positions of pairs of real tokens). Other modules run one
    copy per head of a layer through the whole module. Either way the numbers are what one
    :func:`headspace.ablate` run per head gives, to float32 rounding (a test holds this). The model runs
    in eval mode without autograd; its mode is restored. Deterministic for a deterministic model.
    """
    module = as_module(model)
    layers = attention_layers(model)
    metric = _checked_importance_args(module, layers, metric, mode, max_rows)
    all_heads = [(i, h) for i, (_, attn) in enumerate(layers) for h in range(attn.n_heads)]
    todo = all_heads if heads is None else _check_heads(heads, all_heads, layers)
    if inputs is None and (not callable(metric) or mode == "mean"):
        raise ValueError("inputs are needed for the built-in metrics and for mode='mean'; got None")
    batches = make_batches(model, inputs, key_padding, batch_size) if inputs is not None else []
    means = mean_z(model, inputs, key_padding=key_padding, batch_size=batch_size) if mode == "mean" else None
    ablated = [torch.full((attn.n_heads,), float("nan"), dtype=torch.float64) for _, attn in layers]
    scores = [torch.full((attn.n_heads,), float("nan"), dtype=torch.float64) for _, attn in layers]
    with eval_mode(module):
        if callable(metric):
            name, baseline = _by_callable(model, metric, mode, means, todo, ablated, scores, progress)
        else:
            m: _Metric = (_Loss if metric == "loss" else _Cosine)(model, module, batches)
            name = m.name
            # every batch ticks: over several batches a unit is one head ablated on one batch
            n_batches = max(1, len(batches))
            bar = progress_bar(
                total=len(todo) * n_batches, desc=f"ablating heads ({name}, {mode})",
                unit="head" if n_batches == 1 else "head-batch", disable=not progress,
            )  # fmt: skip
            run = _from_layers if _engine_applies(module, batches) else _replicated
            values, baseline = run(_Ablations(module, layers, m, batches, todo, mode, means, max_rows), bar)
            bar.close()
            for (layer, head), value in zip(todo, values):
                ablated[layer][head] = value
                scores[layer][head] = m.score(value, baseline)
    return HeadImportance(
        scores=pad_heads(scores), ablated=pad_heads(ablated), baseline=float(baseline), metric=name, mode=mode
    )


def _by_callable(
    model: Any, metric: Callable[[Any], float], mode: str, means: Any, todo: list[tuple[int, int]],
    ablated: list[Tensor], scores: list[Tensor], progress: bool,
) -> tuple[str, float]:  # fmt: skip
    """:func:`head_importance` with a callable metric: one :func:`ablate` run per head, written into
    ``ablated`` and ``scores`` (per layer, [n_heads]); returns the metric's name and the baseline."""
    name = getattr(metric, "__name__", type(metric).__name__)
    baseline = float(metric(model))
    bar = progress_bar(todo, desc=f"ablating heads ({name}, {mode})", unit="head", disable=not progress)
    for layer, head in bar:
        with ablate(model, {(layer, head): mode}, means=means):
            value = float(metric(model))
        ablated[layer][head] = value
        scores[layer][head] = value - baseline
    return name, baseline


def _checked_importance_args(
    module: nn.Module, layers: Sequence[Any], metric: Any, mode: Any, max_rows: Any
) -> str | Callable[[Any], float]:
    """:func:`head_importance`'s checks; returns the metric with ``"auto"`` resolved."""
    if not layers:
        raise ValueError(f"model has no MultiHeadAttention layer; got {type(module).__name__}")
    if mode not in ABLATION_MODES:
        raise ValueError(f"mode must be one of {ABLATION_MODES}; got {mode!r}")
    if not callable(metric) and metric not in METRICS:
        raise ValueError(
            f"metric must be one of {METRICS} or a callable metric(model) -> float; got {metric!r}"
        )
    if not is_int(max_rows) or max_rows <= 0:
        raise ValueError(f"max_rows must be a positive int; got {max_rows!r}")
    if not callable(metric) and metric == "auto":
        metric = "loss" if _is_decoder(module) else "cosine"
    if not callable(metric) and metric == "loss" and not _is_decoder(module):
        raise ValueError(
            "metric='loss' is a decoder metric (next-token cross-entropy of the logits [batch, seq, "
            f"vocab_size]); got model {_model_kind(module)}, whose output is not next-token logits. For "
            "this model use metric='cosine' (or 'auto'), or a callable metric(model) -> float"
        )
    return metric


def _layer_means(means: dict[tuple[int, int], Tensor] | None, layer: int, n_heads: int) -> Tensor | None:
    """The mean z of every head of ``layer`` [n_heads, d_head], or None (zero ablation)."""
    if means is None:
        return None
    return torch.stack([means[(layer, h)] for h in range(n_heads)])  # (n_heads, d_head)


@dataclass
class _Ablations:
    """What the built-in metrics' sweep over heads needs (the arguments of :func:`head_importance`)."""

    module: nn.Module
    layers: Sequence[Any]
    metric: _Metric
    batches: Sequence[Batch]
    todo: Sequence[tuple[int, int]]
    mode: str
    means: dict[tuple[int, int], Tensor] | None
    max_rows: int


def _replicated(a: _Ablations, bar: Any) -> tuple[list[float], float]:
    """(the metric with each head of ``todo`` ablated, the baseline): whole-module runs, a batch copy
    per head of a layer."""
    module, layers, m, batches = a.module, a.layers, a.metric, a.batches
    baseline = m.baseline()
    todo, mode, means = a.todo, a.mode, a.means
    max_rows = a.max_rows
    by_layer: dict[int, list[int]] = {}
    for layer, head in todo:
        by_layer.setdefault(layer, []).append(head)
    found: dict[tuple[int, int], float] = {}
    for layer, layer_heads in by_layer.items():
        path = layers[layer][0]
        layer_means = _layer_means(means, layer, layers[layer][1].n_heads)
        total = torch.zeros(len(layer_heads), dtype=torch.float64)
        count = torch.zeros(len(layer_heads), dtype=torch.float64)
        hook_name = f"{path}.hook_z" if path else "hook_z"
        for bi, batch in enumerate(batches):
            b = batch.args[0].shape[0]
            chunk = max(1, max_rows // b)
            for start in range(0, len(layer_heads), chunk):
                part = layer_heads[start : start + chunk]
                R = len(part)
                rep = Batch(
                    tuple(replicate(a, R) for a in batch.args),
                    None if batch.key_padding is None else replicate(batch.key_padding, R),
                    None if batch.tokens is None else replicate(batch.tokens, R),
                )
                with hooked(module, {hook_name: replica_hook(part, mode, layer_means, b)}):
                    out = rep.run(module)  # (R b, ...)
                t, c = m.stats(bi, out, R)  # (R,) x 2
                total[start : start + R] += t
                count[start : start + R] += c
                bar.update(R)
        for h, value in zip(layer_heads, m.value(total, count).tolist()):
            found[(layer, h)] = value
    return [found[pair] for pair in todo], baseline


def _engine_applies(module: nn.Module, batches: Sequence[Batch]) -> bool:
    """Whether the batched engine can run: an Encoder or Decoder fed token ids alone, whose blocks run
    as the stock forward runs them (not Gemma 4 / 3n: per-layer inputs, shared keys, AltUp; their
    heads are ablated through the whole forward instead)."""
    from ...model.models import Decoder, Encoder

    stock = type(module).forward is Encoder.forward or (
        type(module).forward is Decoder.forward and type(module).hidden_states is Decoder.hidden_states
    )
    return stock and all(b.tokens is not None and len(b.args) == 1 for b in batches)


def _plain_unembedding(module: nn.Module) -> Tensor | None:
    """The unembedding weight [vocab_size, d_model] of a Decoder whose logits are ``F.linear(h, weight)``
    in float32 (:meth:`~headspace.Decoder.unembed` itself; a tied embedding or an ``nn.Linear`` without
    bias; no final soft-capping), else None (the logits then come from ``unembed``)."""
    from ...model.models import Decoder

    if not isinstance(module, Decoder) or type(module).unembed is not Decoder.unembed:
        return None
    if getattr(module.config, "final_softcap", None) is not None:
        return None
    head = module.lm_head
    if head is not None and not (type(head) is nn.Linear and head.bias is None):
        return None
    weight = module.tok_embed.weight if head is None else head.weight
    return weight if isinstance(weight, Tensor) and weight.dtype == torch.float32 else None


def _finish(module: nn.Module, x: Tensor, buffer: list[Tensor] | None = None) -> Tensor:
    """What the Encoder's or Decoder's forward does after its last block: LN_f, and a decoder's logits
    (:meth:`~headspace.Decoder.unembed`, final soft-capping included).

    ``buffer``: a one-item list holding a float32 tensor the logits may be written into (the same GEMM
    as ``F.linear``, into memory reused from one call to the next; grown and replaced when too small),
    or an empty list to start one; None: fresh logits.
    """
    if module.ln_final is not None:
        x = module.ln_final(x)  # (runs, seq, d_model)
    if not _is_decoder(module):
        return x
    weight = _plain_unembedding(module)
    if buffer is not None and weight is not None and x.dtype == torch.float32:
        runs, seq, _ = x.shape
        n = runs * seq * weight.shape[0]
        if not buffer or buffer[0].numel() < n or buffer[0].device != x.device:
            buffer[:] = [torch.empty(n, dtype=torch.float32, device=x.device)]
        out = buffer[0][:n].view(runs * seq, weight.shape[0])  # (runs seq, vocab_size)
        torch.matmul(x.reshape(runs * seq, -1), weight.t(), out=out)
        return out.view(runs, seq, -1)  # (runs, seq, vocab_size)
    return module.unembed(x)  # (runs, seq, vocab_size), float32


#: The engine turns the final stream into the metric's output this many bytes (float64) at a time.
OUTPUT_CHUNK_BYTES = 128 << 20


def _from_layers(a: _Ablations, bar: Any) -> tuple[list[float], float]:
    """(the metric with each head of ``todo`` ablated, the baseline), through the batched engine (see
    :func:`head_importance`): per batch, one unablated run (the baseline and the stream every copy
    starts from), then groups of heads of at most ``max_rows`` rows."""
    module, layers, m, batches = a.module, a.layers, a.metric, a.batches
    todo, mode, means = a.todo, a.mode, a.means
    from .patching import run_from_layers

    decoder = _is_decoder(module)
    weight = _plain_unembedding(module) if isinstance(m, _Loss) else None  # None: logits from unembed
    order = sorted(range(len(todo)), key=lambda i: todo[i][0])  # by layer: the order runs join in
    total = torch.zeros(len(todo), dtype=torch.float64)
    count = torch.zeros(len(todo), dtype=torch.float64)
    base_total, base_count = torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    buffer: list[Tensor] = []  # the logits of one chunk, memory reused from chunk to chunk
    for bi, batch in enumerate(batches):
        b, seq = batch.tokens.shape
        with trace(module, "blocks.*.hook_resid_pre") as t:
            out = batch.run(module)
        bt, bc = m.base_stats(bi, out)
        base_total, base_count = base_total + bt, base_count + bc
        del out
        # a decoder's attention is causal: the positions the metric does not read (the loss: the last)
        # change none that it reads, so the copies run without them
        keep = m.positions_read(seq) if decoder else seq
        per = max(1, a.max_rows // b)
        for g0 in range(0, len(order), per):
            group = order[g0 : g0 + per]
            heads_at: dict[int, list[int]] = {}
            for i in group:
                heads_at.setdefault(todo[i][0], []).append(todo[i][1])
            joins = {  # (len(hs) b, keep, d_model) each
                l: replicate(t[f"blocks.{l}.hook_resid_pre"][:, :keep], len(hs)) for l, hs in heads_at.items()
            }
            hooks, block_kwargs = _engine_calls(module, layers, batch, heads_at, mode, means, keep)
            x = run_from_layers(module, joins, hooks, block_kwargs, separate=True)  # (len(group) b, keep, d)
            if isinstance(m, _Loss) and weight is not None and x.dtype == weight.dtype:
                st, sc = m.stream_stats(bi, x, len(group), weight)  # (len(group),) x 2
                total[group] += st
                count[group] += sc
            else:
                _chunked_stats(a, bi, x, group, buffer, total, count)
            bar.update(len(group))
    return m.value(total, count).tolist(), m.baseline_of(base_total, base_count)


def _chunked_stats(
    a: _Ablations, bi: int, x: Tensor, group: list[int], buffer: list[Tensor], total: Tensor, count: Tensor
) -> None:
    """Adds the metric's (sum, count) of the copies ``group`` of batch ``bi`` (their final streams
    ``x`` [len(group) b, keep, d_model]) to ``total`` / ``count``: :func:`_finish` and
    :meth:`_Metric.stats`, :data:`OUTPUT_CHUNK_BYTES` of output at a time."""
    module, m = a.module, a.metric
    b, seq = a.batches[bi].tokens.shape
    vocab = getattr(module.config, "vocab_size", 1) if _is_decoder(module) else x.shape[-1]
    used = m.positions_read(seq)  # only these positions are unembedded (the loss: seq - 1)
    step = max(1, OUTPUT_CHUNK_BYTES // max(1, b * used * vocab * 8))
    for c0 in range(0, len(group), step):
        part = group[c0 : c0 + step]
        out = _finish(module, x[c0 * b : (c0 + len(part)) * b, :used], buffer)  # (len(part) b, used, ...)
        st, sc = m.stats(bi, out, len(part), overwrite=True)  # (len(part),) x 2
        total[part] += st
        count[part] += sc


def _engine_calls(
    module: nn.Module,
    layers: Sequence[Any],
    batch: Batch,
    heads_at: dict[int, list[int]],
    mode: str,
    means: dict[tuple[int, int], Tensor] | None,
    keep: int,
) -> tuple[Callable, Callable]:
    """``hooks`` and ``block_kwargs`` of :func:`~headspace.analysis.patching.run_from_layers` (with
    ``separate=True``) for one batch whose copies ablate ``heads_at[l]`` (copy ``r`` of layer ``l``:
    head ``heads_at[l][r]``), on its first ``keep`` positions.

    The block calls are those of ``Encoder.forward`` / ``Decoder.forward`` (padding, causality and
    rotary positions as there), with the padding replicated over the copies; one positions tensor for
    every call (the rotary tables are computed once).
    """
    b = batch.tokens.shape[0]
    rotary = getattr(module, "rotary", None)
    decoder = _is_decoder(module)
    padding = None if batch.key_padding is None else batch.key_padding[:, :keep]  # (b, keep)
    positions = torch.arange(keep, device=batch.tokens.device) if rotary is not None else None  # (keep,)

    def hooks(layer: int, first: int, n: int) -> dict[str, Callable]:
        lm = _layer_means(means, layer, layers[layer][1].n_heads)
        return {"attn.hook_z": _rows_hook(heads_at[layer], mode, lm, b, first)}

    def block_kwargs(layer: int, runs: int) -> dict[str, Any]:
        kw: dict[str, Any] = {}
        if padding is not None:
            kw["key_padding"] = replicate(padding, runs // b)  # (runs, keep)
        if decoder:
            kw["is_causal"] = True
        if positions is not None and getattr(module.blocks[layer].attn, "rotary", None) is not None:
            kw["positions"] = positions  # (NoPE layers, e.g. EXAONE 4's global ones: none, as forward)
        return kw

    return hooks, block_kwargs


def _rows_hook(heads: Sequence[int], mode: str, means: Tensor | None, b: int, first: int) -> Callable:
    """A ``hook_z`` function ablating head ``heads[r]`` in rows ``first + r b .. first + (r + 1) b``."""

    def fn(z: Tensor, point: Any) -> Tensor:  # z: (runs, seq, n_heads, d_head)
        z = z.clone()
        zr = z[first : first + len(heads) * b].view(len(heads), b, *z.shape[1:])  # (R, b, seq, H, dh)
        for r, h in enumerate(heads):
            zr[r, :, :, h] = 0.0 if mode == "zero" else means[h].to(z)
        return z

    return fn
