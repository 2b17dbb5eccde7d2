"""GGUF files of the rotary and parallel families (pretrained/gguf_families.py), read by ``load_gguf``.

Each file is written with the `gguf` package's ``GGUFWriter`` from a tiny random checkpoint that
transformers 5 builds and saves: the tensor names come from gguf's own ``TensorNameMap`` for the
architecture, the metadata from the writer's ``add_*`` methods (llama.cpp's keys), and the file holds
what llama.cpp's convert_hf_to_gguf.py writes, checked against its source, class by class (_metadata's
helpers name the class whose ``set_gguf_parameters`` each one follows): GPT-NeoX's q/k/v rows as
[3, H, d_head]; OLMo's and Granite's W_Q / W_K rows permuted (LlamaModel.permute); Gemma's norms as 1 + w;
StableLM's per-head QK norms stacked [heads, d_head]; Phi-2's and StarCoder's feed_forward_length as
4 * embedding_length whatever the checkpoint has; no RoPE base where the converter writes none (gptneox,
stablelm, phi2, gemma: llama.cpp then runs 10000, so those checkpoints keep 10000). GPT-J has no class
in the converter; its file follows gguf's tensor names and llama.cpp's keys. The model read from the file
must equal the safetensors load of the same checkpoint and transformers' eager forward (logits within
1e-4 of their largest magnitude). Broken files are refused by name before any tensor data is read.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import gguf  # a dev dependency (the K-quants' dequantisation): imported, not skipped
import numpy as np
import pytest
import torch
import transformers as T
from safetensors.torch import load_file

import headspace as hs
from headspace.pretrained.gguf import load_gguf
from headspace.pretrained.gguf_format import GGUFError

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, H, KV, DM, CTX = 263, 48, 2, 4, 2, 37, 32  # vocab, hidden, layers, heads (d_head 12), kv, mlp, ctx
A = gguf.MODEL_ARCH
# phi3: head_dim 12, rotary_dim 8 (fraction 2/3), 4 planes
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 300.0,
    "short_factor": [1.0, 1.3, 1.7, 2.2],
    "long_factor": [2.0, 3.5, 5.0, 7.5],
    "partial_rotary_factor": 2 / 3,
}
# name -> (gguf arch, config class, model class, config arguments)
ARCHS: dict[str, tuple[Any, Any, Any, dict[str, Any]]] = {
    "gpt_neox": (A.GPTNEOX, T.GPTNeoXConfig, T.GPTNeoXForCausalLM, {
        "use_parallel_residual": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1 / 3},
    }),
    "gpt_neox_sequential": (A.GPTNEOX, T.GPTNeoXConfig, T.GPTNeoXForCausalLM, {
        "use_parallel_residual": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    }),
    "stablelm": (A.STABLELM, T.StableLmConfig, T.StableLmForCausalLM, {
        "num_key_value_heads": KV, "use_qkv_bias": True, "use_parallel_residual": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    }),
    "stablelm_qk_norm": (A.STABLELM, T.StableLmConfig, T.StableLmForCausalLM, {
        "num_key_value_heads": KV, "qk_layernorm": True, "use_parallel_residual": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1 / 3},
    }),
    "phi": (A.PHI2, T.PhiConfig, T.PhiForCausalLM, {
        "hidden_act": "gelu_new",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    }),
    "phi_fused": (A.PHI2, T.PhiConfig, T.PhiForCausalLM, {  # the older Wqkv checkpoints' attn_qkv
        "hidden_act": "gelu_new",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    }),
    "phi3": (A.PHI3, T.Phi3Config, T.Phi3ForCausalLM, {
        "num_key_value_heads": KV, "partial_rotary_factor": 2 / 3,
        "rope_parameters": {"rope_type": "default", "rope_theta": 200.0, "partial_rotary_factor": 2 / 3},
    }),
    "phi3_longrope": (A.PHI3, T.Phi3Config, T.Phi3ForCausalLM, {
        "num_key_value_heads": KV, "partial_rotary_factor": 2 / 3, "original_max_position_embeddings": 10,
        "rope_parameters": LONGROPE,
    }),
    "gemma": (A.GEMMA, T.GemmaConfig, T.GemmaForCausalLM, {
        "num_key_value_heads": KV, "head_dim": 10, "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }),
    "granite": (A.GRANITE, T.GraniteConfig, T.GraniteForCausalLM, {
        "num_key_value_heads": KV, "embedding_multiplier": 3.5, "attention_multiplier": 0.21,
        "residual_multiplier": 0.37, "logits_scaling": 2.6, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 120.0},
    }),
    "granite_linear": (A.GRANITE, T.GraniteConfig, T.GraniteForCausalLM, {
        "num_key_value_heads": KV, "attention_multiplier": 0.3, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "linear", "rope_theta": 120.0, "factor": 2.5},
    }),
    "granite_yarn": (A.GRANITE, T.GraniteConfig, T.GraniteForCausalLM, {
        "num_key_value_heads": KV, "attention_multiplier": 0.3, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 120.0, "factor": 4.0,
                            "original_max_position_embeddings": 8},
    }),
    "olmo": (A.OLMO, T.OlmoConfig, T.OlmoForCausalLM, {
        "num_key_value_heads": KV, "rope_parameters": {"rope_type": "default", "rope_theta": 80.0},
    }),
    "cohere": (A.COMMAND_R, T.CohereConfig, T.CohereForCausalLM, {
        "num_key_value_heads": KV, "logit_scale": 0.37, "use_qk_norm": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 70.0},
    }),
    "gptj": (A.GPTJ, T.GPTJConfig, T.GPTJForCausalLM, {"rotary_dim": 8, "n_inner": None}),
    "bloom": (A.BLOOM, T.BloomConfig, T.BloomForCausalLM, {"layer_norm_epsilon": 1e-5}),
    "falcon": (A.FALCON, T.FalconConfig, T.FalconForCausalLM, {
        "new_decoder_architecture": True, "num_kv_heads": KV, "ffn_hidden_size": DM, "bias": False,
        "tie_word_embeddings": False, "max_position_embeddings": 2048,
    }),
    "mpt": (A.MPT, T.MptConfig, T.MptForCausalLM, {"expansion_ratio": 4}),
    "starcoder": (A.STARCODER, T.GPTBigCodeConfig, T.GPTBigCodeForCausalLM, {
        "multi_query": True, "n_inner": DM, "layer_norm_epsilon": 1e-5,
    }),
}  # fmt: skip

SPECIAL = "<|endoftext|>"
MERGES = ["Ġ t", "h e", "Ġt he"]


def _byte_chars() -> list[str]:
    """GPT-2's 256 byte characters, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        chars[b] = chr(b) if b in keep else chr(256 + (extra := extra + 1) - 1)
    return [chars[b] for b in range(256)]


def _tokens() -> list[str]:
    """The vocabulary, padded to the embedding's rows as llama.cpp's converter pads it ("[PAD{i}]")."""
    tokens = [SPECIAL, *_byte_chars()]
    tokens += [m.replace(" ", "") for m in MERGES if m.replace(" ", "") not in tokens]
    return tokens + [f"[PAD{i}]" for i in range(len(tokens), V)]


N_REAL = len(_tokens()) - sum(t.startswith("[PAD") for t in _tokens())


def build(arch: str, folder: Path) -> Any:
    """A random transformers model of ``arch`` saved into ``folder``, read back with eager attention."""
    _, config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    kw = dict(
        vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, intermediate_size=DM,
        max_position_embeddings=CTX, initializer_range=0.3, pad_token_id=0, bos_token_id=0, eos_token_id=0,
        layer_norm_eps=1e-5, rms_norm_eps=1e-5,
    )  # fmt: skip
    kw.update(extra)
    model = model_cls(config_cls(**kw)).eval()
    with torch.no_grad():  # norms and biases away from their start, so a wrong or skipped one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    return model_cls.from_pretrained(folder, attn_implementation="eager").eval()


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute``: each head's rows from (half, index) to (pair, member) order."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _as_llama_cpp(name: str, w: torch.Tensor, arch: str) -> torch.Tensor:
    """What llama.cpp's converter (convert_hf_to_gguf.py) stores for Hugging Face tensor ``name``."""
    if arch == "falcon" and "query_key_value" in name:  # FalconModel: [Hkv, g + 2, d] rows -> q, k, v
        d = D // H
        grouped = w.view(KV, H // KV + 2, d, D)
        q, k, v = (
            grouped[:, :-2].reshape(H * d, D),
            grouped[:, -2].reshape(KV * d, D),
            grouped[:, -1].reshape(KV * d, D),
        )
        return torch.cat([q, k, v])
    if arch.startswith(("gpt_neox", "bloom")) and "query_key_value" in name:  # GPTNeoX / BloomModel
        d = D // H
        if w.dim() == 2:  # [H 3 d, D] -> [3 H d, D]
            return w.reshape(H, 3, d, D).transpose(0, 1).reshape(3 * H * d, D)
        return w.reshape(H, 3, d).transpose(0, 1).reshape(-1)  # [H 3 d] -> [3 H d]
    if arch.startswith(("olmo", "granite")) and name.endswith("q_proj.weight"):
        return _permute(w, H)
    if arch.startswith(("olmo", "granite")) and name.endswith("k_proj.weight"):
        return _permute(w, KV)
    if arch == "gemma" and name.endswith("norm.weight"):
        return w + 1
    return w


def _base(w: gguf.GGUFWriter, cfg: Any, *, theta: bool = True) -> None:
    """TextModel.set_gguf_parameters: block count, context, widths, head counts, the RoPE base (where
    the config has one), the norm eps the config names, head_dim as key/value length where it is set."""
    w.add_block_count(L)
    w.add_context_length(CTX)
    w.add_embedding_length(D)
    w.add_feed_forward_length(DM)
    w.add_head_count(H)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if theta:
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])


def _rope_dims(cfg: Any) -> int:
    """int(partial_rotary_factor * (hidden // heads)): the converters' rotated dims per head."""
    return int(cfg.rope_parameters.get("partial_rotary_factor", 1.0) * (D // H))


def _neox_like(w: gguf.GGUFWriter, arch: str, cfg: Any) -> None:
    """GPTNeoXModel / StableLMModel / Phi2Model.set_gguf_parameters: no RoPE base; GPT-NeoX no kv count;
    Phi-2 feed_forward_length 4 * n_embd and kv = heads."""
    w.add_block_count(L)
    w.add_context_length(CTX)
    w.add_embedding_length(D)
    w.add_feed_forward_length(4 * D if arch.startswith("phi") else DM)
    w.add_head_count(H)
    if arch.startswith("stablelm"):
        w.add_head_count_kv(cfg.num_key_value_heads)
    elif arch.startswith("phi"):
        w.add_head_count_kv(H)
    if not arch.startswith("phi"):
        w.add_parallel_residual(cfg.use_parallel_residual)
    w.add_layer_norm_eps(1e-5)
    w.add_rope_dimension_count(_rope_dims(cfg))


def _phi3(w: gguf.GGUFWriter, arch: str, cfg: Any) -> None:
    """Phi3MiniModel.set_gguf_parameters (+ generate_extra_tensors' attention factor for LongRoPE)."""
    _base(w, cfg)
    rp = cfg.rope_parameters
    original = rp.get("original_max_position_embeddings") or getattr(
        cfg, "original_max_position_embeddings", CTX
    )
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(_rope_dims(cfg))
    w.add_sliding_window(cfg.sliding_window or 0)
    if arch == "phi3_longrope":
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(CTX / original) / math.log(original)))


def _others(w: gguf.GGUFWriter, arch: str, cfg: Any) -> None:
    """GemmaModel (no RoPE base, head_dim as key/value length), GraniteModel (LlamaModel's + the four
    multipliers), OlmoModel (+ eps 1e-5), CommandR2Model (+ logit scale, scaling type none),
    StarCoderModel (one kv head, feed_forward_length 4 * n_embd), GPT-J (no converter class)."""
    if arch == "gemma":
        _base(w, cfg, theta=False)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    elif arch.startswith("granite"):
        _base(w, cfg)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_vocab_size(V)
        w.add_rope_dimension_count(D // H)
        _scaling(w, cfg.rope_parameters)
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    elif arch == "olmo":
        _base(w, cfg)
        w.add_layer_norm_eps(1e-5)
    elif arch == "cohere":
        _base(w, cfg)
        w.add_layer_norm_eps(1e-5)
        w.add_logit_scale(cfg.logit_scale)
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    elif arch == "bloom":  # BloomModel: context seq_length, else n_embed (BloomConfig has none)
        w.add_context_length(getattr(cfg, "seq_length", None) or D)
        w.add_embedding_length(D)
        w.add_feed_forward_length(4 * D)
        w.add_block_count(L)
        w.add_head_count(H)
        w.add_head_count_kv(H)
        w.add_layer_norm_eps(1e-5)
    elif arch == "falcon":  # FalconModel: context 2048 (not in config.json), MLP 4 * hidden, no RoPE base
        w.add_context_length(2048)
        w.add_embedding_length(D)
        w.add_feed_forward_length(4 * D)
        w.add_block_count(L)
        w.add_head_count(H)
        w.add_head_count_kv(KV)
        w.add_layer_norm_eps(1e-5)
    elif arch == "mpt":  # MPTModel: max_alibi_bias the config's alibi_bias_max
        w.add_context_length(cfg.max_seq_len)
        w.add_embedding_length(D)
        w.add_block_count(L)
        w.add_feed_forward_length(4 * D)
        w.add_head_count(H)
        w.add_layer_norm_eps(1e-5)
        w.add_max_alibi_bias(float(cfg.attn_config.alibi_bias_max))
    elif arch == "starcoder":
        w.add_context_length(CTX)
        w.add_embedding_length(D)
        w.add_feed_forward_length(4 * D)
        w.add_block_count(L)
        w.add_head_count(H)
        w.add_head_count_kv(1)
        w.add_layer_norm_eps(1e-5)
    else:  # gptj: llama.cpp's keys for what its gptj graph reads
        w.add_block_count(L)
        w.add_context_length(CTX)
        w.add_embedding_length(D)
        w.add_feed_forward_length(4 * D)
        w.add_head_count(H)
        w.add_rope_dimension_count(cfg.rotary_dim)
        w.add_layer_norm_eps(1e-5)


def _scaling(w: gguf.GGUFWriter, rope: dict[str, Any]) -> None:
    """LlamaModel.set_gguf_parameters' linear scaling (type and factor); YaRN as llama.cpp's keys name it
    (type, factor, original context), the keys headspace's Llama reader takes."""
    if rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def _metadata(writer: gguf.GGUFWriter, arch: str, cfg: Any) -> None:
    """llama.cpp's metadata for the family (its converter's set_gguf_parameters), through the writer."""
    if arch.startswith(("gpt_neox", "stablelm", "phi")) and not arch.startswith("phi3"):
        _neox_like(writer, arch, cfg)
    elif arch.startswith("phi3"):
        _phi3(writer, arch, cfg)
    else:
        _others(writer, arch, cfg)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(_tokens())
    writer.add_token_types([3] + [1] * (N_REAL - 1) + [5] * (V - N_REAL))  # 5: unused (the padding)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)


def _llama_cpp_tensors(arch: str, folder: Path) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under llama.cpp's names, as its converter stores them (F32)."""
    names = gguf.get_tensor_name_map(ARCHS[arch][0], L)
    out: dict[str, torch.Tensor] = {}
    norms: dict[str, dict[int, torch.Tensor]] = {}
    for name, w in load_file(folder / "model.safetensors").items():
        per_head = re.fullmatch(r"(.*)\.norms\.(\d+)\.weight", name)
        if per_head:  # StableLMModel._stack_qk_norm: the heads' norms [d_head] stacked in head order
            norms.setdefault(f"{names.get_name(per_head[1])}.weight", {})[int(per_head[2])] = w.float()
            continue
        lookup = re.sub(r"transformer\.", "", name) if arch == "bloom" else name  # as BloomModel strips it
        gguf_name = names.get_name(lookup, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        out[gguf_name] = _as_llama_cpp(name, w.float(), arch)
    for gguf_name, heads in norms.items():
        out[gguf_name] = torch.stack([heads[h] for h in sorted(heads)])  # [heads, d_head]
    if arch == "phi_fused":  # an older Wqkv checkpoint: attn_qkv rows [q; k; v]
        for n in range(L):
            for kind in ("weight", "bias"):
                out[f"blk.{n}.attn_qkv.{kind}"] = torch.cat(
                    [out.pop(f"blk.{n}.attn_{x}.{kind}") for x in "qkv"]
                )
    return {k: v.numpy().astype(np.float32) for k, v in out.items()}


def write_gguf(
    arch: str,
    folder: Path,
    path: Path,
    *,
    drop: str = "",
    kv: dict[str, Any] | None = None,
    replace: dict[str, np.ndarray] | None = None,
    omit: tuple[str, ...] = (),
) -> Path:
    """The checkpoint in ``folder`` as llama.cpp would write it (F32), or changed: tensor ``drop`` left
    out, metadata ``kv`` added or overwritten (str, int as uint32, float as float32), metadata keys
    ``omit``ted, tensors ``replace``d (GGUF name -> array)."""
    gguf_arch = ARCHS[arch][0]
    cfg = T.AutoConfig.from_pretrained(folder)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf_arch])
    _metadata(writer, arch, cfg)
    for key, value in (kv or {}).items():
        {str: writer.add_string, int: writer.add_uint32, float: writer.add_float32}[type(value)](key, value)
    for key in omit:
        del writer.kv_data[0][key]
    for gguf_name, array in _llama_cpp_tensors(arch, folder).items():
        if gguf_name != drop:
            writer.add_tensor(gguf_name, (replace or {}).get(gguf_name, array))
    if arch == "phi3_longrope":  # llama.cpp's Phi3MiniModel: LongRoPE's lists as float32 tensors
        for which in ("long", "short"):
            if f"rope_factors_{which}.weight" != drop:
                factors = np.array(LONGROPE[f"{which}_factor"], dtype=np.float32)  # [rotary_dim / 2]
                writer.add_tensor(f"rope_factors_{which}.weight", factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, Any]]:
    out = {}
    for arch in ARCHS:
        folder = tmp_path_factory.mktemp(arch)
        ref = build(arch, folder)
        out[arch] = (folder, write_gguf(arch, folder, folder.parent / f"{arch}.gguf"), ref)
    return out


@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_gguf_file_loads_equal_to_the_safetensors_folder_and_transformers(saved: dict, arch: str) -> None:
    folder, path, ref = saved[arch]
    ours, theirs = load_gguf(path), hs.load(folder)
    assert ours.config.extra["model_type"] == theirs.config.extra["model_type"]
    for field in ("n_layers", "n_heads", "n_kv_heads", "d_head", "d_mlp", "norm", "rope_theta"):
        assert getattr(ours.config, field) == getattr(theirs.config, field), field
    rotary = [getattr(m.model.blocks[0].attn.rotary, "rotary_dim", None) for m in (ours, theirs)]
    assert rotary[0] == rotary[1]
    gen = torch.Generator().manual_seed(3)
    # 10 tokens, and 20: past phi3_longrope's original 10 positions (its long factors)
    for tokens in (
        torch.tensor([[3, 100, 7, 260, 55, 8, 200, 1, 9, 40]]),
        torch.randint(0, V, (1, 20), generator=gen),
    ):
        with torch.no_grad():
            want = ref(input_ids=tokens).logits
            got, folder_logits = ours(tokens), theirs(tokens)
        bound = 1e-4 * float(want.abs().max())
        torch.testing.assert_close(got, want, atol=bound, rtol=0)
        torch.testing.assert_close(got, folder_logits, atol=1e-5 * float(want.abs().max()), rtol=0)
    if arch != "gemma":  # F32 storage and no (1 + w) round trip: the very same weights
        for name, value in theirs.model.state_dict().items():
            assert torch.equal(ours.model.state_dict()[name], value), name


@pytest.mark.parametrize(
    "arch",
    [
        "gpt_neox",
        "phi3_longrope",
        "granite",
        "granite_yarn",
        "gemma",
        "cohere",
        "gptj",
        "stablelm_qk_norm",
        "starcoder",
        "bloom",
        "mpt",
        "falcon",
    ],
)
def test_greedy_decoding_of_the_gguf_load_equals_transformers(saved: dict, arch: str) -> None:
    _, path, ref = saved[arch]
    ours = load_gguf(path)
    prompt = torch.randint(1, V, (1, 6), generator=torch.Generator().manual_seed(5))
    new = 12  # to position 17: past LongRoPE's original 10 (the long factors)
    got = ours.generate(prompt, new, temperature=0)
    with torch.no_grad():
        want = ref.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
    assert torch.equal(got, want)


def test_the_tokenizer_comes_from_the_file(saved: dict) -> None:
    ours = load_gguf(saved["phi"][1])
    assert ours.tokenizer.vocab_size == V
    ids = ours.tokenize(["the the"])[0].tolist()
    assert ids == [_tokens().index(t) for t in ("t", "he", "Ġthe")]  # the merges "h e", "Ġ t", "Ġt he"


@pytest.mark.parametrize(
    ("arch", "drop", "kv", "message"),
    [
        (
            "gpt_neox",
            "blk.1.attn_qkv.bias",
            None,
            "missing tensors for a 'gptneox' model.*blk.1.attn_qkv.bias",
        ),
        ("phi3", "", {"phi3.rope.scaling.type": "longrope"}, "'phi3.rope.scaling.type' is 'longrope'"),
        (
            "starcoder",
            "",
            {"starcoder.rope.scaling.type": "linear"},
            "'starcoder.rope.scaling.type' is 'linear'",
        ),
        ("olmo", "", {"olmo.attention.clamp_kqv": 8.0}, "clip_qkv"),  # OlmoModel: add_clamp_kqv (float32)
        ("phi3_longrope", "rope_factors_short.weight", None, "missing tensors .*rope_factors_short.weight"),
        ("starcoder", "", {"starcoder.attention.head_count_kv": 4}, r"head_count_kv' is 4; expected 1"),
        ("phi", "blk.1.attn_k.weight", None, "missing tensors for a 'phi2' model.*blk.1.attn_k.weight"),
        (
            "mpt",
            "",
            {"mpt.attention.max_alibi_bias": 0.0},
            "alibi=False is not supported",
        ),  # MPT without ALiBi
    ],
)
def test_broken_files_are_refused_by_name(
    saved: dict, tmp_path: Path, arch: str, drop: str, kv: dict | None, message: str
) -> None:
    path = write_gguf(arch, saved[arch][0], tmp_path / "broken.gguf", drop=drop, kv=kv)
    with pytest.raises(ValueError, match=message):
        load_gguf(path)


def test_a_tensor_of_the_wrong_shape_is_refused_before_any_data_is_read(saved: dict, tmp_path: Path) -> None:
    folder = saved["stablelm"][0]
    path = write_gguf("stablelm", folder, tmp_path / "shape.gguf", kv={"stablelm.note": "x"})
    good = load_gguf(path)  # an unknown string key is ignored, as llama.cpp does
    assert good.config.extra["model_type"] == "stablelm"
    wide = np.zeros((DM, D + 1), dtype=np.float32)  # ffn_up [DM, D] one column too wide
    path = write_gguf("stablelm", folder, tmp_path / "wide.gguf", replace={"blk.0.ffn_up.weight": wide})
    with pytest.raises(
        GGUFError, match=r"tensor 'blk.0.ffn_up.weight' has shape \[37, 49\], but the metadata"
    ):
        load_gguf(path)
    data = bytearray((tmp_path / "shape.gguf").read_bytes())
    at = data.find(b"blk.0.ffn_up.weight") + len(b"blk.0.ffn_up.weight") + 4  # after the name and n_dims
    data[at : at + 8] = (D + 1).to_bytes(8, "little")  # ggml dim 0 is PyTorch's last: [DM, D + 1]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"'blk.0.ffn_up.weight' and .* overlap in the file"):
        load_gguf(bad)  # the header's own check, before the family's


def _same_weights(ref: Any, **changes: Any) -> Any:
    """transformers' model of ``ref``'s weights with config fields ``changes``, eager attention."""
    cfg = ref.config.__class__.from_dict({**ref.config.to_dict(), **changes})
    cfg._attn_implementation = "eager"
    model = ref.__class__(cfg).eval()
    model.load_state_dict(ref.state_dict())
    return model


def _assert_logits_equal(ours: Any, ref: Any) -> None:
    tokens = torch.randint(0, V, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want, got = ref(input_ids=tokens).logits, ours(tokens)
    torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0)


def test_a_granite_file_without_attention_scale_runs_llama_cpps_1_over_sqrt_d(
    saved: dict, tmp_path: Path
) -> None:
    folder, _, ref = saved["granite"]
    path = write_gguf("granite", folder, tmp_path / "g.gguf", omit=("granite.attention.scale",))
    ours = load_gguf(path)  # llama.cpp: f_attention_scale 0 -> kq_scale 1 / sqrt(d_head)
    _assert_logits_equal(ours, _same_weights(ref, attention_multiplier=1 / math.sqrt(D // H)))
    with pytest.raises(AssertionError):  # the checkpoint's own multiplier (0.21) is another model
        _assert_logits_equal(ours, ref)


def test_a_phi3_attention_factor_the_file_states_is_the_one_used(saved: dict, tmp_path: Path) -> None:
    folder, _, ref = saved["phi3_longrope"]
    path = write_gguf("phi3_longrope", folder, tmp_path / "p.gguf", kv={"phi3.rope.scaling.attn_factor": 1.5})
    rope = {**ref.config.rope_parameters, "attention_factor": 1.5}
    _assert_logits_equal(load_gguf(path), _same_weights(ref, rope_parameters=rope))


def test_stablelm_without_its_parallel_flag_follows_the_tensor_table(saved: dict, tmp_path: Path) -> None:
    folder, _, ref = saved["stablelm_qk_norm"]  # parallel: no ffn_norm tensors
    path = write_gguf(
        "stablelm_qk_norm", folder, tmp_path / "s.gguf", omit=("stablelm.use_parallel_residual",)
    )
    _assert_logits_equal(load_gguf(path), ref)
