"""Float32 tensors that carry a reduced-precision copy of themselves: the machinery behind the weights.

:class:`~headspace.kernels.bf16.BF16Weight` and :class:`~headspace.kernels.int8.Int8Weight` are float32
tensors (the values their layer really multiplies by, so views, per-head matrices and analyses read them
as any float32 tensor) that also carry the bfloat16 / int8 data in attributes. :class:`ReducedWeight` is
what the two share: the attributes survive ``copy.deepcopy`` (a Parameter stays a Parameter), pickling and
``Tensor.detach`` (which ``nn.Parameter(...)`` calls); ``F.linear(x, w, b)`` with such a ``w`` runs the
weight's kernel when it applies; every other operation sees the plain float32 tensor and returns plain
tensors.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["Carrier", "ReducedWeight", "plain_clone"]

_C = TypeVar("_C", bound="Carrier")


def plain_clone(t: Tensor) -> Tensor:
    """A clone of ``t``'s float32 values as a plain tensor (no subclass dispatch on the way)."""
    with torch._C.DisableTorchFunctionSubclass():
        return Tensor.clone(t)


class Carrier(Tensor):
    """A tensor subclass over float32 ``values`` whose extra data are plain attributes set at construction."""

    @classmethod
    def carrying(cls: type[_C], values: Tensor, **attrs: Any) -> _C:
        """``values`` (shared, not copied) as a ``cls``, with ``attrs`` set on it."""
        t = Tensor._make_subclass(cls, values, False)
        for name, value in attrs.items():
            setattr(t, name, value)
        return t

    def __init__(self, *args: Any) -> None:  # everything is set in __new__
        super().__init__()


class ReducedWeight(Carrier):
    """A weight [out, in] read as float32 that carries a reduced-precision copy and a kernel for it.

    A subclass says how to rebuild itself over new float32 values (:meth:`_deepcopied`, :meth:`_pickled`,
    :meth:`_detached`) and when and how its kernel runs (:meth:`_applies`, :meth:`_linear`).
    """

    def _deepcopied(self, values: Tensor) -> ReducedWeight:
        """The weight ``copy.deepcopy`` makes over ``values`` (a clone of this one's)."""
        raise NotImplementedError

    def _pickled(self, values: Tensor) -> tuple[Any, tuple[Any, ...]]:
        """``(callable, args)`` that rebuild this weight over ``values`` when unpickled."""
        raise NotImplementedError

    def _detached(self, values: Tensor) -> ReducedWeight:
        """This weight over ``values`` (its detached float32 tensor), sharing the reduced-precision data."""
        raise NotImplementedError

    def _applies(self, x: Any, bias: Any) -> bool:
        """Whether ``F.linear(x, self, bias)`` may run the kernel."""
        raise NotImplementedError

    def _linear(self, x: Tensor, bias: Tensor | None) -> Tensor:
        """The kernel: ``x self^T + bias``."""
        raise NotImplementedError

    def __deepcopy__(self, memo: dict) -> ReducedWeight:
        t = self._deepcopied(plain_clone(self))
        if getattr(self, "_is_param", False):
            t._is_param = True  # a Parameter stays a Parameter (copy.deepcopy of a module)
        memo[id(self)] = t
        return t

    def __reduce_ex__(self, protocol: int) -> Any:
        return self._pickled(plain_clone(self))

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and type(args[1]) is cls:
            x, bias = args[0], args[2] if len(args) > 2 else kwargs.get("bias")
            if args[1]._applies(x, bias):
                return args[1]._linear(x, bias)
        if func is Tensor.detach and type(args[0]) is cls:  # nn.Parameter(...) detaches: keep the type
            with torch._C.DisableTorchFunctionSubclass():
                values = Tensor.detach(args[0])
            return args[0]._detached(values)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
