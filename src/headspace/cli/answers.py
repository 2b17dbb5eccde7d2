"""Answer tokens checked against the prompt they continue (``patch``, ``attribute``).

``--answer "Mary"`` after "... gave a drink to" is the token ``Mary`` (no leading space), while the model
continues that prompt with ``␣Mary``: logit(Mary) - logit(John) is then the difference of two tokens the
model would not write there, a number without meaning. :func:`continuation_token` finds the token the
model would use for the answer's word after the prompt; :func:`warn_if_not_continuation` prints a warning
(stderr, one line; the command still runs) when the answer is another token.
"""

from __future__ import annotations

from typing import Any

import click


def continuation_token(model: Any, prompt: str, answer: str) -> int | None:
    """The token the model's tokenizer gives ``answer``'s first piece when it follows ``prompt`` as text.

    An answer given with its own leading space is appended as it is; one that starts with a letter or
    digit is a new word, appended after a space unless the prompt ends with one (``"Mary"`` after
    ``"... to"`` -> ``" Mary"``); anything else (``"."``) directly. None when the prompt's tokens are not
    a prefix of the joined text's (the tokenizer merged across the boundary) or the model has no
    tokenizer.
    """
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None or not answer:
        return None
    new_word = answer[0].isalnum() and not prompt[-1:].isspace()
    joined = prompt + (" " if new_word else "") + answer
    before, after = tokenizer.plain_ids(prompt), tokenizer.plain_ids(joined)
    if len(after) <= len(before) or after[: len(before)] != before:
        return None
    return int(after[len(before)])


def warn_if_not_continuation(model: Any, prompt: str, answers: dict[str, str | None]) -> None:
    """For each ``{option: answer}`` (None: not given), warn on stderr when the answer's token is not the
    one the model would use after ``prompt`` (:func:`continuation_token`), naming that token."""
    from ..analysis.causal.causal_inputs import is_decoder, stack_of, token_id, token_str
    from ..pretrained.tokenization import readable_token

    if not is_decoder(stack_of(model, "the answer check")):
        return  # an encoder's metric names no token
    for option, answer in answers.items():
        if answer is None:
            continue
        given = token_id(model, answer, option)
        natural = continuation_token(model, prompt, answer)
        if natural is None or natural == given:
            continue
        g, n = readable_token(token_str(model, given)), readable_token(token_str(model, natural))
        text = token_str(model, natural)
        click.echo(
            f"warning: {option} {answer!r} is the token {g} (id {given}), but after the prompt the model "
            f"writes that word as {n} (id {natural}): the logit of {g} measures a token it would not use "
            f"there; pass {option} {text!r}",
            err=True,
        )
