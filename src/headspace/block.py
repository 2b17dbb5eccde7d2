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

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import KVCache, MultiHeadAttention, check_input_tensor, rotate_fused
from .checks import check_positive_float, check_positive_int, check_probability
from .functional import sdpa_attention
from .hooks import HookPoint
from .kernels.bf16 import BF16Weight, float32_rows, is_bf16
from .kernels.int8 import is_int8
from .kernels.prepack import pack_weight, packable, packed_linear_fn
from .kernels.workspace import Workspace
from .masks import CanonicalMask
from .norms import RMSNorm
from .positions import Rotary

#: Activation names accepted by :class:`FeedForward`, :class:`GatedFeedForward` and the models' configs.
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")
#: Residual/LayerNorm arrangements accepted by :class:`TransformerBlock`.
NORMS = ("post", "pre")
#: Kinds of normalisation layer accepted by :class:`TransformerBlock` (``norm_kind``).
NORM_KINDS = ("layernorm", "rmsnorm")
#: Kinds of feed-forward network accepted by :class:`TransformerBlock` (``mlp_kind``).
MLP_KINDS = ("plain", "gated")
#: The hook points of :class:`TransformerBlock` itself, in the order they fire.
_BLOCK_HOOKS = ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post")


def norm_fn(norm: nn.Module) -> Callable[[Tensor], Tensor]:
    """``norm`` as a callable of the rows, resolved once: ``F.rms_norm`` for an RMSNorm of offset 0 on
    float32 rows (bitwise what :class:`~headspace.norms.RMSNorm` computes, in one op instead of seven),
    ``F.layer_norm`` for a LayerNorm, the module itself otherwise."""
    if type(norm) is RMSNorm and norm.offset == 0.0:
        shape, weight, eps = (norm.d_model,), norm.weight, norm.eps

        def rms(x: Tensor) -> Tensor:
            return F.rms_norm(x, shape, weight, eps) if x.dtype == torch.float32 else norm(x)

        return rms
    if type(norm) is nn.LayerNorm:
        shape, weight, bias, eps = norm.normalized_shape, norm.weight, norm.bias, norm.eps
        return lambda x: F.layer_norm(x, shape, weight, bias, eps)
    return norm


def linear_fn(
    weight: Tensor, bias: Tensor | None, pack_rows: int | None = None
) -> Callable[[Tensor], Tensor]:
    """``F.linear(x, weight, bias)`` of the rows ``x`` [n, in] as a callable, resolved once: ``torch.mm``
    on a transposed view of a plain float weight without bias (the product ``F.linear`` runs, without
    its dispatch layers), ``F.linear`` itself otherwise (biases, and the int8 / bfloat16 weights whose
    ``F.linear`` runs their own kernels). With ``pack_rows``, a plain float32 weight is packed once for
    MKL's GEMM at that many rows (:func:`headspace.kernels.prepack.packed_linear_fn`: a copy)."""
    if pack_rows is not None and packable(weight):
        return packed_linear_fn(weight, bias, pack_rows)
    if bias is None and type(weight) in (nn.Parameter, Tensor):
        weight_t = weight.t()  # (in, out): a view, so in-place edits of the weight show
        return lambda x: torch.mm(x, weight_t)
    return lambda x: F.linear(x, weight, bias)


#: the native step's codes for the activations it runs in place (see kernels/decode_rows.cpp)
_NATIVE_ACTS = {(nn.SiLU, None): 0, (nn.ReLU, None): 1, (nn.GELU, "none"): 2, (nn.GELU, "tanh"): 3}


def native_norm(norm: nn.Module | None) -> tuple[int, Tensor | None, Tensor | None, float] | None:
    """``norm`` as the native step runs it (kind, weight, bias, eps): an RMSNorm of offset 0 (kind 0,
    ``F.rms_norm``) or a LayerNorm over one dim (kind 1, ``F.layer_norm``) with float32 parameters, the
    forms :func:`norm_fn` runs on float32 rows; None otherwise (kind -1: no norm)."""
    if norm is None:
        return -1, None, None, 0.0
    if type(norm) is RMSNorm and norm.offset == 0.0 and norm.weight.dtype == torch.float32:
        return 0, norm.weight, None, float(norm.eps)
    if type(norm) is nn.LayerNorm and len(norm.normalized_shape) == 1:
        w, b = norm.weight, norm.bias
        if all(t is None or t.dtype == torch.float32 for t in (w, b)):
            return 1, w, b, float(norm.eps)
    return None


def native_linear(
    weight: Tensor, bias: Tensor | None, packed: Tensor | None = None
) -> tuple[Tensor, Tensor | None, Tensor | None, int] | None:
    """A product as the native step runs it, (weight, bias, packed copy, kind), as :func:`linear_fn`
    runs it: a plain float32 weight without bias transposed ([in, out], ``mm``; kind 0), with a float32
    bias as it is ([out, in], ``linear``; kind 0); with a ``packed`` copy for MKL's GEMM the weight as it
    is (``mkl::_mkl_linear``, :func:`headspace.kernels.prepack.packed_linear_fn`; kind 1); a
    :class:`~headspace.kernels.bf16.BF16Weight` as its float32 values and oneDNN's packed copy
    (:func:`headspace.kernels.bf16.bf16_linear`; kind 2). None for int8 weights and other dtypes."""
    if bias is not None and (type(bias) not in (nn.Parameter, Tensor) or bias.dtype != torch.float32):
        return None
    if type(weight) is BF16Weight and weight.dim() == 2:
        with torch._C.DisableTorchFunctionSubclass():
            values = Tensor.as_subclass(weight, Tensor)  # the float32 values, as a plain tensor
        return values, bias, weight.packed, 2
    if type(weight) not in (nn.Parameter, Tensor) or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    if packed is not None:
        return weight, bias, packed, 1
    return (weight.t(), None, None, 0) if bias is None else (weight, bias, None, 0)


def activation_fn_(act: nn.Module) -> Callable[[Tensor], Tensor]:
    """``act`` as a callable, resolved once: in place on its (fresh) input for torch's SiLU, ReLU and
    GELU modules, the module itself otherwise."""
    kind = type(act)
    if kind is nn.SiLU:
        return lambda x: F.silu(x, inplace=True)
    if kind is nn.ReLU:
        return torch.relu_
    if kind is nn.GELU:
        approximate = act.approximate  # type: ignore[attr-defined]
        return lambda x: torch.ops.aten.gelu_(x, approximate=approximate)
    return act


class DecodingLayer(NamedTuple):
    """One pre-norm block's decoding step, flattened (:meth:`TransformerBlock.decoding_layer`): each
    product a callable of the rows, the norms and the in-place activation resolved, the head counts
    as numbers. ``gate`` is None for a plain MLP."""

    norm1: Callable[[Tensor], Tensor]
    qkv: Callable[[Tensor], Tensor]
    n_heads: int
    n_kv_heads: int
    d_head: int
    gqa: bool
    scale: float
    rotary: Rotary | None
    o: Callable[[Tensor], Tensor]
    norm2: Callable[[Tensor], Tensor]
    gate: Callable[[Tensor], Tensor] | None
    act_: Callable[[Tensor], Tensor]
    fc_in: Callable[[Tensor], Tensor]
    fc_out: Callable[[Tensor], Tensor]
    #: the same step as :func:`headspace.kernels.native.decode_rows` takes it (its tensors, ints and
    #: floats, :func:`native_parts`), or None where some part has no native form
    native: tuple[list[Tensor | None], list[int], list[float]] | None = None


def decode_layer_rows(
    layer: DecodingLayer,
    x: Tensor,
    kv_cache: KVCache | tuple[Tensor, Tensor, Tensor, Tensor],
    cos: Tensor | None,
    sin: Tensor | None,
) -> Tensor:
    """One block's decoding step on the rows ``x`` [batch, d_model] -> [batch, d_model], for a caller
    that ran ``kv_cache.check(batch, 1, ...)``; ``cos``/``sin`` [1, 1, rotary_dim] (None without rotary).

    :meth:`TransformerBlock.forward` for one new position after the cache, bit for bit: each product
    one 2-D call (no reshapes around it), q and k rotated as [batch, heads, 1, d_head] rows of the fused
    projection, the new key and value appended by :meth:`~headspace.KVCache.append_one`, the
    activation and the gate's product in place on the fresh gate output.

    ``kv_cache`` may instead be the views (k_slot, v_slot, keys, values) a caller took of
    :meth:`~headspace.KVCache.stacked` buffers: the new position's slots [batch, n_kv_heads, 1, d_head]
    and the filled positions [batch, n_kv_heads, length + 1, d_head]; the caller advances the length.
    """
    B = x.shape[0]
    H, Hkv, dh = layer.n_heads, layer.n_kv_heads, layer.d_head
    qkv = layer.qkv(layer.norm1(x)).view(B, H + 2 * Hkv, 1, dh)  # (B, H + 2 Hkv, 1, dh)
    qk, v_new = qkv.split_with_sizes([H + Hkv, Hkv], 1)  # (B, H + Hkv, 1, dh), (B, Hkv, 1, dh)
    if cos is not None and sin is not None and layer.rotary is not None:
        qk = rotate_fused(qk, cos, sin, layer.rotary)  # (B, H + Hkv, 1, dh), fresh
    q, k_new = qk.split_with_sizes([H, Hkv], 1)  # (B, H, 1, dh), (B, Hkv, 1, dh)
    if isinstance(kv_cache, tuple):
        k_slot, v_slot, k, v = kv_cache  # (B, Hkv, 1, dh) x 2, (B, Hkv, Sk, dh) x 2
        k_slot.copy_(k_new)
        v_slot.copy_(v_new)
    else:
        assert kv_cache is not None
        k, v = kv_cache.append_one(k_new, v_new)  # (B, Hkv, Sk, dh) x 2
    # one query after its cached keys: every key may be attended (no mask, or the filled slots)
    z = F.scaled_dot_product_attention(
        q, k, v, scale=layer.scale, enable_gqa=layer.gqa
    )  # (B, H, 1, dh), stored as (B, 1, H, dh)
    h = x + layer.o(z.reshape(B, H * dh))  # (B, d_model): heads concatenated
    m = layer.norm2(h)  # (B, d_model)
    if layer.gate is not None:
        m = layer.act_(layer.gate(m)).mul_(layer.fc_in(m))  # (B, d_mlp): act(gate) * up
    else:
        m = layer.act_(layer.fc_in(m))  # (B, d_mlp)
    return h + layer.fc_out(m)  # (B, d_model)


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


def make_norm(kind: str, d_model: int, eps: float) -> nn.Module:
    """``"layernorm"`` (``nn.LayerNorm``: weight and bias) or ``"rmsnorm"`` (:class:`RMSNorm`: weight)."""
    if kind == "layernorm":
        return nn.LayerNorm(d_model, eps=eps)
    if kind == "rmsnorm":
        return RMSNorm(d_model, eps=eps)
    raise ValueError(f"norm_kind must be one of {list(NORM_KINDS)}; got {kind!r}")


def _fire(hook: HookPoint, value: Tensor) -> Tensor:
    """``hook(value)`` while the hook point has a function, ``value`` itself (no module call) otherwise."""
    return hook(value) if hook.fns else value


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
        """
        return self.fc_out(_fire(self.hook_post, self._hidden(x)))  # (batch, seq, d_model)


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

    with ``Attn`` a :class:`~headspace.MultiHeadAttention` (``.attn``) and ``MLP`` a :class:`FeedForward`
    (``.mlp``; a :class:`GatedFeedForward` with ``mlp_kind="gated"``). Paper symbols (Vaswani et al.
    2017, section 3.1): ``LayerNorm(x + Sublayer(x))`` is the post-LN arrangement; ``d_mlp = d_ff``.

    Options beyond the classic block (a Llama block is ``norm="pre", norm_kind="rmsnorm",
    mlp_kind="gated", act="silu", bias=False`` with a ``rotary``): ``norm_kind`` picks LayerNorm or
    RMSNorm for ``ln1``/``ln2``; ``bias`` switches every bias, ``qkv_bias`` / ``out_bias`` / ``mlp_bias``
    (default: ``bias``) the q/k/v, attention-output and MLP biases apart; ``rotary`` gives the
    attention rotary positions (:class:`~headspace.positions.Rotary`; the same object may serve every
    block of a model).

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
    ) -> None:
        super().__init__()
        if norm not in NORMS:
            raise ValueError(
                f"norm must be one of {list(NORMS)} ('post' = BERT, 'pre' = GPT-2); got {norm!r}"
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
            qkv_bias=qkv_bias, out_bias=out_bias, rotary=rotary,
        )  # fmt: skip
        self.ln1 = make_norm(norm_kind, d_model, ln_eps)
        mlp_bias = bias if mlp_bias is None else mlp_bias
        if mlp_kind == "gated":
            self.mlp: FeedForward | GatedFeedForward = GatedFeedForward(
                d_model, d_mlp, act=act, bias=mlp_bias
            )
        else:
            self.mlp = FeedForward(d_model, d_mlp, act=act, bias=mlp_bias)
        self.ln2 = make_norm(norm_kind, d_model, ln_eps)
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
        if self.pre_ln:
            a = self.dropout(self.attn(self.ln1(x), **kw))  # (batch, seq, d_model)
            if self.hook_attn_out.fns:
                a = self.hook_attn_out(a)
            h = x + a  # (batch, seq, d_model)
            if self.hook_resid_mid.fns:
                h = self.hook_resid_mid(h)
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
            and self.mlp_kind == "plain"
            and self.attn.rotary is None
            and self.attn.fused
        )

    @property
    def decode_supported(self) -> bool:
        """Whether :func:`decode_layer_rows` may stand in for :meth:`forward` (pre-norm, fused self-attention
        with :class:`~headspace.MultiHeadAttention`'s own forward, no ``check_finite``)."""
        a = self.attn
        return (
            self.pre_ln
            and isinstance(a, MultiHeadAttention)  # not a head-parallel shard, which has no fused weight
            and type(a).forward is MultiHeadAttention.forward
            and a.fused
            and not a.check_finite
            and isinstance(self.mlp, (FeedForward, GatedFeedForward))
        )

    @property
    def hooks_idle(self) -> bool:
        """Whether no hook point of this block (its own, its attention's, its MLP's) has a function."""
        modules = self._modules  # direct lookups: checked in every block at every decoding step
        for name in _BLOCK_HOOKS:
            if modules[name].active:  # type: ignore[union-attr]
                return False
        if self.attn.hooks_active:
            return False
        return not any(isinstance(m, HookPoint) and m.active for m in self.mlp._modules.values())

    def decoding_layer(self, pack_rows: int | None = None) -> DecodingLayer:
        """This block's decoding step flattened: its weights, biases, norms and activation resolved once
        into plain callables and numbers (:class:`DecodingLayer`), for :func:`decode_layer_rows`.

        What :class:`headspace.decoding.DecodePlan` builds once per :meth:`headspace.Decoder.generate`
        call, so that no decoding step looks anything up through ``nn.Module`` attributes. The callables
        hold the block's parameters themselves (and transposed views of them): edits of their values
        show, replaced parameters do not (build it again). Only for a block with :attr:`decode_supported`.
        With ``pack_rows``, the float32 products run on copies of the weights packed for MKL's GEMM at
        that many rows (:mod:`headspace.kernels.prepack`): edits made after the packing do not show.
        """
        a, mlp = self.attn, self.mlp
        weights = self._products()
        packed: dict[str, Tensor | None] = {
            k: None if pack_rows is None or not packable(w) else pack_weight(w, pack_rows)
            for k, (w, _) in weights.items()
        }  # one packed copy per weight, shared by the Python and the native step

        def product(k: str) -> Callable[[Tensor], Tensor]:
            (w, b), p = weights[k], packed[k]
            return linear_fn(w, b) if p is None else packed_linear_fn(w, b, pack_rows, p)  # type: ignore[arg-type]

        return DecodingLayer(
            norm1=norm_fn(self.ln1),
            qkv=product("qkv"),
            n_heads=a.n_heads,
            n_kv_heads=a.n_kv_heads,
            d_head=a.d_head,
            gqa=a.n_kv_heads != a.n_heads,
            scale=a.scale,
            rotary=a.rotary,
            o=product("o"),
            norm2=norm_fn(self.ln2),
            gate=product("gate") if "gate" in weights else None,
            act_=activation_fn_(mlp.act),
            fc_in=product("in"),
            fc_out=product("out"),
            native=self.native_parts(pack_rows, packed),
        )

    def _products(self) -> dict[str, tuple[Tensor, Tensor | None]]:
        """The (weight, bias) of each product of a step: qkv, o, gate (gated MLPs only), in, out."""
        a, mlp = self.attn, self.mlp
        out: dict[str, tuple[Tensor, Tensor | None]] = {"qkv": (a.qkv_weight, a.qkv_bias)}
        out["o"] = (a.o_weight, a.o_bias)
        if isinstance(mlp, GatedFeedForward):
            out["gate"] = (mlp.fc_gate.weight, mlp.fc_gate.bias)
        out["in"] = (mlp.fc_in.weight, mlp.fc_in.bias)
        out["out"] = (mlp.fc_out.weight, mlp.fc_out.bias)
        return out

    def native_parts(
        self, pack_rows: int | None = None, packed: dict[str, Tensor | None] | None = None
    ) -> tuple[list[Tensor | None], list[int], list[float]] | None:
        """This block's decoding step as :func:`headspace.kernels.native.decode_rows` takes it: 19
        tensors (None where absent), 11 ints and 3 floats in the order ``kernels/decode_rows.cpp``
        lists; None where a part has no native form (:func:`native_norm`, :func:`native_linear`, an
        activation other than torch's SiLU, ReLU and GELU). ``packed`` holds each product's copy
        packed for MKL's GEMM at ``pack_rows`` rows (None: not packed). Views of the parameters:
        in-place edits of their values show (in the unpacked products), replaced parameters do not."""
        a, mlp = self.attn, self.mlp
        weights = self._products()
        packed = packed or {}
        gated = "gate" in weights
        n1, n2 = native_norm(self.ln1), native_norm(self.ln2)
        act = mlp.act
        code = _NATIVE_ACTS.get((type(act), getattr(act, "approximate", None)))
        keys = ("qkv", "o", "gate", "in", "out")
        products = {k: native_linear(*weights[k], packed.get(k)) for k in keys if k in weights}
        if n1 is None or n2 is None or n1[0] != n2[0] or n1[0] < 0 or code is None:
            return None
        if None in products.values():
            return None
        kinds = {p[3] for p in products.values()}  # type: ignore[index]
        if len(kinds) != 1:
            return None  # products of several kinds in one block: not a form the step takes
        parts = [products.get(k, (None, None, None, 0)) for k in keys]
        rotary = a.rotary
        rot_kind = 0 if rotary is None else 2 if rotary.interleaved else 1
        rot_dim = 0 if rotary is None else rotary.rotary_dim
        params = [n1[1], n1[2]]
        params += [*parts[0][:2], *parts[1][:2], n2[1], n2[2], *parts[2][:2], *parts[3][:2], *parts[4][:2]]
        params += [p[2] for p in parts]  # the packed copies (None: not packed)
        (kind,) = kinds
        rows = (pack_rows or 0) if kind == 1 else 0
        ints = [n1[0], a.n_heads, a.n_kv_heads, a.d_head, rot_kind, rot_dim, int(gated), code, rows, kind]
        qkv_weight = weights["qkv"][0]
        ints.append(float32_rows(qkv_weight) if kind == 2 and type(qkv_weight) is BF16Weight else -1)
        return params, ints, [n1[3], n2[3], float(a.scale)]

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
