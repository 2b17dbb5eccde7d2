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
    quiet = {r["command"]: r for r in doc["rows"] if r["mode"] == "quiet"}
    for name in script.ENGINES:  # the engine timed in the same run, by the command's own arguments
        assert quiet[name]["engine_run_s"] > 0 and quiet[name]["engine_load_s"] > 0
        assert quiet[name]["engine_wall_s"] > quiet[name]["engine_load_s"] + quiet[name]["engine_run_s"]
        assert sum(quiet[name]["engine_parts"].values()) == pytest.approx(
            quiet[name]["engine_run_s"], abs=0.01
        )
    assert set(quiet["circuit"]["engine_parts"]) == {"edge_scores", "faithfulness_curve"}
    assert set(quiet["heads"]["engine_parts"]) == {"head_roles", "head_importance"}
    printed = capsys.readouterr().out
    for row in doc["table"]:
        assert row["engine_source"] == ("same run" if row["command"] in script.ENGINES else None)
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


def test_the_ratio_of_the_target_is_against_the_same_run_engine(script: ModuleType) -> None:
    rows = [
        {"command": "heads", "mode": "quiet", "load_s": 3.0, "wall_s": 8.0, "rc": 0, "engine_run_s": 2.0},
        {"command": "atlas", "mode": "quiet", "load_s": 3.0, "wall_s": 8.0, "rc": 0, "engine_run_s": None},
    ]
    heads, atlas = script.summarise(rows, {"heads": 4.0, "atlas": 1.0})
    assert heads["engine_s"] == heads["engine_run_s"] == 2.0 and heads["engine_source"] == "same run"
    assert heads["expected_s"] == 5.0 and heads["quiet_over_expected"] == 1.6
    assert heads["quiet_over_probe"] is None  # no probe wall time given
    assert heads["engine_published_s"] == 4.0 and heads["quiet_over_published"] == pytest.approx(
        8 / 7, abs=0.01
    )
    # the probe failed: the published figure is the fallback, and says so
    assert atlas["engine_s"] == 1.0 and atlas["engine_source"] == "published" and atlas["expected_s"] == 4.0


def test_the_engine_probe_takes_the_commands_own_arguments_and_defaults(tmp_path: Path) -> None:
    engine = _load("bench_cli_engine_script", ROOT / "benchmarks" / "cli_engine.py")
    p = engine.command_params(["circuit", "--model", "smollm2", "--out", str(tmp_path / "o"), "--pairs", "4"])
    assert (p["method"], p["steps"], p["pairs"], p["batch_size"]) == ("eap-ig", 5, 4, 32)
    p = engine.command_params(["generate", "--model", "smollm2", "Hello", "--tokens", "7"])
    assert (p["target"], p["max_new_tokens"], p["temperature"], p["seed"]) == ("Hello", 7, 0.8, 0)
    p = engine.command_params(["atlas", "--model", "smollm2", "--corpus", "c", "--out", str(tmp_path / "a")])
    assert (p["importance"], p["window"], p["batch_size"]) == ("atp*", 512, 8)
    assert set(engine.RUNS) == set(engine.ENGINES) and not list(tmp_path.iterdir())
