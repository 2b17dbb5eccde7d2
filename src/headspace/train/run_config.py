"""What decides a training run: :class:`TrainConfig` (checked when made, with per-task defaults), the
parameter count of the model it describes, and the learning-rate schedule.

:mod:`.loop` re-exports these names.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .data import LEVELS
from .tasks import TASKS, make_task

#: The largest model :func:`train` builds, in parameters (checked before anything is allocated). At 16
#: bytes a parameter (float32 weights, gradients and AdamW's two moments) that is 32 GB before activations.
MAX_PARAMETERS = 2_000_000_000

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


def check_model_size(
    config: TrainConfig, vocab_size: int, seq_len: int, max_parameters: int | None = None
) -> None:
    """``ValueError`` when the model of ``config`` would have more than ``max_parameters`` parameters
    (None: :data:`MAX_PARAMETERS`)."""
    cap = MAX_PARAMETERS if max_parameters is None else max_parameters
    n = parameter_count(config, vocab_size, seq_len)
    if n > cap:
        d_mlp = config.d_mlp if config.d_mlp is not None else 4 * (config.d_model or 0)
        raise ValueError(
            f"the model is too large to train: {n:,} parameters (n_layers={config.n_layers}, "
            f"d_model={config.d_model}, d_mlp={d_mlp}, vocab_size={vocab_size}, seq_len={seq_len}), more "
            f"than the cap of {cap:,} (MAX_PARAMETERS; 16 bytes a parameter for float32 weights, "
            f"gradients and AdamW moments: {16 * cap / 1e9:.0f} GB); choose a smaller n_layers, "
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
