"""The head atlas against a plain forward: tokens/s, the ratio to the forward, peak RSS (issue #28 Speed).

SmolLM2-135M, windows of 512 tokens, batch 8, float32, on a code corpus every machine has (the Python
standard library's ``json``, ``email`` and ``asyncio`` packages, read as a folder). Three parts, each in
its own fresh process so that each peak RSS is its own (``ru_maxrss`` never goes down):

* ``forward``: ``model.model(tokens)`` on every batch (the logits, as the atlas's forward computes them);
* ``stats``: :func:`headspace.analysis.atlas` without ``ablation`` (everything else);
* ``ablation``: the exact mean-ablation pass alone (``--ablation-tokens``, fewer: one replicated pass up
  the stack per head, 270 heads), with the forward timed on the same tokens for its ratio;
* ``importance``: the default importance pass alone, AtP*'s estimate of the same column
  (:func:`headspace.analysis.atlas_importance.attribute_batch`: one forward and one backward), on the
  forward's tokens (issue #41: at most 3x the forward's time).

Peak RSS is reported whole and above the process's RSS once the model is loaded. Targets (issue #28):
stats >= 0.6x the forward's tokens/s; with ablation <= 10x the forward's time; peak <= 1.5x the forward's;
(issue #41) the atp* importance pass <= 3x the forward's time.
``--tiny`` runs the same parts on a random 2-layer rotary decoder and a random token corpus (seconds: the
smoke test's run, not a measurement).

    python benchmarks/atlas.py                          # the table; JSON in benchmarks/results/local/
    python benchmarks/atlas.py --save                   # publish: benchmarks/results/atlas.json
    python benchmarks/atlas.py --tokens 4096 --ablation-tokens 1024 --threads 2
    python benchmarks/atlas.py --tiny --tokens 256 --ablation-tokens 128 --window 64 --out /tmp/a.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from headspace.bench.scripts import output_path

RESULTS = Path(__file__).resolve().parent / "results"


def corpus_folder() -> Path:
    """A folder of Python files: the standard library's json package (small and always there)."""
    return Path(json.__file__).resolve().parent


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def tiny_model_and_corpus() -> tuple[Any, list[Any]]:
    """A random 2-layer rotary, RMSNorm, grouped-query decoder (positions up to 512) and a corpus of
    random token documents (the ``--tiny`` smoke run)."""
    import torch

    import headspace

    torch.manual_seed(0)
    cfg = headspace.ModelConfig(
        arch="decoder", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=64,
        max_seq_len=512, positions="rotary", norm_kind="rmsnorm", mlp_kind="gated", act="silu", bias=False,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 64, (n,), generator=g) for n in (700, 300, 1500, 90)]
    return headspace.Decoder(cfg).eval(), docs


def run_part(
    part: str,
    tokens: int,
    window: int,
    batch: int,
    threads: int,
    save: Path | None = None,
    tiny: bool = False,
) -> dict:
    """One part in this process: seconds, tokens, peak RSS (MB, whole and above the loaded model)."""
    import torch

    import headspace
    from headspace.analysis import atlas
    from headspace.analysis.atlas.run import _batches, _shards
    from headspace.analysis.atlas_ablation import ablate_batch
    from headspace.analysis.atlas_importance import attribute_batch
    from headspace.analysis.atlas_state import AtlasState
    from headspace.analysis.corpus import Corpus
    from headspace.analysis.trace import as_module

    torch.set_num_threads(threads)
    if tiny:
        model, docs = tiny_model_and_corpus()
        corpus = Corpus.of(docs)
    else:
        model = headspace.load("smollm2")
        corpus = Corpus.of(corpus_folder())
    windows = [w for g in _shards(model, corpus, window, tokens, 10**9) for w in g]
    n = sum(w.tokens.shape[0] for w in windows)
    base = _rss_mb()
    module = as_module(model)

    def forward_seconds() -> float:
        t = time.perf_counter()
        with torch.no_grad():
            for toks, real, _ in _batches(windows, batch, 0):
                module(toks, None if bool(real.all()) else real)
        return time.perf_counter() - t

    beside = forward_seconds() if part == "importance" else None  # the same process, just before
    t0 = time.perf_counter()
    with torch.no_grad():
        if part == "forward":
            for toks, real, _ in _batches(windows, batch, 0):
                module(toks, None if bool(real.all()) else real)
        elif part == "stats":
            result = atlas(model, corpus, window=window, batch_size=batch, max_tokens=tokens, ablation=False,
                           induction_repeated=False, progress=False)  # fmt: skip
        else:
            L, H, dh = len(module.blocks), module.blocks[0].attn.n_heads, module.blocks[0].attn.d_head
            means = torch.zeros(L, H, dh, dtype=torch.float64)  # the cost does not depend on the values
            state = AtlasState(L, H, dh, 1)
            run = ablate_batch if part == "ablation" else attribute_batch
            for toks, real, _ in _batches(windows, batch, 0):
                run(module, state, toks, real, means)
    seconds = time.perf_counter() - t0
    if save is not None and part == "stats":
        result.to_json(save)
    record = {"part": part, "tokens": n, "seconds": seconds, "tokens_per_s": n / seconds,
              "peak_rss_mb": _peak_mb(), "peak_over_model_mb": _peak_mb() - base}  # fmt: skip
    if beside is not None:  # a forward just before and just after, in this process: the load-robust ratio
        record["forward_beside_s"] = [beside, forward_seconds()]
    return record


def _child(part: str, tokens: int, args: argparse.Namespace, save: Path | None = None) -> dict:
    cmd = [sys.executable, __file__, "--part", part, "--tokens", str(tokens), "--window", str(args.window),
           "--batch", str(args.batch), "--threads", str(args.threads)]  # fmt: skip
    if save is not None:
        cmd += ["--save-atlas", str(save)]
    if args.tiny:
        cmd += ["--tiny"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=os.environ.copy())
    record = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(record), file=sys.stderr, flush=True)  # each part as it ends
    return record


def draw_grid(d: dict, path: Path) -> None:
    """Four layer x head panels of an atlas.json dict (previous, first, induction, copying) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = ("previous", "first", "induction", "copying")
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 6.5), constrained_layout=True)
    for ax, name in zip(axes, names):
        grid = np.array([[np.nan if v is None else v for v in row] for row in d[name]], dtype=float)
        signed = name == "copying"
        m = np.nanmax(np.abs(grid)) if signed else None
        im = ax.imshow(grid, aspect="auto", cmap="RdBu_r" if signed else "viridis",
                       vmin=-m if signed else 0, vmax=m if signed else None)  # fmt: skip
        ax.set_title(name)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        fig.colorbar(im, ax=ax, shrink=0.6)
    fig.suptitle(f"head atlas: {d['model']}, {d['n_tokens']} tokens (Python's json package)")
    fig.savefig(path, dpi=90)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--ablation-tokens", type=int, default=1024)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--part", choices=["forward", "stats", "ablation", "importance"], help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: results/local/atlas.json)")
    p.add_argument("--save", action="store_true", help="publish: write benchmarks/results/atlas.json")
    p.add_argument("--picture", type=Path, default=None, help="also draw the grid of the stats part (PNG)")
    p.add_argument("--save-atlas", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--tiny", action="store_true", help="a random tiny decoder and corpus (a smoke run)")
    args = p.parse_args(argv)
    if args.save and args.out is not None:
        p.error("--save writes benchmarks/results/atlas.json; give either --save or --out")
    args.out = output_path(args.out, args.save, "atlas.json", RESULTS)
    if args.part:
        record = run_part(
            args.part, args.tokens, args.window, args.batch, args.threads, args.save_atlas, args.tiny
        )
        print(json.dumps(record))
        return 0
    fwd = _child("forward", args.tokens, args)
    saved = None if args.picture is None else args.picture.with_suffix(".json")
    stats = _child("stats", args.tokens, args, saved)
    if saved is not None:
        draw_grid(json.loads(saved.read_text()), args.picture)
        saved.unlink()
    imp = _child("importance", args.tokens, args)
    fwd_small = _child("forward", args.ablation_tokens, args)
    abl = _child("ablation", args.ablation_tokens, args)
    rows = [
        ("forward", fwd, 1.0, 1.0),
        ("stats (no ablation)", stats, stats["tokens_per_s"] / fwd["tokens_per_s"],
         stats["peak_over_model_mb"] / max(1e-9, fwd["peak_over_model_mb"])),
        ("importance (atp*)", imp, imp["tokens_per_s"] / fwd["tokens_per_s"],
         imp["peak_over_model_mb"] / max(1e-9, fwd["peak_over_model_mb"])),
        (f"forward ({fwd_small['tokens']} tok)", fwd_small, 1.0, 1.0),
        ("ablation pass", abl, abl["tokens_per_s"] / fwd_small["tokens_per_s"],
         abl["peak_over_model_mb"] / max(1e-9, fwd_small["peak_over_model_mb"])),
    ]  # fmt: skip
    name = "a random tiny decoder" if args.tiny else "SmolLM2-135M"
    print(f"{name}, window {args.window}, batch {args.batch}, {args.threads} threads, float32")
    print(f"{'part':<24}{'tokens':>8}{'s':>9}{'tok/s':>9}{'x fwd speed':>13}{'peak MB':>9}{'over model':>12}")
    for name, r, ratio, _ in rows:
        print(f"{name:<24}{r['tokens']:>8}{r['seconds']:>9.2f}{r['tokens_per_s']:>9.1f}{ratio:>13.3f}"
              f"{r['peak_rss_mb']:>9.0f}{r['peak_over_model_mb']:>12.0f}")  # fmt: skip
    with_abl = (stats["seconds"] / stats["tokens"] + abl["seconds"] / abl["tokens"]) / (
        fwd["seconds"] / fwd["tokens"]
    )
    print(f"stats + ablation: {with_abl:.1f}x the forward's time per token")
    imp_ratio = imp["seconds"] / (sum(imp["forward_beside_s"]) / 2)  # against the forwards beside it
    verdict = "met" if imp_ratio <= 3 else "not met"
    print(f"importance (atp*): {imp_ratio:.2f}x the mean of a forward just before and after it, same process "
          f"(target <= 3x: {verdict})")  # fmt: skip
    kept = {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("part", "out")
    }
    record = {"benchmark": "atlas", "args": kept, "parts": {
        "forward": fwd, "stats": stats, "importance": imp, "forward_ablation_tokens": fwd_small,
        "ablation": abl}, "importance_time_ratio": imp_ratio,
        "stats_speed_ratio": rows[1][2], "stats_peak_ratio": rows[1][3],
        "ablation_time_ratio_same_tokens": abl["seconds"] / fwd_small["seconds"],
        "with_ablation_time_ratio": with_abl}  # fmt: skip
    from headspace.bench import machine_info
    from headspace.core.fileio import write_json

    record["machine"] = machine_info()
    write_json(args.out, record)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
