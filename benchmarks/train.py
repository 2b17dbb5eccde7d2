"""Training throughput: headspace's Decoder against a nanoGPT-style reference of the same size.

Both models are trained side by side in one process with the same optimizer (AdamW), the same batches
(random token windows), the same gradient clipping and the same number of threads. Timing alternates
between the two (round-robin), each round timing ``--steps`` optimizer steps, and the table quotes the
median tokens/s over the rounds and the median of the per-round ratios headspace / reference (both
models are timed back to back in every round, so the ratio is robust to a busy machine; target >= 1.0x).

    python benchmarks/train.py                    # d_model 128, 4 layers x 4 heads, seq 128, batch 16
    python benchmarks/train.py --quick            # a smoke run, under a minute
    python benchmarks/train.py --device cuda      # on a GPU
    python benchmarks/train.py --save             # publish: benchmarks/results/train.json

Writes JSON (the settings, every round's numbers, the medians, the machine) to
benchmarks/results/local/train.json (git-ignored) unless ``--out PATH``; only ``--save`` replaces the
committed benchmarks/results/train.json.
The reference model is written here, after nanoGPT (one fused c_attn, scaled_dot_product_attention with
is_causal, GELU(tanh) MLP, pre-LN, tied embeddings), so that nothing but the model differs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from headspace.bench.scripts import add_output_options, check_output_options, check_positive, output_path
from headspace.model.models import Decoder, ModelConfig
from headspace.train.checkpoint import write_atomic

RESULTS = Path(__file__).resolve().parent / "results"
"""The published results (committed); runs without --save write to RESULTS / "local"."""


# ------------------------------------------------------------------------------------------ the reference
class RefAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # (B, T, C) x 3
        hs = C // self.n_heads
        q = q.view(B, T, self.n_heads, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_heads, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_heads, hs).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.c_proj(y)


class RefBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_mlp: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = RefAttention(d_model, n_heads)
        self.ln_2 = nn.LayerNorm(d_model)
        self.c_fc = nn.Linear(d_model, d_mlp)
        self.c_proj = nn.Linear(d_mlp, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class RefGPT(nn.Module):
    def __init__(self, vocab: int, seq: int, d_model: int, n_layers: int, n_heads: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(seq, d_model)
        self.h = nn.ModuleList(RefBlock(d_model, n_heads, 4 * d_model) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, C)
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # (B, T, vocab): tied embeddings


# ------------------------------------------------------------------------------------------ timing
def _train_steps(
    model: nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor], device: str
) -> float:
    """Run one optimizer step per batch; return the seconds taken."""
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for tokens in batches:
        logits = model(tokens[:, :-1])  # (B, T, vocab)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--vocab", type=int, default=65, help="65: a character-level vocabulary")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per timed round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--quick", action="store_true", help="d_model 64, 2 layers, seq 64, 3 rounds")
    add_output_options(p, "train.json")
    a = p.parse_args(argv)
    check_output_options(p, a, "train.json")
    out = output_path(a.out, a.save, "train.json", RESULTS)
    if a.quick:
        a.d_model, a.layers, a.seq, a.rounds = 64, 2, 64, 3
    check_positive(p, a, ("d_model", "layers", "heads", "seq", "batch", "vocab", "steps", "rounds"))
    if a.d_model % a.heads:
        p.error(f"--d-model {a.d_model} must be divisible by --heads {a.heads}")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    if a.threads:
        torch.set_num_threads(a.threads)

    torch.manual_seed(0)
    cfg = ModelConfig(
        arch="decoder", vocab_size=a.vocab, d_model=a.d_model, n_layers=a.layers, n_heads=a.heads,
        max_seq_len=a.seq, type_vocab_size=0,
    )  # fmt: skip
    models = {
        "headspace": Decoder(cfg).to(a.device),
        "nanogpt_ref": RefGPT(a.vocab, a.seq, a.d_model, a.layers, a.heads).to(a.device),
    }
    n_params = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    g = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g).to(a.device) for _ in range(a.steps)
    ]
    for k in models:  # warm-up (allocator, kernels)
        _train_steps(models[k], opts[k], batches[:2], a.device)
    tokens = a.batch * a.seq * a.steps
    rounds: dict[str, list[float]] = {k: [] for k in models}
    for r in tqdm(range(a.rounds), desc="rounds", unit="round"):
        order = list(models) if r % 2 == 0 else list(reversed(models))  # alternate who goes first
        for k in order:
            rounds[k].append(tokens / _train_steps(models[k], opts[k], batches, a.device))
    med = {k: statistics.median(v) for k, v in rounds.items()}
    # each round times both models back to back, so the per-round ratio cancels slow drifts of the
    # machine's load; its median is the headline number
    paired = [h / r for h, r in zip(rounds["headspace"], rounds["nanogpt_ref"])]
    ratio = statistics.median(paired)

    print(
        f"\ntraining throughput, {a.layers} layers x {a.heads} heads, d_model {a.d_model}, seq {a.seq}, "
        f"batch {a.batch}, {a.device}, {torch.get_num_threads()} threads, {a.rounds} rounds x {a.steps} steps"
    )
    print("| model | parameters | median tokens/s | min | max |")
    print("|---|---:|---:|---:|---:|")
    for k in models:
        print(f"| {k} | {n_params[k]:,} | {med[k]:,.0f} | {min(rounds[k]):,.0f} | {max(rounds[k]):,.0f} |")
    print(
        f"\nheadspace / nanoGPT-style reference: {ratio:.3f}x (median of per-round ratios; ratio of the "
        f"medians {med['headspace'] / med['nanogpt_ref']:.3f}x; target >= 1.0x)"
    )

    result = {
        "benchmark": "train",
        "settings": {
            k: getattr(a, k)
            for k in ("d_model", "layers", "heads", "seq", "batch", "vocab", "steps", "rounds", "device")
        },
        "threads": torch.get_num_threads(),
        "parameters": n_params,
        "tokens_per_s_rounds": rounds,
        "median_tokens_per_s": med,
        "ratio_headspace_over_reference": ratio,
        "per_round_ratios": paired,
        "ratio_of_medians": med["headspace"] / med["nanogpt_ref"],
        "target_ratio": 1.0,
        "meets_target": ratio >= 1.0,
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
        },
        "finite": all(math.isfinite(x) for v in rounds.values() for x in v),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
