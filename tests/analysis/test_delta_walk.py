"""The lesson on a Gated DeltaNet layer (issue #39): the exact effective weights ``w_tj`` of a head
(``o_t = sum_j w_tj v_j``) and ``explain`` walking a DeltaNet head, on Qwen3-Next / Qwen3.5 checkpoints
built by transformers 5.25 (every zero-initialised parameter set random).

References: the layer's own recorded rule output ``hook_o`` (headspace's chunked rule), transformers'
``torch_chunk_gated_delta_rule`` output inside its own forward, and a float64 recurrence run here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T
from click.testing import CliRunner

import headspace as hs
from headspace.analysis.lesson.explain import TokenizedSentence, explain
from headspace.attention.delta_net import GatedDeltaNet
from headspace.attention.delta_weights import delta_parts, delta_weights
from headspace.cli import cli

pytestmark = pytest.mark.usefixtures("single_thread")

V, D = 61, 24
COMMON = dict(vocab_size=V, hidden_size=D, intermediate_size=20, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=5,
              linear_value_head_dim=7, linear_conv_kernel_dim=3, max_position_embeddings=128, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)  # fmt: skip
FAMILIES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "qwen3_next": (T.Qwen3NextConfig, T.Qwen3NextForCausalLM,
                   dict(head_dim=6, partial_rotary_factor=1 / 3, num_experts=5, num_experts_per_tok=2,
                        moe_intermediate_size=9, shared_expert_intermediate_size=11, decoder_sparse_step=1,
                        mlp_only_layers=[])),
    "qwen3_5_text": (T.Qwen3_5TextConfig, T.Qwen3_5ForCausalLM, dict(head_dim=8)),
}  # fmt: skip
WORDS = "the cat sat on mat and it was happy because dog ran".split()


def _build(family: str, folder: Path) -> Any:
    """A random transformers model of ``family`` (every zero-initialised parameter set random), saved
    with a word-level tokenizer; returned read back with eager attention."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(5)
    model = model_cls(config_cls(**COMMON, **extra)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith("gate.weight") and "proj" not in name:
                p.copy_(torch.randn_like(p))
            elif name.endswith("dt_bias") or name.endswith("A_log"):  # decays far from 0 and from 1
                p.copy_(torch.randn_like(p) - 1.5)
            else:
                p.copy_(0.3 * torch.randn_like(p))
    model.save_pretrained(folder)
    names = ["<unk>", "<pad>", "<s>", "</s>", *WORDS]
    names += [f"x{i}" for i in range(V - len(names))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return model_cls.from_pretrained(
        folder, attn_implementation="eager", experts_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    return {f: (folder := tmp_path_factory.mktemp(f), _build(f, folder)) for f in FAMILIES}


def _record(layer: GatedDeltaNet, run: Any) -> dict[str, torch.Tensor]:
    """The layer's hook values (q, k, v, gate, beta, o, state) during ``run()``."""
    got: dict[str, torch.Tensor] = {}
    removers = []
    for name in ("q", "k", "v", "gate", "beta", "o", "state"):

        def keep(value: torch.Tensor, _point: Any, name: str = name) -> None:
            got[name] = value.detach().clone()

        removers.append(getattr(layer, f"hook_{name}").add(keep, this_thread=True))
    try:
        run()
    finally:
        for remove in removers:
            remove()
    return got


def _recurrence64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
    """The delta rule a position at a time in float64 (delta_rule's conventions): (o [B, S, Hv, dv], the
    final state [B, Hv, dk, dv])."""
    group = v.shape[2] // q.shape[2]
    q, k = (x.double().repeat_interleave(group, dim=2) for x in (q, k))  # (B, S, Hv, dk)
    q = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() / q.shape[-1] ** 0.5  # the rule's eps
    k = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    v, g, beta = v.double(), g.double(), beta.double()
    B, S, Hv, dk = q.shape
    s = torch.zeros(B, Hv, dk, v.shape[-1], dtype=torch.float64)
    out = []
    for t in range(S):
        s = s * g[:, t].exp()[..., None, None]
        read = torch.einsum("bhk,bhkv->bhv", k[:, t], s)  # k_t S
        s = s + torch.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t, :, None] * (v[:, t] - read))
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], s))
    return torch.stack(out, dim=1), s


@pytest.mark.parametrize("family", list(FAMILIES))
def test_effective_weights_give_the_rule_output_of_every_deltanet_head(saved: dict, family: str) -> None:
    ours = hs.load(saved[family][0]).model
    ids = torch.randint(3, V, (2, 70))  # 70 positions: the chunked rule runs two chunks of 64
    for block in ours.blocks:
        if not isinstance(block.attn, GatedDeltaNet):
            continue
        with torch.inference_mode():
            rec = _record(block.attn, lambda: ours(ids))
        w = delta_weights(rec["q"], rec["k"], rec["gate"], rec["beta"])  # (B, Hv, S, S)
        assert w.shape == (2, 6, 70, 70) and torch.equal(w, w.tril())
        o = torch.einsum("bhts,bshd->bthd", w, rec["v"].float())  # (B, S, Hv, dv)
        scale = float(rec["o"].abs().max())
        assert float((o - rec["o"]).abs().max()) <= 2e-5 * scale
        ref, state = _recurrence64(rec["q"], rec["k"], rec["v"], rec["gate"], rec["beta"])
        o64 = torch.einsum("bhts,bshd->bthd", w.double(), rec["v"].double())  # (B, S, Hv, dv)
        assert float((o64 - ref).abs().max()) <= 1e-6 * scale  # w itself is exact to float32 rounding
        assert torch.allclose(rec["state"].double(), state, atol=2e-5 * float(state.abs().max()))
        assert float(w.abs().max()) > 0.05 and float(w.min()) < 0  # a real, signed pattern


def test_effective_weights_give_transformers_own_rule_output(saved: dict, monkeypatch: Any) -> None:
    import transformers.models.qwen3_next.modeling_qwen3_next as modeling

    ref = saved["qwen3_next"][1]
    calls: list[tuple[torch.Tensor, ...]] = []
    rule = modeling.torch_chunk_gated_delta_rule

    def spy(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kw: Any) -> Any:
        out = rule(query, key, value, **kw)
        calls.append((query, key, value, kw["g"], kw["beta"], out[0]))
        return out

    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", spy)
    with torch.no_grad():
        ref(torch.randint(3, V, (1, 40)))
    assert len(calls) == 3  # layers 0, 1, 2 are Gated DeltaNet
    for q, k, v, g, beta, o in calls:
        w = delta_weights(q, k, g, beta)  # (1, Hv, S, S)
        mine = torch.einsum("bhts,bshd->bthd", w, v.float())  # (1, S, Hv, dv)
        assert float((mine - o).abs().max()) <= 2e-5 * float(o.abs().max())


def test_the_parts_of_a_weight_without_erasure_and_one_step_back() -> None:
    torch.manual_seed(0)
    q, k = torch.randn(1, 5, 1, 4), torch.randn(1, 5, 1, 4)
    g, beta = -torch.rand(1, 5, 2), torch.rand(1, 5, 2)
    w = delta_weights(q, k, g, beta)  # (1, 2, 5, 5)
    parts = delta_parts(q, k, g, beta)
    qn = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() / 2.0  # (1, 5, 1, 4): sqrt(d_k) = 2
    kn = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    for t in range(5):  # the diagonal has nothing to erase: w_tt = beta_t q_t . k_t
        dot = float(qn[0, t, 0] @ kn[0, t, 0])
        assert float(w[0, 1, t, t]) == pytest.approx(float(beta[0, t, 1]) * dot, abs=1e-6)
        assert float(parts["linear"][0, 1, t, t]) == pytest.approx(float(beta[0, t, 1]) * dot, abs=1e-6)
    # one step back: w_{t,t-1} = beta_{t-1} exp(g_t) (q_t - beta_t (q_t . k_t) k_t) . k_{t-1}
    t, h = 3, 0
    u = qn[0, t, 0] - beta[0, t, h] * (qn[0, t, 0] @ kn[0, t, 0]) * kn[0, t, 0]
    want = float(beta[0, t - 1, h] * g[0, t, h].exp() * (u @ kn[0, t - 1, 0]))
    assert float(w[0, h, t, t - 1]) == pytest.approx(want, abs=1e-6)
    assert float(parts["decay"][0, h, t, 0]) == pytest.approx(float(g[0, 1:4, h].sum().exp()), rel=1e-6)
    assert torch.equal(parts["decay"], parts["decay"].tril())


def test_bad_shapes_are_refused_in_one_line() -> None:
    q = torch.randn(1, 4, 2, 3)
    with pytest.raises(ValueError, match=r"g and beta must be \[batch, seq, n_v_heads\] .* got \[1, 5, 4\]"):
        delta_weights(q, q, torch.randn(1, 5, 4), torch.randn(1, 5, 4))
    with pytest.raises(ValueError, match="n_v_heads must be a multiple of the 2 query/key heads; got 3"):
        delta_weights(q, q, torch.randn(1, 4, 3), torch.randn(1, 4, 3))
    with pytest.raises(ValueError, match=r"q and k must be \[batch, seq, n_k_heads, d_k\]"):
        delta_weights(q, q[:, :3], torch.randn(1, 4, 2), torch.randn(1, 4, 2))


TEXT = "the cat sat on the mat and it was happy"


def _reference_layer(ref: Any, family: str, layer: int, ids: torch.Tensor, monkeypatch: Any) -> dict:
    """Transformers' own values inside DeltaNet layer ``layer`` on ``ids``: the rule output ``o``
    [1, S, Hv, dv], the gated norm's gate input ``gate_in`` and output ``z`` [1, S, Hv, dv], the layer
    output ``out`` [1, S, d_model]."""
    import importlib

    modeling = importlib.import_module(f"transformers.models.{family.removesuffix('_text')}.modeling_"
                                       f"{family.removesuffix('_text')}")  # fmt: skip
    mixer = ref.model.layers[layer].linear_attn
    got: dict[str, torch.Tensor] = {}
    rule = modeling.torch_chunk_gated_delta_rule

    def spy(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kw: Any) -> Any:
        out = rule(query, key, value, **kw)
        got.setdefault("o_all", []).append(out[0])  # type: ignore[attr-defined]
        return out

    def norm_hook(_m: Any, args: Any, out: torch.Tensor) -> None:
        got["gate_in"], got["z"] = args[1], out

    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", spy)
    handles = [mixer.norm.register_forward_hook(norm_hook),
               mixer.register_forward_hook(lambda _m, _a, out: got.__setitem__("out", out))]  # fmt: skip
    try:
        with torch.no_grad():
            ref(ids)
    finally:
        for h in handles:
            h.remove()
    deltanets = [i for i, b in enumerate(ref.model.layers) if hasattr(b, "linear_attn")]
    got["o"] = got.pop("o_all")[deltanets.index(layer)]  # type: ignore[index]
    shape = got["o"].shape  # (1, S, Hv, dv)
    got["gate_in"], got["z"] = got["gate_in"].reshape(shape), got["z"].reshape(shape)
    return got


@pytest.mark.parametrize("family", list(FAMILIES))
def test_explain_walks_a_deltanet_head_exactly_as_transformers_computes_it(
    saved: dict, family: str, monkeypatch: Any
) -> None:
    folder, ref = saved[family]
    ours = hs.load(folder)
    ids = torch.tensor([[4 + WORDS.index(w) for w in TEXT.split()]])
    tokenized = TokenizedSentence(TEXT, TEXT.split(), ids, None)
    layer, head, t = 1, 5, 7  # value head 5 reads query/key head 1 (3 value heads per key head)
    e = explain(ours, TEXT, "it", layer=layer, head=head, tokenized=tokenized)
    want = _reference_layer(ref, family, layer, ids, monkeypatch)
    assert (e.layer, e.head, e.kv_head, e.token_index, e.n_heads) == (layer, head, 1, t, 6)
    w, v = torch.tensor(e.pattern), torch.tensor(e.v)  # (seq,), (seq, dv)
    assert torch.count_nonzero(w[t + 1 :]) == 0 and all(s is None for s in e.scores[t + 1 :])
    o = want["o"][0, t, head]  # (dv,): transformers' rule output
    assert float((w @ v - o).abs().max()) <= 2e-5 * float(o.abs().max())
    assert torch.allclose(
        torch.tensor(e.gate), torch.nn.functional.silu(want["gate_in"][0, t, head]), atol=1e-6
    )
    assert torch.allclose(torch.tensor(e.z), want["z"][0, t, head], atol=1e-5)
    assert torch.allclose(torch.tensor(e.out), want["out"][0, t], atol=1e-5)
    assert [a.index for a in e.top] == sorted(range(t + 1), key=lambda j: -abs(e.pattern[j]))[:5]
    (step,) = [s for s in e.scheme_steps if s.scheme != "experts"]  # (its block's MoE: step 8)
    assert step.scheme == "delta_rule" and step.numbers["o_gap"] <= 1e-5
    assert torch.allclose(torch.tensor(step.numbers["o"], dtype=torch.float64), o.double(), atol=1e-5)
    assert [r["j"] for r in step.numbers["top"]] == [a.index for a in e.top]
    assert all(len(line) <= 96 for line in step.lines)
    chosen = explain(ours, TEXT, "it", layer=layer, tokenized=tokenized)  # no head: the largest |z_h W_O[h]|
    assert chosen.head == max(range(6), key=lambda h: e.head_contributions[h]) and chosen.layer == layer
    assert {f.layer for f in chosen.ranking} == {3}  # the ranking: the softmax layer only


def test_the_cli_walks_a_deltanet_head_in_100_columns(saved: dict, tmp_path: Path) -> None:
    folder = str(saved["qwen3_next"][0])
    args = ["explain", TEXT, "--model", folder, "--token", "it", "--layer", "0", "--head", "5"]
    res = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "Gated DeltaNet" in res.output and "the delta rule: o_t = sum_j w_tj v_j" in res.output
    assert "o = sum_j w_tj v_j" in res.output and "gate = silu(x W_Z[5])" in res.output
    assert max(len(line) for line in res.output.splitlines()) <= 100
    res = CliRunner().invoke(cli, [*args, "--json", "--out", str(tmp_path / "pics")], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["layer"] == 0 and d["head"] == 5 and d["scheme_steps"][0]["scheme"] == "delta_rule"
    assert len(d["pattern"]) == len(TEXT.split()) and len(d["pictures"]) == 2
    assert all(Path(p).is_file() and Path(p).parent == tmp_path / "pics" for p in d["pictures"])
    assert d["shapes"]["q"] == [5] and d["shapes"]["v"] == [10, 7] and d["shapes"]["W_O"] == [42, D]
    res = CliRunner().invoke(cli, [*args[:-2], "--json"], catch_exceptions=False)  # --layer 0, no head
    assert res.exit_code == 0 and json.loads(res.output)["layer"] == 0
    res = CliRunner().invoke(cli, [*args[:-1], "6"])  # the widest layer has 6 heads: its DeltaNet ones
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == ["error: head 6 is out of range: valid heads are 0..5"]
    res = CliRunner().invoke(cli, [*args[:-3], "3", "--head", "5"])  # layer 3: 4 softmax heads
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == ["error: head 5 is out of range: valid heads are 0..3"]
