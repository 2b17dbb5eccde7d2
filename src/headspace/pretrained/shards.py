"""A Hugging Face folder's weights: ``model.safetensors`` or the shards its index names, headers checked.

:func:`weight_files` lists the files (a shard index, ``model.safetensors.index.json``, may name only bare
file names of the folder); :func:`shard_headers` reads and checks every file's header
(:func:`~headspace.pretrained.hf.safetensors_header`) and merges them into one, refusing a tensor stored
twice or an index that misplaces a tensor. Nothing but headers is read.
"""

from __future__ import annotations

from pathlib import Path

from .hf import SafetensorsHeader, TensorEntry, optional_file, read_json, require_file, safetensors_header

__all__ = ["SHARD_INDEX", "shard_headers", "weight_files"]

#: The name of the index that maps each tensor to its shard.
SHARD_INDEX = "model.safetensors.index.json"


def weight_files(path: Path) -> tuple[list[Path], dict[str, Path] | None]:
    """``model.safetensors``, or the shards a ``model.safetensors.index.json`` names (inside the folder).

    Returns (the files, the index's ``{tensor name: shard}`` or None for a single file). A shard must be
    named by a bare file name of the folder (no folder part, no ".."); it may be a symbolic link, as the
    Hugging Face cache stores them, to a regular file.
    """
    single = optional_file(path, "model.safetensors", "the weights")
    if single is not None:
        return [single], None
    index_path = optional_file(path, SHARD_INDEX, "the shard index")
    if index_path is None:
        require_file(path, "model.safetensors", f"the weights, or {SHARD_INDEX} naming the shards")
    index = read_json(index_path)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_path}: 'weight_map' must be a non-empty object {{tensor name: shard file}}")
    files: list[Path] = []
    where: dict[str, Path] = {}
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file:
            raise ValueError(f"{index_path}: weight_map[{name!r}] must be a file name; got {file!r:.80}")
        if file in (".", "..") or Path(file).name != file or "\\" in file:
            raise ValueError(
                f"{index_path}: weight_map[{name!r}] = {file!r:.80} points outside the model folder {path}; "
                "shards must be files in the folder itself"
            )
        shard = path / file
        where[name] = shard
        if shard not in files:
            files.append(require_file(path, file, f"a shard named by {SHARD_INDEX}"))
    return files, where


def shard_headers(
    files: list[Path], weight_map: dict[str, Path] | None, index_path: Path
) -> tuple[SafetensorsHeader, dict[Path, SafetensorsHeader]]:
    """Every file's checked header, and one header of all their tensors (the index path as its path).

    A tensor stored in two files is refused; with shards, the index must place every tensor where it is.
    """
    per_file = {file: safetensors_header(file) for file in files}
    if weight_map is None:
        return per_file[files[0]], per_file
    merged: dict[str, TensorEntry] = {}
    home: dict[str, Path] = {}
    for file, header in per_file.items():
        for name, entry in header.tensors.items():
            if name in merged:
                raise ValueError(f"tensor {name!r} is stored twice: in {home[name]} and in {file}")
            merged[name], home[name] = entry, file
    misplaced = sorted(n for n, f in weight_map.items() if home.get(n) != f)
    unlisted = sorted(n for n in merged if n not in weight_map)
    if misplaced or unlisted:
        raise ValueError(
            f"{index_path} does not match its shards: "
            + (f"tensors not in the shard it names: {misplaced[:10]}" if misplaced else "")
            + ("; " if misplaced and unlisted else "")
            + (f"tensors in shards but not in weight_map: {unlisted[:10]}" if unlisted else "")
        )
    size = sum(h.file_size for h in per_file.values())
    return SafetensorsHeader(index_path, merged, {}, size), per_file
