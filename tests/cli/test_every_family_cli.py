"""Every decoder and encoder family of ``headspace.pretrained.families_table.FAMILIES`` through the CLI.

For each family, a tiny random checkpoint written by transformers 5 itself (odd sizes, a few heads,
grouped keys where the family has them) and a word-level ``tokenizer.json`` go into ``tmp_path``; then
``headspace explain``, ``headspace heads``, ``headspace generate`` (decoders) and ``headspace view -o``
(page data only, no browser) run on ``--model FOLDER`` in-process and must exit 0. The builders are one
table here (config class + overrides per ``model_type``): the families' own test modules are not
importable as packages (tests/ has no ``__init__``).

Refused, by name (:data:`REFUSALS`): the explorer page on DeepSeek's latent attention and Llama 4's
tempered NoPE layers: one line naming the attention field, exit 2 (``explain`` walks them all, with a
lesson step per mechanism: tests/analysis/test_mechanism_walks.py).

Out of scope, by name (:data:`OUT_OF_SCOPE`): the encoder-decoders (T5, BART, Marian, Whisper) need a
source beside the ids; ``headspace explain`` handles them (tests/encdec/test_explain_encdec.py), the
other commands refuse them in one line (checked below).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T
from click.testing import CliRunner

from headspace.cli import cli
from headspace.pretrained.families_table import FAMILIES

pytestmark = pytest.mark.usefixtures("single_thread")

WORDS = "the cat sat on mat because it was tired and dog ran to a house".split()
V = 61  # vocabulary: <unk>, <pad>, <s>, </s>, the words, then filler words
SENTENCE = "the cat sat on the mat because it was tired"
D, L, H, KV, DM, CTX = 48, 2, 4, 2, 37, 40
LLAMA = dict(vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=KV,
             intermediate_size=DM, max_position_embeddings=CTX, pad_token_id=1, bos_token_id=2,
             eos_token_id=3, tie_word_embeddings=False)  # fmt: skip
SLIDING = ["sliding_attention", "full_attention"]
MOE = dict(num_experts_per_tok=2, head_dim=12)
#: DeepSeek's latent attention (one key head per query head), a dense layer 0 and a routed layer 1
MLA = dict(num_key_value_heads=H, kv_lora_rank=10, qk_rope_head_dim=4, v_head_dim=6, qk_nope_head_dim=8,
           moe_intermediate_size=12, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
           first_k_dense_replace=1, routed_scaling_factor=1.7)  # fmt: skip
#: Gated DeltaNet layer 0, full (gated) attention layer 1: ``--layer 1 --head 1`` is an attention head
DELTA = dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=5, linear_value_head_dim=7,
             linear_conv_kernel_dim=3)  # fmt: skip

#: model_type -> (config class, model class, overrides of LLAMA, or a full keyword set with "only")
BUILDERS: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "bert": (T.BertConfig, T.BertModel, dict(only=True, vocab_size=V, hidden_size=D, num_hidden_layers=L,
             num_attention_heads=H, intermediate_size=DM, max_position_embeddings=CTX, pad_token_id=1)),
    "roberta": (T.RobertaConfig, T.RobertaModel, dict(only=True, vocab_size=V, hidden_size=D,
                num_hidden_layers=L, num_attention_heads=H, intermediate_size=DM, max_position_embeddings=CTX,
                pad_token_id=1, bos_token_id=2, eos_token_id=3)),
    "gpt2": (T.GPT2Config, T.GPT2LMHeadModel, dict(only=True, vocab_size=V, n_embd=D, n_layer=L, n_head=H,
             n_positions=CTX, bos_token_id=2, eos_token_id=3)),
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, {"sliding_window": 5}),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, {}),
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, {"head_dim": 12, "sliding_window": 5}),
    "gemma3_text": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, {"head_dim": 12, "sliding_window": 5}),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, {"head_dim": 12}),
    "olmo2": (T.Olmo2Config, T.Olmo2ForCausalLM, {}),
    "smollm3": (T.SmolLM3Config, T.SmolLM3ForCausalLM, {}),
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM, {"original_max_position_embeddings": 10, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 300.0, "short_factor": [1.0, 1.3, 1.7, 2.2],
        "long_factor": [2.0, 3.5, 5.0, 7.5], "partial_rotary_factor": 2 / 3},
        "partial_rotary_factor": 2 / 3}),
    "gemma": (T.GemmaConfig, T.GemmaForCausalLM, {"head_dim": 10, "tie_word_embeddings": True}),
    "granite": (T.GraniteConfig, T.GraniteForCausalLM, {"embedding_multiplier": 3.5, "attention_multiplier":
                0.21, "residual_multiplier": 0.37, "logits_scaling": 2.6}),
    "olmo": (T.OlmoConfig, T.OlmoForCausalLM, {}),
    "seed_oss": (T.SeedOssConfig, T.SeedOssForCausalLM, {"head_dim": 10, "attention_bias": True}),
    "olmo3": (T.Olmo3Config, T.Olmo3ForCausalLM, {"sliding_window": 5, "layer_types": SLIDING}),
    "exaone4": (T.Exaone4Config, T.Exaone4ForCausalLM, {"sliding_window": 5, "layer_types": SLIDING}),
    "gpt_neox": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM, {"num_key_value_heads": H, "rope_parameters": {
        "rope_type": "default", "rope_theta": 300.0, "partial_rotary_factor": 0.5}}),
    "stablelm": (T.StableLmConfig, T.StableLmForCausalLM, {"qk_layernorm": True, "rope_parameters": {
        "rope_type": "default", "rope_theta": 90.0, "partial_rotary_factor": 0.5}}),
    "cohere": (T.CohereConfig, T.CohereForCausalLM, {"use_qk_norm": True}),
    "phi": (T.PhiConfig, T.PhiForCausalLM, {"rope_parameters": {
        "rope_type": "default", "rope_theta": 60.0, "partial_rotary_factor": 0.5}}),
    "gptj": (T.GPTJConfig, T.GPTJForCausalLM, dict(only=True, vocab_size=V, n_embd=D, n_layer=L, n_head=H,
             n_positions=CTX, rotary_dim=8, bos_token_id=2, eos_token_id=3, tie_word_embeddings=False)),
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, {"num_local_experts": 4, **MOE}),
    "qwen2_moe": (T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM, {"num_experts": 4, "moe_intermediate_size": DM,
                  "shared_expert_intermediate_size": 17, **MOE}),
    "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, {"num_experts": 4, "moe_intermediate_size": DM,
                  **MOE}),
    "olmoe": (T.OlmoeConfig, T.OlmoeForCausalLM, {"num_experts": 4, **MOE}),
    "gpt_oss": (T.GptOssConfig, T.GptOssForCausalLM, {"num_local_experts": 4, "sliding_window": 5,
                "layer_types": SLIDING, **MOE}),
    "opt": (T.OPTConfig, T.OPTForCausalLM, dict(only=True, vocab_size=V, hidden_size=D, num_hidden_layers=L,
            num_attention_heads=H, ffn_dim=DM, max_position_embeddings=CTX, word_embed_proj_dim=20,
            pad_token_id=1, bos_token_id=2, eos_token_id=3)),
    "gpt_neo": (T.GPTNeoConfig, T.GPTNeoForCausalLM, dict(only=True, vocab_size=V, hidden_size=D,
                num_layers=L, num_heads=H, max_position_embeddings=CTX,
                attention_types=[[["local", "global"], 1]], window_size=4, bos_token_id=2, eos_token_id=3)),
    "gpt_bigcode": (T.GPTBigCodeConfig, T.GPTBigCodeForCausalLM, dict(only=True, vocab_size=V, n_embd=D,
                    n_layer=L, n_head=H, n_positions=CTX, multi_query=True, bos_token_id=2, eos_token_id=3)),
    "gemma4_text": (T.Gemma4TextConfig, T.Gemma4ForCausalLM, {"head_dim": 8, "global_head_dim": 16,
                    "sliding_window": 4, "layer_types": SLIDING}),
    "gemma3n_text": (T.Gemma3nTextConfig, T.Gemma3nForCausalLM, {"head_dim": 12, "num_key_value_heads": 1,
                     "intermediate_size": [26, 22], "layer_types": SLIDING, "sliding_window": 4,
                     "hidden_size_per_layer_input": 5, "vocab_size_per_layer_input": 40,
                     "num_kv_shared_layers": 0, "laurel_rank": 3, "altup_num_inputs": 3,
                     "activation_sparsity_pattern": [0.95, 0.0]}),
    "bloom": (T.BloomConfig, T.BloomForCausalLM, dict(only=True, vocab_size=V, hidden_size=D, n_layer=L,
              n_head=6, bos_token_id=2, eos_token_id=3, pad_token_id=1)),
    "falcon": (T.FalconConfig, T.FalconForCausalLM, dict(only=True, vocab_size=V, hidden_size=D,
               num_hidden_layers=L, num_attention_heads=H, num_kv_heads=KV, new_decoder_architecture=True,
               alibi=True, ffn_hidden_size=DM, bos_token_id=2, eos_token_id=3, pad_token_id=1)),
    "mpt": (T.MptConfig, T.MptForCausalLM, dict(only=True, vocab_size=V, d_model=D, n_layers=L, n_heads=H,
            max_seq_len=CTX, pad_token_id=1, bos_token_id=2, eos_token_id=3)),
    "xlm-roberta": (T.XLMRobertaConfig, T.XLMRobertaModel, dict(only=True, vocab_size=V, hidden_size=D,
                    num_hidden_layers=L, num_attention_heads=H, intermediate_size=DM,
                    max_position_embeddings=CTX, pad_token_id=1, bos_token_id=2, eos_token_id=3)),
    "camembert": (T.CamembertConfig, T.CamembertModel, dict(only=True, vocab_size=V, hidden_size=D,
                  num_hidden_layers=L, num_attention_heads=H, intermediate_size=DM,
                  max_position_embeddings=CTX, pad_token_id=1, bos_token_id=2, eos_token_id=3)),
    "modernbert": (T.ModernBertConfig, T.ModernBertModel, dict(only=True, vocab_size=V, hidden_size=D,
                   num_hidden_layers=L, num_attention_heads=H, intermediate_size=DM,
                   max_position_embeddings=CTX, pad_token_id=1, bos_token_id=2, eos_token_id=3,
                   cls_token_id=2, sep_token_id=3, local_attention=6, global_attn_every_n_layers=2,
                   global_rope_theta=1234.0, local_rope_theta=77.0, norm_bias=True, attention_bias=True,
                   mlp_bias=True)),
    "deepseek_v2": (T.DeepseekV2Config, T.DeepseekV2ForCausalLM, {**MLA, "q_lora_rank": None,
                    "topk_method": "greedy"}),
    "deepseek_v3": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM, {**MLA, "q_lora_rank": 14, "n_group": 2,
                    "topk_group": 1, "norm_topk_prob": True}),
    "qwen3_next": (T.Qwen3NextConfig, T.Qwen3NextForCausalLM, {**DELTA, "head_dim": 6,
                   "partial_rotary_factor": 1 / 3, "num_experts": 5, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 9, "shared_expert_intermediate_size": 11,
                   "decoder_sparse_step": 1, "mlp_only_layers": []}),
    "qwen3_5_text": (T.Qwen3_5TextConfig, T.Qwen3_5ForCausalLM, {**DELTA, "head_dim": 8}),
    "llama4_text": (T.Llama4TextConfig, T.Llama4ForCausalLM, {"intermediate_size": 14,
                    "intermediate_size_mlp": 22, "head_dim": 10, "num_local_experts": 3,
                    "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "attention_chunk_size": 5,
                    "floor_scale": 3, "attn_scale": 0.4, "no_rope_layer_interval": 2,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 300.0}}),
    "diffllama": (T.DiffLlamaConfig, T.DiffLlamaForCausalLM, {"head_dim": 6}),
}  # fmt: skip

#: model_type -> why this test does not run the CLI on it
OUT_OF_SCOPE = {
    f.model_type: "an encoder-decoder: its forward needs a source (text or audio) beside the ids"
    for f in FAMILIES
    if f.kind == "encoder-decoder"
}
KINDS = {f.model_type: f.kind for f in FAMILIES}
IN_SCOPE = [f.model_type for f in FAMILIES if f.model_type not in OUT_OF_SCOPE]


def test_the_table_covers_every_family_of_the_registry() -> None:
    assert sorted(BUILDERS) == sorted(IN_SCOPE)
    assert set(OUT_OF_SCOPE) == {"t5", "bart", "marian", "whisper"}


def write_tokenizer(folder: Path) -> None:
    """A word-level ``tokenizer.json`` of ``V`` entries, split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    names = ["<unk>", "<pad>", "<s>", "</s>", *WORDS]
    names += [f"x{i}" for i in range(V - len(names))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))


def build(model_type: str, folder: Path) -> Path:
    """The tiny checkpoint of ``model_type`` (norms and biases moved off their start) and its tokenizer."""
    config_cls, model_cls, over = BUILDERS[model_type]
    kw = {k: v for k, v in over.items() if k != "only"} if over.get("only") else {**LLAMA, **over}
    torch.manual_seed(0)
    model = model_cls(config_cls(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    folder.mkdir()
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


#: (model_type, command) -> the attention field its one-line refusal names: the explorer page recomputes
#: q k^T -> softmax -> z_h W_O[h], which these layers do not follow (headspace.attention.walkable);
#: "explain 1 1" is ``explain --layer 1 --head 1`` (no family refuses it: each mechanism has its step)
REFUSALS = {
    **{(t, "view"): "latent" for t in ("deepseek_v2", "deepseek_v3")},
    ("llama4_text", "view"): "temperature",  # layer 1 is a NoPE layer with the query temperature
}


def _run(args: list[str], refused: str | None = None) -> Any:
    """``headspace ARGS`` in-process: exit 0, or where ``refused`` names an attention field, exit 2 with
    one line ``error: ...`` naming that field."""
    res = CliRunner().invoke(cli, args, catch_exceptions=False)
    if refused is None:
        assert res.exit_code == 0, f"headspace {' '.join(args)}\n{res.output}"
    else:
        lines = res.output.strip().splitlines()
        assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.output
        assert f"attention field '{refused}' is set" in lines[0]
    return res


@pytest.mark.slow
@pytest.mark.parametrize("model_type", IN_SCOPE)
def test_every_command_runs_on_the_family(model_type: str, tmp_path: Path) -> None:
    folder = str(build(model_type, tmp_path / model_type))
    decoder = KINDS[model_type] == "decoder"
    refused = {c: REFUSALS.get((model_type, c)) for c in ("explain", "explain 1 1", "view")}
    out = _run(["explain", SENTENCE, "--model", folder, "--token", "it", "--json"], refused["explain"])
    if refused["explain"] is None:
        e = json.loads(out.output)
        assert e["tokens"][e["token_index"]].strip() == "it" and len(e["pattern"]) == len(e["tokens"])
    one = ["explain", SENTENCE, "--model", folder, "--token", "it", "--layer", "1", "--head", "1"]
    _run(one, refused["explain 1 1"])
    _run(["heads", SENTENCE, "--model", folder])
    if decoder:
        res = _run(["generate", "--model", folder, "the cat", "--tokens", "4", "--temperature", "0"])
        assert res.output.strip()
    page = tmp_path / "page.html"
    _run(["view", SENTENCE, "--model", folder, "-o", str(page)], refused["view"])
    if refused["view"] is None:
        assert page.stat().st_size > 1000 and "</html>" in page.read_text(encoding="utf-8").lower()
    else:
        assert not page.exists()


# ------------------------------------------------------------------ what the CLI run found, checked fast
def _manual_ablated_loss(model: Any, ids: torch.Tensor, layer: int, head: int) -> float:
    """The mean next-token loss of ``ids`` [1, seq] with head ``head`` of ``layer`` zeroed in ``hook_z``:
    the whole forward, no engine."""
    from headspace.analysis.trace.trace import hooked

    def zero(z: torch.Tensor, point: Any) -> torch.Tensor:  # z: (batch, seq, n_heads, d_head)
        z = z.clone()
        z[:, :, head] = 0
        return z

    with torch.no_grad(), hooked(model, {f"blocks.{layer}.attn.hook_z": zero}):
        logits = model(ids)  # (1, seq, vocab)
    return float(torch.nn.functional.cross_entropy(logits[0, :-1].double(), ids[0, 1:]))


@pytest.mark.parametrize("model_type", ["gemma4_text", "exaone4"])
def test_head_importance_equals_the_whole_forward_ablation(model_type: str, tmp_path: Path) -> None:
    """Gemma 4 (per-layer inputs, shared keys) once went through the block-by-block engine and got
    wrong numbers; EXAONE 4's NoPE layers were handed rotary positions and refused."""
    import headspace as hs
    from headspace.analysis import head_importance

    model = hs.load(build(model_type, tmp_path / model_type)).model
    ids = torch.tensor([[4, 5, 6, 7, 4, 9, 10, 11, 12, 13]])  # (1, 10)
    got = head_importance(model, ids, metric="loss", progress=False)
    for layer in range(L):
        for head in range(H):
            want = _manual_ablated_loss(model, ids, layer, head)
            assert float(got.ablated[layer, head]) == pytest.approx(want, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("model_type", ["bloom", "gpt_oss"])
def test_induction_traces_alibi_layers_and_fits_a_short_context(model_type: str, tmp_path: Path) -> None:
    """The chunked path cannot add ALiBi's bias (BLOOM) nor a learned sink (gpt-oss, where it refused):
    the scores come from the traced patterns, equal to the attention mass read off ``hook_pattern``."""
    import headspace as hs
    from headspace.analysis import induction_scores
    from headspace.analysis.lesson.roles import repeated_tokens
    from headspace.analysis.trace.trace import hooked

    loaded = hs.load(build(model_type, tmp_path / model_type))
    n = 7
    got = induction_scores(loaded, n=n, batch=2, bos=None)  # (L, H)
    tokens = repeated_tokens(V, n, 2, seed=0, bos=None, exclude=[1])  # (2, 2 n)
    seen: dict[str, torch.Tensor] = {}

    def keep(p: torch.Tensor, point: Any) -> None:  # p: (batch, H, 2 n, 2 n)
        seen[point.name] = p

    with torch.no_grad(), hooked(loaded.model, {"blocks.*.attn.hook_pattern": keep}):
        loaded.model(tokens)
    q = torch.arange(n, 2 * n)  # (n,): the second copy
    for i in range(L):
        want = seen[f"blocks.{i}.attn.hook_pattern"][:, :, q, q - n + 1].mean(dim=(0, 2))  # (H,)
        torch.testing.assert_close(got[i], want.float())


@pytest.mark.parametrize(
    ("model_type", "field", "walk_refused", "page_refused"),
    [("diffllama", "differential", False, False), ("deepseek_v2", "latent", False, True),
     ("llama4_text", "temperature", False, True)],
)  # fmt: skip
def test_the_walk_and_the_page_refuse_layers_they_cannot_recompute(
    model_type: str, field: str, walk_refused: bool, page_refused: bool, tmp_path: Path
) -> None:
    """The lesson walks differential pairs, latent attention and tempered layers (each with its step:
    "differential", "latent", "temperature"); the explorer page draws differential pair maps and
    refuses latent attention and tempered layers, whose scores it cannot recompute."""
    import headspace as hs
    from headspace.analysis.lesson.explain import explain
    from headspace.viz.explorer import Explorer

    loaded = hs.load(build(model_type, tmp_path / model_type))
    said = f"attention field '{field}' is set"
    ids = torch.tensor([[4, 5, 6, 7, 4, 9, 10, 11, 12, 13]])  # (1, 10)
    if walk_refused:
        for kwargs in ({}, {"layer": 1, "head": 1}):
            with pytest.raises(ValueError, match=said):
                explain(loaded, SENTENCE, "it", **kwargs)
    else:
        e = explain(loaded, SENTENCE, "it", layer=1, head=1)
        assert field in {s.scheme for s in e.scheme_steps}
    if page_refused:
        with pytest.raises(ValueError, match=said):
            Explorer(loaded.model, ids)
    else:
        Explorer(loaded.model, ids)
