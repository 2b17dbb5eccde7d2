"""Options every model command shares (``--model``, ``--json``, ``--out``) and value checks.

The checks are click callbacks that raise :class:`~headspace.errors.UsageError`: one line on stderr,
exit code 2, naming the option, what came and what is valid.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ..errors import UsageError

#: The seeds ``torch.manual_seed`` takes: a non-negative 64-bit signed integer.
MAX_SEED = 2**63 - 1


def _option_name(param: click.Parameter) -> str:
    opts = getattr(param, "opts", None) or [param.name or "value"]
    return max(opts, key=len)


def positive_int(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """A callback: the option's value, if given, must be >= 1."""
    if value is not None and value < 1:
        raise UsageError(f"{_option_name(param)} must be a positive integer (1 or more); got {value}")
    return value


def seed_value(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """A callback: a seed must lie in [0, 2**63 - 1], the range torch's generators take."""
    if value is not None and not 0 <= value <= MAX_SEED:
        raise UsageError(f"{_option_name(param)} must be in 0..{MAX_SEED} (2**63 - 1); got {value}")
    return value


model_option = click.option(
    "--model",
    "model_spec",
    default="minilm",
    show_default=True,
    help="'minilm' (bundled all-MiniLM-L6-v2) or a folder with a Hugging Face checkpoint (BERT, GPT-2).",
)
json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print the numbers as JSON instead of tables."
)
out_option = click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder for PNG pictures (created if needed).",
)
