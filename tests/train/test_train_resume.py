"""A run killed with SIGKILL at an arbitrary step and resumed ends bit-identical to an uninterrupted one.

Dropout is on, so the resumed run must also restore the global RNG state to match. The uninterrupted run
and the resume go through the command line; the run that is killed is the same configuration started
through ``train()`` in a child process whose ``on_step`` callback sleeps a little after every step, so
that the kill lands mid-run, between two checkpoints (the resume checks that the configurations agree).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

CONFIG = {
    "task": "relations", "d_model": 16, "n_heads": 2, "batch_size": 8, "steps": 30, "warmup": 5,
    "dropout": 0.1, "save_every": 4, "eval_every": 10, "eval_batch": 32, "log_every": 1,
}  # fmt: skip
ARGS = [
    "--task", "relations", "--d-model", "16", "--heads", "2", "--batch-size", "8", "--steps", "30",
    "--warmup", "5", "--dropout", "0.1", "--save-every", "4", "--eval-every", "10", "--eval-batch", "32",
    "--log-every", "1", "--no-progress",
]  # fmt: skip


# the run to be killed: CONFIG through the Python API, each step followed by a short sleep
SLOW_RUN = """
import json, sys, time
from headspace.train import TrainConfig, train
config = TrainConfig(**json.loads(sys.argv[1]))
train(config, sys.argv[2], progress=False, on_step=lambda step: time.sleep(0.05))
"""


def _command(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "headspace", "train", *ARGS, "--out", str(out), *extra]


def _slow_command(out: Path) -> list[str]:
    return [sys.executable, "-c", SLOW_RUN, json.dumps(CONFIG), str(out)]


def _latest_step(run: Path) -> int:
    try:
        return json.loads((run / "checkpoints" / "latest.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return -1


def _logged_steps(run: Path) -> list[int]:
    steps = []
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return steps
    for line in lines:
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):  # a line being written
            continue
    return steps


def _final(run: Path) -> tuple[dict, dict]:
    folder = run / "checkpoints" / "step-000030"
    return load_file(folder / "model.safetensors"), load_file(folder / "state.safetensors")


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(tmp_path: Path) -> None:
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    subprocess.run(_command(whole), check=True, capture_output=True, timeout=300)

    # slow each step a little so that the kill lands mid-run, between two checkpoints
    proc = subprocess.Popen(_slow_command(killed), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        # wait for the second checkpoint and two more steps, so the kill lands between checkpoints
        while _latest_step(killed) < 8 or max(_logged_steps(killed), default=0) < _latest_step(killed) + 2:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "the run never got past its second checkpoint"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    stopped_at = _latest_step(killed)
    assert 8 <= stopped_at < 30
    assert max(_logged_steps(killed)) > stopped_at  # it ran past its last checkpoint: those steps are redone

    resumed = subprocess.run(_command(killed, "--resume"), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]  # the same configuration as the command line's
    weights_a, state_a = _final(whole)
    weights_b, state_b = _final(killed)
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        assert torch.equal(weights_a[name], weights_b[name]), name
    moments = [k for k in state_a if k.startswith("optimizer.")]
    assert moments and all(torch.equal(state_a[k], state_b[k]) for k in moments)
    rows = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in rows if r["kind"] == "train"]
    assert train_steps == list(range(1, 31))  # the steps after the checkpoint were logged once, not twice
    losses_a = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in losses_a if r["kind"] == "train"] == [
        r["loss"] for r in rows if r["kind"] == "train"
    ]
