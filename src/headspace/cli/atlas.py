"""``headspace atlas``: every head's statistics over a corpus, into ``DIR/atlas.json`` and ``DIR/atlas.html``.

Runs :func:`headspace.analysis.atlas` with its shards sealed in ``DIR/shards`` (a killed run started
again with the same command resumes), a progress bar (tokens/s, ETA), and, under ``torchrun
--nproc-per-node N -m headspace atlas ...``, one shard in N per rank (gloo on CPU, NCCL with
``--device cuda``); rank 0 writes the files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from ..core.errors import UsageError
from ..core.fileio import parse_json, read_regular_file
from .encdec_inputs import is_encdec_spec
from .errors import check_input, one_line
from .loader import load_model
from .options import model_choice_option
from .output import check_writable_folder, output_folder

OWN_PAGE_MARK = b'<script type="application/json" id="atlas-data">'
"""What every atlas page headspace writes holds (:func:`headspace.viz.atlas.write_atlas_page`)."""


class RunError(click.ClickException):
    """A run that could not finish (its output could not be written): one line on stderr, exit code 1."""

    exit_code = 1

    def show(self, file: object = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


def _ours(path: Path) -> bool:
    """Whether ``path`` (an existing ``atlas.json`` or ``atlas.html``) is a file headspace wrote."""
    try:
        raw = read_regular_file(path, max_bytes=1 << 30, follow_symlinks=False)
        if path.suffix == ".html":
            return OWN_PAGE_MARK in raw
        d = parse_json(raw)
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and d.get("kind") == "head_atlas"


def check_own_outputs(out_dir: Path) -> None:
    """Refuse to run where ``atlas.json`` / ``atlas.html`` exist in ``out_dir`` but headspace did not
    write them (they would be overwritten)."""
    for name in ("atlas.json", "atlas.html"):
        path = out_dir / name
        if os.path.lexists(path) and not _ours(path):
            raise UsageError(
                f"--out {out_dir}: {name} there is not a head atlas headspace wrote; expected a folder "
                "without it or with one of headspace's own: move it away or choose another folder"
            )


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
@click.option(
    "--importance",
    type=click.Choice(["atp*", "exact", "none"]),
    default="atp*",
    show_default=True,
    help="Each head's mean-ablation loss change: AtP* estimate (one forward and backward), exact "
    "(one run per head: slow), or none.",
)
@click.option(
    "--importance-check",
    "importance_check",
    type=click.IntRange(min=1),
    default=None,
    metavar="TOKENS",
    help="Also run AtP* and exact on the first TOKENS tokens; their agreement goes into atlas.json.",
)
@click.option("--no-ablation", is_flag=True, help="Skip the importance pass (as --importance none).")
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
    importance: str,
    importance_check: int | None,
    no_ablation: bool,
    device: str,
) -> None:
    """Every head over a corpus: the head atlas (statistics, relations, top examples). On an
    encoder-decoder (a folder of WAV files or of sentences): the cross-attention heads' statistics."""
    if is_encdec_spec(model_spec):
        from .encdec_atlas import atlas_encoder_decoder

        return atlas_encoder_decoder(model_spec, corpus, out)
    from ..analysis.atlas.guard import folder_lock
    from ..analysis.atlas.run import atlas
    from ..core.process_group import setup_distributed, teardown

    if importance_check is not None and (no_ablation or importance == "none"):
        raise UsageError(
            "--importance-check compares atp* with exact: it needs --importance atp* or exact; got "
            f"{'--no-ablation' if no_ablation else '--importance none'}"
        )
    out_dir = check_writable_folder(out)
    check_input(corpus, "--corpus", "corpus", "any")
    out_dir = output_folder(out_dir)
    check_own_outputs(out_dir)
    try:
        info = setup_distributed(device)
    except RuntimeError as e:  # torch built without distributed, a rank's environment unusable
        raise UsageError(one_line(e)) from None
    try:
        model = load_model(model_spec)
        if device == "cuda":
            import torch

            model.model.to(torch.device("cuda", torch.cuda.current_device()))
        try:
            with folder_lock(out_dir, info):
                result = atlas(
                    model, corpus, window=window, batch_size=batch_size, top_k=top_k, max_tokens=max_tokens,
                    ablation=not no_ablation, out=out_dir, shard_size=shard_size, model_name=model_spec,
                    dist_info=info, progress=info.is_main, importance=importance,
                    importance_check=importance_check,
                )  # fmt: skip
                if info.is_main:
                    _write(result, out_dir, info.world_size)
        except OSError as e:
            if isinstance(e, FileNotFoundError):
                raise  # an input gone: the command line's one path says so (exit code 2)
            raise RunError(_os_reason(e)) from None  # the output could not be written: exit code 1
    finally:
        teardown(info)


def _os_reason(e: OSError) -> str:
    """An operating-system error on one line, without the ``[Errno N]`` prefix where the message (ours,
    naming the path) says it all."""
    if e.filename is None and e.strerror:
        return " ".join(e.strerror.split())
    return one_line(e)


def _write(result: Any, out_dir: Path, world_size: int) -> None:
    """``atlas.json`` and ``atlas.html`` of ``result`` in ``out_dir``, and the line saying so."""
    from ..viz.atlas import write_atlas_page

    d = result.to_dict()
    check_own_outputs(out_dir)  # again: a file put there while the run went
    try:
        result.to_json(out_dir / "atlas.json")
        write_atlas_page(out_dir / "atlas.html", d)
    except OSError as e:
        raise OSError(
            e.errno,
            f"{out_dir}: cannot write atlas.json and atlas.html ({e.strerror or type(e).__name__}); "
            f"the sealed shards in {out_dir / 'shards'} are kept: run again to write them from those",
        ) from None
    L, H = len(d["n_heads"]), max(d["n_heads"])
    click.echo(
        f"wrote {out_dir / 'atlas.json'} and {out_dir / 'atlas.html'} ({d['n_tokens']} tokens in "
        f"{d['n_sequences']} windows, {L} layers x {H} heads, {world_size} process(es); importance: "
        f"{d['importance_method']})"
    )
    check = d.get("importance_check")
    if check:
        click.echo(
            f"importance check on {check['tokens']} tokens: atp* against exact, Spearman "
            f"{check['spearman']:.3f}, top-{check['top_k']} overlap {check['top_k_overlap']:.2f}"
        )


COMMANDS = (atlas_cmd,)
