"""Data-parallel training: ``torchrun --nproc-per-node 2 -m headspace train`` against one process.

With the same global batch, 2 gloo processes (each training on half of every batch, DDP averaging the
gradients) must log the same loss at every step as one process, write one run folder (rank 0 only),
and resume from a checkpoint under torchrun to the same final weights as a run never interrupted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close

from headspace.train.loop import TrainConfig, train

pytestmark = pytest.mark.slow  # the whole module (pyproject.toml: -m slow runs it)

TIMEOUT_S = 300  # one torchrun launch: an agent and 2 fresh interpreters on a busy 2-core machine

# a small run: 1 layer x 2 heads, d_model 16, global batch 8 (4 rows per rank), 6 steps
SETTINGS = {
    "task": "relations",
    "n_layers": 1,
    "n_heads": 2,
    "d_model": 16,
    "batch_size": 8,
    "steps": 6,
    "warmup": 2,
    "eval_every": 6,
    "save_every": 3,
    "log_every": 1,
}
CLI_ARGS = [
    "--task", "relations", "--layers", "1", "--heads", "2", "--d-model", "16", "--batch-size", "8",
    "--steps", "6", "--warmup", "2", "--eval-every", "6", "--save-every", "3", "--log-every", "1",
    "--no-progress",
]  # fmt: skip


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_train(*args: str) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node 2 -m headspace train ARGS`` on 127.0.0.1; killed whole after TIMEOUT_S."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1",
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "-m", "headspace", "train", *args,
    ]  # fmt: skip
    # torchrun's agent keeps its log folder (tempfile.mkdtemp(prefix="torchelastic_")) after the job: the
    # job's temporary files go to a folder of this launch's own, removed when it ends
    with tempfile.TemporaryDirectory(prefix="headspace-torchrun-") as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "TMPDIR": tmp}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)  # fmt: skip
        try:
            out, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the agent and both workers
            proc.communicate()
            pytest.fail(f"torchrun did not finish within {TIMEOUT_S} s: {' '.join(cmd)}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _rows(run: Path, kind: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"step-{step:06d}" / "model.safetensors")


def _simulate_kill_after(run: Path, step: int) -> None:
    """Leave ``run`` as a run killed after its checkpoint at ``step``: later checkpoints and files gone."""
    ckpts = run / "checkpoints"
    for folder in ckpts.glob("step-*"):
        if int(folder.name.split("-")[1]) > step:
            shutil.rmtree(folder)
    (ckpts / "latest.json").write_text(json.dumps({"step": step, "folder": f"step-{step:06d}"}))
    (run / "summary.json").unlink()


def test_torchrun_two_processes_match_one_process_and_resume(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    train(TrainConfig(**SETTINGS), one, progress=False)
    res = torchrun_train(*CLI_ARGS, "--out", str(two))
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("accuracy ") == 1, res.stdout  # only rank 0 reports

    # the loss curve: every step, both runs (the 2-process loss is the mean over the ranks' halves)
    loss_one, loss_two = _rows(one, "train"), _rows(two, "train")
    assert [r["step"] for r in loss_two] == [1, 2, 3, 4, 5, 6]  # written once: rank 0 only
    assert_close(torch.tensor([r["loss"] for r in loss_two]), torch.tensor([r["loss"] for r in loss_one]))
    # the clipped gradient norm is taken after DDP's all-reduce: the norm of the whole-batch gradient
    assert_close(
        torch.tensor([r["grad_norm"] for r in loss_two]), torch.tensor([r["grad_norm"] for r in loss_one])
    )
    # the heads are evaluated before training and at the end, by rank 0 only
    assert [r["step"] for r in _rows(two, "eval")] == [r["step"] for r in _rows(one, "eval")] == [0, 6]
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == [
        "latest.json",
        "step-000003",
        "step-000006",
    ]

    # the weights after 6 steps; the key bias is left out: its gradient is exactly zero in exact arithmetic
    # (softmax ignores a constant added to every score of a query), so AdamW normalises float noise into
    # steps of size ~lr that differ between any two summation orders
    w_one, w_two = _weights(one, 6), _weights(two, 6)
    assert w_one.keys() == w_two.keys()
    d = 16  # d_model; qkv_bias rows: [q (d), k (d), v (d)]
    for name, t in w_one.items():
        if name.endswith("attn.qkv_bias"):
            assert_close(w_two[name][:d], t[:d])
            assert_close(w_two[name][2 * d :], t[2 * d :])
        else:
            assert_close(w_two[name], t, msg=name)

    # --resume under torchrun: kill after step 3, resume, end where the uninterrupted run ended
    resumed = tmp_path / "resumed"
    shutil.copytree(two, resumed)
    _simulate_kill_after(resumed, 3)
    res = torchrun_train(*CLI_ARGS, "--out", str(resumed), "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    final, want = _weights(resumed, 6), _weights(two, 6)
    for name, t in want.items():
        # the same ranks, the same rows and the restored optimizer state: the same bits
        assert torch.equal(final[name], t), name

    def without_speed(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]

    assert without_speed(_rows(resumed, "train")) == without_speed(
        _rows(two, "train")
    )  # steps 1-3 kept, 4-6 redone
    assert json.loads((resumed / "summary.json").read_text())["accuracy"] == pytest.approx(
        json.loads((two / "summary.json").read_text())["accuracy"]
    )
