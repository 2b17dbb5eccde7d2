"""The explorer page in a real browser: Debian's Chromium, headless, driven by Playwright.

The page is written by ``headspace view`` for all-MiniLM-L6-v2; what it shows after a click on a layer,
a head and a token is held against an independent trace of the same model (headspace.trace) and against
Hugging Face transformers' attention weights. No console error and no request other than the file itself
are allowed. Playwright never downloads a browser: it launches the system Chromium by path
(``HEADSPACE_CHROMIUM``, default /usr/bin/chromium; ``.ci/run`` installs it and sets
``HEADSPACE_REQUIRE_BROWSER=1`` so that a missing browser fails there instead of skipping).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from tokenizers import Tokenizer

import headspace
from headspace import trace
from headspace.cli import cli
from headspace.viz.explorer import Explorer
from headspace.viz.explorer.page import HEADLESS_CHROMIUM_ARGS

os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
CHROMIUM = os.environ.get("HEADSPACE_CHROMIUM", "/usr/bin/chromium")
if not (Path(CHROMIUM).is_file() and shutil.which(CHROMIUM)):
    if os.environ.get("HEADSPACE_REQUIRE_BROWSER"):
        raise RuntimeError(f"HEADSPACE_REQUIRE_BROWSER is set but no Chromium at {CHROMIUM}")
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)
from playwright import sync_api  # noqa: E402 - the [dev] extra; never downloads a browser

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

SENTENCE = "The cat sat on the mat because it was tired."
LAYER, HEAD, TOKEN = 2, 5, 8  # token 8 is "it" ([CLS] the cat sat on the mat because it ...)
LAUNCH_ARGS = list(HEADLESS_CHROMIUM_ARGS)


@pytest.fixture(scope="module")
def minilm() -> Any:
    return headspace.load("minilm")


@pytest.fixture(scope="module")
def page_file(minilm: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The page, written by the command line as a user would."""
    path = tmp_path_factory.mktemp("explorer") / "minilm.html"
    result = CliRunner().invoke(cli, ["view", SENTENCE, "--model", "minilm", "-o", str(path)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"wrote {path}") and "13 tokens, 6 layers, float32" in result.output
    return path


@pytest.fixture(scope="module")
def reference(minilm: Any) -> dict[str, Any]:
    """The same forward pass traced in Python: tokens, patterns, z and attention outputs per layer."""
    tokens, _ = minilm.tokenize([SENTENCE])  # (1, seq)
    with torch.no_grad(), trace(minilm.model, ["*.hook_pattern", "*.hook_z", "*.hook_attn_out"]) as t:
        minilm.model(tokens)
    return {
        "labels": minilm.tokenizer.tokens(SENTENCE),
        "pattern": [t.pattern(i)[0] for i in range(6)],  # (H, S, S) each
        "z": [t.z(i)[0] for i in range(6)],  # (S, H, dh)
        "out": [t.act("attn_out", i)[0] for i in range(6)],  # (S, d_model)
    }


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=LAUNCH_ARGS)
        yield b
        b.close()


class Watched:
    """A browser page that records console errors, page errors and every request it makes."""

    def __init__(self, browser: Any, url: str) -> None:
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page = browser.new_page(viewport={"width": 1500, "height": 1000})
        self.page.on(
            "console", lambda m: self.errors.append(m.text) if m.type in ("error", "warning") else None
        )
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.goto(url)
        self.page.wait_for_selector("body[data-ready='true']", timeout=30_000)

    def snapshot(self) -> dict[str, Any]:
        return self.page.evaluate("window.headspaceExplorer.snapshot()")


@pytest.fixture(scope="module")
def shown(browser: Any, page_file: Path) -> Iterator[Watched]:
    w = Watched(browser, page_file.as_uri())
    yield w
    w.page.close()


def as_float(text: str) -> float:
    return float(text.strip())


def test_page_opens_on_the_head_and_token_explain_walks(browser: Any, page_file: Path, minilm: Any) -> None:
    """Not layer 0, head 0, token 1 with every head drawn: the lesson's head and token, one head shown."""
    from headspace.analysis.explain import explain

    e = explain(minilm, SENTENCE)
    assert (e.layer, e.head, e.token_index) == (5, 11, TOKEN)  # "it" -> "cat"
    w = Watched(browser, page_file.as_uri())
    try:
        page = w.page
        snap = w.snapshot()
        assert (snap["layer"], snap["head"], snap["token"]) == (e.layer, e.head, e.token_index)
        assert snap["topToken"] == e.top[0].token == "cat"
        assert page.get_attribute(".layer-pick[aria-checked='true']", "data-layer") == str(e.layer)
        assert page.get_attribute(".head-pick[aria-checked='true']", "data-head") == str(e.head)
        assert page.inner_text(".token[aria-checked='true']") == "it"
        pressed = page.eval_on_selector_all(
            ".head-toggle[aria-pressed='true']", "els => els.map((b) => b.dataset.head)"
        )
        assert pressed == [str(e.head)]
        # while one head is shown, it follows the pipeline's head and layer
        page.click(".head-pick[data-head='3']")
        page.click(".layer-pick[data-layer='1']")
        pressed = page.eval_on_selector_all(
            ".head-toggle[aria-pressed='true']", "els => els.map((b) => b.dataset.head)"
        )
        assert pressed == ["3"]
        page.click("#show-all")
        page.click(".layer-pick[data-layer='2']")
        assert len(page.query_selector_all(".head-toggle[aria-pressed='true']")) == 12
        assert w.errors == []
    finally:
        w.page.close()


def test_markup_in_the_model_name_stays_text(browser: Any, tmp_path: Path) -> None:
    """The title comes from the model folder's name and the page may run inline scripts: no markup in it
    may run (no dialog opens) or add elements."""
    from headspace.model.models import Encoder, ModelConfig

    name = "</title><img src=x onerror=alert(1)><script>alert(2)</script>"
    torch.manual_seed(0)
    model = Encoder(ModelConfig(arch="encoder", vocab_size=53, d_model=35, n_layers=2, n_heads=7)).eval()
    path = Explorer(model, torch.randint(0, 53, (1, 11)), name=name).save(tmp_path / "markup.html")
    dialogs: list[str] = []
    tab = browser.new_page()
    tab.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    try:
        tab.goto(path.as_uri())
        tab.wait_for_selector("body[data-ready='true']", timeout=30_000)
        tab.wait_for_timeout(300)
        assert dialogs == []
        assert tab.title() == f"headspace explorer: {name}"
        assert tab.inner_text("#title") == f"headspace explorer: {name}"
        assert tab.evaluate("document.querySelectorAll('img').length") == 0
        assert tab.evaluate("document.scripts.length") == 2  # the data element and the code element
    finally:
        tab.close()


def test_click_layer_head_token_shows_the_traced_numbers(shown: Watched, reference: dict[str, Any]) -> None:
    page = shown.page
    page.click(f".layer-pick[data-layer='{LAYER}']")
    page.click(f".head-pick[data-head='{HEAD}']")
    page.click(f".token[data-index='{TOKEN}']")
    labels = reference["labels"]
    assert page.inner_text(".token[aria-checked='true']") == labels[TOKEN] == "it"

    weights = reference["pattern"][LAYER][HEAD, TOKEN]  # (S,) this head's softmax row for "it"
    top = int(weights.argmax())
    assert page.inner_text("#top-token") == labels[top]
    assert as_float(page.inner_text("#top-weight")) == pytest.approx(float(weights[top]), abs=5e-5 + 1e-7)

    # the table: every token's score and softmax weight, as printed (4 decimals) and at full precision
    rows = page.query_selector_all("#scores-table tbody tr")
    assert len(rows) == len(labels)
    scores = torch.log(weights)  # softmax is shift-invariant: compare scores up to their log-sum-exp
    shown_scores = torch.tensor([float(r.query_selector(".score").get_attribute("data-value")) for r in rows])
    torch.testing.assert_close(
        shown_scores - torch.logsumexp(shown_scores, 0), scores, rtol=1e-5, atol=1e-5
    )  # log of float32 weights near 0.001 loses ~1e-6 relative; 1e-5 keeps the check on the 5th digit
    for j, r in enumerate(rows):
        assert r.query_selector(".tok").inner_text() == labels[j]
        w = float(weights[j])
        assert as_float(r.query_selector(".weight").inner_text()) == pytest.approx(w, abs=5e-5 + 1e-7)
        assert ("top" in (r.get_attribute("class") or "")) == (j == top)

    snap = shown.snapshot()
    assert (snap["layer"], snap["head"], snap["token"], snap["top"]) == (LAYER, HEAD, TOKEN, top)
    torch.testing.assert_close(torch.tensor(snap["weights"], dtype=torch.float32), weights)
    z = reference["z"][LAYER][TOKEN]  # (H, dh)
    torch.testing.assert_close(torch.tensor(snap["z"], dtype=torch.float32), z[HEAD])
    torch.testing.assert_close(torch.tensor(snap["concat"], dtype=torch.float32), z.flatten())
    torch.testing.assert_close(torch.tensor(snap["out"], dtype=torch.float32), reference["out"][LAYER][TOKEN])
    # the z cells print the same numbers
    cells = page.query_selector_all("#z-cells .cell")
    assert [float(c.get_attribute("data-value")) for c in cells] == pytest.approx(snap["z"], rel=1e-12)
    assert all(abs(as_float(c.inner_text()) - x) <= 0.005 + 1e-9 for c, x in zip(cells, snap["z"]))


def test_page_weights_equal_hugging_face_attentions(shown: Watched, minilm: Any) -> None:
    import transformers

    from headspace.pretrained import minilm_path

    hf = transformers.BertModel.from_pretrained(str(minilm_path()), attn_implementation="eager").eval()
    tokens, _ = minilm.tokenize([SENTENCE])
    with torch.no_grad():
        attentions = hf(tokens, output_attentions=True).attentions  # 6 x (1, H, S, S)
    for layer, head, token in [(0, 0, 1), (LAYER, HEAD, TOKEN), (5, 11, 12)]:
        shown.page.evaluate(
            f"window.headspaceExplorer.select({{layer: {layer}, head: {head}, token: {token}}})"
        )
        weights = torch.tensor(shown.snapshot()["weights"], dtype=torch.float32)
        torch.testing.assert_close(weights, attentions[layer][0, head, token])


def test_keyboard_moves_layer_head_and_token_and_toggles_heads(shown: Watched) -> None:
    page = shown.page
    page.evaluate(f"window.headspaceExplorer.select({{layer: {LAYER}, head: {HEAD}, token: {TOKEN}}})")
    page.focus(".layer-pick[aria-checked='true']")
    page.keyboard.press("ArrowRight")
    assert shown.snapshot()["layer"] == LAYER + 1
    assert page.evaluate("document.activeElement.dataset.layer") == str(LAYER + 1)
    page.keyboard.press("ArrowLeft")
    page.focus(".head-pick[aria-checked='true']")
    page.keyboard.press("ArrowRight")
    assert shown.snapshot()["head"] == HEAD + 1
    page.keyboard.press("End")
    assert shown.snapshot()["head"] == 11
    page.focus(".token[aria-checked='true']")
    page.keyboard.press("ArrowLeft")
    assert shown.snapshot()["token"] == TOKEN - 1
    page.click("#show-all")  # the page shows one head until asked for more
    page.focus(".head-toggle[data-head='0']")
    page.keyboard.press("Space")
    assert page.get_attribute(".head-toggle[data-head='0']", "aria-pressed") == "false"
    page.keyboard.press("ArrowRight")
    assert page.evaluate("document.activeElement.dataset.head") == "1"
    page.keyboard.press("Enter")
    assert page.get_attribute(".head-toggle[data-head='1']", "aria-pressed") == "false"
    page.click("#show-all")
    page.keyboard.press("Escape")
    page.evaluate("document.activeElement.blur()")
    page.keyboard.press("]")  # global shortcut: next layer
    assert shown.snapshot()["layer"] == LAYER + 1


def test_every_view_draws_with_a_legend_and_nothing_is_requested(
    shown: Watched, tmp_path_factory: pytest.TempPathFactory
) -> None:
    page = shown.page
    page.evaluate(f"window.headspaceExplorer.select({{layer: {LAYER}, head: {HEAD}, token: {TOKEN}}})")
    for legend in (
        "heads-legend",
        "q-legend",
        "kv-legend",
        "z-legend",
        "concat-legend",
        "wo-legend",
        "out-legend",
        "overlap-legend",
        "shares-legend",
        "wo-norms-legend",
    ):
        assert page.query_selector(f"#{legend} .legend canvas") is not None, legend
    # the overlap view: 12 x 12 heads, with the random baseline d_head / d_model = 32 / 384 stated
    assert "0.0833" in page.inner_text("#overlap-note")
    page.click(".matrix-pick[data-matrix='W_O']")
    assert page.get_attribute(".matrix-pick[data-matrix='W_O']", "aria-checked") == "true"
    page.click("#mode-select [data-mode='heatmap']")
    assert page.is_visible("#heatmap-canvas") and not page.is_visible("#lines-canvas")
    size = page.evaluate(
        "[document.getElementById('heatmap-canvas').width, document.getElementById('k-canvas').height]"
    )
    assert size[0] > 13 and size[1] == 13 * 14  # 13 tokens: a labelled heatmap, 14 px per k row
    page.click("#mode-select [data-mode='lines']")
    shot = tmp_path_factory.mktemp("screens") / "explorer.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 50_000
    print(f"screenshot: {shot}")
    assert shown.errors == []
    assert shown.requests == [shown.page.url]  # the file itself, nothing else


def test_a_512_token_input_opens_and_works(browser: Any, minilm: Any, tmp_path: Path) -> None:
    words = ("the quick brown fox jumps over the lazy dog while it rains " * 80).split()
    ids = minilm.tokenizer.encode_ids([" ".join(words)])[0]
    ids = [*ids[:511], ids[-1]]  # [CLS] ... [SEP], 512 tokens: the whole position table
    tokens = torch.tensor([ids])  # (1, 512)
    vocab = Tokenizer.from_file(str(minilm.tokenizer.path))
    labels = [vocab.id_to_token(i) for i in ids]
    page = Explorer(minilm.model, tokens, labels=labels, name="all-MiniLM-L6-v2")
    assert page.data["precision"] == "float16"
    path = page.save(tmp_path / "long.html")
    with torch.no_grad(), trace(minilm.model, "blocks.4.attn.hook_pattern") as t:
        minilm.model(tokens)
    w = Watched(browser, path.as_uri())
    try:
        assert w.page.evaluate("document.querySelectorAll('*').length") < 5000  # canvases, not cells
        w.page.evaluate("window.headspaceExplorer.select({layer: 4, head: 3, token: 300})")
        snap = w.snapshot()
        expected = t.pattern(4, 3)[0, 300]  # (512,)
        # q and k are stored as float16 for long inputs: weights agree to about 1e-3
        torch.testing.assert_close(
            torch.tensor(snap["weights"], dtype=torch.float32), expected, rtol=0, atol=1e-2
        )
        assert float(expected[snap["top"]]) >= float(expected.max()) - 1e-2
        assert w.page.inner_text("#top-token") == labels[snap["top"]]
        assert len(w.page.query_selector_all("#scores-table tbody tr")) == 24  # the 24 largest weights
        assert w.errors == []
        assert w.requests == [path.as_uri()]
    finally:
        w.page.close()


def test_repr_html_runs_inside_a_notebook_iframe(browser: Any, tmp_path: Path) -> None:
    """What Jupyter shows: the page inside a sandboxed iframe's srcdoc, scripts running, nothing fetched."""
    from headspace.model.models import Encoder, ModelConfig

    torch.manual_seed(0)
    model = Encoder(ModelConfig(arch="encoder", vocab_size=53, d_model=35, n_layers=2, n_heads=7)).eval()
    toks = torch.randint(0, 53, (1, 11))
    page = Explorer(model, toks, labels=[f"w{i}" for i in range(11)])
    notebook = tmp_path / "notebook.html"
    notebook.write_text(
        f"<html><body><h1>cell output</h1>{page._repr_html_()}</body></html>", encoding="utf-8"
    )
    errors: list[str] = []
    requests: list[str] = []
    tab = browser.new_page()
    tab.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
    tab.on("pageerror", lambda e: errors.append(str(e)))
    tab.on("request", lambda r: requests.append(r.url))
    try:
        tab.goto(notebook.as_uri())
        frame = tab.frames[1]
        frame.wait_for_selector("body[data-ready='true']", timeout=30_000)
        frame.click(".token[data-index='4']")
        with torch.no_grad(), trace(model, "*.hook_pattern") as t:
            model(toks)
        top = int(t.pattern(0, 0)[0, 4].argmax())
        assert frame.inner_text("#top-token") == f"w{top}"
        assert errors == []
        assert requests == [notebook.as_uri()], requests  # the notebook itself; the iframe fetches nothing
    finally:
        tab.close()


def _cell_centre(page: Any, r: int, c: int) -> tuple[float, float]:
    """Where cell (r, c) of the results heatmap is on screen (the canvas may be drawn scaled)."""
    info = page.evaluate("window.headspaceExplorer.result()")
    g = info["grid"]
    box = page.query_selector("#result-canvas").bounding_box()
    sx, sy = box["width"] / info["canvas"][0], box["height"] / info["canvas"][1]
    return box["x"] + (g["ox"] + (c + 0.5) * g["cw"]) * sx, box["y"] + (g["oy"] + (r + 0.5) * g["ch"]) * sy


def test_a_saved_patching_result_draws_as_a_heatmap_and_hover_shows_values(
    browser: Any, tmp_path: Path
) -> None:
    """Explorer(..., results=[saved JSON]): the layer x head heatmap and the layer x position one (token
    labels) draw with a colour legend; hovering a cell shows its value; clicking a head cell moves the
    pipeline to that layer and head; nothing is requested."""
    from headspace.analysis import patching
    from headspace.model.models import Decoder, ModelConfig

    torch.manual_seed(4)
    model = Decoder(ModelConfig(
        arch="decoder", vocab_size=53, d_model=36, n_layers=3, n_heads=6, n_kv_heads=2, d_head=6,
        positions="rotary", norm_kind="rmsnorm", mlp_kind="gated", act="silu", bias=False,
    )).eval()  # fmt: skip
    clean = torch.tensor([[3, 11, 13, 17, 19, 23, 29, 31]])
    corrupt = clean.clone()
    corrupt[0, 2] = 37
    heads = patching.patch(model, clean, corrupt, answer=5, other=7)
    resid = patching.patch(model, clean, corrupt, answer=5, other=7, site="resid")
    saved = resid.to_dict()
    saved["tokens"] = [f"w{i}" for i in range(8)]  # token labels, as a model with a tokenizer saves them
    (tmp_path / "resid.json").write_text(json.dumps(saved))
    page = Explorer(model, clean, results=[heads.to_json(tmp_path / "heads.json"), tmp_path / "resid.json"])
    path = page.save(tmp_path / "results.html")
    w = Watched(browser, path.as_uri())
    try:
        p = w.page
        assert p.is_visible("#view-results")
        assert p.query_selector("#result-legend .legend canvas") is not None
        assert "normalised effect" in p.inner_text("#result-legend")
        assert p.inner_text(".result-pick[aria-checked='true']") == "patching: heads"
        info = p.evaluate("window.headspaceExplorer.result()")
        assert info["rows"] == ["L0", "L1", "L2"] and info["cols"] == [f"H{h}" for h in range(6)]
        assert info["values"] == heads.effect.tolist()
        assert info["canvas"][0] > 6 * 40 and info["canvas"][1] > 3 * 16  # drawn, room for the numbers
        (layer, head), value = heads.top(1)[0]
        p.mouse.move(*_cell_centre(p, layer, head))
        tip = p.inner_text("#tip")
        assert p.is_visible("#tip") and tip.startswith(f"L{layer}, H{head}: ")
        assert as_float(tip.split(": ")[1]) == pytest.approx(value, abs=5e-5 + 1e-7)
        assert p.inner_text("#result-top tbody tr:first-child td.tok") == f"L{layer} H{head}"
        p.mouse.click(*_cell_centre(p, 1, 4))  # follow layer 1, head 4 in the other views
        snap = w.snapshot()
        assert (snap["layer"], snap["head"]) == (1, 4)
        # the layer x position view, with the saved tokens as column labels
        p.click(".result-pick[data-index='1']")
        info = p.evaluate("window.headspaceExplorer.result()")
        assert info["name"] == "patching: resid" and info["cols"] == saved["tokens"]
        assert info["values"] == resid.effect.tolist()
        p.mouse.move(*_cell_centre(p, 2, 5))
        tip = p.inner_text("#tip")
        assert tip.startswith('L2, position 5 "w5": ')
        assert as_float(tip.split(": ")[1]) == pytest.approx(float(resid.effect[2, 5]), abs=5e-5 + 1e-7)
        p.focus(".result-pick[aria-checked='true']")
        p.keyboard.press("ArrowLeft")  # the selector works from the keyboard too
        assert p.evaluate("window.headspaceExplorer.result().index") == 0
        assert w.errors == []
        assert w.requests == [path.as_uri()]
    finally:
        w.page.close()
