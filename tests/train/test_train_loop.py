"""The training loop: config checks, schedule, run folder, per-head metrics, resume and specialisation."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from headspace.train import TrainConfig, learning_rate, load_run, train
from headspace.train import loop as train_loop
from headspace.train.checkpoint import CheckpointError
from headspace.train.loop import (
    EncoderReadout,
    RunFolderError,
    build_model,
    model_config_for,
    parameter_count,
)
from headspace.train.metrics import part_accuracy
from headspace.train.tasks import EVAL_STREAM, RelationsTask, batch_generator

TINY = {"task": "relations", "d_model": 16, "n_heads": 2, "batch_size": 8, "eval_batch": 64, "warmup": 5}


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _reseal(folder: Path) -> None:
    """Rewrite a checkpoint's manifest for its current files (content crafted and sealed)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    for name in manifest["files"]:
        data = (folder / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest))


# ---------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"d_model": 64, "n_heads": 3}, "d_model=64 must be divisible by n_heads=3"),
        ({"steps": 0}, "steps must be an int >= 1; got 0"),
        ({"lr": 0.0}, "lr must be a number in (0.0, 10.0]; got 0.0"),
        ({"lr": float("nan")}, "lr must be a number in (0.0, 10.0]; got nan"),
        ({"dropout": 1.0}, "dropout must be a number in [0.0, 1.0); got 1.0"),
        ({"beta2": 1.0}, "beta2 must be a number in [0.0, 1.0); got 1.0"),
        ({"save_every": -1}, "save_every must be an int >= 0; got -1"),
        ({"task": "copy"}, "task must be one of ['relations', 'reverse', 'text']; got 'copy'"),
        ({"task": "text"}, "task 'text' needs data"),
        ({"data": "x.txt"}, "data='x.txt' is given, so task must be 'text'"),
        ({"task": "text", "data": "x.txt", "arch": "encoder"}, "a text language model needs 'decoder'"),
        ({"seq_len": 32}, "seq_len is fixed by the task 'relations'"),
        ({"device": "tpu"}, "device must be 'cpu' or 'cuda'; got 'tpu'"),
    ],
)
def test_config_values_out_of_range(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError) as info:
        TrainConfig(**kwargs)
    assert words in str(info.value)


def test_task_defaults_fill_unset_fields() -> None:
    c = TrainConfig()
    assert (c.n_layers, c.n_heads, c.d_model, c.steps, c.batch_size, c.eval_every) == (1, 2, 64, 400, 64, 25)
    assert TrainConfig(n_heads=1).n_heads == 1
    assert TrainConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match=r"unknown fields \['heads'\]"):
        TrainConfig.from_dict({**c.to_dict(), "heads": 2})


def test_learning_rate_warms_up_then_follows_a_cosine() -> None:
    c = TrainConfig(lr=1e-2, warmup=10, steps=110, min_lr_ratio=0.1)
    assert learning_rate(c, 0) == pytest.approx(1e-3)
    assert learning_rate(c, 9) == pytest.approx(1e-2)
    assert learning_rate(c, 10) == pytest.approx(1e-2)
    assert learning_rate(c, 60) == pytest.approx(1e-3 + 0.5 * 9e-3 * (1 + math.cos(math.pi * 0.5)))
    assert learning_rate(c, 110) == pytest.approx(1e-3)
    lrs = [learning_rate(c, s) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))


# ---------------------------------------------------------------------------------------- a tiny run
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    run = tmp_path_factory.mktemp("tiny") / "run"
    torch.manual_seed(0)
    result = train(TrainConfig(**TINY, steps=20, eval_every=10, save_every=7), run, progress=False)
    return run, result


def test_run_folder_holds_config_metrics_checkpoints_and_summary(tiny_run) -> None:
    run, result = tiny_run
    record = json.loads((run / "config.json").read_text())
    assert record["train"]["d_model"] == 16 and record["model"]["n_heads"] == 2
    assert record["data"]["name"] == "relations"
    rows = _rows(run)
    assert [r["step"] for r in rows if r["kind"] == "train"] == [10, 20]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, 10, 20]  # before training, too
    assert {"loss", "lr", "grad_norm", "tokens_per_s"} <= set(rows[1])
    ckpts = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert ckpts == ["step-000014", "step-000020"]  # every 7 steps and at the end, newest two kept
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["relations"]) == {"previous_token", "matching_type"}
    assert 0.0 <= summary["accuracy"] <= 1.0
    model, _ = load_run(run)
    for p, q in zip(model.state_dict().values(), result.model.state_dict().values()):
        assert torch.equal(p, q)


def test_per_head_metrics_match_an_independent_computation(tiny_run) -> None:
    run, result = tiny_run
    ev = [r for r in _rows(run) if r["kind"] == "eval"][-1]
    model = result.model.eval()
    task = RelationsTask()
    batch = task.sample(batch_generator(0, 0, EVAL_STREAM), 64)
    attn = model.blocks[0].attn
    # W_O block norms straight from the weights
    for h in range(2):
        assert ev["wo_norm"][0][h] == pytest.approx(float(attn.W_O[h].detach().norm()), rel=1e-6)
    # attention mass on the ground truth, position by position, from the pattern need_weights returns
    patterns = []
    remove = attn.hook_pattern.add(lambda p, _: patterns.append(p.detach()))
    with torch.no_grad():
        logits = model(batch.tokens)
    remove()
    pattern = patterns[0]  # (batch, heads, seq, seq)
    for r, name in enumerate(task.relations):
        for h in range(2):
            total, count = 0.0, 0
            for b in range(64):
                for i in range(task.n_types, task.seq_len):
                    total += float(pattern[b, h, i, batch.relation_pos[b, i, r]])
                    count += 1
            assert ev["relation_mass"][name][0][h] == pytest.approx(total / count, rel=1e-5)
        # entropy of head 0 by the textbook formula
    p = pattern[:, 0].double()
    ent = -(torch.where(p > 0, p * p.log(), torch.zeros_like(p))).sum(-1).mean()
    assert ev["entropy"][0][0] == pytest.approx(float(ent), rel=1e-5)
    # ablation: zeroing head h's columns of the output projection is the same as zeroing z_h
    _, parts = part_accuracy(task, logits, batch)
    for h in range(2):
        ablated = model.__class__(model.config)
        ablated.load_state_dict(model.state_dict())
        ablated.eval()
        with torch.no_grad():
            ablated.blocks[0].attn.W_O[h].zero_()
            _, parts_h = part_accuracy(task, ablated(batch.tokens), batch)
        for r, name in enumerate(task.relations):
            assert ev["ablation_acc"][name][0][h] == pytest.approx(parts[r] - parts_h[r], abs=1e-9)


# ---------------------------------------------------------------------------------------- run folders
def test_output_folder_holding_another_run_is_refused(tiny_run) -> None:
    run, _ = tiny_run
    with pytest.raises(
        RunFolderError, match=r"already holds another run \(task 'relations', 20 steps\); pass --resume"
    ):
        train(TrainConfig(**TINY, steps=5), run, progress=False)


def test_non_empty_folder_and_resume_without_run(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(RunFolderError, match="is not empty and holds no run"):
        train(TrainConfig(**TINY, steps=5), tmp_path, progress=False)
    with pytest.raises(RunFolderError, match="holds no run"):
        train(TrainConfig(**TINY, steps=5), tmp_path / "empty", resume=True, progress=False)


def test_resume_with_another_config_lists_the_differing_fields(tiny_run) -> None:
    run, _ = tiny_run
    with pytest.raises(RunFolderError) as info:
        train(TrainConfig(**{**TINY, "batch_size": 16}, steps=20, lr=1e-2), run, resume=True, progress=False)
    msg = str(info.value)
    assert "train.batch_size: checkpoint has 8, requested 16" in msg
    assert "train.lr: checkpoint has 0.003, requested 0.01" in msg
    assert "d_model" not in msg


def test_resume_from_a_corrupt_checkpoint_names_the_file(tmp_path: Path) -> None:
    run = tmp_path / "run"
    config = TrainConfig(**TINY, steps=4, eval_every=100)
    train(config, run, progress=False)
    weights = next((run / "checkpoints").glob("step-*")) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: does not match its seal: 100 bytes"):
        train(config, run, resume=True, progress=False)


# ---------------------------------------------------------------------------------------- specialisation
def test_two_heads_specialise_one_per_relation(tmp_path: Path) -> None:
    """A shortened version of `headspace train --task relations` (default model, 250 of its 400 steps)."""
    result = train(TrainConfig(steps=250, eval_every=250, eval_batch=256), tmp_path / "r", progress=False)
    s = result.summary
    assert s is not None and s["accuracy"] >= 0.98
    prev, match = s["relations"]["previous_token"], s["relations"]["matching_type"]
    assert prev["head"] != match["head"]
    for r in (prev, match):
        assert r["attention_mass"] >= 0.8
        assert r["ablation_drop"] >= 0.5
        assert r["other_drop"] <= 0.05


def test_encoder_trains_on_the_task(tmp_path: Path) -> None:
    result = train(
        TrainConfig(**TINY, arch="encoder", steps=30, eval_every=30), tmp_path / "e", progress=False
    )
    rows = [r for r in _rows(tmp_path / "e") if r["kind"] == "train"]
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert result.summary is not None and len(result.final_eval["entropy"][0]) == 2


def test_reverse_task_runs_and_summarises_its_one_relation(tmp_path: Path) -> None:
    config = TrainConfig(**{**TINY, "task": "reverse"}, steps=6, eval_every=3)
    result = train(config, tmp_path / "rev", progress=False)
    assert result.summary is not None and list(result.summary["relations"]) == ["mirror"]
    mirror = result.summary["relations"]["mirror"]
    assert mirror["other_drop"] == 0.0 and len(mirror["head"]) == 2
    assert len(result.final_eval["relation_mass"]["mirror"]) == 2  # two layers (the reverse default)


def test_a_run_written_before_a_model_field_existed_still_resumes(tmp_path: Path) -> None:
    # run folders from before ModelConfig.pruned_heads lack the field: absent means its default
    run = tmp_path / "run"
    config = TrainConfig(**TINY, steps=4, eval_every=100)
    train(config, run, progress=False)
    ckpt = next((run / "checkpoints").glob("step-*"))
    for path in (run / "config.json", ckpt / "config.json"):
        record = json.loads(path.read_text())
        del record["model"]["pruned_heads"]
        path.write_text(json.dumps(record, indent=2, sort_keys=True, allow_nan=False) + "\n")
    _reseal(ckpt)  # the old checkpoint's own, consistent seal
    result = train(config, run, resume=True, progress=False)
    assert result is not None
    # a real difference is still refused
    with pytest.raises(RunFolderError, match=r"train.lr: checkpoint has 0.003, requested 0.01"):
        train(TrainConfig(**TINY, steps=4, eval_every=100, lr=1e-2), run, resume=True, progress=False)


# ---------------------------------------------------------------------------------------- the model size
@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"d_model": 10**6}, "the model is too large to train: 12,000,"),
        ({"n_layers": 10**5}, "parameters (n_layers=100000, d_model=64, d_mlp=256"),
        ({"d_model": 64, "d_mlp": 10**8}, "d_mlp=100000000"),
        ({"task": "text", "data": "x.txt", "seq_len": 10**8}, "seq_len=100000000"),
    ],
)
def test_an_oversized_model_is_refused_before_anything_is_allocated(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError) as info:
        TrainConfig(**kwargs)  # instantly: nothing is built
    msg = str(info.value)
    assert words in msg and "more than the cap of 2,000,000,000 (MAX_PARAMETERS" in msg


@pytest.mark.parametrize(
    "kwargs",
    [
        {"task": "relations", "d_model": 24, "n_heads": 3, "n_layers": 2},
        {"task": "reverse", "arch": "encoder", "d_model": 16, "n_heads": 2, "d_mlp": 40},
        {"task": "text", "data": "x.txt", "d_model": 8, "n_heads": 2, "n_layers": 3, "seq_len": 11},
    ],
)
def test_parameter_count_is_that_of_the_model_built(kwargs: dict) -> None:
    config = TrainConfig(**kwargs)
    vocab, seq = (37, 11) if config.task == "text" else (None, None)
    if vocab is None:
        task = train_loop.make_task(config.task)
        vocab, seq = task.vocab_size, task.seq_len
    model = build_model(model_config_for(config, vocab, seq))
    assert isinstance(model, EncoderReadout) == (config.arch == "encoder")
    assert parameter_count(config, vocab, seq) == sum(p.numel() for p in model.parameters())


def test_a_text_model_is_checked_again_with_its_vocabulary(tmp_path: Path, monkeypatch) -> None:
    data = tmp_path / "d.txt"
    data.write_text("".join(chr(0x4E00 + i) for i in range(3000)))  # 3000 distinct characters
    config = TrainConfig(task="text", data=str(data), seq_len=8, n_layers=1, n_heads=2, d_model=16)
    monkeypatch.setattr(train_loop, "MAX_PARAMETERS", 40_000)  # 1 character: fits; 3000: does not
    monkeypatch.setattr(train_loop, "build_model", lambda *_: pytest.fail("built before the size check"))
    with pytest.raises(
        ValueError, match=r"too large to train: 51,440 parameters .* vocab_size=3000, seq_len=8"
    ):
        train(config, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------- on_step
def test_on_step_is_called_after_every_step_and_can_stop_the_run(tmp_path: Path) -> None:
    seen: list[int] = []
    train(TrainConfig(**TINY, steps=5, eval_every=100), tmp_path / "a", progress=False, on_step=seen.append)
    assert seen == [1, 2, 3, 4, 5]

    def stop_at_3(step: int) -> None:
        if step == 3:
            raise KeyboardInterrupt

    run = tmp_path / "b"
    config = TrainConfig(**TINY, steps=5, eval_every=100, save_every=3)
    with pytest.raises(KeyboardInterrupt):
        train(config, run, progress=False, on_step=stop_at_3)
    assert json.loads((run / "checkpoints" / "latest.json").read_text())["step"] == 3  # saved before it ran
    assert train(config, run, resume=True, progress=False).step == 5
    with pytest.raises(TypeError, match="on_step must be a callable"):
        train(config, tmp_path / "c", progress=False, on_step=3)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------- resume, defended
@pytest.fixture()
def killed_run(tmp_path: Path) -> tuple[Path, TrainConfig]:
    """A 4-step run with checkpoints at 2 and 4, left as if killed after step 3 (latest: step 2)."""
    run = tmp_path / "run"
    config = TrainConfig(**TINY, steps=4, eval_every=100, save_every=2, log_every=1)
    train(config, run, progress=False)
    ckpts = run / "checkpoints"
    shutil.rmtree(ckpts / "step-000004")
    (ckpts / "latest.json").write_text(json.dumps({"step": 2, "folder": "step-000002"}))
    (run / "summary.json").unlink()
    return run, config


def _refused_untouched(
    run: Path, config: TrainConfig, words: str, exc: type[Exception] = CheckpointError
) -> None:
    before = {name: (run / name).read_bytes() for name in ("metrics.jsonl", "config.json")}
    with pytest.raises(exc, match=words):
        train(config, run, resume=True, progress=False)
    assert {name: (run / name).read_bytes() for name in before} == before  # metrics not trimmed


def test_an_edited_step_is_refused_and_the_run_folder_left_alone(killed_run) -> None:
    run, config = killed_run
    state = run / "checkpoints" / "step-000002" / "state.json"
    state.write_bytes(state.read_bytes().replace(b'"step": 2', b'"step": 3'))
    _refused_untouched(run, config, r"step-000002/state\.json: corrupted: its SHA-256 does not match")


def test_a_sealed_step_past_the_run_or_unlike_the_optimizer_is_refused(killed_run) -> None:
    run, config = killed_run
    ckpts = run / "checkpoints"
    for step in (10**6, 3):  # renamed and resealed consistently: the folder, the pointer, both JSON files
        old = next(ckpts.glob("step-*"))
        new = ckpts / f"step-{step:06d}"
        os.replace(old, new)
        for name in ("state.json", "manifest.json"):
            record = json.loads((new / name).read_text())
            record["step"] = step
            (new / name).write_text(json.dumps(record))
        _reseal(new)
        (ckpts / "latest.json").write_text(json.dumps({"step": step, "folder": new.name}))
        words = (
            r"state\.json: step 1000000 is past the run's last step \(4\)"
            if step > 4
            else r"optimizer\.state\.0\.step counts 2 optimizer steps, but the checkpoint is at step 3"
        )
        _refused_untouched(run, config, words)


def test_a_sealed_moment_of_the_wrong_shape_is_refused_before_metrics_are_trimmed(killed_run) -> None:
    run, config = killed_run
    folder = run / "checkpoints" / "step-000002"
    tensors = load_file(folder / "state.safetensors")
    tensors["optimizer.state.0.exp_avg"] = tensors["optimizer.state.0.exp_avg"][:1].contiguous()
    save_file(tensors, folder / "state.safetensors")
    _reseal(folder)
    _refused_untouched(run, config, r"state\.safetensors: optimizer\.state\.0\.exp_avg has shape")


@pytest.fixture()
def alarm() -> Iterator[None]:
    """Fail instead of hanging if a read blocks (a FIFO opened for reading)."""

    def hung(*_: object) -> None:
        raise TimeoutError("the reader blocked")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("name", ["config.json", "metrics.jsonl"])
def test_run_files_that_are_not_regular_files_are_refused(killed_run, alarm, name: str) -> None:
    run, config = killed_run
    (run / name).unlink()
    os.mkfifo(run / name)
    with pytest.raises(RunFolderError, match=rf"{name}: a named pipe \(FIFO\), not a regular file"):
        train(config, run, resume=True, progress=False)


def test_temporaries_of_a_killed_save_are_removed_at_resume(killed_run) -> None:
    run, config = killed_run
    stale = run / "checkpoints" / ".step-000004.x1y2z3.tmp"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half written")
    train(config, run, resume=True, progress=False)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "latest.json",
        "step-000002",
        "step-000004",
    ]


TEXT_RUN = {"task": "text", "seq_len": 8, "n_layers": 1, "n_heads": 2, "d_model": 16, "batch_size": 4,
            "eval_batch": 4, "warmup": 1, "steps": 2, "eval_every": 2}  # fmt: skip


def test_a_text_run_records_its_data_checksum_and_refuses_changed_data(tmp_path: Path) -> None:
    data = tmp_path / "notes.txt"
    text = "the cat sat on the mat. " * 20
    data.write_text(text)
    run = tmp_path / "run"
    config = TrainConfig(**TEXT_RUN, data=str(data))
    train(config, run, progress=False)
    record = json.loads((run / "config.json").read_text())
    assert record["data"]["sha256"] == hashlib.sha256(text.encode()).hexdigest()
    data.write_text(text.replace("cat", "act"))  # same length, same characters, other content
    with pytest.raises(RunFolderError) as info:
        train(config, run, resume=True, progress=False)
    msg = str(info.value)
    assert f"the data file {data} is not the one this run was trained on" in msg
    assert record["data"]["sha256"] in msg and hashlib.sha256(data.read_bytes()).hexdigest() in msg
    data.write_text(text)  # the content it was trained on: resumes
    assert train(config, run, resume=True, progress=False).step == 2


def test_a_text_run_recorded_before_the_data_checksum_still_resumes(tmp_path: Path) -> None:
    data = tmp_path / "notes.txt"
    data.write_text("the cat sat on the mat. " * 20)
    run = tmp_path / "run"
    config = TrainConfig(**{**TEXT_RUN, "steps": 4, "save_every": 2}, data=str(data))
    train(config, run, progress=False)
    ckpts = run / "checkpoints"
    shutil.rmtree(ckpts / "step-000004")
    (ckpts / "latest.json").write_text(json.dumps({"step": 2, "folder": "step-000002"}))
    for path in (run / "config.json", ckpts / "step-000002" / "config.json"):
        record = json.loads(path.read_text())
        del record["data"]["sha256"]
        path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    _reseal(ckpts / "step-000002")
    assert train(config, run, resume=True, progress=False).step == 4


def test_load_run_refuses_a_config_implying_more_weights_than_the_file_holds(
    tmp_path: Path, monkeypatch
) -> None:
    run = tmp_path / "run"
    train(TrainConfig(**TINY, steps=2, eval_every=100), run, progress=False)
    folder = run / "checkpoints" / "step-000002"
    record = json.loads((folder / "config.json").read_text())
    record["model"]["n_layers"] = 10**5  # resealed: only the content can tell
    (folder / "config.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    _reseal(folder)
    monkeypatch.setattr(train_loop, "build_model", lambda *_: pytest.fail("built before the check"))
    with pytest.raises(CheckpointError) as info:
        load_run(run)
    msg = str(info.value)
    assert (
        str(folder / "config.json") in msg
        and "implies at least 204,802,432 parameters" in msg
        and "n_layers=100000" in msg
    )
