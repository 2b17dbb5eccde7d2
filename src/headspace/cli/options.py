"""Options every model command shares (``--model``, ``--precision``, ``--json``, ``--out``) and value checks.

The checks are click callbacks that raise :class:`~headspace.errors.UsageError`: one line on stderr,
exit code 2, naming the option, what came and what is valid.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from ..core.errors import UsageError

#: The seeds ``torch.manual_seed`` takes: a non-negative 64-bit signed integer.
MAX_SEED = 2**63 - 1


def _option_name(param: click.Parameter) -> str:
    opts = getattr(param, "opts", None) or [param.name or "value"]
    return max(opts, key=len)


def positive_int(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """A callback: the option's value, if given, must be >= 1."""
    if value is not None and value < 1:
        raise UsageError(f"{_option_name(param)} must be a positive integer (1 or more); got {value}")
    return value


def seed_value(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """A callback: a seed must lie in [0, 2**63 - 1], the range torch's generators take."""
    if value is not None and not 0 <= value <= MAX_SEED:
        raise UsageError(f"{_option_name(param)} must be in 0..{MAX_SEED} (2**63 - 1); got {value}")
    return value


#: The help of every command's ``--model``: what :func:`headspace.pretrained.load` accepts (kept here, not
#: read from the registry, so that --help needs no torch; a test checks it names every folder model type).
MODEL_HELP = (
    "'minilm' (all-MiniLM-L6-v2, an encoder), 'smollm2' (SmolLM2-135M-Instruct, a decoder), 'gemma3' or "
    "'gemma3-270m' (Gemma-3-270M, a decoder), a folder holding a Hugging Face checkpoint (config.json + "
    "model.safetensors: the encoders BERT, RoBERTa, XLM-RoBERTa, CamemBERT and ModernBERT; the decoders "
    "GPT-2, Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Gemma 4, Gemma 3n, OLMo 2, SmolLM3, Phi-3, "
    "Gemma, Granite, OLMo, OLMo 3, EXAONE 4, Seed-OSS, GPT-NeoX, StableLM, Cohere, Phi-2, GPT-J, OPT, "
    "GPT-Neo, GPT-BigCode, BLOOM, Falcon, MPT, DiffLlama, DeepSeek V2 and V3, the mixtures of experts "
    "Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss and Llama 4, or the hybrids Qwen3-Next and Qwen3.5), "
    "or a .gguf file (Llama family, Gemma 3, and the GGUF architectures of these families). T5, BART, "
    "Marian and Whisper folders and 'whisper-base' (Whisper base, from its CTranslate2 file) load in Python "
    "(headspace.load); of the commands, explain, patch, attribute, why and atlas (sentences, or WAV files "
    "for Whisper) and align (Whisper) run encoder-decoders."
)


def model_choice_option(
    default: str | None, *, dest: str = "model_spec", needs: str = ""
) -> Callable[[Any], Any]:
    """``--model NAME | FOLDER | FILE.gguf`` into ``dest``, with :data:`MODEL_HELP` (and what the command
    ``needs``, e.g. a decoder); ``default`` None: no default (the command reads something else then)."""
    return click.option(
        "--model",
        dest,
        default=default,
        show_default=default is not None,
        metavar="MODEL",
        help=MODEL_HELP + (f" {needs}" if needs else ""),
    )


model_option = model_choice_option("minilm")
#: ``--model`` of the commands that read logits (patch, attribute, generate): default smollm2.
decoder_model_option = model_choice_option(
    "smollm2", needs="This command needs a decoder (smollm2, gemma3, GPT-2, Llama, Mistral, Qwen2)."
)
#: The --help epilog of the commands that print tokens: how :func:`headspace.tokenization.readable_token`
#: shows them (kept here so that --help needs no torch; a test holds the two together).
TOKENS_HELP = (
    "Tokens are printed as their text, a space shown as ␣ (byte-level BPE's Ġ, SentencePiece's ▁), a "
    "newline as ↵, a tab as ⇥, other invisible characters and the bytes of an incomplete character as "
    "escapes (\\xa0, \\xc3); --json gives the strings the Python API gives."
)

json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print the numbers as JSON instead of tables."
)
out_option = click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder for PNG pictures (created if needed).",
)


#: The model precisions (:data:`headspace.models.PRECISIONS`, kept here so --help needs no torch).
MODEL_PRECISIONS = ("float32", "bfloat16", "int8")


def precision_value(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """A callback: a model precision must be one of :data:`MODEL_PRECISIONS` (one line, exit 2)."""
    if value is not None and value not in MODEL_PRECISIONS:
        valid = ", ".join(MODEL_PRECISIONS)
        name = "--precision" if "--precision" in (getattr(param, "opts", None) or []) else _option_name(param)
        raise UsageError(f"{name} must be one of {valid}; got {value!r}")
    return value


_PRECISION_HELP = (
    "The model's precision: float32 (exact), bfloat16, or int8 (int8 weights, activations quantised "
    "per token); patterns and reported numbers stay float32."
)


def _precision_option(*flags: str) -> Any:
    """A click option choosing the model's precision, spelled ``flags``, into ``model_precision``."""
    return click.option(
        *flags,
        "model_precision",
        default="float32",
        show_default=True,
        callback=precision_value,
        metavar="[" + "|".join(MODEL_PRECISIONS) + "]",
        help=_PRECISION_HELP,
    )


#: ``--precision`` / ``--model-precision`` on every command that runs a model (``view`` takes only
#: ``--model-precision``: its ``--precision`` is the page's stored numbers).
precision_option = _precision_option("--precision", "--model-precision")
model_precision_option = _precision_option("--model-precision")


def choice_option(
    *param_decls: str, choices: Sequence[str], default: str | None, help: str | None = None
) -> Callable[[Any], Any]:
    """``--name`` taking one of ``choices`` (click lists them in --help and refuses the rest), its default
    shown."""
    return click.option(
        *param_decls,
        type=click.Choice(list(choices)),
        default=default,
        show_default=default is not None,
        help=help,
    )


#: ``--max-memory`` of ``patch``, ``attribute`` and ``circuit`` (the API's ``max_memory=``).
max_memory_option = click.option(
    "--max-memory", "max_memory", default=None, metavar="SIZE",
    help="Refuse a run whose estimated peak memory is above SIZE (e.g. 8G, 512M; default: "
    "$HEADSPACE_MAX_MEMORY, else the memory available now).",
)  # fmt: skip


def checked_memory(max_memory: str | None) -> str | None:
    """``--max-memory`` checked before the model loads (a size such as ``8G``; None: the default); a bad
    size is a ``ValueError`` naming the option, which the command line's one error path reports."""
    if max_memory is not None:
        from ..analysis.causal.budget import parse_memory

        parse_memory(max_memory, "--max-memory")
    return max_memory
