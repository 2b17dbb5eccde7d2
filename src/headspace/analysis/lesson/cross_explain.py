"""``headspace explain`` on an encoder-decoder: one output token through one cross-attention head, from a
source sentence (T5, BART, Marian with their ``tokenizer.json``) or a WAV file (Whisper), plus what the
picture needs (the head's whole pattern, the source's word boundaries).

The model's greedy output is the text: Whisper's decoder reads its prompt
``<|startoftranscript|><|en|><|transcribe|><|notimestamps|>``, a translator its start token, then the
output tokens ``y_0 .. y_{n-1}`` and the end token. Output token ``y_k`` is predicted at decoder position
``P - 1 + k`` (``P``: the prompt's length): that query is the one walked (:func:`explain_encdec`).

The default head is the cross-attention head whose pattern over the output rows (the queries predicting
``y_0 .. y_{n-1}`` and the end) forms the most consistent monotonic path over the source
(:func:`headspace.analysis.lesson.alignment.alignment_heads`' consistency score: DTW of the normalised
pattern, then how much more each row attends to its own stretch of the path than the other rows do).
Audio patterns are scored over the audio's frames only (20 ms each, the 30 s window cropped), as
Whisper's timing code does; text patterns over the source tokens, without the median filter.

Word boundaries: for audio, each word's start and end (seconds) from the top quarter of the heads
(:func:`~headspace.analysis.lesson.alignment.word_timings`' method: DTW, narrowed to sounding frames);
for text, the source positions where a word starts (a token whose text begins with a space) or a special
token (``</s>``) starts or ends.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...model.encdec import EncoderDecoder
from ...pretrained.encdec.features import log_mel, read_wav
from ..trace.trace import trace
from .alignment import (
    FRAME_SECONDS,
    _cross_scores,
    _text_ids,
    _timings,
    consistency_scores,
    normalise,
    speech_frames,
    word_groups,
)
from .cross import EncDecLesson, explain_encdec

#: the most output tokens a translator generates for the lesson
MAX_NEW_TOKENS = 32


@dataclass
class CrossExplanation:
    """The lesson of one output token through one cross-attention head, with its context.

    ``outputs``: the output tokens' texts [n]; ``token``: the index ``k`` of the one followed;
    ``sources``: a label per source position (token text, or the frame's start ``"1.24s"``) [seq_k];
    ``pattern``: the head's pattern, one row per output token and the end [n + 1][seq_k] (audio: cropped
    to the audio's frames, not renormalised); ``scores``: every head's consistency [n_layers][n_heads];
    ``boundaries``: word starts (text: source positions) or word starts and ends (audio: seconds);
    ``words``: (word, start, end) in the same units; ``seconds_per_key``: 0.02 for audio, else None;
    ``chosen``: why this head; ``queries``: the decoder's input token at each row [n + 1] (the row that
    predicts ``outputs[k]`` reads ``queries[k]``, the token before it).
    """

    lesson: EncDecLesson
    outputs: list[str]
    token: int
    sources: list[str]
    pattern: list[list[float]]
    scores: list[list[float]]
    boundaries: list[float]
    words: list[tuple[str, float, float]]
    seconds_per_key: float | None
    chosen: str
    queries: list[str]

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-ready values (the lesson's steps under ``"lesson"``)."""
        d = dict(self.__dict__)
        d["lesson"] = dict(self.lesson.__dict__)
        d["words"] = [list(w) for w in self.words]
        return d


def _piece(model: EncoderDecoder, tid: int) -> str:
    return model.tokenizer.token_text(model.tokenizer.token_of(tid) or "")


def _check_model(model: Any) -> None:
    if not isinstance(model, EncoderDecoder):
        raise TypeError(f"model must be a headspace EncoderDecoder; got {type(model).__name__}")
    if model.tokenizer is None:
        raise ValueError(
            f"{model.config.name or 'the model'}: no tokenizer (a tokenizer.json in the checkpoint folder); "
            "explain needs one to read the source and print the output"
        )


def _audio_inputs(model: Any, source: Any) -> tuple[Tensor, list[int], list[int], Tensor]:
    """(features [1, n_mels, 3000], prompt ids, output ids, samples [n]) of a WAV path or samples."""
    if not callable(getattr(model, "prompt", None)):
        raise ValueError(
            "model: an audio encoder-decoder without Whisper's prompt (headspace.load('whisper-base'))"
        )
    samples = read_wav(source) if isinstance(source, (str, os.PathLike)) else source
    text = _text_ids(model, samples, None)
    if not text:
        raise ValueError(f"{source}: the model heard no words in it; nothing to explain")
    return log_mel(samples, model.config.n_mels)[None], model.prompt(), text, samples  # [1, n_mels, 3000]


def _text_inputs(
    model: EncoderDecoder, source: str, target: str | None
) -> tuple[Tensor, list[int], list[int]]:
    """(source ids [1, seq], prompt ids, output ids) of a sentence; the output: ``target``'s tokens, or
    the greedy translation."""
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"source must be a non-empty sentence; got {source!r}")
    ids = torch.tensor(model.tokenizer.encode_ids([source]))  # [1, seq]
    start = model.config.decoder_start_token_id
    if target is not None:
        if not isinstance(target, str) or not target.strip():
            raise ValueError(f"target must be a non-empty sentence or None; got {target!r}")
        return ids, [start], list(model.tokenizer.plain_ids(target))
    out = model.generate(ids, MAX_NEW_TOKENS, decoder_input_ids=torch.tensor([[start]]))[0].tolist()
    text = out[1:]
    if text and text[-1] == model.config.eos_token_id:
        text = text[:-1]
    if not text:
        raise ValueError(f"{source!r}: the model's output is empty (it ends at once); nothing to explain")
    return ids, [start], text


def _text_scores(model: EncoderDecoder, ids: Tensor, decoder_ids: Tensor, rows: slice) -> Tensor:
    """Every cross head's pattern [n_layers, n_heads, rows, seq_k] at the output rows."""
    names = [f"decoder.blocks.{i}.cross_attn.hook_pattern" for i in range(len(model.decoder.blocks))]
    with torch.no_grad(), trace(model, names=names) as t:
        model(ids, decoder_ids)
    return torch.stack([t[n][0, :, rows] for n in names])  # L x [H, rows, seq_k] -> [L, H, rows, seq_k]


def _pick(model: EncoderDecoder, text: list[int], token: int | str | None) -> int:
    """The output token's index: ``token`` an index or an output token's text; None: the middle one."""
    if token is None:
        return len(text) // 2
    if isinstance(token, int) and not isinstance(token, bool):
        if not 0 <= token < len(text):
            raise ValueError(
                f"token must be in [0, {len(text)}) (the output has {len(text)} tokens); got {token}"
            )
        return token
    pieces = [_piece(model, t).strip() for t in text]
    if str(token).strip() not in pieces:
        raise ValueError(f"token {token!r} is not among the output tokens {pieces[:20]}")
    return pieces.index(str(token).strip())


def _check_head(model: EncoderDecoder, layer: int | None, head: int | None) -> None:
    n_layers, n_heads = model.config.n_decoder_layers, model.config.n_heads
    if layer is not None and not 0 <= layer < n_layers:
        raise ValueError(f"layer must be in [0, {n_layers}) for the decoder's {n_layers} layers; got {layer}")
    if head is not None and not 0 <= head < n_heads:
        raise ValueError(f"head must be in [0, {n_heads}); got {head}")


@dataclass
class CrossPatterns:
    """Every cross-attention head's pattern at the output rows of one input (module docstring).

    ``inputs``: source ids [1, seq] or features [1, n_mels, 3000]; ``prompt``, ``text``: the decoder's
    prompt and output ids; ``patterns`` [n_layers, n_heads, n + 1, seq_k] (audio: softmax over the audio's
    frames only, as Whisper's timing code); ``matrices``: their normalised form (same shape, for DTW);
    ``samples``: the 16 kHz audio [n] (None for text)."""

    inputs: Tensor
    prompt: list[int]
    text: list[int]
    patterns: Tensor
    matrices: Tensor
    samples: Tensor | None


def cross_patterns(
    model: EncoderDecoder, source: str | os.PathLike[str] | Tensor, target: str | None = None
) -> CrossPatterns:
    """The cross-attention patterns of ``model``'s output for ``source`` (a sentence; Whisper: a WAV path or
    16 kHz samples [n]); the output is ``target``'s tokens (text models) or the greedy output."""
    _check_model(model)
    if model.config.audio:
        inputs, prompt, text, samples = _audio_inputs(model, source)
        patterns = _cross_scores(model, samples, text).softmax(dim=-1)  # [L, H, rows, n_frames]
        return CrossPatterns(inputs, prompt, text, patterns, normalise(patterns), samples)
    inputs, prompt, text = _text_inputs(model, str(source), target)
    rows = slice(len(prompt) - 1, len(prompt) + len(text))
    decoder_ids = torch.tensor([[*prompt, *text, model.config.eos_token_id]])  # [1, seq_dec]
    patterns = _text_scores(model, inputs, decoder_ids, rows)  # [L, H, rows, seq_k]
    return CrossPatterns(inputs, prompt, text, patterns, normalise(patterns, width=1), None)


def monotonic_scores(p: CrossPatterns) -> Tensor:
    """Every head's monotonic-alignment score [n_layers, n_heads]: the consistency of its DTW path
    (module docstring; near 0 for a sink or a diffuse head, near 1 for rows walking through the source)."""
    return consistency_scores(p.patterns, p.matrices)


def explain_cross(
    model: EncoderDecoder,
    source: str | os.PathLike[str] | Tensor,
    *,
    token: int | str | None = None,
    layer: int | None = None,
    head: int | None = None,
    target: str | None = None,
) -> CrossExplanation:
    """Walk output token ``token`` (module docstring) of ``model``'s greedy output for ``source`` (a
    sentence, or for Whisper a WAV path or 16 kHz samples [n]) through cross-attention head ``head`` of
    decoder layer ``layer`` (defaults: the most consistent monotonic head; with only ``layer`` given, the
    best head of that layer). ``target``: the output text to follow instead of the greedy output (text
    models only)."""
    _check_model(model)
    _check_head(model, layer, head)
    audio = model.config.audio
    cp = cross_patterns(model, source, target)
    inputs, prompt, text, patterns, matrices = cp.inputs, cp.prompt, cp.text, cp.patterns, cp.matrices
    scores = monotonic_scores(cp)
    k = _pick(model, text, token)
    chosen = "given"
    if layer is None or head is None:
        masked = scores.clone()
        if layer is not None:
            masked[torch.arange(masked.shape[0]) != layer] = -float("inf")
        if head is not None:
            masked[:, torch.arange(masked.shape[1]) != head] = -float("inf")
        best = int(masked.flatten().argmax())
        layer, head = divmod(best, scores.shape[1])
        chosen = f"the most consistent monotonic alignment ({float(scores[layer, head]):.3f})"
    decoder_ids = torch.tensor([[*prompt, *text, model.config.eos_token_id]])  # [1, seq_dec]
    lesson = explain_encdec(model, inputs, decoder_ids, layer=layer, head=head, position=len(prompt) - 1 + k)
    groups = word_groups(model, text) if audio else []
    if audio:
        top = scores.flatten().argsort(descending=True)[: max(1, scores.numel() // 4)]
        chosen_m = torch.stack([matrices[int(i) // scores.shape[1], int(i) % scores.shape[1]] for i in top])
        speech = speech_frames(cp.samples, patterns.shape[-1])
        timed = _timings(chosen_m.mean(dim=0), groups, speech)
        words = [(w.word, round(w.start, 3), round(w.end, 3)) for w in timed]
        boundaries = sorted({t for _, a, b in words for t in (a, b)})
        n_keys = patterns.shape[-1]
        sources = [f"{j * FRAME_SECONDS:.2f}s" for j in range(len(lesson.pattern))]
        picture = _full_rows(model, inputs, decoder_ids, layer, head, len(prompt), len(text), n_keys)
    else:
        src_ids = inputs[0].tolist()
        sources = [_piece(model, t) for t in src_ids]
        special = [t in model.tokenizer.control_ids for t in src_ids]  # </s> etc.: no word, its own span
        starts = [
            j for j, s in enumerate(sources) if j == 0 or s.startswith(" ") or special[j] or special[j - 1]
        ]
        words = [(sources[a].strip() + "".join(sources[a + 1 : b]), float(a), float(b))
                 for a, b in zip(starts, [*starts[1:], len(sources)]) if not special[a]]  # fmt: skip
        boundaries = [float(j) for j in starts[1:]]
        picture = patterns[layer, head]
    return CrossExplanation(
        lesson=lesson, outputs=[_piece(model, t) for t in text], token=k, sources=sources,
        pattern=picture.tolist(), scores=scores.tolist(), boundaries=boundaries, words=words,
        seconds_per_key=FRAME_SECONDS if audio else None, chosen=chosen,
        queries=[_piece(model, t) for t in [prompt[-1], *text]],
    )  # fmt: skip


def _full_rows(
    model: EncoderDecoder,
    feats: Tensor,
    ids: Tensor,
    layer: int,
    head: int,
    n_prompt: int,
    n: int,
    n_keys: int,
) -> Tensor:
    """The head's true pattern (softmax over the whole 30 s window) at the output rows, cropped to the
    audio's ``n_keys`` frames [n + 1, n_keys]."""
    name = f"decoder.blocks.{layer}.cross_attn.hook_pattern"
    with torch.no_grad(), trace(model, names=[name]) as t:
        model(feats, ids)
    return t[name][0, head, n_prompt - 1 : n_prompt + n, :n_keys]  # [n + 1, n_keys]


__all__ = ["CrossExplanation", "CrossPatterns", "cross_patterns", "explain_cross", "monotonic_scores"]
