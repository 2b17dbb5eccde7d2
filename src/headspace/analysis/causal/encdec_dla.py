"""Direct logit attribution through an encoder-decoder's decoder (issue #40).

In a pre-LN decoder (T5, Whisper) the final stream at position ``t`` is a sum of parts::

    h_t = embed_t + sum_L (sum_h r^self_{L,h} + b^self_O,L) + (sum_h r^cross_{L,h} + b^cross_O,L) + mlp_L

(``embed``: the token embedding plus positions, ``decoder.blocks.0.hook_resid_pre``; ``r_{L,h}``: a head's
``hook_result``, ``z_h W_O[h]``), and the logit of token ``y`` is, with the final norm's scale frozen at
``h_t`` (:func:`~.causal_inputs.frozen_norm`: ``N(h) = center(h) * s + beta``)::

    logit_y = output_scale * N(h_t) . W_U[:, y] + b_U[y]
            = sum_parts o * (center(part) * s) . W_U[:, y] + o * beta . W_U[:, y] + b_U[y]   (o: output_scale)

so every part's share adds up to the logit exactly. A cross-attention head's share is what it read from
the source (or the audio) and wrote towards ``y``. A post-LN decoder (BART, Marian) normalises the stream
after every sublayer, so its logit is no sum of the sublayers' outputs: refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...core.checks import is_int
from ...model.encdec import EncoderDecoder
from ..trace.trace import trace
from .causal_inputs import centered, frozen_norm


@dataclass
class EncDecLogitAttribution:
    """Each part's share of ``logit`` (the token ``token`` at decoder position ``position``, first row).

    ``self_heads``, ``cross_heads`` [n_layers, n_heads]; ``mlps``, ``self_biases``, ``cross_biases``
    [n_layers] (the output projections' biases ``b_O``); ``embed``: the embedding's; ``norm_bias``: the
    final norm's bias plus ``b_U[token]``; ``total``: their sum, equal to ``logit`` (the model's)."""

    token: int
    position: int
    self_heads: Tensor
    cross_heads: Tensor
    mlps: Tensor
    self_biases: Tensor
    cross_biases: Tensor
    embed: float
    norm_bias: float
    total: float
    logit: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values (tensors as nested lists)."""
        return {k: v.tolist() if isinstance(v, Tensor) else v for k, v in self.__dict__.items()}


def _check(model: Any, decoder_input_ids: Any, token: Any) -> None:
    if not isinstance(model, EncoderDecoder):
        raise TypeError(f"model must be a headspace EncoderDecoder; got {type(model).__name__}")
    if model.config.layout != "pre":
        raise ValueError(
            f"direct logit attribution through the decoder needs a pre-LN model (T5, Whisper); "
            f"{model.config.name or 'this model'} is post-LN (BART, Marian): every sublayer's norm rescales "
            "the stream, so the logit is no exact sum of the sublayers' outputs"
        )
    if not is_int(token) or not 0 <= token < model.config.vocab_size:
        raise ValueError(f"token must be an id in [0, {model.config.vocab_size}); got {token!r}")
    if not isinstance(decoder_input_ids, Tensor) or decoder_input_ids.dim() != 2:
        raise ValueError("decoder_input_ids must be int64 ids [batch, seq_dec]")


def _bias(attn: Any, like: Tensor) -> Tensor:
    """The output projection's bias [d_model] (zeros where it has none)."""
    return like.new_zeros(like.shape[-1]) if attn.o_bias is None else attn.o_bias.detach()


@torch.no_grad()
def encdec_logit_attribution(
    model: EncoderDecoder,
    inputs: Tensor,
    decoder_input_ids: Tensor,
    token: int,
    *,
    position: int = -1,
    attention_mask: Tensor | None = None,
) -> EncDecLogitAttribution:
    """Split the logit of ``token`` at decoder ``position`` (first row) over the decoder's parts (module
    docstring). ``inputs``: source ids [batch, seq] or audio features [batch, n_mels, frames]."""
    _check(model, decoder_input_ids, token)
    n_layers = len(model.decoder.blocks)
    names = ["decoder.blocks.0.hook_resid_pre", f"decoder.blocks.{n_layers - 1}.hook_resid_post"]
    for i in range(n_layers):
        names += [f"decoder.blocks.{i}.attn.hook_result", f"decoder.blocks.{i}.cross_attn.hook_result"]
        names.append(f"decoder.blocks.{i}.hook_mlp_out")
    with trace(model, names=names) as t:
        logits = model(inputs, decoder_input_ids, attention_mask)  # (B, T, vocab)
    pos = position % decoder_input_ids.shape[1]
    final = t[names[1]][0, pos]  # (d_model,)
    norm = model.decoder.final_ln
    scale, beta = frozen_norm(norm, final)  # (d_model,) x 2
    u = model.W_U[:, token] * model.config.output_scale  # (d_model,)

    def share(part: Tensor) -> Tensor:  # part (..., d_model) -> (...)
        return (centered(norm, part) * scale) @ u

    rows = {
        kind: torch.stack(
            [share(t[f"decoder.blocks.{i}.{kind}.hook_result"][0, pos]) for i in range(n_layers)]
        )
        for kind in ("attn", "cross_attn")
    }  # each (L, H)
    mlps = torch.stack(
        [share(t[f"decoder.blocks.{i}.hook_mlp_out"][0, pos]) for i in range(n_layers)]
    )  # (L,)
    blocks = model.decoder.blocks
    self_b = torch.stack([share(_bias(b.attn, final)) for b in blocks])  # (L,)
    cross_b = torch.stack([share(_bias(b.cross_attn, final)) for b in blocks])  # (L,)
    embed = share(t[names[0]][0, pos])
    b_U = 0.0 if model.logits_bias is None else float(model.logits_bias[token])
    norm_bias = float(beta @ u) + b_U
    total = float(
        embed + rows["attn"].sum() + rows["cross_attn"].sum() + mlps.sum() + self_b.sum() + cross_b.sum()
    )
    return EncDecLogitAttribution(
        token=int(token), position=pos, self_heads=rows["attn"], cross_heads=rows["cross_attn"], mlps=mlps,
        self_biases=self_b, cross_biases=cross_b, embed=float(embed), norm_bias=norm_bias,
        total=total + norm_bias, logit=float(logits[0, pos, token]),
    )  # fmt: skip


__all__ = ["EncDecLogitAttribution", "encdec_logit_attribution"]
