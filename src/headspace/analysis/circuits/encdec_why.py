"""``why`` for a cross-attention score: which parts of the decoder's stream (the query side) and of the
encoder's stream (the key side) make head ``h`` of decoder layer ``L`` score source position ``j`` from
decoder position ``i`` (issue #40).

In a pre-LN model (T5, Whisper) the cross-attention's query input is ``x_i = N_c(d_i)``, ``d_i`` the
decoder's stream after layer ``L``'s self-attention, a sum of parts ``d_i = sum_a c_a`` (the embedding,
every earlier sublayer's output, layer ``L``'s self-attention output); its key input is the encoder's
output ``e_j = N_e(g_j)``, ``g_j = sum_b c'_b`` (the encoder's embedding, every encoder sublayer's
output). With both norms' scales frozen at this run (``N(x) = center(x) * s + beta``)::

    q_a = (center(c_a) * s_c) W_Q[h]      q_bias = beta_c W_Q[h] + b_Q[h]
    k_b = (center(c'_b) * s_e) W_K[h]     k_bias = beta_e W_K[h] + b_K[h]
    score_ij = scale * sum_{a in parts + bias} sum_{b in parts + bias} q_a . k_b

so ``matrix[a, b] = scale * q_a . k_b`` adds up exactly to the head's pre-softmax score
(``hook_scores``; cross-attention has no position bias). A post-LN model (BART, Marian) normalises the
stream after every sublayer, so neither side is a sum of sublayer outputs: refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...core.checks import is_int
from ...model.encdec import EncoderDecoder
from ..causal.causal_inputs import centered, frozen_norm
from ..trace.trace import trace


@dataclass
class CrossScoreSplit:
    """``matrix`` [len(query_parts), len(key_parts)]: each (query part, key part) pair's share of the
    cross-attention score ``score`` (the run's ``hook_scores``); ``total``: the matrix's sum (== score)."""

    layer: int
    head: int
    query: int
    key: int
    query_parts: list[str]
    key_parts: list[str]
    matrix: Tensor
    score: float
    total: float

    def top(self, k: int = 5) -> list[tuple[str, str, float]]:
        """The ``k`` pairs of largest magnitude: (query part, key part, share)."""
        flat = self.matrix.flatten()
        order = flat.abs().argsort(descending=True)[:k]
        n = self.matrix.shape[1]
        return [(self.query_parts[int(i) // n], self.key_parts[int(i) % n], float(flat[i])) for i in order]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values."""
        d = dict(self.__dict__)
        d["matrix"] = self.matrix.tolist()
        return d


def _check(model: Any, layer: Any, head: Any) -> None:
    if not isinstance(model, EncoderDecoder):
        raise TypeError(f"model must be a headspace EncoderDecoder; got {type(model).__name__}")
    c = model.config
    if c.layout != "pre":
        raise ValueError(
            f"why for a cross-attention score needs a pre-LN model (T5, Whisper); {c.name or 'this model'} "
            "is post-LN (BART, Marian): its streams are no sums of sublayer outputs"
        )
    if not is_int(layer) or not 0 <= layer < c.n_decoder_layers:
        raise ValueError(f"layer must be in [0, {c.n_decoder_layers}); got {layer!r}")
    if not is_int(head) or not 0 <= head < c.n_heads:
        raise ValueError(f"head must be in [0, {c.n_heads}); got {head!r}")


def _names(model: EncoderDecoder, layer: int) -> tuple[list[str], list[str]]:
    """The hook names of the query side's parts and of the key side's parts (module docstring)."""
    q = ["decoder.blocks.0.hook_resid_pre"]
    for i in range(layer):
        q += [f"decoder.blocks.{i}.hook_{s}_out" for s in ("attn", "cross", "mlp")]
    q.append(f"decoder.blocks.{layer}.hook_attn_out")
    k = ["encoder.blocks.0.hook_resid_pre"]
    for i in range(len(model.encoder.blocks)):
        k += [f"encoder.blocks.{i}.hook_attn_out", f"encoder.blocks.{i}.hook_mlp_out"]
    return q, k


def _label(name: str) -> str:
    """``decoder.blocks.2.hook_cross_out`` -> ``decoder.2.cross``; a stack's first resid -> its embed."""
    if name.endswith("blocks.0.hook_resid_pre"):
        return name.split(".")[0] + ".embed"
    stack, _, i, hook = name.split(".")
    return f"{stack}.{i}.{hook.removeprefix('hook_').removesuffix('_out')}"


def _side(parts: Tensor, norm: Any, W: Tensor, b: Tensor | None) -> Tensor:
    """Each part's projection through the frozen norm, then the bias row: [n_parts + 1, d_head].

    ``parts`` [n_parts, d_model] sum to the norm's input."""
    scale, beta = frozen_norm(norm, parts.sum(0))  # (d_model,) x 2
    proj = (centered(norm, parts) * scale) @ W  # (n_parts, d_head)
    bias = beta @ W + (0 if b is None else b)  # (d_head,)
    return torch.cat([proj, bias[None]])  # (n_parts + 1, d_head)


@torch.no_grad()
def why_cross_score(
    model: EncoderDecoder,
    inputs: Tensor,
    decoder_input_ids: Tensor,
    *,
    layer: int,
    head: int,
    query: int = -1,
    key: int = 0,
    attention_mask: Tensor | None = None,
) -> CrossScoreSplit:
    """Split head ``head`` of decoder layer ``layer``'s cross-attention score from decoder position
    ``query`` to source position ``key`` (first row) over (query part, key part) pairs (module docstring)."""
    _check(model, layer, head)
    q_names, k_names = _names(model, layer)
    score_name = f"decoder.blocks.{layer}.cross_attn.hook_scores"
    with trace(model, names=[*q_names, *k_names, score_name]) as t:
        model(inputs, decoder_input_ids, attention_mask)
    i = query % decoder_input_ids.shape[1]
    seq_k = t[k_names[0]].shape[1]
    if not is_int(key) or not -seq_k <= key < seq_k:
        raise ValueError(f"key must be a source position in [0, {seq_k}); got {key!r}")
    j = key % seq_k
    attn = model.decoder.blocks[layer].cross_attn
    hd = attn.heads[head]
    q_parts = torch.stack([t[n][0, i] for n in q_names])  # (n_q, d_model)
    k_parts = torch.stack([t[n][0, j] for n in k_names])  # (n_k, d_model)
    q = _side(q_parts, model.decoder.blocks[layer].ln_cross, hd.W_Q, hd.b_Q)  # (n_q + 1, d_head)
    k = _side(k_parts, model.encoder.final_ln, hd.W_K, hd.b_K)  # (n_k + 1, d_head)
    matrix = q @ k.T * attn.scale  # (n_q + 1, n_k + 1)
    return CrossScoreSplit(
        layer=layer, head=head, query=i, key=j, query_parts=[*map(_label, q_names), "bias"],
        key_parts=[*map(_label, k_names), "bias"], matrix=matrix, score=float(t[score_name][0, head, i, j]),
        total=float(matrix.sum()),
    )  # fmt: skip


__all__ = ["CrossScoreSplit", "why_cross_score"]
