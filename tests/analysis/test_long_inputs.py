"""Attention statistics of long inputs in bounded memory (headspace.analysis.chunked, head_roles chunk by
chunk): the same numbers as the full patterns, on every mask, GQA, rotary and padding, and peak memory
that grows with chunk x seq, not seq^2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from torch.testing import assert_close

import headspace as hs
from headspace import MultiHeadAttention, analysis
from headspace.analysis import chunked, each_layer_qk, pattern_rows, summaries
from headspace.analysis.trace import trace
from headspace.nn.masks import RowMasks, canonical_mask

pytestmark = pytest.mark.usefixtures("single_thread")

FIELDS = (*analysis.TARGETS, "entropy")


def rotary_gqa_decoder(n_layers: int = 2, vocab: int = 53) -> hs.Decoder:
    config = hs.ModelConfig(
        arch="decoder", vocab_size=vocab, d_model=42, n_layers=n_layers, n_heads=6, n_kv_heads=2, d_head=8,
        d_mlp=26, max_seq_len=4096, positions="rotary", norm_kind="rmsnorm", mlp_kind="gated", act="silu",
        bias=False,
    )  # fmt: skip
    model = hs.Decoder(config).eval()
    with torch.no_grad():  # sharper patterns than the Xavier start: masses and entropies far apart
        for block in model.blocks:
            block.attn.qkv_weight.mul_(4.0)
    return model


def encoder(vocab: int = 53) -> hs.Encoder:
    config = hs.ModelConfig(
        arch="encoder", vocab_size=vocab, d_model=35, n_layers=2, n_heads=7, max_seq_len=64
    )
    return hs.Encoder(config).eval()


def padded_tokens(vocab: int, batch: int = 3, seq: int = 19) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (batch, seq))
    pad = torch.ones(batch, seq, dtype=torch.bool)
    pad[1, 13:] = False  # right padding
    pad[2, :5] = False  # left padding
    return tokens, pad


def assert_same_roles(got: analysis.HeadRoles, want: analysis.HeadRoles) -> None:
    for name in FIELDS:
        assert_close(getattr(got, name), getattr(want, name), equal_nan=True, msg=name)
    assert got.labels == want.labels and got.n_queries == want.n_queries


# ------------------------------------------------------------------------------------------ head_roles
@pytest.mark.parametrize("chunk", [1, 4, 7, 19, 100])
def test_chunked_roles_equal_full_roles_rotary_gqa_decoder_with_padding(chunk: int) -> None:
    model = rotary_gqa_decoder()
    tokens, pad = padded_tokens(53)
    want = analysis.head_roles(model, tokens, key_padding=pad, chunk_size=None)
    got = analysis.head_roles(model, tokens, key_padding=pad, chunk_size=chunk)
    assert_same_roles(got, want)
    assert got.n_queries == 19 + 13 + 14


@pytest.mark.parametrize("chunk", [1, 6, 19])
def test_chunked_roles_equal_full_roles_encoder_not_causal(chunk: int) -> None:
    model = encoder()
    tokens, pad = padded_tokens(53)
    want = analysis.head_roles(model, tokens, key_padding=pad, chunk_size=None)
    assert_same_roles(analysis.head_roles(model, tokens, key_padding=pad, chunk_size=chunk), want)
    assert_same_roles(
        analysis.head_roles(model, tokens, chunk_size=chunk), analysis.head_roles(model, tokens)
    )


def test_chunked_roles_of_planted_heads_and_a_pruned_model() -> None:
    from test_analysis import planted_role_layer, positions

    attn = planted_role_layer()
    x = positions(2)
    pad = torch.ones(2, 11, dtype=torch.bool)
    pad[1, 8:] = False
    got = analysis.head_roles(attn, x, key_padding=pad, chunk_size=3)
    assert got.labels == [["previous", "next", "current", "first"]]
    assert_same_roles(got, analysis.head_roles(attn, x, key_padding=pad, chunk_size=None))
    model = encoder()
    hs.prune_heads(model, {1: [0, 3]})
    tokens = torch.randint(0, 53, (2, 11))
    got = analysis.head_roles(model, tokens, chunk_size=5)
    assert [len(r) for r in got.labels] == [7, 5] and torch.isnan(got.previous[1, 5:]).all()
    assert_same_roles(got, analysis.head_roles(model, tokens, chunk_size=None))


def test_bfloat16_model_measured_in_float32() -> None:
    model = rotary_gqa_decoder().to(torch.bfloat16)
    tokens, pad = padded_tokens(53)
    got = analysis.head_roles(model, tokens, key_padding=pad, chunk_size=5)
    assert got.entropy.dtype == torch.float32 and torch.isfinite(got.entropy).all()
    errors = []

    def fn(call: chunked.LayerQK) -> None:
        assert call.q.dtype == call.k.dtype == torch.bfloat16
        rows = call.pattern_rows(chunk_size=4)  # float32 from the bfloat16 q and k
        q = call.q.double().transpose(1, 2)  # (B, H, S, dh)
        k = call.k.double().transpose(1, 2).repeat_interleave(3, dim=1)  # (B, H, S, dh)
        scores = q @ k.transpose(-1, -2) * call.scale
        allowed = torch.ones(19, 19, dtype=torch.bool).tril()[None, None] & pad[:, None, None, :]
        want = scores.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num()  # dead rows: 0
        errors.append(float((rows.double() - want).abs().max()))

    with torch.no_grad():
        each_layer_qk(model, lambda: model(tokens, key_padding=pad), fn)
    assert len(errors) == 2 and max(errors) < 1e-5  # bfloat16 arithmetic would be off by ~1e-2


def test_auto_chunk_size_picks_the_chunked_path_for_long_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    model = rotary_gqa_decoder(n_layers=1)
    tokens = torch.randint(0, 53, (1, 40))
    used: list[int | None] = []
    real = analysis.roles._plan

    def spy(*args: object) -> int | None:
        used.append(real(*args))
        return used[-1]

    monkeypatch.setattr(analysis.roles, "_plan", spy)
    want = analysis.head_roles(model, tokens)  # 6 heads x 40^2 x 4 bytes: far below the threshold
    assert used == [None]
    monkeypatch.setattr(analysis.roles, "AUTO_PATTERN_BYTES", 1000)
    got = analysis.head_roles(model, tokens)
    assert used[-1] == chunked.default_chunk_size(1, 6, 40, 40)
    assert_same_roles(got, want)
    with hs.ablate(model, {(0, 1): "zero"}):  # an active hook point: auto keeps the traced path
        analysis.head_roles(model, tokens)
    assert used[-1] is None


def test_chunk_size_errors() -> None:
    model = rotary_gqa_decoder(n_layers=1)
    tokens = torch.randint(0, 53, (1, 5))
    for bad in (0, -2, 1.5, "fast"):
        with pytest.raises(
            ValueError, match=r"chunk_size must be 'auto', None \(full patterns\) or a positive"
        ):
            analysis.head_roles(model, tokens, chunk_size=bad)
    mha = hs.compat.MultiheadAttention(12, 3, batch_first=True)
    with pytest.raises(ValueError, match="have their own forward"):
        analysis.head_roles(mha, torch.randn(1, 4, 12), chunk_size=2)


# ------------------------------------------------------------------------------------------ summaries
def _reference_summary(pattern: torch.Tensor, pad: torch.Tensor | None, targets: torch.Tensor | None) -> dict:
    """The statistics of :func:`summaries`, computed the plain way from a full pattern [B, H, Sq, Sk]."""
    B, H, Sq, Sk = pattern.shape
    P = pattern.double()
    offset = Sk - Sq
    first = torch.zeros(B, dtype=torch.long) if pad is None else pad.float().argmax(1)
    last = torch.full((B,), Sk - 1) if pad is None else Sk - 1 - pad.flip(1).float().argmax(1)

    def at(key: torch.Tensor) -> torch.Tensor:  # key [B, Sq] -> mass [B, H, Sq], 0 outside
        ok = (key >= 0) & (key < Sk)
        got = P.gather(-1, key.clamp(0, Sk - 1)[:, None, :, None].expand(B, H, Sq, 1))[..., 0]
        return got * ok[:, None]

    i = torch.arange(Sq)[None].expand(B, Sq) + offset
    plogp = torch.where(P > 0, P * P.clamp_min(1e-300).log(), torch.zeros_like(P))
    out = {
        "previous": at(i - 1), "next": at(i + 1), "current": at(i), "first": at(first[:, None].expand(B, Sq)),
        "last": at(last[:, None].expand(B, Sq)), "entropy": -plogp.sum(-1), "top_weight": P.amax(-1),
    }  # fmt: skip
    counted = torch.ones(B, Sq, dtype=torch.double) if pad is None or Sq != Sk else pad.double()
    out["received"] = torch.einsum("bhqk,bq->bhk", P, counted)
    if targets is not None:
        t = targets.expand(B, -1, -1)
        ok = (t >= 0) & (t < Sk)
        idx = t.clamp(0, Sk - 1)[:, None].expand(B, H, Sq, t.shape[-1])
        out["targets"] = P.gather(-1, idx) * ok[:, None]
    return {k: v.float() for k, v in out.items()}


def _layer_cases() -> dict[str, dict]:
    g = torch.Generator().manual_seed(5)
    B, Sq = 2, 9
    pad = torch.ones(B, Sq, dtype=torch.bool)
    pad[1, 6:] = False
    dead = torch.ones(Sq, Sq, dtype=torch.bool)
    dead[3] = False  # query 3 may attend to nothing
    additive = torch.randn(B, 6, Sq, Sq, generator=g)
    additive[0, 2, 4] = float("-inf")  # a dead row in the additive mask
    additive[1, :, :, 2] = float("-inf")
    return {
        "none": {},
        "causal": {"is_causal": True},
        "padding": {"key_padding": pad},
        "causal_padding": {"is_causal": True, "key_padding": pad},
        "bool_dead_row": {"attn_mask": dead, "is_causal": True},
        "additive_dead_row": {"attn_mask": additive, "is_causal": True},
    }


@pytest.mark.parametrize("case", list(_layer_cases()))
@pytest.mark.parametrize("chunk", [1, 4, 9])
def test_summaries_and_rows_equal_the_traced_pattern_of_a_rotary_gqa_layer(case: str, chunk: int) -> None:
    torch.manual_seed(1)
    rotary = hs.positions.Rotary(8)
    attn = MultiHeadAttention(24, 6, d_head=8, n_kv_heads=3, bias=False, rotary=rotary).eval()
    with torch.no_grad():
        attn.qkv_weight.mul_(3.0)
    x = torch.randn(2, 9, 24)
    kwargs = _layer_cases()[case]
    with torch.no_grad(), trace(attn, ["hook_rot_q", "hook_rot_k", "hook_pattern"]) as t:
        attn(x, **kwargs)
    q, k, pattern = t["hook_rot_q"], t["hook_rot_k"], t["hook_pattern"]
    targets = torch.tensor([[[j - 3, 0, -1] for j in range(9)]])  # [1, seq_q, 3]
    s = summaries(q, k, chunk_size=chunk, targets=targets, **kwargs)
    pad = kwargs.get("key_padding")
    want = _reference_summary(pattern, pad, targets)
    for name, value in want.items():
        assert_close(getattr(s, name), value, msg=name)
    assert torch.equal(s.top_key, pattern.argmax(-1)) or case.endswith("dead_row")  # ties on dead rows
    assert torch.isfinite(s.entropy).all()
    assert_close(pattern_rows(q, k, chunk_size=chunk, **kwargs), pattern)
    assert_close(pattern_rows(q, k, [8, 0, -6], chunk_size=chunk, **kwargs), pattern[:, :, [8, 0, 3]])
    assert_close(pattern_rows(q, k, 4, **kwargs), pattern[:, :, 4:5])


def test_dead_rows_are_zero_with_zero_entropy_never_nan() -> None:
    q, k = torch.randn(1, 5, 2, 4), torch.randn(1, 5, 2, 4)
    mask = torch.ones(5, 5, dtype=torch.bool)
    mask[2] = False
    s = summaries(q, k, attn_mask=mask)
    rows = pattern_rows(q, k, attn_mask=mask)
    assert torch.equal(rows[:, :, 2], torch.zeros(1, 2, 5)) and torch.isfinite(rows).all()
    assert float(s.entropy[0, :, 2].abs().max()) == 0.0 and float(s.top_weight[0, :, 2].max()) == 0.0
    assert_close(rows.sum(-1)[:, :, [0, 1, 3, 4]], torch.ones(1, 2, 4))


def test_cross_lengths_are_aligned_bottom_right_as_causality() -> None:
    q, k = torch.randn(2, 3, 4, 5), torch.randn(2, 7, 2, 5)  # 3 new queries after 4 cached keys
    s = summaries(q, k, is_causal=True, chunk_size=2)
    rows = pattern_rows(q, k, is_causal=True)
    assert float(rows[:, :, 0, 5:].abs().max()) == 0.0 and bool((rows[:, :, 0, 4] > 0).all())
    assert_close(s.current, rows[:, :, [0, 1, 2], [4, 5, 6]])
    assert_close(s.previous, rows[:, :, [0, 1, 2], [3, 4, 5]])


def test_bad_q_and_k_are_refused_with_their_shapes() -> None:
    q, k = torch.randn(2, 5, 6, 4), torch.randn(2, 5, 4, 4)
    with pytest.raises(ValueError, match=r"n_kv_heads=4 must divide n_heads=6"):
        summaries(q, k)
    with pytest.raises(ValueError, match=r"q must be 4-D \[batch, seq, n_heads, d_head\]"):
        pattern_rows(q[0], k)
    with pytest.raises(ValueError, match=r"must agree on batch and d_head"):
        pattern_rows(q, torch.randn(2, 5, 3, 5))
    with pytest.raises(TypeError, match="key_padding must be a bool tensor"):
        pattern_rows(q, k[:, :, :3], key_padding=torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"query_positions must be in \[-5, 5\)"):
        pattern_rows(q, k[:, :, :3], 5)
    with pytest.raises(ValueError, match="chunk_size must be None"):
        summaries(q, k[:, :, :3], chunk_size=0)


def test_row_masks_equal_canonical_mask_rows() -> None:
    pad = torch.tensor([[True] * 6, [False, False, True, True, True, False]])
    additive = torch.zeros(2, 1, 6, 6)
    additive[1, 0, 3] = float("-inf")
    for kw in (
        {"key_padding": pad, "is_causal": True},
        {"attn_mask": additive, "is_causal": True},
        {"attn_mask": torch.rand(6, 6) > 0.5, "key_padding": pad},
        {"is_causal": True},
    ):
        full = canonical_mask(batch=2, n_heads=3, seq_q=6, seq_k=6, **kw)
        m = full.mask if full.mask is not None else canonical_mask(batch=2, n_heads=3, seq_q=6, seq_k=6).mask
        rows = RowMasks(batch=2, n_heads=3, seq_q=6, seq_k=6, **kw)
        for start, end in ((0, 6), (1, 4), (5, 6)):
            got = rows.rows(start, end)
            if m is not None:
                assert torch.equal(
                    got.mask.expand(2, -1, end - start, 6), m.expand(2, -1, 6, 6)[:, :, start:end]
                )
            dead = full.dead_rows
            if dead is not None and bool(dead[..., start:end, :].any()):
                assert torch.equal(got.dead_rows, dead[..., start:end, :])
            else:
                assert got.dead_rows is None
        index = torch.tensor([4, 0, 2])
        picked = rows.rows(index)
        if m is not None:
            assert torch.equal(picked.mask.expand(2, -1, 3, 6), m.expand(2, -1, 6, 6)[:, :, [4, 0, 2]])


# ------------------------------------------------------------------------------------------ each_layer_qk
def test_each_layer_qk_gives_the_traced_rotated_q_and_k_and_stops_after_the_last_layer() -> None:
    model = rotary_gqa_decoder(n_layers=3)
    tokens, pad = padded_tokens(53)
    want = {}
    for i in range(3):  # one layer traced at a time: the layers before it keep their fused path, as below
        with (
            torch.no_grad(),
            trace(
                model,
                [f"blocks.{i}.attn.hook_rot_q", f"blocks.{i}.attn.hook_rot_k", f"blocks.{i}.attn.hook_v"],
            ) as t,
        ):
            model(tokens, key_padding=pad)
        want[i] = (
            t[f"blocks.{i}.attn.hook_rot_q"],
            t[f"blocks.{i}.attn.hook_rot_k"],
            t[f"blocks.{i}.attn.hook_v"],
        )
    got: dict[int, tuple[torch.Tensor, torch.Tensor, bool, torch.Tensor]] = {}
    expected_pad = [pad]

    def fn(call: chunked.LayerQK) -> None:
        assert not call.attn.hooks_active  # the layer keeps its fused path: no hook point is touched
        assert call.v is not None  # the values of the same projection
        got[call.layer] = (call.q.clone(), call.k.clone(), call.is_causal, call.v.clone())
        assert call.key_padding is expected_pad[0] and call.scale == call.attn.scale

    unembedded = []
    handle = model.ln_final.register_forward_hook(lambda *a: unembedded.append(1))
    try:
        with torch.no_grad():
            each_layer_qk(model, lambda: model(tokens, key_padding=pad), fn)
        assert unembedded == []  # stopped after the last attention layer
        for i in range(3):
            assert_close(got[i][0], want[i][0], rtol=0, atol=0)  # the same operations: bitwise
            assert_close(got[i][1], want[i][1], rtol=0, atol=0)
            assert got[i][2] is True
            assert_close(got[i][3], want[i][2], rtol=0, atol=0)  # v as hook_v shows it
        got.clear()
        expected_pad[0] = None
        with torch.no_grad():
            each_layer_qk(model, lambda: model(tokens), fn, layers=[1])
        assert list(got) == [1]
        with torch.no_grad():
            each_layer_qk(model, lambda: model(tokens), fn, stop_early=False)
        assert unembedded == [1]
    finally:
        handle.remove()


def test_each_layer_qk_plain_layers_see_hook_q_and_hook_k() -> None:
    model = encoder()
    tokens, pad = padded_tokens(53)
    want = {}
    for i in range(2):
        with torch.no_grad(), trace(model, [f"blocks.{i}.attn.hook_q", f"blocks.{i}.attn.hook_k"]) as t:
            model(tokens, key_padding=pad)
        want[i] = (t["q", i], t["k", i])
    seen = []

    def fn(c: chunked.LayerQK) -> None:
        seen.append(
            (c.layer, torch.equal(c.q, want[c.layer][0]), torch.equal(c.k, want[c.layer][1]), c.is_causal)
        )

    with torch.no_grad():
        each_layer_qk(model, lambda: model(tokens, key_padding=pad), fn)
    assert seen == [(0, True, True, False), (1, True, True, False)]


def test_each_layer_qk_ignores_other_threads_and_names_layers_it_cannot_handle() -> None:
    model = rotary_gqa_decoder(n_layers=1)
    tokens = torch.randint(0, 53, (1, 6))
    other: list[int] = []

    def run() -> None:
        worker = threading.Thread(target=lambda: other.append(model(tokens).shape[1]))
        worker.start()
        worker.join()
        model(tokens)

    seen = []
    with torch.no_grad():
        each_layer_qk(model, run, lambda c: seen.append(c.layer))
    assert other == [6] and seen == [0]
    with pytest.raises(ValueError, match=r"run\(\) never called the attention layers \[0\]"):
        each_layer_qk(model, lambda: None, seen.append)
    with pytest.raises(ValueError, match="layers: 3 is out of range; this model has 1 attention layers"):
        each_layer_qk(model, lambda: None, seen.append, layers=[3])


# ------------------------------------------------------------------------------------------ memory
_PROBE = textwrap.dedent(
    """
    import gc, json, sys
    import torch
    torch.set_num_threads(1)
    from headspace.analysis.chunked import role_values
    from headspace.bench import measure_peak_extra_mib
    out = {}
    for seq in (1024, 4096):
        g = torch.Generator().manual_seed(0)
        q, k = torch.randn(1, seq, 4, 16, generator=g), torch.randn(1, seq, 2, 16, generator=g)
        pad = torch.ones(1, seq, dtype=torch.bool)
        role_values(q[:, :64], k[:, :64], is_causal=True, chunk_size=32)  # warm up
        step = lambda: role_values(q, k, key_padding=pad, is_causal=True, chunk_size=32)  # noqa: E731
        out[seq] = measure_peak_extra_mib(step)
    print(json.dumps(out))
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to read peak RSS")
def test_chunked_peak_memory_grows_with_chunk_times_seq_not_seq_squared() -> None:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    peak = {int(s): v for s, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}
    if peak[4096] is None:
        pytest.skip("peak RSS could not be read")
    full_pattern_mib = 4 * 4096 * 4096 * 4 / 2**20  # one layer's float32 pattern at 4096: 256 MiB
    block_mib = 4 * 32 * 4096 * 4 / 2**20  # one block [1, 4, 32, 4096] float32: 2 MiB
    slack = analysis.chunked.BLOCK_BYTES / 2**20 / 8 + 4  # page counters, the outputs, k's float32 copy
    assert peak[4096] <= 6 * block_mib + slack, peak
    assert peak[4096] < full_pattern_mib / 16, peak
    assert peak[4096] <= 4 * max(peak[1024], 1.0) + slack, peak  # linear in seq (x4), not quadratic (x16)


# ------------------------------------------------------------------------------------------ the benchmark
def _bench_script(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}_script", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_long_inputs_benchmark_smoke_run(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from headspace.bench.scripts import output_path

    module = _bench_script("long_inputs")
    results = module.RESULTS
    assert output_path(None, False, "long_inputs.json", results) == results / "local" / "long_inputs.json"
    assert output_path(None, True, "long_inputs.json", results) == results / "long_inputs.json"
    with pytest.raises(SystemExit):
        module.main(["--save", "--out", str(tmp_path / "x.json")])
    out = tmp_path / "long_inputs.json"
    argv = [
        "--random",
        "--layers",
        "1",
        "--heads",
        "3",
        "--kv-heads",
        "1",
        "--d-model",
        "24",
        "--d-mlp",
        "16",
    ]
    argv += ["--vocab", "50", "--seqs", "40", "24", "--in-process", "--out", str(out)]
    threads = torch.get_num_threads()
    try:
        assert module.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "long_inputs" and [r["seq"] for r in doc["rows"]] == [24, 40]
    for row in doc["rows"]:
        assert {"forward", "chunked", "full"} <= set(row) and row["labels_equal"]
        assert row["max_abs_diff_chunked_vs_full"] < 1e-5 and row["chunked"]["chunk_size"] >= 1
        assert row["chunked_over_forward_time"] == pytest.approx(
            row["chunked"]["time_s"] / row["forward"]["time_s"]
        )
    printed = capsys.readouterr().out
    assert "| seq | forward s |" in printed and f"wrote {out}" in printed


@pytest.mark.parametrize("chunk", [1, 5, 19])
def test_sliding_window_layers_in_the_chunked_statistics_equal_their_traced_patterns(chunk: int) -> None:
    """A Gemma-style model (sliding layers of window 4 beside a full one, QK-norm): every layer's pattern
    rows and role values from each_layer_qk equal the traced hook_pattern, padding included."""
    config = hs.ModelConfig(
        arch="decoder", vocab_size=53, d_model=42, n_layers=3, n_heads=6, n_kv_heads=2, d_head=8, d_mlp=26,
        max_seq_len=64, positions="rotary", norm_kind="rmsnorm", mlp_kind="gated", act="silu", bias=False,
        sliding_window=4, layer_types=["sliding", "full", "sliding"], qk_norm="head",
    )  # fmt: skip
    model = hs.Decoder(config).eval()
    tokens, pad = padded_tokens(53)
    with torch.no_grad(), trace(model, "*.hook_pattern") as t:
        model(tokens, key_padding=pad)
    got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def fn(call: chunked.LayerQK) -> None:
        assert call.window == (None if call.layer == 1 else 4)
        got[call.layer] = (call.pattern_rows(chunk_size=chunk), call.role_values(chunk_size=chunk))

    with torch.no_grad():
        each_layer_qk(model, lambda: model(tokens, key_padding=pad), fn)
    real = pad[:, None, :, None]  # (batch, 1, seq, 1): the real queries
    for i in range(3):
        want = t.pattern(i)
        assert_close(got[i][0] * real, want * real, rtol=0, atol=1e-6)
    assert float(got[0][0][0, :, 10, :7].abs().max()) == 0.0  # 4 back or more: outside the window
