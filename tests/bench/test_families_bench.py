"""benchmarks/families.py: a --quick run on two families (tiny checkpoints written by transformers), its
JSON against its printed table, its argument checks, and the committed results left untouched."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
LIBS = ("headspace", "transformers eager", "transformers sdpa")


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_families_script", BENCHMARKS / "families.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_quick_run_on_two_families(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    module = _script()
    published = sorted(p.name for p in (BENCHMARKS / "results").iterdir())
    out = tmp_path / "families.json"
    argv = ["--quick", "--families", "gptj,gemma2", "--threads", "1", "--new", "2", "--out", str(out)]
    assert module.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "families" and doc["failed"] == []
    assert [(r["family"], r["size"]) for r in doc["rows"]] == [("gptj", "tiny"), ("gemma2", "tiny")]
    gptj, gemma2 = doc["rows"]
    assert gptj["shape"] == {"d_model": 64, "n_layers": 2, "n_heads": 4, "d_head": 16}
    assert set(gptj["load_s"]) == set(gptj["forward_tok_s"]) == set(LIBS)
    # transformers has no sdpa path for Gemma 2: left out, with transformers' reason
    assert "transformers sdpa" in gemma2["left_out"] and "transformers sdpa" not in gemma2["load_s"]
    for r in doc["rows"]:
        assert max(r["logits_rel_diff"].values()) < 1e-5  # the timed models compute the same logits
        assert all(r["same_greedy_tokens"].values())
        assert r["forward_tok_s"]["headspace"]["min"] <= r["forward_tok_s"]["headspace"]["median"]
    printed = capsys.readouterr().out
    assert f"| gptj | tiny | {gptj['load_s']['headspace']['median']:.3f} |" in printed
    assert f"{gptj['forward_tok_s']['headspace']['median']:.0f}" in printed
    assert "| gemma2 | tiny |" in printed and " - |" in printed  # the missing sdpa column
    assert sorted(p.name for p in (BENCHMARKS / "results").iterdir()) == published


def test_the_size_is_what_the_issue_asks_and_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    module = _script()
    cfg = module.config_for("gpt_neox", "125m")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (768, 12, 12)
    assert cfg.partial_rotary_factor == 0.25  # the family's own field
    assert module.config_for("gptj", "125m").rotary_dim == 32  # half of d_head 64: partial, interleaved
    assert set(module.decoder_families()) >= {"gptj", "phi", "gpt_neox", "llama"}
    for argv, message in (
        (["--families", "bert"], "--families takes decoder model_types"),
        (["--sizes", "huge"], "--sizes takes sizes of"),
        (["--quick", "--save"], "a --quick smoke run is never published"),
        (["--repeats", "0"], "--repeats must be positive"),
    ):
        with pytest.raises(SystemExit) as exc:
            module.parse_args(argv)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err


def test_the_real_model_is_one_llama_row_and_the_json_is_written_after_every_family(tmp_path: Path) -> None:
    module = _script()
    args = module.parse_args(["--sizes", "125m,real", "--families", "gpt2,llama"])
    assert module.jobs(args) == [("gpt2", "125m"), ("llama", "125m"), ("llama", "real")]
    assert module.jobs(module.parse_args(["--sizes", "real", "--families", "gpt2"])) == []
    assert "real" in module.parse_args([]).sizes  # measured by default, beside the random sizes
    # the JSON is rewritten after each family: the second family sees the first one's file on disk
    out, seen = tmp_path / "families.json", []

    def fake(family: str, size: str, args: object, root: Path) -> dict:
        seen.append(json.loads(out.read_text())["failed"] if out.exists() else None)
        raise RuntimeError(f"no {family}")

    module.measure = fake
    assert module.main(["--quick", "--families", "gpt2,llama", "--out", str(out)]) == 1
    assert seen[0] is None and seen[1] == [
        {"family": "gpt2", "size": "tiny", "error": "RuntimeError: no gpt2"}
    ]
    doc = json.loads(out.read_text())
    assert doc["complete"] and [f["family"] for f in doc["failed"]] == ["gpt2", "llama"]
