"""Progress bars that suit where they are shown: a terminal, a log file, a notebook.

:func:`progress_bar` is what every bar of headspace goes through (training, head ablations, ``encode``,
the attention benchmark):

* a **terminal** gets tqdm's bar (``tqdm.std``, redrawn in place);
* a **notebook** gets tqdm's widget where ``ipywidgets`` is installed, else tqdm's text bar, which
  Jupyter redraws in place too. ``tqdm.auto`` is never imported: without ipywidgets it warns
  ``TqdmWarning: IProgress not found`` in every notebook;
* anything else (a log file, a pipe, a captured stream) gets :class:`PlainProgress`: a plain line every
  :data:`PLAIN_EVERY` seconds (done/total, rate, ETA, the postfix) and one at the end, never a carriage
  return, so a log holds lines, not thousands of redraws; the first unit of a slow pass (one that took
  :data:`FIRST_AFTER` seconds or more) gets its line as it ends, so rate and ETA show at once.

:func:`ticker` turns a bar into the ``on_progress(done, total)`` callback an engine calls per unit.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

#: Seconds between two lines of :class:`PlainProgress`.
PLAIN_EVERY = 5.0
#: A pass whose first unit took at least this many seconds gets a line as that unit ends.
FIRST_AFTER = 1.0


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (what ``tqdm.autonotebook`` checks, without importing it)."""
    if "ipykernel.zmqshell" not in sys.modules:
        return False
    ipython = sys.modules.get("IPython")
    shell = getattr(ipython, "get_ipython", lambda: None)()
    return shell is not None and not any(k in type(shell).__name__.lower() for k in ("qt", "spyder"))


def tqdm_class() -> Any:
    """tqdm's notebook widget in a notebook with ipywidgets installed, else tqdm's text bar."""
    if in_notebook() and importlib.util.find_spec("ipywidgets") is not None:
        from tqdm.notebook import tqdm as notebook_tqdm

        return notebook_tqdm
    from tqdm.std import tqdm as std_tqdm

    return std_tqdm


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def _clock(seconds: float) -> str:
    seconds = max(0, round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class PlainProgress:
    """A progress report in plain lines, for streams that are not a terminal (the subset of tqdm's
    interface headspace uses: iteration, ``update``, ``set_postfix``, ``set_postfix_str``,
    ``set_description_str``, ``write``, ``close``, ``n``).

    A line (``"train text: 120/400 steps, 15.2 step/s, ETA 0:18, loss=2.1234"``) is written as it
    begins and ends (with ``leave``) and between them at most every ``every`` seconds; :meth:`exclude`
    leaves time spent elsewhere (an evaluation) out of the rate.
    """

    def __init__(
        self,
        iterable: Iterable[Any] | None = None,
        *,
        total: int | None = None,
        desc: str = "",
        unit: str = "it",
        initial: int = 0,
        file: IO[str] | None = None,
        disable: bool = False,
        leave: bool = True,
        every: float | None = None,
    ) -> None:
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self.file, self.disable, self.leave = file, disable, leave
        self.every = PLAIN_EVERY if every is None else every
        self.postfix = ""
        self._start = self._last = time.perf_counter()
        self._initial = initial
        self._closed = self._ticked = False
        if not disable and leave:
            self._print(first=True)  # the log says when it began

    # ---------------------------------------------------------------------------- what tqdm offers
    def __iter__(self) -> Iterator[Any]:
        if self.iterable is None:
            raise TypeError("PlainProgress without an iterable cannot be iterated")
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __len__(self) -> int:
        return self.total or 0

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        # the first unit of a slow pass is reported as it ends (its rate and the ETA at once), then every
        first = not self._ticked and n > 0 and now - self._start >= FIRST_AFTER
        self._ticked = self._ticked or n > 0
        if not self.disable and (first or now - self._last >= self.every):
            self._print()

    def set_postfix(self, refresh: bool = True, **values: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def set_description_str(self, desc: str = "", refresh: bool = True) -> None:
        self.desc = desc

    def write(self, message: str, file: IO[str] | None = None) -> None:
        print(message, file=file or self.file or sys.stderr, flush=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.disable and self.leave:
            self._print(final=True)

    # ---------------------------------------------------------------------------- its own
    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` just spent on something else out of the rate (and so the ETA)."""
        self._start += seconds
        self._last += seconds

    @property
    def format_dict(self) -> dict[str, Any]:
        """What tqdm's ``format_dict`` holds of the same things: n, total, elapsed, rate (units per second
        since the start, time given to :meth:`exclude` left out), unit, desc, postfix."""
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        return {
            "n": self.n, "total": self.total, "elapsed": elapsed, "rate": (self.n - self._initial) / elapsed,
            "unit": self.unit, "prefix": self.desc, "postfix": self.postfix,
        }  # fmt: skip

    def line(self, *, final: bool = False, first: bool = False) -> str:
        """The line it prints now (``first``: as it begins; ``final``: as it ends)."""
        elapsed, rate = self.format_dict["elapsed"], self.format_dict["rate"]
        units = self.unit + ("es" if self.unit.endswith(("s", "x", "ch", "sh")) else "s")
        count = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        parts = [f"{self.desc}: {count} {units}" if self.desc else f"{count} {units}"]
        if final:
            parts.append(f"{_clock(elapsed)} at {rate:,.3g} {self.unit}/s")
        elif not first:
            parts.append(f"{rate:,.3g} {self.unit}/s")
            if self.total is not None and rate > 0:
                parts.append(f"ETA {_clock((self.total - self.n) / rate)}")
        if self.postfix:
            parts.append(self.postfix)
        return ", ".join(parts)

    def _print(self, *, final: bool = False, first: bool = False) -> None:
        self._last = time.perf_counter()
        print(self.line(final=final, first=first), file=self.file or sys.stderr, flush=True)


def ticker(bar: Any) -> Callable[[int, int], None]:
    """``on_progress(done, total)`` for an engine that counts its own units (pairs, steps, tokens): each
    call moves ``bar`` (a :func:`progress_bar`) to ``done`` of ``total``, so the bar ticks per unit as
    the engine finishes them, with rate and ETA, instead of once per batch."""

    def on_progress(done: int, total: int) -> None:
        if bar.total != total:
            bar.total = total
        if done != bar.n:
            bar.update(done - bar.n)

    return on_progress


def progress_bar(iterable: Iterable[Any] | None = None, **kwargs: Any) -> Any:
    """A progress bar for ``iterable`` (or ``total=``) written to ``file`` (default ``sys.stderr``):
    tqdm's bar in a terminal or a notebook, :class:`PlainProgress` lines elsewhere (see the module
    docstring). ``kwargs`` are tqdm's (``total``, ``desc``, ``unit``, ``initial``, ``leave``,
    ``disable`` ...); ``every=`` is :class:`PlainProgress`'s and ignored by tqdm."""
    every = kwargs.pop("every", None)
    file = kwargs.get("file") or sys.stderr
    if in_notebook() or _is_terminal(file):
        return tqdm_class()(iterable, **kwargs)
    plain = {
        k: kwargs[k] for k in ("total", "desc", "unit", "initial", "file", "disable", "leave") if k in kwargs
    }
    return PlainProgress(iterable, every=every, **plain)
