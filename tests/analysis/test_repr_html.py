"""Analysis results in a notebook: ``_repr_html_`` is a small, escaped layer x head table; ``to_json(path)``.

Small random models (distinct primes for the shapes), so every test runs in well under a second; the
notebook in examples/ shows the same on MiniLM (tests/test_notebooks.py).
"""

from __future__ import annotations

import html.parser
import json
import re
from pathlib import Path

import pytest
import torch

import headspace as hs
from headspace import MultiHeadAttention, analysis
from headspace.analysis._common import JsonResult, factored_html, format_number, html_table

pytestmark = pytest.mark.usefixtures("single_thread")

N_LAYERS, N_HEADS = 2, 3


@pytest.fixture(scope="module")
def decoder() -> hs.Decoder:
    torch.manual_seed(0)
    cfg = hs.ModelConfig(
        arch="decoder", vocab_size=17, d_model=15, n_layers=N_LAYERS, n_heads=N_HEADS, max_seq_len=16
    )
    return hs.Decoder(cfg).eval()


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 17, (2, 7), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def results(decoder: hs.Decoder, tokens: torch.Tensor) -> dict[str, JsonResult]:
    return {
        "roles": analysis.head_roles(decoder, tokens),
        "importance": analysis.head_importance(decoder, tokens, progress=False),
        "mixing": analysis.head_mixing(decoder, tokens),
        "overlaps": analysis.subspace_overlaps(decoder, "q"),
        "spectra": analysis.circuit_spectra(decoder),
    }


class _Checker(html.parser.HTMLParser):
    """Collects start tags, table header texts and cell texts; fails on a tag closed out of order."""

    VOID = frozenset({"br", "hr", "img", "meta", "link", "input"})

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.tags: list[str] = []
        self.headers: list[str] = []
        self.cells: list[str] = []
        self._text: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        if tag not in self.VOID:
            self.stack.append(tag)
        if tag in ("th", "td"):
            self._text = []

    def handle_endtag(self, tag: str) -> None:
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes {self.stack[-1:]}"
        self.stack.pop()
        if tag in ("th", "td") and self._text is not None:
            (self.headers if tag == "th" else self.cells).append("".join(self._text))
            self._text = None

    def handle_data(self, data: str) -> None:
        if self._text is not None:
            self._text.append(data)


def parse(text: str) -> _Checker:
    checker = _Checker()
    checker.feed(text)
    checker.close()
    assert not checker.stack, f"unclosed tags: {checker.stack}"
    return checker


@pytest.mark.parametrize("name", ["roles", "importance", "mixing", "overlaps", "spectra"])
def test_every_result_shows_small_well_formed_html_with_layer_and_head_labels(
    results: dict[str, JsonResult], name: str
) -> None:
    result = results[name]
    text = result._repr_html_()
    assert len(text) < 6_000, len(text)  # 2 layers x 3 heads: a few small tables, not the tensors
    page = parse(text)
    assert "script" not in page.tags and "style" not in page.tags  # nothing global in a notebook
    assert type(result).__name__ in text and result.kind in text
    assert {"L0", "L1"} <= set(page.headers)  # one row per layer
    if name != "overlaps":  # a layer x head table; the overlaps table has one row per layer
        assert {"H0", "H1", "H2"} <= set(page.headers) and "H3" not in page.headers
    for field in [f for f in result.to_dict() if f != "kind"]:
        assert field in page.cells  # the fields table names every field


def test_layer_head_cells_show_the_values(results: dict[str, JsonResult]) -> None:
    imp = results["importance"]
    cells = parse(imp._repr_html_()).cells
    for layer in range(N_LAYERS):
        for head in range(N_HEADS):
            assert format_number(float(imp.scores[layer, head])) in cells
    roles = results["roles"]
    cells = parse(roles._repr_html_()).cells
    assert any(c.startswith(roles.labels[0][0] + " ") for c in cells)  # "label mass"
    mix = results["mixing"]
    assert format_number(float(mix.mean_share[1, 2])) in parse(mix._repr_html_()).cells


def test_html_escapes_every_value_and_label() -> None:
    evil = '<script>alert("x")</script> & <b>'
    text = html_table([[evil, 1.5]], caption=evil, row_labels=[evil], col_labels=[evil, "n"], corner=evil)
    assert "<script>" not in text and "<b>" not in text
    assert "&lt;script&gt;" in text and "&amp;" in text and "&quot;" in text
    roles = analysis.roles_from_patterns([torch.full((1, 2, 3, 3), 1 / 3)])
    roles.labels[0][1] = evil  # a label with markup (as a caller could set)
    text = roles._repr_html_()
    assert "<script>" not in text and "&lt;script&gt;" in text
    parse(text)


def test_nan_heads_of_a_pruned_model_show_a_dash() -> None:
    cfg = hs.ModelConfig(arch="decoder", vocab_size=11, d_model=14, n_layers=2, n_heads=7, max_seq_len=8)
    model = hs.Decoder(cfg).eval()
    hs.prune_heads(model, {1: [5, 6]})
    mix = analysis.head_mixing(model, torch.randint(0, 11, (1, 5)))
    cells = parse(mix._repr_html_()).cells
    assert cells.count("\u2014") >= 2  # L1 H5, H6 are gone: NaN -> an em dash, not "nan"
    assert "nan" not in cells
    overlaps = analysis.subspace_overlaps(model, "q")
    rows = parse(overlaps._repr_html_()).cells[:12]  # the first table: heads, dim, ... per layer
    assert rows[0] == "7" and rows[6] == "5"  # layer 0 keeps 7 heads, layer 1 has 5 left


def test_big_tables_are_cut_and_say_so() -> None:
    text = html_table(
        [[i * j for j in range(100)] for i in range(100)], row_labels=[str(i) for i in range(100)]
    )
    assert "showing 64 of 100 rows and 64 of 100 columns" in text
    assert len(text) < 100_000


def test_to_json_with_a_path_returns_the_path_and_without_returns_the_text(
    results: dict[str, JsonResult], tmp_path: Path
) -> None:
    roles = results["roles"]
    out = roles.to_json(tmp_path / "new" / "roles.json", indent=1)
    assert out == tmp_path / "new" / "roles.json" and isinstance(out, Path)
    assert json.loads(out.read_text()) == json.loads(roles.to_json()) == roles.to_dict()
    assert isinstance(roles.to_json(str(tmp_path / "r.json")), Path)
    assert not list((tmp_path / "new").glob("*.tmp"))


def test_factored_matrix_html_shows_shapes_norm_and_spectrum() -> None:
    attn = MultiHeadAttention(d_model=35, n_heads=7)
    qk = attn.heads[2].qk()
    text = factored_html(qk)
    page = parse(text)
    assert "FactoredMatrix [35, 35] = A [35, 5] @ B [5, 35] (rank &lt;= 5)" in text
    s = torch.linalg.svdvals(qk.AB.detach().double())
    assert format_number(float(s[0])) in page.cells
    assert format_number(float(s.pow(2).sum().sqrt())) in page.cells
    assert {"|M|_F", "s1", "s5"} <= set(page.headers) and "s6" not in page.headers
    batched = factored_html(analysis.qk_circuit(attn, 0))  # one row per head
    assert {"[0]", "[6]"} <= set(parse(batched).headers) and len(batched) < 4_000
    bad = MultiHeadAttention(d_model=35, n_heads=7)
    with torch.no_grad():
        bad.W_Q[0, 0, 0] = float("nan")
    text = factored_html(bad.heads[0].qk())
    assert "non-finite" in text or "NaN" in text


def test_format_number_is_short() -> None:
    assert format_number(0.123456) == "0.123"
    assert format_number(1.0) == "1"
    assert format_number(float("nan")) == "\u2014"
    assert format_number(3) == "3"
    assert format_number(1.5e-7) == "1.5e-7"
    assert re.fullmatch(r"[-0-9.e]+", format_number(-12345.678))


def test_factored_matrix_shows_itself_in_a_notebook() -> None:
    """``FactoredMatrix._repr_html_`` is :func:`headspace.html.factored_html`: a QK circuit, an OV circuit,
    a batch of rotary circuits (one per offset) all display as small, well-formed, escaped tables."""
    import headspace.core.html
    from headspace.attention.circuits import FactoredMatrix, qk_factors
    from headspace.nn.positions import Rotary

    attn = MultiHeadAttention(d_model=35, n_heads=7)
    qk, ov = attn.heads[2].qk(), attn.heads[4].ov()
    for fm in (qk, ov):
        text = fm._repr_html_()
        assert text == headspace.html.factored_html(fm)
        page = parse(text)
        assert "script" not in page.tags and "style" not in page.tags
        s = torch.linalg.svdvals(fm.AB.detach().double())
        assert format_number(float(s[0])) in page.cells
    rot = Rotary(6)
    W_Q, W_K = torch.randn(11, 6), torch.randn(11, 6)
    deltas = torch.arange(3)
    circuits = qk_factors(W_Q, W_K, rotation=rot.rotation(deltas))  # [3, 11, 11]: one per offset
    page = parse(circuits._repr_html_())
    assert {"[0]", "[1]", "[2]"} <= set(page.headers)
    assert isinstance(circuits, FactoredMatrix)


def test_html_helpers_live_in_the_foundation_module_and_are_re_exported() -> None:
    """headspace.html is a foundation: the standard library, torch and (at most) headspace.checks."""
    import ast
    import inspect

    import headspace.analysis._common as common
    import headspace.core.html

    for name in ("format_number", "html_table", "factored_html", "_shade", "MAX_HTML_ROWS", "MAX_HTML_COLS"):
        assert getattr(common, name) is getattr(headspace.html, name), name
    tree = ast.parse(inspect.getsource(headspace.html))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(("." * node.level) + (node.module or ""))
    inside = {m for m in imported if m.startswith(".") or m.startswith("headspace")}
    assert inside <= {".checks", "headspace.checks"}, inside
