"""Training: built-in tasks with ground truth, text data, the loop, checkpoints and heads over training.

    from headspace.train import TrainConfig, train
    result = train(TrainConfig(task="relations"), "runs/relations")
    result.summary["relations"]      # per relation: the head that serves it, its attention and ablation

See :mod:`.loop` (the run folder), :mod:`.tasks` (the ``relations`` task), :mod:`.checkpoint` (the
checkpoint format) and :mod:`.metrics` (per-head measurements). The pictures of a run (``plot-run``) are
in :mod:`headspace.viz.training` (``headspace.train.plots`` is that module, kept as an old path).
"""

from .checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from .data import TextData, load_text
from .loop import RunFolderError, RunResult, TrainConfig, generate_text, learning_rate, load_run, train
from .tasks import Batch, RelationsTask, ReverseTask, batch_generator, make_task

__all__ = [
    "Batch",
    "Checkpoint",
    "CheckpointError",
    "RelationsTask",
    "ReverseTask",
    "RunFolderError",
    "RunResult",
    "TextData",
    "TrainConfig",
    "batch_generator",
    "generate_text",
    "learning_rate",
    "load_checkpoint",
    "load_run",
    "load_text",
    "make_task",
    "save_checkpoint",
    "train",
]
