"""The atlas page in a real browser: Debian's Chromium, headless, driven by Playwright (as the explorer's).

The page is written for a random decoder's atlas over a token corpus whose example tokens include
markup; the grid, a click on a head, the statistics shown and the highlighted example tokens are held
against ``atlas.json``. No console error and no request other than the file itself are allowed.
Skipped without Chromium (``HEADSPACE_CHROMIUM``, default /usr/bin/chromium) unless
``HEADSPACE_REQUIRE_BROWSER`` is set.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

import headspace as hs
from headspace.analysis import atlas
from headspace.viz.atlas import write_atlas_page

os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
CHROMIUM = os.environ.get("HEADSPACE_CHROMIUM", "/usr/bin/chromium")
if not (Path(CHROMIUM).is_file() and shutil.which(CHROMIUM)):
    if os.environ.get("HEADSPACE_REQUIRE_BROWSER"):
        raise RuntimeError(f"HEADSPACE_REQUIRE_BROWSER is set but no Chromium at {CHROMIUM}")
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)
from playwright import sync_api  # noqa: E402 - the [dev] extra; never downloads a browser

from headspace.viz.explorer.page import HEADLESS_CHROMIUM_ARGS  # noqa: E402

pytestmark = pytest.mark.slow  # the whole module (pyproject.toml: -m slow runs it)


def test_atlas_page_in_chromium(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = hs.ModelConfig(arch="decoder", vocab_size=19, d_model=24, n_layers=2, n_heads=3, max_seq_len=32)
    model = hs.Decoder(cfg).eval()
    docs = [torch.randint(0, 19, (n,), generator=torch.Generator().manual_seed(n)) for n in (13, 7)]
    d = atlas(model, docs, window=8, top_k=2, progress=False, induction_repeated=False).to_dict()
    d["examples"][1][2]["attention"][0]["key_context"]["tokens"][0] = "</script><img src=x onerror=alert(1)>"
    path = write_atlas_page(tmp_path / "atlas.html", d)
    errors: list[str] = []
    requests: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=list(HEADLESS_CHROMIUM_ARGS)
        )
        page = browser.new_page()
        page.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: requests.append(r.url))
        page.goto(path.as_uri())
        page.wait_for_selector("body[data-ready='true']", timeout=30_000)
        assert page.locator("td.cell").count() == 2 * 3
        before = page.get_attribute("td.cell[data-layer='1'][data-head='2']", "style")
        page.select_option("#stat", "entropy")
        assert page.get_attribute("td.cell[data-layer='1'][data-head='2']", "style") != before
        page.click("td.cell[data-layer='1'][data-head='2']")
        shown = page.inner_text("#head-stats td[data-stat='entropy']")
        assert float(shown) == pytest.approx(d["entropy"][1][2], abs=1e-3)
        ex = d["examples"][1][2]["attention"][0]
        keys = page.eval_on_selector_all(
            ".examples[data-kind='attention'] .tok.key", "els => els.map(e => e.textContent)"
        )
        assert keys[0] == ex["key_context"]["tokens"][ex["key_context"]["at"]]
        assert page.locator("img").count() == 0  # the markup in a token stayed text
        assert page.inner_text("#relation")  # words, or "no single relation stands out"
        browser.close()
    assert errors == []
    assert requests == [path.as_uri()]
