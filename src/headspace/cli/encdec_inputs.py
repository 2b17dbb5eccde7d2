"""What the analysis commands share on an encoder-decoder (issue #40): knowing one before it loads, loading
it, its source (a WAV file for Whisper, a sentence for T5, BART and Marian with a ``tokenizer.json``) and
the decoder's tokens, and the one-line refusals of options that do not apply.

The decoder reads the prompt ``P`` (Whisper: ``<|startoftranscript|><|en|><|transcribe|><|notimestamps|>``;
a translator: its start token) then the output tokens ``y_0 .. y_{n-1}`` (the model's greedy output, or
``--target``'s tokens): ``decoder_ids = P + y`` [1, len(P) + n]. Row ``len(P) - 1 + k`` predicts ``y_k``
and the last row predicts the end token (:attr:`EncDecRun.targets`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from torch import Tensor

from ..core.errors import UsageError
from .errors import check_input, reported
from .loader import encoder_decoders_allowed, load_model

#: The largest config.json read to know a folder's kind (bytes): a real one is a few kB.
MAX_CONFIG_BYTES = 1 << 20
#: Registered names that load an encoder-decoder.
ENCDEC_NAMES = ("whisper-base",)

#: ``--target``'s help on patch, attribute and why.
TARGET_HELP = (
    "Encoder-decoders with a text source only (T5, BART, Marian): the output text to follow instead of "
    "the model's greedy translation."
)
target_option = click.option("--target", default=None, help=TARGET_HELP)


def is_encdec_spec(spec: str) -> bool:
    """Whether ``--model spec`` names an encoder-decoder, known without loading it: ``whisper-base``, or a
    folder whose ``config.json`` has a ``model_type`` of T5, BART, Marian or Whisper."""
    from ..pretrained.encdec import ENCDEC_LOADERS

    if spec in ENCDEC_NAMES:
        return True
    path = Path(spec) / "config.json"
    try:
        if not path.is_file() or path.stat().st_size > MAX_CONFIG_BYTES:
            return False
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # the loader says what is wrong with it, in its own words
    return isinstance(config, dict) and config.get("model_type") in ENCDEC_LOADERS


def refuse_target(target: str | None, spec: str) -> None:
    """``--target`` is for encoder-decoders only: one line on any other model."""
    if target is not None:
        raise UsageError(f"--target: only for encoder-decoders; --model {spec} is not one")


def load_encdec(spec: str, precision: str) -> Any:
    """The encoder-decoder ``--model spec`` (float32 only: one line for another ``--precision``)."""
    if precision != "float32":
        raise UsageError(f"--precision {precision}: encoder-decoders ({spec}) run in float32 only")
    with encoder_decoders_allowed():
        return load_model(spec)


def given(*names: str) -> list[str]:
    """The parameters among ``names`` (click's parameter names) given on the command line."""
    from click.core import ParameterSource

    ctx = click.get_current_context()
    return [name for name in names if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE]


def refuse_given(command: str, names: dict[str, str], why: str) -> None:
    """One line when an option that does not apply to an encoder-decoder was given (``names``: click's
    parameter name -> its flag)."""
    for name, flag in names.items():
        if given(name):
            raise UsageError(f"{flag}: {command} on an encoder-decoder {why}; leave {flag} out")


def source_needed(model: Any, spec: str, command: str, argument: str = "its argument") -> UsageError:
    """The line saying what source ``command`` needs on this encoder-decoder."""
    what = "a WAV file" if model.config.audio else "a source sentence"
    return UsageError(f"--model {spec}: an encoder-decoder; {command} needs {what} as {argument}")


@dataclass
class EncDecRun:
    """A source and the decoder's tokens (module docstring): ``inputs`` source ids [1, seq] or log-mel
    features [1, n_mels, 3000]; ``prompt``, ``text``: the decoder's prompt and output ids; ``decoder_ids``
    [1, len(prompt) + len(text)]; ``targets`` [len(text) + 1]: the output ids and the end, predicted at
    ``rows``; ``sources``: a label per source position (token text; audio: the frame's start)."""

    inputs: Tensor
    prompt: list[int]
    text: list[int]
    sources: list[str]

    @property
    def decoder_ids(self) -> Tensor:
        import torch

        return torch.tensor([[*self.prompt, *self.text]])  # [1, seq_dec]

    @property
    def rows(self) -> slice:
        return slice(len(self.prompt) - 1, len(self.prompt) + len(self.text))

    def targets(self, eos: int) -> Tensor:
        import torch

        return torch.tensor([*self.text, eos])  # [len(text) + 1]


def piece(model: Any, tid: int) -> str:
    """The text of token ``tid``."""
    return model.tokenizer.token_text(model.tokenizer.token_of(tid) or "")


def source_inputs(model: Any, source: str, option: str) -> Tensor:
    """Source ids [1, seq] of a sentence, or Whisper's log-mel features [1, n_mels, 3000] of a WAV file;
    one line for a missing, unreadable or empty file or a folder without a tokenizer."""
    import torch

    from ..analysis.lesson.cross_explain import _check_model
    from ..pretrained.encdec.features import wav_features

    with reported(option):
        _check_model(model)
    if model.config.audio:
        check_input(source, option, "audio file")
        with reported():
            return wav_features(source, model.config.n_mels)  # [1, n_mels, 3000]
    if not source.strip():
        raise UsageError(f"{option}: expected a non-empty source sentence; got {source!r}")
    with reported(option):
        return torch.tensor(model.tokenizer.encode_ids([source]))  # [1, seq]


def source_run(model: Any, source: str, option: str, target: str | None) -> EncDecRun:
    """The source's inputs and the decoder's tokens: the greedy output (Whisper: the transcription), or
    ``target``'s tokens (text models)."""
    import torch

    from ..analysis.lesson.cross_explain import MAX_NEW_TOKENS

    if model.config.audio and target is not None:
        raise UsageError("--target: Whisper's output is its own transcription; leave --target out")
    inputs = source_inputs(model, source, option)
    if model.config.audio:
        prompt = model.prompt()
        with reported(option):
            out = model.generate(inputs, 224, decoder_input_ids=torch.tensor([prompt]))[0].tolist()
        sources = [f"{j * 0.02:.2f}s" for j in range(inputs.shape[-1] // 2)]
    else:
        prompt = [model.config.decoder_start_token_id]
        sources = [piece(model, int(t)) for t in inputs[0]]
        if target is not None:
            if not target.strip():
                raise UsageError(f"--target: expected a non-empty sentence; got {target!r}")
            out = [*prompt, *model.tokenizer.plain_ids(target)]
        else:
            out = model.generate(inputs, MAX_NEW_TOKENS, decoder_input_ids=torch.tensor([prompt]))[0].tolist()
    text = out[len(prompt) :]
    if text and text[-1] == model.config.eos_token_id:
        text = text[:-1]
    if not text:
        raise UsageError(
            f"{option} {source}: the model's output is empty (it ends at once); nothing to analyse"
        )
    return EncDecRun(inputs=inputs, prompt=prompt, text=text, sources=sources)


def output_logprob(run: EncDecRun, eos: int) -> Any:
    """``metric(logits [1, seq_dec, vocab]) -> float``: the log-probability of the output and its end,
    ``sum_k log softmax(logits[0, rows])[k, targets[k]]``."""
    import torch

    rows, targets = run.rows, run.targets(eos)

    def metric(logits: Tensor) -> float:
        logp = torch.log_softmax(logits[0, rows].float(), -1)  # [n + 1, vocab]
        return float(logp.gather(-1, targets[:, None]).sum())

    return metric


__all__ = [
    "EncDecRun",
    "given",
    "is_encdec_spec",
    "load_encdec",
    "output_logprob",
    "piece",
    "refuse_given",
    "refuse_target",
    "source_inputs",
    "source_needed",
    "source_run",
    "target_option",
]
