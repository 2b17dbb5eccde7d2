"""MiniLM sentence embeddings per second: headspace, sentence-transformers, transformers' BertModel (sdpa).

All three embed the same 256 sentences of mixed length (half short, about 12 tokens; half long, about
128 tokens), in batches of the same size, float32, with the same number of threads, from text to
L2-normalised mean-pooled embeddings (tokenization included). Before timing, the script checks that
the three produce the same embeddings (max abs difference <= 1e-5). Rounds run the three side by side
in rotating order; the table quotes medians, and the per-round speedups (each round's faster reference
over that round's headspace) show how far the machine's load moved them.

    python benchmarks/encode.py                    # 256 sentences, batch 32, 2 threads, 7 rounds
    python benchmarks/encode.py --rounds 3 --threads 4
    python benchmarks/encode.py --save             # publish: benchmarks/results/encode.json

The JSON goes to benchmarks/results/local/encode.json (git-ignored) unless ``--out PATH``; only ``--save``
replaces the committed benchmarks/results/encode.json.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from headspace import load
from headspace.fileio import write_json
from headspace.pretrained import minilm_path

WORDS = (
    "the a model reads every sentence and turns it into one vector that we can compare with other vectors "
    "people often write short notes while some documents run on for many lines about history science music "
    "food travel weather markets sports cities rivers mountains language computers attention heads layers "
    "small large quick slow bright dark early late new old good bad first last next open close"
).split()
MAX_ABS = 1e-5
RESULTS = Path(__file__).resolve().parent / "results"
"""The published results (committed); runs without --save write to RESULTS / "local"."""


def output_path(out: str | None, save: bool, name: str) -> Path:
    """``--out`` as given; else ``RESULTS/name`` with ``--save``, ``RESULTS/local/name`` without."""
    if out is not None:
        return Path(out)
    return (RESULTS if save else RESULTS / "local") / name


def make_sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` sentences, half short (8-14 words) and half long (110-140 words), shuffled."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        n_words = rng.randint(8, 14) if i % 2 == 0 else rng.randint(110, 140)
        words = [rng.choice(WORDS) for _ in range(n_words)]
        text = " ".join(words)
        out.append(text[0].upper() + text[1:] + rng.choice([".", "!", "?"]))
    rng.shuffle(out)
    return out


def embed_transformers(
    tokenizer, bert, sentences: list[str], batch_size: int, max_length: int
) -> torch.Tensor:
    """sentence-transformers' recipe written out on BertModel: sort by length, pad, mean-pool, normalise."""
    order = sorted(range(len(sentences)), key=lambda i: -len(sentences[i]))
    out = torch.empty(len(sentences), bert.config.hidden_size)  # (n, d_model)
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            enc = tokenizer(
                [sentences[i] for i in rows],
                padding=True,
                truncation=True,
                max_length=max_length,
                return_tensors="pt",
            )
            states = bert(**enc).last_hidden_state  # (b, seq, d_model)
            mask = enc["attention_mask"].unsqueeze(-1).float()  # (b, seq, 1)
            mean = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # (b, d_model)
            out[rows] = F.normalize(mean, dim=1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sentences", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument(
        "--out", default=None, help="JSON output path (default: benchmarks/results/local/encode.json)"
    )
    p.add_argument("--save", action="store_true", help="publish: write benchmarks/results/encode.json")
    a = p.parse_args(argv)
    if a.save and a.out is not None:
        p.error("--save writes benchmarks/results/encode.json; give either --save or --out")
    out = output_path(a.out, a.save, "encode.json")
    for name in ("sentences", "batch_size", "threads", "rounds"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive; got {getattr(a, name)}")
    torch.set_num_threads(a.threads)

    import sentence_transformers
    import transformers

    folder = str(minilm_path())
    ours = load("minilm")
    st = sentence_transformers.SentenceTransformer(folder, device="cpu")
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    hf_bert = transformers.BertModel.from_pretrained(folder, attn_implementation="sdpa").eval()
    sentences = make_sentences(a.sentences)
    n_tokens = [len(x) for x in ours.tokenizer.encode_ids(sentences, max_length=ours.max_length)]
    short = [t for t in n_tokens if t < 64]
    long = [t for t in n_tokens if t >= 64]

    runners: dict[str, Callable[[], torch.Tensor]] = {
        "headspace": lambda: ours.encode(sentences, batch_size=a.batch_size),
        "sentence-transformers": lambda: torch.as_tensor(st.encode(sentences, batch_size=a.batch_size)),
        "transformers BertModel (sdpa)": lambda: embed_transformers(
            hf_tok, hf_bert, sentences, a.batch_size, ours.max_length
        ),
    }
    # same embeddings first (also the warm-up)
    results = {name: run() for name, run in runners.items()}
    diffs = {name: float((results[name] - results["headspace"]).abs().max()) for name in runners}
    for name, d in diffs.items():
        if d > MAX_ABS:
            print(f"error: {name} differs from headspace by {d:.2e} > {MAX_ABS}", file=sys.stderr)
            return 1

    times: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for r in tqdm(range(a.rounds), desc="rounds", unit="round"):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order every round
            t0 = time.perf_counter()
            runners[name]()
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    best_ref = min(med[n] for n in names if n != "headspace")
    rows = []
    print(
        f"\n{a.sentences} sentences ({len(short)} short, median {statistics.median(short)} tokens; "
        f"{len(long)} long, "
        f"median {statistics.median(long)} tokens), batch {a.batch_size}, {a.threads} threads, float32, "
        f"{a.rounds} rounds, torch {torch.__version__}\n"
    )
    print("| model | median s | sentences/s | headspace speedup | max abs diff vs headspace |")
    print("|---|---:|---:|---:|---:|")
    for name in names:
        rate = a.sentences / med[name]
        rows.append(
            {
                "model": name,
                "median_s": med[name],
                "times_s": times[name],
                "sentences_per_s": rate,
                "headspace_speedup": med[name] / med["headspace"],
                "max_abs_diff": diffs[name],
            }
        )
        print(
            f"| {name} | {med[name]:.3f} | {rate:.1f} | {med[name] / med['headspace']:.2f}x | "
            f"{diffs[name]:.1e} |"
        )
    speedup = best_ref / med["headspace"]
    target = 1.2
    # per round: the faster reference of that round over headspace in that round (all three ran in it)
    per_round = [
        min(times[n][r] for n in names if n != "headspace") / times["headspace"][r] for r in range(a.rounds)
    ]
    rounds_met = sum(x >= target for x in per_round)
    print(
        f"\nheadspace vs the faster reference: {speedup:.2f}x "
        f"(target >= {target}x: {'met' if speedup >= target else 'NOT met'}); per round "
        f"{min(per_round):.2f}x-{max(per_round):.2f}x, median {statistics.median(per_round):.2f}x, "
        f"target held in {rounds_met} of {a.rounds} rounds"
    )
    load_avg = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    write_json(
        out,
        {
            "benchmark": "encode",
            "sentences": a.sentences,
            "short_sentences": len(short),
            "long_sentences": len(long),
            "median_tokens_short": statistics.median(short),
            "median_tokens_long": statistics.median(long),
            "batch_size": a.batch_size,
            "threads": a.threads,
            "rounds": a.rounds,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "sentence_transformers": sentence_transformers.__version__,
            "load_average_1m": load_avg,
            "rows": rows,
            "speedup_vs_faster_reference": speedup,
            "speedup_per_round": per_round,
            "rounds_target_met": rounds_met,
            "target": target,
            "target_met": speedup >= target,
        },
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
