"""A reader for CTranslate2 ``model.bin`` files (binary format version 6), as untrusted input.

The layout (little-endian; written by CTranslate2's ``ModelSpec._serialize``)::

    u32 version (6)       string spec name ("WhisperSpec")      u32 revision      u32 n_variables
    n_variables x { string name; u8 ndim; ndim x u32 dim; u8 dtype; u32 n_bytes; n_bytes of data }
    u32 n_aliases
    n_aliases x { string alias; string target }

where ``string`` is a u16 length L (counting a closing NUL byte) followed by L bytes, the last one NUL,
and ``dtype`` indexes (float32, int8, int16, int32, float16, bfloat16). A scalar has ndim 0 and one
element. Nothing may follow the aliases.

Every field is checked before it is used: the version, string lengths and encodings, the variable and
alias counts, names (``[A-Za-z0-9_]`` parts joined by ``/``, unique), ndim, dims, dtype, the byte count
(which must equal the product of the dims times the dtype's size) and that each record lies inside the
file. A violation raises :class:`CT2Error` whose one-line message names the file and the field.
Nothing is executed or unpickled; the whole file is read into memory (its parts concatenated in order).
"""

from __future__ import annotations

import math
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

#: The only binary version read (CTranslate2 >= 3 writes 6).
VERSION = 6
#: The dtype ids of the format, in order.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.int8, torch.int16, torch.int32, torch.float16, torch.bfloat16,
)  # fmt: skip
DTYPE_NAMES = ("float32", "int8", "int16", "int32", "float16", "bfloat16")
MAX_VARIABLES = 100_000
MAX_NDIM = 8
MAX_DIM = 1 << 31
_NAME = re.compile(r"[A-Za-z0-9_]+(/[A-Za-z0-9_]+)*")


class CT2Error(ValueError):
    """A CTranslate2 model file that cannot be read: malformed, truncated or not the expected model.

    ``str(error)`` is ``"<path>: <problem>"``; the two parts are also kept as ``path`` and ``problem``.
    """

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


@dataclass(frozen=True)
class CT2Model:
    """The contents of a ``model.bin``: spec name, revision, variables by name, aliases -> targets."""

    spec: str
    revision: int
    variables: dict[str, Tensor] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)


class _Cursor:
    """Reads checked fields from ``data``, raising :class:`CT2Error` naming ``path`` and the field."""

    def __init__(self, data: bytes | bytearray, path: Path) -> None:
        self.data = memoryview(data)
        self.pos = 0
        self.path = path

    def fail(self, problem: str) -> CT2Error:
        return CT2Error(self.path, problem)

    def take(self, n: int, what: str) -> memoryview:
        if n > len(self.data) - self.pos:
            raise self.fail(
                f"{what} needs {n} bytes at offset {self.pos}, but only {len(self.data) - self.pos} remain "
                "(truncated file)"
            )
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def uint(self, fmt: str, what: str) -> int:
        return int(struct.unpack("<" + fmt, self.take(struct.calcsize(fmt), what))[0])

    def string(self, what: str) -> str:
        n = self.uint("H", f"the length of {what}")
        if n < 1:
            raise self.fail(f"{what} has length 0; expected at least 1 (its closing NUL byte)")
        raw = bytes(self.take(n, what))
        if raw[-1] != 0:
            raise self.fail(f"{what} does not end with a NUL byte")
        try:
            return raw[:-1].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None

    def name(self, what: str) -> str:
        name = self.string(what)
        if not _NAME.fullmatch(name):
            raise self.fail(f"{what} {name[:80]!r} is not a variable name ([A-Za-z0-9_] parts joined by '/')")
        return name


def _variable(c: _Cursor, index: int, n: int) -> tuple[str, Tensor]:
    """One variable record: (name, tensor), every field checked (module docstring)."""
    name = c.name(f"the name of variable {index} of {n}")
    ndim = c.uint("B", f"the ndim of {name!r}")
    if ndim > MAX_NDIM:
        raise c.fail(f"variable {name!r} has ndim {ndim}; expected at most {MAX_NDIM}")
    shape = tuple(c.uint("I", f"dim {d} of {name!r}") for d in range(ndim))
    if any(not 0 < d < MAX_DIM for d in shape):
        raise c.fail(f"variable {name!r} has shape {list(shape)}; every dim must be in [1, {MAX_DIM})")
    code = c.uint("B", f"the dtype of {name!r}")
    if code >= len(DTYPES):
        raise c.fail(f"variable {name!r} has dtype id {code}; expected 0..{len(DTYPES) - 1} {DTYPE_NAMES}")
    dtype = DTYPES[code]
    n_bytes = c.uint("I", f"the byte count of {name!r}")
    want = math.prod(shape) * dtype.itemsize
    if n_bytes != want:
        raise c.fail(
            f"variable {name!r} declares {n_bytes} bytes; its shape {list(shape)} of {DTYPE_NAMES[code]} "
            f"needs {want}"
        )
    raw = bytearray(c.take(n_bytes, f"the data of {name!r}"))  # a copy: aligned, writable
    return name, torch.frombuffer(raw, dtype=dtype).reshape(shape)  # (n_bytes,) -> shape


def parse_ctranslate2(data: bytes | bytearray, path: str | os.PathLike[str] = "model.bin") -> CT2Model:
    """A :class:`CT2Model` from the bytes of a ``model.bin`` (module docstring); ``path`` names it in
    errors."""
    c = _Cursor(data, Path(path))
    version = c.uint("I", "the format version")
    if version != VERSION:
        raise c.fail(f"format version {version}; expected {VERSION} (a CTranslate2 model.bin)")
    spec = c.name("the spec name")
    revision = c.uint("I", "the spec revision")
    n = c.uint("I", "the variable count")
    if not 0 < n <= MAX_VARIABLES:
        raise c.fail(f"variable count {n}; expected 1..{MAX_VARIABLES}")
    variables: dict[str, Tensor] = {}
    for i in range(n):
        name, value = _variable(c, i, n)
        if name in variables:
            raise c.fail(f"variable {name!r} appears twice")
        variables[name] = value
    n_aliases = c.uint("I", "the alias count")
    if n_aliases > MAX_VARIABLES:
        raise c.fail(f"alias count {n_aliases}; expected at most {MAX_VARIABLES}")
    aliases: dict[str, str] = {}
    for i in range(n_aliases):
        alias = c.name(f"alias {i} of {n_aliases}")
        target = c.name(f"the target of alias {alias!r}")
        if alias in variables or alias in aliases:
            raise c.fail(f"alias {alias!r} repeats a name already defined")
        if target not in variables:
            raise c.fail(f"alias {alias!r} points to {target!r}, which is not a variable")
        aliases[alias] = target
    if c.pos != len(c.data):
        raise c.fail(f"{len(c.data) - c.pos} unexpected bytes after the aliases (offset {c.pos})")
    return CT2Model(spec=spec, revision=revision, variables=variables, aliases=aliases)


def read_ctranslate2(parts: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> CT2Model:
    """A ``model.bin`` file, or its parts concatenated in the order given, read and checked.

    Raises :class:`CT2Error` (one line, naming the first part) for a missing, non-regular or malformed file.
    """
    paths = [Path(parts)] if isinstance(parts, (str, os.PathLike)) else [Path(p) for p in parts]
    if not paths:
        raise ValueError("read_ctranslate2 needs a file or a non-empty list of parts; got []")
    data = bytearray()
    for p in paths:
        if not p.is_file():
            raise CT2Error(p, "is not a regular file (a CTranslate2 model.bin or one of its parts expected)")
        data += p.read_bytes()
    return parse_ctranslate2(data, paths[0] if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1} parts)")


__all__ = ["VERSION", "CT2Error", "CT2Model", "parse_ctranslate2", "read_ctranslate2"]
