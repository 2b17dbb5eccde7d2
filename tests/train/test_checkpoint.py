"""Checkpoints: exact round trips, atomic writes, the seal, and a CheckpointError for every bad file."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
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
        # dropout draws its mask from the global RNG, and the mask reaches the gradient of every weight:
        # a resume that did not restore the RNG state would train on other masks and end elsewhere
        model(nn.functional.dropout(x, p=0.5, training=True)).square().mean().backward()
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
        "manifest.json",
        "model.safetensors",
        "state.json",
        "state.safetensors",
    ]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["format"] == "headspace-checkpoint/2" and manifest["step"] == 1
    assert sorted(manifest["files"]) == [
        "config.json",
        "model.safetensors",
        "state.json",
        "state.safetensors",
    ]
    for name, record in manifest["files"].items():  # every other file of the folder is sealed
        data = (folder / name).read_bytes()
        assert record == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
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


def _reseal(folder: Path) -> None:
    """Rewrite the manifest for the folder's current files: content crafted *and* sealed."""
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["files"] = {name: ck._digest((folder / name).read_bytes()) for name in manifest["files"]}
    path.write_text(json.dumps(manifest))


def _edit_json(folder: Path, name: str, edit: Callable[[dict], object], *, reseal: bool = True) -> None:
    path = folder / name
    obj = json.loads(path.read_text())
    new = edit(obj)
    path.write_text(new if isinstance(new, str) else json.dumps(obj))
    if reseal:
        _reseal(folder)


def _edit_tensors(folder: Path, edit: Callable[[dict], None]) -> None:
    path = folder / "state.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    _reseal(folder)


@pytest.mark.parametrize(
    "name, damage, words",
    [
        ("model.safetensors", lambda b: b"", "empty file (0 bytes)"),
        ("model.safetensors", lambda b: b[: len(b) // 2], "does not match its seal"),
        ("state.safetensors", lambda b: b[:-10], "does not match its seal"),
        ("model.safetensors", lambda b: os.urandom(len(b)), "corrupted: its SHA-256 does not match"),
        ("state.json", lambda b: b[: len(b) // 3], "does not match its seal"),
        ("state.json", lambda b: b + b" ", "does not match its seal"),
        ("config.json", lambda b: b.replace(b"0.01", b"0.02"), "corrupted: its SHA-256 does not match"),
        ("manifest.json", lambda b: b[: len(b) // 2], "not valid JSON, truncated or corrupted"),
        ("manifest.json", lambda b: os.urandom(200), "not valid JSON"),
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
    _reseal(folder)
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


def test_weights_of_another_dtype_are_refused(tmp_path: Path) -> None:
    folder = _saved(tmp_path)
    weights = load_file(folder / "model.safetensors")
    weights["a.weight"] = weights["a.weight"].to(torch.float8_e4m3fn)  # isfinite does not exist for it
    save_file(weights, folder / "model.safetensors")
    _reseal(folder)
    ckpt = load_checkpoint(tmp_path)
    with pytest.raises(
        CheckpointError, match=r"'a\.weight' has dtype torch\.float8_e4m3fn, the model expects torch\.float32"
    ):
        load_weights_into(Tiny(), ckpt)


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


# ---------------------------------------------------------------------------------------- the seal
@pytest.mark.parametrize(
    ("old", "new", "words"),
    [
        (
            b'"step": 2',
            b'"step": 7',
            "corrupted: its SHA-256 does not match the one recorded in manifest.json",
        ),
        (b'"step": 2', b'"step": 25', "does not match its seal"),
        (b'"step": 2', b'"step":2', "does not match its seal"),  # shorter, but edited: not "truncated"
    ],
)
def test_an_edited_state_json_is_caught_by_the_manifest(
    tmp_path: Path, old: bytes, new: bytes, words: str
) -> None:
    folder = _saved(tmp_path)
    path = folder / "state.json"
    assert old in path.read_bytes()
    path.write_bytes(path.read_bytes().replace(old, new))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path)
    assert str(path) in str(info.value) and words in str(info.value)


def test_a_missing_manifest_is_refused(tmp_path: Path) -> None:
    folder = _saved(tmp_path)
    (folder / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"manifest\.json: missing: a checkpoint is sealed"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_file_not_in_the_manifest_is_refused(tmp_path: Path, kind: str) -> None:
    folder = _saved(tmp_path)
    extra = folder / "notes.txt"
    if kind == "file":
        extra.write_text("added later")
    else:
        extra.mkdir()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path)
    assert f"{extra}: not sealed in manifest.json" in str(info.value)


def test_the_manifest_must_seal_every_file(tmp_path: Path) -> None:
    folder = _saved(tmp_path)
    _edit_json(folder, "manifest.json", lambda m: m["files"].pop("state.json"), reseal=False)
    with pytest.raises(
        CheckpointError, match=r"manifest\.json: must seal exactly .*\['state\.json'\] not sealed"
    ):
        load_checkpoint(tmp_path)
    _edit_json(
        folder, "manifest.json", lambda m: m["files"].update({"state.json": {"bytes": 1}}), reseal=False
    )
    with pytest.raises(CheckpointError, match=r"the record of state\.json must be"):
        load_checkpoint(tmp_path)


def test_a_step_that_disagrees_with_the_seal_or_the_folder_is_refused(tmp_path: Path) -> None:
    folder = _saved(tmp_path)
    _edit_json(folder, "state.json", lambda s: s.update(step=10**30))  # crafted and resealed
    with pytest.raises(CheckpointError, match=r"state\.json: 'step' is 10{30}; manifest\.json seals step 2"):
        load_checkpoint(tmp_path)
    _edit_json(folder, "manifest.json", lambda m: m.update(step=10**30), reseal=False)
    with pytest.raises(
        CheckpointError, match=r"manifest\.json: seals step 10{30}, but the folder is step-000002"
    ):
        load_checkpoint(tmp_path)
    _edit_json(folder, "manifest.json", lambda m: m.update(step=1e30), reseal=False)
    with pytest.raises(CheckpointError, match=r"manifest\.json: 'step' must be an int >= 0; got 1e\+30"):
        load_checkpoint(tmp_path)


# ---------------------------------------------------------------------------------------- the pointer
def _two_runs(tmp_path: Path) -> tuple[Path, Path]:
    """Run ``a`` (checkpoint at step 2) and run ``b`` of the same configuration (checkpoint at step 5)."""
    model, opt = _trained()
    save_checkpoint(tmp_path / "a", 2, config=CONFIG, model=model, optimizer=opt)
    save_checkpoint(tmp_path / "b", 5, config=CONFIG, model=model, optimizer=opt)
    return tmp_path / "a", tmp_path / "b"


@pytest.mark.parametrize(
    ("folder", "step", "words"),
    [
        ("../../b/checkpoints/step-000005", 5, "'folder' must name a checkpoint folder step-NNNNNN inside"),
        ("/etc", 2, "'folder' must name a checkpoint folder step-NNNNNN inside"),
        ("ABSOLUTE", 5, "'folder' must name a checkpoint folder step-NNNNNN inside"),
        ("step-2", 2, "'folder' must name a checkpoint folder step-NNNNNN inside"),
        (2, 2, "'folder' must name a checkpoint folder step-NNNNNN inside"),
        ("step-000002", 5, "'step' is 5, but 'folder' is 'step-000002'"),
        ("step-000007", 7, "points to step-000007, which does not exist"),
    ],
)
def test_the_latest_pointer_must_stay_inside_its_run(
    tmp_path: Path, folder: object, step: int, words: str
) -> None:
    a, b = _two_runs(tmp_path)
    if folder == "ABSOLUTE":
        folder = str(b / "checkpoints" / "step-000005")
    pointer = a / "checkpoints" / "latest.json"
    pointer.write_text(json.dumps({"step": step, "folder": folder}))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(a, expected_config=CONFIG)  # run b has the same configuration: refused anyway
    assert str(pointer) in str(info.value) and words in str(info.value)


def test_a_pointer_through_a_symbolic_link_is_refused(tmp_path: Path) -> None:
    a, b = _two_runs(tmp_path)
    ckpts = a / "checkpoints"
    (ckpts / "step-000005").symlink_to(b / "checkpoints" / "step-000005")  # another run's, same config
    (ckpts / "latest.json").write_text(json.dumps({"step": 5, "folder": "step-000005"}))
    with pytest.raises(CheckpointError, match=r"latest\.json: points to step-000005, a symbolic link \(to "):
        load_checkpoint(a, expected_config=CONFIG)
    # the pointer file itself, or the whole checkpoints folder, as a link to the other run's
    (ckpts / "latest.json").unlink()
    (ckpts / "latest.json").symlink_to(b / "checkpoints" / "latest.json")
    with pytest.raises(CheckpointError, match=r"latest\.json: a symbolic link \(to .*\), not a regular file"):
        load_checkpoint(a)
    c = tmp_path / "c"
    c.mkdir()
    (c / "checkpoints").symlink_to(b / "checkpoints")
    with pytest.raises(
        CheckpointError, match=r"checkpoints: a symbolic link \(to .*\); a run's checkpoints must"
    ):
        load_checkpoint(c)


# ---------------------------------------------------------------------------------------- crafted content
@pytest.fixture()
def fresh() -> Iterator[tuple[Tiny, torch.optim.AdamW, Callable[[], None]]]:
    """A new model and optimizer to restore into, and a check that nothing about them (or the RNG) changed."""
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()

    def untouched() -> None:
        assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
        assert opt.state_dict()["state"] == {} and opt.param_groups[0]["lr"] == 0.01
        assert torch.equal(torch.get_rng_state(), rng)

    yield model, opt, untouched


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (
            lambda g: g[0].update(params=[0, 1, 99]),
            r"param_groups\[0\]\['params'\] is \[0, 1, 99\]; the optimizer has \[0, 1, 2\]",
        ),
        (lambda g: g[0].update(params=[0, 1, True]), r"param_groups\[0\]\['params'\] is \[0, 1, True\]"),
        (
            lambda g: g[0].update(lr="fast"),
            r"param_groups\[0\]\['lr'\] is 'fast'; expected a finite number >= 0",
        ),
        (
            lambda g: g[0].update(betas=[0.9]),
            r"\['betas'\] is \[0\.9\]; expected a list of 2 finite numbers in \[0, 1\)",
        ),
        (lambda g: g[0].update(betas=[0.9, 1.5]), r"\['betas'\] is \[0\.9, 1\.5\]"),
        (lambda g: g[0].update(amsgrad=True), r"\['amsgrad'\] is True; expected False"),
        (lambda g: g[0].update(fused=True), r"\['fused'\] is True; expected None"),
        (
            lambda g: g[0].pop("eps"),
            r"param_groups\[0\] has the wrong fields: missing \['eps'\], unexpected \[\]",
        ),
        (lambda g: g[0].update(evil=1), r"unexpected \['evil'\]"),
        (lambda g: g.append(dict(g[0])), r"optimizer state for 2 param groups, the optimizer has 1"),
    ],
)
def test_crafted_param_groups_are_refused_before_anything_changes(
    tmp_path: Path, fresh, edit, words: str
) -> None:
    folder = _saved(tmp_path)
    _edit_json(folder, "state.json", lambda s: edit(s["optimizer"]["param_groups"]))
    model, opt, untouched = fresh
    ckpt = load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=words) as info:
        restore_training_state(ckpt, model, opt)
    assert str(folder / "state.json") in str(info.value)
    untouched()


def _set(name: str, value: torch.Tensor) -> Callable[[dict], None]:
    return lambda t: t.update({name: value})


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (
            _set("optimizer.state.0.exp_avg", torch.zeros(5, 3)),
            r"optimizer\.state\.0\.exp_avg has shape \[5, 3\] and dtype torch\.float32; "
            r"parameter 0 has shape \[3, 5\]",
        ),
        (
            _set("optimizer.state.0.exp_avg", torch.zeros(3, 5, dtype=torch.float64)),
            r"exp_avg has shape \[3, 5\] and dtype torch\.float64",
        ),
        (
            _set("optimizer.state.1.exp_avg_sq", torch.full((3,), float("nan"))),
            r"optimizer state 1\.exp_avg_sq has 3 NaN/Inf",
        ),
        (
            _set("optimizer.state.0.step", torch.tensor([3.0, 3.0])),
            r"optimizer\.state\.0\.step has shape \[2\]",
        ),
        (
            _set("optimizer.state.0.step", torch.tensor(2.5)),
            r"optimizer\.state\.0\.step is 2\.5; expected a whole number",
        ),
        (
            _set("optimizer.state.0.bogus", torch.zeros(3, 5)),
            r"parameter 0 has \['bogus', 'exp_avg', 'exp_avg_sq', 'step'\]; AdamW keeps",
        ),
        (lambda t: t.pop("optimizer.state.2.exp_avg_sq"), r"parameter 2 has \['exp_avg', 'step'\]"),
        (
            _set("optimizer.state.99.exp_avg", torch.zeros(3)),
            r"'optimizer\.state\.99\.exp_avg' is for parameter 99; the optimizer has 3",
        ),
        (
            _set("rng.torch", torch.zeros(10, dtype=torch.uint8)),
            r"rng\.torch has shape \[10\] and dtype torch\.uint8; expected uint8 of shape \[5056\]",
        ),
        (_set("rng.torch", torch.zeros(5056)), r"rng\.torch has shape \[5056\] and dtype torch\.float32"),
        (
            _set("rng.torch", torch.full((5056,), 255, dtype=torch.uint8)),
            r"rng\.torch is not a valid generator state",
        ),
        (lambda t: t.pop("rng.torch"), r"holds no CPU RNG state"),
        (
            _set("rng.cuda.1", torch.zeros(16, dtype=torch.uint8)),
            r"CUDA RNG states \['rng\.cuda\.1'\]; expected rng\.cuda\.0",
        ),
    ],
)
def test_crafted_state_tensors_are_refused_before_anything_changes(
    tmp_path: Path, fresh, edit, words: str
) -> None:
    folder = _saved(tmp_path)
    _edit_tensors(folder, edit)
    model, opt, untouched = fresh
    ckpt = load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=words) as info:
        restore_training_state(ckpt, model, opt)
    assert str(folder / "state.safetensors") in str(info.value)
    untouched()


def test_unknown_tensor_names_are_refused_on_load(tmp_path: Path) -> None:
    folder = _saved(tmp_path)
    _edit_tensors(folder, _set("payload", torch.zeros(1)))
    with pytest.raises(CheckpointError, match=r"state\.safetensors: unexpected tensor 'payload'"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("depth", [40, 100_000])  # past the limit; past Python's recursion limit
@pytest.mark.parametrize("name", ["config.json", "state.json"])
def test_deeply_nested_json_is_refused(tmp_path: Path, name: str, depth: int) -> None:
    folder = _saved(tmp_path)
    deep = "[" * depth + "]" * depth
    _edit_json(folder, name, lambda obj: json.dumps(obj)[:-1] + f', "deep": {deep}}}')
    with pytest.raises(
        CheckpointError, match=rf"{name}: not valid JSON, truncated or corrupted \(nested more than 32"
    ):
        load_checkpoint(tmp_path)


def test_nan_in_sealed_json_is_refused(tmp_path: Path) -> None:
    folder = _saved(tmp_path)
    _edit_json(folder, "config.json", lambda obj: json.dumps(obj).replace("0.01", "NaN"))
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON.*NaN is not JSON"):
        load_checkpoint(tmp_path)


@pytest.fixture()
def alarm() -> Iterator[None]:
    """Fail instead of hanging: a read that blocks (a FIFO opened for reading) is interrupted after 20 s."""

    def hung(*_: object) -> None:
        raise TimeoutError("the reader blocked")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize(
    ("name", "make", "words"),
    [
        (
            "model.safetensors",
            lambda p: p.symlink_to("/dev/zero"),
            r"a symbolic link \(to /dev/zero\), not a regular file",
        ),
        ("state.safetensors", os.mkfifo, r"a named pipe \(FIFO\), not a regular file"),
        ("state.json", os.mkdir, r"a folder, not a regular file"),
        ("manifest.json", os.mkfifo, r"a named pipe \(FIFO\), not a regular file"),
        ("latest.json", os.mkfifo, r"a named pipe \(FIFO\), not a regular file"),
        (
            "latest.json",
            lambda p: p.symlink_to("/dev/zero"),
            r"a symbolic link \(to /dev/zero\), not a regular file",
        ),
    ],
)
def test_only_regular_files_are_opened(tmp_path: Path, alarm, name: str, make, words: str) -> None:
    folder = _saved(tmp_path)
    path = (folder.parent if name == "latest.json" else folder) / name
    path.unlink()
    make(path)
    with pytest.raises(CheckpointError, match=words) as info:
        load_checkpoint(tmp_path)
    assert str(path) in str(info.value)


def test_files_over_the_size_cap_are_not_read(tmp_path: Path) -> None:
    folder = _saved(tmp_path)
    manifest = folder / "manifest.json"
    with open(manifest, "ab") as f:
        f.truncate(ck.MAX_MANIFEST_BYTES + 1)  # sparse: nothing is written, nothing may be read
    with pytest.raises(
        CheckpointError, match=rf"manifest\.json: {ck.MAX_MANIFEST_BYTES + 1} bytes, more than"
    ):
        load_checkpoint(tmp_path)


# ---------------------------------------------------------------------------------------- housekeeping
def test_pruning_orders_checkpoints_by_step_number_past_a_million(tmp_path: Path) -> None:
    model, opt = _trained()
    for step in (999_999, 1_000_000, 1_000_001):
        save_checkpoint(tmp_path, step, config=CONFIG, model=model, optimizer=opt, keep_last=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert names == ["step-1000000", "step-1000001"]  # as text, "step-999999" sorts last
    assert load_checkpoint(tmp_path).step == 1_000_001


def test_temporaries_of_a_killed_save_are_removed_at_the_next_save(tmp_path: Path) -> None:
    model, opt = _trained()
    save_checkpoint(tmp_path, 2, config=CONFIG, model=model, optimizer=opt)
    root = tmp_path / "checkpoints"
    (root / ".step-000004.k3j2h1.tmp").mkdir()  # what a SIGKILL during a save leaves
    (root / ".step-000004.k3j2h1.tmp" / "model.safetensors").write_bytes(b"half")
    (root / ".latest.json.a1b2c3.tmp").write_bytes(b"{")
    (root / "notes.txt").write_text("not ours: kept")
    save_checkpoint(tmp_path, 6, config=CONFIG, model=model, optimizer=opt)
    assert sorted(os.listdir(root)) == ["latest.json", "notes.txt", "step-000002", "step-000006"]


def test_a_save_killed_while_replacing_a_step_is_repaired(tmp_path: Path) -> None:
    folder = _saved(tmp_path)
    root = folder.parent
    os.replace(folder, root / ".step-000002.old")  # killed between moving the old copy aside and the new in
    assert ck.remove_stale_temporaries(tmp_path) == [".step-000002.old"]
    assert sorted(os.listdir(root)) == ["latest.json", "step-000002"]
    assert load_checkpoint(tmp_path).step == 2
    (root / ".step-000002.old").mkdir()  # a stale copy beside a whole checkpoint: removed
    ck.remove_stale_temporaries(tmp_path)
    assert sorted(os.listdir(root)) == ["latest.json", "step-000002"]


@pytest.mark.parametrize(("umask", "file_mode", "dir_mode"), [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)])
def test_checkpoint_files_follow_the_umask(tmp_path: Path, umask: int, file_mode: int, dir_mode: int) -> None:
    model, opt = _trained()
    previous = os.umask(umask)
    try:
        folder = save_checkpoint(tmp_path / "run", 1, config=CONFIG, model=model, optimizer=opt)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(folder.stat().st_mode) == dir_mode
    assert stat.S_IMODE(folder.parent.stat().st_mode) == dir_mode
    for path in [*folder.iterdir(), folder.parent / "latest.json"]:
        assert stat.S_IMODE(path.stat().st_mode) == file_mode, path.name
