"""A model's parameters without values: initialisation skipped on the meta device, CPU storage allocated
unwritten, and one cheap pass telling whether weights written in place are all finite floats.

Used by the converters that build a Decoder on the meta device and then assign or write the checkpoint's
weights (:mod:`headspace.pretrained.llama`: ``_build``, :func:`~headspace.pretrained.llama.empty_llama`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = ["SkipMetaInit", "all_finite_floats", "allocate_parameters"]


# what Decoder's initialisation calls: nn.init's functions and the in-place fills behind them
_INIT_FUNCTIONS = frozenset(
    f
    for n in dir(torch.nn.init)
    if n.endswith("_") and not n.startswith("_") and callable(f := getattr(torch.nn.init, n))
)
_INIT_METHODS = frozenset({Tensor.normal_, Tensor.uniform_, Tensor.zero_, Tensor.fill_})


class SkipMetaInit(TorchFunctionMode):
    """Initialisation of meta tensors skipped: they hold no values, and the loaded weights replace them.

    Not only wasted work: PyTorch runs a random init of a meta tensor through its Python reference
    implementation, whose first use imports ``torch._dynamo`` (about 1 s and 65 MiB resident, measured
    on SmolLM2's load).
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _INIT_FUNCTIONS or func in _INIT_METHODS:
            t = args[0] if args else kwargs.get("tensor")
            if isinstance(t, Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


def allocate_parameters(model: nn.Module) -> None:
    """Give every meta parameter of ``model`` CPU storage from ``torch.empty``: no value is written.

    Pages are touched only as the weights are written. (``Module.to_empty`` does the same but imports
    sympy on first use: 25 MiB resident.) Buffers are left as they are.
    """
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for n, p in list(module.named_parameters(recurse=False)):
            if id(p) not in made:
                made[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
            setattr(module, n, made[id(p)])


_SUM_CHUNK = 1 << 22  # values summed at a time when a narrower float is summed in float32 (16 MiB)


def all_finite_floats(tensors: Mapping[str, Tensor], names: list[str]) -> bool:
    """Whether every tensor ``names`` is floating point and finite: one sum per tensor, no copy.

    A NaN or Inf makes a floating-point sum NaN or Inf, so a finite sum means every value is finite; a
    sum that overflows (finite values summing past float32's range) only sends the caller to the exact
    checks, which name the culprits and pass a tensor that has none. A float32 tensor is summed in
    float32, which reads it once and allocates nothing (``sum(dtype=torch.float64)`` would first copy
    it to float64: 216 MiB for SmolLM2's embedding); a narrower float is summed in float32 a bounded
    slice at a time. This is several times faster than ``isfinite(t).all()``, which writes a mask.
    """
    for k in names:
        t = tensors[k]
        if not t.is_floating_point() or t.dtype == torch.float64:
            return False
        if not t.numel():
            continue
        if t.dtype == torch.float32:
            sums = [t.sum()]
        else:
            sums = [part.sum(dtype=torch.float32) for part in t.reshape(-1).split(_SUM_CHUNK)]
        if not all(bool(torch.isfinite(s)) for s in sums):
            return False
    return True
