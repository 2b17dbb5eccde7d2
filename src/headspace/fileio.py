"""Writing files so that nothing is lost: one atomic writer for every file headspace produces.

A file is written to a temporary file in the same folder, flushed to disk, then moved over the target
with ``os.replace``: a reader sees the old file or the new one, never half of one, and a failed write
(a full disk, a crash) leaves the previous file intact.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_file_synced(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and flush it to disk."""
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


def write_atomic(path: str | os.PathLike[str], data: bytes | str, *, make_parents: bool = False) -> Path:
    """Write one file atomically (temporary file in the same folder, then ``os.replace``); return its path.

    ``make_parents`` creates missing folders; otherwise a missing folder raises ``FileNotFoundError``.
    """
    path = Path(path)
    if make_parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write_file_synced(Path(tmp), raw)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def write_json(path: str | os.PathLike[str], obj: Any, *, indent: int | None = 2) -> Path:
    """Write ``obj`` as JSON atomically (folders created as needed)."""
    return write_atomic(path, json.dumps(obj, indent=indent) + "\n", make_parents=True)
