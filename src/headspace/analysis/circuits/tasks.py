"""Circuit tasks: clean/corrupt prompt pairs with an answer and another token, as token ids.

A :class:`Task` holds ``clean`` and ``corrupt`` int64 ids [n_pairs, seq] (right-padded with ``pad``; a
pair's clean and corrupt prompts have the same length ``lengths[p]``), ``answer`` and ``other`` int64
[n_pairs] (single tokens). The metric is ``logit(answer) - logit(other)`` at each pair's last real
position, averaged over pairs.

* :func:`ioi_task`: indirect-object identification built in-process from templates (Wang et al. 2022):
  ``"When Mary and John went to the store, John gave a drink to"`` -> `` Mary`` (answer) vs `` John``
  (other); the corrupt prompt replaces the three names by three others (the "ABC" counterfactual), so
  nothing in it points to the answer. Both name orders (ABBA and BABA) appear equally often. Names are
  kept only where each is one token for the model's tokenizer.
* :func:`load_task`: a user's JSONL file, one ``{"clean", "corrupt", "answer", "other"}`` object a line
  (an untrusted file: a regular file, size-capped, strict JSON, every field checked).
* :func:`make_task`: the same from Python lists.

Refused by name: an empty task, a pair whose clean and corrupt prompts tokenize to different lengths,
a prompt longer than the model's position table (``max_seq_len``), an answer or other that is not one
token, an answer equal to its other; in a task file, a line that is not one JSON object (nested too
deep included).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..causal.budget import check_length
from ..causal.causal_inputs import stack_of, token_id

__all__ = ["IOI_NAMES", "IOI_TEMPLATES", "MAX_TASK_BYTES", "Task", "ioi_task", "load_task", "make_task"]

#: The largest task file :func:`load_task` reads.
MAX_TASK_BYTES = 16 * 1024 * 1024

#: Templates of the built-in IOI task: ``{A}`` and ``{B}`` are the two names, ``{S}`` the repeated one.
IOI_TEMPLATES = (
    "When {A} and {B} went to the store, {S} gave a drink to",
    "When {A} and {B} went to the park, {S} gave a ball to",
    "After {A} and {B} went to the market, {S} handed a bag to",
    "Then, {A} and {B} had a long argument, and afterwards {S} said to",
    "While {A} and {B} were working at the office, {S} gave a report to",
    "Friends {A} and {B} found a necklace at the beach. {S} gave it to",
    "When {A} and {B} got a snack at the cafe, {S} decided to give it to",
    "The local big party was planned by {A} and {B}. {S} sent an invitation to",
)

#: Candidate names (each kept only where it is one token with a leading space).
IOI_NAMES = (
    "Mary John Tom James Dan Sarah Paul Anna Mark Lisa Kate David Emma Michael Alice Jack Laura Peter "
    "Rachel Sam Steve Linda Chris Amy Mike Susan Joe Helen Ben Jane Adam Lucy George Grace Frank Ruth "
    "Henry Rose Andrew Nancy Eric Karen Tim Julia Jason Amanda Kevin Maria Brian Emily"
).split()


@dataclass
class Task:
    """Prompt pairs as ids: ``clean``/``corrupt`` int64 [n_pairs, seq], ``lengths`` int64 [n_pairs]
    (real tokens per pair; the rest is ``pad``), ``answer``/``other`` int64 [n_pairs]; ``name``."""

    name: str
    clean: Tensor
    corrupt: Tensor
    lengths: Tensor
    answer: Tensor
    other: Tensor
    texts: list[tuple[str, str]]

    def __len__(self) -> int:
        return int(self.clean.shape[0])

    @property
    def last(self) -> Tensor:
        """int64 [n_pairs]: each pair's last real position."""
        return self.lengths - 1

    def subset(self, index: Any) -> Task:
        """The pairs at ``index`` (a slice or a list of ints), trimmed to their longest length."""
        idx = list(range(len(self)))[index] if isinstance(index, slice) else list(index)
        if not idx:
            raise ValueError("Task.subset: no pair selected; select at least one")
        lengths = self.lengths[idx]
        width = int(lengths.max())
        return Task(
            self.name, self.clean[idx, :width], self.corrupt[idx, :width], lengths, self.answer[idx],
            self.other[idx], [self.texts[i] for i in idx],
        )  # fmt: skip


def _ids(model: Any, text: str) -> list[int]:
    tokenize = getattr(model, "tokenize_padded", None)
    if tokenize is None:
        raise TypeError(
            f"task prompts are text but {type(model).__name__} has no tokenizer; load the model with "
            "headspace.load(...)"
        )
    tokens, kp = tokenize([text])  # (1, seq) x 2
    return tokens[0, : int(kp[0].sum())].tolist()


def make_task(model: Any, pairs: Sequence[dict[str, Any]], name: str = "task") -> Task:
    """A :class:`Task` from ``pairs``: dicts with ``clean``, ``corrupt`` (texts), ``answer``, ``other``
    (one token each, a string or an id). Every pair is checked; the first bad one is named."""
    module = stack_of(model, "make_task")
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Sequence) or len(pairs) == 0:
        raise ValueError(f"task {name!r} is empty: give at least one clean/corrupt pair; got {pairs!r:.60}")
    rows: list[tuple[list[int], list[int], int, int]] = []
    texts = []
    for n, pair in enumerate(pairs, start=1):
        where = f"task {name!r} pair {n}"
        if not isinstance(pair, dict):
            raise TypeError(f"{where} must be an object with clean, corrupt, answer, other; got {pair!r:.60}")
        missing = [k for k in ("clean", "corrupt", "answer", "other") if k not in pair]
        if missing:
            raise ValueError(f"{where} lacks {missing}; each pair needs clean, corrupt, answer and other")
        clean, corrupt = pair["clean"], pair["corrupt"]
        if not isinstance(clean, str) or not isinstance(corrupt, str) or not clean or not corrupt:
            raise TypeError(
                f"{where}: clean and corrupt must be non-empty texts; got {clean!r:.40}, {corrupt!r:.40}"
            )
        a = token_id(model, pair["answer"], f"{where} answer")
        b = token_id(model, pair["other"], f"{where} other")
        if a == b:
            raise ValueError(f"{where}: answer and other are the same token (id {a}); the metric would be 0")
        ci, ki = _ids(model, clean), _ids(model, corrupt)
        for side, ids in (("clean", ci), ("corrupt", ki)):  # refused before anything runs the model
            check_length(module, torch.tensor([ids], dtype=torch.int64), f"{where} {side} prompt")
        if len(ci) != len(ki):
            raise ValueError(
                f"{where}: clean and corrupt must have equal token lengths (every position is patched "
                f"against its counterpart); got {len(ci)} and {len(ki)} tokens"
            )
        rows.append((ci, ki, a, b))
        texts.append((clean, corrupt))
    width = max(len(r[0]) for r in rows)
    clean_t = torch.zeros(len(rows), width, dtype=torch.int64)  # (n_pairs, seq), right-padded with 0
    corrupt_t = torch.zeros_like(clean_t)
    for p, (ci, ki, _, _) in enumerate(rows):
        clean_t[p, : len(ci)] = torch.tensor(ci)
        corrupt_t[p, : len(ki)] = torch.tensor(ki)
    return Task(
        name, clean_t, corrupt_t, torch.tensor([len(r[0]) for r in rows]), torch.tensor([r[2] for r in rows]),
        torch.tensor([r[3] for r in rows]), texts,
    )  # fmt: skip


def load_task(model: Any, path: str | os.PathLike[str]) -> Task:
    """A :class:`Task` from a JSONL file (one ``{"clean", "corrupt", "answer", "other"}`` a line; blank
    lines skipped). The file is untrusted: a regular file of at most :data:`MAX_TASK_BYTES`."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(
            f"task file {str(p)!r} must be a regular file; got "
            f"{'nothing' if not p.exists() else 'a folder or device'}"
        )
    size = p.stat().st_size
    if size > MAX_TASK_BYTES:
        raise ValueError(f"task file {str(p)!r} is {size} bytes; at most {MAX_TASK_BYTES} are read")
    pairs = []
    with p.open("rb") as f:
        raw = f.read(MAX_TASK_BYTES + 1)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"task file {str(p)!r} is not UTF-8 text (byte {e.start})") from None
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            pairs.append(json.loads(line, parse_constant=_no_constant))
        except RecursionError:  # the parser recurses once per level
            raise ValueError(
                f"task file {str(p)!r} line {n} is not one JSON object of clean, corrupt, answer and "
                "other: it nests too deeply for the JSON parser"
            ) from None
        except (json.JSONDecodeError, ValueError) as e:
            raise ValueError(f"task file {str(p)!r} line {n} is not one JSON object: {e}") from None
    return make_task(model, pairs, name=p.stem)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _one_token_names(model: Any, names: Sequence[str]) -> list[str]:
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise TypeError("ioi_task needs a loaded model with a tokenizer (headspace.load('smollm2'))")
    kept = []
    for n in names:
        ids = tokenizer.plain_ids(" " + n)
        if (
            len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=False) == " " + n
        ):  # not an unknown token
            kept.append(n)
    return kept


def ioi_task(model: Any, n_pairs: int = 256, *, seed: int = 0) -> Task:
    """The built-in indirect-object task: ``n_pairs`` pairs from :data:`IOI_TEMPLATES` and the one-token
    names of :data:`IOI_NAMES`, half ABBA and half BABA, the corrupt prompt with three fresh names
    (equal token lengths are checked, as for any task). Deterministic for a ``seed``."""
    if isinstance(n_pairs, bool) or not isinstance(n_pairs, int) or n_pairs < 1:
        raise ValueError(f"n_pairs must be a positive int; got {n_pairs!r}")
    names = _one_token_names(model, IOI_NAMES)
    if len(names) < 6:
        raise ValueError(f"ioi_task needs at least 6 one-token names for this tokenizer; found {names}")
    rng = random.Random(seed)
    pairs = []
    for n in range(n_pairs):
        template = IOI_TEMPLATES[n % len(IOI_TEMPLATES)]
        io, s, c1, c2, c3 = rng.sample(names, 5)
        first, second = (io, s) if n % 2 == 0 else (s, io)  # ABBA / BABA
        clean = template.format(A=first, B=second, S=s)
        x, y = (c1, c2) if n % 2 == 0 else (c2, c1)
        corrupt = template.format(A=x, B=y, S=c3)
        pairs.append({"clean": clean, "corrupt": corrupt, "answer": " " + io, "other": " " + s})
    return make_task(model, pairs, name="ioi")
