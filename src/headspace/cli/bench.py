"""``headspace bench``: the attention benchmark of :mod:`headspace.bench` from the command line."""

from __future__ import annotations

from typing import Any

import click

from ..core.errors import UsageError
from .options import json_option
from .output import clean, json_out


@click.command("bench")
@click.option("--seq", "seqs", type=int, multiple=True, help="Sequence length(s); repeat the option.")
@click.option("--batch", type=int, default=8, show_default=True)
@click.option("--repeats", type=int, default=None, help="Timed steps per case (default: by size).")
@click.option("--quick", is_flag=True, help="3 repeats and no memory measurement.")
@click.option("--no-memory", is_flag=True, help="Skip the peak-memory subprocesses.")
@json_option
def bench_cmd(
    seqs: tuple[int, ...], batch: int, repeats: int | None, quick: bool, no_memory: bool, as_json: bool
) -> None:
    """Run the attention benchmark (headspace vs torch MHA, nanoGPT-style, textbook, GEMM floor)."""
    from .. import bench

    given = (("--seq", seqs), ("--batch", (batch,)), ("--repeats", () if repeats is None else (repeats,)))
    for name, values in given:
        for v in values:
            if v <= 0:
                raise UsageError(f"{name} must be a positive integer; got {v}")
    kwargs: dict[str, Any] = {"batch": batch, "progress": not as_json}
    if seqs:
        kwargs["seqs"] = tuple(seqs)
    if quick:
        kwargs["repeats"] = 3
        kwargs["measure_memory"] = False
    if repeats is not None:
        kwargs["repeats"] = repeats
    if no_memory:
        kwargs["measure_memory"] = False
    rows = bench.run_attention_benchmark(**kwargs)
    if as_json:
        json_out(clean(rows))
    else:
        click.echo(bench.format_table(rows))
