"""Files on disk: one atomic writer for every file headspace produces, and one bounded reader.

Writing: a file is written to a temporary file in the same folder, flushed to disk, then moved over the
target with ``os.replace``: a reader sees the old file or the new one, never half of one, and a failed
write (a full disk, a crash) leaves the previous file intact. The temporary file is created with mode
``0o666`` and folders (:func:`make_temp_dir`) with ``0o777``, both filtered by the process umask as
any other tool's files are (``0o644`` / ``0o755`` under the usual umask ``0o022``); ``tempfile.mkstemp``
and ``mkdtemp`` are not used because their owner-only modes (``0o600`` / ``0o700``) would survive the
rename.

Reading untrusted files (:func:`read_regular_file`): only a regular file is opened (``os.stat`` and
``S_ISREG`` before ``open``, so a named pipe cannot block the reader and ``/dev/zero`` cannot fill
memory), with a size cap checked before and while reading. :func:`parse_json` reads JSON with a depth
limit and without the non-standard ``NaN`` / ``Infinity`` constants.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

#: JSON nested deeper than this is refused by :func:`parse_json` (headspace's own files use < 10 levels).
MAX_JSON_DEPTH = 32

_OPEN_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
_OPEN_READ = (
    os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
)


class UnsafeFileError(ValueError):
    """A file that :func:`read_regular_file` will not read: not a regular file, too large, or changed."""


def write_file_synced(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and flush it to disk (a new file gets ``0o666`` filtered by the umask)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (a rename into it) to disk, where the platform allows."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _temp_name(parent: Path, prefix: str, suffix: str) -> Path:
    return parent / f"{prefix}{secrets.token_hex(6)}{suffix}"


def make_temp_dir(parent: str | os.PathLike[str], *, prefix: str, suffix: str = ".tmp") -> Path:
    """Create a new, uniquely named folder ``parent/<prefix><random><suffix>`` (mode 0o777 & ~umask)."""
    parent = Path(parent)
    for _ in range(100):
        path = _temp_name(parent, prefix, suffix)
        try:
            os.mkdir(path, 0o777)
        except FileExistsError:  # pragma: no cover - 48 random bits
            continue
        return path
    raise FileExistsError(
        f"{parent}: could not create a temporary folder {prefix}*{suffix}"
    )  # pragma: no cover


def write_atomic(path: str | os.PathLike[str], data: bytes | str, *, make_parents: bool = False) -> Path:
    """Write one file atomically (temporary file in the same folder, then ``os.replace``); return its path.

    The file gets mode ``0o666`` filtered by the umask, like a file any other tool writes.
    ``make_parents`` creates missing folders; otherwise a missing folder raises ``FileNotFoundError``.
    """
    path = Path(path)
    if make_parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    while True:
        tmp = _temp_name(path.parent, f".{path.name}.", ".tmp")
        try:
            fd = os.open(tmp, _OPEN_NEW, 0o666)  # the kernel applies the umask
        except FileExistsError:  # pragma: no cover - 48 random bits
            continue
        break
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def write_json(path: str | os.PathLike[str], obj: Any, *, indent: int | None = 2) -> Path:
    """Write ``obj`` as JSON atomically (folders created as needed)."""
    return write_atomic(path, json.dumps(obj, indent=indent) + "\n", make_parents=True)


# ---------------------------------------------------------------------------------------------- reading
def file_kind(mode: int) -> str:
    """What a ``st_mode`` describes, in words ("a regular file", "a named pipe (FIFO)", ...)."""
    for test, name in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"  # pragma: no cover


def read_regular_file(path: str | os.PathLike[str], *, max_bytes: int, follow_symlinks: bool = True) -> bytes:
    """The bytes of ``path``, which must be a regular file of at most ``max_bytes`` bytes.

    The file is checked with ``os.stat`` (``os.lstat`` when ``follow_symlinks`` is false, so a symbolic
    link is refused) before it is opened, and again on the open descriptor; it is opened non-blocking and
    read up to ``max_bytes + 1`` bytes. Raises ``FileNotFoundError`` when it does not exist,
    :class:`UnsafeFileError` (a ``ValueError`` whose message starts with the path) for anything that is
    not a regular file (a folder, a FIFO, a device, a symbolic link when not followed), a file larger
    than ``max_bytes`` or one replaced while being read, and ``OSError`` when it cannot be read.
    """
    path = Path(path)
    st = os.stat(path, follow_symlinks=follow_symlinks)
    if not stat.S_ISREG(st.st_mode):
        target = f" (to {os.readlink(path)})" if stat.S_ISLNK(st.st_mode) else ""
        raise UnsafeFileError(f"{path}: {file_kind(st.st_mode)}{target}, not a regular file")
    if st.st_size > max_bytes:
        raise UnsafeFileError(f"{path}: {st.st_size} bytes, more than the {max_bytes} bytes allowed")
    flags = _OPEN_READ | (0 if follow_symlinks else getattr(os, "O_NOFOLLOW", 0))
    fd = os.open(path, flags)
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise UnsafeFileError(f"{path}: replaced while being opened")
        chunks, total = [], 0
        while total <= max_bytes:
            chunk = os.read(fd, min(1 << 24, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    finally:
        os.close(fd)
    if total > max_bytes:
        raise UnsafeFileError(f"{path}: grew past the {max_bytes} bytes allowed while being read")
    return b"".join(chunks)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (a NaN or infinite number)")


def json_depth(value: Any) -> int:
    """How deeply ``value`` (parsed JSON) nests lists and dicts (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def parse_json(data: bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse UTF-8 JSON ``data``; ``ValueError`` for invalid JSON, NaN/Infinity or nesting past ``max_depth``.

    (Python's parser recurses once per level: JSON nested deeper than the interpreter's recursion limit
    raises ``RecursionError`` there, which is turned into the same ``ValueError``.)
    """
    try:
        value = json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)
    except RecursionError:
        raise ValueError(f"nested more than {max_depth} levels deep") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 ({e})") from None
    if json_depth(value) > max_depth:
        raise ValueError(f"nested more than {max_depth} levels deep")
    return value
