"""``headspace models``: the families table, as text that fits 100 columns and as JSON, from
headspace.pretrained.families_table (so it lists exactly what ``load(folder)`` reads)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from headspace.cli import cli
from headspace.pretrained import families_table as ft
from headspace.pretrained.registry import FOLDER_LOADERS


def test_models_lists_every_loadable_model_type_within_100_columns() -> None:
    res = CliRunner().invoke(cli, ["models"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert max(len(line) for line in lines) <= 100
    firsts = {line.split()[0] for line in lines if line and not line.startswith((" ", "-"))}
    assert set(FOLDER_LOADERS) <= firsts
    row = next(line for line in lines if line.startswith("gptj "))
    assert row.split()[1:4] == ["decoder", "parallel", "python"]
    assert "interleaved partial rotary" in lines[lines.index(row) + 1]


def test_models_width_wraps_and_a_too_narrow_width_is_one_line_exit_2() -> None:
    res = CliRunner().invoke(cli, ["models", "--width", "90"])
    assert res.exit_code == 0 and max(len(line) for line in res.output.splitlines()) <= 90
    bad = CliRunner().invoke(cli, ["models", "--width", "40"])
    assert bad.exit_code == 2
    assert bad.output.strip().splitlines() == ["error: --width must be an integer >= 90; got 40"]


def test_models_json_is_the_table() -> None:
    res = CliRunner().invoke(cli, ["models", "--json"])
    assert res.exit_code == 0, res.output
    families = json.loads(res.output)["families"]
    assert families == ft.as_json()
    assert {f["model_type"] for f in families} == set(FOLDER_LOADERS)
    neox = next(f for f in families if f["model_type"] == "gpt_neox")
    assert neox["layouts"] == ["parallel", "pre"] and neox["decode"] == ["python", "native"]
