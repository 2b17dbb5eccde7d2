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

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention.functional import sdpa_attention
from ..attention.layer import MultiHeadAttention, check_input_tensor
from ..core.checks import check_positive_float, check_positive_int, check_probability
from ..decode.kv_cache import KVCache
from ..kernels.bf16 import is_bf16
from ..kernels.int8 import is_int8
from ..kernels.workspace import Workspace
from ..nn.hooks import HookPoint, Memo, Recomputed, note_source, noting_sources, resolve, source_of
from ..nn.masks import CanonicalMask
from ..nn.norms import RMSNorm, rms_norm
from ..nn.positions import Rotary

#: Activation names accepted by :class:`FeedForward`, :class:`GatedFeedForward` and the models' configs.
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")
#: Residual/LayerNorm arrangements accepted by :class:`TransformerBlock`.
NORMS = ("post", "pre", "sandwich", "post_sublayer")
#: Kinds of normalisation layer accepted by :class:`TransformerBlock` (``norm_kind``).
NORM_KINDS = ("layernorm", "rmsnorm")
#: Kinds of feed-forward network accepted by :class:`TransformerBlock` (``mlp_kind``).
MLP_KINDS = ("plain", "gated")


def make_activation(act: str) -> nn.Module:
    """``"gelu"`` (exact, erf: BERT), ``"gelu_tanh"`` (tanh approximation: GPT-2's gelu_new), ``"relu"``,
    ``"silu"`` (x sigmoid(x), a.k.a. swish: Llama's gate)."""
    if act == "gelu":
        return nn.GELU(approximate="none")
    if act == "gelu_tanh":
        return nn.GELU(approximate="tanh")
    if act == "relu":
        return nn.ReLU()
    if act == "silu":
        return nn.SiLU()
    raise ValueError(f"act must be one of {list(ACTIVATIONS)}; got {act!r}")


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


def _fire(hook: HookPoint, value: Tensor) -> Tensor:
    """``hook(value)`` while the hook point has a function, ``value`` itself (no module call) otherwise."""
    return hook(value) if hook.fns else value


def _defers(points: tuple[HookPoint, ...]) -> bool:
    """Whether some point of ``points`` fires and every one that fires only records a Deferred."""
    live = [p for p in points if p.active]
    return bool(live) and all(p.defers for p in live)


def _copy(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().clone()


def _norm_source(norm: nn.Module, source: Any, shape: torch.Size) -> Recomputed | None:
    """``norm`` of a value recomputed from ``source``, as a :class:`~headspace.hooks.Recomputed` with copies
    of the norm's weights and the op its forward runs (:func:`~headspace.norms.rms_norm`,
    ``F.layer_norm``); None for other norms."""
    if type(norm) is RMSNorm:
        return Recomputed(rms_norm, source, _copy(norm.weight), norm.eps, norm.offset, shape=shape)
    if type(norm) is nn.LayerNorm:
        w, b = _copy(norm.weight), _copy(norm.bias)
        return Recomputed(F.layer_norm, source, norm.normalized_shape, w, b, norm.eps, shape=shape)
    return None


def _plain_linear(fc: nn.Module) -> bool:
    """Whether ``fc`` is an ``nn.Linear`` whose forward is ``F.linear`` on plain float weights."""
    if type(fc) is not nn.Linear:
        return False
    return all(
        t is None or (t.is_floating_point() and not is_int8(t) and not is_bf16(t))
        for t in (fc.weight, fc.bias)
    )


class DeferredMLP:
    """An MLP's ``hook_pre``, ``hook_pre_linear`` or ``hook_post`` [batch, seq, d_mlp], kept as the MLP's
    input [batch, seq, d_model] (or, in a fully recorded block, a deferred value that computes the input
    again: :class:`~headspace.hooks.Recomputed`) and copies of the input linears' weights and biases.

    ``materialize()`` runs the layer's own ops again on the same input: ``pre = F.linear(x, W_gate,
    b_gate)`` (plain MLP: ``F.linear(x, W_in, b_in)``), ``pre_linear = F.linear(x, W_in, b_in)``, ``post =
    act(pre) * pre_linear`` (plain: ``act(pre)``): bit for bit what the traced forward computed (the
    copies keep it so after the weights change). ``which``: ``"pre"``, ``"pre_linear"`` or ``"post"``.
    """

    def __init__(self, x: Any, mlp: _FeedForwardLayers, which: str) -> None:
        if which not in ("pre", "pre_linear", "post"):
            raise ValueError(f"which must be 'pre', 'pre_linear' or 'post'; got {which!r}")
        self.x, self.which, self.act = x, which, mlp.act
        gated = hasattr(mlp, "fc_gate")
        first = mlp.fc_gate if gated else mlp.fc_in
        self.w_pre = first.weight.detach().clone()
        self.b_pre = None if first.bias is None else first.bias.detach().clone()
        self.w_lin = mlp.fc_in.weight.detach().clone() if gated else None
        self.b_lin = None if not gated or mlp.fc_in.bias is None else mlp.fc_in.bias.detach().clone()
        self.shape = (*x.shape[:-1], first.weight.shape[0])

    def share(self, which: str) -> DeferredMLP:
        """The same inputs (no second copy of anything) for another of the MLP's hook points."""
        other = object.__new__(DeferredMLP)
        other.__dict__.update(self.__dict__)
        other.which = which
        return other

    def evaluate(self, memo: Memo, head: int | None = None) -> Tensor:
        """:meth:`materialize`, a deferred input resolved through ``memo``."""
        x = resolve(self.x, memo)  # (batch, seq, d_model)
        pre = F.linear(x, self.w_pre, self.b_pre)  # (batch, seq, d_mlp)
        if self.which == "pre":
            return pre
        if self.w_lin is None:  # plain MLP: post = act(pre)
            return self.act(pre)
        lin = F.linear(x, self.w_lin, self.b_lin)  # (batch, seq, d_mlp)
        return lin if self.which == "pre_linear" else self.act(pre) * lin

    def materialize(self, head: int | None = None) -> Tensor:
        """[batch, seq, d_mlp] (``head`` is not used: the MLP's hook points have no head axis)."""
        return self.evaluate({}, head)


class DeferredSum:
    """A block's ``hook_resid_mid`` [batch, seq, d_model] where it is ``x + a`` (pre-norm, sandwich and
    post-sublayer blocks), kept as the two tensors the block added (its recorded ``hook_resid_pre`` and
    ``hook_attn_out``): ``materialize()`` adds them again, bit for bit the block's value."""

    def __init__(self, x: Tensor, a: Tensor) -> None:
        self.x, self.a = x, a
        self.shape = tuple(x.shape)

    def evaluate(self, memo: Memo, head: int | None = None) -> Tensor:
        """:meth:`materialize` (``memo`` resolves deferred terms)."""
        return resolve(self.x, memo) + resolve(self.a, memo)

    def materialize(self, head: int | None = None) -> Tensor:
        """[batch, seq, d_model] (``head`` is not used)."""
        return self.evaluate({})


class _FeedForwardLayers(nn.Module):
    """What :class:`FeedForward` and :class:`GatedFeedForward` share: the checks, the activation, the
    linears and hook points (registered in one order: ``fc_gate`` first and ``hook_pre_linear`` between
    ``hook_pre`` and ``hook_post`` when gated), and ``forward`` around each one's hidden units."""

    def __init__(self, d_model: int, d_mlp: int, act: str, bias: bool, *, gated: bool) -> None:
        super().__init__()
        for name, value in (("d_model", d_model), ("d_mlp", d_mlp)):
            check_positive_int(name, value)
        self.act_name = act
        self.act = make_activation(act)
        if gated:
            self.fc_gate = nn.Linear(d_model, d_mlp, bias=bias)
        self.fc_in = nn.Linear(d_model, d_mlp, bias=bias)
        self.fc_out = nn.Linear(d_mlp, d_model, bias=bias)
        self.hook_pre = HookPoint()  # [batch, seq, d_mlp], before the activation (the gate's, if gated)
        if gated:
            self.hook_pre_linear = HookPoint()  # [batch, seq, d_mlp], the linear (up) branch
        self.hook_post = HookPoint()  # [batch, seq, d_mlp], the input of W_out

    def _hidden(self, x: Tensor) -> Tensor:
        """[batch, seq, d_model] -> the hidden units [batch, seq, d_mlp] before ``hook_post``."""
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        """Apply the MLP to every position.

        Notation used for tensor shapes:
            batch, seq, d_model, d_mlp.

        Args:
            x: [batch, seq, d_model].

        Returns:
            [batch, seq, d_model].

        While only recorders (:attr:`HookPoint.defers`) watch the hook points of a standard MLP (plain
        float ``nn.Linear`` layers), they get a :class:`DeferredMLP` of the input instead of the
        [batch, seq, d_mlp] values; the output is the same, bit for bit.
        """
        if any(p.fns for p in self._points()) and self._may_defer(x):
            return self._forward_deferred(x)
        return self.fc_out(_fire(self.hook_post, self._hidden(x)))  # (batch, seq, d_model)

    def _points(self) -> tuple[HookPoint, ...]:
        gated = "hook_pre_linear" in self._modules
        return (
            (self.hook_pre, self.hook_pre_linear, self.hook_post)
            if gated
            else (self.hook_pre, self.hook_post)
        )

    def _may_defer(self, x: Tensor) -> bool:
        """Whether the hook points may get a :class:`DeferredMLP` of ``x``: only recorders fire, this
        class's own ``_hidden``, plain float linears and an activation without parameters, and the
        values [.., d_mlp] of the recorded points outweigh ``x`` and the weight copies (short inputs
        store the values: a copy of the weights is the larger)."""
        if type(self)._hidden not in (FeedForward._hidden, GatedFeedForward._hidden):
            return False
        gated = "fc_gate" in self._modules
        linears = [self.fc_in, self.fc_gate] if gated else [self.fc_in]
        if not all(_plain_linear(fc) for fc in linears) or any(True for _ in self.act.parameters()):
            return False
        if not _defers(self._points()):
            return False
        if source_of(x) is not None:  # a fully recorded block keeps what x is recomputed from anyway
            return True
        rows, d_mlp = x.numel() // max(1, x.shape[-1]), self.fc_in.weight.shape[0]
        recorded = sum(1 for p in self._points() if p.active) * rows * d_mlp
        copies = sum(fc.weight.numel() + (0 if fc.bias is None else fc.bias.numel()) for fc in linears)
        return recorded > copies + x.numel()

    def _forward_deferred(self, x: Tensor) -> Tensor:
        """:meth:`forward`'s ops (those of ``_hidden``, without firing) with the recorders handed a
        :class:`DeferredMLP` of ``x``: [batch, seq, d_model] -> [batch, seq, d_model]."""
        gated = "fc_gate" in self._modules
        if gated:
            hidden = self.act(self.fc_gate(x)) * self.fc_in(x)  # (batch, seq, d_mlp)
        else:
            hidden = self.act(self.fc_in(x))  # (batch, seq, d_mlp)
        names = ("pre", "pre_linear", "post") if gated else ("pre", "post")
        source = source_of(x)
        kept = x.detach() if source is None else source
        deferred: DeferredMLP | None = None
        for point, which in zip(self._points(), names, strict=True):
            if point.active:
                deferred = DeferredMLP(kept, self, which) if deferred is None else deferred.share(which)
                point.fire_deferred(deferred)
        out = self.fc_out(hidden)  # (batch, seq, d_model)
        if source is not None and _plain_linear(self.fc_out):
            # in a fully recorded block: the output is noted as fc_out of the (deferred) hidden units
            post = DeferredMLP(kept, self, "post") if deferred is None else deferred.share("post")
            w, b = self.fc_out.weight.detach().clone(), _copy(self.fc_out.bias)
            note_source(out, Recomputed(F.linear, post, w, b, shape=out.shape))
        return out


class FeedForward(_FeedForwardLayers):
    r"""The position-wise feed-forward network ``MLP(x) = act(x W_in + b_in) W_out + b_out``.

    ``fc_in`` is an ``nn.Linear(d_model, d_mlp)`` (so ``W_in = fc_in.weight.T``), ``fc_out`` an
    ``nn.Linear(d_mlp, d_model)``. Paper symbols (Vaswani et al. 2017, eq. 2): ``W_in = W_1``,
    ``W_out = W_2``, ``d_mlp = d_ff``; the paper's act is ReLU.

    Hook points, both [batch, seq, d_mlp]: ``hook_pre`` (before the activation), ``hook_post`` (after it).
    """

    def __init__(self, d_model: int, d_mlp: int, act: str = "gelu", bias: bool = True) -> None:
        super().__init__(d_model, d_mlp, act, bias, gated=False)

    def _hidden(self, x: Tensor) -> Tensor:
        return self.act(_fire(self.hook_pre, self.fc_in(x)))  # (batch, seq, d_mlp)

    def extra_repr(self) -> str:
        return f"act={self.act_name!r}"


class GatedFeedForward(_FeedForwardLayers):
    r"""A gated feed-forward network ``MLP(x) = (act(x W_gate + b_gate) * (x W_in + b_in)) W_out + b_out``.

    SwiGLU with ``act="silu"`` (Llama, Mistral, Qwen: transformers' ``down_proj(act(gate_proj(x)) *
    up_proj(x))``), GeGLU with ``"gelu"`` / ``"gelu_tanh"`` (Shazeer 2020, "GLU Variants Improve
    Transformer"). ``fc_gate`` and ``fc_in`` are ``nn.Linear(d_model, d_mlp)`` (``W_gate = fc_gate.weight.T``
    is Llama's ``gate_proj``, ``W_in = fc_in.weight.T`` its ``up_proj``), ``fc_out`` an
    ``nn.Linear(d_mlp, d_model)`` (``down_proj``).

    Hook points, all [batch, seq, d_mlp], with TransformerLens's names: ``hook_pre`` (the gate before the
    activation, ``x W_gate + b_gate``), ``hook_pre_linear`` (``x W_in + b_in``), ``hook_post`` (their
    gated product, the input of ``W_out``).
    """

    fc_gate: nn.Linear
    hook_pre_linear: HookPoint

    def __init__(self, d_model: int, d_mlp: int, act: str = "silu", bias: bool = False) -> None:
        super().__init__(d_model, d_mlp, act, bias, gated=True)

    def _hidden(self, x: Tensor) -> Tensor:
        g = _fire(self.hook_pre, self.fc_gate(x))  # (batch, seq, d_mlp)
        u = _fire(self.hook_pre_linear, self.fc_in(x))  # (batch, seq, d_mlp)
        return self.act(g) * u  # (batch, seq, d_mlp)

    def extra_repr(self) -> str:
        return f"act={self.act_name!r}, gated"


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
    ``offset + weight`` (Gemma: 1).

    Hook points, all [batch, seq, d_model]: ``hook_resid_pre`` (the input), ``hook_attn_out`` (the
    attention sublayer's output, after dropout), ``hook_resid_mid`` (``h``), ``hook_mlp_out`` (the MLP
    sublayer's output, after dropout), ``hook_resid_post`` (the output). They cost nothing while no
    function is added to them.
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
        self.d_model = d_model
        self.norm = norm
        self.pre_ln = norm == "pre"
        self.norm_kind = norm_kind
        self.mlp_kind = mlp_kind
        self.attn = MultiHeadAttention(
            d_model, n_heads, d_head=d_head, n_kv_heads=n_kv_heads, bias=bias, dropout=attn_dropout,
            qkv_bias=qkv_bias, out_bias=out_bias, rotary=rotary, window=window, qk_norm=qk_norm,
            qk_norm_eps=ln_eps if qk_norm_eps is None else qk_norm_eps, qk_norm_offset=norm_offset,
            softcap=softcap, scale=scale,
        )  # fmt: skip
        self.ln1 = make_norm(norm_kind, d_model, ln_eps, norm_offset)
        mlp_bias = bias if mlp_bias is None else mlp_bias
        if mlp_kind == "gated":
            self.mlp: FeedForward | GatedFeedForward = GatedFeedForward(
                d_model, d_mlp, act=act, bias=mlp_bias
            )
        else:
            self.mlp = FeedForward(d_model, d_mlp, act=act, bias=mlp_bias)
        self.ln2 = make_norm(norm_kind, d_model, ln_eps, norm_offset)
        sandwich = norm == "sandwich"
        # sandwich norms only: the norms of each sublayer's output, before the residual add
        self.register_module(
            "ln_attn_out", make_norm(norm_kind, d_model, ln_eps, norm_offset) if sandwich else None
        )
        self.register_module(
            "ln_mlp_out", make_norm(norm_kind, d_model, ln_eps, norm_offset) if sandwich else None
        )
        #: Why the cached decoding step may not stand in for this block although the block alone would
        #: allow it: set by the model for model-wide features (final soft-capping, per-layer rotations).
        self.decode_blockers: tuple[str, ...] = ()
        self.dropout = nn.Dropout(dropout)
        self.hook_resid_pre = HookPoint()  # [batch, seq, d_model]
        self.hook_attn_out = HookPoint()  # [batch, seq, d_model]
        self.hook_resid_mid = HookPoint()  # [batch, seq, d_model]
        self.hook_mlp_out = HookPoint()  # [batch, seq, d_model]
        self.hook_resid_post = HookPoint()  # [batch, seq, d_model]

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
        """Run the block on the residual stream ``x``.

        Notation used for tensor shapes:
            batch, seq (the new positions), seq_k (= seq, plus the cached positions with a KV cache),
            d_model.

        Args:
            x: [batch, seq, d_model].
            key_padding: bool [batch, seq_k], True for real tokens.
            attn_mask: bool (True = may attend) or float (additive) mask, see :mod:`headspace.masks`.
            is_causal: causal self-attention (aligned bottom-right, as a KV cache needs).
            kv_cache: this block's :class:`~headspace.KVCache` for incremental decoding.
            positions: rotary attention only: int [seq] or [batch, seq] positions of the new tokens
                (None: after the cached ones), see :meth:`MultiHeadAttention.forward`.

        Returns:
            [batch, seq, d_model].

        While only :func:`headspace.trace`'s recorders watch every hook point of the block (on inputs
        long enough), the recorders get values recomputed from the block's input, the attention's z and
        copies of the weights (:meth:`_forward_noted`); the output is the same, bit for bit.
        """
        check_input_tensor("x", x, self.d_model, "d_model", self.ln1.weight)  # before any LayerNorm
        if self.hook_resid_pre.fns:
            x = self.hook_resid_pre(x)
        kw: dict[str, Any] = {
            "key_padding": key_padding,
            "attn_mask": attn_mask,
            "is_causal": is_causal,
            "kv_cache": kv_cache,
        }
        if positions is not None:
            kw["positions"] = positions
        if self.hook_resid_pre.fns and self._keeps_input_and_z(x, kv_cache):
            with noting_sources():
                note_source(x, x.detach())  # the trace holds x (hook_resid_pre)
                out = self._forward_noted(x, kw)
        elif self.norm in ("sandwich", "post_sublayer"):
            out = self._forward_normed_sublayers(x, kw)
        elif self.pre_ln:
            a = self.dropout(self.attn(self.ln1(x), **kw))  # (batch, seq, d_model)
            if self.hook_attn_out.fns:
                a = self.hook_attn_out(a)
            h = x + a  # (batch, seq, d_model)
            if self.hook_resid_mid.fns:
                h = self._fire_resid_mid(x, a, h)
            m = self.dropout(self.mlp(self.ln2(h)))  # (batch, seq, d_model)
            if self.hook_mlp_out.fns:
                m = self.hook_mlp_out(m)
            out = h + m
        else:
            a = self.dropout(self.attn(x, **kw))  # (batch, seq, d_model)
            if self.hook_attn_out.fns:
                a = self.hook_attn_out(a)
            h = self.ln1(x + a)  # (batch, seq, d_model)
            if self.hook_resid_mid.fns:
                h = self.hook_resid_mid(h)
            m = self.dropout(self.mlp(h))  # (batch, seq, d_model)
            if self.hook_mlp_out.fns:
                m = self.hook_mlp_out(m)
            out = self.ln2(h + m)
        if self.hook_resid_post.fns:
            out = self.hook_resid_post(out)
        return out

    # ------------------------------------------------------------------ a fully recorded block
    def _all_points(self) -> list[HookPoint]:
        """Every hook point of the block, its attention and its MLP."""
        points = [self.hook_resid_pre, self.hook_attn_out, self.hook_resid_mid, self.hook_mlp_out]
        points += [self.hook_resid_post, *self.attn._hook_points, *self.mlp._points()]
        return points

    def _norms(self) -> list[nn.Module]:
        sandwich = self.norm == "sandwich"
        return [self.ln1, self.ln2] + ([self.ln_attn_out, self.ln_mlp_out] if sandwich else [])

    def _keeps_input_and_z(self, x: Tensor, kv_cache: KVCache | None) -> bool:
        """Whether this call keeps only the block's input and the attention's z (and copies of the
        weights): every hook point of the block, its attention and its MLP is recorded and nothing
        replaces a value, the parts are the standard ones (this module's MLPs, plain float linears,
        RMSNorm or LayerNorm, no soft-capping), in eval mode without a KV cache, and that keeps fewer
        bytes than the parts' own deferrals (:meth:`_kept_bytes`: not so for short inputs, where the
        copies of the weights outweigh the values)."""
        if self.training or kv_cache is not None or self.reduced_precision:
            return False
        a, mlp = self.attn, self.mlp
        if type(a).forward is not MultiHeadAttention.forward or not a.fused or a.softcap is not None:
            return False
        if type(mlp) not in (FeedForward, GatedFeedForward) or any(True for _ in mlp.act.parameters()):
            return False
        linears = [mlp.fc_in, mlp.fc_out] + ([mlp.fc_gate] if "fc_gate" in mlp._modules else [])
        if not all(_plain_linear(fc) for fc in linears):
            return False
        if not all(type(n) in (RMSNorm, nn.LayerNorm) for n in self._norms()):
            return False
        if not all(p.active and p.defers for p in self._all_points()):
            return False
        rows = x.numel() // max(1, x.shape[-1])
        chained, own = self._kept_bytes(rows)
        return chained < own

    def _kept_bytes(self, rows: int) -> tuple[int, int]:
        """What a fully recorded call on ``rows`` positions keeps, in elements, besides
        ``hook_resid_post``: (keeping the input and z, keeping what each part defers on its own)."""
        a, mlp = self.attn, self.mlp
        d, H, Hkv, dh = self.d_model, a.n_heads, a.n_kv_heads, a.d_head
        d_mlp = mlp.fc_in.weight.shape[0]
        mlp_points = len(mlp._points())
        w_o = a.o_weight.numel()
        mlp_in = sum(p.numel() for name, p in mlp.named_parameters() if not name.startswith("fc_out"))
        own = rows * (d + (H + 2 * Hkv) * dh + H * dh + 2 * d) + w_o  # x, q/k/v, z, attn_out, mlp_out
        own += rows * (H + Hkv) * dh * ((a.rotary is not None) + (a.qk_norm is not None))
        own += rows * d * (self.norm == "post")  # a post-LN block's resid_mid
        own += min(mlp_points * rows * d_mlp, rows * d + mlp_in)  # the MLP's values, or its input
        copies = sum(p.numel() for p in self.parameters())  # every weight, copied once
        chained = rows * (d + H * dh) + copies
        return chained, own

    def _noted_norm(self, norm: nn.Module, t: Tensor) -> Tensor:
        """``norm(t)``, noted as recomputed from what ``t`` is recomputed from."""
        out = norm(t)
        source = source_of(t)
        if source is not None:
            node = _norm_source(norm, source, out.shape)
            if node is not None:
                note_source(out, node)
        return out

    @staticmethod
    def _fire_noted(point: HookPoint, t: Tensor) -> None:
        """Fire ``point`` (only recorders watch it) with ``t``, or with what ``t`` is recomputed from."""
        source = source_of(t)
        if source is not None and not isinstance(source, Tensor):
            point.fire_deferred(source)
        else:
            point(t)

    def _forward_noted(self, x: Tensor, kw: dict[str, Any]) -> Tensor:
        """:meth:`forward`'s ops for every arrangement (pre, post, sandwich, post-sublayer), while every
        hook point is recorded: each value is noted as recomputed from the block's input, the
        attention's z and copies of the weights, and the block's hook points get those deferred values
        (:func:`~headspace.hooks.note_source`; the attention and the MLP inside defer theirs to them).
        x [batch, seq, d_model] -> [batch, seq, d_model], the same tensor bit for bit."""
        norm, sandwich = self.norm, self.norm == "sandwich"
        a = self.attn(self._noted_norm(self.ln1, x) if norm in ("pre", "sandwich") else x, **kw)
        if sandwich:
            a = self._noted_norm(self.ln_attn_out, a)
        elif norm == "post_sublayer":
            a = self._noted_norm(self.ln1, a)
        a = self.dropout(a)  # (batch, seq, d_model): eval mode, the tensor itself
        self._fire_noted(self.hook_attn_out, a)
        h = x + a  # (batch, seq, d_model)
        sx, sa = source_of(x), source_of(a)
        if sx is not None and sa is not None:
            note_source(h, Recomputed(operator.add, sx, sa, shape=h.shape))
        if norm == "post":
            h = self._noted_norm(self.ln1, h)
        self._fire_noted(self.hook_resid_mid, h)
        m = self.mlp(self._noted_norm(self.ln2, h) if norm in ("pre", "sandwich") else h)
        if sandwich:
            m = self._noted_norm(self.ln_mlp_out, m)
        elif norm == "post_sublayer":
            m = self._noted_norm(self.ln2, m)
        m = self.dropout(m)
        self._fire_noted(self.hook_mlp_out, m)
        out = h + m  # (batch, seq, d_model)
        return self.ln2(out) if norm == "post" else out

    def _fire_resid_mid(self, x: Tensor, a: Tensor, h: Tensor) -> Tensor:
        """``hook_resid_mid`` on ``h = x + a``: while only recorders watch it and ``x`` and ``a`` are
        recorded too (``hook_resid_pre``, ``hook_attn_out``), they get a :class:`DeferredSum` of the two
        (no third [batch, seq, d_model] tensor kept); otherwise the hook point fires on ``h``."""
        if (
            _defers((self.hook_resid_mid,))
            and _defers((self.hook_resid_pre,))
            and _defers((self.hook_attn_out,))
        ):
            self.hook_resid_mid.fire_deferred(DeferredSum(x.detach(), a.detach()))
            return h
        return self.hook_resid_mid(h)

    def _forward_normed_sublayers(self, x: Tensor, kw: dict[str, Any]) -> Tensor:
        """``norm="sandwich"`` (Gemma: a norm before and after each sublayer) or ``"post_sublayer"``
        (OLMo 2: a norm after each sublayer only), with the residual adds outside the norms:
        x [batch, seq, d_model] -> [batch, seq, d_model]."""
        sandwich = self.norm == "sandwich"
        a = self.attn(self.ln1(x) if sandwich else x, **kw)  # (batch, seq, d_model)
        a = self.dropout(self.ln_attn_out(a) if sandwich else self.ln1(a))
        if self.hook_attn_out.fns:
            a = self.hook_attn_out(a)
        h = x + a  # (batch, seq, d_model)
        if self.hook_resid_mid.fns:
            h = self._fire_resid_mid(x, a, h)
        m = self.mlp(self.ln2(h) if sandwich else h)  # (batch, seq, d_model)
        m = self.dropout(self.ln_mlp_out(m) if sandwich else self.ln2(m))
        if self.hook_mlp_out.fns:
            m = self.hook_mlp_out(m)
        return h + m

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
            and getattr(self.attn, "window", None) is None
            and getattr(self.attn, "qk_norm", None) is None
            and getattr(self.attn, "softcap", None) is None
            and self.attn.rotary is None
            and self.attn.fused
        )

    @property
    def decode_supported(self) -> bool:
        """Whether the decoding step (:mod:`headspace.decode`) may stand in for :meth:`forward` on one new
        position: pre-norm, sandwich (Gemma) or post-sublayer (OLMo 2) norms, fused self-attention with
        :class:`~headspace.MultiHeadAttention`'s own forward (sliding windows, QK-norm and per-layer
        rotations included), no ``check_finite``, this module's MLPs; not score soft-capping (Gemma 2:
        its scores take the reference maths) nor a model-wide :attr:`decode_blockers` reason. Where
        False, decoding runs :meth:`forward` with the KV cache."""
        a = self.attn
        return (
            self.norm in ("pre", "sandwich", "post_sublayer")
            and not self.decode_blockers
            and getattr(a, "softcap", None) is None
            and isinstance(a, MultiHeadAttention)  # not a head-parallel shard, which has no fused weight
            and type(a).forward is MultiHeadAttention.forward
            and a.fused
            and not a.check_finite
            and isinstance(self.mlp, (FeedForward, GatedFeedForward))
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
