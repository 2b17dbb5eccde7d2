"""Head roles: where each head's attention goes, measured over inputs.

For every (layer, head), averaged over the real query tokens of the inputs, the attention mass on

* ``previous``: the token just before the query (queries that have one),
* ``next``: the token just after it (queries that have one),
* ``current``: the query token itself,
* ``first``: the first real token of the sequence ([CLS] / BOS),
* ``last``: the last real token of the sequence ([SEP] / EOS),

and the pattern's ``entropy`` (nats; 0 = one key, ``log n`` = uniform over n keys). The ``label`` of a
head is the target with the largest mean mass if that mass is at least ``threshold``, else ``"mixed"``.
Padding tokens (``key_padding`` False) are neither queries nor targets; sequences may be padded on
either side.

Induction (:func:`induction_scores`, ``head_roles(..., induction=True)``): on a random sequence of ``n``
distinct tokens repeated twice (after a BOS when the model has one), the mean attention mass from each
token of the second copy to the token after its first occurrence (query ``i`` -> key ``i - n + 1``).
An induction head (it copies what followed the current token last time) scores near 1, a previous-token
or first-token head near 0. With scores, a head whose score reaches ``threshold`` is labelled
``"induction"`` whatever its masses on the given inputs: the repeated sequence is built to reveal that
mechanism, and on ordinary text an induction head often parks its attention on the first token.

Long inputs: ``head_roles`` never needs the [batch, n_heads, seq, seq] patterns. With
``chunk_size="auto"`` (default) inputs whose patterns of one layer would exceed
:data:`AUTO_PATTERN_BYTES` are measured block by block from each layer's q and k
(:mod:`headspace.analysis.chunked`): peak extra memory a few [batch, n_heads, chunk, seq] blocks
instead of the patterns; shorter inputs take the traced path (the layers' own patterns, folded into
the sums layer by layer). Both give the same numbers (float32 rounding apart).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...core.checks import check_tensor_dims, is_int, is_number, nonfinite_count
from .._common import Batch, eval_mode, layer_head_table, make_batches, pad_heads
from ..causal.targets import TargetMasses
from ..trace.trace import as_module, attention_layers, hooked
from .chunked import default_chunk_size, each_layer_qk, supports_qk_capture

TARGETS = ("previous", "next", "current", "first", "last")
"""The attention targets measured, in label precedence order (ties go to the earlier one)."""

DEFAULT_THRESHOLD = 0.4

INDUCTION_LABEL = "induction"
"""The label of a head whose induction score reaches the threshold (when scores were computed)."""

AUTO_PATTERN_BYTES = 64 * 2**20
"""``chunk_size="auto"``: above this many bytes of one layer's float32 patterns for a batch
(batch x n_heads x seq x seq x 4), head roles are measured chunk by chunk (SmolLM2's 9 heads: from
about 1,400 tokens at batch 1; MiniLM's 12 heads: 512 tokens from batch 6)."""

DEFAULT_INDUCTION_N = 50
"""Tokens in each copy of the repeated random sequence of :func:`induction_scores`."""

DEFAULT_INDUCTION_BATCH = 4
"""Repeated random sequences averaged over by :func:`induction_scores`."""


@dataclass
class HeadRoles(TargetMasses):
    """Per-head attention statistics and role labels.

    Every tensor is [n_layers, n_heads] (NaN where a pruned layer has fewer heads): the mean attention
    mass on the ``previous``, ``next``, ``current``, ``first`` and ``last`` token, and the mean pattern
    ``entropy`` in nats. ``labels[layer][head]`` is one of :data:`TARGETS`, ``"induction"`` or
    ``"mixed"``, decided with ``threshold``. ``n_queries`` counts the real query tokens averaged over
    (per layer it is the same). ``induction`` is the :func:`induction_scores` [n_layers, n_heads] when
    they were computed (``head_roles(..., induction=True)``), else None.
    """

    kind = "head_roles"

    labels: list[list[str]]
    threshold: float
    n_queries: int
    induction: Tensor | None = None

    def mass(self, target: str) -> Tensor:
        """[n_layers, n_heads] mean mass on ``target`` (one of :data:`TARGETS`)."""
        if target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}; got {target!r}")
        return getattr(self, target)

    def heads_with(self, label: str) -> list[tuple[int, int]]:
        """The (layer, head) pairs labelled ``label``."""
        return [(i, h) for i, row in enumerate(self.labels) for h, lab in enumerate(row) if lab == label]

    def _html_parts(self) -> list[str]:
        masses = torch.stack([self.mass(t) for t in TARGETS], dim=-1)  # (n_layers, max_heads, 5)
        top = torch.nan_to_num(masses, nan=-1.0).amax(dim=-1)  # (n_layers, max_heads)
        top = torch.where(top < 0, torch.full_like(top, float("nan")), top)  # absent (pruned) heads: NaN
        caption = (
            f"label and largest mean mass per head (label 'mixed' below {self.threshold:g}), "
            f"over {self.n_queries} query tokens"
        )
        parts = [
            layer_head_table(top, caption, labels=self.labels),
            layer_head_table(self.entropy, "mean pattern entropy (nats)"),
        ]
        if self.induction is not None:
            parts.append(layer_head_table(self.induction, "induction score (repeated random tokens)"))
        return parts


def label_heads(
    masses: Tensor, n_heads: Sequence[int], threshold: float, *, induction: Tensor | None = None
) -> list[list[str]]:
    """Labels from masses [n_layers, max_heads, len(TARGETS)]: the top target if >= threshold, else mixed.

    With ``induction`` scores [n_layers, max_heads], a head scoring >= threshold is ``"induction"``.
    """
    labels = []
    for layer, n in enumerate(n_heads):
        row = []
        for h in range(n):
            if induction is not None and float(induction[layer, h]) >= threshold:
                row.append(INDUCTION_LABEL)
                continue
            m = masses[layer, h]
            best = int(torch.argmax(m))  # first maximum wins ties
            row.append(TARGETS[best] if float(m[best]) >= threshold else "mixed")
        labels.append(row)
    return labels


def _check_induction(induction: Any, shape: Sequence[int]) -> Tensor:
    """Induction scores must be a float tensor [n_layers, max_heads] (what :func:`induction_scores` gives)."""
    if not isinstance(induction, Tensor) or not induction.is_floating_point():
        got = f"dtype {induction.dtype}" if isinstance(induction, Tensor) else type(induction).__name__
        raise TypeError(f"induction must be a float tensor [n_layers, n_heads] (induction_scores); got {got}")
    if tuple(induction.shape) != tuple(shape):
        raise ValueError(
            f"induction must have shape [n_layers, n_heads] = {list(shape)} (induction_scores of this "
            f"model); got {list(induction.shape)}"
        )
    return induction.detach().to(torch.float32).cpu()


class RoleAccumulator:
    """Sums of per-head masses and entropies over batches, per layer; :meth:`result` averages them.

    Two ways in, one set of rules: :meth:`add` takes a layer's full pattern, :meth:`add_rows` the
    per-query values already reduced from it (what :func:`headspace.analysis.chunked.role_values`
    computes block by block, without the pattern).
    """

    def __init__(self, n_heads: Sequence[int]) -> None:
        self.n_heads = list(n_heads)
        self.sums = [torch.zeros(n, len(TARGETS) + 1, dtype=torch.float64) for n in self.n_heads]
        self.counts = [torch.zeros(len(TARGETS) + 1, dtype=torch.float64) for _ in self.n_heads]
        self.n_queries = 0

    def add(self, layer: int, pattern: Tensor, real: Tensor) -> None:
        """Add one layer's pattern [batch, n_heads, seq, seq] with ``real`` bool [batch, seq]."""
        B, H, Sq, Sk = pattern.shape
        if Sq != Sk:
            got = list(pattern.shape)
            raise ValueError(f"head roles need self-attention patterns (seq_q == seq_k); got {got}")
        if tuple(real.shape) != (B, Sq):
            raise ValueError(f"key_padding must be [batch, seq] = {[B, Sq]}; got {list(real.shape)}")
        P = pattern.detach().to(torch.float64)  # (B, H, S, S)
        real = real.to(P.device)
        S = Sq
        pos = torch.arange(S, device=P.device)  # (S,)
        first = torch.where(real, pos, S).amin(dim=1)  # (B,) first real position
        last = torch.where(real, pos, -1).amax(dim=1)  # (B,) last real position
        values = P.new_zeros(B, H, S, len(TARGETS) + 1)  # (B, H, S, 6): per query
        values[:, :, 1:, 0] = P.diagonal(offset=-1, dim1=-2, dim2=-1)  # query i, key i-1
        values[:, :, :-1, 1] = P.diagonal(offset=1, dim1=-2, dim2=-1)  # query i, key i+1
        values[..., 2] = P.diagonal(dim1=-2, dim2=-1)  # query i, key i
        idx_first = first.clamp(max=S - 1)[:, None, None, None].expand(B, H, S, 1)  # (B, H, S, 1)
        values[..., 3] = P.gather(-1, idx_first).squeeze(-1)
        idx_last = last.clamp(min=0)[:, None, None, None].expand(B, H, S, 1)  # (B, H, S, 1)
        values[..., 4] = P.gather(-1, idx_last).squeeze(-1)
        plogp = torch.where(P > 0, P * torch.log(P.clamp_min(1e-300)), torch.zeros_like(P))
        values[..., 5] = -plogp.sum(-1)  # entropy per query (B, H, S)
        del plogp
        self.add_rows(layer, values, real)

    def add_rows(self, layer: int, values: Tensor, real: Tensor) -> None:
        """Add one layer's per-query values [batch, n_heads, seq, 6] with ``real`` bool [batch, seq].

        ``values[..., :5]`` is each query's mass on the key before it, after it, itself, the first and
        the last real token (:data:`TARGETS` order), ``values[..., 5]`` its entropy. Only real queries
        count; ``previous`` only where the key before is at or after the first real token, ``next`` only
        where the key after is at or before the last real token.
        """
        B, _, S, n = values.shape
        if n != len(TARGETS) + 1:
            raise ValueError(
                f"values must be [batch, n_heads, seq, {len(TARGETS) + 1}]; got {list(values.shape)}"
            )
        if tuple(real.shape) != (B, S):
            raise ValueError(f"key_padding must be [batch, seq] = {[B, S]}; got {list(real.shape)}")
        V = values.detach().to(torch.float64)  # (B, H, S, 6)
        real = real.to(V.device)
        pos = torch.arange(S, device=V.device)[None]  # (1, S)
        first = torch.where(real, pos, S).amin(dim=1, keepdim=True)  # (B, 1) first real position
        last = torch.where(real, pos, -1).amax(dim=1, keepdim=True)  # (B, 1) last real position
        has_prev = (pos >= 1) & (pos - 1 >= first)  # (B, S)
        has_next = (pos + 1 < S) & (pos + 1 <= last)  # (B, S)
        valid = torch.stack([real & has_prev, real & has_next, real, real, real, real], dim=-1)  # (B, S, 6)
        kept = torch.where(valid[:, None], V, torch.zeros((), dtype=V.dtype, device=V.device))  # (B, H, S, 6)
        self.sums[layer] += kept.sum(dim=(0, 2)).cpu()  # (H, 6)
        self.counts[layer] += valid.sum(dim=(0, 1)).to(torch.float64).cpu()  # (6,)
        if layer == 0:
            self.n_queries += int(real.sum())

    def result(self, threshold: float, induction: Tensor | None = None) -> HeadRoles:
        means = [s / c.clamp_min(1) for s, c in zip(self.sums, self.counts)]  # [n_heads_l, 6] each
        for m, c in zip(means, self.counts):
            m[:, c == 0] = float("nan")  # e.g. no query has a previous token
        stacked = pad_heads([m.to(torch.float32) for m in means])  # (n_layers, max_heads, 6)
        fields = {name: stacked[..., j] for j, name in enumerate(TARGETS)}
        masses = torch.nan_to_num(stacked[..., : len(TARGETS)], nan=-1.0)  # (n_layers, max_heads, 5)
        if induction is not None:
            induction = _check_induction(induction, stacked.shape[:2])
        labels = label_heads(masses, self.n_heads, threshold, induction=induction)
        return HeadRoles(
            **fields,
            entropy=stacked[..., len(TARGETS)],
            labels=labels,
            threshold=float(threshold),
            n_queries=self.n_queries,
            induction=induction,
        )


def _check_threshold(threshold: Any) -> float:
    if not is_number(threshold) or not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be a number in (0, 1]; got {threshold!r}")
    return float(threshold)


def roles_from_patterns(
    patterns: Sequence[Tensor],
    key_padding: Tensor | None = None,
    *,
    threshold: float = DEFAULT_THRESHOLD,
    induction: Tensor | None = None,
) -> HeadRoles:
    """Head roles from recorded patterns: one [batch, n_heads, seq, seq] tensor per layer.

    ``key_padding``: bool [batch, seq], True for real tokens (None: all real). ``induction``: scores
    [n_layers, max_heads] from :func:`induction_scores`, kept in the result and used by the labels.

    Every layer's pattern must come from the same inputs (same batch and seq) and be finite: NaN/Inf
    patterns are refused (they would label every head ``"mixed"``).
    """
    threshold = _check_threshold(threshold)
    if isinstance(patterns, Tensor):
        raise TypeError(
            "patterns must be a list of [batch, n_heads, seq, seq] tensors, one per layer; got a single "
            f"tensor of shape {list(patterns.shape)} (for a stacked [n_layers, batch, n_heads, seq, seq] "
            "tensor pass list(patterns.unbind(0)); for one layer pass [pattern])"
        )
    if isinstance(patterns, (str, bytes)) or not isinstance(patterns, Sequence):
        raise TypeError(
            "patterns must be a list of [batch, n_heads, seq, seq] tensors, one per layer; got "
            f"{type(patterns).__name__}"
        )
    if not patterns:
        raise ValueError("patterns must hold one [batch, n_heads, seq, seq] tensor per layer; got none")
    for i, p in enumerate(patterns):
        check_tensor_dims(p, 4, f"patterns[{i}] must be [batch, n_heads, seq, seq]")
        if p.shape[2] != p.shape[3]:
            raise ValueError(
                f"head roles need self-attention patterns (seq_q == seq_k); patterns[{i}] (layer {i}) has "
                f"shape {list(p.shape)}"
            )
        if p.shape[0] != patterns[0].shape[0] or p.shape[2] != patterns[0].shape[2]:
            raise ValueError(
                f"patterns[{i}] (layer {i}) has batch {p.shape[0]}, seq {p.shape[2]} (shape {list(p.shape)}) "
                f"but patterns[0] (layer 0) has batch {patterns[0].shape[0]}, seq {patterns[0].shape[2]} "
                f"(shape {list(patterns[0].shape)}); every layer's pattern must come from the same inputs"
            )
        bad = nonfinite_count(p)
        if bad:
            raise ValueError(
                f"patterns[{i}] (layer {i}) has {bad} non-finite values (NaN/Inf) of {p.numel()}; attention "
                "patterns must be finite probabilities"
            )
    B, _, S, _ = patterns[0].shape
    if key_padding is not None:
        if not isinstance(key_padding, Tensor):
            raise TypeError(
                "key_padding must be a bool tensor [batch, seq] with True for real tokens (or None: all "
                f"real); got {type(key_padding).__name__}"
            )
        if key_padding.dtype != torch.bool:
            raise TypeError(
                "key_padding must be a bool tensor [batch, seq] with True for real tokens; got dtype "
                f"{key_padding.dtype} (integer and float padding masks are refused: their polarity cannot "
                "be guessed; for a 1 = real token convention pass key_padding.bool())"
            )
        if tuple(key_padding.shape) != (B, S):
            raise ValueError(
                f"key_padding must have shape [batch, seq] = {[B, S]} (the patterns' batch and seq); got "
                f"{list(key_padding.shape)}"
            )
    acc = RoleAccumulator([p.shape[1] for p in patterns])
    real = torch.ones(B, S, dtype=torch.bool) if key_padding is None else key_padding
    for i, p in enumerate(patterns):
        acc.add(i, p, real)
    return acc.result(threshold, induction)


def _plan(batch: Batch, layers: Sequence[tuple[str, Any]], chunk_size: Any) -> int | None:
    """Queries per block for this batch, or None for the traced full-pattern path (see head_roles)."""
    if chunk_size is None:
        return None
    x = batch.args[0]
    B, S = int(x.shape[0]), int(x.shape[1])
    n_heads = max(m.n_heads for _, m in layers)
    capturable = all(supports_qk_capture(m) for _, m in layers)
    if chunk_size == "auto":
        # hook functions that replace q, k, scores or patterns are seen by the traced path only
        if not capturable or any(m.hooks_active for _, m in layers):
            return None
        if B * n_heads * S * S * 4 <= AUTO_PATTERN_BYTES:
            return None
        return default_chunk_size(B, n_heads, S, S)
    if not capturable:
        odd = next(type(m).__name__ for _, m in layers if not supports_qk_capture(m))
        raise ValueError(
            f"chunk_size={chunk_size}: this model's {odd} layers have their own forward, so their q and k "
            "cannot be recomputed from their input; pass chunk_size=None (full patterns)"
        )
    return chunk_size


def _check_chunk_size(chunk_size: Any) -> None:
    if chunk_size is None or chunk_size == "auto":
        return
    if not is_int(chunk_size) or chunk_size < 1:
        raise ValueError(
            f"chunk_size must be 'auto', None (full patterns) or a positive int; got {chunk_size!r}"
        )


def _add_batch_full(
    acc: RoleAccumulator, model: Any, layers: Sequence[tuple[str, Any]], batch: Batch
) -> None:
    """The traced path: each layer's pattern is folded into the sums inside its hook, then dropped."""
    module = as_module(model)
    real = batch.real

    def fold(layer: int) -> Any:
        def fn(value: Tensor, point: Any) -> None:
            acc.add(layer, value, real)

        return fn

    names = {
        (f"{path}.hook_pattern" if path else "hook_pattern"): fold(i) for i, (path, _) in enumerate(layers)
    }
    with hooked(model, names):
        batch.run(module)


def _add_batch_chunked(acc: RoleAccumulator, model: Any, batch: Batch, chunk: int) -> None:
    """The chunked path: each layer's q and k, recomputed from its input, reduced block by block."""
    module = as_module(model)
    real = batch.real

    def fold(call: Any) -> None:
        acc.add_rows(call.layer, call.role_values(chunk_size=chunk), real)

    each_layer_qk(model, lambda: batch.run(module), fold)


def head_roles(
    model: Any,
    inputs: Any,
    *,
    key_padding: Tensor | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    batch_size: int = 32,
    chunk_size: int | str | None = "auto",
    induction: bool | Tensor = False,
) -> HeadRoles:
    """Run ``model`` on ``inputs`` and measure every head's attention targets (see the module docstring).

    Args:
        model: a pretrained wrapper (``headspace.load("minilm")``), an Encoder/Decoder, a block or a
            :class:`~headspace.MultiHeadAttention`.
        inputs: sentences (pretrained wrapper), token ids [batch, seq], activations [batch, seq, d_model],
            or a list of tensors (see :func:`headspace.analysis._common.make_batches`).
        key_padding: bool [batch, seq], True for real tokens, with a single tensor input.
        threshold: minimum mean mass for a role label (otherwise ``"mixed"``).
        batch_size: sentences per forward pass.
        chunk_size: how the patterns are measured, per forward pass:

            * ``"auto"`` (default): block by block when one layer's patterns of the pass would exceed
              :data:`AUTO_PATTERN_BYTES` (long inputs), with :func:`~headspace.analysis.chunked.
              default_chunk_size` queries per block; else (and whenever a hook function is active on
              an attention layer, or a layer is a subclass with its own forward) the traced path;
            * None: always the traced path, the layers' own ``hook_pattern`` (one layer's
              [batch, n_heads, seq, seq] alive at a time);
            * an int: block by block with that many queries per block.

            Block by block, each layer's q and k are recomputed from its input with its own projection
            and rotation (:func:`~headspace.analysis.chunked.each_layer_qk`: the layers keep their fused
            path and never build a pattern, and the forward stops after the last attention layer), and
            each block of queries against all keys is softmaxed in float32 and reduced at once. Peak
            extra memory: a few [batch, n_heads, chunk, seq] float32 blocks plus one layer's q and k.
        induction: True: also compute :func:`induction_scores` (defaults; token-id models only) into
            ``HeadRoles.induction`` and label heads ``"induction"``; a tensor: scores already computed
            (``induction_scores(model, n=..., seed=...)``); False (default): None.

    The model runs in eval mode without autograd (its mode is restored).
    """
    threshold = _check_threshold(threshold)
    _check_chunk_size(chunk_size)
    if not isinstance(induction, (bool, Tensor)):
        raise TypeError(
            f"induction must be a bool or the scores of induction_scores(); got {type(induction).__name__}"
        )
    module = as_module(model)
    layers = attention_layers(model)
    if not layers:
        raise ValueError(f"model has no MultiHeadAttention layer; got {type(model).__name__}")
    batches = make_batches(model, inputs, key_padding, batch_size)
    acc = RoleAccumulator([m.n_heads for _, m in layers])
    with eval_mode(module):
        for batch in batches:
            chunk = _plan(batch, layers, chunk_size)
            if chunk is None:
                _add_batch_full(acc, model, layers, batch)
            else:
                _add_batch_chunked(acc, model, batch, chunk)
    scores: Tensor | None = None
    if isinstance(induction, Tensor):
        scores = induction
    elif induction:
        scores = induction_scores(model)
    return acc.result(threshold, scores)


# ---------------------------------------------------------------------------------------------- induction
def _special_ids(model: Any, module: Any) -> set[int]:
    """Token ids that are not ordinary words: the wrapper's special tokens and the config's pad id."""
    ids: set[int] = set()
    special = getattr(model, "special_tokens", None)
    if isinstance(special, dict):
        ids |= {int(v) for v in special.values() if is_int(v)}
    config = getattr(module, "config", None)
    pad = getattr(config, "pad_token_id", None)
    if is_int(pad):
        ids.add(int(pad))
    return ids


def _default_bos(model: Any) -> int | None:
    special = getattr(model, "special_tokens", None)
    bos = special.get("bos") if isinstance(special, dict) else None
    return int(bos) if is_int(bos) else None


def repeated_tokens(
    vocab_size: int, n: int, batch: int, *, seed: int = 0, bos: int | None = None, exclude: Sequence[int] = ()
) -> Tensor:
    """The inputs of :func:`induction_scores`: int64 [batch, (1 if bos is not None) + 2 n].

    Each row is ``[bos] + r + r`` with ``r`` ``n`` distinct token ids drawn from ``[0, vocab_size)``
    minus ``exclude`` (with replacement only if fewer than ``n`` remain), from a generator seeded by
    ``seed``: the same arguments give the same tokens.
    """
    for name, value in (("vocab_size", vocab_size), ("n", n), ("batch", batch)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive int; got {value!r}")
    if not is_int(seed):
        raise TypeError(f"seed must be an int; got {type(seed).__name__} {seed!r}")
    banned = {int(i) for i in exclude} | ({int(bos)} if bos is not None else set())
    candidates = torch.tensor([i for i in range(vocab_size) if i not in banned], dtype=torch.int64)
    if candidates.numel() == 0:
        raise ValueError(
            f"no token id is left to draw from (vocab_size={vocab_size}, excluded {sorted(banned)})"
        )
    g = torch.Generator().manual_seed(int(seed))
    rows = []
    for _ in range(batch):
        if candidates.numel() >= n:
            r = candidates[torch.randperm(candidates.numel(), generator=g)[:n]]  # (n,) distinct
        else:
            r = candidates[torch.randint(candidates.numel(), (n,), generator=g)]  # (n,)
        parts = ([torch.tensor([bos], dtype=torch.int64)] if bos is not None else []) + [r, r]
        rows.append(torch.cat(parts))
    return torch.stack(rows)  # (batch, offset + 2 n)


def induction_scores(
    model: Any,
    *,
    n: int = DEFAULT_INDUCTION_N,
    batch: int = DEFAULT_INDUCTION_BATCH,
    seed: int = 0,
    bos: int | str | None = "auto",
    vocab_size: int | None = None,
) -> Tensor:
    """Each head's induction score: float32 [n_layers, max_heads] in [0, 1] (NaN for pruned heads).

    On ``batch`` rows of :func:`repeated_tokens` (``[bos] + r + r``, ``r`` n distinct random ids), the
    mean over the rows and the ``n`` queries of the second copy of the attention mass from query ``i`` to
    key ``i - n + 1``: the token that followed the query's token at its first occurrence. Meant for
    decoders (causal), where a head can only score by looking back; an encoder's heads are measured by
    the same definition.

    Only the pattern rows of the second copy are computed, from each layer's q and k
    (:func:`headspace.analysis.chunked.each_layer_qk`), so no layer builds a pattern; where that cannot
    be exact (an ALiBi layer's bias, a layer with its own forward: Gemma 2's softcap, Gemma 3n, Gemma 4)
    every layer's traced ``hook_pattern`` gives the rows instead (``2 n + 1`` tokens: a small pattern).

    Args:
        model: a Decoder (or Encoder), a pretrained wrapper, or any module taking token ids [batch, seq]
            (then give ``vocab_size``).
        n: tokens per copy; batch: rows; seed: the random draw (same seed, same tokens, same scores).
        bos: the token put first: ``"auto"`` (the wrapper's ``special_tokens["bos"]``, if any), an id,
            or None (none).
        vocab_size: the ids to draw from (default ``model.config.vocab_size``).
    """
    module = as_module(model)
    layers = attention_layers(model)
    if not layers:
        raise ValueError(f"model has no MultiHeadAttention layer; got {type(model).__name__}")
    config = getattr(module, "config", None)
    if vocab_size is None:
        vocab_size = getattr(config, "vocab_size", None)
        if vocab_size is None:
            raise TypeError(
                f"induction scores need a model that takes token ids; {type(module).__name__} has no "
                "config.vocab_size (pass vocab_size=...)"
            )
    if bos == "auto":
        bos = _default_bos(model)
    elif bos is not None and (not is_int(bos) or not 0 <= bos < vocab_size):
        raise ValueError(f"bos must be 'auto', None or a token id in [0, {vocab_size}); got {bos!r}")
    tokens = repeated_tokens(
        vocab_size, n, batch, seed=seed, bos=bos, exclude=sorted(_special_ids(model, module))
    )
    max_len = getattr(config, "max_seq_len", None)
    if is_int(max_len) and tokens.shape[1] > max_len:
        raise ValueError(
            f"the repeated sequence has {tokens.shape[1]} tokens (n={n} twice"
            f"{' after a BOS' if bos is not None else ''}), more than max_seq_len={max_len}; choose a "
            "smaller n"
        )
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    tokens = tokens.to(device)
    offset = 1 if bos is not None else 0
    queries = torch.arange(offset + n, offset + 2 * n, device=device)  # (n,): the second copy
    keys = queries - n + 1  # (n,): the token after the first occurrence
    rows: list[Tensor] = [torch.empty(0)] * len(layers)

    def mass(layer: int, p: Tensor) -> None:  # p: (batch, n_heads, n, seq), the second copy's rows
        m = p.gather(-1, keys[None, None, :, None].expand(*p.shape[:3], 1)).squeeze(-1)  # (batch, H, n)
        rows[layer] = m.float().mean(dim=(0, 2)).cpu()  # (H,)

    with eval_mode(module):
        if all(_chunkable(m) for _, m in layers):
            each_layer_qk(
                model, lambda: module(tokens), lambda call: mass(call.layer, call.pattern_rows(queries))
            )
        else:  # ALiBi, or a layer with its own forward: each layer's traced pattern (2 n + 1 tokens)
            names = {
                (f"{path}.hook_pattern" if path else "hook_pattern"): _rows_of(mass, i, queries)
                for i, (path, _) in enumerate(layers)
            }
            with hooked(model, names):
                module(tokens)
    return pad_heads(rows)


def _chunkable(attn: Any) -> bool:
    """Whether :func:`~.chunked.each_layer_qk` recomputes ``attn``'s scores whole: its q and k can be
    recomputed from its input, no score bias (ALiBi) is added to them and no learned sink (gpt-oss) joins
    their softmax."""
    no_bias = getattr(getattr(attn, "spec", None), "bias", None) is None
    return supports_qk_capture(attn) and no_bias and getattr(attn, "sinks", None) is None


def _rows_of(mass: Any, layer: int, queries: Tensor) -> Any:
    """A ``hook_pattern`` function handing ``mass(layer, rows)`` the pattern rows ``queries`` of the call
    (``rows`` [batch, n_heads, len(queries), seq]); the pattern is left unchanged."""

    def fn(value: Tensor, point: Any) -> None:  # value: (batch, n_heads, seq, seq)
        mass(layer, value[:, :, queries])

    return fn
