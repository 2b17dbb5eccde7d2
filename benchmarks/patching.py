"""Head-patching sweep: headspace's batched patch() against one hooked forward per site (and TransformerLens).

The sweep of the README's example: every head's z of SmolLM2-135M (30 layers x 9 heads = 270 sites) patched
from the clean indirect-object prompt into the corrupt one, metric logit(" Mary") - logit(" John") at the
last position, float32, 2 threads. Three ways, on the same weights, timed in rotating rounds:

* ``headspace``: :func:`headspace.analysis.patching.patch` (one batched pass up the stack, the shared
  prefix as a KV cache, only the last position unembedded);
* ``naive``: one full forward of the corrupt prompt per site with headspace's hook on that head's z;
* ``transformer_lens``: TransformerLens' TransformerBridge on the same weights (transformers' model loaded
  from the same GGUF), one hooked forward per site, if ``transformer_lens`` imports (skipped otherwise).

All must give the same numbers (max abs difference printed). Target: headspace <= 3 s for the sweep.

    python benchmarks/patching.py                  # the table; JSON in benchmarks/results/local/
    python benchmarks/patching.py --save           # publish: benchmarks/results/patching.json
    python benchmarks/patching.py --model PATH     # any decoder folder; --rounds, --threads
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import headspace
from headspace.analysis.patching import patch
from headspace.analysis.trace import hooked, trace
from headspace.bench import machine_info
from headspace.bench.scripts import add_output_options, check_output_options, output_path
from headspace.core.fileio import write_json

CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPT = "When Mary and John went to the store, Mary gave a drink to"
RESULTS = Path(__file__).resolve().parent / "results"


def naive_sweep(model, clean: torch.Tensor, corrupt: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """One full forward per site (the definition), with headspace's hook on the patched head's z."""
    module = model.model
    L = len(module.blocks)
    with trace(module, names="blocks.*.attn.hook_z") as t:
        module(clean)
    out = torch.empty(L, max(blk.attn.n_heads for blk in module.blocks))
    for layer in range(L):
        cz = t[f"blocks.{layer}.attn.hook_z"]
        for head in range(module.blocks[layer].attn.n_heads):

            def put(z, point, head=head, cz=cz):
                z = z.clone()
                z[:, :, head] = cz[:, :, head]
                return z

            with torch.no_grad(), hooked(module, {f"blocks.{layer}.attn.hook_z": put}):
                logits = module(corrupt)[0, -1]
            out[layer, head] = logits[a] - logits[b]
    return out


def transformer_lens_sweep(
    bridge, clean: torch.Tensor, corrupt: torch.Tensor, a: int, b: int
) -> torch.Tensor:
    """TransformerLens: one hooked forward per site on ``blocks.{l}.attn.hook_z`` (its name for z)."""
    _, cache = bridge.run_with_cache(clean)
    L, H = bridge.cfg.n_layers, bridge.cfg.n_heads
    out = torch.empty(L, H)
    for layer in range(L):
        name = f"blocks.{layer}.attn.hook_z"
        cz = cache[name]
        for head in range(H):

            def put(z, hook, head=head, cz=cz):
                z[:, :, head] = cz[:, :, head]
                return z

            with torch.no_grad():
                logits = bridge.run_with_hooks(corrupt, fwd_hooks=[(name, put)])[0, -1]
            out[layer, head] = logits[a] - logits[b]
    return out


def _plain_copy(hf):
    """transformers' GGUF-loaded model refuses save_pretrained: the same weights in a plain model."""
    import transformers

    config = hf.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(hf.state_dict())
    return plain


def load_transformer_lens(model_spec: str):
    """A TransformerBridge on the same weights, or None with the reason."""
    try:
        from transformer_lens.model_bridge import TransformerBridge
    except Exception as e:  # not installed, or an import-time failure of one of its many dependencies
        return None, f"transformer_lens unavailable ({type(e).__name__}: {e})"
    import transformers

    from headspace.pretrained.gguf_format import smollm2_gguf_path

    # the plain copy of SmolLM2 that TransformerBridge boots from, removed once it has (on Linux the
    # loaded weights may still map its files: that keeps working; elsewhere a failed removal is ignored)
    copy = None
    if model_spec != "smollm2":
        folder = Path(model_spec)
    else:
        path = smollm2_gguf_path()
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
        tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        copy = tempfile.TemporaryDirectory(prefix="headspace-tl-", ignore_cleanup_errors=True)
        folder = Path(copy.name)
        _plain_copy(hf).save_pretrained(folder)
        tok.save_pretrained(folder)
    try:
        bridge = TransformerBridge.boot_transformers(str(folder), device="cpu", dtype=torch.float32)
        bridge.enable_compatibility_mode()
    except Exception as e:
        return None, f"TransformerBridge could not boot {folder} offline ({type(e).__name__}: {e})"
    finally:
        if copy is not None:
            copy.cleanup()
    return bridge, ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-naive", action="store_true", help="skip the one-forward-per-site loop")
    p.add_argument("--no-tl", action="store_true", help="skip TransformerLens")
    p.add_argument("--clean", default=CLEAN)
    p.add_argument("--corrupt", default=CORRUPT)
    p.add_argument("--answer", default=" Mary")
    p.add_argument("--other", default=" John")
    add_output_options(p, "patching.json")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.threads < 1:
        p.error("--rounds and --threads must be positive")
    check_output_options(p, args, "patching.json")
    torch.set_num_threads(args.threads)
    model = headspace.load(args.model)
    tok = model.tokenizer
    clean, _ = model.tokenize_padded([args.clean])
    corrupt, _ = model.tokenize_padded([args.corrupt])
    a, b = tok.plain_ids(args.answer)[0], tok.plain_ids(args.other)[0]
    L = len(model.model.blocks)
    n_sites = sum(blk.attn.n_heads for blk in model.model.blocks)
    cases = {
        "headspace": lambda: patch(model, args.clean, args.corrupt, answer=args.answer, other=args.other)
    }
    if not args.no_naive:
        cases["naive"] = lambda: naive_sweep(model, clean, corrupt, a, b)
    skipped = {}
    if not args.no_tl:
        bridge, why = load_transformer_lens(args.model)
        if bridge is None:
            skipped["transformer_lens"] = why
        else:
            cases["transformer_lens"] = lambda: transformer_lens_sweep(bridge, clean, corrupt, a, b)
    times: dict[str, list[float]] = {name: [] for name in cases}
    values: dict[str, torch.Tensor] = {}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - t0)
            values[name] = out.patched_metric if name == "headspace" else out
    ref = values["headspace"]
    rows = []
    for name in cases:
        med = statistics.median(times[name])
        diff = float((values[name] - ref).abs().max())
        speedup = med / statistics.median(times["headspace"])
        rows.append({"case": name, "median_s": med, "min_s": min(times[name]), "max_s": max(times[name]),
                     "max_abs_diff": diff, "speedup_of_headspace": speedup})  # fmt: skip
    print(
        f"\n{args.model}: {L} layers, {n_sites} head sites, clean {args.clean!r} vs corrupt {args.corrupt!r}"
    )
    print(f"{args.rounds} rounds, {args.threads} threads, float32\n")
    print("| sweep | median s | min s | max s | headspace speedup | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['median_s']:.2f} | {r['min_s']:.2f} | {r['max_s']:.2f} | "
              f"{r['speedup_of_headspace']:.1f}x | {r['max_abs_diff']:.1e} |")  # fmt: skip
    for name, why in skipped.items():
        print(f"({name} skipped: {why})")
    hs_median = statistics.median(times["headspace"])
    print(f"\nTarget headspace <= 3 s: {'met' if hs_median <= 3.0 else 'NOT met'} ({hs_median:.2f} s)")
    out = output_path(args.out, args.save, "patching.json", RESULTS)
    write_json(out, {"rows": rows, "skipped": skipped, "times": times, "machine": machine_info(),
                     "settings": vars(args), "n_sites": n_sites})  # fmt: skip
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
