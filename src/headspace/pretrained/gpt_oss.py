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

from .hf import ConfigFields

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


def gpt_oss_fields(f: ConfigFields) -> dict[str, Any]:
    """The ModelConfig fields of a gpt-oss config beyond its Mistral-like attention: biases on q, k, v
    and o (``attention_bias``), sinks, and the experts (router bias, top-k before the softmax, expert
    biases, the clamped SwiGLU)."""
    bias = f.flag("attention_bias", True)
    return dict(
        qkv_bias=bias,
        out_bias=bias,
        attn_sink=True,
        mlp_kind="moe",
        mlp_bias=True,
        experts_routing="topk_softmax",
        router_bias=True,
        experts_norm_topk=False,
        swiglu_limit=f.number("swiglu_limit", 7.0, low=0.0, low_open=True),
        swiglu_alpha=f.number("swiglu_alpha", 1.702, low=0.0, low_open=True),
    )


def gpt_oss_tensors(
    c: Any, prefix: str, attention: list[Any]
) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    """``attention`` (the Llama family's (ours, HF tensors) pieces without the MLP) plus each layer's
    sinks and fused experts (module docstring), one HF tensor per piece."""
    d, dm, n = c.d_model, c.d_mlp, c.n_experts
    out = list(attention)
    for i in range(c.n_layers):
        p, b = f"{prefix}layers.{i}.", f"blocks.{i}."
        out.append((b + "attn.sinks", [(p + "self_attn.sinks", (c.n_heads,))]))
        shapes = {
            "router.weight": (n, d),
            "router.bias": (n,),
            "experts.gate_up_proj": (n, d, 2 * dm),
            "experts.gate_up_proj_bias": (n, 2 * dm),
            "experts.down_proj": (n, dm, d),
            "experts.down_proj_bias": (n, d),
        }
        for name, shape in shapes.items():
            out.append((f"{b}mlp:{name}", [(f"{p}mlp.{name}", shape)]))
    return out


def gpt_oss_state_dict(t: Mapping[str, Tensor], n_layers: int, prefix: str) -> dict[str, Tensor]:
    """Every layer's MLP state (:func:`gpt_oss_mlp_state`) under ``blocks.N.mlp.``."""
    out: dict[str, Tensor] = {}
    for i in range(n_layers):
        for name, value in gpt_oss_mlp_state(t, f"{prefix}layers.{i}.mlp.").items():
            out[f"blocks.{i}.mlp.{name}"] = value
    return out
