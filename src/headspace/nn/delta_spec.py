"""The description of a Gated DeltaNet layer (the linear-attention layers of Qwen3-Next and Qwen3.5):
:class:`DeltaNetSpec`, the ``delta_net`` field of a :class:`~headspace.nn.spec.BlockSpec` whose
``mixer`` is ``"gated_deltanet"``. The maths is :class:`headspace.attention.delta_net.GatedDeltaNet`'s."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.checks import is_int, is_number


def _fail(name: str, expected: str, value: object) -> ValueError:
    return ValueError(f"DeltaNetSpec.{name} must be {expected}; got {value!r}")


@dataclass(frozen=True)
class DeltaNetSpec:
    """A Gated DeltaNet layer on a residual stream of width ``d_model``: ``n_k_heads`` query/key heads of
    width ``d_k``, ``n_v_heads`` value heads of width ``d_v`` (``n_k_heads`` divides ``n_v_heads``: each
    query/key head serves ``n_v_heads / n_k_heads`` consecutive value heads), a causal depthwise
    convolution of ``conv_kernel`` taps over q, k and v, and the gated RMSNorm's ``norm_eps``."""

    d_model: int
    n_k_heads: int
    n_v_heads: int
    d_k: int
    d_v: int
    conv_kernel: int = 4
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("d_model", "n_k_heads", "n_v_heads", "d_k", "d_v", "conv_kernel"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise _fail(name, "a positive int", value)
        if self.n_v_heads % self.n_k_heads:
            raise _fail("n_v_heads", f"a multiple of n_k_heads={self.n_k_heads}", self.n_v_heads)
        if not is_number(self.norm_eps) or not 0 < self.norm_eps < math.inf:
            raise _fail("norm_eps", "a finite positive float", self.norm_eps)

    @property
    def conv_dim(self) -> int:
        """The channels of the convolution: q, k and v concatenated, ``2 n_k_heads d_k + n_v_heads d_v``."""
        return 2 * self.n_k_heads * self.d_k + self.n_v_heads * self.d_v
