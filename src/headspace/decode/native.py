"""The ``"native"`` backend: a :class:`~headspace.decode.step.DecodeStep` run by C++, every block in one call.

:func:`prepare` hands the description to ``torch.classes.headspace.DecodeStep`` (built and loaded by
:mod:`headspace.kernels.native`) one block at a time, by name (:func:`~headspace.decode.step.named_fields`:
``"qkv.weight"``, ``"norm1.eps"``, ...). The C++ step makes the same ATen calls as the ``"python"``
backend and the same single roundings in its elementwise loops, so its logits are the Python step's
bit for bit (tested). It covers float32 products (MKL-packed or not) and bfloat16 ones, RMSNorm and
LayerNorm, torch's SiLU, ReLU and GELU; a description with any other part (int8 weights, another norm
or activation) has no native form (:func:`native_form` is None) and takes the Python step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..kernels import native as library
from .kv_cache import KVCache
from .step import DecodeStep, NamedFields, named_fields


def native_form(step: DecodeStep) -> tuple[list[NamedFields], NamedFields | None] | None:
    """Each layer's fields and the final norm's, by name, as the C++ step reads them; None where some
    part has no native form."""
    layers = []
    for layer in step.layers:
        fields = named_fields(layer)
        if fields is None:
            return None
        layers.append(fields)
    final = None
    if step.final_norm is not None:
        final = named_fields(step.final_norm)
        if final is None:
            return None
    return layers, final


def prepare(step: DecodeStep) -> Callable[..., Tensor] | None:
    """The ``"native"`` backend: ``run(x, caches, start, cos, sin)`` (the signature of
    :mod:`headspace.decode.backends`), or None where the step has no native form or the library is not
    loaded (:func:`headspace.kernels.native.ready`)."""
    form = native_form(step)
    if form is None or not library.ready():
        return None
    layers, final = form
    obj = library.new_step()
    for fields in layers:
        obj.add_layer(*fields)
    if final is not None:
        obj.set_final_norm(*final)
    run_all = obj.run

    def run(
        x: Tensor, caches: Sequence[KVCache], start: int, cos: Tensor | None, sin: Tensor | None
    ) -> Tensor:
        if x.dtype != torch.float32 or not x.is_cpu:
            raise ValueError(f"the native step runs float32 CPU rows; got {x.dtype} on {x.device}")
        return run_all(x, [c.k for c in caches], [c.v for c in caches], start, cos, sin)

    return run
