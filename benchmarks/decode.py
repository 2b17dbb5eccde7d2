"""Decoder per-token latency with the KV cache at positions 64 ... 1024, against full recompute.

A GPT-2-small-shaped headspace Decoder (12 layers, 12 heads, d_model 768, vocab 50257, 1024 positions,
random weights: latency does not depend on the values) decodes one token at context length ``p``:

* cached: the cache holds ``p - 1`` positions, one new token is run (its keys/values appended);
* full recompute: the whole ``p``-token sequence is run to get the same logits.

Each measurement is repeated and the median quoted; before timing, the script checks that both give
the same logits. Target: the cached step at position 1024 within 1.5x of the one at position 64.

    python benchmarks/decode.py                       # GPT-2 small shape, 2 threads
    python benchmarks/decode.py --small --repeats 5   # a smaller model, for a quick look
    python benchmarks/decode.py --save                # publish: benchmarks/results/decode.json

Sizes: ``--layers``, ``--heads``, ``--d-model``, ``--vocab`` and ``--positions`` override the shape (the
smoke test runs a tiny model). The JSON goes to benchmarks/results/local/decode.json (git-ignored) unless
``--out PATH``; only ``--save`` replaces the committed benchmarks/results/decode.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from headspace import Decoder, ModelConfig
from headspace.bench import timed
from headspace.fileio import write_json

POSITIONS = (64, 128, 256, 512, 1024)
RESULTS = Path(__file__).resolve().parent / "results"
"""The published results (committed); runs without --save write to RESULTS / "local"."""


def output_path(out: str | None, save: bool, name: str) -> Path:
    """``--out`` as given; else ``RESULTS/name`` with ``--save``, ``RESULTS/local/name`` without."""
    if out is not None:
        return Path(out)
    return (RESULTS if save else RESULTS / "local") / name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=30, help="timed cached steps per position")
    p.add_argument("--full-repeats", type=int, default=3, help="timed full recomputes per position")
    p.add_argument("--small", action="store_true", help="6 layers, d_model 384, vocab 8192 (quick look)")
    p.add_argument("--layers", type=int, default=None, help="override the number of layers")
    p.add_argument("--heads", type=int, default=None, help="override the number of heads")
    p.add_argument("--d-model", type=int, default=None, help="override d_model")
    p.add_argument("--vocab", type=int, default=None, help="override the vocabulary size")
    p.add_argument(
        "--positions",
        type=int,
        nargs="+",
        default=list(POSITIONS),
        help="context lengths (default: 64 .. 1024)",
    )
    p.add_argument(
        "--out", default=None, help="JSON output path (default: benchmarks/results/local/decode.json)"
    )
    p.add_argument("--save", action="store_true", help="publish: write benchmarks/results/decode.json")
    a = p.parse_args(argv)
    if a.save and a.out is not None:
        p.error("--save writes benchmarks/results/decode.json; give either --save or --out")
    for name in ("threads", "repeats", "full_repeats", "layers", "heads", "d_model", "vocab"):
        value = getattr(a, name)
        if value is not None and value <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive; got {value}")
    positions = sorted(set(a.positions))
    if positions[0] < 2:
        p.error(f"--positions must be >= 2 (the cache holds position - 1 tokens); got {a.positions}")
    out = output_path(a.out, a.save, "decode.json")
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    if a.small:
        shape = {"vocab_size": 8192, "d_model": 384, "n_layers": 6, "n_heads": 6}
    else:
        shape = {"vocab_size": 50257, "d_model": 768, "n_layers": 12, "n_heads": 12}  # GPT-2 small
    for key, value in (
        ("vocab_size", a.vocab),
        ("d_model", a.d_model),
        ("n_layers", a.layers),
        ("n_heads", a.heads),
    ):
        if value is not None:
            shape[key] = value
    if shape["d_model"] % shape["n_heads"]:
        p.error(f"d_model {shape['d_model']} must be divisible by the number of heads {shape['n_heads']}")
    config = ModelConfig(arch="decoder", max_seq_len=max(1024, positions[-1]), **shape)
    model = Decoder(config).eval()
    tokens = torch.randint(0, config.vocab_size, (1, positions[-1]))
    caches = model.make_kv_caches(1, positions[-1])

    def step(pos: int) -> torch.Tensor:
        for c in caches:
            c.length = pos - 1  # rewind to p - 1 cached positions (the same prefix), run token p
        return model(tokens[:, pos - 1 : pos], kv_caches=caches)

    def full(pos: int) -> torch.Tensor:
        return model(tokens[:, :pos])

    cached: dict[int, list[float]] = {pos: [] for pos in positions}
    recompute: dict[int, list[float]] = {pos: [] for pos in positions}
    with torch.inference_mode():
        model(tokens[:, : positions[-1] - 1], kv_caches=caches)  # prefill once: every position shares it
        for pos in positions:
            torch.testing.assert_close(
                step(pos)[:, -1], full(pos)[:, -1], rtol=1e-4, atol=1e-4
            )  # float32, 12 layers
        # round-robin over positions, so that load on a shared machine hits every position alike
        for r in tqdm(range(a.repeats), desc="cached rounds", unit="round"):
            for pos in positions[r % len(positions) :] + positions[: r % len(positions)]:
                cached[pos] += timed(lambda pos=pos: step(pos), 1)
        for _ in tqdm(range(a.full_repeats), desc="full-recompute rounds", unit="round"):
            for pos in positions:
                recompute[pos] += timed(lambda pos=pos: full(pos), 1)
    rows = [
        {
            "position": pos,
            "cached_ms": 1e3 * statistics.median(cached[pos]),
            "full_recompute_ms": 1e3 * statistics.median(recompute[pos]),
            "cached_times_ms": [1e3 * t for t in cached[pos]],
            "full_times_ms": [1e3 * t for t in recompute[pos]],
        }
        for pos in positions
    ]
    base = rows[0]["cached_ms"]
    first, last = positions[0], positions[-1]
    print(f"\n{config.summary()}; batch 1, float32, {a.threads} threads, torch {torch.__version__}\n")
    header = "| position | cached ms/token | full recompute ms | recompute / cached |"
    print(f"{header} cached vs position {first} |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        r["vs_position_64"] = r["cached_ms"] / base  # the name of the default run: vs the first position
        r["recompute_over_cached"] = r["full_recompute_ms"] / r["cached_ms"]
        print(
            f"| {r['position']} | {r['cached_ms']:.2f} | {r['full_recompute_ms']:.1f} | "
            f"{r['recompute_over_cached']:.1f}x | {r['vs_position_64']:.2f}x |"
        )
    ratio = rows[-1]["vs_position_64"]
    target = 1.5
    print(
        f"\nposition {last} / position {first} (cached): {ratio:.2f}x "
        f"(target <= {target}x: {'met' if ratio <= target else 'NOT met'})"
    )
    write_json(
        out,
        {
            "benchmark": "decode",
            "config": config.to_dict(),
            "positions": positions,
            "threads": a.threads,
            "repeats": a.repeats,
            "full_repeats": a.full_repeats,
            "torch": torch.__version__,
            "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "rows": rows,
            "position_1024_over_64": ratio,  # last over first position (1024 over 64 by default)
            "target": target,
            "target_met": ratio <= target,
        },
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
