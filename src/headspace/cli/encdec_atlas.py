"""``headspace atlas --model whisper-base --corpus FOLDER --out DIR`` (or a T5 / BART / Marian folder): the
atlas's cross-attention statistics over a corpus (issue #40), into ``DIR/cross_atlas.json``.

Every cross-attention head's entropy and monotonic-alignment score, averaged over the corpus
(:func:`headspace.analysis.atlas.cross.cross_atlas`). The corpus is, for Whisper, a WAV file or a folder of
``*.wav`` files (in name order); for a translator, a UTF-8 text file or a folder of ``*.txt`` files, one
source sentence per line, or ``source<TAB>target`` to follow the target instead of the greedy output. The
decoder atlas's other options (windows, shards, importance) do not apply and are refused by name.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from ..core.errors import UsageError
from .encdec_inputs import load_encdec, refuse_given
from .errors import check_input, read_input_file, reported
from .output import check_writable_folder, output_folder

#: The file the command writes in ``--out``.
CROSS_ATLAS_FILE = "cross_atlas.json"
#: The largest sentences file read (bytes).
MAX_CORPUS_BYTES = 16 << 20
#: The decoder atlas's options refused on an encoder-decoder: click's name -> flag.
DECODER_ONLY = {
    "max_tokens": "--tokens", "window": "--window", "batch_size": "--batch-size", "top_k": "--top-k",
    "shard_size": "--shard-size", "importance": "--importance", "importance_check": "--importance-check",
    "no_ablation": "--no-ablation", "device": "--device",
}  # fmt: skip
#: The heads printed (all of them are in cross_atlas.json).
TOP_HEADS = 10


def _files(corpus: Path, suffix: str, what: str) -> list[Path]:
    """``corpus`` itself, or its ``*suffix`` files in name order (one line for a folder without any)."""
    if not corpus.is_dir():
        return [corpus]
    found = sorted(p for p in corpus.iterdir() if p.suffix.lower() == suffix and p.is_file())
    if not found:
        raise UsageError(f"--corpus {corpus}: a folder without {suffix} files; expected {what}")
    return found


def _sentences(files: list[Path]) -> list[Any]:
    """Each non-empty line of each file: a sentence, or a (source, target) pair split at a tab."""
    items: list[Any] = []
    for path in files:
        data = read_input_file(path, "--corpus", "corpus file", MAX_CORPUS_BYTES)
        with reported(f"cannot read corpus file {path}"):
            text = data.decode("utf-8")
        for line in text.splitlines():
            if not line.strip():
                continue
            source, tab, target = line.partition("\t")
            if tab and not (source.strip() and target.strip()):
                raise UsageError(
                    f"corpus file {path}: expected 'source<TAB>target' with both parts; got {line!r}"
                )
            items.append((source.strip(), target.strip()) if tab else line.strip())
    if not items:
        raise UsageError(f"--corpus {files[0]}: no sentence (one source sentence per line expected)")
    return items


def corpus_items(model: Any, corpus: str) -> list[Any]:
    """WAV paths (Whisper) or sentences / (source, target) pairs (module docstring)."""
    path = check_input(corpus, "--corpus", "corpus", "any")
    if model.config.audio:
        return [str(p) for p in _files(path, ".wav", "WAV files (16 kHz PCM or any rate, resampled)")]
    return _sentences(_files(path, ".txt", "UTF-8 text files, one source sentence per line"))


def _check_own(out_dir: Path) -> None:
    """Refuse to overwrite a ``cross_atlas.json`` headspace did not write."""
    from ..core.fileio import parse_json, read_regular_file

    path = out_dir / CROSS_ATLAS_FILE
    if not os.path.lexists(path):
        return
    try:
        ours = parse_json(read_regular_file(path, max_bytes=1 << 30, follow_symlinks=False)).get("kind")
    except (OSError, ValueError, AttributeError):
        ours = None
    if ours != "cross_atlas":
        raise UsageError(
            f"--out {out_dir}: {CROSS_ATLAS_FILE} there is not a cross-attention atlas headspace wrote; move "
            "it away or choose another folder"
        )


def atlas_encoder_decoder(spec: str, corpus: str, out: str) -> None:
    """``headspace atlas`` on an encoder-decoder (module docstring): ``DIR/cross_atlas.json`` (the
    statistics, ``kind: "cross_atlas"``) and the most monotonic heads printed."""
    from ..analysis.atlas.cross import cross_atlas
    from ..core.fileio import write_json

    refuse_given("atlas", DECODER_ONLY, "measures the cross-attention heads' entropy and monotonic alignment")
    out_dir = check_writable_folder(out)
    model = load_encdec(spec, "float32")
    items = corpus_items(model, corpus)
    _check_own(output_folder(out_dir))
    with reported():
        a = cross_atlas(model, items)
    d = {
        "kind": "cross_atlas",
        "model": spec,
        "corpus": [i if isinstance(i, str) else list(i) for i in items],
    }
    d.update(a.to_dict())
    path = write_json(out_dir / CROSS_ATLAS_FILE, d)
    L, H = a.monotonic.shape
    click.echo(f"wrote {path} ({a.n_inputs} inputs, {L} decoder layers x {H} cross-attention heads)")
    ranked = a.ranking()[:TOP_HEADS]
    click.echo(f"the {len(ranked)} most monotonic cross-attention heads (entropy in nats):")
    for layer, head in ranked:
        mono, ent = (round(float(t[layer, head]), 3) + 0.0 for t in (a.monotonic, a.entropy))  # no -0.000
        click.echo(f"  decoder layer {layer:>2} head {head:>2}  monotonic {mono:.3f}  entropy {ent:.3f}")


__all__ = ["CROSS_ATLAS_FILE", "atlas_encoder_decoder", "corpus_items"]
