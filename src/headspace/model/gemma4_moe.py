"""Gemma 4's mixture of experts (``enable_moe_block``): a dense gated MLP and routed experts side by
side, each between its own norms, as transformers' ``Gemma4TextDecoderLayer`` computes them.

On the residual ``h`` [d_model] entering the MLP sublayer (``N`` RMSNorms whose weights scale directly,
``n(x) = x / sqrt(mean(x^2) + eps)`` without a weight)::

    dense   = N_post1(Dense(N_pre(h)))                         (Dense: the layer's gated MLP, ``shared``)
    r       = (n(h) * s_R / sqrt(d_model)) W_R                 router logits [E] (router.weight, router_scale)
    p       = softmax(r);   w, i = topk(p, k);   w = w / sum(w);   w_j <- w_j * c[i_j]   (per_expert_scale)
    experts = N_post2(sum_j w_j y_{i_j}(N_pre2(h)))            y_e: expert e's gated MLP (gelu_tanh)
    MLP(h)  = dense + experts             (the block adds N_mo(MLP(h)) to h: its ``ln_mlp_out``)

The block's own ``ln2`` is the identity (its ``hook_mlp_in`` is ``h``): ``N_pre`` is ``pre_norm`` here,
since the router and ``N_pre2`` read ``h`` itself. Hook points as :class:`MixtureOfExperts`'s:
``hook_router_logits`` (``r``), ``hook_top_k``, ``hook_routing`` (the dense weights ``w`` after the
per-expert scale; zero a column to ablate an expert), ``hook_expert_out`` [batch, seq, E, d_model]
(each expert's weighted output before ``N_post2``: ``N_post2`` is nonlinear, so the experts' slices sum
to the routed output only before it), ``hook_shared_out`` (``dense``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.norms import RMSNorm
from .mlp import _fire
from .moe import MixtureOfExperts


class Gemma4MoE(MixtureOfExperts):
    """The dense MLP and the routed experts of a Gemma 4 MoE layer (module docstring). Parameters
    beyond :class:`MixtureOfExperts`'s (``shared`` is the dense MLP, ``shared_gate`` absent):
    ``pre_norm``, ``post_norm_shared``, ``pre_norm_experts``, ``post_norm_experts`` (RMSNorms over
    d_model), ``router_scale`` [d_model], ``per_expert_scale`` [n_experts]."""

    def __init__(
        self, d_model: int, d_dense: int, d_expert: int, n_experts: int, top_k: int, *, act: str, eps: float
    ) -> None:
        super().__init__(d_model, d_expert, n_experts, top_k, act=act, norm_topk=True, d_shared=d_dense)
        self.shared_gate = None
        self.eps = eps
        self.pre_norm = RMSNorm(d_model, eps)
        self.post_norm_shared = RMSNorm(d_model, eps)
        self.pre_norm_experts = RMSNorm(d_model, eps)
        self.post_norm_experts = RMSNorm(d_model, eps)
        self.router_scale = nn.Parameter(torch.ones(d_model))
        self.per_expert_scale = nn.Parameter(torch.ones(n_experts))

    def route(self, x: Tensor) -> Tensor:
        """h [batch, seq, d_model] -> the dense routing weights [batch, seq, n_experts] (module
        docstring), firing the router's hook points."""
        xf = x.float()
        normed = (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)).to(x.dtype)
        scaled = normed * self.router_scale * (x.shape[-1] ** -0.5)  # (batch, seq, d_model)
        logits = _fire(self.hook_router_logits, F.linear(scaled, self.router.weight))  # (batch, seq, E)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)  # (batch, seq, E)
        top_i = _fire(self.hook_top_k, torch.topk(probs, self.top_k, dim=-1).indices)  # (batch, seq, k)
        top_w = probs.gather(-1, top_i)  # (batch, seq, k)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        top_w = top_w * self.per_expert_scale[top_i]  # (batch, seq, k)
        dense = torch.zeros_like(probs).scatter(-1, top_i, top_w)  # (batch, seq, E)
        if self.ablated:
            dense[..., list(self.ablated)] = 0.0
        return _fire(self.hook_routing, dense.to(logits.dtype))

    def forward(self, x: Tensor) -> Tensor:
        """h [batch, seq, d_model] -> dense + experts [batch, seq, d_model] (module docstring); each
        expert runs on the tokens that chose it, added in expert order (transformers' ``index_add_``)."""
        batch, seq, d = x.shape
        weights = self.route(x).reshape(batch * seq, self.n_experts)  # (N, E)
        flat = self.pre_norm_experts(x).reshape(batch * seq, d)  # (N, d_model)
        hooked = self.hook_expert_out.active
        per_expert = flat.new_zeros(batch * seq, self.n_experts, d) if hooked else None  # (N, E, d_model)
        out = torch.zeros_like(flat)  # (N, d_model)
        for e in torch.nonzero(weights.ne(0).any(dim=0)).flatten().tolist():
            rows = torch.nonzero(weights[:, e]).flatten()  # (n_e,)
            y = self.expert(e, flat[rows]) * weights[rows, e, None]  # (n_e, d_model)
            if per_expert is not None:
                per_expert[rows, e] = y
            else:
                out.index_add_(0, rows, y)
        if per_expert is not None:
            per_expert = self.hook_expert_out(per_expert.reshape(batch, seq, self.n_experts, d))
            out = per_expert.sum(dim=2).reshape(batch * seq, d)  # (N, d_model)
        experts = self.post_norm_experts(out.reshape(batch, seq, d))  # (batch, seq, d_model)
        assert self.shared is not None
        dense = _fire(self.hook_shared_out, self.post_norm_shared(self.shared(self.pre_norm(x))))
        return dense + experts  # (batch, seq, d_model)
