"""What torch.compile buys on the models: MiniLM-sized Encoder batches and a Decoder decode step, eager vs
compiled.

Cases (random weights: speed does not depend on the values), each timed eager and compiled
(``torch.compile(fn, fullgraph=True)``, inductor) in alternating rounds, medians quoted:

* ``encoder forward``: a MiniLM-shaped Encoder (6 layers, 12 heads, d_model 384, vocab 30522) on a batch
  of ``--batch`` sentences padded to ``--seq`` tokens (lengths drawn between seq / 4 and seq, the
  key padding passed), ``model(tokens, key_padding)``;
* ``encoder infer``: the same batch through ``Encoder.infer`` (the eager fast path: fused residual adds,
  a reused workspace), against the compiled ``forward``: what compile buys over the best eager path;
* ``decoder step``: a GPT-2-small-shaped Decoder (12 layers, 12 heads, d_model 768, vocab 50257; or
  ``--decoder smollm2``: SmolLM2's shapes, rotary, GQA) decoding one token with a KV cache holding
  ``--context`` positions. The cache length is a Python int that dynamo guards on, so a compiled
  step is specialised to one length (each new length recompiles); the step is timed at one length,
  the cache rewound before each call.

Before timing, every compiled case is checked against eager (max abs diff printed). Compile times (the
first call) are reported apart.

    python benchmarks/compile.py                 # 1 thread, 5 rounds
    python benchmarks/compile.py --threads 2 --rounds 9
    python benchmarks/compile.py --save          # publish: benchmarks/results/compile.json

Small sizes for a smoke run: ``--layers``, ``--d-model``, ``--heads``, ``--vocab``, ``--batch``, ``--seq``,
``--context``, ``--backend eager`` (dynamo only, no code generation). The JSON goes to
benchmarks/results/local/compile.json unless ``--out PATH``; only ``--save`` replaces the committed
benchmarks/results/compile.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import headspace as hs
from headspace.bench import machine_info, round_robin
from headspace.bench.scripts import add_output_options, check_output_options, check_positive, output_path
from headspace.core.fileio import write_json

RESULTS = Path(__file__).resolve().parent / "results"
"""The published results (committed); runs without --save write to RESULTS / "local"."""


def _encoder(a: argparse.Namespace) -> hs.Encoder:
    config = hs.ModelConfig(
        arch="encoder", vocab_size=a.vocab or 30522, d_model=a.d_model or 384, n_layers=a.layers or 6,
        n_heads=a.heads or 12, max_seq_len=max(512, a.seq), name="MiniLM-shaped",
    )  # fmt: skip
    return hs.Encoder(config).eval()


def _decoder(a: argparse.Namespace) -> hs.Decoder:
    if a.decoder == "smollm2":
        config = hs.ModelConfig(
            arch="decoder", vocab_size=a.vocab or 49152, d_model=a.d_model or 576, n_layers=a.layers or 30,
            n_heads=a.heads or 9, n_kv_heads=3 if a.heads is None else 1,
            d_mlp=1536 if a.d_model is None else None,
            max_seq_len=max(2048, a.context + 1), positions="rotary", norm_kind="rmsnorm", mlp_kind="gated",
            act="silu", bias=False, rope_theta=100000.0, name="SmolLM2-shaped",
        )  # fmt: skip
    else:
        config = hs.ModelConfig(
            arch="decoder", vocab_size=a.vocab or 50257, d_model=a.d_model or 768, n_layers=a.layers or 12,
            n_heads=a.heads or 12, max_seq_len=max(1024, a.context + 1), name="GPT-2-small-shaped",
        )  # fmt: skip
    return hs.Decoder(config).eval()


def _compile(fn: Callable[[], Any], backend: str) -> tuple[Callable[[], Any], float, Any]:
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    t0 = time.perf_counter()
    out = compiled()
    return compiled, time.perf_counter() - t0, out


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _encoder_rows(a: argparse.Namespace, compile_s: dict[str, float]) -> list[dict[str, Any]]:
    """Encoder forward and infer, eager, against the compiled forward (padded MiniLM-sized batch)."""
    enc = _encoder(a)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, enc.config.vocab_size, (a.batch, a.seq), generator=g)
    lengths = torch.randint(max(1, a.seq // 4), a.seq + 1, (a.batch,), generator=g)
    pad = torch.arange(a.seq)[None, :] < lengths[:, None]  # (batch, seq): right padding
    pad[0] = True  # one full row: the longest sentence of the batch

    def forward() -> torch.Tensor:
        return enc(tokens, key_padding=pad)

    def infer() -> torch.Tensor:
        return enc.infer(tokens, key_padding=pad)

    want = forward()
    compiled, compile_s["encoder forward"], got = _compile(forward, a.backend)
    real = pad[:, :, None]  # padded rows are free to differ (infer leaves them as they come)
    diffs = {"forward": _diff(got, want), "infer": _diff(infer() * real, want * real)}
    times = round_robin({"eager forward": forward, "eager infer": infer, "compiled": compiled}, a.rounds)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = []
    for case, eager in (("encoder forward", "eager forward"), ("encoder infer", "eager infer")):
        rows.append(
            {
                "case": case,
                "eager_ms": 1e3 * med[eager],
                "compiled_ms": 1e3 * med["compiled"],
                "speedup": med[eager] / med["compiled"],
                "max_abs_diff": diffs[case.split()[1]],
                "times_ms": {
                    "eager": [1e3 * t for t in times[eager]],
                    "compiled": [1e3 * t for t in times["compiled"]],
                },
            }
        )
    rows[1]["note"] = "eager: Encoder.infer (the fast path); compiled: forward"
    return rows


def _decoder_row(a: argparse.Namespace, compile_s: dict[str, float]) -> dict[str, Any]:
    """One decode step with a KV cache of ``a.context`` positions, eager against compiled."""
    dec = _decoder(a)
    context = a.context
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, dec.config.vocab_size, (1, context), generator=g)
    nxt = torch.randint(0, dec.config.vocab_size, (1, 1), generator=g)
    caches = dec.make_kv_caches(1, context + 1)
    dec(prompt, kv_caches=caches)

    def step() -> torch.Tensor:
        for c in caches:
            c.length = context  # rewind: every call decodes position `context` again
        return dec(nxt, kv_caches=caches)

    want = step()
    row: dict[str, Any] = {"case": f"decoder step ({dec.config.name}, context {context})"}
    try:
        compiled, compile_s["decoder step"], got = _compile(step, a.backend)
    except Exception as e:  # e.g. rotary layers whose cos/sin memo breaks the graph
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return row
    times = round_robin({"eager": step, "compiled": compiled}, a.rounds * 4)
    med = {k: statistics.median(v) for k, v in times.items()}
    row.update(
        {
            "eager_ms": 1e3 * med["eager"],
            "compiled_ms": 1e3 * med["compiled"],
            "speedup": med["eager"] / med["compiled"],
            "max_abs_diff": _diff(got, want),
            "times_ms": {k: [1e3 * t for t in v] for k, v in times.items()},
            "note": "compiled for one cache length; a new length recompiles (KVCache.length: a Python int)",
        }
    )
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--context", type=int, default=128, help="cached positions of the decode step")
    p.add_argument("--decoder", choices=("gpt2", "smollm2"), default="gpt2")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    add_output_options(p, "compile.json")
    a = p.parse_args(argv)
    check_output_options(p, a, "compile.json")
    check_positive(p, a, ("threads", "rounds", "batch", "seq", "context"))
    out_path = output_path(a.out, a.save, "compile.json", RESULTS)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    compile_s: dict[str, float] = {}

    with torch.no_grad():
        rows = _encoder_rows(a, compile_s)
        torch._dynamo.reset()
        rows.append(_decoder_row(a, compile_s))

    print(f"\ntorch.compile(fullgraph=True, backend={a.backend!r}) vs eager, {a.threads} thread(s), "
          f"medians of {a.rounds} rounds; encoder batch {a.batch} x {a.seq} (padded)\n")  # fmt: skip
    print("| case | eager ms | compiled ms | speedup | max abs diff |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['case']} | - | - | - | {r['error']} |")
            continue
        print(f"| {r['case']} | {r['eager_ms']:.2f} | {r['compiled_ms']:.2f} | {r['speedup']:.2f}x "
              f"| {r['max_abs_diff']:.1e} |")  # fmt: skip
    for name, s in compile_s.items():
        print(f"compile time (first call), {name}: {s:.1f} s")
    doc = {
        "benchmark": "compile",
        "machine": machine_info(),
        "backend": a.backend,
        "threads": a.threads,
        "rounds": a.rounds,
        "encoder_batch": [a.batch, a.seq],
        "decoder": a.decoder,
        "context": a.context,
        "rows": rows,
        "compile_s": compile_s,
    }
    write_json(out_path, doc)
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
