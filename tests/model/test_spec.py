"""The block description (headspace.nn.spec): every executor reads it, and refuses by name what it lacks.

A description edited by hand (a window set) must change the forward, the Python decoding step and the
circuit runner alike: each is compared with the same weights in a model built with that window from
the start.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import headspace as hs
from headspace.analysis.graph import graph_of, run_graph
from headspace.decode import describe, native, python
from headspace.decode.backends import Stepper
from headspace.model.block import TransformerBlock
from headspace.nn.spec import AttentionSpec, BlockSpec, MLPSpec, NormSpec

V, S, WINDOW = 40, 9, 3


def llama_like(**extra: object) -> hs.ModelConfig:
    fields: dict[str, object] = dict(
        arch="decoder", vocab_size=V, d_model=24, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32,
        positions="rotary", norm_kind="rmsnorm", mlp_kind="gated", act="silu", bias=False,
    )  # fmt: skip
    fields.update(extra)
    return hs.ModelConfig(**fields)  # type: ignore[arg-type]


def edited_and_built() -> tuple[hs.Decoder, hs.Decoder]:
    """(a model whose blocks' window was set by editing their spec, the same weights built windowed)."""
    torch.manual_seed(0)
    edited = hs.Decoder(llama_like()).eval()
    built = hs.Decoder(llama_like(sliding_window=WINDOW)).eval()
    built.load_state_dict(edited.state_dict())
    for block in edited.blocks:
        block.spec = dataclasses.replace(
            block.spec, attention=dataclasses.replace(block.spec.attention, window=WINDOW)
        )
    return edited, built


def test_an_edited_window_changes_the_forward() -> None:
    edited, built = edited_and_built()
    tokens = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    unedited = hs.Decoder(llama_like()).eval()
    with torch.no_grad():
        got, want, before = edited(tokens), built(tokens), unedited(tokens)
    assert torch.equal(got, want)
    assert not torch.equal(got, before)  # the window matters at this length
    assert all(b.attn.window == WINDOW and b.spec.attention.window == WINDOW for b in edited.blocks)


def test_an_edited_window_changes_the_python_decoding_step() -> None:
    edited, built = edited_and_built()
    step = describe(edited)
    assert step is not None and all(layer.window == WINDOW for layer in step.layers)
    tokens = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(2))
    outs = []
    for model in (edited, built):
        stepper = Stepper(describe(model), backend="python")  # type: ignore[arg-type]
        caches = model.make_kv_caches(2, 16)
        with torch.no_grad():
            model(tokens[:, :-1], kv_caches=caches)  # the prompt by forward, then one step
            outs.append(stepper.logits(tokens[:, -1:], caches))
        assert stepper.backend_used == "python"
    assert torch.equal(outs[0], outs[1])
    caches = built.make_kv_caches(2, 16)
    with torch.no_grad():
        built(tokens[:, :-1], kv_caches=caches)
        assert torch.equal(outs[0], built(tokens[:, -1:], kv_caches=caches)[:, -1])  # the cached forward's
        torch.manual_seed(0)
        unwindowed = hs.Decoder(llama_like()).eval()(tokens)[:, -1]
    assert not torch.allclose(outs[0], unwindowed, rtol=1e-4, atol=1e-4)  # the window matters here


def test_an_edited_window_changes_the_circuit_runner() -> None:
    edited, built = edited_and_built()
    tokens = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(3))
    last = torch.full((2,), S - 1)
    with torch.no_grad():
        got = run_graph(edited, graph_of(edited), edited.embed(tokens), last).logits
        want = run_graph(built, graph_of(built), built.embed(tokens), last).logits
        forward = built(tokens)[:, -1]
    assert torch.equal(got, want)
    torch.testing.assert_close(got, forward, rtol=1e-5, atol=1e-5)  # the runner's own maths, windowed


def test_from_spec_is_the_keyword_constructor() -> None:
    kw = dict(d_head=8, n_kv_heads=2, act="silu", norm="sandwich", norm_kind="rmsnorm", mlp_kind="gated")
    torch.manual_seed(4)
    block = TransformerBlock(32, 4, 48, window=5, qk_norm="head", norm_offset=1.0, **kw)  # type: ignore[arg-type]
    twin = TransformerBlock.from_spec(block.spec)
    assert twin.spec == block.spec
    twin.load_state_dict(block.state_dict())
    x = torch.randn(2, 7, 32)
    assert torch.equal(block(x), twin(x))
    config = llama_like(sliding_window=4)
    model = hs.Decoder(config)
    assert [b.spec for b in model.blocks] == [
        config.block_spec(i, b.attn.rotary) for i, b in enumerate(model.blocks)
    ]
    assert model.blocks[0].attn.rotary is model.blocks[1].attn.rotary  # one rotation, shared


def test_hook_points_for_the_inputs_analyses_read() -> None:
    torch.manual_seed(5)
    model = hs.Decoder(llama_like()).eval()
    tokens = torch.randint(0, V, (1, S))
    seen: dict[str, torch.Tensor] = {}
    names = ["blocks.1.hook_resid_pre", "blocks.1.hook_attn_in", "blocks.1.hook_resid_mid"]
    names += ["blocks.1.hook_mlp_in", "blocks.1.hook_resid_post", "hook_resid_final"]
    points = dict(model.named_modules())
    removers = [points[n].add(lambda t, hook, n=n: seen.setdefault(n, t.detach())) for n in names]
    with torch.no_grad():
        logits = model(tokens)
    for remove in removers:
        remove()
    block = model.blocks[1]
    assert torch.equal(seen["blocks.1.hook_attn_in"], block.ln1(seen["blocks.1.hook_resid_pre"]))
    assert torch.equal(seen["blocks.1.hook_mlp_in"], block.ln2(seen["blocks.1.hook_resid_mid"]))
    assert torch.equal(seen["hook_resid_final"], seen["blocks.1.hook_resid_post"])
    assert torch.equal(logits, model.unembed(model.ln_final(seen["hook_resid_final"])))


def sink_spec(spec: BlockSpec) -> BlockSpec:
    return dataclasses.replace(spec, attention=dataclasses.replace(spec.attention, sink="learned"))


def chunk_spec(spec: BlockSpec) -> BlockSpec:
    return dataclasses.replace(spec, attention=dataclasses.replace(spec.attention, chunk=4))


def test_each_executor_refuses_a_field_it_lacks_by_name() -> None:
    torch.manual_seed(6)
    model = hs.Decoder(llama_like()).eval()
    block = model.blocks[0]
    with pytest.raises(ValueError, match="the block forward does not support the attention field 'chunk'"):
        TransformerBlock.from_spec(chunk_spec(block.spec))
    before = block.spec
    # the forward computes output gates (issue #39), but only where the layer has the gate's weights
    with pytest.raises(ValueError, match="gate is None must be True, fixed by the layer's weights"):
        block.spec = dataclasses.replace(
            before, attention=dataclasses.replace(before.attention, gate="headwise")
        )
    assert block.spec == before  # a refused description changes nothing
    step = describe(model)
    assert step is not None
    # a step whose description carries a sink (as a future block's would): each backend names it
    layers = tuple(dataclasses.replace(layer, spec=sink_spec(layer.spec)) for layer in step.layers)  # type: ignore[arg-type]
    sunk = dataclasses.replace(step, layers=layers)
    with pytest.raises(
        ValueError, match="the native decoding step does not support the attention field 'sink'"
    ):
        native.native_form(sunk)
    with pytest.raises(
        ValueError, match="the Python decoding step does not support the attention field 'sink'"
    ):
        python.prepare(sunk)
    # the description a block reads is the one describe reads: set below the block's own check
    block.attn._spec = chunk_spec(block.spec).attention
    with pytest.raises(ValueError, match="the decoding step does not support the attention field 'chunk'"):
        describe(model)
    qk = hs.Decoder(llama_like(qk_norm="head"))
    with pytest.raises(
        ValueError, match="the circuit runner \\(block 0\\) does not support the attention field 'qk_norm'"
    ):
        graph_of(qk)


def test_a_description_must_fit_the_weights() -> None:
    block = TransformerBlock(16, 4, 32, norm="pre")
    spec = block.spec
    with pytest.raises(
        ValueError, match="n_heads \\* d_head must be 16, fixed by the layer's weights; got 32"
    ):
        block.spec = dataclasses.replace(spec, attention=dataclasses.replace(spec.attention, d_head=8))
    with pytest.raises(
        ValueError, match=r"mlp\.kind must be 'plain', fixed by the block's modules; got 'gated'"
    ):
        block.spec = dataclasses.replace(spec, mlp=dataclasses.replace(spec.mlp, kind="gated"))
    with pytest.raises(ValueError, match="layout == 'sandwich' must be False"):
        block.spec = dataclasses.replace(spec, layout="sandwich")
    assert block.spec == spec
    block.spec = dataclasses.replace(spec, layout="post")  # the same modules, another residual layout
    x = torch.randn(1, 3, 16)
    post = TransformerBlock(16, 4, 32, norm="post")
    post.load_state_dict(block.state_dict())
    assert torch.equal(block(x), post(x))


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: NormSpec("batchnorm"),
            "NormSpec.kind must be one of \\['layernorm', 'rmsnorm'\\]; got 'batchnorm'",
        ),
        (lambda: NormSpec("layernorm", offset=1.0), "NormSpec.offset must be 0 for a LayerNorm"),
        (
            lambda: AttentionSpec(16, 4, 4, 3),
            "AttentionSpec.n_kv_heads must be a divisor of n_heads=4; got 3",
        ),
        (
            lambda: AttentionSpec(16, 4, 4, 4, window=0),
            "AttentionSpec.window must be None or a positive int; got 0",
        ),
        (
            lambda: AttentionSpec(16, 4, 4, 4, sink="yes"),
            "AttentionSpec.sink must be None or one of \\['learned'\\]",
        ),
        (lambda: MLPSpec(0), "MLPSpec.d_mlp must be a positive int; got 0"),
        (lambda: MLPSpec(8, act="tanh"), "MLPSpec.act must be one of"),
        (
            lambda: BlockSpec(AttentionSpec(16, 4, 4, 4), MLPSpec(8), layout="side"),
            "BlockSpec.layout must be one of",
        ),
    ],
)
def test_bad_descriptions_name_the_field(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()  # type: ignore[operator]


def test_the_parallel_layout_runs_both_sublayers_on_the_block_input() -> None:
    """layout "parallel" (GPT-NeoX): out = x + Attn(ln1(x)) + MLP(ln2(x)), in the block forward."""
    torch.manual_seed(7)
    model = hs.Decoder(llama_like()).eval()
    block = model.blocks[0]
    block.spec = dataclasses.replace(block.spec, layout="parallel")
    x = torch.randn(2, 5, block.d_model)
    with torch.no_grad():
        want = x + block.attn(block.ln1(x), is_causal=True) + block.mlp(block.ln2(x))
        torch.testing.assert_close(block(x, is_causal=True), want, rtol=0, atol=1e-6)
