"""The one path of the command line's errors: a user's mistake becomes one line and exit code 2.

The library refuses bad input by raising ``ValueError`` (and its subclasses: ``CheckpointError``,
``UnsafeFileError``, ``GGUFError``, ``UnicodeDecodeError``, ...), ``TypeError``, ``LookupError``,
``OSError`` (a file that cannot be read or written) or ``ImportError`` (a model package not installed):
:data:`USER_ERRORS`. :func:`reported` turns any of them into a :class:`~headspace.errors.UsageError`
(``error: <message on one line>`` on stderr, exit code 2, no traceback). The command group runs every
command inside it (:class:`headspace.cli.HeadspaceGroup`), so a command catches nothing itself; a command
that wants its option named in the message wraps that step in ``reported("--result")``.

``HEADSPACE_TRACEBACK=1`` in the environment lets the original exception through, with its traceback
(for reporting a bug that surfaces as one of these types).

The inputs every command reads are checked here too, in the same words: :func:`check_input` (a missing
file or folder) and :func:`check_index` (a layer or head out of range).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..core.errors import UsageError

#: The exception types the library raises for bad input; each becomes one line with exit code 2.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, LookupError, OSError, ImportError)


def one_line(e: BaseException) -> str:
    """An error's message on one line (a multi-line mismatch report joined with '; ').

    An ``OSError`` reads ``<file>: <the system's reason>`` (the reason alone without a file); a
    ``KeyError`` its key's text without the quotes ``str(KeyError)`` adds."""
    if isinstance(e, OSError) and e.strerror:
        text = e.strerror if e.filename is None else f"{os.fsdecode(e.filename)}: {e.strerror}"
    elif isinstance(e, KeyError) and len(e.args) == 1 and isinstance(e.args[0], str):
        text = e.args[0]
    else:
        text = str(e)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return "; ".join(lines) if lines else type(e).__name__


def as_usage_error(e: BaseException, prefix: str = "", *, in_brackets: bool = False) -> UsageError:
    """The :class:`UsageError` of a library error: its one-line message after ``prefix: `` (if any), or
    ``in_brackets`` after the prefix (``--port 80: cannot listen on 127.0.0.1:80 (Permission denied)``)."""
    message = one_line(e)
    if not prefix:
        return UsageError(message)
    return UsageError(f"{prefix} ({message})" if in_brackets else f"{prefix}: {message}")


def _traceback_wanted() -> bool:
    return os.environ.get("HEADSPACE_TRACEBACK", "") not in ("", "0")


@contextmanager
def reported(prefix: str = "", *, in_brackets: bool = False) -> Iterator[None]:
    """Inside, an error of :data:`USER_ERRORS` is raised again as a one-line :class:`UsageError`.

    ``prefix`` (an option's name, e.g. ``"--result"``) starts the message, the error's own text after a
    colon or (``in_brackets``) in brackets. A broken pipe (the reader of
    stdout went away, ``headspace heads | head``) is left to click, which exits quietly; so is everything
    under ``HEADSPACE_TRACEBACK=1``.
    """
    try:
        yield
    except USER_ERRORS as e:
        if isinstance(e, BrokenPipeError) or getattr(e, "errno", None) == errno.EPIPE or _traceback_wanted():
            raise
        raise as_usage_error(e, prefix, in_brackets=in_brackets) from None


#: What each kind of input must be, in the message of :func:`check_input`.
_EXPECTED = {"file": "a regular file", "folder": "a folder", "any": "a file or a folder"}
#: What is missing, in the message of :func:`check_input`.
_MISSING = {"file": "no such file", "folder": "no such folder", "any": "no such file or folder"}


def check_input(path: str | os.PathLike[str], option: str, noun: str, kind: str = "file") -> Path:
    """``path`` (the value of ``option``, a ``noun`` such as "sentences file") must exist as ``kind``
    (``"file"``, ``"folder"`` or ``"any"``); else one line, the same for every command: ``cannot read
    sentences file x.txt (--sentences): no such file; it must be a regular file``. Returns the path."""
    p = Path(path)
    expected = _EXPECTED[kind]
    found = None
    if not os.path.lexists(p):
        found = _MISSING[kind]
    elif kind == "folder" and not p.is_dir():
        found = "not a folder"
    elif kind == "file" and p.is_dir():
        found = "a folder"
    if found is not None:
        raise UsageError(f"cannot read {noun} {path} ({option}): {found}; it must be {expected}")
    return p


def check_index(name: str, value: int | None, n: int, *, from_end: bool = False) -> None:
    """``value`` (a ``--layer`` or ``--head``, when given) must lie in ``0..n-1`` (``from_end``: also
    ``-n..-1``, counted from the end); else one line, the same for every command: ``layer 99 is out of
    range: valid layers are 0..29``."""
    low = -n if from_end else 0
    if value is not None and not low <= value < n:
        also = f" (or {-n}..-1 from the end)" if from_end else ""
        raise UsageError(f"{name} {value} is out of range: valid {name}s are 0..{n - 1}{also}")


def read_input_file(path: str | os.PathLike[str], option: str, noun: str, max_bytes: int) -> bytes:
    """The bytes of the input file ``path`` (``option``'s value, a ``noun``): a regular file of at most
    ``max_bytes``; else one line naming it (:func:`check_input`'s words when it is missing)."""
    from ..core.fileio import UnsafeFileError, read_regular_file

    check_input(path, option, noun)
    limit = f"only regular files of at most {max_bytes / (1024 * 1024):g} MB are read"
    try:
        return read_regular_file(path, max_bytes=max_bytes)
    except UnsafeFileError as e:
        reason = str(e).removeprefix(f"{path}: ")
        raise UsageError(f"cannot read {noun} {path}: {reason} ({limit})") from None
    except OSError as e:
        raise UsageError(f"cannot read {noun} {path}: {e.strerror or one_line(e)}") from None
