"""A checkpoint's format: its file names and size caps, the JSON it may hold, step folder names, the
flattened optimizer and RNG state, and the :class:`Checkpoint` read back.

Shared by writing (:mod:`.checkpoint`), reading (:mod:`.checkpoint_load`) and restoring
(:mod:`.checkpoint_restore`); :mod:`.checkpoint` re-exports every public name, and its docstring
describes the folder.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..core.checks import nonfinite_count

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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _nonfinite(t: Tensor) -> int:
    """NaN/Inf entries of a floating-point tensor (0 for other dtypes), for any dtype safetensors holds."""
    if not t.is_floating_point():
        return 0
    try:
        return nonfinite_count(t)
    except (NotImplementedError, RuntimeError):  # isfinite is missing for some float8 formats
        return nonfinite_count(t.float())
