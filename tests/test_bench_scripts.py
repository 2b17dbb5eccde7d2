"""The encode benchmark script runs end to end on tiny sizes and writes its JSON."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}_script", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_encode_script_compares_three_models_and_reports_each_round(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], keep_threads: None
) -> None:
    out = tmp_path / "encode.json"
    argv = ["--sentences", "6", "--batch-size", "4", "--rounds", "3", "--threads", "1", "--out", str(out)]
    assert _script("encode").main(argv) == 0
    doc = json.loads(out.read_text())
    assert [r["model"] for r in doc["rows"]] == [
        "headspace",
        "sentence-transformers",
        "transformers BertModel (sdpa)",
    ]
    assert all(r["max_abs_diff"] <= 1e-5 and len(r["times_s"]) == 3 for r in doc["rows"])
    per_round = doc["speedup_per_round"]
    times = {r["model"]: r["times_s"] for r in doc["rows"]}
    for i, x in enumerate(per_round):  # each round's faster reference over that round's headspace
        best = min(times["sentence-transformers"][i], times["transformers BertModel (sdpa)"][i])
        assert x == pytest.approx(best / times["headspace"][i])
    assert doc["rounds_target_met"] == sum(x >= doc["target"] for x in per_round)
    assert doc["target_met"] == (doc["speedup_vs_faster_reference"] >= doc["target"])
    assert "target held in" in capsys.readouterr().out
    assert not list(tmp_path.glob("*.tmp*"))


def test_attention_quick_run_never_replaces_the_published_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep_threads: None
) -> None:
    monkeypatch.chdir(tmp_path)  # the default output paths are relative to the working folder
    argv = ["--quick", "--seq", "8", "--batch", "1", "--d-model", "6", "--n-heads", "2", "--repeats", "1"]
    assert _script("attention").main([*argv, "--no-memory", "--threads", "1"]) == 0
    results = tmp_path / "benchmarks" / "results"
    assert (results / "attention_quick.json").exists()
    assert not (results / "attention.json").exists()
