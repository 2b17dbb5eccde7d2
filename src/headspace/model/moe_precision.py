"""A mixture of experts at ``precision="bfloat16"`` (:meth:`headspace.Decoder.to_precision`, issue #39).

* The experts' weights (``experts_gate``, ``experts_in``, ``experts_out`` [E, out, in], and their biases)
  become bfloat16 numbers held as :class:`BF16Experts`: a float32 tensor [E, out, in] of the rounded
  values (every view and analysis reads it as float32) whose expert ``e`` (``w[e]``, an int index) is a
  :class:`~headspace.kernels.bf16.BF16Weight` over the same values, so that each expert's products run
  in bfloat16 as every other product of the model does: ``y = float32(bf16(x) bf16(W_e)^T + bf16(b_e))``.
  Any other operation on the stacked tensor sees its float32 values (the products are then float32 on
  the rounded weights).
* The router follows transformers' rule in bfloat16: its product runs in bfloat16 like any layer, the
  softmax / sigmoid of the logits in float32 (as :meth:`MixtureOfExperts.route` always does), except in
  DeepSeek V2 / V3 (the blocks with latent attention here), whose ``gate.weight`` transformers keeps in
  float32 (``_keep_in_fp32_modules_strict``) with the logits computed in float32, and V3's
  ``e_score_correction_bias`` likewise: those stay float32, unrounded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..kernels import cpu
from ..kernels.bf16 import BF16Weight
from ..kernels.carrier import ReducedWeight
from .moe import MixtureOfExperts

__all__ = ["BF16Experts", "bf16_experts", "float32_router_params", "is_bf16_experts"]

EXPERT_WEIGHTS = ("experts_gate", "experts_in", "experts_out")


class BF16Experts(ReducedWeight):
    """Stacked expert weights [E, out, in] of bfloat16 numbers read as float32; ``self[e]`` (an int) is
    expert ``e``'s :class:`~headspace.kernels.bf16.BF16Weight` (sharing these values), so ``F.linear(x,
    w[e])`` runs in bfloat16. Build one with :meth:`from_float`.

    Attributes:
        experts: the per-expert weights, ``experts[e]`` [out, in].
    """

    experts: tuple[BF16Weight, ...]

    @staticmethod
    def __new__(cls, values: Tensor, experts: tuple[BF16Weight, ...]) -> BF16Experts:
        return cls.carrying(values, experts=experts)

    @classmethod
    def from_float(cls, weight: Tensor) -> BF16Experts:
        """Round stacked float weights [E, out, in] to bfloat16; each expert packed as a BF16Weight."""
        if not isinstance(weight, Tensor) or weight.dim() != 3 or not weight.is_floating_point():
            got = (
                f"{weight.dtype} {list(weight.shape)}"
                if isinstance(weight, Tensor)
                else type(weight).__name__
            )
            raise ValueError(f"weight must be floating-point stacked matrices [E, out, in]; got {got}")
        values = weight.detach().to(torch.bfloat16).to(torch.float32).contiguous()  # (E, out, in)
        experts = tuple(_expert_weight(values[e]) for e in range(values.shape[0]))
        return cls(values, experts)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"BF16Experts(shape={list(self.shape)}, bfloat16, read as float32)"

    def _deepcopied(self, values: Tensor) -> BF16Experts:
        return BF16Experts.from_float(values)

    def _pickled(self, values: Tensor) -> tuple[Any, tuple[Any, ...]]:
        return (BF16Experts.from_float, (values,))

    def _detached(self, values: Tensor) -> BF16Experts:
        return BF16Experts(values, self.experts)

    def _applies(self, x: Any, bias: Any) -> bool:
        return False  # a stacked weight is never F.linear's weight itself

    def _linear(self, x: Tensor, bias: Tensor | None) -> Tensor:
        raise NotImplementedError("F.linear takes one expert's weight: w[e]")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is Tensor.__getitem__ and type(args[0]) is cls and type(args[1]) is int:
            experts = args[0].experts
            return experts[args[1]]  # (out, in): a BF16Weight (IndexError out of range, as a tensor's)
        return super().__torch_function__(func, types, args, kwargs)


def _expert_weight(values: Tensor) -> BF16Weight:
    """Expert ``values`` [out, in] (bfloat16 numbers in float32) as a BF16Weight sharing them."""
    packed = None
    if cpu.use_onednn_bf16():
        packed = torch.ops.mkldnn._reorder_linear_weight(values.to(torch.bfloat16).contiguous(), 1)
    return BF16Weight(values, packed)


def is_bf16_experts(t: Any) -> bool:
    """Whether ``t`` is a :class:`BF16Experts`."""
    return isinstance(t, BF16Experts)


def _moes(model: nn.Module) -> list[tuple[Any, MixtureOfExperts]]:
    """(block, its mixture of experts) for every block of ``model`` that has one."""
    blocks = getattr(model, "blocks", ())
    return [(b, b.mlp) for b in blocks if isinstance(getattr(b, "mlp", None), MixtureOfExperts)]


def float32_router_params(model: nn.Module) -> list[nn.Parameter]:
    """The router parameters that stay float32 (unrounded) at bfloat16: DeepSeek's (the MoE blocks with
    latent attention): ``router.weight`` and ``score_bias``, as transformers keeps them."""
    kept: list[nn.Parameter] = []
    for block, moe in _moes(model):
        if getattr(block.attn, "latent", None) is not None:
            kept += [p for p in (moe.router.weight, moe.router.bias, moe.score_bias) if p is not None]
    return kept


def bf16_experts(model: nn.Module) -> None:
    """Convert every mixture of experts' stacked expert weights of ``model`` (rounded to bfloat16 before)
    to :class:`BF16Experts`, in place (module docstring)."""
    for _, moe in _moes(model):
        for name in EXPERT_WEIGHTS:
            w = getattr(moe, name)
            if not is_bf16_experts(w):
                setattr(moe, name, nn.Parameter(BF16Experts.from_float(w), requires_grad=False))
