"""What the commands write: strict JSON on stdout (NaN/Inf become null), and checks of output folders.

:func:`check_writable_folder` runs before a command does its work, so that an output folder that cannot
be written (``/proc/x``, ``/dev/null/x``, a read-only disk) is one line with exit code 2, not a traceback
after minutes of work.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from pathlib import Path
from typing import Any

import click

from ..core.errors import UsageError


def json_out(data: Any) -> None:
    click.echo(json.dumps(data, allow_nan=False, default=lambda o: None))


def clean(x: Any) -> Any:
    """Replace NaN/Inf by None, recursively, for strict JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    return x


def check_writable_folder(
    path: str | os.PathLike[str], option: str = "--out", value: str | os.PathLike[str] | None = None
) -> Path:
    """Check that files can be written into the folder ``path``, before the command does its work.

    Every command treats its output folder alike: one that does not exist is created, with its parents
    (the command makes it when it writes, :func:`output_folder`), if the nearest existing folder on the
    way to ``path`` takes a new entry: a probe folder is made in it and removed at once, so nothing is
    left behind. Raises :class:`UsageError` naming the option and its ``value`` (default ``path``), the
    folder and the operating system's reason.
    """
    path = Path(path)
    given = f"{option} {path if value is None else value}"
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if existing == path and os.path.lexists(path) and not path.is_dir():
        raise UsageError(f"{given}: {str(path)!r} is a file, not a folder")
    probe = existing / f".headspace-write-test-{secrets.token_hex(4)}"
    try:
        os.mkdir(probe)
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise UsageError(f"{given}: cannot write in the folder {str(existing)!r} ({reason})") from None
    try:
        os.rmdir(probe)
    except OSError:  # pragma: no cover - we just made it
        pass
    return path


def output_folder(path: str | os.PathLike[str]) -> Path:
    """The checked output folder ``path`` (:func:`check_writable_folder`), created (with its parents) if it
    is new."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def more_note(total: int, shown: int, where: str = "") -> str:
    """What a cut list leaves out: ``" (190 more in circuit.json)"`` (``where`` = ``"in circuit.json"``),
    or ``""`` when nothing is cut."""
    if total <= shown:
        return ""
    return f" ({total - shown} more{f' {where}' if where else ''})"
