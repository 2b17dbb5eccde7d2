"""Exact, compact storage of weight matrices that sit on a 4-bit grid (quantised checkpoints).

A model loaded from a Q4_1 GGUF file (SmolLM2's packaged weights) holds float32 weights that are,
block by block, ``lo + step * code`` with ``code`` in 0..15: 32 consecutive weights of a row of
the checkpoint's matrix share one ``lo`` and one ``step``. Stored as float32 such a W_O is 32 bits a
weight; stored as its codes it is 4 bits plus a ``lo`` and a ``step`` per block of 32: 5 bits a weight
when every ``lo`` and ``step`` is a float16 number (as a GGUF block's are) and is stored so, else 6. The page
rebuilds every float32 bit for bit as ``fl32(fl32(step * code) + lo)``, the float32 operations that
:func:`encode_grid` checks. A matrix that is not exactly on such a grid is not encoded
(:func:`encode_grid` returns ``None``) and the caller stores it as plain floats.

Layout of W_O [H, d_head, d_model]: the checkpoint's ``o_proj`` matrix is W_O transposed,
[d_model, H * d_head], and its blocks run along the H * d_head axis, so the codes are stored in that
order (``"layout": "transposed"``).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import torch
from torch import Tensor

#: Weights per block (as in GGUF's Q4_1 blocks).
BLOCK = 32
#: Codes per block: 4 bits.
LEVELS = 16


def _b64(arr: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(arr).tobytes()).decode("ascii")


def _exact_in_float16(x: np.ndarray) -> bool:
    """Whether every float32 in ``x`` is a float16 number (so float16 storage loses nothing)."""
    with np.errstate(over="ignore"):
        return bool(np.array_equal(x.astype(np.float16).astype(np.float32), x))


def encode_grid(w_o: Tensor) -> dict[str, Any] | None:
    """W_O [H, d_head, d_model] as 4-bit codes with a float32 ``lo`` and ``step`` per block of 32, or
    ``None`` when the float32 values are not exactly ``fl32(fl32(step * code) + lo)`` on every block.

    Returns ``{"dtype": "grid4", "shape", "layout": "transposed", "block": 32, "lo", "step", "codes"}``:
    ``lo`` and ``step`` base64 of little-endian ``scale_dtype`` (float16 when exact, else float32)
    [d_model * blocks_per_row], ``codes`` base64 of
    bytes holding two codes each (element 2k in the low nibble, 2k+1 in the high one), element order
    that of W_O transposed [d_model, H * d_head].
    """
    if w_o.dim() != 3:
        return None
    n_heads, d_head, d_model = w_o.shape
    width = n_heads * d_head
    if width % BLOCK:
        return None
    w = w_o.detach().cpu().float().permute(2, 0, 1).reshape(d_model, width)  # (d_model, H * dh)
    blocks = np.ascontiguousarray(w.numpy()).reshape(d_model * (width // BLOCK), BLOCK)  # (n_blocks, 32)
    if not np.isfinite(blocks).all():
        return None
    lo = blocks.min(axis=1)  # (n_blocks,)
    step = ((blocks.max(axis=1) - lo) / np.float32(LEVELS - 1)).astype(np.float32)  # (n_blocks,)
    safe = np.where(step == 0, np.float32(1), step)
    codes = np.rint((blocks - lo[:, None]) / safe[:, None]).clip(0, LEVELS - 1).astype(np.uint8)  # (n, 32)
    rebuilt = (step[:, None] * codes.astype(np.float32)).astype(np.float32) + lo[:, None]  # (n, 32) float32
    if rebuilt.dtype != np.float32 or not np.array_equal(rebuilt.view(np.uint32), blocks.view(np.uint32)):
        return None
    scale = "<f2" if _exact_in_float16(lo) and _exact_in_float16(step) else "<f4"
    flat = codes.reshape(-1)  # (d_model * H * dh,), an even count (a multiple of 32)
    packed = (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8)
    return {
        "dtype": "grid4",
        "shape": [n_heads, d_head, d_model],
        "layout": "transposed",
        "block": BLOCK,
        "scale_dtype": {"<f2": "float16", "<f4": "float32"}[scale],
        "lo": _b64(lo.astype(scale)),
        "step": _b64(step.astype(scale)),
        "codes": _b64(packed),
    }


def decode_grid(a: dict[str, Any]) -> np.ndarray:
    """Inverse of :func:`encode_grid`: W_O [H, d_head, d_model] as float32, bit for bit."""
    n_heads, d_head, d_model = (int(x) for x in a["shape"])
    scale = {"float16": "<f2", "float32": "<f4"}[a["scale_dtype"]]
    lo = np.frombuffer(base64.b64decode(a["lo"]), dtype=scale).astype(np.float32)  # (n_blocks,)
    step = np.frombuffer(base64.b64decode(a["step"]), dtype=scale).astype(np.float32)  # (n_blocks,)
    packed = np.frombuffer(base64.b64decode(a["codes"]), dtype=np.uint8)  # (n / 2,)
    codes = np.empty(packed.size * 2, dtype=np.float32)
    codes[0::2], codes[1::2] = packed & 15, packed >> 4
    codes = codes.reshape(-1, int(a["block"]))  # (n_blocks, 32)
    w = (step[:, None] * codes).astype(np.float32) + lo[:, None]  # (n_blocks, 32) float32
    w = w.reshape(d_model, n_heads, d_head)  # (d_model, H, dh): the transposed layout
    return np.ascontiguousarray(torch.from_numpy(w).permute(1, 2, 0).numpy())  # (H, dh, d_model)
