"""Progress bars: redrawn in a terminal, plain lines in a log (no carriage returns), no TqdmWarning in a
notebook without ipywidgets."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from headspace import progress
from headspace.core.progress import PlainProgress, progress_bar
from headspace.train import TrainConfig, train


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_stream_that_is_not_a_terminal_gets_plain_lines(monkeypatch) -> None:
    monkeypatch.setattr(progress, "PLAIN_EVERY", 0.0)
    out = io.StringIO()
    bar = progress_bar(total=4, desc="train text", unit="step", file=out, dynamic_ncols=True)
    assert isinstance(bar, PlainProgress)
    for _ in range(4):
        bar.update(1)
    bar.set_postfix(loss="1.2345")
    bar.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert lines[0] == "train text: 0/4 steps"  # as it begins
    assert lines[1].startswith("train text: 1/4 steps, ") and "step/s, ETA " in lines[1]
    assert lines[-1].startswith("train text: 4/4 steps, 0:00 at ") and lines[-1].endswith("loss=1.2345")
    assert list(progress_bar(range(3), file=io.StringIO())) == [0, 1, 2]


def test_plain_lines_come_every_few_seconds_not_every_step() -> None:
    out = io.StringIO()
    bar = PlainProgress(total=1000, desc="x", file=out, every=3600)
    for _ in range(1000):
        bar.update(1)
    bar.close()
    assert len(out.getvalue().splitlines()) == 2  # as it begins and as it ends only
    quiet = io.StringIO()
    PlainProgress(total=2, file=quiet, disable=True, every=0).close()
    assert quiet.getvalue() == ""


def test_a_terminal_keeps_tqdm_s_bar() -> None:
    from tqdm.std import tqdm

    bar = progress_bar(total=2, desc="x", file=_Terminal())
    assert isinstance(bar, tqdm)
    bar.close()


def test_train_progress_in_a_log_has_no_carriage_returns(tmp_path, capsys, monkeypatch) -> None:
    """train's bar on a stderr that is not a terminal (a log file): plain lines with steps, rate and ETA,
    no '\\r' redraws (tqdm wrote one per refresh, flooding the log)."""
    monkeypatch.setattr(progress, "PLAIN_EVERY", 0.0)
    config = TrainConfig(task="relations", n_heads=1, d_model=16, steps=6, eval_every=3, eval_batch=16)
    train(config, tmp_path / "run", progress=True)
    err = capsys.readouterr().err
    assert "\r" not in err
    steps = [line for line in err.splitlines() if line.startswith("train relations: ")]
    assert steps and steps[-1].startswith("train relations: 6/6 steps, ")
    assert any("step/s, ETA " in line for line in steps)


def test_importing_headspace_in_a_notebook_without_ipywidgets_warns_nothing() -> None:
    """A Jupyter kernel without ipywidgets: tqdm.auto would warn "IProgress not found" in every notebook;
    headspace's bars use tqdm's text bar there."""
    pytest.importorskip("tqdm")
    code = """
import sys, types, warnings
import importlib.util
assert importlib.util.find_spec("ipywidgets") is None, "ipywidgets is installed: nothing to test"
sys.modules["ipykernel.zmqshell"] = types.ModuleType("ipykernel.zmqshell")
ipython = types.ModuleType("IPython")
ipython.get_ipython = lambda: type("ZMQInteractiveShell", (), {})()
sys.modules["IPython"] = ipython
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import headspace.analysis, headspace.bench, headspace.pretrained, headspace.train.loop
    from headspace.progress import in_notebook, progress_bar
    from tqdm.std import tqdm
    assert in_notebook()
    bar = progress_bar(total=2, desc="x")
    assert type(bar) is tqdm, type(bar)
    bar.update(2)
    bar.close()
bad = [str(w.message) for w in caught if "IProgress" in str(w.message) or "notebook" in str(w.message)]
assert not bad, bad
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if "ipywidgets is installed" in out.stderr:
        pytest.skip("ipywidgets is installed here")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_first_unit_of_a_slow_pass_gets_its_line_at_once(monkeypatch) -> None:
    """Issue 41: a pass whose units take seconds each showed nothing but its first line for minutes."""
    now = [100.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    out = io.StringIO()
    bar = PlainProgress(total=162, desc="atlas: ablation", unit="tok", file=out, every=60)
    now[0] += 3.0
    bar.update(8)  # 3 s for the first 8 tokens: a line now, with rate and ETA
    now[0] += 3.0
    bar.update(8)  # the next ones within `every`: no line
    lines = out.getvalue().splitlines()
    assert lines == ["atlas: ablation: 0/162 toks", "atlas: ablation: 8/162 toks, 2.67 tok/s, ETA 0:58"]


def test_ticker_moves_a_bar_to_the_engine_s_count() -> None:
    out = io.StringIO()
    bar = PlainProgress(desc="pairs", unit="pair", file=out, every=0)
    tick = progress.ticker(bar)
    for done in (0, 2, 5, 5, 64):
        tick(done, 64)
    assert bar.n == 64 and bar.total == 64
    assert out.getvalue().splitlines()[-1].startswith("pairs: 64/64 pairs, ")
