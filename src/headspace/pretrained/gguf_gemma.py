"""What a Gemma 3 GGUF file holds beyond a Llama's: its configuration, its tensors, its vocabulary.

:func:`~.gguf_format.read_gguf` dispatches here for ``general.architecture == "gemma3"`` (llama.cpp's
converter of ``Gemma3ForCausalLM``); the result is the Hugging Face ``gemma3_text`` config and tensor
names that :mod:`.llama` (with :mod:`.llama_variants`) turns into a Decoder, as for a checkpoint folder::

    GGUF blk.N.                 Hugging Face model.layers.N.            headspace blocks.N.
    attn_norm                   input_layernorm                          ln1
    post_attention_norm         post_attention_layernorm                 ln_attn_out
    ffn_norm                    pre_feedforward_layernorm                ln2
    post_ffw_norm               post_feedforward_layernorm               ln_mlp_out
    attn_q_norm / attn_k_norm   self_attn.q_norm / k_norm                attn.q_norm / k_norm  [d_head]

Conventions undone here (each checked against transformers 5 reading the same file, in the tests):

* every norm weight is stored as ``1 + w`` (llama.cpp folds Gemma's ``x * (1 + w)`` into the weight):
  ``w = stored - 1`` in float32, as transformers does; the Decoder multiplies by ``1 + w`` again;
* W_Q / W_K rows are **not** permuted (llama.cpp rotates Gemma's halves, NEOX-style), so they are
  read as they are;
* what the file does not store is Gemma 3's: layers 6k + 5 attend to every key and the others through
  the sliding window (``sliding_window``); ``rope.freq_base`` (1e6) is the full layers' base, the
  sliding layers' is 10,000; queries are scaled by ``1 / sqrt(query_pre_attn_scalar)`` with
  ``query_pre_attn_scalar = head_dim`` (256), except the 27B shape (62 layers, d_model 5376), whose
  scalar is ``d_model / n_heads`` = 168 as llama.cpp has it; the MLP is GeGLU with tanh-approximate GELU;
  no soft-capping (Gemma 3 has none).

The vocabulary (``tokenizer.ggml.model == "llama"``: SentencePiece, BPE with byte fallback) is listed
without merges. They are implied by the listing order: a token of the vocabulary that splits into two
tokens of the vocabulary is a merge, ranked by the merged token's place in the list (earlier first) and,
among the splits of one token, the longer left part first. Tokens stored as runs of real spaces are
spelled with U+2581 as the normaliser writes a space. Text is split after every space, BOS is added
when ``tokenizer.ggml.add_bos_token`` says so, control tokens (``<start_of_turn>``, ...) match whole as
special tokens and user-defined ones (newline runs, ...) as plain added tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from .gguf_meta import GGUFError, meta_int

__all__ = [
    "GEMMA3_ARCH",
    "GEMMA3_LAYER_NAMES",
    "gemma3_config",
    "gemma3_layer_shapes",
    "sentencepiece_tokenizer",
]

GEMMA3_ARCH = "gemma3"

#: GGUF per-layer tensor part -> Hugging Face name under ``model.layers.N.`` (a Gemma 3 layer).
GEMMA3_LAYER_NAMES: dict[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

_SLIDING_PATTERN = 6  # Gemma 3: five sliding layers, then a full one (llama.cpp and transformers alike)
_LOCAL_BASE = 10000.0  # the sliding layers' RoPE base (transformers' rope_local_base_freq)
_MAX_WINDOW = 1 << 24
_27B_SHAPE = (62, 5376)  # (layers, d_model) of Gemma 3 27B, whose query scale is 1 / sqrt(d_model / heads)


def gemma3_config(meta: Mapping[str, Any], core: dict[str, Any], path: Path) -> dict[str, Any]:
    """The Hugging Face ``gemma3_text`` config from the Llama-shaped ``core`` (sizes, heads, eps, RoPE
    base, special ids: what every supported architecture shares) and the ``gemma3.*`` metadata."""
    if core.get("rope_scaling") is not None:
        raise GGUFError(path, "RoPE scaling on a Gemma 3 file is not supported (Gemma 3 270M/1B have none)")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if f"gemma3.{key}" in meta:
            raise GGUFError(path, f"metadata 'gemma3.{key}' is set, but Gemma 3 has no soft-capping")
    layers, hidden, heads = core["num_hidden_layers"], core["hidden_size"], core["num_attention_heads"]
    window = meta_int(dict(meta), "gemma3.attention.sliding_window", path, 1, _MAX_WINDOW)
    scalar = hidden // heads if (layers, hidden) == _27B_SHAPE else core["head_dim"]
    config = {k: v for k, v in core.items() if k not in ("hidden_act", "mlp_bias", "rope_scaling")}
    config.update(
        model_type="gemma3_text",
        hidden_activation="gelu_pytorch_tanh",
        sliding_window=window,
        layer_types=[
            "full_attention" if (i + 1) % _SLIDING_PATTERN == 0 else "sliding_attention"
            for i in range(layers)
        ],
        rope_local_base_freq=_LOCAL_BASE,
        query_pre_attn_scalar=scalar,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
    )
    return config


def gemma3_layer_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shapes of one Gemma 3 layer's tensors beyond a Llama layer's (GGUF part -> PyTorch shape)."""
    h, d = config["hidden_size"], config["head_dim"]
    return {
        "attn_q_norm": (d,),
        "attn_k_norm": (d,),
        "post_attention_norm": (h,),
        "post_ffw_norm": (h,),
    }


# --------------------------------------------------------------------------------------------------
# The SentencePiece-style vocabulary
# --------------------------------------------------------------------------------------------------

_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4  # tokenizer.ggml.token_type values
_SPACE = "\u2581"  # how SentencePiece writes a space


def _spelled(token: str) -> str:
    """A token stored as a run of real spaces, spelled as the normaliser writes them (U+2581 each)."""
    return _SPACE * len(token) if token and not token.strip(" ") else token


def _implied_merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every (left, right) with left, right and left + right in ``vocab``, best first: by the merged
    token's id, then the longer left part first."""
    merges: list[tuple[str, str]] = []
    for token in sorted(vocab, key=vocab.__getitem__):  # ids ascending (a duplicate keeps its last id)
        n = len(token)
        if n > 1:
            merges += [
                (token[:k], token[k:])
                for k in range(n - 1, 0, -1)
                if token[:k] in vocab and token[k:] in vocab
            ]
    return merges


def sentencepiece_tokenizer(
    meta: Mapping[str, Any], special: Mapping[str, int], path: Path
) -> Callable[[], Tokenizer]:
    """Check a Gemma GGUF vocabulary (``tokenizer.ggml.model == "llama"``) now, and return the function
    that builds its `tokenizers.Tokenizer` (seconds for 262k tokens: the reader runs it beside the
    tensors' dequantisation). Every check on the metadata raises here, as a `GGUFError`."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not isinstance(tokens[0], str):
        raise GGUFError(path, "tokenizer.ggml.tokens is missing or not a list of strings")
    if "tokenizer.ggml.merges" in meta:
        raise GGUFError(path, "a Gemma vocabulary with tokenizer.ggml.merges is not one llama.cpp writes")
    types = meta.get("tokenizer.ggml.token_type")
    if not isinstance(types, np.ndarray) or types.shape != (len(tokens),):
        raise GGUFError(
            path, f"tokenizer.ggml.token_type does not give one type for each of {len(tokens)} tokens"
        )
    if "unk" not in special:
        raise GGUFError(
            path, "a SentencePiece vocabulary needs tokenizer.ggml.unknown_token_id (byte fallback)"
        )
    kinds = types.tolist()  # [n_tokens] ints
    spelled = [_spelled(t) for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    missing = [p for p in (f"<0x{b:02X}>" for b in range(256)) if p not in vocab]
    if missing:
        raise GGUFError(path, f"the vocabulary lacks byte-fallback pieces such as {missing[0]!r}")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True)) and "bos" in special
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and "eos" in special
    bos = [(spelled[special["bos"]], special["bos"])] if add_bos else []
    eos = [(spelled[special["eos"]], special["eos"])] if add_eos else []
    unk = spelled[special["unk"]]

    def build() -> Tokenizer:
        try:
            tok = Tokenizer(
                BPE(
                    vocab=vocab,
                    merges=_implied_merges(vocab),
                    unk_token=unk,
                    fuse_unk=True,
                    byte_fallback=True,
                    dropout=None,
                )
            )
        except Exception as e:  # tokenizers raises plain Exceptions
            raise GGUFError(path, f"the vocabulary does not form a BPE model: {e}") from None
        tok.normalizer = normalizers.Replace(" ", _SPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        tok.decoder = decoders.Sequence(
            [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        )
        control = [t for t, k in zip(spelled, kinds) if k == _CONTROL]
        if control:
            tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
        user = [t for t, k in zip(spelled, kinds) if k == _USER_DEFINED]
        if user:
            tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
        single = [*(t for t, _ in bos), "$A:0", *(t for t, _ in eos)]
        pair = [*single, *(f"{t}:1" for t, _ in bos), "$B:1", *(f"{t}:1" for t, _ in eos)]
        try:
            tok.post_processor = processors.TemplateProcessing(
                single=single, pair=pair, special_tokens=bos + eos
            )
        except Exception as e:
            raise GGUFError(path, f"cannot add the BOS / EOS tokens around texts: {e}") from None
        return tok

    return build
