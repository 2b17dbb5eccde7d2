"""Text -> token ids with a Hugging Face ``tokenizer.json``, read by the ``tokenizers`` library.

:class:`TextTokenizer` turns a list of sentences into a right-padded ``[batch, seq]`` id tensor and its
``key_padding`` mask (True for real tokens), the two inputs every headspace model takes (``pad`` also
left-pads, for decoder prompts). The special tokens ([CLS] ... [SEP] for BERT) come from the
tokenizer's own post-processor. The padding and truncation settings stored in ``tokenizer.json`` are
switched off: headspace pads to the longest sentence of each batch and truncates only when asked
(``max_length``).

``tokenizer.json`` is untrusted input: only a regular file of at most :data:`MAX_TOKENIZER_BYTES` is
read (a FIFO or ``/dev/zero`` in its place is refused before reading), and a file ``tokenizers`` cannot
parse is a ``ValueError`` naming it. Text that cannot be encoded as UTF-8 (a lone surrogate such as
``"\udcff"``, which ``bytes.decode(errors="surrogateescape")`` produces) is a ``ValueError`` naming
the sentence's index and the character's position.

What ends a text or a turn (:attr:`TextTokenizer.end_ids`, :meth:`TextTokenizer.template_end_ids`,
:meth:`TextTokenizer.folder_settings`) and which tokens are control tokens, left out of decoded text
(:attr:`TextTokenizer.control_ids`), are read here too; :mod:`.generation` puts them together.
"""

from __future__ import annotations

import functools
import json
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from torch import Tensor

from ..core.checks import is_int
from ..core.fileio import UnsafeFileError, read_regular_file

#: The largest ``tokenizer.json`` read (the biggest public ones hold ~20 MB).
MAX_TOKENIZER_BYTES = 64 << 20

#: How whitespace inside a token is shown wherever tokens are printed (the command line, its pictures,
#: the explorer's labels): :func:`readable_token`.
WHITESPACE_MARKS = {" ": "\u2423", "\n": "\u21b5", "\t": "\u21e5"}  # ␣ ↵ ⇥


def readable_token(text: str) -> str:
    """A token's text as headspace prints it: each space as ``␣``, newline as ``↵``, tab as ``⇥``, any
    other control or invisible character as a Python escape (``\\r``, ``\\xa0``); the rest as it is.

    ``text`` is what the token stands for (``" cat"``, :meth:`TextTokenizer.token_text` of a piece such
    as ``"Ġcat"``), so ``readable_token(" cat") == "␣cat"``: a leading space is visible, and the same
    token prints the same whatever the tokenizer's own marker.
    """
    out = []
    for ch in text:
        mark = WHITESPACE_MARKS.get(ch)
        if mark is not None:
            out.append(mark)
        elif unicodedata.category(ch) in ("Cc", "Cf", "Zs", "Zl", "Zp"):
            out.append(ch.encode("unicode_escape").decode("ascii"))
        else:
            out.append(ch)
    return "".join(out)


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's ``bytes_to_unicode``), inverted: the character -> its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1)]
    printable += range(ord("\xae"), ord("\xff") + 1)
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")

#: Tokens that end a text or a turn in the common formats (ChatML's ``<|im_end|>``, Gemma's
#: ``<end_of_turn>``, Llama 3's ``<|eot_id|>``, ...): a stop wherever the tokenizer has one as a special
#: token (Gemma's ``</s>`` is an ordinary HTML tag, not a stop).
END_TOKENS = frozenset(
    {"<|im_end|>", "<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>", "<|end|>",
     "<end_of_turn>", "<eos>", "</s>", "<|return|>"}
)  # fmt: skip

#: An added token that looks like a control token though its tokenizer does not flag it special
#: (a GGUF's user-defined ``<start_of_image>``; ``<|x|>``; ``[multimodal]``): snake_case with at least
#: one underscore, so that HTML tags (``<b>``, ``</table>``: Gemma's ordinary added tokens) are text.
_CONTROL_LIKE = re.compile(r"^(<\|[^|\s]+\|>|</?[a-z0-9]+(?:_[a-z0-9]+)+>|\[[a-z0-9_]+\])$")

#: Words that mark a special token of a chat template as the end of a turn or of the text.
_END_WORDS = re.compile(r"end|eot|eos|eom", re.IGNORECASE)

#: The largest tokenizer_config.json / generation_config.json / chat_template.jinja read.
MAX_SETTINGS_BYTES = 16 << 20


def _types(node: Any) -> set[str]:
    """Every ``"type"`` in a tokenizer.json component (a Sequence's parts included)."""
    if isinstance(node, dict):
        found = {node["type"]} if isinstance(node.get("type"), str) else set()
        for value in node.values():
            found |= _types(value)
        return found
    if isinstance(node, list):
        return set().union(*(_types(v) for v in node)) if node else set()
    return set()


def read_tokenizer_file(path: Path, max_bytes: int | None = None) -> str:
    """The text of ``path``, a regular UTF-8 file of at most ``max_bytes`` (None: ``MAX_TOKENIZER_BYTES``).

    Anything else is a ``ValueError`` naming the file (``FileNotFoundError`` when it does not exist).

    The kind and size are checked with ``os.stat`` (symbolic links followed) before the file is opened,
    so a named pipe cannot block the reader and a device cannot fill memory; at most ``max_bytes + 1``
    bytes are read.
    """
    max_bytes = MAX_TOKENIZER_BYTES if max_bytes is None else max_bytes
    try:
        data = read_regular_file(path, max_bytes=max_bytes)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such tokenizer file") from None
    except UnsafeFileError as e:
        raise ValueError(
            f"{e}; a tokenizer.json must be a regular file of at most {max_bytes} bytes"
        ) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a valid tokenizer.json: not UTF-8 text ({e})") from None


def check_encodable(sentences: Sequence[str] | str, name: str = "sentences") -> None:
    """Each sentence must encode as UTF-8: a lone surrogate is a ValueError naming index and position.

    ``sentences`` may be one string (then the message names ``name`` without an index).
    """
    items = [sentences] if isinstance(sentences, str) else list(sentences)
    for i, s in enumerate(items):
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            bad = s[e.start]
            where = name if isinstance(sentences, str) else f"{name}[{i}]"
            raise ValueError(
                f"{where} cannot be encoded as UTF-8: character {bad!r} (U+{ord(bad):04X}, a lone "
                f"surrogate) at position {e.start} of {len(s)}; text must be valid Unicode (a string decoded "
                "with errors='surrogateescape' holds such characters: decode with errors='replace')"
            ) from None


def check_sentences(sentences: Any, name: str = "sentences") -> list[str]:
    """A non-empty list of strings (one string is taken as a list of one); errors name the bad item."""
    if isinstance(sentences, str):
        return [sentences]
    if not isinstance(sentences, (list, tuple)):
        raise TypeError(f"{name} must be a str or a list of str; got {type(sentences).__name__}")
    if len(sentences) == 0:
        raise ValueError(f"{name} is empty; pass at least one sentence")
    for i, s in enumerate(sentences):
        if not isinstance(s, str):
            raise TypeError(f"{name}[{i}] must be a str; got {type(s).__name__} ({s!r:.60})")
    return list(sentences)


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` that pads batches into tensors.

    Args:
        path: a Hugging Face ``tokenizer.json``.
        pad_id: the id used to fill padded positions (BERT: 0, [PAD]); None for tokenizers without
            padding (GPT-2), which then refuse batches of unequal length.
    """

    def __init__(self, path: str | Path, *, pad_id: int | None = None) -> None:
        if not isinstance(path, (str, Path)):
            raise TypeError(f"path must be a str or pathlib.Path; got {type(path).__name__}")
        if pad_id is not None and (not is_int(pad_id) or pad_id < 0):
            raise ValueError(f"pad_id must be None or an int >= 0; got {pad_id!r}")
        self.path = Path(path)
        text = read_tokenizer_file(self.path)
        try:
            self._tok = Tokenizer.from_str(text)
        except Exception as e:  # tokenizers raises its own exception type for every malformed file
            detail = " ".join(str(e).split())[:300]
            raise ValueError(f"{self.path}: not a valid tokenizer.json ({detail})") from None
        self._tok.no_padding()
        self._tok.no_truncation()
        self._max_length: int | None = None
        self.pad_id = pad_id
        self._folder: Path | None = self.path.parent  # read from a file: its folder's settings apply

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: Tokenizer,
        *,
        pad_id: int | None = None,
        path: str | Path = "tokenizer.json",
        copy: bool = True,
    ) -> TextTokenizer:
        """A TextTokenizer from a ``tokenizers.Tokenizer`` in memory (e.g. one built from GGUF metadata).

        The tokenizer is copied (its padding and truncation are switched off on the copy, not on yours);
        ``copy=False`` takes it over instead (for a caller that made it and hands it on: a 262k-token
        vocabulary takes seconds to copy). ``path`` only names it in messages and ``repr``.
        """
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"tokenizer must be a tokenizers.Tokenizer; got {type(tokenizer).__name__}")
        if pad_id is not None and (not is_int(pad_id) or pad_id < 0):
            raise ValueError(f"pad_id must be None or an int >= 0; got {pad_id!r}")
        self = cls.__new__(cls)
        self.path = Path(path)
        self._tok = Tokenizer.from_str(tokenizer.to_str()) if copy else tokenizer
        self._tok.no_padding()
        self._tok.no_truncation()
        self._max_length = None
        self.pad_id = pad_id
        self._folder = None  # (in memory: no folder of settings beside it)
        return self

    @functools.cached_property
    def _piece_kind(self) -> tuple[bool, frozenset[str]]:
        """(byte-level BPE, the added tokens' strings), read once from the tokenizer's own description."""
        spec = json.loads(self._tok.to_str())
        parts = _types(spec.get("pre_tokenizer")) | _types(spec.get("decoder"))
        added = frozenset(t.content for t in self._tok.get_added_tokens_decoder().values())
        return "ByteLevel" in parts, added

    def token_text(self, piece: str) -> str:
        """The text a token piece stands for: byte-level BPE's ``"Ġcat"`` -> ``" cat"`` (bytes of an
        incomplete character as ``\\xNN``), SentencePiece's ``"▁cat"`` -> ``" cat"`` and ``"<0x0A>"`` ->
        ``"\\n"``; special tokens and WordPiece pieces (``"##ing"``) as they are."""
        byte_level, added = self._piece_kind
        if piece in added:
            return piece
        if byte_level:
            table = _byte_of_char()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece).decode("utf-8", errors="backslashreplace")
            return piece
        fallback = _BYTE_FALLBACK.match(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)]).decode("utf-8", errors="backslashreplace")
        return piece.replace("\u2581", " ")

    def readable(self, piece: str) -> str:
        """A token piece as headspace prints it: :func:`readable_token` of :meth:`token_text`."""
        return readable_token(self.token_text(piece))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def _set_truncation(self, max_length: int | None) -> None:
        if max_length == self._max_length:
            return
        if max_length is None:
            self._tok.no_truncation()
        else:
            self._tok.enable_truncation(max_length)
        self._max_length = max_length

    def encode_ids(self, sentences: Sequence[str], *, max_length: int | None = None) -> list[list[int]]:
        """Token ids (special tokens included) of each sentence, truncated to ``max_length`` if given."""
        sentences = check_sentences(sentences)
        if max_length is not None and (not is_int(max_length) or max_length < 2):
            raise ValueError(f"max_length must be None or an int >= 2; got {max_length!r}")
        self._set_truncation(max_length)
        try:
            encodings = self._tok.encode_batch(sentences)
        except Exception:
            check_encodable(sentences)  # names the sentence and the character when that is the cause
            raise
        return [e.ids for e in encodings]

    def _encode_one(self, text: str, name: str, *, add_special_tokens: bool = True) -> Any:
        try:
            return self._tok.encode(text, add_special_tokens=add_special_tokens)
        except Exception:
            check_encodable(text, name)
            raise

    def plain_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` alone, without special tokens (e.g. an answer token ``" Paris"``)."""
        return self._encode_one(check_sentences(text, "text")[0], "text", add_special_tokens=False).ids

    def plain_tokens(self, text: str) -> list[str]:
        """Token strings of ``text`` alone, without special tokens."""
        return self._encode_one(check_sentences(text, "text")[0], "text", add_special_tokens=False).tokens

    def tokens(self, sentence: str) -> list[str]:
        """The token strings of one sentence (special tokens included)."""
        return self._encode_one(check_sentences(sentence, "sentence")[0], "sentence").tokens

    def pad(
        self, ids: Sequence[Sequence[int]], *, side: str = "right", fill_id: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """Pad id lists into (tokens int64 [batch, seq], key_padding bool [batch, seq], True = real).

        Args:
            ids: one list of token ids per sequence.
            side: "right" (default: encoders) or "left" (decoder prompts for ``Decoder.generate``: every
                row's real tokens end at the last column).
            fill_id: the id written at padded positions (None: ``pad_id``; a tokenizer without one then
                refuses sequences of unequal length). Use it when the padded ids are never read, as with
                ``Decoder.generate``'s masked prompts.
        """
        if side not in ("right", "left"):
            raise ValueError(f"side must be 'right' or 'left'; got {side!r}")
        fill = self.pad_id if fill_id is None else fill_id
        lengths = [len(x) for x in ids]
        seq = max(lengths)
        if fill is None and min(lengths) != seq:
            raise ValueError(
                f"this tokenizer has no padding token, so a batch must hold sequences of one length; got "
                f"lengths {sorted(set(lengths))}"
            )
        tokens = torch.full((len(ids), seq), fill or 0, dtype=torch.long)  # (batch, seq)
        key_padding = torch.zeros(len(ids), seq, dtype=torch.bool)  # (batch, seq)
        for i, row in enumerate(ids):
            cols = slice(0, len(row)) if side == "right" else slice(seq - len(row), seq)
            tokens[i, cols] = torch.tensor(row, dtype=torch.long)
            key_padding[i, cols] = True
        return tokens, key_padding

    def __call__(
        self, sentences: Sequence[str] | str, *, max_length: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """(tokens [batch, seq], key_padding [batch, seq]) for a list of sentences."""
        return self.pad(self.encode_ids(sentences, max_length=max_length))

    def decode(self, ids: Sequence[int] | Tensor, *, skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; ``skip_special_tokens`` leaves out every control token
        (:attr:`control_ids`: the special ones and those that look it)."""
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        ids = list(ids)
        if skip_special_tokens:
            control = self.control_ids
            ids = [i for i in ids if i not in control]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def control_ids(self) -> frozenset[int]:
        """The ids of control tokens: added tokens flagged special, and added tokens that look like
        control tokens though not flagged (``<start_of_image>``, ``<|x|>``, ``[multimodal]``: not text a
        reader should see; HTML tags such as ``<b>`` stay text)."""
        return frozenset(
            i
            for i, t in self._tok.get_added_tokens_decoder().items()
            if t.special or _CONTROL_LIKE.match(t.content)
        )

    @functools.cached_property
    def end_ids(self) -> frozenset[int]:
        """The ids of this tokenizer's special tokens named in :data:`END_TOKENS` (end of text or turn)."""
        return frozenset(
            i
            for i, t in self._tok.get_added_tokens_decoder().items()
            if t.special and t.content in END_TOKENS
        )

    def template_end_ids(self, template: str | None) -> frozenset[int]:
        """The ids of the control tokens a chat ``template`` writes whose names say they end a turn or
        the text (``<|im_end|>``, ``<end_of_turn>``, ``<|eot_id|>``: with end, eot, eos or eom)."""
        if not template:
            return frozenset()
        added = self._tok.get_added_tokens_decoder()
        return frozenset(
            i
            for i in self.control_ids
            if added[i].content in template and _END_WORDS.search(added[i].content)
        )

    def id_of(self, token: str | None) -> int | None:
        """The id of ``token`` (None where it is not in the vocabulary, or for None)."""
        return None if token is None else self._tok.token_to_id(token)

    def token_of(self, i: int | None) -> str | None:
        """The token of id ``i`` (None where it has none, or for None)."""
        return None if i is None else self._tok.id_to_token(i)

    def folder_settings(self) -> FolderSettings:
        """What the files beside a ``tokenizer.json`` say about ending and chat (nothing for a tokenizer
        made in memory): ``generation_config.json``'s ``eos_token_id`` (an id or a list), and
        ``tokenizer_config.json``'s ``eos_token`` / ``bos_token`` and ``chat_template`` (a string, or a
        list of named ones: ``"default"`` taken), else ``chat_template.jinja``'s text. Each file is
        untrusted: a regular file of at most :data:`MAX_SETTINGS_BYTES`, JSON of the expected types; a
        ValueError naming the file and the field otherwise."""
        if self._folder is None:
            return FolderSettings()
        return read_folder_settings(self._folder)

    def __repr__(self) -> str:
        return f"TextTokenizer({self.path.name}, vocab_size={self.vocab_size}, pad_id={self.pad_id})"


@dataclass(frozen=True)
class FolderSettings:
    """What a Hugging Face folder's side files say (:meth:`TextTokenizer.folder_settings`)."""

    eos_ids: tuple[int, ...] = ()
    eos_token: str | None = None
    bos_token: str | None = None
    chat_template: str | None = None


def _settings_text(path: Path) -> str:
    """The UTF-8 text of a settings file: a regular file of at most :data:`MAX_SETTINGS_BYTES`."""
    try:
        return read_regular_file(path, max_bytes=MAX_SETTINGS_BYTES).decode("utf-8")
    except UnsafeFileError as e:
        raise ValueError(f"{e}; expected a regular file of at most {MAX_SETTINGS_BYTES} bytes") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None


def _settings_json(path: Path) -> dict[str, Any] | None:
    """A settings file's JSON object, None where the file is absent; a one-line ValueError otherwise."""
    if not path.exists():
        return None
    text = _settings_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object; got {type(data).__name__}")
    return data


def _token_field(data: dict[str, Any], key: str, path: Path) -> str | None:
    """A token field of tokenizer_config.json: a string, ``{"content": string}`` or null."""
    value = data.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ValueError(
            f'{path}: {key} must be a token string (or {{"content": string}}); got {value!r:.60}'
        )
    return value


def _template_field(data: dict[str, Any], path: Path) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of ``{"name", "template"}`` (the
    ``"default"`` one)."""
    value = data.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if value is not None and not isinstance(value, str):
        raise ValueError(
            f'{path}: chat_template must be a string (or a list with a "default"); got {value!r:.60}'
        )
    return value


def read_folder_settings(folder: Path) -> FolderSettings:
    """:meth:`TextTokenizer.folder_settings` of the files in ``folder``."""
    eos_ids: tuple[int, ...] = ()
    gen_path = folder / "generation_config.json"
    gen = _settings_json(gen_path) or {}
    eos = gen.get("eos_token_id")
    if eos is not None:
        ids = eos if isinstance(eos, list) else [eos]
        if not ids or any(not is_int(i) or i < 0 for i in ids):
            raise ValueError(
                f"{gen_path}: eos_token_id must be a token id >= 0 or a list of them; got {eos!r:.60}"
            )
        eos_ids = tuple(ids)
    tok_path = folder / "tokenizer_config.json"
    tok = _settings_json(tok_path) or {}
    template = _template_field(tok, tok_path)
    jinja = folder / "chat_template.jinja"
    if template is None and jinja.exists():
        template = _settings_text(jinja)
    return FolderSettings(
        eos_ids, _token_field(tok, "eos_token", tok_path), _token_field(tok, "bos_token", tok_path), template
    )
