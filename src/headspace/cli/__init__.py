"""The ``headspace`` command: one click group, the commands registered from the modules beside it.

* :mod:`.lesson`: ``explain``, ``heads``, ``subspaces`` (the lesson on real weights);
* :mod:`.view`: ``view`` (the explorer page); :mod:`.train`: ``train``, ``plot-run``, ``generate``;
* :mod:`.causal`: ``patch``, ``attribute`` (which heads cause the answer);
* :mod:`.circuits`: ``why`` (why a head attends), ``circuit`` (which heads work together);
* :mod:`.atlas`: ``atlas`` (every head over a corpus); :mod:`.bench`: ``bench``;
* :mod:`.native`: ``native build``, ``native status``; :mod:`.models`: ``models`` (the families);
* :mod:`.align`: ``align`` (word timings from Whisper's alignment heads);
* :mod:`.demo`: no command at all.

Every command loads models through :func:`.loader.load_model` and reports user errors as one line on
stderr with exit code 2 (:class:`~headspace.errors.UsageError`), never a traceback: the group runs each
command inside :func:`.errors.reported`, the one place that maps the library's error types to that line.
Nothing here imports torch at module level, so ``headspace --help`` answers at once, and :func:`main`
chooses torch's threads from the machine's load before torch starts (:mod:`headspace.core.threads`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import click

from ..core.errors import UsageError
from .align import COMMANDS as ALIGN_COMMANDS
from .atlas import COMMANDS as ATLAS_COMMANDS
from .bench import bench_cmd
from .causal import COMMANDS as CAUSAL_COMMANDS
from .circuits import COMMANDS as CIRCUIT_COMMANDS
from .errors import reported
from .lesson import COMMANDS as LESSON_COMMANDS
from .models import COMMANDS as MODEL_COMMANDS
from .native import COMMANDS as NATIVE_COMMANDS
from .train import COMMANDS as TRAIN_COMMANDS
from .view import view

__all__ = ["UsageError", "cli", "main"]


def check_arguments(args: Sequence[str]) -> None:
    """Refuse arguments that are not valid UTF-8 text (bytes Python kept as surrogate escapes)."""
    for i, arg in enumerate(args, start=1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            try:
                raw = arg.encode("utf-8", "surrogateescape")  # the bytes the shell passed
            except UnicodeEncodeError:
                raw = arg.encode("utf-8", "backslashreplace")
            raise UsageError(
                f"argument {i} is not valid UTF-8 text (its bytes: {raw!r}); pass every argument in UTF-8"
            ) from None


class HeadspaceGroup(click.Group):
    """The command group; it checks every argument before click parses any, and runs every command
    inside :func:`.errors.reported`: the one place where the library's errors become one line, exit 2."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        check_arguments(args)
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        with reported():
            return super().invoke(ctx)


@click.group(
    cls=HeadspaceGroup,
    invoke_without_command=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.version_option(package_name="headspace")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """headspace: multi-head attention with every head's W_Q, W_K, W_V and W_O in plain sight."""
    if ctx.invoked_subcommand is None:
        from .demo import demo

        demo()


_ALL = (
    *LESSON_COMMANDS,
    *CAUSAL_COMMANDS,
    *CIRCUIT_COMMANDS,
    bench_cmd,
    view,
    *TRAIN_COMMANDS,
    *NATIVE_COMMANDS,
    *ATLAS_COMMANDS,
    *MODEL_COMMANDS,
    *ALIGN_COMMANDS,
)
for _command in _ALL:
    cli.add_command(_command)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``headspace`` console script and ``python -m headspace``: torch's threads and
    OpenMP's wait policy chosen from the machine's load first (:mod:`headspace.core.threads`, before torch
    is imported), then the command."""
    from ..core.threads import configure

    try:
        configure()
    except UsageError as e:  # a bad HEADSPACE_THREADS / OMP_NUM_THREADS: one line, exit 2
        e.show()
        sys.exit(e.exit_code)
    cli.main(args=argv, prog_name="headspace", standalone_mode=True)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
