"""A run's progress on stderr: status lines before the first step, then the training bar (:class:`_Progress`).

:mod:`.loop` re-exports these names.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any


class _Progress:
    """What a run is doing, on stderr (rank 0, ``progress=True``): status lines, then the training bar
    (:func:`headspace.progress.progress_bar`: redrawn in a terminal or a notebook, a plain line every few
    seconds with steps, rate and ETA where stderr is a log file or a pipe).

    Status lines say what happens before the first step (reading and encoding the data, building the
    model, the first evaluation, with a bar over its forward passes). The training bar starts after the
    first step this process runs, which carries one-time costs (allocations, the optimizer's state) and
    is not timed, so its first rate and ETA are those of ordinary steps; the time of an evaluation or a
    checkpoint does not count as step time either (the bar's description shows an evaluation's passes).
    """

    def __init__(self, enabled: bool, desc: str, total: int) -> None:
        self.enabled, self.desc, self.total = enabled, desc, total
        self.bar: Any = None
        self._eval_bar: Any = None
        self._last_refresh = 0.0

    def say(self, message: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)

    def start_bar(self, initial: int) -> None:
        """The training bar from step ``initial`` on (timed from now)."""
        if not self.enabled or self.bar is not None:
            return
        from ..core.progress import progress_bar

        self.bar = progress_bar(
            total=self.total,
            initial=initial,
            desc=self.desc,
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
        )

    def step(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def postfix(self, **values: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix(**values, refresh=False)

    def eval_progress(self, step: int) -> Callable[[int, int], None] | None:
        """``on_progress`` for :func:`~.metrics.evaluate`: its passes on the bar (or a bar of its own)."""
        if not self.enabled:
            return None

        def on_progress(done: int, total: int) -> None:
            now = time.perf_counter()
            if self.bar is None:
                if self._eval_bar is None:
                    from ..core.progress import progress_bar

                    self._eval_bar = progress_bar(
                        total=total, desc=f"eval step {step}", unit="pass", leave=False, file=sys.stderr
                    )
                self._eval_bar.update(done - self._eval_bar.n)
            elif done == total:
                self.bar.set_description_str(self.desc, refresh=False)
            elif now - self._last_refresh >= 0.25:
                self._last_refresh = now
                self.bar.set_description_str(f"{self.desc} [eval step {step}: pass {done}/{total}]")

        return on_progress

    def end_eval(self) -> None:
        if self._eval_bar is not None:
            self._eval_bar.close()
            self._eval_bar = None

    def untimed(self, seconds: float) -> None:
        """Leave ``seconds`` just spent (an evaluation, a checkpoint) out of the bar's step rate.

        The bar's elapsed time still counts them; its rate (and so its ETA) is that of training steps.
        """
        from ..core.progress import PlainProgress

        if isinstance(self.bar, PlainProgress):
            self.bar.exclude(seconds)
        elif self.bar is not None:
            self.bar.last_print_t += seconds

    def close(self) -> None:
        if self._eval_bar is not None:
            self._eval_bar.close()
            self._eval_bar = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _eval_line(step: int, result: dict[str, Any], seconds: float) -> str:
    acc = result.get("accuracy")
    extra = "" if acc is None else f", accuracy {acc:.3f}"
    return f"step {step}: eval loss {result['loss']:.4f}{extra} ({seconds:.1f} s)"
