"""Evaluation in chunks: the numbers of one pass over the batch, in memory of one chunk; and progress.

A text run's evaluation batch (512 windows of 128 tokens by default on the command line) used to go
through the model at once, keeping every layer's [batch, heads, seq, seq] pattern and running one
whole-model pass per head ablation: 2.8 GB and a minute for a 0.8M-parameter model. These tests pin
that the chunked evaluation gives the same metrics as a plain one-pass computation, that no pass sees
more than one chunk, that an ablation runs only the layers from the ablated one up, that the peak
memory of an evaluation stays far below the size of the whole batch's patterns, and that a run says
what it does before its first step and times its bar from after it.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from headspace.analysis import roles_from_patterns, wo_norms
from headspace.analysis.trace import attention_layers
from headspace.train import TrainConfig, metrics, train
from headspace.train import loop as train_loop
from headspace.train.data import TextData
from headspace.train.loop import build_model, model_config_for
from headspace.train.metrics import eval_chunk_rows, evaluate, part_accuracy, relation_mass, task_loss
from headspace.train.tasks import EVAL_STREAM, Batch, batch_generator, make_task

pytestmark = pytest.mark.usefixtures("single_thread")

TINY = {"task": "relations", "d_model": 16, "n_heads": 2, "batch_size": 8, "eval_batch": 64, "warmup": 5}


# ---------------------------------------------------------------------------------------- a reference
@torch.no_grad()
def one_pass_reference(model: torch.nn.Module, task: Any, batch: Batch) -> dict[str, Any]:
    """The metrics the plain way: the whole batch at once, every pattern kept, one model pass per head."""
    model.eval()
    layers = [attn for _, attn in attention_layers(model)]
    patterns: list[torch.Tensor] = []
    removers = [a.hook_pattern.add(lambda p, _hp: patterns.append(p.detach())) for a in layers]
    logits = model(batch.tokens)
    for remove in removers:
        remove()
    loss = float(task_loss(logits, batch.targets))
    out: dict[str, Any] = {"loss": loss}
    synthetic = batch.relation_pos is not None
    if synthetic:
        whole, parts = part_accuracy(task, logits, batch)
        out["accuracy"], out["part_accuracy"] = whole, dict(zip(task.relations, parts))
    roles = roles_from_patterns(patterns)
    out["entropy"] = roles.entropy.tolist()
    for target in ("previous", "current", "first"):
        out[f"role_{target}"] = roles.mass(target).tolist()
    out["wo_norm"] = wo_norms(model).tolist()
    if synthetic:
        masses = [relation_mass(p, batch) for p in patterns]
        out["relation_mass"] = {
            name: [m[:, r].tolist() for m in masses] for r, name in enumerate(task.relations)
        }
    ablation_loss, ablation_acc = [], {name: [] for name in getattr(task, "relations", ())}
    for attn in layers:
        row, acc_row = [], {name: [] for name in ablation_acc}
        for h in range(attn.n_heads):

            def zero(z: torch.Tensor, _hp: Any, h: int = h) -> torch.Tensor:
                z = z.clone()
                z[:, :, h] = 0.0
                return z

            remove = attn.hook_z.add(zero)
            ablated = model(batch.tokens)
            remove()
            row.append(float(task_loss(ablated, batch.targets)) - loss)
            if synthetic:
                _, parts_h = part_accuracy(task, ablated, batch)
                for r, name in enumerate(task.relations):
                    acc_row[name].append(out["part_accuracy"][name] - parts_h[r])
        ablation_loss.append(row)
        for name in ablation_acc:
            ablation_acc[name].append(acc_row[name])
    out["ablation_loss"] = ablation_loss
    if synthetic:
        out["ablation_acc"] = ablation_acc
    return out


def assert_same_metrics(got: Any, want: Any, path: str = "") -> None:
    if isinstance(want, dict):
        assert list(got) == list(want), path
        for k in want:
            assert_same_metrics(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_metrics(g, w, f"{path}[{i}]")
    else:
        assert got == pytest.approx(want, rel=1e-5, abs=1e-5), path  # float32 losses of about 3


def text_model(n_layers: int = 3, n_heads: int = 4, d_model: int = 16, seq_len: int = 16) -> Any:
    torch.manual_seed(0)
    cfg = TrainConfig(task="text", data="unused.txt", n_layers=n_layers, n_heads=n_heads, d_model=d_model)
    return build_model(model_config_for(cfg, 11, seq_len)).eval()


def text_batch(rows: int, seq_len: int = 16, vocab: int = 11) -> Batch:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows * (seq_len + 1) + 50,), generator=g)
    data = TextData("unused.txt", "byte", None, ids[:50], ids[50:], seq_len)
    return data.sample(batch_generator(0, 0, EVAL_STREAM), rows, "val")


# ---------------------------------------------------------------------------------------- same numbers
@pytest.mark.parametrize("chunk_rows", [None, 1, 5, 24])
def test_chunked_evaluation_of_a_text_model_matches_one_pass(chunk_rows: int | None) -> None:
    model, batch = text_model(), text_batch(24)
    want = one_pass_reference(model, None, batch)
    got = evaluate(model, None, batch, chunk_rows=chunk_rows)
    assert set(got) == {"loss", "entropy", "role_previous", "role_current", "role_first", "wo_norm",
                        "ablation_loss"}  # fmt: skip
    assert_same_metrics(got, want)


@pytest.mark.parametrize("arch, task_name", [("decoder", "relations"), ("encoder", "relations"),
                                             ("decoder", "reverse")])  # fmt: skip
def test_chunked_evaluation_of_a_task_matches_one_pass(arch: str, task_name: str) -> None:
    task = make_task(task_name)
    torch.manual_seed(0)
    cfg = TrainConfig(task=task_name, arch=arch, n_layers=2, n_heads=2, d_model=16)
    model = build_model(model_config_for(cfg, task.vocab_size, task.seq_len)).eval()
    batch = task.sample(batch_generator(0, 0, EVAL_STREAM), 40)
    want = one_pass_reference(model, task, batch)
    whole = evaluate(model, task, batch)  # 40 sequences: one chunk
    assert_same_metrics(whole, want)
    assert_same_metrics(evaluate(model, task, batch, chunk_rows=7), whole)


def test_a_batch_that_fits_one_chunk_gives_exactly_the_one_pass_numbers() -> None:
    """One layer, one chunk: the same arithmetic as one pass, so summary.json files stay identical."""
    task = make_task("relations")
    torch.manual_seed(0)
    cfg = TrainConfig(task="relations", n_heads=2, d_model=16)
    model = build_model(model_config_for(cfg, task.vocab_size, task.seq_len)).eval()
    batch = task.sample(batch_generator(0, 0, EVAL_STREAM), 64)
    got, want = evaluate(model, task, batch), one_pass_reference(model, task, batch)
    for key in ("loss", "accuracy", "part_accuracy", "relation_mass", "ablation_acc", "ablation_loss"):
        assert got[key] == want[key], key


def test_the_whole_model_ablation_fallback_gives_the_same_numbers(monkeypatch) -> None:
    model, batch = text_model(), text_batch(12)
    fast = evaluate(model, None, batch, chunk_rows=5)
    monkeypatch.setattr(metrics, "_block_stack", lambda *_: None)  # a model laid out some other way
    assert_same_metrics(evaluate(model, None, batch, chunk_rows=5), fast)


# ---------------------------------------------------------------------------------------- in chunks
def test_default_chunks_of_a_text_run_and_of_a_task() -> None:
    assert eval_chunk_rows(512, 128, 4) == 32  # the text run's 512 windows: 16 chunks
    assert eval_chunk_rows(512, 24, 2) == 512  # the relations task's held-out batch: one chunk
    assert eval_chunk_rows(3, 128, 4) == 3 and eval_chunk_rows(512, 4096, 64) == 1
    with pytest.raises(ValueError, match="chunk_rows must be None or an int >= 1"):
        evaluate(text_model(), None, text_batch(2), chunk_rows=0)


@pytest.mark.parametrize("tokens_per_pass", [None, 160])
def test_no_forward_pass_sees_more_than_one_chunk_and_ablations_skip_the_layers_below(
    tokens_per_pass: int | None, monkeypatch
) -> None:
    n_layers, n_heads, rows, chunk, seq = 3, 4, 23, 5, 16
    if tokens_per_pass is not None:  # two heads per ablation pass instead of all four
        monkeypatch.setattr(metrics, "EVAL_CHUNK_TOKENS", tokens_per_pass)
    per_pass = min(n_heads, metrics.EVAL_CHUNK_TOKENS // (seq * chunk))
    groups = math.ceil(n_heads / per_pass)
    model, batch = text_model(n_layers, n_heads, seq_len=seq), text_batch(rows, seq)
    want = one_pass_reference(model, None, batch)
    seen_rows: list[int] = []
    pattern_rows: list[int] = []
    mlp_calls = [0] * n_layers

    def count_mlp(i: int) -> Any:
        return lambda *_args: mlp_calls.__setitem__(i, mlp_calls[i] + 1)

    fold = metrics._Evaluation._fold_pattern

    def fold_and_count(self: Any, value: torch.Tensor, layer: int, chunk: Batch) -> None:
        pattern_rows.append(value.shape[0])
        fold(self, value, layer, chunk)

    monkeypatch.setattr(metrics._Evaluation, "_fold_pattern", fold_and_count)
    removers = [model.register_forward_pre_hook(lambda _m, args: seen_rows.append(args[0].shape[0])).remove]
    for i, block in enumerate(model.blocks):
        removers.append(block.mlp.register_forward_hook(count_mlp(i)).remove)
    progress: list[tuple[int, int]] = []
    got = evaluate(model, None, batch, chunk_rows=chunk, on_progress=lambda d, t: progress.append((d, t)))
    for remove in removers:
        remove()
    assert_same_metrics(got, want)
    n_chunks = math.ceil(rows / chunk)
    passes = n_chunks * (1 + n_layers * groups)
    assert len(seen_rows) == passes and sum(seen_rows) == rows * (1 + n_layers * n_heads)
    assert max(seen_rows) * seq <= max(metrics.EVAL_CHUNK_TOKENS, chunk * seq)  # every pass within budget
    assert max(pattern_rows) == chunk and len(pattern_rows) == n_chunks * n_layers  # clean passes only
    assert progress == [(i, passes) for i in range(passes + 1)]
    # per chunk: the clean pass runs every block; an ablation pass of layer l runs the MLPs of l and up
    assert mlp_calls == [n_chunks * (1 + groups * (i + 1)) for i in range(n_layers)]


def test_the_peak_memory_of_an_evaluation_stays_below_the_whole_batch_patterns(tmp_path: Path) -> None:
    """In a fresh process: the rise of the peak RSS over an evaluation of 256 windows of 128 tokens.

    One layer of 8 heads: the whole batch's float32 patterns are 128 MiB (the one-pass evaluation kept
    them, and the role sums made float64 copies: its peak rose by 1.2 GB); chunked, the rise is that of
    one chunk of 16 windows (80 MB measured).
    """
    script = textwrap.dedent(
        """
        import json, resource, sys, torch
        from headspace.train.loop import TrainConfig, build_model, model_config_for
        from headspace.train.metrics import evaluate
        from headspace.train.tasks import Batch
        torch.set_num_threads(1)
        cfg = TrainConfig(task="text", data="unused.txt", n_layers=1, n_heads=8, d_model=16)
        model = build_model(model_config_for(cfg, 11, 128))
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 11, (256, 129), generator=g)
        batch = Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        evaluate(model, None, Batch(batch.tokens[:2], batch.targets[:2]))  # warm-up: one-time allocations
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result = evaluate(model, None, batch)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({"rise_kib": after - before, "loss": result["loss"]}))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    rise_mib = json.loads(done.stdout.strip().splitlines()[-1])["rise_kib"] / 1024
    whole_patterns_mib = 256 * 8 * 128 * 128 * 4 / 2**20  # 128 MiB
    assert rise_mib < whole_patterns_mib, f"peak RSS rose by {rise_mib:.0f} MiB"


# ---------------------------------------------------------------------------------------- progress
def test_a_run_says_what_it_does_before_its_first_step(tmp_path: Path, capsys) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("the heads of a transformer attend to earlier tokens. " * 40, encoding="utf-8")
    seen: dict[int, str] = {}

    def on_step(step: int) -> None:
        seen[step] = capsys.readouterr().err

    config = TrainConfig(task="text", data=str(text), n_layers=1, n_heads=2, d_model=16, seq_len=16,
                         batch_size=4, eval_batch=8, steps=3, eval_every=100)  # fmt: skip
    train(config, tmp_path / "run", progress=True, on_step=on_step)
    first = seen[1]
    order = ["reading and encoding", "tokens, vocabulary", "building the model", "parameters",
             "evaluating step 0 on 8 held-out windows", "step 0: eval loss",
             "training steps 1..3"]  # fmt: skip
    at = [first.find(words) for words in order]
    assert all(i >= 0 for i in at) and at == sorted(at), first
    assert "train text" in first  # the bar, started once the first step is done
    assert "step 3: eval loss" in seen[3]  # said before step 3 ends (its on_step)


def test_the_bar_is_timed_from_after_the_first_step(tmp_path: Path, monkeypatch) -> None:
    events: list[tuple[str, int]] = []
    start_bar = train_loop._Progress.start_bar

    def record(self: Any, initial: int) -> None:
        events.append(("bar", initial))
        start_bar(self, initial)

    monkeypatch.setattr(train_loop._Progress, "start_bar", record)
    config = TrainConfig(**TINY, steps=4, eval_every=100, save_every=2)
    train(config, tmp_path / "run", progress=True, on_step=lambda s: events.append(("step", s)))
    assert events[:2] == [("bar", 1), ("step", 1)] and events.count(("bar", 1)) == 1
    events.clear()

    def stop_at_2(step: int) -> None:
        events.append(("step", step))
        if step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(config, tmp_path / "killed", progress=True, on_step=stop_at_2)
    events.clear()
    train(
        config, tmp_path / "killed", resume=True, progress=True, on_step=lambda s: events.append(("step", s))
    )
    assert events[:2] == [("bar", 3), ("step", 3)]  # resumed at 2: step 3 is this process's first


def test_time_spent_evaluating_is_left_out_of_the_step_rate(capsys) -> None:
    status = train_loop._Progress(True, "train x", 100)
    status.start_bar(1)
    time.sleep(0.15)
    status.step()  # a step of 0.15 s
    time.sleep(0.6)
    status.untimed(0.6)  # an evaluation of 0.6 s
    time.sleep(0.15)
    status.step()
    rate = status.bar.format_dict["rate"]
    status.close()
    assert rate is not None and rate > 1 / 0.4, rate  # about 1 / 0.15 steps/s, not 2 / 0.9
    assert re.search(r"train x", capsys.readouterr().err)
