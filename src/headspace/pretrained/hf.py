"""Reading and checking a Hugging Face checkpoint folder, shared by every architecture's converter.

Files are read with ``safetensors`` and ``json`` only (no ``transformers``). The config is checked against
what headspace can represent, the tensors against what the config implies: missing, unexpected and
mis-shaped tensors, non-float and NaN/Inf weights are errors that list the names and shapes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from safetensors.torch import load_file
from torch import Tensor, nn

from ..checks import nonfinite_count
from ..tokenization import TextTokenizer


def require_file(folder: Path, name: str, what: str) -> Path:
    path = folder / name
    if not path.is_file():
        present = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        raise FileNotFoundError(
            f"{folder} has no {name} ({what}); a Hugging Face checkpoint folder needs config.json and "
            f"model.safetensors (tokenizer.json optional). Files present: {present}"
        )
    return path


def checked_folder(folder: str | Path) -> Path:
    if not isinstance(folder, (str, Path)):
        raise TypeError(f"folder must be a str or pathlib.Path; got {type(folder).__name__}")
    path = Path(folder)
    if not path.is_dir():
        raise FileNotFoundError(f"folder {str(path)!r} does not exist or is not a directory")
    return path


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object; got {type(data).__name__}")
    return data


def read_tensors(path: Path) -> dict[str, Tensor]:
    try:
        tensors = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for bad files
        raise ValueError(f"{path} is not a readable safetensors file: {e}") from None
    return {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}


# ---------------------------------------------------------------------------------------------- checking
def check_tensors(
    tensors: dict[str, Tensor],
    expected: dict[str, tuple[int, ...]],
    ignorable: Callable[[str], bool],
    source: Path,
) -> list[str]:
    """Missing, unexpected and mis-shaped tensors -> one ValueError listing them; returns ignored names."""
    missing = [f"{k} {list(s)}" for k, s in expected.items() if k not in tensors]
    ignored = sorted(k for k in tensors if k not in expected and ignorable(k))
    unexpected = sorted(
        f"{k} {list(tensors[k].shape)}" for k in tensors if k not in expected and not ignorable(k)
    )
    mismatched = [
        f"{k}: expected {list(s)}, found {list(tensors[k].shape)}"
        for k, s in expected.items()
        if k in tensors and tuple(tensors[k].shape) != s
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): " + ", ".join(missing))
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): " + ", ".join(unexpected))
    if mismatched:
        problems.append(f"shape mismatches ({len(mismatched)}): " + "; ".join(mismatched))
    if problems:
        raise ValueError(f"{source} does not match its config.json:\n  " + "\n  ".join(problems))
    return ignored


def check_values(tensors: dict[str, Tensor], names: Sequence[str], source: Path) -> None:
    """The weights ``names`` must be floating point and finite -> one ValueError naming each bad tensor.

    Buffers the loaders ignore (e.g. ``embeddings.position_ids``, int64) are not in ``names``.
    """
    not_float = [f"{k} ({tensors[k].dtype})" for k in names if not tensors[k].is_floating_point()]
    if not_float:
        raise ValueError(
            f"{source}: weights must be floating point (float32, float16, bfloat16 or float64); "
            f"{len(not_float)} weight(s) are not: " + ", ".join(not_float)
        )
    problems = []
    for k in names:
        bad = nonfinite_count(tensors[k])
        if bad:
            problems.append(f"weight {k!r} has {bad} NaN/Inf values of {tensors[k].numel()}")
    if len(problems) == 1:
        raise ValueError(f"{source}: {problems[0]}")
    if problems:
        raise ValueError(
            f"{source}: {len(problems)} weights have NaN/Inf values:\n  " + "\n  ".join(problems)
        )


def strip_prefix(tensors: dict[str, Tensor], prefix: str, marker: str) -> dict[str, Tensor]:
    """Drop ``prefix`` (e.g. 'bert.') when the model's tensors carry it (task-head checkpoints do)."""
    if any(k.startswith(prefix + marker) for k in tensors):
        return {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in tensors.items()}
    return tensors


def config_problems(
    hf: dict[str, Any], rules: dict[str, Callable[[Any], bool]], defaults: dict[str, Any]
) -> None:
    bad = []
    for key, ok in rules.items():
        value = hf.get(key, defaults.get(key))
        if not ok(value):
            bad.append(f"{key}={value!r}")
    if bad:
        raise ValueError("config.json does not fit headspace: " + ", ".join(bad))


def load_converted(
    model: nn.Module,
    sd: dict[str, Tensor],
    tensors: dict[str, Tensor],
    load_attention: Callable[..., Any],
    prefix: str,
) -> None:
    """Everything but attention through ``load_state_dict``; each attention layer through its layout."""
    result = model.load_state_dict(sd, strict=False)
    attention = sorted(k for k in model.state_dict() if ".attn." in k)
    if result.unexpected_keys or sorted(result.missing_keys) != attention:  # a converter bug, not bad input
        raise RuntimeError(
            f"internal: converted weights left {sorted(set(result.missing_keys) - set(attention))} unset and "
            f"{result.unexpected_keys} unused"
        )
    for i, block in enumerate(model.blocks):
        load_attention(block.attn, tensors, prefix=prefix.format(i))


def open_folder(folder: str | Path) -> tuple[Path, dict[str, Any], Path]:
    """(the folder, its ``config.json`` as a dict, the path of its ``model.safetensors``), checked."""
    path = checked_folder(folder)
    hf = read_json(require_file(path, "config.json", "the model configuration"))
    return path, hf, require_file(path, "model.safetensors", "the weights")


def folder_tokenizer(path: Path, pad_id: int | None) -> TextTokenizer | None:
    """The folder's ``tokenizer.json`` as a :class:`~headspace.tokenization.TextTokenizer`, or None."""
    file = path / "tokenizer.json"
    return TextTokenizer(file, pad_id=pad_id) if file.is_file() else None
