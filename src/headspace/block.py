"""TransformerBlock: attention + feed-forward + residual connections + LayerNorm (pre- or post-LN).

The block that, stacked, makes BERT (post-LN) and GPT (pre-LN)::

    post-LN (BERT, the original paper):      pre-LN (GPT-2 and most models since):
        h   = LN1(x + Attn(x))                   h   = x + Attn(LN1(x))
        out = LN2(h + MLP(h))                    out = h + MLP(LN2(h))

    MLP(x) = act(x W_in + b_in) W_out + b_out     (W_in: [d_model, d_mlp], W_out: [d_mlp, d_model])

Dropout (``dropout``) is applied to the attention output and to the MLP output before each is added to
the residual stream (BERT's hidden dropout, GPT-2's resid_pdrop); ``attn_dropout`` drops pattern
entries inside the attention layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import KVCache, MultiHeadAttention, check_input_tensor
from .checks import check_positive_float, check_positive_int, check_probability
from .functional import sdpa_attention
from .hooks import HookPoint
from .kernels.workspace import Workspace
from .masks import CanonicalMask

#: Activation names accepted by :class:`FeedForward` and the models' configs.
ACTIVATIONS = ("gelu", "gelu_tanh", "relu")
#: Residual/LayerNorm arrangements accepted by :class:`TransformerBlock`.
NORMS = ("post", "pre")


def make_activation(act: str) -> nn.Module:
    """``"gelu"`` (exact, erf: BERT), ``"gelu_tanh"`` (tanh approximation: GPT-2's gelu_new), ``"relu"``."""
    if act == "gelu":
        return nn.GELU(approximate="none")
    if act == "gelu_tanh":
        return nn.GELU(approximate="tanh")
    if act == "relu":
        return nn.ReLU()
    raise ValueError(f"act must be one of {list(ACTIVATIONS)}; got {act!r}")


class FeedForward(nn.Module):
    r"""The position-wise feed-forward network ``MLP(x) = act(x W_in + b_in) W_out + b_out``.

    ``fc_in`` is an ``nn.Linear(d_model, d_mlp)`` (so ``W_in = fc_in.weight.T``), ``fc_out`` an
    ``nn.Linear(d_mlp, d_model)``. Paper symbols (Vaswani et al. 2017, eq. 2): ``W_in = W_1``,
    ``W_out = W_2``, ``d_mlp = d_ff``; the paper's act is ReLU.
    """

    def __init__(self, d_model: int, d_mlp: int, act: str = "gelu", bias: bool = True) -> None:
        super().__init__()
        for name, value in (("d_model", d_model), ("d_mlp", d_mlp)):
            check_positive_int(name, value)
        self.act_name = act
        self.act = make_activation(act)
        self.fc_in = nn.Linear(d_model, d_mlp, bias=bias)
        self.fc_out = nn.Linear(d_mlp, d_model, bias=bias)
        self.hook_pre = HookPoint()  # [batch, seq, d_mlp], before the activation
        self.hook_post = HookPoint()  # [batch, seq, d_mlp], after the activation

    def forward(self, x: Tensor) -> Tensor:
        """Apply the MLP to every position.

        Notation used for tensor shapes:
            batch, seq, d_model, d_mlp.

        Args:
            x: [batch, seq, d_model].

        Returns:
            [batch, seq, d_model].
        """
        h = self.fc_in(x)  # (batch, seq, d_mlp)
        if self.hook_pre.fns:
            h = self.hook_pre(h)
        h = self.act(h)  # (batch, seq, d_mlp)
        if self.hook_post.fns:
            h = self.hook_post(h)
        return self.fc_out(h)  # (batch, seq, d_model)

    def extra_repr(self) -> str:
        return f"act={self.act_name!r}"


class TransformerBlock(nn.Module):
    r"""One transformer block: multi-head self-attention and a feed-forward network, each wrapped in a
    residual connection and a LayerNorm.

    Formula (``norm="post"``, BERT and the original paper; ``norm="pre"``, GPT-2)::

        post:  h = LN1(x + drop(Attn(x)))          out = LN2(h + drop(MLP(h)))
        pre:   h = x + drop(Attn(LN1(x)))          out = h + drop(MLP(LN2(h)))

    with ``Attn`` a :class:`~headspace.MultiHeadAttention` (``.attn``) and ``MLP`` a :class:`FeedForward`
    (``.mlp``). Paper symbols (Vaswani et al. 2017, section 3.1): ``LayerNorm(x + Sublayer(x))`` is the
    post-LN arrangement; ``d_mlp = d_ff``.

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
    ) -> None:
        super().__init__()
        if norm not in NORMS:
            raise ValueError(
                f"norm must be one of {list(NORMS)} ('post' = BERT, 'pre' = GPT-2); got {norm!r}"
            )
        for name, p in (("dropout", dropout), ("attn_dropout", attn_dropout)):
            check_probability(name, p)
        check_positive_float("ln_eps", ln_eps)
        self.d_model = d_model
        self.norm = norm
        self.pre_ln = norm == "pre"
        self.attn = MultiHeadAttention(
            d_model, n_heads, d_head=d_head, n_kv_heads=n_kv_heads, bias=bias, dropout=attn_dropout
        )
        self.ln1 = nn.LayerNorm(d_model, eps=ln_eps)
        self.mlp = FeedForward(d_model, d_mlp, act=act, bias=bias)
        self.ln2 = nn.LayerNorm(d_model, eps=ln_eps)
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

        Returns:
            [batch, seq, d_model].
        """
        check_input_tensor("x", x, self.d_model, "d_model", self.ln1.weight)  # before any LayerNorm
        if self.hook_resid_pre.fns:
            x = self.hook_resid_pre(x)
        kw = {
            "key_padding": key_padding,
            "attn_mask": attn_mask,
            "is_causal": is_causal,
            "kv_cache": kv_cache,
        }
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
        return f"norm={self.norm!r}"

    def infer(self, x: Tensor, attn_mask: Tensor | None = None, workspace: Workspace | None = None) -> Tensor:
        """Inference-only forward with fewer passes over memory; same result as :meth:`forward`.

        The residual add is fused into the output GEMMs (``x + z W_O^T`` and ``h + a W_out^T`` by
        ``addmm``), the activation runs in place, the QKV, residual and MLP matrices are written into
        ``workspace`` (memory the caller reuses across blocks and batches, instead of fresh memory
        the kernel must fault in page by page), and no hook point fires. ``x`` is never written to
        and the result never lies in ``workspace``. Used by :meth:`headspace.Encoder.infer`; call it
        only without autograd, in eval mode and with no hook active (the caller checks).

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
        B, S, d = x.shape
        a, mlp = self.attn, self.mlp
        H, dh = a.n_heads, a.d_head
        ws = Workspace() if workspace is None else workspace
        N = B * S
        x2 = x.reshape(N, d)  # (B S, d_model)
        src = F.layer_norm(x2, (d,), self.ln1.weight, self.ln1.bias, self.ln1.eps) if self.pre_ln else x2
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
