"""trace() in bounded memory: scores, pattern and result recomputed on access, bit for bit.

The reference is the same trace with ``detach=False``: there every value is stored as the layer
computed it (the old path, nothing deferred). The deferred values must equal it exactly, and the pattern
must equal softmax(q k^T * scale + mask) computed by hand from the recorded rotated q and k.
"""

from __future__ import annotations

import math

import pytest
import torch

import headspace as hs
import headspace.attention.functional as fn
from headspace import MultiHeadAttention
from headspace.nn.hooks import deferred_tensors
from headspace.nn.masks import CanonicalMask
from headspace.nn.positions import Rotary

B, S, DH, H, HKV = 2, 13, 5, 7, 1  # distinct primes
D = H * DH  # 35
DEFERRED = ("hook_scores", "hook_pattern", "hook_result")
MLP = ("mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post")  # deferred where larger than the weights
MID = "hook_resid_mid"  # deferred as resid_pre + attn_out where the block adds them (not post-LN)
# what a fully recorded block stores where that is smaller (every other value recomputed from them)
# hook_resid_final is the last block's hook_resid_post, the same tensor (kept once)
KEPT = ("hook_embed", "hook_resid_pre", "attn.hook_z", "hook_resid_post", "hook_resid_final")


def bert_like() -> hs.Encoder:
    cfg = hs.ModelConfig(
        arch="encoder", vocab_size=37, d_model=D, n_layers=2, n_heads=H, d_mlp=23, max_seq_len=32,
    )  # fmt: skip
    model = hs.Encoder(cfg).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv_bias.normal_()
            block.attn.o_bias.normal_()
    return model


def gpt2_like() -> hs.Decoder:
    cfg = hs.ModelConfig(
        arch="decoder", vocab_size=37, d_model=D, n_layers=2, n_heads=H, d_mlp=23, max_seq_len=200
    )
    return hs.Decoder(cfg).eval()


def smollm2_like() -> hs.Decoder:
    cfg = hs.ModelConfig(
        arch="decoder", vocab_size=37, d_model=D, n_layers=2, n_heads=H, n_kv_heads=HKV, d_head=6,
        d_mlp=23, max_seq_len=200, positions="rotary", rope_theta=100.0, norm_kind="rmsnorm",
        mlp_kind="gated", act="silu", bias=False,
    )  # fmt: skip
    return hs.Decoder(cfg).eval()


def assert_traces_equal(lazy: hs.Trace, eager: hs.Trace, *, mid: bool = True, chained: bool = False) -> None:
    """Every value of ``lazy`` equals ``eager``'s bit for bit; the attention's big three, the MLP's hook
    points and (``mid``) hook_resid_mid were deferred, or (``chained``: fully recorded blocks on inputs
    long enough) everything but the blocks' inputs, outputs and z."""
    assert set(lazy) == set(eager)
    deferred = DEFERRED + ((MID,) if mid else ())
    for name in eager:
        assert torch.equal(lazy[name], eager[name].detach()), name
        if chained:
            assert lazy.is_deferred(name) != name.endswith(KEPT), name
        elif not name.endswith(MLP):  # (those depend on the input's length: tested on their own)
            assert lazy.is_deferred(name) == name.endswith(deferred), name
    for layer in range(lazy.n_layers):
        n = lazy._layers[layer].n_heads
        for short in ("scores", "pattern", "result"):
            for h in range(n):  # one head computed alone equals its slice of the whole
                assert torch.equal(lazy.head(short, layer, h), eager.head(short, layer, h).detach())


def run_both(
    model: torch.nn.Module, *args: object, **kwargs: object
) -> tuple[hs.Trace, hs.Trace, torch.Tensor]:
    with torch.no_grad():
        with hs.trace(model) as lazy:
            out_lazy = model(*args, **kwargs)
        with hs.trace(model, detach=False) as eager:
            out_eager = model(*args, **kwargs)
    assert torch.equal(out_lazy, out_eager)  # the forward is unchanged, bit for bit
    return lazy, eager, out_lazy


def by_hand_pattern(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d_head) masked) from hook values q [b, s, H, dh], k [b, s, Hkv, dh]."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)  # (b, s, H, dh)
    scores = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) / math.sqrt(q.shape[-1])  # (b, H, s, s)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0)  # (b, H, s, s)


def test_encoder_with_key_padding_bitwise_and_by_hand() -> None:
    model = bert_like()
    tokens = torch.randint(0, 37, (B, S))
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[1, 9:] = False
    lazy, eager, _ = run_both(model, tokens, key_padding=pad)
    assert_traces_equal(lazy, eager, chained=True)  # 26 rows: the blocks keep their input and z
    with torch.no_grad(), hs.trace(model) as short:  # 13 rows: the copies of the weights would outweigh
        model(tokens[:1], key_padding=pad[:1])
    assert short.is_deferred("blocks.0.attn.hook_pattern") and not short.is_deferred("blocks.0.attn.hook_q")
    assert not short.is_deferred(f"blocks.0.{MID}")  # post-LN: resid_mid = LN1(x + a) is stored
    allowed = pad[:, None, None, :]  # (B, 1, 1, S)
    want = by_hand_pattern(lazy["blocks.1.attn.hook_q"], lazy["blocks.1.attn.hook_k"], allowed)
    torch.testing.assert_close(lazy.pattern(1).double(), want)


def test_gpt2_like_causal_bitwise() -> None:
    model = gpt2_like()
    lazy, eager, _ = run_both(model, torch.randint(0, 37, (B, S)))
    assert_traces_equal(lazy, eager, chained=True)
    assert torch.equal(lazy.pattern(0).triu(1), torch.zeros(B, H, S, S))
    lazy, eager, _ = run_both(model, torch.randint(0, 37, (1, S)))  # 13 rows: each part defers its own
    assert_traces_equal(lazy, eager)


def test_smollm2_like_rotary_gqa_bitwise_and_by_hand() -> None:
    model = smollm2_like()
    tokens = torch.randint(0, 37, (B, S))
    lazy, eager, _ = run_both(model, tokens)
    assert_traces_equal(lazy, eager, chained=True)
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    want = by_hand_pattern(lazy["blocks.0.attn.hook_rot_q"], lazy["blocks.0.attn.hook_rot_k"], causal)
    torch.testing.assert_close(lazy.pattern(0).double(), want)
    # a fully recorded block: the deferred pattern holds no q or k, only the block's input (and copies)
    d = lazy._values["blocks.0.attn.hook_pattern"]
    held = {t.untyped_storage().data_ptr() for t in deferred_tensors(d) if tuple(t.shape[:2]) == (B, S)}
    assert held == {lazy["blocks.0.hook_resid_pre"].untyped_storage().data_ptr()}
    # recording only some hook points: the pattern holds the rotated q and k the trace records anyway
    with torch.no_grad(), hs.trace(model, ["*.hook_rot_q", "*.hook_rot_k", "*.hook_pattern"]) as part:
        model(tokens)
    d = part._values["blocks.0.attn.hook_pattern"]
    assert d.q.untyped_storage().data_ptr() == part["blocks.0.attn.hook_rot_q"].untyped_storage().data_ptr()
    assert torch.equal(part.pattern(0), eager.pattern(0))


def test_bare_layer_float_mask_dead_rows_cross_attention_and_need_weights() -> None:
    attn = MultiHeadAttention(D, H, n_kv_heads=HKV, kdim=11, vdim=17).eval()
    x, c, v = torch.randn(B, S, D), torch.randn(B, 3, 11), torch.randn(B, 3, 17)
    mask = torch.randn(B, H, S, 3)
    mask[0, 2, 4] = float("-inf")  # a dead row: all zero in the pattern
    lazy, eager, _ = run_both(attn, x, c, v, attn_mask=mask)
    assert_traces_equal(lazy, eager)
    assert float(lazy.pattern(0, 2)[0, 4].abs().sum()) == 0.0
    with torch.no_grad(), hs.trace(attn) as t:  # need_weights: the layer computes the pattern anyway
        _, weights = attn(x, c, v, attn_mask=mask, need_weights=True)
    assert not t.is_deferred("hook_pattern") and torch.equal(t["hook_pattern"], weights)


@pytest.mark.parametrize("rotary", [False, True])
def test_query_blocks_equal_the_whole_layer(monkeypatch: pytest.MonkeyPatch, rotary: bool) -> None:
    """Long inputs: z a block of 64 queries at a time. At d_head 64 (GPT-2's, SmolLM2's) the forward is
    the whole-layer one bit for bit; the deferred scores and patterns are bit for bit at any d_head."""
    extra = dict(positions="rotary", norm_kind="rmsnorm", n_kv_heads=1) if rotary else {}
    cfg = hs.ModelConfig(
        arch="decoder", vocab_size=37, d_model=3 * 64, n_layers=2, n_heads=3, d_mlp=23, max_seq_len=256,
        **extra,
    )  # fmt: skip
    model = hs.Decoder(cfg).eval()
    tokens = torch.randint(0, 37, (1, 229))
    with torch.no_grad(), hs.trace(model, detach=False) as eager:
        want = model(tokens)
    monkeypatch.setattr(fn, "TRACED_BLOCK_BYTES", 1)  # every layer in blocks of TRACED_MIN_ROWS rows
    calls: list[int] = []
    original = fn.mask_rows
    monkeypatch.setattr(fn, "mask_rows", lambda *a: calls.append(a[3]) or original(*a))
    with torch.no_grad(), hs.trace(model) as lazy:
        got = model(tokens)
    assert calls[:3] == [0, 64, 128] and calls[3] == 0  # the blocks did run (rows 128-228: one block)
    assert torch.equal(got, want)
    assert_traces_equal(lazy, eager, chained=True)


def test_a_short_last_query_block_joins_the_one_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """193 queries in blocks of 64 would leave a block of one row, a matrix-vector product that rounds
    otherwise than the whole layer's GEMM; it joins the block before, and z stays bit for bit."""
    assert fn.row_blocks(1, 193, 193, 4) == [(0, 193)]
    monkeypatch.setattr(fn, "TRACED_BLOCK_BYTES", 1)
    assert fn.row_blocks(1, 193, 193, 4) == [(0, 64), (64, 128), (128, 193)]
    assert fn.row_blocks(1, 192, 192, 4) == [(0, 64), (64, 128), (128, 192)]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 3, 193, 64, generator=gen) for _ in range(3))
    for mask in (CanonicalMask(None, True, None), CanonicalMask(None, False, None)):
        want, pattern, _ = fn.reference_parts(q, k, v, mask, scale=0.125)
        assert torch.equal(fn.reference_rows(q, k, v, mask, scale=0.125), want)
        assert torch.equal(fn.attention_rows(q, k, mask, scale=0.125, which="pattern"), pattern)


def test_query_blocks_at_a_tiny_d_head_agree_to_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    model = gpt2_like()  # d_head 5: the GEMM of a block's weighted sum may round otherwise
    tokens = torch.randint(0, 37, (1, 197))
    with torch.no_grad(), hs.trace(model, detach=False) as eager:
        want = model(tokens)
    monkeypatch.setattr(fn, "TRACED_BLOCK_BYTES", 1)
    with torch.no_grad(), hs.trace(model) as lazy:
        got = model(tokens)
    torch.testing.assert_close(got, want)
    assert torch.equal(lazy.pattern(0), eager.pattern(0))  # layer 0's inputs are the same: exact


def test_replacing_hooks_and_detach_false_store_values_as_computed() -> None:
    model = smollm2_like()
    tokens = torch.randint(0, 37, (1, S))

    def uniform(p: torch.Tensor, point: object) -> torch.Tensor:
        return torch.full_like(p, 1.0 / p.shape[-1])

    with torch.no_grad(), hs.trace(model, hooks={"blocks.0.attn.hook_pattern": uniform}) as t:
        model(tokens)
    assert not t.is_deferred("blocks.0.attn.hook_pattern") and t.is_deferred("blocks.1.attn.hook_pattern")
    assert torch.equal(t.pattern(0), torch.full((1, H, S, S), 1.0 / S))
    x = torch.randn(1, S, D, requires_grad=True)
    with hs.trace(model.blocks[0].attn, detach=False) as t:
        model.blocks[0].attn(x, is_causal=True)
    t["hook_pattern"].sum().backward()  # part of the forward's graph, as before
    assert x.grad is not None and not t.is_deferred("hook_pattern")


def test_values_survive_weight_edits_and_memory_is_smaller() -> None:
    model = smollm2_like()
    tokens = torch.randint(0, 37, (B, S))
    lazy, eager, _ = run_both(model, tokens)
    before = lazy.result(1).clone()
    with torch.no_grad():
        model.blocks[1].attn.o_weight.zero_()  # the trace keeps its own copy of W_O
    assert torch.equal(lazy.result(1), before)
    assert lazy.stored_bytes() < 0.6 * eager.stored_bytes()


@pytest.mark.slow
def test_smollm2_deferred_trace_equals_stored_trace(smollm2) -> None:
    ids, _ = smollm2.tokenize_padded(["The cat sat on the mat because the cat was tired."])
    names = ["blocks.0.*", "blocks.17.attn.*", "blocks.29.*"]
    with torch.no_grad():
        with hs.trace(smollm2.model, names) as lazy:
            got = smollm2.model(ids)
        with hs.trace(smollm2.model, names, detach=False) as eager:
            want = smollm2.model(ids)
    assert torch.equal(got, want)
    for name in eager:
        assert torch.equal(lazy[name], eager[name]), name
    assert lazy.is_deferred("blocks.17.attn.hook_pattern")
    assert torch.equal(lazy.pattern(17, 5), eager.pattern(17, 5))


def test_mlp_and_resid_mid_survive_weight_edits_and_replacing_hooks_store() -> None:
    model = smollm2_like()
    tokens = torch.randint(0, 37, (B, 64))  # 128 rows: the MLP's values outweigh a copy of its weights
    lazy, eager, _ = run_both(model, tokens)
    assert_traces_equal(lazy, eager, chained=True)
    assert all(lazy.is_deferred(n) for n in lazy if n.endswith(MLP))
    names = [
        "blocks.1.mlp.hook_pre",
        "blocks.1.mlp.hook_pre_linear",
        "blocks.1.mlp.hook_post",
        f"blocks.1.{MID}",
    ]
    before = {n: lazy[n].clone() for n in names}
    with torch.no_grad():
        for p in model.blocks[1].mlp.parameters():
            p.mul_(2.0)  # the deferred MLP values keep copies of the input linears
    for n in names:
        assert torch.equal(lazy[n], before[n]) and torch.equal(before[n], eager[n]), n
    # the three MLP hook points share one input and one copy of the weights
    shared = {id(vars(lazy._values[n])["x"]) for n in names[:3]}
    assert len(shared) == 1

    def double(v: torch.Tensor, point: object) -> torch.Tensor:
        return v * 2

    with torch.no_grad(), hs.trace(model, hooks={"blocks.0.mlp.hook_pre": double}) as t:
        out = model(tokens)
    assert not t.is_deferred("blocks.0.mlp.hook_pre") and t.is_deferred("blocks.1.mlp.hook_pre")
    with torch.no_grad(), hs.trace(model, hooks={"blocks.0.mlp.hook_pre": double}, detach=False) as e:
        want = model(tokens)
    assert torch.equal(out, want)  # the replacement still reaches the forward
    for name in e:
        assert torch.equal(t[name], e[name]), name


@pytest.mark.slow
def test_smollm2_every_hook_point_equals_the_stored_trace(smollm2) -> None:
    ids, _ = smollm2.tokenize_padded(["The cat sat on the mat because the cat was tired."])
    with torch.no_grad():
        with hs.trace(smollm2.model) as lazy:
            got = smollm2.model(ids)
        with hs.trace(smollm2.model, detach=False) as eager:
            want = smollm2.model(ids)
    assert torch.equal(got, want)
    assert set(lazy) == set(eager)
    for name in eager:
        assert torch.equal(lazy[name], eager[name]), name
    # 13 tokens: the MLP's values are smaller than a copy of its weights, so they are stored
    assert not lazy.is_deferred("blocks.29.mlp.hook_post") and lazy.is_deferred(f"blocks.3.{MID}")


@pytest.mark.slow
def test_smollm2_long_input_mlp_deferred_bitwise(smollm2) -> None:
    ids = torch.randint(0, smollm2.config.vocab_size, (1, 480), generator=torch.Generator().manual_seed(0))
    names = ["blocks.0.*", "blocks.29.*"]
    with torch.no_grad():
        with hs.trace(smollm2.model, names) as lazy:
            got = smollm2.model(ids)
        with hs.trace(smollm2.model, names, detach=False) as eager:
            want = smollm2.model(ids)
    assert torch.equal(got, want)
    for name in eager:
        assert torch.equal(lazy[name], eager[name]), name
    for layer in (0, 29):  # 480 rows: the MLP's values outweigh a copy of its weights
        assert all(lazy.is_deferred(f"blocks.{layer}.{n}") for n in (*MLP, MID))
    assert lazy.stored_bytes() < 0.6 * eager.stored_bytes()


@pytest.mark.parametrize("norm", ["pre", "post", "sandwich", "post_sublayer"])
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm_rotary_qk_head", "rmsnorm_qk_all"])
def test_a_fully_recorded_block_keeps_its_input_z_and_copies(norm: str, kind: str) -> None:
    """Every hook point of a block recorded, on an input long enough: the trace holds the block's input,
    z, its output and one copy of each weight it needs, nothing else; every value (and every head of
    every per-head value) is the stored trace's bit for bit, before and after the weights change."""
    extra: dict = {"norm_kind": "layernorm", "mlp_kind": "plain", "act": "gelu", "bias": True}
    if kind != "layernorm":
        extra = {"norm_kind": "rmsnorm", "mlp_kind": "gated", "act": "silu", "bias": False}
        extra["qk_norm"] = "head" if "head" in kind else "all"
        extra["rotary"] = Rotary(6, base=100.0) if "rotary" in kind else None
    block = hs.TransformerBlock(D, H, 23, d_head=6, n_kv_heads=HKV, norm=norm, **extra).eval()
    with torch.no_grad():
        for p in block.parameters():  # biases and norm weights away from 0 and 1
            p.add_(torch.randn_like(p) * 0.1)
    x = torch.randn(B, 40, D)
    lazy, eager, _ = run_both(block, x, is_causal=True)
    assert_traces_equal(lazy, eager, chained=True)
    for short in ("q", "k", "v", "z", "scores", "pattern", "result"):
        for h in range(H):
            assert torch.equal(lazy.head(short, 0, h), eager.head(short, 0, h).detach()), (short, h)
    weights = sum(p.numel() for name, p in block.named_parameters() if not (norm == "post" and "ln2" in name))
    tables = 2 * 40 * 6 if kind == "rmsnorm_rotary_qk_head" else 0  # the rotary cos and sin [1, 1, 40, 6]
    values = 2 * x.numel() + B * 40 * H * 6  # input and output [B, 40, D], z [B, 40, H, 6]
    assert lazy.stored_bytes() == 4 * (values + weights + tables)  # (post-LN's last LN2 is the output's)
    before = {name: lazy[name].clone() for name in lazy}
    with torch.no_grad():
        for p in block.parameters():
            p.mul_(1.5)
    for name in lazy:
        assert torch.equal(lazy[name], before[name]), name


def test_the_value_read_last_is_let_go_before_the_next_is_computed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading every layer's pattern holds one pattern at a time, not the last one and the next."""
    import weakref

    model = gpt2_like()
    with torch.no_grad(), hs.trace(model, "*.hook_pattern") as t:
        model(torch.randint(0, 37, (1, S)))
    first = weakref.ref(t.pattern(0))
    original = fn.DeferredAttention.evaluate
    alive: list[bool] = []

    def evaluate(self: fn.DeferredAttention, memo: dict, head: int | None = None) -> torch.Tensor:
        alive.append(first() is not None)
        return original(self, memo, head)

    monkeypatch.setattr(fn.DeferredAttention, "evaluate", evaluate)
    assert torch.equal(t.pattern(0), t.pattern(0))  # the value read last is kept (no second computation)
    t.pattern(1)
    assert alive == [False]


def test_a_fully_recorded_gemma_like_block_with_a_window_and_offset_norms() -> None:
    """Sandwich norms scaling by 1 + weight, QK-norm, a sliding window, a score scale of its own: still
    the stored trace bit for bit, every value but the input, z and the output recomputed."""
    block = hs.TransformerBlock(
        D, H, 23, d_head=6, n_kv_heads=HKV, norm="sandwich", norm_kind="rmsnorm", mlp_kind="gated",
        act="gelu_tanh", bias=False, qk_norm="head", rotary=Rotary(6, base=100.0), window=5, scale=0.3,
        norm_offset=1.0,
    ).eval()  # fmt: skip
    with torch.no_grad():
        for p in block.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    lazy, eager, _ = run_both(block, torch.randn(B, 40, D), is_causal=True)
    assert_traces_equal(lazy, eager, chained=True)
    assert float(lazy.pattern(0)[0, 0, 20, :15].abs().sum()) == 0.0  # outside the window
