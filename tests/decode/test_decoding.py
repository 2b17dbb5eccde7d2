"""headspace.decode: the cached decoding step described once (describe), run by a backend (Stepper),
the KV caches it writes, generate around it, and the weights prepacked for MKL's GEMM
(headspace.kernels.prepack)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

import headspace.decode.loop as decoding_mod
from headspace import Decoder, ModelConfig
from headspace.decode import (
    KVCache,
    Stepper,
    backend_names,
    choose_pack_rows,
    describe,
    generation_caches,
    product_weights,
    register_backend,
)
from headspace.decode.loop import choose_unembed_rows
from headspace.decode.python import cache_views
from headspace.kernels import prepack

pytestmark = pytest.mark.kernels

B, H, DH, V, L = 3, 7, 5, 13, 2  # batch, n_heads, d_head, vocab, layers: distinct primes
MKL = prepack.prepack_available()

CONFIGS = [
    {},  # GPT-2-like: learned positions, LayerNorm, biases, plain gelu_tanh MLP
    {"positions": "rotary", "norm_kind": "rmsnorm", "mlp_kind": "gated", "act": "silu", "bias": False,
     "n_heads": 6, "n_kv_heads": 2, "d_model": 36},  # Llama-like, grouped-query (d_head 6)
    {"positions": "rotary", "norm_kind": "rmsnorm", "mlp_kind": "gated", "act": "gelu", "bias": True,
     "n_heads": 6, "n_kv_heads": 3, "d_model": 36, "tie_embeddings": False},  # Qwen-like biases, GeGLU
]  # fmt: skip
LLAMA = {"positions": "rotary", "norm_kind": "rmsnorm", "mlp_kind": "gated", "bias": False, "n_heads": 6,
         "d_model": 36}  # fmt: skip
GEMMA_LIKE = [
    # Gemma 3: sandwich norms of 1 + w, QK-norm over d_head, one key/value head, a window of 3 on the
    # first layer (crossed by the 9 positions) with its own rotary base, scaled embeddings and scores;
    # Gemma 2's final-logit soft-capping on top
    {**LLAMA, "act": "gelu_tanh", "norm": "sandwich", "norm_offset": 1.0, "qk_norm": "head",
     "n_kv_heads": 1, "sliding_window": 3, "layer_types": ["sliding", "full"], "rope_local_theta": 100.0,
     "embed_scale": 36**0.5, "query_pre_attn_scalar": 17, "final_softcap": 3.0},
    # OLMo 2: norms after each sublayer only, QK-norm over all heads at once; Mistral's window on both
    {**LLAMA, "act": "silu", "norm": "post_sublayer", "qk_norm": "all", "n_kv_heads": 3, "sliding_window": 4},
    # SmolLM3: a first layer without positions (NoPE), the step's own rotation from the second; a
    # window of 7 that the steps fill (written in place) and then cross (the oldest key dropped)
    {**LLAMA, "act": "silu", "n_kv_heads": 2, "nope_layers": [0], "sliding_window": 7},
]  # fmt: skip
#: the post layout (OPT-350m: a norm after each residual add, no final norm): the Python step only
POST = {"norm": "post", "act": "relu"}
STEP_CONFIGS = CONFIGS + GEMMA_LIKE + [POST]


def decoder(**kw) -> Decoder:
    args = {"vocab_size": V, "d_model": H * DH, "n_layers": L, "n_heads": H, "d_mlp": 11, "max_seq_len": 19}
    return Decoder(ModelConfig(arch="decoder", **{**args, **kw})).eval()


def primed(model: Decoder, seed: int, stacked: bool = False) -> tuple[torch.Tensor, list, list]:
    """Tokens [B, 9] and two KV caches, each holding the model's first 5 positions of them (ours stacked
    in two buffers, as generate makes them, with ``stacked``)."""
    torch.manual_seed(seed)
    tokens = torch.randint(0, V, (B, 9))
    ours = generation_caches(model, B, 9) if stacked else model.make_kv_caches(B, 9)
    ref = model.make_kv_caches(B, 9)
    model(tokens[:, :5], kv_caches=ours)
    model(tokens[:, :5], kv_caches=ref)
    return tokens, ours, ref


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("kw", STEP_CONFIGS)
@torch.no_grad()
def test_plan_logits_are_bit_for_bit_forwards_cached_step(kw: dict, stacked: bool) -> None:
    torch.manual_seed(0)
    model = decoder(**kw)
    with torch.no_grad():  # norms away from their start, so a skipped or swapped one shows
        for name, p in model.named_parameters():
            if "norm" in name or "ln" in name:
                p.add_(torch.randn_like(p) * 0.3)
    tokens, ours, ref = primed(model, 0, stacked)
    windowed = kw.get("sliding_window") is not None
    assert (ours[0].stack is not None) == (stacked and not windowed)  # a window is never stacked
    plan = model.decode_plan()
    assert plan is not None and plan.idle() and plan.step.pack_rows is None
    plan.backend = "python"
    for i in range(5, 9):
        a = plan.logits(tokens[:, i : i + 1], ours)  # (B, V)
        b = model(tokens[:, i : i + 1], kv_caches=ref)[:, -1]  # forward: the blocks themselves
        assert a.shape == (B, V) and torch.equal(a, b) and plan.backend_used == "python"
        for mine, theirs in zip(ours, ref):
            assert torch.equal(mine.k, theirs.k) and torch.equal(mine.v, theirs.v)
            assert mine.length == theirs.length == i + 1 and mine.held == theirs.held
    if windowed:  # the sliding layer's cache held only its window, the full one every position
        assert ours[0].k.shape[2] == kw["sliding_window"] < 9


@pytest.mark.parametrize("kw", STEP_CONFIGS)
def test_generate_with_the_plan_equals_generate_without(kw: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(1)
    model = decoder(**kw)
    prompt = torch.randint(0, V, (B, 4))
    fast = model.generate(prompt, 8, temperature=0)
    sampled = model.generate(prompt, 8, seed=3)
    monkeypatch.setattr(decoding_mod, "describe", lambda *args: None)  # forward only
    assert torch.equal(fast, model.generate(prompt, 8, temperature=0))
    assert torch.equal(sampled, model.generate(prompt, 8, seed=3))
    # the steps ran in inference mode, the result is an ordinary tensor: it trains (an inference
    # tensor could not be saved for the embedding's backward)
    assert not fast.is_inference() and not sampled.is_inference()
    model.train()
    model(fast).logsumexp(-1).sum().backward()
    assert model.tok_embed.weight.grad is not None


def test_a_plan_steps_aside_for_hooks_and_training() -> None:
    """A hook point gaining a function, anywhere a step passes, or train mode: ``idle()`` is False and
    generate runs that step through forward, which fires the hook."""
    model = decoder(**CONFIGS[1])
    plan = model.decode_plan()
    assert plan is not None and plan.idle()
    points = [model.hook_embed, model.blocks[1].hook_resid_mid, model.blocks[0].attn.hook_rot_k]
    points.append(model.blocks[1].mlp.hook_post)
    for point in points:
        remove = point.add(lambda value, hook: None)
        assert not plan.idle() and model.decode_plan() is None
        remove()
        assert plan.idle()
    # a function for the calling thread only: this thread's steps step aside, another thread's do not
    remove = model.blocks[1].attn.hook_z.add(lambda value, hook: None, this_thread=True)
    seen: list[bool] = []
    other = threading.Thread(target=lambda: seen.append(plan.idle()))
    other.start()
    other.join()
    assert not plan.idle() and seen == [True]
    remove()
    assert plan.idle()
    model.train()
    assert not plan.idle() and model.decode_plan() is None


def test_a_hook_added_during_generation_fires_on_the_next_steps() -> None:
    torch.manual_seed(2)
    model = decoder(**CONFIGS[1])
    seen: list[tuple[int | bool, ...]] = []
    added: list = []

    def add_later(value: torch.Tensor, hook) -> None:  # fires in the prompt's forward, then stays off
        if not added:
            added.append(
                model.blocks[0].attn.hook_pattern.add(lambda v, h: seen.append((*v.shape, v.is_inference())))
            )

    remove = model.blocks[1].hook_resid_pre.add(add_later)
    model.generate(torch.randint(0, V, (1, 4)), 4, temperature=0)
    remove()
    added[0]()
    # the prompt (added during its block 1, after block 0 fired) then three one-token steps, which
    # forward runs with ordinary tensors (not the plan's inference mode): a hook may keep them
    assert seen == [(1, 6, 1, 5, False), (1, 6, 1, 6, False), (1, 6, 1, 7, False)]


@pytest.mark.usefixtures("automatic_choices")
def test_choose_pack_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    model = decoder(**CONFIGS[1])
    assert choose_pack_rows(model, 8, False) is None
    assert choose_pack_rows(model, 1, None) is None  # one row: MKL's matrix-vector kernel, no packing
    assert choose_pack_rows(model, 8, None) is None  # a tiny model: below MIN_PACK_BYTES
    monkeypatch.setattr(prepack, "MIN_PACK_BYTES", 0)
    monkeypatch.setattr(prepack, "prepack_available", lambda: True)  # the policy asks it (kernels/policy.py)
    monkeypatch.setattr(prepack, "available_memory_bytes", lambda: 10**12)
    assert choose_pack_rows(model, 8, None) == 8
    nbytes = sum(w.numel() * 4 for w in product_weights(model))
    monkeypatch.setattr(prepack, "available_memory_bytes", lambda: 2 * nbytes - 1)  # the copy must fit twice
    assert choose_pack_rows(model, 8, None) is None
    monkeypatch.setattr(prepack, "available_memory_bytes", lambda: None)  # unknown: do not pack
    assert choose_pack_rows(model, 8, None) is None
    assert choose_pack_rows(model, 8, True) == 8
    with pytest.raises(TypeError, match="prepack must be None"):
        choose_pack_rows(model, 8, "yes")  # type: ignore[arg-type]
    monkeypatch.setattr(prepack, "prepack_available", lambda: False)
    with pytest.raises(ValueError, match="prepack=True needs torch's MKL packed linear"):
        model.generate(torch.zeros(2, 3, dtype=torch.long), 2, prepack=True)


@pytest.mark.usefixtures("automatic_choices")
@torch.no_grad()
def test_at_batch_1_a_large_unembedding_alone_is_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    model = decoder(**GEMMA_LIKE[0])
    assert choose_unembed_rows(model, 1, None) is None  # a tiny model: below MIN_PACK_BYTES
    monkeypatch.setattr(prepack, "MIN_PACK_BYTES", 0)
    monkeypatch.setattr(prepack, "prepack_available", lambda: True)
    monkeypatch.setattr(prepack, "available_memory_bytes", lambda: 10**12)
    assert choose_unembed_rows(model, 1, None) == 1
    assert choose_unembed_rows(model, 2, None) is None  # batches pack every product (choose_pack_rows)
    assert choose_unembed_rows(model, 1, False) is None and choose_unembed_rows(model, 1, True) is None
    monkeypatch.setattr(prepack, "available_memory_bytes", lambda: None)  # unknown: do not pack
    assert choose_unembed_rows(model, 1, None) is None
    if not MKL:
        return
    step = describe(model, None, 1)
    assert step is not None and step.unembed.kind == "packed" and step.unembed.rows == 1
    assert {layer.qkv.kind for layer in step.layers} == {"float32"}  # the blocks stay plain
    torch.manual_seed(5)
    tokens = torch.randint(0, V, (1, 9))
    ours, ref = model.make_kv_caches(1, 9), model.make_kv_caches(1, 9)
    model(tokens[:, :5], kv_caches=ours)
    model(tokens[:, :5], kv_caches=ref)
    run = Stepper(step, "python")
    for i in range(5, 9):
        a = run.logits(tokens[:, i : i + 1], ours)
        torch.testing.assert_close(a, model(tokens[:, i : i + 1], kv_caches=ref)[:, -1], rtol=1e-5, atol=1e-5)


def test_product_weights_are_every_product_of_a_step() -> None:
    model = decoder(**CONFIGS[2])
    weights = product_weights(model)
    assert len(weights) == L * 5 + 1  # qkv, W_O, gate, in, out per block; the untied unembedding
    assert weights[-1] is model.lm_head.weight and weights[0] is model.blocks[0].attn.qkv_weight


@pytest.mark.skipif(not MKL, reason="this torch has no MKL packed linear (torch.ops.mkl._mkl_linear)")
@pytest.mark.parametrize("rows", [2, 3, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear_to_rounding(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    w, b = torch.randn(37, 23), (torch.randn(37) if bias else None)
    f = prepack.packed_linear_fn(w, b, rows)
    for n in (rows, 1, rows + 1):  # other row counts fall back inside the op
        x = torch.randn(n, 23)
        torch.testing.assert_close(f(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not MKL, reason="this torch has no MKL packed linear (torch.ops.mkl._mkl_linear)")
@pytest.mark.parametrize("kw", STEP_CONFIGS)
@torch.no_grad()
def test_prepacked_steps_equal_forward_to_rounding(kw: dict) -> None:
    torch.manual_seed(4)
    model = decoder(**kw)
    tokens, ours, ref = primed(model, 4)
    plan = model.decode_plan(pack_rows=B)
    assert isinstance(plan, Stepper) and plan.step.pack_rows == B
    assert {layer.qkv.kind for layer in plan.step.layers} == {"packed"}
    for i in range(5, 9):
        a = plan.logits(tokens[:, i : i + 1], ours)
        torch.testing.assert_close(a, model(tokens[:, i : i + 1], kv_caches=ref)[:, -1], rtol=1e-5, atol=1e-5)
    prompt = torch.randint(0, V, (B, 4))
    assert torch.equal(
        model.generate(prompt, 8, temperature=0, prepack=True),
        model.generate(prompt, 8, temperature=0, prepack=False),
    )


@torch.no_grad()
def test_compile_true_is_accepted_and_warns_that_it_is_ignored() -> None:
    """generate(compile=True), kept for code written for earlier versions: a FutureWarning, then the
    default step's tokens."""
    torch.manual_seed(5)
    model = decoder(**CONFIGS[1])
    prompt = torch.randint(0, V, (B, 4))
    ref = model.generate(prompt, 8, temperature=0)
    with pytest.warns(FutureWarning, match=r"compile=True\) is ignored"):
        assert torch.equal(model.generate(prompt, 8, temperature=0, compile=True), ref)
    with pytest.raises(TypeError, match="compile must be a bool"):
        model.generate(prompt, 2, compile="yes")  # type: ignore[arg-type]


def test_stacked_caches_are_caches_of_their_own() -> None:
    """KVCache.stacked: layer i's cache is slice i of two buffers and appends, checks and overflows as a
    cache of its own; a step takes every layer's views at once only for the whole stack, in order, at
    one length, without autograd history."""
    torch.manual_seed(3)
    caches = KVCache.stacked(L + 1, B, 2, DH, 7)
    alone = [KVCache(B, 2, DH, 7) for _ in range(L + 1)]
    k_all, v_all, _ = caches[0].stack
    assert k_all.shape == (L + 1, B, 2, 7, DH) and [c.stack[2] for c in caches] == list(range(L + 1))
    for step in range(3):
        for i, (c, a) in enumerate(zip(caches, alone)):
            k, v = torch.randn(B, 2, 1, DH), torch.randn(B, 2, 1, DH)
            got = c.append_one(k, v) if step else c.append(k, v)
            want = a.append(k, v)
            assert all(torch.equal(x, y) for x, y in zip(got, want))
            assert torch.equal(k_all[i], a.k) and c.k.data_ptr() == k_all[i].data_ptr()
            assert torch.equal(v_all[i], a.v) and c.v.data_ptr() == v_all[i].data_ptr()
    with pytest.raises(ValueError, match="overflow"):
        caches[1].append(torch.randn(B, 2, 5, DH), torch.randn(B, 2, 5, DH))
    with pytest.raises(ValueError, match="batch"):
        caches[1].check(B + 1, 1, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="n must be a positive"):
        KVCache.stacked(0, B, 2, DH, 7)
    with torch.no_grad():
        for some in (caches, caches[::-1], caches[:-1], alone):  # the stack in order, or not
            views = cache_views(some, 3)
            assert len(views) == len(some)
            for (k_slot, v_slot, k, v), c in zip(views, some):
                assert k_slot.shape == (B, 2, 1, DH) and k.shape == (B, 2, 4, DH)
                assert k_slot.data_ptr() == c.k[:, :, 3:].data_ptr() and k.data_ptr() == c.k.data_ptr()
                assert v_slot.data_ptr() == c.v[:, :, 3:].data_ptr() and torch.equal(v, c.v[:, :, :4])


def test_generate_decodes_into_stacked_caches_when_the_blocks_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    model = decoder(**CONFIGS[1])
    caches = generation_caches(model, 2, 11)
    assert len(caches) == L and all(c.stack is not None and c.capacity == 11 for c in caches)
    made: list = []
    real = generation_caches
    monkeypatch.setattr(
        "headspace.decode.loop.generation_caches", lambda *a: made.append(real(*a)) or made[-1]
    )
    prompt = torch.randint(0, V, (2, 4))
    fast = model.generate(prompt, 6, temperature=0)
    assert made and made[0][0].stack is not None
    monkeypatch.setattr(  # each block's own cache: the same tokens
        "headspace.decode.loop.generation_caches",
        lambda m, b, c: [x.attn.make_kv_cache(b, c) for x in m.blocks],
    )
    assert torch.equal(model.generate(prompt, 6, temperature=0), fast)


def test_stacked_layers_start_on_64_byte_boundaries_as_caches_of_their_own() -> None:
    """MKL's products inside attention may sum in another order at another alignment (seen on AMD
    CPUs): every layer's slice of the stacked buffers is aligned as a buffer of its own is."""
    caches = KVCache.stacked(3, 2, 3, 5, 7)  # 2 x 3 x 7 x 5 floats a layer: 840 bytes, not a multiple of 64
    k_all, v_all, _ = caches[0].stack  # type: ignore[misc]
    assert k_all.shape == (3, 2, 3, 7, 5)
    for i, cache in enumerate(caches):
        assert cache.k.is_contiguous() and cache.k.data_ptr() % 64 == 0 and cache.v.data_ptr() % 64 == 0
        assert cache.k.data_ptr() == k_all[i].data_ptr()
    assert not k_all.any() and not v_all.any()


def test_a_forced_prepack_fallback_turns_the_automatic_choice_off() -> None:
    from headspace.kernels import cpu

    weights = [torch.empty(3000, 3000)]  # 36 MB of float32: past MIN_PACK_BYTES
    if not prepack.should_prepack(weights, 8):
        pytest.skip("no MKL packed linear, or too little memory, here: the choice is off already")
    with cpu.force_fallback("prepack"):
        assert not prepack.should_prepack(weights, 8)
    assert prepack.should_prepack(weights, 8)


def test_the_backend_registry_has_one_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    """Backends are registered by name, ``prepare(step) -> run | None``; generate(backend=...) runs the
    one named, and refuses unknown names and contradictions by name."""
    import headspace.decode.backends as backends_mod
    from headspace.decode import python

    assert backend_names()[:2] == ("python", "native")
    calls: list[int] = []

    def counting(step):  # a backend of a user's: the Python step, counted
        run = python.prepare(step)
        return lambda x, caches, start, cos, sin: calls.append(start) or run(x, caches, start, cos, sin)

    monkeypatch.setitem(backends_mod._BACKENDS, "counting", counting)
    assert "counting" in backend_names()
    torch.manual_seed(6)
    model = decoder(**CONFIGS[1])
    prompt = torch.randint(0, V, (B, 4))
    ref = model.generate(prompt, 6, temperature=0, backend="python")
    assert torch.equal(model.generate(prompt, 6, temperature=0, backend="counting"), ref)
    assert calls == [4, 5, 6, 7, 8]  # every step after the prompt's (the last token needs no step)
    with pytest.raises(ValueError, match=r"backend must be one of \['python', 'native', 'counting'\]"):
        model.generate(prompt, 2, backend="fast")
    with pytest.raises(ValueError, match="backend='python' contradicts native=True"):
        model.generate(prompt, 2, backend="python", native=True)
    with pytest.raises(TypeError, match="a backend's name must be a non-empty str"):
        register_backend("", counting)


def test_describe_names_every_part_and_refuses_blocks_without_a_step() -> None:
    """The step's description is the model's parameters themselves, each a named field; a post-norm
    block's step is the Python backend's only (no native form), as is a block with score
    soft-capping."""
    from headspace.decode import named_fields

    model = decoder(**CONFIGS[2])
    step = describe(model)
    assert step is not None and len(step.layers) == L
    layer = step.layers[1]
    assert layer.qkv.weight is model.blocks[1].attn.qkv_weight and layer.qkv.kind == "float32"
    assert layer.norm1.kind == "rmsnorm" and layer.activation == "gelu" and layer.gate is not None
    tensors, ints, floats, texts = named_fields(layer)  # type: ignore[misc]
    assert tensors["qkv.bias"] is model.blocks[1].attn.qkv_bias and tensors["fc_out.weight"] is not None
    assert ints["n_heads"] == 6 and ints["n_kv_heads"] == 3 and ints["rotary.dim"] == 6
    assert floats["scale"] == pytest.approx(6**-0.5) and texts["rotary.kind"] == "half"
    assert "gate.packed" not in tensors  # None values are left out
    int8 = decoder(**CONFIGS[1]).to_precision("int8")
    int8_step = describe(int8)
    assert int8_step is not None and int8_step.layers[0].qkv.kind == "other"
    assert named_fields(int8_step.layers[0]) is None  # no native form: the Python step runs it
    capped = decoder(**LLAMA, attn_softcap=5.0)
    capped_step = describe(capped)
    assert capped_step is not None and capped.decode_plan() is not None
    assert [x.softcap for x in capped_step.layers] == [5.0] * L
    assert named_fields(capped_step.layers[0]) is None  # no native form: the Python step runs it
    post = decoder(**POST)  # the post layout: a step, the Python backend's only
    post_step = describe(post)
    assert post_step is not None and post.decode_plan() is not None
    assert [x.post for x in post_step.layers] == [True] * L and post_step.final_norm is None
    assert post_step.layers[0].norm1.weight is post.blocks[0].ln1.weight  # type: ignore[union-attr]
    assert named_fields(post_step.layers[0]) is None  # no native form: the Python step runs it
    prompt = torch.randint(0, V, (B, 4))
    assert torch.equal(
        post.generate(prompt, 3, temperature=0), post.generate(prompt, 3, temperature=0, use_cache=False)
    )
