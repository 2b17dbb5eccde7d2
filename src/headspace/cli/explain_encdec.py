"""``headspace explain`` on an encoder-decoder: ``--model whisper-base speech.wav`` or ``--model FOLDER
"source sentence"`` (T5, BART, Marian with a ``tokenizer.json``) walks one output token through one
cross-attention head (:func:`headspace.analysis.lesson.cross_explain.explain_cross`) and, with ``--out``,
draws the head's pattern over the source with the word boundaries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ..core.errors import UsageError
from .errors import check_input
from .output import clean, json_out

#: ``--target``'s help (kept here beside the branch it feeds)
ENCDEC_TARGET_HELP = (
    "Encoder-decoders with a text source only: the output text to follow instead of the model's "
    "greedy translation."
)


def is_encoder_decoder(model: Any) -> bool:
    """Whether ``model`` is a headspace :class:`~headspace.model.encdec.EncoderDecoder`."""
    from ..model.encdec import EncoderDecoder

    return isinstance(model, EncoderDecoder)


def _token(token: str | None) -> int | str | None:
    return int(token) if token is not None and token.strip().isdigit() else token


def explain_encoder_decoder(
    model: Any,
    model_spec: str,
    source: str | None,
    *,
    token: str | None,
    layer: int | None,
    head: int | None,
    target: str | None,
    precision: str,
    out_dir: Path | None,
    as_json: bool,
) -> None:
    """The command's encoder-decoder branch: checks (one line each), the lesson, the text or JSON, and
    ``cross_attention_L{layer}_H{head}.png`` in ``out_dir``."""
    from ..analysis.lesson.cross_explain import explain_cross
    from ..viz.cross_attention import plot_cross_explanation

    name = model.config.name or model_spec
    if precision != "float32":
        raise UsageError(f"--precision {precision}: encoder-decoders ({name}) run in float32 only")
    if source is None:
        what = "a WAV file (SPEECH.WAV)" if model.config.audio else "a source sentence"
        raise UsageError(f"--model {model_spec}: an encoder-decoder; explain needs {what} as its argument")
    if model.config.audio:
        check_input(source, "SPEECH.WAV", "audio file")
        if target is not None:
            raise UsageError("--target: Whisper's output is its own transcription; leave --target out")
    e = explain_cross(model, source, token=_token(token), layer=layer, head=head, target=target)
    les = e.lesson
    picture = None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        picture = plot_cross_explanation(e, out_dir / f"cross_attention_L{les.layer}_H{les.head}.png")
    if as_json:
        d = e.to_dict()
        d["picture"] = None if picture is None else str(picture)
        json_out(clean(d))
        return
    followed = e.outputs[e.token]
    click.echo(f"{name}: output {' '.join(o.strip() for o in e.outputs)!r}")
    click.echo(
        f"following output token {e.token} {followed.strip()!r} (decoder position {les.position}, which "
        f"reads {e.queries[e.token].strip()!r}) through decoder layer {les.layer} cross-attention head "
        f"{les.head} ({e.chosen})"
    )
    click.echo(les.text(e.sources))
    unit = "s" if e.seconds_per_key is not None else ""
    click.echo("words: " + ", ".join(f"{w} {a:g}{unit}-{b:g}{unit}" for w, a, b in e.words))
    if picture is not None:
        click.echo(f"wrote {picture}")
