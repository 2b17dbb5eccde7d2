"""Gemma-3-270M: headspace against transformers, side by side: load, memory, decode, prefill.

    python benchmarks/gemma3.py [--rounds 3] [--new-tokens 32] [--prefill 2048] [--save]

* **load**: ``headspace.load("gemma3")`` (the four chunk packages, SHA-256 checked) and transformers'
  ``Gemma3ForCausalLM.from_pretrained(folder, gguf_file=...)`` on the same file concatenated, each in a
  fresh process; seconds, and the resident memory the load added (RSS after the load minus RSS after the
  imports) against the float32 weights' bytes.
* **decode**: greedy tokens/s of ``generate`` after a short prompt at batch 1 and batch 8 (float32, both
  models in this process, rotating rounds, medians).
* **prefill**: seconds to run a 2,048-token prompt and produce the next token (``generate`` of 1 token).

Prints a table and writes JSON (``benchmarks/results/local/gemma3.json``; ``--save``:
``benchmarks/results/gemma3.json``). ``--quick`` is a smoke run (1 round, 4 tokens, prefill 64, no
transformers load in a child).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from headspace.bench.measure import machine_info, read_status_kib, spread
from headspace.bench.scripts import add_output_options, check_output_options, check_positive, output_path
from headspace.decode.loop import choose_unembed_q8
from headspace.pretrained.gguf import assemble_gemma3_gguf

RESULTS = Path(__file__).resolve().parent / "results"
NAME = "gemma3.json"
os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF dequantisation draws its own bar
PROMPT = "The history of the city begins in the year"


def _rss_mib() -> float:
    return (read_status_kib("VmRSS") or 0) / 1024


def _child_load(which: str, path: str) -> dict[str, Any]:
    """In a fresh process: load one model, report seconds and resident memory."""
    import headspace

    if which == "hf":
        import transformers

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    before = _rss_mib()
    start = time.perf_counter()
    if which == "headspace":
        model = headspace.load("gemma3").model
    else:
        p = Path(path)
        model = transformers.Gemma3ForCausalLM.from_pretrained(
            str(p.parent), gguf_file=p.name, dtype=torch.float32, attn_implementation="eager"
        )
    seconds = time.perf_counter() - start
    after = _rss_mib()
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}
    weights = sum(unique.values())  # a tied unembedding counted once
    return {"seconds": seconds, "rss_added_mib": after - before, "weights_mib": weights / 2**20}


def _load_in_child(which: str, path: Path, threads: int) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = [sys.executable, __file__, "--child", which, "--path", str(path), "--threads", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def measure(ours: Any, hf: Any, *, rounds: int, new_tokens: int, prefill: int) -> dict[str, dict[str, Any]]:
    """Decode (batch 1 and 8) and prefill, headspace's ``ours`` (a loaded Gemma 3) beside transformers'
    ``hf`` on the same weights, in rotating rounds: tokens/s, medians and spread, same tokens or not."""
    prompt = ours.tokenizer.pad(ours.tokenizer.encode_ids([PROMPT]), side="left")[0]  # [1, seq]
    long_ids = torch.randint(1000, 200000, (1, prefill), generator=torch.Generator().manual_seed(0))
    long_ids[0, 0] = 2  # BOS
    cases: dict[str, dict[str, Any]] = {}
    with torch.no_grad():
        for batch in (1, 8):
            ids = prompt.expand(batch, -1).contiguous()  # [batch, seq]
            times: dict[str, list[float]] = {"headspace": [], "hf": []}
            check = {}
            ours.model.generate(ids, 2, temperature=0)  # warm-up, unmeasured (finds the Q8_0 blocks once)
            hf.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)
            for _ in range(rounds):
                for who in ("headspace", "hf"):
                    start = time.perf_counter()
                    if who == "headspace":
                        out = ours.model.generate(ids, new_tokens, temperature=0)
                    else:
                        out = hf.generate(
                            ids,
                            max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens,
                            do_sample=False,
                        )
                    times[who].append(time.perf_counter() - start)
                    check[who] = out
            tokens = batch * new_tokens
            cases[f"decode_b{batch}"] = {
                who: {"tokens_per_s": tokens / statistics.median(t), **spread(t)} for who, t in times.items()
            }
            cases[f"decode_b{batch}"]["same_tokens"] = bool(torch.equal(check["headspace"], check["hf"]))
            q8 = choose_unembed_q8(ours.model, batch) is not None
            cases[f"decode_b{batch}"]["headspace_unembedding"] = "q8_0 blocks" if q8 else "float32"
        times = {"headspace": [], "hf": []}
        for _ in range(rounds):
            for who in ("headspace", "hf"):
                start = time.perf_counter()
                if who == "headspace":
                    ours.model.generate(long_ids, 1, temperature=0)
                else:
                    hf.generate(long_ids, max_new_tokens=1, do_sample=False)
                times[who].append(time.perf_counter() - start)
        cases[f"prefill_{prefill}"] = {who: spread(t) for who, t in times.items()}

    return cases


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, never published")
    parser.add_argument("--child", choices=["headspace", "hf"], help=argparse.SUPPRESS)
    parser.add_argument("--path", default="", help=argparse.SUPPRESS)
    add_output_options(parser, NAME)
    args = parser.parse_args(argv)
    check_output_options(parser, args, NAME, smoke="quick")
    check_positive(parser, args, ["rounds", "new_tokens", "prefill", "threads"])
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(_child_load(args.child, args.path)))
        return
    if args.quick:
        args.rounds, args.new_tokens, args.prefill = 1, 4, 64

    import transformers

    import headspace
    from headspace.kernels import native

    if not args.quick:
        native.build()  # before any timing: the native step and q8_0_mm (else a first call builds it)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    folder = Path(tempfile.mkdtemp(prefix="gemma3-bench-"))
    try:
        path = assemble_gemma3_gguf(folder)
        loads: dict[str, list[dict[str, Any]]] = {"headspace": [], "hf": []}
        for _ in range(1 if args.quick else args.rounds):
            loads["headspace"].append(_load_in_child("headspace", path, args.threads))
        if not args.quick:
            loads["hf"].append(_load_in_child("hf", path, args.threads))  # ~1 minute: once
        ours = headspace.load("gemma3")
        hf = transformers.Gemma3ForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    cases = measure(ours, hf, rounds=args.rounds, new_tokens=args.new_tokens, prefill=args.prefill)
    load = {
        who: {
            "seconds": spread([r["seconds"] for r in rs]),
            "rss_added_mib": statistics.median(r["rss_added_mib"] for r in rs),
            "weights_mib": rs[0]["weights_mib"],
        }
        for who, rs in loads.items()
        if rs
    }
    result = {
        "benchmark": "gemma3",
        "machine": machine_info(),
        "threads": args.threads,
        "rounds": args.rounds,
        "new_tokens": args.new_tokens,
        "load": load,
        "cases": cases,
        "native": native.status(),
    }
    print(
        f"Gemma-3-270M, {args.threads} threads, {args.rounds} rounds, medians "
        f"(load average {os.getloadavg()[0]:.1f})"
    )
    print(f"{'case':<16} {'headspace':>12} {'transformers':>13} {'ratio':>7}")
    for who_case, r in load.items():
        mem = r["rss_added_mib"] / r["weights_mib"]
        print(
            f"load {who_case:<11} {r['seconds']['median']:>10.2f} s   memory {mem:.2f}x the float32 weights"
        )
    for name, r in cases.items():
        if name.startswith("decode"):
            a, b = r["headspace"]["tokens_per_s"], r["hf"]["tokens_per_s"]
            print(
                f"{name:<16} {a:>8.1f} tok/s {b:>8.1f} tok/s {a / b:>6.2f}x  same tokens: {r['same_tokens']}"
            )
        else:
            a, b = r["headspace"]["median"], r["hf"]["median"]
            print(f"{name:<16} {a:>10.2f} s {b:>11.2f} s {b / a:>6.2f}x")
    out = output_path(args.out, args.save, NAME, RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
