"""``head_importance`` on SmolLM2: the batched engine beside the whole-model path, and ``headspace heads``.

Side by side in one run, on the command's default sentence (every head of SmolLM2, 270):

* ``engine``      ``head_importance(smollm2, sentence)``: a head's copies start at its block from the
                  unablated stream (:func:`headspace.analysis.patching.run_from_layers`);
* ``whole_model`` the same numbers the way they were computed before: one copy of the batch per head of
                  a layer, each through the whole model (``ablation._replicated``);
* ``cli``         ``headspace heads --model smollm2 --json`` as a subprocess, load included.

Each reports wall seconds and the process's CPU seconds (on a shared machine the wall time of a run
depends on the other load; the CPU time much less). The largest difference of the two sweeps' scores is
printed too (they must agree to float32 rounding).

``--random``: a tiny random decoder on random tokens instead of SmolLM2, without the command (the smoke
test's run).

Usage: python benchmarks/heads.py [--threads 2] [--rounds 1] [--skip-whole-model] [--random]
       [--out PATH | --save]
Writes benchmarks/results/local/heads.json (git-ignored) unless ``--out PATH``; only ``--save`` replaces
the committed benchmarks/results/heads.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

import headspace as hs
from headspace.analysis import ablation, head_importance
from headspace.analysis.explain import DEFAULT_SENTENCE
from headspace.analysis.trace import attention_layers
from headspace.bench.scripts import output_path
from headspace.core.fileio import write_json

RESULTS = Path(__file__).resolve().parent / "results"
"""The published results (committed); runs without --save write to RESULTS / "local"."""


def timed(fn) -> tuple[object, float, float]:
    """(fn(), wall seconds, CPU seconds of this process)."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def run_command(threads: int) -> dict:
    """``headspace heads --model smollm2 --json`` in a subprocess: {case, wall_s, cpu_s, rc}."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "headspace", "heads", "--model", "smollm2", "--json"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    if done.returncode != 0:
        print(done.stderr[-2000:], file=sys.stderr)
    return {"case": "cli", "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "rc": done.returncode}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--skip-whole-model", action="store_true")
    ap.add_argument("--random", action="store_true", help="a tiny random decoder, without the command")
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/local/heads.json)")
    ap.add_argument("--save", action="store_true", help="publish: write benchmarks/results/heads.json")
    args = ap.parse_args(argv)
    if args.save and args.out is not None:
        ap.error("--save publishes to benchmarks/results/; it cannot go with --out")
    if args.rounds <= 0 or args.threads <= 0:
        ap.error(f"--rounds and --threads must be positive; got {args.rounds}, {args.threads}")
    out = output_path(args.out, args.save, "heads.json", RESULTS)
    torch.set_num_threads(args.threads)
    if args.random:
        cfg = hs.ModelConfig(
            arch="decoder", vocab_size=101, d_model=48, n_layers=3, n_heads=6, n_kv_heads=2, d_mlp=64,
            max_seq_len=32, positions="rotary", norm_kind="rmsnorm", mlp_kind="gated", act="silu", bias=False,
        )  # fmt: skip
        model: object = hs.Decoder(cfg).eval()
        inputs: object = torch.randint(0, 101, (1, 12), generator=torch.Generator().manual_seed(0))
    else:
        model, inputs = hs.load("smollm2"), DEFAULT_SENTENCE
    n_tokens = 12 if args.random else int(model.tokenize_padded([DEFAULT_SENTENCE])[0].shape[1])
    head_importance(model, inputs, heads=[(0, 0)], progress=False)  # warm-up
    rows: list[dict] = []
    results: dict[str, object] = {}
    for _ in range(args.rounds):
        imp, wall, cpu = timed(lambda: head_importance(model, inputs, progress=False))
        results["engine"] = imp
        rows.append({"case": "engine", "wall_s": round(wall, 2), "cpu_s": round(cpu, 2)})
        if not args.skip_whole_model:
            engine_applies = ablation._engine_applies
            ablation._engine_applies = lambda *a: False
            try:
                imp, wall, cpu = timed(lambda: head_importance(model, inputs, progress=False))
            finally:
                ablation._engine_applies = engine_applies
            results["whole_model"] = imp
            rows.append({"case": "whole_model", "wall_s": round(wall, 2), "cpu_s": round(cpu, 2)})
    if not args.random:
        rows.append(run_command(args.threads))
    diff = None
    if "whole_model" in results:
        a, b = results["engine"].scores, results["whole_model"].scores  # type: ignore[attr-defined]
        diff = float((a - b).abs().nan_to_num().max())
    n_heads = sum(a.n_heads for _, a in attention_layers(model))
    what, load = ("random" if args.random else "SmolLM2"), os.getloadavg()[0]
    print(f"{what}, {n_tokens} tokens, {n_heads} heads, {args.threads} threads, load {load:.1f}")
    print(f"{'case':>12} {'wall s':>8} {'cpu s':>8}")
    for r in rows:
        print(f"{r['case']:>12} {r['wall_s']:>8.2f} {r['cpu_s']:>8.2f}")
    if diff is not None:
        print(f"largest |engine - whole_model| score difference: {diff:.2e}")
    doc = {
        "benchmark": "heads",
        "model": "random" if args.random else "smollm2",
        "sentence": None if args.random else DEFAULT_SENTENCE,
        "tokens": n_tokens,
        "threads": args.threads,
        "load_average": os.getloadavg()[0],
        "cpu": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
        "max_score_difference": diff,
    }
    write_json(out, doc)
    print(f"wrote {os.path.relpath(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
