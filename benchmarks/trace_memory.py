"""Peak memory of tracing SmolLM2: every hook point, patterns only, and a plain forward, side by side.

Each case runs in a fresh subprocess (a clean resident set): load SmolLM2, reset the peak-RSS counter
(``/proc/self/clear_refs``), run one forward of ``--tokens`` random token ids under ``torch.no_grad()``,
and report the peak resident set above the loaded model (``VmHWM`` - RSS after the load) and what the
trace itself holds (:meth:`headspace.trace.Trace.stored_bytes`). Cases:

* ``forward``      a plain forward (the logits [1, tokens, 49152] alone are 0.2 GB at 1,024 tokens);
* ``trace_all``    ``with headspace.trace(model)``: every hook point (each block keeping its input, z
                   and copies of its weights, every other value recomputed from those when read);
* ``stored_all``   the same with ``detach=False``: every value stored as computed (what a trace held
                   before, and what TransformerLens's ``run_with_cache`` holds); 1,024 tokens only;
* ``patterns``     ``trace(model, "*.hook_pattern")``, then every layer's pattern read once;
* ``transformer_lens``  ``run_with_cache`` of TransformerLens's HookedTransformer, only if installed.

``--random``: a tiny random SmolLM2-shaped model instead of SmolLM2 (the smoke test's run).

Usage: python benchmarks/trace_memory.py [--tokens 1024 8192] [--threads 2] [--random] [--out PATH | --save]
Prints a table; writes benchmarks/results/local/trace_memory.json (git-ignored) unless ``--out PATH``;
only ``--save`` replaces the committed benchmarks/results/trace_memory.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from headspace.bench.scripts import output_path

RESULTS = Path(__file__).resolve().parent / "results"
"""The published results (committed); runs without --save write to RESULTS / "local"."""
GB = 1e9


def load_model(random: bool):  # -> (model, vocab_size)
    """SmolLM2's Decoder, or a tiny random one of its shape family (rotary, grouped-query, RMSNorm)."""
    import headspace as hs

    if not random:
        pretrained = hs.load("smollm2")
        return pretrained.model.eval(), pretrained.config.vocab_size
    cfg = hs.ModelConfig(
        arch="decoder", vocab_size=101, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2, d_mlp=64,
        max_seq_len=256, positions="rotary", norm_kind="rmsnorm", mlp_kind="gated", act="silu", bias=False,
    )  # fmt: skip
    return hs.Decoder(cfg).eval(), cfg.vocab_size


def _status_kb(field: str) -> int:
    """A ``/proc/self/status`` field in kB (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def run_case(case: str, tokens: int, threads: int, random: bool = False) -> dict:
    """One case in this process: {case, tokens, peak_over_model_gb, stored_gb, seconds}."""
    import torch

    import headspace as hs

    torch.set_num_threads(threads)
    model, vocab = load_model(random)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, tokens), generator=gen)  # (1, tokens)
    if case == "transformer_lens":
        from transformer_lens import HookedTransformer

        tl = HookedTransformer.from_pretrained("HuggingFaceTB/SmolLM2-135M", device="cpu")
    model_kb = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from here
    stored = 0
    t0 = time.perf_counter()
    with torch.no_grad():
        if case == "forward":
            model(ids)
        elif case in ("trace_all", "stored_all"):
            with hs.trace(model, detach=case == "trace_all") as t:
                model(ids)
            stored = t.stored_bytes()
        elif case == "patterns":
            with hs.trace(model, "*.hook_pattern") as t:
                model(ids)
            stored = t.stored_bytes()
            for layer in range(t.n_layers):
                t.pattern(layer)
        elif case == "transformer_lens":
            _, _cache = tl.run_with_cache(ids)
        else:
            raise ValueError(f"unknown case {case!r}")
    seconds = time.perf_counter() - t0
    peak_kb = _status_kb("VmHWM")
    return {
        "case": case,
        "tokens": tokens,
        "peak_over_model_gb": round((peak_kb - model_kb) * 1024 / GB, 3),
        "stored_gb": round(stored / GB, 3),
        "seconds": round(seconds, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--random", action="store_true", help="a tiny random model instead of SmolLM2")
    ap.add_argument(
        "--out", default=None, help="JSON path (default: benchmarks/results/local/trace_memory.json)"
    )
    ap.add_argument("--save", action="store_true", help="publish: write benchmarks/results/trace_memory.json")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # the subprocess of one case
    args = ap.parse_args(argv)
    if args.save and args.out is not None:
        ap.error("--save publishes to benchmarks/results/; it cannot go with --out")
    if any(n <= 0 for n in args.tokens):
        ap.error(f"--tokens must be positive; got {args.tokens}")
    if args.case is not None:
        print(json.dumps(run_case(args.case, args.tokens[0], args.threads, args.random)))
        return 0
    out = output_path(args.out, args.save, "trace_memory.json", RESULTS)
    cases = []
    for n in args.tokens:
        names = ["forward", "trace_all", "patterns"] + (["stored_all"] if n <= 1024 else [])
        if importlib.util.find_spec("transformer_lens") is not None and n <= 1024:
            names.append("transformer_lens")
        cases += [(name, n) for name in names]
    rows = []
    for name, n in cases:
        cmd = [sys.executable, __file__, "--case", name, "--tokens", str(n), "--threads", str(args.threads)]
        cmd += ["--random"] if args.random else []
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(f"{name} at {n} tokens failed:\n{done.stderr[-2000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{r['case']:>17} {r['tokens']:>6} tokens: peak +{r['peak_over_model_gb']:.2f} GB over the "
              f"model, trace holds {r['stored_gb']:.2f} GB, {r['seconds']:.1f} s", flush=True)  # fmt: skip
    print()
    print(f"{'case':>17} {'tokens':>6} {'peak over model (GB)':>21} {'trace holds (GB)':>17} {'s':>7}")
    for r in rows:
        print(
            f"{r['case']:>17} {r['tokens']:>6} {r['peak_over_model_gb']:>21.2f} {r['stored_gb']:>17.2f} "
            f"{r['seconds']:>7.1f}"
        )
    from headspace.core.fileio import write_json

    doc = {
        "benchmark": "trace_memory",
        "model": "random" if args.random else "smollm2",
        "threads": args.threads,
        "cpu": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
        "transformer_lens_installed": importlib.util.find_spec("transformer_lens") is not None,
        "rows": rows,
    }
    write_json(out, doc)
    print(f"wrote {os.path.relpath(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
