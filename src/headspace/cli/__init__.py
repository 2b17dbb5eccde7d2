"""The ``headspace`` command: one click group, the commands registered from the modules beside it.

* :mod:`.lesson`: ``explain``, ``heads``, ``subspaces`` (the lesson on real weights);
* :mod:`.view`: ``view`` (the explorer page); :mod:`.train`: ``train``, ``plot-run``, ``generate``;
* :mod:`.bench`: ``bench``; :mod:`.demo`: no command at all.

Every command loads models through :func:`.loader.load_model` and reports user errors as one line on
stderr with exit code 2 (:class:`~headspace.errors.UsageError`), never a traceback. Nothing here imports
torch at module level, so ``headspace --help`` answers at once.
"""

from __future__ import annotations

import sys

import click

from ..errors import UsageError
from .bench import bench_cmd
from .lesson import COMMANDS as LESSON_COMMANDS
from .train import COMMANDS as TRAIN_COMMANDS
from .view import view

__all__ = ["UsageError", "cli", "main"]


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="headspace")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """headspace: multi-head attention with every head's W_Q, W_K, W_V and W_O in plain sight."""
    if ctx.invoked_subcommand is None:
        from .demo import demo

        demo()


for _command in (*LESSON_COMMANDS, bench_cmd, view, *TRAIN_COMMANDS):
    cli.add_command(_command)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``headspace`` console script and ``python -m headspace``."""
    cli.main(args=argv, prog_name="headspace", standalone_mode=True)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
