"""Checkpoints: safetensors tensors + JSON, written atomically, checked field by field when read.

A checkpoint is a folder::

    RUN_DIR/checkpoints/step-000600/
        config.json          the run's configuration (model and training), JSON
        model.safetensors    the model's weights (state_dict names)
        state.safetensors    optimizer moments and RNG states as tensors (RNG states as uint8)
        state.json           step, optimizer hyper-parameters, scheduler state, metadata, and the size and
                             SHA-256 of each file above (a truncated or altered file is caught on load)
    RUN_DIR/checkpoints/latest.json   {"step": 600, "folder": "step-000600"}: the newest complete one

Writing is atomic: every file goes to a temporary folder, which is renamed into place only when all of
it is on disk; then ``latest.json`` is replaced (temporary file + ``os.replace``). A save that fails
half-way (a full disk) removes its temporary folder and leaves the previous checkpoint and pointer
intact. Nothing is ever pickled or unpickled: tensors go through safetensors, everything else is JSON.

Every problem found on load is a :class:`CheckpointError` naming the file and the problem: missing,
empty, truncated or altered files, random bytes, a different configuration (the differing fields are
listed), missing or unexpected weight names, wrong shapes, NaN/Inf weights.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor, nn

from ..checks import nonfinite_count
from ..fileio import fsync_dir, write_atomic, write_file_synced

FORMAT = "headspace-checkpoint/1"
CONFIG_FILE = "config.json"
MODEL_FILE = "model.safetensors"
STATE_TENSORS_FILE = "state.safetensors"
STATE_FILE = "state.json"
LATEST_FILE = "latest.json"
CHECKPOINTS_DIR = "checkpoints"


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
    """The inverse of :func:`flatten_optimizer`: a state_dict for ``optimizer.load_state_dict``."""
    state: dict[int, dict[str, Any]] = {}
    prefix = "optimizer.state."
    for name, value in tensors.items():
        if not name.startswith(prefix):
            continue
        idx, key = name[len(prefix) :].split(".", 1)
        state.setdefault(int(idx), {})[key] = value
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


def set_rng_state(tensors: Mapping[str, Tensor]) -> None:
    """Restore what :func:`rng_state` saved (CUDA states only where CUDA is in use)."""
    if "rng.torch" in tensors:
        torch.set_rng_state(tensors["rng.torch"].to(torch.uint8))
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("rng.cuda.")]
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
        state: the JSON side of the training state (optimizer groups, scheduler, extra metadata).
    """

    folder: Path
    step: int
    config: dict[str, Any]
    model_state: dict[str, Tensor]
    state_tensors: dict[str, Tensor] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)

    def optimizer_state_dict(self) -> dict[str, Any]:
        if "optimizer" not in self.state:
            raise CheckpointError(f"{self.folder / STATE_FILE}: holds no optimizer state")
        return unflatten_optimizer(self.state_tensors, self.state["optimizer"])

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
    """Write a checkpoint of ``model`` (and ``optimizer``, RNG states, ``extra_state``) at ``step``.

    Returns the checkpoint folder ``run_dir/checkpoints/step-NNNNNN``. Only the newest ``keep_last``
    checkpoints are kept. On any failure (e.g. a full disk) the partial folder is removed, the previous
    checkpoint stays the latest, and a :class:`CheckpointError` says what failed. ``config`` and
    ``extra_state`` must hold plain JSON values, checked before anything is written: another type (a
    tensor) is a ``TypeError``, a NaN/Inf float a ``ValueError``, each naming the field (``config['lr']``).
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int; got {step!r}")
    if not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be an int >= 1; got {keep_last!r}")
    _check_json(config, "config")
    if extra_state is not None:
        _check_json(extra_state, "extra_state")
    root = Path(run_dir) / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    final = root / name
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=root))
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
        }
        state["files"] = {fname: _digest(data) for fname, data in blobs.items()}
        blobs[STATE_FILE] = _json_bytes(state)
        for fname, data in blobs.items():
            _write_file(tmp / fname, data)
        _fsync_dir(tmp)
        if final.exists():  # re-saving a step (after a resume): move the old one aside first
            old = root / f".{name}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
        write_atomic(root / LATEST_FILE, _json_bytes({"step": step, "folder": name}))
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        previous = _read_latest_name(root)
        kept = (
            f"the previous checkpoint ({previous}) is intact" if previous else "no earlier checkpoint exists"
        )
        raise CheckpointError(
            f"{final}: could not write the checkpoint for step {step}: {e.strerror or e}; {kept}"
        ) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune(root, keep_last)
    return final


def _read_latest_name(root: Path) -> str | None:
    try:
        return str(json.loads((root / LATEST_FILE).read_text())["folder"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _prune(root: Path, keep_last: int) -> None:
    latest = _read_latest_name(root)
    folders = sorted(p for p in root.glob("step-*") if p.is_dir())
    for p in folders[:-keep_last]:
        if p.name != latest:
            shutil.rmtree(p, ignore_errors=True)


# ------------------------------------------------------------------------------------------ reading
def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """A checkpoint folder from a run folder (its latest checkpoint) or a checkpoint folder itself."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or folder")
    if (p / STATE_FILE).exists() or (p / MODEL_FILE).exists():
        return p
    root = p / CHECKPOINTS_DIR if (p / CHECKPOINTS_DIR).is_dir() else p
    pointer = root / LATEST_FILE
    if not pointer.exists():
        raise CheckpointError(
            f"{p}: holds no checkpoint (no {CHECKPOINTS_DIR}/{LATEST_FILE} and no {STATE_FILE})"
        )
    try:
        latest = json.loads(pointer.read_text(encoding="utf-8"))
        folder = root / str(latest["folder"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{pointer}: unreadable pointer to the latest checkpoint ({e})") from None
    if not folder.is_dir():
        raise CheckpointError(f"{pointer}: points to {folder.name}, which does not exist")
    return folder


def _read_json(path: Path) -> dict[str, Any]:
    data = _read_bytes(path)
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: not valid JSON, truncated or corrupted ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a JSON object; got {type(obj).__name__}")
    return obj


def _read_bytes(path: Path) -> bytes:
    if not path.exists():
        raise CheckpointError(f"{path}: missing")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable ({e.strerror or e})") from None
    if not data:
        raise CheckpointError(f"{path}: empty file (0 bytes)")
    return data


def _verify(path: Path, data: bytes, expected: Any) -> None:
    if not isinstance(expected, dict) or "bytes" not in expected or "sha256" not in expected:
        raise CheckpointError(f"{path}: no size/checksum recorded for it in {STATE_FILE}")
    if len(data) != expected["bytes"]:
        what = "truncated" if len(data) < expected["bytes"] else "has extra bytes"
        raise CheckpointError(f"{path}: {what}: {len(data)} bytes, {STATE_FILE} records {expected['bytes']}")
    if hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise CheckpointError(
            f"{path}: corrupted: its SHA-256 does not match the one recorded in {STATE_FILE}"
        )


def _load_tensors(path: Path, data: bytes) -> dict[str, Tensor]:
    try:
        return st_load(data)
    except (SafetensorError, ValueError, RuntimeError, OverflowError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    expected_config: Mapping[str, Any] | None = None,
    allow_differ: tuple = (),
    normalize_config: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Checkpoint:
    """Read and check a checkpoint (a checkpoint folder, or a run folder for its latest one).

    Every file is checked against the size and SHA-256 recorded in ``state.json``. With
    ``expected_config`` the stored configuration is compared field by field first (fields named in
    ``allow_differ``, dotted, may differ); any other difference raises :class:`CheckpointError` listing
    them. ``normalize_config`` is applied to the stored configuration before that comparison (the
    training loop fills in fields added since the checkpoint was written, with their defaults).
    Weights with NaN/Inf are refused.
    """
    folder = resolve_checkpoint(path)
    state_path = folder / STATE_FILE
    state = _read_json(state_path)
    if state.get("format") != FORMAT:
        raise CheckpointError(
            f"{state_path}: not a headspace checkpoint (format {state.get('format')!r}, expected {FORMAT!r})"
        )
    step = state.get("step")
    if not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{state_path}: 'step' must be a non-negative int; got {step!r}")
    files = state.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"{state_path}: no 'files' table of sizes and checksums")

    config_path = folder / CONFIG_FILE
    config_bytes = _read_bytes(config_path)
    _verify(config_path, config_bytes, files.get(CONFIG_FILE))
    config = _read_json(config_path)
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
    model_bytes = _read_bytes(model_path)
    _verify(model_path, model_bytes, files.get(MODEL_FILE))
    model_state = _load_tensors(model_path, model_bytes)
    for name, t in model_state.items():
        bad = nonfinite_count(t) if t.is_floating_point() else 0
        if bad:
            raise CheckpointError(f"{model_path}: weight {name!r} has {bad} NaN/Inf values of {t.numel()}")

    state_tensors: dict[str, Tensor] = {}
    if STATE_TENSORS_FILE in files:
        tpath = folder / STATE_TENSORS_FILE
        tbytes = _read_bytes(tpath)
        _verify(tpath, tbytes, files[STATE_TENSORS_FILE])
        state_tensors = _load_tensors(tpath, tbytes)
    return Checkpoint(folder, step, config, model_state, state_tensors, state)


def load_weights_into(model: nn.Module, checkpoint: Checkpoint) -> None:
    """Copy the checkpoint's weights into ``model``: names and shapes must match exactly.

    Missing or unexpected names and wrong shapes raise :class:`CheckpointError` listing them (nothing is
    copied then).
    """
    path = checkpoint.folder / MODEL_FILE
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
    if problems:
        raise CheckpointError(f"{path}: does not fit the model: " + "; ".join(problems))
    model.load_state_dict(checkpoint.model_state, strict=True)


def restore_training_state(
    checkpoint: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Load weights, optimizer state and RNG states from ``checkpoint`` (for an exact resume)."""
    load_weights_into(model, checkpoint)
    if optimizer is not None:
        sd = checkpoint.optimizer_state_dict()
        n_params = sum(len(g["params"]) for g in optimizer.param_groups)
        n_saved = sum(len(g["params"]) for g in sd["param_groups"])
        if n_params != n_saved:
            raise CheckpointError(
                f"{checkpoint.folder / STATE_FILE}: optimizer state for {n_saved} parameters, the model has "
                f"{n_params}"
            )
        for idx, values in sd["state"].items():
            for key, value in values.items():
                if (
                    isinstance(value, Tensor)
                    and value.is_floating_point()
                    and not bool(torch.isfinite(value).all())
                ):
                    raise CheckpointError(
                        f"{checkpoint.folder / STATE_TENSORS_FILE}: optimizer state {idx}.{key} has NaN/Inf"
                    )
        try:
            optimizer.load_state_dict(sd)
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(
                f"{checkpoint.folder / STATE_FILE}: optimizer state does not fit ({e})"
            ) from None
    set_rng_state(checkpoint.rng_tensors())
