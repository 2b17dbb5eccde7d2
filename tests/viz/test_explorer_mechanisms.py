"""The explorer on output gates (a tiny Qwen3-Next) and differential attention (a tiny DiffLlama), both
built and saved by transformers 5.25 and read back by ``headspace.load``.

The page's own JavaScript (explorer_mechanisms.js and explorer.js's ``kvHead`` ... ``compute`` block, run
by node on the page's stored arrays) must give back the model's ``hook_z`` and ``hook_result`` (the gated
z and each head's or pair's part), the layer's output and each pair's ``hook_diff_pattern``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers as T

import headspace as hs
from headspace.viz.explorer import Explorer
from headspace.viz.explorer.data import unpack

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.skipif(  # CI sets HEADSPACE_REQUIRE_BROWSER and installs node: a missing one fails there
        shutil.which("node") is None and not os.environ.get("HEADSPACE_REQUIRE_BROWSER"),
        reason="node is not installed: the page's JS cannot run",
    ),
]

ASSETS = Path(__file__).parents[2] / "src/headspace/viz/explorer/assets"
SEQ = 7
HOOKS = {"hook_z", "hook_result", "hook_diff_pattern", "hook_z_normed", "hook_attn_out"}


def _randomise(model: Any, lam: float) -> None:
    """Every parameter random (norms around 1, gates and lambdas at a scale where they matter)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_((lam if "lambda" in name else 0.3) * torch.randn_like(p))


def _load(folder: Path, model: Any, lam: float = 0.3) -> Any:
    _randomise(model, lam)
    model.save_pretrained(folder)
    return hs.load(folder).model


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Qwen3-Next with one gated full-attention layer (block 3) after three Gated DeltaNet layers."""
    torch.manual_seed(3)
    config = T.Qwen3NextConfig(
        vocab_size=61, hidden_size=24, intermediate_size=20, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=6, partial_rotary_factor=1 / 3, linear_num_key_heads=2,
        linear_num_value_heads=6, linear_key_head_dim=5, linear_value_head_dim=7, linear_conv_kernel_dim=3,
        num_experts=5, num_experts_per_tok=2, moe_intermediate_size=9, shared_expert_intermediate_size=11,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return _load(tmp_path_factory.mktemp("qwen3_next"), T.Qwen3NextForCausalLM(config).eval())


@pytest.fixture(scope="module")
def diffllama(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """DiffLlama with 6 query heads (3 pairs) over 2 key/value heads, lambda away from lambda_init."""
    torch.manual_seed(0)
    config = T.DiffLlamaConfig(
        vocab_size=71, hidden_size=36, intermediate_size=22, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=6, max_position_embeddings=64, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=None,
    )  # fmt: skip
    return _load(tmp_path_factory.mktemp("diffllama"), T.DiffLlamaForCausalLM(config).eval(), lam=0.5)


def _page_js(layer: dict, tmp_path: Path) -> list[dict[str, Any]]:
    """The page's ``compute(0, h, t)`` for every head and token of ``layer``, run by node."""
    src = (ASSETS / "explorer.js").read_text(encoding="utf-8")
    body = re.search(
        r"  function kvHead.*?\n    return \{ L, scores, weights, sink, top, z[^}]*\};\n  \}\n", src, re.S
    )
    assert body is not None, "explorer.js's kvHead ... compute block moved"
    meta = {k: v for k, v in layer.items() if k not in ("q", "k", "v", "W_O", "b_O", "overlap")}
    arrays = {k: unpack(layer[k]).ravel().tolist() for k in ("q", "k", "v", "W_O")}
    for key in ("gate", "gate_mean", "diff_maps"):
        if key in layer:
            arrays[key] = unpack(layer[key]).ravel().tolist()
    script = (
        f"const SEQ = {SEQ}; const meta = {json.dumps(meta)}; const A = {json.dumps(arrays)};\n"
        "const F = (x) => (x ? Float32Array.from(x) : null);\n"
        "const decode = (a) => F(A[Object.keys(meta).find((k) => meta[k] === a)]);\n"
        + (ASSETS / "explorer_mechanisms.js").read_text(encoding="utf-8")
        + "\nconst L = { meta, H: meta.n_heads, Hkv: meta.n_kv_heads, dh: meta.d_head, dm: meta.d_model,"
        " q: F(A.q), k: F(A.k), v: F(A.v), WO: F(A.W_O), bO: null, ...mechanismArrays(meta, decode) };\n"
        "const layerData = () => L;\n" + body.group(0) + "\nconst out = [];\n"
        "for (let h = 0; h < L.H; h++) for (let t = 0; t < SEQ; t++) { const r = compute(0, h, t);"
        " out.push({ h, t, z: Array.from(r.z), concat: Array.from(r.concat), contrib: Array.from(r.contrib),"
        " out: Array.from(r.out), diff: r.diff ? Array.from(r.diff) : null, pair: r.pair ?? null }); }\n"
        "console.log(JSON.stringify(out));"
    )
    path = tmp_path / "page_compute.js"
    path.write_text(script, encoding="utf-8")
    res = subprocess.run(["node", str(path)], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(res.stdout)


def _traced(model: Any, toks: torch.Tensor) -> Any:
    with torch.no_grad(), hs.trace(model, names=lambda n: n.rsplit(".", 1)[-1] in HOOKS) as t:
        model(toks)
    return t


def close(got: list[float], want: torch.Tensor, atol: float = 1e-5) -> None:
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float64), want.double(), atol=atol, rtol=max(atol, 1e-5)
    )


def test_the_page_gates_z_and_shows_each_heads_gate(qwen3_next: Any, tmp_path: Path) -> None:
    toks = torch.randint(3, 61, (1, SEQ), generator=torch.Generator().manual_seed(1))  # (1, SEQ)
    (layer,) = Explorer(qwen3_next, toks, precision="float32").data["layers"]  # block 3, the softmax layer
    t = _traced(qwen3_next, toks)
    z, result = t["blocks.3.attn.hook_z"][0], t["blocks.3.attn.hook_result"][0]  # (S, H, dh), (S, H, dm)
    out = t["blocks.3.hook_attn_out"][0]  # (S, d_model)
    gate = torch.from_numpy(unpack(layer["gate"]).copy())  # (S, H, dh)
    assert float((gate - 1).abs().mean()) > 0.1  # far from 1: an ungated z fails below
    for r in _page_js(layer, tmp_path):
        h, i = r["h"], r["t"]
        close(r["z"], z[i, h])  # hook_z: the gated z
        close(r["contrib"], result[i, h])  # z_h W_O[h]
        close(r["out"], out[i])


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_the_page_draws_each_pairs_difference_map_and_output(
    diffllama: Any, tmp_path: Path, precision: str
) -> None:
    toks = torch.randint(3, 71, (1, SEQ), generator=torch.Generator().manual_seed(2))  # (1, SEQ)
    data = Explorer(diffllama, toks, precision=precision).data
    t = _traced(diffllama, toks)
    tol = 1e-5 if precision == "float32" else 1e-2  # float16: 3 digits
    for i, layer in enumerate(data["layers"]):
        attn = diffllama.blocks[i].attn
        D = layer["differential"]
        assert D["n_pairs"] == 3 and D["lambda"] == pytest.approx(float(attn.lambda_full().detach()))
        assert abs(D["lambda"] - D["lambda_init"]) > 0.05  # lambda matters
        assert D["recomputed"] is (precision == "float32")
        assert ("stored" in D["label"]) is (precision == "float16")
        diff = t[f"blocks.{i}.attn.hook_diff_pattern"][0]  # (P, S, S)
        z, normed = t[f"blocks.{i}.attn.hook_z"][0], t[f"blocks.{i}.attn.hook_z_normed"][0]  # (S, H|P, 2dh)
        result, out = t[f"blocks.{i}.attn.hook_result"][0], t[f"blocks.{i}.hook_attn_out"][0]  # (S, P, dm)
        np.testing.assert_allclose(unpack(layer["diff_maps"]), diff.numpy(), atol=tol)
        norms = result.norm(dim=-1)  # (S, P): each pair's part
        shares = unpack(layer["shares"])  # (S, H): each head shows its pair's share
        np.testing.assert_allclose(
            shares, (norms / norms.sum(-1, keepdim=True))[:, [0, 1, 2, 0, 1, 2]], atol=1e-6
        )
        for r in _page_js(layer, tmp_path):
            h, s = r["h"], r["t"]
            assert r["pair"] == h % 3
            close(r["diff"], diff[h % 3, s], tol)
            close(r["z"], z[s, h], tol)
            close(r["concat"], normed[s].flatten(), 50 * tol)  # the norm divides by a small rms
            close(r["contrib"], result[s, h % 3], 50 * tol)
            close(r["out"], out[s], 50 * tol)


@pytest.mark.slow
def test_the_page_draws_gates_and_difference_maps_in_chromium(
    qwen3_next: Any, diffllama: Any, browser: Any, tmp_path: Path
) -> None:
    """The whole page (headless Chromium): the pipeline's z is the gated hook_z and its gate line shows
    the gate; on DiffLlama it draws the pair's map, whose row equals hook_diff_pattern."""
    for model, block, layer, vocab in [(qwen3_next, "blocks.3", 0, 61), (diffllama, "blocks.1", 1, 71)]:
        toks = torch.randint(3, vocab, (1, SEQ), generator=torch.Generator().manual_seed(4))  # (1, SEQ)
        explorer = Explorer(model, toks, precision="float32")
        path = explorer.save(tmp_path / f"{vocab}.html")
        t = _traced(model, toks)
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e, errors=errors: errors.append(str(e)))
        try:
            page.goto(path.as_uri())
            page.wait_for_selector("body[data-ready='true']", timeout=30_000)
            page.evaluate(f"window.headspaceExplorer.select({{layer: {layer}, head: 2, token: 5}})")
            snap = page.evaluate("window.headspaceExplorer.snapshot()")
            close(snap["z"], t[f"{block}.attn.hook_z"][0, 5, 2])
            note = page.inner_text("#heads-note")
            if "gate" in explorer.data["layers"][layer]:
                want = torch.from_numpy(unpack(explorer.data["layers"][layer]["gate"])[5, 2].copy())  # (dh,)
                close(snap["gate"], want, 1e-7)
                assert snap["diff"] is None and "output gate" in note
                assert "gate sigmoid(x W_G[2])" in page.inner_text("#z-legend")
                assert page.locator("#diff-view").is_hidden()
            else:
                close(snap["diff"], t[f"{block}.attn.hook_diff_pattern"][0, 2, 5])
                assert "differential pairs" in note and "p_1 - lambda p_2" in page.inner_text("#z-legend")
                assert page.locator("#diff-canvas").get_attribute("data-pair") == "2"
                assert page.locator("#diff-view").is_visible()
                wo_rows = page.evaluate("document.getElementById('wo-canvas')._grid.rows")
                assert wo_rows == 12 and "W_O[4], W_O[5]" in page.inner_text("#wo-legend")  # pair 2's rows
        finally:
            page.close()
        assert not errors
