"""Gemma 2, Gemma 3, Qwen3, OLMo 2, SmolLM3 and sliding-window Mistral on headspace's own layers.

References: tiny random models built and saved by transformers 5 (eager attention), read by
:func:`headspace.pretrained.load_llama` without transformers. Every model has a sliding window (or
NoPE / QK-norm layers) that a 13-token sequence crosses, so a wrong window, norm or rotation shows.
Tolerances (float32): logits <= 1e-4, every head's pattern <= 5e-5; gradients to float32 rounding
at their scale (rtol 1e-4, atol 2e-5 x max |grad|); greedy generation token for token, also on a
left-padded batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

import headspace as hs
from headspace.decode import describe, generation_caches
from headspace.pretrained import load_llama
from headspace.pretrained.llama import llama_parameter_count

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, H, DH, DM, W = 97, 42, 3, 6, 10, 59, 5  # vocab, hidden, layers, heads, head_dim, mlp, window
SLIDING = ["sliding_attention", "full_attention", "sliding_attention"]
# name -> (config class, model class, overrides)
ARCHS: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    # one key/value head for every query head (as Gemma 3 270M), QK-norm, local / global RoPE bases
    "gemma3_text": (
        T.Gemma3TextConfig,
        T.Gemma3ForCausalLM,
        {
            "num_key_value_heads": 1,
            "layer_types": SLIDING,
            "query_pre_attn_scalar": 17,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        },
    ),
    # soft-capped scores and logits (small caps, so that they bend), sandwich norms
    "gemma2": (
        T.Gemma2Config,
        T.Gemma2ForCausalLM,
        {
            "num_key_value_heads": 2,
            "query_pre_attn_scalar": 13,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
        },
    ),
    "qwen3": (
        T.Qwen3Config,
        T.Qwen3ForCausalLM,
        {"num_key_value_heads": 3, "use_sliding_window": True, "max_window_layers": 1},
    ),
    # no window (transformers' OLMo 2 has none; a stray sliding_window in its config would still make
    # transformers' cache keep only the window's keys, so the reference would disagree with itself)
    "olmo2": (T.Olmo2Config, T.Olmo2ForCausalLM, {"num_key_value_heads": 2, "sliding_window": None}),
    "smollm3": (
        T.SmolLM3Config,
        T.SmolLM3ForCausalLM,
        {"num_key_value_heads": 2, "no_rope_layers": [1, 0, 1]},
    ),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, {"num_key_value_heads": 2}),
}


def build(arch: str, folder: Path) -> Any:
    """A random transformers model of ``arch`` saved into ``folder``, read back with eager attention."""
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    kw = dict(
        vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, head_dim=DH,
        intermediate_size=DM, max_position_embeddings=64, sliding_window=W, initializer_range=0.2,
        pad_token_id=0, bos_token_id=1, eos_token_id=None, tie_word_embeddings=arch != "olmo2",
    )  # fmt: skip
    kw.update(extra)
    model = model_cls(config_cls(**kw)).eval()
    with torch.no_grad():  # norms away from their start, so a swapped or skipped one shows
        for name, p in model.named_parameters():
            if "norm" in name:
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


def test_configs_say_what_each_architecture_is(saved: dict) -> None:
    c = {arch: load_llama(folder).config for arch, (folder, _) in saved.items()}
    for arch, (_, ref) in saved.items():  # the arithmetic count is what the checkpoint holds
        assert llama_parameter_count(c[arch])[0] == sum(p.numel() for p in ref.parameters()), arch
    g3 = c["gemma3_text"]
    assert (g3.norm, g3.norm_offset, g3.qk_norm, g3.n_kv_heads) == ("sandwich", 1.0, "head", 1)
    assert (g3.sliding_window, g3.layer_types) == (W, ["sliding", "full", "sliding"])
    assert (g3.rope_theta, g3.rope_local_theta, g3.embed_scale) == (1e6, 100.0, D**0.5)
    assert abs(g3.attn_scale - 17**-0.5) < 1e-15
    assert (c["gemma2"].attn_softcap, c["gemma2"].final_softcap) == (2.0, 3.0)
    assert c["gemma2"].layer_types == ["sliding", "full", "sliding"]
    assert (c["qwen3"].qk_norm, c["qwen3"].layer_types) == ("head", ["full", "sliding", "sliding"])
    assert (c["olmo2"].norm, c["olmo2"].qk_norm, c["olmo2"].sliding_window) == ("post_sublayer", "all", None)
    assert c["smollm3"].nope_layers == [1] and c["mistral"].layer_types == ["sliding"] * L
    model = load_llama(saved["smollm3"][0]).model
    assert [b.attn.rotary is None for b in model.blocks] == [False, True, False]
    assert hs.load(saved["gemma3_text"][0]).config.qk_norm == "head"  # by config.json's model_type


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_and_every_head_pattern_equal_transformers(saved: dict, arch: str) -> None:
    folder, ref = saved[arch]
    ours = load_llama(folder)
    tokens = torch.randint(1, V, (2, 13))  # longer than the window (5)
    with torch.no_grad():
        want = ref(input_ids=tokens, output_attentions=True)
        with hs.trace(ours.model, names="*.hook_pattern") as t:
            traced = ours(tokens)
        fast = ours.model(tokens)
    torch.testing.assert_close(traced, want.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(fast, want.logits, atol=1e-4, rtol=0)
    for layer in range(L):
        torch.testing.assert_close(t.pattern(layer), want.attentions[layer], atol=5e-5, rtol=0)
    if ours.config.sliding_window is not None:  # the window has teeth: a key W back gets no weight
        sliding = ours.config.layer_types.index("sliding")
        assert float(t.pattern(sliding)[:, :, W:, 0].abs().max()) == 0.0


@pytest.mark.parametrize("arch", list(ARCHS))
def test_gradients_equal_transformers(saved: dict, arch: str) -> None:
    folder, ref = saved[arch]
    ours = load_llama(folder).model.train()  # dropout 0: train = eval
    ref.zero_grad()
    tokens = torch.randint(1, V, (2, 11))
    weights = torch.randn(2, 11, V)
    (ref(input_ids=tokens).logits * weights).sum().backward()
    (ours(tokens) * weights).sum().backward()
    hq = H * DH
    a, theirs = ours.blocks[0].attn, ref.model.layers[0].self_attn
    _close_grad(a.qkv_weight.grad[:hq], theirs.q_proj.weight.grad)
    _close_grad(ours.tok_embed.weight.grad, ref.model.embed_tokens.weight.grad)
    if a.q_norm is not None:
        _close_grad(a.k_norm.weight.grad, theirs.k_norm.weight.grad)
    _close_grad(ours.blocks[2].ln2.weight.grad, _ln2(ref, arch).weight.grad)
    ref.eval()


def _close_grad(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to float32 rounding at the gradient's own scale (sums taken in another order)."""
    scale = float(want.abs().max())
    assert scale > 0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5 * scale)


def _ln2(ref: Any, arch: str) -> Any:
    layer = ref.model.layers[2]
    if arch in ("gemma2", "gemma3_text"):
        return layer.pre_feedforward_layernorm
    return layer.post_feedforward_layernorm if arch == "olmo2" else layer.post_attention_layernorm


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_generation_equals_transformers_also_left_padded(saved: dict, arch: str) -> None:
    folder, ref = saved[arch]
    ours = load_llama(folder)
    # the cached step covers windows, QK-norm, NoPE, sandwich norms and both soft-cappings (Gemma 2's
    # scores: the Python step's only)
    assert describe(ours.model) is not None
    lengths, new = (7, 3, 5), 2 * W + 1  # 11 new tokens: more than 2x the window past the prompt
    if ours.config.sliding_window is not None:  # the sliding layers' caches hold the window, no more
        caches = generation_caches(ours.model, len(lengths), max(lengths) + new)
        held = {c.k.shape[2] for c, b in zip(caches, ours.model.blocks) if b.attn.window is not None}
        assert held == {W}
    seq = max(lengths)
    tokens = torch.zeros(len(lengths), seq, dtype=torch.long)  # (batch, seq), pad id 0
    key_padding = torch.zeros(len(lengths), seq, dtype=torch.bool)  # (batch, seq)
    for i, n in enumerate(lengths):
        tokens[i, seq - n :] = torch.randint(1, V, (n,))
        key_padding[i, seq - n :] = True
    alone = ours.generate(tokens[:1], new, temperature=0)
    padded = ours.generate(tokens, new, key_padding=key_padding, temperature=0)
    assert torch.equal(
        padded, ours.generate(tokens, new, key_padding=key_padding, temperature=0, use_cache=False)
    )
    with torch.no_grad():
        want_alone = ref.generate(
            tokens[:1], attention_mask=torch.ones_like(tokens[:1]), max_new_tokens=new, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
        want = ref.generate(
            tokens, attention_mask=key_padding.long(), max_new_tokens=new, do_sample=False, pad_token_id=0
        )
    assert torch.equal(alone, want_alone)
    assert torch.equal(padded, want)


def test_bad_values_are_refused_naming_the_field() -> None:
    base = dict(arch="decoder", vocab_size=11, d_model=12, n_layers=2, n_heads=2, norm_kind="rmsnorm")
    cases = [
        ({"sliding_window": 0}, "sliding_window must be None or an int >= 1"),
        ({"layer_types": ["sliding", "full"]}, "has 'sliding' layers but sliding_window is None"),
        ({"layer_types": ["full"]}, "layer_types must list"),
        ({"qk_norm": "layer"}, "qk_norm must be None, 'head', 'all' or 'head_layernorm'"),
        ({"attn_softcap": 0.0}, "attn_softcap must be None or a finite number > 0"),
        ({"final_softcap": float("inf")}, "final_softcap must be None"),
        ({"embed_scale": -1.0}, "embed_scale must be a finite number > 0"),
        ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be None"),
        ({"nope_layers": [2]}, "nope_layers must be a list of layer indices"),
        (
            {"norm_kind": "layernorm", "norm_offset": 1.0},
            "norm_offset must be a finite number, non-zero only",
        ),
        ({"rope_local_theta": 100.0}, "need positions='rotary'"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            hs.ModelConfig(**{**base, **change})
    c = hs.ModelConfig(**base, positions="rotary", sliding_window=3, layer_types=["sliding", "full"])
    assert hs.ModelConfig.from_dict(c.to_dict()) == c


def test_qk_capture_applies_qk_norm_and_pruning_refuses_a_joint_norm(saved: dict) -> None:
    from headspace.analysis.chunked import each_layer_qk

    model = load_llama(saved["qwen3"][0]).model  # per-head QK-norm; layer 0 is a full layer
    tokens = torch.randint(1, V, (1, 9))
    with torch.no_grad(), hs.trace(model, names="blocks.0.attn.hook_rot_q") as t:
        model(tokens)
    got: list[torch.Tensor] = []
    with torch.no_grad():
        each_layer_qk(model, lambda: model(tokens), lambda lqk: got.append(lqk.q.clone()), layers=[0])
    torch.testing.assert_close(got[0], t["blocks.0.attn.hook_rot_q"])  # normed, then rotated
    olmo = load_llama(saved["olmo2"][0]).model
    with pytest.raises(ValueError, match="qk_norm='all'"):
        hs.prune_heads(olmo, {0: [0, 1, 2]})  # a whole key/value group


def test_features_the_decoding_step_covers_keep_it_and_the_others_fall_back_to_forward() -> None:
    base = dict(
        arch="decoder", vocab_size=V, d_model=D, n_layers=2, n_heads=H, n_kv_heads=2, d_head=DH, d_mlp=DM,
        positions="rotary", norm_kind="rmsnorm", mlp_kind="gated", act="gelu_tanh", bias=False,
    )  # fmt: skip
    step_ok = [
        {"embed_scale": D**0.5, "norm_offset": 1.0, "query_pre_attn_scalar": 17},
        {"sliding_window": 3},
        {"qk_norm": "head"},
        {"qk_norm": "all"},
        {"final_softcap": 3.0},
        {"attn_softcap": 2.0},
        {"norm": "sandwich"},
        {"norm": "post_sublayer"},
        {"nope_layers": [1]},
        {"sliding_window": 3, "layer_types": ["sliding", "full"], "rope_local_theta": 100.0},
    ]
    forward_only: list[dict] = []
    prompt = torch.randint(0, V, (2, 5))
    for change in [*step_ok, *forward_only]:
        torch.manual_seed(0)
        model = hs.Decoder(hs.ModelConfig(**base, **change)).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        assert (describe(model) is not None) == (change in step_ok), change
        cached = model.generate(prompt, 6, temperature=0, native=False)  # (the Python step)
        assert torch.equal(cached, model.generate(prompt, 6, temperature=0, use_cache=False)), change
