"""Does tracing cost anything when it is not active? MultiHeadAttention timed side by side.

Variants, timed round-robin in one run (medians over rounds, ratios to ``fresh``):

* ``fresh``               a layer that was never traced (fused scaled_dot_product_attention path);
* ``after_trace``         the same layer after a ``trace()`` on it has exited (hooks removed);
* ``other_layer_traced``  the layer while a ``trace()`` is active on *another* layer of the same model;
* ``traced``              the layer while every one of its hook points is traced (the explicit path),
                          for reference: that is the cost of asking for every intermediate.

Usage: python benchmarks/trace_overhead.py [--rounds 30] [--batch 8] [--seq 128] [--d-model 512] [--heads 8]
       [--threads N] [--out PATH | --save]
Writes benchmarks/results/local/trace_overhead.json (git-ignored) unless ``--out PATH``; only ``--save``
replaces the committed benchmarks/results/trace_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

import headspace as hs
from headspace.bench.scripts import add_output_options, check_output_options, check_positive, output_path

RESULTS = Path(__file__).resolve().parent / "results"
"""The published results (committed); runs without --save write to RESULTS / "local"."""


def timed(run: Callable[[int], object], inner: int) -> float:
    """Seconds per call of ``run(inner)``, which makes ``inner`` calls."""
    t0 = time.perf_counter()
    run(inner)
    return (time.perf_counter() - t0) / inner


def repeat(fn: Callable[[], object]) -> Callable[[int], None]:
    def run(inner: int) -> None:
        for _ in range(inner):
            fn()

    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--inner", type=int, default=5, help="calls per timing")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    add_output_options(ap, "trace_overhead.json")
    args = ap.parse_args(argv)
    check_positive(ap, args, ("rounds", "inner", "batch", "seq", "d_model", "heads"))
    if args.rounds < 2:
        ap.error(f"--rounds must be at least 2 (quartiles need two timings); got {args.rounds}")
    check_output_options(ap, args, "trace_overhead.json")
    out = output_path(args.out, args.save, "trace_overhead.json", RESULTS)

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    stack = nn.ModuleList(
        [hs.MultiHeadAttention(args.d_model, args.heads), hs.MultiHeadAttention(args.d_model, args.heads)]
    ).eval()
    fresh = hs.MultiHeadAttention(args.d_model, args.heads).eval()
    fresh.load_state_dict(stack[1].state_dict())
    x = torch.randn(args.batch, args.seq, args.d_model)
    layer = stack[1]
    with hs.trace(layer) as t:  # leaves `layer` in the after-trace state
        layer(x)
    assert len(t) == 7 and not layer.hooks_active

    def other_layer_traced(inner: int) -> None:
        with hs.trace(stack, "0.hook_pattern"):  # entered once per timing, as a user would
            assert stack[0].hooks_active and not layer.hooks_active
            for _ in range(inner):
                layer(x)

    def traced(inner: int) -> None:
        with hs.trace(layer):
            for _ in range(inner):
                layer(x)

    variants: dict[str, Callable[[int], object]] = {
        "fresh": repeat(lambda: fresh(x)),
        "after_trace": repeat(lambda: layer(x)),
        "other_layer_traced": other_layer_traced,
        "traced": traced,
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    with torch.inference_mode():
        for fn in variants.values():  # warm-up
            fn(1)
        for _ in tqdm(range(args.rounds), desc="rounds", unit="round"):
            for name, fn in variants.items():
                times[name].append(timed(fn, args.inner))
    base = statistics.median(times["fresh"])
    rows = []
    shape = f"[{args.batch}, {args.seq}, {args.d_model}]"
    print(f"\nMultiHeadAttention d_model={args.d_model} heads={args.heads} x={shape}")
    print(f"{'variant':<20} {'median ms':>10} {'q1 ms':>8} {'q3 ms':>8} {'ratio':>7}")
    for name, ts in times.items():
        q1, med, q3 = statistics.quantiles(ts, n=4)
        med = statistics.median(ts)
        rows.append(
            {
                "variant": name,
                "median_ms": med * 1e3,
                "q1_ms": q1 * 1e3,
                "q3_ms": q3 * 1e3,
                "ratio": med / base,
            }
        )
        print(f"{name:<20} {med * 1e3:>10.3f} {q1 * 1e3:>8.3f} {q3 * 1e3:>8.3f} {med / base:>7.3f}")
    result = {
        "benchmark": "trace_overhead",
        "config": vars(args)
        | {"torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine()},
        "results": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
