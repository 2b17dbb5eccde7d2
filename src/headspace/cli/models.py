"""``headspace models``: the families ``headspace.load(folder)`` reads, from
:data:`headspace.pretrained.families_table.FAMILIES` (the table the README's is generated from)."""

from __future__ import annotations

import click

from ..core.errors import UsageError
from .options import json_option
from .output import json_out

#: The narrowest ``--width`` the table wraps to (the first line of a row takes up to 90 columns, unwrapped).
MIN_WIDTH = 90


@click.command("models")
@click.option(
    "--width", type=int, default=100, show_default=True, help="Wrap each row's details to this many columns."
)
@json_option
def models_cmd(width: int, as_json: bool) -> None:
    """List the model families a checkpoint folder may hold: positions, layout, decoding, exactness."""
    from ..pretrained import families_table

    if width < MIN_WIDTH:
        raise UsageError(f"--width must be an integer >= {MIN_WIDTH}; got {width}")
    if as_json:
        json_out({"families": families_table.as_json()})
        return
    click.echo(families_table.text_table(width), nl=False)


COMMANDS = (models_cmd,)
