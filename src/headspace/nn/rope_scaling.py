"""The rotary scalings that go beyond a fixed rescaling of ``inv_freq``: YaRN, dynamic NTK and LongRoPE.

Each is transformers 5's (``modeling_rope_utils``), operation for operation in float32, so that the
frequencies are bitwise the same. Notation: ``dim`` = rotary_dim, ``n_planes`` = dim // 2, ``base`` the
RoPE base, ``i`` = 0 .. n_planes - 1; ``L`` = ``max_position_embeddings`` of the config.

YaRN (``{"rope_type": "yarn", "factor", "original_max_position_embeddings", ...}``)::

    extrapolation_i = 1 / base ** (2i / dim)       interpolation_i = extrapolation_i / factor
    low, high = correction range of (beta_fast, beta_slow) rotations over original_max_position_embeddings
    ramp_i = clamp((i - low) / (high - low), 0, 1)  (floor / ceil of low / high unless truncate is false)
    inv_freq_i = interpolation_i * ramp_i + extrapolation_i * (1 - ramp_i)
    attention_factor = attention_factor, or mscale(factor, mscale) / mscale(factor, mscale_all_dim) when
        both are set, or mscale(factor) = 0.1 ln(factor) + 1 (1 for factor <= 1)

  cos and sin are multiplied by ``attention_factor``: q and k grow by it on the rotated features, so a
  score's rotated part grows by ``attention_factor ** 2``. A missing ``factor`` is
  ``L / original_max_position_embeddings``.

Dynamic NTK (``{"rope_type": "dynamic", "factor"}``, with ``L``): at sequence length ``n`` (the largest
position of a call plus one, at least ``L``) the base becomes
``base * (factor * n / L - (factor - 1)) ** (dim / (dim - 2))``. As transformers keeps it, the
frequencies are state: they follow the longest sequence seen since they were last reset; a call shorter
than ``L`` after a longer one resets them to the plain frequencies.

LongRoPE (``{"rope_type": "longrope", "short_factor", "long_factor", "original_max_position_embeddings"}``):
``inv_freq_i = 1 / (ext_i * base ** (2i / dim))`` with ``ext`` the ``long_factor`` list when a call's
largest position plus one exceeds ``original_max_position_embeddings``, the ``short_factor`` list
otherwise (the whole call uses one list). ``attention_factor`` (cos and sin multiplied by it) is the
given one, or ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`` (1 for factor <= 1), with
``factor`` = the given one or ``L / original_max_position_embeddings``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


#: The rotary types this module computes (beside positions.py's default, linear and llama3).
EXTENDED_ROPE_TYPES: tuple[str, ...] = ("yarn", "dynamic", "longrope")

# (required keys, optional keys) per type; "max_position_embeddings" is the config's L, which the
# loader passes in the scaling dict (transformers reads it from the config).
_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "yarn": (
        ("original_max_position_embeddings",),
        (
            "factor",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
            "max_position_embeddings",
        ),
    ),
    "dynamic": (("factor", "max_position_embeddings"), ("original_max_position_embeddings",)),
    "longrope": (
        ("short_factor", "long_factor", "original_max_position_embeddings"),
        ("factor", "attention_factor", "max_position_embeddings"),
    ),
}
_INT_KEYS = ("original_max_position_embeddings", "max_position_embeddings")


def _fail(rope_type: str, key: str, expected: str, value: Any) -> ValueError:
    return ValueError(f"scaling (rope_scaling) {rope_type!r}: {key!r} must be {expected}; got {value!r:.80}")


def _checked(rope_type: str, key: str, value: Any, n_planes: int) -> Any:
    """One entry of the scaling dict, checked (None for an optional key left null)."""
    if value is None:
        return None
    if key in _INT_KEYS:
        if not is_int(value) or value <= 0:
            raise _fail(rope_type, key, "a positive int", value)
        return int(value)
    if key == "truncate":
        if not isinstance(value, bool):
            raise _fail(rope_type, key, "a bool", value)
        return value
    if key in ("short_factor", "long_factor"):
        ok = isinstance(value, list) and len(value) == n_planes
        if not ok or not all(is_number(v) and math.isfinite(v) and v > 0 for v in value):
            raise _fail(rope_type, key, f"a list of {n_planes} finite numbers > 0 (rotary_dim // 2)", value)
        return [float(v) for v in value]
    if not is_number(value) or not math.isfinite(value) or value < 0:
        raise _fail(rope_type, key, "a finite number >= 0", value)
    if key == "factor" and value <= 0:
        raise _fail(rope_type, key, "a finite number > 0", value)
    return float(value)


def parse_extended(
    rope_type: str, scaling: dict[str, Any], echo: tuple[str, ...], n_planes: int
) -> dict[str, Any]:
    """The checked parameters of a YaRN / dynamic / LongRoPE ``scaling`` dict; errors name the key.

    ``echo``: keys that may come along unread (``rope_theta``, ``partial_rotary_factor``, checked by the
    caller). A factor that has to be derived (``L / original_max_position_embeddings``) needs
    ``max_position_embeddings``.
    """
    required, optional = _KEYS[rope_type]
    allowed = {"rope_type", "type", *required, *optional, *echo}
    unknown = sorted(str(k) for k in scaling if k not in allowed)
    if unknown:
        raise ValueError(
            f"scaling (rope_scaling) {rope_type!r} takes the keys {['rope_type', *required, *optional]}; "
            f"got unexpected {unknown}"
        )
    missing = [k for k in required if scaling.get(k) is None]
    if missing:
        raise ValueError(
            f"scaling (rope_scaling) {rope_type!r} needs the keys {list(required)}; missing {missing}"
        )
    params = {k: _checked(rope_type, k, scaling.get(k), n_planes) for k in (*required, *optional)}
    if rope_type != "dynamic" and params["factor"] is None:
        if params["max_position_embeddings"] is None:
            raise ValueError(
                f"scaling (rope_scaling) {rope_type!r} has no 'factor': give it, or "
                "'max_position_embeddings' to derive it from"
            )
        params["factor"] = params["max_position_embeddings"] / params["original_max_position_embeddings"]
    return params


def _mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(scale) + 1`` (1 for scale <= 1), transformers' ``yarn_get_mscale``."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn(dim: int, base: float, p: dict[str, Any]) -> tuple[Tensor, float]:
    """(inv_freq [dim // 2] float32, attention_factor) of YaRN (module docstring)."""
    factor = p["factor"]
    attention_factor = p["attention_factor"]
    if attention_factor is None:
        if p["mscale"] and p["mscale_all_dim"]:
            attention_factor = float(_mscale(factor, p["mscale"]) / _mscale(factor, p["mscale_all_dim"]))
        else:
            attention_factor = _mscale(factor)
    beta_fast = p["beta_fast"] or 32
    beta_slow = p["beta_slow"] or 1
    original = p["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p["truncate"] is None or p["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)  # [n_planes]
    extrapolation = 1.0 / pos_freqs  # [n_planes]
    interpolation = 1.0 / (factor * pos_freqs)  # [n_planes]
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)  # [n_planes]
    keep = 1 - ramp.to(dtype=torch.float)  # [n_planes]: the share of the extrapolated frequency
    inv_freq = interpolation * (1 - keep) + extrapolation * keep  # [n_planes]
    return inv_freq, float(attention_factor)


def longrope(dim: int, base: float, p: dict[str, Any], long: bool) -> Tensor:
    """inv_freq [dim // 2] float32 of LongRoPE with the long (``long``) or short factors."""
    ext = torch.tensor(p["long_factor"] if long else p["short_factor"], dtype=torch.float32)  # [n_planes]
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [n_planes]
    return 1.0 / (ext * base**shape)


def longrope_attention_factor(p: dict[str, Any]) -> float:
    """LongRoPE's attention factor (module docstring)."""
    if p["attention_factor"] is not None:
        return float(p["attention_factor"])
    factor = p["factor"]
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(p["original_max_position_embeddings"]))


def dynamic(dim: int, base: float, p: dict[str, Any], seq_len: Tensor | None) -> Tensor:
    """inv_freq [dim // 2] float32 of dynamic NTK at sequence length ``seq_len`` (a 0-D int64 tensor;
    None: the config's ``max_position_embeddings``), transformers' ``_compute_dynamic_ntk_parameters``."""
    factor, limit = p["factor"], p["max_position_embeddings"]
    length: Any = limit
    if seq_len is not None:
        length = torch.maximum(seq_len, torch.tensor(limit, dtype=seq_len.dtype, device=seq_len.device))
    scaled = base * ((factor * length / limit) - (factor - 1)) ** (dim / (dim - 2))  # float or 0-D float32
    steps = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim  # [n_planes]
    if isinstance(scaled, Tensor):
        scaled = scaled.cpu()
    return 1.0 / (scaled**steps)
