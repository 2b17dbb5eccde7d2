"""The ``headspace`` command.

Commands live beside the code they drive and are registered here. Errors a user can cause are one
line on stderr with exit code 2 (:class:`UsageError`), never a traceback.
"""

from __future__ import annotations

import sys

import click

from .errors import UsageError

__all__ = ["UsageError", "cli", "main"]


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="headspace")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """headspace: multi-head attention with every head's W_Q, W_K, W_V and W_O in plain sight."""
    if ctx.invoked_subcommand is None:
        from .__main__ import demo

        demo()


def _register() -> None:
    from .cli_lesson import COMMANDS

    for command in COMMANDS:
        cli.add_command(command)


_register()

from .viz.explorer.command import view  # noqa: E402 - `headspace view`, the explorer page

cli.add_command(view)


from .train.commands import COMMANDS as _TRAIN_COMMANDS  # noqa: E402 - train, plot-run, generate

for _command in _TRAIN_COMMANDS:
    cli.add_command(_command)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``headspace`` console script and ``python -m headspace``."""
    cli.main(args=argv, prog_name="headspace", standalone_mode=True)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
