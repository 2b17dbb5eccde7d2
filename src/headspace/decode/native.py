"""The ``"native"`` backend: a :class:`~headspace.decode.step.DecodeStep` run by C++, every block in one call.

:func:`prepare` hands the description to ``torch.classes.headspace.DecodeStep`` (built and loaded by
:mod:`headspace.kernels.native`) one block at a time, by name (:func:`~headspace.decode.step.named_fields`:
``"qkv.weight"``, ``"norm1.eps"``, ...). The C++ step makes the same ATen calls as the ``"python"``
backend and the same single roundings in its elementwise loops, so its logits are the Python step's
bit for bit (tested). It covers float32 products (MKL-packed or not) and bfloat16 ones, RMSNorm (any
offset: Gemma's ``1 + weight`` too) and LayerNorm, torch's SiLU, ReLU and GELU, and Gemma 3's and its
relatives' operations: QK-norm (over each head or over all heads), sliding windows (the windowed
cache written as its own ``append_one`` writes it, the window's mask passed to attention), per-layer
rotations and NoPE layers (each layer handed its own tables, the other rotaries' made per call as the
Python step makes them), sandwich and post-sublayer norms. A description with any other part (int8
weights, another norm or activation, the parallel or post layout) has no native form
(:func:`native_form` is None) and takes the Python step (asked for by name, :func:`prepare` refuses
ALiBi and the post layout by field name); so does a call with gradients enabled on a model with
windowed caches (their ``append_one`` then keeps the keys' history, which only the Python step does).

Notation used for tensor shapes:
    rotary_dim (the features of d_head a rotation turns).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..kernels import native as library
from ..nn.kv_cache import KVCache
from ..nn.spec import refuse_unsupported
from . import python
from .step import DecodeStep, NamedFields, named_fields

#: The block features (:func:`~headspace.nn.spec.features_of`) the C++ step computes.
# a parallel or post layer, chunks and the query temperature: Python only (step.PYTHON_ONLY)
NATIVE_FEATURES = ("window", "qk_norm", "layout", "chunk", "temperature")


def native_form(step: DecodeStep) -> tuple[list[NamedFields], NamedFields | None] | None:
    """Each layer's fields and the final norm's, by name, as the C++ step reads them; None where some
    part has no native form. A block description with a field the C++ step does not compute
    (:data:`NATIVE_FEATURES`) raises ``ValueError`` naming the field: it never falls back silently."""
    layers = []
    for layer in step.layers:
        if layer.alibi_slopes is not None or layer.softcap is not None:
            return None  # ALiBi, soft-capping: the Python step's only (:func:`prepare` refuses them by name)
        if layer.latent is not None or layer.moe is not None:  # latent attention, experts: the Python step's
            return None
        if layer.spec is not None:
            refuse_unsupported(layer.spec, "the native decoding step", NATIVE_FEATURES)
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
    for layer in step.layers:  # asked for by name: a field it lacks is refused by name
        python_only = layer.alibi_slopes is not None or layer.softcap is not None or layer.moe is not None
        if layer.spec is not None and python_only:
            refuse_unsupported(layer.spec, "the native decoding step", NATIVE_FEATURES)
        if layer.post:  # the post layout (OPT-350m): the Python step's only
            raise ValueError("the native decoding step does not support the block field 'layout' ('post')")
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
    tables = python.LayerTables(step)  # each layer's rotation tables, as the Python step's
    windowed = any(layer.window is not None for layer in step.layers)
    tensors = [t for fields in layers for t in fields[0].values()]  # what the keys' history could reach
    python_run: list[Callable[..., Tensor]] = []

    def run(
        x: Tensor, caches: Sequence[KVCache], start: int, cos: Tensor | None, sin: Tensor | None
    ) -> Tensor:
        if x.dtype != torch.float32 or not x.is_cpu:
            raise ValueError(f"the native step runs float32 CPU rows; got {x.dtype} on {x.device}")
        if windowed and (any(c._k_parts for c in caches) or _tracked(x, tensors)):
            # a windowed cache keeping its keys' history (KVCache._append_windowed): the Python step's
            if not python_run:
                python_run.append(python.prepare(step))
            return python_run[0](x, caches, start, cos, sin)
        per_layer = tables(x, start, cos, sin)
        held = [-1 if c.window is None else c.held for c in caches]  # a window's held positions
        return run_all(
            x,
            [c.k for c in caches],
            [c.v for c in caches],
            start,
            [t[0] for t in per_layer],
            [t[1] for t in per_layer],
            held,
        )

    return run


def _tracked(x: Tensor, tensors: list[Tensor]) -> bool:
    """Whether the new keys would carry autograd history (grad mode on, and the rows or a weight
    requiring it), as a windowed cache's ``append_one`` asks."""
    return torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in tensors))
