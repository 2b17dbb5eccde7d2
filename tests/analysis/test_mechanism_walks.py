"""``headspace explain`` walks latent attention, differential attention and shared keys/values (issue 39).

Tiny random checkpoints built and saved by transformers 5 itself (odd sizes; every norm, lambda and
zero-initialised parameter set random), read back by ``headspace.load``; each explained head sits on the
mechanism's layer and every number of its step is checked against the model's own hook points.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

pytestmark = pytest.mark.usefixtures("single_thread")

WORDS = "the cat sat on mat because it was tired and dog ran to a house".split()
V = 61
SENTENCE = "the cat sat on the mat because it was tired"
D, H = 48, 4
BASE = dict(vocab_size=V, hidden_size=D, num_attention_heads=H, max_position_embeddings=40, pad_token_id=1,
            bos_token_id=2, eos_token_id=3, tie_word_embeddings=False)  # fmt: skip
MLA = dict(num_hidden_layers=2, num_key_value_heads=H, intermediate_size=37, kv_lora_rank=10,
           qk_rope_head_dim=4, v_head_dim=6, qk_nope_head_dim=8, moe_intermediate_size=12,
           n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
           routed_scaling_factor=1.7)  # fmt: skip
SLIDING = ["sliding_attention", "full_attention"] * 2
#: model_type -> (config class, model class, keywords beside BASE)
BUILDERS: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "deepseek_v2": (T.DeepseekV2Config, T.DeepseekV2ForCausalLM, {**MLA, "q_lora_rank": None,
                    "topk_method": "greedy"}),
    "deepseek_v3": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM, {**MLA, "q_lora_rank": 14, "n_group": 2,
                    "topk_group": 1, "norm_topk_prob": True}),
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, dict(num_hidden_layers=2, num_key_value_heads=2,
                intermediate_size=37, num_local_experts=5, num_experts_per_tok=2)),
    "diffllama": (T.DiffLlamaConfig, T.DiffLlamaForCausalLM, dict(num_hidden_layers=2, num_key_value_heads=2,
                  head_dim=6, intermediate_size=37)),
    "gemma3n_text": (T.Gemma3nTextConfig, T.Gemma3nForCausalLM, dict(num_hidden_layers=4,
                     num_key_value_heads=1, head_dim=12, intermediate_size=[26, 22, 26, 18],
                     layer_types=SLIDING, sliding_window=4,
                     hidden_size_per_layer_input=5, vocab_size_per_layer_input=40, num_kv_shared_layers=2,
                     laurel_rank=3, altup_num_inputs=3, activation_sparsity_pattern=[0.95, 0.6, 0.0, 0.0])),
    "gemma4_text": (T.Gemma4TextConfig, T.Gemma4ForCausalLM, dict(num_hidden_layers=4, num_key_value_heads=2,
                    head_dim=8, global_head_dim=14, num_global_key_value_heads=1, intermediate_size=22,
                    sliding_window=4, layer_types=SLIDING, attention_k_eq_v=True, num_kv_shared_layers=2,
                    hidden_size_per_layer_input=0)),
}  # fmt: skip


def write_tokenizer(folder: Path) -> None:
    """A word-level ``tokenizer.json`` of ``V`` entries, split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    names = ["<unk>", "<pad>", "<s>", "</s>", *WORDS]
    names += [f"x{i}" for i in range(V - len(names))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))


def build(model_type: str, folder: Path) -> Path:
    """The tiny checkpoint of ``model_type`` (norms, scales and lambdas set random) and its tokenizer."""
    config_cls, model_cls, over = BUILDERS[model_type]
    torch.manual_seed(0)
    model = model_cls(config_cls(**BASE, **over)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            unit = "norm" in name or "scale" in name
            p.copy_((1.0 + 0.3 * torch.randn_like(p)) if unit else 0.3 * torch.randn_like(p))
    folder.mkdir()
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


#: a DeepSeek V3 whose latents' down projections have biases (``attention_bias``): for ``why`` only
BIASED = (T.DeepseekV3Config, T.DeepseekV3ForCausalLM, {**BUILDERS["deepseek_v3"][2], "attention_bias": True})


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("walks")
    BUILDERS["deepseek_v3_biased"] = BIASED
    try:
        return {t: build(t, root / t) for t in BUILDERS}
    finally:
        del BUILDERS["deepseek_v3_biased"]


def _explained(folder: Path, layer: int | None, head: int | None) -> tuple[Any, Any, dict[str, Any], Any]:
    """(loaded model, explanation of "it", its steps by name, the trace of the same forward)."""
    import headspace as hs
    from headspace.analysis.lesson.explain import explain, tokenize_sentence

    loaded = hs.load(folder)
    e = explain(loaded, SENTENCE, "it", layer=layer, head=head)
    with torch.no_grad(), hs.trace(loaded.model, names=["*.hook_*"]) as t:
        loaded.model(tokenize_sentence(loaded, SENTENCE).ids)
    return loaded, e, {s.scheme: s for s in e.scheme_steps}, t


def _visible(e: Any) -> list[int]:
    return [j for j, s in enumerate(e.scores) if s is not None]


@pytest.mark.parametrize(
    ("model_type", "layer", "owner"),
    [("gemma3n_text", 2, 0), ("gemma3n_text", 3, 1), ("gemma4_text", 2, 0), ("gemma4_text", 3, 1)],
)
@pytest.mark.parametrize("head", [0, 2])
def test_a_shared_kv_layer_is_walked_on_its_owners_keys_and_values(
    folders: dict[str, Path], model_type: str, layer: int, owner: int, head: int
) -> None:
    loaded, e, steps, t = _explained(folders[model_type], layer, head)
    attn = loaded.model.blocks[layer].attn
    assert attn.spec.kv_source == owner and attn.kv_owner is loaded.model.blocks[owner].attn
    n = steps["kv_source"].numbers
    assert n["owner"] == owner and n["owner_keys"] == "hook_rot_k" and n["max_k_gap"] == 0.0
    kv, i, keys = head // attn.group_size, e.token_index, _visible(e)
    own = f"blocks.{owner}.attn"
    assert e.k == t[f"{own}.hook_k"][0, :, kv].tolist() and e.v == t[f"{own}.hook_v"][0, :, kv].tolist()
    # the walk, from the owner's hook points and the layer's own query: scores, then z
    k = t[f"{own}.hook_rot_k"][0, :, kv]  # (seq, d_head)
    q = t[f"blocks.{layer}.attn.hook_rot_q"][0, i, head]  # (d_head,)
    scores = attn.scale * (k @ q)  # (seq,)
    want = t[f"blocks.{layer}.attn.hook_scores"][0, head, i]  # (seq,)
    torch.testing.assert_close(scores[keys], want[keys], atol=1e-5, rtol=1e-5)
    assert n["scores"] == pytest.approx([float(want[j]) for j in n["keys"]], abs=1e-5)
    assert n["max_score_gap"] < 1e-5 and n["max_z_gap"] < 1e-5
    v = t[f"{own}.hook_v_normed"][0, :, kv]  # (seq, d_head): the owner's values after the value norm
    z = torch.tensor(e.pattern) @ v  # (d_head,)
    torch.testing.assert_close(z, t[f"blocks.{layer}.attn.hook_z"][0, i, head], atol=1e-5, rtol=1e-5)
    assert e.z == pytest.approx(z.tolist(), abs=1e-5)


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize(("layer", "head"), [(0, 2), (1, 1), (1, 3)])
def test_a_latent_head_is_walked_with_its_score_split(
    folders: dict[str, Path], model_type: str, layer: int, head: int
) -> None:
    loaded, e, steps, t = _explained(folders[model_type], layer, head)
    attn = loaded.model.blocks[layer].attn
    n = steps["latent"].numbers
    path, i, nope = f"blocks.{layer}.attn", e.token_index, MLA["qk_nope_head_dim"]
    assert n["kv_lora_rank"] == MLA["kv_lora_rank"] and n["qk_rope_head_dim"] == MLA["qk_rope_head_dim"]
    scores = t[f"{path}.hook_scores"][0, head, i]  # (seq,)
    keys = n["keys"]
    assert keys and all(e.scores[j] is not None for j in keys)
    total = [a + b for a, b in zip(n["nope"], n["rope"])]
    assert total == pytest.approx([float(scores[j]) for j in keys], abs=1e-5)
    # the non-rotary part needs no positions: hook_q's and hook_k's first qk_nope_head_dim features
    q, k = t[f"{path}.hook_q"][0, i, head], t[f"{path}.hook_k"][0, :, head]  # (dqk,), (seq, dqk)
    want_nope = attn.scale * (k[:, :nope] @ q[:nope])  # (seq,)
    assert n["nope"] == pytest.approx([float(want_nope[j]) for j in keys], abs=1e-5)
    # the rotary key part is the one shared by every head (hook_rope_k)
    rope_k = t[f"{path}.hook_rope_k"][0]  # (seq, rope)
    for h in range(H):
        torch.testing.assert_close(t[f"{path}.hook_k"][0, :, h, nope:], rope_k)
    assert max(n["max_k_nope_gap"], n["max_v_gap"], n["max_rope_k_gap"], n["max_score_gap"]) < 1e-5
    # the walk's own numbers: q_rot . k_rot_j * scale is the score; z and v are the hooks' (v_head_dim wide)
    q_rot, k_rot = torch.tensor(e.q_rot), torch.tensor(e.k_rot)  # (dqk,), (seq, dqk)
    again = attn.scale * (k_rot @ q_rot)  # (seq,)
    torch.testing.assert_close(again[_visible(e)], scores[_visible(e)], atol=1e-5, rtol=1e-5)
    assert len(e.z) == MLA["v_head_dim"] and e.z == pytest.approx(t[f"{path}.hook_z"][0, i, head].tolist())
    shapes, dqk = e.to_dict()["shapes"], MLA["qk_nope_head_dim"] + MLA["qk_rope_head_dim"]
    assert shapes["q"] == [dqk] and shapes["k"] == [len(e.tokens), dqk]
    assert shapes["v"] == [len(e.tokens), MLA["v_head_dim"]] and shapes["z"] == [MLA["v_head_dim"]]
    cache = attn.make_kv_cache(1, 8)
    assert n["cache_per_token"] == cache.numbers_per_token == MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]
    assert n["kv_per_token"] == H * (MLA["qk_nope_head_dim"] + MLA["qk_rope_head_dim"] + MLA["v_head_dim"])


@pytest.mark.parametrize(("layer", "head"), [(0, 0), (0, 3), (1, 1), (1, 2)])
def test_a_differential_head_is_walked_through_its_pair(
    folders: dict[str, Path], layer: int, head: int
) -> None:
    loaded, e, steps, t = _explained(folders["diffllama"], layer, head)
    attn = loaded.model.blocks[layer].attn
    n = steps["differential"].numbers
    path, i, P = f"blocks.{layer}.attn", e.token_index, H // 2
    pair = head % P
    assert n["pair"] == pair and n["heads"] == [pair, pair + P]
    # lambda from transformers' own parameters (the checkpoint read back by transformers)
    ref = T.DiffLlamaForCausalLM.from_pretrained(folders["diffllama"], attn_implementation="eager")
    r = ref.model.layers[layer].self_attn
    with torch.no_grad():
        lam = float(
            torch.exp((r.lambda_q1 * r.lambda_k1).sum()) - torch.exp((r.lambda_q2 * r.lambda_k2).sum())
        )
    assert n["lambda"] == pytest.approx(lam + r.lambda_init, abs=1e-6)
    assert n["lambda_init"] == pytest.approx(r.lambda_init)
    pattern, diff = t[f"{path}.hook_pattern"][0], t[f"{path}.hook_diff_pattern"][0, pair, i]
    keys = n["keys"]
    assert n["p1"] == pytest.approx([float(pattern[pair, i, j]) for j in keys])
    assert n["p2"] == pytest.approx([float(pattern[pair + P, i, j]) for j in keys])
    assert n["diff"] == pytest.approx([float(diff[j]) for j in keys], abs=1e-6)
    assert n["max_diff_gap"] < 1e-6 and n["max_norm_gap"] < 1e-5
    # each head's part of the output (the pair's norm frozen at the run's scale) sums to the layer's
    out = t[f"{path}.hook_result"][0, i].sum(dim=0)  # (d_model,)
    if attn.o_bias is not None:
        out = out + attn.o_bias
    assert e.out == pytest.approx(out.tolist(), abs=1e-5)
    assert len(e.head_contributions) == H and sum(e.head_shares) == pytest.approx(1.0)


@pytest.mark.parametrize("model_type", list(BUILDERS))
def test_the_ranking_reaches_every_layer_and_the_steps_print(
    folders: dict[str, Path], model_type: str
) -> None:
    import json

    from headspace.cli.render import EXPLAIN_WIDTH, scheme_lines

    loaded, e, steps, _ = _explained(folders[model_type], None, None)
    n_layers = len(loaded.model.blocks)
    assert sorted({(f.layer, f.head) for f in e.ranking}) == [
        (li, h) for li in range(n_layers) for h in range(H)
    ]
    for layer in range(n_layers):
        _, e, steps, _ = _explained(folders[model_type], layer, 1)
        assert all(len(line) <= EXPLAIN_WIDTH for line in scheme_lines(e)), scheme_lines(e)
        json.loads(json.dumps(e.to_dict(top=2)))
        field = {"deepseek_v2": "latent", "deepseek_v3": "latent", "diffllama": "differential"}.get(
            model_type
        )
        if field is None:
            field = "kv_source" if loaded.model.blocks[layer].attn.spec.kv_source is not None else None
        assert (field in steps) if field else not {"latent", "differential", "kv_source"} & set(steps)


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3", "deepseek_v3_biased", "diffllama"])
@pytest.mark.parametrize(("layer", "head"), [(0, 1), (1, 0), (1, 3)])
def test_why_splits_a_latent_or_differential_score_exactly(
    folders: dict[str, Path], model_type: str, layer: int, head: int
) -> None:
    """``why`` (score_decomposition): the parts add up to ``hook_scores`` (MLA at the run's frozen
    latent-norm scales); an earlier differential layer's parts are its heads, not its pairs."""
    import headspace as hs
    from headspace.analysis.circuits.decomposition import score_decomposition
    from headspace.analysis.lesson.explain import tokenize_sentence

    loaded = hs.load(folders[model_type])
    if model_type == "deepseek_v3_biased":
        assert loaded.model.blocks[layer].attn.kv_a_proj_with_mqa.bias is not None
    d = score_decomposition(loaded, SENTENCE, layer, head, query=7)
    with torch.no_grad(), hs.trace(loaded.model, names=["*.hook_scores"]) as t:
        loaded.model(tokenize_sentence(loaded, SENTENCE).ids)
    want = float(t[f"blocks.{layer}.attn.hook_scores"][0, head, 7, d.key])
    assert float(d.parts.sum()) == pytest.approx(want, abs=1e-5 * max(1.0, abs(want)))
    want_names = ["embed", *(f"L0H{h}" for h in range(H)), "mlp0"] if layer else ["embed"]
    assert d.components == [*want_names, "bias"]


def test_a_differential_layers_head_parts_sum_to_each_pairs_result(folders: dict[str, Path]) -> None:
    import headspace as hs
    from headspace.analysis.lesson.explain import tokenize_sentence

    loaded = hs.load(folders["diffllama"])
    with torch.no_grad(), hs.trace(loaded.model, names=["*.hook_z", "*.hook_result"]) as t:
        loaded.model(tokenize_sentence(loaded, SENTENCE).ids)
    for layer, block in enumerate(loaded.model.blocks):
        parts = block.attn.head_parts(t[f"blocks.{layer}.attn.hook_z"][0])  # (seq, H, d_model)
        pairs = parts[:, : H // 2] + parts[:, H // 2 :]  # (seq, P, d_model)
        torch.testing.assert_close(pairs, t[f"blocks.{layer}.attn.hook_result"][0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", ["gemma3n_text", "gemma4_text"])
def test_the_explorer_page_refuses_shared_kv_layers_by_name(
    folders: dict[str, Path], model_type: str, tmp_path: Path
) -> None:
    """The page recomputes scores from each layer's own q and k; a sharing layer has no k of its own: one
    line naming the field (it said the layer "did not run during the forward pass"), exit 2."""
    from click.testing import CliRunner

    from headspace.cli import cli

    page = tmp_path / "page.html"
    res = CliRunner().invoke(cli, ["view", SENTENCE, "--model", str(folders[model_type]), "-o", str(page)])
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.output
    assert "attention field 'kv_source' is set" in lines[0] and "blocks.2.attn" in lines[0]
    assert not page.exists()


def test_direct_logit_attribution_on_a_differential_model_is_per_query_head(folders: dict[str, Path]) -> None:
    """DLA gives each of the n_heads query heads its part (it gave n_heads / 2 pair parts as if heads); a
    pair's two heads add up to the pair's own part (its hook_result through the frozen final norm), and
    all the parts to the logit."""
    import headspace as hs
    from headspace.analysis.causal.attribution import direct_logit_attribution
    from headspace.analysis.causal.causal_inputs import token_id
    from headspace.analysis.lesson.explain import tokenize_sentence
    from headspace.nn.norms import rms_inverse

    loaded = hs.load(folders["diffllama"])
    d = direct_logit_attribution(loaded, SENTENCE, "tired", "dog")
    m = loaded.model
    n_layers = len(m.blocks)
    assert d.heads.shape == (n_layers, H) and d.layer_heads == [H] * n_layers
    torch.testing.assert_close(d.total, d.logit, atol=1e-4, rtol=1e-4)
    with torch.no_grad(), hs.trace(m, names=["*.hook_result", "hook_resid_final"]) as t:
        m(tokenize_sentence(loaded, SENTENCE).ids)
    u = m.W_U[:, token_id(loaded, "tired")] - m.W_U[:, token_id(loaded, "dog")]  # (d_model,)
    x = t["hook_resid_final"][0, -1]  # (d_model,)
    scale = (m.ln_final.offset + m.ln_final.weight) * rms_inverse(x, m.ln_final.eps)  # (d_model,)
    for layer in range(n_layers):
        own = (t[f"blocks.{layer}.attn.hook_result"][0, -1] * scale) @ u  # (P,): each pair's part
        torch.testing.assert_close(
            d.heads[layer, : H // 2] + d.heads[layer, H // 2 :], own, atol=1e-5, rtol=1e-4
        )
        assert not torch.allclose(d.heads[layer, : H // 2], own, atol=1e-5)  # heads, not pairs


@pytest.mark.parametrize(
    ("model_type", "field"),
    [("deepseek_v3", "attention field 'latent'"), ("diffllama", "attention field 'differential'"),
     ("gemma3n_text", "attention field 'qk_norm'"), ("gemma4_text", "attention field 'qk_norm'")],
)  # fmt: skip
def test_the_circuit_runner_refuses_these_blocks_by_the_fields_name(
    folders: dict[str, Path], model_type: str, field: str
) -> None:
    """It said "circuits need pre-norm decoder blocks ..." for all of them, naming no field."""
    import headspace as hs
    from headspace.analysis.circuits.nodes import graph_of

    with pytest.raises(ValueError, match=f"^the circuit runner \\(block 0\\) does not support the {field}"):
        graph_of(hs.load(folders[model_type]))


def test_the_circuit_runner_names_a_mixture_of_experts_and_a_layout() -> None:
    import dataclasses

    from headspace.analysis.circuits.nodes import _check_block
    from headspace.model.block import TransformerBlock
    from headspace.nn.spec import MLPSpec

    block = TransformerBlock(d_model=12, n_heads=3, d_mlp=14, norm="pre")
    _check_block(0, block)  # a plain pre-norm block runs
    moe = dataclasses.replace(block.spec, mlp=MLPSpec(kind="moe", d_mlp=14, n_experts=4, top_k=2))
    with pytest.raises(ValueError, match=r"block 2\) does not support the block field 'mlp.kind' \('moe'"):
        _check_block(2, TransformerBlock.from_spec(moe))
    post = TransformerBlock.from_spec(dataclasses.replace(block.spec, layout="post"))
    with pytest.raises(ValueError, match=r"block 1\) does not support the block field 'layout' \('post'\)"):
        _check_block(1, post)


@pytest.mark.parametrize("model_type", ["mixtral", "deepseek_v3"])
def test_the_lesson_walks_the_explained_tokens_experts_as_transformers_routes_it(
    folders: dict[str, Path], model_type: str
) -> None:
    """The "experts" step: transformers' router logits, chosen experts and weights for the walked token
    at the walked block (its MoE gate, hooked in the test), and the step's own two checks at rounding."""
    import headspace as hs
    from headspace.analysis.lesson.explain import explain, tokenize_sentence

    loaded, layer = hs.load(folders[model_type]), 1  # DeepSeek's block 0 is dense
    e = explain(loaded, SENTENCE, "it", layer=layer, head=0)
    steps = {s.scheme: s for s in e.scheme_steps}
    n = steps["experts"].numbers
    assert n["block"] == layer and len(n["chosen"]) == n["top_k"] == 2
    assert n["max_expert_gap"] < 1e-5 and n["max_sum_gap"] < 1e-5
    hf = (
        BUILDERS[model_type][1]
        .from_pretrained(folders[model_type], attn_implementation="eager", experts_implementation="eager")
        .eval()
    )
    got: dict[str, Any] = {}
    gate = hf.model.layers[layer].mlp.gate
    handle = gate.register_forward_hook(lambda _m, _a, out: got.update(out=out))
    with torch.no_grad():
        hf(tokenize_sentence(loaded, SENTENCE).ids)
    handle.remove()
    logits, weights, chosen = (o.reshape(-1, o.shape[-1]) for o in got["out"])  # (seq, E), (seq, k) x 2
    i = e.token_index
    assert n["chosen"] == chosen[i].tolist()
    torch.testing.assert_close(torch.tensor(n["weights"]), weights[i].float(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(torch.tensor(n["router_logits"]), logits[i].float(), atol=1e-5, rtol=1e-5)
    assert any("mixture of" in line for line in steps["experts"].lines)


def test_a_dense_block_has_no_experts_step(folders: dict[str, Path]) -> None:
    import headspace as hs
    from headspace.analysis.lesson.explain import explain

    e = explain(hs.load(folders["deepseek_v3"]), SENTENCE, "it", layer=0, head=0)
    assert "experts" not in {s.scheme for s in e.scheme_steps} and "latent" in {
        s.scheme for s in e.scheme_steps
    }


def test_headspace_explain_prints_the_experts_step_after_the_attention(folders: dict[str, Path]) -> None:
    from click.testing import CliRunner

    from headspace.cli import cli

    args = [
        "explain",
        "--model",
        str(folders["mixtral"]),
        SENTENCE,
        "--token",
        "it",
        "--layer",
        "1",
        "--head",
        "0",
    ]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    after = r.output.split("\n8. mixture of experts: token ", 1)
    assert len(after) == 2 and "7." in after[0] and "against the MLP's output: max gap" in after[1]
