"""Rotary heads by frequency plane: how much of each head's score each RoPE plane carries.

With rotary positions (RoPE) the score of a query on a key is a sum of independent parts, one per
rotation plane ``(a, b)`` of the head's features plus the unrotated ("pass-through") features of partial
rotary::

    q_rot . k_rot = sum over planes (a, b) of (q_rot[a] k_rot[a] + q_rot[b] k_rot[b])
                    + sum over pass-through features f of q[f] k[f]

with ``q_rot``, ``k_rot`` the rotated query and key (``hook_rot_q``, ``hook_rot_k``); plane ``i``'s part is
``[q_a, q_b] R_i(delta) [k_a, k_b]^T`` in the unrotated values, a function of the offset ``delta`` that
turns once every ``wavelength_i = 2 pi / inv_freq_i`` tokens. :func:`plane_scores` returns the parts
(they add up exactly to the unscaled score, ``hook_scores / scale``); :func:`rotary_planes` measures, per
layer and head over inputs, each plane's share of the score's magnitude::

    share[l, h, i] = sum over pairs of |part_i| / sum over pairs of sum over parts of |part|

summed over every (real query, key it may attend to) pair, and sums the shares of the *slow* planes
(wavelength longer than ``split`` tokens, by default the longest input: they turn less than once across
it, so they compare content almost regardless of distance) with the pass-through share, against the
*fast* planes (which vary with the offset: position). A head is labelled ``"content"`` when the slow
share reaches ``threshold``, ``"position"`` when the fast share does, else ``"mixed"``. This is the
reading of Barbero et al. (2024, "Round and round we go! What makes rotary positional encodings
useful?"): high frequencies serve positional heads, low frequencies semantic ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ...attention.functional import repeat_kv
from ...nn.positions import Rotary
from .._common import Batch, JsonResult, eval_mode, make_batches, pad_heads
from ..trace.trace import as_module, attention_layers, trace

LABELS = ("content", "position", "mixed")
DEFAULT_THRESHOLD = 0.6


@dataclass
class RotaryPlanes(JsonResult):
    """Each rotary head's score magnitude split by frequency plane.

    Shapes (NaN where a pruned layer has fewer heads): ``share`` [n_layers, n_heads, n_planes], the share
    of the score's magnitude on each plane; ``passthrough`` [n_layers, n_heads], the share on the
    unrotated features (0 with full rotary); ``share.sum(-1) + passthrough == 1``. ``wavelengths``
    [n_layers, n_planes]: tokens per turn of each plane (``2 pi / inv_freq``, scaling included).
    ``slow`` [n_layers, n_heads]: the share on planes with wavelength > ``split`` tokens plus the
    pass-through share; ``fast = 1 - slow``. ``labels[layer][head]``: "content" (slow >= threshold),
    "position" (fast >= threshold) or "mixed". ``n_pairs``: (query, key) pairs summed over per head.
    """

    kind = "rotary_planes"

    share: Tensor
    passthrough: Tensor
    wavelengths: Tensor
    slow: Tensor
    fast: Tensor
    labels: list[list[str]]
    split: float
    threshold: float
    n_pairs: int

    def heads_with(self, label: str) -> list[tuple[int, int]]:
        """The (layer, head) pairs labelled ``label`` (one of "content", "position", "mixed")."""
        if label not in LABELS:
            raise ValueError(f"label must be one of {LABELS}; got {label!r}")
        return [(i, h) for i, row in enumerate(self.labels) for h, lab in enumerate(row) if lab == label]


def _check_qk(q: Any, k: Any, rotary: Any) -> None:
    if not isinstance(rotary, Rotary):
        raise TypeError(f"rotary must be a headspace.positions.Rotary; got {type(rotary).__name__}")
    for name, t, heads in (("q", q, "n_heads"), ("k", k, "n_kv_heads")):
        if not isinstance(t, Tensor) or t.dim() != 4 or t.shape[-1] != rotary.d_head:
            got = list(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(
                f"{name} must be [batch, seq, {heads}, d_head={rotary.d_head}] (rotated); got {got}"
            )
    if q.shape[0] != k.shape[0] or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"q [batch, seq_q, n_heads, d_head] and k [batch, seq_k, n_kv_heads, d_head] need the same batch "
            f"and n_kv_heads dividing n_heads; got q {list(q.shape)}, k {list(k.shape)}"
        )


def plane_scores(q: Tensor, k: Tensor, rotary: Rotary) -> Tensor:
    """The parts of the unscaled scores, one per rotation plane, plus the pass-through part.

    Notation used for tensor shapes:
        batch, seq_q, seq_k, n_heads, n_kv_heads, d_head; n_planes = rotary.rotary_dim // 2.

    Args:
        q: rotated queries [batch, seq_q, n_heads, d_head] (``hook_rot_q``).
        k: rotated keys [batch, seq_k, n_kv_heads, d_head] (``hook_rot_k``).
        rotary: the layer's :class:`~headspace.positions.Rotary` (its ``planes()`` say which features pair).

    Returns:
        [batch, n_heads, seq_q, seq_k, n_planes + 1]: part ``i < n_planes`` is plane ``i``'s
        ``q_a k_a + q_b k_b``, the last the pass-through features' ``q_f k_f`` (0 with full rotary). They sum
        over the last axis to ``q k^T``, the score before the ``1 / sqrt(d_head)`` scale.
    """
    _check_qk(q, k, rotary)
    qh = q.transpose(1, 2)  # (batch, n_heads, seq_q, d_head)
    kh = repeat_kv(k.transpose(1, 2), q.shape[2])  # (batch, n_heads, seq_k, d_head)
    parts = [qh[..., [a, b]] @ kh[..., [a, b]].transpose(-2, -1) for a, b in rotary.planes()]
    rd = rotary.rotary_dim
    parts.append(qh[..., rd:] @ kh[..., rd:].transpose(-2, -1))  # (batch, n_heads, seq_q, seq_k); 0 if full
    return torch.stack(parts, dim=-1)  # (batch, n_heads, seq_q, seq_k, n_planes + 1)


def _abs_sums(q: Tensor, k: Tensor, rotary: Rotary, allowed: Tensor) -> Tensor:
    """Sums over allowed pairs of |part|, one part at a time -> [n_heads, n_planes + 1] float64."""
    qh = q.transpose(1, 2).double()  # (batch, n_heads, seq_q, d_head)
    kh = repeat_kv(k.transpose(1, 2), q.shape[2]).double()  # (batch, n_heads, seq_k, d_head)
    w = allowed.double()  # (batch, n_heads, seq_q, seq_k)
    rd = rotary.rotary_dim
    sums = []
    for cols in [[a, b] for a, b in rotary.planes()] + [list(range(rd, rotary.d_head))]:
        part = qh[..., cols] @ kh[..., cols].transpose(-2, -1)  # (batch, n_heads, seq_q, seq_k)
        sums.append((part.abs() * w).sum(dim=(0, 2, 3)))  # (n_heads,)
    return torch.stack(sums, dim=-1)  # (n_heads, n_planes + 1)


def _batches(model: Any, inputs: Any, key_padding: Tensor | None, batch_size: int) -> list[Batch]:
    """make_batches, except that texts for a decoder wrapper are right-padded with its tokenize_padded."""
    texts = [inputs] if isinstance(inputs, str) else inputs
    pad = getattr(model, "tokenize_padded", None)
    if (
        pad is not None
        and not hasattr(model, "max_length")  # encoders: make_batches truncates as encode() does
        and isinstance(texts, Sequence)
        and texts
        and all(isinstance(s, str) for s in texts)
    ):
        if key_padding is not None:
            raise ValueError("key_padding is derived from the texts; pass it only with a tensor input")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int; got {batch_size!r}")
        out = []
        for start in range(0, len(texts), batch_size):
            tokens, kp = pad(list(texts[start : start + batch_size]))  # (b, seq) x 2
            out.append(Batch((tokens,), kp, tokens))
        return out
    return make_batches(model, inputs, key_padding, batch_size)


def rotary_planes(
    model: Any,
    inputs: Any,
    *,
    key_padding: Tensor | None = None,
    batch_size: int = 8,
    split: float | None = None,
    threshold: float = DEFAULT_THRESHOLD,
) -> RotaryPlanes:
    """Per layer and head, the share of the score's magnitude on each rotary plane, over ``inputs``.

    See the module docstring for the definitions. Every attention layer must have rotary positions.

    Args:
        model: a rotary :class:`~headspace.Decoder` / :class:`~headspace.Encoder`, a pretrained wrapper
            (``headspace.load_llama(folder)``) or a bare rotary attention layer.
        inputs: texts (with a wrapper), token ids [batch, seq], or activations [batch, seq, d_model] for a
            bare layer; see :func:`headspace.analysis._common.make_batches`.
        key_padding: bool [batch, seq], True for real tokens, with a tensor input.
        batch_size: texts per forward pass.
        split: the wavelength (tokens) between fast and slow planes (None: the longest real input).
        threshold: the slow (fast) share from which a head is labelled "content" ("position"), in (0.5, 1].

    Returns:
        :class:`RotaryPlanes`.
    """
    _check_settings(threshold, split)
    module = as_module(model)
    layers = _rotary_layers(module)
    batches = _batches(model, inputs, key_padding, batch_size)

    def hook(path: str, short: str) -> str:
        return f"{path}.hook_{short}" if path else f"hook_{short}"

    names = [hook(p, s) for p, _ in layers for s in ("rot_q", "rot_k", "scores")]
    sums = [torch.zeros(a.n_heads, a.rotary.rotary_dim // 2 + 1, dtype=torch.float64) for _, a in layers]
    n_pairs, longest = 0, 0
    with eval_mode(module):
        for batch in batches:
            with trace(module, names=names) as t:
                batch.run(module)
            real = batch.real  # (batch, seq)
            longest = max(longest, int(real.sum(dim=1).max()))
            for i, (path, attn) in enumerate(layers):
                scores = t[hook(path, "scores")]  # (batch, n_heads, seq_q, seq_k)
                # the pairs the layer may attend (finite score) from a real query
                allowed = torch.isfinite(scores) & real.to(scores.device)[:, None, :, None]
                q, k = t[hook(path, "rot_q")], t[hook(path, "rot_k")]
                sums[i] += _abs_sums(q, k, attn.rotary, allowed).cpu()
                if i == 0:
                    n_pairs += int(allowed[:, 0].sum())
    return _planes(layers, sums, float(longest if split is None else split), float(threshold), n_pairs)


def _check_settings(threshold: Any, split: Any) -> None:
    """``rotary_planes``' ``threshold`` in (0.5, 1] and ``split`` None or positive, else ValueError."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.5 < threshold <= 1:
        raise ValueError(f"threshold must be a number in (0.5, 1]; got {threshold!r}")
    if split is not None and (
        isinstance(split, bool) or not isinstance(split, (int, float)) or not split > 0
    ):
        raise ValueError(f"split must be None or a positive number of tokens; got {split!r}")


def _rotary_layers(module: nn.Module) -> list[tuple[str, Any]]:
    """The attention layers of ``module``, each checked rotary, all of one ``rotary_dim``."""
    layers = attention_layers(module)
    if not layers:
        raise ValueError(f"model has no MultiHeadAttention layer; got {type(module).__name__}")
    plain = [path or "<the layer>" for path, attn in layers if attn.rotary is None]
    if plain:
        raise ValueError(
            f"rotary_planes needs rotary positions in every attention layer; {len(plain)} have none: "
            f"{plain[:4]}"
        )
    widths = sorted({a.rotary.rotary_dim for _, a in layers})
    if len(widths) > 1:
        raise ValueError(f"rotary_planes needs one rotary_dim in every layer; got {widths}")
    return layers


def _planes(
    layers: list[tuple[str, Any]], sums: list[Tensor], split: float, threshold: float, n_pairs: int
) -> RotaryPlanes:
    """:class:`RotaryPlanes` from each layer's summed magnitudes per plane ``sums`` [n_heads, n_planes + 1]
    (the last column: the dimensions rotary leaves alone)."""
    shares, passthrough, slow, waves = [], [], [], []
    for (_, attn), s in zip(layers, sums):
        total = s.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)  # (n_heads, 1)
        frac = s / total  # (n_heads, n_planes + 1)
        wl = attn.rotary.wavelengths.detach().double().cpu()  # (n_planes,)
        shares.append(frac[:, :-1])
        passthrough.append(frac[:, -1])
        slow.append(frac[:, :-1][:, wl > split].sum(dim=-1) + frac[:, -1])
        waves.append(wl)
    slow_t = pad_heads(slow)  # (n_layers, n_heads)
    labels = []
    for row in slow:
        labels.append(
            [
                "content" if v >= threshold else "position" if 1 - v >= threshold else "mixed"
                for v in row.tolist()
            ]
        )
    return RotaryPlanes(
        share=pad_heads(shares),  # (n_layers, n_heads, n_planes)
        wavelengths=torch.stack(waves),  # (n_layers, n_planes)
        passthrough=pad_heads(passthrough),
        slow=slow_t,
        fast=1 - slow_t,
        labels=labels,
        split=split,
        threshold=threshold,
        n_pairs=n_pairs,
    )


__all__ = ["LABELS", "RotaryPlanes", "plane_scores", "rotary_planes"]
