"""Gemma 3n's text decoder (transformers' ``Gemma3nForCausalLM``): AltUp streams, LAuReL, per-layer
inputs, activation sparsity, and the attention of :mod:`headspace.model.gemma_extras`.

The residual is ``K = altup_num_inputs`` streams ``X`` [K, batch, seq, d_model] (``a`` =
``altup_active_idx`` the one the layers compute on). Embedding: ``X_0 = e = E_tok[t] sqrt(d_model)``,
``X_k = rescale(e W_k^up, e)`` for k >= 1, with ``rescale(y, x) = y * rms(x) / max(rms(y), sqrt(1e-5))``.
Layer ``l`` (``N`` RMSNorms whose weights scale directly; ``m(x) = tanh((N_R(x) / d_model) W_R)`` [K]
the AltUp router)::

    P   = X + coefs_P(m(X_a)) . X                                 predict: [K, K] mix per token
    x   = P_a;  n = N_1(x)
    lau = n + N_L(n W_left W_right)                               LAuReL
    h   = (x + N_ao(Attn(n)) + lau) / sqrt(2)
    o   = h + N_mo(MLP(N_2(h)))                                   (the block's sandwich norms)
    C   = P + (o - P_a) (1 + m(o) W_C)                            correct: one factor per stream
    C_k += N_l((gelu_tanh(C_a s_C W_g[l]) * P_l) W_p[l])          k >= 1 (per-layer input; s_C with
                                                                  ``altup_correct_scale``)
    logits = cap tanh(N_f(mean(X_0, rescale(X_k W_k^down, X_0))) E_tok^T / cap)

with the per-layer inputs ``P_l`` as Gemma 4's (:mod:`~headspace.model.gemma4_model`; token ids beyond
``vocab_size_per_layer_input`` read row 0). Activation sparsity (``activation_sparsity_pattern[l] =
s > 0``): the MLP's gate becomes ``relu(g - mean(g) - std(g) Phi^-1(s))`` before its activation
(:class:`SparseGatedFeedForward`). Hook points: the blocks' ``hook_attn_in`` (``n``), ``hook_attn_out``
(``N_ao(Attn(n))``), ``hook_resid_mid`` (``h``), ``hook_mlp_in``, ``hook_mlp_out``, ``hook_resid_post``
(``o``), the attention's own; ``altup.L.hook_predict`` / ``hook_correct`` [K, batch, seq, d_model]
(``P``, ``C`` before the per-layer input), ``laurel.L.hook_out`` (``lau - n``), ``ple.L.hook_out``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.hooks import HookPoint
from ..nn.kv_cache import KVCache
from ..nn.norms import RMSNorm
from . import gemma3n_step, gemma4_step
from .config import ModelConfig
from .gemma4_model import Gemma4Decoder
from .mlp import GatedFeedForward, _fire


class SparseGatedFeedForward(GatedFeedForward):
    """A gated MLP whose gate keeps only what lies above a Gaussian quantile of its own row (Gemma 3n's
    activation sparsity ``sparsity`` in (0, 1)): ``g <- relu(g - (mean(g) + std(g) Phi^-1(sparsity)))``
    (std without Bessel's correction), then ``act(g) * u``."""

    def __init__(self, d_model: int, d_mlp: int, act: str, sparsity: float) -> None:
        super().__init__(d_model, d_mlp, act=act, bias=False)
        self.sparsity = float(sparsity)
        self._std_multiplier: tuple[float, Tensor] | None = None  # (sparsity, Phi^-1 of it), on first use

    def _hidden(self, x: Tensor) -> Tensor:
        g = self.fc_gate(x)  # (batch, seq, d_mlp)
        memo = self._std_multiplier
        if memo is None or memo[0] != self.sparsity:  # Phi^-1(sparsity) as transformers computes it, once
            with torch.inference_mode(False):  # (a plain tensor: usable with autograd later)
                memo = (
                    self.sparsity,
                    torch.distributions.normal.Normal(0, 1).icdf(torch.tensor(self.sparsity)),
                )
            self._std_multiplier = memo
        std_multiplier = memo[1]
        cutoff = g.mean(-1, keepdim=True) + g.std(-1, keepdim=True, unbiased=False) * std_multiplier.to(
            g.dtype
        )
        g = _fire(self.hook_pre, F.relu(g - cutoff))  # (batch, seq, d_mlp)
        u = _fire(self.hook_pre_linear, self.fc_in(x))  # (batch, seq, d_mlp)
        return self.act(g) * u  # (batch, seq, d_mlp)


class AltUp(nn.Module):
    """One layer's AltUp predict / correct over ``K`` streams (module docstring). Parameters as
    transformers names them: ``router`` [K, d_model], ``router_norm``, ``prediction_coefs`` [K K, K],
    ``correction_coefs`` [K, K], ``correct_output_scale`` [d_model]."""

    def __init__(self, d_model: int, k: int, active: int, eps: float) -> None:
        super().__init__()
        self.k, self.active = k, active
        self.router = nn.Linear(d_model, k, bias=False)
        self.router_norm = RMSNorm(d_model, eps)
        self.prediction_coefs = nn.Linear(k, k * k, bias=False)
        self.correction_coefs = nn.Linear(k, k, bias=False)
        self.correct_output_scale = nn.Parameter(torch.zeros(d_model))
        self.hook_predict = HookPoint()  # [K, batch, seq, d_model]
        self.hook_correct = HookPoint()  # [K, batch, seq, d_model]

    def modalities(self, x: Tensor) -> Tensor:
        """``tanh((N_R(x) / d_model) W_R)`` [batch, seq, K] of x [batch, seq, d_model]."""
        scale = torch.tensor(x.shape[-1] ** -1.0)
        return torch.tanh(self.router(self.router_norm(x) * scale).float()).type_as(x)

    def predict(self, X: Tensor) -> Tensor:
        """X [K, B, S, d] -> the predictions [K, B, S, d]."""
        m = self.modalities(X[self.active])  # (B, S, K)
        coefs = (
            self.prediction_coefs(m).reshape(*m.shape[:-1], self.k, self.k).permute(0, 1, 3, 2)
        )  # (B,S,K,K)
        out = torch.matmul(X.permute(1, 2, 3, 0), coefs).permute(3, 0, 1, 2) + X  # (K, B, S, d)
        return _fire(self.hook_predict, out.contiguous())

    def correct(self, P: Tensor, o: Tensor) -> Tensor:
        """Predictions P [K, B, S, d] corrected by the layer's output o [B, S, d] -> [K, B, S, d]."""
        coefs = (self.correction_coefs(self.modalities(o)) + 1.0).permute(2, 0, 1).unsqueeze(-1)  # (K,B,S,1)
        innovation = (o - P[self.active]).repeat(self.k, 1, 1, 1)  # (K, B, S, d)
        return _fire(self.hook_correct, (innovation * coefs + P).contiguous())


class Laurel(nn.Module):
    """LAuReL: ``n + N_L(n W_left W_right)`` of n [batch, seq, d_model]; ``hook_out`` the added term."""

    def __init__(self, d_model: int, rank: int, eps: float) -> None:
        super().__init__()
        self.left = nn.Linear(d_model, rank, bias=False)
        self.right = nn.Linear(rank, d_model, bias=False)
        self.norm = RMSNorm(d_model, eps)
        self.hook_out = HookPoint()  # [batch, seq, d_model]

    def forward(self, n: Tensor) -> Tensor:
        return n + _fire(self.hook_out, self.norm(self.right(self.left(n))))


def _rescale(y: Tensor, target: Tensor) -> Tensor:
    """y [..., d] scaled to ``target``'s root mean square per token (``target`` [..., 1])."""
    return y * target / torch.sqrt(torch.mean(y**2, dim=-1, keepdim=True).clamp(min=1e-5))


class Gemma3nDecoder(Gemma4Decoder):
    """Gemma 3n's text decoder (module docstring). ``config.extra["gemma3n"]``: as Gemma 4's layer
    description (``layers``, ``rope``, ``ple``, ``ple_vocab``; no ``moe``) plus ``altup`` (``k``,
    ``active``, ``correct_scale``), ``laurel_rank`` and ``sparsity`` (one per layer)."""

    EXTRA_KEY = "gemma3n"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        c = self.config
        g = c.extra["gemma3n"]
        d, eps, a = c.d_model, c.ln_eps, g["altup"]
        for block, s in zip(self.blocks, g["sparsity"], strict=True):
            if s > 0:
                block.mlp = SparseGatedFeedForward(d, block.spec.mlp.d_mlp, c.act, s)
        self.altup = nn.ModuleList(AltUp(d, a["k"], a["active"], eps) for _ in range(c.n_layers))
        self.laurel = nn.ModuleList(Laurel(d, g["laurel_rank"], eps) for _ in range(c.n_layers))
        self.altup_up = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(a["k"] - 1))
        self.altup_down = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(a["k"] - 1))
        self._init_weights()

    def _layer(self, i: int, X: Tensor, P: Tensor, kw: dict) -> Tensor:
        """Layer ``i`` on the streams X [K, B, S, d] with its per-layer input P [B, S, p]."""
        block, alt = self.blocks[i], self.altup[i]
        Xp = alt.predict(X)  # (K, B, S, d)
        x = Xp[alt.active]  # (B, S, d)
        n = _fire(block.hook_attn_in, block.ln1(x))
        attn = _fire(block.hook_attn_out, block.ln_attn_out(block.attn(n, **kw)))  # (B, S, d)
        h = _fire(block.hook_resid_mid, ((x + attn) + self.laurel[i](n)) / math.sqrt(2))
        m = _fire(block.hook_mlp_out, block.ln_mlp_out(block.mlp(_fire(block.hook_mlp_in, block.ln2(h)))))
        C = alt.correct(Xp, _fire(block.hook_resid_post, h + m))  # (K, B, S, d)
        first = C[alt.active].clone()  # (B, S, d)
        if self.config.extra["gemma3n"]["altup"]["correct_scale"]:
            first = (first.type_as(alt.correct_output_scale) * alt.correct_output_scale).type_as(first)
        C[1:] += self.ple[i].term(first, P)
        return C

    def hidden_states(
        self,
        tokens: Tensor,
        key_padding: Tensor | None = None,
        kv_caches: list[KVCache] | None = None,
        *,
        positions: Tensor | None = None,
    ) -> Tensor:
        """The final residual after the norm [batch, seq, d_model] (module docstring)."""
        e, pos, _ = self._embedded(tokens, kv_caches, positions)  # (B, S, d)
        P = self.per_layer_inputs(tokens, e)  # (B, S, L, p)
        target = torch.mean(e**2, dim=-1, keepdim=True) ** 0.5  # (B, S, 1)
        X = torch.stack([e] + [_rescale(up(e), target) for up in self.altup_up])  # (K, B, S, d)
        causal = not (kv_caches is not None and tokens.shape[1] == 1)
        # a one-token cached step with nothing watching: the layers without module calls (bit for bit)
        lean = (
            gemma4_step.Shared(pos)
            if gemma4_step.takes(self, tokens, key_padding, kv_caches, positions)
            else None
        )
        self._kv_store.open()
        try:
            for i in range(len(self.blocks)):
                cache = None if kv_caches is None else kv_caches[i]
                if lean is not None:
                    X = gemma3n_step.layer(self, i, X, P[:, :, i], cache, lean)  # (K, B, 1, d)
                    continue
                kw = {"key_padding": key_padding, "is_causal": causal, "kv_cache": cache, "positions": pos}
                X = self._layer(i, X, P[:, :, i], kw)
        finally:
            self._kv_store.close()
        target = torch.mean(X[0] ** 2, dim=-1, keepdim=True) ** 0.5  # (B, S, 1)
        outs = [X[0]] + [_rescale(down(X[k + 1]), target) for k, down in enumerate(self.altup_down)]
        return self.final_norm(torch.stack(outs).mean(dim=0))  # (B, S, d)
