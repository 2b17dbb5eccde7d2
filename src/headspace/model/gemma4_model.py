"""Gemma 4's text decoder (transformers' ``Gemma4ForCausalLM``) on headspace's blocks.

A :class:`Gemma4Decoder` is a :class:`~headspace.Decoder` whose blocks differ per layer, as
``config.extra["gemma4"]`` (:data:`LAYER_KEYS` per layer, written by the loader) says: sliding layers
of ``d_head`` and ``n_kv_heads``, full ("global") layers of their own head width and key/value heads
(``attention_k_eq_v``: values from the key projection; proportional partial RoPE), later layers reading
an earlier layer's keys and values (``kv_source``), a wider MLP on those (``use_double_wide_mlp``).
Every attention has a value norm without scale, QK-norms whose weights scale directly, and score scale 1
(:mod:`headspace.model.gemma_extras`). Around the blocks (``p`` = ``hidden_size_per_layer_input``)::

    e = E_tok[t] sqrt(d_model)
    P = (RMSNorm_P(e W_P / sqrt(d_model))[.., l, :] + E_ple[t][.., l, :] sqrt(p)) / sqrt(2)   [B, S, L, p]
    h_l = Block_l(h_{l-1})                                  (sandwich norms, :class:`TransformerBlock`)
    h_l <- h_l + N_l((gelu_tanh(h_l W_g[l]) * P[.., l, :]) W_p[l])    (per-layer input; hook_ple_out)
    h_l <- h_l * s_l                                        (layer_scalar)
    logits = cap tanh(RMSNorm_f(h_L) E_tok^T / cap)

Hook points beyond the Decoder's: ``hook_per_layer_inputs`` [batch, seq, n_layers, p] (``P``) and,
per layer, ``ple.L.hook_out`` [batch, seq, d_model] (the per-layer input's residual contribution).
``blocks.L.hook_resid_post`` is the block's output before the per-layer input and scalar.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor, nn

from ..nn.hooks import HookPoint
from ..nn.inputs import check_positions, check_tokens
from ..nn.kv_cache import KVCache
from ..nn.norms import RMSNorm
from ..nn.positions import Rotary
from ..nn.spec import BlockSpec
from . import gemma4_step
from .block import TransformerBlock
from .block import _sum as residual_sum
from .config import ModelConfig
from .gemma4_moe import Gemma4MoE
from .gemma_extras import GemmaAttention, SharedKV, proportional_rotary
from .mlp import make_activation
from .models import Decoder

#: The per-layer entries of ``config.extra["gemma4"]["layers"]``.
LAYER_KEYS = ("type", "d_head", "n_kv_heads", "d_mlp", "k_eq_v", "kv_source")


def _rotaries(c: ModelConfig, g: dict[str, Any]) -> dict[str, Rotary]:
    """One rotation per layer type: sliding layers' plain RoPE over their head width, the full
    layers' (``"proportional"`` partial or plain) over theirs."""
    out: dict[str, Rotary] = {}
    for kind, rope in g["rope"].items():
        widths = [layer["d_head"] for layer in g["layers"] if layer["type"] == kind]
        if not widths:
            continue
        if rope["rope_type"] == "proportional":
            out[kind] = proportional_rotary(widths[0], rope["rope_theta"], rope["partial"], rope["factor"])
        else:
            out[kind] = Rotary(widths[0], base=rope["rope_theta"], max_seq_len=c.max_seq_len)
    return out


def gemma4_block_specs(c: ModelConfig, key: str = "gemma4") -> list[BlockSpec]:
    """Every block's description from ``c`` and ``c.extra[key]`` (module docstring; Gemma 3n's
    layers are described under ``"gemma3n"`` the same way)."""
    g = c.extra[key]
    rotaries = _rotaries(c, g)
    base = c.block_spec(0)
    specs = []
    for layer in g["layers"]:
        kind = layer["type"]
        attention = dataclasses.replace(
            base.attention, d_head=layer["d_head"], n_kv_heads=layer["n_kv_heads"], positions=rotaries[kind],
            window=c.sliding_window if kind == "sliding" else None, scale=1.0, v_norm=True,
            k_eq_v=layer["k_eq_v"], kv_source=layer["kv_source"],
        )  # fmt: skip
        mlp = dataclasses.replace(base.mlp, d_mlp=layer["d_mlp"])
        if g.get("moe"):  # the experts' width; the dense MLP is the "shared" expert every token takes
            moe = g["moe"]
            mlp = dataclasses.replace(
                mlp, kind="moe", d_mlp=moe["d_expert"], n_experts=moe["n_experts"], top_k=moe["top_k"],
                norm_topk=True, d_shared=layer["d_mlp"],
            )  # fmt: skip
        specs.append(dataclasses.replace(base, attention=attention, mlp=mlp))
    return specs


class PerLayerInput(nn.Module):
    """One layer's per-layer input: ``h + N((act(h W_g) * P_l) W_p)`` with hook ``hook_out`` [batch,
    seq, d_model] (the added term). ``gate`` [p, d_model], ``proj`` [d_model, p] (nn.Linear layouts)."""

    def __init__(self, d_model: int, p: int, act: str, eps: float) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, p, bias=False)
        self.proj = nn.Linear(p, d_model, bias=False)
        self.norm = RMSNorm(d_model, eps=eps)
        self.act = make_activation(act)
        self.hook_out = HookPoint()  # [batch, seq, d_model]

    def term(self, h: Tensor, per_layer: Tensor) -> Tensor:
        """The added term ``N((act(h W_g) * P_l) W_p)`` [B, S, d_model] (through ``hook_out``) of h [B, S,
        d_model] and per_layer [B, S, p]."""
        y = self.norm(self.proj(self.act(self.gate(h)) * per_layer))  # (B, S, d_model)
        return self.hook_out(y) if self.hook_out.fns else y

    def forward(self, h: Tensor, per_layer: Tensor, scale: Tensor | None = None) -> Tensor:
        """h [B, S, d_model], per_layer [B, S, p] -> ``h + term`` [B, S, d_model], times ``scale`` (a
        0-d tensor: the layer scalar) when given. While no hook function and no autograd graph sees the
        term, the sum and the product are written over it (the same values)."""
        y = self.term(h, per_layer)  # (B, S, d_model)
        out = residual_sum(y, h, self.hook_out)  # (B, S, d_model): over y where nothing else reads it
        if scale is None:
            return out
        return out.mul_(scale) if out is y and not h.requires_grad else out * scale


class Gemma4Decoder(Decoder):
    """Gemma 4's text decoder (module docstring). ``config.extra["gemma4"]``: ``layers`` (one dict of
    :data:`LAYER_KEYS` per layer), ``rope`` (per layer type: ``rope_type``, ``rope_theta``,
    ``partial``, ``factor``), ``ple`` (p, or None without per-layer inputs), ``ple_vocab`` and ``moe``
    (None, or ``n_experts``, ``top_k``, ``d_expert``: every layer's MLP a
    :class:`~headspace.model.gemma4_moe.Gemma4MoE`, its block's ``ln2`` the identity)."""

    #: the key of ``config.extra`` that describes the layers
    EXTRA_KEY = "gemma4"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        c = self.config
        g = c.extra[self.EXTRA_KEY]
        self.blocks = nn.ModuleList(
            TransformerBlock.from_spec(s) for s in gemma4_block_specs(c, self.EXTRA_KEY)
        )
        self._kv_store = SharedKV()  # the owners' keys and values, while a forward runs
        for i, block in enumerate(self.blocks):
            attn = block.attn
            assert isinstance(attn, GemmaAttention)
            attn.layer_index, attn.kv_store = i, self._kv_store
            if attn.spec.kv_source is not None:
                attn.share_from(self.blocks[attn.spec.kv_source].attn)
            if g.get("moe"):  # the router and the experts' norm read h itself: the block's ln2 is none
                m = block.spec.mlp
                assert m.n_experts is not None and m.top_k is not None and m.d_shared is not None
                block.mlp = Gemma4MoE(
                    c.d_model, m.d_shared, m.d_mlp, m.n_experts, m.top_k, act=c.act, eps=c.ln_eps
                )
                block.ln2 = nn.Identity()
        self.register_buffer("layer_scalars", torch.ones(c.n_layers))
        p = g["ple"]
        self.ple_dim = p
        if p:
            L, d = c.n_layers, c.d_model
            self.ple_embed = nn.Embedding(g["ple_vocab"], L * p)
            self.ple_model_proj = nn.Linear(d, L * p, bias=False)
            self.ple_norm = RMSNorm(p, eps=c.ln_eps)
            self.ple = nn.ModuleList(PerLayerInput(d, p, c.act, c.ln_eps) for _ in range(L))
            self.hook_per_layer_inputs = HookPoint()  # [batch, seq, n_layers, p]
        self._init_weights()

    def per_layer_inputs(self, tokens: Tensor, e: Tensor) -> Tensor:
        """``P`` [batch, seq, n_layers, p] of tokens [batch, seq] and their embedding e [batch, seq,
        d_model] (module docstring)."""
        B, S = tokens.shape
        L, p, d = self.config.n_layers, self.ple_dim, self.config.d_model
        ctx = self.ple_model_proj(e) * (d**-0.5)  # (B, S, L p)
        ctx = self.ple_norm(ctx.reshape(B, S, L, p))  # (B, S, L, p)
        if self.ple_embed.num_embeddings < self.config.vocab_size:  # (Gemma 3n: others read row 0)
            tokens = torch.where(tokens < self.ple_embed.num_embeddings, tokens, 0)  # (B, S)
        ids = self.ple_embed(tokens) * torch.tensor(math.sqrt(p), dtype=e.dtype)  # (B, S, L p)
        out = (ctx + ids.reshape(B, S, L, p)) * (2.0**-0.5)  # (B, S, L, p)
        return self.hook_per_layer_inputs(out) if self.hook_per_layer_inputs.fns else out

    def _embedded(
        self, tokens: Tensor, kv_caches: list[KVCache] | None, positions: Tensor | None
    ) -> tuple[Tensor, Tensor, int]:
        """(the embedding [batch, seq, d_model], the rotary positions [seq] or [batch, seq], the first
        new position), the inputs checked as :meth:`~headspace.Decoder.hidden_states` checks them."""
        if kv_caches is not None and (
            not isinstance(kv_caches, (list, tuple)) or len(kv_caches) != len(self.blocks)
        ):
            raise ValueError(f"kv_caches must be a list of {len(self.blocks)} KVCache (one per block)")
        start = 0 if kv_caches is None else kv_caches[0].length
        check_tokens(tokens, self.config, start=start, check_length=positions is None,
                     device=self.tok_embed.weight.device)  # fmt: skip
        if positions is None:
            x = self.embed(tokens, start=start)  # (batch, seq, d_model)
            pos = torch.arange(start, start + tokens.shape[1], device=tokens.device)  # (seq,)
        else:
            check_positions(positions, tokens, self.config)
            x = self.embed(tokens, positions=positions)  # (batch, seq, d_model)
            pos = positions
        return x, pos, start

    def hidden_states(
        self,
        tokens: Tensor,
        key_padding: Tensor | None = None,
        kv_caches: list[KVCache] | None = None,
        *,
        positions: Tensor | None = None,
    ) -> Tensor:
        """:meth:`~headspace.Decoder.hidden_states` with the per-layer inputs and layer scalars (module
        docstring); owners leave their keys and values to the layers that share them."""
        x, pos, _ = self._embedded(tokens, kv_caches, positions)  # (batch, seq, d_model)
        P = self.per_layer_inputs(tokens, x) if self.ple_dim else None  # (batch, seq, L, p)
        if gemma4_step.takes(self, tokens, key_padding, kv_caches, positions):
            assert kv_caches is not None  # a one-token cached step, nothing watching: no module calls
            return gemma4_step.hidden_states(self, x, P, kv_caches, pos)  # (batch, 1, d_model)
        causal = not (kv_caches is not None and tokens.shape[1] == 1)
        self._kv_store.open()
        try:
            for i, block in enumerate(self.blocks):
                cache = None if kv_caches is None else kv_caches[i]
                x = block(x, key_padding=key_padding, is_causal=causal, kv_cache=cache, positions=pos)
                if P is not None:  # (batch, seq, d_model), the layer scalar applied
                    x = self.ple[i](x, P[:, :, i], self.layer_scalars[i])
                else:
                    x = x * self.layer_scalars[i]
        finally:
            self._kv_store.close()
        return self.final_norm(x)


def state_dict_names(config: ModelConfig, prefix: str = "model.") -> dict[str, str]:
    """Gemma4Decoder parameter name -> transformers' name, for the tensors beyond the blocks' attention
    and MLP (per-layer inputs, layer scalars are handled by the loader)."""
    out = {"tok_embed.weight": f"{prefix}embed_tokens.weight", "ln_final.weight": f"{prefix}norm.weight"}
    if config.extra["gemma4"]["ple"]:
        out.update({
            "ple_embed.weight": f"{prefix}embed_tokens_per_layer.weight",
            "ple_model_proj.weight": f"{prefix}per_layer_model_projection.weight",
            "ple_norm.weight": f"{prefix}per_layer_projection_norm.weight",
        })  # fmt: skip
        for i in range(config.n_layers):
            p, b = f"{prefix}layers.{i}.", f"ple.{i}."
            out[b + "gate.weight"] = p + "per_layer_input_gate.weight"
            out[b + "proj.weight"] = p + "per_layer_projection.weight"
            out[b + "norm.weight"] = p + "post_per_layer_input_norm.weight"
    return out


__all__ = ["Gemma4Decoder", "PerLayerInput", "gemma4_block_specs", "state_dict_names"]
