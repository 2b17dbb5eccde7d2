"""Checkpoints: safetensors tensors + JSON, sealed by one manifest, written atomically, checked when read.

A checkpoint is a folder::

    RUN_DIR/checkpoints/step-000600/
        config.json          the run's configuration (model and training), JSON
        model.safetensors    the model's weights (state_dict names)
        state.safetensors    optimizer moments (``optimizer.state.<i>.<key>``) and RNG states
                             (``rng.torch``, ``rng.cuda.<i>``, uint8)
        state.json           {"format", "step", "optimizer": {"param_groups", "scalars"}, "extra"}
        manifest.json        the seal: {"format", "step", "files": {name: {"bytes", "sha256"}}} for each of
                             the four files above
    RUN_DIR/checkpoints/latest.json   {"step": 600, "folder": "step-000600"}: the newest complete one

**Sealed.** ``manifest.json`` records the size and SHA-256 of every other file of the folder. On load,
a missing manifest, a file it does not list, a listed file that is missing, and any file whose size or
checksum differs are refused before any content is parsed: an edited ``step`` in ``state.json`` is
caught like a flipped bit in the weights. (The manifest detects damage and edits; it is not a
signature: whoever may write the folder may also rewrite the manifest, which is why the content is
validated as well, below.) Checkpoints of format 1 (before the manifest, with the sizes and checksums
inside the unsealed ``state.json``) are refused.

**Written atomically.** Every file goes to a temporary folder ``.step-NNNNNN.<random>.tmp``, the
manifest last; the folder is renamed into place only when all of it is on disk; then ``latest.json`` is
replaced (temporary file + ``os.replace``). A save that fails half-way (a full disk) removes its
temporary folder and leaves the previous checkpoint and pointer intact; temporary folders left by a
killed process are removed at the next save (and, for a training run, at ``--resume``). Only the newest
``keep_last`` checkpoints are kept, ordered by their step number. Files get the usual modes
(``0o666`` / ``0o777`` filtered by the umask). Nothing is ever pickled or unpickled, nothing goes through
``torch.load``: tensors go through safetensors, everything else is JSON.

**Read defensively.** ``latest.json`` must name a folder ``step-NNNNNN`` of its own step that resolves
inside the same ``checkpoints/`` folder (no ``..``, no absolute path, no symbolic link). Only regular
files are opened (never a symbolic link, a FIFO or a device: checked with ``os.lstat`` before opening),
each within a size cap (:data:`MAX_JSON_BYTES`, :data:`MAX_TENSORS_BYTES`); JSON is read with a depth
limit. Every problem is a :class:`CheckpointError` naming the file, what was expected and what was
found: missing, empty, truncated or altered files, random bytes, a different configuration (the
differing fields are listed), missing or unexpected weight names, wrong shapes or dtypes, NaN/Inf
weights, optimizer state or RNG states that do not fit the model and optimizer they are restored into
(:func:`restore_training_state` checks all of it before it changes anything).

Writing is here (:func:`save_checkpoint`); the format's names and shared checks are in
:mod:`.checkpoint_format`, reading in :mod:`.checkpoint_load`, restoring in :mod:`.checkpoint_restore`,
and every public name is importable from this module.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save
from torch import nn

from ..core.fileio import (
    fsync_dir,
    make_temp_dir,
    parse_json,
    read_regular_file,
    write_atomic,
    write_file_synced,
)
from .checkpoint_format import (
    _OLD_FOLDER,
    _TEMP_FOLDER,
    _TEMP_POINTER,
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    FORMAT,
    LATEST_FILE,
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    MODEL_FILE,
    SEALED_FILES,
    STATE_FILE,
    STATE_TENSORS_FILE,
    Checkpoint,
    CheckpointError,
    _check_json,
    _digest,
    _json_bytes,
    _step_of_folder,
    config_differences,
    flatten_optimizer,
    rng_state,
    set_rng_state,
    step_folder_name,
    unflatten_optimizer,
)
from .checkpoint_format import MAX_JSON_BYTES as MAX_JSON_BYTES  # re-exported: the size caps
from .checkpoint_format import MAX_TENSORS_BYTES as MAX_TENSORS_BYTES
from .checkpoint_load import (
    load_checkpoint,
    resolve_checkpoint,
)
from .checkpoint_restore import (
    load_weights_into,
    restore_training_state,
)

__all__ = [
    "CHECKPOINTS_DIR",
    "CONFIG_FILE",
    "FORMAT",
    "LATEST_FILE",
    "MANIFEST_FILE",
    "MODEL_FILE",
    "SEALED_FILES",
    "STATE_FILE",
    "STATE_TENSORS_FILE",
    "Checkpoint",
    "CheckpointError",
    "config_differences",
    "flatten_optimizer",
    "load_checkpoint",
    "load_weights_into",
    "remove_stale_temporaries",
    "resolve_checkpoint",
    "restore_training_state",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "unflatten_optimizer",
    "write_atomic",
]

# ------------------------------------------------------------------------------------------ writing helpers
# (the checkpoint folder's files go through _write_file, which tests replace to simulate a full disk)
_write_file = write_file_synced
_fsync_dir = fsync_dir


def save_checkpoint(
    run_dir: str | os.PathLike[str],
    step: int,
    *,
    config: Mapping[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra_state: Mapping[str, Any] | None = None,
    keep_last: int = 2,
) -> Path:
    """Write a sealed checkpoint of ``model`` (and ``optimizer``, RNG states, ``extra_state``) at ``step``.

    Returns the checkpoint folder ``run_dir/checkpoints/step-NNNNNN``. Only the newest ``keep_last``
    checkpoints (by step number) are kept; temporary folders left by an earlier, killed save are removed
    first. On any failure (e.g. a full disk) the partial folder is removed, the previous checkpoint stays
    the latest, and a :class:`CheckpointError` says what failed. ``config`` and ``extra_state`` must
    hold plain JSON values, checked before anything is written: another type (a tensor) is a
    ``TypeError``, a NaN/Inf float a ``ValueError``, each naming the field (``config['lr']``).
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int; got {step!r}")
    if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1:
        raise ValueError(f"keep_last must be an int >= 1; got {keep_last!r}")
    _check_json(config, "config")
    if extra_state is not None:
        _check_json(extra_state, "extra_state")
    root = Path(run_dir) / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(run_dir)
    name = step_folder_name(step)
    final = root / name
    tmp = make_temp_dir(root, prefix=f".{name}.", suffix=".tmp")
    try:
        weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
        state_tensors = dict(rng_state())
        state: dict[str, Any] = {"format": FORMAT, "step": step, "extra": dict(extra_state or {})}
        if optimizer is not None:
            opt_tensors, opt_meta = flatten_optimizer(optimizer)
            state_tensors.update(opt_tensors)
            state["optimizer"] = opt_meta
        blobs = {
            CONFIG_FILE: _json_bytes(dict(config)),
            MODEL_FILE: st_save(weights, metadata={"format": FORMAT}),
            STATE_TENSORS_FILE: st_save(state_tensors, metadata={"format": FORMAT}),
            STATE_FILE: _json_bytes(state),
        }
        manifest = {"format": FORMAT, "step": step, "files": {f: _digest(d) for f, d in blobs.items()}}
        blobs[MANIFEST_FILE] = _json_bytes(manifest)  # written last: a folder with a manifest is whole
        for fname, data in blobs.items():
            _write_file(tmp / fname, data)
        _fsync_dir(tmp)
        if os.path.lexists(final):  # re-saving a step (after a resume): move the old one aside first
            old = root / f".{name}.old"
            _remove(old)
            os.replace(final, old)
            os.replace(tmp, final)
            _remove(old)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
        write_atomic(root / LATEST_FILE, _json_bytes({"step": step, "folder": name}))
    except OSError as e:
        _remove(tmp)
        previous = _read_latest_name(root)
        kept = (
            f"the previous checkpoint ({previous}) is intact" if previous else "no earlier checkpoint exists"
        )
        raise CheckpointError(
            f"{final}: could not write the checkpoint for step {step}: {e.strerror or e}; {kept}"
        ) from e
    except BaseException:
        _remove(tmp)
        raise
    _prune(root, keep_last)
    return final


def _remove(path: Path) -> None:
    """Remove a folder tree, a file or a symbolic link (never following the link); missing is fine."""
    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink(missing_ok=True)
        else:
            shutil.rmtree(path, ignore_errors=True)
    except OSError:
        pass


def remove_stale_temporaries(run_dir: str | os.PathLike[str]) -> list[str]:
    """Remove what a killed save left in ``run_dir/checkpoints``; return the names removed or restored.

    A save killed mid-way leaves its temporary folder ``.step-NNNNNN.<random>.tmp`` (never used: the
    previous checkpoint stayed the latest) and perhaps a temporary ``.latest.json.<random>.tmp``; both are
    removed. A save killed while replacing an existing ``step-NNNNNN`` leaves the old copy as
    ``.step-NNNNNN.old``: it is moved back when ``step-NNNNNN`` is missing, removed otherwise. Only one
    process may write a run's checkpoints at a time (the training loop's rank 0), so every such leftover
    is stale when this runs.
    """
    root = Path(run_dir) / CHECKPOINTS_DIR
    done: list[str] = []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return done
    for name in names:
        path = root / name
        if _TEMP_FOLDER.fullmatch(name) or _TEMP_POINTER.fullmatch(name):
            _remove(path)
            done.append(name)
        elif (m := _OLD_FOLDER.fullmatch(name)) is not None:
            final = root / m[1]
            if not os.path.lexists(final) and path.is_dir() and not path.is_symlink():
                try:
                    os.replace(path, final)
                except OSError:  # pragma: no cover - left for the next attempt
                    continue
            else:
                _remove(path)
            done.append(name)
    return done


def _read_latest_name(root: Path) -> str | None:
    try:
        latest = parse_json(read_regular_file(root / LATEST_FILE, max_bytes=MAX_MANIFEST_BYTES))
        return str(latest["folder"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _prune(root: Path, keep_last: int) -> None:
    """Remove all but the newest ``keep_last`` checkpoint folders, newest by step number, never the latest."""
    latest = _read_latest_name(root)
    folders: list[tuple[int, Path]] = []
    for p in root.iterdir():
        step = _step_of_folder(p.name)
        if step is not None and p.is_dir() and not p.is_symlink():
            folders.append((step, p))
    folders.sort()
    for _, p in folders[:-keep_last]:
        if p.name != latest:
            shutil.rmtree(p, ignore_errors=True)
