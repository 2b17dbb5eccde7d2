"""Checks of what a model is given: token ids, positions, prompt masks (errors name the argument)."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from .masks import check_key_padding


class ModelConfig(Protocol):
    """What the checks read of a model's configuration (:class:`headspace.ModelConfig` has both)."""

    vocab_size: int
    max_seq_len: int


def _check_integer_matrix(t: Any, name: str, what: str) -> None:
    """``t`` must be an integer tensor (``what``: "token ids", "position indices"); errors name it."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be an int64 tensor [batch, seq] of {what}; got {type(t).__name__}")
    if t.dtype not in (torch.int64, torch.int32):  # the dtypes torch's embedding lookup takes
        raise TypeError(
            f"{name} must be an integer tensor (int64 or int32) [batch, seq] of {what}; got dtype {t.dtype}"
        )


def _check_below(t: Tensor, name: str, bound: int, outside: str, noun: str = "") -> None:
    """Every value of ``t`` in [0, bound); else ``"{name} contains {noun}{value}, outside {outside}"``.

    Under ``torch.compile`` (:func:`torch.compiler.is_compiling`) reading the offending value back to
    Python would break the graph (a data-dependent ``int(tensor)``), so the check stays inside the graph
    as ``torch._assert_async``: a value outside the range raises ``RuntimeError`` when the compiled code
    runs, with the message ``"tokens contains an id outside [0, vocab_size=...)"`` (``"positions
    contains a value outside ..."``) and without the value itself. Shape, dtype and device checks are
    the same in both modes.
    """
    if torch.compiler.is_compiling():
        inside = ((t >= 0) & (t < bound)).all()  # () bool, True for an empty tensor
        what = f"an {noun.strip()}" if noun else "a value"
        torch._assert_async(
            inside, f"{name} contains {what} outside {outside} (checked in the compiled graph)"
        )
        return
    if t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= bound:
            raise ValueError(f"{name} contains {noun}{lo if lo < 0 else hi}, outside {outside}")


def check_tokens(
    tokens: Any,
    config: ModelConfig,
    *,
    start: int = 0,
    name: str = "tokens",
    check_length: bool = True,
    device: torch.device | None = None,
) -> None:
    """Tokens must be an integer tensor [batch, seq] of ids < vocab_size fitting the position table.

    ``check_length=False`` leaves the length to the caller: with per-row positions (left-padded
    batches) the columns may outnumber the position table while every position stays inside it.
    ``device``: the model's device, which the tokens must be on (None: not checked).
    """
    _check_integer_matrix(tokens, name, "token ids")
    if device is not None and tokens.device != device:
        raise ValueError(
            f"{name} are on device {tokens.device} but the model's weights are on {device}; "
            f"move them with {name}.to({str(device)!r})"
        )
    if tokens.dim() != 2:
        hint = " (for one sequence use .unsqueeze(0))" if tokens.dim() == 1 else ""
        raise ValueError(f"{name} must be 2-D [batch, seq]; got shape {list(tokens.shape)}{hint}")
    seq = tokens.shape[1]
    if check_length and start + seq > config.max_seq_len:
        where = f" starting at position {start}" if start else ""
        raise ValueError(
            f"{name} has length {seq}{where}, longer than the position table "
            f"(max_seq_len={config.max_seq_len}); "
            f"refused, not truncated: truncate the input to at most {config.max_seq_len - start} tokens"
        )
    _check_below(tokens, name, config.vocab_size, f"[0, vocab_size={config.vocab_size})", noun="id ")


def check_positions(positions: Any, tokens: Tensor, config: ModelConfig) -> None:
    """Positions must be an integer tensor shaped like ``tokens`` with values in [0, max_seq_len)."""
    _check_integer_matrix(positions, "positions", "position indices")
    if positions.shape != tokens.shape:
        raise ValueError(
            f"positions must have the shape of tokens [batch, seq] = {list(tokens.shape)}; "
            f"got {list(positions.shape)}"
        )
    if positions.device != tokens.device:
        raise ValueError(f"positions is on {positions.device} but tokens is on {tokens.device}")
    table = f"the position table [0, max_seq_len={config.max_seq_len})"
    _check_below(positions, "positions", config.max_seq_len, table)


def check_left_padding(key_padding: Any, tokens: Tensor) -> None:
    """A prompt mask for :meth:`Decoder.generate`: bool, shaped like ``tokens``, left-padded, no empty row.

    Left padding: in every row the real tokens (True) are right-aligned, ``[F, F, T, T]``; a False after
    a True (``[T, F, T]``, ``[T, T, F]``) is refused, and so is a row with no True.
    """
    check_key_padding(key_padding, tokens.shape[0], tokens.shape[1], tokens.device)

    def show(row: int) -> str:
        flags = "".join("T" if x else "F" for x in key_padding[row].tolist())
        return flags if len(flags) <= 40 else f"{flags[:18]}...{flags[-18:]}"

    empty = (~key_padding.any(dim=1)).nonzero()  # (n_empty, 1)
    if len(empty):
        row = int(empty[0, 0])
        raise ValueError(
            f"key_padding row {row} has no real token (all False); every prompt needs at least 1 token"
        )
    # a real token followed by padding: the real tokens of that row are not right-aligned
    gaps = (key_padding[:, :-1] & ~key_padding[:, 1:]).any(dim=1).nonzero()  # (n_bad, 1)
    if len(gaps):
        row = int(gaps[0, 0])
        raise ValueError(
            "key_padding must be left padding: each row's real tokens (True) right-aligned after its "
            f"padding (False), like FFTTT; row {row} is {show(row)}"
        )
