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
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from torch import Tensor, nn

from ..analysis.trace.trace import attention_layers
from ..core.fileio import UnsafeFileError, parse_json, read_regular_file, write_atomic
from ..core.process_group import DistInfo, barrier, setup_distributed, teardown
from ..distributed.data_parallel import average_across_ranks, check_same_config, local_batch_slice, wrap_model
from ..model.models import Decoder, Encoder, ModelConfig
from .checkpoint import (
    STATE_FILE,
    STATE_TENSORS_FILE,
    Checkpoint,
    CheckpointError,
    config_differences,
    load_checkpoint,
    load_weights_into,
    remove_stale_temporaries,
    restore_training_state,
    save_checkpoint,
)
from .data import LEVELS, TextData, load_text
from .metrics import evaluate, relation_summary, task_loss
from .tasks import (
    DROPOUT_STREAM,
    EVAL_STREAM,
    TASKS,
    TRAIN_STREAM,
    Batch,
    batch_generator,
    make_task,
    step_seed,
)

RUN_FORMAT = "headspace-run/1"
RUN_CONFIG = "config.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"

#: Fields of TrainConfig that may change when a run is resumed (they do not change the weights). A text
#: run's data file must hold the same content: its SHA-256 (``data.sha256``) is compared on ``--resume``.
RESUMABLE_CHANGES = ("train.device", "train.save_every", "train.eval_every", "train.log_every", "data.path")

#: The largest model :func:`train` builds, in parameters (checked before anything is allocated). At 16
#: bytes a parameter (float32 weights, gradients and AdamW's two moments) that is 32 GB before activations.
MAX_PARAMETERS = 2_000_000_000
#: Size caps of the run folder's own files read back on ``--resume``.
MAX_RECORD_BYTES = 64 << 20
MAX_METRICS_BYTES = 1 << 30

# per-task defaults for the fields left as None
_DEFAULTS = {
    "relations": {
        "n_layers": 1,
        "n_heads": 2,
        "d_model": 64,
        "steps": 400,
        "lr": 3e-3,
        "batch_size": 64,
        "eval_every": 25,
        "eval_batch": 512,
    },
    "reverse": {
        "n_layers": 2,
        "n_heads": 2,
        "d_model": 64,
        "steps": 1500,
        "lr": 3e-3,
        "batch_size": 64,
        "eval_every": 100,
        "eval_batch": 512,
    },
    "text": {
        "n_layers": 4,
        "n_heads": 4,
        "d_model": 128,
        "steps": 2000,
        "lr": 1e-3,
        "batch_size": 32,
        "eval_every": 250,
        "eval_batch": 64,
    },
}


@dataclass
class TrainConfig:
    """Everything that decides a training run (stored as JSON in the run folder and its checkpoints).

    Fields left as ``None`` take the task's default (see ``_DEFAULTS``): ``relations`` trains 1 layer x 2
    heads, d_model 64, 400 steps, evaluated every 25; ``text`` 4 layers x 4 heads, d_model 128, 2000
    steps. Out-of-range values raise ``ValueError`` naming the field, and so does a model of more than
    :data:`MAX_PARAMETERS` parameters (see :func:`parameter_count`; a text model's vocabulary is known
    only once its file is read, so :func:`train` checks the count again before building the model).
    """

    #: "relations", "reverse" (built-in synthetic tasks) or "text" (a language model on ``data``).
    task: str = "relations"
    #: UTF-8 text file for task "text".
    data: str | None = None
    #: Text tokens: "char" (characters of the file) or "byte" (UTF-8 bytes).
    level: str = "char"
    #: "decoder" (causal) or "encoder" (bidirectional, with a linear read-out; synthetic tasks only).
    arch: str = "decoder"
    n_layers: int | None = None
    n_heads: int | None = None
    d_model: int | None = None
    #: Feed-forward width; None: 4 * d_model.
    d_mlp: int | None = None
    dropout: float = 0.0
    #: Window length for text (default 128); synthetic tasks fix their own length.
    seq_len: int | None = None
    #: Global batch (split over data-parallel ranks).
    batch_size: int | None = None
    steps: int | None = None
    #: Peak learning rate, reached after ``warmup`` steps, then a cosine decay to ``min_lr_ratio * lr``.
    lr: float | None = None
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.99
    #: Clip the global gradient norm to this value (0: no clipping).
    grad_clip: float = 1.0
    #: Evaluate (and measure every head) before training, every this many steps and at the end.
    eval_every: int | None = None
    #: Evaluation batch size (a fixed held-out batch; 512 sequences for tasks, 64 windows for text, whose
    #: per-head ablations cost one forward pass per head).
    eval_batch: int | None = None
    #: Log the training loss every this many steps.
    log_every: int = 10
    #: Write a checkpoint every this many steps (0: only at the end).
    save_every: int = 0
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.data is not None and self.task != "text":
            raise ValueError(f"data={self.data!r} is given, so task must be 'text'; got task={self.task!r}")
        if self.task not in (*TASKS, "text"):
            raise ValueError(f"task must be one of {[*TASKS, 'text']}; got {self.task!r}")
        if self.task == "text" and self.data is None:
            raise ValueError("task 'text' needs data (a UTF-8 text file, --data FILE)")
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {list(LEVELS)}; got {self.level!r}")
        if self.arch not in ("decoder", "encoder"):
            raise ValueError(f"arch must be 'decoder' or 'encoder'; got {self.arch!r}")
        if self.arch == "encoder" and self.task == "text":
            raise ValueError(
                "arch='encoder' trains only synthetic tasks; a text language model needs 'decoder'"
            )
        for name, value in _DEFAULTS[self.task].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.task == "text" and self.seq_len is None:
            self.seq_len = 128
        if self.task != "text" and self.seq_len is not None:
            raise ValueError(
                f"seq_len is fixed by the task {self.task!r}; leave it unset (got {self.seq_len})"
            )
        for name in ("n_layers", "n_heads", "d_model", "batch_size", "steps", "eval_every", "eval_batch"):
            _positive_int(name, getattr(self, name))
        _positive_int("log_every", self.log_every)
        for name in ("d_mlp", "seq_len"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        for name in ("warmup", "save_every", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0; got {v!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} must be divisible by n_heads={self.n_heads} "
                "(d_head = d_model / n_heads)"
            )
        _in_range("lr", self.lr, 0.0, 10.0, low_open=True)
        _in_range("min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        _in_range("weight_decay", self.weight_decay, 0.0, 10.0)
        _in_range("beta1", self.beta1, 0.0, 1.0, high_open=True)
        _in_range("beta2", self.beta2, 0.0, 1.0, high_open=True)
        _in_range("grad_clip", self.grad_clip, 0.0, 1e6)
        _in_range("dropout", self.dropout, 0.0, 1.0, high_open=True)
        if not isinstance(self.device, str) or self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda'; got {self.device!r}")
        if self.task == "text":  # the vocabulary is the file's: 256 bytes, or at least one character
            assert self.seq_len is not None
            check_model_size(self, 256 if self.level == "byte" else 1, self.seq_len)
        else:
            task = make_task(self.task)
            check_model_size(self, task.vocab_size, task.seq_len)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"TrainConfig: unknown fields {unknown}; known fields: {sorted(known)}")
        return cls(**data)


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1; got {value!r}")


def _in_range(
    name: str, value: Any, low: float, high: float, *, low_open: bool = False, high_open: bool = False
) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise ValueError(f"{name} must be a number in {lo}{low}, {high}{hi}; got {value!r}")


def parameter_count(config: TrainConfig, vocab_size: int, seq_len: int) -> int:
    """The number of parameters of the model :func:`train` builds for ``config``, without building it.

    With d = d_model, m = d_mlp (default 4 d), V = vocab_size, S = seq_len and L = n_layers: token and
    position embeddings V d + S d; per block 4 d^2 + 4 d (W_Q, W_K, W_V, W_O and biases), 2 d m + m + d
    (feed-forward), 4 d (two LayerNorms); the final LayerNorm 2 d; the decoder's unembedding is tied to the
    token embedding, the encoder's read-out adds d V + V.
    """
    d, n_layers = config.d_model, config.n_layers
    assert d is not None and n_layers is not None
    m = config.d_mlp if config.d_mlp is not None else 4 * d
    per_block = (4 * d * d + 4 * d) + (2 * d * m + m + d) + 4 * d
    total = vocab_size * d + seq_len * d + n_layers * per_block + 2 * d
    if config.arch == "encoder":
        total += d * vocab_size + vocab_size
    return total


def check_model_size(config: TrainConfig, vocab_size: int, seq_len: int) -> None:
    """``ValueError`` when the model of ``config`` would have more than :data:`MAX_PARAMETERS` parameters."""
    n = parameter_count(config, vocab_size, seq_len)
    if n > MAX_PARAMETERS:
        d_mlp = config.d_mlp if config.d_mlp is not None else 4 * (config.d_model or 0)
        raise ValueError(
            f"the model is too large to train: {n:,} parameters (n_layers={config.n_layers}, "
            f"d_model={config.d_model}, d_mlp={d_mlp}, vocab_size={vocab_size}, seq_len={seq_len}), more "
            f"than the cap of {MAX_PARAMETERS:,} (MAX_PARAMETERS; 16 bytes a parameter for float32 weights, "
            f"gradients and AdamW moments: {16 * MAX_PARAMETERS / 1e9:.0f} GB); choose a smaller n_layers, "
            "d_model or d_mlp"
        )


def learning_rate(config: TrainConfig, step: int) -> float:
    """Linear warm-up to ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr_ratio * lr``."""
    peak, floor = config.lr, config.lr * config.min_lr_ratio
    if step < config.warmup:
        return peak * (step + 1) / config.warmup
    span = max(1, config.steps - config.warmup)
    progress = min(1.0, (step - config.warmup) / span)
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


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
@dataclass
class RunResult:
    """What :func:`train` returns: the run folder, the final step, the last evaluation and the summary
    (what ``summary.json`` holds; None on ranks other than 0, which write nothing)."""

    run_dir: Path
    step: int
    model: nn.Module
    final_eval: dict[str, Any]
    summary: dict[str, Any] | None


class RunFolderError(ValueError):
    """The output folder cannot take this run (it holds another run, or nothing to resume)."""


def run_record(config: TrainConfig, model_config: ModelConfig, data: dict[str, Any]) -> dict[str, Any]:
    return {"format": RUN_FORMAT, "train": config.to_dict(), "model": model_config.to_dict(), "data": data}


def with_current_defaults(saved: dict[str, Any]) -> dict[str, Any]:
    """A stored run record with the model fields added since it was written filled in by their defaults.

    A field added to :class:`~headspace.ModelConfig` with a default that keeps the old behaviour (such
    as ``pruned_heads``) is absent from older run folders; read through ``ModelConfig`` they compare
    equal to a new request, so ``--resume`` keeps working. A record that does not parse is returned as
    it is, and the comparison names its fields.
    """
    model = saved.get("model") if isinstance(saved, dict) else None
    if not isinstance(model, dict):
        return saved
    try:
        return {**saved, "model": ModelConfig.from_dict(dict(model)).to_dict()}
    except (TypeError, ValueError):
        return saved


def normalizer_for(record: dict[str, Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """How a stored run record is read before it is compared with ``record`` (a new request).

    :func:`with_current_defaults`, and a text run's ``data.sha256`` (the checksum of the data file's
    content, recorded since it was added) taken from ``record`` when the stored record predates it, so
    such a run folder stays resumable (its vocabulary and token counts are still compared).
    """

    def normalize(saved: dict[str, Any]) -> dict[str, Any]:
        out = with_current_defaults(saved)
        data, wanted = out.get("data") if isinstance(out, dict) else None, record.get("data")
        if (
            isinstance(data, dict)
            and isinstance(wanted, dict)
            and "sha256" not in data
            and "sha256" in wanted
        ):
            out = {**out, "data": {**data, "sha256": wanted["sha256"]}}
        return out

    return normalize


def _read_record(path: Path) -> Any:
    """A JSON file of the run folder: a regular file within its size cap, nested at most 32 levels."""
    return parse_json(read_regular_file(path, max_bytes=MAX_RECORD_BYTES))


def _check_same_data(out: Path, saved: Any, record: dict[str, Any]) -> None:
    """A text run resumes only on the data it was trained on: the SHA-256 of the file's content."""
    before = saved.get("data") if isinstance(saved, dict) else None
    now = record.get("data")
    if not (isinstance(before, dict) and isinstance(now, dict)):
        return
    if "sha256" in before and "sha256" in now and before["sha256"] != now["sha256"]:
        raise RunFolderError(
            f"--resume: the data file {now.get('path')} is not the one this run was trained on: the "
            f"SHA-256 of its content is {now['sha256']}, {out / RUN_CONFIG} records {before['sha256']} "
            f"(for {before.get('path')}); resume with the same data or start a new run"
        )


def _check_run_dir(out: Path, record: dict[str, Any], resume: bool) -> None:
    cfg = out / RUN_CONFIG
    if resume:
        if not os.path.lexists(cfg):
            raise RunFolderError(
                f"--resume: {out} holds no run (no {RUN_CONFIG}); start one without --resume"
            )
        try:
            saved = _read_record(cfg)
        except UnsafeFileError as e:
            raise RunFolderError(f"--resume: {e}") from None
        except (OSError, ValueError) as e:
            raise RunFolderError(f"--resume: {cfg} is unreadable ({e})") from None
        _check_same_data(out, saved, record)
        diffs = [
            d
            for d in config_differences(normalizer_for(record)(saved), record)
            if not any(d.startswith(f"{f}:") or d.startswith(f"{f}.") for f in RESUMABLE_CHANGES)
        ]
        if diffs:
            raise RunFolderError(
                f"--resume: {out} holds a run with another configuration; differing fields: "
                + "; ".join(diffs)
            )
        return
    if out.exists() and not out.is_dir():
        raise RunFolderError(f"--out {out} is a file, not a folder")
    if os.path.lexists(cfg):
        try:
            saved = _read_record(cfg)
            what = f"task {saved['train']['task']!r}, {saved['train']['steps']} steps"
        except (OSError, ValueError, KeyError, TypeError):
            what = "unreadable config"
        raise RunFolderError(
            f"--out {out} already holds another run ({what}); pass --resume to continue it "
            "(in Python: train(..., resume=True)) or choose a new folder"
        )
    if out.exists() and any(out.iterdir()):
        raise RunFolderError(f"--out {out} is not empty and holds no run; choose a new or empty folder")


def _read_metrics(path: Path) -> str | None:
    """The metrics file's text (None when there is none yet), read as a bounded regular file."""
    try:
        raw = read_regular_file(path, max_bytes=MAX_METRICS_BYTES)
    except FileNotFoundError:
        return None
    except UnsafeFileError as e:
        raise RunFolderError(f"--resume: {e}") from None
    except OSError as e:
        raise RunFolderError(f"--resume: {path} is unreadable ({e.strerror or e})") from None
    return raw.decode("utf-8", errors="replace")  # a line cut by a kill may end mid-character


def _trim_metrics(path: Path, text: str | None, step: int) -> None:
    """Keep the metrics lines up to ``step`` (a resumed run rewrites what came after its checkpoint)."""
    if text is None:
        return
    kept = []
    for line in text.splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError, RecursionError):
            continue  # a line cut short by a kill
    write_atomic(path, "".join(k + "\n" for k in kept))


def _check_resume_point(ckpt: Checkpoint, config: TrainConfig) -> None:
    """The checkpoint's step within the run, and the optimizer's step counts equal to it."""
    assert config.steps is not None
    if ckpt.step > config.steps:
        raise CheckpointError(
            f"{ckpt.folder / STATE_FILE}: step {ckpt.step} is past the run's last step ({config.steps})"
        )
    for name, t in sorted(ckpt.state_tensors.items()):
        if name.startswith("optimizer.state.") and name.endswith(".step") and t.numel() == 1:
            counted = float(t)
            if counted != ckpt.step:
                raise CheckpointError(
                    f"{ckpt.folder / STATE_TENSORS_FILE}: {name} counts {counted:g} optimizer steps, but "
                    f"the checkpoint is at step {ckpt.step}"
                )


def _optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices (>= 2-D), none on biases and LayerNorm gains (as nanoGPT)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), foreach=False)


# --------------------------------------------------------------------------------------------- progress
class _Progress:
    """What a run is doing, on stderr (rank 0, ``progress=True``): status lines, then the training bar
    (:func:`headspace.progress.progress_bar`: redrawn in a terminal or a notebook, a plain line every few
    seconds with steps, rate and ETA where stderr is a log file or a pipe).

    Status lines say what happens before the first step (reading and encoding the data, building the
    model, the first evaluation, with a bar over its forward passes). The training bar starts after the
    first step this process runs, which carries one-time costs (allocations, the optimizer's state) and
    is not timed, so its first rate and ETA are those of ordinary steps; the time of an evaluation or a
    checkpoint does not count as step time either (the bar's description shows an evaluation's passes).
    """

    def __init__(self, enabled: bool, desc: str, total: int) -> None:
        self.enabled, self.desc, self.total = enabled, desc, total
        self.bar: Any = None
        self._eval_bar: Any = None
        self._last_refresh = 0.0

    def say(self, message: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)

    def start_bar(self, initial: int) -> None:
        """The training bar from step ``initial`` on (timed from now)."""
        if not self.enabled or self.bar is not None:
            return
        from ..core.progress import progress_bar

        self.bar = progress_bar(
            total=self.total,
            initial=initial,
            desc=self.desc,
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
        )

    def step(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def postfix(self, **values: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix(**values, refresh=False)

    def eval_progress(self, step: int) -> Callable[[int, int], None] | None:
        """``on_progress`` for :func:`~.metrics.evaluate`: its passes on the bar (or a bar of its own)."""
        if not self.enabled:
            return None

        def on_progress(done: int, total: int) -> None:
            now = time.perf_counter()
            if self.bar is None:
                if self._eval_bar is None:
                    from ..core.progress import progress_bar

                    self._eval_bar = progress_bar(
                        total=total, desc=f"eval step {step}", unit="pass", leave=False, file=sys.stderr
                    )
                self._eval_bar.update(done - self._eval_bar.n)
            elif done == total:
                self.bar.set_description_str(self.desc, refresh=False)
            elif now - self._last_refresh >= 0.25:
                self._last_refresh = now
                self.bar.set_description_str(f"{self.desc} [eval step {step}: pass {done}/{total}]")

        return on_progress

    def end_eval(self) -> None:
        if self._eval_bar is not None:
            self._eval_bar.close()
            self._eval_bar = None

    def untimed(self, seconds: float) -> None:
        """Leave ``seconds`` just spent (an evaluation, a checkpoint) out of the bar's step rate.

        The bar's elapsed time still counts them; its rate (and so its ETA) is that of training steps.
        """
        from ..core.progress import PlainProgress

        if isinstance(self.bar, PlainProgress):
            self.bar.exclude(seconds)
        elif self.bar is not None:
            self.bar.last_print_t += seconds

    def close(self) -> None:
        if self._eval_bar is not None:
            self._eval_bar.close()
            self._eval_bar = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _describe_eval(source: _Source, batch: Batch, model: nn.Module) -> str:
    rows = batch.tokens.shape[0]
    what = "windows" if source.text is not None else "sequences"
    n_heads = sum(m.n_heads for _, m in attention_layers(model))
    return f"{rows} held-out {what} (loss, attention patterns, {n_heads} head ablations)"


def _eval_line(step: int, result: dict[str, Any], seconds: float) -> str:
    acc = result.get("accuracy")
    extra = "" if acc is None else f", accuracy {acc:.3f}"
    return f"step {step}: eval loss {result['loss']:.4f}{extra} ({seconds:.1f} s)"


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
    check_model_size(config, source.vocab_size, source.seq_len)  # before anything is allocated
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
