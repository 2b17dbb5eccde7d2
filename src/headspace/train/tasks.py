"""Built-in synthetic tasks with ground truth for where each relation between tokens points.

A task draws batches of token sequences with per-position targets. Targets are aligned with the inputs:
the model's output at position ``i`` is scored against ``targets[:, i]`` (``IGNORE`` = no target there).
Every scored position needs exactly one *relation* (a rule saying which earlier token holds the answer),
and the batch says which one (``relation``) and where it points (``relation_pos``), so that a trained
head's attention can be checked against the ground truth and ablations can be scored per relation.

Tasks:

``relations`` (:class:`RelationsTask`): every answer needs two different relations at once.
    The sequence opens with a *memory* of ``n_types`` items, one per type in random order, each with a
    random value, then a *stream* of ``n_stream`` random items. All items are tokens ``item(t, v)``
    naming a type and a value. At every stream position the answer is the pair ``(a, b)``, one token:

    * ``a`` = the value of the token just before (relation ``previous_token``),
    * ``b`` = the value of the memory item whose type matches the current token's type (relation
      ``matching_type``).

    Example (``n_types=3``; items written type:value)::

        memory: 2:5 0:1 1:7 | stream: 1:4   0:3   2:6   2:0
        answer:                    (7,7) (4,1) (3,5) (6,5)

    Each part of the answer is an *output* that needs exactly one relation: the batch gives, per scored
    position and relation, the key position holding it (``relation_pos``), and :meth:`RelationsTask.parts`
    splits an answer token into its parts, so accuracy, attention and ablations are scored per relation.
    One query must look at two places at once: a single head has to split its attention (and cannot
    tell which value came from where), two heads can each take one relation.

``reverse`` (:class:`ReverseTask`): ``x_1 .. x_n SEP x_n .. x_1`` as next-token prediction; the token
    predicted at output step ``i`` sits at the mirror position (relation ``mirror``).

Data depend only on the ``torch.Generator`` passed in, so a batch is a pure function of (seed, step):
see :func:`batch_generator`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from ..core.checks import is_int

IGNORE = -100  # target value meaning "no target at this position" (cross_entropy's ignore_index)

TRAIN_STREAM = 0
EVAL_STREAM = 1
DROPOUT_STREAM = 2  # + rank: each rank draws its own dropout masks


def step_seed(seed: int, step: int, stream: int = TRAIN_STREAM) -> int:
    """A 64-bit seed that depends only on (seed, step, stream), mixed by NumPy's SeedSequence.

    Neighbouring steps (and streams) get unrelated values.
    """
    for name, value in (("seed", seed), ("step", step), ("stream", stream)):
        if not is_int(value) or value < 0:
            raise ValueError(f"{name} must be a non-negative int; got {value!r}")
    state = np.random.SeedSequence([seed, step, stream]).generate_state(2, dtype=np.uint32)
    return int(state[0]) << 32 | int(state[1])


def batch_generator(seed: int, step: int, stream: int = TRAIN_STREAM) -> torch.Generator:
    """A CPU generator whose state depends only on (seed, step, stream) (see :func:`step_seed`)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(step_seed(seed, step, stream))
    return g


@dataclass(frozen=True)
class Batch:
    """One batch of a task.

    Attributes:
        tokens: int64 [batch, seq] inputs.
        targets: int64 [batch, seq], the answer token expected at each position, ``IGNORE`` where none.
        relation_pos: int64 [batch, seq, n_relations], for each scored position and relation the key
            position that relation points to (-1 where none); None for data without ground truth (text).
    """

    tokens: Tensor
    targets: Tensor
    relation_pos: Tensor | None = None

    def rows(self, start: int, stop: int) -> Batch:
        """Rows [start, stop) of every tensor (a data-parallel rank's share of the global batch)."""
        rel = None if self.relation_pos is None else self.relation_pos[start:stop]
        return Batch(self.tokens[start:stop], self.targets[start:stop], rel)

    def to(self, device: torch.device | str) -> Batch:
        rel = None if self.relation_pos is None else self.relation_pos.to(device)
        return Batch(self.tokens.to(device), self.targets.to(device), rel)


def _check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if not is_int(value):
        raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bound}; got {value}")
    return value


class _Task:
    """What the built-in tasks share: a name, relations, options, and :meth:`describe` from them."""

    name: ClassVar[str]
    relations: ClassVar[tuple[str, ...]]
    #: The constructor's options, in the order :meth:`describe` lists them.
    options: ClassVar[tuple[str, ...]]
    vocab_size: int
    seq_len: int

    def describe(self) -> dict:
        """The task as a JSON-able dict: name, options, vocab_size, seq_len and relations."""
        return {
            "name": self.name,
            **{option: getattr(self, option) for option in self.options},
            "vocab_size": self.vocab_size,
            "seq_len": self.seq_len,
            "relations": list(self.relations),
        }


class RelationsTask(_Task):
    """Answers that need two relations at once, each part needing exactly one (see the module docstring).

    Token ids: ``item(t, v) = t * n_values + v`` for the ``n_types * n_values`` items, then the answers
    ``answer(a, b) = n_types * n_values + a * n_values + b``. Sequence length ``n_types + n_stream``;
    positions ``n_types ..`` (the stream) are scored.
    """

    name = "relations"
    relations = ("previous_token", "matching_type")
    options = ("n_types", "n_values", "n_stream")

    def __init__(self, n_types: int = 8, n_values: int = 8, n_stream: int = 16) -> None:
        self.n_types = _check_int("n_types", n_types, 2, 64)
        self.n_values = _check_int("n_values", n_values, 2, 64)
        self.n_stream = _check_int("n_stream", n_stream, 1, 1024)
        self.answer_base = n_types * n_values
        self.vocab_size = self.answer_base + n_values * n_values
        self.seq_len = n_types + n_stream

    def sample(self, generator: torch.Generator, batch_size: int) -> Batch:
        """Draw ``batch_size`` sequences; see :class:`Batch` for the fields."""
        _check_int("batch_size", batch_size, 1)
        B, K, V, P = batch_size, self.n_types, self.n_values, self.n_stream
        g = generator
        mem_types = torch.rand(B, K, generator=g).argsort(dim=1)  # (B, K): a random order of the types
        mem_values = torch.randint(0, V, (B, K), generator=g)  # (B, K)
        types = torch.randint(0, K, (B, P), generator=g)  # (B, P) stream types
        values = torch.randint(0, V, (B, P), generator=g)  # (B, P) stream values

        slot_of_type = mem_types.argsort(dim=1)  # (B, K): slot_of_type[b, t] = k with mem_types[b, k] == t
        value_of_type = mem_values.gather(1, slot_of_type)  # (B, K)
        tokens = torch.cat([mem_types * V + mem_values, types * V + values], dim=1)  # (B, K + P)

        all_values = torch.cat([mem_values, values], dim=1)  # (B, K + P)
        a = all_values[:, K - 1 : K + P - 1]  # (B, P): value of the previous token
        b = value_of_type.gather(1, types)  # (B, P): value of the memory item of the same type

        S = self.seq_len
        targets = torch.full((B, S), IGNORE, dtype=torch.long)
        targets[:, K:] = self.answer_base + a * V + b
        relation_pos = torch.full((B, S, 2), -1, dtype=torch.long)
        relation_pos[:, K:, 0] = torch.arange(K - 1, K + P - 1)
        relation_pos[:, K:, 1] = slot_of_type.gather(1, types)
        return Batch(tokens, targets, relation_pos)

    def parts(self, answers: Tensor) -> Tensor:
        """Split answer tokens [...] into their parts [..., 2] = (previous value, matching-type value).

        Tokens that are not answers give part -1 (never equal to a true part).
        """
        x = answers - self.answer_base
        ok = (x >= 0) & (x < self.n_values * self.n_values)
        parts = torch.stack([x // self.n_values, x % self.n_values], dim=-1)  # (..., 2)
        return torch.where(ok.unsqueeze(-1), parts, torch.full_like(parts, -1))

    def token_name(self, token: int) -> str:
        """A readable name for a token id: ``3:5`` for an item, ``(a,b)`` for an answer."""
        if 0 <= token < self.answer_base:
            t, v = divmod(token, self.n_values)
            return f"{t}:{v}"
        if self.answer_base <= token < self.vocab_size:
            a, b = divmod(token - self.answer_base, self.n_values)
            return f"({a},{b})"
        raise ValueError(f"token must be in [0, {self.vocab_size}); got {token}")


class ReverseTask(_Task):
    """``x_1 .. x_n SEP x_n .. x_1``, trained as next-token prediction on the reversed half.

    Token ids ``[0, n_symbols)`` are symbols, ``n_symbols`` is SEP. The output at position ``n + i``
    (SEP for i = 0) predicts ``x_{n-i}``, which sits at position ``n - 1 - i`` (relation ``mirror``).
    """

    name = "reverse"
    relations = ("mirror",)
    options = ("n_symbols", "length")

    def __init__(self, n_symbols: int = 16, length: int = 8) -> None:
        self.n_symbols = _check_int("n_symbols", n_symbols, 2, 4096)
        self.length = _check_int("length", length, 1, 512)
        self.sep_id = n_symbols
        self.vocab_size = n_symbols + 1
        self.seq_len = 2 * length + 1

    def sample(self, generator: torch.Generator, batch_size: int) -> Batch:
        _check_int("batch_size", batch_size, 1)
        B, n = batch_size, self.length
        x = torch.randint(0, self.n_symbols, (B, n), generator=generator)  # (B, n)
        sep = torch.full((B, 1), self.sep_id, dtype=torch.long)
        tokens = torch.cat([x, sep, x.flip(1)], dim=1)  # (B, 2n + 1)
        out_pos = torch.arange(n, 2 * n)  # (n,) positions SEP .. second-to-last: each predicts the next
        targets = torch.full((B, self.seq_len), IGNORE, dtype=torch.long)
        targets[:, out_pos] = x.flip(1)
        relation_pos = torch.full((B, self.seq_len, 1), -1, dtype=torch.long)
        relation_pos[:, out_pos, 0] = (n - 1 - torch.arange(n)).expand(B, n)
        return Batch(tokens, targets, relation_pos)

    def parts(self, answers: Tensor) -> Tensor:
        """One part per answer: the symbol itself, [...] -> [..., 1]."""
        return answers.unsqueeze(-1)


TASKS = ("relations", "reverse")


def make_task(name: str, **options: int) -> RelationsTask | ReverseTask:
    """A built-in task by name (``relations`` or ``reverse``) with its options."""
    if name == "relations":
        return RelationsTask(**options)
    if name == "reverse":
        return ReverseTask(**options)
    raise ValueError(f"task must be one of {', '.join(TASKS)}; got {name!r}")
