"""``headspace.ablate(model, experts=...)`` against transformers (issue #39).

"zero" is the layer's output minus that expert's term, the routing unchanged: in transformers that is
the same forward with the expert's down-projection (and its bias) zeroed. References: tiny random
models built and saved by transformers 5.25 (routers, norms and biases random), read back by
``headspace.load``.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

import headspace as hs
from headspace.model.moe import MixtureOfExperts

pytestmark = pytest.mark.usefixtures("single_thread")

V = 61
BASE = dict(vocab_size=V, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=6, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False)  # fmt: skip
MIXTRAL = dict(num_local_experts=5, num_experts_per_tok=2, intermediate_size=13)
QWEN2_MOE = dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=13, intermediate_size=20,
                 shared_expert_intermediate_size=11, norm_topk_prob=False)  # fmt: skip
DEEPSEEK_V3 = dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=12, intermediate_size=30,
                   n_shared_experts=1, routed_scaling_factor=1.7, n_group=4, topk_group=2,
                   first_k_dense_replace=1, q_lora_rank=14, kv_lora_rank=10, qk_rope_head_dim=4, head_dim=4,
                   num_key_value_heads=4, qk_nope_head_dim=8, v_head_dim=6, norm_topk_prob=True)  # fmt: skip
GPT_OSS = dict(num_local_experts=5, num_experts_per_tok=2, intermediate_size=13, sliding_window=4,
               layer_types=["sliding_attention", "full_attention"], swiglu_limit=1.5, eos_token_id=None,
               rope_parameters={"rope_type": "default", "rope_theta": 1000.0})  # fmt: skip
LLAMA4 = dict(num_local_experts=3, num_experts_per_tok=1, intermediate_size=14, intermediate_size_mlp=22,
              interleave_moe_layer_step=2, attention_chunk_size=5, no_rope_layer_interval=2,
              rope_parameters={"rope_type": "default", "rope_theta": 300.0})  # fmt: skip
QWEN3_NEXT = dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=9, intermediate_size=20,
                  shared_expert_intermediate_size=11, decoder_sparse_step=1, mlp_only_layers=[],
                  partial_rotary_factor=1 / 3, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=5, linear_value_head_dim=7, linear_conv_kernel_dim=3,
                  layer_types=["linear_attention", "full_attention"])  # fmt: skip
GEMMA4 = dict(enable_moe_block=True, num_experts=5, top_k_experts=2, moe_intermediate_size=9,
              intermediate_size=20, num_kv_shared_layers=0, hidden_size_per_layer_input=0, global_head_dim=10,
              sliding_window=4, attention_k_eq_v=False,
              layer_types=["sliding_attention", "full_attention"])  # fmt: skip
# name -> (config class, model class, overrides, path of a layer's MoE in transformers, shared expert's name)
FAMILIES: dict[str, tuple[Any, Any, dict[str, Any], str, str | None]] = {
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, MIXTRAL, "mlp", None),
    "qwen2_moe": (T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM, QWEN2_MOE, "mlp", "shared_expert"),
    "deepseek_v3": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM, DEEPSEEK_V3, "mlp", "shared_experts"),
    "gpt_oss": (T.GptOssConfig, T.GptOssForCausalLM, GPT_OSS, "mlp", None),
    "llama4_text": (T.Llama4TextConfig, T.Llama4ForCausalLM, LLAMA4, "feed_forward", "shared_expert"),
    "qwen3_next": (T.Qwen3NextConfig, T.Qwen3NextForCausalLM, QWEN3_NEXT, "mlp", "shared_expert"),
    "gemma4_text": (T.Gemma4TextConfig, T.Gemma4ForCausalLM, GEMMA4, "", "mlp"),  # experts on the layer
}


def build(family: str, folder: Path) -> Any:
    """A random transformers model of ``family`` saved into ``folder``, read back with eager attention."""
    config_cls, model_cls, extra, _, _ = FAMILIES[family]
    torch.manual_seed(5)
    model = model_cls(config_cls(**{**BASE, **extra})).eval()
    with torch.no_grad():
        bias = [(n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
        for name, p in [*model.named_parameters(), *bias]:
            if "norm" in name or "scale" in name:  # (Gemma 4: the router's scales)
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif "router" in name or name.endswith(("mlp.gate.weight", "e_score_correction_bias", "sinks")):
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model_cls.from_pretrained(
        folder, attn_implementation="eager", experts_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Any]]:
    """family -> (headspace model, transformers model), built lazily."""
    return {}


def pair(saved: dict, factory: pytest.TempPathFactory, family: str) -> tuple[Any, Any]:
    if family not in saved:
        folder = factory.mktemp(family)
        ref = build(family, folder)
        saved[family] = (hs.load(folder), ref)
    return saved[family]


def moe_layers(ours: Any) -> list[int]:
    return [i for i, b in enumerate(ours.model.blocks) if isinstance(b.mlp, MixtureOfExperts)]


def tokens() -> torch.Tensor:
    return torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(7))


def zeroed_reference(ref: Any, path: str, layer: int, expert: int | str, shared: str | None) -> torch.Tensor:
    """transformers' logits with ``expert``'s down-projection (and bias) of ``layer`` zeroed."""
    moe = getattr(ref.model.layers[layer], path) if path else ref.model.layers[layer]
    if expert == "shared":
        params = [getattr(moe, shared).down_proj.weight]
    else:
        params = [moe.experts.down_proj]
        if getattr(moe.experts, "down_proj_bias", None) is not None:
            params.append(moe.experts.down_proj_bias)
    saved = [p.detach().clone() for p in params]
    try:
        with torch.no_grad():
            for p in params:
                p[expert if expert != "shared" else slice(None)] = 0.0
            return ref(input_ids=tokens()).logits
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_zero_equals_transformers_with_the_down_projection_zeroed(
    saved: dict, tmp_path_factory: pytest.TempPathFactory, family: str
) -> None:
    ours, ref = pair(saved, tmp_path_factory, family)
    _, _, _, path, shared = FAMILIES[family]
    layer = moe_layers(ours)[-1]
    with torch.no_grad(), hs.trace(ours.model, names=[f"blocks.{layer}.mlp.hook_routing"]) as t:
        plain = ours(tokens())
        routing = t[f"blocks.{layer}.mlp.hook_routing"]  # (batch, seq, E)
    expert = int(routing.ne(0).sum((0, 1)).argmax())  # the busiest expert
    cases: list[int | str] = [expert] + (["shared"] if shared else [])
    for e in cases:
        want = zeroed_reference(ref, path, layer, e, shared)
        with torch.no_grad(), hs.ablate(ours, experts={(layer, e): "zero"}):
            got = ours(tokens())
        scale = float(want.abs().max())
        torch.testing.assert_close(got, want, atol=1e-4 * scale, rtol=0)
        assert float((got - plain).abs().max()) > 1e-2 * scale, (family, e)  # the ablation has teeth
    with torch.no_grad():  # undone on exit
        torch.testing.assert_close(ours(tokens()), plain, atol=0, rtol=0)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_mean_replaces_the_routed_rows_by_their_mean_routing_unchanged(
    saved: dict, tmp_path_factory: pytest.TempPathFactory, family: str
) -> None:
    ours, _ = pair(saved, tmp_path_factory, family)
    layer = moe_layers(ours)[-1]
    pre = f"blocks.{layer}"
    names = [f"{pre}.mlp.hook_expert_out", f"{pre}.mlp.hook_shared_out", f"{pre}.hook_mlp_out",
             f"{pre}.mlp.hook_routing", f"{pre}.mlp.hook_top_k"]  # fmt: skip
    with torch.no_grad(), hs.trace(ours.model, names=names) as t:
        ours(tokens())
    routing = t[f"{pre}.mlp.hook_routing"]  # (batch, seq, E)
    counts = routing.ne(0).sum((0, 1))  # (E,)
    e = int(torch.where(counts < counts.new_tensor(routing[..., 0].numel()), counts, -1).argmax())
    rows = routing[..., e].ne(0)  # (batch, seq)
    assert 0 < int(rows.sum()) < rows.numel()  # some tokens took it, some did not
    c = t[f"{pre}.mlp.hook_expert_out"][..., e, :]  # (batch, seq, d_model)
    s = t[f"{pre}.mlp.hook_shared_out"]  # (batch, seq, d_model)
    want = t[f"{pre}.hook_mlp_out"] - c + rows[..., None] * c[rows].mean(0) - s + s.mean((0, 1))
    with torch.no_grad(), hs.ablate(ours, experts={(layer, e): "mean", (layer, "shared"): "mean"}):
        with hs.trace(ours.model, names=names) as t2:
            ours(tokens())
    torch.testing.assert_close(t2[f"{pre}.hook_mlp_out"], want, atol=1e-5, rtol=0)
    assert torch.equal(t2[f"{pre}.mlp.hook_top_k"], t[f"{pre}.mlp.hook_top_k"])  # routing unchanged


def test_heads_and_experts_together_and_other_threads_untouched(
    saved: dict, tmp_path_factory: pytest.TempPathFactory
) -> None:
    ours, _ = pair(saved, tmp_path_factory, "mixtral")
    with torch.no_grad():
        plain = ours(tokens())
        with hs.ablate(ours, {(0, 1): "zero"}):
            heads_only = ours(tokens())
        with hs.ablate(ours, {(0, 1): "zero"}, experts=[(1, 0)]):
            both = ours(tokens())
            seen: list[torch.Tensor] = []
            other = threading.Thread(target=lambda: seen.append(ours(tokens())))
            other.start()
            other.join()
        with hs.ablate(ours, experts=[(1, 0)], all_threads=True):
            box: list[torch.Tensor] = []
            other = threading.Thread(target=lambda: box.append(ours(tokens())))
            other.start()
            other.join()
    assert not torch.allclose(both, heads_only) and not torch.allclose(both, plain)
    torch.testing.assert_close(seen[0], plain, atol=0, rtol=0)  # another thread: unablated
    with torch.no_grad(), hs.ablate(ours, experts=[(1, 0)]):
        experts_only = ours(tokens())
    torch.testing.assert_close(box[0], experts_only, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("experts", "message"),
    [
        (
            {(0, 1): "zero"},
            r"experts: layer 0 has no mixture of experts \(its MLP is a \w+\); the layers with "
            r"experts are \[1\]; got \(0, 1\)",
        ),
        ({(2, 1): "zero"}, r"experts: layer must be an int in \[0, 2\) for this model; got 2"),
        ({(1, 8): "zero"}, r"experts: expert must be an int in \[0, 8\) or 'shared' for layer 1; got 8"),
        ({(1, "x"): "zero"}, r"experts: expert must be an int in \[0, 8\) or 'shared' for layer 1; got 'x'"),
        ({(1, 2): "resample"}, r"experts\[\(1, 2\)\] must be one of \('zero', 'mean'\); got 'resample'"),
    ],
)
def test_bad_experts_are_refused_in_one_line(
    saved: dict, tmp_path_factory: pytest.TempPathFactory, experts: dict, message: str
) -> None:
    ours, _ = pair(saved, tmp_path_factory, "deepseek_v3")
    with pytest.raises(ValueError, match=f"^{message}$"), hs.ablate(ours, experts=experts):
        pass


def test_a_layer_without_a_shared_expert_refuses_it_by_name(
    saved: dict, tmp_path_factory: pytest.TempPathFactory
) -> None:
    ours, _ = pair(saved, tmp_path_factory, "mixtral")
    message = r"^experts: layer 1 has no shared expert: expert must be an int in \[0, 5\); got 'shared'$"
    with pytest.raises(ValueError, match=message), hs.ablate(ours, experts={(1, "shared"): "zero"}):
        pass
