"""The team's limit of 80 lines a function holds for the command line and the explorer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "headspace"
PARTS = ("cli", "viz/explorer", "core/threads.py", "core/progress.py")


def _functions(part: str) -> list[tuple[str, int]]:
    root = SRC / part
    files = [root] if root.suffix == ".py" else sorted(root.rglob("*.py"))
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1  # the def line to the last, decorators apart
                found.append((f"{path.relative_to(SRC)}:{node.name}", length))
    return found


@pytest.mark.parametrize("part", PARTS)
def test_no_function_is_longer_than_80_lines(part: str) -> None:
    functions = _functions(part)
    assert functions
    assert [(name, n) for name, n in functions if n > 80] == []
