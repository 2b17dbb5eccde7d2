"""TransformerBlock: equals torch.nn.TransformerEncoderLayer (pre-/post-LN); hook points, cache, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from headspace.model.block import FeedForward, TransformerBlock

B, S, H, DH, DM = 2, 3, 7, 5, 11  # batch, seq, n_heads, d_head, d_mlp: distinct primes
D = H * DH  # d_model = 35


def reference_layer(block: TransformerBlock, act: str) -> nn.TransformerEncoderLayer:
    """torch's own encoder layer carrying the block's weights."""
    activation = {"gelu": "gelu", "relu": "relu", "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}[act]
    ref = nn.TransformerEncoderLayer(
        block.d_model,
        block.attn.n_heads,
        block.mlp.fc_in.out_features,
        dropout=0.0,
        activation=activation,
        layer_norm_eps=block.ln1.eps,
        batch_first=True,
        norm_first=block.norm == "pre",
        dtype=block.ln1.weight.dtype,
    )
    with torch.no_grad():
        ref.self_attn.in_proj_weight.copy_(block.attn.qkv_weight)
        ref.self_attn.in_proj_bias.copy_(block.attn.qkv_bias)
        ref.self_attn.out_proj.weight.copy_(block.attn.o_weight)
        ref.self_attn.out_proj.bias.copy_(block.attn.o_bias)
        for mine, theirs in ((block.mlp.fc_in, ref.linear1), (block.mlp.fc_out, ref.linear2)):
            theirs.weight.copy_(mine.weight)
            theirs.bias.copy_(mine.bias)
        for mine, theirs in ((block.ln1, ref.norm1), (block.ln2, ref.norm2)):
            theirs.weight.copy_(mine.weight)
            theirs.bias.copy_(mine.bias)
    return ref.eval()


def randomize_(module: nn.Module) -> None:
    """Random values everywhere (LayerNorm gains and biases too, so a swapped norm shows)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(
                torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 and p.shape[0] == module.d_model else 0.0)
            )


@pytest.mark.parametrize("norm", ["post", "pre"])
@pytest.mark.parametrize("act", ["gelu", "relu", "gelu_tanh"])
def test_block_equals_torch_encoder_layer(norm: str, act: str) -> None:
    block = TransformerBlock(D, H, DM, act=act, norm=norm).eval()
    randomize_(block)
    ref = reference_layer(block, act)
    x = torch.randn(B, S, D)
    key_padding = torch.tensor([[True, True, True], [True, True, False]])
    with torch.no_grad():
        out = block(x, key_padding=key_padding)
        expected = ref(x, src_key_padding_mask=~key_padding)  # torch: True = padding
    assert out.shape == (B, S, D)
    # torch's layer returns zeros at padded positions on its fused path; compare the real ones
    torch.testing.assert_close(out[key_padding], expected[key_padding])
    causal = torch.triu(torch.full((S, S), float("-inf")), diagonal=1)
    with torch.no_grad():
        torch.testing.assert_close(block(x, is_causal=True), ref(x, src_mask=causal, is_causal=True))


def test_block_gradients_equal_torch_encoder_layer() -> None:
    # float64: the same maths must give the same gradients to float64 precision (in float32 the two
    # summation orders differ by up to ~1e-4 relative on these O(10) gradients)
    block = TransformerBlock(D, H, DM, norm="pre", act="gelu").double()
    randomize_(block)
    ref = reference_layer(block, "gelu").train()
    x = torch.randn(B, S, D, dtype=torch.float64)
    w = torch.randn(B, S, D, dtype=torch.float64)
    (block(x) * w).sum().backward()
    (ref(x) * w).sum().backward()
    torch.testing.assert_close(block.attn.qkv_weight.grad, ref.self_attn.in_proj_weight.grad)
    torch.testing.assert_close(block.mlp.fc_in.weight.grad, ref.linear1.weight.grad)
    torch.testing.assert_close(block.ln2.weight.grad, ref.norm2.weight.grad)


@settings(max_examples=15, deadline=None)
@given(
    batch=st.integers(1, 3),
    seq=st.integers(1, 6),
    n_heads=st.sampled_from([1, 2, 3]),
    d_head=st.sampled_from([2, 5]),
    d_mlp=st.integers(1, 13),
    norm=st.sampled_from(["pre", "post"]),
)
def test_block_matches_reference_over_shapes(
    batch: int, seq: int, n_heads: int, d_head: int, d_mlp: int, norm: str
) -> None:
    torch.manual_seed(batch * 1000 + seq * 100 + n_heads * 10 + d_head)
    block = TransformerBlock(n_heads * d_head, n_heads, d_mlp, norm=norm, act="relu").eval()
    randomize_(block)
    ref = reference_layer(block, "relu")
    x = torch.randn(batch, seq, n_heads * d_head)
    with torch.no_grad():
        torch.testing.assert_close(block(x), ref(x))


def test_formulas_written_out() -> None:
    """pre-LN: h = x + Attn(LN1 x), out = h + MLP(LN2 h).
    post-LN: h = LN1(x + Attn x), out = LN2(h + MLP h).
    """
    x = torch.randn(B, S, D)
    for norm in ("pre", "post"):
        block = TransformerBlock(D, H, DM, norm=norm, act="relu").eval()
        randomize_(block)

        def mlp(t: torch.Tensor, blk: TransformerBlock = block) -> torch.Tensor:
            return F.relu(t @ blk.mlp.fc_in.weight.T + blk.mlp.fc_in.bias) @ blk.mlp.fc_out.weight.T + (
                blk.mlp.fc_out.bias
            )

        with torch.no_grad():
            if norm == "pre":
                h = x + block.attn(block.ln1(x))
                expected = h + mlp(block.ln2(h))
            else:
                h = block.ln1(x + block.attn(x))
                expected = block.ln2(h + mlp(h))
            torch.testing.assert_close(block(x), expected)


def test_gradcheck_float64() -> None:
    for norm in ("pre", "post"):
        block = TransformerBlock(6, 2, 5, d_head=3, norm=norm, act="gelu").double()
        x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
        pad = torch.tensor([[True, True, False], [True, True, True]])
        assert torch.autograd.gradcheck(lambda t, blk=block, p=pad: blk(t, key_padding=p), (x,))


def test_hook_points_see_the_residual_stream() -> None:
    block = TransformerBlock(D, H, DM, norm="pre").eval()
    randomize_(block)
    seen: dict[str, torch.Tensor] = {}
    for name in ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post"):
        getattr(block, name).add(lambda v, hp, n=name: seen.__setitem__(n, v.clone()))
    x = torch.randn(B, S, D)
    with torch.no_grad():
        out = block(x)
    for v in seen.values():
        assert v.shape == (B, S, D)
    torch.testing.assert_close(seen["hook_resid_pre"], x)
    torch.testing.assert_close(seen["hook_resid_mid"], seen["hook_resid_pre"] + seen["hook_attn_out"])
    torch.testing.assert_close(seen["hook_resid_post"], seen["hook_resid_mid"] + seen["hook_mlp_out"])
    torch.testing.assert_close(seen["hook_resid_post"], out)


def test_hook_can_ablate_the_attention_sublayer() -> None:
    block = TransformerBlock(D, H, DM, norm="pre").eval()
    randomize_(block)
    block.hook_attn_out.add(lambda v, hp: torch.zeros_like(v))
    x = torch.randn(B, S, D)
    with torch.no_grad():
        expected = x + block.mlp(block.ln2(x))
        torch.testing.assert_close(block(x), expected)


def test_dropout_only_in_training() -> None:
    block = TransformerBlock(D, H, DM, dropout=0.5, attn_dropout=0.5)
    x = torch.randn(B, S, D)
    torch.manual_seed(1)
    a = block(x)
    torch.manual_seed(2)
    b = block(x)
    assert not torch.allclose(a, b)
    block.eval()
    torch.testing.assert_close(block(x), block(x))


def test_kv_cache_decoding_equals_full_causal_pass() -> None:
    block = TransformerBlock(D, H, DM, norm="pre").eval()
    randomize_(block)
    x = torch.randn(B, 5, D)
    with torch.no_grad():
        full = block(x, is_causal=True)
        cache = block.attn.make_kv_cache(B, 5)
        steps = [block(x[:, :2], is_causal=True, kv_cache=cache)]
        steps += [block(x[:, i : i + 1], is_causal=True, kv_cache=cache) for i in range(2, 5)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full)


def test_grouped_query_and_no_bias() -> None:
    block = TransformerBlock(D, H, DM, n_kv_heads=1, bias=False)
    assert block.attn.n_kv_heads == 1
    assert block.mlp.fc_in.bias is None
    assert block(torch.randn(B, S, D)).shape == (B, S, D)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"norm": "middle"}, ["norm", "'post'", "'middle'"]),
        ({"act": "swish"}, ["act", "gelu", "'swish'"]),
        ({"dropout": 1.0}, ["dropout", "1.0"]),
        ({"ln_eps": 0.0}, ["ln_eps", "0.0"]),
        ({"ln_eps": float("inf")}, ["ln_eps", "finite", "inf"]),
        ({"dropout": "0.1"}, ["dropout", "'0.1'"]),
        ({"attn_dropout": -0.5}, ["attn_dropout", "-0.5"]),
        ({"d_head": None, "n_heads": 4}, ["d_model=35", "n_heads=4"]),
    ],
)
def test_bad_construction_names_the_argument(kwargs: dict, words: list[str]) -> None:
    args = {"d_model": D, "n_heads": H, "d_mlp": DM, **kwargs}
    with pytest.raises(ValueError) as info:
        TransformerBlock(args.pop("d_model"), args.pop("n_heads"), args.pop("d_mlp"), **args)
    for word in words:
        assert word in str(info.value)


def test_bad_input_names_the_tensor() -> None:
    block = TransformerBlock(D, H, DM)
    with pytest.raises(TypeError, match="x must be a tensor"):
        block([[0.0] * D])
    with pytest.raises(ValueError, match="last dimension d_model=35"):
        block(torch.randn(B, S, D + 1))
    with pytest.raises(ValueError, match="d_mlp must be a positive int"):
        FeedForward(D, 0)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_bad_input_is_named_before_any_layer_norm(norm: str) -> None:
    # pre-LN runs a LayerNorm first: its own error would name neither x nor d_model
    block = TransformerBlock(D, H, DM, norm=norm).eval()
    for run in (block, lambda x: block.infer(x)):
        with pytest.raises(
            ValueError, match=r"x must have last dimension d_model=35; got shape \[2, 3, 34\]"
        ):
            run(torch.randn(B, S, D - 1))
        with pytest.raises(
            TypeError, match=r"x has dtype torch.float64 but the layer's weights are torch.float32"
        ):
            run(torch.randn(B, S, D, dtype=torch.float64))
        with pytest.raises(ValueError, match=r"x must be 3-D \[batch, seq, d_model=35\].*unsqueeze"):
            run(torch.randn(S, D))
