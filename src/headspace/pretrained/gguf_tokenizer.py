"""A GGUF file's byte-level BPE tokenizer (``tokenizer.ggml.model == "gpt2"``) as a `tokenizers.Tokenizer`.

The vocabulary, merges, token types, split regex (``tokenizer.ggml.pre``, transformers 5's table) and
BOS / EOS template of the ``tokenizer.ggml.*`` metadata, built so that the ids agree with
``AutoTokenizer.from_pretrained(..., gguf_file=...)``. Part of the GGUF reader (:mod:`.gguf_format`,
which re-exports these names; Gemma 3's SentencePiece tokenizer: :mod:`.gguf_gemma`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from .gguf_meta import GGUFError


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: byte-level BPE spells every byte as one of these."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_CHARS = _byte_alphabet()
_ALPHABET = frozenset(_BYTE_CHARS.values())

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex its merges were learned with. Any other value (smollm, gpt-2,
# starcoder, ...) gets GPT-2's own ByteLevel regex. This is the table transformers 5 uses, so the ids
# agree with `AutoTokenizer.from_pretrained(..., gguf_file=...)`.
_PRE_TOKENIZER_SPLITS: dict[str, str] = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}

_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def _vocabulary(
    meta: dict[str, Any], path: Path
) -> tuple[list[str], list[int], dict[str, int], list[tuple[str, str]]]:
    """(tokens, their ``token_type``s, {byte-alphabet spelling: id}, merge pairs) from ``tokenizer.ggml.*``.

    Tokens outside the byte alphabet (a file that spells a token as raw UTF-8) are respelled, byte by
    byte, in it; a token appearing twice keeps its last id, as a dict built in order does.
    """
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not tokens or not isinstance(tokens[0], str):
        raise GGUFError(path, "tokenizer.ggml.tokens is missing or not a list of strings")
    if not isinstance(merges, list) or (merges and not isinstance(merges[0], str)):
        raise GGUFError(path, "tokenizer.ggml.merges is missing or not a list of strings")
    types = meta.get("tokenizer.ggml.token_type", np.zeros(0))
    if not isinstance(types, np.ndarray) or (types.size and types.shape != (len(tokens),)):
        raise GGUFError(
            path, f"tokenizer.ggml.token_type does not give one type for each of {len(tokens)} tokens"
        )
    vocab = {
        t if set(t) <= _ALPHABET else "".join(_BYTE_CHARS[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    pairs: list[tuple[str, str]] = []
    for i, merge in enumerate(merges):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise GGUFError(
                path, f"tokenizer.ggml.merges[{i}] is {merge!r}, not two tokens separated by a space"
            )
        pairs.append((parts[0], parts[1]))
    return tokens, types.tolist(), vocab, pairs


def _byte_level_bpe(vocab: dict[str, int], pairs: list[tuple[str, str]], pre: Any, path: Path) -> Tokenizer:
    """The BPE model with the split regex of ``pre`` (``tokenizer.ggml.pre``) and the ByteLevel decoder."""
    try:
        tok = Tokenizer(
            BPE(
                vocab=vocab,
                merges=pairs,
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        )
    except Exception as e:  # tokenizers raises plain Exceptions for merges naming unknown tokens
        raise GGUFError(path, f"the vocabulary and merges do not form a BPE model: {e}") from None

    split = _PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's regex inside
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    return tok


def _add_whole_tokens(
    tok: Tokenizer, tokens: list[str], types: list[int], vocab: dict[str, int], special: dict[str, int]
) -> None:
    """The tokens that match whole in text: control ones and bos/eos/unk/pad as special, user-defined
    ones as ordinary added tokens."""
    # Control tokens (<|endoftext|>, <|im_start|>, ...) match whole in text, as special tokens; a
    # "control" token spelled outside the byte alphabet is a llama.cpp mislabel and stays a plain
    # vocabulary entry. User-defined tokens (<think>, ...) match whole too, as ordinary added tokens.
    control = [t for t, k in zip(tokens, types) if k == _CONTROL and set(t) <= _ALPHABET]
    if control:
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    known = tok.get_vocab()
    user = [t for t, k in zip(tokens, types) if k == _USER_DEFINED and t in known]
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    # bos/eos/unk/pad match whole in text even when not marked control (kept to their vocabulary ids)
    named = {tokens[i] for i in special.values() if vocab.get(tokens[i]) == i} - set(control)
    if named:
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in sorted(named)])


def _add_bos_eos(
    tok: Tokenizer, meta: dict[str, Any], tokens: list[str], special: dict[str, int], path: Path
) -> None:
    """BOS / EOS added around each encoded text when the file asks for it (tokenizer.ggml.add_*_token)."""
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and "bos" in special
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and "eos" in special
    # (the template transformers builds: "[bos] $A [eos]", and "[bos] $A [eos] [bos] $B [eos]" for pairs)
    bos = [tokens[special["bos"]]] if add_bos else []
    eos = [tokens[special["eos"]]] if add_eos else []
    single = [*bos, "$A:0", *eos]
    pair = [*single, *(f"{t}:1" for t in bos), "$B:1", *(f"{t}:1" for t in eos)]
    added = [(t, special[k]) for k, ts in (("bos", bos), ("eos", eos)) for t in ts]
    try:
        tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=added)
    except Exception as e:  # a BOS / EOS spelled so that the template cannot hold it
        raise GGUFError(path, f"cannot add the BOS / EOS tokens {bos + eos} around texts: {e}") from None


def _build_tokenizer(meta: dict[str, Any], special: dict[str, int], path: Path) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` from ``tokenizer.ggml.*`` (model "gpt2")."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFError(
            path, f"tokenizer.ggml.model is {model!r}; only 'gpt2' (byte-level BPE) tokenizers are supported"
        )
    tokens, types, vocab, pairs = _vocabulary(meta, path)
    tok = _byte_level_bpe(vocab, pairs, meta.get("tokenizer.ggml.pre", ""), path)
    _add_whole_tokens(tok, tokens, types, vocab, special)
    _add_bos_eos(tok, meta, tokens, special, path)
    return tok
