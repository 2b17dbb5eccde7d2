"""``headspace atlas``: every head's statistics over a corpus, into ``DIR/atlas.json`` and ``DIR/atlas.html``.

Runs :func:`headspace.analysis.atlas` with its shards sealed in ``DIR/shards`` (a killed run started
again with the same command resumes), a progress bar (tokens/s, ETA), and, under ``torchrun
--nproc-per-node N -m headspace atlas ...``, one shard in N per rank (gloo on CPU, NCCL with
``--device cuda``); rank 0 writes the files.
"""

from __future__ import annotations

import click

from .errors import check_input
from .loader import load_model
from .options import model_choice_option
from .output import check_writable_folder, output_folder


@click.command("atlas")
@model_choice_option("smollm2")
@click.option(
    "--corpus", required=True, help='A UTF-8 text file, a folder of them, or JSONL ({"text": ...} per line).'
)
@click.option("--out", "out", required=True, help="Folder for atlas.json, atlas.html and the sealed shards.")
@click.option("--tokens", "max_tokens", type=click.IntRange(min=1), default=None, help="Stop after N tokens.")
@click.option(
    "--window", type=click.IntRange(min=2), default=512, show_default=True, help="Tokens per window."
)
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--top-k", type=click.IntRange(min=1), default=8, show_default=True, help="Examples per head.")
@click.option(
    "--shard-size", type=click.IntRange(min=1), default=64, show_default=True, help="Windows per shard."
)
@click.option("--no-ablation", is_flag=True, help="Skip the mean-ablation pass (the slow part).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
def atlas_cmd(
    model_spec: str,
    corpus: str,
    out: str,
    max_tokens: int | None,
    window: int,
    batch_size: int,
    top_k: int,
    shard_size: int,
    no_ablation: bool,
    device: str,
) -> None:
    """Every head over a corpus: the head atlas (statistics, relations, top examples)."""
    from ..analysis.atlas import atlas
    from ..core.process_group import setup_distributed, teardown
    from ..viz.atlas import write_atlas_page

    out_dir = check_writable_folder(out)
    check_input(corpus, "--corpus", "corpus", "any")
    info = setup_distributed(device)
    try:
        model = load_model(model_spec)
        if device == "cuda":
            import torch

            model.model.to(torch.device("cuda", torch.cuda.current_device()))
        result = atlas(
            model, corpus, window=window, batch_size=batch_size, top_k=top_k, max_tokens=max_tokens,
            ablation=not no_ablation, out=output_folder(out_dir), shard_size=shard_size,
            model_name=model_spec, dist_info=info, progress=info.is_main,
        )  # fmt: skip
        if info.is_main:
            d = result.to_dict()
            result.to_json(out_dir / "atlas.json")
            write_atlas_page(out_dir / "atlas.html", d)
            L, H = len(d["n_heads"]), max(d["n_heads"])
            click.echo(
                f"wrote {out_dir / 'atlas.json'} and {out_dir / 'atlas.html'} ({d['n_tokens']} tokens in "
                f"{d['n_sequences']} windows, {L} layers x {H} heads, {info.world_size} process(es))"
            )
    finally:
        teardown(info)


COMMANDS = (atlas_cmd,)
