"""Every script in benchmarks/ runs end to end on tiny sizes; its JSON says what its printed table says.

Each script writes benchmarks/results/local/NAME.json by default (git-ignored) and replaces the committed
benchmarks/results/NAME.json only with ``--save``; every test here checks that the committed results
are left byte for byte as they were. The explorer's run needs Chromium: it skips without one, unless
``HEADSPACE_REQUIRE_BROWSER=1`` (CI), where a missing browser fails.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from headspace.bench import CASES, MODES
from headspace.bench.scripts import output_path
from headspace.kernels import native

pytestmark = pytest.mark.slow  # the whole module (pyproject.toml: -m slow runs it)

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
COMMITTED = BENCHMARKS / "results"
SCRIPTS = (
    "attention", "attention_parts", "decode", "decode_step", "encode", "explorer", "int8_kernels",
    "precision_cpus", "side_by_side", "trace_overhead", "train", "trace_memory", "heads", "atlas",
)  # fmt: skip
ELSEWHERE = {  # scripts whose smoke run lives with their own tests
    "patching": "needs headspace.load('smollm2'): tests/analysis/test_patching.py runs it",
    "long_inputs": "real runs need SmolLM2: tests/analysis/test_long_inputs.py runs it tiny (--random)",
    "compile": "tests/model/test_compile_models.py runs it tiny (--backend eager)",
    "circuits": "needs a tokenizer: tests/analysis/test_circuits.py runs it on a tiny GPT-2 folder",
    "atp_star": "needs a tokenizer: tests/analysis/test_circuits.py runs it on a tiny GPT-2 folder",
    "gemma3": "needs Gemma-3-270M and transformers' copy: tests/pretrained/test_gemma3.py runs its measure()",
    "cli": "runs the commands on a tiny GPT-2 folder: tests/cli/test_bench_cli.py runs it (--quick)",
    "cli_engine": "cli.py's same-run engine probe: tests/cli/test_bench_cli.py runs it beside each command",
    "families": "tests/bench/test_families_bench.py runs it (--quick, two families)",
    "whisper": "needs Whisper base and espeak-ng: tests/encdec/test_whisper_bench.py runs it (--quick)",
    "whisper_ct2_child": "whisper.py's ctranslate2 process: tests/encdec/test_whisper_bench.py runs both",
    "attention_variants": "tests/bench/test_attention_variants_bench.py runs it (--quick, two cases)",
}
CHROMIUM = os.environ.get("HEADSPACE_CHROMIUM", "/usr/bin/chromium")


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}_script", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _snapshot() -> dict[str, str]:
    """SHA-256 of every file under benchmarks/results/ except local/ (what a run must never touch)."""
    return {
        str(p.relative_to(COMMITTED)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(COMMITTED.rglob("*"))
        if p.is_file() and "local" not in p.relative_to(COMMITTED).parts
    }


@pytest.fixture(autouse=True)
def committed_results_untouched() -> Iterator[None]:
    before = _snapshot()
    yield
    assert _snapshot() == before, "a benchmark run changed or added files in benchmarks/results/"


@pytest.fixture
def keep_threads() -> Iterator[None]:
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _table_rows(text: str) -> list[list[str]]:
    """The cells of every Markdown table row (``| a | b |``), header and separator rows excluded."""
    rows: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not (line.startswith("|") and line.endswith("|")):
            continue
        if set(line) <= set("|-: "):  # the separator: the row before it was the header
            rows.pop()
            continue
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_every_script_has_a_smoke_test() -> None:
    found = {p.stem for p in BENCHMARKS.glob("*.py")}
    assert found - set(SCRIPTS) - set(ELSEWHERE) == set(), "a new benchmark script needs a smoke test here"


def test_the_committed_results_are_there() -> None:
    for name in SCRIPTS:
        doc = json.loads((COMMITTED / f"{name}.json").read_text())
        assert doc["benchmark"] == name


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_writes_local_results_by_default_and_publishes_only_with_save(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _script(name)
    assert module.RESULTS == COMMITTED  # the published folder is the repository's, wherever one runs from
    assert module.output_path is output_path  # the shared helper, not a copy of it
    results = tmp_path / "results"
    assert output_path(None, False, f"{name}.json", results) == results / "local" / f"{name}.json"
    assert output_path(None, True, f"{name}.json", results) == results / f"{name}.json"
    assert output_path("x/y.json", False, f"{name}.json", results) == Path("x/y.json")
    monkeypatch.setattr(module, "RESULTS", results)
    with pytest.raises(SystemExit) as exc:
        module.main(["--save", "--out", str(tmp_path / "z.json")])
    assert exc.value.code == 2  # argparse's error: --save and --out together
    assert not list(tmp_path.rglob("*.json"))


@pytest.mark.kernels
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
    printed = capsys.readouterr().out
    assert "target held in" in printed and f"wrote {out}" in printed
    table = _table_rows(printed)
    first = [
        [
            r["model"],
            f"{r['median_s']:.3f}",
            f"{r['sentences_per_s']:.1f}",
            f"{r['headspace_speedup']:.2f}x",
            f"{r['max_abs_diff']:.1e}",
        ]
        for r in doc["rows"]
    ]
    assert table[: len(first)] == first
    # the precisions table: every model at every precision, from the same rounds, said as in the JSON
    prec = doc["precision_rows"]
    assert [(r["model"], r["precision"]) for r in prec] == [
        ("headspace", "float32"),
        ("sentence-transformers", "float32"),
        ("ONNX Runtime", "float32"),
        ("headspace", "bfloat16"),
        ("sentence-transformers", "bfloat16"),
        ("headspace", "int8"),
        ("ONNX Runtime", "int8"),
    ]
    assert table[len(first) :] == [
        [
            r["model"],
            r["precision"],
            f"{r['median_s']:.3f}",
            f"{r['sentences_per_s']:.1f}",
            f"{r['speedup_vs_st_float32']:.2f}x",
            f"{r['min_cosine_to_float32']:.6f}",
            f"{r['max_abs_diff']:.1e}",
        ]
        for r in prec
    ]
    assert prec[0]["min_cosine_to_float32"] == pytest.approx(1.0) and prec[2]["max_abs_diff"] <= 1e-5
    assert all(len(r["times_s"]) == 3 for r in prec)
    for c in doc["precision_targets"]:
        assert c["met"] == (c["value"] >= c["limit"]) and f"{c['target']}: {c['value']:.2f}x" in printed
    assert {c["target"] for c in doc["accuracy_targets"]} >= {
        "bfloat16: min cosine to float32 >= 0.9999",
        "int8: min cosine to float32 >= 0.995",
        "int8: min cosine >= ONNX Runtime int8's",
    }
    assert not list(tmp_path.glob("*.tmp*"))


def test_attention_quick_run_never_replaces_the_published_results(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    keep_threads: None,
) -> None:
    module = _script("attention")
    monkeypatch.setattr(module, "RESULTS", tmp_path / "results")
    argv = ["--quick", "--seq", "8", "--batch", "1", "--d-model", "6", "--n-heads", "2", "--repeats", "1"]
    assert module.main([*argv, "--no-memory", "--threads", "1"]) == 0  # no --out: the local default
    results = tmp_path / "results"
    doc = json.loads((results / "local" / "attention_quick.json").read_text())
    assert not (results / "attention.json").exists() and not (results / "attention_quick.json").exists()
    printed = capsys.readouterr().out
    timing, accuracy = printed.split("output accuracy (float32)")
    # one table per mode, one seq column: "label | ms (x floor)"
    table = sorted((row[0], row[1].split()[0]) for row in _table_rows(timing) if len(row) == 2)
    assert table == sorted((r["label"], f"{r['median_ms']:.1f}") for r in doc["rows"])
    # then each layer's output error against float64: "label | abs (relative)", from the first mode
    errors = [row for row in _table_rows(accuracy) if len(row) == 2]
    first = [r for r in doc["rows"] if r["mode"] == "forward" and r["case"] != "gemm_floor"]
    assert errors == [[r["label"], f"{r['max_abs_error']:.1e} ({r['max_rel_error']:.1e})"] for r in first]
    assert len(doc["rows"]) == len(MODES) * len(CASES)  # forward and forward + backward, every case
    with pytest.raises(SystemExit):
        module.main([*argv, "--save"])  # a smoke run is never published
    assert not (results / "attention.json").exists()
    assert module.main([*argv, "--no-memory", "--threads", "1", "--dtype", "bfloat16"]) == 0
    doc = json.loads((results / "local" / "attention_quick_bfloat16.json").read_text())
    assert {r["dtype"] for r in doc["rows"]} == {"bfloat16"} and len(doc["rows"]) == len(MODES) * len(CASES)
    assert "n_heads=2, bfloat16, 1 threads" in capsys.readouterr().out


def test_decode_script_tiny_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], keep_threads: None
) -> None:
    out = tmp_path / "decode.json"
    argv = ["--layers", "1", "--heads", "2", "--d-model", "8", "--vocab", "11", "--positions", "4", "9", "6"]
    argv += ["--repeats", "2", "--full-repeats", "1", "--threads", "1", "--out", str(out), "--no-smollm2"]
    assert _script("decode").main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["positions"] == [4, 6, 9] and [r["position"] for r in doc["rows"]] == [4, 6, 9]
    assert doc["config"]["n_layers"] == 1 and doc["config"]["d_model"] == 8
    assert all(len(r["cached_times_ms"]) == 2 and len(r["full_times_ms"]) == 1 for r in doc["rows"])
    assert doc["position_1024_over_64"] == pytest.approx(doc["rows"][-1]["vs_position_64"])
    assert doc["target_met"] == (doc["position_1024_over_64"] <= doc["target"])
    printed = capsys.readouterr().out
    assert "cached vs position 4" in printed and "position 9 / position 4 (cached)" in printed
    assert _table_rows(printed) == [
        [
            str(r["position"]),
            f"{r['cached_ms']:.2f}",
            f"{r['full_recompute_ms']:.1f}",
            f"{r['recompute_over_cached']:.1f}x",
            f"{r['vs_position_64']:.2f}x",
        ]
        for r in doc["rows"]
    ]


def test_decode_script_smollm2_against_transformers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], keep_threads: None, smollm2_gguf
) -> None:
    out = tmp_path / "decode.json"
    argv = [
        "--smollm2-only",
        "--prompt-len",
        "16",
        "--decode-tokens",
        "2",
        "--decode-prompt",
        "4",
    ]
    argv += ["--accuracy-tokens", "40", "--smollm2-rounds", "1", "--threads", "1", "--out", str(out)]
    assert _script("decode").main(argv) == 0
    doc = json.loads(out.read_text())["smollm2"]
    rows = doc["rows"]
    names = ["headspace", "transformers", "headspace bfloat16", "headspace int8", "headspace prepack=False"]
    assert [r["model"] for r in rows] == [*names, "headspace native=False"]
    info = doc["native"]
    assert info["status"] == native.status() and info["compiler"] == native.compiler()
    if info["compiler"] is not None:  # built before the timed rounds, and one compile from nothing timed
        assert info["status"] == "loaded" and info["compile_s"] > 0 and info["build_s"] >= 0
    pack = doc["prepack_batch8"]
    assert pack["batch"] == 8 and pack["pack_s"] > 0 and pack["extra_mib"] > 0
    assert doc["same_greedy_tokens"] == {"1": True, "8": True}  # the same float32 weights, the same tokens
    floor = doc["products_floor_ms"]
    assert set(floor) == {"1", "8"} and all(v > 0 for v in floor.values())
    assert all(len(doc["products_floor_times_ms"][b]) == 1 for b in ("1", "8"))
    floor_bf16 = doc["products_floor_bf16_ms"]
    assert set(floor_bf16) == {"1", "8"} and all(v > 0 for v in floor_bf16.values())
    assert all(len(doc["products_floor_bf16_times_ms"][b]) == 1 for b in ("1", "8"))
    for r in rows[:2]:
        assert r["load_s"] > 0 and r["weights_mib"] > 500 and r["peak_extra_mib"] > 0
    assert rows[0]["top1_agreement"] == 1.0 and rows[0]["perplexity_ratio"] == 1.0
    assert all(0 < r["top1_agreement"] <= 1 and len(r["decode_times_ms_batch8"]) == 1 for r in rows)
    printed = capsys.readouterr().out
    products = "the products alone (151 float32 matrix products per token, nothing else)"
    assert f"{products}: batch 1 {floor['1']:.2f} ms" in printed
    ratio = floor_bf16["1"] / floor["1"]
    assert f"weights, nothing else): batch 1 {floor_bf16['1']:.2f} ms, {ratio:.2f}x the float32" in printed
    assert f"at batch 8 (generate's default there): {pack['pack_s']:.2f} s once per generate call" in printed
    targets = [t["target"] for t in doc["targets"]]
    assert "decode tokens/s over transformers', batch 1, native=False" in targets
    if info["compile_s"] is not None:
        assert "the native decoding step (headspace.kernels.native): loaded; compiling it takes " in printed
    assert "decode tokens/s over transformers', batch 1" in targets and not any(
        "compile" in t for t in targets
    )
    table = _table_rows(printed)
    assert table[:2] == [
        [
            r["model"],
            f"{r['load_s']:.2f}",
            f"{r['rss_extra_mib']:.0f} ({r['rss_extra_mib'] / r['weights_mib']:.2f}x)",
            f"{r['peak_extra_mib']:.0f} ({r['peak_extra_mib'] / r['weights_mib']:.2f}x)",
            f"{r['prefill_tokens_per_s']:.0f}",
            f"{r['decode_ms_batch1']:.2f}",
            f"{r['decode_ms_batch8']:.2f}",
        ]
        for r in rows[:2]
    ]
    assert table[2:] == [
        [
            r["model"],
            r["precision"],
            f"{r['prefill_tokens_per_s']:.0f}",
            f"{r['decode_ms_batch1']:.2f}",
            f"{r['decode_ms_batch8']:.2f}",
            f"{r['top1_agreement']:.4f}",
            f"{r['perplexity']:.3f}",
            f"{r['perplexity_ratio']:.4f}",
        ]
        for r in rows
    ]
    assert {c["target"] for c in doc["targets"]} == {
        "headspace load s",
        "headspace resident memory after load / float32 weights",
        "headspace peak memory during load / float32 weights",
        "decode tokens/s over transformers', batch 1",
        "decode tokens/s over transformers', batch 8",
        "decode tokens/s over transformers', batch 1, native=False",
        "decode tokens/s over transformers', batch 8, native=False",
        "bfloat16 decode ms/token / float32's, batch 1",
    }


def test_precision_cpus_script_native_and_avx2_emulated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], smollm2_gguf: Path
) -> None:
    module = _script("precision_cpus")
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # the children's folders: none may be left
    out = tmp_path / "precision_cpus.json"
    argv = ["--quick", "--settings", "native,AVX2 emulated", "--sentences", "4", "--tokens", "16"]
    argv += ["--rounds", "1", "--decode-tokens", "1", "--threads", "1", "--out", str(out)]
    assert module.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "precision_cpus" and doc["quick"] and doc["threads"] == 1
    assert (doc["sentences"], doc["tokens"], doc["rounds"], doc["decode_tokens"]) == (4, 16, 1, 1)
    assert [c["setting"] for c in doc["settings"]] == ["native", "AVX2 emulated"]
    native_child, avx2_child = doc["settings"]
    native_report, avx2_report = native_child["report"], avx2_child["report"]
    assert native_report["env"] == {} and native_report["forced_fallbacks"] == []
    # the emulated CPU is what the child saw: torch read the variables at its start
    assert avx2_report["env"] == module.AVX2 and avx2_report["forced_fallbacks"] == []
    assert avx2_report["aten_capability"] == "AVX2" and avx2_report["onednn_bf16"] is False
    assert avx2_report["bf16_product"] == "float32 gemm on bfloat16 values"
    # oneDNN capped at AVX2 sums int8 pairs in saturating int16: both int8 kernels fail the probe there
    assert (
        avx2_report["int8_product"]
        == avx2_report["int8_few_rows"]
        == ("float32 gemm of the quantised activations")
    )
    for c in doc["settings"]:
        assert c["threads"] == 1 and [e["rows"] for e in c["int8_check"]] == [1, 8, 64, 512]
        for e in c["int8_check"]:  # the int32 sums exact; apart only by quantisation on a boundary
            assert e["max_rel_error_same_quantisation"] <= 1e-5 and 0 <= e["max_rel_error"] <= 1e-3
            assert e["levels_apart"] > 0 or e["max_rel_error"] <= 1e-5
        for prec in ("float32", "bfloat16", "int8"):
            mini, smol = c["minilm"][prec], c["smollm2"][prec]
            assert len(mini["times_s"]) == len(smol["decode_times_ms"]) == 1 and mini["median_s"] > 0
            assert 0.99 < mini["min_cosine"] <= 1 + 1e-6 and 0 < smol["top1_agreement"] <= 1
        assert c["minilm"]["float32"]["max_abs_diff"] == 0 and c["smollm2"]["float32"]["top1_agreement"] == 1
    vs = native_child["float32_vs_reference"]  # the reference against itself
    assert vs["minilm_max_abs_diff"] == 0 and vs["smollm2_top1_agreement"] == 1
    assert vs["smollm2_perplexity_ratio"] == 1
    vs = avx2_child["float32_vs_reference"]  # float32 moves by rounding only
    assert vs["reference"] == "native" and vs["minilm_min_cosine"] > 0.9999
    assert 0 <= vs["minilm_max_abs_diff"] < 1e-4
    assert vs["smollm2_perplexity_ratio"] == pytest.approx(
        avx2_child["smollm2"]["float32"]["perplexity"] / native_child["smollm2"]["float32"]["perplexity"]
    )
    rows = doc["rows"]
    assert [(r["setting"], r["precision"]) for r in rows] == [
        (s, p) for s in ("native", "AVX2 emulated") for p in ("float32", "bfloat16", "int8")
    ]
    assert rows[4]["branch"] == "float32 gemm on bfloat16 values"
    assert rows[4]["minilm_min_cosine"] == avx2_child["minilm"]["bfloat16"]["min_cosine"]
    assert rows[3]["minilm_max_abs_diff"] == avx2_child["float32_vs_reference"]["minilm_max_abs_diff"]
    printed = capsys.readouterr().out
    assert "[1/2] native (no variables): running ..." in printed
    assert "[2/2] AVX2 emulated: done in " in printed
    table = _table_rows(printed)
    assert table[: len(rows)] == [
        [
            r["setting"],
            r["precision"],
            r["branch"],
            f"{r['minilm_min_cosine']:.6f}",
            f"{r['minilm_max_abs_diff']:.1e}",
            f"{r['minilm_s']:.3f}",
            f"{r['smollm2_top1_agreement']:.4f}",
            f"{r['smollm2_perplexity_ratio']:.4f}",
            f"{r['smollm2_ms_per_token']:.2f}",
        ]
        for r in rows
    ]
    assert table[len(rows) :] == [
        [c["setting"], c["report"]["aten_capability"], str(c["report"]["onednn_bf16"]), "-"]
        + [
            f"{e['max_rel_error']:.1e} ({e['max_rel_error_same_quantisation']:.0e}; "
            f"{e['levels_apart']} apart)"
            for e in c["int8_check"]
        ]
        for c in doc["settings"]
    ]
    assert len(doc["targets"]) == 8
    for t in doc["targets"]:
        error = t["target"].startswith("int8: F.linear within")  # an error at most the limit, else a cosine
        met = t["value"] <= t["limit"] if error else t["value"] >= t["limit"]
        assert t["met"] == met
        assert f"{t['setting']}: {t['target']}: {t['value']:.6g} ({'met' if met else 'NOT met'})" in printed
    assert doc["all_targets_met"] == all(t["met"] for t in doc["targets"])
    assert f"wrote {out}" in printed and list(temp.iterdir()) == []


def test_precision_cpus_settings_are_named_by_key_or_name() -> None:
    parse = _script("precision_cpus").parse_settings
    names = [name for _, name, _ in parse("native, fallbacks forced,avx2,AVX2 emulated,native")]
    assert names == ["native, fallbacks forced", "AVX2 emulated", "native"]
    names = [name for _, name, _ in parse("generic,native-fallbacks")]
    assert names == ["generic ATen", "native, fallbacks forced"]
    with pytest.raises(ValueError, match="unknown setting 'sse2'"):
        parse("native,sse2")


def test_train_script_tiny_models(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], keep_threads: None
) -> None:
    out = tmp_path / "train.json"
    argv = ["--d-model", "16", "--layers", "1", "--heads", "2", "--seq", "8", "--batch", "2", "--vocab", "11"]
    argv += ["--steps", "1", "--rounds", "2", "--threads", "1", "--out", str(out)]
    assert _script("train").main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["settings"]["d_model"] == 16 and doc["settings"]["rounds"] == 2 and doc["finite"]
    assert doc["parameters"]["headspace"] == doc["parameters"]["nanogpt_ref"]  # the same model size
    assert all(len(v) == 2 for v in doc["tokens_per_s_rounds"].values())
    printed = capsys.readouterr().out
    rounds = doc["tokens_per_s_rounds"]
    assert _table_rows(printed) == [
        [
            k,
            f"{doc['parameters'][k]:,}",
            f"{doc['median_tokens_per_s'][k]:,.0f}",
            f"{min(rounds[k]):,.0f}",
            f"{max(rounds[k]):,.0f}",
        ]
        for k in ("headspace", "nanogpt_ref")
    ]
    assert f"reference: {doc['ratio_headspace_over_reference']:.3f}x" in printed


def test_trace_overhead_script_tiny_layer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], keep_threads: None
) -> None:
    out = tmp_path / "trace.json"
    argv = ["--rounds", "3", "--inner", "1", "--batch", "1", "--seq", "4", "--d-model", "8", "--heads", "2"]
    assert _script("trace_overhead").main([*argv, "--threads", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["variant"] for r in doc["results"]] == ["fresh", "after_trace", "other_layer_traced", "traced"]
    assert doc["results"][0]["ratio"] == 1.0 and doc["config"]["d_model"] == 8
    printed = capsys.readouterr().out
    lines = {line.split()[0]: line.split()[1:] for line in printed.splitlines() if line.strip()}
    for r in doc["results"]:
        assert lines[r["variant"]] == [
            f"{r['median_ms']:.3f}",
            f"{r['q1_ms']:.3f}",
            f"{r['q3_ms']:.3f}",
            f"{r['ratio']:.3f}",
        ]


def test_trace_memory_script_random_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "trace_memory.json"
    argv = ["--random", "--tokens", "96", "--threads", "1", "--out", str(out)]
    assert _script("trace_memory").main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "trace_memory" and doc["model"] == "random"
    rows = {r["case"]: r for r in doc["rows"]}
    assert {"forward", "trace_all", "patterns", "stored_all"} <= set(rows)
    assert rows["forward"]["stored_gb"] == 0.0
    assert rows["stored_all"]["stored_gb"] >= rows["trace_all"]["stored_gb"] >= rows["patterns"]["stored_gb"]
    printed = capsys.readouterr().out
    for r in doc["rows"]:
        assert f"{r['peak_over_model_gb']:.2f}" in printed and r["case"] in printed


def test_atlas_script_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--tiny``: the four parts, each in its own process, on a random decoder and token corpus."""
    out = tmp_path / "atlas.json"
    argv = ["--tiny", "--tokens", "192", "--ablation-tokens", "64", "--window", "64", "--batch", "2"]
    assert _script("atlas").main([*argv, "--threads", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "atlas" and doc["args"]["tiny"] is True
    parts = doc["parts"]
    assert [parts[k]["tokens"] for k in ("forward", "stats", "forward_ablation_tokens", "ablation")] == [
        192, 192, 64, 64,
    ]  # fmt: skip
    assert doc["stats_speed_ratio"] == pytest.approx(
        parts["stats"]["tokens_per_s"] / parts["forward"]["tokens_per_s"]
    )
    assert doc["ablation_time_ratio_same_tokens"] == pytest.approx(
        parts["ablation"]["seconds"] / parts["forward_ablation_tokens"]["seconds"]
    )
    imp = parts["importance"]  # issue 41: the atp* pass, with a forward just before and after it
    assert imp["tokens"] == 192 and len(imp["forward_beside_s"]) == 2
    assert doc["importance_time_ratio"] == pytest.approx(imp["seconds"] / (sum(imp["forward_beside_s"]) / 2))
    printed = capsys.readouterr().out
    assert "a random tiny decoder" in printed and f"{doc['with_ablation_time_ratio']:.1f}x" in printed
    assert f"importance (atp*): {doc['importance_time_ratio']:.2f}x" in printed


def test_heads_script_random_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], keep_threads: None
) -> None:
    out = tmp_path / "heads.json"
    assert _script("heads").main(["--random", "--threads", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["case"] for r in doc["rows"]] == ["engine", "whole_model"]  # no command with --random
    assert doc["max_score_difference"] < 1e-5
    printed = capsys.readouterr().out
    for r in doc["rows"]:
        assert f"{r['case']:>12} {r['wall_s']:>8.2f} {r['cpu_s']:>8.2f}" in printed


@pytest.mark.parametrize("torchao", ["as installed", "hidden"])
def test_int8_kernels_script_tiny_shapes(
    torchao: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    keep_threads: None,
) -> None:
    if torchao == "hidden":  # `import torchao` (and every submodule, if already imported) raises ImportError
        for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")] + ["torchao"]:
            monkeypatch.setitem(sys.modules, name, None)

        def no_int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("self.size(0) needs to be greater than 16")  # CUDA's limit, as if it applied

        monkeypatch.setattr(torch, "_int_mm", no_int_mm)
        have_torchao = False
    else:
        have_torchao = importlib.util.find_spec("torchao") is not None
    out = tmp_path / "int8.json"
    argv = ["--quick", "--rounds", "2", "--block-ms", "0.5", "--threads", "1", "--out", str(out)]
    assert _script("int8_kernels").main(argv) == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert doc["benchmark"] == "int8_kernels" and doc["quick"] and doc["rounds"] == 2
    candidates = [
        "float32",
        "headspace int8",
        "headspace int8 fallback",
        "torchao int8 dynamic",
        "torch._int_mm",
    ]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    assert [r["candidate"] for r in rows] == candidates * len(shapes)
    status = {c: {r["status"] for r in rows if r["candidate"] == c} for c in candidates}
    assert status["float32"] == status["headspace int8"] == status["headspace int8 fallback"] == {"ok"}
    assert doc["cpu"]["aten_capability"] == torch.backends.cpu.get_cpu_capability()
    assert status["torchao int8 dynamic"] == ({"ok"} if have_torchao else {"not installed"})
    if torchao == "hidden":
        (said,) = status["torch._int_mm"]
        assert said.startswith("cannot run: RuntimeError: self.size(0) needs to be greater than 16")
    else:
        assert status["torch._int_mm"] == {"ok"}
    from headspace.kernels import cpu

    # a plain torch._int_mm saturates where it is not exact (no VNNI: kernels.cpu); headspace's own rows
    # take the fallback there and stay right
    int_mm_exact = cpu.int8_products_exact()[1]
    for r in rows:
        if r["status"] == "ok":
            assert len(r["times_ms"]) == 2 and r["min_ms"] <= r["median_ms"] <= r["max_ms"]
            if r["candidate"] != "torch._int_mm" or int_mm_exact:
                assert r["max_rel_error"] < (1e-5 if r["candidate"] == "float32" else 0.1)
    printed = capsys.readouterr().out
    assert _table_rows(printed) == [
        [r["shape"], r["candidate"], "-", "-", "-", "-", r["status"]]
        if r["status"] != "ok"
        else [
            r["shape"],
            r["candidate"],
            f"{r['median_ms']:.3f}",
            f"{r['min_ms']:.3f}",
            f"{r['max_ms']:.3f}",
            f"{r['speed_vs_float32']:.2f}x",
            f"{r['max_rel_error']:.1e}",
        ]
        for r in rows
    ]
    groups = list(dict.fromkeys(r["group"] for r in rows))
    assert len(doc["conclusions"]) == len(groups) == 3
    for group, line in zip(groups, doc["conclusions"]):
        assert line in printed and line.startswith(f"{group}: fastest: ")
        mine = [r for r in rows if r["group"] == group]
        for shape in dict.fromkeys(r["shape"] for r in mine):
            ok = [r for r in mine if r["shape"] == shape and r["status"] == "ok"]
            floor = ok[0]["median_ms"]  # float32's
            assert all(r["speed_vs_float32"] == pytest.approx(floor / r["median_ms"]) for r in ok)
            fastest = min(ok, key=lambda r: r["median_ms"])["candidate"]
            assert f"{fastest} on " in line  # the conclusion names each shape's fastest, from the medians
        if not have_torchao:
            assert "torchao int8 dynamic not installed" in line
    assert f"wrote {out}" in printed and not list(tmp_path.glob("*.tmp*"))


def _chromium_or_skip() -> None:
    if Path(CHROMIUM).is_file() and shutil.which(CHROMIUM):
        return
    if os.environ.get("HEADSPACE_REQUIRE_BROWSER"):
        pytest.fail(f"HEADSPACE_REQUIRE_BROWSER is set but there is no Chromium at {CHROMIUM}")
    pytest.skip(
        f"no Chromium at {CHROMIUM} (apt-get install chromium); the explorer benchmark opens pages in it"
    )


def test_explorer_script_one_short_page(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], keep_threads: None
) -> None:
    _chromium_or_skip()
    out = tmp_path / "explorer.json"
    assert (
        _script("explorer").main(["--runs", "1", "--lengths", "6", "--chromium", CHROMIUM, "--out", str(out)])
        == 0
    )
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    assert row["tokens"] == 6 and row["precision"] == "float32" and row["runs"] == 1
    assert row["load_ms_median"] > 0 and row["file_mb"] > 0
    printed = capsys.readouterr().out
    (line,) = [line.split() for line in printed.splitlines() if re.match(r"\s*6\s+float32\s", line)]
    assert line == [
        "6",
        "float32",
        f"{row['file_mb']:.2f}",
        f"{row['build_s']:.2f}",
        f"{row['load_ms_median']:.0f}",
        f"{row['draw_ms_median']:.0f}",
        f"{row['wall_ms_median']:.0f}",
        f"{row['switch_layer_ms_median']:.0f}",
        f"{row['switch_token_ms_median']:.0f}",
    ]
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.skipif(native.compiler() is None, reason="the native step needs a C++ compiler")
def test_decode_step_script_random(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], keep_threads: None
) -> None:
    out = tmp_path / "step.json"
    argv = ["--random", "--layers", "2", "--prompt-len", "5", "--steps", "3", "--rounds", "2"]
    argv += ["--threads", "1"]
    assert _script("decode_step").main([*argv, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "decode_step" and doc["rounds"] == 2 and doc["native"]["status"] == "loaded"
    rows = doc["rows"]
    assert [r["step"] for r in rows] == ["native", "python"]
    for r in rows:
        times = doc["times_s"][r["step"]]
        assert len(times["step"]) == len(times["products"]) == r["n_steps"] == 6  # 2 rounds x 3 steps
        over = sorted(1e3 * (s - p) for s, p in zip(times["step"], times["products"]))
        assert r["over_products_ms"] == pytest.approx((over[2] + over[3]) / 2)
        assert r["over_products_q1_ms"] <= r["over_products_ms"] <= r["over_products_q3_ms"]
        steps, prods = sorted(times["step"]), sorted(times["products"])
        assert r["step_ms"] == pytest.approx(1e3 * (steps[2] + steps[3]) / 2)
        assert r["products_ms"] == pytest.approx(1e3 * (prods[2] + prods[3]) / 2)
        assert r["step_over_products"] == pytest.approx(r["step_ms"] / r["products_ms"])
    printed = capsys.readouterr().out
    table = _table_rows(printed)
    assert [row[0] for row in table] == ["native", "python"]
    assert table[0][1] == f"{rows[0]['step_ms']:.2f}"
    assert table[1][3].startswith(f"{rows[1]['over_products_ms']:.2f} (")


def test_attention_parts_script_quick(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], keep_threads: None
) -> None:
    out = tmp_path / "parts.json"
    assert (
        _script("attention_parts").main(["--quick", "--rounds", "2", "--threads", "1", "--out", str(out)])
        == 0
    )
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "attention_parts" and doc["quick"] and doc["rounds"] == 2
    results = doc["results"]
    assert [(r["seq"], r["mode"]) for r in results] == [
        (32, "forward"),
        (32, "backward"),
        (64, "forward"),
        (64, "backward"),
    ]
    cases = ["layer", "sdpa", "sdpa math", "attention GEMMs", "projection GEMMs", "GEMM floor"]
    for r in results:
        assert list(r["ms"]) == cases
        ms = {c: r["ms"][c]["median"] for c in cases}
        assert all(r["ms"][c]["min"] <= ms[c] <= r["ms"][c]["max"] for c in cases)
        assert r["sdpa_over_attention_gemms"] == pytest.approx(ms["sdpa"] / ms["attention GEMMs"])
        assert r["rest_over_projection_gemms"] == pytest.approx(
            (ms["layer"] - ms["sdpa"]) / ms["projection GEMMs"]
        )
        assert r["layer_over_floor"] == pytest.approx(ms["layer"] / ms["GEMM floor"])
    rows = _table_rows(capsys.readouterr().out)
    assert [(int(row[0]), row[1]) for row in rows] == [(r["seq"], r["mode"]) for r in results]
    for row, r in zip(rows, results):
        assert row[2].startswith(f"{r['ms']['layer']['median']:.2f} (")
        assert row[-1].startswith(f"{r['layer_over_floor']:.2f}x (")


def test_side_by_side_script_against_this_checkout(
    smollm2_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One round of each tree (here: this checkout twice), tiny: every figure in both, a ratio each."""
    out = tmp_path / "side.json"
    argv = ["--before", str(BENCHMARKS.parent), "--rounds", "1", "--tokens", "4", "--steps", "2"]
    assert _script("side_by_side").main([*argv, "--sentences", "4", "--threads", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "side_by_side" and set(doc["runs"]) == {"this", "before"}
    assert [r["figure"] for r in doc["rows"]] == [
        "decode b1 ms/token",
        "decode b8 ms/token",
        "gemma3 decode b1 ms/token",
        "encode s",
        "patch sweep s",
    ]
    for row in doc["rows"]:
        assert row["ratio"] == pytest.approx(row["this"]["median"] / row["before"]["median"])
        assert 0 < row["before"]["min"] <= row["before"]["median"] <= row["before"]["max"]
    # the default step in both children: the native one where this machine can build it, else Python
    want = "loaded" if native.compiler() is not None else doc["native"]["before"]
    assert doc["native"] == {"this": want, "before": want}
    assert "| decode b8 ms/token |" in capsys.readouterr().out
