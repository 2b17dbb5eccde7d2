"""The attention benchmark: headspace against torch MHA, nanoGPT-style, textbook and the GEMM floor.

Every case computes the same self-attention (no mask, no dropout, float32 unless ``dtype`` says
``"bfloat16"``: then weights, input, gradients and the floor's matrices are all bfloat16) of one layer with
``d_model`` and ``n_heads`` on an input [batch, seq, d_model], in two modes:

* ``forward``: eval mode under ``torch.no_grad()``;
* ``backward``: forward then ``out.backward(grad)`` (grads of the input and of every parameter; the
  parameters' grads are set to None before each step so every step allocates them, as in training).

Cases (``CASES``):

==========================  ============================================================================
``headspace``               :class:`~headspace.MultiHeadAttention`, fast path (fused QKV + SDPA)
``headspace_idle_hooks``    the same, on a layer whose hook points had functions added and removed again
``headspace_weights``       the same layer with ``need_weights=True`` (explicit path, per-head pattern)
``torch_mha``               ``torch.nn.MultiheadAttention(batch_first=True)``, ``need_weights=False``
``torch_mha_weights``       the same with ``need_weights=True, average_attn_weights=False``
``nanogpt``                 nanoGPT-style: one ``nn.Linear`` to QKV, split, view, SDPA, ``nn.Linear`` out
``textbook``                per-head ``nn.Linear`` q/k/v, a Python loop over heads, softmax, concat, W_O
``gemm_floor``              the bare matrix products of the same shapes (see below)
==========================  ============================================================================

The GEMM floor is the time of the matrix products that any exact implementation of this layer must
do, as plain ``torch.matmul(..., out=...)`` on preallocated float32 tensors (B = batch, S = seq,
D = d_model, H = n_heads, dh = D / H)::

    forward    X[B S, D] @ W_qkv[D, 3D]         Q[B H, S, dh] @ K^T[B H, dh, S]
               P[B H, S, S] @ V[B H, S, dh]     Z[B S, D] @ W_O[D, D]
    backward   the four above, then             dY[B S, D] @ W_O^T -> dZ      Z^T @ dY -> dW_O
               dZ[B H, S, dh] @ V^T -> dP       P^T @ dZ -> dV
               dS[B H, S, S] @ K -> dQ          dS^T @ Q -> dK
               dQKV[B S, 3D] @ W_qkv^T -> dX    X^T @ dQKV -> dW_qkv

No softmax, bias, mask, reshape or allocation is in the floor: it is a lower bound on time, not an
implementation (it needs no extra memory because its buffers are built beforehand).

Timing: all cases of one (seq, mode) are built, run once to warm up, then run round-robin
``repeats`` times, so that a change in machine load touches every case alike; we report the median.
Each target's verdict is the ratio of two medians; the table and JSON add the spread of the per-round
ratios (round ``i`` of both cases ran back to back) and in how many rounds the target held, so a
verdict that a busy machine can flip is visible as such.
Peak extra memory: in a fresh subprocess per (seq, mode), each case is built and warmed up, then
the kernel's resident-set high-water mark is reset (``/proc/self/clear_refs``) and one more step is
run; the peak extra memory is the high-water mark minus the resident set before the step. glibc's
malloc is told (``MALLOC_MMAP_THRESHOLD_``) to map every block of 64 KiB or more afresh and unmap
it on free, so no case runs in memory that an earlier one left behind. headspace's per-thread
workspace (:mod:`headspace.workspace`: the fused QKV projection of large no-grad calls, and the memory
of dropped attention patterns) is released after the warm-up, so the measured step allocates it again
and its size counts. On systems without ``/proc`` the memory columns are left empty. The kernel
counts resident pages in per-CPU (older kernels: per-thread) counters that it reads approximately, so
a figure is exact only to :func:`rss_counter_slack_mib` (1.5 MiB on 2 CPUs and 2 threads), far
below the patterns the memory targets compare.

Timing runs in one process: there headspace's workspace stays allocated from call to call, which
is what it is for; between calls it keeps the QKV projection ([B S, 3D] floats) and one dropped
pattern ([B, H, S, S]).

The cases themselves (their modules, :func:`build_case`, the float64 reference) are in
:mod:`.attention_cases`, whose names this module re-exports; measuring, the targets and the table are here.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..kernels.workspace import release_thread_workspace
from .attention_cases import (
    CASES,
    GEMM_FLOOR,
    LABELS,
    MODES,
    Case,
    _dtype_name,
    build_case,
    float64_reference,
)
from .attention_cases import DTYPES as DTYPES  # re-exported: the cases are defined there
from .attention_cases import NanoGPTAttention as NanoGPTAttention
from .attention_cases import TextbookAttention as TextbookAttention
from .attention_cases import copy_weights as copy_weights
from .measure import machine_info, measure_peak_extra_mib, round_robin

#: The targets of the issue, as (description, check) pairs evaluated by :func:`check_targets`.
FAST_VS_FLOOR = {"forward": 1.05, "backward": 1.12}
WEIGHTS_VS_TORCH = 0.8
IDLE_HOOKS_TOLERANCE = 1.05


# ---------------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------------
def _memory_probe(
    cases: Sequence[str], seq: int, batch: int, d_model: int, n_heads: int, mode: str, dtype: str = "float32"
) -> dict:
    """In a fresh interpreter: peak extra MiB of each case of one (seq, mode)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    args = {
        "cases": list(cases),
        "seq": seq,
        "batch": batch,
        "d_model": d_model,
        "n_heads": n_heads,
        "mode": mode,
        "threads": torch.get_num_threads(),
        "dtype": dtype,
    }
    code = "import sys; from headspace.bench.attention import _memory_probe_main as m; m(sys.argv[1])"
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)], env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe for seq={seq} mode={mode} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _memory_probe_main(arg: str) -> None:
    """Entry point of the memory subprocess: prints one JSON line {case: MiB or None}."""
    a = json.loads(arg)
    torch.set_num_threads(a["threads"])
    out = {}
    for name in a["cases"]:
        case = build_case(
            name, seq=a["seq"], batch=a["batch"], d_model=a["d_model"], n_heads=a["n_heads"], mode=a["mode"],
            dtype=a.get("dtype", "float32"),
        )  # fmt: skip
        case.step()  # warm-up: one-time allocations (thread pools, library scratch) are not the case's
        # but headspace's per-thread workspace grows with the input, like an activation: the measured
        # step allocates it again, so the memory it keeps between calls is counted as the step's
        release_thread_workspace()
        out[name] = measure_peak_extra_mib(case.step)
        del case
        gc.collect()
    print(json.dumps(out))


def _auto_repeats(round_s: float, target_s: float = 25.0) -> int:
    """Repeats for one (seq, mode): about ``target_s`` seconds of timing, between 3 and 15."""
    return max(3, min(15, int(target_s / max(round_s, 1e-9))))


def _output_errors(built: Sequence[Case], **sizes: Any) -> dict[str, tuple[float, float]]:
    """Per case with a layer: (max |out - float64 reference|, that over max |reference|)."""
    ref = float64_reference(**sizes)
    scale = float(ref.abs().max())
    errors = {}
    for case in built:
        if case.module is None:
            continue
        err = float((case.output().double() - ref).abs().max())
        errors[case.name] = (err, err / scale)
    return errors


def run_attention_benchmark(
    seqs: Iterable[int] = (128, 512, 1024, 2048),
    *,
    batch: int = 8,
    d_model: int = 512,
    n_heads: int = 8,
    modes: Iterable[str] = MODES,
    cases: Iterable[str] = CASES,
    repeats: int | None = None,
    threads: int | None = None,
    measure_memory: bool = True,
    progress: bool = True,
    dtype: str | torch.dtype = "float32",
) -> list[dict]:
    """Time (and measure the peak extra memory of) every case at every seq and mode.

    Args:
        seqs: sequence lengths.
        batch, d_model, n_heads: the layer and input sizes (float32, d_head = d_model // n_heads).
        modes: "forward" (eval, no_grad) and/or "backward" (forward + backward).
        cases: a subset of :data:`CASES`.
        repeats: timed steps per case after one warm-up; None picks 3 to 15 by the size (about 25 s of
            timing per (seq, mode)).
        threads: ``torch.set_num_threads`` for the run (None keeps torch's setting); recorded per row.
        measure_memory: measure peak extra memory in a subprocess per (seq, mode).
        progress: show a tqdm progress bar.
        dtype: ``"float32"`` (default) or ``"bfloat16"`` (or the torch dtypes): every case and the floor
            in that dtype; recorded per row as ``dtype``.

    Returns:
        One dict per (seq, mode, case): ``case``, ``label``, ``seq``, ``mode``, ``batch``, ``d_model``,
        ``n_heads``, ``dtype``, ``threads``, ``repeats``, ``median_ms``, ``times_ms``, ``peak_extra_mib``
        (or None)
        , ``vs_floor`` (median over the GEMM floor's median, when the floor was run), and the output's
        ``max_abs_error`` / ``max_rel_error`` against :func:`float64_reference` (None for the floor).
    """
    seqs, modes, cases = [int(s) for s in seqs], list(modes), list(cases)
    dtype_name = _dtype_name(dtype)
    _check_benchmark_args(seqs, modes, cases, batch, d_model, n_heads, repeats)
    if threads is not None:
        torch.set_num_threads(threads)

    from ..core.progress import progress_bar

    groups = [(s, m) for s in seqs for m in modes]
    bar = progress_bar(total=len(groups), desc="attention benchmark", unit="group", disable=not progress)
    rows: list[dict] = []
    sizes = {"batch": batch, "d_model": d_model, "n_heads": n_heads}
    for seq, mode in groups:
        bar.set_postfix_str(f"seq={seq} {mode}")
        rows += _measure_group(cases, seq, mode, sizes, dtype_name, repeats, measure_memory)
        bar.update(1)
    bar.close()
    return rows


def _measure_group(
    cases: list[str],
    seq: int,
    mode: str,
    sizes: dict[str, int],
    dtype_name: str,
    repeats: int | None,
    measure_memory: bool,
) -> list[dict]:
    """The rows of :func:`run_attention_benchmark` for one (seq, mode), one per case, in ``cases`` order.

    ``sizes``: ``batch``, ``d_model``, ``n_heads``. The peak memory is measured first (a subprocess per
    group, when ``measure_memory``), then every case is built, timed round-robin and its output compared
    with the float64 reference.
    """
    batch, d_model, n_heads = sizes["batch"], sizes["d_model"], sizes["n_heads"]
    memory = (
        _memory_probe(cases, seq, batch, d_model, n_heads, mode, dtype_name)
        if measure_memory
        else dict.fromkeys(cases)
    )
    built = [build_case(c, seq=seq, mode=mode, dtype=dtype_name, **sizes) for c in cases]
    n, times = _time_round_robin(built, repeats)
    errors = _output_errors(built, seq=seq, dtype=dtype_name, **sizes)
    del built
    gc.collect()
    floor = statistics.median(times["gemm_floor"]) if "gemm_floor" in times else None
    n_threads = torch.get_num_threads()
    rows = []
    for name in cases:
        med = statistics.median(times[name])
        rows.append(
            {
                "case": name,
                "label": LABELS[name],
                "seq": seq,
                "mode": mode,
                **sizes,
                "dtype": dtype_name,
                "threads": n_threads,
                "repeats": n,
                "median_ms": med,
                "times_ms": times[name],
                "peak_extra_mib": memory.get(name),
                "vs_floor": None if floor is None else med / floor,
                "max_abs_error": errors.get(name, (None, None))[0],
                "max_rel_error": errors.get(name, (None, None))[1],
            }
        )
    return rows


def _check_benchmark_args(
    seqs: list[int],
    modes: list[str],
    cases: list[str],
    batch: int,
    d_model: int,
    n_heads: int,
    repeats: int | None,
) -> None:
    """``ValueError`` naming the argument unless modes and cases are non-empty subsets of :data:`MODES`
    and :data:`CASES`, the sizes and seqs positive ints (at least one seq), ``n_heads`` divides
    ``d_model`` and ``repeats`` is None or a positive int."""
    for name, values, known in (("modes", modes, MODES), ("cases", cases, CASES)):
        bad = [v for v in values if v not in known]
        if bad or not values:
            raise ValueError(f"{name} must be a non-empty subset of {list(known)}; got {values}")
    for name, value in (
        ("batch", batch),
        ("d_model", d_model),
        ("n_heads", n_heads),
        *(("seq", s) for s in seqs),
    ):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int; got {value!r}")
    if not seqs:
        raise ValueError("seqs must name at least one sequence length; got none")
    if d_model % n_heads != 0:
        raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
    if repeats is not None and (not isinstance(repeats, int) or repeats < 1):
        raise ValueError(f"repeats must be a positive int or None; got {repeats!r}")


def _time_round_robin(built: list[Case], repeats: int | None) -> tuple[int, dict[str, list[float]]]:
    """One warm-up step of every case, then ``repeats`` rounds (None: picked by the warm-up's time, see
    :func:`_auto_repeats`) of :func:`~.measure.round_robin`, so that a change of load touches every case
    alike. Returns the rounds and each case's step times in ms, in round order."""
    t0 = time.perf_counter()
    for case in built:
        case.step()  # warm-up
    n = repeats if repeats is not None else _auto_repeats(time.perf_counter() - t0)
    seconds = round_robin({c.name: c.step for c in built}, n)
    return n, {name: [t * 1e3 for t in ts] for name, ts in seconds.items()}


# ---------------------------------------------------------------------------------------------------
# Targets and the table
# ---------------------------------------------------------------------------------------------------
def _round_ratios(num: dict, den: dict, limit: float) -> dict:
    """Per-round ratios of two rows timed side by side (round ``i`` of both ran back to back).

    The verdict stays the ratio of medians; these say how far one round's load moved it:
    ``round_min``, ``round_median`` and ``round_max`` of ``num[i] / den[i]``, and ``rounds_met``,
    how many of the ``rounds`` were within ``limit``. Empty when the rows hold no aligned times.
    """
    a, b = num.get("times_ms"), den.get("times_ms")
    if not a or not b or len(a) != len(b):  # rows not timed side by side (hand-made or partial)
        return {}
    ratios = [x / y for x, y in zip(a, b)]
    return {
        "round_min": min(ratios),
        "round_median": statistics.median(ratios),
        "round_max": max(ratios),
        "rounds_met": sum(x <= limit for x in ratios),
        "rounds": len(ratios),
    }


def check_targets(rows: Sequence[dict]) -> list[dict]:
    """Evaluate the issue's targets on ``rows``; one dict per check.

    Every check has ``target``, ``seq``, ``mode``, ``value`` (the ratio of medians), ``limit`` and ``ok``
    (value <= limit). Time checks add the spread of the per-round ratios (see :func:`_round_ratios`):
    on a busy machine one verdict can flip from run to run, and the spread shows by how much.
    """
    by = {(r["case"], r["seq"], r["mode"]): r for r in rows}
    checks: list[dict] = []

    def add(
        target: str, seq: int, mode: str, value: float, limit: float, pair: tuple[dict, dict] | None = None
    ) -> None:
        check = {
            "target": target,
            "seq": seq,
            "mode": mode,
            "value": value,
            "limit": limit,
            "ok": value <= limit,
        }
        check.update(_round_ratios(*pair, limit) if pair is not None else {})
        checks.append(check)

    for (case, seq, mode), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        if case != "headspace":
            continue
        fl, nano = by.get(("gemm_floor", seq, mode)), by.get(("nanogpt", seq, mode))
        idle = by.get(("headspace_idle_hooks", seq, mode))
        if seq >= 512 and fl is not None:
            add(
                "fast path / GEMM floor",
                seq,
                mode,
                r["median_ms"] / fl["median_ms"],
                FAST_VS_FLOOR[mode],
                (r, fl),
            )
        if seq >= 512 and nano is not None:
            add("fast path / nanoGPT-style", seq, mode, r["median_ms"] / nano["median_ms"], 1.0, (r, nano))
        if idle is not None:
            add(
                "idle hook points / fast path",
                seq,
                mode,
                idle["median_ms"] / r["median_ms"],
                IDLE_HOOKS_TOLERANCE,
                (idle, r),
            )
    for (case, seq, mode), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        torch_w = by.get(("torch_mha_weights", seq, mode))
        if case != "headspace_weights" or seq < 1024 or torch_w is None:
            continue
        add(
            "need_weights time / torch MHA's",
            seq,
            mode,
            r["median_ms"] / torch_w["median_ms"],
            WEIGHTS_VS_TORCH,
            (r, torch_w),
        )
        if r["peak_extra_mib"] is not None and torch_w["peak_extra_mib"]:
            add(
                "need_weights memory / torch MHA's",
                seq,
                mode,
                r["peak_extra_mib"] / torch_w["peak_extra_mib"],
                1.0,
            )
    return checks


def format_table(rows: Sequence[dict], *, targets: bool = True) -> str:
    """A plain-text (Markdown) table per mode: median ms, x GEMM floor and peak extra MiB per seq; then
    each layer's output accuracy against float64 (rows of the first mode that has it)."""
    if not rows:
        return "(no benchmark rows)"
    lines: list[str] = []
    seqs = sorted({r["seq"] for r in rows})
    by = {(r["case"], r["seq"], r["mode"]): r for r in rows}
    first = rows[0]
    for mode in [m for m in MODES if any(r["mode"] == m for r in rows)]:
        title = "forward (eval, no_grad)" if mode == "forward" else "forward + backward"
        lines.append(
            f"{title}: batch={first['batch']}, d_model={first['d_model']}, n_heads={first['n_heads']}, "
            f"{first.get('dtype', 'float32')}, {first['threads']} threads; "
            "median ms (x GEMM floor) / peak extra MiB"
        )
        lines.append("")
        lines.append("| case | " + " | ".join(f"seq {s}" for s in seqs) + " |")
        lines.append("|---|" + "---:|" * len(seqs))
        for case in [c for c in CASES if any(r["case"] == c and r["mode"] == mode for r in rows)]:
            cells = []
            for s in seqs:
                r = by.get((case, s, mode))
                if r is None:
                    cells.append("")
                    continue
                cell = f"{r['median_ms']:.1f}"
                if r["vs_floor"] is not None and case != "gemm_floor":
                    cell += f" ({r['vs_floor']:.2f}x)"
                if r["peak_extra_mib"] is not None:
                    cell += f" / {r['peak_extra_mib']:.0f}"
                cells.append(cell)
            lines.append(f"| {LABELS[case]} | " + " | ".join(cells) + " |")
        lines.append("")
    accurate = [c for c in CASES if any(r["case"] == c and r.get("max_abs_error") is not None for r in rows)]
    if accurate:
        mode = next(r["mode"] for r in rows if r.get("max_abs_error") is not None)
        lines.append(
            f"output accuracy ({first.get('dtype', 'float32')}): max abs error against the same layer in "
            "float64 on the same weights and input (relative to max |output|)"
        )
        lines.append("")
        lines.append("| case | " + " | ".join(f"seq {s}" for s in seqs) + " |")
        lines.append("|---|" + "---:|" * len(seqs))
        for case in accurate:
            cells = []
            for s in seqs:
                r = by.get((case, s, mode))
                ok = r is not None and r.get("max_abs_error") is not None
                cells.append(f"{r['max_abs_error']:.1e} ({r['max_rel_error']:.1e})" if ok else "")
            lines.append(f"| {LABELS[case]} | " + " | ".join(cells) + " |")
        lines.append("")
    if targets:
        checks = check_targets(rows)
        if checks:
            lines.append("| target | seq | mode | measured | limit | met | per round: min-max, met |")
            lines.append("|---|---:|---|---:|---:|---|---|")
            for c in checks:
                spread = ""
                if "rounds" in c:
                    spread = f"{c['round_min']:.2f}-{c['round_max']:.2f}, {c['rounds_met']} of {c['rounds']}"
                lines.append(
                    f"| {c['target']} | {c['seq']} | {c['mode']} | {c['value']:.3f} | {c['limit']:.2f} | "
                    f"{'yes' if c['ok'] else 'NO'} | {spread} |"
                )
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def write_json(rows: Sequence[dict], path: str | os.PathLike[str], *, extra: dict | None = None) -> None:
    """Write rows, machine info, the floor's definition and the target checks as JSON, atomically."""
    doc = {
        "benchmark": "attention",
        "machine": machine_info(),
        "gemm_floor": GEMM_FLOOR,
        "rows": list(rows),
        "targets": check_targets(rows),
        **(extra or {}),
    }
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
