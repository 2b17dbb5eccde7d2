"""headspace.layouts: bit-exact round trips, and converted layers that reproduce the source modules.

The Hugging Face modules are built from small configs with random weights (nothing is downloaded).
Sizes are distinct primes: batch 3, seq 5, n_heads 2, d_head 7 (d_model 14); GQA: 6 heads over 3.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from headspace import MultiHeadAttention
from headspace import layouts as hl
from headspace.attention.compat import MultiheadAttention as CompatMHA

B, S, H, DH = 3, 5, 2, 7
D = H * DH

from transformers import BertConfig, GPT2Config  # noqa: E402
from transformers.models.bert.modeling_bert import BertAttention, BertModel  # noqa: E402
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention, GPT2Model  # noqa: E402


def randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    """Random values in every parameter (biases included, which most modules start at zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) / p.shape[-1] ** 0.5)
    return module


def layer(**kw) -> MultiHeadAttention:
    return randomize(MultiHeadAttention(**{"d_model": D, "n_heads": H, **kw}))


def assert_same_params(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k


def grads_as_layer(attn: MultiHeadAttention) -> MultiHeadAttention:
    """A copy of ``attn`` whose parameters hold its gradients: converting it converts the gradients
    (every layout map is linear and moves values only)."""
    g = MultiHeadAttention(
        attn.d_model,
        attn.n_heads,
        attn.d_head,
        attn.n_kv_heads,
        attn.kdim,
        attn.vdim,
        bias=attn.b_O is not None,
    )
    with torch.no_grad():
        for (_, p), (_, q) in zip(g.named_parameters(), attn.named_parameters()):
            p.copy_(q.grad)
    return g


def bert_config(**kw) -> BertConfig:
    return BertConfig(
        hidden_size=D,
        num_attention_heads=H,
        num_hidden_layers=2,
        intermediate_size=11,
        vocab_size=19,
        max_position_embeddings=13,
        attention_probs_dropout_prob=0.0,
        hidden_dropout_prob=0.0,
        attn_implementation="eager",
        **kw,
    )


def gpt2_config() -> GPT2Config:
    return GPT2Config(
        n_embd=D,
        n_head=H,
        n_layer=2,
        vocab_size=19,
        n_positions=13,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
        attn_implementation="eager",
    )


# ---------------------------------------------------------------------------------------------- round trips
LAYOUT_FNS = {
    "torch_mha": (hl.to_torch_mha, hl.from_torch_mha, hl.load_torch_mha),
    "hf_bert": (hl.to_hf_bert, hl.from_hf_bert, hl.load_hf_bert),
    "gpt2": (hl.to_gpt2, hl.from_gpt2, hl.load_gpt2),
    "transformer_lens": (hl.to_transformer_lens, hl.from_transformer_lens, hl.load_transformer_lens),
}


def from_kwargs(name: str, n_heads: int) -> dict:
    return {} if name == "transformer_lens" else {"n_heads": n_heads}


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(sorted(LAYOUT_FNS)),
    n_heads=st.integers(1, 4),
    d_head=st.integers(1, 5),
    bias=st.booleans(),
    prefix=st.sampled_from(["", "encoder.layer.3.attention.", "h.0.attn."]),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_round_trips_are_bit_exact(
    name: str, n_heads: int, d_head: int, bias: bool, prefix: str, dtype: torch.dtype
) -> None:
    to, frm, load = LAYOUT_FNS[name]
    d = n_heads * d_head
    attn = randomize(MultiHeadAttention(d, n_heads, bias=bias, dtype=dtype))
    sd = to(attn, prefix=prefix)
    assert all(k.startswith(prefix) for k in sd)
    back = frm(sd, prefix=prefix, **from_kwargs(name, n_heads))
    if bias or name == "torch_mha":
        assert_same_params(back, attn)  # layer -> layout -> layer
    else:  # the HF / TransformerLens layouts always carry biases: a bias-free layer comes back with zeros
        for k, v in back.state_dict().items():
            assert torch.equal(v, attn.state_dict()[k]) if k in attn.state_dict() else not v.any(), k
    again = to(back, prefix=prefix)  # layout -> layer -> layout
    assert again.keys() == sd.keys()
    for k in sd:
        assert again[k].dtype == sd[k].dtype and torch.equal(again[k], sd[k]), k
    target = randomize(MultiHeadAttention(d, n_heads, bias=bias, dtype=dtype), seed=9)
    assert load(target, sd, prefix=prefix) is target  # in place
    assert_same_params(target, attn)


def test_outputs_are_fresh_tensors_not_views_of_the_layer() -> None:
    attn = layer()
    for name, (to, _, _) in LAYOUT_FNS.items():
        sd = to(attn)
        before = {k: v.clone() for k, v in sd.items()}
        with torch.no_grad():
            for p in attn.parameters():
                p.add_(1.0)
        for k in sd:
            assert torch.equal(sd[k], before[k]), (name, k)
            assert not sd[k].requires_grad, (name, k)


def test_gqa_and_cross_dims_round_trip_through_transformer_lens() -> None:
    attn = randomize(MultiHeadAttention(d_model=11, n_heads=6, d_head=5, n_kv_heads=3, kdim=13, vdim=17))
    sd = hl.to_transformer_lens(attn, prefix="blocks.0.attn.")
    assert {k: tuple(v.shape) for k, v in sd.items()} == {
        "blocks.0.attn.W_Q": (6, 11, 5),
        "blocks.0.attn._W_K": (3, 13, 5),
        "blocks.0.attn._W_V": (3, 17, 5),
        "blocks.0.attn.W_O": (6, 5, 11),
        "blocks.0.attn.b_Q": (6, 5),
        "blocks.0.attn._b_K": (3, 5),
        "blocks.0.attn._b_V": (3, 5),
        "blocks.0.attn.b_O": (11,),
    }
    assert torch.equal(sd["blocks.0.attn.W_Q"], attn.W_Q) and torch.equal(sd["blocks.0.attn._W_V"], attn.W_V)
    assert_same_params(hl.from_transformer_lens(sd, prefix="blocks.0.attn."), attn)


# ---------------------------------------------------------------------------------------------- torch MHA
@pytest.mark.parametrize("kvdims", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_torch_mha_conversion_reproduces_torch(kvdims: bool, bias: bool) -> None:
    kdim, vdim = (13, 17) if kvdims else (None, None)
    ref = randomize(nn.MultiheadAttention(D, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=True))
    attn = hl.from_torch_mha(ref.state_dict(), n_heads=H)
    x = torch.randn(B, S, D, requires_grad=True)
    c = torch.randn(B, 3, ref.kdim, requires_grad=True)
    val = torch.randn(B, 3, ref.vdim)
    pad = torch.tensor([[True, True, True], [True, False, True], [True, True, False]])  # True = real token
    ours = attn(x, c, val, key_padding=pad)
    x2, c2 = (t.detach().clone().requires_grad_() for t in (x, c))
    theirs, _ = ref(x2, c2, val, key_padding_mask=~pad, need_weights=False)  # torch: True = padding
    torch.testing.assert_close(ours, theirs)
    cot = torch.randn_like(ours)
    (ours * cot).sum().backward()
    (theirs * cot).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(c.grad, c2.grad)
    grads = hl.to_torch_mha(grads_as_layer(attn))
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)
    back = nn.MultiheadAttention(D, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=True)
    back.load_state_dict(hl.to_torch_mha(attn))  # strict: same keys and shapes as torch
    for k, v in ref.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_torch_mha_from_inside_a_transformer_encoder_layer() -> None:
    enc = randomize(nn.TransformerEncoderLayer(D, H, dim_feedforward=11, dropout=0.0, batch_first=True))
    attn = hl.from_torch_mha(enc.state_dict(), n_heads=H, prefix="self_attn.")  # linear1.* etc. are ignored
    x = torch.randn(B, S, D)
    causal = nn.Transformer.generate_square_subsequent_mask(S)
    torch.testing.assert_close(attn(x, is_causal=True), enc.self_attn(x, x, x, attn_mask=causal)[0])


def test_torch_mha_bias_kv_goes_to_compat() -> None:
    ref = randomize(nn.MultiheadAttention(D, H, add_bias_kv=True))
    with pytest.raises(hl.LayoutError, match=r"compat\.MultiheadAttention") as err:
        hl.from_torch_mha(ref.state_dict(), n_heads=H)
    assert "bias_k" in str(err.value)
    compat = CompatMHA(D, H, add_bias_kv=True)
    compat.load_state_dict(ref.state_dict())
    sd = hl.to_torch_mha(compat)
    assert sd.keys() == ref.state_dict().keys()
    assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())


# ---------------------------------------------------------------------------------------------- BERT
def hf_padding_mask(pad: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Hugging Face's extended additive mask [batch, 1, 1, seq_k] from pad (True = real token)."""
    return torch.zeros(pad.shape, dtype=dtype).masked_fill(~pad, torch.finfo(dtype).min)[:, None, None, :]


def test_hf_bert_conversion_reproduces_bert_attention() -> None:
    bert = randomize(BertAttention(bert_config())).eval()
    attn = hl.from_hf_bert(bert.state_dict(), n_heads=H)
    x = torch.randn(B, S, D, requires_grad=True)
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[1, 3:] = False
    pad[2, 1:] = False
    # attention alone: BertSelfAttention, then the dense of BertSelfOutput
    context = bert.self(x, attention_mask=hf_padding_mask(pad))[0]
    theirs = bert.output.dense(context)
    ours = attn(x, key_padding=pad)
    torch.testing.assert_close(ours, theirs)
    # the whole BertAttention = LayerNorm(dense(...) + x); the LayerNorm is not ours, the rest is
    full = bert(x, attention_mask=hf_padding_mask(pad))[0]
    torch.testing.assert_close(bert.output.LayerNorm(ours + x), full)
    cot = torch.randn_like(ours)
    (theirs * cot).sum().backward()
    gx_ref = x.grad.clone()
    x.grad = None
    (ours * cot).sum().backward()
    torch.testing.assert_close(x.grad, gx_ref)
    grads = hl.to_hf_bert(grads_as_layer(attn))
    for name, p in bert.named_parameters():
        if "LayerNorm" not in name:
            torch.testing.assert_close(grads[name], p.grad, msg=name)


def test_hf_bert_layer_from_a_whole_model_checkpoint() -> None:
    model = randomize(BertModel(bert_config(), add_pooling_layer=False)).eval()
    flat = dict(model.state_dict())  # a whole-model flat dict, as read from model.safetensors
    prefix = "encoder.layer.1.attention."
    attn = hl.from_hf_bert(flat, n_heads=H, prefix=prefix)
    x = torch.randn(B, S, D)
    ref = model.encoder.layer[1].attention
    torch.testing.assert_close(attn(x), ref.output.dense(ref.self(x)[0]))
    target = MultiHeadAttention(D, H)
    hl.load_hf_bert(target, flat, prefix=prefix)  # in place, e.g. into a model's block
    assert_same_params(target, attn)
    written = hl.to_hf_bert(attn, prefix=prefix)
    for k, v in written.items():
        assert torch.equal(v, flat[k]), k


# ---------------------------------------------------------------------------------------------- GPT-2
def test_gpt2_conversion_reproduces_gpt2_attention() -> None:
    gpt = randomize(GPT2Attention(gpt2_config(), layer_idx=0)).eval()
    attn = hl.from_gpt2(gpt.state_dict(), n_heads=H)
    x = torch.randn(B, S, D, requires_grad=True)
    causal = torch.full((S, S), torch.finfo(torch.float32).min).triu(1)[None, None]  # (1, 1, S, S)
    theirs = gpt(x, attention_mask=causal)[0]
    ours = attn(x, is_causal=True)
    torch.testing.assert_close(ours, theirs)
    cot = torch.randn_like(ours)
    (theirs * cot).sum().backward()
    gx_ref = x.grad.clone()
    x.grad = None
    (ours * cot).sum().backward()
    torch.testing.assert_close(x.grad, gx_ref)
    grads = hl.to_gpt2(grads_as_layer(attn))
    for name, p in gpt.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


def test_gpt2_from_a_whole_model_checkpoint_with_old_mask_buffers() -> None:
    model = randomize(GPT2Model(gpt2_config())).eval()
    flat = dict(model.state_dict())
    flat["h.1.attn.bias"] = torch.ones(1, 1, 13, 13, dtype=torch.bool).tril()  # as in older checkpoints
    flat["h.1.attn.masked_bias"] = torch.tensor(-1e4)
    attn = hl.from_gpt2(flat, n_heads=H, prefix="h.1.attn.")
    x = torch.randn(B, S, D)
    causal = torch.full((S, S), torch.finfo(torch.float32).min).triu(1)[None, None]  # (1, 1, S, S)
    torch.testing.assert_close(attn(x, is_causal=True), model.h[1].attn(x, attention_mask=causal)[0])
    assert hl.to_gpt2(attn, prefix="h.1.attn.")["h.1.attn.c_attn.weight"].shape == (
        D,
        3 * D,
    )  # Conv1D [in, out]


# ------------------------------------------------------------------------------------------ TransformerLens
def transformer_lens_attention(sd: dict[str, Tensor], x: Tensor) -> Tensor:
    """TransformerLens's attention written from its einsum formulas (causal, GQA by repeat_interleave)."""
    if "_W_K" in sd:
        group = sd["W_Q"].shape[0] // sd["_W_K"].shape[0]
        W_K, W_V = (sd[n].repeat_interleave(group, dim=0) for n in ("_W_K", "_W_V"))
        b_K, b_V = (sd[n].repeat_interleave(group, dim=0) for n in ("_b_K", "_b_V"))
    else:
        W_K, W_V, b_K, b_V = sd["W_K"], sd["W_V"], sd["b_K"], sd["b_V"]
    q = torch.einsum("bpm,hmd->bphd", x, sd["W_Q"]) + sd["b_Q"]  # (batch, pos, head, d_head)
    k = torch.einsum("bpm,hmd->bphd", x, W_K) + b_K  # (batch, pos, head, d_head)
    v = torch.einsum("bpm,hmd->bphd", x, W_V) + b_V  # (batch, pos, head, d_head)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / sd["W_Q"].shape[-1] ** 0.5  # (batch, head, q, k)
    n = x.shape[1]
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    pattern = scores.softmax(dim=-1)  # (batch, head, q, k)
    z = torch.einsum("bhqk,bkhd->bqhd", pattern, v)  # (batch, pos, head, d_head)
    result = torch.einsum("bqhd,hdm->bqhm", z, sd["W_O"])  # (batch, pos, head, d_model)
    return result.sum(dim=2) + sd["b_O"]


@pytest.mark.parametrize("n_kv_heads", [6, 3, 1])
def test_transformer_lens_conversion_reproduces_its_formulas(n_kv_heads: int) -> None:
    g = torch.Generator().manual_seed(1)
    n_heads, d_model, d_head = 6, 11, 5
    kv = "_" if n_kv_heads != n_heads else ""
    sd = {
        "W_Q": torch.randn(n_heads, d_model, d_head, generator=g) / 3,
        f"{kv}W_K": torch.randn(n_kv_heads, d_model, d_head, generator=g) / 3,
        f"{kv}W_V": torch.randn(n_kv_heads, d_model, d_head, generator=g) / 3,
        "W_O": torch.randn(n_heads, d_head, d_model, generator=g) / 3,
        "b_Q": torch.randn(n_heads, d_head, generator=g),
        f"{kv}b_K": torch.randn(n_kv_heads, d_head, generator=g),
        f"{kv}b_V": torch.randn(n_kv_heads, d_head, generator=g),
        "b_O": torch.randn(d_model, generator=g),
        "mask": torch.ones(13, 13, dtype=torch.bool).tril(),  # TransformerLens's buffers: ignored
        "IGNORE": torch.tensor(float("-inf")),
    }
    attn = hl.from_transformer_lens({f"blocks.0.attn.{k}": v for k, v in sd.items()}, prefix="blocks.0.attn.")
    assert (attn.n_heads, attn.n_kv_heads, attn.d_head, attn.d_model) == (
        n_heads,
        n_kv_heads,
        d_head,
        d_model,
    )
    x = torch.randn(B, S, d_model)
    torch.testing.assert_close(attn(x, is_causal=True), transformer_lens_attention(sd, x))
    for h in range(n_heads):  # per-head tensors are the layer's own views
        assert torch.equal(attn.heads[h].W_Q, sd["W_Q"][h])
        assert torch.equal(attn.heads[h].W_K, sd[f"{kv}W_K"][h // (n_heads // n_kv_heads)])


# ---------------------------------------------------------------------------------------------- errors
def test_layout_error_lists_missing_unexpected_and_mismatched_keys() -> None:
    sd = hl.to_hf_bert(layer(), prefix="encoder.layer.0.attention.")
    del sd["encoder.layer.0.attention.self.value.weight"]
    sd["encoder.layer.0.attention.self.key.weight"] = torch.zeros(D - 1, D)
    sd["encoder.layer.0.attention.self.rotary.weight"] = torch.zeros(3)
    sd["encoder.layer.0.attention.output.LayerNorm.weight"] = torch.ones(D)  # not attention: fine
    sd["encoder.layer.1.attention.anything"] = torch.zeros(1)  # outside the prefix: ignored
    with pytest.raises(hl.LayoutError) as err:
        hl.from_hf_bert(sd, n_heads=H, prefix="encoder.layer.0.attention.")
    e = err.value
    assert isinstance(e, ValueError)
    assert e.missing == ["self.value.weight"]
    assert e.unexpected == ["self.rotary.weight"]
    assert e.mismatched == {"self.key.weight": ((D, D), (D - 1, D))}
    msg = str(e)
    for part in (
        "hf_bert",
        "encoder.layer.0.attention.self.value.weight",
        "self.rotary.weight",
        f"[{D}, {D}]",
    ):
        assert part in msg


@pytest.mark.parametrize(
    ("call", "exc", "words"),
    [
        (lambda sd: hl.from_gpt2(sd, n_heads=H, prefix="h.9."), hl.LayoutError, ["no key starts", "h.9."]),
        (lambda sd: hl.from_gpt2(sd, n_heads=3), ValueError, ["n_heads=3", "n_embd"]),
        (lambda sd: hl.from_gpt2(sd, n_heads=0), ValueError, ["n_heads"]),
        (lambda sd: hl.from_gpt2({"c_attn.weight": sd["c_attn.weight"]}, n_heads=H), hl.LayoutError,
         ["c_proj.weight"]),
        (lambda sd: hl.from_gpt2({**sd, "c_proj.bias": None}, n_heads=H), TypeError, ["c_proj.bias"]),
        (lambda sd: hl.from_gpt2(list(sd.items()), n_heads=H), TypeError, ["state_dict", "mapping"]),
        (lambda sd: hl.from_gpt2(sd, n_heads=H, prefix=3), TypeError, ["prefix"]),
        (
            lambda sd: hl.from_gpt2({k: v for k, v in sd.items() if k != "c_proj.bias"}, n_heads=H),
            hl.LayoutError,
            ["c_proj.bias", "all or none"],
        ),
        (
            lambda sd: hl.from_gpt2({**sd, "c_proj.bias": sd["c_proj.bias"].double()}, n_heads=H),
            hl.LayoutError,
            ["dtypes"],
        ),
        (lambda sd: hl.load_gpt2(MultiHeadAttention(D, H, d_head=5), sd), ValueError, ["d_head: layer 5"]),
        (lambda sd: hl.load_gpt2(MultiHeadAttention(D + 2, H), sd), ValueError, ["d_model"]),
    ],
)  # fmt: skip
def test_bad_state_dicts_and_arguments(call, exc: type[Exception], words: list[str]) -> None:
    sd = hl.to_gpt2(layer())
    with pytest.raises(exc) as err:
        call(sd)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_layers_a_layout_cannot_hold_are_refused_by_name() -> None:
    gqa = layer(n_heads=6, d_head=3, n_kv_heads=2, d_model=11)
    for to in (hl.to_torch_mha, hl.to_hf_bert, hl.to_gpt2):
        with pytest.raises(ValueError, match="n_kv_heads=2"):
            to(gqa)
    wide = layer(n_heads=2, d_head=5)  # n_heads * d_head = 10 != d_model = 14: fine in BERT's layout
    with pytest.raises(ValueError, match="n_heads \\* d_head = 10"):
        hl.to_gpt2(wide)
    assert hl.from_hf_bert(hl.to_hf_bert(wide), n_heads=2).d_head == 5
    cross = layer(kdim=13, vdim=17)
    with pytest.raises(ValueError, match="kdim=13"):
        hl.to_hf_bert(cross)
    with pytest.raises(TypeError, match="attn"):
        hl.to_transformer_lens(nn.Linear(2, 2))  # type: ignore[arg-type]


def test_zero_biases_load_into_a_bias_free_layer_but_others_do_not() -> None:
    no_bias = layer(bias=False)
    sd = hl.to_hf_bert(no_bias)  # BERT always has biases: zeros are written
    assert not sd["self.query.bias"].any()
    target = MultiHeadAttention(D, H, bias=False)
    hl.load_hf_bert(target, sd)
    assert_same_params(target, no_bias)
    sd["output.dense.bias"] = torch.ones(D)
    with pytest.raises(ValueError, match="bias"):
        hl.load_hf_bert(target, sd)


@pytest.mark.parametrize(
    ("read", "key", "shape", "words"),
    [
        (hl.from_hf_bert, "self.query.weight", (D,), ["must be a 2-D", f"1-D tensor of shape [{D}]"]),
        (hl.from_hf_bert, "self.query.weight", (H, DH, D), ["2-D tensor [n_heads d_head, d_model]", "3-D"]),
        (hl.from_hf_bert, "self.query.weight", (), ["query.weight must be a 2-D", "0-D tensor of shape []"]),
        (hl.from_torch_mha, "in_proj_weight", (), ["in_proj_weight must be a 2-D tensor", "0-D"]),
        (hl.from_torch_mha, "in_proj_weight", (3 * D,), ["[3 embed_dim, embed_dim]", f"shape [{3 * D}]"]),
        (hl.from_torch_mha, "q_proj_weight", (D, D, 3), ["q_proj_weight must be a 2-D", "3-D"]),
        (hl.from_gpt2, "c_attn.weight", (), ["c_attn.weight must be a 2-D tensor", "0-D"]),
        (hl.from_gpt2, "c_attn.weight", (D, 3, D), ["[d_model, 3 d_model]", f"3-D tensor of shape [{D}, 3,"]),
    ],
)
def test_weights_of_the_wrong_rank_are_named_with_the_expected_shape(read, key, shape, words) -> None:
    with pytest.raises(hl.LayoutError) as err:
        read({key: torch.zeros(shape)}, n_heads=H)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_transformer_lens_k_of_the_wrong_rank_is_named() -> None:
    sd = hl.to_transformer_lens(layer())
    with pytest.raises(
        hl.LayoutError, match=r"W_K must be a 3-D tensor \[n_kv_heads, kdim, d_head\]; got a 0-D"
    ):
        hl.from_transformer_lens({**sd, "W_K": torch.tensor(1.0)})


@pytest.mark.parametrize(
    ("to", "read", "load"),
    [
        (hl.to_torch_mha, hl.from_torch_mha, hl.load_torch_mha),
        (hl.to_hf_bert, hl.from_hf_bert, hl.load_hf_bert),
        (hl.to_gpt2, hl.from_gpt2, hl.load_gpt2),
    ],
)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_weights_are_refused_naming_the_keys(to, read, load, dtype: torch.dtype) -> None:
    sd = {k: v.to(dtype) for k, v in to(layer(), prefix="blk.").items()}
    first = next(iter(sd))
    with pytest.raises(hl.LayoutError, match=rf"weights must be floating point .*got {first} \({dtype}\)"):
        read(sd, n_heads=H, prefix="blk.")
    target = layer()
    before = target.W_Q.detach().clone()
    with pytest.raises(hl.LayoutError, match="weights must be floating point"):
        load(target, sd, prefix="blk.")  # copy_ would cast the integers silently
    assert torch.equal(target.W_Q, before)


def test_a_layer_with_qkv_biases_only_round_trips_through_every_layout() -> None:
    """Qwen2-style layers (biases on q, k, v, none on the output) export with a zero output bias."""
    from headspace import layouts

    torch.manual_seed(5)
    attn = MultiHeadAttention(12, 3, qkv_bias=True, out_bias=False)
    with torch.no_grad():
        attn.qkv_bias.normal_()
    x = torch.randn(2, 4, 12)
    sd = layouts.to_transformer_lens(attn)
    back = layouts.load_transformer_lens(MultiHeadAttention(12, 3, qkv_bias=True, out_bias=False), sd)
    torch.testing.assert_close(back(x), attn(x))
    full = layouts.from_transformer_lens(sd)  # a layer with every bias: the output bias is zero
    torch.testing.assert_close(full(x), attn(x))
    with pytest.raises(ValueError, match="no output bias"):
        sd2 = dict(sd)
        sd2["b_O"] = torch.ones(12)
        layouts.load_transformer_lens(MultiHeadAttention(12, 3, qkv_bias=True, out_bias=False), sd2)
