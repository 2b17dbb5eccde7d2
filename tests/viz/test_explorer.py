"""The explorer's data and page, without a browser (tests/viz/test_explorer_browser.py drives Chromium).

The page recomputes scores, softmax, z and the output from the stored q, k, v, W_O and b_O; here a
numpy mirror of that arithmetic is held against an independent trace of the model (hook_pattern,
hook_z and the block's hook_attn_out), on small random models with distinct prime sizes.
"""

from __future__ import annotations

import html
import importlib
import json
import re
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from headspace import MultiHeadAttention, trace
from headspace.cli import cli
from headspace.model.models import Decoder, Encoder, ModelConfig
from headspace.viz.explorer import (
    Explorer,
    build_page_data,
    capture_layers,
    render_page,
    serve_page,
    write_page,
)
from headspace.viz.explorer.data import AUTO_FLOAT32_MAX_TOKENS, unpack

pytestmark = pytest.mark.usefixtures("single_thread")

# distinct primes: seq=11, n_heads=7, d_head=5 (d_model=35), 2 layers, vocab 53
SEQ, N_HEADS, D_HEAD, VOCAB = 11, 7, 5, 53


def encoder() -> Encoder:
    torch.manual_seed(1)
    return Encoder(
        ModelConfig(arch="encoder", vocab_size=VOCAB, d_model=N_HEADS * D_HEAD, n_layers=2, n_heads=N_HEADS)
    ).eval()


def gqa_decoder() -> Decoder:
    torch.manual_seed(2)
    config = ModelConfig(
        arch="decoder", vocab_size=VOCAB, d_model=30, n_layers=2, n_heads=6, n_kv_heads=2, d_head=5
    )
    return Decoder(config).eval()


def rotary_decoder() -> Decoder:
    """Llama-shaped: rotary positions (q and k rotated after the projections), GQA, RMSNorm, no biases."""
    torch.manual_seed(4)
    config = ModelConfig(
        arch="decoder", vocab_size=VOCAB, d_model=36, n_layers=2, n_heads=6, n_kv_heads=2, d_head=6,
        positions="rotary", norm_kind="rmsnorm", mlp_kind="gated", act="silu", bias=False,
    )  # fmt: skip
    return Decoder(config).eval()


def tokens(seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(3))  # (1, seq)


def reference(model: torch.nn.Module, toks: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Per layer: pattern [H, S, S], z [S, H, dh], attention output [S, d_model], from a plain trace."""
    with torch.no_grad(), trace(model, ["*.hook_pattern", "*.hook_z", "*.hook_attn_out"]) as t:
        model(toks)
    return [
        {
            "pattern": t.pattern(i)[0],
            "z": t.z(i)[0],
            "out": t.act("attn_out", i)[0],
        }
        for i in range(t.n_layers)
    ]


def mirror(layer: dict) -> dict[str, np.ndarray]:
    """What explorer.js computes from one stored layer, in float64 (scores, softmax, z, out)."""
    q, k, v = unpack(layer["q"]).astype(np.float64), unpack(layer["k"]), unpack(layer["v"])  # (S, H, dh) ...
    W_O = unpack(layer["W_O"]).astype(np.float64)  # (H, dh, d_model)
    H, Hkv = q.shape[1], k.shape[1]
    k = np.repeat(k, H // Hkv, axis=1).astype(np.float64)  # (S, H, dh)
    v = np.repeat(v, H // Hkv, axis=1).astype(np.float64)  # (S, H, dh)
    scores = np.einsum("qhd,khd->hqk", q * layer["scale"], k)  # (H, S, S)
    if layer["mask"] == "causal":
        scores = np.where(np.tril(np.ones(scores.shape[1:], dtype=bool)), scores, -np.inf)
    e = np.exp(scores - scores.max(-1, keepdims=True))
    pattern = e / e.sum(-1, keepdims=True)  # (H, S, S)
    z = np.einsum("hqk,khd->qhd", pattern, v)  # (S, H, dh)
    out = np.einsum("qhd,hdm->qm", z, W_O)  # (S, d_model)
    if layer["b_O"] is not None:
        out = out + unpack(layer["b_O"])
    return {"pattern": pattern, "z": z, "out": out}


def close(actual: np.ndarray, expected: torch.Tensor) -> None:
    """float32 defaults of assert_close, the float64 mirror rounded to float32 first."""
    torch.testing.assert_close(torch.from_numpy(np.asarray(actual, dtype=np.float32)), expected.float())


# ---------------------------------------------------------------------------------------------- data
@pytest.mark.parametrize(
    "make", [encoder, gqa_decoder, rotary_decoder], ids=["encoder", "gqa-decoder", "rotary-decoder"]
)
def test_page_arithmetic_reproduces_the_trace(make) -> None:
    model = make()
    toks = tokens()
    page = Explorer(model, toks, labels=[f"t{i}" for i in range(SEQ)])
    ref = reference(model, toks)
    assert len(page.data["layers"]) == len(ref) == 2
    for layer, r in zip(page.data["layers"], ref):
        assert layer["rotary"] == (make is rotary_decoder)  # there q and k are stored rotated
        m = mirror(layer)
        close(m["pattern"], r["pattern"])
        close(m["z"], r["z"])
        close(m["out"], r["out"])


@settings(max_examples=12, deadline=None)
@given(
    n_kv_heads=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 2]),
    d_head=st.integers(1, 6),
    seq=st.integers(1, 9),
    causal=st.booleans(),
    bias=st.booleans(),
)
def test_page_arithmetic_holds_for_any_head_layout(
    n_kv_heads: int, group: int, d_head: int, seq: int, causal: bool, bias: bool
) -> None:
    """One attention layer of any head count, kv grouping, width and length, causal or not."""
    n_heads = n_kv_heads * group
    torch.manual_seed(seq * 31 + d_head)
    attn = MultiHeadAttention(
        d_model=7, n_heads=n_heads, d_head=d_head, n_kv_heads=n_kv_heads, bias=bias
    ).eval()
    x = torch.randn(1, seq, 7)  # (1, seq, d_model)
    layer = build_page_data(capture_layers(attn, lambda: attn(x, is_causal=causal)), ["t"] * seq)["layers"][0]
    assert layer["mask"] == ("causal" if causal and seq > 1 else "none")
    with torch.no_grad():
        out, pattern = attn(x, is_causal=causal, need_weights=True)  # the fused layer, untraced
    m = mirror(layer)
    close(m["pattern"], pattern[0])
    close(m["out"], out[0])


def test_stored_arrays_have_documented_shapes_and_are_the_traced_values() -> None:
    model = gqa_decoder()
    toks = tokens()
    page = Explorer(model, toks)
    layer = page.data["layers"][1]
    assert layer["mask"] == "causal"
    assert unpack(layer["q"]).shape == (SEQ, 6, 5)  # [seq, n_heads, d_head]
    assert unpack(layer["k"]).shape == unpack(layer["v"]).shape == (SEQ, 2, 5)  # [seq, n_kv_heads, d_head]
    assert unpack(layer["W_O"]).shape == (6, 5, 30)  # [n_heads, d_head, d_model]
    assert unpack(layer["shares"]).shape == (SEQ, 6)
    assert unpack(layer["overlap"]["W_Q"]).shape == (6, 6)
    assert unpack(layer["overlap"]["W_K"]).shape == (2, 2)  # grouped-query: per kv head
    # Traced the way the page traces (every layer, hook_result too: the sum over heads then replaces the
    # fused output projection, which changes the last bits of the next layer's input), float32 storage
    # is the traced tensor bit for bit.
    with torch.no_grad(), trace(model, ["*.hook_q", "*.hook_v", "*.hook_result"]) as t:
        model(toks)
    np.testing.assert_array_equal(unpack(layer["q"]), t["blocks.1.attn.hook_q"][0].numpy())
    np.testing.assert_array_equal(unpack(layer["v"]), t["blocks.1.attn.hook_v"][0].numpy())
    np.testing.assert_array_equal(unpack(layer["W_O"]), model.blocks[1].attn.W_O.detach().numpy())
    assert page.data["tokens"] == [str(i) for i in toks[0].tolist()]


def test_shares_are_each_heads_norm_over_the_sum_of_norms() -> None:
    model = encoder()
    toks = tokens()
    page = Explorer(model, toks)
    with torch.no_grad(), trace(model, "*.hook_z") as t:
        model(toks)
    for i, layer in enumerate(page.data["layers"]):
        z = t.z(i)[0]  # (S, H, dh)
        norms = torch.einsum("shd,hdm->shm", z, model.blocks[i].attn.W_O).norm(dim=-1)  # (S, H)
        expected = norms / norms.sum(-1, keepdim=True)
        torch.testing.assert_close(torch.from_numpy(unpack(layer["shares"])), expected)
        assert layer["wo_norms"] == pytest.approx(
            model.blocks[i].attn.W_O.detach().flatten(1).norm(dim=1).tolist()
        )


def test_overlaps_show_planted_structure_and_the_random_baseline() -> None:
    model = encoder()
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.W_Q[1] = attn.W_Q[0] @ torch.randn(D_HEAD, D_HEAD)  # same column space as head 0
        basis = torch.linalg.qr(torch.randn(N_HEADS * D_HEAD, N_HEADS * D_HEAD))[0]  # (35, 35)
        attn.W_Q[2] = basis[:, :D_HEAD]  # orthogonal to head 3's subspace
        attn.W_Q[3] = basis[:, D_HEAD : 2 * D_HEAD]
    page = Explorer(model, tokens())
    layer = page.data["layers"][0]
    ov = unpack(layer["overlap"]["W_Q"])
    assert ov[0, 1] == pytest.approx(1.0, abs=1e-5)
    assert ov[2, 3] == pytest.approx(0.0, abs=1e-5)
    np.testing.assert_allclose(np.diag(ov), 1.0, atol=1e-5)
    assert layer["overlap_baseline"] == pytest.approx(D_HEAD / (N_HEADS * D_HEAD))


def test_precision_auto_float16_and_its_rounding() -> None:
    model = encoder()
    toks = tokens()
    f32 = Explorer(model, toks, precision="float32").data
    f16 = Explorer(model, toks, precision="float16").data
    assert Explorer(model, toks).data["precision"] == "float32"  # 11 <= AUTO_FLOAT32_MAX_TOKENS
    assert SEQ <= AUTO_FLOAT32_MAX_TOKENS
    q32, q16 = unpack(f32["layers"][0]["q"]), unpack(f16["layers"][0]["q"])
    assert len(f16["layers"][0]["q"]["data"]) < 0.6 * len(f32["layers"][0]["q"]["data"])
    np.testing.assert_array_equal(q16, q32.astype(np.float16).astype(np.float32))
    long_toks = torch.randint(0, VOCAB, (1, AUTO_FLOAT32_MAX_TOKENS + 1))
    long = Explorer(encoder_with_positions(AUTO_FLOAT32_MAX_TOKENS + 1), long_toks).data
    assert long["precision"] == "float16"


def encoder_with_positions(n: int) -> Encoder:
    config = ModelConfig(arch="encoder", vocab_size=VOCAB, d_model=10, n_layers=1, n_heads=2, max_seq_len=n)
    return Encoder(config).eval()


# ---------------------------------------------------------------------------------------------- bad input
def test_bad_inputs_name_the_problem() -> None:
    model = encoder()
    with pytest.raises(
        ValueError, match=r"sentence must be a str .* or an int64 token tensor \[1, seq\].*shape \[2, 11\]"
    ):
        Explorer(model, torch.randint(0, VOCAB, (2, SEQ)))
    with pytest.raises(ValueError, match=r"dtype torch\.float32"):
        Explorer(model, torch.zeros(1, SEQ))
    with pytest.raises(TypeError, match="a sentence needs a model with a tokenizer"):
        Explorer(model, "a sentence")
    with pytest.raises(TypeError, match="got int"):
        Explorer(3, tokens())
    with pytest.raises(ValueError, match=r"precision must be one of.*'float8'"):
        Explorer(model, tokens(), precision="float8")
    with pytest.raises(ValueError, match="no headspace MultiHeadAttention"):
        Explorer(torch.nn.Linear(3, 3), tokens(), run=lambda: None)
    with pytest.raises(ValueError, match="labels has 2 entries but the input has 11 tokens"):
        Explorer(model, tokens(), labels=["a", "b"])
    with pytest.raises(ValueError, match="tokens has 2 labels but the traced sequence has 11"):
        build_page_data(capture_layers(model, lambda: model(tokens())), ["a", "b"])


def test_refuses_masks_and_biases_it_cannot_redraw() -> None:
    model = encoder()
    toks = tokens()
    pad = torch.ones(1, SEQ, dtype=torch.bool)
    pad[0, -3:] = False
    with pytest.raises(ValueError, match="masks another set of keys"):
        Explorer(model, toks, run=lambda: model(toks, key_padding=pad))
    attn = model.blocks[0].attn
    bias = torch.randn(SEQ, SEQ)  # an additive float mask: scores are no longer q k^T * scale
    x = torch.randn(1, SEQ, N_HEADS * D_HEAD)
    with pytest.raises(ValueError, match="scores are not q k\\^T \\* scale"):
        capture_layers(attn, lambda: attn(x, attn_mask=bias))
    with pytest.raises(ValueError, match="ran 2 times"):
        capture_layers(attn, lambda: (attn(x), attn(x)))
    with pytest.raises(ValueError, match="did not run"):
        capture_layers(model, lambda: None)


# ---------------------------------------------------------------------------------------------- page
def test_page_is_self_contained_and_escapes_its_data(tmp_path: Path) -> None:
    model = encoder()
    labels = [f"t{i}" for i in range(SEQ)]
    labels[3] = "</script><script>alert(1)</script>"
    labels[4] = "__DATA__ /*__JS__*/"
    page = Explorer(model, tokens(), labels=labels)
    text = page.html
    # nothing can be fetched: no URL, no external script/style/font, and a CSP that forbids requests
    assert "default-src 'none'" in text
    assert not re.search(r"https?://", text)
    assert not re.search(r"<(link|img|iframe)\b|\bsrc=|@import|url\(", text)
    assert text.count("</script>") == 2  # the data element and the code element, nothing from a label
    data = json.loads(
        re.search(r'<script type="application/json" id="explorer-data">(.*?)</script>', text, re.S)[1]
    )
    assert data["tokens"] == labels
    assert data == json.loads(json.dumps(page.data))
    path = page.save(tmp_path / "page.html")
    assert path.read_text(encoding="utf-8") == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.html"]  # no temp file left behind


def test_render_and_write_check_their_arguments(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="data must be the dict from build_page_data"):
        render_page({"x": 1})
    with pytest.raises(ValueError, match=r"output folder .*missing.* does not exist"):
        write_page(tmp_path / "missing" / "page.html", "<html></html>")
    with pytest.raises(ValueError, match="captures is empty"):
        build_page_data([], [])


def test_repr_html_is_an_iframe_holding_the_whole_page() -> None:
    page = Explorer(encoder(), tokens())
    frame = page._repr_html_()
    assert frame.startswith("<iframe ") and 'sandbox="allow-scripts"' in frame
    srcdoc = re.search(r'srcdoc="([^"]*)"', frame)[1]
    assert html.unescape(srcdoc) == page.html


def test_serve_page_answers_with_the_file(tmp_path: Path) -> None:
    path = tmp_path / "page.html"
    path.write_text("<html>explorer</html>", encoding="utf-8")
    server = serve_page(path, port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as r:
            assert r.read() == path.read_bytes()
            assert r.headers["Content-Type"].startswith("text/html")
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/elsewhere.js", timeout=10)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


# ---------------------------------------------------------------------------------------------- CLI errors
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["view", "a sentence"], "say where the page goes: -o FILE.html"),
        (["view", "   ", "-o", "x.html"], "SENTENCE is empty"),
        (["view", "hi", "--model", "nosuchmodel", "-o", "x.html"], "unknown model 'nosuchmodel'"),
        # a missing folder is created, as for every command's output (docs/cli.md); one that cannot be is not
        (
            ["view", "hi", "-o", "/proc/no/such/x.html"],
            "-o /proc/no/such/x.html: cannot write in the folder '/proc'",
        ),
    ],
)
def test_view_usage_errors_are_one_line_with_exit_code_2(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output
    assert "Traceback" not in result.output


def test_view_refuses_an_unwritable_output_folder() -> None:
    result = CliRunner().invoke(cli, ["view", "hi", "-o", "/proc/page.html"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output
    assert lines[0].startswith("error: -o /proc/page.html: cannot write in the folder '/proc' (")


# ---------------------------------------------------------------------------------------------- title
MARKUP = "</title><img src=x onerror=alert(1)><script>alert(1)</script>"


def test_title_is_escaped_in_the_page() -> None:
    """The title comes from the model's (folder's) name, and the page's CSP allows inline scripts."""
    page = Explorer(encoder(), tokens(), name=MARKUP)
    text = page.html
    title = f"headspace explorer: {MARKUP}"
    assert page.data["title"] == title
    assert f"<title>{html.escape(title)}</title>" in text
    assert f'<h1 id="title">{html.escape(title)}</h1>' in text
    assert text.count("</title>") == 1 and "<img" not in text and "<script>alert" not in text
    assert text.count("<script") == 2  # the data element and the code element


def test_a_model_folder_named_with_markup_gives_an_escaped_title(tmp_path: Path) -> None:
    import shutil

    import transformers

    from headspace.pretrained import minilm_path

    folder = tmp_path / "<img src=x onerror=alert(1)>"
    config = transformers.BertConfig(
        vocab_size=30522, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(str(folder), safe_serialization=True)
    shutil.copy(Path(minilm_path()) / "tokenizer.json", folder / "tokenizer.json")
    out = tmp_path / "page.html"
    result = CliRunner().invoke(cli, ["view", "it is here", "--model", str(folder), "-o", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text(encoding="utf-8")
    escaped = html.escape(f"headspace explorer: {folder.name}")
    assert f"<title>{escaped}</title>" in text and f'<h1 id="title">{escaped}</h1>' in text
    assert "<img" not in text


# ---------------------------------------------------------------------------------------------- opening
def test_page_opens_on_the_head_and_token_explain_walks() -> None:
    import headspace
    from headspace.analysis.explain import explain
    from headspace.core.defaults import DEFAULT_SENTENCE

    minilm = headspace.load("minilm")
    page = Explorer(minilm, DEFAULT_SENTENCE)
    e = explain(minilm)
    assert page.data["initial"] == {"layer": e.layer, "head": e.head, "token": e.token_index}
    assert page.data["initial"]["token"] == 10 and (e.layer, e.head) in {(5, 11), (3, 1)}
    # a bare module with ids for labels: the first token and the best-ranked head for it
    bare = Explorer(encoder(), tokens()).data["initial"]
    assert bare["token"] == 0 and 0 <= bare["layer"] < 2 and 0 <= bare["head"] < N_HEADS
    model = encoder()
    captures = capture_layers(model, lambda: model(tokens()))
    with pytest.raises(ValueError, match=r"initial head 9 is out of range 0\.\.6"):
        build_page_data(captures, ["t"] * SEQ, initial={"head": 9})


# ---------------------------------------------------------------------------------------------- serving
def _view_dirs(folder: Path) -> list[Path]:
    return sorted(folder.glob("headspace-view-*"))


@pytest.fixture()
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tempfile (and TMPDIR) pointed at a folder of this test's own."""
    import tempfile

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_port_in_use_fails_fast_before_building_anything(private_tmp: Path, monkeypatch) -> None:
    import socket
    import time

    cli_view = importlib.import_module("headspace.cli.view")

    def no_load(spec: str):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(cli_view, "load_model", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.perf_counter()
        result = CliRunner().invoke(cli, ["view", "--serve", "--port", str(port)])
        elapsed = time.perf_counter() - start
    assert result.exit_code == 2, result.output
    assert result.output.strip() == (
        f"error: --port {port}: cannot listen on 127.0.0.1:{port} (Address already in use)"
    )
    assert elapsed < 10
    assert _view_dirs(private_tmp) == []


def test_view_reports_the_whole_wait_and_cleans_up_after_ctrl_c(private_tmp: Path, monkeypatch) -> None:
    import time

    import headspace

    cli_view = importlib.import_module("headspace.cli.view")
    from headspace.viz.explorer.page import PageServer

    minilm = headspace.load("minilm")

    def slow_load(spec: str):
        time.sleep(1.5)  # what loading the model costs the user (at least)
        return minilm

    served: list[Path] = []

    def interrupted(self, *args, **kwargs):
        served.extend(p / "explorer.html" for p in _view_dirs(private_tmp))
        assert served and served[0].is_file() and self.body == served[0].read_bytes()
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_view, "load_model", slow_load)
    monkeypatch.setattr(PageServer, "serve_forever", interrupted)
    result = CliRunner().invoke(cli, ["view", "--serve", "--port", "0"])
    assert result.exit_code == 0, result.output
    m = re.search(r"\) in ([\d.]+) s \(load ([\d.]+) s, build ([\d.]+) s\)", result.output)
    assert m, result.output
    total, load, build = map(float, m.groups())
    assert load >= 1.5 and total >= load + build - 0.11  # rounded to 0.1 s each
    assert "serving on http://127.0.0.1:" in result.output
    assert len(served) == 1 and _view_dirs(private_tmp) == []  # the 5 MB page is gone


def test_sigterm_stops_the_server_and_removes_its_page(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "headspace", "view", "--serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        url = None
        deadline = time.monotonic() + 240
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            m = re.search(r"serving on (http://\S+/)", line)
            url = m[1] if m else None
        assert url, proc.stderr.read() if proc.poll() is not None else "no 'serving on' line"
        (folder,) = _view_dirs(tmp_path)
        with urllib.request.urlopen(url, timeout=30) as r:
            assert r.read() == (folder / "explorer.html").read_bytes()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        assert not folder.exists() and _view_dirs(tmp_path) == []
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_client_leaving_mid_download_is_dropped_quietly(tmp_path: Path, capfd) -> None:
    import socket
    import struct
    import time

    path = tmp_path / "big.html"
    path.write_bytes(b"<html>" + b"x" * (32 << 20) + b"</html>")  # more than the socket buffers hold
    server = serve_page(path, port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        for _ in range(3):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", port))
            s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert s.recv(1024).startswith(b"HTTP/1.0 200")
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with RST
            s.close()
        time.sleep(1.0)  # the handlers hit the closed connections
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as r:
            assert len(r.read()) == path.stat().st_size  # still serving
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err
