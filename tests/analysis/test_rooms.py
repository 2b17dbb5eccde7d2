"""analysis/ in rooms by product (issue 37): every old flat module path is the module in its room itself,
and no room imports another room's private names."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import headspace

ANALYSIS = Path(__file__).resolve().parents[2] / "src" / "headspace" / "analysis"

#: old module (under headspace.analysis) -> its module in a room, as the rooms were laid out in #37
MOVED = {
    "atlas_state": "atlas.state",
    "atlas_measure": "atlas.measure",
    "atlas_ablation": "atlas.ablation",
    "corpus": "atlas.corpus",
    "atlas_guard": "atlas.guard",
    "patching": "causal.patching",
    "attribution": "causal.attribution",
    "interventions": "causal.interventions",
    "causal_inputs": "causal.causal_inputs",
    "ablation": "causal.ablation",
    "targets": "causal.targets",
    "atp_star": "circuits.atp_star",
    "atp_edges": "circuits.atp_edges",
    "atlas_importance": "atlas.importance",
    "cross_lesson": "lesson.cross",
    "alignment": "lesson.alignment",
    "encdec_patching": "causal.encdec_patching",
    "budget": "causal.budget",
    "graph": "circuits.graph",
    "decomposition": "circuits.decomposition",
    "tasks": "circuits.tasks",
    "explain": "lesson.explain",
    "roles": "lesson.roles",
    "subspaces": "lesson.subspaces",
    "rotary": "lesson.rotary",
    "mixing": "lesson.mixing",
    "chunked": "lesson.chunked",
    "content_tokens": "lesson.content_tokens",
}
#: old modules whose name is now a room's package: the package re-exports the module's public names
BECAME_ROOMS = {"atlas": "atlas.run", "circuits": "circuits.edges", "trace": "trace.trace"}
ROOMS = ("atlas", "causal", "circuits", "lesson", "trace")


def _public_names(module: object) -> set[str]:
    """Names a module defines itself (functions, classes, top-level assignments), without a leading _."""
    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))  # type: ignore[attr-defined]
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if not n.startswith("_")}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_every_old_path_is_the_module_in_its_room(old: str, monkeypatch: pytest.MonkeyPatch) -> None:
    new = importlib.import_module(f"headspace.analysis.{MOVED[old]}")
    all_names = headspace.analysis.__all__
    assert importlib.import_module(f"headspace.analysis.{old}") is new
    # the attribute is the module, or the function of that name the package exports (atp_star)
    expected = getattr(new, old) if old in all_names else new
    assert getattr(headspace.analysis, old) is expected
    if old in all_names:
        return  # a dotted path through it reaches the function, as it did before the rooms
    # a monkeypatch through the old dotted path is seen by the module in its room
    marker = object()
    monkeypatch.setattr(f"headspace.analysis.{old}._rooms_probe", marker, raising=False)
    assert new._rooms_probe is marker


@pytest.mark.parametrize("old", sorted(BECAME_ROOMS))
def test_a_room_named_as_an_old_module_reexports_its_public_names(old: str) -> None:
    room = importlib.import_module(f"headspace.analysis.{old}")
    module = importlib.import_module(f"headspace.analysis.{BECAME_ROOMS[old]}")
    public = _public_names(module)
    assert public, "the scan must see the module's names"
    assert {n for n in public if getattr(room, n, None) is not getattr(module, n)} == set()


def test_the_monkeypatch_strings_the_tests_use_reach_the_room_modules(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from headspace.analysis.causal import patching
    from headspace.analysis.lesson import roles

    spy = object()
    monkeypatch.setattr("headspace.analysis.patching.run_from_layers", spy)
    monkeypatch.setattr("headspace.analysis.roles.AUTO_PATTERN_BYTES", 1000)
    assert patching.run_from_layers is spy and roles.AUTO_PATTERN_BYTES == 1000


def test_the_analysis_package_keeps_its_names() -> None:
    import headspace.analysis as analysis

    assert callable(analysis.atlas) and analysis.atlas.__module__ == "headspace.analysis.atlas.run"
    assert callable(analysis.trace)  # the trace room, callable as the trace module was
    for name in analysis.__all__:
        assert getattr(analysis, name) is not None


def _room_of(path: Path, root: Path) -> str | None:
    parts = path.relative_to(root).parts
    return parts[0] if len(parts) > 1 else None


def cross_room_private_imports(root: Path) -> list[str]:
    """``file: module [names]`` for every private name a room imports from another room or from outside
    ``analysis/`` (its own room's private names are its own)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        room = _room_of(path, root)
        if room is None:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            module = node.module or ""
            if node.level == 2 and module.split(".")[0] in ROOMS:
                target = module.split(".")[0]
            elif node.level == 0 and module.startswith("headspace.analysis."):
                target = module.split(".")[2]
            elif node.level >= 3 or (node.level == 0 and module.startswith("headspace")):
                target = "outside analysis/"  # another package's private names (model._Stack was one)
            else:
                continue
            private = [a.name for a in node.names if a.name.startswith("_")]
            if target != room and private:
                found.append(f"{path.relative_to(root).as_posix()}: {node.module} {private}")
    return found


def test_the_scan_finds_cross_room_private_imports(tmp_path: Path) -> None:
    (tmp_path / "atlas").mkdir()
    (tmp_path / "causal").mkdir()
    (tmp_path / "atlas" / "x.py").write_text(
        "from ..causal.ablation import _replicate, mean_z\n"
        "from .state import _own\n"
        "from .._common import eval_mode\n"
        "from headspace.analysis.lesson.roles import _plan\n"
        "from ...model.models import _Stack, Decoder\n",
        encoding="utf-8",
    )
    (tmp_path / "causal" / "y.py").write_text("from ..causal.ablation import _same_room\n", encoding="utf-8")
    assert cross_room_private_imports(tmp_path) == [
        "atlas/x.py: causal.ablation ['_replicate']",
        "atlas/x.py: headspace.analysis.lesson.roles ['_plan']",
        "atlas/x.py: model.models ['_Stack']",
    ]


def test_no_room_imports_another_rooms_private_names() -> None:
    assert cross_room_private_imports(ANALYSIS) == []


def room_imports(root: Path) -> dict[str, set[str]]:
    """Per room, the other rooms its modules import (module-level and inside functions alike)."""
    found: dict[str, set[str]] = {room: set() for room in ROOMS}
    for room in ROOMS:
        for path in (root / room).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.level == 2 and node.module:
                    other = node.module.split(".")[0]
                    if other in ROOMS and other != room:
                        found[room].add(other)
    return found


def test_the_rooms_import_each_other_one_way() -> None:
    """No two rooms import each other, directly or round a longer loop: the rooms form layers."""
    graph = room_imports(ANALYSIS)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph[start])

    circles = [room for room in ROOMS if reaches(room, room, {room})]
    assert circles == [], f"rooms on an import circle: {circles} ({graph})"
