"""Each precision's accuracy and speed per CPU capability: native, AVX2 emulated, generic ATen, fallbacks.

headspace chooses each reduced-precision fast path from torch's own queries (headspace.kernels.cpu):
bfloat16 products on oneDNN where it has a bfloat16 kernel, else a float32 GEMM on the bfloat16-rounded
values; int8 products on oneDNN / ``torch._int_mm`` where a probe finds them exact, else a float32 GEMM of
the quantised activations. This script runs the same measurements under five CPU settings, each in a
fresh Python process, since torch reads the emulation variables at start-up:

=================================== ===============================================================
setting                             environment of the child process
=================================== ===============================================================
native                              (none of the variables below)
AVX2 emulated                       ``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
                                    MKL_ENABLE_INSTRUCTIONS=AVX2``: an AVX2 CPU without VNNI/AVX-512
AVX2 emulated + fallbacks forced    the same and ``HEADSPACE_FORCE_FALLBACK=all``
generic ATen                        ``ATEN_CPU_CAPABILITY=default`` (ATen's generic kernels)
native, fallbacks forced            ``HEADSPACE_FORCE_FALLBACK=bf16,int8``
=================================== ===============================================================

Each child measures, at float32, bfloat16 and int8 (``headspace.load(name, precision=...)``):

* ``headspace.kernels.cpu.report()``: torch's view of the CPU and the branch each precision takes;
* all-MiniLM-L6-v2 on ``--sentences`` (256) sentences of benchmarks/encode.py's mix (half short, half
  long; batch ``--batch-size``): the minimum cosine and max abs difference of the bfloat16 and int8
  embeddings to that child's float32 ones, and the median seconds to encode them all (``--rounds``,
  the precisions taking turns);
* SmolLM2-135M-Instruct on ``--tokens`` (1,000) tokens of README.md + docs/*.md (benchmarks/decode.py's
  text and measures): top-1 next-token agreement with that child's float32 logits and the perplexity
  ratio, and the median ms per greedy token at batch 1 (``generate(..., temperature=0, native=False)``:
  the Python step, whose every product goes through the precision's kernel;
  ``(time(n + 1 tokens) - time(1 token)) / n`` with n = ``--decode-tokens``);
* int8 correct: ``F.linear(x, Int8Weight)`` at 1, 8, 64 and 512 rows (1 and 8 take the few-rows branch,
  64 and 512 the many-rows one) against ``headspace.kernels.int8.int8_linear_reference`` (float64), on
  x [rows, 576] ~ N(0, 3^2) and W [1536, 576] ~ N(0, 0.05^2): the largest error over the largest
  |output|; and, to tell the products from the quantisation, the same against the float64 product of
  the activations as the kernel quantised them, with the count of those a level apart from the
  reference's float64 quantisation (a float32 rounding on a boundary: one such value moves an output by
  up to ~1.3e-3 of the largest here, so the 1e-3 target is about one level).

The float32 rows compare each setting's float32 results with the first setting's (native by default):
float32 itself moves by rounding when the kernels change (MKL's and ATen's vector widths), and that is
the scale against which the reduced precisions' differences read. Targets, per setting: bfloat16 min
cosine >= 0.9999, int8 min cosine >= 0.995, int8 error <= 1e-3 at every row count, and <= 1e-5 against
the product of its own quantised activations (the int32 sums exact).

    python benchmarks/precision_cpus.py                     # every setting, 2 threads (~6 min when quiet)
    python benchmarks/precision_cpus.py --quick             # 32 sentences, 200 tokens, 1 round
    python benchmarks/precision_cpus.py --settings native,avx2
    python benchmarks/precision_cpus.py --save              # publish: benchmarks/results/precision_cpus.json

``--settings`` takes the keys (``native``, ``avx2``, ``avx2-fallbacks``, ``generic``,
``native-fallbacks``) or the names above, comma-separated. The JSON goes to
benchmarks/results/local/precision_cpus.json (git-ignored) unless ``--out PATH``; only ``--save`` replaces
the committed benchmarks/results/precision_cpus.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import headspace
from headspace.bench import machine_info
from headspace.bench.scripts import add_output_options, check_output_options, check_positive, output_path
from headspace.core.fileio import write_json

BENCHMARKS = Path(__file__).resolve().parent
RESULTS = BENCHMARKS / "results"
"""The published results (committed); runs without --save write to RESULTS / "local"."""

AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
#: (key, name, environment) of every CPU setting, in the order run; the first run is the float32 reference.
SETTINGS: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("native", "native", {}),
    ("avx2", "AVX2 emulated", AVX2),
    ("avx2-fallbacks", "AVX2 emulated + fallbacks forced", {**AVX2, "HEADSPACE_FORCE_FALLBACK": "all"}),
    ("generic", "generic ATen", {"ATEN_CPU_CAPABILITY": "default"}),
    ("native-fallbacks", "native, fallbacks forced", {"HEADSPACE_FORCE_FALLBACK": "bf16,int8"}),
)
#: The variables a child's environment is cleared of before its setting's own are set.
CONTROLLED = (*AVX2, "HEADSPACE_FORCE_FALLBACK")
PRECISIONS = ("float32", "bfloat16", "int8")
#: Accuracy targets: the minimum cosine of MiniLM's embeddings to float32 (benchmarks/encode.py's).
MIN_COSINE = {"bfloat16": 0.9999, "int8": 0.995}
#: int8 correct: F.linear(x, Int8Weight)'s largest error over the largest |output| of the float64 reference.
INT8_ROWS = (1, 8, 64, 512)
INT8_SHAPE = (1536, 576)  # (out, in)
INT8_MAX_REL = 1e-3
#: ... and of the float64 product of the activations as the kernel quantised them (its int32 sums exact).
INT8_SAME_MAX_REL = 1e-5
QUICK = {"sentences": 32, "tokens": 200, "rounds": 1, "decode_tokens": 4}
FULL = {"sentences": 256, "tokens": 1000, "rounds": 3, "decode_tokens": 32}


def parse_settings(text: str) -> list[tuple[str, str, dict[str, str]]]:
    """The settings named in ``text``: keys or names, comma-separated (a name may hold a comma itself:
    "native, fallbacks forced"); in the order given, each once."""
    known = {}
    for s in SETTINGS:
        known[s[0]] = known[s[1].lower()] = s
    parts = [" ".join(p.split()).lower() for p in text.split(",")]
    chosen: list[tuple[str, str, dict[str, str]]] = []
    i = 0
    while i < len(parts):
        joined = f"{parts[i]}, {parts[i + 1]}" if i + 1 < len(parts) else None
        if joined in known:  # the longer name first: "native, fallbacks forced" over "native"
            name, i = joined, i + 2
        elif parts[i] in known:
            name, i = parts[i], i + 1
        else:
            raise ValueError(
                f"unknown setting {parts[i]!r}; give keys or names from: "
                + "; ".join(f"{k} ({n})" for k, n, _ in SETTINGS)
            )
        if known[name] not in chosen:
            chosen.append(known[name])
    return chosen


# --------------------------------------------------------------------------------------------- child
def int8_errors(rows_list: tuple[int, ...] = INT8_ROWS, seed: int = 0) -> list[dict[str, Any]]:
    """``F.linear(x, Int8Weight)`` against :func:`~headspace.kernels.int8.int8_linear_reference` per row
    count: the largest |error| over the largest |reference output| (x ~ N(0, 3^2), W ~ N(0, 0.05^2)).

    Beside it, what separates the products from the quantisation: the same error against the float64
    product of the activations as the kernel quantises them (``quantize_activation``, float32), and how
    many of those quantised values lie a level apart from the reference's float64 quantisation (an input
    on a rounding boundary: one such value moves an output by ``s_t |W|``, ~1e-3 of the largest here).
    """
    from headspace.kernels.int8 import Int8Weight, int8_linear_reference, quantize_activation

    gen = torch.Generator().manual_seed(seed)
    w = Int8Weight.from_float(torch.randn(INT8_SHAPE, generator=gen) * 0.05)  # (out, in)
    w64 = w.q.double() * w.scale.double()[:, None]  # (out, in)
    out = []
    with torch.inference_mode():
        for rows in rows_list:
            x = torch.randn(rows, INT8_SHAPE[1], generator=gen) * 3.0  # (rows, in)
            y = F.linear(x, w).double()  # (rows, out), the int8 kernel
            ref = int8_linear_reference(x, w.q, w.scale)  # (rows, out) float64
            xq, s_t, z_t = quantize_activation(x)  # (rows, in) uint8, (rows,) x 2: float32 maths
            same = ((xq.double() - z_t.double()[:, None]) * s_t.double()[:, None]) @ w64.T  # (rows, out)
            x64 = x.double()  # the reference's quantisation (int8_linear_reference's first lines)
            lo, hi = x64.min(dim=1).values.clamp(max=0.0), x64.max(dim=1).values.clamp(min=0.0)
            s = (hi - lo) / 254
            s = torch.where(s > 0, s, torch.ones_like(s))[:, None]  # (rows, 1)
            q64 = torch.floor(x64 / s + torch.round(-lo[:, None] / s) + 0.5)  # (rows, in)
            scale = float(ref.abs().max())
            out.append(
                {
                    "rows": rows,
                    "max_rel_error": float((y - ref).abs().max()) / scale,
                    "max_rel_error_same_quantisation": float((y - same).abs().max()) / scale,
                    "levels_apart": int((q64 != xq.double()).sum()),
                }
            )
    return out


def _rotated(names: tuple[str, ...], r: int) -> tuple[str, ...]:
    return names[r % len(names) :] + names[: r % len(names)]


def measure_minilm(a: argparse.Namespace, embeddings_path: Path) -> dict[str, Any]:
    """MiniLM at each precision: accuracy to this process's float32 embeddings (saved to
    ``embeddings_path`` for the parent) and the median seconds to encode the sentences."""
    from encode import make_sentences

    sentences = make_sentences(a.sentences)
    models = {p: headspace.load("minilm", precision=p) for p in PRECISIONS}

    def encode(p: str) -> torch.Tensor:
        return models[p].encode(sentences, batch_size=a.batch_size, progress=False)

    emb = {p: encode(p) for p in PRECISIONS}  # also the warm-up
    torch.save(emb["float32"], embeddings_path)
    times: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    for r in range(a.rounds):
        for p in _rotated(PRECISIONS, r):
            t0 = time.perf_counter()
            encode(p)
            times[p].append(time.perf_counter() - t0)
    ref = emb["float32"]
    return {
        p: {
            "min_cosine": float((emb[p] * ref).sum(dim=1).min()),
            "max_abs_diff": float((emb[p] - ref).abs().max()),
            "median_s": statistics.median(times[p]),
            "times_s": times[p],
        }
        for p in PRECISIONS
    }


def measure_smollm2(a: argparse.Namespace, argmax_path: Path) -> dict[str, Any]:
    """SmolLM2 at each precision: top-1 agreement and perplexity ratio to this process's float32 logits
    (whose argmax is saved to ``argmax_path`` for the parent), and the median ms per greedy token."""
    from decode import accuracy_text_ids, accuracy_vs_float32, next_token_logits

    models = {p: headspace.load("smollm2", precision=p) for p in PRECISIONS}
    ids = accuracy_text_ids(models["float32"].tokenizer, a.tokens)
    targets = torch.tensor(ids[1:])
    logits = {p: next_token_logits(models[p].model, ids, 512) for p in PRECISIONS}  # (tokens, vocab) each
    torch.save(logits["float32"].argmax(-1), argmax_path)
    accuracy = {p: accuracy_vs_float32(logits[p], logits["float32"], targets) for p in PRECISIONS}
    del logits
    prompt = torch.tensor([ids[:32]])  # (1, 32)

    def generate(p: str, n: int) -> None:
        models[p].model.generate(prompt, n, temperature=0, native=False)

    times: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    with torch.inference_mode():
        for p in PRECISIONS:
            generate(p, 2)  # warm-up
        for r in range(a.rounds):
            for p in _rotated(PRECISIONS, r):
                t0 = time.perf_counter()
                generate(p, 1)
                t1 = time.perf_counter()
                generate(p, a.decode_tokens + 1)
                t2 = time.perf_counter()
                times[p].append(((t2 - t1) - (t1 - t0)) / a.decode_tokens)
    return {
        p: {
            **accuracy[p],
            "decode_ms": 1e3 * statistics.median(times[p]),
            "decode_times_ms": [1e3 * t for t in times[p]],
        }
        for p in PRECISIONS
    }


def run_child(a: argparse.Namespace) -> int:
    """In a child process (its CPU setting in the environment): every measurement, one JSON line out."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))  # encode.py's sentences and decode.py's measures
    from headspace.kernels import cpu

    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    folder = Path(a.child)
    doc = {
        "report": cpu.report(),
        "threads": torch.get_num_threads(),
        "int8_check": int8_errors(),
        "minilm": measure_minilm(a, folder / "minilm_float32.pt"),
        "smollm2": measure_smollm2(a, folder / "smollm2_float32_argmax.pt"),
    }
    doc["seconds"] = time.perf_counter() - t0
    print(json.dumps(doc))
    return 0


# -------------------------------------------------------------------------------------------- parent
def child_env(env: dict[str, str]) -> dict[str, str]:
    """This process's environment without the CPU-setting variables, plus ``env``; the child imports the
    headspace this process imported (its folder first on PYTHONPATH)."""
    out = {k: v for k, v in os.environ.items() if k not in CONTROLLED}
    src = str(Path(headspace.__file__).resolve().parents[1])
    out["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])
    out["TQDM_DISABLE"] = "1"
    return out | env


def spawn(a: argparse.Namespace, env: dict[str, str], folder: Path) -> dict[str, Any]:
    """Run this script's child measurements in a fresh interpreter with ``env``; its JSON."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", str(folder)]
    for name in ("sentences", "tokens", "rounds", "decode_tokens", "batch_size", "threads"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(a, name))]
    proc = subprocess.run(argv, capture_output=True, text=True, env=child_env(env), check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the child process failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def branch(report: dict[str, Any], precision: str) -> str:
    """The product a precision runs in a child, from its ``cpu.report()``."""
    if precision == "bfloat16":
        return str(report["bf16_product"])
    if precision == "int8":
        many, few = report["int8_product"], report["int8_few_rows"]
        return str(many) if few == many else f"{many}; few rows: {few}"
    return f"float32 (ATen {report['aten_capability']})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--settings",
        default=",".join(k for k, _, _ in SETTINGS),
        help="comma-separated keys or names of the CPU settings (default: all five)",
    )
    p.add_argument("--quick", action="store_true", help="32 sentences, 200 tokens, 1 round, 4 tokens decoded")
    p.add_argument("--sentences", type=int, default=None, help="MiniLM sentences (256; --quick 32)")
    p.add_argument("--tokens", type=int, default=None, help="SmolLM2 accuracy tokens (1000; --quick 200)")
    p.add_argument("--rounds", type=int, default=None, help="timing rounds (3; --quick 1)")
    p.add_argument("--decode-tokens", type=int, default=None, help="greedy tokens timed (32; --quick 4)")
    p.add_argument("--batch-size", type=int, default=32, help="MiniLM batch size")
    p.add_argument("--threads", type=int, default=2)
    add_output_options(p, "precision_cpus.json")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: a child's temp folder
    a = p.parse_args(argv)
    check_output_options(p, a, "precision_cpus.json", smoke="quick")
    for name, value in (QUICK if a.quick else FULL).items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    check_positive(p, a, ("sentences", "tokens", "rounds", "decode_tokens", "batch_size", "threads"))
    if a.child is not None:
        return run_child(a)
    try:
        settings = parse_settings(a.settings)
    except ValueError as e:
        p.error(str(e))
    out = output_path(a.out, a.save, "precision_cpus.json", RESULTS)

    children: list[dict[str, Any]] = []
    ref_emb = ref_argmax = None
    with tempfile.TemporaryDirectory(prefix="headspace-precision-cpus-") as tmp:
        for i, (key, name, env) in enumerate(settings):
            folder = Path(tmp) / key
            folder.mkdir()
            said = " ".join(f"{k}={v}" for k, v in env.items()) or "no variables"
            print(f"[{i + 1}/{len(settings)}] {name} ({said}): running ...", flush=True)
            t0 = time.perf_counter()
            child = spawn(a, env, folder)
            emb = torch.load(folder / "minilm_float32.pt")
            argmax = torch.load(folder / "smollm2_float32_argmax.pt")
            if ref_emb is None:
                ref_emb, ref_argmax = emb, argmax
            ref_ppl = children[0]["smollm2"]["float32"]["perplexity"] if children else None
            ppl = child["smollm2"]["float32"]["perplexity"]
            child["float32_vs_reference"] = {
                "reference": settings[0][1],
                "minilm_min_cosine": float((emb * ref_emb).sum(dim=1).min()),
                "minilm_max_abs_diff": float((emb - ref_emb).abs().max()),
                "smollm2_top1_agreement": float((argmax == ref_argmax).float().mean()),
                "smollm2_perplexity_ratio": 1.0 if ref_ppl is None else ppl / ref_ppl,
            }
            children.append({"key": key, "setting": name, "env": env, **child})
            print(
                f"[{i + 1}/{len(settings)}] {name}: done in {time.perf_counter() - t0:.0f} s "
                f"(ATen {child['report']['aten_capability']}, bfloat16: {child['report']['bf16_product']}, "
                f"int8: {child['report']['int8_product']})",
                flush=True,
            )

    rows: list[dict[str, Any]] = []
    for c in children:
        for prec in PRECISIONS:
            mini, smol = c["minilm"][prec], c["smollm2"][prec]
            if prec == "float32":  # against the reference setting's float32
                vs = c["float32_vs_reference"]
                accuracy = {
                    "against": f"{vs['reference']} float32",
                    "minilm_min_cosine": vs["minilm_min_cosine"],
                    "minilm_max_abs_diff": vs["minilm_max_abs_diff"],
                    "smollm2_top1_agreement": vs["smollm2_top1_agreement"],
                    "smollm2_perplexity_ratio": vs["smollm2_perplexity_ratio"],
                }
            else:  # against this setting's own float32
                accuracy = {
                    "against": "float32 of the same setting",
                    "minilm_min_cosine": mini["min_cosine"],
                    "minilm_max_abs_diff": mini["max_abs_diff"],
                    "smollm2_top1_agreement": smol["top1_agreement"],
                    "smollm2_perplexity_ratio": smol["perplexity_ratio"],
                }
            rows.append(
                {
                    "setting": c["setting"],
                    "precision": prec,
                    "branch": branch(c["report"], prec),
                    **accuracy,
                    "minilm_s": mini["median_s"],
                    "smollm2_ms_per_token": smol["decode_ms"],
                }
            )
    checks: list[dict[str, Any]] = []
    for c in children:
        for prec, limit in MIN_COSINE.items():
            value = c["minilm"][prec]["min_cosine"]
            checks.append(
                {"setting": c["setting"], "target": f"{prec}: MiniLM min cosine to float32 >= {limit}",
                 "value": value, "limit": limit, "met": value >= limit}
            )  # fmt: skip
        worst = max(e["max_rel_error"] for e in c["int8_check"])
        checks.append(
            {"setting": c["setting"], "target": f"int8: F.linear within {INT8_MAX_REL} of the reference",
             "value": worst, "limit": INT8_MAX_REL, "met": worst <= INT8_MAX_REL}
        )  # fmt: skip
        worst = max(e["max_rel_error_same_quantisation"] for e in c["int8_check"])
        checks.append(
            {"setting": c["setting"],
             "target": f"int8: F.linear within {INT8_SAME_MAX_REL} of the float64 product of its own x_q",
             "value": worst, "limit": INT8_SAME_MAX_REL, "met": worst <= INT8_SAME_MAX_REL}
        )  # fmt: skip

    ref_name = settings[0][1]
    print(
        f"\nMiniLM: {a.sentences} sentences (batch {a.batch_size}); SmolLM2: {a.tokens} tokens of "
        f"README.md + docs/*.md, ms per greedy token at batch 1 (native=False, {a.decode_tokens} tokens); "
        f"{a.rounds} rounds, {a.threads} threads, torch {torch.__version__}. bfloat16 and int8 rows: against "
        f"the same setting's float32; float32 rows: against the {ref_name} setting's float32\n"
    )
    print(
        "| CPU setting | precision | product | MiniLM min cosine | MiniLM max abs diff | MiniLM s | "
        "SmolLM2 top-1 | perplexity ratio | ms/token |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['setting']} | {r['precision']} | {r['branch']} | {r['minilm_min_cosine']:.6f} | "
            f"{r['minilm_max_abs_diff']:.1e} | {r['minilm_s']:.3f} | {r['smollm2_top1_agreement']:.4f} | "
            f"{r['smollm2_perplexity_ratio']:.4f} | {r['smollm2_ms_per_token']:.2f} |"
        )
    print(
        f"\nint8 correct: F.linear(x, Int8Weight) against int8_linear_reference (float64), x [rows, "
        f"{INT8_SHAPE[1]}] ~ N(0, 3^2), W {list(INT8_SHAPE)} ~ N(0, 0.05^2): largest error / largest "
        "|output|; in brackets, the same against the float64 product of the activations as the kernel "
        "quantised them, and how many of those lie a level apart from the reference's float64 quantisation\n"
    )
    print(
        "| CPU setting | ATen | oneDNN bfloat16 | forced fallbacks | "
        + " | ".join(f"{n} rows" for n in INT8_ROWS)
        + " |"
    )
    print("|---|---|---|---|" + "---:|" * len(INT8_ROWS))
    for c in children:
        rep = c["report"]
        print(
            f"| {c['setting']} | {rep['aten_capability']} | {rep['onednn_bf16']} | "
            f"{', '.join(rep['forced_fallbacks']) or '-'} | "
            + " | ".join(
                f"{e['max_rel_error']:.1e} ({e['max_rel_error_same_quantisation']:.0e}; "
                f"{e['levels_apart']} apart)"
                for e in c["int8_check"]
            )
            + " |"
        )
    print()
    for c in checks:
        verdict = "met" if c["met"] else "NOT met"
        print(f"{c['setting']}: {c['target']}: {c['value']:.6g} ({verdict})")
    write_json(
        out,
        {
            "benchmark": "precision_cpus",
            "machine": machine_info(),
            "torch": torch.__version__,
            "threads": a.threads,
            "quick": a.quick,
            "sentences": a.sentences,
            "batch_size": a.batch_size,
            "tokens": a.tokens,
            "rounds": a.rounds,
            "decode_tokens": a.decode_tokens,
            "decode_step": "python (generate(native=False)), batch 1, greedy",
            "reference_setting": ref_name,
            "settings": children,
            "rows": rows,
            "targets": checks,
            "all_targets_met": all(c["met"] for c in checks),
        },
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
