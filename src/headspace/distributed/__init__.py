"""Running one model over several processes with torch.distributed (under ``torchrun``).

The map:

* :mod:`~headspace.distributed.data_parallel`: data-parallel training, every rank a whole model and its
  own rows of each batch (:func:`wrap_model` in ``DistributedDataParallel``, :func:`local_batch_slice`,
  :func:`check_same_config`, :func:`average_across_ranks`); :mod:`headspace.train`'s loop uses it;
* :mod:`~headspace.distributed.head_parallel`: head-parallel (tensor-parallel) layers, each rank some
  heads of every attention layer and some units of every MLP, one all-reduce after ``W_O`` / ``fc_out``
  (:class:`HeadParallelAttention`, :class:`HeadParallelFeedForward`, :func:`shard_model`,
  :func:`gather_model`);
* the process group itself (:func:`setup_distributed`, :class:`DistInfo`, :func:`barrier`,
  :func:`teardown`) is :mod:`headspace.core.process_group`, re-exported here: the atlas's sharded run
  (:mod:`headspace.analysis`) and the CLI join it too.

Layering: above :mod:`headspace.model` and the attention layer it shards, below :mod:`headspace.train`
(pyproject.toml, ``[tool.importlinter]``). docs/distributed.md is the guide; docs/scaling.md has the
maths and the measurements. Old paths keep working: ``headspace.model.parallel`` and
``headspace.parallel`` are :mod:`~headspace.distributed.head_parallel`, ``headspace.train.distributed``
is :mod:`~headspace.distributed.data_parallel` (the same module objects).
"""

from ..core.process_group import DistInfo, barrier, setup_distributed, teardown
from .data_parallel import average_across_ranks, check_same_config, local_batch_slice, wrap_model
from .head_parallel import (
    HeadParallelAttention,
    HeadParallelFeedForward,
    attention_shard,
    feed_forward_shard,
    gather_model,
    shard_model,
)

__all__ = [
    "DistInfo",
    "HeadParallelAttention",
    "HeadParallelFeedForward",
    "attention_shard",
    "average_across_ranks",
    "barrier",
    "check_same_config",
    "feed_forward_shard",
    "gather_model",
    "local_batch_slice",
    "setup_distributed",
    "shard_model",
    "teardown",
    "wrap_model",
]
