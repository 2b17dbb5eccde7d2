"""What the causal tools share: prompts to tokens, answer tokens, the final norm frozen, the unembedding.

A model here is a loaded decoder (``headspace.load(...)``, with a tokenizer) or a bare
:class:`~headspace.Decoder` / :class:`~headspace.Encoder` given token ids. Decoders are read at the last
real position of each prompt; the answer is one token (a string that tokenizes to exactly one token, or
an id).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ...core.checks import is_int
from ...nn.norms import rms_inverse
from ..trace.trace import as_module
from .budget import check_length


@dataclass
class Prompts:
    """Token ids [batch, seq], key_padding [batch, seq] (True = real), and each row's last real index."""

    tokens: Tensor
    key_padding: Tensor
    last: Tensor  # int64 [batch]
    texts: list[str] | None

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]


def is_decoder(module: nn.Module) -> bool:
    return getattr(getattr(module, "config", None), "arch", None) == "decoder"


def stack_of(model: Any, what: str) -> nn.Module:
    """The Encoder/Decoder behind ``model``, refusing anything else with a clear error."""
    module = as_module(model)
    if not hasattr(module, "blocks") or not hasattr(module, "config"):
        raise TypeError(
            f"{what} needs a headspace Encoder or Decoder (or a loaded model wrapping one); "
            f"got {type(model).__name__}"
        )
    return module


def last_resid(module: nn.Module) -> str:
    """The hook point of the last block's output, ``blocks.{n_layers - 1}.hook_resid_post`` (the final
    norm's input, from which the output is read)."""
    return f"blocks.{len(module.blocks) - 1}.hook_resid_post"


def prompts_of(model: Any, prompts: Any, what: str = "prompts") -> Prompts:
    """Tokenize ``prompts`` (a str, a list of str, or int64 ids [batch, seq]) for ``model``; prompts longer
    than its position table are refused here, before any forward (:func:`.budget.check_length`)."""
    module = stack_of(model, what)
    device = next(module.parameters()).device
    if isinstance(prompts, Tensor):
        if prompts.dim() == 1:
            prompts = prompts.unsqueeze(0)  # (1, seq)
        if prompts.dim() != 2 or prompts.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"{what} as a tensor must be int64 token ids [batch, seq]; got {list(prompts.shape)}"
            )
        tokens = prompts.long().to(device)
        key_padding = torch.ones_like(tokens, dtype=torch.bool)
        texts = None
    else:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, Sequence) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise TypeError(f"{what} must be a string, a list of strings or token ids; got {prompts!r:.80}")
        tokenize = getattr(model, "tokenize_padded", None)
        if tokenize is None:
            raise TypeError(
                f"{what} are text but {type(model).__name__} has no tokenizer; pass a loaded model "
                "(headspace.load(...)) or token ids [batch, seq]"
            )
        tokens, key_padding = tokenize(list(prompts))  # (batch, seq) x 2, right-padded
        tokens, key_padding = tokens.to(device), key_padding.to(device)
        texts = list(prompts)
    label = "prompt" if what == "prompts" else f"{what} prompt"
    check_length(module, tokens, label if tokens.shape[0] == 1 else f"the longest {label}")
    empty = [0] if tokens.shape[1] == 0 else (~key_padding.any(dim=1)).nonzero()[:, 0].tolist()
    if empty:
        raise ValueError(_empty_message(what, empty[0], tokens.shape[0], texts))
    last = key_padding.long().sum(dim=1) - 1  # (batch,): right padding, so the last real index
    return Prompts(tokens, key_padding, last, texts)


def _empty_message(what: str, row: int, n: int, texts: list[str] | None) -> str:
    """``"clean prompt is empty ('' tokenizes to no token): ..."``, ``"prompt 2 of 3 is empty ..."``."""
    label = "prompt" if what == "prompts" else f"{what} prompt"
    which = label if n == 1 else f"{label} {row + 1} of {n}"
    why = "it holds no token id" if texts is None else f"{texts[row]!r} tokenizes to no token"
    return f"{which} is empty ({why}): every prompt needs at least one token"


def token_id(model: Any, answer: Any, what: str = "answer") -> int:
    """The single token id of ``answer`` (an id, or a string that must tokenize to exactly one token)."""
    module = stack_of(model, what)
    vocab = module.config.vocab_size
    if is_int(answer):
        if not 0 <= answer < vocab:
            raise ValueError(f"{what} id must be in [0, vocab_size={vocab}); got {answer}")
        return answer
    if not isinstance(answer, str):
        raise TypeError(f"{what} must be a token string (e.g. ' Paris') or a token id; got {answer!r}")
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise TypeError(f"{what} is text but the model has no tokenizer; pass the token id")
    ids = tokenizer.plain_ids(answer)
    if len(ids) != 1:
        pieces = tokenizer.plain_tokens(answer) if ids else []
        raise ValueError(
            f"{what} {answer!r} must be one token; it tokenizes to {len(ids)}: {pieces} (ids {ids}). "
            "Choose a single-token answer (a leading space often matters: ' Paris' vs 'Paris')"
        )
    return ids[0]


def check_distinct_answers(model: Any, answer: int, other: int | None) -> None:
    """``answer`` and ``other`` (token ids) must differ: logit(answer) - logit(other) would be 0 always."""
    if other is not None and answer == other:
        raise ValueError(
            f"answer and other are the same token ({token_str(model, answer)!r}, id {answer}): the metric "
            "logit(answer) - logit(other) is then 0 in every run; give two different tokens (e.g. answer "
            "' Mary', other ' John'), or no other for logit(answer) alone"
        )


def token_str(model: Any, token: int) -> str:
    tokenizer = getattr(model, "tokenizer", None)
    return str(token) if tokenizer is None else tokenizer.decode([token], skip_special_tokens=False)


def frozen_norm(norm: nn.Module | None, x: Tensor) -> tuple[Tensor, Tensor]:
    """The final norm at ``x`` [..., d_model] as a linear map with its scale frozen from this run.

    Returns (``scale`` [..., d_model], ``bias`` [..., d_model]) with ``norm(x) = center(x) * scale + bias``
    exactly, where ``center`` subtracts the mean for a LayerNorm and is the identity for an RMSNorm.
    A part ``p`` of ``x`` then contributes ``center(p) * scale`` (its share of the normalised stream).
    """
    if norm is None or isinstance(norm, nn.Identity):  # no norm (ModernBERT's first attention input)
        return torch.ones_like(x), torch.zeros_like(x)
    if isinstance(norm, nn.LayerNorm):
        sigma = torch.sqrt(x.var(dim=-1, unbiased=False, keepdim=True) + norm.eps)  # (..., 1)
        w = norm.weight if norm.weight is not None else torch.ones_like(x[..., 0, None])
        b = norm.bias if norm.bias is not None else torch.zeros_like(x[..., 0, None])
        return (w / sigma).expand_as(x), b.expand_as(x)
    eps = getattr(norm, "eps", None)
    weight = getattr(norm, "weight", None)
    if eps is None or weight is None:
        raise TypeError(f"cannot freeze a final norm of type {type(norm).__name__}")
    w = weight + getattr(norm, "offset", 0.0)
    return (w * rms_inverse(x, eps).to(x.dtype)).expand_as(x), torch.zeros_like(x)


def post_attention_norm(block: nn.Module) -> nn.Module | None:
    """The norm between a block's attention output and the residual add (Gemma's sandwich
    ``ln_attn_out``, OLMo 2's post-sublayer ``ln1``), or None (pre- and post-LN blocks add the attention
    output as it is). A head's direct part passes it, frozen at the layer's output."""
    kind = getattr(block, "norm", None)
    if kind == "sandwich":
        return block.ln_attn_out
    return block.ln1 if kind == "post_sublayer" else None


def centered(norm: nn.Module | None, p: Tensor) -> Tensor:
    """``p`` minus its mean over d_model for a LayerNorm (the norm's linear part); ``p`` otherwise."""
    if isinstance(norm, nn.LayerNorm):
        return p - p.mean(dim=-1, keepdim=True)
    return p


def gather_last(t: Tensor, last: Tensor) -> Tensor:
    """Rows of ``t`` [batch, seq, ...] at each row's index ``last`` [batch] -> [batch, ...]."""
    return t[torch.arange(t.shape[0], device=t.device), last]
