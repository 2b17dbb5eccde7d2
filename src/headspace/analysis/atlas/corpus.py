"""A corpus for the head atlas: documents read from untrusted files, tokenised, cut into windows.

A corpus is a UTF-8 text file (one document), a folder of them (every regular file whose name ends in
one of :data:`TEXT_SUFFIXES`, in sorted path order, each one document; ``.jsonl`` files inside count as
JSONL), a JSONL file (``.jsonl``: one JSON object ``{"text": "..."}`` per non-blank line, each a
document), or, from Python, a list of strings (or, for models without a tokenizer, of 1-D int64
token tensors). Symbolic links inside a folder are skipped (and a file turned into one is refused when
read). Files are read with :func:`headspace.fileio.read_regular_file` (regular files only, at most
:data:`MAX_FILE_BYTES` each); anything malformed (invalid or too deeply nested JSON, a ``"text"`` with
a lone surrogate) is refused with a one-line error naming the file (and line) and what was expected.

Each document is tokenised once, exactly as ``model.tokenize_padded([text])`` does (the pretrained
wrapper's own tokeniser, special tokens included), a document longer than :data:`MAX_PIECE_CHARS`
characters in bounded pieces (:func:`document_tokens`), and its real tokens are cut into consecutive
windows of ``window`` tokens (the last one shorter); a document shorter than the window is one
sequence. :func:`read_windows` reads a corpus once, up to ``max_tokens``, and keeps its windows. The
SHA-256 of the corpus is taken over every document's name and UTF-8 bytes in order (see
:meth:`Corpus.sha256`; :func:`read_windows` takes it over the documents it read), so it names the text,
whatever the layout of the folder it came from.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ...core.checks import is_int
from ...core.fileio import read_regular_file

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


def _check_unicode(text: str, where: str) -> None:
    """Refuse a string that is not valid Unicode (a lone surrogate, from a JSON ``"\\ud800"`` escape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{where}: expected valid Unicode text; got a lone surrogate U+{ord(text[e.start]):04X} at "
            f"character {e.start}"
        ) from None


def _jsonl_documents(path: Path, name: str, *, follow: bool = True) -> Iterator[tuple[str, str]]:
    """``(name:line, text)`` of each non-blank line of the JSONL file ``path`` (``follow``: a symbolic
    link given as the corpus itself is read; inside a folder links are not)."""
    raw = read_regular_file(path, max_bytes=MAX_FILE_BYTES, follow_symlinks=follow)
    text = _decode(raw, str(path))
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
        except RecursionError:
            raise ValueError(
                f'{path} line {n}: expected a JSON object {{"text": "..."}}; got JSON nested deeper than the '
                "parser's recursion limit"
            ) from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            got = type(obj).__name__ if not isinstance(obj, dict) else f"keys {sorted(obj)[:5]}"
            if isinstance(obj, dict) and "text" in obj:
                got = f'"text" of type {type(obj["text"]).__name__}'
            raise ValueError(f'{path} line {n}: expected a JSON object with a "text" string; got {got}')
        _check_unicode(obj["text"], f'{path} line {n}: "text"')
        yield f"{name}:{n}", obj["text"]


def _folder_files(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in filenames:
            path = Path(dirpath) / f
            if not f.startswith(".") and f.endswith(TEXT_SUFFIXES) and not path.is_symlink():
                files.append(path)
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
                if isinstance(text, str):
                    _check_unicode(text, f"corpus[{i}]")
                yield f"{'text' if isinstance(text, str) else 'tokens'} {i}", text
            return
        root: Path = self.source
        files = _folder_files(root) if root.is_dir() else [root]
        for path in files:
            name = str(path.relative_to(root)) if root.is_dir() else path.name
            if path.suffix == ".jsonl":
                yield from _jsonl_documents(path, name, follow=not root.is_dir())
            else:
                raw = read_regular_file(path, max_bytes=MAX_FILE_BYTES, follow_symlinks=not root.is_dir())
                yield name, _decode(raw, str(path))

    def sha256(self) -> str:
        """SHA-256 (hex) of the documents: for each, its name, a NUL, its UTF-8 bytes, a NUL."""
        h = hashlib.sha256()
        for name, text in self.documents():
            raw = text.encode("utf-8") if isinstance(text, str) else text.numpy().tobytes()
            h.update(name.encode("utf-8") + b"\0" + raw + b"\0")
        return h.hexdigest()


MAX_PIECE_CHARS = 1 << 20
"""A document longer than this (in characters) is tokenised in pieces of at most this many (see
:func:`text_pieces`), so that the tokenizer never holds a huge string."""


_CUT = re.compile(r"\s(?=\S)")  # in a reversed text: a whitespace character after a non-whitespace one


def text_pieces(text: str, max_chars: int) -> Iterator[str]:
    """``text`` cut into consecutive pieces of at most ``max_chars`` characters (joined, they are
    ``text``), each cut placed before a whitespace character that follows a non-whitespace one (so a word
    and the spaces before it stay together, as byte-level BPE pre-tokenisers split them), the last such
    place within the bound, or at ``max_chars`` where a piece has none."""
    start, n = 0, len(text)
    while n - start > max_chars:
        end = start + max_chars
        back = text[start : end + 1][::-1]  # text[end], text[end - 1], ..., text[start]
        found = _CUT.search(back)
        cut = end if found is None else end - found.start()
        yield text[start:cut]
        start = cut
    yield text[start:]


def _tokenize(model: Any, text: str) -> Tensor:
    tokenize = getattr(model, "tokenize_padded", None)
    if tokenize is None:
        raise TypeError(
            f"a text corpus needs a pretrained model with a tokenizer (headspace.load(...)); got "
            f"{type(model).__name__}"
        )
    tokens, real = tokenize([text])  # (1, n) x 2
    return tokens[0][real[0]].to(torch.int64)  # (n,)


def _special_ends(model: Any) -> tuple[list[int], list[int]] | None:
    """The special tokens ``tokenize_padded`` puts before and after a text's own tokens (BOS; BERT's
    [CLS] and [SEP]), from a one-word probe; None when the model's tokenizer cannot say."""
    plain = getattr(getattr(model, "tokenizer", None), "plain_ids", None)
    if plain is None:
        return None
    inner, full = list(plain("a")), _tokenize(model, "a").tolist()
    for at in range(len(full) - len(inner) + 1):
        if full[at : at + len(inner)] == inner:
            return full[:at], full[at + len(inner) :]
    return None  # pragma: no cover - a post-processor that rewrites the text's tokens


def document_tokens(
    model: Any, text: str | Tensor, *, max_chars: int = MAX_PIECE_CHARS, max_tokens: int | None = None
) -> Tensor:
    """The real tokens int64 [n] of one document (a token document is its own tokens).

    A text of at most ``max_chars`` characters is tokenised once, exactly as
    ``model.tokenize_padded([text])`` does. A longer one is tokenised piece by piece
    (:func:`text_pieces`), each piece once and without special tokens, between the special tokens that
    ``tokenize_padded`` puts around a text; tokenisation stops once ``max_tokens`` tokens are there (the
    result may be longer: cut it). At a cut the tokens may differ from the whole text's where a
    tokenizer merges across whitespace (byte-level BPE does not).
    """
    if isinstance(text, Tensor):
        return text
    if len(text) <= max_chars:
        return _tokenize(model, text)
    ends = _special_ends(model)
    if ends is None:
        return _tokenize(model, text)
    plain = model.tokenizer.plain_ids
    ids, n = list(ends[0]), len(ends[0])
    parts = [torch.tensor(ids, dtype=torch.int64)]
    for piece in text_pieces(text, max_chars):
        if max_tokens is not None and n >= max_tokens:
            return torch.cat(parts)
        part = torch.tensor(plain(piece), dtype=torch.int64)  # (m,)
        parts.append(part)
        n += part.numel()
    parts.append(torch.tensor(ends[1], dtype=torch.int64))
    return torch.cat(parts)  # (n,)


def check_window(window: Any, model: Any) -> int:
    """``window`` as a positive int, at most the model's position table (``config.max_seq_len``)."""
    if not is_int(window) or window < 2:
        raise ValueError(f"window must be an int >= 2 (tokens per sequence); got {window!r}")
    limit = getattr(getattr(model, "config", None), "max_seq_len", None)
    if is_int(limit) and window > limit:
        raise ValueError(f"window={window} is longer than this model's position table (max_seq_len={limit})")
    return int(window)


def sequences(
    model: Any,
    corpus: Corpus,
    window: int,
    max_tokens: int | None = None,
    *,
    max_chars: int = MAX_PIECE_CHARS,
) -> Iterator[Window]:
    """Every window of every document, in order, up to ``max_tokens`` tokens in all (the last cut short).

    Documents with no token are skipped. Each document is read and tokenised once, here, one at a time
    (:func:`document_tokens`); no document is read past the one that reaches ``max_tokens``.
    """
    index = used = 0
    for d, (name, text) in enumerate(corpus.documents()):
        left = None if max_tokens is None else max_tokens - used
        tokens = document_tokens(model, text, max_chars=max_chars, max_tokens=left)  # (n,)
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


@dataclass
class CorpusWindows:
    """A corpus read once (:func:`read_windows`): its windows (tokens int32, in memory or mapped),
    the SHA-256 of the documents read (as :meth:`Corpus.sha256`, over those read), and their count."""

    windows: list[Window]
    sha256: str
    n_documents: int


class _TokenFile:
    """Token ids (int32) appended to ``folder/.atlas-tokens-RANK.tmp`` as they come, then mapped back
    read-only (file-backed pages the system can drop, not the process's own memory) and the file
    removed (the mapping keeps its data)."""

    def __init__(self, folder: Path, rank: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f".atlas-tokens-{rank}.tmp"
        self.path.unlink(missing_ok=True)  # a killed run's; a link there is removed, never followed
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        self.file = os.fdopen(os.open(self.path, flags, 0o600), "wb")  # closed in mapped() or discard()
        self.n = 0

    def append(self, tokens: Tensor) -> int:
        """Write ``tokens`` [n]; their offset in the file (in tokens)."""
        at = self.n
        self.file.write(tokens.to(torch.int32).contiguous().numpy().tobytes())
        self.n += int(tokens.numel())
        return at

    def mapped(self) -> Tensor:
        """int32 [n]: every token written, mapped from the file (which is then removed)."""
        self.file.close()
        try:
            if not self.n:
                return torch.zeros(0, dtype=torch.int32)
            return torch.from_file(str(self.path), shared=False, size=self.n, dtype=torch.int32)  # (n,)
        finally:
            self.path.unlink(missing_ok=True)

    def discard(self) -> None:
        self.file.close()
        self.path.unlink(missing_ok=True)


def read_windows(
    model: Any,
    corpus: Corpus,
    window: int,
    max_tokens: int | None = None,
    *,
    max_chars: int = MAX_PIECE_CHARS,
    spill: tuple[Path, int] | None = None,
) -> CorpusWindows:
    """Every window of :func:`sequences`, from one reading of the corpus, with the SHA-256 of the
    documents read. Raises ``ValueError`` for a corpus with no text (no document, or only empty ones).

    ``spill`` (a folder and this process's rank): the token ids go to a file there as they are read and
    the windows are views of its mapping, so they take no memory of the process's own; without it they
    are kept in memory (4 bytes a token).
    """
    h = hashlib.sha256()
    count = {"read": 0, "with_text": 0}

    def docs() -> Iterator[tuple[str, str | Tensor]]:
        for name, text in corpus.documents():
            raw = text.encode("utf-8") if isinstance(text, str) else text.numpy().tobytes()
            h.update(name.encode("utf-8") + b"\0" + raw + b"\0")
            count["read"] += 1
            count["with_text"] += bool(text.strip()) if isinstance(text, str) else text.numel() > 0
            yield name, text

    sink = None if spill is None else _TokenFile(*spill)
    windows: list[Window] = []
    offsets: list[tuple[int, int, str, int, int, int]] = []  # (index, document, name, start, offset, n)
    try:
        for w in sequences(model, _Replay(docs()), window, max_tokens, max_chars=max_chars):  # type: ignore[arg-type]
            if sink is None:
                windows.append(Window(w.index, w.document, w.name, w.start, w.tokens.to(torch.int32).clone()))
            else:
                at = sink.append(w.tokens)  # keep the place, not the tokens
                offsets.append((w.index, w.document, w.name, w.start, at, int(w.tokens.shape[0])))
    except BaseException:
        if sink is not None:
            sink.discard()
        raise
    if sink is not None:
        ids = sink.mapped()  # (n,)
        for index, document, name, start, at, n in offsets:
            windows.append(Window(index, document, name, start, ids[at : at + n]))  # (n,) each
    if not count["with_text"] or not windows:
        where = "(a list)" if isinstance(corpus.source, list) else str(corpus.source)
        raise ValueError(
            f"corpus {where}: expected some text to measure; got {count['read']} document(s), "
            f"{'all empty' if count['read'] else 'none'}"
        )
    return CorpusWindows(windows, h.hexdigest(), count["read"])


class _Replay:
    """A corpus whose :meth:`documents` are one given iterator (read once)."""

    def __init__(self, docs: Iterator[tuple[str, str | Tensor]]) -> None:
        self._docs = docs

    def documents(self) -> Iterator[tuple[str, str | Tensor]]:
        return self._docs
