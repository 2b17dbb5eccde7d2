"""The attention mechanisms of issue 39 side by side with transformers: forward and decode tokens/s, and the
KV cache's bytes per token, at a 125M-parameter configuration of each (random weights).

Each mechanism is one :class:`Case` of :data:`CASES`: a transformers ``model_type`` and the config fields
that switch the mechanism on. At ``125m`` every case has ``hidden_size`` 768, 12 layers, 12 heads
(d_head 64), a 32000-token vocabulary; dense MLPs are 3072 wide, mixtures of experts have 8 small experts
(top 2, 224 wide) so that the whole model stays near 125M parameters (the JSON records each model's
count). ``tiny`` (``--quick``) is 64 wide, 2 layers, 4 heads, the same fields. Cases:

* ``sinks``: gpt-oss (learned sinks, alternating 128-token windows and full layers, q/k/v/o biases, MoE);
* ``moe_mixtral`` / ``moe_qwen3``: Mixtral and Qwen3-MoE (mixtures of experts on plain attention);
* ``gemma4``: Gemma 4 text (value norm, score scale 1, ``attention_k_eq_v``, shared keys and values);
* ``mla`` (deepseek_v3), ``gates_deltanet`` (qwen3_next), ``chunk`` (llama4_text), ``differential``
  (diffllama): run only where ``headspace.load`` has a loader for the model_type
  (``headspace.pretrained.registry.FOLDER_LOADERS``); otherwise listed under ``not_loadable``.

Per case, for ``headspace``, ``transformers eager`` and ``transformers sdpa`` (as benchmarks/families.py:
the same loaders, the same checks that the logits agree and greedy decoding gives the same tokens, rounds
rotating over the libraries, median and spread of ``--repeats`` rounds):

* ``forward tok/s``: one forward of ``--batch`` x ``--seq`` tokens;
* ``decode tok/s``: greedy decoding at batch 1, ``--new`` tokens after a ``--seq``-token prompt, prefill
  left out (``n / (time(n + 1) - time(1))``);
* ``cache B/token``: the KV cache's bytes per cached position: headspace's caches for ``--seq`` positions
  (``model.make_kv_caches(1, seq)``: every tensor they hold, over ``seq``) against the cache transformers
  returns after a forward of ``--seq`` tokens (``past_key_values``: every tensor it holds, over ``seq``).

    python benchmarks/attention_variants.py               # every loadable case at 125m
    python benchmarks/attention_variants.py --quick       # tiny size, few tokens: a smoke run
    python benchmarks/attention_variants.py --cases sinks,gemma4 --save

The JSON goes to benchmarks/results/local/attention_variants.json (git-ignored) unless ``--out PATH``; only
``--save`` writes benchmarks/results/attention_variants.json (never from a ``--quick`` run).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from headspace.bench import machine_info, round_robin
from headspace.bench.scripts import add_output_options, check_output_options, check_positive, output_path
from headspace.core.fileio import write_json
from headspace.pretrained.registry import FOLDER_LOADERS

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
NAME = "attention_variants.json"
LIBS = ("headspace", "transformers eager", "transformers sdpa")
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
_EXPERTS = 8  # small experts: a 125M model in all
_D_EXPERT = {"125m": 224, "tiny": 32}


def _families() -> ModuleType:
    """benchmarks/families.py, loaded by path (its loaders, runners, checks and rates are shared)."""
    spec = importlib.util.spec_from_file_location(
        "bench_families_for_variants", Path(__file__).with_name("families.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Case:
    """One mechanism: its name, the transformers ``model_type`` that carries it, and the config fields that
    switch it on (``"{d_expert}"``, ``"{d_head}"``, ``"{sliding_full}"``, ``"{kv_shared}"`` filled in per
    size)."""

    name: str
    model_type: str
    mechanism: str
    fields: dict[str, Any] = field(default_factory=dict)


def _alternating(n: int, a: str, b: str) -> list[str]:
    return [a if i % 2 == 0 else b for i in range(n)]


CASES: tuple[Case, ...] = (
    Case("sinks", "gpt_oss", "learned sinks, 128-token windows, q/k/v/o biases, MoE",
         {"num_local_experts": _EXPERTS, "num_experts_per_tok": 2, "intermediate_size": "{d_expert}",
          "head_dim": "{d_head}", "sliding_window": 128, "layer_types": "{sliding_full}"}),
    Case("moe_mixtral", "mixtral", "mixture of experts (top 2 of 8)",
         {"num_local_experts": _EXPERTS, "num_experts_per_tok": 2, "intermediate_size": "{d_expert}"}),
    Case("moe_qwen3", "qwen3_moe", "mixture of experts (top 2 of 8), QK-norm",
         {"num_experts": _EXPERTS, "num_experts_per_tok": 2, "moe_intermediate_size": "{d_expert}",
          "head_dim": "{d_head}"}),
    Case("gemma4", "gemma4_text", "value norm, score scale 1, k = v on global layers, shared K/V",
         {"head_dim": "{d_head}", "global_head_dim": "{d_head}", "sliding_window": 128,
          "layer_types": "{sliding_full}", "attention_k_eq_v": True, "num_kv_shared_layers": "{kv_shared}",
          "hidden_size_per_layer_input": 0}),
    Case("mla", "deepseek_v3", "multi-head latent attention, MoE",
         {"n_routed_experts": _EXPERTS, "num_experts_per_tok": 2, "moe_intermediate_size": "{d_expert}",
          "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
          "kv_lora_rank": 128, "q_lora_rank": 192, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32,
          "v_head_dim": 32}),
    Case("gates_deltanet", "qwen3_next", "output gates, Gated DeltaNet layers, MoE",
         {"num_experts": _EXPERTS, "num_experts_per_tok": 2, "moe_intermediate_size": "{d_expert}",
          "shared_expert_intermediate_size": "{d_expert}", "head_dim": "{d_head}",
          "linear_num_key_heads": 6, "linear_num_value_heads": 12, "linear_key_head_dim": 64,
          "linear_value_head_dim": 64}),
    Case("chunk", "llama4_text", "chunked attention, NoPE layers with temperature, L2 QK-norm, MoE",
         {"num_local_experts": _EXPERTS, "num_experts_per_tok": 1, "intermediate_size": "{d_expert}",
          "intermediate_size_mlp": 3072, "attention_chunk_size": 128, "head_dim": "{d_head}"}),
    Case("differential", "diffllama", "differential attention", {}),
)  # fmt: skip


def loadable(case: Case) -> bool:
    """Whether ``headspace.load`` reads folders of the case's model_type (a parallel branch may add it)."""
    return case.model_type in FOLDER_LOADERS


def _filled(value: Any, size: str) -> Any:
    dims = SIZES[size]
    fills = {
        "{d_expert}": _D_EXPERT[size],
        "{d_head}": dims["hidden_size"] // dims["num_attention_heads"],
        "{sliding_full}": _alternating(dims["num_hidden_layers"], "sliding_attention", "full_attention"),
        "{kv_shared}": 2 if dims["num_hidden_layers"] >= 4 else 0,  # (tiny: no earlier layer of each type)
    }
    return fills.get(value, value) if isinstance(value, str) else value


def config_for(case: Case, size: str) -> Any:
    """The transformers config of ``case`` at ``size`` (module docstring)."""
    from transformers import AutoConfig

    dims = SIZES[size]
    fields = {k: _filled(v, size) for k, v in case.fields.items()}
    return AutoConfig.for_model(
        case.model_type, vocab_size=VOCAB, max_position_embeddings=POSITIONS,
        num_key_value_heads=dims["num_attention_heads"], pad_token_id=0, bos_token_id=1, eos_token_id=None,
        tie_word_embeddings=False, **{**dims, **fields},
    )  # fmt: skip


def write_checkpoint(case: Case, size: str, folder: Path) -> int:
    """A random transformers model of ``case`` at ``size`` saved into ``folder``; returns its parameters."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_for(case, size)).eval()
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def _tensor_bytes(obj: Any, depth: int = 0) -> int:
    """Bytes of every tensor ``obj`` holds: itself, in lists / tuples / dicts, or in its attributes (three
    levels down; a tensor seen twice is counted once per place it is held)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if depth > 3 or obj is None or isinstance(obj, (int, float, str, bool)):
        return 0
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, depth + 1) for v in obj)
    return sum(_tensor_bytes(v, depth + 1) for v in getattr(obj, "__dict__", {}).values())


def cache_bytes_per_token(models: dict[str, Any], seq: int) -> dict[str, float | str]:
    """Each library's KV-cache bytes per cached position after ``seq`` positions (module docstring);
    a library whose cache cannot be read gets the reason instead."""
    out: dict[str, float | str] = {}
    ids = torch.randint(2, VOCAB, (1, seq), generator=torch.Generator().manual_seed(3))  # [1, seq]
    for name, m in models.items():
        try:
            if name == "headspace":
                caches = m.model.make_kv_caches(1, seq)
                total = sum(_tensor_bytes({k: v for k, v in vars(c).items() if k != "stack"}) for c in caches)
            else:
                with torch.inference_mode():
                    total = _tensor_bytes(m(input_ids=ids, use_cache=True).past_key_values)
            out[name] = total / seq
        except Exception as e:  # reported in the row, not fatal
            out[name] = f"{type(e).__name__}: {e}"[:160]
    return out


def measure(case: Case, size: str, args: argparse.Namespace, root: Path, fam: ModuleType) -> dict[str, Any]:
    """One case at one size: forward and decode figures per library, and the cache's bytes per token."""
    folder = root / f"{case.name}_{size}"
    n_params = write_checkpoint(case, size, folder)
    _, models, skipped = fam.load_each(folder)
    forward, generate = fam.runners(models)
    ids = torch.randint(2, VOCAB, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    check = fam._check_same(forward, generate, ids, args.new)
    with torch.inference_mode():
        fwd_times = round_robin({k: (lambda f=f: f(ids)) for k, f in forward.items()}, args.repeats)
        one = round_robin({k: (lambda g=g: g(ids[:1], 1)) for k, g in generate.items()}, args.repeats)
        many = round_robin(
            {k: (lambda g=g: g(ids[:1], args.new + 1)) for k, g in generate.items()}, args.repeats
        )
    decode_times = {k: [a - b for a, b in zip(many[k], one[k]) if a > b] for k in many}
    return {
        "case": case.name, "model_type": case.model_type, "mechanism": case.mechanism, "size": size,
        "parameters": n_params, "left_out": skipped,
        "forward_tok_s": fam._rates(fwd_times, args.batch * args.seq),
        "decode_tok_s": fam._rates(decode_times, args.new),
        "cache_bytes_per_token": cache_bytes_per_token(models, args.seq),
        **check,
    }  # fmt: skip


def _cell(figures: dict[str, Any], lib: str, form: str) -> str:
    v = figures.get(lib)
    if isinstance(v, dict):
        v = v["median"]
    return form.format(v) if isinstance(v, (int, float)) else "-"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table: one row per case and size, the three libraries side by side (medians)."""
    short = {"headspace": "hs", "transformers eager": "eager", "transformers sdpa": "sdpa"}
    cols = ["case", "model_type", "size", "params M"]
    for what in ("fwd tok/s", "decode tok/s", "cache B/tok"):
        cols += [f"{what} {short[lib]}" for lib in LIBS]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r["case"], r["model_type"], r["size"], f"{r['parameters'] / 1e6:.1f}"]
        cells += [_cell(r["forward_tok_s"], lib, "{:.0f}") for lib in LIBS]
        cells += [_cell(r["decode_tok_s"], lib, "{:.1f}") for lib in LIBS]
        cells += [_cell(r["cache_bytes_per_token"], lib, "{:.0f}") for lib in LIBS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [c.name for c in CASES]
    p.add_argument("--cases", default=None, help=f"comma-separated cases of {names} (default: all loadable)")
    p.add_argument("--quick", action="store_true", help="a smoke run: tiny size, few tokens, 1 round")
    p.add_argument("--repeats", type=int, default=None, help="rounds per figure (default 5; 1 with --quick)")
    p.add_argument("--batch", type=int, default=None, help="forward batch (default 4; 1 with --quick)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 128; 8 with --quick)")
    p.add_argument("--new", type=int, default=None, help="decoded tokens (default 32; 4 with --quick)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add_output_options(p, NAME)
    args = p.parse_args(argv)
    check_output_options(p, args, NAME, smoke="quick")
    check_positive(p, args, ("repeats", "batch", "seq", "new", "threads"))
    for key, full, quick in (("repeats", 5, 1), ("batch", 4, 1), ("seq", 128, 8), ("new", 32, 4)):
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    chosen = names if args.cases is None else [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in names]
    if unknown or not chosen:
        p.error(f"--cases takes cases of {names}; got {unknown or chosen}")
    args.cases = chosen
    args.size = "tiny" if args.quick else "125m"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    fam = _families()
    cases = [c for c in CASES if c.name in args.cases]
    rows: list[dict[str, Any]] = []
    failed: list[dict[str, str]] = []
    not_loadable = [{"case": c.name, "model_type": c.model_type} for c in cases if not loadable(c)]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="headspace_variants_") as tmp:
        for case in (c for c in cases if loadable(c)):
            print(f"{case.name} ({case.model_type}) at {args.size} ...", file=sys.stderr, flush=True)
            try:
                rows.append(measure(case, args.size, args, Path(tmp), fam))
            except Exception as e:  # one case's failure is reported, not fatal to the rest
                failed.append({"case": case.name, "error": f"{type(e).__name__}: {e}"[:300]})
    print(format_table(rows))
    for f in failed:
        print(f"FAILED {f['case']}: {f['error']}")
    if not_loadable:
        print(
            "not loadable by headspace yet: "
            + ", ".join(f"{c['case']} ({c['model_type']})" for c in not_loadable)
        )
    path = output_path(args.out, args.save, NAME, RESULTS)
    shown = {k: v for k, v in vars(args).items() if k not in ("out", "save")}
    doc = {
        "benchmark": "attention_variants", "args": shown,
        "machine": machine_info(), "seconds": time.perf_counter() - t0, "median_of": args.repeats,
        "rows": rows, "failed": failed, "not_loadable": not_loadable,
    }  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, doc)
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
