"""The decoding step's kernel policy, decided in one place: packing, the Q8_0 unembedding and the rows.

The choice is made from a model's description (:class:`StepProducts`: every block's
:class:`~headspace.nn.spec.BlockSpec`, the vocabulary, whether the products are plain float32 CPU
matrices) and from this CPU's capabilities and forced fallbacks (:mod:`headspace.kernels.cpu`,
:mod:`headspace.kernels.prepack`, :mod:`headspace.kernels.q8_0`), never from a model's modules.
:func:`choose_kernels` answers for one ``generate`` call (:class:`KernelChoice`):

* ``pack_rows``: every float32 product packed for MKL's GEMM at the batch (:func:`pack_rows`):
  ``prepack`` True packs (refused where torch has no MKL packed linear), False never, None where it
  pays and fits (:func:`~headspace.kernels.prepack.pays_to_pack`: batch >= 2, at least
  :data:`~headspace.kernels.prepack.MIN_PACK_BYTES` of float32 weights, their copy within half the
  available memory, the ``prepack`` fallback not forced);
* ``unembed_q8``: at most :data:`~headspace.kernels.q8_0.MAX_ROWS` rows, the unembedding is multiplied
  from its Q8_0 blocks where it is exactly them (:func:`unembed_q8`: ``q8_0_mm`` available at a vector
  width, a float32 unembedding without bias of at least ``MIN_PACK_BYTES``, the ``q8_0`` fallback not
  forced);
* ``unembed_rows``: at batch 1 with ``prepack`` None, else where the unembedding is not Q8_0 blocks, the
  unembedding alone packed for one row (:func:`unembed_rows`: a float32 unembedding that pays to pack).

Each choice needs every block's decoding step (``StepProducts.stepped``): without one nothing steps,
and nothing is packed for it (``prepack=True`` excepted: the caller asked). ``HEADSPACE_FORCE_FALLBACK``
(``prepack``, ``q8_0``) is read at every decision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..nn.spec import BlockSpec
from . import cpu, prepack, q8_0
from . import native as library

#: bytes of one float32 weight element (the only kind the policy packs or reads as Q8_0 blocks)
_FLOAT32_BYTES = 4


@dataclass(frozen=True)
class StepProducts:
    """What the kernel policy reads of a decoder: its description, not its modules.

    ``blocks``: every block's description; ``vocab_size`` and ``d_model`` shape the unembedding
    [vocab_size, d_model]; ``float32``: the products' weights are plain float32 CPU matrices (a
    ``"float32"`` model on the CPU: bfloat16 and int8 carriers run their own kernels);
    ``unembed_bias``: the unembedding adds a bias; ``stepped``: every block has its decoding step."""

    blocks: tuple[BlockSpec, ...]
    vocab_size: int
    d_model: int
    float32: bool
    unembed_bias: bool = False
    stepped: bool = True

    @property
    def unembed_bytes(self) -> int:
        """The float32 unembedding's bytes (0 where the products are not float32)."""
        return self.vocab_size * self.d_model * _FLOAT32_BYTES if self.float32 else 0

    @property
    def weight_bytes(self) -> int:
        """The float32 bytes of every weight a step multiplies by: per block the fused QKV
        [(n_heads + 2 n_kv_heads) d_head, d_model], W_O [d_model, n_heads d_head] and the MLP's
        (gate,) in [d_mlp, d_model] and out [d_model, d_mlp]; then the unembedding. 0 where the
        products are not float32."""
        if not self.float32:
            return 0
        elements = 0
        for spec in self.blocks:
            a, m = spec.attention, spec.mlp
            elements += (a.n_heads + 2 * a.n_kv_heads) * a.d_head * a.d_model  # W_QKV
            elements += a.n_heads * a.d_head * a.d_model  # W_O
            elements += (3 if m.kind == "gated" else 2) * m.d_mlp * a.d_model  # (gate,) in, out
        return elements * _FLOAT32_BYTES + self.unembed_bytes


@dataclass(frozen=True)
class KernelChoice:
    """The kernels of one ``generate`` call's step: ``pack_rows`` (every float32 product packed for
    that batch), ``unembed_q8`` (the unembedding from its exact Q8_0 blocks, where it is them) and
    ``unembed_rows`` (else, and without ``pack_rows``, the unembedding alone packed for that batch);
    None / False: none."""

    pack_rows: int | None = None
    unembed_q8: bool = False
    unembed_rows: int | None = None


def choose_kernels(
    products: StepProducts, batch: int, prepack_option: bool | None, *, q8: bool = True
) -> KernelChoice:
    """The kernels for ``batch`` rows (module docstring); ``prepack_option`` is ``generate``'s
    ``prepack``; ``q8`` False never reads the unembedding as Q8_0 blocks (``use_cache=False``)."""
    rows = pack_rows(products, batch, prepack_option)
    blocks = q8 and unembed_q8(products, batch)
    unembed = unembed_rows(products, batch, prepack_option) if rows is None else None
    return KernelChoice(rows, blocks, unembed)


def pack_rows(products: StepProducts, batch: int, prepack_option: bool | None) -> int | None:
    """The rows to pack every float32 product for (None: no packing). ``prepack_option`` None chooses
    (batch >= 2 and :func:`~headspace.kernels.prepack.pays_to_pack` of :attr:`StepProducts.weight_bytes`,
    every block stepped); True packs (a ValueError where this torch has no MKL packed linear); False
    never packs; anything else is a TypeError."""
    if prepack_option is None:
        if batch < 2 or not products.stepped:
            return None
        return batch if prepack.pays_to_pack(products.weight_bytes) else None
    if not isinstance(prepack_option, bool):
        raise TypeError(
            f"prepack must be None (choose), True or False; got {type(prepack_option).__name__} "
            f"{prepack_option!r}"
        )
    if not prepack_option:
        return None
    if not prepack.prepack_available():
        mkl = torch.backends.mkl.is_available()
        raise ValueError(
            "prepack=True needs torch's MKL packed linear (torch.ops.mkl._mkl_linear, x86 builds with "
            f"MKL); this torch has none (torch.backends.mkl.is_available()={mkl})"
        )
    return batch


def unembed_rows(products: StepProducts, batch: int, prepack_option: bool | None) -> int | None:
    """At batch 1 with ``prepack_option`` None, the rows to pack the unembedding alone for (1), or
    None: a float32 unembedding that pays to pack (:func:`~headspace.kernels.prepack.pays_to_pack`),
    every block stepped. ``prepack_option`` True or False is :func:`pack_rows`' to answer."""
    if batch != 1 or prepack_option is not None or not products.stepped or not products.float32:
        return None
    return 1 if prepack.pays_to_pack(products.unembed_bytes) else None


def unembed_q8(products: StepProducts, batch: int) -> bool:
    """Whether the step multiplies the unembedding from its Q8_0 blocks where it is exactly them: at
    most :data:`~headspace.kernels.q8_0.MAX_ROWS` rows, the ``q8_0`` fallback not forced, a vector
    width (AVX2 or AVX512, as torch reports the CPU), every block stepped, a float32 unembedding
    without bias of at least :data:`~headspace.kernels.prepack.MIN_PACK_BYTES` (smaller ones stay in
    the caches: their steps stay bit for bit ``forward``'s), and ``q8_0_mm`` loaded (the native
    library is built, in the background, on the way)."""
    if batch > q8_0.MAX_ROWS or cpu.forced("q8_0") or q8_0.simd_level() < 1:
        return False
    if not products.stepped or products.unembed_bias or not products.float32:
        return False
    if products.unembed_bytes < prepack.MIN_PACK_BYTES:
        return False
    library.start_build()  # finds a finished build at once (else builds it in the background)
    return q8_0.q8_0_available()
