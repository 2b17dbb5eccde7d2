"""The explorer on a model with learned sinks (a tiny gpt-oss built by transformers): the page data carries
each layer's sink logits, and the page (headless Chromium) draws each row's key weights with the sink in
the softmax, labels the sink's mass, and both equal hook_pattern / hook_sink of the same forward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

import headspace as hs
from headspace.viz.explorer import Explorer

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, H, DH, DM, E, K, W, SEQ = 37, 24, 2, 4, 6, 10, 3, 2, 8, 6  # SEQ <= W: a causal mask everywhere


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A random gpt-oss saved by transformers (every parameter random, the sinks too), read back."""
    folder: Path = tmp_path_factory.mktemp("gpt_oss")
    torch.manual_seed(7)
    config = T.GptOssConfig(
        vocab_size=V, hidden_size=D, intermediate_size=DM, num_hidden_layers=L, num_attention_heads=H,
        num_key_value_heads=2, head_dim=DH, num_local_experts=E, num_experts_per_tok=K, sliding_window=W,
        max_position_embeddings=32, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, pad_token_id=0, eos_token_id=None,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = T.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1.0 if ("router" in name or "sinks" in name) else 0.3
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else scale * torch.randn_like(p))
    model.save_pretrained(folder)
    return hs.load(folder).model


def traced(model: Any, toks: torch.Tensor) -> Any:
    with torch.no_grad(), hs.trace(model, names=["*.hook_pattern", "*.hook_sink"]) as t:
        model(toks)
    return t


def test_page_data_carries_each_layers_sink_logits(gpt_oss: Any) -> None:
    toks = torch.randint(3, V, (1, SEQ))
    data = Explorer(gpt_oss, toks, precision="float32").data
    for i, layer in enumerate(data["layers"]):
        assert layer["sinks"] == [float(x) for x in gpt_oss.blocks[i].attn.sinks.detach()]
    rotary = hs.Decoder(
        hs.ModelConfig(
            arch="decoder", vocab_size=V, d_model=D, n_layers=1, n_heads=H, d_mlp=DM, max_seq_len=16
        )
    ).eval()
    assert Explorer(rotary, toks).data["layers"][0]["sinks"] is None  # a model without sinks: None


@pytest.mark.slow
def test_page_draws_key_weights_and_the_sink_mass_in_chromium(
    gpt_oss: Any, browser: Any, tmp_path: Path
) -> None:
    toks = torch.randint(3, V, (1, SEQ))
    path = Explorer(gpt_oss, toks, precision="float32").save(tmp_path / "sinks.html")
    t = traced(gpt_oss, toks)
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(path.as_uri())
        page.wait_for_selector("body[data-ready='true']", timeout=30_000)
        for layer, head, token in ((0, 1, 5), (1, 3, 2)):
            page.evaluate(
                f"window.headspaceExplorer.select({{layer: {layer}, head: {head}, token: {token}}})"
            )
            snap = page.evaluate("window.headspaceExplorer.snapshot()")
            want = t.pattern(layer)[0, head, token]  # (SEQ,): the key weights
            sink = float(t[f"blocks.{layer}.attn.hook_sink"][0, head, token])
            torch.testing.assert_close(
                torch.tensor(snap["weights"], dtype=torch.float64), want.double(), atol=1e-5, rtol=0
            )
            assert snap["sink"] == pytest.approx(sink, abs=1e-5) and 0.0 < sink < 1.0
            shown = float(snap["scoresNote"].split(" takes ")[1].split(" ")[0])  # the label's sink mass
            assert shown == pytest.approx(sink, abs=1e-4)
            assert "the key weights sum to 1 - sink" in page.inner_text("#scores-note")
            s_h = float(gpt_oss.blocks[layer].attn.sinks.detach()[head])
            assert f"H{head} {s_h:.3f}" in page.inner_text("#heads-note")  # the shown head's s_h
    finally:
        page.close()
    assert not errors
