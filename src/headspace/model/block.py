"""TransformerBlock: attention + feed-forward + residual connections + LayerNorm (pre- or post-LN).

The block that, stacked, makes BERT (post-LN), GPT (pre-LN) and Llama (pre-RMSNorm, gated MLP, RoPE)::

    post-LN (BERT, the original paper):      pre-LN (GPT-2 and most models since):
        h   = LN1(x + Attn(x))                   h   = x + Attn(LN1(x))
        out = LN2(h + MLP(h))                    out = h + MLP(LN2(h))

    plain MLP:  MLP(x) = act(x W_in + b_in) W_out + b_out    (W_in: [d_model, d_mlp], W_out: [d_mlp, d_model])
    gated MLP:  MLP(x) = (act(x W_gate + b_gate) * (x W_in + b_in)) W_out + b_out
                (SwiGLU with act = silu: Llama, Mistral, Qwen; GeGLU with gelu: Gemma)

The norms are LayerNorm (``norm_kind="layernorm"``) or :class:`~headspace.norms.RMSNorm`
(``"rmsnorm"``); the attention may carry rotary positions (:class:`~headspace.positions.Rotary`).

Dropout (``dropout``) is applied to the attention output and to the MLP output before each is added to
the residual stream (BERT's hidden dropout, GPT-2's resid_pdrop); ``attn_dropout`` drops pattern
entries inside the attention layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention.delta_net import GatedDeltaNet
from ..attention.described import DescribedAttention
from ..attention.differential import DifferentialAttention
from ..attention.functional import sdpa_attention
from ..attention.latent import LatentAttention
from ..attention.layer import MultiHeadAttention, check_input_tensor
from ..core.checks import check_positive_float, check_probability
from ..kernels.bf16 import is_bf16
from ..kernels.int8 import is_int8
from ..kernels.workspace import Workspace
from ..nn.hooks import HookPoint
from ..nn.kv_cache import KVCache
from ..nn.masks import CanonicalMask
from ..nn.norms import RMSNorm
from ..nn.positions import Rotary
from ..nn.spec import BlockSpec, MLPSpec, NormSpec, features_of, refuse_unsupported
from . import recorded
from .gemma_extras import GemmaAttention
from .mlp import ACTIVATIONS as ACTIVATIONS  # re-exported: the MLPs' old home
from .mlp import FeedForward, GatedFeedForward, _fire, make_activation
from .moe import MixtureOfExperts, moe_of
from .parallel_norm import shared_norm

#: Residual/LayerNorm arrangements accepted by :class:`TransformerBlock`.
NORMS = ("post", "pre", "sandwich", "post_sublayer", "parallel")
#: Kinds of normalisation layer accepted by :class:`TransformerBlock` (``norm_kind``).
NORM_KINDS = ("layernorm", "rmsnorm")
#: Kinds of feed-forward network accepted by :class:`TransformerBlock` (``mlp_kind``).
MLP_KINDS = ("plain", "gated")


def make_norm(kind: str, d_model: int, eps: float, offset: float = 0.0) -> nn.Module:
    """``"layernorm"`` (``nn.LayerNorm``: weight and bias) or ``"rmsnorm"`` (:class:`RMSNorm`: weight;
    ``offset`` 1 for Gemma's ``(1 + weight)``; a LayerNorm takes no offset)."""
    if kind == "layernorm":
        if offset:
            raise ValueError(f"norm offset={offset} is for RMSNorm (Gemma's 1 + weight); LayerNorm has none")
        return nn.LayerNorm(d_model, eps=eps)
    if kind == "rmsnorm":
        return RMSNorm(d_model, eps=eps, offset=offset)
    raise ValueError(f"norm_kind must be one of {list(NORM_KINDS)}; got {kind!r}")


#: The block features (:func:`~headspace.nn.spec.features_of`) :meth:`TransformerBlock.forward` computes.
BLOCK_FEATURES = (
    "window",
    "chunk",
    "window_sides",
    "softcap",
    "qk_norm",
    "bias",
    "layout",
    "sink",
    "gate",
    "moe",
    "mixer",
    "v_norm",
    "k_eq_v",
    "kv_source",
    "latent",
    "temperature",
    "differential",
    "attn_norm",
)


def _check_block_args(
    norm: str,
    norm_kind: str,
    mlp_kind: str,
    mlp_bias: object,
    dropout: float,
    attn_dropout: float,
    ln_eps: float,
) -> None:
    """The keyword constructor's own checks (each a one-line error naming the argument)."""
    if norm not in NORMS:
        raise ValueError(
            f"norm must be one of {list(NORMS)} ('post' = BERT, 'pre' = GPT-2, 'sandwich' = Gemma, "
            f"'post_sublayer' = OLMo 2); got {norm!r}"
        )
    if norm_kind not in NORM_KINDS:
        raise ValueError(f"norm_kind must be one of {list(NORM_KINDS)}; got {norm_kind!r}")
    if mlp_kind not in MLP_KINDS:
        raise ValueError(
            f"mlp_kind must be one of {list(MLP_KINDS)} ('gated' = SwiGLU/GeGLU); got {mlp_kind!r}"
        )
    if mlp_bias is not None and not isinstance(mlp_bias, bool):
        raise TypeError(f"mlp_bias must be a bool or None (= bias); got {type(mlp_bias).__name__}")
    for name, p in (("dropout", dropout), ("attn_dropout", attn_dropout)):
        check_probability(name, p)
    check_positive_float("ln_eps", ln_eps)


def _check_block_fits(old: BlockSpec, new: BlockSpec) -> None:
    """One-line ``ValueError`` naming the first field of ``new`` that the block's modules fix to
    ``old``'s value (the norm and MLP kinds and sizes; a sandwich layout's extra norms)."""
    fixed = {
        "norm.kind": (old.norm.kind, new.norm.kind),
        "mlp.kind": (old.mlp.kind, new.mlp.kind),
        "mlp.d_mlp": (old.mlp.d_mlp, new.mlp.d_mlp),
        "mlp.bias": (old.mlp.bias, new.mlp.bias),
        "mlp.n_experts": (old.mlp.n_experts, new.mlp.n_experts),
        "mlp.top_k": (old.mlp.top_k, new.mlp.top_k),
        "mlp.norm_topk": (old.mlp.norm_topk, new.mlp.norm_topk),
        "mlp.d_shared": (old.mlp.d_shared, new.mlp.d_shared),
        "mlp.routing": (old.mlp.routing, new.mlp.routing),
        "mlp.router_bias": (old.mlp.router_bias, new.mlp.router_bias),
        "mlp.swiglu_limit": (old.mlp.swiglu_limit, new.mlp.swiglu_limit),
        "mlp.swiglu_alpha": (old.mlp.swiglu_alpha, new.mlp.swiglu_alpha),
        "mlp.shared_gate": (old.mlp.shared_gate, new.mlp.shared_gate),
        "layout == 'sandwich'": (old.layout == "sandwich", new.layout == "sandwich"),
        "attn_norm": (old.attn_norm, new.attn_norm),
    }
    for name, (have, got) in fixed.items():
        if have != got:
            raise ValueError(
                f"block spec: {name} must be {have!r}, fixed by the block's modules; got {got!r} "
                "(build a new block to change it)"
            )


class TransformerBlock(nn.Module):
    r"""One transformer block: multi-head self-attention and a feed-forward network, each wrapped in a
    residual connection and a LayerNorm.

    Formula (``norm="post"``, BERT and the original paper; ``norm="pre"``, GPT-2)::

        post:  h = LN1(x + drop(Attn(x)))          out = LN2(h + drop(MLP(h)))
        pre:   h = x + drop(Attn(LN1(x)))          out = h + drop(MLP(LN2(h)))
        sandwich (Gemma 2 and 3): h = x + drop(LN_attn_out(Attn(LN1(x))))
                                  out = h + drop(LN_mlp_out(MLP(LN2(h))))
        post_sublayer (OLMo 2):   h = x + drop(LN1(Attn(x)))   out = h + drop(LN2(MLP(h)))

    with ``Attn`` a :class:`~headspace.MultiHeadAttention` (``.attn``) and ``MLP`` a :class:`FeedForward`
    (``.mlp``; a :class:`GatedFeedForward` with ``mlp_kind="gated"``). Paper symbols (Vaswani et al.
    2017, section 3.1): ``LayerNorm(x + Sublayer(x))`` is the post-LN arrangement; ``d_mlp = d_ff``.

    Options beyond the classic block (a Llama block is ``norm="pre", norm_kind="rmsnorm",
    mlp_kind="gated", act="silu", bias=False`` with a ``rotary``): ``norm_kind`` picks LayerNorm or
    RMSNorm for ``ln1``/``ln2``; ``bias`` switches every bias, ``qkv_bias`` / ``out_bias`` / ``mlp_bias``
    (default: ``bias``) the q/k/v, attention-output and MLP biases apart; ``rotary`` gives the
    attention rotary positions (:class:`~headspace.positions.Rotary`; the same object may serve every
    block of a model). ``window``, ``qk_norm`` (with ``qk_norm_eps``), ``softcap`` and ``scale`` go to
    :class:`~headspace.MultiHeadAttention` (sliding window, QK-norm, score soft-capping, the score
    scale); ``norm_offset`` makes every RMSNorm of the block (and the QK-norms) scale by
    ``offset + weight`` (Gemma: 1). These keywords build a :class:`~headspace.nn.spec.BlockSpec`;
    :meth:`from_spec` builds the block from one, and :attr:`spec` is the description every executor
    reads at call time.

    Hook points, all [batch, seq, d_model]: ``hook_resid_pre`` (the input), ``hook_attn_in`` (the
    attention's input: ``LN1(x)``, or ``x`` where the layout has no norm before it), ``hook_attn_out``
    (the attention sublayer's output, after dropout), ``hook_resid_mid`` (``h``), ``hook_mlp_in`` (the
    MLP's input: ``LN2(h)``, or ``h``), ``hook_mlp_out`` (the MLP sublayer's output, after dropout),
    ``hook_resid_post`` (the output). They cost nothing while no function is added to them.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_mlp: int,
        *,
        d_head: int | None = None,
        n_kv_heads: int | None = None,
        act: str = "gelu",
        norm: str = "post",
        dropout: float = 0.0,
        attn_dropout: float = 0.0,
        ln_eps: float = 1e-5,
        bias: bool = True,
        norm_kind: str = "layernorm",
        mlp_kind: str = "plain",
        qkv_bias: bool | None = None,
        out_bias: bool | None = None,
        mlp_bias: bool | None = None,
        rotary: Rotary | None = None,
        window: int | None = None,
        qk_norm: str | None = None,
        qk_norm_eps: float | None = None,
        softcap: float | None = None,
        scale: float | None = None,
        norm_offset: float = 0.0,
    ) -> None:
        super().__init__()
        _check_block_args(norm, norm_kind, mlp_kind, mlp_bias, dropout, attn_dropout, ln_eps)
        attention = MultiHeadAttention(
            d_model,
            n_heads,
            d_head=d_head,
            n_kv_heads=n_kv_heads,
            bias=bias,
            dropout=attn_dropout,
            qkv_bias=qkv_bias,
            out_bias=out_bias,
            rotary=rotary,
            window=window,
            qk_norm=qk_norm,
            qk_norm_eps=ln_eps if qk_norm_eps is None else qk_norm_eps,
            qk_norm_offset=norm_offset,
            softcap=softcap,
            scale=scale,
        )  # fmt: skip  (the layer checks the attention's arguments, with its own messages)
        spec = BlockSpec(
            attention=attention.spec,
            mlp=MLPSpec(d_mlp, kind=mlp_kind, act=act, bias=bias if mlp_bias is None else mlp_bias),
            norm=NormSpec(norm_kind, float(ln_eps), float(norm_offset)),
            layout=norm,
            dropout=float(dropout),
        )
        self._build(spec, attention)

    @classmethod
    def from_spec(cls, spec: BlockSpec) -> TransformerBlock:
        """The block ``spec`` describes (fresh weights: Xavier-uniform attention, torch's default
        linears, unit norms), with ``spec`` as its :attr:`spec`."""
        if not isinstance(spec, BlockSpec):
            raise TypeError(f"from_spec expects a headspace.nn.spec.BlockSpec; got {type(spec).__name__}")
        block = cls.__new__(cls)
        nn.Module.__init__(block)
        block._build(spec, None)
        return block

    def _build(self, spec: BlockSpec, attention: MultiHeadAttention | None) -> None:
        """The modules of ``spec``: ``attn``, ``ln1``, ``mlp``, ``ln2`` (a sandwich block's ``ln_attn_out``
        and ``ln_mlp_out``), the dropout and the hook points; the residual layout bound."""
        refuse_unsupported(spec, "the block forward", BLOCK_FEATURES)
        a, n, d = spec.attention, spec.norm, spec.d_model
        if spec.mixer == "gated_deltanet":  # (linear attention: attention/delta_net.py)
            attention = GatedDeltaNet(spec.delta_net)  # type: ignore[assignment]
        if attention is None and (a.v_norm or a.k_eq_v or a.kv_source is not None):
            attention = GemmaAttention.from_spec(a)  # Gemma 3n / 4 (model/gemma_extras.py)
        if attention is None and a.latent is not None:  # DeepSeek's latent attention: its own layer
            attention = LatentAttention.from_spec(a)  # type: ignore[assignment]
        if attention is None:
            kind, extra = MultiHeadAttention, {}
            if a.differential is not None:  # DiffLlama: the pair norm's eps is the description's qk_norm_eps
                kind = DifferentialAttention
                extra = {"lambda_init": a.differential, "norm_eps": a.qk_norm_eps}
            attention = kind(
                d, a.n_heads, d_head=a.d_head, n_kv_heads=a.n_kv_heads, dropout=a.dropout,
                qkv_bias=a.qkv_bias, out_bias=a.out_bias, rotary=a.positions, window=a.window,
                qk_norm=a.qk_norm, qk_norm_eps=a.qk_norm_eps, qk_norm_offset=a.qk_norm_offset,
                softcap=a.softcap, scale=a.scale, sink=a.sink, gate=a.gate, alibi_slopes=a.alibi_slopes,
                **extra,
            )  # fmt: skip
            if a.chunk is not None or a.temperature is not None:  # (Llama 4's: set on the built layer)
                attention.spec = dataclasses.replace(attention.spec, chunk=a.chunk, temperature=a.temperature)
            if a.window_sides is not None:  # the layer's own constructor builds the causal band
                attention.spec = dataclasses.replace(attention.spec, window_sides=a.window_sides)
        self.attn = attention
        # no attention norm (ModernBERT's first layer): an Identity, so that ``.ln1`` stays readable
        self.ln1 = make_norm(n.kind, d, n.eps, n.offset) if spec.attn_norm else nn.Identity()
        m = spec.mlp
        kind = GatedFeedForward if m.kind == "gated" else FeedForward
        self.mlp: FeedForward | GatedFeedForward | MixtureOfExperts = (
            moe_of(d, m) if m.kind == "moe" else kind(d, m.d_mlp, act=m.act, bias=m.bias)
        )
        self.ln2 = make_norm(n.kind, d, n.eps, n.offset)
        sandwich = spec.layout == "sandwich"
        # sandwich norms only: the norms of each sublayer's output, before the residual add
        self.register_module("ln_attn_out", make_norm(n.kind, d, n.eps, n.offset) if sandwich else None)
        self.register_module("ln_mlp_out", make_norm(n.kind, d, n.eps, n.offset) if sandwich else None)
        #: Why the cached decoding step may not stand in for this block although the block alone would
        #: allow it: set by the model for model-wide features (final soft-capping, per-layer rotations).
        self.decode_blockers: tuple[str, ...] = ()
        self.dropout = nn.Dropout(spec.dropout)
        self.hook_resid_pre = HookPoint()  # [batch, seq, d_model]
        self.hook_attn_in = HookPoint()  # [batch, seq, d_model]: the attention's input (after its norm)
        self.hook_attn_out = HookPoint()  # [batch, seq, d_model]
        self.hook_resid_mid = HookPoint()  # [batch, seq, d_model]
        self.hook_mlp_in = HookPoint()  # [batch, seq, d_model]: the MLP's input (after its norm)
        self.hook_mlp_out = HookPoint()  # [batch, seq, d_model]
        self.hook_resid_post = HookPoint()  # [batch, seq, d_model]
        self._spec = spec
        self._residual = _RESIDUAL[spec.layout]

    @property
    def spec(self) -> BlockSpec:
        """THE description of this block (:class:`~headspace.nn.spec.BlockSpec`): its forward, the
        decoding step (:func:`headspace.decode.describe`) and the circuit runner read the block's maths
        from it at call time. Assigning an edited description (``block.spec = dataclasses.replace(
        block.spec, ...)``) changes them all; fields fixed by the weights (head counts and widths, the
        biases present, the norm and MLP kinds, a sandwich layout's extra norms) must stay, and fields
        the forward does not compute (``chunk``, ``bias``, ``gate``, the ``parallel`` layout)
        are refused by name."""
        if not isinstance(self.attn, DescribedAttention):  # a head-parallel shard keeps the built one
            return self._spec
        attention = self.attn.spec
        if self._spec.attention is not attention:
            self._spec = dataclasses.replace(self._spec, attention=attention)
        return self._spec

    @spec.setter
    def spec(self, spec: BlockSpec) -> None:
        if not isinstance(spec, BlockSpec):
            raise TypeError(f"block.spec must be a headspace.nn.spec.BlockSpec; got {type(spec).__name__}")
        refuse_unsupported(spec, "the block forward", BLOCK_FEATURES)
        _check_block_fits(self.spec, spec)
        if not isinstance(self.attn, DescribedAttention):
            raise TypeError(
                f"block.spec: this block's attention ({type(self.attn).__name__}) has no description"
            )
        self.attn.spec = spec.attention
        for norm in (self.ln1, self.ln2, self.ln_attn_out, self.ln_mlp_out):
            if norm is not None and not isinstance(norm, nn.Identity):
                norm.eps = spec.norm.eps
                if isinstance(norm, RMSNorm):
                    norm.offset = spec.norm.offset
        if spec.mlp.act != self.mlp.act_name:
            self.mlp.act_name, self.mlp.act = spec.mlp.act, make_activation(spec.mlp.act)
        self.dropout.p = spec.dropout
        self._spec = spec
        self._residual = _RESIDUAL[spec.layout]

    @property
    def d_model(self) -> int:
        """The residual stream's width."""
        return self._spec.d_model

    @property
    def norm(self) -> str:
        """The residual layout: ``"post"``, ``"pre"``, ``"sandwich"`` or ``"post_sublayer"`` (the spec's)."""
        return self._spec.layout

    @property
    def pre_ln(self) -> bool:
        """Whether the layout is ``"pre"``."""
        return self._spec.layout == "pre"

    @property
    def norm_kind(self) -> str:
        """``"layernorm"`` or ``"rmsnorm"`` (the spec's ``norm.kind``)."""
        return self._spec.norm.kind

    @property
    def mlp_kind(self) -> str:
        """``"plain"`` or ``"gated"`` (the spec's ``mlp.kind``)."""
        return self._spec.mlp.kind

    def forward(
        self,
        x: Tensor,
        *,
        key_padding: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        kv_cache: KVCache | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """The block on the residual stream x [batch, seq, d_model] -> [batch, seq, d_model]: the residual
        maths of the layout of :attr:`spec` (class docstring; bound when the spec was set).

        ``key_padding`` (bool [batch, seq_k], True = real token), ``attn_mask``, ``is_causal``,
        ``kv_cache`` and ``positions`` go to :meth:`MultiHeadAttention.forward`. While only
        :func:`headspace.trace`'s recorders watch every hook point (on inputs long enough), the trace's
        executor runs the block instead (:mod:`~headspace.model.recorded`): the same output, bit for bit.
        """
        ref = self.ln2 if isinstance(self.ln1, nn.Identity) else self.ln1  # ModernBERT's layer 0: no ln1
        check_input_tensor("x", x, self.d_model, "d_model", ref.weight)  # before any LayerNorm
        x = _fire(self.hook_resid_pre, x)
        kw: dict[str, Any] = {"key_padding": key_padding, "attn_mask": attn_mask, "is_causal": is_causal}
        kw.update(kv_cache=kv_cache, **({} if positions is None else {"positions": positions}))
        if self.hook_resid_pre.fns and recorded.takes(self, x, kv_cache):
            out = recorded.run(self, x, kw)  # the trace's executor (only recorders watch)
        else:
            out = self._residual(self, x, kw)
        return _fire(self.hook_resid_post, out)

    # ------------------------------------------------------------------ the residual layouts
    def _pre(self, x: Tensor, kw: dict[str, Any]) -> Tensor:
        """pre (GPT-2, Llama): ``h = x + drop(Attn(LN1(x)))``, ``out = h + drop(MLP(LN2(h)))``."""
        a = _fire(self.hook_attn_out, self.dropout(self.attn(_fire(self.hook_attn_in, self.ln1(x)), **kw)))
        h = self._resid_mid(x, a)  # (batch, seq, d_model): x + a
        m = _fire(self.hook_mlp_out, self.dropout(self.mlp(_fire(self.hook_mlp_in, self.ln2(h)))))
        return _sum(m, h, self.hook_mlp_out)  # (batch, seq, d_model): h + m

    def _post(self, x: Tensor, kw: dict[str, Any]) -> Tensor:
        """post (BERT): ``h = LN1(x + drop(Attn(x)))``, ``out = LN2(h + drop(MLP(h)))``."""
        a = _fire(self.hook_attn_out, self.dropout(self.attn(_fire(self.hook_attn_in, x), **kw)))
        h = _fire(self.hook_resid_mid, self.ln1(x + a))  # (batch, seq, d_model)
        m = _fire(self.hook_mlp_out, self.dropout(self.mlp(_fire(self.hook_mlp_in, h))))
        return self.ln2(h + m)

    def _sandwich(self, x: Tensor, kw: dict[str, Any]) -> Tensor:
        """sandwich (Gemma 2 / 3): ``h = x + drop(LN_ao(Attn(LN1(x))))``,
        ``out = h + drop(LN_mo(MLP(LN2(h))))``."""
        a = self.attn(_fire(self.hook_attn_in, self.ln1(x)), **kw)  # (batch, seq, d_model)
        a = _fire(self.hook_attn_out, self.dropout(self.ln_attn_out(a)))
        h = self._resid_mid(x, a)  # (batch, seq, d_model): x + a
        m = self.mlp(_fire(self.hook_mlp_in, self.ln2(h)))  # (batch, seq, d_model)
        return h + _fire(self.hook_mlp_out, self.dropout(self.ln_mlp_out(m)))

    def _post_sublayer(self, x: Tensor, kw: dict[str, Any]) -> Tensor:
        """post_sublayer (OLMo 2): ``h = x + drop(LN1(Attn(x)))``, ``out = h + drop(LN2(MLP(h)))``."""
        a = _fire(self.hook_attn_out, self.dropout(self.ln1(self.attn(_fire(self.hook_attn_in, x), **kw))))
        h = self._resid_mid(x, a)  # (batch, seq, d_model): x + a
        return h + _fire(self.hook_mlp_out, self.dropout(self.ln2(self.mlp(_fire(self.hook_mlp_in, h)))))

    def _parallel(self, x: Tensor, kw: dict[str, Any]) -> Tensor:
        """parallel (GPT-NeoX, GPT-J, Phi-2, Cohere): ``out = x + drop(Attn(LN1(x))) + drop(MLP(LN2(x)))``,
        both sublayers reading the block's input (a one-norm family's LN2 is a copy of its LN1); no
        ``hook_resid_mid`` (there is no middle of the residual). While LN2 equals LN1 and nothing watches
        them, LN1(x) serves both (:mod:`~headspace.model.parallel_norm`: the same values)."""
        n = shared_norm(self, x, MultiHeadAttention, (FeedForward, GatedFeedForward))  # (b, s, d) or None
        a = self.attn(_fire(self.hook_attn_in, self.ln1(x) if n is None else n), **kw)  # (b, s, d)
        a = _fire(self.hook_attn_out, self.dropout(a))
        m = _fire(
            self.hook_mlp_out,
            self.dropout(self.mlp(_fire(self.hook_mlp_in, self.ln2(x) if n is None else n))),
        )
        return _sum(_sum(a, x, self.hook_attn_out), m, _UNWATCHED)  # (batch, seq, d_model): x + a + m

    def _resid_mid(self, x: Tensor, a: Tensor) -> Tensor:
        """``h = x + a`` [batch, seq, d_model], passed through ``hook_resid_mid`` while it is watched."""
        if self.hook_resid_mid.fns:
            return recorded.fire_resid_mid(self, x, a, x + a)  # (batch, seq, d_model)
        return _sum(a, x, self.hook_attn_out)  # (batch, seq, d_model): x + a

    def extra_repr(self) -> str:
        s = f"norm={self.norm!r}"
        if self.norm_kind != "layernorm":
            s += f", norm_kind={self.norm_kind!r}"
        return s

    @property
    def infer_supported(self) -> bool:
        """Whether :meth:`infer` has a fused path for this block (LayerNorm, plain MLP, no rotary)."""
        return (
            self.norm_kind == "layernorm"
            and self.norm in ("pre", "post")
            and self.mlp_kind == "plain"
            and not features_of(self.spec)
            and self.spec.attention.positions is None
            and self.attn.fused
        )

    @property
    def decode_supported(self) -> bool:
        """Whether the decoding step (:mod:`headspace.decode`) may stand in for :meth:`forward` on one new
        position: pre-norm, post (OPT-350m), sandwich (Gemma), post-sublayer (OLMo 2) or parallel
        (GPT-NeoX) blocks, fused self-attention with
        :class:`~headspace.MultiHeadAttention`'s own forward (sliding windows, QK-norm and per-layer
        rotations included; score soft-capping, Gemma 2's, in the Python step only), no ``check_finite``,
        this module's MLPs; not a model-wide :attr:`decode_blockers` reason. Where
        False, decoding runs :meth:`forward` with the KV cache. A pre-norm block with latent attention
        (DeepSeek) with its own forward has the Python step (its forward on one position). A
        :class:`~headspace.model.moe.MixtureOfExperts` MLP with its own forward has the Python step
        (the module called on the new rows), and so do learned sinks (gpt-oss), output gates and a
        pre-norm Gated DeltaNet or differential attention block with its own forward (Qwen3-Next,
        Qwen3.5, DiffLlama)."""
        a = self.attn
        mlp_ok = isinstance(self.mlp, (FeedForward, GatedFeedForward)) or (
            isinstance(self.mlp, MixtureOfExperts) and type(self.mlp).forward is MixtureOfExperts.forward
        )
        own = (GatedDeltaNet, DifferentialAttention)  # their forwards on one position with their caches
        if isinstance(a, own):
            ok = (
                self.norm == "pre"
                and not self.decode_blockers
                and type(a).forward in (c.forward for c in own)
            )
            return ok and mlp_ok
        if isinstance(a, LatentAttention):
            return (
                self.norm == "pre"
                and not self.decode_blockers
                and type(a).forward is LatentAttention.forward
                and mlp_ok
            )
        return (
            self.norm in ("pre", "post", "sandwich", "post_sublayer", "parallel")
            and not self.decode_blockers
            and isinstance(a, MultiHeadAttention)
            and type(a).forward is MultiHeadAttention.forward
            and a.fused
            and not a.check_finite
            and mlp_ok
        )

    @property
    def reduced_precision(self) -> bool:
        """Whether any product of this block has int8 or bfloat16 weights (``to_precision(...)``)."""
        return any(is_int8(p) or is_bf16(p) for p in self.parameters(recurse=True))

    def infer(self, x: Tensor, attn_mask: Tensor | None = None, workspace: Workspace | None = None) -> Tensor:
        """Inference-only forward with fewer passes over memory; same result as :meth:`forward`.

        The residual add is fused into the output GEMMs (``x + z W_O^T`` and ``h + a W_out^T`` by
        ``addmm``), the activation runs in place, the QKV, residual and MLP matrices are written into
        ``workspace`` (memory the caller reuses across blocks and batches, instead of fresh memory
        the kernel must fault in page by page), and no hook point fires. ``x`` is never written to
        and the result never lies in ``workspace``. Used by :meth:`headspace.Encoder.infer`; call it
        only without autograd, in eval mode and with no hook active (the caller checks). Blocks with
        RMSNorm, a gated MLP or rotary positions (:attr:`infer_supported` False) run :meth:`forward`.

        Notation used for tensor shapes:
            batch, seq, d_model, d_mlp, n_heads, n_kv_heads, d_head.

        Args:
            x: [batch, seq, d_model].
            attn_mask: None or bool [batch, 1, 1, seq] (True = real key), as sdpa takes it.
            workspace: scratch memory to reuse (None: a fresh one for this call).

        Returns:
            [batch, seq, d_model].
        """
        check_input_tensor("x", x, self.d_model, "d_model", self.ln1.weight)
        if not self.infer_supported:
            return self(x, attn_mask=attn_mask)
        B, S, d = x.shape
        a, mlp = self.attn, self.mlp
        H, dh = a.n_heads, a.d_head
        ws = Workspace() if workspace is None else workspace
        N = B * S
        x2 = x.reshape(N, d)  # (B S, d_model)
        src = F.layer_norm(x2, (d,), self.ln1.weight, self.ln1.bias, self.ln1.eps) if self.pre_ln else x2
        if self.reduced_precision:
            return self._infer_products(x2, src, B, S, attn_mask)
        q, k, v = a.project_qkv(src.view(B, S, d), workspace=ws)  # (B, H, S, dh), (B, Hkv, S, dh) x 2
        mask = CanonicalMask(mask=attn_mask, is_causal=False, dead_rows=None)  # every row has a real key
        z, _ = sdpa_attention(q, k, v, mask, scale=a.scale)  # (B, H, S, dh), stored as (B, S, H, dh)
        z = z.transpose(1, 2).reshape(N, H * dh)  # (B S, H dh): heads concatenated (a view)
        h = torch.addmm(x2, z, a.o_weight.t(), out=ws.matrix("h", N, d, x))  # (B S, d_model): x + z W_O^T
        if a.o_bias is not None:
            h += a.o_bias
        if not self.pre_ln:
            h = F.layer_norm(h, (d,), self.ln1.weight, self.ln1.bias, self.ln1.eps)  # fresh, not ws
        src = F.layer_norm(h, (d,), self.ln2.weight, self.ln2.bias, self.ln2.eps) if self.pre_ln else h
        u = ws.linear("mlp", src, mlp.fc_in.weight, mlp.fc_in.bias)  # (B S, d_mlp)
        if mlp.act_name == "relu":
            u.relu_()
        else:
            torch.ops.aten.gelu_(u, approximate="tanh" if mlp.act_name == "gelu_tanh" else "none")
        if self.pre_ln:
            out = torch.addmm(h, u, mlp.fc_out.weight.t())  # (B S, d_model): h + act(u) W_out^T, fresh
        else:
            out = h.addmm_(u, mlp.fc_out.weight.t())  # (B S, d_model): in place on LN1's fresh output
        if mlp.fc_out.bias is not None:
            out += mlp.fc_out.bias
        if not self.pre_ln:
            out = F.layer_norm(out, (d,), self.ln2.weight, self.ln2.bias, self.ln2.eps)
        return out.view(B, S, d)  # (B, S, d_model)

    def _infer_products(self, x2: Tensor, src: Tensor, B: int, S: int, attn_mask: Tensor | None) -> Tensor:
        """:meth:`infer` for int8 / bfloat16 weights: each product by ``F.linear`` (the int8 kernel for an
        :class:`~headspace.kernels.int8.Int8Weight`, the packed bfloat16 one for a
        :class:`~headspace.kernels.bf16.BF16Weight`), the rest as in :meth:`infer`.

        x2 [B S, d_model] the input, src [B S, d_model] the attention's input (x2 or LN1(x2)).
        """
        a, mlp = self.attn, self.mlp
        d, H, dh = self.d_model, a.n_heads, a.d_head
        N = B * S
        q, k, v = a.project_qkv(src.view(B, S, d))  # (B, H, S, dh), (B, Hkv, S, dh) x 2: int8 F.linear
        mask = CanonicalMask(mask=attn_mask, is_causal=False, dead_rows=None)
        z, _ = sdpa_attention(q, k, v, mask, scale=a.scale)  # (B, H, S, dh)
        z = z.transpose(1, 2).reshape(N, H * dh)  # (B S, H dh)
        h = F.linear(z, a.o_weight, a.o_bias)  # (B S, d_model): int8 for an Int8Weight
        h += x2  # x + z W_O^T + b_O
        if not self.pre_ln:
            h = F.layer_norm(h, (d,), self.ln1.weight, self.ln1.bias, self.ln1.eps)
        src = F.layer_norm(h, (d,), self.ln2.weight, self.ln2.bias, self.ln2.eps) if self.pre_ln else h
        u = F.linear(src, mlp.fc_in.weight, mlp.fc_in.bias)  # (B S, d_mlp)
        if mlp.act_name == "relu":
            u.relu_()
        else:
            torch.ops.aten.gelu_(u, approximate="tanh" if mlp.act_name == "gelu_tanh" else "none")
        out = F.linear(u, mlp.fc_out.weight, mlp.fc_out.bias)  # (B S, d_model)
        out += h
        if not self.pre_ln:
            out = F.layer_norm(out, (d,), self.ln2.weight, self.ln2.bias, self.ln2.eps)
        return out.view(B, S, d)  # (B, S, d_model)


#: A hook point with no function: :func:`_sum` may write over a value no hook point has seen.
_UNWATCHED = HookPoint()


def _sum(a: Tensor, b: Tensor, seen_by: HookPoint) -> Tensor:
    """``a + b`` (same shape, [batch, seq, d_model]; float addition commutes, so the same values as
    ``b + a``), written over ``a`` where nothing else can read it: ``a`` is a sublayer's fresh output
    that passed ``seen_by`` with no function there, no autograd graph records it, and it is a dense
    tensor of ``b``'s shape and dtype sharing no memory with ``b``."""
    if (
        torch.compiler.is_compiling()  # the compiler fuses the add itself (and cannot trace data_ptr)
        or seen_by.fns
        or a.requires_grad
        or a.shape != b.shape
        or a.dtype != b.dtype
        or not a.is_contiguous()
        or a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    ):
        return a + b  # (batch, seq, d_model)
    return a.add_(b)


#: The residual maths of each layout (:attr:`TransformerBlock.spec`'s ``layout``), bound when it is set.
_RESIDUAL = {
    "pre": TransformerBlock._pre,
    "post": TransformerBlock._post,
    "sandwich": TransformerBlock._sandwich,
    "post_sublayer": TransformerBlock._post_sublayer,
    "parallel": TransformerBlock._parallel,
}


def __getattr__(name: str) -> Any:
    """The trace executor's values that this module once held (:data:`~headspace.model.recorded.
    FORMER_BLOCK_NAMES`), still importable from here: the same objects."""
    if name in recorded.FORMER_BLOCK_NAMES:
        return getattr(recorded, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
