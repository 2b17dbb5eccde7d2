"""Decoding: a Decoder's cached one-token step, written once, and the sampling loop around it.

The map:

* :class:`KVCache` (and :meth:`KVCache.stacked`: every layer's cache a slice of two buffers), the keys and
  values of the positions decoded so far, lives below the attention layer in :mod:`headspace.nn.kv_cache`
  (``headspace.decode.kv_cache`` is that module; ``headspace.decode.KVCache`` that class);
* :mod:`~headspace.decode.step`: :func:`describe`, the one function that reads a model's internals for
  decoding, and the frozen description it returns (:class:`DecodeStep` of :class:`LayerStep`, each
  :class:`Norm` and :class:`Product` a named field);
* :mod:`~headspace.decode.backends`: the registry (``"python"``, ``"native"``; one signature,
  :func:`register_backend`) and :class:`Stepper`, a step run by a chosen backend;
* :mod:`~headspace.decode.python` and :mod:`~headspace.decode.native`: the two backends (the C++ one
  built and loaded by :mod:`headspace.kernels.native`);
* :mod:`~headspace.decode.loop`: :func:`generate`, the sampling loop (:meth:`headspace.Decoder.generate`).

The package sits above the model (:mod:`headspace.model`): importing it registers :func:`generate` and
:func:`decode_plan` as what ``Decoder.generate`` and ``Decoder.decode_plan`` run
(:mod:`headspace.model.decoding`); the model never imports it.

What is exact: a step on either backend gives ``Decoder.forward``'s logits on one new token with the
caches, bit for bit (to float32 rounding with weights packed for MKL); see ``docs/design.md``.
"""

from ..model.decoding import Decoding, provide_decoding
from ..nn.kv_cache import KVCache
from .backends import Stepper, backend_names, decode_plan, get_backend, register_backend
from .loop import choose_pack_rows, generate, generation_caches, sample
from .step import DecodeStep, LayerStep, Norm, Product, describe, named_fields, product_weights

__all__ = [
    "DecodeStep",
    "KVCache",
    "LayerStep",
    "Norm",
    "Product",
    "Stepper",
    "backend_names",
    "choose_pack_rows",
    "decode_plan",
    "describe",
    "generate",
    "generation_caches",
    "get_backend",
    "named_fields",
    "product_weights",
    "register_backend",
    "sample",
]

provide_decoding(Decoding(generate=generate, plan=decode_plan))
