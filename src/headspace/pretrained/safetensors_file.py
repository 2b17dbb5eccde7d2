"""The header of a safetensors file, read and checked without reading the tensors (``safetensors_header``).

A model folder is untrusted input: the file must be a regular file, its 8-byte little-endian header
length at most :data:`MAX_HEADER_BYTES` and inside the file, the header a JSON object whose every tensor
has a known dtype, a shape of ints >= 0 and a byte range inside the data that its shape and dtype fill
exactly, apart from every other tensor's. :mod:`headspace.pretrained.hf` re-exports every name here.
"""

from __future__ import annotations

import itertools
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.checks import is_int
from ..core.fileio import UnsafeFileError, file_kind, parse_json

#: A safetensors header (its JSON) larger than this is refused unread.
MAX_HEADER_BYTES = 100 << 20

# safetensors dtype -> (bytes per element, torch dtype name, floating point)
_DTYPES: dict[str, tuple[int, str, bool]] = {
    "BOOL": (1, "torch.bool", False),
    "U8": (1, "torch.uint8", False),
    "I8": (1, "torch.int8", False),
    "F8_E5M2": (1, "torch.float8_e5m2", True),
    "F8_E4M3": (1, "torch.float8_e4m3fn", True),
    "I16": (2, "torch.int16", False),
    "U16": (2, "torch.uint16", False),
    "F16": (2, "torch.float16", True),
    "BF16": (2, "torch.bfloat16", True),
    "I32": (4, "torch.int32", False),
    "U32": (4, "torch.uint32", False),
    "F32": (4, "torch.float32", True),
    "I64": (8, "torch.int64", False),
    "U64": (8, "torch.uint64", False),
    "F64": (8, "torch.float64", True),
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header: its stored name, dtype code, shape and byte range."""

    name: str
    dtype: str  # safetensors' code: "F32", "BF16", "I64" ...
    shape: tuple[int, ...]
    begin: int  # byte offsets inside the data section (after the header)
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_floating_point(self) -> bool:
        return _DTYPES[self.dtype][2]

    @property
    def dtype_name(self) -> str:
        """The torch dtype's name (``torch.float16``), for messages."""
        return _DTYPES[self.dtype][1]


@dataclass(frozen=True)
class SafetensorsHeader:
    """What a safetensors file holds, from its header alone (:func:`safetensors_header`)."""

    path: Path
    tensors: dict[str, TensorEntry]
    metadata: dict[str, Any]
    file_size: int

    @property
    def n_values(self) -> int:
        """Elements in all tensors together (parameters and buffers)."""
        return sum(e.numel for e in self.tensors.values())


def _read_exactly(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 24))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _stat_weights(path: Path) -> os.stat_result:
    """``os.stat(path)`` (links resolved) of a regular file; FileNotFoundError / UnsafeFileError otherwise."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} (the weights) does not exist") from None
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFileError(f"{path} (the weights) is {file_kind(st.st_mode)}, not a regular file")
    return st


def _header_bytes(path: Path, st: os.stat_result, bad: str) -> bytes:
    """The header's JSON bytes: the length from the first 8 bytes (little-endian), then that many bytes.

    The file opened must be the one ``st`` describes; the length must be at most :data:`MAX_HEADER_BYTES`
    and fit in the ``st.st_size - 8`` bytes after it. ``bad`` begins every ValueError.
    """
    size = st.st_size
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise UnsafeFileError(f"{path} (the weights) was replaced while being opened")
        n = int.from_bytes(_read_exactly(fd, 8), "little")
        if n > MAX_HEADER_BYTES or n > size - 8:
            raise ValueError(
                f"{bad}: its first 8 bytes give a header of {n:,} bytes, but the file holds {size - 8:,} "
                f"bytes after them and a header may hold at most {MAX_HEADER_BYTES:,} (random bytes or "
                "truncated)"
            )
        raw = _read_exactly(fd, n)
    finally:
        os.close(fd)
    if len(raw) != n:
        raise ValueError(f"{bad}: the file ended inside its {n:,}-byte header (truncated while being read)")
    return raw


def _header_json(raw: bytes, bad: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``raw`` parsed -> (the tensors' entries by name, unchecked; ``__metadata__``, or {})."""
    try:
        header = parse_json(raw)
    except ValueError as e:
        raise ValueError(f"{bad}: its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{bad}: its header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise ValueError(f"{bad}: its __metadata__ is a {type(metadata).__name__}, not an object")
    return header, metadata


def _entry(path: Path, name: str, info: Any, data_bytes: int) -> TensorEntry:
    """One header entry checked: known dtype, shape of ints >= 0, byte range inside the data that fits it."""
    where = f"{path}: tensor {name!r} in the safetensors header"
    if not isinstance(info, dict):
        raise ValueError(f"{where} is a {type(info).__name__}, not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise ValueError(f"{where} has dtype {dtype!r:.40}; known dtypes: {sorted(_DTYPES)}")
    if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
        raise ValueError(f"{where} has shape {shape!r:.80}; expected a list of ints >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o) for o in offsets)) or not (
        0 <= offsets[0] <= offsets[1]
    ):
        raise ValueError(
            f"{where} has data_offsets {offsets!r:.80}; expected [begin, end], 0 <= begin <= end"
        )
    if offsets[1] > data_bytes:
        raise ValueError(
            f"{where} claims bytes [{offsets[0]:,}, {offsets[1]:,}) of the data, but the file holds "
            f"{data_bytes:,} bytes of data (truncated or forged)"
        )
    entry = TensorEntry(name, dtype, tuple(shape), offsets[0], offsets[1])
    if offsets[1] - offsets[0] != entry.numel * _DTYPES[dtype][0]:
        raise ValueError(
            f"{where}: shape {shape} of {dtype} needs {entry.numel * _DTYPES[dtype][0]:,} bytes, but its "
            f"data_offsets span {offsets[1] - offsets[0]:,}"
        )
    return entry


def safetensors_header(path: str | Path) -> SafetensorsHeader:
    """The checked header of a safetensors file; nothing else of the file is read.

    The file must be a regular file (links resolved). Its first 8 bytes (little-endian) give the header's
    length, which must be at most :data:`MAX_HEADER_BYTES` and fit in the file; the header is a JSON
    object ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`` whose every
    dtype is known, every shape a list of ints >= 0, and every byte range inside the file's data, as long
    as its shape and dtype need, and apart from the others. ``ValueError`` naming the file otherwise
    (empty, truncated, random bytes ...).
    """
    path = Path(path)
    st = _stat_weights(path)
    size = st.st_size
    bad = f"{path} is not a valid safetensors file"
    if size < 8:
        raise ValueError(f"{bad}: {size} bytes, too short for the 8-byte header length (empty or truncated)")
    raw = _header_bytes(path, st, bad)
    header, metadata = _header_json(raw, bad)
    data_bytes = size - 8 - len(raw)
    entries = {name: _entry(path, name, info, data_bytes) for name, info in header.items()}
    spans = sorted((e.begin, e.end, e.name) for e in entries.values() if e.end > e.begin)
    for (_, end_a, a), (begin_b, _, b) in itertools.pairwise(spans):
        if begin_b < end_a:
            raise ValueError(f"{bad}: the data of tensors {a!r} and {b!r} overlap")
    return SafetensorsHeader(path, entries, metadata, size)
