"""The GGUF container: a regular file (or parts read whole, SHA-256 checked) whose header, metadata and
tensor table are parsed without trusting them.

Every count and length in the header is checked against the file's size before anything is allocated;
every tensor's storage type must be supported and its data must lie inside the file, aligned, apart
from every other tensor's. Part of the GGUF reader (:mod:`.gguf_format`, which re-exports these names).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from .gguf_meta import GGUFError

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # v1 (2023) counted with 32-bit integers; llama.cpp no longer reads it either
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 3  # arrays of arrays of arrays of scalars, at most: real files use one level

# metadata value types -> struct format of one scalar (8 = string and 9 = array are variable-length)
_SCALAR_FORMATS: dict[int, str] = {
    0: "B",  # uint8
    1: "b",  # int8
    2: "H",  # uint16
    3: "h",  # int16
    4: "I",  # uint32
    5: "i",  # int32
    6: "f",  # float32
    7: "?",  # bool
    10: "Q",  # uint64
    11: "q",  # int64
    12: "d",  # float64
}
_STRING, _ARRAY = 8, 9
# numeric arrays are read as numpy arrays of these (little-endian) types
_ARRAY_DTYPES: dict[int, str] = {
    0: "u1",
    1: "i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "u1",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_MAX_TABLE = 1 << 20  # metadata entries or tensors (10,000 Llama layers hold 90,003 tensors)
_MAX_ARRAY_ITEMS = 1 << 23  # strings or arrays in one metadata array (vocabularies reach ~260k)

# ggml storage type id -> (name, elements per block, bytes per block). Only these are read; a tensor of
# any other type (IQ*, TQ*, MXFP4, ...) is refused with its name and type.
_TENSOR_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    30: ("BF16", 1, 2),
}
SUPPORTED_TENSOR_TYPES: tuple[str, ...] = tuple(name for name, _, _ in _TENSOR_TYPES.values())
# names of the types this reader knows of but refuses, for a clearer message than a bare id
_KNOWN_UNSUPPORTED_TYPES: dict[int, str] = {
    9: "Q8_1",
    15: "Q8_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    20: "IQ4_NL",
    21: "IQ3_S",
    22: "IQ2_S",
    23: "IQ4_XS",
    24: "I8",
    25: "I16",
    26: "I32",
    27: "I64",
    28: "F64",
    29: "IQ1_M",
    34: "TQ1_0",
    35: "TQ2_0",
    39: "MXFP4",
    40: "NVFP4",
    41: "Q1_0",
}
# the fewest bytes per weight any supported type spends (Q2_K: 84 bytes / 256 weights)
_MIN_BYTES_PER_WEIGHT = min(size / block for _, block, size in _TENSOR_TYPES.values())

_HEADER_CHUNK = 1 << 20  # the header is read in growing chunks, starting with 1 MiB


@dataclass(frozen=True)
class _TensorInfo:
    """One row of the tensor table. ``shape`` is in PyTorch order (ggml's reversed)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # from the start of the data section
    nbytes: int  # 0 until the type has been checked

    @property
    def type_name(self) -> str:
        return _type_name(self.ggml_type)


@dataclass(frozen=True)
class _Header:
    version: int
    metadata: dict[str, Any]
    tensors: list[_TensorInfo]
    data_start: int
    file_size: int


def _type_name(ggml_type: int) -> str:
    if ggml_type in _TENSOR_TYPES:
        return _TENSOR_TYPES[ggml_type][0]
    return _KNOWN_UNSUPPORTED_TYPES.get(ggml_type, f"unknown type id {ggml_type}")


_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class _HeaderReader:
    """Sequential little-endian reads from the start of a file, buffered in growing chunks.

    Every read first checks that the bytes exist in the file, so a length or count in a hostile header
    can never make this allocate more than the file holds.
    """

    def __init__(self, f: BinaryIO, size: int, path: Path) -> None:
        self._f = f
        self._size = size
        self._path = path
        self._buf = bytearray()
        self.pos = 0

    def fail(self, problem: str) -> GGUFError:
        return GGUFError(self._path, problem)

    def remaining(self) -> int:
        return self._size - self.pos

    def need(self, n: int, what: str) -> None:
        """Make ``n`` bytes from ``pos`` available in the buffer, or raise: the file is truncated."""
        end = self.pos + n
        if end <= len(self._buf):
            return
        if end > self._size:
            raise self.fail(
                f"truncated: {what} at byte {self.pos} needs {n} bytes but the file has {self._size} bytes"
            )
        target = min(self._size, max(end, 2 * len(self._buf), _HEADER_CHUNK))
        while len(self._buf) < target:
            chunk = self._f.read(target - len(self._buf))
            if not chunk:
                raise self.fail(f"the file ended at byte {len(self._buf)} while reading {what}; it shrank?")
            self._buf += chunk

    def scalar(self, fmt: str, what: str) -> Any:
        s = struct.Struct("<" + fmt)
        self.need(s.size, what)
        (value,) = s.unpack_from(self._buf, self.pos)
        self.pos += s.size
        return value

    def u32(self, what: str) -> int:
        self.need(4, what)
        (value,) = _U32.unpack_from(self._buf, self.pos)
        self.pos += 4
        return value

    def u64(self, what: str) -> int:
        self.need(8, what)
        (value,) = _U64.unpack_from(self._buf, self.pos)
        self.pos += 8
        return value

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        if n > self.remaining():
            raise self.fail(f"{what} claims {n} bytes at byte {self.pos}, past the end of the file")
        self.need(n, what)
        raw = self._buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 ({e})") from None

    def strings(self, count: int, what: str) -> list[str]:
        """``count`` strings in a row: the vocabulary and merges, so the loop is kept tight."""
        out: list[str] = []
        buf = self._buf  # grows in place, so this reference stays valid
        pos = self.pos
        unpack = _U64.unpack_from
        for i in range(count):
            if pos + 8 > len(buf):
                self.pos = pos
                self.need(8, f"{what}[{i}]")
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > len(buf):
                if n > self._size - pos:
                    raise self.fail(f"{what}[{i}] claims {n} bytes at byte {pos}, past the end of the file")
                self.pos = pos
                self.need(n, f"{what}[{i}]")
            try:
                out.append(buf[pos : pos + n].decode("utf-8"))
            except UnicodeDecodeError as e:
                raise self.fail(f"{what}[{i}] is not valid UTF-8 ({e})") from None
            pos += n
        self.pos = pos
        return out

    def value(self, value_type: int, what: str, depth: int = 0) -> Any:
        """One metadata value of ``value_type``."""
        if value_type in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[value_type], what)
        if value_type == _STRING:
            return self.string(what)
        if value_type != _ARRAY:
            raise self.fail(f"{what} has unknown metadata value type {value_type}")
        if depth >= _MAX_NESTING:
            raise self.fail(f"{what} nests arrays more than {_MAX_NESTING} deep")
        element_type = self.u32(f"the element type of {what}")
        count = self.u64(f"the length of {what}")
        if element_type in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[element_type]
            width = struct.calcsize(fmt)
            if count * width > self.remaining():
                raise self.fail(
                    f"{what} claims {count} elements of {width} bytes at byte {self.pos}, "
                    "past the end of the file"
                )
            self.need(count * width, what)
            # numpy, not a list: a list would spend ~36 bytes of memory per byte of a hostile array
            view = np.frombuffer(self._buf, dtype=_ARRAY_DTYPES[element_type], count=count, offset=self.pos)
            values = view.copy()  # [count]; the copy releases the buffer, which must stay growable
            del view
            self.pos += count * width
            return values != 0 if element_type == 7 else values
        # a string is at least its 8-byte length, an array its 12-byte type and count
        if element_type == _STRING:
            min_width = 8
        elif element_type == _ARRAY:
            min_width = 12
        else:
            raise self.fail(f"{what} is an array of unknown metadata value type {element_type}")
        if count * min_width > self.remaining():
            raise self.fail(f"{what} claims {count} elements at byte {self.pos}, past the end of the file")
        if count > _MAX_ARRAY_ITEMS:
            raise self.fail(f"{what} has {count} elements; more than {_MAX_ARRAY_ITEMS} is not a model's")
        if element_type == _STRING:
            return self.strings(count, what)
        return [self.value(_ARRAY, f"{what}[{i}]", depth + 1) for i in range(count)]


def _parse_header(f: BinaryIO, size: int, path: Path) -> _Header:
    """The metadata and tensor table, with every length checked against the file's ``size``."""
    r = _HeaderReader(f, size, path)
    if size < 4:
        raise r.fail(f"not a GGUF file: it has {size} bytes, fewer than the 4-byte magic")
    r.need(4, "the magic")
    magic = bytes(r._buf[:4])
    if magic != _MAGIC:
        raise r.fail(f"not a GGUF file: it starts with {magic!r}, not {_MAGIC!r}")
    r.pos = 4
    version = r.u32("the version")
    if version not in _VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        hint = " (it looks big-endian, which is not supported)" if swapped in _VERSIONS else ""
        raise r.fail(f"GGUF version {version}{hint}; this reader handles versions {_VERSIONS}")
    tensor_count = r.u64("the tensor count")
    kv_count = r.u64("the metadata count")
    # a key/value pair takes at least 8 (key length) + 4 (type) + 1 bytes; a tensor row 8 + 4 + 8 + 4 + 8
    if kv_count * 13 > r.remaining():
        raise r.fail(f"the header claims {kv_count} metadata entries, more than the file could hold")
    if tensor_count * 32 > r.remaining():
        raise r.fail(f"the header claims {tensor_count} tensors, more than the file could hold")
    if max(kv_count, tensor_count) > _MAX_TABLE:
        raise r.fail(
            f"the header claims {kv_count} metadata entries and {tensor_count} tensors; at most "
            f"{_MAX_TABLE} of each are read"
        )

    metadata: dict[str, Any] = {}
    for i in range(kv_count):
        key = r.string(f"metadata key #{i}")
        if key in metadata:
            raise r.fail(f"metadata key {key!r} appears twice")
        value_type = r.u32(f"the type of metadata {key!r}")
        metadata[key] = r.value(value_type, f"metadata {key!r}")

    tensors: list[_TensorInfo] = []
    seen: set[str] = set()
    for i in range(tensor_count):
        name = r.string(f"the name of tensor #{i}")
        if name in seen:
            raise r.fail(f"tensor {name!r} appears twice in the tensor table")
        seen.add(name)
        n_dims = r.u32(f"the number of dimensions of tensor {name!r}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise r.fail(f"tensor {name!r} has {n_dims} dimensions; ggml allows 1 to {_MAX_DIMS}")
        dims = [r.u64(f"dimension {d} of tensor {name!r}") for d in range(n_dims)]
        if any(d == 0 for d in dims):
            raise r.fail(f"tensor {name!r} has an empty dimension: ggml shape {dims}")
        ggml_type = r.u32(f"the type of tensor {name!r}")
        offset = r.u64(f"the data offset of tensor {name!r}")
        # ggml order is fastest-moving first: reversed, it is PyTorch's row-major shape
        tensors.append(_TensorInfo(name, tuple(reversed(dims)), ggml_type, offset, 0))

    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1:
        raise r.fail(f"general.alignment is {alignment!r}, not a positive integer")
    if alignment & (alignment - 1) or alignment > 1 << 16:
        raise r.fail(f"general.alignment is {alignment}, not a power of two up to 65536")
    data_start = -(-r.pos // alignment) * alignment  # the tensor table, padded to the alignment
    if data_start > size:
        raise r.fail(f"truncated: the tensor data should start at byte {data_start}, past the end ({size})")

    checked = [_check_tensor_extent(t, data_start, alignment, size, path) for t in tensors]
    _check_no_overlap(checked, path)
    return _Header(version, metadata, checked, data_start, size)


def _check_tensor_extent(
    t: _TensorInfo, data_start: int, alignment: int, size: int, path: Path
) -> _TensorInfo:
    """``t`` with its byte count, once its type is supported and its data lies inside the file."""
    if t.ggml_type not in _TENSOR_TYPES:
        raise GGUFError(
            path,
            f"tensor {t.name!r} is stored as {_type_name(t.ggml_type)}, which this reader does not support; "
            f"supported types: {', '.join(SUPPORTED_TENSOR_TYPES)}",
        )
    type_name, block, block_bytes = _TENSOR_TYPES[t.ggml_type]
    if t.shape[-1] % block:
        raise GGUFError(
            path,
            f"tensor {t.name!r} ({type_name}) has rows of {t.shape[-1]} values, not a multiple of its "
            f"block size {block}",
        )
    nbytes = math.prod(t.shape) // block * block_bytes
    if t.offset % alignment:
        raise GGUFError(
            path, f"tensor {t.name!r} starts at data offset {t.offset}, not a multiple of {alignment}"
        )
    start = data_start + t.offset
    if start + nbytes > size:
        raise GGUFError(
            path,
            f"tensor {t.name!r} ({type_name}, shape {list(t.shape)}) needs bytes {start} to {start + nbytes} "
            f"but the file ends at byte {size} (truncated or corrupt)",
        )
    return _TensorInfo(t.name, t.shape, t.ggml_type, t.offset, nbytes)


def _check_no_overlap(tensors: list[_TensorInfo], path: Path) -> None:
    """No two tensors share bytes: so the dequantised total is bounded by a multiple of the file size."""
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors)
    for (_, end, name), (start, _, next_name) in itertools.pairwise(spans):
        if start < end:
            raise GGUFError(path, f"tensors {name!r} and {next_name!r} overlap in the file")


def _open_regular(path: Path) -> tuple[BinaryIO, int]:
    """Open ``path`` for reading if it is a regular file: (file, size). FIFOs, devices, dirs are refused."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise GGUFError(path, f"cannot read: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = (
            "a directory"
            if stat.S_ISDIR(st.st_mode)
            else "a FIFO"
            if stat.S_ISFIFO(st.st_mode)
            else "a device"
            if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
            else "a socket"
            if stat.S_ISSOCK(st.st_mode)
            else "not a regular file"
        )
        raise GGUFError(path, f"not a regular file ({kind}); a GGUF model must be a regular file")
    # O_NONBLOCK: should the path have been swapped for a FIFO since the stat, opening does not hang
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise GGUFError(path, f"cannot open: {e.strerror or e}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise GGUFError(path, "not a regular file (it changed while being opened)")
    return os.fdopen(fd, "rb", buffering=0), st.st_size


def _checked_digest(sha256: str | None) -> str | None:
    """``sha256`` as 64 lower-case hex digits (None stays None); anything else is a ValueError."""
    if sha256 is None:
        return None
    if (
        not isinstance(sha256, str)
        or len(sha256) != 64
        or any(c not in "0123456789abcdefABCDEF" for c in sha256)
    ):
        raise ValueError(f"sha256 must be 64 hexadecimal digits; got {sha256!r:.80}")
    return sha256.lower()


class _MemoryFile:
    """The bytes of a file held in memory, read as `_parse_header` and `_read_into` read a file."""

    def __init__(self, data: bytearray) -> None:
        self._data = memoryview(data)
        self._pos = 0

    def seek(self, offset: int) -> int:
        self._pos = offset
        return offset

    def read(self, n: int) -> bytes:
        out = bytes(self._data[self._pos : self._pos + n])
        self._pos += len(out)
        return out

    def readinto(self, buf: memoryview) -> int:
        chunk = self._data[self._pos : self._pos + len(buf)]
        buf[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)

    def __enter__(self) -> _MemoryFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._data.release()


def _read_whole(parts: list[Path], digest: str | None) -> tuple[Any, int]:
    """The parts' bytes, concatenated in one buffer, as a file object, and their total size; with
    ``digest``, the SHA-256 of those bytes is checked first (a `GGUFError` naming both digests)."""
    opened = [_open_regular(p) for p in parts]  # every part a regular file, before anything is read
    size = sum(n for _, n in opened)
    data = bytearray(size)
    view, at = memoryview(data), 0
    h = hashlib.sha256()
    try:
        for (f, n), p in zip(opened, parts):
            with f:
                got = 0
                while got < n:
                    k = f.readinto(view[at + got : at + n])
                    if not k:
                        raise GGUFError(
                            p, f"the file ended after {got} of its {n} bytes; it shrank while being read?"
                        )
                    got += k
                if f.read(1):
                    raise GGUFError(p, f"the file grew past its {n} bytes while being read")
            h.update(view[at : at + n])
            at += n
    finally:
        view.release()
    if digest is not None and h.hexdigest() != digest:
        shown = parts[0] if len(parts) == 1 else f"{parts[0]} (+{len(parts) - 1} parts)"
        raise GGUFError(
            shown, f"SHA-256 is {h.hexdigest()}, but {digest} was expected: the file is not the one recorded"
        )
    return _MemoryFile(data), size
