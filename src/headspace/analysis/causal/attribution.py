"""Which parts write the answer: direct logit attribution and the logit lens (decoders).

**Direct logit attribution.** In a pre-norm decoder the residual stream at the last position is a sum
of parts: ``x_L = e + sum_l (sum_h r_{l,h} + b_O^l + m_l)``, with ``e`` the embeddings, ``r_{l,h}`` head
``h``'s output ``z_h W_O[h]`` (``hook_result``), ``b_O^l`` the attention bias and ``m_l`` the MLP output.
The logit of token ``a`` is ``norm(x_L) . u`` with ``u = W_U[:, a]`` (``W_U[:, a] - W_U[:, b]`` for the
logit difference a - b). With the final norm's scale frozen from the run (``sigma``, the LayerNorm's or
RMSNorm's divisor at ``x_L``), the norm is linear, ``norm(x) = c(x) w / sigma + beta`` (``c`` subtracts
the mean for a LayerNorm), so each part ``p`` contributes ``(c(p) w / sigma) . u`` and the parts add up
**exactly** to the model's own logit (difference); ``beta . u`` is the norm's bias term. Where a norm sits
between the attention output and the residual add (Gemma 2 / 3's sandwich ``ln_attn_out``, OLMo 2's
post-sublayer norm), it is frozen the same way at the layer's output ``sum_h r_{l,h} + b_O^l``, so each
head's part is its ``hook_result`` through that norm (the norm's shift joins ``b_O^l``); the MLP's part is
``hook_mlp_out``, taken after its norm.

**Gates and hybrids** (Qwen3-Next, Qwen3.5). A gated softmax layer's ``hook_result`` is the gated
``(z_h * sigmoid(x W_G[h])) W_O[h]``: each head's part holds the gate **frozen at its run's value**
(the gate is not attributed apart; the parts still add up exactly). A Gated DeltaNet layer's heads are
its value heads, each ``z_h W_O[h]`` (its ``hook_result``; ``z_h`` the gated norm's output, its silu gate
as on the run): exact the same way. Layers may have different head counts: ``heads`` is padded with
zeros to the widest layer and ``layer_heads`` gives each layer's count. A mixture of experts is one
part per layer (``mlps``: the routed and shared experts together).

**Logit lens.** Each layer's residual stream at the last position, read through the final norm and the
unembedding as if the model stopped there: the top tokens per layer, and the answer's rank and
probability per layer. The last row is the model's own prediction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ...attention.delta_net import GatedDeltaNet
from .._common import JsonResult, eval_mode
from ..trace.trace import trace
from .budget import attribution_bytes, check_memory, shape_of
from .causal_inputs import (
    centered,
    check_distinct_answers,
    frozen_norm,
    gather_last,
    is_decoder,
    last_resid,
    post_attention_norm,
    prompts_of,
    stack_of,
    token_id,
    token_str,
)


def _decoder(model: Any, what: str) -> Any:
    module = stack_of(model, what)
    if not is_decoder(module):
        raise TypeError(
            f"{what} reads logits, so it needs a decoder (GPT-2, Llama-family); this model is an "
            f"{module.config.arch}. For encoders use headspace.analysis.patch with an embedding metric"
        )
    return module


@dataclass
class LogitAttribution(JsonResult):
    """Each part's direct contribution to the logit (difference) at the last position.

    Shapes (``P`` prompts; means over prompts in the fields without ``per_prompt``):

    * ``heads``: [n_layers, max_heads], each head's ``hook_result`` (a gated head's with its gate
      frozen at the run's value); a layer with fewer heads is padded with zeros (``layer_heads``);
    * ``mlps``: [n_layers]; ``attn_biases``: [n_layers] (``b_O``, 0 without bias;
      through a post-attention norm, with that norm's shift);
    * ``embed``, ``norm_bias``, ``total``, ``logit``: scalars (0-d tensors); ``total`` is the sum of every
      part and equals ``logit``, the model's own logit (difference), up to float rounding;
    * ``per_prompt``: the same per prompt (``heads`` [P, n_layers, max_heads] ...);
    * ``layer_heads``: each layer's head count; ``mixers``: each layer's mixer (``"attention"`` or
      ``"gated_deltanet"``); ``gated``: whether each layer's heads carry a frozen output gate.
    """

    kind = "direct_logit_attribution"

    heads: Tensor
    mlps: Tensor
    attn_biases: Tensor
    embed: Tensor
    norm_bias: Tensor
    total: Tensor
    logit: Tensor
    answer: int
    other: int | None
    answer_token: str
    other_token: str | None
    per_prompt: dict[str, Tensor] = field(default_factory=dict)
    layer_heads: list[int] = field(default_factory=list)
    mixers: list[str] = field(default_factory=list)
    gated: list[bool] = field(default_factory=list)

    def top_heads(self, k: int = 10) -> list[tuple[int, int, float]]:
        """The ``k`` heads with the largest absolute contribution: ``[(layer, head, value), ...]``."""
        flat = self.heads.flatten()
        n = self.heads.shape[1]
        counts = self.layer_heads or [n] * self.heads.shape[0]
        real = [i for i in range(flat.numel()) if i % n < counts[i // n]]  # the padding left out
        order = sorted(real, key=lambda i: -abs(float(flat[i])))[:k]
        return [(i // n, i % n, float(flat[i])) for i in order]


def _check_memory(module: Any, p: Any, kind: str, max_memory: Any) -> None:
    """Refuse a forward whose estimated peak memory (:func:`.budget.attribution_bytes`) is above the limit."""
    m, (rows, seq) = shape_of(module), p.tokens.shape
    what = "direct logit attribution" if kind == "dla" else "the logit lens"
    check_memory(
        attribution_bytes(m, rows, seq, kind), what,
        f"{rows} prompt{'s' * (rows != 1)} of {seq} tokens, {m.n_layers} layers, {m.n_heads} heads, "
        f"d_model {m.d_model}, vocabulary {m.vocab}", "use fewer or shorter prompts", max_memory,
        p.tokens.device,
    )  # fmt: skip


@torch.no_grad()
def direct_logit_attribution(
    model: Any, prompts: Any, answer: Any, other: Any = None, *, max_memory: int | str | None = None
) -> LogitAttribution:
    """Direct logit attribution of ``answer`` (minus ``other``) at the last position of each prompt.

    Args:
        model: a loaded decoder (``headspace.load(...)``) or a :class:`~headspace.Decoder`.
        prompts: a string, a list of strings (right-padded into one batch) or int64 ids [batch, seq].
        answer: one token (``" Paris"``) or its id; ``other``: the same, for a logit difference.
        max_memory: the memory limit (bytes or a size such as ``"8G"``; default ``$HEADSPACE_MAX_MEMORY``,
            else the memory available): a run estimated above it is refused before the forward
            (:mod:`.budget`), and so is a prompt longer than the position table.

    Returns:
        :class:`LogitAttribution`; ``total == logit`` (the parts add up to the model's logit).

    Gated layers and Gated DeltaNet layers are attributed per head (module docstring: a gate is frozen
    at its run's value; the result's ``layer_heads``, ``mixers`` and ``gated`` say which is which).
    Differential layers (DiffLlama) are attributed per query head, each pair's norm frozen at its run's
    scale (``DifferentialAttention.head_parts``): heads ``j`` and ``j + n_heads / 2`` add up to pair
    ``j``'s ``hook_result``.

    Raises:
        ValueError: a block of the ``post`` layout (a norm after each residual add: OPT-350m), by name.
    """
    module = _decoder(model, "direct_logit_attribution")
    if any(block.spec.layout == "post" for block in module.blocks):  # OPT-350m: do_layer_norm_before false
        raise ValueError(
            "direct_logit_attribution does not support the block field 'layout' ('post'): the norm after "
            "each residual add rescales the whole stream, so no part has a fixed direct path to the logit"
        )
    p = prompts_of(model, prompts)
    a = token_id(model, answer, "answer")
    b = None if other is None else token_id(model, other, "other")
    check_distinct_answers(model, a, b)
    _check_memory(module, p, "dla", max_memory)
    n_layers = len(module.blocks)
    last = last_resid(module)
    with eval_mode(module), torch.no_grad():
        names = ["hook_embed", "blocks.*.attn.hook_result", "blocks.*.hook_mlp_out", last]
        names += [f"blocks.{i}.attn.hook_z" for i, b in enumerate(module.blocks) if _differential(b)]
        with trace(module, names=names) as t:
            logits = module(p.tokens, p.key_padding)  # (P, seq, vocab)
    W_U = module.W_U  # (d_model, vocab)
    u = W_U[:, a] if b is None else W_U[:, a] - W_U[:, b]  # (d_model,)
    x_final = gather_last(t[last], p.last)  # (P, d_model)
    scale, beta = frozen_norm(module.ln_final, x_final)  # (P, d_model) x 2
    norm = module.ln_final

    def contrib(part: Tensor) -> Tensor:  # part (P, ..., d_model) at the last position -> (P, ...)
        s = scale.view(scale.shape[0], *([1] * (part.dim() - 2)), scale.shape[-1])
        return (centered(norm, part) * s) @ u

    embed = contrib(gather_last(t["hook_embed"], p.last))  # (P,)
    mlps = torch.stack(
        [contrib(gather_last(t[f"blocks.{i}.hook_mlp_out"], p.last)) for i in range(n_layers)], dim=1
    )  # (P, L)
    heads, attn_biases, counts = _attention_parts(module, t, p, contrib)  # (P, L, H), (P, L), [L]
    norm_bias = beta @ u  # (P,)
    total = embed + heads.sum((1, 2)) + mlps.sum(1) + attn_biases.sum(1) + norm_bias  # (P,)
    last_logits = gather_last(logits, p.last)  # (P, vocab)
    logit = last_logits[:, a] if b is None else last_logits[:, a] - last_logits[:, b]  # (P,)
    per = {
        "heads": heads, "mlps": mlps, "attn_biases": attn_biases, "embed": embed,
        "norm_bias": norm_bias, "total": total, "logit": logit,
    }  # fmt: skip
    return LogitAttribution(
        heads=heads.mean(0), mlps=mlps.mean(0), attn_biases=attn_biases.mean(0), embed=embed.mean(0),
        norm_bias=norm_bias.mean(0), total=total.mean(0), logit=logit.mean(0), answer=a, other=b,
        answer_token=token_str(model, a), other_token=None if b is None else token_str(model, b),
        per_prompt=per, layer_heads=counts, mixers=[_mixer(block) for block in module.blocks],
        gated=[getattr(block.attn, "gate_weight", None) is not None for block in module.blocks],
    )  # fmt: skip


def _attention_parts(module: Any, t: Any, p: Any, contrib: Any) -> tuple[Tensor, Tensor, list[int]]:
    """Each layer's heads' parts [P, L, max_heads] (zeros after a layer's own heads), its bias parts
    [P, L] and its head counts, from the trace ``t`` (``blocks.*.attn.hook_result``); ``contrib`` maps
    a part [P, ..., d_model] at the last position to its logit contribution [P, ...]."""
    per_layer, biases = [], []
    for i, block in enumerate(module.blocks):
        if _differential(block):  # hook_result is per pair: each head's part at its pair's frozen norm
            z = gather_last(t[f"blocks.{i}.attn.hook_z"], p.last)  # (P, H, 2 d_head)
            r = block.attn.head_parts(z).to(t[f"blocks.{i}.attn.hook_result"].dtype)  # (P, H, d_model)
        else:
            r = gather_last(t[f"blocks.{i}.attn.hook_result"], p.last)  # (P, H, d_model)
        b_O = getattr(block.attn, "o_bias", None)  # a Gated DeltaNet has none
        bias = r.new_zeros(p.batch, r.shape[-1]) if b_O is None else b_O.expand(p.batch, -1)  # (P, d_model)
        post = post_attention_norm(block)
        if post is not None:  # the heads reach the stream through this norm, frozen at the layer's output
            s_post, beta_post = frozen_norm(post, r.sum(1) + bias)  # (P, d_model) x 2
            r = centered(post, r) * s_post[:, None]  # (P, H, d_model)
            bias = centered(post, bias) * s_post + beta_post  # (P, d_model)
        per_layer.append(contrib(r))  # (P, H)
        biases.append(contrib(bias[:, None])[:, 0])  # (P,)
    counts = [h.shape[1] for h in per_layer]
    width = max(counts)
    heads = torch.stack([torch.nn.functional.pad(h, (0, width - h.shape[1])) for h in per_layer], dim=1)
    # (P, L, max_heads): zeros after each layer's own heads
    return heads, torch.stack(biases, dim=1), counts


def _differential(block: Any) -> bool:
    """Whether ``block`` is differential attention (its ``hook_result`` holds a part per pair of heads)."""
    return hasattr(block.attn, "head_parts")


def _mixer(block: Any) -> str:
    """The block field 'mixer' of ``block``: ``"gated_deltanet"`` or ``"attention"``."""
    return "gated_deltanet" if isinstance(block.attn, GatedDeltaNet) else "attention"


@dataclass
class LogitLens(JsonResult):
    """Each layer's residual stream read through the final norm and the unembedding (last position).

    Row ``0`` is the embeddings, row ``l`` the stream after block ``l - 1``; the last row is the model's
    own prediction. Shapes (``P`` prompts, ``R = n_layers + 1`` rows, ``k`` = ``top``):

    * ``top_ids`` int64 [P, R, k], ``top_probs`` [P, R, k], ``top_tokens`` [P][R][k] strings;
    * ``answer_rank`` int64 [P, R] (0 = the top token) and ``answer_prob`` [P, R], or None without answer.
    """

    kind = "logit_lens"

    top_ids: Tensor
    top_probs: Tensor
    top_tokens: list[list[list[str]]]
    answer: int | None
    answer_token: str | None
    answer_rank: Tensor | None
    answer_prob: Tensor | None


@torch.no_grad()
def logit_lens(
    model: Any, prompts: Any, answer: Any = None, *, top: int = 5, max_memory: int | str | None = None
) -> LogitLens:
    """The logit lens of each prompt's last position (see the module docstring; ``max_memory`` as for
    :func:`direct_logit_attribution`)."""
    module = _decoder(model, "logit_lens")
    if not isinstance(top, int) or isinstance(top, bool) or top < 1:
        raise ValueError(f"top must be a positive int; got {top!r}")
    p = prompts_of(model, prompts)
    a = None if answer is None else token_id(model, answer, "answer")
    _check_memory(module, p, "lens", max_memory)
    with eval_mode(module), torch.no_grad():
        with trace(module, names=["hook_embed", "blocks.*.hook_resid_post"]) as t:
            module(p.tokens, p.key_padding)
        streams = [t["hook_embed"]] + [t[f"blocks.{i}.hook_resid_post"] for i in range(len(module.blocks))]
        rows = torch.stack([gather_last(s, p.last) for s in streams], dim=1)  # (P, R, d_model)
        normed = rows if module.ln_final is None else module.ln_final(rows)  # (P, R, d_model)
        logits = normed @ module.W_U  # (P, R, vocab)
        probs = torch.softmax(logits.float(), dim=-1)  # (P, R, vocab)
    k = min(top, probs.shape[-1])
    top_probs, top_ids = probs.topk(k, dim=-1)  # (P, R, k) x 2
    tokens = [[[token_str(model, int(i)) for i in row] for row in prompt] for prompt in top_ids]
    rank = prob = None
    if a is not None:
        prob = probs[..., a]  # (P, R)
        rank = (probs > prob.unsqueeze(-1)).sum(-1)  # (P, R): how many tokens beat the answer
    return LogitLens(
        top_ids=top_ids, top_probs=top_probs, top_tokens=tokens, answer=a,
        answer_token=None if a is None else token_str(model, a), answer_rank=rank, answer_prob=prob,
    )  # fmt: skip
