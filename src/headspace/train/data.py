"""Text data for a character- or byte-level language model, with clear errors for bad files.

:func:`load_text` reads a UTF-8 text file and turns it into token ids:

* ``level="char"``: one token per Unicode character; the vocabulary is the sorted set of characters
  of the file (stored with the run, so generation decodes the same way);
* ``level="byte"``: one token per byte of the UTF-8 encoding; the vocabulary is all 256 byte values.

The last ``val_fraction`` of the tokens is held out for evaluation. Batches are random windows of
``seq_len + 1`` tokens drawn with a generator that depends only on (seed, step), the inputs being the
first ``seq_len`` tokens and the targets the next token at each position.

The SHA-256 of the file's content is kept (``TextData.sha256``) and recorded with a run, so that
``--resume`` refuses a data file whose content changed.

Refused with a ``ValueError`` naming the file: missing or unreadable files, empty files, binary files
(NUL bytes or invalid UTF-8, with the offset), files too short for one window in each split.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .tasks import Batch

LEVELS = ("char", "byte")


@dataclass
class TextData:
    """A tokenised text file split into a training and a held-out part.

    Attributes:
        path: the file.
        level: "char" or "byte".
        vocab: the characters (char level, sorted) in id order; ``None`` at byte level (id = byte).
        train, val: int64 [n] token ids.
        seq_len: window length.
        sha256: the SHA-256 of the file's bytes (hex); None for a TextData made by hand.
    """

    path: str
    level: str
    vocab: str | None
    train: Tensor
    val: Tensor
    seq_len: int
    sha256: str | None = None

    @property
    def vocab_size(self) -> int:
        return 256 if self.vocab is None else len(self.vocab)

    def describe(self) -> dict:
        """The run record's ``data`` entry (with ``sha256`` when known)."""
        out = {
            "name": "text",
            "path": self.path,
            "level": self.level,
            "vocab": self.vocab,
            "vocab_size": self.vocab_size,
            "seq_len": self.seq_len,
            "train_tokens": int(self.train.numel()),
            "val_tokens": int(self.val.numel()),
        }
        if self.sha256 is not None:
            out["sha256"] = self.sha256
        return out

    def sample(self, generator: torch.Generator, batch_size: int, split: str = "train") -> Batch:
        """``batch_size`` random windows: tokens [batch, seq_len], targets = the next tokens."""
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val'; got {split!r}")
        ids = self.train if split == "train" else self.val
        n_starts = ids.numel() - self.seq_len
        starts = torch.randint(0, n_starts, (batch_size,), generator=generator)  # (batch,)
        offsets = torch.arange(self.seq_len + 1)  # (seq_len + 1,)
        windows = ids[starts[:, None] + offsets[None, :]]  # (batch, seq_len + 1)
        return Batch(windows[:, :-1].contiguous(), windows[:, 1:].contiguous())

    def encode(self, text: str) -> Tensor:
        """Token ids [n] of ``text``; characters outside the vocabulary raise ``ValueError`` listing them."""
        return encode(text, self.level, self.vocab)

    def decode(self, ids: Tensor | list[int]) -> str:
        return decode(ids, self.level, self.vocab)


def _code_points(text: str) -> np.ndarray:
    """The code points of ``text`` as uint32 [n] (lone surrogates included), without a Python loop."""
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")


def encode(text: str, level: str, vocab: str | None) -> Tensor:
    """Token ids of ``text`` at ``level`` with ``vocab`` (char level) -> int64 [n].

    Vectorised (a few milliseconds a megabyte): bytes or code points are looked up as arrays.
    """
    if level == "byte":
        raw = text.encode("utf-8")
        return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).astype(np.int64))
    if vocab is None:
        raise ValueError("a char-level vocabulary is needed to encode text")
    points = _code_points(text)  # (n,)
    known = _code_points(vocab)  # (vocab_size,)
    order = np.argsort(known, kind="stable")
    sorted_known = known[order]
    # the last of equal characters, as a dict built from the vocabulary would map it
    at = (np.searchsorted(sorted_known, points, side="right") - 1).clip(min=0)  # (n,)
    found = sorted_known[at] == points if len(known) else np.zeros(len(points), dtype=bool)
    if not found.all():
        unknown = sorted({chr(c) for c in np.unique(points[~found]).tolist()})
        raise ValueError(
            f"text has characters the model never saw in training: {unknown[:10]!r}"
            f"{' ...' if len(unknown) > 10 else ''}; known characters: {vocab[:60]!r}"
        )
    return torch.from_numpy(order[at].astype(np.int64))


def decode(ids: Tensor | list[int], level: str, vocab: str | None) -> str:
    """Text from token ids (bytes that are not valid UTF-8 become U+FFFD at byte level)."""
    values = ids.tolist() if isinstance(ids, Tensor) else list(ids)
    if level == "byte":
        return bytes(values).decode("utf-8", errors="replace")
    assert vocab is not None
    return "".join(vocab[i] for i in values)


def load_text(
    path: str | os.PathLike[str], *, level: str = "char", seq_len: int = 128, val_fraction: float = 0.1
) -> TextData:
    """Read a UTF-8 text file as token ids; see the module docstring for the checks."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {list(LEVELS)}; got {level!r}")
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len must be an int >= 1; got {seq_len!r}")
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)):
        raise TypeError(
            f"val_fraction must be a float in (0, 1); got {val_fraction!r} ({type(val_fraction).__name__})"
        )
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1); got {val_fraction}")
    p = Path(path)
    if not p.exists():
        raise ValueError(f"data file {p} does not exist")
    if not p.is_file():
        raise ValueError(f"data file {p} is not a regular file")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ValueError(f"data file {p} cannot be read: {e.strerror or e}") from None
    if not raw:
        raise ValueError(f"data file {p} is empty; give a UTF-8 text file")
    nul = raw.find(b"\x00")
    if nul >= 0:
        raise ValueError(
            f"data file {p} is binary, not text (a NUL byte at offset {nul}); give a UTF-8 text file"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"data file {p} is not UTF-8 text (invalid byte 0x{raw[e.start]:02x} at offset {e.start}); "
            "give a UTF-8 text file"
        ) from None
    vocab = None if level == "byte" else "".join(sorted(set(text)))
    ids = encode(text, level, vocab)
    n = ids.numel()
    n_val = max(seq_len + 1, round(n * val_fraction))
    n_train = n - n_val
    need = 2 * (seq_len + 1)
    if n_train < seq_len + 1:
        raise ValueError(
            f"data file {p} is too short: {n} {level} tokens, but seq_len={seq_len} needs at least {need} "
            f"(one window of seq_len + 1 tokens for training and one held out); use a longer file or a "
            f"smaller --seq-len"
        )
    digest = hashlib.sha256(raw).hexdigest()
    return TextData(str(p), level, vocab, ids[:n_train].clone(), ids[n_train:].clone(), seq_len, digest)
