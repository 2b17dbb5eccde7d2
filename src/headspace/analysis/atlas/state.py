"""The head atlas's running state: sums, counts and top-k candidates, merged exactly in any order.

Every statistic of :func:`headspace.analysis.atlas` is a sum over query positions divided by a count.
A shard (a fixed group of sequences) accumulates its sums in float64; when it is sealed they become
fixed-point integers (``round(x * 2**FIXED_BITS)``, Python ints in the JSON), so that adding shards is
integer addition: associative and exact, so the merged atlas is the same whatever the order or the
grouping (resumed runs, ranks of a torch.distributed job). The quantum 2^-40 ~ 9e-13 is far below the
float32 rounding of the model's own numbers.

Top-k examples are candidates ``(score, sequence, query, key, value)`` per head; a merge keeps the
``top_k`` largest under a total order (score descending, then sequence, query, key), so it is
order-independent too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

FIXED_BITS = 40
"""Sums are stored as integers in units of 2^-FIXED_BITS."""

MEANS = ("previous", "first", "sink", "self", "entropy", "duplicate", "induction", "copying", "direct_effect")
"""The per-head means of the atlas, each a sum [n_layers, max_heads] over its own count of queries."""

EXAMPLE_KINDS = ("attention", "direct_effect")
"""Top-k example lists per head: by attention weight, and by |direct effect|."""

Candidate = tuple[float, int, int, int, float]  # (score, sequence, query, key, value)


def _fixed(t: Tensor) -> list[Any]:
    """float64 tensor -> nested lists of ints in units of 2^-FIXED_BITS."""
    scaled = torch.round(t.to(torch.float64) * 2.0**FIXED_BITS)
    rows = scaled.reshape(scaled.shape[0], -1)  # (n_layers, the rest flattened)
    return [[int(v) for v in row] for row in rows.tolist()]


def _unfixed(rows: list[list[int]], shape: tuple[int, ...]) -> list[list[int]]:
    if len(rows) != shape[0] or any(len(r) != int(torch.tensor(shape[1:]).prod()) for r in rows):
        raise ValueError(f"atlas shard: a sum has the wrong shape; expected {list(shape)}")
    return rows


def _sort_key(c: Candidate) -> tuple[float, int, int, int]:
    return (-c[0], c[1], c[2], c[3])


def keep_top(candidates: Iterable[Candidate], k: int) -> list[Candidate]:
    """The ``k`` best candidates (score descending; ties by sequence, query, key): a total order."""
    return sorted(candidates, key=_sort_key)[:k]


@dataclass
class AtlasState:
    """Sums (fixed-point ints once sealed), counts and top-k candidates of a part of the corpus.

    ``sums[name]``: float64 [n_layers, max_heads] while accumulating (:meth:`add_sum`), ints after
    :meth:`seal`; ``counts[name]``: the queries each mean is over. ``z_sum`` float64 [n_layers,
    max_heads, d_head]: the sum of every head's z over the real tokens (``n_tokens``), for mean-ablation.
    ``ablation_sum`` [n_layers, max_heads] the corpus cross-entropy summed over next-token pairs with
    each head mean-ablated, ``clean_sum`` the same without ablation, ``n_pairs`` their count.
    ``top[kind][layer][head]``: candidate lists.
    """

    n_layers: int
    max_heads: int
    d_head: int
    top_k: int
    sums: dict[str, Any] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    z_sum: Any = None
    ablation_sum: Any = None
    clean_sum: Any = 0
    n_pairs: int = 0
    n_queries: int = 0
    n_tokens: int = 0
    n_sequences: int = 0
    top: dict[str, list[list[list[Candidate]]]] = field(default_factory=dict)
    sealed: bool = False

    def __post_init__(self) -> None:
        shape = (self.n_layers, self.max_heads)
        for name in MEANS:
            self.sums.setdefault(name, torch.zeros(shape, dtype=torch.float64))
            self.counts.setdefault(name, 0)
        if self.z_sum is None:
            self.z_sum = torch.zeros(*shape, self.d_head, dtype=torch.float64)
        if self.ablation_sum is None:
            self.ablation_sum = torch.zeros(shape, dtype=torch.float64)
        for kind in EXAMPLE_KINDS:
            self.top.setdefault(kind, [[[] for _ in range(self.max_heads)] for _ in range(self.n_layers)])

    def add_sum(self, name: str, layer: int, values: Tensor, count: int) -> None:
        """Add per-head sums ``values`` [n_heads] of layer ``layer`` over ``count`` queries (counted once,
        on layer 0: every layer sees the same queries)."""
        self.sums[name][layer, : values.shape[0]] += values.detach().to(torch.float64).cpu()
        if layer == 0:
            self.counts[name] += int(count)

    def add_candidates(self, kind: str, layer: int, head: int, found: list[Candidate]) -> None:
        """Offer candidates for head (layer, head); only the ``top_k`` best are kept."""
        kept = self.top[kind][layer][head]
        kept.extend(found)
        self.top[kind][layer][head] = keep_top(kept, self.top_k)

    def seal(self) -> dict[str, Any]:
        """The JSON form: sums as fixed-point ints (see the module docstring)."""
        return {
            "shape": [self.n_layers, self.max_heads, self.d_head], "top_k": self.top_k,
            "sums": {n: _fixed(self.sums[n]) for n in MEANS}, "counts": dict(self.counts),
            "z_sum": _fixed(self.z_sum), "ablation_sum": _fixed(self.ablation_sum),
            "clean_sum": round(float(self.clean_sum) * 2.0**FIXED_BITS), "n_pairs": self.n_pairs,
            "n_queries": self.n_queries, "n_tokens": self.n_tokens, "n_sequences": self.n_sequences,
            "top": {k: [[[list(c) for c in cs] for cs in row] for row in self.top[k]] for k in EXAMPLE_KINDS},
        }  # fmt: skip


@dataclass
class SealedState:
    """A merged, sealed state: integer sums (exact), counts and top-k lists; :meth:`add` merges one more."""

    data: dict[str, Any]

    @classmethod
    def empty_like(cls, other: dict[str, Any]) -> SealedState:
        """A state of zeros with the shape and ``top_k`` of ``other`` (a sealed dict)."""
        L, H, dh = other["shape"]
        blank = AtlasState(L, H, dh, other["top_k"]).seal()
        return cls(blank)

    def add(self, other: dict[str, Any]) -> None:
        """Merge the sealed dict ``other`` in (integer sums add; top-k lists merge)."""
        d = self.data
        if other["shape"] != d["shape"] or other["top_k"] != d["top_k"]:
            raise ValueError(
                f"atlas shards disagree: shape {other['shape']} top_k {other['top_k']} against "
                f"{d['shape']} top_k {d['top_k']}"
            )
        L, H, dh = d["shape"]
        for name in MEANS:
            a, b = d["sums"][name], _unfixed(other["sums"][name], (L, H))
            d["sums"][name] = [[x + y for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]
            d["counts"][name] += int(other["counts"][name])
        for key, shape in (("z_sum", (L, H * dh)), ("ablation_sum", (L, H))):
            b = _unfixed(other[key], shape)
            d[key] = [[x + y for x, y in zip(ra, rb)] for ra, rb in zip(d[key], b)]
        for key in ("clean_sum", "n_pairs", "n_queries", "n_tokens", "n_sequences"):
            d[key] += int(other[key])
        k = d["top_k"]
        for kind in EXAMPLE_KINDS:
            for layer in range(L):
                for h in range(H):
                    both = [tuple(c) for c in d["top"][kind][layer][h] + other["top"][kind][layer][h]]
                    d["top"][kind][layer][h] = [list(c) for c in keep_top(both, k)]  # type: ignore[arg-type]

    def mean(self, name: str) -> Tensor:
        """float64 [n_layers, max_heads]: the sum divided by its count (NaN when the count is 0)."""
        count = self.data["counts"][name]
        s = torch.tensor(self.data["sums"][name], dtype=torch.float64) / 2.0**FIXED_BITS
        return s / count if count else torch.full_like(s, float("nan"))

    def z_means(self) -> Tensor:
        """float64 [n_layers, max_heads, d_head]: every head's mean z over the corpus's real tokens."""
        L, H, dh = self.data["shape"]
        s = (
            torch.tensor(self.data["z_sum"], dtype=torch.float64).view(L, H, dh) / 2.0**FIXED_BITS
        )  # (L, H, dh)
        return s / max(1, self.data["n_tokens"])
