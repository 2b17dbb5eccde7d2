"""benchmarks/cli.py, the README's commands timed quiet and beside one competing process: its smoke run
(--quick) on a tiny GPT-2 folder, and its engine figures read from the published benchmarks."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from headspace.bench.scripts import output_path

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return _load("bench_cli_script", ROOT / "benchmarks" / "cli.py")


def test_the_engine_figures_come_from_the_published_benchmarks(script: ModuleType) -> None:
    circuits = json.loads((ROOT / "benchmarks/results/circuits.json").read_text())
    rows = {r["case"]: r["headspace_s"] for r in circuits["rows"]}
    assert script.engine_circuit() == pytest.approx(
        rows["eap-ig (5 steps)"] + rows["faithfulness curve (11 points)"]
    )
    heads = json.loads((ROOT / "benchmarks/results/heads.json").read_text())
    assert script.engine_heads() == next(r["wall_s"] for r in heads["rows"] if r["case"] == "engine")
    atlas = json.loads((ROOT / "benchmarks/results/atlas.json").read_text())["parts"]
    per_token = 1 / atlas["stats"]["tokens_per_s"] + 1 / atlas["importance"]["tokens_per_s"]  # atp*
    assert script.engine_atlas(162) == pytest.approx(162 * per_token)
    assert 0 < script.engine_generate(6, 32) < 32 * 0.1  # 32 steps of tens of milliseconds


@pytest.mark.slow
def test_quick_run_times_every_command_quiet_and_busy(
    script: ModuleType, tiny_gpt2: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import transformers

    folder = tiny_gpt2()  # its tokenizer, and a model with room for `heads`' induction test (2 x 50 tokens)
    config = transformers.GPT2Config.from_pretrained(str(folder))
    config.n_positions = 128
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(str(folder))
    out = tmp_path / "cli.json"
    assert script.main(["--quick", "--model", str(folder), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "cli" and doc["quick"]
    assert [(r["command"], r["mode"]) for r in doc["rows"]] == [
        (c, m) for m in ("quiet", "busy") for c in script.COMMANDS
    ]
    assert {"explain", "patch", "attribute"} <= set(script.COMMANDS)  # the README's first commands
    assert all(r["rc"] == 0 and r["wall_s"] > 0 and r["load_s"] > 0 for r in doc["rows"])
    printed = capsys.readouterr().out
    for row in doc["table"]:
        assert row["busy_over_quiet"] == pytest.approx(row["busy_s"] / row["quiet_s"], abs=0.01)
        assert f"| {row['command']} | {row['quiet_s']} | {row['busy_s']} |" in printed


def test_local_by_default_and_save_refused_with_out_or_quick(script: ModuleType, tmp_path: Path) -> None:
    assert script.RESULTS == ROOT / "benchmarks" / "results" and script.output_path is output_path
    for argv in (["--save", "--out", str(tmp_path / "x.json")], ["--save", "--quick"], ["--commands", "x"]):
        with pytest.raises(SystemExit) as exc:
            script.main(argv)
        assert exc.value.code == 2
    assert not list(tmp_path.iterdir())


def test_the_readme_timings_are_the_published_benchmark(script: ModuleType, tmp_path: Path) -> None:
    doc = json.loads((ROOT / "benchmarks/results/cli.json").read_text())
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start, end = (readme.index(m) for m in script.MARKERS)
    assert readme[start + len(script.MARKERS[0]) : end] == script.readme_sentence(doc)
    for row in doc["table"]:
        assert f"`{row['command']}` {row['quiet_s']:.1f} s" in readme  # every timed command is quoted
    copy = tmp_path / "README.md"
    copy.write_text(readme.replace(script.readme_sentence(doc), "stale"), encoding="utf-8")
    script.write_readme(doc, copy)
    assert copy.read_text(encoding="utf-8") == readme
