"""Data-parallel training helpers (torch.distributed, DistributedDataParallel).

:func:`wrap_model` wraps the model in :class:`~torch.nn.parallel.DistributedDataParallel`,
:func:`check_same_config` makes sure every rank was started with the same configuration,
:func:`local_batch_slice` says which rows of a global batch a rank owns, and
:func:`average_across_ranks` averages a logged value; :mod:`headspace.train`'s loop calls them. The
process group itself is :mod:`headspace.core.process_group`. Old path: ``headspace.train.distributed``.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..core.checks import is_int
from ..core.process_group import DistInfo, all_gather_bytes, compare_configs, device_of

__all__ = ["average_across_ranks", "check_same_config", "local_batch_slice", "wrap_model"]


def wrap_model(model: nn.Module, info: DistInfo) -> nn.Module:
    """DistributedDataParallel around ``model`` when ``info.enabled``; the model itself otherwise.

    DDP broadcasts rank 0's parameters at construction and averages gradients over ranks in backward,
    so a step on ``world_size`` shards of a global batch equals one step on the whole batch (the loss
    being a mean over rows).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if not isinstance(info, DistInfo):
        raise TypeError(f"info must be a DistInfo (from setup_distributed); got {type(info).__name__}")
    if not info.enabled:
        return model
    if info.backend == "nccl":
        return nn.parallel.DistributedDataParallel(model, device_ids=[info.local_rank])
    return nn.parallel.DistributedDataParallel(model)


def local_batch_slice(global_batch: int, info: DistInfo) -> slice:
    """The rows ``[rank * B / W, (rank + 1) * B / W)`` of a global batch of ``B`` rows this rank owns.

    Every rank draws the same global batch (same seed and step); each trains on its own slice.
    """
    if not is_int(global_batch) or global_batch <= 0:
        raise ValueError(f"global_batch must be a positive int; got {global_batch!r}")
    if global_batch % info.world_size != 0:
        raise ValueError(
            f"global_batch={global_batch} is not divisible by the world size {info.world_size}; choose a "
            f"batch size that is a multiple of the number of processes (e.g. "
            f"{info.world_size * max(1, global_batch // info.world_size)})"
        )
    per_rank = global_batch // info.world_size
    return slice(info.rank * per_rank, (info.rank + 1) * per_rank)


def average_across_ranks(value: Tensor | float, info: DistInfo) -> float:
    """The mean of a scalar over all ranks (for logging a loss); the value itself in a world of one."""
    t = torch.as_tensor(value, dtype=torch.float64).detach().reshape(())
    if not info.enabled:
        return float(t)
    t = t.to(device_of(info))
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t) / info.world_size


# ---------------------------------------------------------------------------------------------- config check
def _config_payload(config: Any) -> bytes:
    """This rank's config as JSON, or a JSON error record (so a bad value on one rank fails every rank)."""
    if not isinstance(config, dict):
        record = {"error": f"config_dict must be a dict; got {type(config).__name__}"}
    else:
        try:
            record = {"config": json.loads(json.dumps(config, sort_keys=True))}
        except (TypeError, ValueError) as e:
            record = {"error": f"config_dict must be JSON-serialisable ({e})"}
    return json.dumps(record, sort_keys=True).encode()


def check_same_config(config_dict: dict[str, Any], info: DistInfo) -> None:
    """Raise ``ValueError`` on every rank if the ranks were given different configurations.

    Each rank sends its ``config_dict`` as JSON to all others; the message lists each differing field
    with every rank's value. Nothing to compare in a world of one (only the type is checked).
    """
    payload = _config_payload(config_dict)
    if not info.enabled:
        record = json.loads(payload)
        if "error" in record:
            raise TypeError(record["error"])
        return
    records = [json.loads(p) for p in all_gather_bytes(payload, device_of(info))]
    compare_configs(records, "config_dict")
