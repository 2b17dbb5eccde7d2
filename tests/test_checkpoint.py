"""Checkpoints: exact round trips, atomic writes, and a CheckpointError for every kind of bad file."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from headspace.train import checkpoint as ck
from headspace.train.checkpoint import (
    CheckpointError,
    config_differences,
    load_checkpoint,
    load_weights_into,
    restore_training_state,
    save_checkpoint,
)

CONFIG = {"model": {"d_model": 5, "n_heads": 1}, "train": {"lr": 0.01, "seed": 3}}


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 3)  # weights [3, 5]: distinct primes so a transposed tensor fails
        self.b = nn.Linear(3, 7, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _trained(steps: int = 3) -> tuple[Tiny, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for i in range(steps):
        x = torch.randn(2, 5, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return model, opt


def _continue(model: Tiny, opt: torch.optim.Optimizer, steps: int) -> None:
    for i in range(100, 100 + steps):
        x = torch.randn(2, 5, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        (model(x).square().mean() + 0.01 * torch.rand(())).backward()  # touches the global RNG
        opt.step()


def test_round_trip_resumes_bit_identically(tmp_path: Path) -> None:
    model, opt = _trained()
    torch.manual_seed(42)
    folder = save_checkpoint(tmp_path, 3, config=CONFIG, model=model, optimizer=opt)
    assert folder == tmp_path / "checkpoints" / "step-000003"
    _continue(model, opt, 4)  # the uninterrupted run

    fresh = Tiny()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    ckpt = load_checkpoint(tmp_path, expected_config=CONFIG)
    assert ckpt.step == 3 and ckpt.config == CONFIG
    restore_training_state(ckpt, fresh, fresh_opt)  # weights, optimizer moments and RNG
    _continue(fresh, fresh_opt, 4)
    for (name, p), q in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(p, q), name
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key]), key


def test_files_are_safetensors_and_json_never_pickle(tmp_path: Path) -> None:
    model, opt = _trained()
    folder = save_checkpoint(tmp_path, 1, config=CONFIG, model=model, optimizer=opt)
    assert sorted(os.listdir(folder)) == [
        "config.json",
        "model.safetensors",
        "state.json",
        "state.safetensors",
    ]
    weights = load_file(folder / "model.safetensors")
    assert torch.equal(weights["a.weight"], model.a.weight.detach())
    state = load_file(folder / "state.safetensors")
    assert state["rng.torch"].dtype == torch.uint8
    assert {k for k in state if k.startswith("optimizer.state.0.")} == {
        "optimizer.state.0.exp_avg",
        "optimizer.state.0.exp_avg_sq",
        "optimizer.state.0.step",
    }
    meta = json.loads((folder / "state.json").read_text())
    assert meta["optimizer"]["param_groups"][0]["betas"] == [0.9, 0.999]
    assert json.loads((tmp_path / "checkpoints" / "latest.json").read_text()) == {
        "folder": "step-000001",
        "step": 1,
    }


def test_keeps_only_the_newest_checkpoints(tmp_path: Path) -> None:
    model, opt = _trained()
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, config=CONFIG, model=model, optimizer=opt, keep_last=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == ["step-000003", "step-000004"]
    assert load_checkpoint(tmp_path).step == 4


def test_full_disk_leaves_the_previous_checkpoint_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _trained()
    save_checkpoint(tmp_path, 5, config=CONFIG, model=model, optimizer=opt)
    before = {p.name: p.read_bytes() for p in (tmp_path / "checkpoints" / "step-000005").iterdir()}
    real_write = ck._write_file
    calls = {"n": 0}

    def full_disk(path: Path, data: bytes) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the second file: half of it lands, then the disk is full
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(path, data)

    monkeypatch.setattr(ck, "_write_file", full_disk)
    with torch.no_grad():
        model.a.weight.add_(1.0)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(tmp_path, 6, config=CONFIG, model=model, optimizer=opt)
    msg = str(info.value)
    assert "step-000006" in msg and "No space left on device" in msg and "step-000005" in msg
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest.json", "step-000005"]  # no temporary left
    assert {p.name: p.read_bytes() for p in (root / "step-000005").iterdir()} == before
    assert load_checkpoint(tmp_path).step == 5


def _saved(tmp_path: Path) -> Path:
    model, opt = _trained()
    return save_checkpoint(tmp_path, 2, config=CONFIG, model=model, optimizer=opt)


@pytest.mark.parametrize(
    "name, damage, words",
    [
        ("model.safetensors", lambda b: b"", "empty file (0 bytes)"),
        ("model.safetensors", lambda b: b[: len(b) // 2], "truncated"),
        ("state.safetensors", lambda b: b[:-10], "truncated"),
        ("model.safetensors", lambda b: os.urandom(len(b)), "corrupted: its SHA-256 does not match"),
        ("state.json", lambda b: b[: len(b) // 3], "not valid JSON, truncated or corrupted"),
        ("state.json", lambda b: os.urandom(200), "not valid JSON"),
        ("config.json", lambda b: b.replace(b"0.01", b"0.02"), "corrupted: its SHA-256 does not match"),
    ],
)
def test_damaged_files_raise_checkpoint_error_naming_the_file(
    tmp_path: Path, name: str, damage, words: str
) -> None:
    folder = _saved(tmp_path)
    path = folder / name
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path)
    assert str(path) in str(info.value)
    assert words in str(info.value)


def test_missing_file_and_missing_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        load_checkpoint(tmp_path)
    folder = _saved(tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors: missing"):
        load_checkpoint(folder)


def test_valid_safetensors_with_bad_header_is_refused(tmp_path: Path) -> None:
    folder = _saved(tmp_path)
    # rewrite a safetensors file with garbage after a plausible header length, and fix the checksum
    garbage = (10**6).to_bytes(8, "little") + b"{" * 40
    (folder / "model.safetensors").write_bytes(garbage)
    state = json.loads((folder / "state.json").read_text())
    state["files"]["model.safetensors"] = ck._digest(garbage)
    (folder / "state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        load_checkpoint(folder)


def test_foreign_config_lists_the_differing_fields(tmp_path: Path) -> None:
    _saved(tmp_path)
    other = {"model": {"d_model": 7, "n_heads": 1}, "train": {"lr": 0.01, "seed": 4, "steps": 9}}
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path, expected_config=other)
    msg = str(info.value)
    assert "config.json" in msg
    assert "model.d_model: checkpoint has 5, requested 7" in msg
    assert "train.seed: checkpoint has 3, requested 4" in msg
    assert "train.steps: absent in the checkpoint, requested 9" in msg
    assert "lr" not in msg  # equal fields are not listed
    ok = load_checkpoint(
        tmp_path, expected_config={**CONFIG, "train": {"lr": 0.01, "seed": 9}}, allow_differ=("train.seed",)
    )
    assert ok.step == 2


def test_nan_weights_are_refused(tmp_path: Path) -> None:
    model, opt = _trained()
    with torch.no_grad():
        model.b.weight[1, 2] = float("nan")
    save_checkpoint(tmp_path, 1, config=CONFIG, model=model, optimizer=opt)
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: weight 'b\.weight' has 1 NaN/Inf values of 21"
    ):
        load_checkpoint(tmp_path)


class Other(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 3)
        self.c = nn.Linear(3, 7)


class Wider(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 2)
        self.b = nn.Linear(2, 7, bias=False)


def test_missing_unexpected_and_misshapen_weights_are_listed(tmp_path: Path) -> None:
    _saved(tmp_path)
    ckpt = load_checkpoint(tmp_path)
    other = Other()
    before = other.a.weight.detach().clone()
    with pytest.raises(CheckpointError) as info:
        load_weights_into(other, ckpt)
    msg = str(info.value)
    assert "model.safetensors" in msg
    assert "missing weights ['c.bias', 'c.weight']" in msg and "unexpected weights ['b.weight']" in msg
    assert torch.equal(other.a.weight, before)  # nothing copied
    with pytest.raises(CheckpointError, match=r"'a\.weight' has shape \[3, 5\], the model expects \[2, 5\]"):
        load_weights_into(Wider(), ckpt)


def test_config_differences_reads_nested_fields() -> None:
    assert config_differences({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}}) == [
        "a.c: checkpoint has 2, requested 3"
    ]
    assert config_differences({"x": 1}, {"x": 1}) == []


@pytest.mark.parametrize(
    ("config", "exc", "words"),
    [
        ({"t": torch.zeros(1)}, TypeError, "config['t'] is a Tensor"),
        ({"train": {"betas": [0.9, torch.tensor(0.99)]}}, TypeError, "['train']['betas'][1] is a Tensor"),
        ({"train": {"lr": float("nan")}}, ValueError, "config['train']['lr'] is nan"),
        ({"model": {"tags": {"a", "b"}}}, TypeError, "config['model']['tags'] is a set"),
    ],
)  # fmt: skip
def test_config_that_is_not_json_is_refused_naming_the_field(
    tmp_path: Path, config: dict, exc: type[Exception], words: str
) -> None:
    model, _ = _trained(0)
    with pytest.raises(exc) as info:
        save_checkpoint(tmp_path, 1, config=config, model=model)
    assert words in str(info.value) and "config must hold only JSON values" in str(info.value)
    assert not (tmp_path / "checkpoints").exists()  # refused before anything is written
    with pytest.raises(TypeError, match=r"extra_state\['seen'\] is a Tensor"):
        save_checkpoint(tmp_path, 1, config=CONFIG, model=model, extra_state={"seen": torch.ones(2)})
