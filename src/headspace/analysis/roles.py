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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..checks import is_number, nonfinite_count
from ..trace import as_module, attention_layers, trace
from ._common import JsonResult, eval_mode, layer_head_table, make_batches, pad_heads

TARGETS = ("previous", "next", "current", "first", "last")
"""The attention targets measured, in label precedence order (ties go to the earlier one)."""

DEFAULT_THRESHOLD = 0.4


@dataclass
class HeadRoles(JsonResult):
    """Per-head attention statistics and role labels.

    Every tensor is [n_layers, n_heads] (NaN where a pruned layer has fewer heads): the mean attention
    mass on the ``previous``, ``next``, ``current``, ``first`` and ``last`` token, and the mean pattern
    ``entropy`` in nats. ``labels[layer][head]`` is one of :data:`TARGETS` or ``"mixed"``, decided with
    ``threshold``. ``n_queries`` counts the real query tokens averaged over (per layer it is the same).
    """

    kind = "head_roles"

    previous: Tensor
    next: Tensor
    current: Tensor
    first: Tensor
    last: Tensor
    entropy: Tensor
    labels: list[list[str]]
    threshold: float
    n_queries: int

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
        return [
            layer_head_table(top, caption, labels=self.labels),
            layer_head_table(self.entropy, "mean pattern entropy (nats)"),
        ]


def label_heads(masses: Tensor, n_heads: Sequence[int], threshold: float) -> list[list[str]]:
    """Labels from masses [n_layers, max_heads, len(TARGETS)]: the top target if >= threshold, else mixed."""
    labels = []
    for layer, n in enumerate(n_heads):
        row = []
        for h in range(n):
            m = masses[layer, h]
            best = int(torch.argmax(m))  # first maximum wins ties
            row.append(TARGETS[best] if float(m[best]) >= threshold else "mixed")
        labels.append(row)
    return labels


class RoleAccumulator:
    """Sums of per-head masses and entropies over batches, per layer; :meth:`result` averages them."""

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
        rq = real[:, None, :].to(P.dtype)  # (B, 1, S): real queries

        def masked_sum(values: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
            """values (B, H, n), valid (B, 1, n) -> per-head sum (H,), count."""
            return (values * valid).sum(dim=(0, 2)), valid.sum()

        out = []
        has_prev = pos[None, None, 1:] - 1 >= first[:, None, None]  # (B, 1, S-1)
        prev_valid = rq[..., 1:] * has_prev.to(P.dtype)  # (B, 1, S-1)
        out.append(masked_sum(P.diagonal(offset=-1, dim1=-2, dim2=-1), prev_valid))  # query i, key i-1
        has_next = pos[None, None, :-1] + 1 <= last[:, None, None]  # (B, 1, S-1)
        next_valid = rq[..., :-1] * has_next.to(P.dtype)  # (B, 1, S-1)
        out.append(masked_sum(P.diagonal(offset=1, dim1=-2, dim2=-1), next_valid))  # query i, key i+1
        out.append(masked_sum(P.diagonal(dim1=-2, dim2=-1), rq))  # query i, key i
        idx_first = first.clamp(max=S - 1)[:, None, None, None].expand(B, H, S, 1)  # (B, H, S, 1)
        out.append(masked_sum(P.gather(-1, idx_first).squeeze(-1), rq))
        idx_last = last.clamp(min=0)[:, None, None, None].expand(B, H, S, 1)  # (B, H, S, 1)
        out.append(masked_sum(P.gather(-1, idx_last).squeeze(-1), rq))
        plogp = torch.where(P > 0, P * torch.log(P.clamp_min(1e-300)), torch.zeros_like(P))
        out.append(masked_sum(-plogp.sum(-1), rq))  # entropy per query (B, H, S)
        for j, (s, c) in enumerate(out):
            self.sums[layer][:, j] += s.cpu()
            self.counts[layer][j] += c.cpu()
        if layer == 0:
            self.n_queries += int(real.sum())

    def result(self, threshold: float) -> HeadRoles:
        means = [s / c.clamp_min(1) for s, c in zip(self.sums, self.counts)]  # [n_heads_l, 6] each
        for m, c in zip(means, self.counts):
            m[:, c == 0] = float("nan")  # e.g. no query has a previous token
        stacked = pad_heads([m.to(torch.float32) for m in means])  # (n_layers, max_heads, 6)
        fields = {name: stacked[..., j] for j, name in enumerate(TARGETS)}
        masses = torch.nan_to_num(stacked[..., : len(TARGETS)], nan=-1.0)  # (n_layers, max_heads, 5)
        labels = label_heads(masses, self.n_heads, threshold)
        return HeadRoles(
            **fields,
            entropy=stacked[..., len(TARGETS)],
            labels=labels,
            threshold=float(threshold),
            n_queries=self.n_queries,
        )


def _check_threshold(threshold: Any) -> float:
    if not is_number(threshold) or not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be a number in (0, 1]; got {threshold!r}")
    return float(threshold)


def roles_from_patterns(
    patterns: Sequence[Tensor], key_padding: Tensor | None = None, *, threshold: float = DEFAULT_THRESHOLD
) -> HeadRoles:
    """Head roles from recorded patterns: one [batch, n_heads, seq, seq] tensor per layer.

    ``key_padding``: bool [batch, seq], True for real tokens (None: all real).

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
        if not isinstance(p, Tensor) or p.dim() != 4:
            got = list(p.shape) if isinstance(p, Tensor) else type(p).__name__
            raise ValueError(f"patterns[{i}] must be [batch, n_heads, seq, seq]; got {got}")
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
    return acc.result(threshold)


def head_roles(
    model: Any,
    inputs: Any,
    *,
    key_padding: Tensor | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    batch_size: int = 32,
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

    Only ``hook_pattern`` is traced; the model runs in eval mode without autograd (its mode is restored).
    """
    threshold = _check_threshold(threshold)
    module = as_module(model)
    layers = attention_layers(model)
    if not layers:
        raise ValueError(f"model has no MultiHeadAttention layer; got {type(model).__name__}")
    batches = make_batches(model, inputs, key_padding, batch_size)
    acc = RoleAccumulator([m.n_heads for _, m in layers])
    with eval_mode(module):
        for batch in batches:
            with trace(model, "*hook_pattern") as t:
                batch.run(module)
            for i in range(len(layers)):
                acc.add(i, t.pattern(i), batch.real)
    return acc.result(threshold)
