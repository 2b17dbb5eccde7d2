"""Errors a user can cause from the command line."""

from __future__ import annotations

import click


class UsageError(click.ClickException):
    """A user error: printed as one line ('error: ...') on stderr, exit code 2, no traceback."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", err=True, file=file)
