"""The process group: where this process stands in a torch.distributed job (torchrun).

:func:`setup_distributed` joins the process group that ``torchrun`` describes in the environment (gloo on
CPU, nccl on GPU); without ``torchrun`` (no ``WORLD_SIZE``) it returns a world of one and the helpers do
nothing. Used by training (data parallel, :mod:`headspace.distributed.data_parallel`), by head-parallel
layers (:mod:`headspace.distributed.head_parallel`) and by the atlas's sharded run. Payloads between
ranks travel as JSON bytes: nothing is pickled.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .checks import is_number

__all__ = [
    "DistInfo",
    "all_gather_bytes",
    "barrier",
    "compare_configs",
    "device_of",
    "setup_distributed",
    "teardown",
]


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands in the job: ``rank`` of ``world_size`` processes, ``local_rank`` on its
    machine, and the ``backend`` of the process group ("gloo", "nccl"; None when not distributed)."""

    rank: int
    world_size: int
    local_rank: int
    backend: str | None

    @property
    def is_main(self) -> bool:
        """True on rank 0, the only rank that writes checkpoints, metrics and summaries."""
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        """True when more than one process takes part."""
        return self.world_size > 1


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise ValueError(f"environment variable {name} is not set; start the job with torchrun")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer; got {raw!r}") from None


def setup_distributed(device: str = "cpu", *, timeout_s: float = 600.0) -> DistInfo:
    """Join the process group described by torchrun's environment; a world of one without it.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (set by
    ``torchrun``). ``device="cpu"`` uses the gloo backend; ``"cuda"`` uses nccl and selects GPU
    ``LOCAL_RANK``. A process group that is already initialised is reused. ``timeout_s`` bounds every
    collective, so a rank that never arrives fails the job instead of hanging it.

    Returns:
        DistInfo of this process (``world_size == 1`` and ``backend None`` without torchrun).
    """
    if not isinstance(device, str) or device.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda' (optionally 'cuda:N'); got {device!r}")
    if not is_number(timeout_s) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a positive number of seconds; got {timeout_s!r}")
    on_cuda = device.startswith("cuda")
    if dist.is_available() and dist.is_initialized():
        backend = str(dist.get_backend())
        return DistInfo(dist.get_rank(), dist.get_world_size(), _env_int("LOCAL_RANK", 0), backend)
    world_size = _env_int("WORLD_SIZE", 1)
    if world_size <= 1:
        return DistInfo(rank=0, world_size=1, local_rank=0, backend=None)
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed support")
    rank = _env_int("RANK")
    local_rank = _env_int("LOCAL_RANK", rank)
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK must be in [0, WORLD_SIZE={world_size}); got RANK={rank}")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise ValueError(f"environment variable {name} is not set; start the job with torchrun")
    if on_cuda:
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' (nccl backend) was asked for but no CUDA device is available")
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK={local_rank} but this machine has {torch.cuda.device_count()} CUDA devices; "
                "start at most one process per GPU (torchrun --nproc-per-node)"
            )
        torch.cuda.set_device(local_rank)
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(
        backend=backend, init_method="env://", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )  # fmt: skip
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, backend=backend)


def device_of(info: DistInfo) -> torch.device:
    """The device collectives of this group use (nccl only moves CUDA tensors)."""
    if info.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier(info: DistInfo) -> None:
    """Wait until every rank reaches this point (nothing to do in a world of one)."""
    if info.enabled:
        if info.backend == "nccl":
            dist.barrier(device_ids=[info.local_rank])
        else:
            dist.barrier()


def teardown(info: DistInfo) -> None:
    """Leave the process group (nothing to do in a world of one)."""
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


def all_gather_bytes(
    payload: bytes, device: torch.device, group: dist.ProcessGroup | None = None
) -> list[bytes]:
    """Every rank's ``payload``, in rank order (JSON text travels as uint8 tensors: nothing is pickled)."""
    world = dist.get_world_size(group)
    data = torch.tensor(list(payload), dtype=torch.uint8)  # (n_bytes,)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data.to(device)
    gathered = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [bytes(g[: int(s)].cpu().tolist()) for g, s in zip(gathered, sizes)]


def compare_configs(records: list[dict[str, Any]], what: str) -> None:
    """Raise ValueError (identically on every rank) if the ranks' records differ."""
    errors = [f"rank {r}: {rec['error']}" for r, rec in enumerate(records) if "error" in rec]
    if errors:
        raise ValueError(f"{what} could not be compared across ranks: " + "; ".join(errors))
    configs = [rec["config"] for rec in records]
    keys = sorted(set().union(*(c.keys() for c in configs)))
    missing = object()
    differing = []
    for key in keys:
        values = [c.get(key, missing) for c in configs]
        if any(v != values[0] for v in values[1:]):
            shown = ", ".join(
                f"rank {r}={'<missing>' if v is missing else json.dumps(v)}" for r, v in enumerate(values)
            )
            differing.append(f"{key} ({shown})")
    if differing:
        raise ValueError(
            f"{what} differs across the {len(configs)} ranks; every rank must be started with the same "
            f"settings. Differing fields: " + "; ".join(differing)
        )
