"""The frame the family loaders share: open the folder, check the weights from the headers, then read them.

Every loader of a Hugging Face folder (``config.json`` + ``model.safetensors`` or its shards) does the same
four things around its own config reader and tensor renaming:

1. :func:`open_family`: the precision named, the folder checked, ``config.json`` read as a bounded file;
2. :func:`folder_headers`: the weight files (or the shards an index names) and their checked headers;
3. a check of every tensor's name, dtype and shape against the config **from the headers alone**, so
   that a malformed or hostile file is refused before any payload is read:

   - :func:`read_listed`, for loaders that list each Hugging Face tensor with its shape
     (``expected: {name: shape}``): the parameter count, then names, shapes and dtypes;
   - :func:`read_renamed`, for loaders that rename tensors with a function
     (``rename(tensors, config) -> state dict``): the renaming runs first on meta tensors shaped as
     the header says (nothing allocated, nothing read), and its result is checked against the shapes
     the model expects; a tensor moved as it is, is named by its name in the file;

4. the tensors read one at a time (:func:`~headspace.pretrained.hf.load_tensors`: float32, NaN/Inf
   refused).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..model.config import ModelConfig
from ..model.models import check_precision
from .hf import (
    SafetensorsHeader,
    _not_float_error,
    check_dtypes,
    check_parameter_count,
    check_tensors,
    checked_folder,
    load_tensors,
    read_json,
    require_file,
)
from .shards import SHARD_INDEX, shard_headers, weight_files

__all__ = [
    "FamilyFolder",
    "folder_headers",
    "open_family",
    "pop_tied_head",
    "read_listed",
    "read_renamed",
    "tie_differs",
]

Headers = tuple[SafetensorsHeader, dict[Path, SafetensorsHeader]]


@dataclass(frozen=True)
class FamilyFolder:
    """A checked model folder: its path, its ``config.json`` as a dict, and that file's path (a str,
    which every config message begins with)."""

    path: Path
    hf: dict[str, Any]
    config_file: str


def open_family(folder: str | Path, precision: str) -> FamilyFolder:
    """``precision`` checked (:func:`~headspace.model.models.check_precision`), then the folder and its
    ``config.json`` (a regular file of bounded size holding a JSON object); errors name what is wrong."""
    check_precision(precision)
    path = checked_folder(folder)
    hf = read_json(require_file(path, "config.json", "the model configuration"))
    return FamilyFolder(path, hf, str(path / "config.json"))


def folder_headers(path: Path) -> Headers:
    """(one header of every tensor, each file's header): ``model.safetensors`` or the shards of
    ``model.safetensors.index.json`` (:func:`~headspace.pretrained.shards.weight_files`,
    :func:`~headspace.pretrained.shards.shard_headers`); only headers are read."""
    files, weight_map = weight_files(path)
    return shard_headers(files, weight_map, path / SHARD_INDEX)


def _read(per_file: Mapping[Path, SafetensorsHeader], names: list[str]) -> dict[str, Tensor]:
    """The tensors ``names`` (already checked), from whichever file holds each, as float32."""
    tensors: dict[str, Tensor] = {}
    for file_header in per_file.values():
        here = [k for k in names if k in file_header.tensors]
        if here:
            tensors.update(load_tensors(file_header, file_header.tensors, here))
    return tensors


def read_listed(
    headers: Headers,
    expected: dict[str, tuple[int, ...]] | Callable[[], dict[str, tuple[int, ...]]],
    config: ModelConfig,
    fields: str,
    config_file: str,
    ignorable: Callable[[str], bool],
    *,
    count: tuple[int, int] | None = None,
) -> tuple[dict[str, Tensor], list[str]]:
    """(the ``expected`` tensors as float32, the ignored names), everything checked from the headers first.

    ``expected``: every Hugging Face tensor the config implies, with its shape (or a function listing
    them, called only after the count matched, when the list could be long: then ``count`` is given). The
    parameter count
    (``count``: (parameters, tensors), by default the sum over ``expected``) is compared with the headers
    (:func:`~headspace.pretrained.hf.check_parameter_count`, ``fields`` naming the config values behind
    it); a tied checkpoint may also store ``lm_head.weight`` ([vocab, d_model], added to ``expected``);
    then missing / unexpected / mis-shaped tensors and non-float dtypes are refused, all before reading.
    """
    header, per_file = headers
    if count is None:
        assert not callable(expected), "a deferred expected needs its count"
        count = (sum(math.prod(s) for s in expected.values()), len(expected))
    summary = check_parameter_count(*count, header, fields, config_file)
    if callable(expected):  # listed only once the count is known to fit the headers
        expected = expected()
    if "lm_head.weight" in header.tensors and config.tie_embeddings:
        expected["lm_head.weight"] = (config.vocab_size, config.d_model)
    ignored = check_tensors(header.tensors, expected, ignorable, header.path, summary=summary)
    check_dtypes(header.tensors, expected, header.path)
    return _read(per_file, list(expected)), ignored


def tie_differs(head: Tensor | None, emb: Tensor | None) -> bool:
    """Whether a stored ``lm_head.weight`` differs from the embedding it is tied to (False when either is
    None). Meta tensors (the header-only pass of :func:`read_renamed`) are compared by shape only."""
    if head is None or emb is None:
        return False
    if head.shape != emb.shape:
        return True
    return not (head.is_meta or emb.is_meta) and not torch.equal(head, emb)


Renamer = Callable[[dict[str, Tensor]], dict[str, Tensor]]


class _Recorder(dict[str, Tensor]):
    """A dict of tensors that remembers the order in which its entries were read (for messages)."""

    def __init__(self, tensors: Mapping[str, Tensor]) -> None:
        super().__init__(tensors)
        self.read: list[str] = []

    def __getitem__(self, key: str) -> Tensor:
        self.read.append(key)
        return super().__getitem__(key)

    def pop(self, key: str, *default: Any) -> Any:
        self.read.append(key)
        return super().pop(key, *default)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.append(key)
        return super().get(key, default)


def _renamed(rename: Renamer, tensors: dict[str, Tensor], source: Path) -> dict[str, Tensor]:
    """``rename(tensors)``, its errors as one-line ValueErrors naming ``source``; torch's errors (tensors
    of shapes that do not combine, in a cat or a view) name the last three tensors read, with shapes."""
    recorder = _Recorder(tensors)
    try:
        return rename(recorder)
    except KeyError as e:
        raise ValueError(f"{source} does not match its config.json: missing tensor {e}") from None
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    except RuntimeError as e:
        last = list(dict.fromkeys(reversed([k for k in recorder.read if k in tensors])))[:3][::-1]
        read = ", ".join(f"{k} {list(tensors[k].shape)}" for k in last)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"{source} does not match its config.json: the shapes of the tensors read last ({read}) do not "
            f"combine as the config says (torch: {first})"
        ) from None


def _meta(header: SafetensorsHeader) -> dict[str, Tensor]:
    """A meta tensor per header entry: its shape; float32 for floating point, its own dtype otherwise."""
    out: dict[str, Tensor] = {}
    for name, e in header.tensors.items():
        dtype = torch.float32 if e.is_floating_point else getattr(torch, e.dtype_name.removeprefix("torch."))
        out[name] = torch.empty(e.shape, dtype=dtype, device="meta")
    return out


def read_renamed(
    headers: Headers,
    rename: Renamer,
    expected: dict[str, tuple[int, ...]],
    ignorable: Callable[[str], bool],
) -> tuple[dict[str, Tensor], list[str]]:
    """(the renamed tensors ``expected`` names, as float32; the ignored names), checked header-first.

    ``rename(tensors)`` maps the file's tensors ({name: tensor}, a dict it may pop) to the names of
    ``expected`` (leftovers are reported as unexpected unless ``ignorable``); it must depend on the
    tensors' names and shapes only, except for value checks that it skips on meta tensors
    (:func:`tie_differs`). It first runs on meta tensors shaped as the headers say: missing tensors
    (KeyError), shapes torch cannot combine, and results of the wrong shape or a non-float dtype are
    refused (:func:`~headspace.pretrained.hf.check_tensors`; a tensor moved unchanged is named as the
    file names it) before any payload is read. Then the tensors it used are read and it runs again.
    """
    header, per_file = headers
    meta = _meta(header)
    out = _renamed(rename, dict(meta), header.path)
    by_id = {id(v): k for k, v in meta.items()}
    moved = [(k, by_id[id(v)]) for k, v in out.items() if k in expected and id(v) in by_id]
    theirs = [t for _, t in moved]
    label = {k: t for k, t in moved if t not in out and theirs.count(t) == 1}  # one name per tensor
    shown = {label.get(k, k): v for k, v in out.items()}
    ignored = check_tensors(shown, {label.get(k, k): s for k, s in expected.items()}, ignorable, header.path)
    not_float = [f"{label.get(k, k)} ({out[k].dtype})" for k in expected if not out[k].is_floating_point()]
    if not_float:
        raise _not_float_error(header.path, not_float)
    unused = {k for k, v in out.items() if k not in expected and meta.get(k) is v}
    names = [k for k in meta if k not in unused]
    tensors: dict[str, Tensor] = {**{k: meta[k] for k in unused}, **_read(per_file, names)}
    real = _renamed(rename, tensors, header.path)
    return {k: real[k].float() for k in expected}, ignored


def pop_tied_head(tensors: dict[str, Tensor], config: ModelConfig, prefix: str, source: Path) -> None:
    """Drop the ``lm_head.weight`` a tied checkpoint stores (when ``config.tie_embeddings``), refusing one
    that differs from ``{prefix}embed_tokens.weight`` (a ValueError naming ``source``)."""
    head = tensors.pop("lm_head.weight", None) if config.tie_embeddings else None
    if tie_differs(head, tensors.get(f"{prefix}embed_tokens.weight")):
        raise ValueError(f"{source}: tie_word_embeddings=true but lm_head.weight differs from the embedding")
