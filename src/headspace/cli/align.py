"""``headspace align --model whisper-base speech.wav [--heads auto|L:H,L:H...]``: each word's start and
end in seconds, from the chosen cross-attention heads' attention and dynamic time warping
(:mod:`headspace.analysis.lesson.alignment`). ``--heads auto`` finds the heads first from the audio alone
(:func:`~headspace.analysis.lesson.alignment.alignment_heads`, the path's own consistency), never from the
model's config."""

from __future__ import annotations

import click

from ..core.errors import UsageError
from .errors import check_input
from .loader import load_model
from .options import json_option, model_choice_option
from .output import json_out


def parse_heads(text: str, n_layers: int, n_heads: int) -> list[tuple[int, int]]:
    """``"3:1,4:2"`` -> [(3, 1), (4, 2)]; UsageError naming the bad pair and the valid ranges."""
    out = []
    for part in text.split(","):
        layer, _, head = part.strip().partition(":")
        if not (layer.isdigit() and head.isdigit()) or int(layer) >= n_layers or int(head) >= n_heads:
            raise UsageError(
                f"--heads: expected 'auto' or LAYER:HEAD pairs separated by commas, layer < {n_layers}, "
                f"head < {n_heads}; got {part.strip()!r}"
            )
        out.append((int(layer), int(head)))
    return out


@click.command("align")
@click.argument("audio", metavar="SPEECH.WAV")
@model_choice_option(
    "whisper-base", needs="This command needs a Whisper model with its tokenizer: 'whisper-base'."
)
@click.option("--heads", default="auto", show_default=True, help="auto, or LAYER:HEAD,LAYER:HEAD ...")
@click.option("--top", type=click.IntRange(min=1), default=None,
              help="With --heads auto: how many of the best heads to use (default: a quarter).")  # fmt: skip
@click.option("--transcript", default=None, help="The words spoken (default: the model's transcription).")
@json_option
def align(
    audio: str, model_spec: str, heads: str, top: int | None, transcript: str | None, as_json: bool
) -> None:
    """Print each word's start and end (seconds) in a 16 kHz WAV file, from Whisper's alignment heads."""
    from ..analysis.lesson.alignment import alignment_heads, word_timings

    check_input(audio, "SPEECH.WAV", "audio file")
    model = load_model(model_spec, whisper=True)
    if not getattr(model.config, "audio", False):
        raise UsageError(f"--model {model_spec}: align needs a Whisper model (audio encoder-decoder)")
    n_layers, n_heads = len(model.decoder.blocks), model.config.n_heads
    if heads.strip() == "auto":
        found = alignment_heads(model, audio, transcript)
        chosen = found.best() if top is None else found.top(min(top, n_layers * n_heads))
    else:
        chosen = parse_heads(heads, n_layers, n_heads)
    words = word_timings(model, audio, chosen, transcript)
    if as_json:
        json_out({"heads": [list(p) for p in chosen],
                  "words": [{"word": w.word, "start": w.start, "end": w.end} for w in words]})  # fmt: skip
        return
    click.echo("heads: " + ",".join(f"{lay}:{h}" for lay, h in chosen))
    for w in words:
        click.echo(f"{w.start:7.2f} {w.end:7.2f}  {w.word}")


COMMANDS = (align,)
