"""headspace.distributed in one process: the sharding arithmetic, a world of one, and input checks.

The sharding is tested here without communication: the shards of every rank, built one after the other
in this process, must add up to the whole layer (that sum is exactly what the all-reduce computes).
The real 2-process runs are in test_parallel_dist.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

from headspace import MultiHeadAttention
from headspace.distributed.data_parallel import (
    average_across_ranks,
    check_same_config,
    local_batch_slice,
    wrap_model,
)
from headspace.distributed.head_parallel import (
    DistInfo,
    HeadParallelAttention,
    HeadParallelFeedForward,
    attention_shard,
    barrier,
    feed_forward_shard,
    gather_model,
    setup_distributed,
    shard_model,
    teardown,
)
from headspace.model.block import FeedForward, TransformerBlock

SINGLE = DistInfo(rank=0, world_size=1, local_rank=0, backend=None)


# ---------------------------------------------------------------------------------------------- shard maths
@settings(max_examples=25, deadline=None)
@given(
    world=st.sampled_from([1, 2, 3]),
    kv_per_rank=st.integers(1, 2),
    group=st.integers(1, 3),
    d_head=st.integers(1, 4),
    d_model=st.integers(2, 9),
    batch=st.integers(1, 3),
    seq=st.integers(1, 5),
    bias=st.booleans(),
    causal=st.booleans(),
)
def test_attention_shards_add_up_to_the_layer(
    world: int, kv_per_rank: int, group: int, d_head: int, d_model: int, batch: int, seq: int, bias: bool,
    causal: bool,
) -> None:  # fmt: skip
    """sum_r shard_r(x) + b_O == attn(x), for outputs and gradients, over heads, GQA groups and ranks."""
    n_kv = world * kv_per_rank
    attn = MultiHeadAttention(d_model, n_kv * group, d_head=d_head, n_kv_heads=n_kv, bias=bias)
    if bias:
        with torch.no_grad():
            attn.qkv_bias.normal_()
            attn.o_bias.normal_()
    x = torch.randn(batch, seq, d_model)
    shards = [attention_shard(attn, r, world) for r in range(world)]
    x_s, x_r = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = sum(s(x_s, is_causal=causal) for s in shards)
    if bias:
        out = out + attn.o_bias
    want = attn(x_r, is_causal=causal)
    assert_close(out, want)
    probe = torch.randn_like(want)
    (out * probe).sum().backward()
    (want * probe).sum().backward()
    assert_close(x_s.grad, x_r.grad)
    per = attn.n_heads // world
    for r, s in enumerate(shards):
        assert s.n_heads == per and s.n_kv_heads == kv_per_rank and s.o_bias is None
        assert_close(s.W_Q.detach(), attn.W_Q[r * per : (r + 1) * per].detach())
        assert_close(s.W_K.detach(), attn.W_K[r * kv_per_rank : (r + 1) * kv_per_rank].detach())
        cols = slice(r * per * d_head, (r + 1) * per * d_head)
        assert_close(s.o_weight.grad, attn.o_weight.grad[:, cols])


@settings(max_examples=15, deadline=None)
@given(world=st.sampled_from([1, 2, 3]), units=st.integers(1, 4), act=st.sampled_from(["gelu", "relu"]))
def test_feed_forward_shards_add_up_to_the_layer(world: int, units: int, act: str) -> None:
    ff = FeedForward(7, world * units, act=act)
    with torch.no_grad():
        ff.fc_in.bias.normal_()
        ff.fc_out.bias.normal_()
    x = torch.randn(2, 3, 7)
    shards = [feed_forward_shard(ff, r, world) for r in range(world)]
    assert all(type(s) is FeedForward and s.fc_out.bias is None for s in shards)
    assert_close(sum(s(x) for s in shards) + ff.fc_out.bias, ff(x))


def test_shard_keeps_the_layers_settings_and_frozen_weights() -> None:
    attn = MultiHeadAttention(11, 6, d_head=3, n_kv_heads=2, dropout=0.25, scale=0.7)
    attn.qkv_weight.requires_grad_(False)
    attn.eval()
    shard = attention_shard(attn, 1, 2)
    assert (shard.n_heads, shard.n_kv_heads, shard.d_head, shard.d_model) == (3, 1, 3, 11)
    assert shard.scale == 0.7 and shard.dropout == 0.25 and not shard.training
    assert not shard.qkv_weight.requires_grad and shard.o_weight.requires_grad
    assert_close(shard.W_Q, attn.W_Q[3:6])
    assert_close(shard.W_V, attn.W_V[1:2])


# ---------------------------------------------------------------------------------------------- world of one
def test_head_parallel_attention_without_a_process_group_is_the_layer() -> None:
    attn = MultiHeadAttention(11, 6, d_head=3, n_kv_heads=2)
    with torch.no_grad():
        attn.o_bias.normal_()
    par = HeadParallelAttention.from_module(attn)
    assert (par.rank, par.world_size, par.head_slice) == (0, 1, slice(0, 6))
    x = torch.randn(2, 5, 11)
    out, pattern = par(x, is_causal=True, need_weights=True)
    want, want_pattern = attn(x, is_causal=True, need_weights=True)
    assert_close(out, want)
    assert_close(pattern, want_pattern)
    full = par.gather()
    assert type(full) is MultiHeadAttention
    for name, p in attn.named_parameters():
        assert torch.equal(dict(full.named_parameters())[name], p)
    assert full.qkv_weight.data_ptr() != attn.qkv_weight.data_ptr()  # a copy, not the shard's storage


def test_shard_model_and_gather_model_without_a_process_group() -> None:
    block = TransformerBlock(12, 4, 10, n_kv_heads=2, norm="pre")
    ref = TransformerBlock(12, 4, 10, n_kv_heads=2, norm="pre")
    ref.load_state_dict(block.state_dict())
    assert shard_model(block) is block
    assert isinstance(block.attn, HeadParallelAttention) and isinstance(block.mlp, HeadParallelFeedForward)
    x = torch.randn(2, 3, 12)
    assert_close(block(x, is_causal=True), ref(x, is_causal=True))
    full = gather_model(block)
    assert type(full.attn) is MultiHeadAttention and type(full.mlp) is FeedForward
    assert set(full.state_dict()) == set(ref.state_dict())
    for name, t in ref.state_dict().items():
        assert torch.equal(full.state_dict()[name], t), name
    assert type(gather_model(block.attn)) is MultiHeadAttention


def test_setup_distributed_without_torchrun_is_a_world_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    info = setup_distributed("cpu")
    assert info == SINGLE and info.is_main and not info.enabled
    model = nn.Linear(2, 3)
    assert wrap_model(model, info) is model
    assert average_across_ranks(torch.tensor(2.5), info) == 2.5
    check_same_config({"lr": 0.1}, info)
    barrier(info)
    teardown(info)


def test_local_batch_slices_tile_the_global_batch() -> None:
    for world in (1, 2, 3, 6):
        rows = []
        for rank in range(world):
            s = local_batch_slice(12, DistInfo(rank, world, rank, "gloo"))
            rows += list(range(12))[s]
        assert rows == list(range(12))
    assert DistInfo(1, 2, 1, "gloo").enabled and not DistInfo(1, 2, 1, "gloo").is_main


# ---------------------------------------------------------------------------------------------- bad input
def test_setup_distributed_rejects_bad_arguments_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"device must be 'cpu' or 'cuda'.*'tpu'"):
        setup_distributed("tpu")
    with pytest.raises(ValueError, match="timeout_s must be a positive"):
        setup_distributed("cpu", timeout_s=0)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE must be an integer; got 'two'"):
        setup_distributed("cpu")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="RANK is not set"):
        setup_distributed("cpu")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match=r"RANK must be in \[0, WORLD_SIZE=2\); got RANK=2"):
        setup_distributed("cpu")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR is not set"):
        setup_distributed("cpu")


def test_helpers_reject_wrong_types() -> None:
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module; got str"):
        wrap_model("model", SINGLE)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="info must be a DistInfo"):
        wrap_model(nn.Linear(1, 1), {"rank": 0})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config_dict must be a dict; got list"):
        check_same_config([1, 2], SINGLE)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config_dict must be JSON-serialisable"):
        check_same_config({"device": torch.device("cpu")}, SINGLE)
    with pytest.raises(ValueError, match="global_batch=10 is not divisible by the world size 4"):
        local_batch_slice(10, DistInfo(0, 4, 0, "gloo"))
    with pytest.raises(ValueError, match="global_batch must be a positive int; got 0"):
        local_batch_slice(0, SINGLE)
    with pytest.raises(TypeError, match=r"attn must be a headspace.MultiHeadAttention; got Linear"):
        HeadParallelAttention.from_module(nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ff must be a feed-forward module with nn.Linear .fc_in"):
        HeadParallelFeedForward.from_module(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module; got int"):
        gather_model(3)  # type: ignore[arg-type]


def test_shards_reject_indivisible_heads_and_bad_ranks() -> None:
    attn = MultiHeadAttention(10, 5)
    with pytest.raises(
        ValueError, match=r"n_heads=5 is not divisible by the world size 2.*divisors: \[1, 5\]"
    ):
        attention_shard(attn, 0, 2)
    with pytest.raises(ValueError, match="n_kv_heads=3 is not divisible by the world size 2"):
        attention_shard(MultiHeadAttention(12, 6, n_kv_heads=3), 0, 2)
    with pytest.raises(ValueError, match="need integers 0 <= rank < world_size; got rank=2, world_size=2"):
        attention_shard(MultiHeadAttention(12, 6), 2, 2)
    with pytest.raises(ValueError, match="d_mlp=9 is not divisible by the world size 2"):
        feed_forward_shard(FeedForward(4, 9), 1, 2)
    with pytest.raises(ValueError, match="group was given but no process group is initialised"):
        HeadParallelAttention.from_module(MultiHeadAttention(12, 6), group=object())  # type: ignore[arg-type]
    par = HeadParallelAttention.from_module(MultiHeadAttention(12, 6))
    with pytest.raises(ValueError, match=r"4-D mask must be \[batch, n_heads, seq_q, seq_k\] with n_heads=6"):
        par(torch.randn(1, 2, 12), attn_mask=torch.ones(1, 4, 2, 2, dtype=torch.bool))


@pytest.mark.parametrize("world", [1, 3])
def test_rotary_gqa_shards_add_up_with_qkv_bias_only(world: int) -> None:
    """Qwen2-like: rotary positions, grouped-query heads, biases on q/k/v only; explicit positions."""
    from headspace.nn.positions import Rotary

    torch.manual_seed(3)
    attn = MultiHeadAttention(
        30, 6, d_head=6, n_kv_heads=3, qkv_bias=True, out_bias=False, rotary=Rotary(6, base=500.0)
    )
    with torch.no_grad():
        attn.qkv_bias.normal_()
    x = torch.randn(2, 5, 30)
    positions = torch.tensor([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]])
    shards = [attention_shard(attn, r, world) for r in range(world)]
    assert all(s.rotary is attn.rotary and s.o_bias is None for s in shards)
    out = sum(s(x, is_causal=True, positions=positions) for s in shards)
    assert_close(out, attn(x, is_causal=True, positions=positions))
    hp = HeadParallelAttention.from_module(attn)  # a world of one: the whole layer, positions passed on
    assert_close(hp(x, is_causal=True, positions=positions), attn(x, is_causal=True, positions=positions))
    back = hp.gather()
    assert back.rotary is attn.rotary and back.o_bias is None and back.qkv_bias is not None
