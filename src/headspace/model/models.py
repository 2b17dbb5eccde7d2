"""Encoder (BERT family) and Decoder (GPT family), built from a :class:`~headspace.config.ModelConfig`.

Both models are a stack of :class:`~headspace.block.TransformerBlock` between an embedding layer and an
output::

    Encoder (BERT):  e = LN_emb(E_tok[t] + E_pos[p] + E_type[s]);  h_l = Block_l(h_{l-1}) (post-LN)
                     out = h_L
    Decoder (GPT-2): e = E_tok[t] + E_pos[p];  h_l = Block_l(h_{l-1}) (pre-LN, causal)
                     logits = LN_f(h_L) E_tok^T
    Decoder (Llama): e = E_tok[t];  h_l = Block_l(h_{l-1}, positions p) (pre-RMSNorm, RoPE, SwiGLU)
                     logits = RMSNorm_f(h_L) W_U

With ``config.positions="rotary"`` there is no position table: one :class:`~headspace.positions.Rotary`
(shared by every block's attention, ``model.rotary``) rotates queries and keys, and ``max_seq_len`` still
bounds the positions.

Every intermediate has a named hook point (``hook_embed``, ``blocks.3.attn.hook_pattern``,
``blocks.0.hook_resid_post`` ...).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention.delta_net import GatedDeltaNet
from ..attention.pruning import shrink_attention
from ..core.checks import is_int
from ..kernels.bf16 import BF16Weight, is_bf16, round_to_bf16
from ..kernels.int8 import Int8Weight, is_int8
from ..kernels.workspace import Workspace
from ..nn.hooks import HookPoint
from ..nn.inputs import check_positions, check_tokens
from ..nn.kv_cache import KVCache
from ..nn.masks import check_key_padding
from ..nn.positions import Rotary
from ..nn.softcap import owns_output, soft_cap
from .block import TransformerBlock, make_norm
from .config import ModelConfig
from .decoding import StepPlan, decoding
from .moe_precision import bf16_experts, float32_router_params
from .special_decoders import refuse_wrong_decoder
from .unembed_recycled import recycled_logits


def _check_config(config: Any, arch: str, cls_name: str) -> ModelConfig:
    if not isinstance(config, ModelConfig):
        raise TypeError(f"{cls_name}(config) expects a headspace.ModelConfig; got {type(config).__name__}")
    if config.arch != arch:
        raise ValueError(f"{cls_name} needs ModelConfig(arch={arch!r}); got arch={config.arch!r}")
    return config


__all__ = ["PRECISIONS", "Decoder", "Encoder", "ModelConfig", "check_precision"]

#: The precisions a model runs at (:meth:`Encoder.to_precision`, ``headspace.load(..., precision=)``):
#: ``"float32"`` (the default, exact), ``"bfloat16"`` (weights in bfloat16, products in bfloat16 with
#: float32 accumulation) and ``"int8"`` (weights int8 per output channel, the products' inputs quantised
#: dynamically per token); at both reduced precisions everything between the products is float32.
PRECISIONS = ("float32", "bfloat16", "int8")


def check_precision(precision: Any) -> str:
    """``precision`` if it names one of :data:`PRECISIONS`, else an error listing them."""
    if not isinstance(precision, str):
        raise TypeError(
            f"precision must be one of {list(PRECISIONS)}; got {type(precision).__name__} {precision!r}"
        )
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}; got {precision!r}")
    return precision


def _quantize_parameter(module: nn.Module, name: str) -> None:
    """Replace the float weight ``module.<name>`` by its :class:`~headspace.kernels.int8.Int8Weight`."""
    w = getattr(module, name)
    if w is None or is_int8(w):
        return
    setattr(module, name, nn.Parameter(Int8Weight.from_float(w), requires_grad=False))


def _bf16_parameter(module: nn.Module, name: str) -> None:
    """Replace the float weight ``module.<name>`` by its :class:`~headspace.kernels.bf16.BF16Weight`."""
    w = getattr(module, name)
    if w is None or is_bf16(w):
        return
    setattr(module, name, nn.Parameter(BF16Weight.from_float(w), requires_grad=False))


def _product_weights(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, parameter name) of every weight that enters a product ``F.linear``: q/k/v, W_O, the MLP's
    and, in a decoder, the unembedding (the token embedding itself when tied)."""
    found: list[tuple[nn.Module, str]] = []
    for block in model.blocks:
        attn = block.attn
        if isinstance(attn, GatedDeltaNet):  # (its projections are nn.Linear: in_qkv, in_z, in_b, in_a, out)
            found.extend((lin, "weight") for lin in attn.children() if isinstance(lin, nn.Linear))
        if getattr(attn, "latent", None) is not None:  # latent attention: its projections are nn.Linear
            found.extend((lin, "weight") for lin in attn.modules() if isinstance(lin, nn.Linear))
            found.extend((lin, "weight") for lin in block.mlp.modules() if isinstance(lin, nn.Linear))
            continue
        for name in ("qkv_weight",) if attn.fused else ("q_weight", "k_weight", "v_weight"):
            found.append((attn, name))
        found.append((attn, "o_weight"))
        found.extend((lin, "weight") for lin in block.mlp.modules() if isinstance(lin, nn.Linear))
    if isinstance(model, Decoder):
        found.append((model.tok_embed, "weight") if model.lm_head is None else (model.lm_head, "weight"))
    return found


def model_decode_blockers(c: ModelConfig) -> tuple[str, ...]:
    """The model-wide features of ``c`` the cached decoding step does not compute (each block gets them
    as :attr:`~headspace.block.TransformerBlock.decode_blockers`, which makes its ``decode_supported``
    False, so decoding runs ``forward``). None today: final-logit soft-capping, per-layer rotary bases
    and NoPE layers are all in the step (:mod:`headspace.decode.step`)."""
    del c
    return ()


class _Stack(nn.Module):
    """What Encoder and Decoder share: embeddings, blocks, optional LayerNorms, initialisation."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.tok_embed = nn.Embedding(c.vocab_size, c.d_model)
        # learned positions only; rotary positions live in the attention layers, "none" has none
        self.pos_embed = nn.Embedding(c.max_seq_len, c.d_model) if c.positions == "learned" else None
        self.type_embed = nn.Embedding(c.type_vocab_size, c.d_model) if c.type_vocab_size else None
        self.embed_ln = make_norm(c.norm_kind, c.d_model, c.ln_eps, c.norm_offset) if c.embed_ln else None
        self.embed_dropout = nn.Dropout(c.emb_dropout)
        self.hook_embed = HookPoint()  # [batch, seq, d_model]: the residual stream entering block 0
        # one per kind of layer (NoPE layers: None), shared: cos/sin are computed once per forward
        self.blocks = nn.ModuleList(TransformerBlock.from_spec(spec) for spec in c.block_specs())
        self.ln_final = make_norm(c.norm_kind, c.d_model, c.ln_eps, c.norm_offset) if c.final_ln else None
        self.hook_resid_final = (
            HookPoint()
        )  # [batch, seq, d_model]: the final norm's input (last block's output)
        blockers = model_decode_blockers(c)
        for block in self.blocks:
            block.decode_blockers = blockers
        self._init_weights()
        for layer in c.pruned_heads:  # built as prune_heads leaves them: (H', ...) fused storage
            shrink_attention(self.blocks[layer].attn, c.kept_heads(layer))

    def final_norm(self, x: Tensor) -> Tensor:
        """The residual stream leaving the last block x [batch, seq, d_model] through ``hook_resid_final``
        (while watched), then the final norm where the model has one: [batch, seq, d_model]."""
        if self.hook_resid_final.fns:
            x = self.hook_resid_final(x)
        return x if self.ln_final is None else self.ln_final(x)

    def _init_weights(self) -> None:
        """Normal(0, init_std) embeddings and feed-forward weights, zero biases, unit LayerNorms (RMSNorms
        start at one by themselves).

        Attention layers keep their own initialisation (Xavier-uniform, as torch.nn.MultiheadAttention).
        """
        std = self.config.init_std
        for m in self.modules():
            if isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    @property
    def rotary(self) -> Rotary | None:
        """The :class:`~headspace.positions.Rotary` the attention layers share (None without rotary)."""
        return self.blocks[0].attn.rotary if len(self.blocks) else None

    @property
    def precision(self) -> str:
        """``"float32"``, ``"bfloat16"`` or ``"int8"`` (:data:`PRECISIONS`), read from the weights.

        A model cast by hand to another dtype (``model.half()``) reads as that dtype's name.
        """
        # (a head-parallel shard's attention has no fused o_weight: its model reads as its embedding's dtype)
        o_weight = getattr(self.blocks[0].attn, "o_weight", None) if len(self.blocks) else None
        if o_weight is not None and is_int8(o_weight):
            return "int8"
        if o_weight is not None and is_bf16(o_weight):
            return "bfloat16"
        dtype = self.tok_embed.weight.dtype
        return {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(
            dtype, str(dtype).removeprefix("torch.")
        )

    def to_precision(self, precision: str) -> _Stack:
        """Convert this float32 model, in place, to ``precision`` (one of :data:`PRECISIONS`); returns it.

        * ``"bfloat16"``: every weight rounded to bfloat16; the weights of the products (q/k/v, W_O, the
          MLP, a decoder's unembedding) become :class:`~headspace.kernels.bf16.BF16Weight`: their
          products run in bfloat16 (inputs rounded, float32 accumulation, the result rounded) on a
          packed copy kept beside the float32 values; everything between the products (norms,
          attention, softmax, the residual stream) is float32, as under ``torch.autocast``.
        * ``"int8"``: the weights of every product (q/k/v, W_O, the MLP, a decoder's unembedding) become
          :class:`~headspace.kernels.int8.Int8Weight`: int8 per output channel, read as their float32
          dequantised values by everything but the product itself, whose input is quantised per call;
          activations, norms, attention and the pattern stay float32. The token embedding of a decoder
          with tied embeddings is the unembedding too, so it is quantised (its rows dequantised).

        At both reduced precisions the weights read as float32 tensors holding the values the model
        computes with, and activations, hook points, attention patterns and logits are float32: traces
        and every analysis work unchanged and report float32 numbers. Converting to the current
        precision does nothing; converting a reduced-precision model again is refused (load it again in
        float32 instead). Inference only: the converted weights do not train (gradients, where asked
        for, flow through float32 products of the rounded weights).
        """
        precision = check_precision(precision)
        current = self.precision
        if precision == current:
            return self
        if current != "float32":
            raise ValueError(
                f"this model is already {current}; convert from float32 (load it again with "
                f"precision={precision!r})"
            )
        if precision == "bfloat16":
            kept = {id(p) for p in float32_router_params(self)}  # DeepSeek's routers, as transformers
            with torch.no_grad():
                for p in self.parameters():
                    if p.is_floating_point() and id(p) not in kept:
                        p.copy_(round_to_bf16(p))  # every weight a bfloat16 number (norms, biases too)
            for module, name in _product_weights(self):
                if id(getattr(module, name)) not in kept:
                    _bf16_parameter(module, name)
            bf16_experts(self)  # the experts' stacked weights (headspace.model.moe_precision)
            return self
        for module, name in _product_weights(self):
            _quantize_parameter(module, name)
        return self

    def embed(
        self,
        tokens: Tensor,
        *,
        start: int = 0,
        token_type_ids: Tensor | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """Token (times ``config.embed_scale``) + position (+ token-type) embeddings, LayerNorm and
        dropout as configured.

        Shapes: tokens [batch, seq] -> [batch, seq, d_model]; positions are ``start .. start + seq - 1``
        for every row, or the given per-row ``positions`` int64 [batch, seq] (left-padded batches:
        each row counts from 0 at its first real token). Give ``start`` or ``positions``, not both.
        Without a learned position table (rotary or no positions) the positions add nothing here.
        """
        if positions is not None and start:
            raise ValueError(f"embed takes start or positions, not both; got start={start} and positions")
        e = self.tok_embed(tokens)  # (batch, seq, d_model)
        if self.config.embed_scale != 1.0:
            e = e * self.config.embed_scale  # Gemma: E_tok[t] * sqrt(d_model)
        if self.pos_embed is not None:
            if positions is None:
                seq = tokens.shape[1]
                positions = torch.arange(start, start + seq, device=tokens.device)  # (seq,)
            e = e + self.pos_embed(positions)  # (batch, seq, d_model)
        if self.type_embed is not None:
            if token_type_ids is None:
                e = e + self.type_embed.weight[0]  # every token of segment 0
            else:
                e = e + self.type_embed(token_type_ids)  # (batch, seq, d_model)
        if self.embed_ln is not None:
            e = self.embed_ln(e)
        e = self.embed_dropout(e)
        if self.hook_embed.fns:
            e = self.hook_embed(e)
        return e

    def extra_repr(self) -> str:
        return self.config.summary()


class Encoder(_Stack):
    r"""A BERT-family encoder: embeddings, then bidirectional post-LN transformer blocks.

    Formula::

        h_0 = Dropout(LN_emb(E_tok[t_i] + E_pos[i] + E_type[s_i]))
        h_l = Block_l(h_{l-1}, key_padding)          l = 1 .. n_layers
        out = h_L  (LN_final(h_L) when config.final_ln, i.e. pre-LN encoders)

    Padding tokens are never attended to (their own rows are computed, as in BERT, and can be ignored).
    ``.blocks[l]`` is a :class:`~headspace.block.TransformerBlock`; ``.hook_embed`` sees ``h_0``.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(_check_config(config, "encoder", "Encoder"))

    def forward(
        self, tokens: Tensor, key_padding: Tensor | None = None, token_type_ids: Tensor | None = None
    ) -> Tensor:
        """Token states for a (padded) batch.

        Notation used for tensor shapes:
            batch, seq (<= config.max_seq_len), d_model.

        Args:
            tokens: int64 [batch, seq] token ids.
            key_padding: bool [batch, seq], True for real tokens (None: every token is real).
            token_type_ids: int64 [batch, seq] segment ids (None: all segment 0).

        Returns:
            hidden states [batch, seq, d_model].
        """
        check_tokens(tokens, self.config, device=self.tok_embed.weight.device)
        if token_type_ids is not None:
            if self.type_embed is None:
                raise ValueError("token_type_ids were given but this encoder has type_vocab_size=0")
            if not isinstance(token_type_ids, Tensor) or token_type_ids.shape != tokens.shape:
                got = (
                    list(token_type_ids.shape) if isinstance(token_type_ids, Tensor) else type(token_type_ids)
                )
                raise ValueError(
                    f"token_type_ids must have the shape of tokens {list(tokens.shape)}; got {got}"
                )
            check_tokens(
                token_type_ids,
                dataclasses.replace(self.config, vocab_size=self.config.type_vocab_size, pad_token_id=None),
                name="token_type_ids",
                device=self.tok_embed.weight.device,
            )
        x = self.embed(tokens, token_type_ids=token_type_ids)  # (batch, seq, d_model)
        pos = torch.arange(tokens.shape[1], device=tokens.device)  # (seq,): one for every rotary block
        for block in self.blocks:
            kw = {} if block.attn.rotary is None else {"positions": pos}
            x = block(x, key_padding=key_padding, **kw)  # (batch, seq, d_model)
        return self.final_norm(x)

    def infer(
        self,
        tokens: Tensor,
        key_padding: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        *,
        workspace: Workspace | None = None,
    ) -> Tensor:
        """:meth:`forward` for inference: the same token states with fewer passes over memory.

        The blocks share one :class:`~headspace.workspace.Workspace` for their large intermediate
        matrices; pass your own ``workspace`` to keep that memory across calls (as ``encode`` does
        across batches). The returned tensor is always fresh memory, never part of the workspace.

        Falls back to :meth:`forward` whenever the fast path could differ from it: with autograd on,
        in training mode (dropout), while any hook point has a function, or with ``check_finite`` set;
        and for blocks the fast path does not cover (RMSNorm, gated MLP, rotary positions).

        Notation used for tensor shapes:
            batch, seq (<= config.max_seq_len), d_model.

        Args:
            tokens: int64 [batch, seq] token ids.
            key_padding: bool [batch, seq], True for real tokens (None: every token is real).
            token_type_ids: int64 [batch, seq] segment ids (None: all segment 0).
            workspace: scratch memory to reuse (None: a fresh one for this call).

        Returns:
            hidden states [batch, seq, d_model].
        """
        if (
            torch.is_grad_enabled()
            or self.training
            or token_type_ids is not None
            or any(m.fns for m in self.modules() if isinstance(m, HookPoint))
            or any(b.attn.check_finite for b in self.blocks)
            or not all(b.infer_supported for b in self.blocks)
        ):
            return self(tokens, key_padding, token_type_ids)
        check_tokens(tokens, self.config, device=self.tok_embed.weight.device)
        batch, seq = tokens.shape
        mask = None
        if key_padding is not None:
            check_key_padding(key_padding, batch, seq, tokens.device)
            if not bool(key_padding.all()):
                if not bool(key_padding.any(dim=1).all()):
                    return self(tokens, key_padding)  # a sample with no real token: forward's dead-row rule
                mask = key_padding[:, None, None, :]  # (batch, 1, 1, seq)
        ws = Workspace() if workspace is None else workspace
        x = self.embed(tokens).contiguous()  # (batch, seq, d_model)
        for block in self.blocks:
            x = block.infer(x, mask, ws)  # (batch, seq, d_model)
        return self.final_norm(x)


class Decoder(_Stack):
    r"""A GPT-family decoder: embeddings, causal pre-LN transformer blocks, final LayerNorm, logits.

    Formula::

        h_0 = Dropout(E_tok[t_i] + E_pos[i])         (E_tok[t_i] alone with rotary positions)
        h_l = Block_l(h_{l-1}, causal)               l = 1 .. n_layers
        logits = LN_f(h_L) W_U                       W_U = E_tok^T when config.tie_embeddings

    Llama-family models (``positions="rotary"``, ``norm_kind="rmsnorm"``, ``mlp_kind="gated"``): no
    position table; every attention layer rotates its queries and keys to their positions (``i`` for
    column ``i``, after any cached positions; per-row ``positions`` for left-padded batches), and
    ``max_seq_len`` bounds the positions. See :func:`headspace.pretrained.load_llama`.

    ``generate()`` samples continuations with a KV cache (temperature, top-k, reproducible with a seed);
    prompts of different lengths go in one left-padded batch with their ``key_padding``.
    """

    def __init__(self, config: ModelConfig) -> None:
        refuse_wrong_decoder(config, type(self))  # a Gemma 4 / 3n config builds only its own class
        super().__init__(_check_config(config, "decoder", "Decoder"))
        c = self.config
        bias = getattr(c, "unembed_bias", False)  # GPT-J, Phi: the unembedding has a bias
        self.lm_head = None if c.tie_embeddings else nn.Linear(c.d_model, c.vocab_size, bias=bias)
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, std=c.init_std)
            if self.lm_head.bias is not None:
                nn.init.zeros_(self.lm_head.bias)

    @property
    def W_U(self) -> Tensor:
        """The unembedding [d_model, vocab_size]: ``logits = LN_f(h_L) @ W_U`` (a view)."""
        w = self.tok_embed.weight if self.lm_head is None else self.lm_head.weight
        return w.T  # (d_model, vocab_size)

    def make_kv_caches(self, batch: int, capacity: int | None = None) -> list[KVCache]:
        """One :class:`~headspace.KVCache` per block, for ``capacity`` positions (default max_seq_len)."""
        capacity = self.config.max_seq_len if capacity is None else capacity
        if not is_int(capacity) or capacity < 1:
            raise ValueError(f"capacity must be None or an int >= 1 (positions to cache); got {capacity!r}")
        if capacity > self.config.max_seq_len:
            raise ValueError(
                f"capacity={capacity} exceeds the position table (max_seq_len={self.config.max_seq_len})"
                if self.pos_embed is not None
                else f"capacity={capacity} exceeds the longest sequence "
                f"(max_seq_len={self.config.max_seq_len})"
            )
        return [block.attn.make_kv_cache(batch, capacity) for block in self.blocks]

    def hidden_states(
        self,
        tokens: Tensor,
        key_padding: Tensor | None = None,
        kv_caches: list[KVCache] | None = None,
        *,
        positions: Tensor | None = None,
    ) -> Tensor:
        """The final residual stream after LN_f, [batch, seq, d_model]: ``forward`` without unembedding."""
        start = 0
        if kv_caches is not None:
            if not isinstance(kv_caches, (list, tuple)) or len(kv_caches) != len(self.blocks):
                got = len(kv_caches) if isinstance(kv_caches, (list, tuple)) else type(kv_caches).__name__
                raise ValueError(
                    f"kv_caches must be a list of {len(self.blocks)} KVCache (one per block, from "
                    f"make_kv_caches); got {got}"
                )
            bad = [i for i, c in enumerate(kv_caches) if not isinstance(c, KVCache)]
            if bad:
                raise TypeError(
                    f"kv_caches must hold one KVCache per block (from make_kv_caches); item {bad[0]} is "
                    f"{type(kv_caches[bad[0]]).__name__}"
                )
            start = kv_caches[0].length
        # with per-row positions the table bounds the positions (checked below), not the columns
        check_tokens(
            tokens,
            self.config,
            start=start,
            check_length=positions is None,
            device=self.tok_embed.weight.device,
        )
        if positions is None:
            x = self.embed(tokens, start=start)  # (batch, seq, d_model)
        else:
            check_positions(positions, tokens, self.config)
            x = self.embed(tokens, positions=positions)  # (batch, seq, d_model)
        # one positions tensor for every rotary block, so the rotation's cos/sin are computed once
        seq = tokens.shape[1]
        pos = torch.arange(start, start + seq, device=tokens.device) if positions is None else positions
        # (seq,) or (batch, seq)
        # one new query after the cached positions sees every key: causality is vacuous there, and
        # dropping it lets attention run without building a mask in every layer
        causal = not (kv_caches is not None and tokens.shape[1] == 1)
        for i, block in enumerate(self.blocks):
            cache = None if kv_caches is None else kv_caches[i]
            kw = {} if block.attn.rotary is None else {"positions": pos}  # (NoPE blocks: none)
            x = block(x, key_padding=key_padding, is_causal=causal, kv_cache=cache, **kw)  # (batch, seq, d)
        return self.final_norm(x)

    def decode_plan(self, pack_rows: int | None = None) -> StepPlan | None:
        """This model's cached decoding step (:func:`headspace.decode.describe`) ready to run
        (:class:`headspace.decode.Stepper`), or None where one-token steps must take :meth:`forward`
        (training mode, a block without
        :attr:`~headspace.block.TransformerBlock.decode_supported`, or an active hook point).
        ``plan.logits(tokens, caches)`` is ``forward(tokens, kv_caches=caches)[:, -1]``, bit for bit,
        while ``plan.idle()``; with ``pack_rows`` (a batch size) the float32 products run on weights
        packed for MKL's GEMM (a second copy of them, equal to float32 rounding). Run by
        :func:`headspace.decode.decode_plan` (:mod:`headspace.model.decoding`)."""
        return decoding().plan(self, pack_rows)

    def forward(
        self,
        tokens: Tensor,
        key_padding: Tensor | None = None,
        kv_caches: list[KVCache] | None = None,
        *,
        positions: Tensor | None = None,
    ) -> Tensor:
        """Next-token logits at every position.

        Notation used for tensor shapes:
            batch, seq (new positions), seq_k (seq plus cached positions), d_model, vocab_size.

        Args:
            tokens: int64 [batch, seq] token ids.
            key_padding: bool [batch, seq_k], True for real tokens (None: all real).
            kv_caches: from :meth:`make_kv_caches`; the new positions follow the cached ones and their
                keys/values are appended.
            positions: int64 [batch, seq] indices into the position table, per row (None: the column
                index, after any cached positions). Left-padded batches pass ``cumsum(key_padding) - 1``
                (clamped at 0) so that each row counts from 0 at its first real token, as
                :meth:`generate` does. With rotary positions they are the positions the queries and
                keys are rotated to (in [0, max_seq_len) all the same).

        Returns:
            logits [batch, seq, vocab_size], float32 at every precision of :meth:`to_precision`
            (``cap * tanh(logits / cap)`` with ``config.final_softcap``).
        """
        h = self.hidden_states(tokens, key_padding, kv_caches, positions=positions)  # (batch, seq, d_model)
        return self.unembed(h)

    def last_logits(
        self,
        tokens: Tensor,
        key_padding: Tensor | None = None,
        kv_caches: list[KVCache] | None = None,
        *,
        positions: Tensor | None = None,
    ) -> Tensor:
        """``forward(...)[:, -1]``, float32 [batch, vocab_size], unembedding only the last position (what
        generation reads: a 262k-word vocabulary over a 2,048-token prompt would be 2 GB of logits).
        The same products on one row instead of all: equal to float32 rounding, not bit for bit."""
        h = self.hidden_states(tokens, key_padding, kv_caches, positions=positions)  # (batch, seq, d_model)
        return self.unembed(h[:, -1:])[:, -1]  # (batch, vocab_size)

    def unembed(self, h: Tensor) -> Tensor:
        """Logits [..., vocab_size] (float32) of final residuals h [..., d_model] (after LN_f): the
        unembedding, then ``cap * tanh(logits / cap)`` with ``config.final_softcap``."""
        logits = None
        if self.lm_head is None:
            logits = recycled_logits(h, self.tok_embed.weight, None)  # (no page faults: unembed_recycled)
            logits = F.linear(h, self.tok_embed.weight) if logits is None else logits  # (batch, seq, vocab)
        elif type(self.lm_head) is nn.Linear and owns_output(self.lm_head):  # (no module hook to fire)
            logits = recycled_logits(h, self.lm_head.weight, self.lm_head.bias)  # (batch, seq, vocab_size)
        if logits is None:
            logits = self.lm_head(h)  # (batch, seq, vocab_size)
        cap = self.config.final_softcap
        if cap is not None:  # Gemma 2's final-logit soft-capping; in place on logits nobody else holds
            fresh = owns_output(self.lm_head) and not (torch.is_grad_enabled() and logits.requires_grad)
            logits = soft_cap(logits, cap, in_place=fresh)  # (batch, seq, vocab_size)
        return logits if logits.dtype == torch.float32 else logits.float()  # float32 at every precision

    def generate(self, tokens: Tensor, max_new_tokens: int, **options: Any) -> Tensor:
        """Sample ``max_new_tokens`` continuation tokens after each (left-padded) prompt:
        :func:`headspace.decode.generate` on this model (its options: ``key_padding``, ``temperature``
        (0: greedy), ``top_k``, ``seed``, ``use_cache``, ``prepack``, ``backend``, ``native``,
        ``stop_tokens``, ``on_token``; see ``docs/decoding.md``). Returns [batch, prompt_len +
        max_new_tokens] (fewer columns only where ``stop_tokens`` stopped every row). Run by the
        decoding package above the model (:mod:`headspace.model.decoding`)."""
        return decoding().generate(self, tokens, max_new_tokens, **options)
