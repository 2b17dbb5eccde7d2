"""What keeps an atlas run from mixing: the model's weights fingerprint, one run per output folder, and
the checks of a shard read back from disk.

* :func:`weights_sha256`: the SHA-256 of the weights themselves (every entry of ``state_dict()``: its
  name, dtype, shape and bytes), taken at the start of every run, so a run over other weights under the
  same name or path, or after in-place edits of the weights (``p.mul_``, ``p.data.copy_``, a
  ``load_state_dict``), has another fingerprint than the shards it finds. The bytes are hashed each
  time rather than trusted from version counters: an edit through ``p.data`` does not move
  ``p._version``.
* :func:`folder_lock`: an exclusive ``fcntl.flock`` on ``OUT/.atlas.lock``, held for the whole run
  (re-entrant in one thread); a second run on the same folder is refused in one line naming the holder.
  Under torch.distributed, local rank 0 of each machine takes it and every rank learns the outcome.
* :func:`read_shard`: a sealed shard read back, refused in one line when it belongs to another run or
  names sequences it cannot hold, recomputed (with one line on stderr) when it is damaged.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...core.fileio import parse_json, read_regular_file
from ...core.process_group import DistInfo, all_gather_bytes, device_of
from .corpus import Window
from .state import EXAMPLE_KINDS, SealedState

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: runs are not locked
    fcntl = None  # type: ignore[assignment]

SHARD_FORMAT = "headspace-atlas-shard/1"
LOCK_NAME = ".atlas.lock"
"""The lock file inside an atlas output folder."""

_HASH_CHUNK = 1 << 24  # elements per piece of a tensor copied off its device


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def weights_sha256(module: nn.Module) -> str:
    """SHA-256 (hex) of ``module``'s weights: for every ``state_dict()`` entry in order, its name, dtype
    and shape, then its elements' bytes in C order (a tensor shared under two names is hashed once, the
    second name recorded as an alias). Any change of any weight's value, dtype or shape changes it."""
    h = hashlib.sha256()
    seen: dict[tuple[int, tuple[int, ...], tuple[int, ...], str], str] = {}
    for name, t in module.state_dict().items():
        if not isinstance(t, torch.Tensor):  # pragma: no cover - extra state
            h.update(f"{name}\0extra\0{t!r}\0".encode())
            continue
        t = t.detach()
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype))
        if t.numel() and key in seen:
            h.update(f"{name}\0alias\0{seen[key]}\0".encode())
            continue
        seen[key] = name
        h.update(f"{name}\0{t.dtype}\0{list(t.shape)}\0".encode())
        flat = t.contiguous().reshape(-1)  # (numel,)
        for start in range(0, flat.numel(), _HASH_CHUNK):
            piece = flat[start : start + _HASH_CHUNK].cpu().contiguous()  # (<= chunk,)
            h.update(piece.view(torch.uint8).numpy().data)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------ the lock
_HELD: dict[tuple[str, int], int] = {}  # (folder, thread) -> depth of nested holds
_HELD_GUARD = threading.Lock()


def _holder(path: Path) -> str:
    try:
        text = read_regular_file(path, max_bytes=4096).decode("utf-8", "replace").strip()
    except (OSError, ValueError):
        text = ""
    return text or "another process"


def _try_lock(folder: Path) -> tuple[int | None, str | None]:
    """(the open lock file descriptor, None) or (None, why not): an exclusive lock on ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None, (
            f"{folder}: another atlas run is writing this folder ({_holder(path)}); wait for it to "
            "finish or choose another output folder"
        )
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {stamp}\n".encode())
    return fd, None


@contextmanager
def folder_lock(folder: str | os.PathLike[str], info: DistInfo | None = None) -> Iterator[None]:
    """Hold the exclusive lock of the atlas output ``folder`` (created if missing) for the ``with``
    block, or raise ``ValueError`` naming the run that holds it. Re-entrant within one thread."""
    folder = Path(folder)
    key = (str(folder.resolve()), threading.get_ident())
    with _HELD_GUARD:
        nested = _HELD.get(key, 0) > 0
        if nested:
            _HELD[key] += 1
    if nested:
        try:
            yield
        finally:
            with _HELD_GUARD:
                _HELD[key] -= 1
        return
    fd, why = (None, None)
    if fcntl is not None and (info is None or info.local_rank == 0):
        fd, why = _try_lock(folder)
    if info is not None and info.enabled:
        refusals = [r.decode() for r in all_gather_bytes((why or "").encode(), device_of(info)) if r]
        why = why or (refusals[0] if refusals else None)
    if why is not None:
        if fd is not None:
            os.close(fd)
        raise ValueError(why)
    with _HELD_GUARD:
        _HELD[key] = 1
    try:
        yield
    finally:
        with _HELD_GUARD:
            del _HELD[key]
        if fd is not None:
            os.close(fd)  # releases the flock


# ------------------------------------------------------------------------------------------ the shards
def _damaged(path: Path, why: str) -> None:
    sys.stderr.write(f"atlas: {path} is damaged ({why}); computing that shard again\n")
    sys.stderr.flush()


def _check_state(path: Path, state: Any, windows: list[Window], blank: dict[str, Any]) -> None:
    """Refuse a sealed state that cannot be merged or names a sequence, query or key outside
    ``windows`` (a shard edited and sealed again)."""
    try:
        SealedState.empty_like(blank).add(state)
        lengths = {w.index: int(w.tokens.shape[0]) for w in windows}
        for kind in EXAMPLE_KINDS:
            for row in state["top"][kind]:
                for cands in row:
                    for _, seq, q, k, _ in cands:
                        n = lengths.get(int(seq))
                        if n is None:
                            raise ValueError(
                                f"names sequence {seq}, which is not one of its sequences "
                                f"{min(lengths)}..{max(lengths)}"
                            )
                        if not (0 <= int(q) < n and 0 <= int(k) < n):
                            raise ValueError(
                                f"names query {q} / key {k} outside sequence {seq} of {n} tokens"
                            )
    except (KeyError, TypeError, ValueError, IndexError) as e:
        what = f"lacks {e}" if isinstance(e, KeyError) else str(e).splitlines()[0]
        raise ValueError(
            f"{path}: a sealed shard this run cannot use ({what}); delete it to compute it again"
        ) from None


def _fingerprint_error(path: Path, theirs: Any, ours: dict[str, Any]) -> ValueError:
    differ = {k for k in ours if isinstance(theirs, dict) and theirs.get(k) != ours[k]}
    if differ == {"importance"}:
        return ValueError(
            f"{path}: a shard of importance {theirs.get('importance')!r}; this run asks for "
            f"{ours['importance']!r}: use the same importance method (--importance) or a fresh output folder"
        )
    if "weights_sha256" in differ and differ <= {"weights_sha256", "model"}:
        return ValueError(
            f"{path}: a shard of a model with other weights (weights SHA-256 "
            f"{theirs.get('weights_sha256')}); "
            f"this model's weights have SHA-256 {ours['weights_sha256']}: use a fresh output folder or the "
            "same weights"
        )
    return ValueError(
        f"{path}: a shard of another run (fingerprint {theirs!r}); expected {ours!r}: use a fresh output "
        "folder or the same arguments"
    )


def read_shard(
    path: Path, fingerprint: dict[str, Any], windows: list[Window], blank: dict[str, Any]
) -> dict[str, Any] | None:
    """The state of the sealed shard ``path`` over ``windows``, or None when absent or damaged (then it is
    computed again, and a damaged one is named on stderr). ``ValueError`` for a shard of another run
    (fingerprint ``fingerprint``) or one whose sealed state ``windows`` cannot hold; ``blank`` is an
    empty sealed state of this run's shape."""
    if not os.path.lexists(path):
        return None
    try:
        obj = parse_json(read_regular_file(path, max_bytes=1 << 30))
    except ValueError as e:
        _damaged(path, str(e).splitlines()[0] if str(e) else "not JSON")
        return None
    if not isinstance(obj, dict) or obj.get("format") != SHARD_FORMAT or "state" not in obj:
        _damaged(path, f"not a {SHARD_FORMAT} file")
        return None
    if obj.get("fingerprint") != fingerprint:
        raise _fingerprint_error(path, obj.get("fingerprint"), fingerprint)
    if obj.get("sha256") != _digest(obj["state"]):
        _damaged(path, "its state does not match its SHA-256")
        return None
    _check_state(path, obj["state"], windows, blank)
    return obj["state"]


def seal(state: dict[str, Any], fingerprint: dict[str, Any]) -> str:
    """The JSON text of a sealed shard: its format, the run's fingerprint, the state and its SHA-256."""
    return json.dumps(
        {"format": SHARD_FORMAT, "fingerprint": fingerprint, "state": state, "sha256": _digest(state)}
    )
