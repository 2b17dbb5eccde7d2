"""The head atlas: every head's statistics over a whole corpus, streamed, resumable, on torch.distributed.

:func:`atlas` reads a corpus (:mod:`.corpus`), cuts it into windows, groups consecutive windows into
*shards* of ``shard_size`` sequences and measures every head on every query position of every sequence
(:mod:`.atlas_measure`; the ``ablation`` pass :mod:`.atlas_ablation`). Each shard's sums, counts and
top-k candidates (:mod:`.atlas_state`) are merged as they come, so memory does not grow with the corpus
(the corpus is read and tokenised once, :func:`.corpus.read_windows`: with ``out`` its token ids live in
a mapped file, without it in memory).

**Resumable.** With ``out``, each finished shard is sealed in ``out/shards/`` (one JSON file written
atomically, holding the run's fingerprint, with the SHA-256 of the model's weights, and the SHA-256 of
its state, checked when read back: :mod:`.atlas_guard`, which also locks ``out`` for the run); a run
killed at any moment and started again with the same arguments skips the sealed shards and writes the
same atlas: merged sums are fixed-point integers, so the order in which shards come does not matter.

**Distributed.** Under ``torchrun`` (:func:`headspace.process_group.setup_distributed`) rank ``r`` of
``W`` takes the shards ``i`` with ``i % W == r``; the ranks' merged states are exchanged as JSON
(:func:`headspace.process_group.all_gather_bytes`) and added: every rank holds the same atlas as one
process would (integer sums; top-k lists under a total order).

Two passes over the corpus: the statistics (and each head's mean z), then, for decoders, the
importance column ``ablation``: each head's mean-ablation loss change with the corpus means
(:mod:`.atlas_importance`), estimated by AtP* (``importance="atp*"``, the default: one forward and one
backward), or exact (``importance="exact"``: one replicated run per layer and head, the slow part), or
skipped (``importance="none"``, or ``ablation=False``). ``atlas.json`` names the method
(``importance_method``); ``importance_check=N`` also runs both methods on the first ``N`` tokens'
windows and records their agreement (``importance_check``: Spearman, top-k overlap).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ...attention.delta_net import refuse_linear_attention_model
from ...core.checks import is_int
from ...core.fileio import write_atomic
from ...core.process_group import DistInfo, all_gather_bytes, device_of
from ...core.progress import progress_bar
from .._common import eval_mode, to_plain
from ..causal.causal_inputs import is_decoder, token_str
from ..lesson.roles import induction_scores
from ..trace.trace import as_module, attention_layers
from .ablation import ablate_batch
from .corpus import MAX_PIECE_CHARS, Corpus, Window, check_window, read_windows, sequences
from .guard import SHARD_FORMAT, folder_lock, read_shard, seal, weights_sha256
from .importance import agreement, attribute_batch, check_importance
from .measure import measure_batch
from .state import EXAMPLE_KINDS, MEANS, AtlasState, SealedState

__all__ = ["SHARD_FORMAT", "Atlas", "atlas"]

CONTEXT = 8
"""Tokens of context each side of an example's query and key."""

CHECK_TOP_K = 10
"""Heads in the top-k overlap of the importance check (fewer when the model has fewer)."""


@dataclass
class Atlas:
    """Every head's statistics over a corpus (:func:`atlas`); :meth:`to_dict` is ``atlas.json``.

    Each statistic is float64 [n_layers, max_heads] (NaN where not defined: encoders have no
    ``copying``, ``direct_effect``, ``ablation``; pruned heads): ``previous``, ``first`` (means over
    queries ``i >= 1`` of the mass on key ``i - 1`` and on key 0), ``self``, ``entropy`` (nats),
    ``duplicate``, ``induction``, ``copying``, ``direct_effect`` (means over queries; see
    :mod:`.atlas_measure`), ``ablation`` (corpus loss with the head mean-ablated minus the clean loss);
    ``induction_repeated`` the repeated-random-token score of :func:`induction_scores` (decoders).
    ``examples[layer][head]``: ``{"attention": [...], "direct_effect": [...]}``, each example a dict
    (sequence, document, query and key positions in the document, value, and the tokens around them).
    ``weights_sha256``: the fingerprint of the model's weights (:func:`.atlas_guard.weights_sha256`).
    ``importance_method``: what produced ``ablation`` (``"atp*"``, ``"exact"``, ``"none"``);
    ``importance_check``: None, or the sample comparison of AtP* and exact
    (:func:`.atlas_importance.agreement`, plus ``tokens``, ``windows`` and both columns ``atp*`` and
    ``exact`` as [layer][head] lists).
    """

    stats: dict[str, Tensor]
    examples: list[list[dict[str, list[dict[str, Any]]]]]
    n_queries: int
    n_tokens: int
    n_sequences: int
    corpus_sha256: str
    model: str
    window: int
    clean_loss: float | None
    n_heads: list[int]
    weights_sha256: str | None = None
    importance_method: str = "exact"
    importance_check: dict[str, Any] | None = None

    def __getattr__(self, name: str) -> Any:
        stats = self.__dict__.get("stats", {})
        if name in stats:
            return stats[name]
        raise AttributeError(name)

    def to_dict(self) -> dict[str, Any]:
        """``atlas.json``: the statistics (lists [n_layers][n_heads], NaN as null), examples and counts."""
        out: dict[str, Any] = {"kind": "head_atlas"}
        for name, t in self.stats.items():
            out[name] = [[to_plain(float(v)) for v in row[:n]] for row, n in zip(t, self.n_heads)]
        out.update(
            examples=self.examples, n_queries=self.n_queries, n_tokens=self.n_tokens,
            n_sequences=self.n_sequences, corpus_sha256=self.corpus_sha256, model=self.model,
            window=self.window, clean_loss=self.clean_loss, n_heads=self.n_heads,
            weights_sha256=self.weights_sha256, importance_method=self.importance_method,
            importance_check=self.importance_check,
        )  # fmt: skip
        return out

    def to_json(self, path: str | Path | None = None) -> str | Path:
        """The JSON text of :meth:`to_dict`; with ``path`` written there atomically (the path returned)."""
        text = json.dumps(self.to_dict(), indent=1, sort_keys=True)
        return text if path is None else write_atomic(path, text + "\n", make_parents=True)


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _shards(
    model: Any, corpus: Corpus, window: int, max_tokens: int | None, size: int
) -> Iterator[list[Window]]:
    part: list[Window] = []
    for w in sequences(model, corpus, window, max_tokens):
        part.append(w)
        if len(part) == size:
            yield part
            part = []
    if part:
        yield part


def _batches(windows: list[Window], batch_size: int, pad: int) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """(tokens int64 [B, S] right-padded with ``pad``, real bool [B, S], sequence ids int64 [B])."""
    for start in range(0, len(windows), batch_size):
        part = windows[start : start + batch_size]
        S = max(w.tokens.shape[0] for w in part)
        tokens = torch.full((len(part), S), pad, dtype=torch.int64)  # (B, S)
        real = torch.zeros(len(part), S, dtype=torch.bool)  # (B, S)
        for b, w in enumerate(part):
            tokens[b, : w.tokens.shape[0]] = w.tokens
            real[b, : w.tokens.shape[0]] = True
        yield tokens, real, torch.tensor([w.index for w in part], dtype=torch.int64)


def _run_phase(
    name: str,
    shard_groups: Callable[[], Iterator[list[Window]]],
    work: Callable[[list[Window]], dict[str, Any]],
    fingerprint: dict[str, Any],
    out: Path | None,
    info: DistInfo,
    bar: Any,
    blank: dict[str, Any],
) -> SealedState | None:
    """Each of this rank's shards, read back sealed or computed and sealed; their merged state (None
    when this rank had none). ``bar.update(tokens)`` follows each shard (a :class:`_Ticker` makes that
    the rest of a shard whose work moved the bar as it went). A shard that cannot be written is an
    ``OSError`` saying that the shards sealed before it are kept (a rerun resumes from them)."""
    merged: SealedState | None = None
    for index, windows in enumerate(shard_groups()):
        if index % info.world_size != info.rank:
            continue
        path = None if out is None else out / "shards" / f"{name}-{index:06d}.json"
        mark = {**fingerprint, "shard": index}
        state = None if path is None else read_shard(path, mark, windows, blank)
        if state is None:
            state = work(windows)
            if path is not None:
                try:
                    write_atomic(path, seal(state, mark), make_parents=True)
                except OSError as e:
                    raise OSError(
                        e.errno,
                        f"{path}: cannot write this shard ({e.strerror or type(e).__name__}); the "
                        f"shards sealed before it in {path.parent} are kept: run again to resume from them",
                    ) from None
        bar.update(sum(w.tokens.shape[0] for w in windows))
        if merged is None:
            merged = SealedState.empty_like(state)
        merged.add(state)
    return merged


def _all_ranks(local: SealedState | None, info: DistInfo, blank: dict[str, Any]) -> SealedState:
    """Every rank's merged state added together (exact), on every rank."""
    total = SealedState.empty_like(blank)
    if not info.enabled:
        if local is not None:
            total.add(local.data)
        return total
    payload = json.dumps(None if local is None else local.data).encode()
    for raw in all_gather_bytes(payload, device_of(info)):
        part = json.loads(raw)
        if part is not None:
            total.add(part)
    return total


def _context(tokens: list[str], at: int) -> dict[str, Any]:
    lo = max(0, at - CONTEXT)
    return {"tokens": tokens[lo : at + CONTEXT + 1], "at": at - lo}


def _examples(
    model: Any, merged: SealedState, windows: list[Window], n_heads: list[int]
) -> list[list[dict[str, list[dict[str, Any]]]]]:
    """The top-k candidates with their documents and tokens of context (``windows`` in sequence order)."""
    top = merged.data["top"]
    found = {w.index: w for w in windows}
    names: dict[int, str] = {}

    def text(i: int) -> str:
        if i not in names:
            names[i] = token_str(model, i)
        return names[i]

    out = []
    for layer, n in enumerate(n_heads):
        row = []
        for h in range(n):
            per: dict[str, list[dict[str, Any]]] = {}
            for kind in EXAMPLE_KINDS:
                items = []
                for _, seq, q, k, value in top[kind][layer][h]:
                    w = found[int(seq)]
                    toks = [text(int(t)) for t in w.tokens.tolist()]
                    items.append({
                        "sequence": int(seq), "document": w.name, "query": w.start + int(q),
                        "key": w.start + int(k), "value": float(value),
                        "query_context": _context(toks, int(q)), "key_context": _context(toks, int(k)),
                    })  # fmt: skip
                per[kind] = items
            row.append(per)
        out.append(row)
    return out


def _check_args(batch_size: Any, top_k: Any, max_tokens: Any, shard_size: Any) -> None:
    for name, value in (("batch_size", batch_size), ("top_k", top_k), ("shard_size", shard_size)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive int; got {value!r}")
    if max_tokens is not None and (not is_int(max_tokens) or max_tokens < 1):
        raise ValueError(f"max_tokens must be a positive int or None (the whole corpus); got {max_tokens!r}")


def _finish(
    merged: SealedState, ablated: SealedState | None, n_heads: list[int], decoder: bool
) -> tuple[dict[str, Tensor], float | None]:
    stats = {name: merged.mean(name) for name in MEANS}
    clean = None
    L, H = len(n_heads), merged.data["shape"][1]
    abl = torch.full((L, H), float("nan"), dtype=torch.float64)
    if ablated is not None and ablated.data["n_pairs"]:
        pairs = ablated.data["n_pairs"]
        clean = ablated.data["clean_sum"] / 2.0**40 / pairs
        abl = torch.tensor(ablated.data["ablation_sum"], dtype=torch.float64) / 2.0**40 / pairs - clean
    stats["ablation"] = abl
    if not decoder:
        stats["copying"] = torch.full((L, H), float("nan"), dtype=torch.float64)
        stats["direct_effect"] = torch.full((L, H), float("nan"), dtype=torch.float64)
    return stats, clean


@dataclass
class _Phase:
    """What every pass over the shards shares: the shard groups, the run's fingerprint, where shards are
    sealed, the rank, and the progress bar's total."""

    groups: Callable[[], Iterator[list[Window]]]
    fingerprint: dict[str, Any]
    out: Path | None
    info: DistInfo
    total: int | None
    progress: bool


class _Ticker:
    """A token bar moved by fractions of a batch while a shard is computed (``tick``) and brought to the
    shard's whole count when it is done (``update``, what :func:`_run_phase` calls)."""

    def __init__(self, bar: Any) -> None:
        self.bar, self.part, self.shown = bar, 0.0, 0

    def tick(self, tokens: float) -> None:
        self.part += tokens
        step = int(self.part) - self.shown
        if step > 0:
            self.bar.update(step)
            self.shown += step

    def update(self, tokens: int) -> None:
        if tokens > self.shown:
            self.bar.update(tokens - self.shown)
        self.part, self.shown = 0.0, 0


def _importance_batch(
    method: str, module: Any, state: AtlasState, tokens: Tensor, real: Tensor, means: Tensor, ticker: _Ticker
) -> None:
    """One batch of the importance pass by ``method`` (``"atp*"`` or ``"exact"``), moving ``ticker``."""
    n = float(real.sum())
    if method == "exact":
        ablate_batch(module, state, tokens, real, means, tick=lambda f: ticker.tick(f * n))
    else:
        attribute_batch(module, state, tokens, real, means)
        ticker.tick(n)


def _ablation_phase(
    run: _Phase, module: Any, merged: SealedState, blank: dict[str, Any], dims: tuple[int, int, int, int],
    batch_size: int, pad: int, device: torch.device, method: str,
) -> SealedState:  # fmt: skip
    """The importance pass by ``method`` over every shard (with the corpus means of ``merged``), merged
    over ranks; its shards' fingerprint names the method (a shard of another method is refused)."""
    L, H, dh, top_k = dims
    means = merged.z_means().to(device)  # (L, H, dh)
    fingerprint = {**run.fingerprint, "means_sha256": _digest(merged.data["z_sum"]), "importance": method}
    desc = "atlas: ablation (exact)" if method == "exact" else f"atlas: importance ({method})"
    bar = progress_bar(total=run.total, desc=desc, unit="tok", disable=not run.progress)
    ticker = _Ticker(bar)

    def ablate(windows: list[Window]) -> dict[str, Any]:
        state = AtlasState(L, H, dh, top_k)
        for tokens, real, _ in _batches(windows, batch_size, pad):
            _importance_batch(method, module, state, tokens.to(device), real.to(device), means, ticker)
        return state.seal()

    local = _run_phase("ablation", run.groups, ablate, fingerprint, run.out, run.info, ticker, blank)
    bar.close()
    return _all_ranks(local, run.info, blank)


def _importance_check(
    module: Any, windows: list[Window], n_tokens: int, merged: SealedState, dims: tuple[int, int, int, int],
    batch_size: int, pad: int, device: torch.device, n_heads: list[int], progress: bool,
) -> dict[str, Any]:  # fmt: skip
    """Both importance methods on the first windows holding at least ``n_tokens`` tokens (all when the
    corpus has fewer), and their :func:`.atlas_importance.agreement` over every head."""
    sample: list[Window] = []
    count = 0
    for w in windows:
        if count >= n_tokens:
            break
        sample.append(w)
        count += int(w.tokens.shape[0])
    L, H, dh, top_k = dims
    means = merged.z_means().to(device)  # (L, H, dh)
    bar = progress_bar(total=2 * count, desc="atlas: importance check", unit="tok", disable=not progress)
    ticker = _Ticker(bar)
    cols: dict[str, Tensor] = {}
    for method in ("atp*", "exact"):
        state = AtlasState(L, H, dh, top_k)
        for tokens, real, _ in _batches(sample, batch_size, pad):
            _importance_batch(method, module, state, tokens.to(device), real.to(device), means, ticker)
        col = torch.full((L, H), float("nan"), dtype=torch.float64)
        if state.n_pairs:
            col = (state.ablation_sum - state.clean_sum) / state.n_pairs  # (L, H)
        for layer, n in enumerate(n_heads):
            col[layer, n:] = float("nan")
        cols[method] = col
    bar.close()
    found = agreement(cols["atp*"], cols["exact"], min(CHECK_TOP_K, sum(n_heads)))
    as_lists = {
        m: [[to_plain(float(v)) for v in row[:n]] for row, n in zip(c, n_heads)] for m, c in cols.items()
    }
    return {"tokens": count, "windows": len(sample), **found, **as_lists}


@dataclass
class _Settings:
    """An :func:`atlas` call's arguments, checked."""

    window: int
    batch_size: int
    top_k: int
    max_tokens: int | None
    ablation: bool
    induction_repeated: bool
    shard_size: int
    max_piece_chars: int
    progress: bool
    importance: str = "atp*"
    importance_check: int | None = None


def atlas(
    model: Any,
    corpus: Any,
    *,
    window: int = 512,
    batch_size: int = 8,
    top_k: int = 8,
    max_tokens: int | None = None,
    ablation: bool = True,
    induction_repeated: bool = True,
    out: str | Path | None = None,
    shard_size: int = 64,
    model_name: str | None = None,
    dist_info: DistInfo | None = None,
    progress: bool = True,
    max_piece_chars: int = MAX_PIECE_CHARS,
    importance: str = "atp*",
    importance_check: int | None = None,
) -> Atlas:
    """Every head's statistics over ``corpus`` (see the module docstring and :class:`Atlas`).

    Args:
        model: a pretrained wrapper with a tokenizer (``headspace.load("smollm2")``, ``"minilm"``).
        corpus: a path (UTF-8 text file, folder, ``.jsonl``) or a list of strings (:mod:`.corpus`).
        window: tokens per sequence (longer documents are cut into windows).
        batch_size: sequences per forward pass (right-padded).
        top_k: examples kept per head and kind.
        max_tokens: stop after this many tokens (None: the whole corpus); nothing past them is read.
        ablation: False skips the importance column (as ``importance="none"``).
        importance: how each head's mean-ablation loss change (the ``ablation`` column; decoders) is
            measured: ``"atp*"`` (the default: AtP*'s first-order estimate, one forward and one backward
            of the corpus, :mod:`.atlas_importance`), ``"exact"`` (one replicated run per layer and head:
            the slow part) or ``"none"``.
        importance_check: with a method, also run both methods on the first windows holding this many
            tokens and record their agreement in ``importance_check`` (None: no check).
        induction_repeated: also compute :func:`induction_scores` (repeated random tokens; decoders).
        out: a folder for the sealed shards (resumable runs; locked while the run lasts, a second run
            on it is refused); None keeps everything in memory.
        shard_size: sequences per shard (the unit of resuming and of distribution).
        model_name: what ``atlas.json`` calls the model (default: the config's ``name`` or the class).
        dist_info: a torch.distributed job's :class:`~headspace.process_group.DistInfo` (None: one process).
        progress: show progress bars (tokens/s and ETA).
        max_piece_chars: documents longer than this many characters are tokenised in pieces of at most
            this many (:func:`headspace.analysis.corpus.document_tokens`).

    The corpus is read and tokenised once (its token ids kept: with ``out`` in a file there, mapped and
    removed at once; without, in memory, 4 bytes a token); shards are
    fingerprinted by the corpus, the arguments and the SHA-256 of the model's weights
    (:func:`headspace.analysis.atlas_guard.weights_sha256`), so a shard of other weights is refused.

    Exact: the same sums and counts as running the per-prompt functions on each sequence (tested against
    :func:`head_roles`, :func:`direct_logit_attribution` and :func:`headspace.ablate`), float32
    rounding of the model apart; identical across resumed and distributed runs.
    """
    _check_args(batch_size, top_k, max_tokens, shard_size)
    method = check_importance(importance, ablation, importance_check)
    if not is_int(max_piece_chars) or max_piece_chars < 1:
        raise ValueError(f"max_piece_chars must be a positive int; got {max_piece_chars!r}")
    module = as_module(model)
    refuse_linear_attention_model(module, "atlas")
    if not attention_layers(model):
        raise ValueError(f"model has no MultiHeadAttention layer; got {type(model).__name__}")
    settings = _Settings(
        check_window(window, module), batch_size, top_k, max_tokens, method != "none", induction_repeated,
        shard_size, max_piece_chars, progress, method, importance_check,
    )  # fmt: skip
    corp = Corpus.of(corpus)
    info = dist_info or DistInfo(rank=0, world_size=1, local_rank=0, backend=None)
    name = model_name or str(getattr(module.config, "name", None) or type(module).__name__)
    if out is None:
        return _atlas_run(model, corp, settings, name, None, info)
    with folder_lock(out, info):
        return _atlas_run(model, corp, settings, name, Path(out), info)


def _atlas_run(
    model: Any, corp: Corpus, s: _Settings, name: str, out_dir: Path | None, info: DistInfo
) -> Atlas:
    """:func:`atlas` once its arguments are checked (and its output folder locked)."""
    module = as_module(model)
    layers = attention_layers(model)
    decoder = is_decoder(module)
    n_heads = [a.n_heads for _, a in layers]
    L, H, dh = len(layers), max(n_heads), max(a.d_head for _, a in layers)
    weights = weights_sha256(module)
    spill = None if out_dir is None else (out_dir, info.rank)
    read = read_windows(model, corp, s.window, s.max_tokens, max_chars=s.max_piece_chars, spill=spill)
    fingerprint = {
        "corpus_sha256": read.sha256, "model": name, "weights_sha256": weights, "window": s.window,
        "batch_size": s.batch_size, "top_k": s.top_k, "max_tokens": s.max_tokens, "shard_size": s.shard_size,
    }  # fmt: skip
    pad = int(getattr(module.config, "pad_token_id", None) or 0)
    device = next(module.parameters()).device
    shards = [read.windows[i : i + s.shard_size] for i in range(0, len(read.windows), s.shard_size)]

    def groups() -> Iterator[list[Window]]:
        return iter(shards)

    mine = (g for i, g in enumerate(shards) if i % info.world_size == info.rank)
    total = sum(w.tokens.shape[0] for g in mine for w in g)  # this rank's tokens

    def measure(windows: list[Window]) -> dict[str, Any]:
        state = AtlasState(L, H, dh, s.top_k)
        for tokens, real, ids in _batches(windows, s.batch_size, pad):
            measure_batch(model, module, layers, state, tokens.to(device), real.to(device), ids)
        return state.seal()

    blank = AtlasState(L, H, dh, s.top_k).seal()
    with eval_mode(module):
        bar = progress_bar(total=total, desc="atlas: attention", unit="tok", disable=not s.progress)
        local = _run_phase("stats", groups, measure, fingerprint, out_dir, info, bar, blank)
        bar.close()
        merged = _all_ranks(local, info, blank)
        ablated = check = None
        method = s.importance if decoder else "none"
        dims = (L, H, dh, s.top_k)
        if method != "none":
            run = _Phase(groups, fingerprint, out_dir, info, total, s.progress)
            ablated = _ablation_phase(run, module, merged, blank, dims, s.batch_size, pad, device, method)
            if s.importance_check is not None:
                check = _importance_check(
                    module, read.windows, s.importance_check, merged, dims, s.batch_size, pad, device,
                    n_heads, s.progress,
                )  # fmt: skip
        stats, clean = _finish(merged, ablated, n_heads, decoder)
        nan = torch.full((L, H), float("nan"), dtype=torch.float64)
        repeated = decoder and s.induction_repeated
        stats["induction_repeated"] = induction_scores(model).to(torch.float64) if repeated else nan
    return Atlas(
        stats=stats, examples=_examples(model, merged, read.windows, n_heads),
        n_queries=merged.data["n_queries"], n_tokens=merged.data["n_tokens"],
        n_sequences=merged.data["n_sequences"], corpus_sha256=read.sha256, model=name, window=s.window,
        clean_loss=clean, n_heads=n_heads, weights_sha256=weights, importance_method=method,
        importance_check=check,
    )  # fmt: skip
