"""Text -> token ids with a Hugging Face ``tokenizer.json``, read by the ``tokenizers`` library.

:class:`TextTokenizer` turns a list of sentences into a right-padded ``[batch, seq]`` id tensor and its
``key_padding`` mask (True for real tokens), the two inputs every headspace model takes (``pad`` also
left-pads, for decoder prompts). The special tokens ([CLS] ... [SEP] for BERT) come from the
tokenizer's own post-processor. The padding and truncation settings stored in ``tokenizer.json`` are
switched off: headspace pads to the longest sentence of each batch and truncates only when asked
(``max_length``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from torch import Tensor

from .checks import is_int


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
        self.path = Path(path)
        self._tok = Tokenizer.from_file(str(self.path))
        self._tok.no_padding()
        self._tok.no_truncation()
        self._max_length: int | None = None
        self.pad_id = pad_id

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
        return [e.ids for e in self._tok.encode_batch(sentences)]

    def tokens(self, sentence: str) -> list[str]:
        """The token strings of one sentence (special tokens included)."""
        return self._tok.encode(check_sentences(sentence, "sentence")[0]).tokens

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
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"TextTokenizer({self.path.name}, vocab_size={self.vocab_size}, pad_id={self.pad_id})"
