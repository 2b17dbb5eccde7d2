"""Restoring a checkpoint read back into live objects: weights into a model (:func:`load_weights_into`),
optimizer state and RNG states (:func:`restore_training_state`, which checks everything before it
changes anything). :mod:`.checkpoint` re-exports these names.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from .checkpoint_format import (
    _OPT_TENSOR,
    MODEL_FILE,
    STATE_FILE,
    STATE_TENSORS_FILE,
    Checkpoint,
    CheckpointError,
    _cuda_rng_names,
    _is_int,
    _nonfinite,
    set_rng_state,
    unflatten_optimizer,
)


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
