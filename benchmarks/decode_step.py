"""What one decoding step costs over its matrix products: the native step against the Python step.

A cached decoding step at batch 1 is its matrix products (every weight times one row) plus everything
between them. ``benchmarks/decode.py`` times whole ``generate`` calls; this script isolates the step:
each timed step (``Stepper.logits`` on one new token, the KV caches stacked as ``generate`` makes
them) is followed at once by the step's products alone (``torch.mm`` of a preallocated row by the same
weights), and the difference of the two is the step's cost over its products, paired so that the
host's slow and fast moments cancel. Two steps take turns round by round:

* ``native``: every block in one C++ call (:mod:`headspace.kernels.native`, built first);
* ``python``: the same step run from Python (:func:`headspace.decode.python.layer_rows` per block).

Both give the same logits bit for bit (checked before timing). The table gives medians with the
quartiles of the per-step differences.

    python benchmarks/decode_step.py           # SmolLM2 (headspace.load("smollm2")), 6 rounds of 40 steps
    python benchmarks/decode_step.py --random  # a random Llama-shaped Decoder (no model package)
    python benchmarks/decode_step.py --save    # publish: benchmarks/results/decode_step.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from headspace import Decoder, ModelConfig
from headspace.bench import machine_info
from headspace.bench.scripts import add_output_options, check_output_options, check_positive, output_path
from headspace.core.fileio import write_json
from headspace.decode import Stepper, describe, generation_caches, product_weights
from headspace.decode.native import native_form
from headspace.kernels import native

RESULTS = Path(__file__).resolve().parent / "results"
STEPS = ("native", "python")


def random_decoder(layers: int) -> Decoder:
    """A small random Llama-shaped Decoder (rotary, grouped-query, RMSNorm, SwiGLU)."""
    torch.manual_seed(0)
    config = ModelConfig(
        arch="decoder", vocab_size=101, d_model=64, n_layers=layers, n_heads=4, n_kv_heads=2, d_mlp=96,
        max_seq_len=256, positions="rotary", norm_kind="rmsnorm", mlp_kind="gated", act="silu", bias=False,
    )  # fmt: skip
    return Decoder(config).eval()


def quartiles(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], q[2]


def measure(model: Decoder, prompt: torch.Tensor, steps: int, rounds: int) -> dict[str, Any]:
    """Per-step (step, products) seconds of each step kind, ``rounds`` rotating rounds of ``steps``."""
    step = describe(model)
    assert step is not None and native_form(step) is not None, "the model must have a native step"
    steppers = {kind: Stepper(step, kind) for kind in STEPS}
    weights = product_weights(model)
    rows = {w.shape[1]: torch.randn(1, w.shape[1]) for w in weights}  # (1, in) per input width

    def products() -> None:
        for w in weights:
            torch.mm(rows[w.shape[1]], w.t())  # (1, out)

    def primed() -> tuple[list, torch.Tensor]:
        caches = generation_caches(model, 1, prompt.shape[1] + steps + 1)
        model(prompt, kv_caches=caches)
        return caches, prompt[:, -1:]

    # the same logits from both, bit for bit, before anything is timed
    (ca, tok), (cb, _) = primed(), primed()
    for _ in range(3):
        a = steppers["native"].logits(tok, ca)
        assert torch.equal(a, steppers["python"].logits(tok, cb)), (
            "the native step must equal the Python step"
        )
    times: dict[str, dict[str, list[float]]] = {k: {"step": [], "products": []} for k in STEPS}
    for r in tqdm(range(rounds), desc="rounds", unit="round"):
        for kind in STEPS[r % 2 :] + STEPS[: r % 2]:
            plan = steppers[kind]
            caches, tok = primed()
            for _ in range(steps):
                t0 = time.perf_counter()
                plan.logits(tok, caches)
                t1 = time.perf_counter()
                products()
                t2 = time.perf_counter()
                times[kind]["step"].append(t1 - t0)
                times[kind]["products"].append(t2 - t1)
    return {"times": times, "n_products": len(weights)}


def summarise(times: dict[str, dict[str, list[float]]]) -> list[dict[str, Any]]:
    rows = []
    for kind in STEPS:
        step, prod = times[kind]["step"], times[kind]["products"]
        over = [1e3 * (s - p) for s, p in zip(step, prod)]
        lo, hi = quartiles(over)
        rows.append(
            {
                "step": kind,
                "step_ms": 1e3 * statistics.median(step),
                "products_ms": 1e3 * statistics.median(prod),
                "over_products_ms": statistics.median(over),
                "over_products_q1_ms": lo,
                "over_products_q3_ms": hi,
                "step_over_products": statistics.median(step) / statistics.median(prod),
                "n_steps": len(step),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--random", action="store_true", help="a random Llama-shaped Decoder, not SmolLM2")
    p.add_argument("--layers", type=int, default=4, help="layers of the --random model")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=40, help="timed steps per round and kind")
    p.add_argument("--rounds", type=int, default=6, help="rounds; the two kinds take turns in each")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    add_output_options(p, "decode_step.json")
    a = p.parse_args(argv)
    check_output_options(p, a, "decode_step.json", smoke="random")
    check_positive(p, a, ("layers", "prompt_len", "steps", "rounds", "threads"))
    out = output_path(a.out, a.save, "decode_step.json", RESULTS)
    torch.set_num_threads(a.threads)
    if not native.build():
        print(f"the native step is unavailable: {native.status()}", file=sys.stderr)
        return 1
    if a.random:
        model, name = random_decoder(a.layers), f"random Llama-shaped Decoder, {a.layers} layers"
    else:
        import headspace

        model, name = headspace.load("smollm2").model, "SmolLM2-135M-Instruct"
    prompt = torch.randint(0, model.config.vocab_size, (1, a.prompt_len))
    with torch.inference_mode():
        res = measure(model, prompt, a.steps, a.rounds)
    rows = summarise(res["times"])
    print(
        f"\n{name}: one cached step at batch 1 after a {a.prompt_len}-token prompt, each followed by its "
        f"{res['n_products']} products alone; {a.rounds} rounds x {a.steps} steps per kind, "
        f"{a.threads} threads; medians (quartiles of step - products)\n"
    )
    print("| step | ms/step | products ms | step - products ms | step / products |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        spread = f"{r['over_products_q1_ms']:.2f}-{r['over_products_q3_ms']:.2f}"
        print(
            f"| {r['step']} | {r['step_ms']:.2f} | {r['products_ms']:.2f} | {r['over_products_ms']:.2f} "
            f"({spread}) | {r['step_over_products']:.2f}x |"
        )
    doc = {
        "benchmark": "decode_step",
        "machine": machine_info(),
        "threads": a.threads,
        "torch": torch.__version__,
        "model": name,
        "prompt_len": a.prompt_len,
        "steps": a.steps,
        "rounds": a.rounds,
        "native": {"status": native.status(), "compiler": native.compiler()},
        "rows": rows,
        "times_s": res["times"],
    }
    write_json(out, doc)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
