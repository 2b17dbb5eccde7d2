"""No file in ``src/headspace`` over 700 lines and no Python function over 80 (issue 37).

A file is measured in lines (``str.splitlines``), whatever its kind: Python, and the C++, JavaScript,
CSS and HTML shipped beside it. A function (``def``, ``async def``, methods and nested functions alike)
is measured from its ``def`` line to its last line, docstring and comments included; decorators are not
counted. Every offender is named with its size, so one run lists all that is left to split.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "headspace"

MAX_FILE_LINES = 700
MAX_FUNCTION_LINES = 80

#: the files measured: every source and asset kind that ``src/headspace`` holds
SUFFIXES = (".py", ".cpp", ".h", ".js", ".css", ".html")


def long_files(root: Path, limit: int = MAX_FILE_LINES) -> list[str]:
    """``"path: N lines"`` for each file under ``root`` of a kind in :data:`SUFFIXES` over ``limit`` lines."""
    found = []
    for path in sorted(root.rglob("*")):
        if path.suffix in SUFFIXES and path.is_file():
            n = len(path.read_text(encoding="utf-8").splitlines())
            if n > limit:
                found.append(f"{path.relative_to(root)}: {n} lines")
    return found


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``"path:line name: N lines"`` for every Python function under ``root`` over ``limit`` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in sorted(functions, key=lambda f: f.lineno):
            assert node.end_lineno is not None
            n = node.end_lineno - node.lineno + 1
            if n > limit:
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {n} lines")
    return found


def _function(name: str, body_lines: int, indent: str = "") -> str:
    """A function of exactly ``2 + body_lines`` lines: its ``def``, a docstring line, then ``body_lines``."""
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(body_lines))
    return f'{indent}def {name}() -> None:\n{indent}    """Doc."""\n{body}'


def test_the_scan_names_each_offender_with_its_size(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text(
        _function("fits", 78)  # 80 lines: at the limit
        + _function("too_long", 79)  # 81 lines
        + "class C:\n"
        + _function("method", 90, indent="    ")  # 92 lines
        + "async def outer() -> None:\n"
        + _function("inner", 100, indent="    ")  # 102 lines inside an outer of 104
        + "    return None\n",
        encoding="utf-8",
    )
    (tmp_path / "pkg" / "b.js").write_text("x;\n" * 701, encoding="utf-8")
    (tmp_path / "pkg" / "e.py").write_text("x = 1\n" * 702, encoding="utf-8")
    (tmp_path / "c.cpp").write_text("x;\n" * 700, encoding="utf-8")  # at the limit
    (tmp_path / "d.txt").write_text("x\n" * 900, encoding="utf-8")  # not a source kind
    assert long_files(tmp_path) == [
        "pkg/b.js: 701 lines",
        "pkg/e.py: 702 lines",
    ]
    assert long_functions(tmp_path) == [
        "pkg/a.py:81 too_long: 81 lines",
        "pkg/a.py:163 method: 92 lines",
        "pkg/a.py:255 outer: 104 lines",
        "pkg/a.py:256 inner: 102 lines",
    ]


def test_no_file_over_700_lines() -> None:
    offenders = long_files(SRC)
    assert not offenders, f"{len(offenders)} file(s) over {MAX_FILE_LINES} lines: " + "; ".join(offenders)


def test_no_function_over_80_lines() -> None:
    offenders = long_functions(SRC)
    assert not offenders, f"{len(offenders)} function(s) over {MAX_FUNCTION_LINES} lines: " + "; ".join(
        offenders
    )
