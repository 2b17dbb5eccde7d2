"""A corpus for the head atlas: documents read from untrusted files, tokenised, cut into windows.

A corpus is a UTF-8 text file (one document), a folder of them (every regular file whose name ends in
one of :data:`TEXT_SUFFIXES`, in sorted path order, each one document; ``.jsonl`` files inside count as
JSONL), a JSONL file (``.jsonl``: one JSON object ``{"text": "..."}`` per non-blank line, each a
document), or, from Python, a list of strings (or, for models without a tokenizer, of 1-D int64
token tensors). Files are read with
:func:`headspace.fileio.read_regular_file` (regular files only, at most :data:`MAX_FILE_BYTES` each);
anything malformed is refused with a one-line error naming the file (and line) and what was expected.

Each document is tokenised exactly as ``model.tokenize_padded([text])`` does (the pretrained wrapper's
own tokeniser, special tokens included) and its real tokens are cut into consecutive windows of
``window`` tokens (the last one shorter); a document shorter than the window is one sequence. The
SHA-256 of the corpus is taken over every document's name and UTF-8 bytes in order (see
:meth:`Corpus.sha256`), so it names the text, whatever the layout of the folder it came from.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..core.checks import is_int
from ..core.fileio import read_regular_file

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")
"""The files a corpus folder contributes (others are ignored); ``.jsonl`` ones are read as JSONL."""

MAX_FILE_BYTES = 512 * 2**20
"""The largest corpus file read (one file is read whole; the corpus as a whole has no limit)."""


@dataclass(frozen=True)
class Window:
    """One window of one document: ``index`` in the corpus's sequence order, ``document`` (its index and
    ``name``), ``start`` (its first token's position in the document) and its ``tokens`` int64 [n]."""

    index: int
    document: int
    name: str
    start: int
    tokens: Tensor


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{where}: expected UTF-8 text; got byte 0x{raw[e.start]:02x} at offset {e.start}, which is not "
            "UTF-8"
        ) from None


def _jsonl_documents(path: Path, name: str) -> Iterator[tuple[str, str]]:
    text = _decode(read_regular_file(path, max_bytes=MAX_FILE_BYTES), str(path))
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(
                f'{path} line {n}: expected a JSON object {{"text": "..."}}; got invalid JSON ({e.msg} at '
                f"column {e.colno})"
            ) from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            got = type(obj).__name__ if not isinstance(obj, dict) else f"keys {sorted(obj)[:5]}"
            if isinstance(obj, dict) and "text" in obj:
                got = f'"text" of type {type(obj["text"]).__name__}'
            raise ValueError(f'{path} line {n}: expected a JSON object with a "text" string; got {got}')
        yield f"{name}:{n}", obj["text"]


def _folder_files(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in filenames:
            if not f.startswith(".") and f.endswith(TEXT_SUFFIXES):
                files.append(Path(dirpath) / f)
    return sorted(files)


@dataclass
class Corpus:
    """The documents of a corpus, read lazily in a fixed order (see the module docstring).

    ``source`` is a path or a list of strings; :meth:`documents` yields ``(name, text)`` pairs, one
    document held at a time.
    """

    source: Any

    @classmethod
    def of(cls, corpus: Any) -> Corpus:
        """A :class:`Corpus` from a path (file or folder), a list of strings or a Corpus; checked here."""
        if isinstance(corpus, Corpus):
            return corpus
        if isinstance(corpus, (str, os.PathLike)):
            corpus = Path(corpus)
        elif isinstance(corpus, Sequence) and all(isinstance(t, str) for t in corpus):
            if not corpus:
                raise ValueError("corpus must hold at least one document; got an empty list")
            return cls(list(corpus))
        elif isinstance(corpus, Sequence) and corpus and all(isinstance(t, Tensor) for t in corpus):
            for i, t in enumerate(corpus):
                if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
                    raise ValueError(
                        f"corpus[{i}]: token documents must be 1-D int64 tensors [n]; got {t.dtype} "
                        f"{list(t.shape)}"
                    )
            return cls([t.to(torch.int64).cpu() for t in corpus])
        else:
            raise TypeError(
                "corpus must be a path (a UTF-8 text file, a folder of them, or JSONL with one "
                f'{{"text": ...}} per line) or a list of strings; got {type(corpus).__name__}'
            )
        if not corpus.exists():
            raise FileNotFoundError(f"corpus {corpus}: no such file or folder")
        if corpus.is_dir() and not _folder_files(corpus):
            raise ValueError(f"corpus folder {corpus}: expected files ending in {TEXT_SUFFIXES}; found none")
        return cls(corpus)

    def documents(self) -> Iterator[tuple[str, str | Tensor]]:
        """``(name, text)`` of each document, in order (token documents: ``(name, ids [n])``)."""
        if isinstance(self.source, list):
            for i, text in enumerate(self.source):
                yield f"{'text' if isinstance(text, str) else 'tokens'} {i}", text
            return
        root: Path = self.source
        files = _folder_files(root) if root.is_dir() else [root]
        for path in files:
            name = str(path.relative_to(root)) if root.is_dir() else path.name
            if path.suffix == ".jsonl":
                yield from _jsonl_documents(path, name)
            else:
                yield name, _decode(read_regular_file(path, max_bytes=MAX_FILE_BYTES), str(path))

    def sha256(self) -> str:
        """SHA-256 (hex) of the documents: for each, its name, a NUL, its UTF-8 bytes, a NUL."""
        h = hashlib.sha256()
        for name, text in self.documents():
            raw = text.encode("utf-8") if isinstance(text, str) else text.numpy().tobytes()
            h.update(name.encode("utf-8") + b"\0" + raw + b"\0")
        return h.hexdigest()


def document_tokens(model: Any, text: str | Tensor) -> Tensor:
    """The real tokens int64 [n] of one document, as ``model.tokenize_padded([text])`` gives them (a
    token document is its own tokens)."""
    if isinstance(text, Tensor):
        return text
    tokenize = getattr(model, "tokenize_padded", None)
    if tokenize is None:
        raise TypeError(
            f"a text corpus needs a pretrained model with a tokenizer (headspace.load(...)); got "
            f"{type(model).__name__}"
        )
    tokens, real = tokenize([text])  # (1, n) x 2
    return tokens[0][real[0]].to(torch.int64)  # (n,)


def check_window(window: Any, model: Any) -> int:
    """``window`` as a positive int, at most the model's position table (``config.max_seq_len``)."""
    if not is_int(window) or window < 2:
        raise ValueError(f"window must be an int >= 2 (tokens per sequence); got {window!r}")
    limit = getattr(getattr(model, "config", None), "max_seq_len", None)
    if is_int(limit) and window > limit:
        raise ValueError(f"window={window} is longer than this model's position table (max_seq_len={limit})")
    return int(window)


def sequences(model: Any, corpus: Corpus, window: int, max_tokens: int | None = None) -> Iterator[Window]:
    """Every window of every document, in order, up to ``max_tokens`` tokens in all (the last cut short).

    Documents with no token are skipped. Tokenisation happens here, one document at a time.
    """
    index = used = 0
    for d, (name, text) in enumerate(corpus.documents()):
        tokens = document_tokens(model, text)  # (n,)
        for start in range(0, tokens.shape[0], window):
            piece = tokens[start : start + window]  # (<= window,)
            if max_tokens is not None:
                piece = piece[: max_tokens - used]
            if piece.numel() == 0:
                return
            yield Window(index, d, name, start, piece)
            index += 1
            used += piece.numel()
            if max_tokens is not None and used >= max_tokens:
                return
