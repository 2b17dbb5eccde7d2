"""A run folder's own files: the run record (``config.json``) and its checks on ``--out`` / ``--resume``,
``metrics.jsonl`` read back and trimmed, and the resume point's checks.

:mod:`.loop` re-exports these names.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from ..core.fileio import UnsafeFileError, parse_json, read_regular_file, write_atomic
from ..model.models import ModelConfig
from .checkpoint import (
    STATE_FILE,
    STATE_TENSORS_FILE,
    Checkpoint,
    CheckpointError,
    config_differences,
)
from .run_config import TrainConfig

RUN_FORMAT = "headspace-run/1"
RUN_CONFIG = "config.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"

#: Fields of TrainConfig that may change when a run is resumed (they do not change the weights). A text
#: run's data file must hold the same content: its SHA-256 (``data.sha256``) is compared on ``--resume``.
RESUMABLE_CHANGES = ("train.device", "train.save_every", "train.eval_every", "train.log_every", "data.path")
#: Size caps of the run folder's own files read back on ``--resume``.
MAX_RECORD_BYTES = 64 << 20
MAX_METRICS_BYTES = 1 << 30


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
