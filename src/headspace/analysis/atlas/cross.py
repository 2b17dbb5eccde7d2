"""The atlas's cross-attention statistics on an encoder-decoder (issue #40): every cross-attention head's
entropy and monotonic-alignment score over a corpus of audio files (Whisper) or source sentences (with
their targets, or the model's greedy output).

For each input the rows are the decoder queries that predict each output token and the end
(:func:`headspace.analysis.lesson.cross_explain.cross_patterns`; audio: the softmax over the audio's frames,
the 30 s window's padding cropped), and per head::

    entropy    = mean_rows  -sum_j p_j log p_j                     (nats; 0: one source position)
    monotonic  = the DTW path's consistency (lesson.cross_explain.monotonic_scores: ~0 sink or diffuse)

each averaged over the corpus. The other atlas statistics (previous-token, induction, ablation) are the
decoder-only atlas's and do not apply to cross-attention.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...model.encdec import EncoderDecoder
from ..lesson.cross_explain import cross_patterns, monotonic_scores


@dataclass
class CrossAtlas:
    """``entropy``, ``monotonic`` [n_layers, n_heads] averaged over ``n_inputs`` inputs; ``per_input``:
    each input's two [n_layers, n_heads] tensors, in corpus order."""

    entropy: Tensor
    monotonic: Tensor
    n_inputs: int
    per_input: list[tuple[Tensor, Tensor]]

    def ranking(self) -> list[tuple[int, int]]:
        """(layer, head) pairs, the most monotonic first."""
        n_heads = self.monotonic.shape[1]
        return [divmod(int(i), n_heads) for i in self.monotonic.flatten().argsort(descending=True)]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values."""
        return {
            "entropy": self.entropy.tolist(), "monotonic": self.monotonic.tolist(), "n_inputs": self.n_inputs,
            "ranking": [list(p) for p in self.ranking()],
        }  # fmt: skip


def head_entropy(patterns: Tensor) -> Tensor:
    """Mean over rows of each head's entropy (nats): ``patterns`` [L, H, rows, seq_k] -> [L, H]."""
    p = patterns.double()
    return -(p * p.clamp(min=1e-30).log()).sum(-1).mean(-1).float()


def _items(model: EncoderDecoder, corpus: Any) -> list[tuple[Any, str | None]]:
    """(source, target or None) for each corpus item, one line naming the first bad one."""
    if isinstance(corpus, (str, os.PathLike)) or not isinstance(corpus, Sequence) or not corpus:
        raise ValueError(
            "corpus must be a non-empty list of WAV paths (Whisper) or of sentences / (source, target) "
            f"pairs; got {type(corpus).__name__}"
        )
    out: list[tuple[Any, str | None]] = []
    for i, item in enumerate(corpus):
        if model.config.audio and isinstance(item, (str, os.PathLike, Tensor)):
            out.append((item, None))
        elif not model.config.audio and isinstance(item, str):
            out.append((item, None))
        elif not model.config.audio and isinstance(item, (tuple, list)) and len(item) == 2:
            out.append((str(item[0]), str(item[1])))
        else:
            want = "a sentence or a (source, target) pair"
            if model.config.audio:
                want = "a WAV path or 16 kHz samples"
            raise ValueError(f"corpus item {i} must be {want}; got {item!r}"[:300])
    return out


def cross_atlas(model: EncoderDecoder, corpus: Sequence[Any]) -> CrossAtlas:
    """Every cross-attention head's mean entropy and monotonic-alignment score over ``corpus`` (module
    docstring): WAV paths (or 16 kHz samples [n]) for Whisper; sentences or (source, target) pairs for
    T5, BART and Marian (with their tokenizer)."""
    if not isinstance(model, EncoderDecoder):
        raise TypeError(f"model must be a headspace EncoderDecoder; got {type(model).__name__}")
    per = []
    for source, target in _items(model, corpus):
        p = cross_patterns(model, source, target)
        per.append((head_entropy(p.patterns), monotonic_scores(p)))
    return CrossAtlas(
        entropy=torch.stack([e for e, _ in per]).mean(0),
        monotonic=torch.stack([m for _, m in per]).mean(0),
        n_inputs=len(per),
        per_input=per,
    )


__all__ = ["CrossAtlas", "cross_atlas", "head_entropy"]
