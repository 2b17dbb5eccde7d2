"""Text generation as people use it: a pretrained decoder's stop tokens, its chat template, and text
streamed as it comes (:meth:`headspace.pretrained.PretrainedDecoder.generate` on text calls
:func:`generate_text`).

* **Stop tokens** (:func:`stop_token_ids`): the end-of-text and end-of-turn tokens the model names:
  a GGUF's ``tokenizer.ggml.eos_token_id`` / ``eot_token_id`` / ``eom_token_id``, a Hugging Face
  folder's ``eos_token_id`` (``config.json``, ``generation_config.json``: an id or a list) and
  ``tokenizer_config.json``'s ``eos_token``, the special tokens of the tokenizer named as ends
  (:data:`~.tokenization.END_TOKENS`: ``<|im_end|>``, ``<end_of_turn>``, ...) and the control tokens its
  chat template writes whose names say end (:meth:`~.tokenization.TextTokenizer.template_end_ids`).
* **Chat** (:func:`render_chat`): the model's chat template (a Jinja template: untrusted input, so
  rendered in jinja2's immutable sandbox) over one user message with ``add_generation_prompt=True``;
  the result is tokenized without adding special tokens (the template writes its own).
* **Streaming** (:class:`TextStream`): the text decoded so far, handed on in pieces as each token
  comes; a piece is held back while the text ends in an incomplete UTF-8 character (``\\ufffd``). The
  pieces add up to the text returned.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Collection, Sequence
from typing import Any

from torch import Tensor

from ..model.models import Decoder
from .tokenization import TextTokenizer, check_sentences


def stop_token_ids(
    tokenizer: TextTokenizer,
    special_tokens: dict[str, int],
    extra: dict[str, Any],
    template: str | None,
    vocab_size: int,
) -> list[int]:
    """The sorted ids that end generation (see the module docstring): ``special_tokens``' ``eos``,
    ``eot`` and ``eom`` (a GGUF's), ``extra["eos_token_id"]`` (a config.json's: an id or a list), the
    tokenizer's folder settings, its special end tokens and ``template``'s end tokens. Ids outside
    [0, ``vocab_size``) are left out: the model never samples them (a tiny test model's config may name
    GPT-2's 50256); config.json's ``eos_token_id`` of another type is a ValueError."""
    found = {special_tokens[key] for key in ("eos", "eot", "eom") if key in special_tokens}
    eos = extra.get("eos_token_id")
    named = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if any(isinstance(i, bool) or not isinstance(i, int) for i in named):
        raise ValueError(f"config.json's eos_token_id must be a token id or a list of them; got {eos!r:.60}")
    settings = tokenizer.folder_settings()
    found |= {*named, *settings.eos_ids, *tokenizer.end_ids, *tokenizer.template_end_ids(template)}
    eos_token = tokenizer.id_of(settings.eos_token)
    if eos_token is not None:
        found.add(eos_token)
    return sorted(i for i in found if 0 <= i < vocab_size)


def render_chat(template: str, user: str, *, bos_token: str | None, eos_token: str | None) -> str:
    """``template`` (a Jinja chat template, untrusted: rendered in jinja2's ``ImmutableSandboxedEnvironment``)
    over the conversation ``[{"role": "user", "content": user}]`` with ``add_generation_prompt=True``,
    as transformers' ``apply_chat_template`` renders it (``trim_blocks``, ``lstrip_blocks``,
    ``raise_exception``, ``strftime_now``). A template that fails, or that tries what the sandbox
    forbids, is a one-line ValueError."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(
            messages=[{"role": "user", "content": user}],
            add_generation_prompt=True,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
        )
    except Exception as e:  # a template is code: anything it raises is its failure, said in one line
        said = " ".join(str(e).split())[:200]
        raise ValueError(f"the model's chat template failed: {type(e).__name__}: {said}") from None


class TextStream:
    """``on_token`` for :func:`headspace.decode.generate` at batch 1: hands ``on_text`` each new piece
    of the text of ``prefix`` ids + the tokens so far (decoded without control tokens), up to the
    first of ``stops``. :meth:`finish` hands on what is left, so that the pieces add up to the text
    of every token."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        on_text: Callable[[str], object],
        prefix: Sequence[int],
        stops: Collection[int],
    ) -> None:
        self.tokenizer, self.on_text, self.stops = tokenizer, on_text, frozenset(stops)
        self.ids = list(prefix)
        self.sent = ""
        self.stopped = False

    def start(self) -> None:
        """Hand on the prefix's text (the prompt, echoed before its continuation)."""
        self._send(self.tokenizer.decode(self.ids), final=False)

    def __call__(self, new: Tensor) -> None:
        if self.stopped:
            return
        token = int(new[0])
        if token in self.stops:
            self.stopped = True
            return
        self.ids.append(token)
        self._send(self.tokenizer.decode(self.ids), final=False)

    def finish(self) -> str:
        """Hand on the rest; the whole text."""
        text = self.tokenizer.decode(self.ids)
        self._send(text, final=True)
        return text

    def _send(self, text: str, *, final: bool) -> None:
        if not final and text.endswith("\ufffd"):
            return  # an incomplete UTF-8 character: its next bytes come with the next token
        if text.startswith(self.sent) and len(text) > len(self.sent):
            self.on_text(text[len(self.sent) :])
            self.sent = text


def _both(first: Any, then: TextStream) -> Callable[[Tensor], None]:
    """``on_token`` calling ``first``, then ``then``."""
    if not callable(first):
        raise TypeError(f"on_token must be None or callable (new tokens [batch]); got {first!r:.60}")

    def call(new: Tensor) -> None:
        first(new)
        then(new)

    return call


def _cut(row: list[int], stops: frozenset[int]) -> list[int]:
    """``row``'s tokens before the first of ``stops``."""
    for k, t in enumerate(row):
        if t in stops:
            return row[:k]
    return row


def generate_text(
    model: Decoder,
    tokenizer: TextTokenizer,
    prompt: str | Sequence[str],
    max_new_tokens: int,
    *,
    stops: Sequence[int],
    template: str | None,
    on_text: Callable[[str], object] | None,
    options: dict[str, Any],
) -> str | list[str]:
    """:meth:`~headspace.pretrained.PretrainedDecoder.generate` on text (see its docstring): the prompt
    (or with ``template`` its chat rendering, then only the reply) and its continuation up to a stop."""
    texts = check_sentences(prompt, "prompt")
    if on_text is not None and (not callable(on_text) or not isinstance(prompt, str)):
        got = f"a list of {len(texts)} prompts" if not isinstance(prompt, str) else repr(on_text)
        raise TypeError(f"on_text streams one prompt's text: a callable, with a str prompt; got {got:.60}")
    if template is None:
        ids = tokenizer.encode_ids(texts)
    else:
        settings = tokenizer.folder_settings()
        marks = {"bos_token": settings.bos_token, "eos_token": settings.eos_token}
        ids = [tokenizer.plain_ids(render_chat(template, t, **marks)) for t in texts]
    for i, row in enumerate(ids):
        if not row:
            where = "prompt" if isinstance(prompt, str) else f"prompt[{i}]"
            raise ValueError(f"{where} ({texts[i]!r:.60}) tokenizes to no token; give at least 1 token")
    # the padded ids are masked out, never read: any id will do where the tokenizer has no pad token
    fill = 0 if tokenizer.pad_id is None else tokenizer.pad_id
    tokens, key_padding = tokenizer.pad(ids, side="left", fill_id=fill)  # (batch, seq) x 2
    padded = None if bool(key_padding.all()) else key_padding
    stream = None
    on_token = options.pop("on_token", None)  # the caller's own, called before the stream's
    if on_text is not None:
        stream = TextStream(tokenizer, on_text, [] if template else ids[0], stops)
        stream.start()
        if on_token is not None:
            on_token = _both(on_token, stream)
    out = model.generate(tokens, max_new_tokens, key_padding=padded, stop_tokens=list(stops),
                         on_token=on_token or stream, **options)  # fmt: skip  # (batch, seq + steps)
    seq, ends = tokens.shape[1], frozenset(stops)
    kept = [[] if template else row for row in ids]  # the prompt's tokens, kept in the text without chat
    decoded = [tokenizer.decode(kept[i] + _cut(out[i, seq:].tolist(), ends)) for i in range(len(ids))]
    if stream is not None:
        stream.finish()
    return decoded[0] if isinstance(prompt, str) else decoded
