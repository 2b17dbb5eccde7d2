"""The training loop: AdamW, warm-up + cosine schedule, gradient clipping, evaluation, exact resume.

:func:`train` trains a :class:`~headspace.models.Decoder` (or an :class:`~headspace.models.Encoder` with
a linear read-out) described by a :class:`TrainConfig` on a built-in task (:mod:`.tasks`) or a text file
(:mod:`.data`), and writes a run folder::

    RUN_DIR/config.json        the run: {"format", "train": TrainConfig, "model": ModelConfig, "data"}
    RUN_DIR/metrics.jsonl      one JSON object per line: {"kind": "train", "step", "loss", "lr",
                               "grad_norm", "tokens_per_s"} and {"kind": "eval", "step", "loss",
                               "accuracy", per-head measurements (see :mod:`.metrics`)};
                               tokens_per_s counts training time only (not evaluations or checkpoints)
    RUN_DIR/checkpoints/       see :mod:`.checkpoint` (every ``save_every`` steps and at the end)
    RUN_DIR/summary.json       synthetic tasks: accuracy and, per relation, the head that serves it;
                               text: the held-out loss (and bits per token, perplexity), the last
                               training loss, steps, parameters and this process's time and tokens/s

Determinism: the weights are initialised from ``seed``; the batch of step ``s`` is drawn from a
generator seeded by (seed, s) only; the global RNG (dropout) is reseeded at every step from
(seed, s, rank), so data-parallel ranks draw different dropout masks; evaluation uses its own generator
and never touches the global RNG. A checkpoint stores the optimizer state and the RNG states, so a run
killed at any step and resumed from its last checkpoint ends with the same weights, bit for bit, as a
run never interrupted.

Progress (``progress=True``, rank 0, on stderr): status lines from the start (reading and encoding the
data, building the model, the first evaluation with a bar over its forward passes), then the training
bar, started once the first step of the process is done so that its rate and ETA leave out that step's
one-time costs (and evaluations and checkpoints). Evaluations run in chunks (see :mod:`.metrics`), so
their memory is that of one chunk whatever ``eval_batch`` is.

Data parallel (``torchrun --nproc-per-node W -m headspace train ...``): every rank draws the same
global batch and trains on rows ``[r B/W, (r+1) B/W)``; DDP averages the gradients, so a step equals the
one-process step on the whole batch. Only rank 0 writes files.

The run's parts, each in its module (every name importable from here): :mod:`.run_config` (the
configuration, the model's size and the learning-rate schedule), :mod:`.run_folder` (the run folder's
own files and checks), :mod:`.run_progress` (progress on stderr).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from torch import Tensor, nn

from ..analysis.trace.trace import attention_layers
from ..core.fileio import write_atomic
from ..core.process_group import DistInfo, barrier, setup_distributed, teardown
from ..distributed.data_parallel import average_across_ranks, check_same_config, local_batch_slice, wrap_model
from ..model.models import Decoder, Encoder, ModelConfig
from .checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_weights_into,
    remove_stale_temporaries,
    restore_training_state,
    save_checkpoint,
)
from .data import TextData, load_text
from .metrics import evaluate, relation_summary, task_loss
from .run_config import MAX_PARAMETERS, TrainConfig, check_model_size, learning_rate
from .run_config import parameter_count as parameter_count  # re-exported, as every name below
from .run_folder import MAX_METRICS_BYTES as MAX_METRICS_BYTES
from .run_folder import MAX_RECORD_BYTES as MAX_RECORD_BYTES
from .run_folder import (
    METRICS_FILE,
    RESUMABLE_CHANGES,
    RUN_CONFIG,
    SUMMARY_FILE,
    RunResult,
    _check_resume_point,
    _check_run_dir,
    _read_metrics,
    _trim_metrics,
    normalizer_for,
    run_record,
)
from .run_folder import RUN_FORMAT as RUN_FORMAT
from .run_folder import RunFolderError as RunFolderError
from .run_folder import with_current_defaults as with_current_defaults
from .run_progress import _eval_line, _Progress
from .tasks import (
    DROPOUT_STREAM,
    EVAL_STREAM,
    TRAIN_STREAM,
    Batch,
    batch_generator,
    make_task,
    step_seed,
)


# --------------------------------------------------------------------------------------------- models
class EncoderReadout(nn.Module):
    """An :class:`~headspace.models.Encoder` with a linear read-out: ``logits = Encoder(t) W + b``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.readout = nn.Linear(config.d_model, config.vocab_size)
        nn.init.normal_(self.readout.weight, std=config.init_std)
        nn.init.zeros_(self.readout.bias)

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens [batch, seq] -> logits [batch, seq, vocab_size]."""
        return self.readout(self.encoder(tokens))  # (batch, seq, vocab_size)


def model_config_for(config: TrainConfig, vocab_size: int, seq_len: int) -> ModelConfig:
    return ModelConfig(
        arch=config.arch,
        vocab_size=vocab_size,
        d_model=config.d_model,
        n_layers=config.n_layers,
        n_heads=config.n_heads,
        d_mlp=config.d_mlp,
        max_seq_len=seq_len,
        norm="pre",
        dropout=config.dropout,
        type_vocab_size=0,
        final_ln=True,
        name=f"headspace-train-{config.task}",
    )


def build_model(model_config: ModelConfig) -> nn.Module:
    """A Decoder, or an Encoder with a read-out, for ``model_config``."""
    if model_config.arch == "decoder":
        return Decoder(model_config)
    return EncoderReadout(model_config)


# --------------------------------------------------------------------------------------------- data
class _Source:
    """The task or the text, behind one interface: train/eval batches and a description."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        if config.task == "text":
            assert config.data is not None and config.seq_len is not None
            self.text: TextData | None = load_text(config.data, level=config.level, seq_len=config.seq_len)
            self.task: Any = None
            self.vocab_size = self.text.vocab_size
            self.seq_len = config.seq_len
        else:
            self.text = None
            self.task = make_task(config.task)
            self.vocab_size = self.task.vocab_size
            self.seq_len = self.task.seq_len

    def describe(self) -> dict[str, Any]:
        return self.text.describe() if self.text is not None else self.task.describe()

    def train_batch(self, step: int) -> Batch:
        g = batch_generator(self.config.seed, step, TRAIN_STREAM)
        if self.text is not None:
            return self.text.sample(g, self.config.batch_size, "train")
        return self.task.sample(g, self.config.batch_size)

    def eval_batch(self) -> Batch:
        g = batch_generator(self.config.seed, 0, EVAL_STREAM)
        if self.text is not None:
            return self.text.sample(g, self.config.eval_batch, "val")
        return self.task.sample(g, self.config.eval_batch)


# --------------------------------------------------------------------------------------------- run folder
def _optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices (>= 2-D), none on biases and LayerNorm gains (as nanoGPT)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), foreach=False)


def _describe_eval(source: _Source, batch: Batch, model: nn.Module) -> str:
    rows = batch.tokens.shape[0]
    what = "windows" if source.text is not None else "sequences"
    n_heads = sum(m.n_heads for _, m in attention_layers(model))
    return f"{rows} held-out {what} (loss, attention patterns, {n_heads} head ablations)"


# --------------------------------------------------------------------------------------------- training
def train(
    config: TrainConfig,
    out: str | os.PathLike[str],
    *,
    resume: bool = False,
    progress: bool = True,
    on_step: Callable[[int], None] | None = None,
    _info: DistInfo | None = None,
) -> RunResult:
    """Train ``config`` into the run folder ``out`` (see the module docstring); returns a :class:`RunResult`.

    ``resume=True`` continues the run in ``out`` from its latest checkpoint (the configuration must be
    the same, except the fields in ``RESUMABLE_CHANGES``, and a text run's data file must hold the same
    content). The checkpoint is validated completely before the run folder is touched (see
    :mod:`.checkpoint`). ``on_step(step)``, when given, is called on every rank after each optimizer step
    with the number of steps done, once that step's logging, evaluation and checkpoint are written; an
    exception it raises stops the run there (the last checkpoint stays valid). Errors a user can cause
    (bad data file, an output folder holding another run, a corrupt checkpoint, a model over
    :data:`MAX_PARAMETERS`) raise ``ValueError`` subclasses (:class:`RunFolderError`,
    :class:`~headspace.train.checkpoint.CheckpointError`).
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig; got {type(config).__name__}")
    if on_step is not None and not callable(on_step):
        raise TypeError(f"on_step must be a callable taking the step number; got {type(on_step).__name__}")
    out = Path(out)
    info = _info or setup_distributed(config.device)
    try:
        return _train(config, out, resume, progress, info, on_step)
    finally:
        if _info is None:
            teardown(info)


def _train(
    config: TrainConfig,
    out: Path,
    resume: bool,
    progress: bool,
    info: DistInfo,
    on_step: Callable[[int], None] | None,
) -> RunResult:
    """The run behind :func:`train` on this rank, in its four stages.

    Read the data and check the run folder (:func:`_read_run`), build the model and its optimizer
    (:func:`_build`), start the folder or restore its checkpoint (:func:`_open_run`), run the steps
    (:func:`_run_steps`); rank 0 then writes ``summary.json`` (:func:`_summary`).
    """
    assert config.steps is not None and config.eval_every is not None
    device = torch.device(config.device if config.device != "cuda" else f"cuda:{info.local_rank}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA device is available; use --device cpu")
    status = _Progress(progress and info.is_main, f"train {config.task}", config.steps)
    t_run = time.perf_counter()
    source, model_config, record = _read_run(config, out, resume, info, status)
    model, optimizer = _build(config, model_config, source, device, status)
    start = _open_run(config, out, resume, info, status, record, model, optimizer)
    wrapped = wrap_model(model, info)
    eval_batch = source.eval_batch().to(device)
    steps = _Steps(config, out, info, status, source, record, model, optimizer, wrapped, eval_batch, device)
    last_eval, last_loss, trained_seconds = _run_steps(steps, start, on_step)
    barrier(info)

    summary = None
    if info.is_main:
        if not last_eval:  # resumed at the last step: evaluate once more for the summary
            last_eval = {"kind": "eval", "step": config.steps, **evaluate(model, source.task, eval_batch)}
        summary = _summary(config, source, model, last_eval, last_loss, start, trained_seconds,
                           time.perf_counter() - t_run)  # fmt: skip
        write_atomic(out / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
    return RunResult(out, config.steps, model, last_eval, summary)


def _read_run(
    config: TrainConfig, out: Path, resume: bool, info: DistInfo, status: _Progress
) -> tuple[_Source, ModelConfig, dict[str, Any]]:
    """Read and encode the data, check the model's size and the run folder (every rank, before any write).

    Returns the data source, the model's configuration and the run record (``run_config.json``'s
    content). On resume, rank 0 also removes the temporaries a save killed mid-way left behind.
    """
    t0 = time.perf_counter()
    if config.task == "text":
        status.say(f"reading and encoding {config.data} ({config.level} level) ...")
    source = _Source(config)
    if source.text is not None:
        d = source.text.describe()
        status.say(
            f"{d['train_tokens'] + d['val_tokens']:,} {config.level} tokens, vocabulary {d['vocab_size']} "
            f"({d['train_tokens']:,} train, {d['val_tokens']:,} held out) in {time.perf_counter() - t0:.1f} s"
        )
    # before anything is allocated; the cap read here, where MAX_PARAMETERS is documented
    check_model_size(config, source.vocab_size, source.seq_len, MAX_PARAMETERS)
    model_config = model_config_for(config, source.vocab_size, source.seq_len)
    record = run_record(config, model_config, source.describe())
    check_same_config({k: v for k, v in config.to_dict().items() if k != "device"}, info)
    _check_run_dir(out, record, resume)
    if resume and info.is_main:
        remove_stale_temporaries(out)  # what a save killed mid-way left behind
    barrier(info)  # every rank checks the folder before rank 0 writes into it
    return source, model_config, record


def _build(
    config: TrainConfig, model_config: ModelConfig, source: _Source, device: torch.device, status: _Progress
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model (initialized from ``config.seed``) on ``device``, and its optimizer."""
    status.say("building the model and its optimizer ...")
    t0 = time.perf_counter()
    torch.manual_seed(config.seed)
    model = build_model(model_config).to(device)
    optimizer = _optimizer(model, config)
    status.say(
        f"model: {config.arch}, {config.n_layers} layer(s) x {config.n_heads} head(s), d_model "
        f"{config.d_model}, seq {source.seq_len}, vocabulary {source.vocab_size}: "
        f"{sum(p.numel() for p in model.parameters()):,} parameters, on {device} "
        f"({time.perf_counter() - t0:.1f} s)"
    )
    return model, optimizer


def _open_run(
    config: TrainConfig,
    out: Path,
    resume: bool,
    info: DistInfo,
    status: _Progress,
    record: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
) -> int:
    """Start the run folder, or restore model and optimizer from its latest checkpoint; the first step.

    A resume reads and checks everything before the folder changes, then trims ``metrics.jsonl`` to the
    checkpoint's step and rewrites ``run_config.json`` (the resumable fields may differ).
    """
    start = 0
    metrics_path = out / METRICS_FILE
    metrics_text: str | None = None
    if resume:
        # everything is read and checked before the run folder changes
        ckpt = load_checkpoint(
            out,
            expected_config=record,
            allow_differ=RESUMABLE_CHANGES,
            normalize_config=normalizer_for(record),
        )
        _check_resume_point(ckpt, config)
        metrics_text = _read_metrics(metrics_path) if info.is_main else None
        restore_training_state(ckpt, model, optimizer)
        start = ckpt.step
        status.say(f"resuming at step {start} of {config.steps} from {ckpt.folder}")
    elif info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / RUN_CONFIG, json.dumps(record, indent=2, sort_keys=True) + "\n")
    barrier(info)
    if info.is_main and resume:
        _trim_metrics(metrics_path, metrics_text, start)
        write_atomic(out / RUN_CONFIG, json.dumps(record, indent=2, sort_keys=True) + "\n")
    return start


@dataclass
class _Steps:
    """What the training steps of one run share: the run, the model and its optimizer, the held-out batch."""

    config: TrainConfig
    out: Path
    info: DistInfo
    status: _Progress
    source: _Source
    record: dict[str, Any]
    model: nn.Module
    optimizer: torch.optim.Optimizer
    wrapped: nn.Module
    eval_batch: Batch
    device: torch.device

    def evaluate(self, step: int) -> dict[str, Any]:
        """The ``eval`` row of ``metrics.jsonl`` at ``step`` (loss, accuracy, patterns, ablations)."""
        t = time.perf_counter()
        result = evaluate(
            self.model, self.source.task, self.eval_batch, on_progress=self.status.eval_progress(step)
        )
        self.status.end_eval()
        self.status.say(_eval_line(step, result, time.perf_counter() - t))
        return {"kind": "eval", "step": step, **result}

    def optimizer_step(self, step: int, lr: float, rows: slice) -> tuple[Tensor, float]:
        """One optimizer step on this rank's ``rows`` of batch ``step`` at learning rate ``lr``.

        Dropout masks are a function of (seed, step, rank), so ranks differ and a resume replays them.
        Returns the loss (a 0-d tensor, this rank's) and the gradients' total 2-norm, measured before
        clipping to ``grad_clip`` (when it is > 0).
        """
        config = self.config
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = self.source.train_batch(step).rows(rows.start, rows.stop).to(self.device)
        torch.manual_seed(step_seed(config.seed, step, DROPOUT_STREAM + self.info.rank))
        logits = self.wrapped(batch.tokens)  # (local_batch, seq, vocab)
        loss = task_loss(logits, batch.targets)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        params = self.model.parameters()
        if config.grad_clip > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, config.grad_clip))
        else:
            grad_norm = float(
                torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))
            )
        self.optimizer.step()
        return loss, grad_norm


def _write_row(log: IO[str] | None, row: dict[str, Any]) -> None:
    """One JSON line of ``metrics.jsonl``, flushed (nothing on ranks without the file)."""
    if log is not None:
        log.write(json.dumps(row) + "\n")
        log.flush()


def _run_steps(
    steps: _Steps, start: int, on_step: Callable[[int], None] | None
) -> tuple[dict[str, Any], float | None, float]:
    """Steps ``start + 1 .. config.steps``, with rank 0 logging, evaluating and saving on schedule.

    Evaluates step 0 first on a fresh run. Returns the last evaluation row (``{}`` when none ran), the
    last logged mean training loss (None when none was logged) and the seconds spent in training steps
    (evaluations and checkpoints left out, as in ``tokens_per_s``).
    """
    config, info, status, source = steps.config, steps.info, steps.status, steps.source
    local_rows = local_batch_slice(config.batch_size, info)
    tokens_per_step = config.batch_size * source.seq_len
    log = open(steps.out / METRICS_FILE, "a", encoding="utf-8") if info.is_main else None
    last_eval: dict[str, Any] = {}
    prev_det = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        if info.is_main and start == 0:  # the heads before any training: random matrices
            status.say(f"evaluating step 0 on {_describe_eval(source, steps.eval_batch, steps.model)} ...")
            last_eval = steps.evaluate(0)
            _write_row(log, last_eval)
        if start < config.steps:
            status.say(
                f"training steps {start + 1}..{config.steps} on batches of {config.batch_size} x "
                f"{source.seq_len} tokens; step {start + 1} carries one-time setup and is not timed ..."
            )
        steps.model.train()
        t_last, tokens_since = time.perf_counter(), 0
        trained_seconds, last_loss = 0.0, None  # training time only (no evaluations, no checkpoints)
        for step in range(start, config.steps):
            lr = learning_rate(config, step)
            loss, grad_norm = steps.optimizer_step(step, lr, local_rows)
            done = step + 1
            tokens_since += tokens_per_step
            if done % config.log_every == 0 or done == config.steps:
                mean_loss = average_across_ranks(loss.detach(), info)
                now = time.perf_counter()
                tps = tokens_since / max(now - t_last, 1e-9)
                trained_seconds += now - t_last
                t_last, tokens_since, last_loss = now, 0, mean_loss
                _write_row(log, {"kind": "train", "step": done, "loss": mean_loss, "lr": lr,
                                 "grad_norm": grad_norm, "tokens_per_s": tps})  # fmt: skip
                status.postfix(loss=f"{mean_loss:.4f}", tok_s=f"{tps:,.0f}")
            if status.bar is None:
                status.start_bar(done)  # after the first step: its one-time costs are not timed
            else:
                status.step()
            paused = time.perf_counter()
            if info.is_main and (done % config.eval_every == 0 or done == config.steps):
                last_eval = steps.evaluate(done)
                _write_row(log, last_eval)
                acc = last_eval.get("accuracy")
                extra = {} if acc is None else {"acc": f"{acc:.3f}"}
                status.postfix(loss=f"{float(loss.detach()):.4f}", eval=f"{last_eval['loss']:.4f}", **extra)
            if info.is_main and (
                (config.save_every and done % config.save_every == 0) or done == config.steps
            ):
                save_checkpoint(
                    steps.out, done, config=steps.record, model=steps.model, optimizer=steps.optimizer
                )
            if on_step is not None:
                on_step(done)
            pause = time.perf_counter() - paused
            t_last += pause  # tokens_per_s: training time only, without evaluations and checkpoints
            status.untimed(pause)
    finally:
        torch.use_deterministic_algorithms(prev_det)
        status.close()
        if log is not None:
            log.close()
    return last_eval, last_loss, trained_seconds


def _summary(
    config: TrainConfig, source: _Source, model: nn.Module, last_eval: dict[str, Any],
    train_loss: float | None, start: int, trained_seconds: float, seconds: float,
) -> dict[str, Any]:  # fmt: skip
    """summary.json: for a task, its accuracy, loss and per-relation results at the last evaluation; for
    a text run, :func:`_text_summary`."""
    if source.task is None:
        return _text_summary(config, source, model, last_eval, train_loss, start, trained_seconds, seconds)
    return {
        "task": config.task,
        "n_layers": config.n_layers,
        "n_heads": config.n_heads,
        "d_model": config.d_model,
        "steps": config.steps,
        "accuracy": last_eval["accuracy"],
        "loss": last_eval["loss"],
        "relations": relation_summary(source.task, last_eval),
    }


def _text_summary(
    config: TrainConfig, source: _Source, model: nn.Module, last_eval: dict[str, Any],
    train_loss: float | None, start: int, trained_seconds: float, seconds: float,
) -> dict[str, Any]:  # fmt: skip
    """summary.json of a text run: the held-out loss at the end (nats per token; also in bits and as a
    perplexity), the last logged training loss, and this process's steps, time and tokens/s (a resumed
    run counts the steps it ran itself)."""
    loss = float(last_eval["loss"])
    finite = math.isfinite(loss)
    steps_run = config.steps - start
    tokens = steps_run * config.batch_size * source.seq_len
    return {
        "task": config.task,
        "data": config.data,
        "level": config.level,
        "arch": config.arch,
        "n_layers": config.n_layers,
        "n_heads": config.n_heads,
        "d_model": config.d_model,
        "seq_len": source.seq_len,
        "vocab_size": source.vocab_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps": config.steps,
        "loss": loss,
        "bits_per_token": loss / math.log(2) if finite else None,
        "perplexity": math.exp(loss) if finite and loss < 700 else None,
        "train_loss": train_loss,
        "steps_this_process": steps_run,
        "train_seconds": trained_seconds,
        "tokens_per_s": tokens / trained_seconds if trained_seconds > 0 else None,
        "seconds": seconds,
    }


# --------------------------------------------------------------------------------------------- loading a run
def load_run(run_dir: str | os.PathLike[str], *, device: str = "cpu") -> tuple[nn.Module, dict[str, Any]]:
    """The trained model of a run folder (its latest checkpoint) and the run record (config.json)."""
    run_dir = Path(run_dir)
    ckpt = load_checkpoint(run_dir)
    record = ckpt.config
    try:
        model_config = ModelConfig.from_dict(record["model"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{ckpt.folder / RUN_CONFIG}: no usable model configuration ({e})") from None
    # refuse a configuration implying more parameters than the weights file holds, before building it
    c = model_config
    assert c.d_mlp is not None
    at_least = c.n_layers * 2 * c.d_model * c.d_mlp + (c.vocab_size + c.max_seq_len) * c.d_model
    held = sum(t.numel() for t in ckpt.model_state.values())
    if at_least > held:
        raise CheckpointError(
            f"{ckpt.folder / RUN_CONFIG}: the model configuration implies at least {at_least:,} parameters "
            f"(n_layers={c.n_layers}, d_model={c.d_model}, d_mlp={c.d_mlp}, vocab_size={c.vocab_size}, "
            f"max_seq_len={c.max_seq_len}), but model.safetensors holds {held:,}"
        )
    model = build_model(model_config)
    load_weights_into(model, ckpt)
    return model.to(device).eval(), record


def generate_text(
    run_dir: str | os.PathLike[str],
    prompt: str,
    *,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = None,
    seed: int | None = 0,
    device: str = "cpu",
) -> str:
    """Continue ``prompt`` with the language model trained in ``run_dir`` (KV-cached decoding)."""
    from .data import decode, encode

    model, record = load_run(run_dir, device=device)
    data = record.get("data", {})
    if data.get("name") != "text" or not isinstance(model, Decoder):
        raise ValueError(f"{run_dir} holds a {data.get('name', 'unknown')!r} run, not a text language model")
    if not prompt:
        raise ValueError("prompt must hold at least one character")
    ids = encode(prompt, data["level"], data.get("vocab")).to(device)
    max_len = model.config.max_seq_len
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0; got {max_new_tokens!r}")
    if max_len < 2:
        raise ValueError(f"this model's position table holds {max_len} position; generation needs >= 2")
    # Decode with the KV cache while the text fits the position table; past it, slide: keep the last
    # half window as context and decode the next chunk with a fresh cache.
    out = ids
    remaining = max_new_tokens
    chunk_seed = seed
    while remaining > 0:
        context = out[-max(1, max_len // 2) :] if out.numel() >= max_len else out
        new = min(remaining, max_len - context.numel())
        grown = model.generate(context[None, :], new, temperature=temperature, top_k=top_k, seed=chunk_seed)
        out = torch.cat([out, grown[0, context.numel() :]])  # (n + new,)
        remaining -= new
        chunk_seed = None if chunk_seed is None else chunk_seed + 1
    new_ids = out[ids.numel() :]
    return prompt + decode(new_ids, data["level"], data.get("vocab"))
