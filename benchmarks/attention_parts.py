"""Where the attention layer's time above the GEMM floor goes: the layer, its SDPA kernel and the floor's
two halves, side by side.

``benchmarks/attention.py`` compares headspace's fast path with the GEMM floor (the bare matrix products
of one layer; the definition is in :mod:`headspace.bench.attention`). This script splits both in two:

* ``layer``: :class:`headspace.MultiHeadAttention` (fast path: fused QKV projection, SDPA, W_O);
* ``sdpa``: ``F.scaled_dot_product_attention`` alone on q, k, v [batch, n_heads, seq, d_head], the
  kernel the layer runs (torch's CPU flash attention; its backward recomputes the scores and softmax);
* ``sdpa math``: the same call on torch's math backend (``sdpa_kernel(SDPBackend.MATH)``: the scores and
  the softmax written out and saved for the backward, which so recomputes nothing);
* ``attention GEMMs``: the floor's products inside SDPA: ``Q K^T`` and ``P V`` forward, ``dZ V^T``,
  ``P^T dZ``, ``dS K`` and ``dS^T Q`` backward (``torch.matmul(..., out=...)``, preallocated);
* ``projection GEMMs``: the floor's products outside it: ``X W_qkv`` and ``Z W_O`` forward, their two
  input and two weight gradients backward;
* ``GEMM floor``: both halves in one call (what ``benchmarks/attention.py`` calls the floor).

Then ``sdpa / attention GEMMs`` is what the attention kernel costs over its products, and ``(layer - sdpa)
/ projection GEMMs`` what everything else costs over its products (reshapes, bias, the gradient's
concatenation), and ``(sdpa + projection GEMMs) / floor`` the least the layer could take over the floor
with that SDPA kernel if everything else were free. All cases of one (seq, mode) take turns in each
round (``headspace.bench.round_robin``); the table gives medians in ms with min-max over the rounds.

    python benchmarks/attention_parts.py                      # seq 512 1024, batch 8, d_model 512, 8 heads
    python benchmarks/attention_parts.py --dtype bfloat16
    python benchmarks/attention_parts.py --quick              # tiny: a smoke run
    python benchmarks/attention_parts.py --save               # publish: results/attention_parts.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

from headspace import MultiHeadAttention
from headspace.bench import machine_info
from headspace.bench.measure import round_robin
from headspace.bench.scripts import add_output_options, check_output_options, check_positive, output_path
from headspace.core.fileio import write_json

RESULTS = Path(__file__).resolve().parent / "results"
CASES = ("layer", "sdpa", "sdpa math", "attention GEMMs", "projection GEMMs", "GEMM floor")
MODES = ("forward", "backward")


def build(
    batch: int, seq: int, d_model: int, n_heads: int, mode: str, dtype: torch.dtype
) -> dict[str, Callable[[], None]]:
    """One callable per case for this shape and mode (``"backward"``: forward and backward)."""
    B, S, D, H = batch, seq, d_model, n_heads
    dh = D // H
    gen = torch.Generator().manual_seed(0)
    backward = mode == "backward"

    def r(*shape: int, grad: bool = False) -> Tensor:
        t = (torch.randn(*shape, generator=gen) * 0.1).to(dtype)
        return t.requires_grad_(grad)

    layer = MultiHeadAttention(D, H).to(dtype)
    x = r(B, S, D, grad=backward)
    dy = r(B, S, D)
    q, k, v = (r(B, H, S, dh, grad=backward) for _ in range(3))
    dz = r(B, H, S, dh)

    def run_layer() -> None:
        if backward:
            layer(x).backward(dy)
        else:
            with torch.no_grad():
                layer(x)

    def run_sdpa() -> None:
        if backward:
            F.scaled_dot_product_attention(q, k, v).backward(dz)
        else:
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v)

    def run_math() -> None:
        with sdpa_kernel(SDPBackend.MATH):
            run_sdpa()

    # the floor's products (headspace.bench.attention's definition), on preallocated tensors
    qm, kt, vm = r(B * H, S, dh), r(B * H, dh, S), r(B * H, S, dh)
    scores, zh = r(B * H, S, S), r(B * H, S, dh)
    xm, w_qkv, qkv, zo, w_o, y = r(B * S, D), r(D, 3 * D), r(B * S, 3 * D), r(B * S, D), r(D, D), r(B * S, D)
    dzh, dp, dv, dq, dk = (r(B * H, S, dh), r(B * H, S, S), r(B * H, S, dh), r(B * H, S, dh), r(B * H, S, dh))
    dym, dzm, dw_o, dqkv, dx, dw_qkv = (
        r(B * S, D),
        r(B * S, D),
        r(D, D),
        r(B * S, 3 * D),
        r(B * S, D),
        r(D, 3 * D),
    )
    km, vt = kt.transpose(1, 2), vm.transpose(1, 2)  # (B H, S, dh), (B H, dh, S): strided, as in autograd

    def attention_gemms() -> None:
        torch.matmul(qm, kt, out=scores)  # (B H, S, S)
        torch.matmul(scores, vm, out=zh)  # (B H, S, dh)
        if backward:
            torch.matmul(dzh, vt, out=dp)
            torch.matmul(scores.transpose(1, 2), dzh, out=dv)
            torch.matmul(dp, km, out=dq)
            torch.matmul(dp.transpose(1, 2), qm, out=dk)

    def projection_gemms() -> None:
        torch.matmul(xm, w_qkv, out=qkv)  # (B S, 3 D)
        torch.matmul(zo, w_o, out=y)  # (B S, D)
        if backward:
            torch.matmul(dym, w_o.t(), out=dzm)
            torch.matmul(zo.t(), dym, out=dw_o)
            torch.matmul(dqkv, w_qkv.t(), out=dx)
            torch.matmul(xm.t(), dqkv, out=dw_qkv)

    def floor() -> None:
        projection_gemms()
        attention_gemms()

    return {
        "layer": run_layer,
        "sdpa": run_sdpa,
        "sdpa math": run_math,
        "attention GEMMs": attention_gemms,
        "projection GEMMs": projection_gemms,
        "GEMM floor": floor,
    }


def summarise(times: dict[str, list[float]]) -> dict:
    """Medians, spreads and the two ratios of one (seq, mode) from its per-round seconds."""
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    out = {
        "ms": {
            name: {"median": med[name], "min": min(t) * 1e3, "max": max(t) * 1e3} for name, t in times.items()
        },
        "sdpa_over_attention_gemms": med["sdpa"] / med["attention GEMMs"],
        "rest_over_projection_gemms": (med["layer"] - med["sdpa"]) / med["projection GEMMs"],
        "layer_over_floor": med["layer"] / med["GEMM floor"],
        # the layer with everything but SDPA and the projections' products free
        "sdpa_plus_projection_gemms_over_floor": (med["sdpa"] + med["projection GEMMs"]) / med["GEMM floor"],
    }
    rounds = zip(times["layer"], times["GEMM floor"])
    per_round = [a / b for a, b in rounds]
    out["layer_over_floor_rounds"] = {"min": min(per_round), "max": max(per_round)}
    return out


def format_table(results: list[dict]) -> str:
    """One Markdown table: per (seq, mode), each case's median ms (min-max), then the ratios."""
    head = (
        "| seq | mode | "
        + " | ".join(CASES)
        + " | sdpa / its GEMMs | rest / its GEMMs | (sdpa + projection GEMMs) / floor | layer / floor |"
    )
    lines = [head, "|" + "---|" * 2 + "---:|" * (len(CASES) + 4)]
    for res in results:
        cells = [
            f"{res['ms'][c]['median']:.2f} ({res['ms'][c]['min']:.2f}-{res['ms'][c]['max']:.2f})"
            for c in CASES
        ]
        lo, hi = res["layer_over_floor_rounds"]["min"], res["layer_over_floor_rounds"]["max"]
        lines.append(
            f"| {res['seq']} | {res['mode']} | " + " | ".join(cells)
            + f" | {res['sdpa_over_attention_gemms']:.2f}x | {res['rest_over_projection_gemms']:.2f}x"
            + f" | {res['sdpa_plus_projection_gemms_over_floor']:.2f}x"
            + f" | {res['layer_over_floor']:.2f}x ({lo:.2f}-{hi:.2f}) |"
        )  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=None, help="sequence lengths (default: 512 1024)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--rounds", type=int, default=11, help="rounds; every case runs once per round")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument(
        "--quick", action="store_true", help="seq 32 64, batch 2, d_model 64, 3 rounds: a smoke run"
    )
    add_output_options(p, "attention_parts.json")
    a = p.parse_args(argv)
    check_output_options(p, a, "attention_parts.json", smoke="quick")
    check_positive(p, a, ("batch", "d_model", "n_heads", "rounds", "threads"))
    if a.quick:
        a.seq, a.batch, a.d_model, a.n_heads, a.rounds = a.seq or [32, 64], 2, 64, 4, min(a.rounds, 3)
    seqs = a.seq or [512, 1024]
    if any(s <= 0 for s in seqs) or a.d_model % a.n_heads:
        p.error(
            "--seq must be positive and --d-model divisible by --n-heads; "
            f"got {seqs}, {a.d_model}, {a.n_heads}"
        )
    suffix = "_quick" if a.quick else ("" if a.dtype == "float32" else f"_{a.dtype}")
    out = output_path(a.out, a.save, f"attention_parts{suffix}.json", RESULTS)
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    results = []
    jobs = [(s, m) for s in seqs for m in a.modes]
    for seq, mode in tqdm(jobs, desc="shapes", unit="shape"):
        fns = build(a.batch, seq, a.d_model, a.n_heads, mode, dtype)
        for fn in fns.values():  # warm-up
            fn()
        res = summarise(round_robin(fns, a.rounds))
        results.append({"seq": seq, "mode": mode, **res})
    print(
        f"\nattention layer and its parts: batch {a.batch}, d_model {a.d_model}, {a.n_heads} heads, "
        f"{a.dtype}, {a.threads} threads, {a.rounds} rounds; median ms (min-max)\n"
    )
    print(format_table(results))
    doc = {
        "benchmark": "attention_parts",
        "machine": machine_info(),
        "threads": a.threads,
        "torch": torch.__version__,
        "dtype": a.dtype,
        "batch": a.batch,
        "d_model": a.d_model,
        "n_heads": a.n_heads,
        "rounds": a.rounds,
        "quick": a.quick,
        "results": results,
    }
    write_json(out, doc)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
