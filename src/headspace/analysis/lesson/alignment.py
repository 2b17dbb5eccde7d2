"""Whisper's alignment heads, found from the audio, and word timings from them (issue #40).

A cross-attention head of decoder layer ``L`` gives, for the decoder's rows (the ``<|notimestamps|>``
row, then one row per text token; row ``i`` is the query that predicts text token ``i``, the last row
predicts end-of-text) a pattern over the encoder frames of the audio (20 ms each: 10 ms hop, stride-2
convolution). As in Whisper's own timestamp code (``whisper/timing.py``)::

    W     = softmax_frames(scores[:, :, :n_frames])     [heads, rows, n_frames]  (cropped to the audio)
    W     = (W - mean_rows(W)) / std_rows(W)             per head, per frame
    W     = median_filter_frames(W, 7)                   reflect-padded
    path  = DTW(-mean_heads(W))                          monotonic (row, frame) path from (0, 0) to the end
    jump  = the first frame of each row on the path      start of token i = jump[i] * 20 ms

A word (tokens grouped by the tokenizer's leading space) spans the frames from its first token's jump
to the jump of the token after its last (Whisper's convention: the next word's start, or end-of-text).
That span also holds the silence before the word (the row predicting a word's first token starts where
the previous word ends), so :func:`word_timings` narrows it by default to its longest run of sounding
frames (a frame sounds when its loudest mel band is within 30 dB of the loudest frame's,
:func:`speech_frames`; runs closer than 100 ms joined).

:func:`alignment_heads` scores every head alone (``W`` of that one head):

* given ``word_times`` [(word, start_s, end_s)], the mean over words of the intersection over union of
  the head's word interval (narrowed to sound) and the true one; ``boundary_error`` [layers, heads]
  holds the mean over words of ``(|start - start_true| + |end - end_true|) / 2`` in seconds;
* otherwise the path's own consistency: with ``m[k, i]`` = the attention mass of row ``k`` (the raw
  cropped softmax) on row ``i``'s path frames (widened by 2 frames), ``score = mean_i (m[i, i] -
  mean_{k != i} m[k, i])``: how much more each row attends to its own stretch of the path than the other
  rows do. A head that looks at a fixed frame (a sink) or everywhere scores near 0, a head whose rows
  walk through the audio near 1.

The finder never reads the heads a model's config lists.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ...model.encdec import EncoderDecoder
from ...pretrained.encdec.features import SAMPLE_RATE, log_mel, read_wav
from .dtw import dtw_paths

#: seconds per encoder frame (2 x 10 ms hop)
FRAME_SECONDS = 0.02
MEDIAN_WIDTH = 7
#: a frame sounds when its loudest mel band is within 30 dB (3 log10 units) of the loudest frame's
SILENCE_FLOOR = 3.0
#: silent frames (20 ms each) inside one word's sound (a closure), at most
MAX_GAP = 5
_SAMPLES_PER_FRAME = int(SAMPLE_RATE * FRAME_SECONDS)


@dataclass
class WordTiming:
    """One word and its start and end in seconds."""

    word: str
    start: float
    end: float


@dataclass
class AlignmentHeads:
    """Every cross-attention head's alignment score (higher is better) and the heads ranked by it.

    ``scores`` [n_layers, n_heads]; ``ranking``: every (layer, head), best first; ``method``:
    ``"timings"`` or ``"consistency"`` (module docstring); ``boundary_error`` [n_layers, n_heads] seconds
    (timings only); ``words``: the words aligned.
    """

    scores: Tensor
    ranking: list[tuple[int, int]]
    method: str
    words: list[str]
    boundary_error: Tensor | None = None

    def top(self, k: int) -> list[tuple[int, int]]:
        """The ``k`` best (layer, head) pairs."""
        return self.ranking[:k]

    def best(self) -> list[tuple[int, int]]:
        """The top quarter of the heads (at least one), the heads ``headspace align --heads auto`` uses:
        averaging that many was steadier than fewer on espeak-ng speech (tests/encdec/test_alignment.py;
        on Whisper base, top 12 of 48: 33 and 18 ms mean boundary error on two sentences, top 8: 109 and
        49 ms)."""
        return self.top(max(1, len(self.ranking) // 4))

    def to_dict(self) -> dict[str, Any]:
        """Plain lists, ready for JSON."""
        return {
            "method": self.method,
            "scores": self.scores.tolist(),
            "ranking": [list(p) for p in self.ranking],
            "words": self.words,
            "boundary_error": None if self.boundary_error is None else self.boundary_error.tolist(),
        }


def _audio(audio: Any) -> Tensor:
    """Samples [n] at 16 kHz of a WAV path or a 1-D float tensor."""
    if isinstance(audio, (str, os.PathLike)):
        return read_wav(audio)
    if isinstance(audio, Tensor) and audio.dim() == 1 and audio.is_floating_point() and audio.numel():
        return audio.float()
    got = f"{audio.dtype} {list(audio.shape)}" if isinstance(audio, Tensor) else type(audio).__name__
    raise ValueError(f"audio must be a 16 kHz WAV path or a non-empty 1-D float tensor; got {got}")


def _check_model(model: Any) -> None:
    whisper = (
        isinstance(model, EncoderDecoder) and model.config.audio and callable(getattr(model, "prompt", None))
    )
    if not whisper or model.tokenizer is None:
        raise ValueError(
            f"model must be a Whisper EncoderDecoder with its tokenizer (headspace.load('whisper-base')); "
            f"got {type(model).__name__}"
        )


def _text_ids(model: Any, samples: Tensor, transcript: str | None) -> list[int]:
    """The transcript's token ids (leading space added), or the model's greedy transcription."""
    if transcript is None:
        feats = log_mel(samples, model.config.n_mels)[None]  # [n_mels, 3000] -> [1, n_mels, 3000]
        prompt = model.prompt()
        ids = model.generate(feats, 224, decoder_input_ids=torch.tensor([prompt]))[0].tolist()
        ids = ids[len(prompt) :]
        return ids[:-1] if ids and ids[-1] == model.config.eos_token_id else ids
    text = " " + transcript.strip()
    return list(model.tokenizer.plain_ids(text))


def _cross_scores(model: Any, samples: Tensor, text: list[int]) -> Tensor:
    """Cross-attention scores [n_layers, n_heads, rows, n_frames] of the rows ``<|notimestamps|>`` and
    each text token (module docstring), cropped to the audio's frames."""
    feats = log_mel(samples, model.config.n_mels)[None]  # [n_mels, 3000] -> [1, n_mels, 3000]
    prompt = model.prompt()
    ids = torch.tensor([[*prompt, *text, model.config.eos_token_id]])  # [1, seq_dec]
    n_frames = min(-(-samples.shape[0] // _SAMPLES_PER_FRAME), model.config.max_source_positions)
    kept: dict[int, Tensor] = {}
    removers = []
    for layer, block in enumerate(model.decoder.blocks):

        def keep(value: Tensor, _point: Any, layer: int = layer) -> None:
            kept[layer] = value[0, :, len(prompt) - 1 : -1, :n_frames].detach()  # [H, rows, n_frames]

        removers.append(block.cross_attn.hook_scores.add(keep))
    try:
        with torch.no_grad():
            model(feats, ids)
    finally:
        for remove in removers:
            remove()
    return torch.stack([kept[i] for i in range(len(model.decoder.blocks))])  # [L, H, rows, n_frames]


def normalise(pattern: Tensor, width: int = MEDIAN_WIDTH) -> Tensor:
    """Whisper's matrix: ``pattern`` [..., rows, frames] standardised over rows per frame, then median
    filtered along frames (``width``, reflect padding). Same shape."""
    std, mean = torch.std_mean(pattern, dim=-2, keepdim=True, unbiased=False)
    x = (pattern - mean) / std.clamp(min=1e-12)
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    shape = x.shape
    flat = x.reshape(-1, 1, shape[-1])  # [..., rows, frames] -> [B, 1, frames]
    flat = F.pad(flat, (pad, pad), mode="reflect")  # [B, 1, frames + 2 pad]
    med = flat.unfold(-1, width, 1).sort(dim=-1).values[..., pad]  # [B, 1, frames]
    return med.reshape(shape)  # [B, 1, frames] -> [..., rows, frames]


def dtw(cost: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Whisper's dynamic time warping of ``cost`` [rows, frames]: the (row, frame) indices of the
    cheapest monotonic path from (0, 0) to (rows - 1, frames - 1), steps (1, 1), (1, 0), (0, 1); ties
    prefer the frame step, as ``whisper.timing.dtw_cpu`` does (:func:`.dtw.dtw_paths`, one matrix)."""
    return dtw_paths(cost[None])[0]  # [rows, frames] -> [1, rows, frames]


def _jumps(rows: np.ndarray, frames: np.ndarray, n_rows: int) -> np.ndarray:
    """The first frame of each row on the path [n_rows]."""
    first = np.full(n_rows, -1)
    for r, f in zip(rows.tolist(), frames.tolist(), strict=True):
        if first[r] < 0:
            first[r] = f
    return first


def word_groups(model: Any, text: list[int]) -> list[tuple[str, int, int]]:
    """(word, first token index, one past its last) of ``text`` ids, a new word at each token whose text
    starts with a space (the first token always starts one)."""
    out: list[tuple[str, int, int]] = []
    for i, tid in enumerate(text):
        piece = model.tokenizer.token_text(model.tokenizer.token_of(tid) or "")
        if not out or piece.startswith(" "):
            out.append(("", i, i))
        word, s, _ = out[-1]
        out[-1] = (word + piece, s, i + 1)
    return [(w.strip(), s, e) for w, s, e in out]


def speech_frames(samples: Tensor, n_frames: int, floor: float = SILENCE_FLOOR) -> np.ndarray:
    """Which of the first ``n_frames`` encoder frames (20 ms) hold sound [n_frames] (bool): the frame's
    loudest log10 mel power (as in :func:`log_mel`, before scaling) is within ``floor`` (log10 units;
    3 = 30 dB) of the loudest frame's."""
    feats = log_mel(samples, 80) * 4.0 - 4.0  # [80, 3000]: log10 mel power
    loud = feats.max(dim=0).values[: 2 * n_frames]  # [2 n_frames] (10 ms frames)
    loud = F.pad(loud, (0, 2 * n_frames - loud.shape[0]), value=float(loud.min()))
    pairs = loud.reshape(n_frames, 2).max(dim=1).values  # [2 n_frames] -> [n_frames, 2] -> [n_frames]
    return (pairs > pairs.max() - floor).numpy()


def _trim(start: int, end: int, speech: np.ndarray | None, gap: int = MAX_GAP) -> tuple[int, int]:
    """Frames [start, end) narrowed to their longest sounding run (runs apart by fewer than ``gap``
    silent frames joined: a stop consonant's closure stays inside its word); unchanged if none sounds."""
    if speech is None or end <= start:
        return start, end
    loud = np.nonzero(speech[start:end])[0]
    if loud.size == 0:
        return start, end
    breaks = np.nonzero(np.diff(loud) > gap)[0]  # a run ends after loud[b] for each b
    firsts = np.concatenate(([loud[0]], loud[breaks + 1]))
    lasts = np.concatenate((loud[breaks], [loud[-1]]))
    best = int(np.argmax(lasts - firsts))
    return start + int(firsts[best]), start + int(lasts[best]) + 1


def _timings(
    matrix: Tensor,
    groups: list[tuple[str, int, int]],
    speech: np.ndarray | None = None,
    path: tuple[np.ndarray, np.ndarray] | None = None,
) -> list[WordTiming]:
    """Word timings from a normalised matrix [rows, frames] (module docstring); with ``speech``
    [frames] (bool) each word's frames are narrowed to the sounding ones (:func:`speech_frames`).
    ``path``: ``dtw(-matrix)`` when the caller has it already."""
    rows, frames = dtw(-matrix) if path is None else path
    jump = _jumps(rows, frames, matrix.shape[0])
    out = []
    for w, s, e in groups:
        a, b = _trim(int(jump[s]), int(jump[e]), speech)
        out.append(WordTiming(w, a * FRAME_SECONDS, b * FRAME_SECONDS))
    return out


def _consistency(pattern: Tensor, path: tuple[np.ndarray, np.ndarray], widen: int = 2) -> float:
    """The path-consistency score of one head (module docstring); ``pattern`` [rows, frames] softmax,
    ``path`` the DTW path of its negated normalised matrix."""
    rows, frames = path
    n, m = pattern.shape
    mask = torch.zeros(n, m, dtype=pattern.dtype)  # [rows, frames]: each row's path stretch, widened
    for r in range(n):
        fr = frames[rows == r]
        mask[r, max(0, int(fr.min()) - widen) : min(m, int(fr.max()) + widen + 1)] = 1.0
    mass = pattern @ mask.T  # [rows, rows]: m[k, i]
    own = mass.diagonal()
    others = (mass.sum(0) - own) / max(n - 1, 1)
    return float((own - others).mean())


def consistency_scores(patterns: Tensor, matrices: Tensor) -> Tensor:
    """Every head's path-consistency score [L, H] (module docstring) from its softmax ``patterns`` and
    normalised ``matrices``, each [L, H, rows, frames]: all heads' DTW paths in one batch."""
    n_layers, n_heads = patterns.shape[:2]
    paths = dtw_paths(-matrices.flatten(0, 1))  # [L, H, rows, frames] -> [L H, rows, frames]
    scores = torch.zeros(n_layers, n_heads)
    for layer in range(n_layers):
        for h in range(n_heads):
            scores[layer, h] = _consistency(patterns[layer, h], paths[layer * n_heads + h])
    return scores


def _check_word_times(word_times: Any) -> list[tuple[str, float, float]]:
    ok = isinstance(word_times, Sequence) and len(word_times) > 0
    out = []
    for item in word_times if ok else ():
        good = (
            isinstance(item, Sequence) and len(item) == 3 and isinstance(item[0], str)
            and all(isinstance(t, (int, float)) for t in item[1:]) and 0 <= item[1] <= item[2]
        )  # fmt: skip
        if not good:
            raise ValueError(
                f"word_times must be (word, start_s, end_s) with 0 <= start <= end; got {item!r}"
            )
        out.append((item[0], float(item[1]), float(item[2])))
    if not ok:
        raise ValueError(f"word_times must be a non-empty list of (word, start_s, end_s); got {word_times!r}")
    return out


def _timing_scores(
    patterns: Tensor,
    groups: list[tuple[str, int, int]],
    truth: list[tuple[str, float, float]],
    speech: np.ndarray | None,
) -> tuple[Tensor, Tensor]:
    """(mean intersection over union of found and true word intervals, mean boundary error in s), each
    [L, H], of each head's word timings alone (module docstring)."""
    n_layers, n_heads = patterns.shape[:2]
    iou, error = torch.zeros(n_layers, n_heads), torch.zeros(n_layers, n_heads)
    matrices = normalise(patterns)  # [L, H, rows, frames]
    paths = dtw_paths(-matrices.flatten(0, 1))  # [L, H, rows, frames] -> [L H, rows, frames]
    for layer in range(n_layers):
        for h in range(n_heads):
            found = _timings(matrices[layer, h], groups, speech, paths[layer * n_heads + h])
            ov, err = 0.0, 0.0
            for t, (_, t0, t1) in zip(found, truth, strict=True):
                union = max(t.end, t1) - min(t.start, t0)
                ov += max(0.0, min(t.end, t1) - max(t.start, t0)) / union if union > 0 else 0.0
                err += (abs(t.start - t0) + abs(t.end - t1)) / 2
            iou[layer, h], error[layer, h] = ov / len(groups), err / len(groups)
    return iou, error


def alignment_heads(
    model: EncoderDecoder,
    audio: str | os.PathLike[str] | Tensor,
    transcript: str | None = None,
    word_times: Sequence[tuple[str, float, float]] | None = None,
) -> AlignmentHeads:
    """Score every cross-attention head of a Whisper ``model`` by how well its DTW path over the frames of
    ``audio`` (a 16 kHz WAV path or samples [n]) aligns the text (module docstring). The text: the words
    of ``word_times`` if given, else ``transcript``, else the model's own greedy transcription. Scores by
    agreement with ``word_times`` when given, else by the path's own consistency."""
    _check_model(model)
    samples = _audio(audio)
    truth = None if word_times is None else _check_word_times(word_times)
    if truth is not None and transcript is None:
        transcript = " ".join(w for w, _, _ in truth)
    text = _text_ids(model, samples, transcript)
    if not text:
        raise ValueError("no text to align: the transcript is empty (and the model heard no words)")
    groups = word_groups(model, text)
    patterns = _cross_scores(model, samples, text).softmax(dim=-1)  # [L, H, rows, n_frames]
    if truth is not None:
        if len(truth) != len(groups):
            raise ValueError(
                f"word_times has {len(truth)} words; the transcript splits into {len(groups)} "
                f"({[w for w, _, _ in groups][:8]})"
            )
        speech = speech_frames(samples, patterns.shape[-1])
        scores, error = _timing_scores(patterns, groups, truth, speech)
        order = sorted(
            ((lay, h) for lay in range(scores.shape[0]) for h in range(scores.shape[1])),
            key=lambda p: (-float(scores[p]), float(error[p])),
        )
        return AlignmentHeads(scores, order, "timings", [w for w, _, _ in groups], error)
    scores = consistency_scores(patterns, normalise(patterns))
    order = sorted(
        ((lay, h) for lay in range(scores.shape[0]) for h in range(scores.shape[1])),
        key=lambda p: -float(scores[p]),
    )
    return AlignmentHeads(scores, order, "consistency", [w for w, _, _ in groups])


def word_timings(
    model: EncoderDecoder,
    audio: str | os.PathLike[str] | Tensor,
    heads: Sequence[tuple[int, int]],
    transcript: str | None = None,
    *,
    trim_silence: bool = True,
) -> list[WordTiming]:
    """Each word's start and end (seconds) in ``audio`` from the ``heads`` [(layer, head)]: their
    normalised matrices averaged, then DTW (module docstring). Text as in :func:`alignment_heads`. With
    ``trim_silence`` each word's frames are narrowed to the sounding ones (:func:`speech_frames`): the
    DTW row of a word's first token also spans the silence before it."""
    _check_model(model)
    n_layers, n_heads = len(model.decoder.blocks), model.config.n_heads
    heads = list(heads)
    bad = [p for p in heads if not (isinstance(p, tuple) and len(p) == 2 and 0 <= p[0] < n_layers
                                    and 0 <= p[1] < n_heads)]  # fmt: skip
    if not heads or bad:
        raise ValueError(
            f"heads must be a non-empty list of (layer < {n_layers}, head < {n_heads}); got {heads!r}"
        )
    samples = _audio(audio)
    text = _text_ids(model, samples, transcript)
    if not text:
        return []
    patterns = _cross_scores(model, samples, text).softmax(dim=-1)  # [L, H, rows, n_frames]
    chosen = torch.stack([patterns[lay, h] for lay, h in heads])  # [n_chosen, rows, n_frames]
    speech = speech_frames(samples, patterns.shape[-1]) if trim_silence else None
    return _timings(normalise(chosen).mean(dim=0), word_groups(model, text), speech)


__all__ = [
    "FRAME_SECONDS",
    "AlignmentHeads",
    "WordTiming",
    "alignment_heads",
    "dtw",
    "normalise",
    "word_groups",
    "word_timings",
]
