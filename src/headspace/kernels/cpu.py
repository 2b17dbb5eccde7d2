"""What this CPU's kernels can do, asked of torch and of the kernels themselves, and the fallbacks.

Every fast path of :mod:`headspace.kernels` is chosen here, never from ``/proc/cpuinfo`` strings. Each
name below is a fast path, when it runs, and its fallback (the same maths):

* ``bf16``: oneDNN's packed bfloat16 product, where ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``
  (which honours ``ONEDNN_MAX_CPU_ISA`` too); else a float32 GEMM on the bfloat16-rounded values, the
  result rounded to bfloat16.
* ``int8``: oneDNN's u8 x s8 product and ``torch._int_mm``, each where it sums a worst case exactly in
  int32 (:func:`int8_products_exact`; CPUs without VNNI sum pairs in saturating int16); else a float32
  GEMM of the same quantised activations by the dequantised weight.
* ``prepack``: MKL's packed GEMM where torch has it (:func:`mkl_packed_linear_available`); else the
  plain product.
* ``native``: the C++ decoding step once built; else the Python step (the same logits, bit for bit).
* ``q8_0``: the decoding step's unembedding from a matrix's exact Q8_0 blocks
  (:mod:`headspace.kernels.q8_0`) at the vector width ``torch.backends.cpu.get_cpu_capability()``
  reports, once the native library is built; else ``torch.mm`` on the float32 matrix (the same logits
  to float32 rounding).
* ``speculative``: an encoder-decoder's exact speculative greedy decoding with n-gram drafts
  (:mod:`headspace.model.encdec.speculative`; not CPU-dependent); else one token per decoding step.
* ``draft_model``: its drafts from the decoder's int8 copy (:mod:`headspace.model.encdec.draft_model`);
  else n-gram drafts only.
* ``denormals``: the Gated DeltaNet's chunked rule with denormal floats flushed to zero in the calling
  thread, where ``torch.set_flush_denormal`` can (:mod:`headspace.kernels.denormals`); else as they come.

Forcing a fallback, so that a CPU that has every fast path can test the others: the environment variable
``HEADSPACE_FORCE_FALLBACK`` (a comma-separated list of the names above, or ``all``), read at every
decision, or :func:`force_fallback` as a context manager. A bfloat16 weight converted while its fast
path is forced off holds no packed copy, and runs the fallback from then on.

:func:`report` is what the benchmarks print beside their tables: torch's own view of the CPU and the
branch each precision takes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator

import torch

__all__ = [
    "ENV",
    "FALLBACKS",
    "bf16_many_rows_in_float32",
    "force_fallback",
    "forced",
    "int8_products_exact",
    "mkl_packed_linear_available",
    "onednn_bf16_supported",
    "report",
    "use_onednn_bf16",
    "use_onednn_int8",
]

ENV = "HEADSPACE_FORCE_FALLBACK"
"""The environment variable that forces fallbacks: names from :data:`FALLBACKS`, comma-separated, or
``all``."""
FALLBACKS = ("bf16", "int8", "prepack", "native", "q8_0", "speculative", "draft_model", "denormals")
"""The fast paths that have a fallback (see the module docstring)."""

_local = threading.local()
#: The variables that make torch's kernels act as on a lesser CPU (oneDNN's ISA, ATen's dispatch, MKL's).
_EMULATION = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")


def _from_env() -> frozenset[str]:
    raw = os.environ.get(ENV, "")
    return _parse(raw)


@functools.lru_cache(maxsize=8)
def _parse(raw: str) -> frozenset[str]:
    names = {n.strip().lower() for n in raw.split(",") if n.strip()}
    if "all" in names:
        return frozenset(FALLBACKS)
    unknown = sorted(names - set(FALLBACKS))
    if unknown:
        raise ValueError(f"{ENV} must list names from {', '.join(FALLBACKS)} or 'all'; got {raw!r}")
    return frozenset(names)


_NAMES = frozenset(FALLBACKS)
_environ_get = os.environ.get


def forced(name: str) -> bool:
    """Whether the fallback of fast path ``name`` is forced (:data:`ENV` or :func:`force_fallback`).

    Read at every decision (it runs beside every reduced-precision product): one environment lookup,
    the parse cached per value of the variable."""
    if name not in _NAMES:
        raise ValueError(f"name must be one of {', '.join(FALLBACKS)}; got {name!r}")
    raw = _environ_get(ENV)
    if raw and name in _parse(raw):
        return True
    local = getattr(_local, "forced", None)
    return local is not None and name in local


@contextlib.contextmanager
def force_fallback(*names: str) -> Iterator[None]:
    """Run the block with the fallbacks of ``names`` (default: all of them) forced, in this thread."""
    chosen = frozenset(names or FALLBACKS)
    unknown = sorted(chosen - set(FALLBACKS))
    if unknown:
        raise ValueError(f"names must be from {', '.join(FALLBACKS)}; got {', '.join(unknown)}")
    before = getattr(_local, "forced", frozenset())
    _local.forced = before | chosen
    try:
        yield
    finally:
        _local.forced = before


# --------------------------------------------------------------------------------------------- bf16
@functools.lru_cache(maxsize=1)
def onednn_bf16_supported() -> bool:
    """Whether oneDNN runs bfloat16 products on this CPU (torch's own query; False without oneDNN)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def use_onednn_bf16() -> bool:
    """Whether bfloat16 products run on oneDNN's packed kernel now (supported, fallback not forced)."""
    return onednn_bf16_supported() and not forced("bf16")


@functools.lru_cache(maxsize=1)
def bf16_many_rows_in_float32() -> bool:
    """Whether many-row bfloat16 products (compute-bound) run faster as float32 GEMMs on the rounded
    values than on oneDNN's bfloat16 kernel, from ``torch.cpu.get_capabilities()``.

    True on Intel CPUs with AVX512-BF16 but no AMX (``vdpbf16ps`` runs at half the rate of float32
    FMAs there, so oneDNN's bfloat16 GEMM is slower than float32's); False with AMX, and on AMD CPUs
    (Zen 4's bfloat16 GEMM is faster than its float32 one). The measurements behind this rule are in
    docs/benchmarks.md ("Figures formerly in docstrings"). Where oneDNN has no bfloat16 kernel at all
    every row count runs in float32 (:func:`use_onednn_bf16`).
    """
    try:
        caps = torch.cpu.get_capabilities()
    except (AttributeError, RuntimeError):
        return False
    intel = "intel" in str(caps.get("cpu_name", "")).lower()
    return intel and bool(caps.get("avx512_bf16")) and not caps.get("amx_bf16")


# --------------------------------------------------------------------------------------------- int8
@functools.lru_cache(maxsize=1)
def int8_products_exact() -> tuple[bool, bool]:
    """Whether (oneDNN's u8 x s8 product, ``torch._int_mm``'s s8 x s8 product) sum exactly in int32.

    Asked of the kernels themselves, on the worst case for a CPU without VNNI: there both sum
    neighbouring pairs of products in saturating int16 (``vpmaddubsw``; 255 x 127 x 2 > 32767), and
    ``ONEDNN_MAX_CPU_ISA`` can lower oneDNN to such kernels on any CPU, which torch's CPU flags do not
    show. One small product of each kind, at 1 and 64 rows, once per process.
    """
    k, n = 64, 32
    onednn = intmm = True
    try:
        w = torch.full((n, k), 127, dtype=torch.int8)
        packed = torch.ops.onednn.qlinear_prepack(w, None)
        ones, zeros = torch.ones(n), torch.zeros(n, dtype=torch.long)
        for rows in (1, 64):
            xq = torch.full((rows, k), 255, dtype=torch.uint8)
            a = torch.ops.onednn.qlinear_pointwise(
                xq, 1.0, 0, packed, ones, zeros, None, 1.0, 0, torch.float32, "none", [], ""
            )  # (rows, n): sum_i 255 * 127
            onednn = onednn and bool((a == 255 * 127 * k).all())
    except (AttributeError, RuntimeError):
        onednn = False
    try:
        for rows in (1, 64):
            a = torch.full((rows, k), 127, dtype=torch.int8)
            b = torch.full((k, n), 127, dtype=torch.int8)
            intmm = intmm and bool((torch._int_mm(a, b) == 127 * 127 * k).all())
    except (AttributeError, RuntimeError):
        intmm = False
    return onednn, intmm


def use_onednn_int8() -> tuple[bool, bool]:
    """(oneDNN's u8 x s8 product, ``torch._int_mm``) each usable now: exact here, fallback not forced."""
    if forced("int8"):
        return False, False
    return int8_products_exact()


# ------------------------------------------------------------------------------------------ prepack
def mkl_packed_linear_available() -> bool:
    """Whether this torch has MKL's packed linear (``torch.ops.mkl._mkl_linear``: x86 builds with MKL)."""
    if not torch.backends.mkl.is_available():
        return False
    try:
        return bool(torch.ops.mkl._mkl_reorder_linear_weight) and bool(torch.ops.mkl._mkl_linear)
    except (AttributeError, RuntimeError):
        return False


# ------------------------------------------------------------------------------------------- report
def report() -> dict[str, object]:
    """torch's view of this CPU and the branch each fast path takes now: for benchmarks' tables."""
    caps: dict[str, object] = {}
    with contextlib.suppress(AttributeError, RuntimeError):
        caps = dict(torch.cpu.get_capabilities())
    onednn_i8, int_mm = use_onednn_int8()
    bf16 = "onednn" if use_onednn_bf16() else "float32 gemm on bfloat16 values"
    if use_onednn_bf16() and bf16_many_rows_in_float32():
        bf16 = "onednn (float32 gemm from 128 rows)"
    return {
        "cpu_name": caps.get("cpu_name"),
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn": torch.backends.mkldnn.is_available(),
        "mkl": torch.backends.mkl.is_available(),
        "avx512_vnni": caps.get("avx512_vnni"),
        "avx512_bf16": caps.get("avx512_bf16"),
        "amx_bf16": caps.get("amx_bf16"),
        "onednn_bf16": onednn_bf16_supported(),
        "forced_fallbacks": sorted(set(_from_env()) | set(getattr(_local, "forced", frozenset()))),
        "env": {k: os.environ[k] for k in _EMULATION if k in os.environ},
        "bf16_product": bf16,
        "int8_product": "onednn" if onednn_i8 else "float32 gemm of the quantised activations",
        "int8_few_rows": "torch._int_mm"
        if int_mm
        else "onednn"
        if onednn_i8
        else "float32 gemm of the quantised activations",
        "prepack": mkl_packed_linear_available() and not forced("prepack"),
    }
