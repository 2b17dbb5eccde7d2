"""Llama-family checkpoints (Llama, Mistral, Qwen2) on headspace's own layers, against transformers.

The references are small random models built and saved by transformers 5 (``save_pretrained``,
safetensors); headspace reads the folders without transformers. Tolerances are the float32
``assert_close`` defaults (rtol 1.3e-6, atol 1e-5) everywhere; the logits in fact come out bitwise equal.
"""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import headspace as hs
from headspace.model.block import GatedFeedForward, TransformerBlock
from headspace.nn.norms import RMSNorm
from headspace.nn.positions import Rotary
from headspace.pretrained import PretrainedDecoder, hf, llama_config, llama_from_tensors, load_llama
from headspace.pretrained import llama as llama_module
from headspace.pretrained.llama import llama_parameter_count

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, H, DH, DM, CTX = 97, 42, 2, 6, 10, 58, 64  # vocab, hidden, layers, heads, head_dim, mlp, context
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# name -> (config class, model class, config overrides)
ARCHS: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    # GQA (groups of 3), head_dim 10 != hidden / heads = 7, untied, Llama 3.1 RoPE scaling
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {"num_key_value_heads": 2, "rope_parameters": {"rope_theta": 500.0, **LLAMA3}},
    ),
    # every head its own key/value head, biases on q, k, v, o and the MLP, tied, linear scaling, GeGLU
    "llama_bias_tied": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {
            "attention_bias": True,
            "mlp_bias": True,
            "tie_word_embeddings": True,
            "hidden_act": "gelu_pytorch_tanh",
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        },
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        {"num_key_value_heads": 3, "sliding_window": None},
    ),
    # q/k/v biases only, tied (as Qwen2-0.5B), GQA
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        {"num_key_value_heads": 2, "tie_word_embeddings": True},
    ),
}


def build(arch: str, folder: Path, **overrides: Any) -> tuple[Path, Any]:
    """A small random transformers model of ``arch`` saved into ``folder``; returns (folder, model)."""
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    kw = dict(
        vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, head_dim=DH,
        intermediate_size=DM, max_position_embeddings=CTX, bos_token_id=1, eos_token_id=None,
        initializer_range=0.2,  # larger than the default 0.02: greedy decoding does not fall into repeats
    )  # fmt: skip
    kw.update(extra)
    kw.update(overrides)
    model = model_cls(config_cls(**kw)).eval()
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a swapped one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Each architecture's folder and its transformers model (eager attention, for the patterns)."""
    out = {}
    for arch in ARCHS:
        folder, _ = build(arch, tmp_path_factory.mktemp(arch))
        ref = ARCHS[arch][1].from_pretrained(folder, attn_implementation="eager").eval()
        out[arch] = (folder, ref)
    return out


def edit_config(folder: Path, **changes: Any) -> Path:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
    return folder


def copy_folder(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


# ---------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_and_every_head_pattern_equal_transformers(saved: dict, arch: str) -> None:
    folder, ref = saved[arch]
    ours = load_llama(folder)
    assert isinstance(ours, PretrainedDecoder)
    c = ours.config
    assert (c.positions, c.norm_kind, c.mlp_kind, c.n_kv_heads, c.d_head) == (
        "rotary", "rmsnorm", "gated", ref.config.num_key_value_heads, DH,
    )  # fmt: skip
    assert (ours.model.lm_head is None) == ref.config.tie_word_embeddings
    tokens = torch.randint(0, V, (3, 13))
    with torch.no_grad():
        want = ref(input_ids=tokens, output_attentions=True)
    with hs.trace(ours.model, names="*.hook_pattern") as t:
        got = ours(tokens)
    torch.testing.assert_close(got, want.logits)
    torch.testing.assert_close(ours.model(tokens), want.logits)  # the untraced fast path too
    for layer in range(L):
        torch.testing.assert_close(t.pattern(layer), want.attentions[layer])


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_generation_equals_transformers_also_left_padded(saved: dict, arch: str) -> None:
    folder, ref = saved[arch]
    ours = load_llama(folder)
    prompt = torch.randint(0, V, (2, 4))
    cached = ours.generate(prompt, 9, temperature=0)
    assert torch.equal(cached, ours.generate(prompt, 9, temperature=0, use_cache=False))
    with torch.no_grad():
        theirs = ref.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=9, do_sample=False, pad_token_id=0
        )
    assert torch.equal(cached, theirs)
    lengths, new = (5, 2, 3), 8
    seq = max(lengths)
    tokens = torch.zeros(len(lengths), seq, dtype=torch.long)  # (batch, seq): pad id 0, never attended
    key_padding = torch.zeros(len(lengths), seq, dtype=torch.bool)  # (batch, seq)
    for i, n in enumerate(lengths):
        tokens[i, seq - n :] = torch.randint(1, V, (n,))
        key_padding[i, seq - n :] = True
    padded = ours.generate(tokens, new, key_padding=key_padding, temperature=0)
    assert torch.equal(
        padded, ours.generate(tokens, new, key_padding=key_padding, temperature=0, use_cache=False)
    )
    with torch.no_grad():
        theirs = ref.generate(
            tokens, attention_mask=key_padding.long(), do_sample=False, max_new_tokens=new, pad_token_id=0
        )
    assert torch.equal(padded, theirs)
    # the comparison has teeth: attending to the padding changes the logits
    with torch.no_grad():
        assert not torch.allclose(
            ours.model(tokens)[:, -1], ours.model(tokens, key_padding)[:, -1], atol=1e-4
        )
    for i, n in enumerate(lengths):  # each row is what its prompt gives alone
        assert torch.equal(
            padded[i, seq - n :], ours.generate(tokens[i : i + 1, seq - n :], new, temperature=0)[0]
        )


def test_gradients_equal_transformers(tmp_path: Path) -> None:
    # transformers' default initialisation: gradients of a few units, so the float32 tolerance is a fair test
    folder, ref = build("llama", tmp_path / "llama", initializer_range=0.02)
    ref.train()  # dropout is 0: train = eval
    ours = load_llama(folder).model.train()
    tokens = torch.randint(0, V, (2, 9))
    weights = torch.randn(2, 9, V)
    (ref(input_ids=tokens).logits * weights).sum().backward()
    (ours(tokens) * weights).sum().backward()
    hq = H * DH
    a = ours.blocks[1].attn
    torch.testing.assert_close(a.qkv_weight.grad[:hq], ref.model.layers[1].self_attn.q_proj.weight.grad)
    torch.testing.assert_close(
        a.qkv_weight.grad[hq + 2 * DH :], ref.model.layers[1].self_attn.v_proj.weight.grad
    )
    torch.testing.assert_close(ours.tok_embed.weight.grad, ref.model.embed_tokens.weight.grad)
    torch.testing.assert_close(
        ours.blocks[0].mlp.fc_gate.weight.grad, ref.model.layers[0].mlp.gate_proj.weight.grad
    )
    torch.testing.assert_close(ours.ln_final.weight.grad, ref.model.norm.weight.grad)


@pytest.mark.parametrize("arch", ["llama", "llama_bias_tied"])
def test_per_head_results_sum_to_the_attention_output(saved: dict, arch: str) -> None:
    model = load_llama(saved[arch][0]).model
    tokens = torch.randint(0, V, (2, 8))
    with hs.trace(model) as t:
        model(tokens)
    for layer, block in enumerate(model.blocks):
        out = t.result(layer).sum(dim=2)  # (batch, seq, d_model): sum over heads of z_h W_O[h]
        if block.attn.b_O is not None:
            out = out + block.attn.b_O
        torch.testing.assert_close(out, t[f"blocks.{layer}.hook_attn_out"])
    assert (model.blocks[0].attn.b_O is None) == (arch == "llama")


def test_sharded_checkpoint_loads(tmp_path: Path, saved: dict) -> None:
    _, ref = saved["llama"]
    folder = tmp_path / "sharded"
    ref.save_pretrained(folder, max_shard_size="40KB")
    assert not (folder / "model.safetensors").exists() and len(list(folder.glob("model-*.safetensors"))) > 1
    ours = hs.load(folder)  # by config.json's model_type
    tokens = torch.randint(0, V, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), ref(input_ids=tokens).logits)


def test_bare_model_checkpoint_and_registry(tmp_path: Path, saved: dict) -> None:
    _, ref = saved["qwen2"]
    ref.model.save_pretrained(tmp_path / "base")  # Qwen2Model: names without "model.", no lm_head
    ours = hs.load(str(tmp_path / "base"))
    assert isinstance(ours, PretrainedDecoder) and ours.config.extra["model_type"] == "qwen2"
    tokens = torch.randint(0, V, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), ref(input_ids=tokens).logits)


def test_llama_from_tensors_with_a_tokenizers_tokenizer(saved: dict) -> None:
    """The converter other readers (GGUF) call: HF config dict, HF-named tensors, a tokenizers.Tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder, ref = saved["llama"]
    words = ["<unk>"] + [f"w{i}" for i in range(V - 1)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = json.loads((folder / "config.json").read_text())
    tensors = {k: v.to(torch.bfloat16).float() for k, v in ref.state_dict().items()}
    ours = llama_from_tensors(hf, tensors, tok, name="from-tensors", source="memory")
    assert ours.config.name == "from-tensors" and ours.config.extra["source"] == "memory"
    tokens = torch.randint(0, V, (1, 5))
    ref_bf = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    ref_bf.load_state_dict(tensors)
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), ref_bf(input_ids=tokens).logits)
    text = ours.generate("w3 w5 w7", 4, temperature=0)
    assert isinstance(text, str) and text.startswith("w3 w5 w7") and len(text.split()) == 7
    with pytest.raises(
        ValueError, match=r"memory does not match its config.json.*\n  missing tensors \(1\): lm_head"
    ):
        llama_from_tensors(
            hf, {k: v for k, v in tensors.items() if k != "lm_head.weight"}, None, source="memory"
        )


# ------------------------------------------------------------------------------------------ rope settings
def test_rope_scaling_and_old_style_configs(tmp_path: Path, saved: dict) -> None:
    folder, _ = saved["llama"]
    c = load_llama(folder).config
    assert c.rope_theta == 500.0 and c.rope_scaling["rope_type"] == "llama3"
    assert load_llama(saved["llama_bias_tied"][0]).config.rope_scaling == {
        "rope_type": "linear",
        "factor": 2.0,
    }
    hf = json.loads((folder / "config.json").read_text())
    old = {k: v for k, v in hf.items() if k != "rope_parameters"}  # transformers 4 spelling
    old.update(
        rope_theta=500.0,
        rope_scaling={"type": "llama3", **{k: v for k, v in LLAMA3.items() if k != "rope_type"}},
    )
    c_old = llama_config(old)
    assert c_old.rope_theta == 500.0
    torch.testing.assert_close(c_old.make_rotary().inv_freq, c.make_rotary().inv_freq, rtol=0, atol=0)
    assert llama_config({**old, "rope_scaling": None}).rope_scaling is None


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rope_parameters": {"rope_type": "proportional", "factor": 2.0, "rope_theta": 1e4}},
         r"rope_scaling.*'rope_type' must be one of \['default', 'linear', 'llama3', 'yarn'.*"
         r"got 'proportional'"),
        ({"hidden_act": "relu2"}, r"hidden_act='relu2' is not supported; supported: \['gelu'"),
        ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5.*supported: 1.0 or absent"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantized checkpoints"),
        ({"model_type": "gemma"},
         r"model_type='gemma' is not supported here; supported: \['llama', 'mistral', 'qwen2', 'gemma2'"),
        ({"num_key_value_heads": 4}, "num_attention_heads=6 is not divisible by num_key_value_heads=4"),
        ({"vocab_size": 0}, "vocab_size must be an int >= 1; got 0"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
    ],
)  # fmt: skip
def test_unsupported_configs_are_refused_naming_the_field(
    tmp_path: Path, saved: dict, changes: dict, message: str
) -> None:
    folder = edit_config(copy_folder(saved["llama"][0], tmp_path / "m"), **changes)
    with pytest.raises(ValueError, match=message):
        load_llama(folder)


def test_an_active_sliding_window_is_the_layers_window(tmp_path: Path) -> None:
    """Mistral's sliding window (refused before #27) is every layer's; Qwen2's from max_window_layers on."""
    folder, ref = build("mistral", tmp_path / "m", sliding_window=5)
    ours = load_llama(folder)
    assert ours.config.sliding_window == 5 and ours.config.layer_types == ["sliding"] * L
    assert all(b.attn.window == 5 for b in ours.model.blocks)
    tokens = torch.randint(0, V, (2, 16))  # longer than the window
    with torch.no_grad():
        want = ref(input_ids=tokens).logits
        torch.testing.assert_close(ours(tokens), want)
        windowless = copy_folder(folder, tmp_path / "w")
        edit_config(windowless, sliding_window=None)
        assert not torch.allclose(load_llama(windowless)(tokens), want, atol=1e-4)  # the window matters
    qwen = edit_config(copy_folder(folder, tmp_path / "q"), model_type="qwen2", use_sliding_window=True,
                       max_window_layers=1, layer_types=None)  # fmt: skip
    c = llama_config(json.loads((qwen / "config.json").read_text()))
    assert c.layer_types == ["full", "sliding"] and c.sliding_window == 5
    assert (
        llama_config(
            {**json.loads((qwen / "config.json").read_text()), "use_sliding_window": False}
        ).sliding_window
        is None
    )


@pytest.fixture
def nothing_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a model or reading a tensor fails the test: refusals must come from config and header."""

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a model was built or a tensor read before the refusal")

    monkeypatch.setattr(llama_module, "Decoder", forbidden)
    monkeypatch.setattr(hf, "safe_open", forbidden)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"num_hidden_layers": 10**6}, "num_hidden_layers=1000000"),
        ({"hidden_size": 6 * 10**6, "head_dim": None}, "hidden_size=6000000"),
        ({"vocab_size": 10**9}, "vocab_size=1000000000"),
    ],
)
def test_absurd_sizes_are_refused_from_the_config_before_allocating(
    tmp_path: Path, saved: dict, nothing_built: None, changes: dict, field: str
) -> None:
    folder = edit_config(copy_folder(saved["llama"][0], tmp_path / "m"), **changes)
    start = time.perf_counter()
    with pytest.raises(
        ValueError, match=r"implies [\d,]+ parameters in [\d,]+ tensors, but .* holds"
    ) as info:
        load_llama(folder)
    assert field in str(info.value).splitlines()[0]
    assert time.perf_counter() - start < 2.0


def forged_safetensors(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_forged_safetensors_headers_are_refused(tmp_path: Path, saved: dict, nothing_built: None) -> None:
    folder = copy_folder(saved["mistral"][0], tmp_path / "m")
    big = {
        "model.embed_tokens.weight": {"dtype": "F32", "shape": [97, 10**6], "data_offsets": [0, 388 * 10**6]}
    }
    forged_safetensors(folder / "model.safetensors", big, b"\0" * 16)
    with pytest.raises(
        ValueError, match=r"claims bytes \[0, 388,000,000\) of the data, but the file holds 16 bytes"
    ):
        load_llama(folder)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 2**60) + b"{}")
    with pytest.raises(
        ValueError, match=r"model.safetensors is not a valid safetensors file: .* header of [\d,]+ bytes"
    ):
        load_llama(folder)


def test_missing_wrong_shape_and_bad_dtype_tensors_are_listed(tmp_path: Path, saved: dict) -> None:
    src = saved["mistral"][0]
    tensors = load_file(str(src / "model.safetensors"))
    cases = [
        ({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"},
         r"missing tensors \(1\): model.layers.1.mlp.up_proj.weight \[58, 42\]"),
        ({**tensors, "model.norm.weight": torch.ones(41)},
         r"shape mismatches \(1\): model.norm.weight: expected \[42\], found \[41\]"),
        ({**tensors, "model.extra.weight": torch.ones(3)},
         r"unexpected tensors \(1\): model.extra.weight \[3\]"),
        ({**tensors, "model.norm.weight": torch.ones(42, dtype=torch.int32)},
         r"weights must be floating point .*model.norm.weight \(torch.int32\)"),
        ({**tensors, "model.norm.weight": torch.full((42,), float("nan"))},
         r"weight 'model.norm.weight' has 42 NaN/Inf values"),
    ]  # fmt: skip
    for i, (t, message) in enumerate(cases):
        folder = copy_folder(src, tmp_path / f"m{i}")
        save_file(t, str(folder / "model.safetensors"))
        with pytest.raises(ValueError, match=message):
            load_llama(folder)


def test_shard_index_pointing_outside_the_folder_is_refused(tmp_path: Path, saved: dict) -> None:
    folder = copy_folder(saved["mistral"][0], tmp_path / "m")
    (folder / "model.safetensors").rename(tmp_path / "evil.safetensors")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "../evil.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        ValueError, match=r"weight_map\['model.embed_tokens.weight'\] = '../evil.safetensors' points outside"
    ):
        load_llama(folder)
    (folder / "model.safetensors.index.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"has no model\.safetensors"):
        load_llama(folder)


def test_parameter_count_matches_transformers(saved: dict) -> None:
    for arch, (folder, ref) in saved.items():
        c = load_llama(folder).config
        n_params, n_tensors = llama_parameter_count(c)
        assert n_params == sum(p.numel() for p in ref.parameters()), arch
        assert n_tensors == len(hf.safetensors_header(folder / "model.safetensors").tensors), arch


# ------------------------------------------------------------------------------ configs, blocks, layers
def test_model_config_fields_defaults_json_and_errors() -> None:
    old = hs.ModelConfig(arch="decoder", vocab_size=11, d_model=12, n_heads=3, n_layers=1).to_dict()
    for key in ("positions", "rope_theta", "rotary_fraction", "rope_interleaved", "rope_scaling",
                "norm_kind", "mlp_kind", "qkv_bias", "out_bias", "mlp_bias"):  # fmt: skip
        del old[key]
    c = hs.ModelConfig.from_dict(old)  # written before the fields existed: the old meaning
    assert (c.positions, c.norm_kind, c.mlp_kind, c.qkv_bias, c.out_bias, c.mlp_bias) == (
        "learned", "layernorm", "plain", True, True, True,
    )  # fmt: skip
    llama = llama_config(json.loads(json.dumps({**ARCHS["llama"][2], "model_type": "llama", "vocab_size": V,
        "hidden_size": D, "num_hidden_layers": L, "num_attention_heads": H, "head_dim": DH,
        "intermediate_size": DM})))  # fmt: skip
    assert hs.ModelConfig.from_dict(json.loads(json.dumps(llama.to_dict()))) == llama
    bad = [
        ({"positions": "rope"},
         r"ModelConfig.positions must be one of \['learned', 'rotary', 'none'\]; got 'rope'"),
        ({"rope_theta": 500.0}, r"rope_theta=500.0 set but positions='learned'"),
        ({"positions": "rotary", "rope_scaling": {"rope_type": "ntk"}},
         r"ModelConfig.rope_scaling: .*got 'ntk'"),
        ({"positions": "rotary", "rotary_fraction": 0.3},
         r"ModelConfig.rotary_fraction: rotary_dim .* = 1 must be even"),
        ({"norm_kind": "batchnorm"}, r"ModelConfig.norm_kind must be one of \['layernorm', 'rmsnorm'\]"),
        ({"mlp_kind": "sparse"}, r"ModelConfig.mlp_kind must be one of \['plain', 'gated', 'moe'\]"),
        ({"mlp_kind": "moe"}, r"ModelConfig: MLPSpec.n_experts must be a positive int; got None"),
        ({"qkv_bias": "yes"}, r"ModelConfig.qkv_bias must be a bool"),
    ]  # fmt: skip
    for changes, message in bad:
        with pytest.raises(ValueError, match=message):
            hs.ModelConfig(arch="decoder", vocab_size=11, d_model=12, n_heads=3, n_layers=1, **changes)


def test_gated_rmsnorm_rotary_blocks_fall_back_in_infer_and_encoders_work() -> None:
    block = TransformerBlock(12, 3, 7, norm="pre", norm_kind="rmsnorm", mlp_kind="gated", act="silu",
                             bias=False, rotary=Rotary(4)).eval()  # fmt: skip
    assert (
        isinstance(block.ln1, RMSNorm)
        and isinstance(block.mlp, GatedFeedForward)
        and not block.infer_supported
    )
    assert [n for n, _ in block.mlp.named_parameters()] == ["fc_gate.weight", "fc_in.weight", "fc_out.weight"]
    x = torch.randn(2, 5, 12)
    with torch.no_grad():
        torch.testing.assert_close(block.infer(x), block(x))
    cfg = hs.ModelConfig(arch="encoder", vocab_size=11, d_model=12, n_heads=3, n_layers=2, max_seq_len=9,
                         positions="rotary", norm_kind="rmsnorm", mlp_kind="gated", act="gelu")  # fmt: skip
    enc = hs.Encoder(cfg).eval()
    assert enc.pos_embed is None and enc.rotary is enc.blocks[1].attn.rotary  # one Rotary, shared
    tokens = torch.randint(0, 11, (2, 9))
    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[1, 6:] = False
    with torch.no_grad():
        torch.testing.assert_close(enc.infer(tokens, pad), enc(tokens, pad))
    with hs.trace(enc, names="blocks.0.mlp.hook_*") as t:
        enc(tokens)
    assert set(t) == {"blocks.0.mlp.hook_pre", "blocks.0.mlp.hook_pre_linear", "blocks.0.mlp.hook_post"}


def test_learned_position_models_are_unchanged() -> None:
    """A GPT-2-shaped config builds what it always built: same parameters, no rotary, no new hook points."""
    cfg = hs.ModelConfig(arch="decoder", vocab_size=31, d_model=12, n_heads=3, n_layers=2, max_seq_len=8)
    model = hs.Decoder(cfg)
    assert model.rotary is None and model.pos_embed is not None
    assert all(b.attn.hook_rot_q is None and b.infer_supported for b in model.blocks)
    names = {n for n, _ in model.named_parameters()}
    assert (
        "blocks.0.mlp.fc_in.bias" in names and "blocks.0.ln1.bias" in names and len(names) == 2 + 12 * 2 + 2
    )
    nope = hs.Decoder(hs.ModelConfig(**{**cfg.to_dict(), "positions": "none"}))
    assert nope.pos_embed is None and nope(torch.randint(0, 31, (1, 8))).shape == (1, 8, 31)


def test_rotary_decoder_positions_reach_the_rotation_and_cos_sin_are_computed_once() -> None:
    cfg = hs.ModelConfig(arch="decoder", vocab_size=31, d_model=12, n_heads=3, n_kv_heads=1, n_layers=3,
                         max_seq_len=16, positions="rotary", norm_kind="rmsnorm", mlp_kind="gated",
                         act="silu", bias=False)  # fmt: skip
    model = hs.Decoder(cfg).eval()
    calls = []
    cos_sin = Rotary.cos_sin

    def counting(self: Rotary, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return cos_sin(self, *args, **kwargs)

    tokens = torch.randint(0, 31, (2, 6))
    Rotary.cos_sin = counting  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        Rotary.cos_sin = cos_sin  # type: ignore[method-assign]
    assert len(calls) == 1  # three layers, one table
    with torch.no_grad():
        base = model(tokens)
        moved = model(tokens, positions=torch.arange(6).expand(2, 6) + 3)
    torch.testing.assert_close(moved, base, rtol=1e-5, atol=1e-5)  # only differences matter
    with pytest.raises(
        ValueError, match=r"positions contains 16, outside the position table \[0, max_seq_len=16\)"
    ):
        model(tokens, positions=torch.arange(6).expand(2, 6) + 11)
    assert math.isfinite(float(model.generate(tokens, 3, temperature=0).float().sum()))
