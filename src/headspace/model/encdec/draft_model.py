"""A draft model for exact speculative decoding: the decoder itself with int8 weights (:class:`DraftModel`).

Where the n-gram drafts of :mod:`headspace.model.encdec.speculative` find nothing (speech that does not
repeat itself), the drafts come from a cheaper copy of the same decoder: every decoder linear (the fused
self-attention QKV and output, the cross-attention query and output, the MLP's two layers) and the
unembedding held as int8 per output channel (symmetric: ``s_w[o] = max_i |W[o, i]| / 127``,
``W_q = round(W / s_w)``), the norms and embeddings shared with the float32 model (read, not copied), its
own self-attention caches, and the cross keys and values read as bfloat16 copies (made once per input)
where oneDNN runs bfloat16 here and the ``bf16`` fallback is not forced (else the float32 ones). It
proposes ``k`` tokens greedily (the argmax of its own logits); the float32 model verifies them with
:func:`~headspace.model.encdec.speculative.fast_verify` exactly as it verifies n-gram drafts, so the tokens
kept are the float32 model's greedy tokens whatever the draft proposes: a wrong draft costs time, never a
token.

The draft's caches hold a prefix of the tokens it was last given (:attr:`DraftModel.fed`); each
:meth:`DraftModel.propose` keeps the longest prefix still equal to the greedy tokens (rolling back the
rest), feeds the tokens after it in one forward, then one token per draft.

The products run on fbgemm (torch's quantized ``linear_dynamic``, the input quantised per call by fbgemm,
as the screen of :mod:`headspace.model.encdec.screen` does); where fbgemm is missing or its int8 product
does not sum exactly (a CPU without VNNI), or the ``int8`` fallback is forced, there is no draft model
(n-gram drafts only). Off with ``draft_model=False`` or ``HEADSPACE_FORCE_FALLBACK=draft_model``; taken
only where :func:`draft_model_usable` holds.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from ...kernels.cpu import forced, use_onednn_bf16
from ...nn.kv_cache import KVCache
from .fast_step import _residual
from .screen import _fbgemm_exact
from .stacks import DecoderStack


def draft_model_usable(decoder: DecoderStack, draft_model: bool | None) -> bool:
    """Whether a :class:`DraftModel` is made: ``draft_model`` is not False, neither the ``draft_model`` nor
    the ``int8`` fallback is forced, fbgemm's int8 product sums exactly here (asked of the kernel:
    :func:`~headspace.model.encdec.screen._fbgemm_exact`), the decoder's weights are float32 on the CPU and
    every MLP is a plain (ungated) feed-forward (the decoder's other conditions are
    :func:`fast_step_usable`'s, checked by the caller). Raises ``ValueError`` unless ``draft_model`` is
    None or a bool."""
    if draft_model is not None and not isinstance(draft_model, bool):
        raise ValueError(f"draft_model must be None, True or False; got {draft_model!r}")
    if draft_model is False or forced("draft_model") or forced("int8") or not _fbgemm_exact():
        return False
    for block in decoder.blocks:
        mlp = block.mlp
        if "fc_gate" in mlp._modules or not hasattr(mlp, "fc_in") or not hasattr(mlp, "fc_out"):
            return False
        w = block.attn.qkv_weight
        if w.dtype != torch.float32 or w.device.type != "cpu":
            return False
    return True


class _Packed:
    """fbgemm's packed int8 linear ``x W^T + b`` (``W`` per output channel, symmetric; the input
    quantised per call by fbgemm itself): x [..., in] -> [..., out], float32."""

    def __init__(self, w: Tensor, b: Tensor | None) -> None:
        w = w.detach()
        scale = w.abs().amax(1).clamp_min(torch.finfo(w.dtype).tiny) / 127  # (out,)
        q = torch.round(w / scale[:, None]).to(torch.int8)  # (out, in)
        zeros = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # torch's quantized tensors warn that they are deprecated
            warnings.simplefilter("ignore")
            qw = torch._make_per_channel_quantized_tensor(q, scale.double(), zeros, 0)
            self.packed = torch.ops.quantized.linear_prepack(qw, None if b is None else b.detach())

    def __call__(self, x: Tensor) -> Tensor:
        return torch.ops.quantized.linear_dynamic(x, self.packed, False)


class _Layer:
    """One decoder block's int8 weights (and the float32 biases, shared)."""

    def __init__(self, block: torch.nn.Module) -> None:
        a, c, mlp = block.attn, block.cross_attn, block.mlp
        H, dh = c.n_heads, c.d_head
        self.qkv, self.o = _Packed(a.qkv_weight, a.qkv_bias), _Packed(a.o_weight, a.o_bias)
        cb = None if c.qkv_bias is None else c.qkv_bias[: H * dh]
        self.cq, self.co = _Packed(c.qkv_weight[: H * dh], cb), _Packed(c.o_weight, c.o_bias)
        self.fc_in = _Packed(mlp.fc_in.weight, mlp.fc_in.bias)
        self.fc_out = _Packed(mlp.fc_out.weight, mlp.fc_out.bias)


class DraftModel:
    """int8 copy of ``decoder`` (module docstring) with the unembedding ``unembed`` [vocab, d_model] (+
    ``bias`` [vocab] or None; ``scale``: the model's output scale, multiplied into the final stream).

    ``fits(decoder)`` says whether it was made from these weights, unchanged since (an in-place edit of a
    weight bumps its version)."""

    def __init__(self, decoder: DecoderStack, unembed: Tensor, bias: Tensor | None, scale: float) -> None:
        self.key = self._key(decoder, unembed)
        self.layers = [_Layer(b) for b in decoder.blocks]
        self.unembed, self.scale = _Packed(unembed, bias), scale
        self.caches: list[KVCache] = []
        self.fed: list[int] = []

    @staticmethod
    def _key(decoder: DecoderStack, unembed: Tensor) -> tuple[int, ...]:
        ws = [p for p in decoder.parameters()] + [unembed]
        return tuple(x for p in ws for x in (p.data_ptr(), p._version))

    def fits(self, decoder: DecoderStack, unembed: Tensor) -> bool:
        """Whether this draft was made from these weights, unchanged since."""
        return self.key == self._key(decoder, unembed)

    def start(self, decoder: DecoderStack, cross: list[tuple[Tensor, Tensor]], capacity: int) -> None:
        """Empty caches of ``capacity`` positions for a new input whose cross keys/values are ``cross``
        (each [1, H, Sk, dh]; the draft reads bfloat16 copies of them where :func:`use_onednn_bf16`)."""
        if use_onednn_bf16():
            cross = [(k.to(torch.bfloat16), v.to(torch.bfloat16)) for k, v in cross]
        self.decoder, self.cross = decoder, cross
        self.caches = [b.attn.make_kv_cache(1, capacity) for b in decoder.blocks]
        self.fed = []

    def stop(self) -> None:
        """Let go of the input's cross keys/values and the caches (kept on the model between calls)."""
        self.cross, self.caches, self.fed = [], [], []

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """``k`` greedy tokens of the draft after ``tokens`` (batch 1; [] when ``k`` < 1)."""
        if k < 1:
            return []
        keep = 0
        limit = min(len(self.fed), len(tokens) - 1)  # at least the newest token is fed
        while keep < limit and self.fed[keep] == tokens[keep]:
            keep += 1
        for cache in self.caches:
            cache.length = keep
        self.fed = list(tokens[:keep])
        feed = tokens[keep:]
        out: list[int] = []
        while True:
            h = self._forward(torch.tensor([feed]))  # (1, T, d_model)
            self.fed += feed
            out.append(self._argmax(h[0, -1]))
            if len(out) == k:
                return out
            feed = out[-1:]

    def _argmax(self, h: Tensor) -> int:
        """The draft's greedy token of one final-stream row ``h`` [d_model]."""
        if self.scale != 1.0:
            h = h * self.scale
        return int(self.unembed(h[None]).argmax())

    def _forward(self, ids: Tensor) -> Tensor:
        """The draft's final stream [1, T, d_model] of ``T`` new tokens ``ids`` [1, T] after its cache."""
        dec = self.decoder
        x = dec.embed(ids, self.caches[0].length)  # (1, T, d_model)
        for block, w, cache, (k, v) in zip(dec.blocks, self.layers, self.caches, self.cross, strict=True):
            pre = block.pre
            h = block.ln1(x) if pre else x
            x = _residual(pre, block.ln1, x, _self_attention(block.attn, w, h, cache))
            h = block.ln_cross(x) if pre else x
            x = _residual(pre, block.ln_cross, x, _cross_attention(block.cross_attn, w, h, k, v))
            h = block.ln2(x) if pre else x
            mlp = w.fc_out(block.mlp.act(w.fc_in(h)))
            x = _residual(pre, block.ln2, x, mlp)  # (1, T, d_model)
        return x if dec.final_ln is None else dec.final_ln(x)


def _self_attention(a: torch.nn.Module, w: _Layer, h: Tensor, cache: KVCache) -> Tensor:
    """Causal self-attention of ``T`` new positions ``h`` [1, T, d_model] on ``cache`` by the int8
    weights -> [1, T, d_model]; the new keys and values are appended."""
    B, T, _ = h.shape
    H, dh = a.n_heads, a.d_head
    qkv = w.qkv(h)  # (B, T, 3 H dh)
    q, k, v = qkv.view(B, T, 3, H, dh).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, T, dh) x 3
    before = cache.length
    keys, values = cache.append(k, v)  # (B, H, before + T, dh) x 2
    if T == 1:
        z = F.scaled_dot_product_attention(q, keys, values, scale=a.scale)  # (B, H, 1, dh)
    else:
        i = torch.arange(T)[:, None]  # (T, 1)
        j = torch.arange(before + T)[None, :]  # (1, before + T)
        z = F.scaled_dot_product_attention(q, keys, values, attn_mask=j <= before + i, scale=a.scale)
    z = z.transpose(1, 2).reshape(B, T, H * dh)  # (B, T, H dh)
    return w.o(z)  # (B, T, d_model)


def _cross_attention(c: torch.nn.Module, w: _Layer, h: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Cross-attention of ``h`` [1, T, d_model] on the float32 model's cross keys/values ``k``, ``v``
    [1, H, Sk, dh] (float32 or bfloat16: the query is cast to their type) by the int8 query and output
    weights -> [1, T, d_model]."""
    B, T, _ = h.shape
    H, dh = c.n_heads, c.d_head
    q = w.cq(h).view(B, T, H, dh).transpose(1, 2).to(k.dtype)  # (B, H, T, dh)
    z = F.scaled_dot_product_attention(q, k, v, scale=c.scale).float()  # (B, H, T, dh)
    z = z.transpose(1, 2).reshape(B, T, H * dh)  # (B, T, H dh)
    return w.co(z)  # (B, T, d_model)


__all__ = ["DraftModel", "draft_model_usable"]
