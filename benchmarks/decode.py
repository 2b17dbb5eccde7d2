"""Decoder per-token latency with the KV cache at positions 64 ... 1024, against full recompute.

A GPT-2-small-shaped headspace Decoder (12 layers, 12 heads, d_model 768, vocab 50257, 1024 positions,
random weights: latency does not depend on the values) decodes one token at context length ``p``:

* cached: the cache holds ``p - 1`` positions, one new token is run (its keys/values appended);
* full recompute: the whole ``p``-token sequence is run to get the same logits.

Each measurement is repeated and the median quoted; before timing, the script checks that both give
the same logits. Target: the cached step at position 1024 within 1.5x of the one at position 64.

Then SmolLM2-135M-Instruct (``headspace.load("smollm2")``) against transformers' ``LlamaForCausalLM`` on
the same float32 weights (``from_pretrained(folder, gguf_file=..., dtype=torch.float32)``), side by side:

* load: GGUF file to a ready model, in a fresh interpreter each (seconds; the resident memory the load
  added, once done and at its peak, over the float32 weights' size);
* prefill: tokens/s of one forward over a ``--prompt-len`` (512) token prompt into a KV cache;
* decode: greedy ms/token with the KV cache at batch 1 and 8 (each library's own ``generate``:
  ``(time(n + 1 tokens) - time(1 token)) / n``, which leaves the prefill out), rounds rotating over
  the models;

At batch 8 headspace's generate packs the float32 weights for MKL's GEMM once per call (its default
there, ``prepack=None``; see headspace.kernels.prepack): the row "headspace prepack=False" decodes without,
and the script prints the packing's seconds and memory. The products alone (``torch.mm`` on the
weights as stored, nothing else) are timed for reference. At
batch 1 (and wherever the weights are not packed) "headspace" runs the native step
(headspace.kernels.native: every block in one C++ call, built before timing; the compile time is
printed), and the row "headspace native=False" the same step in Python,

and headspace at each precision (float32, bfloat16, int8): the same prefill and decode figures, and the
accuracy against float32 over ``--accuracy-tokens`` (2,000) tokens of this repository's README.md and
docs/*.md: top-1 next-token agreement and the perplexity ratio. ``--no-smollm2`` skips this part.

    python benchmarks/decode.py                       # GPT-2 small shape, 2 threads
    python benchmarks/decode.py --small --repeats 5   # a smaller model, for a quick look
    python benchmarks/decode.py --save                # publish: benchmarks/results/decode.json

Sizes: ``--layers``, ``--heads``, ``--d-model``, ``--vocab`` and ``--positions`` override the shape (the
smoke test runs a tiny model). The JSON goes to benchmarks/results/local/decode.json (git-ignored) unless
``--out PATH``; only ``--save`` replaces the committed benchmarks/results/decode.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from headspace import Decoder, ModelConfig
from headspace.bench import machine_info, read_status_kib, timed
from headspace.bench.scripts import add_output_options, check_output_options, check_positive, output_path
from headspace.core.fileio import write_json

POSITIONS = (64, 128, 256, 512, 1024)
UNPACKED = "headspace prepack=False"
"""The row of headspace's float32 model decoding without weights packed for MKL's GEMM."""
PYTHON_STEP = "headspace native=False"
"""The row of headspace's float32 model decoding with the Python step (no native step)."""
REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
"""The published results (committed); runs without --save write to RESULTS / "local"."""


#: SmolLM2 targets: load seconds, peak load memory / float32 weights, decode speedups over transformers
#: (batch -> tokens/s ratio), bfloat16 decode time / float32's at batch 1.
SMOLLM2_TARGETS = {
    "load_s": 3.0,
    "load_memory": 1.3,
    "decode_speedup": {1: 1.3, 8: 1.2},
    "bf16_over_f32": 0.6,
}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def probe_load(which: str, threads: int) -> dict:
    """In this (fresh) interpreter: load SmolLM2 with ``which`` library; seconds and memory the load added.

    Imports come first, outside the timing; ``peak_extra_mib`` is the resident-set high-water mark
    (``VmHWM``, reset to the resident set just before the load) minus the resident set before it. Not
    ``ru_maxrss``: a process started by fork + exec reports in it at least its parent's resident set at
    the fork, so a probe started from a large parent (this script after its GPT-2 table, a test session)
    read 913 MiB where the load itself peaks at ~620.
    """
    torch.set_num_threads(threads)
    import headspace
    from headspace.pretrained.gguf_format import smollm2_gguf_path

    path = smollm2_gguf_path()
    if which == "transformers":
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _rss_mib()
    t0 = time.perf_counter()
    if which == "headspace":
        model = headspace.load("smollm2").model
    else:
        model = transformers.LlamaForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
    load_s = time.perf_counter() - t0
    peak = (read_status_kib("VmHWM") or 0) / 1024
    params = sum(p.numel() for p in model.parameters())
    return {
        "load_s": load_s,
        "peak_extra_mib": peak - before,
        "rss_extra_mib": _rss_mib() - before,
        "weights_mib": params * 4 / 2**20,
        "parameters": params,
    }


def _load_in_subprocess(which: str, threads: int) -> dict:
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import decode, json; "
    code += f"print(json.dumps(decode.probe_load({which!r}, {threads})))"
    env = dict(os.environ, TQDM_DISABLE="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"loading SmolLM2 with {which} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def accuracy_text_ids(tokenizer: Any, n_tokens: int) -> list[int]:
    """The first ``n_tokens`` + 1 token ids of README.md followed by docs/*.md (sorted by name)."""
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    text = "\n\n".join(f.read_text(encoding="utf-8") for f in files if f.is_file())
    ids = tokenizer.encode_ids([text])[0]
    if len(ids) < n_tokens + 1:
        raise ValueError(
            f"README.md + docs/*.md hold {len(ids)} tokens; --accuracy-tokens needs {n_tokens} + 1"
        )
    return ids[: n_tokens + 1]


def next_token_logits(model: Any, ids: list[int], window: int) -> torch.Tensor:
    """Logits for tokens 1 .. len(ids) - 1 from ids 0 .. len - 2, in windows of ``window`` tokens."""
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[start : min(start + window, len(ids) - 1)]])  # (1, w)
            out.append(model(chunk)[0].float())  # (w, vocab)
    return torch.cat(out)  # (n, vocab)


def accuracy_vs_float32(logits: torch.Tensor, ref: torch.Tensor, targets: torch.Tensor) -> dict:
    """Top-1 agreement with the float32 logits ``ref`` and the perplexities of ``targets`` under both."""
    nll = torch.nn.functional.cross_entropy(logits, targets)
    nll_ref = torch.nn.functional.cross_entropy(ref, targets)
    return {
        "top1_agreement": float((logits.argmax(-1) == ref.argmax(-1)).float().mean()),
        "perplexity": math.exp(float(nll)),
        "perplexity_float32": math.exp(float(nll_ref)),
        "perplexity_ratio": math.exp(float(nll - nll_ref)),
    }


def prepack_cost(model: Any, batch: int) -> dict:
    """Seconds to pack ``model``'s weights for MKL's GEMM at ``batch`` rows (what generate does once per
    call at batch >= 2), and the resident MiB the packed copy adds while it is held."""
    import gc

    from headspace.decode import describe

    gc.collect()
    before = _rss_mib()
    t0 = time.perf_counter()
    plan = describe(model, pack_rows=batch)
    seconds = time.perf_counter() - t0
    extra = _rss_mib() - before
    del plan
    gc.collect()
    return {"batch": batch, "pack_s": seconds, "extra_mib": extra}


def products_floor(pre: Any, batch: int) -> Any:
    """A call that runs only the products of one decoding step: every weight that enters an ``F.linear``
    (q/k/v fused, W_O, the MLP's, the unembedding) times ``batch`` preallocated rows, as ``torch.mm``; no
    attention, norm, rotation, cache or sampling. The time no float32 decoder that multiplies by the
    weights as they are stored can beat (at batch >= 2 MKL repacks each weight inside ``torch.mm``;
    weights packed beforehand, as headspace's generate does there, go below it)."""
    from headspace.decode import product_weights

    weights = product_weights(pre.model)
    rows = {w.shape[1]: torch.randn(batch, w.shape[1]) for w in weights}  # (batch, in) per input width

    def run() -> None:
        for w in weights:
            torch.mm(rows[w.shape[1]], w.t())  # (batch, out)

    run.n_products = len(weights)  # type: ignore[attr-defined]
    return run


def products_floor_bf16(pre: Any, batch: int) -> Any:
    """:func:`products_floor` for a ``precision="bfloat16"`` model: every product weight's packed bfloat16
    copy (:class:`headspace.kernels.bf16.BF16Weight`) times ``batch`` preallocated bfloat16 rows, by the
    oneDNN call its products run (``torch.ops.mkldnn._linear_pointwise``), nothing else: the fastest a
    bfloat16 decoder can multiply by its weights on this CPU."""
    from headspace.decode import product_weights

    weights = [w.packed for w in product_weights(pre.model)]
    widths = [w.shape[1] for w in product_weights(pre.model)]
    rows = {n: torch.randn(batch, n).to(torch.bfloat16) for n in set(widths)}  # (batch, in) per width
    linear = torch.ops.mkldnn._linear_pointwise

    def run() -> None:
        for w, n in zip(weights, widths):
            linear(rows[n], w, None, "none", [], "")  # (batch, out) bfloat16

    run.n_products = len(weights)  # type: ignore[attr-defined]
    return run


def native_build() -> dict:
    """Build (or find) the native decoding step for the timed rows, and time one compile of it from
    nothing (into a temporary folder): its status, compiler and seconds."""
    import subprocess
    import tempfile

    from headspace.kernels import native

    t0 = time.perf_counter()
    native.build()
    build_s = time.perf_counter() - t0
    cxx = native.compiler()
    compile_s = None
    if cxx is not None:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()  # the build's own compiler command, into a folder of its own
            done = subprocess.run(native._command(cxx, Path(tmp) / "probe.so"), capture_output=True)
            compile_s = None if done.returncode else time.perf_counter() - t0
    return {"status": native.status(), "compiler": cxx, "build_s": build_s, "compile_s": compile_s}


def run_smollm2(a: argparse.Namespace) -> dict:
    """SmolLM2 against transformers, and headspace at each precision (see the module docstring)."""
    import transformers

    import headspace
    from headspace.pretrained.gguf_format import smollm2_gguf_path

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    loads = {which: _load_in_subprocess(which, a.threads) for which in ("headspace", "transformers")}
    path = smollm2_gguf_path()
    models: dict[str, Any] = {
        "headspace": headspace.load("smollm2"),
        "headspace bfloat16": headspace.load("smollm2", precision="bfloat16"),
        "headspace int8": headspace.load("smollm2", precision="int8"),
    }
    hf = transformers.LlamaForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    tok = models["headspace"].tokenizer
    ids = accuracy_text_ids(tok, max(a.accuracy_tokens, a.prompt_len + 8 * a.decode_prompt))
    prompt = torch.tensor([ids[: a.prompt_len]])  # (1, prompt_len)
    decode_prompts = torch.tensor([ids[i * a.decode_prompt : (i + 1) * a.decode_prompt] for i in range(8)])

    def hs_prefill(pre: Any) -> Any:
        def run() -> None:
            caches = pre.model.make_kv_caches(1, a.prompt_len + 1)
            pre.model(prompt, kv_caches=caches)

        return run

    def hf_prefill() -> None:
        hf(prompt, use_cache=True, past_key_values=transformers.DynamicCache())

    def hs_generate(pre: Any, x: torch.Tensor, n: int, **kw: Any) -> torch.Tensor:
        return pre.model.generate(x, n, temperature=0, **kw)

    def hf_generate(x: torch.Tensor, n: int) -> torch.Tensor:
        return hf.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    # "headspace" packs its weights for MKL's GEMM at batch 8 (generate's default, prepack=None);
    # UNPACKED is the same model without (prepack=False)
    # "headspace" runs the native step where it has one (built here first), PYTHON_STEP the Python step
    native_info = native_build()
    models[UNPACKED] = models[PYTHON_STEP] = models["headspace"]
    names = ["headspace", "transformers", "headspace bfloat16", "headspace int8", UNPACKED, PYTHON_STEP]
    options = {n: {} for n in names} | {
        UNPACKED: {"prepack": False},
        PYTHON_STEP: {"native": False},
    }
    prefill = {n: hf_prefill if n == "transformers" else hs_prefill(models[n]) for n in names}
    generate = {
        n: (lambda x, k: hf_generate(x, k))
        if n == "transformers"
        else (lambda x, k, m=models[n], kw=options[n]: hs_generate(m, x, k, **kw))
        for n in names
    }
    with torch.inference_mode():
        # the same greedy tokens as transformers first (float32), and a warm-up of everything
        same = {}
        for batch in (1, 8):
            x = decode_prompts[:batch]
            ours, theirs = generate["headspace"](x, 8), generate["transformers"](x, 8)
            same[batch] = bool(torch.equal(ours, theirs))
        for n in names:
            prefill[n]()
            for batch in (1, 8):
                generate[n](decode_prompts[:batch], 2)
        floors = {b: products_floor(models["headspace"], b) for b in (1, 8)}
        floors_bf16 = {b: products_floor_bf16(models["headspace bfloat16"], b) for b in (1, 8)}
        for b in (1, 8):
            floors_bf16[b]()  # warm-up
        t_floor: dict[int, list[float]] = {1: [], 8: []}
        t_floor_bf16: dict[int, list[float]] = {1: [], 8: []}
        t_prefill: dict[str, list[float]] = {n: [] for n in names}
        t_decode: dict[tuple[str, int], list[float]] = {(n, b): [] for n in names for b in (1, 8)}
        for r in tqdm(range(a.smollm2_rounds), desc="SmolLM2 rounds", unit="round"):
            for n in names[r % len(names) :] + names[: r % len(names)]:
                t0 = time.perf_counter()
                prefill[n]()
                t_prefill[n].append(time.perf_counter() - t0)
                for batch in (1, 8):
                    x = decode_prompts[:batch]
                    t0 = time.perf_counter()
                    generate[n](x, 1)
                    t1 = time.perf_counter()
                    generate[n](x, a.decode_tokens + 1)
                    t2 = time.perf_counter()
                    t_decode[(n, batch)].append(((t2 - t1) - (t1 - t0)) / a.decode_tokens)
            for batch in (1, 8):
                t0 = time.perf_counter()
                floors[batch]()
                t_floor[batch].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                floors_bf16[batch]()
                t_floor_bf16[batch].append(time.perf_counter() - t0)
        # accuracy of each precision against float32 on the README + docs text
        acc_ids = ids[: a.accuracy_tokens + 1]
        targets = torch.tensor(acc_ids[1:])
        ref = next_token_logits(models["headspace"].model, acc_ids, a.prompt_len)
        hf_logits = next_token_logits(lambda t: hf(t).logits, acc_ids, a.prompt_len)
        accuracy = {"headspace": accuracy_vs_float32(ref, ref, targets)}
        accuracy["transformers"] = accuracy_vs_float32(hf_logits, ref, targets)
        for n in ("headspace bfloat16", "headspace int8"):
            accuracy[n] = accuracy_vs_float32(
                next_token_logits(models[n].model, acc_ids, a.prompt_len), ref, targets
            )
        # the same forward: packing and compiling are decoding-step matters
        accuracy[UNPACKED] = accuracy[PYTHON_STEP] = accuracy["headspace"]
        pack = prepack_cost(models["headspace"].model, 8)
    rows = []
    for n in names:
        row = {
            "model": n,
            "precision": {"headspace bfloat16": "bfloat16", "headspace int8": "int8"}.get(n, "float32"),
            "prefill_tokens_per_s": a.prompt_len / statistics.median(t_prefill[n]),
            "prefill_times_s": t_prefill[n],
            **{f"decode_ms_batch{b}": 1e3 * statistics.median(t_decode[(n, b)]) for b in (1, 8)},
            **{f"decode_times_ms_batch{b}": [1e3 * t for t in t_decode[(n, b)]] for b in (1, 8)},
            **accuracy[n],
        }
        if n in loads:
            row.update(loads[n])
        rows.append(row)
    by = {r["model"]: r for r in rows}
    T = SMOLLM2_TARGETS
    hs_load = loads["headspace"]
    checks = [
        {"target": "headspace load s", "value": hs_load["load_s"], "limit": T["load_s"],
         "met": hs_load["load_s"] <= T["load_s"]},
        {"target": "headspace resident memory after load / float32 weights",
         "value": hs_load["rss_extra_mib"] / hs_load["weights_mib"], "limit": T["load_memory"],
         "met": hs_load["rss_extra_mib"] / hs_load["weights_mib"] <= T["load_memory"]},
        {"target": "headspace peak memory during load / float32 weights",
         "value": hs_load["peak_extra_mib"] / hs_load["weights_mib"], "limit": T["load_memory"],
         "met": hs_load["peak_extra_mib"] / hs_load["weights_mib"] <= T["load_memory"]},
    ]  # fmt: skip
    steps = [("headspace", ""), (PYTHON_STEP, ", native=False")]
    for n, what in steps:
        for b, limit in T["decode_speedup"].items():
            per_round = [x / y for x, y in zip(t_decode[("transformers", b)], t_decode[(n, b)])]
            value = by["transformers"][f"decode_ms_batch{b}"] / by[n][f"decode_ms_batch{b}"]
            checks.append(
                {"target": f"decode tokens/s over transformers', batch {b}{what}", "value": value,
                 "limit": limit, "met": value >= limit, "round_min": min(per_round),
                 "round_max": max(per_round), "rounds_met": sum(x >= limit for x in per_round),
                 "rounds": len(per_round)}
            )  # fmt: skip
    per_round = [x / y for x, y in zip(t_decode[("headspace bfloat16", 1)], t_decode[("headspace", 1)])]
    value = by["headspace bfloat16"]["decode_ms_batch1"] / by["headspace"]["decode_ms_batch1"]
    checks.append(
        {"target": "bfloat16 decode ms/token / float32's, batch 1", "value": value,
         "limit": T["bf16_over_f32"], "met": value <= T["bf16_over_f32"], "round_min": min(per_round),
         "round_max": max(per_round), "rounds_met": sum(x <= T["bf16_over_f32"] for x in per_round),
         "rounds": len(per_round)}
    )  # fmt: skip
    print(
        f"\nSmolLM2-135M-Instruct (GGUF, float32 weights {hs_load['weights_mib']:.0f} MiB), "
        f"{a.threads} threads, prefill {a.prompt_len} tokens, decode {a.decode_tokens} greedy tokens after "
        f"{a.decode_prompt}-token prompts, {a.smollm2_rounds} rounds; greedy tokens equal transformers': "
        f"batch 1 {same[1]}, batch 8 {same[8]}\n"
    )
    print(
        "| model | load s | MiB after load (x weights) | peak MiB in load (x weights) | prefill tokens/s | "
        "decode ms/token b1 | decode ms/token b8 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows[:2]:
        after, peak = r["rss_extra_mib"] / r["weights_mib"], r["peak_extra_mib"] / r["weights_mib"]
        print(
            f"| {r['model']} | {r['load_s']:.2f} | {r['rss_extra_mib']:.0f} ({after:.2f}x) | "
            f"{r['peak_extra_mib']:.0f} ({peak:.2f}x) | {r['prefill_tokens_per_s']:.0f} | "
            f"{r['decode_ms_batch1']:.2f} | {r['decode_ms_batch8']:.2f} |"
        )
    print(
        f"\nheadspace at each precision: accuracy against float32 over {a.accuracy_tokens} tokens of "
        "README.md + docs/*.md\n"
    )
    print(
        "| model | precision | prefill tokens/s | decode ms/token b1 | decode ms/token b8 | "
        "top-1 agreement | perplexity | perplexity ratio |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['precision']} | {r['prefill_tokens_per_s']:.0f} | "
            f"{r['decode_ms_batch1']:.2f} | {r['decode_ms_batch8']:.2f} | {r['top1_agreement']:.4f} | "
            f"{r['perplexity']:.3f} | "
            f"{r['perplexity_ratio']:.4f} |"
        )
    floor_ms = {b: 1e3 * statistics.median(t_floor[b]) for b in (1, 8)}
    over = {
        (n, b): by[n][f"decode_ms_batch{b}"] / floor_ms[b]
        for n in ("headspace", "transformers")
        for b in (1, 8)
    }
    print(
        f"\nthe products alone ({floors[1].n_products} float32 matrix products per token, nothing else): "
        + "; ".join(
            f"batch {b} {floor_ms[b]:.2f} ms, headspace {over[('headspace', b)]:.2f}x that, "
            f"transformers {over[('transformers', b)]:.2f}x"
            for b in (1, 8)
        )
    )
    floor_bf16_ms = {b: 1e3 * statistics.median(t_floor_bf16[b]) for b in (1, 8)}
    print(
        f"the bfloat16 products alone ({floors_bf16[1].n_products} one-row oneDNN products on the packed "
        "bfloat16 weights, nothing else): "
        + "; ".join(
            f"batch {b} {floor_bf16_ms[b]:.2f} ms, "
            f"{floor_bf16_ms[b] / floor_ms[b]:.2f}x the float32 products'"
            for b in (1, 8)
        )
    )
    print(
        f"packing the weights for MKL's GEMM at batch 8 (generate's default there): {pack['pack_s']:.2f} s "
        f"once per generate call, {pack['extra_mib']:.0f} MiB more while it runs "
        f"({pack['extra_mib'] / hs_load['weights_mib']:.2f}x the float32 weights)"
    )
    compiled_in = native_info["compile_s"]
    print(
        f"the native decoding step (headspace.kernels.native): {native_info['status']}; compiling it "
        + ("failed" if compiled_in is None else f"takes {compiled_in:.1f} s")
        + f" ({native_info['compiler']}, once per machine; this run found it in "
        f"{native_info['build_s']:.2f} s)"
    )
    print()
    for c in checks:
        spread = (
            f"; per round {c['round_min']:.2f}-{c['round_max']:.2f}, "
            f"held in {c['rounds_met']} of {c['rounds']}"
            if "rounds" in c
            else ""
        )
        verdict = "met" if c["met"] else "NOT met"
        print(f"{c['target']}: {c['value']:.2f} (limit {c['limit']}: {verdict}){spread}")
    return {
        "model": "SmolLM2-135M-Instruct",
        "prompt_len": a.prompt_len,
        "decode_tokens": a.decode_tokens,
        "decode_prompt": a.decode_prompt,
        "accuracy_tokens": a.accuracy_tokens,
        "rounds": a.smollm2_rounds,
        "same_greedy_tokens": {str(b): v for b, v in same.items()},
        "prepack_batch8": pack,
        "native": native_info,
        "products_floor_ms": {str(b): v for b, v in floor_ms.items()},
        "products_floor_times_ms": {str(b): [1e3 * t for t in t_floor[b]] for b in (1, 8)},
        "products_floor_bf16_ms": {str(b): v for b, v in floor_bf16_ms.items()},
        "products_floor_bf16_times_ms": {str(b): [1e3 * t for t in t_floor_bf16[b]] for b in (1, 8)},
        "rows": rows,
        "targets": checks,
        "transformers": transformers.__version__,
    }


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
    add_output_options(p, "decode.json")
    p.add_argument("--no-smollm2", action="store_true", help="only the GPT-2-shaped table")
    p.add_argument("--smollm2-only", action="store_true", help="only SmolLM2 against transformers")
    p.add_argument("--prompt-len", type=int, default=512, help="SmolLM2 prefill prompt (tokens)")
    p.add_argument("--decode-tokens", type=int, default=32, help="SmolLM2 greedy tokens timed per round")
    p.add_argument("--decode-prompt", type=int, default=32, help="SmolLM2 prompt length before decoding")
    p.add_argument("--accuracy-tokens", type=int, default=2000, help="README + docs tokens for accuracy")
    p.add_argument("--smollm2-rounds", type=int, default=5, help="SmolLM2 timing rounds")
    a = p.parse_args(argv)
    check_output_options(p, a, "decode.json")
    if a.no_smollm2 and a.smollm2_only:
        p.error("--no-smollm2 and --smollm2-only leave nothing to run; give one")
    check_positive(
        p,
        a,
        (
            "threads",
            "repeats",
            "full_repeats",
            "layers",
            "heads",
            "d_model",
            "vocab",
            "prompt_len",
            "decode_tokens",
            "decode_prompt",
            "accuracy_tokens",
            "smollm2_rounds",
        ),
    )
    positions = sorted(set(a.positions))
    if positions[0] < 2:
        p.error(f"--positions must be >= 2 (the cache holds position - 1 tokens); got {a.positions}")
    out = output_path(a.out, a.save, "decode.json", RESULTS)
    torch.set_num_threads(a.threads)
    if a.smollm2_only:
        doc = {
            "benchmark": "decode",
            "machine": machine_info(),
            "threads": a.threads,
            "torch": torch.__version__,
            "smollm2": run_smollm2(a),
        }
        doc["load_average_1m"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        write_json(out, doc)
        print(f"wrote {out}")
        return 0
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
    smollm2 = None if a.no_smollm2 else run_smollm2(a)
    write_json(
        out,
        {
            "smollm2": smollm2,
            "benchmark": "decode",
            "machine": machine_info(),
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
