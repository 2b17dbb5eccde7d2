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
        (["--forward-rounds", "0"], "--forward-rounds must be positive"),
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


def _fake_row(family: str, size: str, tok_s: float) -> dict:
    """A row as measure() returns it, with made-up figures (the --update tests measure nothing)."""
    one = {lib: {"median": tok_s, "min": tok_s, "max": tok_s} for lib in LIBS}
    return {"family": family, "size": size, "load_s": one, "forward_tok_s": one, "decode_tok_s": one,
            "logits_rel_diff": {lib: 0.0 for lib in LIBS}}  # fmt: skip


def test_update_replaces_the_measured_rows_and_keeps_the_others(tmp_path: Path) -> None:
    module = _script()
    module.decoder_families = lambda: ["gpt2", "llama", "gemma2"]  # the whole table, for `complete`
    out, speed = tmp_path / "families.json", {"gpt2": 10.0, "llama": 20.0, "gemma2": 30.0}

    def fake(family: str, size: str, args: object, root: Path) -> dict:
        if speed[family] is None:
            raise RuntimeError(f"no {family}")
        return _fake_row(family, size, speed[family])

    module.measure = fake
    speed["gemma2"] = None
    assert module.main(["--quick", "--families", "gemma2,llama,gpt2", "--out", str(out)]) == 1
    first = json.loads(out.read_text())
    assert first["complete"] and "missing" not in first  # without --update: the run reached its end
    speed.update(gemma2=33.0, llama=22.0)
    assert module.main(["--quick", "--families", "gemma2", "--out", str(out), "--update"]) == 0
    doc = json.loads(out.read_text())
    rows = {r["family"]: r["forward_tok_s"]["headspace"]["median"] for r in doc["rows"]}
    assert [r["family"] for r in doc["rows"]] == ["gpt2", "llama", "gemma2"]  # the table's order
    assert rows == {"gpt2": 10.0, "llama": 20.0, "gemma2": 33.0}  # llama not re-measured: kept
    assert doc["failed"] == [] and doc["complete"] and doc["missing"] == []  # gemma2's failure replaced
    speed.update(llama=None)  # a family that fails now loses its old row: the file says it fails
    assert module.main(["--quick", "--families", "llama", "--out", str(out), "--update"]) == 1
    doc = json.loads(out.read_text())
    assert [r["family"] for r in doc["rows"]] == ["gpt2", "gemma2"]
    assert [f["family"] for f in doc["failed"]] == ["llama"]
    assert not doc["complete"] and doc["missing"] == ["llama (tiny)"]


def test_update_refuses_a_file_measured_otherwise_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    module = _script()
    out = tmp_path / "families.json"
    base = ["--quick", "--families", "gpt2", "--out", str(out), "--update"]
    assert module.parse_args(base).previous is None  # no file yet: a new one
    out.write_text(json.dumps({"benchmark": "families", "args": {"quick": True, "batch": 1, "seq": 8,
                                                                 "new": 4}, "rows": []}))  # fmt: skip
    assert module.parse_args(base).previous["rows"] == []
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"benchmark": "decode", "rows": []}))
    for argv, message in (
        ([*base, "--seq", "16"], "was measured with seq=8; this run has seq=16"),
        ([*base[:3], "--out", str(other), "--update"], "is not a results file of benchmarks/families.py"),
    ):
        with pytest.raises(SystemExit) as exc:
            module.parse_args(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert message in err[-1] and "Traceback" not in "\n".join(err)


@pytest.mark.slow
def test_every_decoder_family_has_a_config_near_125m_parameters() -> None:
    """transformers' defaults give some families billions of parameters (qwen3_next: 512 experts) or
    configs it refuses (gpt_neo's 24 attention layers): every family's config at each size builds."""
    import torch
    from transformers import AutoModelForCausalLM

    module = _script()
    four_wide_experts = {"mixtral", "olmoe", "gpt_oss"}  # 4 experts of 3072 (the morning's configs)
    for family in module.decoder_families():
        module.config_for(family, "tiny")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(module.config_for(family, "125m"))
        n = sum(p.numel() for p in model.parameters())
        assert 100e6 < n < (450e6 if family in four_wide_experts else 180e6), (family, n)


@pytest.mark.slow
def test_the_families_added_to_the_benchmark_run_at_the_tiny_size(tmp_path: Path) -> None:
    module = _script()
    added = "gpt_neo,gemma4_text,gemma3n_text,qwen3_next,qwen3_5_text,deepseek_v2,deepseek_v3,llama4_text"
    out = tmp_path / "families.json"
    argv = ["--quick", "--families", added + ",diffllama", "--threads", "1", "--new", "2", "--out", str(out)]
    assert module.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["failed"] == [] and len(doc["rows"]) == 9
    for r in doc["rows"]:
        assert max(r["logits_rel_diff"].values()) < 1e-5 and all(r["same_greedy_tokens"].values())
        assert r["n_params"] > 0 and r["measured"]["median_of"] == 1 == r["measured"]["forward_median_of"]
