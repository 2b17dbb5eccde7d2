"""Rotary position embeddings (RoPE) with every rotation plane and matrix in plain sight.

RoPE (Su et al., 2021) turns each query and key vector by an angle proportional to its position. The
first ``rotary_dim`` features of a head are split into ``rotary_dim // 2`` rotation planes ``(a, b)``; plane
``i`` has the frequency ``w_i = inv_freq[i] = base ** (-2i / rotary_dim)`` (radians per token, before any
``scaling``) and, at integer position ``p``, its pair of features turns by the angle ``p * w_i``::

    [x_a, x_b] -> [x_a cos(p w) - x_b sin(p w),  x_b cos(p w) + x_a sin(p w)]

Features ``rotary_dim .. d_head - 1`` pass through unchanged (partial rotary, ``fraction < 1``).

Rotation matrix and the relative-position identity (row-vector convention, ``x`` is a row):
    ``rotate(x, p) == x @ R(p)``, where ``R(delta)`` (:meth:`Rotary.rotation`) is the [d_head, d_head]
    matrix that is the identity on pass-through features and, on each plane ``(a, b)`` with frequency ``w``::

        R[a, a] = cos(delta w)     R[a, b] = +sin(delta w)
        R[b, a] = -sin(delta w)    R[b, b] = cos(delta w)

    ``R`` is orthogonal, ``R(0) = I``, ``R(s) @ R(t) = R(s + t)`` and ``R(t)^T = R(-t)``, so the score of
    the query at position ``i`` against the key at position ``j`` depends on the positions only through
    ``delta = i - j`` (query position minus key position)::

        score(i, j) = rotate(q, i) @ rotate(k, j)^T = q R(i) R(j)^T k^T = q @ R(i - j) @ k^T

    Plane by plane, the score is a sum of independent 2-D parts plus the pass-through part (see
    :meth:`Rotary.planes`): ``sum over planes (a, b) of [q_a, q_b] R_ab(i - j) [k_a, k_b]^T +
    sum over pass-through f of q_f k_f``.

Pairing conventions (which features form a plane):
    ``interleaved=False`` (rotate-half): planes ``(i, i + rotary_dim // 2)``, as Hugging Face's
        ``rotate_half`` / ``apply_rotary_pos_emb`` (Llama, Mistral, Qwen, ...), GPT-NeoX and llama.cpp's
        "neox" mode.
    ``interleaved=True``: planes ``(2i, 2i + 1)``, as GPT-J, Meta's original complex formulation
        (``x_a + i x_b`` times ``exp(i p w)``) and llama.cpp's "normal" mode.
    The two are the same maths up to a permutation of the rotary features: interleaved feature ``2i``
    is rotate-half feature ``i`` and interleaved ``2i + 1`` is rotate-half ``i + rotary_dim // 2``.

Scaling (transformers' ``rope_scaling`` / ``rope_parameters``), all folded into ``inv_freq``:
    ``None`` or ``{"rope_type": "default"}``: no scaling.
    ``{"rope_type": "linear", "factor": f}``: positions divided by ``f`` (``inv_freq / f``, as transformers).
    ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}``: Llama 3.1's rescaling; wavelengths shorter than
    ``original / high_freq_factor`` keep their frequency, those longer than ``original / low_freq_factor``
    are divided by ``factor``, those between are interpolated smoothly (same float32 operations as
    transformers' ``_compute_llama3_parameters``).
    ``"yarn"``, ``"dynamic"`` (NTK) and ``"longrope"``: :mod:`headspace.nn.rope_scaling` (the formulas).
    YaRN and LongRoPE multiply cos and sin by an ``attention_factor`` (q and k grow by it on the rotated
    features); dynamic NTK and LongRoPE pick their frequencies per call from the call's largest
    position, as transformers' ``dynamic_rope_update`` (dynamic NTK keeps them as state: they follow the
    longest call seen, and reset on a call shorter than the config's length).

YaRN / LongRoPE and ``rotation``: with ``attention_factor`` ``a`` != 1, ``rotate(x, p)`` is ``a`` times
the rotation on the rotated features, so the relative identity holds with ``a ** 2`` folded into the
planes of ``R(delta)``: ``rotate(q, i) @ rotate(k, j)^T = q @ R(i - j) @ k^T`` where ``R`` is
:meth:`Rotary.rotation` (no longer orthogonal; the pass-through block stays the identity).

Numerics: ``inv_freq`` is computed in float32 exactly as transformers does; cos/sin are computed in
float32 (float64 when float64 is asked for) and cast to the requested dtype, so float32 and bfloat16
results match transformers' Llama rotary embedding.

Notation used for tensor shapes:
    batch: batch size; n_heads: heads; seq: sequence length; d_head: per-head width;
    rotary_dim: the rotated features (``int(d_head * fraction)``, even); n_planes: ``rotary_dim // 2``.

    positions:   [seq] or [batch, seq], integer dtype
    x:           [batch, n_heads, seq, d_head]
    cos, sin:    [batch, seq, rotary_dim] ([1, seq, rotary_dim] for positions [seq])
    inv_freq:    [n_planes]
    rotation(d): [d_head, d_head] ([*delta.shape, d_head, d_head] for a tensor delta)
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import Tensor, nn

from . import rope_scaling
from .rope_scaling import EXTENDED_ROPE_TYPES

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", *EXTENDED_ROPE_TYPES)

# The keys each rope_type needs besides "rope_type" itself.
_ROPE_TYPE_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# Keys of transformers' rope_parameters that may come along; accepted when they agree with base / fraction.
_ECHO_KEYS: tuple[str, ...] = ("rope_theta", "partial_rotary_factor")


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_positions(positions: Any) -> None:
    if not isinstance(positions, Tensor):
        raise TypeError(
            f"positions must be an integer tensor [seq] or [batch, seq]; got {type(positions).__name__}"
        )
    if positions.dtype == torch.bool or positions.dtype.is_floating_point or positions.dtype.is_complex:
        raise TypeError(
            f"positions must have an integer dtype (e.g. torch.int64); got {positions.dtype} "
            "(token indices, not scaled positions: put scaling in `scaling`)"
        )
    if positions.dim() not in (1, 2):
        raise ValueError(
            f"positions must be [seq] or [batch, seq]; got {positions.dim()}-D shape {list(positions.shape)}"
        )


def _scaling_number(rope_type: str, key: str, value: Any, *, integer: bool = False) -> float:
    """A finite, positive entry of the scaling dict; errors name the field, what is expected and what came."""
    ok = _is_int(value) if integer else _is_real(value)
    if not ok or not math.isfinite(value) or value <= 0:
        kind = "a positive int" if integer else "a finite number > 0"
        raise ValueError(f"scaling (rope_scaling) {rope_type!r}: {key!r} must be {kind}; got {value!r}")
    return float(value)


def _parse_scaling(
    scaling: Any, base: float, fraction: float, n_planes: int = 0
) -> tuple[str, dict[str, Any]]:
    """Validate ``scaling`` and return (rope_type, its numeric parameters)."""
    if scaling is None:
        return "default", {}
    if not isinstance(scaling, dict):
        raise TypeError(
            "scaling (rope_scaling) must be None or a dict such as {'rope_type': 'linear', 'factor': 2.0}; "
            f"got {type(scaling).__name__}"
        )
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if "rope_type" in scaling and "type" in scaling and scaling["type"] != scaling["rope_type"]:
        raise ValueError(
            f"scaling (rope_scaling) has both 'rope_type'={scaling['rope_type']!r} and "
            f"'type'={scaling['type']!r}; they must agree"
        )
    if rope_type not in SUPPORTED_ROPE_TYPES:
        got = "no 'rope_type' key" if rope_type is None else repr(rope_type)
        raise ValueError(
            f"scaling (rope_scaling) 'rope_type' must be one of {list(SUPPORTED_ROPE_TYPES)}; got {got}"
        )
    for key, ours, name in (("rope_theta", base, "base"), ("partial_rotary_factor", fraction, "fraction")):
        if key in scaling and scaling[key] is not None and scaling[key] != ours:
            raise ValueError(
                f"scaling (rope_scaling) {key!r}={scaling[key]!r} disagrees with {name}={ours!r}; "
                f"pass {name}={scaling[key]!r} or drop {key!r}"
            )
    if rope_type in EXTENDED_ROPE_TYPES:
        return rope_type, rope_scaling.parse_extended(rope_type, scaling, _ECHO_KEYS, n_planes)
    needed = _ROPE_TYPE_KEYS[rope_type]
    allowed = {"rope_type", "type", *needed, *_ECHO_KEYS}
    unknown = sorted(str(k) for k in scaling if k not in allowed)
    if unknown:
        raise ValueError(
            f"scaling (rope_scaling) {rope_type!r} takes the keys {['rope_type', *needed]}; "
            f"got unexpected {unknown}"
        )
    missing = [k for k in needed if k not in scaling]
    if missing:
        raise ValueError(
            f"scaling (rope_scaling) {rope_type!r} needs the keys {list(needed)}; missing {missing}"
        )
    params = {
        key: _scaling_number(rope_type, key, scaling[key], integer=key == "original_max_position_embeddings")
        for key in needed
    }
    if rope_type == "llama3" and not params["high_freq_factor"] > params["low_freq_factor"]:
        raise ValueError(
            "scaling (rope_scaling) 'llama3': 'high_freq_factor' must be greater than 'low_freq_factor'; "
            f"got high_freq_factor={scaling['high_freq_factor']!r}, "
            f"low_freq_factor={scaling['low_freq_factor']!r}"
        )
    return rope_type, params


def _default_inv_freq(rotary_dim: int, base: float) -> Tensor:
    """[rotary_dim // 2] float32, on the CPU: ``1 / base ** (2i / rotary_dim)`` (transformers' operations)."""
    steps = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu")  # [n_planes]
    exponents = steps.float() / rotary_dim  # [n_planes]
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: Tensor, params: dict[str, float]) -> Tensor:
    """Llama 3.1 rescaling, the float32 operations of transformers' ``_compute_llama3_parameters``."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    original = params["original_max_position_embeddings"]
    low_freq_wavelen = original / low  # longer wavelengths: frequency / factor
    high_freq_wavelen = original / high  # shorter wavelengths: frequency kept
    wavelen = 2 * math.pi / inv_freq  # [n_planes]
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class Rotary(nn.Module):
    """Rotary position embeddings for one head width; no parameters, its tables are non-persistent buffers.

    Notation used for tensor shapes:
        batch, n_heads, seq, d_head; rotary_dim = int(d_head * fraction); n_planes = rotary_dim // 2.

    Args:
        d_head: per-head width (positive int).
        base: the RoPE base ("rope_theta"), finite and > 0.
        fraction: share of ``d_head`` that rotates, in (0, 1]; ``int(d_head * fraction)`` must be even and
            >= 2 (transformers' ``partial_rotary_factor``).
        interleaved: pair features ``(2i, 2i + 1)`` (GPT-J / Meta) instead of ``(i, i + rotary_dim // 2)``
            (Hugging Face rotate-half).
        max_seq_len: precompute float32 cos/sin tables for positions ``0 .. max_seq_len - 1``; lookups
            give the same numbers as computing them directly (positions outside the table, or float64
            requests, are computed directly). On an accelerator the range check costs one host sync.
            Under ``torch.compile`` the tables are not read (the range check would break the graph):
            cos/sin are computed directly, inside the graph.
        scaling: None, ``{"rope_type": "default"}``, ``{"rope_type": "linear", "factor": f}`` or
            ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
            "original_max_position_embeddings"}``, or yarn / dynamic / longrope
            (:mod:`headspace.nn.rope_scaling`: their keys, plus the config's ``max_position_embeddings``
            where the type reads it) (transformers' ``rope_scaling``); ``rope_theta`` /
            ``partial_rotary_factor`` may come along if they agree with ``base`` / ``fraction``.

    Attributes:
        rotary_dim: the number of rotated features (the first ones).
        inv_freq: [n_planes] float32 frequencies (radians per token), scaling included; stays float32
            when the module is cast (``.to(torch.bfloat16)`` moves it but does not round it).
        wavelengths: [n_planes] ``2 pi / inv_freq``, in tokens.
    """

    inv_freq: Tensor

    def __init__(
        self,
        d_head: int,
        *,
        base: float = 10000.0,
        fraction: float = 1.0,
        interleaved: bool = False,
        max_seq_len: int | None = None,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if not _is_int(d_head):
            raise TypeError(f"d_head must be a positive int; got {type(d_head).__name__} {d_head!r}")
        if d_head <= 0:
            raise ValueError(f"d_head must be a positive int; got {d_head!r}")
        if not _is_real(base):
            raise TypeError(f"base must be a finite number > 0; got {type(base).__name__} {base!r}")
        if not math.isfinite(base) or base <= 0:
            raise ValueError(f"base must be a finite number > 0; got {base!r}")
        if not _is_real(fraction):
            raise TypeError(f"fraction must be a number in (0, 1]; got {type(fraction).__name__} {fraction}")
        if not (0 < fraction <= 1):
            raise ValueError(f"fraction must be in (0, 1]; got {fraction!r}")
        rotary_dim = int(d_head * fraction)
        if rotary_dim < 2 or rotary_dim % 2 != 0:
            raise ValueError(
                f"rotary_dim = int(d_head * fraction) = int({d_head} * {fraction}) = {rotary_dim} must be "
                f"even and >= 2 (features rotate in pairs); choose d_head / fraction so that it is"
            )
        if not isinstance(interleaved, bool):
            raise TypeError(f"interleaved must be a bool; got {type(interleaved).__name__} {interleaved!r}")
        if max_seq_len is not None and not _is_int(max_seq_len):
            raise TypeError(
                f"max_seq_len must be None or a positive int; got {type(max_seq_len).__name__} {max_seq_len}"
            )
        if max_seq_len is not None and max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be None or a positive int; got {max_seq_len!r}")
        rope_type, params = _parse_scaling(scaling, float(base), float(fraction), rotary_dim // 2)

        self.d_head = d_head
        self.base = float(base)
        self.fraction = float(fraction)
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        self.max_seq_len = max_seq_len
        self.rope_type = rope_type
        self.scaling_params = params

        #: cos and sin are multiplied by it (YaRN, LongRoPE; 1 otherwise): q and k grow by it on the
        #: rotated features.
        self.attention_factor = 1.0
        inv_freq = _default_inv_freq(rotary_dim, self.base)  # [n_planes]
        if rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif rope_type == "yarn":
            inv_freq, self.attention_factor = rope_scaling.yarn(rotary_dim, self.base, params)
        elif rope_type == "longrope":
            inv_freq = rope_scaling.longrope(rotary_dim, self.base, params, long=False)
            self.attention_factor = rope_scaling.longrope_attention_factor(params)
        elif rope_type == "dynamic":
            inv_freq = rope_scaling.dynamic(rotary_dim, self.base, params, None)
        if rope_type in ("dynamic", "longrope"):
            self.max_seq_len = None  # the frequencies depend on the call: no fixed tables
        # dynamic NTK's state (transformers' max_seq_len_cached) and a counter of frequency changes
        self._cached_len = int(params.get("max_position_embeddings") or 0)
        self._freq_version = 0
        self._original_inv_freq = inv_freq
        self._inv_freq_cpu = inv_freq  # the float32 master copy the buffers are rebuilt from
        self.register_buffer("inv_freq", inv_freq.clone(), persistent=False)
        self.register_buffer("_cos_table", None, persistent=False)
        self.register_buffer("_sin_table", None, persistent=False)
        self._build_tables(inv_freq.device)

    # ----------------------------------------------------------------------------------------------- tables

    def _build_tables(self, device: torch.device) -> None:
        """(Re)build ``inv_freq`` and the cos/sin tables, float32, on ``device``."""
        self.inv_freq = self._inv_freq_cpu.to(device)
        if self.max_seq_len is None:
            return
        table_positions = torch.arange(self.max_seq_len, device=device)  # [max_seq_len]
        freqs = table_positions[:, None].to(torch.float32) * self.inv_freq  # [max_seq_len, n_planes]
        self._cos_table = freqs.cos()
        self._sin_table = freqs.sin()

    def _apply(self, fn: Any, recurse: bool = True) -> Rotary:  # fn: Callable[[Tensor], Tensor]
        # Module.to / .cuda / .half run through here: follow the device, but keep the tables float32.
        super()._apply(fn, recurse)
        self._build_tables(self.inv_freq.device)
        return self

    # ---------------------------------------------------------------------------------------- inspection

    @property
    def wavelengths(self) -> Tensor:
        """[n_planes] ``2 pi / inv_freq``: tokens per full turn of each plane."""
        return 2 * math.pi / self.inv_freq

    def planes(self) -> list[tuple[int, int]]:
        """Index pairs ``(a, b)``, in d_head coordinates, of the planes; plane ``i`` turns at ``inv_freq[i]``.

        Rotate-half: ``(i, i + rotary_dim // 2)``; interleaved: ``(2i, 2i + 1)``. Features
        ``rotary_dim .. d_head - 1`` pass through and are in no plane.
        """
        half = self.rotary_dim // 2
        if self.interleaved:
            return [(2 * i, 2 * i + 1) for i in range(half)]
        return [(i, i + half) for i in range(half)]

    def extra_repr(self) -> str:
        return (
            f"d_head={self.d_head}, rotary_dim={self.rotary_dim}, base={self.base}, "
            f"interleaved={self.interleaved}, rope_type={self.rope_type!r}"
        )

    # ------------------------------------------------------------------------------------------- cos / sin

    def cos_sin(
        self, positions: Tensor, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
    ) -> tuple[Tensor, Tensor]:
        """cos and sin of ``positions * inv_freq``, laid out to match the pairing.

        Notation used for tensor shapes:
            batch, seq, rotary_dim.

        Args:
            positions: integer [seq] or [batch, seq] (per-row positions, e.g. left padding or a KV cache).
            dtype: dtype of the result; computed in float32 (float64 when float64 is asked) and cast.
            device: device of the result (default: that of ``positions``).

        Returns:
            (cos, sin), each [batch, seq, rotary_dim] ([1, seq, rotary_dim] for positions [seq]); with
            rotate-half the per-plane values are repeated as ``[c_0 .. c_{n-1}, c_0 .. c_{n-1}]``,
            interleaved as ``[c_0, c_0, c_1, c_1, ...]``.
        """
        _check_positions(positions)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype; got {dtype!r}")
        device = positions.device if device is None else torch.device(device)
        positions = positions.to(device)
        if positions.dim() == 1:
            positions = positions.unsqueeze(0)  # [seq] -> [1, seq]
        compute_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        cos, sin = self._plane_cos_sin(positions, compute_dtype)  # each [batch, seq, n_planes]
        if self.interleaved:
            cos = cos.repeat_interleave(2, dim=-1)  # [batch, seq, n_planes] -> [batch, seq, rotary_dim]
            sin = sin.repeat_interleave(2, dim=-1)  # [batch, seq, n_planes] -> [batch, seq, rotary_dim]
        else:
            cos = torch.cat((cos, cos), dim=-1)  # [batch, seq, rotary_dim]
            sin = torch.cat((sin, sin), dim=-1)  # [batch, seq, rotary_dim]
        if self.attention_factor != 1.0:  # YaRN / LongRoPE: transformers' cos * attention_scaling
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def _follow(self, positions: Tensor) -> None:
        """Dynamic NTK and LongRoPE: set ``inv_freq`` for a call at ``positions`` as transformers'
        ``dynamic_rope_update`` does (nn/rope_scaling.py); nothing for the other types."""
        if self.rope_type not in ("dynamic", "longrope") or positions.numel() == 0:
            return
        seq_len = positions.max().cpu() + 1  # 0-D int64: the call's length
        params = self.scaling_params
        new: Tensor | None = None
        if self.rope_type == "longrope":
            long = bool(seq_len > params["original_max_position_embeddings"])
            new = rope_scaling.longrope(self.rotary_dim, self.base, params, long)
        else:
            original = params["max_position_embeddings"]
            cached = self._cached_len
            if int(seq_len) > cached:  # growth: frequencies for this length
                new = rope_scaling.dynamic(self.rotary_dim, self.base, params, seq_len)
                self._cached_len = int(seq_len)
            if int(seq_len) < original and cached > original:  # back to the plain frequencies
                new = self._original_inv_freq
                self._cached_len = original
        if new is not None and not torch.equal(new, self._inv_freq_cpu):
            self._inv_freq_cpu = new
            self.inv_freq = new.to(self.inv_freq.device)
            self._freq_version += 1

    def _plane_cos_sin(self, positions: Tensor, compute_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [batch, seq] (on the target device) -> cos, sin [batch, seq, n_planes], compute_dtype."""
        self._follow(positions)
        inv_freq = self.inv_freq.to(device=positions.device, dtype=torch.float32)
        table = self._cos_table
        if (
            table is not None
            and not torch.compiler.is_compiling()  # the range check below is data-dependent
            and compute_dtype == torch.float32
            and table.device == positions.device
            and positions.numel() > 0
            and bool(((positions >= 0) & (positions < table.shape[0])).all())
        ):
            return self._cos_table[positions], self._sin_table[positions]  # each [batch, seq, n_planes]
        freqs = positions[..., None].to(compute_dtype) * inv_freq.to(compute_dtype)  # [batch, seq, n_planes]
        return freqs.cos(), freqs.sin()

    # -------------------------------------------------------------------------------------------- rotating

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate queries or keys to their positions; out of place, same shape and dtype as ``x``.

        Notation used for tensor shapes:
            batch, n_heads, seq, d_head, rotary_dim.

        Args:
            x: [batch, n_heads, seq, d_head], floating.
            positions: integer [seq] (shared by every row) or [batch, seq] (per row; batch 1 broadcasts).

        Returns:
            [batch, n_heads, seq, d_head]: ``x * cos + turn(x) * sin`` on the first ``rotary_dim``
            features (transformers' order of operations), the rest unchanged; row by row equal to
            ``x[b, h, s] @ self.rotation(positions[b, s])``.
        """
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a tensor [batch, n_heads, seq, d_head]; got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(
                f"x must be 4-D [batch, n_heads, seq, d_head={self.d_head}]; got shape {list(x.shape)}"
            )
        if not x.dtype.is_floating_point:
            raise TypeError(f"x must be a floating tensor; got {x.dtype}")
        batch, _, seq, d_head = x.shape
        if d_head != self.d_head:
            raise ValueError(f"x's last dim must be d_head={self.d_head}; got shape {list(x.shape)}")
        _check_positions(positions)
        expected = f"[{seq}] or [{batch}, {seq}] (or [1, {seq}])"
        if positions.shape[-1] != seq or (positions.dim() == 2 and positions.shape[0] not in (1, batch)):
            raise ValueError(
                f"positions must be {expected} to match x [batch={batch}, n_heads, seq={seq}, d_head]; "
                f"got {list(positions.shape)}"
            )
        cos, sin = _signed_tables(self, positions, x.dtype, x.device)  # each [batch or 1, 1, seq, rotary_dim]
        return rotate_fused(x, cos, sin, self)  # [batch, n_heads, seq, d_head]

    def rotation(
        self,
        delta: int | Tensor,
        *,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str | None = None,
    ) -> Tensor:
        """The matrix ``R(delta)``: for rows q and k, ``rotate(q, i) @ rotate(k, j)^T == q @ R(i - j) @ k^T``;
        orthogonal, and ``rotate(x, p) == x @ R(p)``, when ``attention_factor`` is 1 (else the planes carry
        ``attention_factor ** 2``). Dynamic NTK and LongRoPE: the frequencies of the last call.

        On each plane ``(a, b)`` with frequency ``w`` (``g = attention_factor ** 2``):
        ``R[a, a] = R[b, b] = g cos(delta w)``, ``R[a, b] = +g sin(delta w)``, ``R[b, a] = -g sin(delta w)``;
        the identity on pass-through features.

        Notation used for tensor shapes:
            d_head; delta_shape: the shape of a tensor ``delta``.

        Args:
            delta: an int or an integer tensor of relative positions (query position minus key position).
            dtype: dtype of the result; angles are computed in float64 from the float32 ``inv_freq``.
            device: device of the result (default: that of a tensor ``delta``, else of ``inv_freq``).

        Returns:
            [d_head, d_head] for an int or 0-D tensor, [*delta_shape, d_head, d_head] otherwise.
        """
        if _is_int(delta):
            delta_t = torch.tensor(delta, dtype=torch.int64)
        elif isinstance(delta, Tensor) and not (
            delta.dtype == torch.bool or delta.dtype.is_floating_point or delta.dtype.is_complex
        ):
            delta_t = delta
        else:
            got = delta.dtype if isinstance(delta, Tensor) else f"{type(delta).__name__} {delta!r}"
            raise TypeError(f"delta must be an int or an integer tensor; got {got}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype; got {dtype!r}")
        if device is None:
            device = delta_t.device if isinstance(delta, Tensor) else self.inv_freq.device
        delta_t = delta_t.to(device)
        inv_freq = self.inv_freq.to(device=device, dtype=torch.float64)  # [n_planes]
        angles = delta_t[..., None].to(torch.float64) * inv_freq  # [*delta_shape, n_planes]
        cos, sin = angles.cos(), angles.sin()
        eye = torch.eye(self.d_head, dtype=torch.float64, device=device)  # [d_head, d_head]
        matrix = eye.repeat(*delta_t.shape, 1, 1)  # [*delta_shape, d_head, d_head]
        a = torch.tensor([p[0] for p in self.planes()], device=device)  # [n_planes]
        b = torch.tensor([p[1] for p in self.planes()], device=device)  # [n_planes]
        gain = self.attention_factor**2  # YaRN / LongRoPE: q and k each scaled by attention_factor
        cos, sin = cos * gain, sin * gain
        matrix[..., a, a] = cos
        matrix[..., b, b] = cos
        matrix[..., a, b] = sin
        matrix[..., b, a] = -sin
        return matrix.to(dtype)


# One (cos, signed sin) pair per Rotary module: the last positions it was asked for. The blocks of a model
# share one Rotary and receive the same positions tensor, so the tables are computed once per forward.
_ROTARY_TABLES: weakref.WeakKeyDictionary[Rotary, tuple[Any, ...]] = weakref.WeakKeyDictionary()


def rotary_tables(
    rotary: Rotary, positions: Tensor, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, Tensor]:
    """cos and signed sin of ``positions``, shaped to broadcast over heads, for :func:`rotate_fused`.

    Returns (cos, sin_signed), each [batch or 1, 1, seq, rotary_dim] in ``dtype``: ``cos`` is
    :meth:`Rotary.cos_sin`'s, and ``sin_signed`` its sin with the sign of the 90-degree turn folded in
    (``-sin`` on each plane's first feature, ``+sin`` on its second), so that
    ``turn(x) * sin == swap(x) * sin_signed`` with ``swap`` a roll (rotate-half) or a pair flip
    (interleaved). The last result is remembered per Rotary module (keyed by the positions tensor
    itself and its version), so layers sharing a Rotary compute it once per forward. Under
    ``torch.compile`` nothing is remembered (the memo reads version counters and inference flags, which
    would break the graph): each layer computes the tables inside the graph.
    """
    if torch.compiler.is_compiling():
        return _signed_tables(rotary, positions, dtype, device)
    inference = positions.is_inference()  # no version counter: such positions are compared by value
    key = (
        None if inference else positions._version,
        dtype,
        device,
        (torch.is_inference_mode_enabled(), rotary._freq_version),
    )
    memo = _ROTARY_TABLES.get(rotary)
    if memo is not None and memo[1:5] == key:
        same = torch.equal(memo[0], positions) if inference else memo[0] is positions
        if same:
            return memo[5], memo[6]
    cos, sin = _signed_tables(rotary, positions, dtype, device)
    _ROTARY_TABLES[rotary] = (positions.clone() if inference else positions, *key, cos, sin)
    return cos, sin


def _signed_tables(
    rotary: Rotary, positions: Tensor, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, Tensor]:
    """:func:`rotary_tables` without the memo: (cos, sin_signed), each [batch or 1, 1, seq, rotary_dim]."""
    cos, sin = rotary.cos_sin(positions, dtype, device)  # (batch or 1, seq, rotary_dim) x 2
    half = rotary.rotary_dim // 2
    sign = torch.ones(rotary.rotary_dim, dtype=dtype, device=device)  # (rotary_dim,)
    if rotary.interleaved:
        sign[0::2] = -1.0  # planes (2i, 2i + 1): the turn is [-x_b, x_a]
    else:
        sign[:half] = -1.0  # planes (i, i + half): the turn is [-x_{i + half}, x_i]
    cos = cos.unsqueeze(1)  # (batch or 1, 1, seq, rotary_dim)
    sin = (sin * sign).unsqueeze(1)  # (batch or 1, 1, seq, rotary_dim)
    return cos, sin


def rotate_fused(x: Tensor, cos: Tensor, sin_signed: Tensor, rotary: Rotary) -> Tensor:
    """Rotate queries or keys ``x`` [batch, heads, seq, d_head] with :func:`rotary_tables`' cos/sin.

    ``x * cos + turn(x) * sin`` on the first ``rotary_dim`` features, in transformers' order of
    operations (so float32 results are bitwise those of ``apply_rotary_pos_emb``), the pass-through
    features copied. Three elementwise ops and a roll; ``x`` may be a strided view (of the fused QKV
    projection). Returns a fresh [batch, heads, seq, d_head] tensor; differentiable.
    """
    rd = rotary.rotary_dim
    d_head = x.shape[-1]
    xr = x if rd == d_head else x[..., :rd]  # (batch, heads, seq, rotary_dim)
    if rotary.interleaved:
        swapped = torch.stack((xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)  # pairs swapped
        # (batch, heads, seq, rotary_dim): [x_b, x_a] per plane, as flip(-1) of the pairs but faster
    else:
        swapped = xr.roll(rd // 2, dims=-1)  # (batch, heads, seq, rotary_dim): [x_b, x_a] per plane
    out = xr * cos  # (batch, heads, seq, rotary_dim)
    out += swapped * sin_signed
    if rd == d_head:
        return out
    return torch.cat((out, x[..., rd:]), dim=-1)  # (batch, heads, seq, d_head)
