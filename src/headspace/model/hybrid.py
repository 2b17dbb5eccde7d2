"""The fields of hybrid models (Qwen3-Next, Qwen3.5): output gates on the softmax layers and Gated DeltaNet
layers (``ModelConfig.layer_types`` ``"linear"``) among them, read into each block's description.

``ModelConfig.attn_gate`` (None, ``"elementwise"`` or ``"headwise"``) is every softmax layer's
``AttentionSpec.gate``; ``ModelConfig.delta_net`` (None, or a dict of :class:`~headspace.nn.delta_spec.
DeltaNetSpec`'s ``n_k_heads``, ``n_v_heads``, ``d_k``, ``d_v``, ``conv_kernel``; ``d_model`` and
``norm_eps`` are the model's ``d_model`` and ``ln_eps``) the description of every ``"linear"`` layer.
"""

from __future__ import annotations

from typing import Any

from ..nn.delta_spec import DeltaNetSpec
from ..nn.spec import GATES

#: The keys of ``ModelConfig.delta_net``.
DELTA_NET_KEYS = ("n_k_heads", "n_v_heads", "d_k", "d_v", "conv_kernel")


def check_hybrid(config: Any) -> None:
    """One-line ``ValueError`` naming the field where ``attn_gate`` / ``delta_net`` / the ``"linear"``
    layers of ``config`` (a ModelConfig) do not fit together."""
    if config.attn_gate is not None and config.attn_gate not in GATES:
        raise ValueError(
            f"ModelConfig.attn_gate must be None or one of {list(GATES)}; got {config.attn_gate!r}"
        )
    linear = "linear" in (config.layer_types or [])
    d = config.delta_net
    if d is None:
        if linear:
            raise ValueError("ModelConfig.layer_types has 'linear' layers but delta_net is None")
        return
    if not isinstance(d, dict) or sorted(d) != sorted(DELTA_NET_KEYS):
        raise ValueError(
            f"ModelConfig.delta_net must be None or a dict of {list(DELTA_NET_KEYS)}; got {d!r:.120}"
        )
    delta_net_spec(config)  # the values, checked as the blocks' DeltaNetSpec checks them


def delta_net_spec(config: Any) -> DeltaNetSpec:
    """The :class:`DeltaNetSpec` of ``config``'s ``"linear"`` layers (``ValueError`` naming the field)."""
    try:
        return DeltaNetSpec(config.d_model, norm_eps=float(config.ln_eps), **config.delta_net)
    except (TypeError, ValueError) as e:
        raise ValueError(f"ModelConfig.delta_net: {e}") from None
