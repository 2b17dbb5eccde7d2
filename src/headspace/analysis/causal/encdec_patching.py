"""Activation patching of cross-attention heads: clean and corrupt sources (sentences or audio), the same
decoder tokens.

For a decoder layer ``L`` and head ``h``, the corrupt run is repeated with that head's output ``z_h``
(``decoder.blocks.L.cross_attn.hook_z[..., h, :]``, [batch, seq_dec, d_head]) taken from the clean run;
the effect is ``metric(patched) - metric(corrupt)``. The decoder reads the source only through its
cross-attention heads, so patching every head of every layer gives the clean logits exactly (the decoder's
own tokens are the same in both runs): the sweep's heads share out that whole difference (not additively).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ...core.checks import is_int
from ...model.encdec import EncoderDecoder
from ..trace.trace import hooked, trace


@dataclass
class CrossPatching:
    """``effects`` [n_decoder_layers, n_heads]: ``metric(patched) - metric(corrupt)`` per head; ``clean``
    and ``corrupt``: the metric of the two runs."""

    effects: Tensor
    clean: float
    corrupt: float


def _z_name(layer: int) -> str:
    return f"decoder.blocks.{layer}.cross_attn.hook_z"


def _check_heads(model: EncoderDecoder, heads: Sequence[tuple[int, int]]) -> None:
    c = model.config
    for pair in heads:
        ok = isinstance(pair, tuple) and len(pair) == 2 and all(is_int(v) for v in pair)
        if not ok or not (0 <= pair[0] < c.n_decoder_layers and 0 <= pair[1] < c.n_heads):
            raise ValueError(
                f"heads must be (decoder layer in [0, {c.n_decoder_layers}), head in [0, {c.n_heads})) "
                f"pairs; got {pair!r}"
            )


def clean_cross_z(model: EncoderDecoder, clean: Tensor, decoder_input_ids: Tensor) -> dict[int, Tensor]:
    """Every decoder layer's cross-attention ``hook_z`` [batch, seq_dec, n_heads, d_head] of the clean run."""
    names = [_z_name(i) for i in range(model.config.n_decoder_layers)]
    with torch.no_grad(), trace(model, names=names) as t:
        model(clean, decoder_input_ids)
    return {i: t[_z_name(i)] for i in range(model.config.n_decoder_layers)}


def patched_logits(
    model: EncoderDecoder,
    clean: Tensor | dict[int, Tensor],
    corrupt: Tensor,
    decoder_input_ids: Tensor,
    heads: Sequence[tuple[int, int]],
    *,
    memory: Tensor | None = None,
) -> Tensor:
    """The corrupt run's logits [batch, seq_dec, vocab] with the cross-attention heads ``heads`` ((decoder
    layer, head) pairs) given the clean run's ``z`` (``clean``: the clean inputs, or
    :func:`clean_cross_z` of them). ``memory``: ``model.encode(corrupt)`` [batch, seq_k, d_model] when
    known (the encoder is not run again; the patch is in the decoder)."""
    if not isinstance(model, EncoderDecoder):
        raise TypeError(f"model must be a headspace EncoderDecoder; got {type(model).__name__}")
    _check_heads(model, heads)
    z = clean if isinstance(clean, dict) else clean_cross_z(model, clean, decoder_input_ids)
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        by_layer.setdefault(layer, []).append(head)

    def patch(layer: int, chosen: list[int]) -> Callable[[Tensor, object], Tensor]:
        def fn(value: Tensor, _point: object) -> Tensor:
            if value.shape != z[layer].shape:
                raise ValueError(
                    f"the clean and corrupt runs must give the same shapes; {_z_name(layer)} is "
                    f"{list(value.shape)} corrupt and {list(z[layer].shape)} clean"
                )
            out = value.clone()
            out[:, :, chosen] = z[layer][:, :, chosen]  # (B, T, len(chosen), dh)
            return out

        return fn

    hooks = {_z_name(layer): patch(layer, chosen) for layer, chosen in by_layer.items()}
    with torch.no_grad(), hooked(model, hooks):
        if memory is not None:
            return model.decode(decoder_input_ids, memory)
        return model(corrupt, decoder_input_ids)


def _default_metric(clean_logits: Tensor) -> Callable[[Tensor], float]:
    """The log-probability, at the last position of the first row, of the clean run's top token there."""
    target = int(clean_logits[0, -1].argmax())
    return lambda logits: float(torch.log_softmax(logits[0, -1].float(), -1)[target])


def patch_cross_heads(
    model: EncoderDecoder,
    clean: Tensor,
    corrupt: Tensor,
    decoder_input_ids: Tensor,
    metric: Callable[[Tensor], float] | None = None,
) -> CrossPatching:
    """Patch each cross-attention head alone (module docstring). ``metric(logits) -> float``; default: the
    log-probability of the clean run's top next token at the last position (first row)."""
    with torch.no_grad():
        clean_logits = model(clean, decoder_input_ids)
        corrupt_logits = model(corrupt, decoder_input_ids)
    metric = _default_metric(clean_logits) if metric is None else metric
    z = clean_cross_z(model, clean, decoder_input_ids)
    with torch.no_grad():
        memory = model.encode(corrupt)  # [batch, seq_k, d_model]: one encoder run for every patched run
    c = model.config
    base = metric(corrupt_logits)
    effects = torch.zeros(c.n_decoder_layers, c.n_heads)
    for layer in range(c.n_decoder_layers):
        for head in range(c.n_heads):
            effects[layer, head] = (
                metric(patched_logits(model, z, corrupt, decoder_input_ids, [(layer, head)], memory=memory))
                - base
            )
    return CrossPatching(effects=effects, clean=metric(clean_logits), corrupt=base)
