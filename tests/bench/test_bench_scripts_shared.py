"""headspace.bench.scripts: the --out/--save options and argument checks every benchmarks/ script shares."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from headspace.bench.scripts import add_output_options, check_output_options, output_path


def _parse(argv: list[str], smoke: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    add_output_options(p, "thing.json", note=", with --quick thing_quick.json there")
    a = p.parse_args(argv)
    check_output_options(p, a, "thing.json", smoke=smoke)
    return a


def test_output_path_local_by_default_published_with_save(tmp_path: Path) -> None:
    a = _parse([])
    assert (a.out, a.save) == (None, False)
    assert output_path(a.out, a.save, "thing.json", tmp_path) == tmp_path / "local" / "thing.json"
    a = _parse(["--save"], smoke="quick")
    assert output_path(a.out, a.save, "thing.json", tmp_path) == tmp_path / "thing.json"
    a = _parse(["--out", "x/y.json", "--quick"], smoke="quick")
    assert output_path(a.out, a.save, "thing.json", tmp_path) == Path("x/y.json")


@pytest.mark.parametrize(
    ("argv", "smoke", "message"),
    [
        (["--save", "--out", "z.json"], None, "--save writes benchmarks/results/thing.json; give either"),
        (["--save", "--quick"], "quick", "a --quick smoke run is never published"),
    ],
)
def test_save_is_refused_with_out_or_a_smoke_run(
    argv: list[str], smoke: str | None, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse(argv, smoke)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_save_with_quick_is_allowed_without_a_smoke_flag() -> None:
    assert _parse(["--save", "--quick"]).save  # a script whose --quick is no smoke run says so by omission


def test_help_names_the_default_paths(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "benchmarks/results/local/thing.json, with --quick thing_quick.json there" in text
    assert "publish: write benchmarks/results/thing.json" in text


def test_check_positive_names_the_option_and_skips_none(capsys: pytest.CaptureFixture[str]) -> None:
    from headspace.bench.scripts import check_positive

    p = argparse.ArgumentParser()
    check_positive(p, argparse.Namespace(batch_size=3, repeats=None), ("batch_size", "repeats"))
    with pytest.raises(SystemExit) as exc:
        check_positive(p, argparse.Namespace(batch_size=0, repeats=None), ("repeats", "batch_size"))
    assert exc.value.code == 2 and "--batch-size must be positive; got 0" in capsys.readouterr().err
