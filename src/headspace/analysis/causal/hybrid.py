"""The shared prefix of patched runs on hybrid models (Qwen3-Next, Qwen3.5): softmax layers keep the
prefix's keys and values, Gated DeltaNet layers their convolution inputs and recurrent state.

Activation patching (:mod:`.engine`) runs the positions before the first token where the prompts differ
once and starts every patched run from that prefix. For a softmax layer the prefix is its keys and values
``(k, v)`` [1, n_kv_heads, p, d_head] each; for a Gated DeltaNet layer it is the :class:`~headspace.
attention.delta_net.DeltaNetCache` after position ``p - 1``: ``(conv, state)``, [1, conv_dim,
conv_kernel - 1] and [1, n_v_heads, d_k, d_v]. A run from that state is the full run (the chunked rule
started from a state equals the rule over the whole sequence, float rounding apart), so patching a
DeltaNet head's ``hook_z`` (its gated norm's output, the input of its rows of W_O) is exact.
"""

from __future__ import annotations

from torch import Tensor, nn

from ...attention.delta_net import DeltaNetCache, GatedDeltaNet
from ...attention.latent import LatentAttention
from ...nn.kv_cache import KVCache


def prefix_state(cache: KVCache, p: int) -> tuple[Tensor, Tensor]:
    """A copy of what ``cache`` holds after the prefix of ``p`` positions: ``(k, v)`` [1, Hkv, p, d_head]
    x 2, or a DeltaNet cache's ``(conv, state)`` (module docstring)."""
    if isinstance(cache, DeltaNetCache):
        return cache.conv.clone(), cache.state.clone()
    return cache.k[:, :, :p].clone(), cache.v[:, :, :p].clone()


def prefix_cache(layer: nn.Module, saved: tuple[Tensor, Tensor], runs: int, seq: int, p: int) -> KVCache:
    """A cache of ``runs`` rows and capacity ``seq`` for ``layer`` (a block's ``attn``), holding the
    prefix ``saved`` (:func:`prefix_state`) of ``p`` positions in every row."""
    a, b = saved
    if isinstance(layer, GatedDeltaNet):
        delta = layer.make_kv_cache(runs, seq)
        delta.conv.copy_(a.expand(runs, -1, -1))  # (runs, conv_dim, conv_kernel - 1)
        delta.state.copy_(b.expand(runs, -1, -1, -1))  # (runs, n_v_heads, d_k, d_v)
        delta.length = p
        return delta
    if isinstance(layer, LatentAttention):  # its cache holds the latent and the shared rotary key
        cache = layer.make_kv_cache(runs, seq)
    else:
        cache = KVCache(runs, a.shape[1], a.shape[3], seq, dtype=a.dtype, device=a.device)
    cache.k[:, :, :p] = a
    cache.v[:, :, :p] = b
    cache.length = p
    return cache
