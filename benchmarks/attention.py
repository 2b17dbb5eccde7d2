"""Attention benchmark: headspace vs torch MHA, a nanoGPT-style module, a textbook module and the GEMM floor.

Prints a Markdown table (median ms, ratio to the GEMM floor, peak extra MiB) and writes JSON with the
machine's description. The logic lives in :mod:`headspace.bench` (also behind ``headspace bench``).

    python benchmarks/attention.py                       # seed configuration, seq 128 512 1024 2048
    python benchmarks/attention.py --quick               # small sizes, under a minute (attention_quick.json)
    python benchmarks/attention.py --seq 512 1024 --repeats 5 --threads 2
    python benchmarks/attention.py --save                # publish: benchmarks/results/attention.json
    python benchmarks/attention.py --dtype bfloat16      # every case and the floor in bfloat16

The JSON goes to benchmarks/results/local/ (git-ignored) unless ``--out PATH`` says otherwise; only
``--save`` replaces the committed benchmarks/results/attention.json (a ``--quick`` run is never published).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from headspace.bench import CASES, MODES, format_table, machine_info, run_attention_benchmark, write_json
from headspace.bench.scripts import add_output_options, check_output_options, check_positive, output_path

RESULTS = Path(__file__).resolve().parent / "results"
"""The published results (committed); runs without --save write to RESULTS / "local"."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--seq", type=int, nargs="+", default=None, help="sequence lengths (default: 128 512 1024 2048)"
    )
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--repeats", type=int, default=None, help="timed steps per case (default: 3-15 by size)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="weights, inputs and the GEMM floor's matrices (default float32; JSON name gets _bfloat16)",
    )
    p.add_argument("--quick", action="store_true", help="seq 128 256, batch 4, 3 repeats: a smoke run")
    add_output_options(p, "attention.json", note=", with --quick attention_quick.json there")
    a = p.parse_args(argv)
    check_output_options(p, a, "attention.json", smoke="quick")
    suffix = ("_quick" if a.quick else "") + ("" if a.dtype == "float32" else f"_{a.dtype}")
    out = output_path(a.out, a.save, f"attention{suffix}.json", RESULTS)
    check_positive(p, a, ("batch", "d_model", "n_heads", "repeats", "threads"))
    seqs = a.seq or ([128, 256] if a.quick else [128, 512, 1024, 2048])
    if any(s <= 0 for s in seqs):
        p.error(f"--seq values must be positive; got {seqs}")
    batch = 4 if a.quick and a.batch == 8 else a.batch
    repeats = 3 if a.quick and a.repeats is None else a.repeats
    start = time.time()
    rows = run_attention_benchmark(
        seqs,
        batch=batch,
        d_model=a.d_model,
        n_heads=a.n_heads,
        modes=a.modes,
        cases=a.cases,
        repeats=repeats,
        threads=a.threads,
        measure_memory=not a.no_memory,
        dtype=a.dtype,
    )
    info = machine_info()
    print(
        f"\nmachine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, "
        f"{info['torch_threads']} threads, load average {info.get('load_average_1m', '?')}\n"
    )
    print(format_table(rows))
    write_json(
        rows, out, extra={"argv": sys.argv[1:] if argv is None else argv, "wall_s": time.time() - start}
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
