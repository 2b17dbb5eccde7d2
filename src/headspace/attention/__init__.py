"""Multi-head attention, each head's W_Q, W_K, W_V and W_O in plain sight.

The map:

* :mod:`~headspace.attention.layer`: :class:`MultiHeadAttention` (fused storage, hook points, the KV
  cache, rotary positions, grouped-query heads, forward), its description read at call time
  (:mod:`~headspace.attention.described`), its per-head views, projections, q/k/v stages and QK-norm
  (:mod:`~headspace.attention.projection`) and its argument and input checks
  (:mod:`~headspace.attention.checks`);
* :mod:`~headspace.attention.recording`: the traced path as a trace records it (hook firing, and what
  recorders are handed instead of scores, pattern and result): the trace's executor of the layer;
* :mod:`~headspace.attention.functional`: the maths behind one signature: scores, pattern and the
  backends (sdpa, explicit, reference);
* :mod:`~headspace.attention.heads`: :class:`Head` / :class:`HeadList`, one head's matrices as views;
* :mod:`~headspace.attention.circuits`: :class:`FactoredMatrix`, the QK and OV circuits;
* :mod:`~headspace.attention.pruning`: removing heads from the fused storage;
* :mod:`~headspace.attention.compat`: the drop-in for ``torch.nn.MultiheadAttention`` (torch's
  exceptions, call checks and masks: :mod:`~headspace.attention.compat_torch`).

``headspace.attention`` itself holds the layer's names, as the module of that name did.
"""

from ..nn.kv_cache import KVCache
from ..nn.positions import rotary_tables, rotate_fused
from .layer import MultiHeadAttention, _check_finite, check_input_tensor, resolve_head_dims

__all__ = [
    "KVCache",
    "MultiHeadAttention",
    "_check_finite",
    "check_input_tensor",
    "resolve_head_dims",
    "rotary_tables",
    "rotate_fused",
]
