"""Every public name keeps working: ``headspace.__all__``, the dotted paths the README and docs name, and
the lazy loading that keeps ``import headspace`` (and ``headspace --help``) free of torch."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import headspace

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _documented_paths() -> list[str]:
    found: set[str] = set()
    for doc in DOCS:
        found |= set(re.findall(r"\bheadspace(?:\.[A-Za-z_][A-Za-z0-9_]*)+", doc.read_text(encoding="utf-8")))
    return sorted(found)


def _resolve(path: str) -> object:
    """Import the longest importable module prefix of ``path``, then follow attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(path)


@pytest.mark.parametrize("name", headspace.__all__)
def test_every_name_in_all_resolves(name: str) -> None:
    assert getattr(headspace, name) is not None
    assert name in dir(headspace)


def test_the_docs_name_paths_at_all() -> None:
    assert len(_documented_paths()) >= 10  # the scan below must see the README's paths


@pytest.mark.parametrize("path", _documented_paths())
def test_every_documented_path_resolves(path: str) -> None:
    assert _resolve(path) is not None


def test_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        headspace.no_such_name  # noqa: B018


def test_trace_is_callable_after_its_module_is_imported() -> None:
    import headspace.analysis.trace  # binds headspace.trace to the submodule

    layer = headspace.MultiHeadAttention(6, 2)
    import torch

    with headspace.trace(layer, names="hook_pattern") as t:
        layer(torch.randn(1, 3, 6))
    assert t["hook_pattern"].shape == (1, 2, 3, 3)


def test_import_and_help_do_not_import_torch() -> None:
    code = (
        "import sys, headspace\n"
        "from headspace.cli import cli\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("old", sorted(headspace._MOVED))
def test_every_moved_module_keeps_its_old_import_path(old: str) -> None:
    """#26 moved the flat modules into packages: ``headspace.<old>`` is the module at its new home itself
    (one object, so a monkeypatch of either is seen by both), importable and as an attribute."""
    new = importlib.import_module(f"headspace.{headspace._MOVED[old]}")
    assert importlib.import_module(f"headspace.{old}") is new
    parent = headspace
    for part in old.split("."):  # headspace.train.plots: the attribute of headspace.train
        parent = getattr(parent, part)
    # headspace.analysis.atp_star stays the function of that name, as before analysis/ had rooms (#37)
    assert parent is new or parent is getattr(new, old.rpartition(".")[2], None)
    assert new.__spec__.name == new.__name__ == f"headspace.{headspace._MOVED[old]}"  # its own spec kept


@pytest.mark.parametrize(
    "path",
    [
        "headspace.attention.MultiHeadAttention",
        "headspace.attention.KVCache",
        "headspace.attention.rotate_fused",
        "headspace.decoding.DecodePlan",
        "headspace.decoding.generation_caches",
        "headspace.generate.generate",
        "headspace.workspace.Workspace",
        "headspace.masks.canonical_mask",
        "headspace.block.TransformerBlock",
        "headspace.models.Decoder",
        "headspace.trace.Trace",
        "headspace.explain.explain",
        "headspace.tokenization.readable_token",
        "headspace.fileio.write_json",
        "headspace.compat.MultiheadAttention",
        "headspace.train.plots.plot_run",
        "headspace.train.plots.read_metrics",
        "headspace.train.plots.METRICS_FILE",
    ],
)
def test_names_at_their_old_paths(path: str) -> None:
    assert _resolve(path) is not None


def test_old_module_paths_in_a_fresh_process() -> None:
    code = (
        "from headspace.masks import canonical_mask\n"
        "from headspace.block import TransformerBlock\n"
        "import headspace.trace, headspace.positions as p, headspace.nn.positions as q\n"
        "assert callable(headspace.trace) and p is q\n"
        "from headspace.generate import generate\n"
        "from headspace.decoding import DecodePlan\n"
        "from headspace.train.plots import plot_run, read_metrics\n"
        "from headspace.train import plots\n"
        "import headspace.viz.training as v\n"
        "assert plots is v and plot_run is v.plot_run and read_metrics is v.read_metrics\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
