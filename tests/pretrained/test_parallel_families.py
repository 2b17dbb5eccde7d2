"""GPT-NeoX (parallel and sequential residual), StableLM (parallel and sequential) and Cohere against
transformers 5 itself: partial rotary, interleaved pairs, LayerNorm with and without bias, the
parallel layout.

References: tiny random checkpoints built and saved by transformers (odd sizes, every norm weight and
bias random, non-default values of the fields that matter), read back with ``headspace.load`` and
compared with transformers' eager forward: logits within 1e-4 of their largest magnitude, every
head's pattern within 1e-5; greedy decoding token for token through the cached step (the parallel
layout on the Python backend: the native step has no form of it); ``head.qk(delta)`` against
the traced scores on a partial and an interleaved rotation.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

import headspace as hs
from headspace.decode import describe

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, H, DM, CTX = 83, 48, 3, 4, 37, 32  # vocab, hidden, layers, heads (d_head 12), mlp, context
ARCHS: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "gpt_neox": (
        T.GPTNeoXConfig,
        T.GPTNeoXForCausalLM,
        {
            "use_parallel_residual": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 300.0, "partial_rotary_factor": 1 / 3},
        },
    ),
    "gpt_neox_sequential": (
        T.GPTNeoXConfig,
        T.GPTNeoXForCausalLM,
        {
            "use_parallel_residual": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 300.0, "partial_rotary_factor": 0.5},
        },
    ),
    "stablelm": (
        T.StableLmConfig,
        T.StableLmForCausalLM,
        {
            "num_key_value_heads": 2,
            "use_qkv_bias": True,
            "use_parallel_residual": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 90.0, "partial_rotary_factor": 2 / 3},
        },
    ),
    "stablelm_sequential": (
        T.StableLmConfig,
        T.StableLmForCausalLM,
        {
            "num_key_value_heads": 4,
            "use_parallel_residual": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 90.0, "partial_rotary_factor": 0.5},
        },
    ),
    "phi": (
        T.PhiConfig,
        T.PhiForCausalLM,
        {
            "hidden_act": "gelu_new",
            "rope_parameters": {"rope_type": "default", "rope_theta": 60.0, "partial_rotary_factor": 0.5},
        },
    ),
    # rotary_dim 8 of d_head 12, interleaved; n_inner None: 4 d_model
    "gptj": (
        T.GPTJConfig,
        T.GPTJForCausalLM,
        {"rotary_dim": 8, "n_inner": None, "tie_word_embeddings": False},
    ),
    # per-head QK LayerNorm (qk_norm "head_layernorm")
    "stablelm_qk": (
        T.StableLmConfig,
        T.StableLmForCausalLM,
        {
            "num_key_value_heads": 2,
            "qk_layernorm": True,
            "use_parallel_residual": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 90.0, "partial_rotary_factor": 0.5},
        },
    ),
    "cohere_qk": (
        T.CohereConfig,
        T.CohereForCausalLM,
        {
            "num_key_value_heads": 2,
            "use_qk_norm": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 70.0},
        },
    ),
    "cohere": (
        T.CohereConfig,
        T.CohereForCausalLM,
        {
            "num_key_value_heads": 2,
            "logit_scale": 0.37,
            "attention_bias": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 70.0},
        },
    ),
}


def build(arch: str, folder: Path) -> Any:
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    kw = dict(
        vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, intermediate_size=DM,
        max_position_embeddings=CTX, initializer_range=0.3, pad_token_id=0, bos_token_id=1,
        eos_token_id=None, layer_norm_eps=1e-5,
    )  # fmt: skip
    kw.update(extra)
    model = model_cls(config_cls(**kw)).eval()
    with torch.no_grad():  # norms and biases away from their start, so a wrong or skipped one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    return model_cls.from_pretrained(folder, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    out = {}
    for arch in ARCHS:
        folder = tmp_path_factory.mktemp(arch)
        out[arch] = (folder, build(arch, folder))
    return out


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_and_every_head_pattern_equal_transformers(saved: dict, arch: str) -> None:
    folder, ref = saved[arch]
    ours = hs.load(folder)
    assert ours.config.norm == ("pre" if arch.endswith("sequential") else "parallel")
    tokens = torch.randint(1, V, (2, 13))
    with torch.no_grad():
        want = ref(input_ids=tokens, output_attentions=True)
        with hs.trace(ours.model, names="*.hook_pattern") as t:
            got = ours(tokens)
    bound = 1e-4 * float(want.logits.abs().max())
    torch.testing.assert_close(got, want.logits, atol=bound, rtol=0)
    for layer in range(L):
        torch.testing.assert_close(t.pattern(layer), want.attentions[layer], atol=1e-5, rtol=0)


def test_configs_say_what_each_family_is(saved: dict) -> None:
    rot = {a: hs.load(f).model.blocks[0].attn.rotary for a, (f, _) in saved.items()}
    assert (rot["gpt_neox"].rotary_dim, rot["gpt_neox_sequential"].rotary_dim) == (4, 6)
    assert (rot["stablelm"].rotary_dim, rot["stablelm"].base) == (8, 90.0)
    assert (rot["cohere"].rotary_dim, rot["cohere"].interleaved) == (12, True)
    assert (rot["gptj"].rotary_dim, rot["gptj"].interleaved, rot["gptj"].base) == (8, True, 10000.0)
    assert (rot["phi"].rotary_dim, rot["phi"].interleaved) == (6, False)
    for arch in ("gptj", "phi"):  # the unembedding's bias is there, and random
        assert hs.load(saved[arch][0]).model.lm_head.bias.abs().max() > 0
    cohere = hs.load(saved["cohere"][0]).config
    assert cohere.extra["logit_scale"] == 0.37 and not cohere.tie_embeddings


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_decoding_equals_transformers(saved: dict, arch: str) -> None:
    folder, ref = saved[arch]
    ours = hs.load(folder)
    step = describe(ours.model)  # the Python cached step runs both layouts (the native one: sequential)
    assert step is not None
    assert [layer.parallel for layer in step.layers] == [True if ours.config.norm == "parallel" else None] * L
    prompt = torch.randint(1, V, (1, 6))
    got = ours.generate(prompt, 10, temperature=0)
    with torch.no_grad():
        want = ref.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False, pad_token_id=0
        )
    assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ["gpt_neox", "cohere", "gptj"])
def test_qk_delta_is_the_partial_or_interleaved_circuit(saved: dict, arch: str) -> None:
    ours = hs.load(saved[arch][0])
    tokens = torch.randint(1, V, (1, 11))
    with hs.trace(ours.model, names=["blocks.1.hook_attn_in", "blocks.1.attn.hook_scores"]) as t:
        ours(tokens)
    attn = ours.model.blocks[1].attn
    x = t["blocks.1.hook_attn_in"][0].double()  # (S, d_model)
    xa = torch.cat([x, torch.ones(11, 1, dtype=torch.float64)], dim=-1)  # (S, d_model + 1): the biases
    scores = t["blocks.1.attn.hook_scores"][0].double() / attn.scale  # (H, S, S)
    delta = torch.arange(11)[:, None] - torch.arange(11)[None, :]  # (S, S)
    causal = torch.ones(11, 11, dtype=torch.bool).tril()
    for h in range(H):
        AB = attn.heads[h].qk(delta, augmented=True).AB.double()  # (S, S, d_model + 1, d_model + 1)
        got = torch.einsum("im,ijmn,jn->ij", xa, AB, xa)  # (S, S)
        torch.testing.assert_close(got[causal], scores[h][causal], rtol=1e-4, atol=1e-4)


def test_per_head_qk_layernorm_is_loaded_and_its_circuit_refused_by_name(saved: dict, tmp_path: Path) -> None:
    for arch in ("stablelm_qk", "cohere_qk"):
        ours = hs.load(saved[arch][0])
        attn = ours.model.blocks[0].attn
        assert ours.config.qk_norm == "head_layernorm" and attn.q_norm.weight.shape == (H, 12)
        assert attn.k_norm.weight.shape == (2, 12) and float(attn.q_norm.weight.detach().std()) > 0
        with pytest.raises(ValueError, match="attention field 'qk_norm' \\('head_layernorm'"):
            attn.heads[0].qk(3)
    for arch, key in (("phi", "qk_layernorm"),):  # Phi's is one LayerNorm with bias shared by the heads
        folder = tmp_path / arch
        shutil.copytree(saved[arch][0], folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, key: True}))
        with pytest.raises(ValueError, match=f"{key}=true") as info:
            hs.load(folder)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("arch", ["gpt_neox", "gptj"])
def test_score_decomposition_adds_up_through_parallel_blocks(saved: dict, arch: str) -> None:
    """The parts (embedding, every earlier head and MLP, the bias) of a head's score add up to it: the
    heads of a parallel block read its LN1, frozen, as a pre-norm block's do."""
    from headspace.analysis.decomposition import score_decomposition

    model = hs.load(saved[arch][0]).model
    tokens = torch.randint(1, V, (1, 9), generator=torch.Generator().manual_seed(3))
    for layer, head, q in [(0, 1, 4), (2, 3, 8)]:
        r = score_decomposition(model, tokens, layer, head, query=q)
        assert abs(r.total - r.score) <= 1e-4 * max(1.0, abs(r.score)), (layer, r.total, r.score)


def test_pruning_a_per_head_qk_layernorm_layer_keeps_the_kept_heads_norms(saved: dict) -> None:
    """Pruned heads 2, 3 (key/value head 1) of a StableLM layer with per-head QK LayerNorm: the layer
    computes what the unpruned one does with those heads' z zero-ablated."""
    from headspace.analysis.interventions import prune_heads

    ours = hs.load(saved["stablelm_qk"][0]).model
    tokens = torch.randint(1, V, (1, 9), generator=torch.Generator().manual_seed(5))

    with torch.no_grad():
        with hs.ablate(ours, {(0, 2): "zero", (0, 3): "zero"}):
            want = ours(tokens)
        prune_heads(ours, {0: [2, 3]})
        assert ours.blocks[0].attn.q_norm.weight.shape == (2, 12)
        got = ours(tokens)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
