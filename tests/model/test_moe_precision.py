"""A mixture of experts at ``precision="bfloat16"`` (issue #39): the experts' products run in bfloat16,
the routers follow transformers' rule (DeepSeek's stay float32), logits stay within bfloat16's
tolerance of float32 and of transformers' own bfloat16 forward, and routing away from near-ties is the
float32 model's. References: tiny random models built and saved by transformers 5.25."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers as T

import headspace as hs
from headspace.kernels.bf16 import is_bf16
from headspace.model.moe import MixtureOfExperts
from headspace.model.moe_precision import BF16Experts, is_bf16_experts

pytestmark = pytest.mark.usefixtures("single_thread")

V = 61
BASE = dict(
    vocab_size=V,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
MIXTRAL = dict(num_local_experts=5, num_experts_per_tok=2, intermediate_size=24, num_key_value_heads=2,
               head_dim=8)  # fmt: skip
DEEPSEEK_V3 = dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, intermediate_size=40,
                   n_shared_experts=1, routed_scaling_factor=1.7, n_group=4, topk_group=2,
                   first_k_dense_replace=1, q_lora_rank=14, kv_lora_rank=10, qk_rope_head_dim=4, head_dim=4,
                   num_key_value_heads=4, qk_nope_head_dim=8, v_head_dim=6, norm_topk_prob=True)  # fmt: skip
FAMILIES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, MIXTRAL),
    "deepseek_v3": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM, DEEPSEEK_V3),
}


def build(family: str, folder: Path) -> None:
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(11)
    model = model_cls(config_cls(**{**BASE, **extra})).eval()
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "inv_freq" in name:
                continue
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(("mlp.gate.weight", "e_score_correction_bias")):
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    model.save_pretrained(folder)


@pytest.fixture(scope="module", params=list(FAMILIES))
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    path = tmp_path_factory.mktemp(request.param)
    build(request.param, path)
    return request.param, path


def tokens() -> torch.Tensor:
    return torch.randint(3, V, (2, 10), generator=torch.Generator().manual_seed(3))


def test_bf16_converts_the_experts_and_keeps_routing_and_logits(folder: tuple[str, Path]) -> None:
    family, path = folder
    exact, ours = hs.load(path), hs.load(path, precision="bfloat16")
    layer = next(i for i, b in enumerate(ours.model.blocks) if isinstance(b.mlp, MixtureOfExperts))
    moe, moe32 = ours.model.blocks[layer].mlp, exact.model.blocks[layer].mlp
    for name in ("experts_gate", "experts_in", "experts_out"):
        w = getattr(moe, name)
        assert is_bf16_experts(w) and all(is_bf16(w[e]) for e in range(moe.n_experts)), name
        assert torch.equal(w, getattr(moe32, name).to(torch.bfloat16).float()), name  # bfloat16 numbers
    if family == "deepseek_v3":  # transformers keeps DeepSeek's gate.weight (and correction bias) float32
        assert not is_bf16(moe.router.weight) and torch.equal(moe.router.weight, moe32.router.weight)
        assert torch.equal(moe.score_bias, moe32.score_bias)
    else:  # the router's product in bfloat16 (its softmax in float32, as transformers)
        assert is_bf16(moe.router.weight)
    names = [f"blocks.{i}.mlp.hook_top_k" for i in range(len(ours.model.blocks))
             if isinstance(ours.model.blocks[i].mlp, MixtureOfExperts)]  # fmt: skip
    names += [f"blocks.{layer}.mlp.hook_router_logits"]
    with torch.no_grad(), hs.trace(exact.model, names=names) as t32, hs.trace(ours.model, names=names) as t16:
        want, got = exact(tokens()), ours(tokens())
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, atol=0.05 * scale, rtol=0)
    assert not torch.equal(got, want)
    logits = t32[f"blocks.{layer}.mlp.hook_router_logits"]  # (batch, seq, E)
    k = moe.top_k
    top = logits.topk(k + 1, dim=-1).values  # (batch, seq, k + 1)
    clear = (top[..., k - 1] - top[..., k]) > 0.1  # (batch, seq): no near-tie at the k-th place
    assert int(clear.sum()) >= clear.numel() // 2
    a, b = t32[names[0]].sort(-1).values, t16[names[0]].sort(-1).values  # (batch, seq, k)
    assert torch.equal(a[clear], b[clear])
    # transformers' own bfloat16 forward, at the same tolerance
    ref = FAMILIES[family][1].from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    with torch.no_grad():
        want16 = ref(input_ids=tokens()).logits.float()
    torch.testing.assert_close(got, want16, atol=0.05 * scale, rtol=0)


def test_an_experts_products_round_to_bfloat16(folder: tuple[str, Path]) -> None:
    """Expert e's output is bf16(act(g) * u) W_out with g, u and the result each a bfloat16 product of
    bfloat16-rounded inputs (float32 sums), as every product of the model at this precision."""
    _, path = folder
    moe = next(
        b.mlp for b in hs.load(path, precision="bfloat16").model.blocks if isinstance(b.mlp, MixtureOfExperts)
    )
    x = torch.randn(5, moe.experts_gate.shape[-1], generator=torch.Generator().manual_seed(1))

    def rb(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).float()

    e = 1
    plain = [getattr(moe, n).as_subclass(torch.Tensor)[e] for n in ("experts_gate", "experts_in")]
    gate, up = (rb(F.linear(rb(x), w)) for w in plain)  # (5, d_mlp) each
    w_out = moe.experts_out.as_subclass(torch.Tensor)[e]  # (d_model, d_mlp)
    want = rb(F.linear(rb(moe.act(gate) * up), w_out))  # (5, d_model)
    with torch.no_grad():
        got = moe.expert(e, x)
    torch.testing.assert_close(got, want, atol=0, rtol=2**-7)  # at most one bfloat16 step (sum order)
    assert isinstance(moe.experts_gate, BF16Experts)
