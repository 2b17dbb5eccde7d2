"""trace() and Trace: names, shapes, exactness, the hook_result identity, patching, the fast path."""

from __future__ import annotations

import pytest
import torch

import headspace as hs
from headspace import MultiHeadAttention, Trace
from headspace.analysis.trace import ATTN_HOOKS, BLOCK_HOOKS, attention_layers, hooked, select_hook_points

B, S, DH, H = 2, 3, 5, 7  # distinct primes: a swapped axis fails
D = H * DH  # 35


def encoder(n_kv_heads: int | None = None) -> hs.Encoder:
    cfg = hs.ModelConfig(
        arch="encoder", vocab_size=37, d_model=D, n_layers=2, n_heads=H, n_kv_heads=n_kv_heads, d_mlp=23,
        max_seq_len=16,
    )  # fmt: skip
    model = hs.Encoder(cfg).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.o_bias.normal_()
            block.attn.qkv_bias.normal_()
    return model


def decoder() -> hs.Decoder:
    cfg = hs.ModelConfig(
        arch="decoder", vocab_size=37, d_model=D, n_layers=2, n_heads=H, d_mlp=23, max_seq_len=16
    )
    return hs.Decoder(cfg).eval()


def test_names_follow_module_paths_and_shapes_use_one_vocabulary() -> None:
    model = encoder(n_kv_heads=1)  # multi-query: k/v hooks have 1 head
    tokens = torch.randint(0, 37, (B, S))
    with hs.trace(model) as t:
        model(tokens)
    expected = {f"blocks.{i}.attn.hook_{n}" for i in range(2) for n in ATTN_HOOKS}
    expected |= {f"blocks.{i}.hook_{n}" for i in range(2) for n in BLOCK_HOOKS}
    assert expected <= set(t)
    assert t["blocks.1.attn.hook_q"].shape == (B, S, H, DH)
    assert t["blocks.1.attn.hook_k"].shape == (B, S, 1, DH)
    assert t["blocks.1.attn.hook_v"].shape == (B, S, 1, DH)
    assert t["blocks.1.attn.hook_scores"].shape == (B, H, S, S)
    assert t["blocks.1.attn.hook_pattern"].shape == (B, H, S, S)
    assert t["blocks.1.attn.hook_z"].shape == (B, S, H, DH)
    assert t["blocks.1.attn.hook_result"].shape == (B, S, H, D)
    for n in BLOCK_HOOKS:
        assert t[f"blocks.0.hook_{n}"].shape == (B, S, D)
    assert t.layer_paths == ["blocks.0.attn", "blocks.1.attn"]


def test_traced_run_equals_untraced_run_encoder_with_padding() -> None:
    model = encoder()
    tokens = torch.randint(0, 37, (B, 11))
    pad = torch.ones(B, 11, dtype=torch.bool)
    pad[1, 7:] = False
    want = model(tokens, key_padding=pad)
    with hs.trace(model) as t:
        got = model(tokens, key_padding=pad)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(t["blocks.1.hook_resid_post"], want)
    assert float(t.pattern(0)[1, :, :, 7:].abs().max()) == 0.0  # padding is never attended


def test_traced_run_equals_untraced_run_decoder() -> None:
    model = decoder()
    tokens = torch.randint(0, 37, (B, 11))
    want = model(tokens)
    with hs.trace(model, "*.attn.*") as t:
        got = model(tokens)
    torch.testing.assert_close(got, want)
    assert torch.equal(t.pattern(1).triu(1), torch.zeros_like(t.pattern(1)))  # causal


def test_sum_of_head_results_plus_b_O_is_the_attention_output() -> None:
    model = encoder()
    tokens = torch.randint(0, 37, (B, 11))
    outputs: dict[int, torch.Tensor] = {}
    handles = [
        block.attn.register_forward_hook(lambda m, i, o, k=k: outputs.__setitem__(k, o))
        for k, block in enumerate(model.blocks)
    ]
    try:
        with hs.trace(model, "*hook_result") as t:
            model(tokens)
    finally:
        for h in handles:
            h.remove()
    for i, block in enumerate(model.blocks):
        total = t.result(i).sum(dim=2) + block.attn.b_O  # (B, seq, d_model)
        torch.testing.assert_close(total, outputs[i])


def test_head_result_is_z_times_its_W_O_block() -> None:
    attn = MultiHeadAttention(d_model=D, n_heads=H).eval()
    x = torch.randn(B, S, D)
    with hs.trace(attn) as t:
        attn(x)
    for h in range(H):
        torch.testing.assert_close(t.result(0, h), t.z(0, h) @ attn.W_O[h])
    assert t.layer_paths == [""] and "hook_pattern" in t


def test_only_traced_layers_leave_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    model = encoder()
    tokens = torch.randint(0, 37, (B, S))
    calls: list[int] = []
    original = MultiHeadAttention.traced_attention

    def spy(self: MultiHeadAttention, *args, **kwargs):
        calls.append(id(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(MultiHeadAttention, "traced_attention", spy)
    a0, a1 = model.blocks[0].attn, model.blocks[1].attn
    with hs.trace(model, "blocks.1.attn.hook_pattern") as t:
        assert a1.hooks_active and not a0.hooks_active
        model(tokens)
    assert calls == [id(a1)]
    assert set(t) == {"blocks.1.attn.hook_pattern"}
    calls.clear()
    with hs.trace(model, "*hook_resid_*"):  # block-level hooks only: both attention layers stay fused
        model(tokens)
    assert calls == []
    model(tokens)  # after exit, nothing is hooked anywhere
    assert calls == []
    assert not any(p.fns for p in select_hook_points(model).values())


def test_hooks_are_removed_when_the_block_raises() -> None:
    model = encoder()
    with pytest.raises(RuntimeError, match="boom"):
        with hs.trace(model, hooks={"blocks.0.attn.hook_z": lambda v, p: None}):
            raise RuntimeError("boom")
    assert not any(p.fns for p in select_hook_points(model).values())


def test_patching_replaces_values_and_the_trace_sees_the_replacement() -> None:
    attn = MultiHeadAttention(d_model=D, n_heads=H).eval()
    with torch.no_grad():
        attn.qkv_bias.normal_()
        attn.o_bias.normal_()
    x = torch.randn(B, S, D)
    eye = torch.eye(S).expand(B, H, S, S)
    with hs.trace(attn, "hook_pattern", hooks={"hook_pattern": lambda p, hp: eye}) as t:
        out = attn(x)
    torch.testing.assert_close(t["hook_pattern"], eye)
    # each query attends only to itself: z_h = v_h, out = sum_h (x W_V[h] + b_V[h]) W_O[h] + b_O
    want = torch.einsum("bsd,hde->bshe", x, attn.W_V) + attn.b_V  # (B, S, H, DH)
    want = torch.einsum("bshe,hem->bsm", want, attn.W_O) + attn.b_O
    torch.testing.assert_close(out, want)


def test_hooked_patch_of_resid_changes_the_model_output() -> None:
    model = encoder()
    tokens = torch.randint(0, 37, (B, S))
    with hooked(model, {"blocks.1.hook_resid_post": lambda v, p: torch.zeros_like(v)}):
        out = model(tokens)
    assert torch.count_nonzero(out) == 0
    assert torch.count_nonzero(model(tokens)) > 0


def test_trace_helpers_layers_heads_stack_and_gqa() -> None:
    model = encoder(n_kv_heads=1)
    tokens = torch.randint(0, 37, (B, S))
    with hs.trace(model) as t:
        model(tokens)
    assert isinstance(t, Trace) and len(t) == len(list(iter(t)))
    assert torch.equal(t["pattern", 1], t["blocks.1.attn.hook_pattern"])
    assert torch.equal(t["pattern", 1, 4], t["blocks.1.attn.hook_pattern"][:, 4])
    assert torch.equal(t.z(0, 6), t["blocks.0.attn.hook_z"][:, :, 6])
    assert torch.equal(t.head("k", 0, 6), t["blocks.0.attn.hook_k"][:, :, 0])  # all heads read kv head 0
    assert torch.equal(t.act("resid_post", 0), t["blocks.0.hook_resid_post"])
    assert torch.equal(t.act("hook_resid_pre", 1), t["blocks.1.hook_resid_pre"])
    assert t.stack("pattern").shape == (2, B, H, S, S)
    assert set(t.layer(1)) == set(ATTN_HOOKS) | set(BLOCK_HOOKS)
    assert torch.equal(t.pattern(-1), t.pattern(1))


def test_calls_count_and_last_value_wins() -> None:
    attn = MultiHeadAttention(d_model=D, n_heads=H)
    x1, x2 = torch.randn(B, S, D), torch.randn(B, 11, D)
    with hs.trace(attn, "hook_pattern") as t:
        attn(x1)
        attn(x2)
    assert t.calls["hook_pattern"] == 2
    assert t["hook_pattern"].shape == (B, H, 11, 11)


def test_detach_false_keeps_the_graph() -> None:
    attn = MultiHeadAttention(d_model=D, n_heads=H)
    x = torch.randn(B, S, D)
    with hs.trace(attn, "hook_z") as t:
        attn(x)
    assert not t["hook_z"].requires_grad
    with hs.trace(attn, "hook_z", detach=False) as t:
        attn(x)
    t["hook_z"].sum().backward()
    assert attn.qkv_weight.grad is not None and attn.qkv_weight.grad.abs().sum() > 0


def test_name_filters_globs_lists_and_predicates() -> None:
    model = encoder()
    assert set(select_hook_points(model, "blocks.0.attn.hook_q")) == {"blocks.0.attn.hook_q"}
    assert set(select_hook_points(model, "*.hook_pattern")) == {
        "blocks.0.attn.hook_pattern",
        "blocks.1.attn.hook_pattern",
    }
    assert len(select_hook_points(model, ["blocks.1.*"])) > 10
    assert set(select_hook_points(model, lambda n: n.endswith("hook_embed"))) == {"hook_embed"}
    # a bare hook name means that hook point in every layer
    assert set(select_hook_points(model, "hook_z")) == {"blocks.0.attn.hook_z", "blocks.1.attn.hook_z"}
    assert set(select_hook_points(model, "attn.hook_q")) == {"blocks.0.attn.hook_q", "blocks.1.attn.hook_q"}


def test_hooks_that_return_another_dtype_or_device_are_refused() -> None:
    # the replacement would otherwise fail deep inside torch, or (meta) compute from uninitialised memory
    attn = MultiHeadAttention(D, H).eval()
    x = torch.randn(B, S, D)
    for change, words in (
        (lambda v: v.double(), "torch.float64 on cpu"),
        (lambda v: v.to("meta"), "on meta"),
    ):
        with hooked(attn, {"hook_pattern": lambda v, hp, change=change: change(v)}):
            with pytest.raises(
                ValueError,
                match=rf"must return a tensor of the value's dtype torch.float32 on cpu; got .*{words}",
            ):
                attn(x, need_weights=True)
    with pytest.raises(TypeError, match=r"names must be None, a hook name or glob.*got int 123"):
        select_hook_points(attn, 123)


def test_bad_names_and_keys_say_what_is_valid() -> None:
    model = encoder()
    with pytest.raises(
        ValueError, match=r"names: 'blocks.0.attn.hook_patern' matches no hook point.*hook_pattern"
    ):
        with hs.trace(model, "blocks.0.attn.hook_patern"):
            pass
    with pytest.raises(TypeError, match="names must hold strings"):
        with hs.trace(model, [3]):
            pass
    with pytest.raises(TypeError, match="detach must be a bool"):
        with hs.trace(model, detach="yes"):
            pass
    with pytest.raises(TypeError, match=r"hooks\['hook_embed'\] must be callable"):
        with hs.trace(model, hooks={"hook_embed": 3}):
            pass
    with pytest.raises(TypeError, match=r"nn\.Module"):
        with hs.trace("minilm"):
            pass
    with hs.trace(model, "*hook_pattern") as t:
        model(torch.randint(0, 37, (B, S)))
    with pytest.raises(KeyError, match="was not recorded"):
        t["blocks.0.attn.hook_q"]
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\) for this model; got 2"):
        t.pattern(2)
    with pytest.raises(ValueError, match=r"head must be an int in \[0, 7\) for layer 0; got 7"):
        t.pattern(0, 7)
    with pytest.raises(ValueError, match="name must be one of"):
        t.act("attn", 0)
    with pytest.raises(ValueError, match="per-head attention hook"):
        t.head("resid_post", 0, 1)


def test_hook_replacement_of_wrong_shape_is_refused() -> None:
    attn = MultiHeadAttention(d_model=D, n_heads=H)
    with pytest.raises(ValueError, match=r"hook_z must return None or a tensor of shape \[2, 3, 7, 5\]"):
        with hooked(attn, {"hook_z": lambda v, p: v[:, :, :2]}):
            attn(torch.randn(B, S, D))


def test_stack_refuses_layers_of_different_shapes_after_pruning() -> None:
    model = encoder()
    hs.prune_heads(model, {0: [1]})
    with hs.trace(model, "*hook_pattern") as t:
        model(torch.randint(0, 37, (B, S)))
    assert t.pattern(0).shape == (B, H - 1, S, S)
    with pytest.raises(ValueError, match="shapes differ"):
        t.stack("pattern")


def test_attention_layers_in_module_order() -> None:
    model = encoder()
    assert [p for p, _ in attention_layers(model)] == ["blocks.0.attn", "blocks.1.attn"]
    assert attention_layers(model.blocks[1].attn)[0][1] is model.blocks[1].attn


def test_patched_forward_is_differentiable_float64_gradcheck() -> None:
    attn = MultiHeadAttention(d_model=10, n_heads=2, dtype=torch.float64)
    scale = torch.tensor([2.0, -0.5], dtype=torch.float64)[:, None]  # (n_heads, 1)

    def patch(z: torch.Tensor, point: object) -> torch.Tensor:  # z: (batch, seq, n_heads, d_head)
        return z * scale

    x = torch.randn(2, 3, 10, dtype=torch.float64, requires_grad=True)
    with hs.trace(attn, "hook_result") as plain:
        attn(x)
    with hs.trace(attn, "hook_result", hooks={"hook_z": patch}, detach=False):
        patched = attn(x)
        assert torch.autograd.gradcheck(lambda u: attn(u), (x,))
    want = (plain["hook_result"] * scale).sum(dim=2) + attn.b_O  # each head's result scaled
    torch.testing.assert_close(patched, want)
