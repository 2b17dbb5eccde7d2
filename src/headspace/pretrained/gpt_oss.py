"""gpt-oss's mixture of experts in headspace's layout (the family's loader is not written yet).

transformers' ``GptOssMLP`` stores each layer's experts fused and transposed ([in, out])::

    mlp.router.weight [E, d_model], mlp.router.bias [E]          -> mlp.router.weight / .bias
    mlp.experts.gate_up_proj [E, d_model, 2 d_mlp]               gate = columns 0, 2, 4 ..., up = 1, 3, 5 ...
    mlp.experts.gate_up_proj_bias [E, 2 d_mlp]                   (interleaved the same way)
    mlp.experts.down_proj [E, d_mlp, d_model], down_proj_bias [E, d_model]

:func:`gpt_oss_mlp_state` gives the :class:`~headspace.model.moe.MixtureOfExperts` state dict
(``experts_gate`` / ``experts_in`` [E, d_mlp, d_model], ``experts_out`` [E, d_model, d_mlp], [out, in]
as ``nn.Linear``, and their biases); :data:`GPT_OSS_MLP` the fields of its ``MLPSpec``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

#: The MLPSpec fields of a gpt-oss layer beyond the sizes (``swiglu_limit`` / ``swiglu_alpha`` from
#: the config: transformers' defaults 7.0 and 1.702).
GPT_OSS_MLP: dict[str, Any] = {"kind": "moe", "routing": "topk_softmax", "router_bias": True, "bias": True}


def gpt_oss_mlp_state(t: Mapping[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """``prefix`` + transformers' gpt-oss MLP tensor names (module docstring) -> the
    :class:`~headspace.model.moe.MixtureOfExperts` state dict (float32, contiguous)."""
    e = prefix + "experts."
    gate_up = t[e + "gate_up_proj"].float()  # (E, d_model, 2 d_mlp): gate, up interleaved
    gate_up_bias = t[e + "gate_up_proj_bias"].float()  # (E, 2 d_mlp)
    return {
        "router.weight": t[prefix + "router.weight"].float(),
        "router.bias": t[prefix + "router.bias"].float(),
        "experts_gate": gate_up[:, :, 0::2].transpose(1, 2).contiguous(),  # (E, d_mlp, d_model)
        "experts_in": gate_up[:, :, 1::2].transpose(1, 2).contiguous(),  # (E, d_mlp, d_model)
        "experts_out": t[e + "down_proj"].float().transpose(1, 2).contiguous(),  # (E, d_model, d_mlp)
        "experts_gate_bias": gate_up_bias[:, 0::2].contiguous(),  # (E, d_mlp)
        "experts_in_bias": gate_up_bias[:, 1::2].contiguous(),  # (E, d_mlp)
        "experts_out_bias": t[e + "down_proj_bias"].float(),  # (E, d_model)
    }
