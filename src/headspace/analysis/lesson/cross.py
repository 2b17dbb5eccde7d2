"""The lesson on an encoder-decoder: one output token through one cross-attention head (or a T5 head's
relative-position bias), every number of the pipeline computed from the head's weights and the run's
inputs.

Cross-attention, for the decoder's query position ``t`` of head ``h`` in decoder layer ``L``::

    x_t   = the decoder's stream entering the cross-attention (after its norm where pre-LN)   [d_model]
    e_j   = the encoder's output at source position (token or audio frame) j                  [d_model]
    q     = x_t W_Q[h] + b_Q[h]        k_j = e_j W_K[h] + b_K[h]        v_j = e_j W_V[h] + b_V[h]   [d_head]
    s_j   = q . k_j * scale            p = softmax_j(s)  (over the source, padding masked)
    z     = sum_j p_j v_j              out = z W_O[h]                                            [d_model]

Self-attention (``attention="self"``) is the same over the stack's own positions, plus T5's bucket bias
``s_j = q . k_j * scale + weight[bucket(j - t), h]`` (:mod:`headspace.model.encdec.positions`), shown as
its own step (``buckets``, ``bias``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ...core.checks import is_int
from ...model.encdec import EncoderDecoder
from ..trace.trace import trace


@dataclass
class EncDecLesson:
    """One head's numbers for one query position (module docstring). Lists of floats, ready for JSON.

    ``stack``/``attention``: ``"decoder"``/``"cross"``, or a stack's ``"self"``; ``keys``, ``values``:
    [seq_k][d_head]; ``bias`` / ``buckets``: T5's bucket bias and bucket per key (self-attention of a
    T5 model), else None; ``top``: (key position, weight) of the largest weights, largest first.
    """

    stack: str
    attention: str
    layer: int
    head: int
    position: int
    scale: float
    x: list[float]
    q: list[float]
    keys: list[list[float]]
    scores: list[float]
    pattern: list[float]
    values: list[list[float]]
    z: list[float]
    out: list[float]
    bias: list[float] | None = None
    buckets: list[int] | None = None
    top: list[tuple[int, float]] = field(default_factory=list)

    def text(self, keys: list[str] | None = None) -> str:
        """The lesson as lines of text; ``keys`` names each key position (source tokens, frame times)."""

        def name(j: int) -> str:
            return keys[j] if keys is not None else f"#{j}"

        what = "source" if self.attention == "cross" else "position"
        lines = [
            f"{self.stack} layer {self.layer} head {self.head}, {self.attention}-attention, query position "
            f"{self.position}",
            f"q = x W_Q + b_Q: {len(self.q)} numbers from the decoder's stream"
            if self.attention == "cross"
            else f"q = x W_Q + b_Q: {len(self.q)} numbers",
            f"k_j, v_j = e_j W_K + b_K, e_j W_V + b_V for each of {len(self.keys)} {what}s",
        ]
        if self.bias is not None:
            pairs = ", ".join(
                f"{name(j)}: bucket {b} bias {v:+.3f}"
                for j, (b, v) in enumerate(zip(self.buckets or [], self.bias))
            )
            lines.append(f"relative-position bias by bucket of (key - query): {pairs}")
        lines.append(f"scores s_j = q . k_j * {self.scale:g}" + (" + bias" if self.bias is not None else ""))
        lines.append(
            "softmax over the "
            + what
            + "s; largest weights: "
            + ", ".join(f"{name(j)} {w:.3f}" for j, w in self.top)
        )
        lines.append(
            f"z = sum_j p_j v_j ({len(self.z)} numbers), written as z W_O[h] ({len(self.out)} numbers)"
        )
        return "\n".join(lines)


def _check(model: EncoderDecoder, stack: str, attention: str, layer: int, head: int) -> None:
    if not isinstance(model, EncoderDecoder):
        raise TypeError(f"model must be a headspace EncoderDecoder; got {type(model).__name__}")
    if (stack, attention) not in (("decoder", "cross"), ("decoder", "self"), ("encoder", "self")):
        raise ValueError(
            f"(stack, attention) must be ('decoder', 'cross'), ('decoder', 'self') or ('encoder', 'self'); "
            f"got ({stack!r}, {attention!r})"
        )
    c = model.config
    n = c.n_encoder_layers if stack == "encoder" else c.n_decoder_layers
    if not is_int(layer) or not 0 <= layer < n:
        raise ValueError(f"layer must be in [0, {n}) for the {stack}'s {n} layers; got {layer!r}")
    if not is_int(head) or not 0 <= head < c.n_heads:
        raise ValueError(f"head must be in [0, {c.n_heads}); got {head!r}")


def explain_encdec(
    model: EncoderDecoder,
    inputs: Tensor,
    decoder_input_ids: Tensor,
    *,
    layer: int,
    head: int,
    position: int = -1,
    stack: str = "decoder",
    attention: str = "cross",
    attention_mask: Tensor | None = None,
) -> EncDecLesson:
    """Walk query ``position`` (of the first row) through ``head`` of ``stack``'s layer ``layer``
    (module docstring): one forward pass records the layer's input and its key/value input, and every
    step is computed again from the head's views (``W_Q[h]``, ``W_K[h]``, ``W_V[h]``, ``W_O[h]``)."""
    _check(model, stack, attention, layer, head)
    block = f"{stack}.blocks.{layer}"
    point = f"{block}.hook_cross_in" if attention == "cross" else f"{block}.hook_attn_in"
    names = [
        point,
        "encoder.hook_out",
        f"{block}.{'cross_attn' if attention == 'cross' else 'attn'}.hook_pattern",
    ]
    with torch.no_grad(), trace(model, names=names) as t:
        model(inputs, decoder_input_ids, attention_mask)
    layer_mod = getattr(model, stack).blocks[layer]
    attn = layer_mod.cross_attn if attention == "cross" else layer_mod.attn
    x_all = t[point][0]  # (S_q, d_model)
    position = position % x_all.shape[0]
    kv_in = t["encoder.hook_out"][0] if attention == "cross" else x_all  # (S_k, d_model)
    hd = attn.heads[head]
    with torch.no_grad():
        q = t[point][0, position] @ hd.W_Q + (0 if hd.b_Q is None else hd.b_Q)  # (dh,)
        k = kv_in @ hd.W_K + (0 if hd.b_K is None else hd.b_K)  # (S_k, dh)
        v = kv_in @ hd.W_V + (0 if hd.b_V is None else hd.b_V)  # (S_k, dh)
        scores = k @ q * attn.scale  # (S_k,)
        bias = buckets = None
        table = getattr(attn, "position_bias", None)
        if table is not None:
            delta = position - torch.arange(kv_in.shape[0])  # (S_k,): query minus key position
            buckets = table.bucket(delta)
            bias = table.at(delta)[:, head]  # (S_k,)
            scores = scores + bias
        keep = _visible(model, attention, stack, kv_in.shape[0], position, attention_mask)
        scores = scores.masked_fill(~keep, float("-inf"))
        p = torch.softmax(scores, -1)  # (S_k,)
        z = p @ v  # (dh,)
        out = z @ hd.W_O  # (d_model,)
    weights, where = p.topk(min(5, p.shape[0]))
    return EncDecLesson(
        stack=stack, attention=attention, layer=layer, head=head, position=position, scale=float(attn.scale),
        x=x_all[position].tolist(), q=q.tolist(), keys=k.tolist(), scores=scores.tolist(), pattern=p.tolist(),
        values=v.tolist(), z=z.tolist(), out=out.tolist(), bias=None if bias is None else bias.tolist(),
        buckets=None if buckets is None else buckets.tolist(),
        top=[(int(j), float(w)) for j, w in zip(where, weights)],
    )  # fmt: skip


def _visible(
    model: EncoderDecoder, attention: str, stack: str, seq_k: int, position: int, mask: Tensor | None
) -> Tensor:
    """Which keys the query may see: the source's real positions (cross, encoder), the past (decoder)."""
    keep = torch.ones(seq_k, dtype=torch.bool)
    if stack == "decoder" and attention == "self":
        keep &= torch.arange(seq_k) <= position
    elif mask is not None and not model.config.audio:
        keep &= mask[0].bool().cpu()
    return keep
