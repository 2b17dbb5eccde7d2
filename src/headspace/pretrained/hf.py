"""Reading and checking a Hugging Face checkpoint folder, shared by every architecture's converter.

Files are read with ``safetensors`` and ``json`` only (no ``transformers``). A model folder is untrusted
input, so everything is checked before anything large is built:

* files: only regular files are read (``os.stat`` + ``S_ISREG`` after resolving symbolic links, so a
  FIFO cannot hang the reader and a link to ``/dev/zero`` cannot fill memory); JSON files
  (``config.json``, ``sentence_bert_config.json``) are capped at :data:`MAX_JSON_BYTES`, the
  ``tokenizer.json`` by :mod:`headspace.tokenization`;
* config fields: every field a converter reads is checked for type and range (:class:`ConfigFields`),
  naming the field (``tie_word_embeddings: "false"`` is an error, not a true value);
* weights: the safetensors header is parsed by :func:`safetensors_header` (in :mod:`.safetensors_file`,
  re-exported here: an 8-byte little-endian length, at most :data:`MAX_HEADER_BYTES` and no more than
  the file holds, then JSON; every tensor's dtype known and its ``data_offsets`` inside the file and
  matching its shape). The parameter count the
  config implies is compared with what the header holds (:func:`check_parameter_count`) before the
  expected tensors are even listed, so a 600-byte config claiming a million layers is refused at once;
  then names, shapes and dtypes are checked from the header (:func:`check_tensors`, :func:`check_dtypes`),
  and only then are the needed tensors read, one at a time (``safe_open``), converted to float32 and
  checked for NaN/Inf (:func:`load_tensors`).

Every error is a ``ValueError`` (``FileNotFoundError`` for a missing file) that names the file and the
problem; a report of several problems has a summary as its first line and reads well with its lines
joined by ``"; "`` (as the CLI prints it).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn

from ..core.checks import is_int, is_number, nonfinite_count
from ..core.fileio import UnsafeFileError, file_kind, parse_json, read_regular_file
from ..model.config import ModelConfig
from .safetensors_file import MAX_HEADER_BYTES as MAX_HEADER_BYTES  # re-exported: the header is read there
from .safetensors_file import SafetensorsHeader, TensorEntry, safetensors_header
from .tokenization import TextTokenizer

#: ``config.json`` and other JSON files of a folder larger than this are refused unread.
MAX_JSON_BYTES = 64 << 20
#: At most this many names are listed per kind of problem (the count is always given).
MAX_LISTED = 20


# ---------------------------------------------------------------------------------------------- files
def _listing(folder: Path, limit: int = MAX_LISTED) -> list[str]:
    if not folder.is_dir():
        return []
    names = sorted(p.name for p in itertools.islice(folder.iterdir(), 1000))
    return names[:limit] + ([f"... ({len(names) - limit} more)"] if len(names) > limit else [])


def _refuse_non_regular(path: Path, what: str) -> None:
    """``path`` exists (maybe as a dangling link); it must be a regular file once links are resolved."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        target = os.readlink(path) if os.path.islink(path) else "?"
        raise ValueError(f"{path} ({what}) is a symbolic link to {target}, which does not exist") from None
    except OSError as e:
        raise ValueError(f"{path} ({what}) cannot be examined: {e}") from None
    if not stat.S_ISREG(st.st_mode):
        link = f" (a symbolic link to {os.path.realpath(path)})" if os.path.islink(path) else ""
        raise UnsafeFileError(
            f"{path} ({what}) is {file_kind(st.st_mode)}{link}, not a regular file; only regular "
            "files are read"
        )


def require_file(folder: Path, name: str, what: str) -> Path:
    """``folder / name``, which must exist and be a regular file (links resolved); errors name it."""
    path = folder / name
    if not os.path.lexists(path):
        raise FileNotFoundError(
            f"{folder} has no {name} ({what}); a Hugging Face checkpoint folder needs config.json and "
            f"model.safetensors (tokenizer.json optional). Files present: {_listing(folder)}"
        )
    _refuse_non_regular(path, what)
    return path


def optional_file(folder: Path, name: str, what: str) -> Path | None:
    """``folder / name`` when present (then it must be a regular file), else None."""
    path = folder / name
    if not os.path.lexists(path):
        return None
    _refuse_non_regular(path, what)
    return path


def checked_folder(folder: str | Path) -> Path:
    if not isinstance(folder, (str, Path)):
        raise TypeError(f"folder must be a str or pathlib.Path; got {type(folder).__name__}")
    path = Path(folder)
    if not path.is_dir():
        raise FileNotFoundError(f"folder {str(path)!r} does not exist or is not a directory")
    return path


def read_json(path: Path, *, max_bytes: int | None = None) -> dict[str, Any]:
    """A JSON object from a regular file of at most ``max_bytes`` (None: :data:`MAX_JSON_BYTES`).

    ``ValueError`` naming the file for anything else: not a regular file, too large, not UTF-8 JSON (or
    nested too deeply), not an object.
    """
    max_bytes = MAX_JSON_BYTES if max_bytes is None else max_bytes
    try:
        data = parse_json(read_regular_file(path, max_bytes=max_bytes))
    except UnsafeFileError as e:
        raise UnsafeFileError(f"{e} (a JSON file here may hold at most {max_bytes} bytes)") from None
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object; got {type(data).__name__}")
    return data


# ---------------------------------------------------------------------------------------------- config fields
_REQUIRED = object()


class ConfigFields:
    """Typed, range-checked reads of a ``config.json`` dict; every error names the file and the field.

    ``ConfigFields(hf).integer("num_hidden_layers")`` returns an int >= 1 or raises ``ValueError``
    (``config.json: num_hidden_layers must be an int >= 1; got '12' (str)``). A field that is absent
    takes its default; a field that is required has none (:meth:`require` lists every absent one at once).
    """

    def __init__(self, hf: Mapping[str, Any], source: str = "config.json") -> None:
        self.hf = hf
        self.source = source

    def _fail(self, key: str, want: str, value: Any) -> ValueError:
        return ValueError(f"{self.source}: {key} must be {want}; got {value!r:.80} ({type(value).__name__})")

    def _get(self, key: str, default: Any) -> Any:
        if key in self.hf:
            return self.hf[key]
        if default is _REQUIRED:
            raise ValueError(f"{self.source} lacks the field {key!r}")
        return default

    def require(self, keys: Sequence[str], what: str) -> None:
        absent = [k for k in keys if k not in self.hf]
        if absent:
            raise ValueError(f"{self.source} lacks the {what} fields {absent}")

    def integer(
        self,
        key: str,
        default: Any = _REQUIRED,
        *,
        minimum: int = 1,
        maximum: int | None = None,
        allow_none: bool = False,
    ) -> Any:
        value = self._get(key, default)
        if value is None and allow_none:
            return None
        want = f"an int >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
        if allow_none:
            want += " (or null)"
        if not is_int(value) or value < minimum or (maximum is not None and value > maximum):
            raise self._fail(key, want, value)
        return value

    def number(
        self,
        key: str,
        default: Any = _REQUIRED,
        *,
        low: float,
        high: float = math.inf,
        low_open: bool = False,
        high_open: bool = True,
    ) -> float:
        value = self._get(key, default)
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        ok = is_number(value) and math.isfinite(value)
        ok = (
            ok
            and (value > low if low_open else value >= low)
            and (value < high if high_open else value <= high)
        )
        if not ok:
            raise self._fail(key, f"a finite number in {interval}", value)
        return float(value)

    def probability(self, key: str, default: Any = _REQUIRED) -> float:
        """A dropout probability: a number in [0, 1)."""
        return self.number(key, default, low=0.0, high=1.0)

    def flag(self, key: str, default: Any = _REQUIRED) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self._fail(key, "true or false (a JSON boolean, not a string or number)", value)
        return value

    def text(self, key: str, default: Any = _REQUIRED, *, allow_none: bool = False) -> Any:
        value = self._get(key, default)
        if value is None and allow_none:
            return None
        if not isinstance(value, str):
            raise self._fail(key, "a string" + (" (or null)" if allow_none else ""), value)
        return value


def config_problems(
    hf: Mapping[str, Any],
    rules: dict[str, Callable[[Any], bool]],
    defaults: dict[str, Any],
    source: str = "config.json",
) -> None:
    """The fields ``rules`` must accept (absent ones take ``defaults``) -> one ValueError listing the rest.

    A value a rule cannot even test (a list where a name is expected) counts as refused. The message
    begins with ``source`` (the file's path, when known).
    """
    bad = []
    for key, ok in rules.items():
        value = hf.get(key, defaults.get(key))
        try:
            accepted = bool(ok(value))
        except TypeError:  # e.g. an unhashable list tested for membership
            accepted = False
        if not accepted:
            bad.append(f"{key}={value!r:.80}")
    if bad:
        raise ValueError(f"{source} does not fit headspace: " + ", ".join(bad))


def config_fields(hf: Any, source: str = "config.json") -> ConfigFields:
    """:class:`ConfigFields` over ``hf``, the ``config.json`` dict (TypeError otherwise), ``model_type`` read.

    The first read of every converter: ``model_type`` must be a string or null (whether it is the
    architecture's is up to :func:`refuse_unsupported`, after the architecture's own reads). ``source``
    begins every message (a loader passes the file's full path, so the message names the folder).
    """
    if not isinstance(hf, dict):
        raise TypeError(f"hf must be the config.json dict; got {type(hf).__name__}")
    f = ConfigFields(hf, source)
    f.text("model_type", None, allow_none=True)
    return f


def refuse_unsupported(
    f: ConfigFields, model_type: str, rules: dict[str, Callable[[Any], bool]], defaults: dict[str, Any]
) -> None:
    """:func:`config_problems` for one architecture: its ``model_type``, its ``rules``, no cross-attention.

    ``model_type`` may also be absent; ``add_cross_attention`` is first read as a boolean. The refused
    fields are listed in that order (``model_type``, the ``rules``, ``add_cross_attention``).
    """
    f.flag("add_cross_attention", False)
    every = {"model_type": lambda v: v in (None, model_type), **rules, "add_cross_attention": lambda v: not v}
    config_problems(f.hf, every, defaults, f.source)


def config_sizes(f: ConfigFields, width: str, heads: str, pad_default: int | None) -> dict[str, Any]:
    """The sizes every converter reads, checked: :class:`~headspace.ModelConfig` keyword arguments.

    ``vocab_size``; ``d_model`` from the field ``width`` and ``n_heads`` from ``heads``, which must divide
    it; ``pad_token_id`` (default ``pad_default``; null allowed), which must be below ``vocab_size``.
    """
    vocab_size = f.integer("vocab_size")
    d_model, n_heads = f.integer(width), f.integer(heads)
    if d_model % n_heads:
        raise ValueError(
            f"{f.source}: {width}={d_model} must be divisible by {heads}={n_heads} "
            f"(head size {d_model / n_heads:g})"
        )
    pad_token_id = f.integer("pad_token_id", pad_default, minimum=0, allow_none=True)
    if pad_token_id is not None and pad_token_id >= vocab_size:
        raise ValueError(f"{f.source}: pad_token_id must be < vocab_size={vocab_size}; got {pad_token_id}")
    return {"vocab_size": vocab_size, "d_model": d_model, "n_heads": n_heads, "pad_token_id": pad_token_id}


@contextmanager
def fitting_headspace(source: str = "config.json") -> Iterator[None]:
    """A ``ValueError`` inside (a field read, :class:`~headspace.ModelConfig`'s own checks) becomes
    ``"{source} does not fit headspace: ..."``."""
    try:
        yield
    except ValueError as e:
        raise ValueError(f"{source} does not fit headspace: {e}") from None


def _counted(n: int, what: str) -> str:
    return f"{n:,} {what}{'' if n == 1 else 's'}"


def check_parameter_count(
    implied_values: int,
    implied_tensors: int,
    header: SafetensorsHeader,
    fields: str,
    config_source: str = "config.json",
) -> str | None:
    """Compare what the config implies with what the file holds, from the header alone.

    Returns None when the file holds at least as many values and tensors as the config implies (extra
    tensors may be ignorable), else a one-line summary naming both counts, the config (``config_source``:
    its path, when it is a file) and ``fields`` (the config values behind them). When building the list of
    expected tensors would be out of proportion to the file (more than ``2 * tensors + 64``), raises
    ``ValueError`` with that summary at once.
    """
    held, held_tensors = header.n_values, len(header.tensors)
    if implied_values <= held and implied_tensors <= held_tensors:
        return None
    summary = (
        f"{config_source} ({fields}) implies {_counted(implied_values, 'parameter')} in "
        f"{_counted(implied_tensors, 'tensor')}, but {header.path} holds {_counted(held, 'value')} in "
        f"{_counted(held_tensors, 'tensor')}: the config does not describe these weights"
    )
    if implied_tensors > 2 * held_tensors + 64:
        raise ValueError(summary)
    return summary


def parameter_count(shapes: Iterable[tuple[int, ...]]) -> int:
    """Elements in tensors of these shapes (exact Python ints: no overflow)."""
    return sum(math.prod(s) for s in shapes)


def layered_count(
    base: Mapping[str, tuple[int, ...]], layer: Mapping[str, tuple[int, ...]], n_layers: int
) -> tuple[int, int]:
    """(parameters, tensors) of the tensors ``base`` plus ``n_layers`` layers of the tensors ``layer``.

    By arithmetic from one layer's shapes: a config claiming a million layers is counted without listing
    them.
    """
    n_params = parameter_count(base.values()) + n_layers * parameter_count(layer.values())
    return n_params, len(base) + n_layers * len(layer)


def config_values(config: ModelConfig, fields: Mapping[str, str]) -> str:
    """``"key=value, ..."`` for each ``config.json`` key of ``fields`` and the ModelConfig attribute it
    became (values as JSON writes them: ``tie_word_embeddings=true``), for messages."""
    return ", ".join(f"{key}={json.dumps(getattr(config, attr))}" for key, attr in fields.items())


def linear_shapes(name: str, n_out: int, n_in: int) -> dict[str, tuple[int, ...]]:
    """The tensors of one ``nn.Linear`` layout: ``{name}.weight`` [n_out, n_in], ``{name}.bias`` [n_out]."""
    return {f"{name}.weight": (n_out, n_in), f"{name}.bias": (n_out,)}


def conv1d_shapes(name: str, n_in: int, n_out: int) -> dict[str, tuple[int, ...]]:
    """GPT-2's ``Conv1D`` layout, the transpose of a linear one: weight [n_in, n_out], bias [n_out]."""
    return {f"{name}.weight": (n_in, n_out), f"{name}.bias": (n_out,)}


def norm_shapes(name: str, d: int) -> dict[str, tuple[int, ...]]:
    """A LayerNorm's tensors: ``{name}.weight`` and ``{name}.bias``, [d] each."""
    return {f"{name}.weight": (d,), f"{name}.bias": (d,)}


def embedding_shapes(c: ModelConfig, tokens: str, positions: str) -> dict[str, tuple[int, ...]]:
    """The token table [vocab_size, d_model] and the learned position table [max_seq_len, d_model]."""
    return {tokens: (c.vocab_size, c.d_model), positions: (c.max_seq_len, c.d_model)}


# ---------------------------------------------------------------------------------------------- checking
def _listed(items: Sequence[str], sep: str = ", ") -> str:
    shown = sep.join(items[:MAX_LISTED])
    return shown + (f"{sep}... ({len(items) - MAX_LISTED} more)" if len(items) > MAX_LISTED else "")


def check_tensors(
    tensors: Mapping[str, Any],
    expected: dict[str, tuple[int, ...]],
    ignorable: Callable[[str], bool],
    source: Path,
    *,
    summary: str | None = None,
) -> list[str]:
    """Missing, unexpected and mis-shaped tensors -> one ValueError listing them; returns ignored names.

    ``tensors`` maps names to anything with a ``.shape`` (tensors, meta tensors, header entries). The
    message's first line counts the problems (after ``summary``, when given); each kind follows on a
    line of its own, at most :data:`MAX_LISTED` names each.
    """
    missing = [f"{k} {list(s)}" for k, s in expected.items() if k not in tensors]
    ignored = sorted(k for k in tensors if k not in expected and ignorable(k))
    unexpected = sorted(
        f"{k} {list(tensors[k].shape)}" for k in tensors if k not in expected and not ignorable(k)
    )
    mismatched = [
        f"{k}: expected {list(s)}, found {list(tensors[k].shape)}"
        for k, s in expected.items()
        if k in tensors and tuple(tensors[k].shape) != tuple(s)
    ]
    problems, counts = [], []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): " + _listed(missing))
        counts.append(f"{len(missing)} missing")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): " + _listed(unexpected))
        counts.append(f"{len(unexpected)} unexpected")
    if mismatched:
        problems.append(f"shape mismatches ({len(mismatched)}): " + _listed(mismatched, "; "))
        counts.append(f"{len(mismatched)} mis-shaped")
    if problems:
        n = len(missing) + len(unexpected) + len(mismatched)
        first = f"{source} does not match its config.json ({', '.join(counts)} tensor{'s' * (n != 1)})"
        if summary:
            first = f"{summary}; {first}"
        raise ValueError(first + "\n  " + "\n  ".join(problems))
    if summary:  # pragma: no cover - every expected tensor present with its shape means enough values
        raise ValueError(summary)
    return ignored


def _not_float_error(source: Path, not_float: Sequence[str]) -> ValueError:
    return ValueError(
        f"{source}: weights must be floating point (float32, float16, bfloat16 or float64); "
        f"{len(not_float)} weight(s) are not: " + _listed(not_float)
    )


def _nonfinite_error(source: Path, problems: Sequence[str]) -> ValueError:
    if len(problems) == 1:
        return ValueError(f"{source}: {problems[0]}")
    return ValueError(
        f"{source}: {len(problems)} weights have NaN/Inf values ({', '.join(problems[:3])}"
        f"{', ...' if len(problems) > 3 else ''})\n  " + "\n  ".join(problems[:MAX_LISTED])
    )


def check_dtypes(entries: Mapping[str, TensorEntry], names: Iterable[str], source: Path) -> None:
    """The weights ``names`` must be stored as floating point, from the header (ValueError names them)."""
    not_float = [f"{k} ({entries[k].dtype_name})" for k in names if not entries[k].is_floating_point]
    if not_float:
        raise _not_float_error(source, not_float)


def check_values(tensors: dict[str, Tensor], names: Sequence[str], source: Path) -> None:
    """The weights ``names`` must be floating point and finite -> one ValueError naming each bad tensor.

    Buffers the loaders ignore (e.g. ``embeddings.position_ids``, int64) are not in ``names``.
    """
    not_float = [f"{k} ({tensors[k].dtype})" for k in names if not tensors[k].is_floating_point()]
    if not_float:
        raise _not_float_error(source, not_float)
    problems = []
    for k in names:
        bad = nonfinite_count(tensors[k])
        if bad:
            problems.append(f"weight {k!r} has {bad} NaN/Inf values of {tensors[k].numel()}")
    if problems:
        raise _nonfinite_error(source, problems)


def load_tensors(
    header: SafetensorsHeader, entries: Mapping[str, TensorEntry], names: Iterable[str]
) -> dict[str, Tensor]:
    """The tensors ``names`` (keys of ``entries``, already checked), read one at a time, as float32.

    Each is read with ``safe_open`` by its stored name, converted to float32 and checked for NaN/Inf; one
    ``ValueError`` names every weight holding NaN/Inf. Nothing else of the file is read.
    """
    names = list(names)
    out: dict[str, Tensor] = {}
    problems = []
    try:
        with safe_open(str(header.path), framework="pt") as f:
            for k in names:
                t = f.get_tensor(entries[k].name)
                if t.is_floating_point() and t.dtype != torch.float32:
                    t = t.float()
                if t.is_floating_point():
                    bad = nonfinite_count(t)
                    if bad:
                        problems.append(f"weight {k!r} has {bad} NaN/Inf values of {t.numel()}")
                out[k] = t
    except Exception as e:  # safetensors raises its own error types for files its parser refuses
        raise ValueError(f"{header.path} is not a readable safetensors file: {e}") from None
    if problems:
        raise _nonfinite_error(header.path, problems)
    return out


def strip_prefix(tensors: dict[str, Any], prefix: str, marker: str) -> dict[str, Any]:
    """Drop ``prefix`` (e.g. 'bert.') when the model's tensors carry it (task-head checkpoints do)."""
    if any(k.startswith(prefix + marker) for k in tensors):
        return {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in tensors.items()}
    return tensors


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
    """The folder's ``tokenizer.json`` as a :class:`~headspace.tokenization.TextTokenizer`, or None.

    No ``tokenizer.json`` is fine (None); one that is not a regular file, too large or not a tokenizer
    is a ``ValueError`` naming it.
    """
    file = optional_file(path, "tokenizer.json", "the tokenizer")
    return None if file is None else TextTokenizer(file, pad_id=pad_id)


def renamed(t: Mapping[str, Tensor], names: Mapping[str, str], ours: str, theirs: str) -> dict[str, Tensor]:
    """``{ours + a: t[theirs + b]}`` for each ``a: b`` of ``names`` (headspace's name: the checkpoint's)."""
    return {ours + a: t[theirs + b] for a, b in names.items()}


@dataclass(frozen=True)
class OpenedCheckpoint:
    """A checkpoint folder whose config and safetensors header passed every check that reads no tensor.

    ``entries``: the header's tensors under the converter's names (a task model's prefix dropped);
    ``summary``: :func:`check_parameter_count`'s, for :func:`read_checked`.
    """

    path: Path
    config: ModelConfig
    weights: Path
    header: SafetensorsHeader
    entries: dict[str, TensorEntry]
    summary: str | None


def open_checkpoint(
    folder: str | Path,
    name: str,
    read_config: Callable[..., ModelConfig],
    prefix: str,
    marker: str,
    count: Callable[[ModelConfig], tuple[int, int]],
    fields: Mapping[str, str],
) -> OpenedCheckpoint:
    """Open ``folder`` (:func:`open_folder`), read its config and header, compare the parameter counts.

    ``read_config(hf, name=..., source=...)`` makes the :class:`~headspace.ModelConfig` (named ``name`` or
    the folder's name; its messages begin with ``source``, the config file's path); ``prefix`` is dropped
    from the tensor names when ``prefix + marker`` names one (:func:`strip_prefix`); ``count(config)``
    gives the (parameters, tensors) the config implies, and the message names the config values behind
    them: the ``config.json`` keys of ``fields`` with the ModelConfig attributes they became
    (:func:`config_values`, :func:`check_parameter_count`).
    """
    path, hf, weights = open_folder(folder)
    config = read_config(hf, name=name or path.name, source=str(path / "config.json"))
    header = safetensors_header(weights)
    entries = strip_prefix(header.tensors, prefix, marker)
    implied, implied_tensors = count(config)
    summary = check_parameter_count(
        implied, implied_tensors, header, config_values(config, fields), str(path / "config.json")
    )
    return OpenedCheckpoint(path, config, weights, header, entries, summary)


def read_checked(
    opened: OpenedCheckpoint, expected: dict[str, tuple[int, ...]], ignorable: Callable[[str], bool]
) -> tuple[dict[str, Tensor], list[str]]:
    """(the ``expected`` tensors as float32, the ignored names): names, shapes and dtypes are checked
    from the header first (:func:`check_tensors`, :func:`check_dtypes`), then :func:`load_tensors`
    reads them (NaN/Inf refused)."""
    ignored = check_tensors(opened.entries, expected, ignorable, opened.weights, summary=opened.summary)
    check_dtypes(opened.entries, expected, opened.weights)
    return load_tensors(opened.header, opened.entries, expected), ignored
