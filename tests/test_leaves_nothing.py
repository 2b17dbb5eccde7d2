"""The test session writes nothing outside its temporary folders: not under $HOME (ONNX Runtime's telemetry
store), and pytest's own tmp_path folders are kept only for the tests that failed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# benchmarks/encode.py's ONNX Runtime path in small: import, build a session, run it
_ONNXRUNTIME = """
import numpy as np, onnx, onnxruntime as ort
from onnx import TensorProto, helper
x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
print(session.run(None, {"x": np.array([-1.0, 2.0], np.float32)})[0].tolist())
"""


def test_onnxruntime_under_the_test_environment_writes_nothing_under_home(tmp_path: Path) -> None:
    """A child with this session's environment (as the benchmark scripts' children and torchrun ranks get
    it) and an empty $HOME loads ONNX Runtime and runs a graph; $HOME stays empty."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "XDG_CACHE_HOME"}
    env["HOME"] = str(home)
    command = [sys.executable, "-c", _ONNXRUNTIME]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[0.0, 2.0]"
    assert sorted(str(p.relative_to(home)) for p in home.rglob("*")) == []


def test_pytest_keeps_tmp_path_folders_of_failed_tests_only(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The project's pytest settings, run on two tests that each write a file into tmp_path: after the
    session only the failing test's folder is still there (pytest's default keeps every test's folder
    of the last three sessions)."""
    assert request.config.getini("tmp_path_retention_policy") == "failed"
    assert int(request.config.getini("tmp_path_retention_count")) == 1
    (tmp_path / "test_two.py").write_text(
        textwrap.dedent(
            """
            def test_passes(tmp_path):
                (tmp_path / "kept_if_failed.bin").write_bytes(bytes(1024))

            def test_fails(tmp_path):
                (tmp_path / "kept_if_failed.bin").write_bytes(bytes(1024))
                assert False
            """
        )
    )
    root = tmp_path / "root"
    root.mkdir()
    env = dict(os.environ, PYTEST_DEBUG_TEMPROOT=str(root))
    settings = ["-p", "no:cacheprovider", "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *settings, str(tmp_path / "test_two.py")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert "1 failed, 1 passed" in done.stdout, done.stdout + done.stderr
    left = sorted(p.parent.name for p in root.rglob("kept_if_failed.bin"))
    assert left == ["test_fails0"]
