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
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor, nn

from ..core.checks import nonfinite_count
from ..core.fileio import (
    UnsafeFileError,
    file_kind,
    fsync_dir,
    make_temp_dir,
    parse_json,
    read_regular_file,
    write_atomic,
    write_file_synced,
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

FORMAT = "headspace-checkpoint/2"
CONFIG_FILE = "config.json"
MODEL_FILE = "model.safetensors"
STATE_TENSORS_FILE = "state.safetensors"
STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest.json"
CHECKPOINTS_DIR = "checkpoints"
#: The files a checkpoint folder holds besides the manifest, each sealed by it.
SEALED_FILES = (CONFIG_FILE, MODEL_FILE, STATE_TENSORS_FILE, STATE_FILE)

#: Size caps of the files read back: JSON files (config, state), the manifest and pointer, tensor files.
MAX_JSON_BYTES = 64 << 20
MAX_MANIFEST_BYTES = 1 << 20
#: 64 GiB: the AdamW moments of the largest model training accepts (2e9 float32 parameters) are 16 GB.
MAX_TENSORS_BYTES = 64 << 30

_STEP_FOLDER = re.compile(r"step-(\d{6,})")
_TEMP_FOLDER = re.compile(r"\.step-\d{6,}\.[0-9a-z_]+\.tmp")
_OLD_FOLDER = re.compile(r"\.(step-\d{6,})\.old")
_TEMP_POINTER = re.compile(re.escape(f".{LATEST_FILE}.") + r"[0-9a-z_]+\.tmp")
_OPT_TENSOR = re.compile(r"optimizer\.state\.(0|[1-9][0-9]*)\.([A-Za-z_][A-Za-z0-9_]*)")
_CUDA_RNG = re.compile(r"rng\.cuda\.(0|[1-9][0-9]*)")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (or written): the message names the file and the problem."""


# ------------------------------------------------------------------------------------------ writing helpers
# (the checkpoint folder's files go through _write_file, which tests replace to simulate a full disk)
_write_file = write_file_synced
_fsync_dir = fsync_dir


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n").encode("utf-8")


def _json_problem(value: Any, path: str) -> tuple[type[Exception], str] | None:
    """Where ``value`` stops being JSON that ``json.dumps(allow_nan=False)`` writes, or None.

    Returns (the exception type to raise, ``"config['a'][0] is a Tensor"``): TypeError for a value of
    another type, ValueError for a NaN/Inf float.
    """
    if value is None or isinstance(value, (str, bool, int)):
        return None
    if isinstance(value, float):
        if math.isfinite(value):
            return None
        return ValueError, f"{path} is {value!r}, which JSON cannot hold"
    if isinstance(value, dict):
        for key, item in value.items():
            if key is not None and not isinstance(key, (str, int, float, bool)):
                return TypeError, f"{path} has the key {key!r} of type {type(key).__name__}"
            found = _json_problem(item, f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = _json_problem(item, f"{path}[{i}]")
            if found:
                return found
        return None
    return TypeError, f"{path} is a {type(value).__name__}"


def _check_json(value: Any, name: str) -> None:
    """``value`` (the argument ``name``) must be a mapping of JSON values; the error names the field."""
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict of JSON values; got {type(value).__name__}")
    found = _json_problem(dict(value), name)
    if found:
        kind, problem = found
        raise kind(
            f"{name} must hold only JSON values (dict, list, str, int, finite float, bool, None) to be "
            f"stored in {CONFIG_FILE if name == 'config' else STATE_FILE}; {problem}"
        )


def _digest(data: bytes) -> dict[str, Any]:
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def step_folder_name(step: int) -> str:
    """The folder name of the checkpoint at ``step``: ``step-000600`` (at least six digits)."""
    return f"step-{step:06d}"


def _step_of_folder(name: str) -> int | None:
    """The step a folder name ``step-NNNNNN`` stands for (None for any other name, or a non-canonical one)."""
    m = _STEP_FOLDER.fullmatch(name)
    if m is None:
        return None
    step = int(m[1])
    return step if step_folder_name(step) == name else None


# ------------------------------------------------------------------------------------------ optimizer state
def flatten_optimizer(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """An optimizer's state_dict as (tensors, JSON): ``optimizer.state.<param>.<key>`` tensors, the rest JSON.

    Non-tensor per-parameter values and the param groups (learning rate, betas, ...) go to JSON.
    """
    sd = optimizer.state_dict()
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, Tensor):
                tensors[f"optimizer.state.{idx}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(idx), {})[key] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def unflatten_optimizer(tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`flatten_optimizer`: a state_dict for ``optimizer.load_state_dict``.

    Tensor names other than ``optimizer.state.<i>.<key>`` are skipped. (It checks nothing else:
    :func:`restore_training_state` validates a checkpoint's optimizer state against the optimizer.)
    """
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        m = _OPT_TENSOR.fullmatch(name)
        if m is not None:
            state.setdefault(int(m[1]), {})[m[2]] = value
    for idx, values in meta.get("scalars", {}).items():
        state.setdefault(int(idx), {}).update(values)
    groups = []
    for g in meta["param_groups"]:
        g = dict(g)
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    return {"state": state, "param_groups": groups}


# ------------------------------------------------------------------------------------------ RNG state
def rng_state() -> dict[str, Tensor]:
    """torch's CPU (and CUDA) generator states as uint8 tensors."""
    states = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            states[f"rng.cuda.{i}"] = s
    return states


def _cuda_rng_names(tensors: Mapping[str, Tensor]) -> list[str]:
    """The ``rng.cuda.<i>`` names in device order (by the number, not as text: 2 before 10)."""
    found = [(int(m[1]), name) for name in tensors if (m := _CUDA_RNG.fullmatch(name))]
    return [name for _, name in sorted(found)]


def set_rng_state(tensors: Mapping[str, Tensor]) -> None:
    """Restore what :func:`rng_state` saved (CUDA states only where CUDA is in use)."""
    if "rng.torch" in tensors:
        torch.set_rng_state(tensors["rng.torch"].to(torch.uint8))
    cuda = [tensors[k] for k in _cuda_rng_names(tensors)]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.to(torch.uint8) for s in cuda[: torch.cuda.device_count()]])


# ------------------------------------------------------------------------------------------ config comparison
def config_differences(saved: Any, requested: Any, prefix: str = "") -> list[str]:
    """Field-by-field differences between two JSON configurations, one readable line each."""
    if isinstance(saved, dict) and isinstance(requested, dict):
        out: list[str] = []
        for key in sorted(set(saved) | set(requested)):
            name = f"{prefix}{key}"
            if key not in saved:
                out.append(f"{name}: absent in the checkpoint, requested {requested[key]!r}")
            elif key not in requested:
                out.append(f"{name}: checkpoint has {saved[key]!r}, absent in the request")
            else:
                out.extend(config_differences(saved[key], requested[key], f"{name}."))
        return out
    if saved != requested:
        return [f"{prefix.rstrip('.')}: checkpoint has {saved!r}, requested {requested!r}"]
    return []


# ------------------------------------------------------------------------------------------ the checkpoint
@dataclass
class Checkpoint:
    """A checkpoint read back: everything is plain tensors and JSON values.

    Attributes:
        folder: where it was read from.
        step: the number of optimizer steps taken when it was written.
        config: the run configuration (JSON), as stored in ``config.json``.
        model_state: the weights by state_dict name.
        state_tensors: optimizer moments (``optimizer.state.<i>.<key>``) and RNG states (``rng.*``).
        state: the JSON side of the training state (optimizer groups, extra metadata).
    """

    folder: Path
    step: int
    config: dict[str, Any]
    model_state: dict[str, Tensor]
    state_tensors: dict[str, Tensor] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)

    def rng_tensors(self) -> dict[str, Tensor]:
        return {k: v for k, v in self.state_tensors.items() if k.startswith("rng.")}


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


# ------------------------------------------------------------------------------------------ reading
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read_file(path: Path, max_bytes: int) -> bytes:
    """A regular file's bytes (never through a symbolic link), at most ``max_bytes``; CheckpointError else."""
    try:
        return read_regular_file(path, max_bytes=max_bytes, follow_symlinks=False)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except UnsafeFileError as e:
        raise CheckpointError(str(e)) from None
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable ({e.strerror or e})") from None


def _json_object(path: Path, data: bytes) -> dict[str, Any]:
    try:
        obj = parse_json(data)
    except ValueError as e:
        raise CheckpointError(f"{path}: not valid JSON, truncated or corrupted ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a JSON object; got {type(obj).__name__}")
    return obj


def _checkpoints_root(run_or_root: Path) -> Path:
    sub = run_or_root / CHECKPOINTS_DIR
    if sub.is_symlink():
        raise CheckpointError(
            f"{sub}: a symbolic link (to {os.readlink(sub)}); a run's checkpoints must be a folder inside "
            "the run folder"
        )
    return sub if sub.is_dir() else run_or_root


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """A checkpoint folder from a run folder (its latest checkpoint) or a checkpoint folder itself.

    The pointer ``latest.json`` must name, by its step, a folder ``step-NNNNNN`` that is a real folder
    (not a symbolic link) of the same ``checkpoints/`` folder, and must resolve there: a pointer to
    ``../../other_run/...``, to an absolute path or through a symbolic link raises
    :class:`CheckpointError`.
    """
    p = Path(path)
    if not os.path.lexists(p):
        raise CheckpointError(f"{p}: no such file or folder")
    if any(os.path.lexists(p / name) for name in (MANIFEST_FILE, STATE_FILE, MODEL_FILE)):
        return p
    root = _checkpoints_root(p)
    pointer = root / LATEST_FILE
    if not os.path.lexists(pointer):
        raise CheckpointError(
            f"{p}: holds no checkpoint (no {CHECKPOINTS_DIR}/{LATEST_FILE} and no {MANIFEST_FILE})"
        )
    latest = _json_object(pointer, _read_file(pointer, MAX_MANIFEST_BYTES))
    name, step = latest.get("folder"), latest.get("step")
    if not isinstance(name, str) or _step_of_folder(name) is None:
        raise CheckpointError(
            f"{pointer}: 'folder' must name a checkpoint folder step-NNNNNN inside {root}; got {name!r}"
        )
    if not _is_int(step) or step_folder_name(step) != name:
        raise CheckpointError(
            f"{pointer}: 'step' is {step!r}, but 'folder' is {name!r} (step {_step_of_folder(name)})"
        )
    folder = root / name
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        raise CheckpointError(f"{pointer}: points to {name}, which does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise CheckpointError(
            f"{pointer}: points to {name}, a symbolic link (to {os.readlink(folder)}); a checkpoint must be "
            f"a folder inside {root}"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"{pointer}: points to {name}, which is {file_kind(st.st_mode)}, not a folder")
    resolved, inside = folder.resolve(), root.resolve()
    if resolved.parent != inside:
        raise CheckpointError(f"{pointer}: points to {name}, which resolves to {resolved}, outside {inside}")
    return folder


def _read_manifest(folder: Path) -> tuple[int, dict[str, dict[str, Any]]]:
    """The step and the ``files`` table of ``folder/manifest.json``, every field checked."""
    path = folder / MANIFEST_FILE
    if not os.path.lexists(path):
        raise CheckpointError(
            f"{path}: missing: a checkpoint is sealed by the sizes and SHA-256 of its files in "
            f"{MANIFEST_FILE}; this folder is incomplete, or was written before {FORMAT} (format 1 "
            "checkpoints are not accepted)"
        )
    manifest = _json_object(path, _read_file(path, MAX_MANIFEST_BYTES))
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: not a headspace checkpoint manifest (format {manifest.get('format')!r}, expected "
            f"{FORMAT!r})"
        )
    step = manifest.get("step")
    if not _is_int(step) or step < 0:
        raise CheckpointError(f"{path}: 'step' must be an int >= 0; got {step!r}")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"{path}: 'files' must be a table of sizes and checksums; got {files!r:.80}")
    missing = [n for n in SEALED_FILES if n not in files]
    unexpected = sorted(set(files) - set(SEALED_FILES))
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: must seal exactly {list(SEALED_FILES)}; "
            + "; ".join(
                ([f"{missing} not sealed"] if missing else [])
                + ([f"unknown {unexpected}"] if unexpected else [])
            )
        )
    caps = {MODEL_FILE: MAX_TENSORS_BYTES, STATE_TENSORS_FILE: MAX_TENSORS_BYTES}
    for name, record in files.items():
        cap = caps.get(name, MAX_JSON_BYTES)
        if (
            not isinstance(record, dict)
            or set(record) != {"bytes", "sha256"}
            or not _is_int(record["bytes"])
            or not 0 < record["bytes"] <= cap
            or not isinstance(record["sha256"], str)
            or not _SHA256.fullmatch(record["sha256"])
        ):
            raise CheckpointError(
                f"{path}: the record of {name} must be {{'bytes': an int in [1, {cap}], 'sha256': 64 "
                f"lowercase hex digits}}; got {record!r:.120}"
            )
    return step, files


def _read_sealed(path: Path, record: Mapping[str, Any]) -> bytes:
    """A sealed file's bytes, its size and SHA-256 checked against its record in the manifest."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (it is sealed in {MANIFEST_FILE})") from None
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        target = f" (to {os.readlink(path)})" if stat.S_ISLNK(st.st_mode) else ""
        raise CheckpointError(f"{path}: {file_kind(st.st_mode)}{target}, not a regular file")
    want = record["bytes"]
    if st.st_size == 0:
        raise CheckpointError(f"{path}: empty file (0 bytes); {MANIFEST_FILE} records {want}")
    if st.st_size != want:
        # a size alone does not tell a cut file from an edited one (a shorter step number in state.json)
        what = "shorter" if st.st_size < want else "longer"
        raise CheckpointError(
            f"{path}: does not match its seal: {st.st_size} bytes, {MANIFEST_FILE} records {want} ({what} "
            "than when it was saved: edited, truncated or damaged since)"
        )
    data = _read_file(path, want)
    if len(data) != want:
        raise CheckpointError(
            f"{path}: changed while being read: {len(data)} bytes, {MANIFEST_FILE} records {want}"
        )
    if hashlib.sha256(data).hexdigest() != record["sha256"]:
        raise CheckpointError(
            f"{path}: corrupted: its SHA-256 does not match the one recorded in {MANIFEST_FILE}"
        )
    return data


def _nonfinite(t: Tensor) -> int:
    """NaN/Inf entries of a floating-point tensor (0 for other dtypes), for any dtype safetensors holds."""
    if not t.is_floating_point():
        return 0
    try:
        return nonfinite_count(t)
    except (NotImplementedError, RuntimeError):  # isfinite is missing for some float8 formats
        return nonfinite_count(t.float())


def _load_tensors(path: Path, data: bytes) -> dict[str, Tensor]:
    try:
        return st_load(data)
    except (SafetensorError, ValueError, RuntimeError, OverflowError, TypeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def _check_state(path: Path, state: dict[str, Any], step: int) -> None:
    """The JSON side of the training state: known fields of the right types, the manifest's step."""
    unexpected = sorted(set(state) - {"format", "step", "extra", "optimizer"})
    if unexpected:
        raise CheckpointError(
            f"{path}: unexpected fields {unexpected} (expected format, step, extra, optimizer)"
        )
    if state.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: not a headspace checkpoint (format {state.get('format')!r}, expected {FORMAT!r})"
        )
    if state.get("step") != step or not _is_int(state.get("step")):
        raise CheckpointError(f"{path}: 'step' is {state.get('step')!r}; {MANIFEST_FILE} seals step {step}")
    if not isinstance(state.get("extra", {}), dict):
        raise CheckpointError(f"{path}: 'extra' must be a JSON object; got {type(state['extra']).__name__}")
    if "optimizer" in state:
        opt = state["optimizer"]
        if (
            not isinstance(opt, dict)
            or set(opt) != {"param_groups", "scalars"}
            or not isinstance(opt["param_groups"], list)
            or not all(isinstance(g, dict) for g in opt["param_groups"])
            or not isinstance(opt["scalars"], dict)
            or not all(isinstance(v, dict) for v in opt["scalars"].values())
        ):
            raise CheckpointError(
                f"{path}: 'optimizer' must be {{'param_groups': [objects], 'scalars': {{index: object}}}}; "
                f"got {opt!r:.120}"
            )


def _check_tensor_names(path: Path, tensors: Mapping[str, Tensor], has_optimizer: bool) -> None:
    for name in sorted(tensors):
        if name == "rng.torch" or _CUDA_RNG.fullmatch(name):
            continue
        if _OPT_TENSOR.fullmatch(name):
            if not has_optimizer:
                raise CheckpointError(f"{path}: holds {name!r}, but {STATE_FILE} records no optimizer")
            continue
        raise CheckpointError(
            f"{path}: unexpected tensor {name!r} "
            "(expected rng.torch, rng.cuda.<i>, optimizer.state.<i>.<key>)"
        )


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    expected_config: Mapping[str, Any] | None = None,
    allow_differ: tuple[str, ...] = (),
    normalize_config: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Checkpoint:
    """Read and check a checkpoint (a checkpoint folder, or a run folder for its latest one).

    First the seal: the folder must hold exactly the manifest and the files it lists, each a regular
    file of the recorded size and SHA-256. Then the content: ``state.json`` (its step the manifest's),
    ``config.json`` (compared with ``expected_config`` field by field when given: fields named in
    ``allow_differ``, dotted, may differ, any other difference raises :class:`CheckpointError` listing
    them; ``normalize_config`` is applied to the stored configuration first, so that fields added since
    the checkpoint was written read as their defaults), the tensor names, NaN/Inf weights. Whether the
    tensors fit a model and optimizer is checked by :func:`load_weights_into` and
    :func:`restore_training_state`.
    """
    folder = resolve_checkpoint(path)
    step, files = _read_manifest(folder)
    try:
        present = sorted(os.listdir(folder))
    except OSError as e:
        raise CheckpointError(f"{folder}: unreadable ({e.strerror or e})") from None
    for name in present:
        if name != MANIFEST_FILE and name not in files:
            raise CheckpointError(
                f"{folder / name}: not sealed in {MANIFEST_FILE} (a checkpoint folder holds exactly "
                f"{[*SEALED_FILES, MANIFEST_FILE]}); refusing a folder changed after it was written"
            )
    named = _step_of_folder(folder.name)
    if named is not None and named != step:
        raise CheckpointError(f"{folder / MANIFEST_FILE}: seals step {step}, but the folder is {folder.name}")
    blobs = {name: _read_sealed(folder / name, files[name]) for name in SEALED_FILES}

    state_path = folder / STATE_FILE
    state = _json_object(state_path, blobs[STATE_FILE])
    _check_state(state_path, state, step)

    config_path = folder / CONFIG_FILE
    config = _json_object(config_path, blobs[CONFIG_FILE])
    if expected_config is not None:
        diffs = [
            d
            for d in config_differences(
                config if normalize_config is None else normalize_config(config), dict(expected_config)
            )
            if not any(d.startswith(f"{f}:") or d.startswith(f"{f}.") for f in allow_differ)
        ]
        if diffs:
            raise CheckpointError(
                f"{config_path}: the checkpoint was written with another configuration; differing fields: "
                + "; ".join(diffs)
            )

    model_path = folder / MODEL_FILE
    model_state = _load_tensors(model_path, blobs[MODEL_FILE])
    for name, t in model_state.items():
        bad = _nonfinite(t)
        if bad:
            raise CheckpointError(f"{model_path}: weight {name!r} has {bad} NaN/Inf values of {t.numel()}")

    tpath = folder / STATE_TENSORS_FILE
    state_tensors = _load_tensors(tpath, blobs[STATE_TENSORS_FILE])
    _check_tensor_names(tpath, state_tensors, "optimizer" in state)
    return Checkpoint(folder, step, config, model_state, state_tensors, state)


# ------------------------------------------------------------------------------------------ restoring
def _weight_problems(model: nn.Module, checkpoint: Checkpoint) -> list[str]:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(checkpoint.model_state))
    unexpected = sorted(set(checkpoint.model_state) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing weights {missing}")
    if unexpected:
        problems.append(f"unexpected weights {unexpected}")
    for name in sorted(set(expected) & set(checkpoint.model_state)):
        want, got = expected[name], checkpoint.model_state[name]
        if tuple(want.shape) != tuple(got.shape):
            problems.append(f"{name!r} has shape {list(got.shape)}, the model expects {list(want.shape)}")
        elif want.dtype != got.dtype:
            problems.append(f"{name!r} has dtype {got.dtype}, the model expects {want.dtype}")
    return problems


def load_weights_into(model: nn.Module, checkpoint: Checkpoint) -> None:
    """Copy the checkpoint's weights into ``model``: names, shapes and dtypes must match exactly.

    Missing or unexpected names, wrong shapes and dtypes raise :class:`CheckpointError` listing them
    (nothing is copied then).
    """
    problems = _weight_problems(model, checkpoint)
    if problems:
        raise CheckpointError(
            f"{checkpoint.folder / MODEL_FILE}: does not fit the model: " + "; ".join(problems)
        )
    model.load_state_dict(checkpoint.model_state, strict=True)


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_group(where: str, g: int, saved: dict[str, Any], live: dict[str, Any]) -> None:
    """One saved param group against the live optimizer's: the same keys, params and flags, sane numbers."""
    name = f"{where}: optimizer param_groups[{g}]"
    if set(saved) != set(live):
        missing, unexpected = sorted(set(live) - set(saved)), sorted(set(saved) - set(live))
        raise CheckpointError(f"{name} has the wrong fields: missing {missing}, unexpected {unexpected}")
    if saved["params"] != live["params"] or not all(_is_int(i) for i in saved["params"]):
        raise CheckpointError(
            f"{name}['params'] is {saved['params']!r:.120}; the optimizer has {live['params']}"
        )
    for key, want in live.items():
        got = saved[key]
        if key == "params":
            continue
        if want is None or isinstance(want, (bool, str)):
            ok = type(got) is type(want) and got == want  # implementation flags: as the optimizer has them
            expected = repr(want)
        elif isinstance(want, (int, float)):
            ok = _finite_number(got) and got >= 0
            expected = "a finite number >= 0"
        elif isinstance(want, (list, tuple)) and all(_finite_number(v) for v in want):
            ok = (
                isinstance(got, list)
                and len(got) == len(want)
                and all(_finite_number(v) and (0 <= v < 1 if key == "betas" else True) for v in got)
            )
            expected = f"a list of {len(want)} finite numbers" + (" in [0, 1)" if key == "betas" else "")
        else:
            ok, expected = False, f"a value JSON can hold (the optimizer has a {type(want).__name__})"
        if not ok:
            raise CheckpointError(f"{name}[{key!r}] is {got!r:.80}; expected {expected}")


def _checked_optimizer_state(checkpoint: Checkpoint, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The checkpoint's optimizer state_dict, checked field by field and tensor by tensor."""
    where = checkpoint.folder / STATE_FILE
    twhere = checkpoint.folder / STATE_TENSORS_FILE
    meta = checkpoint.state.get("optimizer")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where}: holds no optimizer state")
    live = optimizer.state_dict()
    groups = meta["param_groups"]
    if len(groups) != len(live["param_groups"]):
        raise CheckpointError(
            f"{where}: optimizer state for {len(groups)} param groups, the optimizer has "
            f"{len(live['param_groups'])}"
        )
    params: dict[int, Tensor] = {}
    amsgrad: dict[int, bool] = {}
    for g, (saved, live_group, group) in enumerate(zip(groups, live["param_groups"], optimizer.param_groups)):
        _check_group(str(where), g, saved, live_group)
        for idx, p in zip(live_group["params"], group["params"]):
            params[idx] = p
            amsgrad[idx] = bool(group.get("amsgrad", False))
    state: dict[int, dict[str, Any]] = {}
    for name, t in checkpoint.state_tensors.items():
        m = _OPT_TENSOR.fullmatch(name)
        if m is None:
            continue
        idx = int(m[1])
        if idx not in params:
            raise CheckpointError(
                f"{twhere}: {name!r} is for parameter {idx}; the optimizer has {len(params)}"
            )
        state.setdefault(idx, {})[m[2]] = t
    for key, values in meta["scalars"].items():
        if not (isinstance(key, str) and key.isdecimal() and int(key) in params):
            raise CheckpointError(
                f"{where}: optimizer scalars for parameter {key!r}; the optimizer has {len(params)}"
            )
        for k, v in values.items():
            if not (isinstance(v, bool) or _finite_number(v)) or k in state.get(int(key), {}):
                raise CheckpointError(
                    f"{where}: optimizer scalar {key}.{k} is {v!r:.80}; expected a finite number"
                )
            state.setdefault(int(key), {})[k] = v
    adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
    for idx, values in sorted(state.items()):
        p = params[idx]
        if adam:
            want = {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if amsgrad[idx] else set())
            if set(values) != want:
                raise CheckpointError(
                    f"{twhere}: the optimizer state of parameter {idx} has {sorted(values)}; "
                    f"{type(optimizer).__name__} keeps {sorted(want)}"
                )
        for key, t in sorted(values.items()):
            label = f"optimizer.state.{idx}.{key}"
            if not isinstance(t, Tensor):
                continue
            if key == "step":
                if t.dim() != 0 or t.dtype not in (torch.float32, torch.float64, torch.int64):
                    raise CheckpointError(
                        f"{twhere}: {label} has shape {list(t.shape)} and dtype {t.dtype}; expected a scalar "
                        "(shape []) float32, float64 or int64"
                    )
                v = float(t)
                if not (math.isfinite(v) and v >= 0 and v == int(v)):
                    raise CheckpointError(f"{twhere}: {label} is {v}; expected a whole number >= 0")
            else:
                if tuple(t.shape) != tuple(p.shape) or t.dtype != p.dtype:
                    raise CheckpointError(
                        f"{twhere}: {label} has shape {list(t.shape)} and dtype {t.dtype}; parameter {idx} "
                        f"has shape {list(p.shape)} and dtype {p.dtype}"
                    )
                bad = _nonfinite(t)
                if bad:
                    raise CheckpointError(f"{twhere}: optimizer state {idx}.{key} has {bad} NaN/Inf values")
    return unflatten_optimizer(checkpoint.state_tensors, meta)


def _checked_rng(checkpoint: Checkpoint) -> dict[str, Tensor]:
    """The checkpoint's RNG states, each checked (shape, dtype, a trial load into a spare generator)."""
    where = checkpoint.folder / STATE_TENSORS_FILE
    rng = checkpoint.rng_tensors()
    if "rng.torch" not in rng:
        raise CheckpointError(f"{where}: holds no CPU RNG state (rng.torch)")
    cuda = _cuda_rng_names(rng)
    if cuda != [f"rng.cuda.{i}" for i in range(len(cuda))]:
        raise CheckpointError(
            f"{where}: CUDA RNG states {cuda}; expected rng.cuda.0, rng.cuda.1, ... in order"
        )
    current = torch.get_rng_state()
    trials: list[tuple[str, Tensor, torch.Generator | None]] = [("rng.torch", current, torch.Generator())]
    n_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for i, name in enumerate(cuda):
        if i < n_devices:
            trials.append((name, torch.cuda.get_rng_state(i), torch.Generator(device=f"cuda:{i}")))
        else:  # not restored on this machine (no such device): only its form is checked
            trials.append((name, rng[name].reshape(-1), None))
    for name, like, spare in trials:
        t = rng[name]
        if t.dtype != torch.uint8 or t.dim() != 1 or t.shape != like.shape:
            raise CheckpointError(
                f"{where}: {name} has shape {list(t.shape)} and dtype {t.dtype}; expected uint8 of shape "
                f"{list(like.shape)}"
            )
        if spare is not None:
            try:
                spare.set_state(t)
            except RuntimeError as e:
                raise CheckpointError(f"{where}: {name} is not a valid generator state ({e})") from None
    return rng


def restore_training_state(
    checkpoint: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Load weights, optimizer state and RNG states from ``checkpoint`` (for an exact resume).

    Everything is checked before anything changes: the weights' names, shapes and dtypes against
    ``model``; the optimizer's param groups (the same count, parameter indices and flags, finite
    hyper-parameters) and every state tensor (a moment: the shape and dtype of its parameter, finite; a
    step count: a whole number) against ``optimizer``; the RNG states' shapes and dtypes, each loaded
    into a spare generator first. A problem raises :class:`CheckpointError` and leaves ``model``,
    ``optimizer`` and the global RNG untouched.
    """
    problems = _weight_problems(model, checkpoint)
    if problems:
        raise CheckpointError(
            f"{checkpoint.folder / MODEL_FILE}: does not fit the model: " + "; ".join(problems)
        )
    sd = _checked_optimizer_state(checkpoint, optimizer) if optimizer is not None else None
    rng = _checked_rng(checkpoint)
    model.load_state_dict(checkpoint.model_state, strict=True)
    if optimizer is not None:
        try:
            optimizer.load_state_dict(sd)
        except (ValueError, KeyError, RuntimeError, TypeError) as e:  # pragma: no cover - checked above
            raise CheckpointError(
                f"{checkpoint.folder / STATE_FILE}: optimizer state does not fit ({e})"
            ) from None
    set_rng_state(rng)
