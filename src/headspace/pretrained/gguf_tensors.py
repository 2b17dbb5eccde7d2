"""A GGUF file's tensor data: read, un-permuted (llama.cpp's W_Q / W_K row order back to Hugging Face's)
and dequantised to float32, a group of tensors of one storage type at a time.

F32, F16, BF16, Q4_0, Q4_1 and Q8_0 are dequantised by vectorised torch code here (bit-identical to the
`gguf` package); the K-quants and Q5_0 / Q5_1 by `gguf.quants.dequantize`. Part of the GGUF reader
(:mod:`.gguf_format`, which re-exports these names).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from .gguf_container import _TENSOR_TYPES, _Header, _TensorInfo
from .gguf_meta import GGUFError


def _f16_column(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 stored at bytes [start, start + 2) of each block, as float32: [n_blocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor, out: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """16 bytes per block -> 32 4-bit values (minus ``offset``) as float32: [n_blocks, 16] -> ``out``.

    ``out``: [n_blocks, 32] float32, returned. The low nibbles are values 0-15 of the block, the high
    nibbles values 16-31.
    """
    if offset:
        out[:, :16] = (qs & 0x0F).view(torch.int8) - offset  # [n_blocks, 16], exact in int8
        out[:, 16:] = (qs >> 4).view(torch.int8) - offset  # [n_blocks, 16]
    else:
        out[:, :16] = qs & 0x0F  # [n_blocks, 16]
        out[:, 16:] = qs >> 4  # [n_blocks, 16]
    return out


# The kernels below round exactly as the gguf package's numpy code does (one float32 multiply, then one
# add for Q4_1; no fused multiply-add), so their results are bit-identical to it. Each writes into
# ``out`` ([n_values] float32, the tensor's final storage or a scratch buffer) in place: no float32
# buffer but ``out`` is allocated.


def _dequant_q8_0(raw: torch.Tensor, out: torch.Tensor) -> None:
    """Q8_0 blocks (fp16 scale d, 32 int8 q) -> q * d. [n_blocks * 34] uint8 -> ``out`` [n_blocks * 32]."""
    blocks = raw.view(-1, 34)  # [n_blocks, 2 + 32]
    d = _f16_column(blocks, 0)  # [n_blocks, 1]
    q = out.view(-1, 32)  # [n_blocks, 32]
    q.copy_(blocks[:, 2:].view(torch.int8))  # int8 -> float32, exact
    q.mul_(d)


def _dequant_q4_0(raw: torch.Tensor, out: torch.Tensor) -> None:
    """Q4_0 blocks (fp16 d, 16 bytes of nibbles) -> d * (q - 8). [n_blocks * 18] uint8 -> [n_blocks * 32]."""
    blocks = raw.view(-1, 18)  # [n_blocks, 2 + 16]
    d = _f16_column(blocks, 0)  # [n_blocks, 1]
    _nibbles(blocks[:, 2:], out.view(-1, 32), offset=8).mul_(d)  # [n_blocks, 32]


def _dequant_q4_1(raw: torch.Tensor, out: torch.Tensor) -> None:
    """Q4_1 blocks (fp16 d, fp16 m, 16 bytes of nibbles) -> d * q + m. [n_blocks * 20] -> [n_blocks * 32]."""
    blocks = raw.view(-1, 20)  # [n_blocks, 2 + 2 + 16]
    d = _f16_column(blocks, 0)  # [n_blocks, 1]
    m = _f16_column(blocks, 2)  # [n_blocks, 1]
    _nibbles(blocks[:, 4:], out.view(-1, 32)).mul_(d).add_(m)  # [n_blocks, 32]


_FAST_DEQUANT: dict[str, Callable[[torch.Tensor, torch.Tensor], object]] = {
    "F32": lambda raw, out: out.copy_(raw.view(torch.float32)),
    "F16": lambda raw, out: out.copy_(raw.view(torch.float16)),
    "BF16": lambda raw, out: out.copy_(raw.view(torch.bfloat16)),
    "Q8_0": _dequant_q8_0,
    "Q4_0": _dequant_q4_0,
    "Q4_1": _dequant_q4_1,
}


def _dequantize(
    raw: np.ndarray, type_name: str, what: str, path: Path, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Whole blocks of one storage type -> their values. ``raw``: [n_bytes] uint8 -> [n_values] float32.

    The values are written into ``out`` ([n_values] float32, contiguous) when given, else into a new
    tensor; either is returned.
    """
    _, block, block_bytes = next(t for t in _TENSOR_TYPES.values() if t[0] == type_name)
    if out is None:
        out = torch.empty(raw.size // block_bytes * block, dtype=torch.float32)  # [n_values]
    if type_name in _FAST_DEQUANT:
        _FAST_DEQUANT[type_name](torch.from_numpy(raw), out)
        return out
    try:
        import gguf.quants
    except ImportError as e:  # pragma: no cover - the K-quants need the gguf package
        raise GGUFError(
            path, f"{what} is {type_name}, which needs the `gguf` package: pip install gguf"
        ) from e
    blocks = raw.reshape(-1, block_bytes)  # [n_blocks, bytes per block]
    qtype = gguf.GGMLQuantizationType[type_name]
    flat = out.numpy()  # [n_values]
    # gguf dequantises a [rows, bytes] array 16 rows at a time: given one block per row, that is ~10
    # numpy calls per 16 blocks. One row of _GGUF_BLOCKS blocks per call instead (the same per-block
    # arithmetic, so the same values).
    for start in range(0, blocks.shape[0], _GGUF_BLOCKS):
        piece = blocks[start : start + _GGUF_BLOCKS]  # [<= _GGUF_BLOCKS, bytes per block]
        try:
            values = gguf.quants.dequantize(piece.reshape(1, -1), qtype)  # [1, blocks x block]
        except Exception as e:  # the gguf package's own errors, whatever they are
            raise GGUFError(path, f"cannot dequantise {what} ({type_name}): {e}") from None
        np.copyto(flat[start * block : (start + piece.shape[0]) * block], values.reshape(-1))  # float32
    return out


def _unpermute_rope_rows(stored: np.ndarray, n_heads: int, out: np.ndarray) -> None:
    """Undo llama.cpp's permutation of W_Q / W_K rows, on the rows' raw bytes (a row is whole blocks).

    ``stored``, ``out``: [n_heads * head_dim, bytes per row] uint8. llama.cpp orders each head's rows as
    (pair j, member k) so that its RoPE rotates adjacent rows (2j, 2j + 1); Hugging Face orders them as
    (half k, index j) and rotates rows j and j + head_dim / 2. Done in numpy: one thread, no torch op.
    """
    rows, row_bytes = stored.shape
    half = rows // n_heads // 2
    pairs = stored.reshape(n_heads, half, 2, row_bytes)  # [heads, head_dim / 2, 2, bytes]: llama.cpp order
    hf_order = pairs.transpose(0, 2, 1, 3)  # [heads, 2, head_dim / 2, bytes]: Hugging Face order
    out.reshape(n_heads, 2, half, row_bytes)[...] = hf_order  # out is contiguous, so this is a view of it


def _read_into(f: BinaryIO, offset: int, out: np.ndarray, name: str, path: Path) -> None:
    """Fill ``out`` ([n_bytes] uint8) from the file at ``offset`` (the caller checked the bytes exist)."""
    view = memoryview(out)
    f.seek(offset)
    got = 0
    while got < out.size:
        n = f.readinto(view[got:])
        if not n:
            raise GGUFError(
                path, f"the file ended while reading tensor {name!r}; it shrank while being read?"
            )
        got += n


# Tensors of one type are dequantised together, up to this many values (32 MiB of float32) at a time:
# a few large torch ops instead of ~10 per tensor. On a busy machine every multi-threaded torch op can
# wait a scheduler slice for its second thread, which made a per-tensor loop many times slower
# (docs/benchmarks.md, "Figures formerly in docstrings").
# A group is dequantised into one scratch buffer and copied out by numpy (single-threaded, no torch op);
# a tensor larger than this is dequantised alone, straight into its own storage.
_CHUNK_VALUES = 1 << 23
# blocks per call of the gguf package's dequantisation (K-quants, Q5_0 / Q5_1): 1M values of 256-blocks
_GGUF_BLOCKS = 4096


def _chunks(infos: list[_TensorInfo]) -> list[list[_TensorInfo]]:
    """``infos`` grouped by storage type, in order, into groups of at most `_CHUNK_VALUES` values.

    A tensor of more values than that is a group of its own.
    """
    chunks: list[list[_TensorInfo]] = []
    open_chunk: dict[str, tuple[list[_TensorInfo], int]] = {}  # type -> (chunk being filled, its values)
    for info in infos:
        values = math.prod(info.shape)
        chunk, filled = open_chunk.get(info.type_name, ([], 0))
        if chunk and filled + values > _CHUNK_VALUES:
            chunk, filled = [], 0
        if not chunk:
            chunks.append(chunk)
        chunk.append(info)
        open_chunk[info.type_name] = (chunk, filled + values)
    return chunks


def _check_destinations(
    given: Any, expected: dict[str, tuple[int, ...]], names: Mapping[str, str], path: Path
) -> dict[str, torch.Tensor]:
    """``read_gguf(into=...)``'s answer, {Hugging Face name: tensor}, as GGUF name -> detached tensor.

    Each must be a float32, contiguous CPU tensor of the expected shape; a wrong one is the caller's
    error (ValueError), not the file's.
    """
    if not isinstance(given, Mapping):
        raise TypeError(f"read_gguf's into() must return a dict {{name: tensor}}; got {type(given).__name__}")
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected.items():
        hf = names[name]
        t = given.get(hf)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{path}: into() gave no tensor for {hf!r}")
        if (
            t.dtype != torch.float32
            or tuple(t.shape) != shape
            or not t.is_contiguous()
            or t.device.type != "cpu"
        ):
            raise ValueError(
                f"{path}: into() gave {hf!r} as {t.dtype} {list(t.shape)} on {t.device}"
                f"{'' if t.is_contiguous() else ' (not contiguous)'}; it must be a contiguous float32 CPU "
                f"tensor of shape {list(shape)}"
            )
        out[name] = t.detach()  # the same storage, writable without autograd
    return out


def _read_tensors(
    f: BinaryIO,
    header: _Header,
    expected: dict[str, tuple[int, ...]],
    heads: dict[str, int],
    path: Path,
    into: dict[str, torch.Tensor] | None = None,
    minus_one: frozenset[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """The tensors named in ``expected`` (GGUF names, in that order), dequantised to float32 ``[*shape]``.

    ``heads`` maps the W_Q / W_K tensors to the number of heads whose rows are un-permuted; the tensors
    in ``minus_one`` (Gemma's norms, stored as 1 + w) have 1 subtracted once dequantised. ``into``
    (GGUF name -> contiguous float32 tensor of the expected shape) receives the values in place, e.g. a
    model's parameters; without it each tensor gets storage of its own (no views into a shared buffer:
    safetensors and ``del`` behave as expected). Beyond those tensors the read holds at most one group's
    raw bytes and one float32 scratch group of `_CHUNK_VALUES` values.
    """
    out = into if into is not None else {n: torch.empty(s, dtype=torch.float32) for n, s in expected.items()}
    infos = {t.name: t for t in header.tensors}
    chunks = _chunks([infos[name] for name in expected])
    grouped = [sum(math.prod(t.shape) for t in c) for c in chunks if len(c) > 1]
    scratch = torch.empty(max(grouped, default=0), dtype=torch.float32)  # [_CHUNK_VALUES at most]
    raw_all = np.empty(max(sum(t.nbytes for t in c) for c in chunks), dtype=np.uint8)  # [bytes of a group]
    stored = np.empty(max((infos[n].nbytes for n in heads), default=0), dtype=np.uint8)  # [bytes of W_Q]
    for chunk in chunks:
        raw = raw_all[: sum(t.nbytes for t in chunk)]  # [bytes of the chunk's tensors]
        at = 0
        for t in chunk:
            dst = raw[at : at + t.nbytes]  # [t.nbytes]
            if t.name in heads:
                rows = t.shape[0]
                _read_into(f, header.data_start + t.offset, stored[: t.nbytes], t.name, path)
                _unpermute_rope_rows(
                    stored[: t.nbytes].reshape(rows, -1), heads[t.name], dst.reshape(rows, -1)
                )
            else:
                _read_into(f, header.data_start + t.offset, dst, t.name, path)
            at += t.nbytes
        what = f"tensor {chunk[0].name!r}" if len(chunk) == 1 else f"tensors {chunk[0].name!r}, ..."
        if len(chunk) == 1:
            _dequantize(raw, chunk[0].type_name, what, path, out=out[chunk[0].name].view(-1))  # [values]
            continue
        values = [math.prod(t.shape) for t in chunk]
        flat = _dequantize(raw, chunk[0].type_name, what, path, out=scratch[: sum(values)]).numpy()
        at = 0
        for t, n in zip(chunk, values):
            np.copyto(out[t.name].numpy().reshape(-1), flat[at : at + n])  # one thread, no torch op
            at += n
    for name in minus_one:
        values = out[name].numpy()
        np.subtract(values, np.float32(1.0), out=values)  # float32, in place: stored (1 + w) -> w
    return {name: out[name] for name in expected}
