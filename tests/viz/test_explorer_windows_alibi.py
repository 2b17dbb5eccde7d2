"""The explorer on sliding-window layers (one-sided and on both sides), chunked layers, ALiBi layers and
QK-norm layers without rotary (NoPE).

The page's own JavaScript (``allowed`` and ``row`` of explorer.js, run by node on the page's stored
q and k) and a numpy mirror of it must give back every head's traced pattern.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from headspace import trace
from headspace.model.models import Decoder, Encoder, ModelConfig
from headspace.nn.alibi import bloom_slopes
from headspace.viz.explorer import Explorer
from headspace.viz.explorer.data import unpack

pytestmark = pytest.mark.usefixtures("single_thread")

SEQ, VOCAB = 9, 41
JS = Path(__file__).parents[2] / "src/headspace/viz/explorer/assets/explorer.js"
BASE = dict(arch="decoder", vocab_size=VOCAB, d_model=24, n_layers=2, n_heads=4, n_kv_heads=2, d_head=6)


def windowed() -> Decoder:
    torch.manual_seed(5)
    config = ModelConfig(**BASE, positions="rotary", sliding_window=3, layer_types=["sliding", "full"])
    return Decoder(config).eval()


def alibi() -> Decoder:
    torch.manual_seed(6)
    return Decoder(ModelConfig(**BASE, positions="none", alibi_slopes=bloom_slopes(4))).eval()


def nope_qk_norm() -> Decoder:
    torch.manual_seed(7)
    config = ModelConfig(**BASE, positions="rotary", nope_layers=[1], qk_norm="head", norm_kind="rmsnorm")
    return Decoder(config).eval()


def band() -> Encoder:
    """A window on both sides of the query (ModernBERT's local layers): window 5 -> |i - j| < 5."""
    torch.manual_seed(8)
    config = ModelConfig(**{**BASE, "arch": "encoder"}, positions="rotary", sliding_window=5,
                         window_sides="both", layer_types=["sliding", "full"])  # fmt: skip
    return Encoder(config).eval()


def chunked() -> Decoder:
    """Llama 4's chunked attention: chunks of 4 keys (query 5 sees keys 4 and 5)."""
    torch.manual_seed(9)
    config = ModelConfig(**BASE, positions="rotary", attention_chunk=4, layer_types=["chunked", "full"])
    return Decoder(config).eval()


MODELS = {"window": windowed, "alibi": alibi, "nope_qk_norm": nope_qk_norm, "band": band, "chunk": chunked}


def _page_and_patterns(make: str) -> tuple[dict, list[torch.Tensor]]:
    model = MODELS[make]()
    with torch.no_grad():  # norms off their start, so a skipped one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    toks = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(3))  # (1, SEQ)
    page = Explorer(model, toks, labels=[f"t{i}" for i in range(SEQ)], precision="float32")
    with torch.no_grad(), trace(model, ["*.hook_pattern"]) as t:
        model(toks)
    return page.data, [t.pattern(i)[0] for i in range(2)]


def mirror(layer: dict) -> np.ndarray:
    """The page's scores -> softmax in numpy (float64): [H, S, S]."""
    q, k = unpack(layer["q"]).astype(np.float64), unpack(layer["k"]).astype(np.float64)  # (S, H|Hkv, dh)
    H = q.shape[1]
    k = np.repeat(k, H // k.shape[1], axis=1)  # (S, H, dh)
    scores = np.einsum("qhd,khd->hqk", q * layer["scale"], k)  # (H, S, S)
    i, j = np.arange(SEQ)[:, None], np.arange(SEQ)[None, :]
    if layer["alibi"] is not None:
        scores = scores - np.asarray(layer["alibi"])[:, None, None] * (i - j)[None]
    ok = np.ones((SEQ, SEQ), dtype=bool) if layer["mask"] == "none" else j <= i
    if layer["mask"] == "window":
        ok = ok & (i - j < layer["window"])
    if layer["mask"] == "band":
        ok = np.abs(i - j) < layer["window"]
    if layer["mask"] == "chunk":
        ok = ok & (i // layer["window"] == j // layer["window"])
    scores = np.where(ok[None], scores, -np.inf)
    e = np.exp(scores - scores.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _js_patterns(layer: dict) -> np.ndarray:
    """explorer.js's own ``allowed`` and ``row`` on the stored layer, run by node: [H, S, S]."""
    src = JS.read_text(encoding="utf-8")
    body = re.search(r"  function kvHead.*?\n    return \{ scores, weights[^}]*\};\n  \}\n", src, re.S)
    assert body is not None, "explorer.js's kvHead ... row block moved"
    q, k = unpack(layer["q"]), unpack(layer["k"])
    L = {"meta": {k2: layer[k2] for k2 in ("scale", "mask", "window", "alibi")}, "H": q.shape[1],
         "Hkv": k.shape[1], "dh": q.shape[2], "q": q.ravel().tolist(), "k": k.ravel().tolist()}  # fmt: skip
    script = (
        f"const SEQ = {SEQ}; const L = {json.dumps(L)};\n{body.group(0)}\n"
        "const out = []; for (let h = 0; h < L.H; h++) { const rows = [];"
        " for (let t = 0; t < SEQ; t++) rows.push(Array.from(row(L, h, t).weights)); out.push(rows); }\n"
        "console.log(JSON.stringify(out));"
    )
    res = subprocess.run(["node", "-e", script], capture_output=True, text=True, timeout=60, check=True)
    return np.asarray(json.loads(res.stdout))


@pytest.mark.parametrize("make", list(MODELS))
def test_page_reproduces_every_heads_pattern(make: str) -> None:
    data, patterns = _page_and_patterns(make)
    layers = data["layers"]
    if make == "window":
        assert [(x["mask"], x["window"]) for x in layers] == [("window", 3), ("causal", None)]
    if make == "band":
        assert [(x["mask"], x["window"]) for x in layers] == [("band", 5), ("none", None)]
    if make == "chunk":
        assert [(x["mask"], x["window"]) for x in layers] == [("chunk", 4), ("causal", None)]
    if make == "alibi":
        assert all(x["alibi"] == pytest.approx(bloom_slopes(4)) for x in layers)
    for layer, want in zip(layers, patterns):
        torch.testing.assert_close(torch.from_numpy(mirror(layer)).float(), want.float())


@pytest.mark.skipif(  # CI sets HEADSPACE_REQUIRE_BROWSER and installs node: a missing one fails there
    shutil.which("node") is None and not os.environ.get("HEADSPACE_REQUIRE_BROWSER"),
    reason="node is not installed: explorer.js cannot run",
)
@pytest.mark.parametrize("make", list(MODELS))
def test_the_pages_javascript_reproduces_every_heads_pattern(make: str) -> None:
    data, patterns = _page_and_patterns(make)
    for layer, want in zip(data["layers"], patterns):
        torch.testing.assert_close(torch.from_numpy(_js_patterns(layer)).float(), want.float())
