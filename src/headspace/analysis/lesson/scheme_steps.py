"""The lesson's positional steps: one titled step per positional scheme, with the explained layer's numbers.

:func:`scheme_steps` asks every function of :data:`SCHEME_STEPS`, in registration order, for its step on
one head of one attention layer; each returns a :class:`SchemeStep` (a title, lines of prose with the
model's numbers, and the same numbers as plain JSON values) or None where its scheme is absent from the
layer. ``headspace explain`` prints them after the rotation step and ``--json`` carries them
(:attr:`~headspace.analysis.lesson.explain.Explanation.scheme_steps`).

Steps registered here, for rotary layers (``attn.rotary``, :class:`headspace.nn.positions.Rotary`):

* ``"partial_rotary"`` (only when ``rotary_dim < d_head``): dims ``0 .. rotary_dim - 1`` rotate, dims
  ``rotary_dim .. d_head - 1`` pass through unchanged (GPT-NeoX 0.25, Phi-2 0.5, Phi-3 0.75, StableLM);
* ``"rotary_pairs"``: which features form a plane: half-split ``(i, i + rotary_dim / 2)`` (Llama,
  rotate-half) or interleaved ``(2i, 2i + 1)`` (GPT-J, Cohere);
* ``"rope_scaling"`` (only when ``rope_type`` is not ``"default"``): a few planes' frequencies before
  scaling, ``w_i = base ** (-2i / rotary_dim)``, and after (the ``inv_freq`` the call used: dynamic NTK
  and LongRoPE pick theirs from the call's length), with YaRN's and LongRoPE's attention factor ``a``
  (cos and sin times ``a``: a score's rotated part grows by ``a ** 2``).

and for ALiBi layers (``attn.spec.alibi_slopes``, :mod:`headspace.nn.alibi`: BLOOM, MPT, Falcon-alibi):

* ``"alibi"``: the head's slope ``m_h`` and, for the explained query ``i`` and its top keys ``j``, the
  bias ``-m_h * (i - j)`` with the scaled score before it (``hook_scores - bias``) and after it (the
  traced ``hook_scores``, the score softmax reads).

A new mechanism adds its step with :func:`register_scheme_step`. Learned sinks (gpt-oss) register
``"sink"`` from :mod:`.sink_steps`, which reads the explained row (:attr:`SchemeContext.pattern`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "SCHEME_STEPS",
    "SchemeContext",
    "SchemeStep",
    "register_scheme_step",
    "scheme_steps",
    "unscaled_frequencies",
]


@dataclass(frozen=True)
class SchemeContext:
    """What a step function may read: the attention layer ``attn`` (a headspace attention module), the
    explained ``head`` (a query head of that layer) and ``seq_len``, the sentence's length in tokens (the
    forward has run: stateful schemes hold the values that call used). Where the caller has them:
    ``index``, the explained query position ``i``, and that query's row for ``head``: ``scores``
    [seq_k] (the traced ``hook_scores[0, head, i]``, float, scaled, ``-inf`` where masked), ``pattern``
    [seq_k] (the weights on the keys) and ``keys`` (the positions ``j`` of its top keys, best first);
    ``values``, the layer's recorded hook values by name (``q``, ``k``, ``v``, ``pattern`` ...; batch
    first, shapes as their hook points); else None / ()."""

    attn: Any
    head: int
    seq_len: int
    index: int | None = None
    scores: torch.Tensor | None = None
    pattern: torch.Tensor | None = None
    keys: tuple[int, ...] = ()
    values: dict[str, torch.Tensor] | None = None


@dataclass
class SchemeStep:
    """One positional step of the lesson: ``scheme`` (its registry name), ``title`` (one line), ``lines``
    (the prose, each line within the terminal's explain width) and ``numbers`` (the step's numbers as
    plain JSON values: ints, floats, strings, lists)."""

    scheme: str
    title: str
    lines: list[str]
    numbers: dict[str, Any] = field(default_factory=dict)


#: A step function: its step for one head of one layer, or None where its scheme is absent.
SchemeStepFn = Callable[[SchemeContext], "SchemeStep | None"]

#: name -> step function, in the order the lesson shows them.
SCHEME_STEPS: dict[str, SchemeStepFn] = {}


def register_scheme_step(name: str, fn: SchemeStepFn) -> SchemeStepFn:
    """Add ``fn`` under ``name`` at the end of :data:`SCHEME_STEPS`; returns ``fn``.

    Raises:
        ValueError: ``name`` is not a non-empty string, or is registered already.
        TypeError: ``fn`` is not callable.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a scheme step's name must be a non-empty string; got {name!r}")
    if name in SCHEME_STEPS:
        raise ValueError(f"the scheme step {name!r} is registered already; registered: {list(SCHEME_STEPS)}")
    if not callable(fn):
        raise TypeError(f"a scheme step must be callable (SchemeContext -> SchemeStep | None); got {fn!r}")
    SCHEME_STEPS[name] = fn
    return fn


def scheme_steps(
    attn: Any,
    head: int,
    seq_len: int,
    *,
    index: int | None = None,
    scores: torch.Tensor | None = None,
    pattern: torch.Tensor | None = None,
    keys: tuple[int, ...] = (),
    values: dict[str, torch.Tensor] | None = None,
) -> list[SchemeStep]:
    """Every registered step that applies to head ``head`` of the layer ``attn``, after a forward of
    ``seq_len`` tokens, in registration order (``index``, ``scores``, ``pattern``, ``keys``,
    ``values``: see :class:`SchemeContext`)."""
    context = SchemeContext(attn, head, seq_len, index, scores, pattern, tuple(keys), values)
    steps = (fn(context) for fn in SCHEME_STEPS.values())
    return [s for s in steps if s is not None]


def unscaled_frequencies(rotary_dim: int, base: float) -> torch.Tensor:
    """[rotary_dim // 2] float32: ``w_i = 1 / base ** (2i / rotary_dim)``, the frequencies before any
    scaling (transformers' float32 operations, as :class:`headspace.nn.positions.Rotary`)."""
    steps = torch.arange(0, rotary_dim, 2, dtype=torch.int64)  # [n_planes]
    return 1.0 / (base ** (steps.float() / rotary_dim))


def _shown_planes(n_planes: int, most: int = 4) -> list[int]:
    """Up to ``most`` plane indices spread from the first (fastest) to the last (slowest)."""
    if n_planes <= most:
        return list(range(n_planes))
    return sorted({round(k * (n_planes - 1) / (most - 1)) for k in range(most)})


def _range(first: int, last: int) -> str:
    return f"dim {first}" if first == last else f"dims {first}..{last}"


def partial_rotary_step(c: SchemeContext) -> SchemeStep | None:
    """Partial rotary: which of the head's dimensions rotate and which pass through (module docstring)."""
    rotary = getattr(c.attn, "rotary", None)
    if rotary is None or rotary.rotary_dim >= rotary.d_head:
        return None
    rd, dh = int(rotary.rotary_dim), int(rotary.d_head)
    return SchemeStep(
        "partial_rotary",
        f"partial rotary: {_range(0, rd - 1)} rotate, the rest pass ({rd} of {dh}, fraction {rd / dh:.4g})",
        [
            f"{_range(0, rd - 1)} of each q and k turn by their positions ({rd // 2} planes);",
            f"{_range(rd, dh - 1)} pass through unchanged: their part of the score, sum over f >= {rd} of",
            "q_f k_f, is the same at every offset i - j (a content term with no position in it)",
        ],
        {"rotary_dim": rd, "d_head": dh, "rotate": [0, rd - 1], "pass": [rd, dh - 1]},
    )


def rotary_pairs_step(c: SchemeContext) -> SchemeStep | None:
    """Which features form each rotation plane: interleaved ``(2i, 2i + 1)`` or half-split."""
    rotary = getattr(c.attn, "rotary", None)
    if rotary is None:
        return None
    planes = [list(p) for p in rotary.planes()]
    half = rotary.rotary_dim // 2
    shown = ", ".join(f"({a}, {b})" for a, b in planes[:3]) + (", ..." if len(planes) > 3 else "")
    if rotary.interleaved:
        kind, rule, like = "interleaved", "(2i, 2i + 1)", "GPT-J, Cohere, llama.cpp's normal mode"
    else:
        kind, rule, like = "half-split", f"(i, i + {half})", "Llama's rotate_half, GPT-NeoX"
    return SchemeStep(
        "rotary_pairs",
        f"rotary pairs: {kind}, plane i is the features {rule}",
        [
            f"planes {shown}, as {like};",
            "plane i turns by the angle position x w_i",
            "the two pairings are the same rotation up to a permutation of the rotated features",
        ],
        {"pairing": kind, "planes": planes},
    )


def _scaling_lines(rotary: Any, c: SchemeContext) -> list[str]:
    """The scaling rule of ``rotary.rope_type`` in words, with its parameters."""
    p, kind = rotary.scaling_params, rotary.rope_type
    if kind == "linear":
        return [f"linear: positions divided by factor {p['factor']:g} (every w_i / {p['factor']:g})"]
    if kind == "llama3":
        m, lo, hi = p["original_max_position_embeddings"], p["low_freq_factor"], p["high_freq_factor"]
        return [
            f"llama3: wavelengths below {m:g}/{hi:g} tokens keep w_i, above {m:g}/{lo:g} are divided by "
            f"{p['factor']:g}, between are interpolated"
        ]
    if kind == "yarn":
        m = p["original_max_position_embeddings"]
        return [
            f"YaRN, factor {p['factor']:g} over {m} positions: fast planes keep w_i, slow ones",
            "w_i / factor, a ramp between",
        ]
    if kind == "longrope":
        m = p["original_max_position_embeddings"]
        which, than = ("long", ">") if c.seq_len > m else ("short", "<=")
        return [f"LongRoPE: w_i / {which}_factor_i, as this call's {c.seq_len} tokens are {than} {m}"]
    if kind == "dynamic":
        seen = getattr(rotary, "_cached_len", c.seq_len)  # the module's state: the longest call seen
        limit = p["max_position_embeddings"]
        return [
            f"dynamic NTK, factor {p['factor']:g}: the base grows past {limit} tokens;",
            f"the frequencies follow the longest call seen ({seen} tokens)",
        ]
    return [f"{kind} scaling"]


def rope_scaling_step(c: SchemeContext) -> SchemeStep | None:
    """Scaled frequencies: a few planes' ``w_i`` before and after scaling, and the attention factor."""
    rotary = getattr(c.attn, "rotary", None)
    if rotary is None or rotary.rope_type == "default":
        return None
    before = unscaled_frequencies(int(rotary.rotary_dim), float(rotary.base))  # [n_planes]
    after = rotary.inv_freq.detach().float().cpu()  # [n_planes]: the frequencies this call used
    planes = _shown_planes(before.numel())
    lines = _scaling_lines(rotary, c)
    lines += [f"plane {i}: w = {float(before[i]):.4g} -> {float(after[i]):.4g} rad/token" for i in planes]
    numbers: dict[str, Any] = {
        "rope_type": rotary.rope_type,
        "planes": planes,
        "before": [float(before[i]) for i in planes],
        "after": [float(after[i]) for i in planes],
        "attention_factor": float(rotary.attention_factor),
    }
    a = float(rotary.attention_factor)
    if a != 1.0:
        lines.append(
            f"attention factor a = {a:.6g}: cos and sin times a, so q and k grow by a on the rotated dims"
        )
        lines.append(f"and their part of every score by a^2 = {a * a:.6g}")
    if rotary.rope_type == "longrope":
        numbers["long"] = c.seq_len > rotary.scaling_params["original_max_position_embeddings"]
    return SchemeStep(
        "rope_scaling", f"{rotary.rope_type} rotary scaling: the scaled frequencies", lines, numbers
    )


register_scheme_step("partial_rotary", partial_rotary_step)
register_scheme_step("rotary_pairs", rotary_pairs_step)
register_scheme_step("rope_scaling", rope_scaling_step)


def alibi_step(c: SchemeContext) -> SchemeStep | None:
    """ALiBi: the head's slope ``m_h`` and, for the explained query ``i`` and each top key ``j``, the bias
    ``-m_h * (i - j)`` with the scaled score before it and after it (``after`` is the traced
    ``hook_scores``, ``before = after + m_h * (i - j)``). Without a query: the bias at offsets 0..3."""
    slopes = getattr(getattr(c.attn, "spec", None), "alibi_slopes", None)
    if slopes is None:
        return None
    m = float(slopes[c.head])
    title = f"ALiBi: bias -m_h x (i - j) added to the score, slope m_h = {m:.6g}"
    lines = [
        f"head {c.head}'s slope m_h = {m:.6g}: every key j loses m_h x (i - j) from its scaled score,",
        "a linear penalty in the distance with no position in q or k (softmax reads the sum)",
    ]
    numbers: dict[str, Any] = {"slope": m}
    finite = c.scores is not None and any(math.isfinite(float(c.scores[j])) for j in c.keys)
    if c.index is None or c.scores is None or not finite:
        deltas = [0, 1, 2, 3]
        lines.append("offsets " + ", ".join(f"{d}: {-m * d:.4g}" for d in deltas))
        numbers.update(delta=deltas, bias=[-m * d for d in deltas])
        return SchemeStep("alibi", title, lines, numbers)
    i = int(c.index)
    keys = [int(j) for j in c.keys if math.isfinite(float(c.scores[j]))]  # masked keys have no score
    after = [float(c.scores[j]) for j in keys]
    bias = [-m * (i - j) + 0.0 for j in keys]  # + 0.0: no -0.0 at delta 0
    before = [a - b for a, b in zip(after, bias)]
    lines.append(f"query {i}'s top keys: score before the bias -> after")
    lines += [f"key {j} (i - j = {i - j}): {s0:.4f} {b:+.4f} -> {s1:.4f}"
              for j, s0, b, s1 in zip(keys, before, bias, after)]  # fmt: skip
    numbers.update(query=i, keys=keys, delta=[i - j for j in keys], bias=bias, before=before, after=after)
    return SchemeStep("alibi", title, lines, numbers)


register_scheme_step("alibi", alibi_step)
