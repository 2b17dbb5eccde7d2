"""A large explorer page's arrays as one deflated block, one byte a character (headspace.viz.explorer.
blob; issue 41: SmolLM2's page at 14 tokens was 10.6 MB of base64, the target 8 MB): the bytes come back
exactly, in Python and in Chromium, which shows the same numbers as from the base64 page."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from headspace.model.models import Decoder, ModelConfig
from headspace.viz.explorer import Explorer, blob


def _as_browser_reads(page: bytes) -> str:
    """The page's bytes decoded as a browser decodes windows-1252 (0x81, 0x8D, 0x8F, 0x90, 0x9D: the C1
    control itself)."""
    return "".join(
        bytes([b]).decode("cp1252", errors="ignore") or chr(b) if 0x80 <= b < 0xA0 else chr(b) for b in page
    )


def test_every_byte_survives_the_escape_and_a_browser_s_decoding() -> None:
    rng = random.Random(0)
    for block in (
        bytes(range(256)) * 3,
        bytes(rng.randrange(256) for _ in range(5000)),
        b"~~<\r\n\x00</script>",
    ):
        text = blob.escape(block)
        assert "<" not in text and "\r" not in text and "\x00" not in text and max(map(ord, text)) < 256
        assert blob.unescape(text) == block
        assert blob.unescape(_as_browser_reads(text.encode("latin-1"))) == block


def _model() -> Decoder:
    torch.manual_seed(5)
    config = ModelConfig(
        arch="decoder", vocab_size=61, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2, d_head=8
    )
    return Decoder(config).eval()


def _pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Explorer, Path, Path]:
    """The same page as base64 (UTF-8) and as a block (windows-1252)."""
    tokens = torch.randint(0, 61, (1, 9), generator=torch.Generator().manual_seed(1))
    page = Explorer(_model(), tokens, labels=[f"t{i}\u2423" for i in range(9)], name="tiny \u2014 model")
    plain = page.save(tmp_path / "plain.html")
    monkeypatch.setattr(blob, "BLOB_MIN_CHARS", 0)
    page._html = None
    packed = page.save(tmp_path / "packed.html")
    return page, plain, packed


def test_a_block_page_is_ascii_around_its_block_and_reads_back_to_the_same_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    page, plain, packed = _pages(tmp_path, monkeypatch)
    body = packed.read_bytes()
    assert blob.BLOB_META.encode() in body[:1024] and b'<meta charset="utf-8">' not in body
    start = body.index(b'id="explorer-blob">')
    around = body[:start] + body[body.index(b"</script>", start) :]
    assert around.isascii() and around.count(b"</script>") == 3
    assert blob.page_data(body) == page.data == blob.page_data(plain.read_bytes())
    assert blob.page_charset(body) == "windows-1252" and blob.page_charset(plain.read_bytes()) == "utf-8"


def _shown(browser: Any, open_tab: Any) -> tuple[dict[str, Any], list[str], str]:
    errors: list[str] = []
    tab = browser.new_page(viewport={"width": 1400, "height": 1000})
    tab.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
    tab.on("pageerror", lambda e: errors.append(str(e)))
    try:
        frame = open_tab(tab)
        frame.wait_for_selector("body[data-ready='true']", timeout=60_000)
        frame.evaluate("window.headspaceExplorer.select({layer: 1, head: 4, token: 7})")
        snap = frame.evaluate("window.headspaceExplorer.snapshot()")
        wo = frame.evaluate("[0, 1, 2].map((i) => document.getElementById('wo-canvas')._hover(i, 5 * i + 3))")
        subtitle = frame.evaluate("document.getElementById('subtitle').textContent")
        assert errors == []
        return snap, wo, subtitle
    finally:
        tab.close()


def test_chromium_shows_the_same_numbers_from_the_block(
    browser: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    page, plain, packed = _pages(tmp_path, monkeypatch)
    want = _shown(browser, lambda tab: (tab.goto(plain.as_uri()), tab)[1])
    assert want[0]["head"] == 4 and "tiny \u2014 model" in want[2]
    assert _shown(browser, lambda tab: (tab.goto(packed.as_uri()), tab)[1]) == want
    # a notebook gives the page as text in an iframe's srcdoc: its characters, not windows-1252 bytes
    notebook = tmp_path / "notebook.html"
    notebook.write_text(f"<!DOCTYPE html><html><body>{page._repr_html_()}</body></html>", encoding="utf-8")

    def in_frame(tab: Any) -> Any:
        tab.goto(notebook.as_uri())
        tab.wait_for_selector("iframe")
        return tab.frames[1]

    assert _shown(browser, in_frame) == want


def test_the_server_names_each_page_s_charset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    import urllib.request

    from headspace.viz.explorer import serve_page

    _, plain, packed = _pages(tmp_path, monkeypatch)
    for path, charset in ((plain, "utf-8"), (packed, "windows-1252")):
        server = serve_page(path, port=0)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/") as reply:
                assert reply.headers["Content-Type"] == f"text/html; charset={charset}"
                assert reply.read() == path.read_bytes()
        finally:
            server.shutdown()
            server.server_close()
            thread.join()
