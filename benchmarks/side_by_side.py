"""Is this checkout slower than another? SmolLM2 and Gemma 3 decoding, MiniLM encoding and the patching sweep.

Each round runs one child process per source tree (this checkout's ``src`` and ``--before``'s, in
alternating order), and each child times, on the same prompt and sentences:

* ``decode b1`` / ``decode b8``: ms per token of SmolLM2 greedy ``generate`` at batch 1 and 8 (after a
  warm-up call; the default step: the native one where it is built, which the script builds first);
* ``gemma3 decode b1``: ms per token of Gemma-3-270M greedy ``generate`` at batch 1;
* ``encode``: seconds for MiniLM to encode ``--sentences`` (256) lines of the README
  (``PretrainedEncoder.encode``);
* ``patch sweep``: seconds for ``patch`` over SmolLM2's 270 heads on the indirect-object prompts of
  ``benchmarks/patching.py`` (its batched sweep; the same numbers in both trees).

It prints each figure's median and spread per tree and the ratio of the medians (this / before), and
writes JSON. A ratio near 1 within the spread means "no slower"; the ratios to transformers are then
the ones ``benchmarks/decode.py`` and ``benchmarks/encode.py`` publish for either tree.

    git worktree add /tmp/before <commit>
    python benchmarks/side_by_side.py --before /tmp/before        # 5 rounds
    python benchmarks/side_by_side.py --before /tmp/before --save # benchmarks/results/side_by_side.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from headspace.bench import machine_info
from headspace.bench.scripts import add_output_options, check_output_options, output_path
from headspace.core.fileio import write_json

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
FIGURES = (
    "decode b1 ms/token",
    "decode b8 ms/token",
    "gemma3 decode b1 ms/token",
    "encode s",
    "patch sweep s",
)

CHILD = r"""
import json, statistics, sys, time
import torch
import headspace
from headspace.kernels import native
torch.set_num_threads(int(sys.argv[1]))
tokens, steps = int(sys.argv[2]), int(sys.argv[3])
native.build()
text = open(sys.argv[4], encoding="utf-8").read()
m = headspace.load("smollm2")
prompt = m.tokenize(text[:20000])[:, :tokens]  # (1, tokens): the README's opening
out = {}
for batch in (1, 8):
    p = prompt.repeat(batch, 1)
    m.model.generate(p, 4, temperature=0)  # warm-up (and the native build's load)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        m.model.generate(p, steps, temperature=0)
        times.append((time.perf_counter() - t0) / steps * 1e3)
    out[f"decode b{batch} ms/token"] = statistics.median(times)
from headspace.analysis.patching import patch
clean = "When Mary and John went to the store, John gave a drink to"
corrupt = "When Mary and John went to the store, Mary gave a drink to"
patch(m, clean, corrupt, answer=" Mary", other=" John")  # warm-up
times = []
for _ in range(3):
    t0 = time.perf_counter()
    patch(m, clean, corrupt, answer=" Mary", other=" John")
    times.append(time.perf_counter() - t0)
out["patch sweep s"] = statistics.median(times)
del m
g = headspace.load("gemma3")
gp = g.tokenize(text[:20000])[:, :tokens]  # (1, tokens)
g.model.generate(gp, 4, temperature=0)
times = []
for _ in range(3):
    t0 = time.perf_counter()
    g.model.generate(gp, steps, temperature=0)
    times.append((time.perf_counter() - t0) / steps * 1e3)
out["gemma3 decode b1 ms/token"] = statistics.median(times)
del g
enc = headspace.load("minilm")
n = int(sys.argv[5])
sentences = [line for line in text.splitlines() if line.strip()][:n]
sentences = (sentences * (n // max(1, len(sentences)) + 1))[:n]
enc.encode(sentences[:16])
times = []
for _ in range(3):
    t0 = time.perf_counter()
    enc.encode(sentences)
    times.append(time.perf_counter() - t0)
out["encode s"] = statistics.median(times)
out["native"] = native.status()
print(json.dumps(out))
"""


def positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int; got {value}")
    return n


def run_child(src: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One child process on the tree whose package lies in ``src``: its figures."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            str(args.threads),
            str(args.tokens),
            str(args.steps),
            str(ROOT / "README.md"),
            str(args.sentences),
        ],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"the child on {src} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarise(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per figure, each tree's median, min and max over the rounds, and the ratio of the medians."""
    rows = []
    for fig in FIGURES:
        row: dict[str, Any] = {"figure": fig}
        for name, values in ((n, [run[fig] for run in r]) for n, r in runs.items()):
            row[name] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        row["ratio"] = row["this"]["median"] / row["before"]["median"]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, type=Path, help="the other checkout (its src/ is used)")
    p.add_argument("--rounds", type=positive, default=5)
    p.add_argument("--threads", type=positive, default=2)
    p.add_argument("--tokens", type=positive, default=32, help="prompt tokens")
    p.add_argument("--steps", type=positive, default=24, help="tokens generated per timed call")
    p.add_argument("--sentences", type=positive, default=256, help="sentences MiniLM encodes per timed call")
    add_output_options(p, "side_by_side.json")
    a = p.parse_args(argv)
    check_output_options(p, a, "side_by_side.json")
    trees = {"this": ROOT / "src", "before": a.before.resolve() / "src"}
    for src in trees.values():
        if not (src / "headspace" / "__init__.py").is_file():
            raise SystemExit(f"--before must be a headspace checkout: no {src / 'headspace' / '__init__.py'}")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for r in tqdm(range(a.rounds), desc="rounds", unit="round"):
        for name in list(trees) if r % 2 == 0 else list(trees)[::-1]:
            runs[name].append(run_child(trees[name], a))
    rows = summarise(runs)
    print(f"\n{a.rounds} rounds, {a.threads} threads, alternating order; medians (min-max)\n")
    print("| figure | this checkout | before | this / before |")
    print("|---|---:|---:|---:|")
    for row in rows:
        cells = [f"{row[n]['median']:.2f} ({row[n]['min']:.2f}-{row[n]['max']:.2f})" for n in trees]
        print(f"| {row['figure']} | {cells[0]} | {cells[1]} | {row['ratio']:.3f} |")
    native = {name: runs[name][-1]["native"] for name in trees}
    print(f"\nnative step: {native}")
    out = output_path(a.out, a.save, "side_by_side.json", RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "side_by_side",
        "machine": machine_info(),
        "args": {**vars(a), "before": str(a.before)},
    }
    write_json(out, {**payload, "rows": rows, "runs": runs, "native": native})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
