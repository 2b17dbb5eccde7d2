"""Head-parallel layers and the distributed helpers on 2 real gloo processes (localhost only).

Each test spawns 2 processes that join a gloo group on 127.0.0.1 through :func:`setup_distributed`
(torchrun's environment variables, set by hand), and checks on every rank against the single-process
layer that both ranks build from the same seed. An assertion on any rank fails the test; a hang fails
it after ``TIMEOUT_S`` instead of blocking CI.
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.testing import assert_close

pytestmark = pytest.mark.slow  # the whole module (pyproject.toml: -m slow runs it)

TIMEOUT_S = 240.0  # the whole spawn (two fresh interpreters importing torch on a busy 2-core machine)
WORLD = 2


# ---------------------------------------------------------------------------------------------- harness
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        GLOO_SOCKET_IFNAME="lo",
    )
    torch.set_num_threads(1)
    from headspace.distributed.head_parallel import setup_distributed, teardown

    info = setup_distributed("cpu", timeout_s=60)
    assert (info.rank, info.world_size, info.backend) == (rank, world, "gloo")
    try:
        fn(rank, world, *args)
    finally:
        teardown(info)


def run_distributed(fn: Callable[..., None], *args: Any, world: int = WORLD) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo processes; fail on any error or after TIMEOUT_S."""
    ctx = mp.start_processes(
        _entry, args=(world, _free_port(), fn, args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"distributed test did not finish within {TIMEOUT_S} s (a rank hung)")


def _run_workers(rank: int, world: int, names: list[str], out_dir: str) -> None:
    """Run each named worker in turn; record 'ok' or the traceback per worker in out_dir/rank<r>.json."""
    results = {}
    for name in names:
        try:
            globals()[name](rank, world)
            results[name] = "ok"
        except Exception:  # recorded and reported by the test of that worker
            results[name] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


WORKERS = [
    "_attention_worker",
    "_feed_forward_worker",
    "_sync_worker",
    "_bad_input_worker",
    "_model_worker",
    "_train_config_worker",
]


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    """One spawn of 2 processes runs every worker (starting processes is the slow part on 2 cores)."""
    out_dir = tmp_path_factory.mktemp("dist")
    run_distributed(_run_workers, WORKERS, str(out_dir))
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _check_worker(results: list[dict[str, str]], name: str) -> None:
    failures = [f"rank {r}:\n{res[name]}" for r, res in enumerate(results) if res[name] != "ok"]
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)


def _raises_on_every_rank(exc: type[Exception], fn: Callable[[], Any], *needles: str) -> str:
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    return msg


# ---------------------------------------------------------------------------------------------- attention
def _per_head_grads(attn: Any) -> list[torch.Tensor | None]:
    """Gradients of W_Q, W_K, W_V rows and of b_Q, b_K, b_V as per-head blocks [heads, d_head, ...]."""
    H, Hkv, dh = attn.n_heads, attn.n_kv_heads, attn.d_head
    sizes = [H * dh, Hkv * dh, Hkv * dh]
    if attn.fused:
        weights = list(attn.qkv_weight.grad.split(sizes, dim=0))  # [(heads dh, d_model)] x 3
    else:
        weights = [attn.q_weight.grad, attn.k_weight.grad, attn.v_weight.grad]  # [(heads dh, kdim|vdim)]
    biases = [None] * 3 if attn.qkv_bias is None else list(attn.qkv_bias.grad.split(sizes))  # [(heads dh,)]
    return [None if g is None else g.unflatten(0, (-1, dh)) for g in weights + biases]  # (heads, dh, ...)


def _check_attention_shard_grads(par: Any, ref: Any) -> None:
    """This rank's weight gradients equal its slice of the single-process layer's gradients."""
    hs, ks, dh = par.head_slice, par.kv_head_slice, par.d_head
    slices = [hs, ks, ks, hs, ks, ks]
    for got, want, sl in zip(_per_head_grads(par.local), _per_head_grads(ref), slices):
        if want is None:
            assert got is None
        else:
            assert_close(got, want[sl])
    if ref.o_bias is not None:
        assert_close(par.o_bias.grad, ref.o_bias.grad)
    cols = slice(hs.start * dh, hs.stop * dh)
    assert_close(par.local.o_weight.grad, ref.o_weight.grad[:, cols])  # (d_model, n_local_heads d_head)


def _attention_worker(rank: int, world: int) -> None:
    from headspace import MultiHeadAttention
    from headspace.distributed.head_parallel import HeadParallelAttention

    # batch=2, seq_q=5, seq_k=7, d_model=11, d_head=3: distinct so a swapped axis fails; n_heads=6 and
    # n_kv_heads=2 are divisible by the world size 2 (each rank: 3 query heads reading 1 kv head).
    B, Sq, Sk, D, dh = 2, 5, 7, 11, 3
    cases = [
        {"n_heads": 6, "n_kv_heads": None, "bias": True, "causal": False, "cross": False},
        {"n_heads": 6, "n_kv_heads": 2, "bias": True, "causal": True, "cross": False},  # GQA, causal
        {"n_heads": 6, "n_kv_heads": 2, "bias": False, "causal": True, "cross": False},
        {"n_heads": 6, "n_kv_heads": 2, "bias": True, "causal": True, "cross": True},  # kdim/vdim, masks
    ]
    for i, case in enumerate(cases):
        torch.manual_seed(100 + i)  # the same layer and inputs on both ranks
        kdim, vdim = (7, 13) if case["cross"] else (None, None)
        ref = MultiHeadAttention(
            D,
            case["n_heads"],
            d_head=dh,
            n_kv_heads=case["n_kv_heads"],
            kdim=kdim,
            vdim=vdim,
            bias=case["bias"],
        )
        if case["bias"]:
            with torch.no_grad():
                ref.qkv_bias.normal_()
                ref.o_bias.normal_()
        x = torch.randn(B, Sq, D)
        probe = torch.randn(B, Sq, D)  # loss = <out, probe>: every output entry gets its own gradient
        kw: dict[str, Any] = {"is_causal": case["causal"]}
        inputs = [x]
        if case["cross"]:
            key, value = torch.randn(B, Sk, kdim), torch.randn(B, Sk, vdim)
            inputs += [key, value]
            pad = torch.ones(B, Sk, dtype=torch.bool)
            pad[1, -2:] = False
            kw["key_padding"] = pad
            kw["attn_mask"] = torch.rand(B, case["n_heads"], Sq, Sk) > 0.3  # per-head mask: cut per rank
        par_inputs = [t.clone().requires_grad_() for t in inputs]
        ref_inputs = [t.clone().requires_grad_() for t in inputs]

        par = HeadParallelAttention.from_module(ref)
        assert par.n_local_heads == case["n_heads"] // world
        assert par.head_slice == slice(rank * 3, rank * 3 + 3)
        out, pattern = par(*par_inputs, need_weights=True, **kw)
        want, want_pattern = ref(*ref_inputs, need_weights=True, **kw)
        assert out.shape == (B, Sq, D) and pattern.shape == (
            B,
            case["n_heads"],
            Sq,
            Sq if not case["cross"] else Sk,
        )
        assert_close(out, want)
        assert_close(pattern, want_pattern)
        (out * probe).sum().backward()
        (want * probe).sum().backward()
        for got_in, want_in in zip(par_inputs, ref_inputs):
            assert_close(got_in.grad, want_in.grad)  # input gradients: all-reduced over the ranks' heads
        _check_attention_shard_grads(par, ref)
        # the fast path (no weights asked) gives the same output
        assert_close(par(*[t.detach() for t in par_inputs], **kw), want.detach())

        full = par.gather()
        assert type(full) is MultiHeadAttention and full.n_heads == ref.n_heads
        for name, p in ref.named_parameters():
            assert torch.equal(dict(full.named_parameters())[name], p), name

    # KV-cache decoding on the shards equals the single-process layer's decoding
    torch.manual_seed(7)
    ref = MultiHeadAttention(D, 6, d_head=dh, n_kv_heads=2)
    par = HeadParallelAttention.from_module(ref)
    x = torch.randn(B, Sq, D)
    cache_p, cache_r = par.make_kv_cache(B, Sq), ref.make_kv_cache(B, Sq)
    assert cache_p.k.shape == (B, 1, Sq, dh)  # this rank's key/value head only
    with torch.no_grad():
        for t in range(Sq):
            step = x[:, t : t + 1]
            assert_close(
                par(step, kv_cache=cache_p, is_causal=True), ref(step, kv_cache=cache_r, is_causal=True)
            )


def test_head_parallel_attention_matches_single_process_on_two_ranks(two_rank_results: list) -> None:
    """Outputs, patterns, input and weight gradients of the sharded layer equal the single-process ones
    (MHA, GQA, causal, no-bias, cross-attention with padding and a per-head mask, KV-cache decoding)."""
    _check_worker(two_rank_results, "_attention_worker")


# ---------------------------------------------------------------------------------------------- feed-forward
def _feed_forward_worker(rank: int, world: int) -> None:
    from headspace.distributed.head_parallel import HeadParallelFeedForward
    from headspace.model.block import FeedForward

    B, S, D, d_mlp = 2, 5, 11, 14  # each rank: 7 hidden units
    for i, (act, bias) in enumerate((("gelu", True), ("relu", False))):
        torch.manual_seed(200 + i)
        ref = FeedForward(D, d_mlp, act=act, bias=bias)
        x = torch.randn(B, S, D)
        probe = torch.randn(B, S, D)
        par = HeadParallelFeedForward.from_module(ref)
        x_par, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, want = par(x_par), ref(x_ref)
        assert_close(out, want)
        (out * probe).sum().backward()
        (want * probe).sum().backward()
        assert_close(x_par.grad, x_ref.grad)
        units = par.unit_slice
        assert units == slice(rank * 7, rank * 7 + 7)
        assert_close(par.local.fc_in.weight.grad, ref.fc_in.weight.grad[units])
        assert_close(par.local.fc_out.weight.grad, ref.fc_out.weight.grad[:, units])
        if bias:
            assert_close(par.local.fc_in.bias.grad, ref.fc_in.bias.grad[units])
            assert_close(par.out_bias.grad, ref.fc_out.bias.grad)
        full = par.gather()
        assert type(full) is FeedForward
        for name, p in ref.named_parameters():
            assert torch.equal(dict(full.named_parameters())[name], p), name


def test_head_parallel_feed_forward_matches_single_process_on_two_ranks(two_rank_results: list) -> None:
    _check_worker(two_rank_results, "_feed_forward_worker")


# ---------------------------------------------------------------------------------------------- bad input
def _bad_input_worker(rank: int, world: int) -> None:
    from headspace import MultiHeadAttention
    from headspace.distributed.data_parallel import check_same_config
    from headspace.distributed.head_parallel import (
        DistInfo,
        HeadParallelAttention,
        HeadParallelFeedForward,
        shard_model,
    )
    from headspace.model.block import FeedForward

    torch.manual_seed(0)
    _raises_on_every_rank(
        ValueError, lambda: HeadParallelAttention.from_module(MultiHeadAttention(10, 5)), "n_heads=5",
        "world size 2",
    )  # fmt: skip
    _raises_on_every_rank(
        ValueError,
        lambda: HeadParallelAttention.from_module(MultiHeadAttention(12, 6, n_kv_heads=3)),
        "n_kv_heads=3",
        "world size 2",
    )
    _raises_on_every_rank(
        ValueError, lambda: HeadParallelFeedForward.from_module(FeedForward(4, 9)), "d_mlp=9", "world size 2"
    )
    # configurations that differ across ranks: the same error on every rank, naming field and values
    attn = MultiHeadAttention(12, 4, d_head=3 if rank == 0 else 2)
    _raises_on_every_rank(
        ValueError,
        lambda: HeadParallelAttention.from_module(attn),
        "differs across the 2 ranks",
        "d_head (rank 0=3, rank 1=2)",
    )
    causal_attn = MultiHeadAttention(12, 4, n_kv_heads=4 if rank == 0 else 2)
    _raises_on_every_rank(
        ValueError, lambda: HeadParallelAttention.from_module(causal_attn), "n_kv_heads (rank 0=4, rank 1=2)"
    )
    ff = FeedForward(4, 6, act="gelu" if rank == 0 else "relu")
    _raises_on_every_rank(ValueError, lambda: HeadParallelFeedForward.from_module(ff), "act (rank 0=")
    not_attn: nn.Module = MultiHeadAttention(12, 4) if rank == 0 else nn.Linear(12, 12)
    _raises_on_every_rank(
        ValueError, lambda: HeadParallelAttention.from_module(not_attn), "rank 1: attn must be a headspace"
    )
    # the same wrong type everywhere is a TypeError
    _raises_on_every_rank(TypeError, lambda: HeadParallelAttention.from_module(nn.Linear(3, 3)), "got Linear")
    model = nn.Sequential(nn.Linear(4, 6 if rank == 0 else 8), MultiHeadAttention(6, 2))
    _raises_on_every_rank(ValueError, lambda: shard_model(model), "model structure differs", "0.weight")
    info = DistInfo(rank, world, rank, "gloo")
    _raises_on_every_rank(
        ValueError,
        lambda: check_same_config({"lr": 0.1, "seed": rank}, info),
        "config_dict differs",
        "seed (rank 0=0, rank 1=1)",
    )
    check_same_config({"lr": 0.1, "layers": [1, 2]}, info)  # equal configs pass
    # after all those errors the ranks are still in step: a good layer shards and runs
    torch.manual_seed(1)
    ref = MultiHeadAttention(12, 4)
    x = torch.randn(2, 3, 12)
    assert_close(HeadParallelAttention.from_module(ref)(x), ref(x))


def test_bad_input_raises_the_same_error_on_every_rank(two_rank_results: list) -> None:
    """n_heads / n_kv_heads / d_mlp not divisible by the world size, and configs differing across ranks."""
    _check_worker(two_rank_results, "_bad_input_worker")


# ---------------------------------------------------------------------------------------------- weights sync
def _sync_worker(rank: int, world: int) -> None:
    from headspace import MultiHeadAttention
    from headspace.distributed.head_parallel import HeadParallelAttention

    torch.manual_seed(rank)  # different weights on each rank
    attn = MultiHeadAttention(12, 4)
    par = HeadParallelAttention.from_module(attn)  # sync_weights=True: rank 0's layer everywhere
    weights = [torch.empty_like(attn.qkv_weight) for _ in range(world)]
    dist.all_gather(weights, attn.qkv_weight.detach())
    assert torch.equal(weights[0], weights[1])
    assert torch.equal(par.gather().qkv_weight, attn.qkv_weight)


def test_from_module_broadcasts_the_first_ranks_weights(two_rank_results: list) -> None:
    _check_worker(two_rank_results, "_sync_worker")


# ---------------------------------------------------------------------------------------------- whole model
def _model_worker(rank: int, world: int) -> None:
    from headspace import MultiHeadAttention
    from headspace.analysis import head_roles
    from headspace.analysis.trace import trace
    from headspace.distributed.head_parallel import (
        HeadParallelAttention,
        HeadParallelFeedForward,
        gather_model,
        shard_model,
    )
    from headspace.model.models import Decoder, ModelConfig

    torch.manual_seed(300)
    config = ModelConfig(
        arch="decoder", vocab_size=23, d_model=12, n_layers=2, n_heads=4, d_head=3, n_kv_heads=2, d_mlp=10,
        max_seq_len=16,
    )  # fmt: skip
    ref = Decoder(config)
    model = Decoder(config)
    model.load_state_dict(ref.state_dict())
    shard_model(model)
    assert all(isinstance(b.attn, HeadParallelAttention) for b in model.blocks)
    assert all(isinstance(b.mlp, HeadParallelFeedForward) for b in model.blocks)
    tokens = torch.randint(0, 23, (2, 5))
    logits, want = model(tokens), ref(tokens)
    assert_close(logits, want)
    logits.logsumexp(-1).sum().backward()
    want.logsumexp(-1).sum().backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if ".attn." in name or ".mlp." in name:
            continue  # sharded: checked layer by layer in the attention and feed-forward workers
        assert_close(p.grad, ref_grads[name].grad, msg=name)  # replicated parameters: full gradients

    # KV-cached generation on the shards (each rank caches its own key/value heads) picks the same tokens
    assert torch.equal(model.generate(tokens[:, :3], 4, top_k=1), ref.generate(tokens[:, :3], 4, top_k=1))

    # the per-head tools on a head-parallel model: gather the heads, then trace as on one process
    full = gather_model(model)
    assert all(type(b.attn) is MultiHeadAttention for b in full.blocks)
    assert set(full.state_dict()) == set(ref.state_dict())
    for name, t in ref.state_dict().items():
        assert torch.equal(full.state_dict()[name], t), name
    with torch.no_grad(), trace(full) as t_full:
        full(tokens)
    with torch.no_grad(), trace(ref) as t_ref:
        ref(tokens)
    with torch.no_grad(), trace(model) as t_local:  # tracing the shards sees this rank's heads only
        model(tokens)
    for layer in range(config.n_layers):
        assert t_full.pattern(layer).shape == (2, 4, 5, 5)
        assert_close(t_full.pattern(layer), t_ref.pattern(layer))
        assert_close(t_full.result(layer), t_ref.result(layer))
        hs = model.blocks[layer].attn.head_slice
        assert_close(t_local.pattern(layer), t_ref.pattern(layer)[:, hs])
    roles, want_roles = head_roles(full, tokens), head_roles(ref, tokens)
    assert roles.labels == want_roles.labels and len(roles.labels[0]) == config.n_heads
    for field in ("previous", "next", "current", "first", "last", "entropy"):
        assert_close(getattr(roles, field), getattr(want_roles, field), msg=field)


def test_head_parallel_decoder_matches_and_gathers_for_the_per_head_tools(two_rank_results: list) -> None:
    """shard_model on a GQA Decoder: same logits and replicated-parameter gradients; gather_model gives
    the single-process model back, and trace() on it sees every head exactly as on one process."""
    _check_worker(two_rank_results, "_model_worker")


# ------------------------------------------------------------------------------------------- training start
def _train_config_worker(rank: int, world: int) -> None:
    import tempfile

    from headspace.distributed.head_parallel import DistInfo
    from headspace.train.loop import TrainConfig, train

    info = DistInfo(rank, world, rank, "gloo")
    with tempfile.TemporaryDirectory(prefix=f"headspace-rank{rank}-") as out:
        config = TrainConfig(task="relations", n_layers=1, n_heads=2, d_model=16, batch_size=8, steps=2,
                             lr=1e-3 if rank == 0 else 2e-3)  # fmt: skip
        _raises_on_every_rank(
            ValueError,
            lambda: train(config, out, progress=False, _info=info),
            "differs across the 2 ranks",
            "lr (rank 0=0.001, rank 1=0.002)",
        )
        config = TrainConfig(task="relations", n_layers=1, n_heads=2, d_model=16, batch_size=7, steps=2)
        _raises_on_every_rank(
            ValueError,
            lambda: train(config, out, progress=False, _info=info),
            "global_batch=7 is not divisible",
        )


def test_training_refuses_configs_that_differ_across_ranks(two_rank_results: list) -> None:
    """Detected at the start of train(), before anything is written, with the same error on every rank."""
    _check_worker(two_rank_results, "_train_config_worker")
