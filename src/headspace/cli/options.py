"""Options every model command shares: ``--model``, ``--json``, ``--out``."""

from __future__ import annotations

from pathlib import Path

import click

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
