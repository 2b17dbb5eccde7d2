"""int8 linear kernels side by side: headspace's int8_linear against torchao and torch._int_mm, on the shapes
the models run.

Shapes (random inputs and weights, the weights scaled by 1 / sqrt(in); the input of the MLP's down
projection [1536 -> d_model] is a hidden activation, GELU(x) on the encoder and SiLU(x) * x' on the
decoder, skewed as the real ones are):

* ``MiniLM encode``: all-MiniLM-L6-v2 encoding a batch, x [4096, 384] (e.g. 32 sentences x 128 tokens)
  through [384 -> 384] (attention out), [384 -> 1152] (fused q, k, v), [384 -> 1536] and [1536 -> 384]
  (the MLP), with a bias;
* ``SmolLM2 decode, batch 1`` and ``batch 8``: one decoding step, x [1, 576] and [8, 576], through
  [576 -> 960] (fused q, k, v with GQA), [576 -> 1536] (gate or up), [1536 -> 576] (down) and
  [576 -> 49152] (the tied unembedding), no bias.

Candidates, timed in rounds that alternate between them (``headspace.bench.round_robin``):

* ``float32``: ``F.linear(x, w, b)``;
* ``headspace int8``: ``headspace.kernels.int8.int8_linear(x, Int8Weight.from_float(w), b)``: int8
  weights per output channel, activations asymmetric uint8 per token, oneDNN's u8 x s8
  ``torch.ops.onednn.qlinear_pointwise``;
* ``torchao int8 dynamic``: ``torchao.quantization.quantize_(linear,
  Int8DynamicActivationInt8WeightConfig(set_inductor_config=False))`` on an ``nn.Linear`` holding ``w``
  and ``b`` (its defaults: symmetric int8 activations per token, int8 weights per row), called eagerly;
  ``not installed`` where ``import torchao`` fails (torchao is no dependency of headspace);
* ``torch._int_mm``: symmetric int8 activations per token (``s_t = max_i |x[t, i]| / 127``), the same
  int8 weights, written as torch ops: quantise, ``torch._int_mm`` (int32 sums), dequantise
  (``acc * s_t * s_w + b``). torch documents shape limits for it (more than 16 rows, sizes multiples of
  8): those are CUDA's; the CPU kernel takes any shape. A candidate whose call raises on a shape is
  reported ``cannot run: <the error>`` there, and the rest of the table still runs;
* ``headspace int8 fallback``: ``int8_linear`` with its fallback forced (``headspace.kernels.cpu``): what
  a CPU whose int8 kernels do not sum exactly runs (no VNNI): the same quantised activations as a float32
  GEMM by the dequantised weight.

The CPU and the branch each precision takes here (``headspace.kernels.cpu.report()``) are printed and
saved with the table.

Each timing is a block of calls (as many as fill ~``--block-ms``, counted once per candidate and shape)
divided by its length; per candidate and shape the table gives the median and the min / max over
``--rounds`` rounds in ms per call, the speed against float32's median (float32 ms / candidate ms: above
1 is faster) and the error: ``max |y - ref| / max |ref|`` with ``ref = x @ w.T + b`` in float64 (the
float32 input and weight, not the quantised ones: what the quantisation costs). A one-line conclusion per
shape group says which candidate is fastest, from the medians.

    python benchmarks/int8_kernels.py                  # 2 threads, 9 rounds
    python benchmarks/int8_kernels.py --threads 1 --rounds 15
    python benchmarks/int8_kernels.py --quick          # tiny shapes: a smoke run
    python benchmarks/int8_kernels.py --save           # publish: benchmarks/results/int8_kernels.json

Two threads by default; on a shared 2-core machine whose other core is busy, two threads wait on each
other and the times land on multiples of the scheduler's slice (measured: 12, 24, 48, 108 ms per call on
shapes that take 0.1-8 ms alone), so ``--threads 1`` there (the committed results are 1 thread).
The JSON goes to benchmarks/results/local/int8_kernels.json (git-ignored) unless ``--out PATH``; only
``--save`` replaces the committed benchmarks/results/int8_kernels.json (not with ``--quick``).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from headspace.bench import machine_info, round_robin, spread
from headspace.bench.scripts import add_output_options, check_output_options, output_path
from headspace.core.fileio import write_json
from headspace.kernels.cpu import force_fallback, report
from headspace.kernels.int8 import Int8Weight, int8_linear, quantize_weight

RESULTS = Path(__file__).resolve().parent / "results"
"""The published results (committed); runs without --save write to RESULTS / "local"."""

CANDIDATES = ("float32", "headspace int8", "headspace int8 fallback", "torchao int8 dynamic", "torch._int_mm")
NOT_INSTALLED = "not installed"

# (group, tokens, [(in, out), ...], bias, hidden-input kind)
GROUPS: tuple[tuple[str, int, tuple[tuple[int, int], ...], bool, str], ...] = (
    ("MiniLM encode", 4096, ((384, 384), (384, 1152), (384, 1536), (1536, 384)), True, "gelu"),
    ("SmolLM2 decode, batch 1", 1, ((576, 960), (576, 1536), (1536, 576), (576, 49152)), False, "swiglu"),
    ("SmolLM2 decode, batch 8", 8, ((576, 960), (576, 1536), (1536, 576), (576, 49152)), False, "swiglu"),
)
QUICK_GROUPS: tuple[tuple[str, int, tuple[tuple[int, int], ...], bool, str], ...] = (
    ("MiniLM encode (quick)", 24, ((16, 16), (16, 48), (64, 16)), True, "gelu"),
    ("SmolLM2 decode, batch 1 (quick)", 1, ((24, 40), (64, 24)), False, "swiglu"),
    ("SmolLM2 decode, batch 8 (quick)", 8, ((24, 40),), False, "swiglu"),
)


def shape_label(tokens: int, n_in: int, n_out: int) -> str:
    return f"x [{tokens}, {n_in}] through [{n_in} -> {n_out}]"


def _input(tokens: int, n_in: int, hidden: bool, kind: str, g: torch.Generator) -> Tensor:
    x = torch.randn(tokens, n_in, generator=g)
    if not hidden:
        return x
    if kind == "gelu":
        return F.gelu(x)
    return F.silu(x) * torch.randn(tokens, n_in, generator=g)


def _torchao_linear(w: Tensor, b: Tensor | None) -> Callable[[Tensor], Tensor] | None:
    """An ``nn.Linear`` holding ``w``, ``b``, through torchao's dynamic int8; None without torchao."""
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    except ImportError:
        return None
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
    with torch.no_grad():
        lin.weight.copy_(w)
        if b is not None:
            lin.bias.copy_(b)
    model = nn.Sequential(lin).eval()
    quantize_(model, Int8DynamicActivationInt8WeightConfig(set_inductor_config=False))
    return model


def _int_mm_linear(w: Tensor, b: Tensor | None) -> Callable[[Tensor], Tensor]:
    """``x w^T + b`` on ``torch._int_mm``: symmetric int8 per token, int8 weights per row, torch ops."""
    q, s_w = quantize_weight(w)  # (out, in) int8, (out,)
    q_t = q.t()  # (in, out): _int_mm's second operand

    def linear(x: Tensor) -> Tensor:
        s_t = x.abs().amax(dim=1).div_(127.0).clamp_(min=1e-12)  # (tokens,)
        xq = torch.round(x / s_t[:, None]).to(torch.int8)  # (tokens, in); |x / s_t| <= 127
        acc = torch._int_mm(xq, q_t)  # (tokens, out) int32
        y = acc.to(torch.float32).mul_(s_t[:, None]).mul_(s_w)  # (tokens, out)
        return y if b is None else y.add_(b)

    return linear


def _forced_fallback(x: Tensor, w: Int8Weight, b: Tensor | None) -> Tensor:
    """headspace's int8 product as a CPU whose int8 kernels are not exact runs it (kernels/cpu.py)."""
    with force_fallback("int8"):
        return int8_linear(x, w, b)


def _block(fn: Callable[[Tensor], Tensor], x: Tensor, block_s: float) -> tuple[Callable[[], None], int]:
    """A callable running ``fn(x)`` n times, n chosen so that one block takes about ``block_s``."""
    fn(x)  # warm-up: packing, first-call allocations
    t0 = time.perf_counter()
    fn(x)
    one = max(time.perf_counter() - t0, 1e-7)
    n = max(1, min(10_000, math.ceil(block_s / one)))

    def run() -> None:
        for _ in range(n):
            fn(x)

    return run, n


def _rel_error(y: Tensor, ref: Tensor) -> float:
    return float((y.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-300))


def _shape_rows(
    group: str, tokens: int, n_in: int, n_out: int, bias: bool, kind: str, a: argparse.Namespace, seed: int
) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    hidden = n_in > n_out  # the MLP's down projection: its input is the hidden activation
    x = _input(tokens, n_in, hidden, kind, g)
    w = torch.randn(n_out, n_in, generator=g) / math.sqrt(n_in)
    b = torch.randn(n_out, generator=g) * 0.1 if bias else None
    ref = x.double() @ w.double().T
    if b is not None:
        ref += b.double()

    wi = Int8Weight.from_float(w)
    fns: dict[str, Callable[[Tensor], Tensor] | str] = {
        "float32": lambda x: F.linear(x, w, b),
        "headspace int8": lambda x: int8_linear(x, wi, b),
        "headspace int8 fallback": lambda x: _forced_fallback(x, wi, b),
    }
    ao = _torchao_linear(w, b)
    fns["torchao int8 dynamic"] = NOT_INSTALLED if ao is None else ao
    fns["torch._int_mm"] = _int_mm_linear(w, b)

    rows: dict[str, dict[str, Any]] = {}
    blocks: dict[str, Callable[[], None]] = {}
    for name in CANDIDATES:
        fn = fns[name]
        row: dict[str, Any] = {
            "group": group,
            "shape": shape_label(tokens, n_in, n_out),
            "x": [tokens, n_in],
            "weight": [n_out, n_in],
            "bias": bias,
            "candidate": name,
        }
        rows[name] = row
        if isinstance(fn, str):
            row["status"] = fn
            continue
        try:
            y = fn(x)
        except Exception as e:  # e.g. a kernel's shape limits
            row["status"] = f"cannot run: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            continue
        row["status"] = "ok"
        row["max_rel_error"] = _rel_error(y, ref)
        blocks[name], row["calls_per_timing"] = _block(fn, x, a.block_ms / 1e3)
    times = round_robin(blocks, a.rounds)
    for name, ts in times.items():
        per_call = [1e3 * t / rows[name]["calls_per_timing"] for t in ts]
        s = spread(per_call)
        rows[name].update(
            {"median_ms": s["median"], "min_ms": s["min"], "max_ms": s["max"], "times_ms": per_call}
        )
    base = rows["float32"]["median_ms"]
    for row in rows.values():
        if row["status"] == "ok":
            row["speed_vs_float32"] = base / row["median_ms"]
    return list(rows.values())


def conclusion(group: str, rows: list[dict[str, Any]]) -> str:
    """Which candidate is fastest on the group's shapes (medians), and each one's speed range vs float32."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    wins: dict[str, int] = {}
    for shape in shapes:
        ok = [r for r in rows if r["shape"] == shape and r["status"] == "ok"]
        best = min(ok, key=lambda r: r["median_ms"])["candidate"]
        wins[best] = wins.get(best, 0) + 1
    order = sorted(wins, key=lambda c: (-wins[c], CANDIDATES.index(c)))
    said = ", ".join(f"{c} on {wins[c]}/{len(shapes)}" for c in order)
    ranges = []
    for c in CANDIDATES[1:]:
        ok = [r["speed_vs_float32"] for r in rows if r["candidate"] == c and r["status"] == "ok"]
        if ok:
            ranges.append(f"{c} {min(ok):.2f}-{max(ok):.2f}x")
        else:
            status = next(r["status"] for r in rows if r["candidate"] == c)
            ranges.append(f"{c} {status}")
    return f"{group}: fastest: {said} shapes; vs float32: {'; '.join(ranges)}"


def table_cells(r: dict[str, Any]) -> list[str]:
    """One printed table row (the smoke test reads the table back against the JSON with this)."""
    if r["status"] != "ok":
        return [r["shape"], r["candidate"], "-", "-", "-", "-", r["status"]]
    return [
        r["shape"],
        r["candidate"],
        f"{r['median_ms']:.3f}",
        f"{r['min_ms']:.3f}",
        f"{r['max_ms']:.3f}",
        f"{r['speed_vs_float32']:.2f}x",
        f"{r['max_rel_error']:.1e}",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--rounds", type=int, default=None, help="timed rounds per shape (default 9; 3 with --quick)"
    )
    p.add_argument(
        "--block-ms", type=float, default=None, help="ms per timing block (default 40; 2 with --quick)"
    )
    p.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run (never published)")
    add_output_options(p, "int8_kernels.json")
    a = p.parse_args(argv)
    check_output_options(p, a, "int8_kernels.json", smoke="quick")
    a.rounds = a.rounds if a.rounds is not None else (3 if a.quick else 9)
    a.block_ms = a.block_ms if a.block_ms is not None else (2.0 if a.quick else 40.0)
    if a.threads < 1 or a.rounds < 1 or a.block_ms <= 0:
        p.error("--threads, --rounds and --block-ms must be positive")
    out_path = output_path(a.out, a.save, "int8_kernels.json", RESULTS)
    torch.set_num_threads(a.threads)
    groups = QUICK_GROUPS if a.quick else GROUPS

    rows: list[dict[str, Any]] = []
    jobs = [
        (grp, tokens, n_in, n_out, bias, kind)
        for grp, tokens, dims, bias, kind in groups
        for n_in, n_out in dims
    ]
    with torch.no_grad():
        for i, (grp, tokens, n_in, n_out, bias, kind) in enumerate(tqdm(jobs, desc="shapes", unit="shape")):
            rows.extend(_shape_rows(grp, tokens, n_in, n_out, bias, kind, a, seed=i))

    print(f"\nthis CPU (headspace.kernels.cpu.report()): {report()}")
    print(f"\nint8 linear kernels vs float32 F.linear, {a.threads} thread(s), {a.rounds} rounds alternating; "
          "ms per call (median, min, max); error: max |y - ref| / max |ref|, ref in float64\n")  # fmt: skip
    print("| shape | candidate | median ms | min ms | max ms | vs float32 | max rel error |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print("| " + " | ".join(table_cells(r)) + " |")
    conclusions = [conclusion(grp, [r for r in rows if r["group"] == grp]) for grp, *_ in groups]
    print()
    for line in conclusions:
        print(line)
    doc = {
        "benchmark": "int8_kernels",
        "machine": machine_info(),
        "threads": a.threads,
        "rounds": a.rounds,
        "block_ms": a.block_ms,
        "quick": a.quick,
        "cpu": report(),
        "candidates": list(CANDIDATES),
        "rows": rows,
        "conclusions": conclusions,
    }
    write_json(out_path, doc)
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
