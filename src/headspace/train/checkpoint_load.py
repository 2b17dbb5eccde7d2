"""Reading a checkpoint back: the ``latest.json`` pointer resolved, the manifest's seal checked, then the
content (weights, optimizer and RNG tensors, state and config JSON) validated (:func:`load_checkpoint`).

Only regular files are opened, each within its size cap; every problem is a
:class:`~.checkpoint_format.CheckpointError` naming the file. :mod:`.checkpoint` re-exports these names.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load as st_load
from torch import Tensor

from ..core.fileio import (
    UnsafeFileError,
    file_kind,
    parse_json,
    read_regular_file,
)
from .checkpoint_format import (
    _CUDA_RNG,
    _OPT_TENSOR,
    _SHA256,
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    FORMAT,
    LATEST_FILE,
    MANIFEST_FILE,
    MAX_JSON_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_TENSORS_BYTES,
    MODEL_FILE,
    SEALED_FILES,
    STATE_FILE,
    STATE_TENSORS_FILE,
    Checkpoint,
    CheckpointError,
    _is_int,
    _nonfinite,
    _step_of_folder,
    config_differences,
    step_folder_name,
)


# ------------------------------------------------------------------------------------------ reading
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
