"""The mixture-of-experts MLP (:class:`MixtureOfExperts`): Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE.

For each position ``x`` [d_model], with ``E`` experts of width ``d_mlp`` and ``k`` chosen per token::

    r     = x W_R                                   router logits [E]      (W_R = router.weight.T)
    p     = softmax(r)                              (float32)
    w, i  = topk(p, k)                              torch.topk: ties go to the lower expert index
    w     = w / sum(w)                              only with norm_topk (Mixtral always; others by config)
    y_e   = (act(x W_gate[e]) * (x W_in[e])) W_out[e]       expert e's output [d_model]
    MoE(x) = sum_j w_j y_{i_j}  +  sigmoid(x w_sg) Shared(x)   (the shared term: Qwen2-MoE only)

Llama 4 (``routing="topk_sigmoid"``, ``shared_gate=False``)::

    v, i  = topk(r, k);   w = sigmoid(v)            each chosen logit's sigmoid (float32)
    MoE(x) = sum_j y_{i_j}(w_j x)  +  Shared(x)     the weight scales the expert's input; no shared gate

exactly as transformers' ``*TopKRouter`` / ``*Experts`` compute it (the routing weights of unchosen
experts are 0, so the sum runs over the chosen ones only). gpt-oss (``routing="topk_softmax"``,
``router_bias``, expert biases, ``swiglu_limit`` / ``swiglu_alpha``)::

    r     = x W_R + b_R
    v, i  = topk(r, k);   w = softmax(v)            the softmax over the k chosen logits only
    g     = min(x W_gate[e] + b_gate[e], limit);   u = clamp(x W_in[e] + b_in[e], -limit, limit)
    y_e   = ((u + 1) * g * sigmoid(alpha g)) W_out[e] + b_out[e]

Hook points (``batch``, ``seq``; ``E`` = ``n_experts``):

* ``hook_router_logits`` [batch, seq, E]: ``r`` (editing it changes the routing);
* ``hook_top_k`` [batch, seq, k] (int64): the chosen experts ``i``, best first;
* ``hook_routing`` [batch, seq, E]: the dense routing weights (``w`` at the chosen experts, 0
  elsewhere); zeroing column ``e`` ablates expert ``e`` (:meth:`MixtureOfExperts.ablate_experts`);
* ``hook_expert_out`` [batch, seq, E, d_model]: each expert's weighted contribution ``w_e y_e`` (zeros
  for the experts a token did not take), so that the sum over the expert axis is the routed output:
  the direct logit attribution of an expert is its slice through the unembedding. Dense over all ``E``
  experts (not ``k``) so that one index means one expert everywhere; computed only while hooked;
* ``hook_shared_out`` [batch, seq, d_model]: the gated shared expert's output (with ``d_shared``).

DeepSeek's routings (``"sigmoid_group_topk"``, ``"softmax_group_topk"``, ``routed_scale``, the
``score_bias`` parameter [E] and an ungated shared expert, ``shared_gate=False``) are
:mod:`headspace.model.moe_routing`'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.checks import check_positive_int
from ..nn.hooks import HookPoint
from ..nn.spec import MLPSpec
from .mlp import _IN_PLACE, GatedFeedForward, _fire, make_activation
from .moe_kernels import routed_sum
from .moe_routing import GROUP_ROUTINGS, group_topk


class MixtureOfExperts(nn.Module):
    """A routed mixture of ``n_experts`` gated experts (module docstring for the formula and hooks).

    Parameters: ``router`` (``nn.Linear(d_model, n_experts)``, no bias), ``experts_gate`` and
    ``experts_in`` [n_experts, d_mlp, d_model] (each expert's ``gate_proj`` / ``up_proj``, [out, in]),
    ``experts_out`` [n_experts, d_model, d_mlp] (``down_proj``); with ``d_shared``: ``shared`` (a
    :class:`~headspace.model.mlp.GatedFeedForward` of width ``d_shared``) and ``shared_gate``
    (``nn.Linear(d_model, 1)``, no bias; None with ``shared_gate=False``: DeepSeek). ``ablated``: expert
    indices whose routing weight is set to 0 (the others keep theirs: no renormalisation), empty by
    default. DeepSeek: ``groups=(n_group, topk_group)`` for the group-limited routings, ``routed_scale``
    (the k weights' factor) and ``score_bias`` (the parameter ``score_bias`` [E], V3's correction bias).
    """

    def __init__(
        self,
        d_model: int,
        d_mlp: int,
        n_experts: int,
        top_k: int,
        *,
        act: str = "silu",
        norm_topk: bool = False,
        d_shared: int | None = None,
        routing: str = "softmax_topk",
        router_bias: bool = False,
        bias: bool = False,
        swiglu: tuple[float, float] | None = None,
        groups: tuple[int, int] | None = None,
        routed_scale: float = 1.0,
        score_bias: bool = False,
        shared_gate: bool = True,
    ) -> None:
        super().__init__()
        for name, value in (("d_model", d_model), ("d_mlp", d_mlp), ("n_experts", n_experts)):
            check_positive_int(name, value)
        check_positive_int("top_k", top_k)
        if top_k > n_experts:
            raise ValueError(f"top_k must be at most n_experts={n_experts}; got {top_k}")
        known = ["softmax_topk", "topk_softmax", "topk_sigmoid", *GROUP_ROUTINGS]
        if routing not in known:
            raise ValueError(f"routing must be one of {known}; got {routing!r}")
        if routing in GROUP_ROUTINGS and groups is None:
            raise ValueError(f"routing={routing!r} needs groups=(n_group, topk_group); got None")
        self.n_experts, self.top_k, self.norm_topk, self.act_name = n_experts, top_k, norm_topk, act
        self.routing, self.swiglu, self.groups, self.routed_scale = routing, swiglu, groups, routed_scale
        #: V3's ``e_score_correction_bias`` [E] (moves the choice, not the weights), or None
        self.register_parameter("score_bias", nn.Parameter(torch.zeros(n_experts)) if score_bias else None)
        self.act = make_activation(act)
        self.router = nn.Linear(d_model, n_experts, bias=router_bias)
        self.experts_gate = nn.Parameter(torch.empty(n_experts, d_mlp, d_model))
        self.experts_in = nn.Parameter(torch.empty(n_experts, d_mlp, d_model))
        self.experts_out = nn.Parameter(torch.empty(n_experts, d_model, d_mlp))
        for w in (self.experts_gate, self.experts_in, self.experts_out):
            nn.init.normal_(w, std=0.02)
        shapes = {"experts_gate_bias": (n_experts, d_mlp), "experts_in_bias": (n_experts, d_mlp),
                  "experts_out_bias": (n_experts, d_model)}  # fmt: skip
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape)) if bias else None)
        self.shared: GatedFeedForward | None = None
        self.shared_gate: nn.Linear | None = None
        if d_shared is not None:
            self.shared = GatedFeedForward(d_model, d_shared, act=act, bias=False)
            self.shared_gate = nn.Linear(d_model, 1, bias=False) if shared_gate else None
        self.ablated: tuple[int, ...] = ()
        self.hook_router_logits = HookPoint()  # [batch, seq, n_experts]
        self.hook_top_k = HookPoint()  # [batch, seq, top_k] int64
        self.hook_routing = HookPoint()  # [batch, seq, n_experts]
        self.hook_expert_out = HookPoint()  # [batch, seq, n_experts, d_model]
        self.hook_shared_out = HookPoint()  # [batch, seq, d_model]

    def ablate_experts(self, experts: list[int] | tuple[int, ...]) -> None:
        """Set the routing weight of each expert of ``experts`` to 0 from now on (``[]``: none): the
        token's other chosen experts keep their weights. Raises ``ValueError`` for an index outside
        ``[0, n_experts)``."""
        for e in experts:
            if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < self.n_experts:
                raise ValueError(f"experts must be ints in [0, {self.n_experts}); got {e!r}")
        self.ablated = tuple(sorted(set(experts)))

    def route(self, x: Tensor) -> Tensor:
        """[batch, seq, d_model] -> the dense routing weights [batch, seq, n_experts] (float32; 0 for the
        experts not chosen), firing the router's hook points."""
        logits = F.linear(x, self.router.weight, self.router.bias)  # (batch, seq, E)
        logits = _fire(self.hook_router_logits, logits)
        if self.routing in GROUP_ROUTINGS:
            return self._route_grouped(logits)
        if self.routing in ("topk_softmax", "topk_sigmoid"):  # the k largest logits, then their weights
            probs = logits
            top_i = _fire(self.hook_top_k, torch.topk(logits, self.top_k, dim=-1).indices)  # (batch, seq, k)
            top_v = logits.gather(-1, top_i)  # (batch, seq, k)
            if self.routing == "topk_softmax":  # gpt-oss: their softmax
                top_w = F.softmax(top_v, dim=-1, dtype=logits.dtype)  # (batch, seq, k)
            else:  # Llama 4: each one's sigmoid (float32, as transformers)
                top_w = torch.sigmoid(top_v.float()).to(logits.dtype)  # (batch, seq, k)
            dense = torch.zeros_like(probs).scatter(-1, top_i, top_w)  # (batch, seq, E)
            if self.ablated:
                dense[..., list(self.ablated)] = 0.0
            return _fire(self.hook_routing, dense)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)  # (batch, seq, E)
        top_i = _fire(self.hook_top_k, torch.topk(probs, self.top_k, dim=-1).indices)  # (batch, seq, k)
        top_w = probs.gather(-1, top_i)  # (batch, seq, k): the top values (or the edited choices')
        if self.norm_topk:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        if self.routed_scale != 1.0:  # DeepSeek V2's greedy routing
            top_w = top_w * self.routed_scale
        dense = torch.zeros_like(probs).scatter(-1, top_i, top_w)  # (batch, seq, E)
        if self.ablated:
            dense[..., list(self.ablated)] = 0.0
        return _fire(self.hook_routing, dense.to(logits.dtype))

    def _route_grouped(self, logits: Tensor) -> Tensor:
        """:meth:`route` for DeepSeek's group-limited routings (:mod:`~headspace.model.moe_routing`):
        logits [batch, seq, E] -> the dense routing weights [batch, seq, E]."""
        assert self.groups is not None
        batch, seq, e = logits.shape
        flat = logits.reshape(batch * seq, e).float()  # (N, E)
        bias = None if self.score_bias is None else self.score_bias.float()
        top_i, top_w = group_topk(
            flat, self.routing, self.top_k, *self.groups, score_bias=bias, norm_topk=self.norm_topk
        )  # (N, k) x 2
        top_i = _fire(self.hook_top_k, top_i.reshape(batch, seq, self.top_k))  # (batch, seq, k)
        top_w = top_w.reshape(batch, seq, self.top_k) * self.routed_scale  # (batch, seq, k)
        dense = torch.zeros(batch, seq, e, dtype=top_w.dtype, device=logits.device)  # (batch, seq, E)
        dense = dense.scatter(-1, top_i, top_w)
        if self.ablated:
            dense[..., list(self.ablated)] = 0.0
        return _fire(self.hook_routing, dense.to(logits.dtype))

    def expert(self, e: int, x: Tensor) -> Tensor:
        """Expert ``e``'s unweighted output ``(act(x W_gate[e]) * (x W_in[e])) W_out[e]`` (with biases
        and the clamped SwiGLU where set: module docstring): [..., d_model] -> [..., d_model]."""
        b_gate, b_in, b_out = (None if b is None else b[e] for b in self._expert_biases())
        gate = F.linear(x, self.experts_gate[e], b_gate)  # (..., d_mlp)
        up = F.linear(x, self.experts_in[e], b_in)  # (..., d_mlp)
        in_place = _IN_PLACE.get(type(self.act))
        if self.swiglu is None and in_place is not None and not (gate.requires_grad or up.requires_grad):
            hidden = in_place(gate, self.act).mul_(up)  # (..., d_mlp): the same values, in gate's memory
        elif self.swiglu is None:
            hidden = self.act(gate) * up  # (..., d_mlp)
        else:
            limit, alpha = self.swiglu
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
            hidden = (up + 1) * (gate * torch.sigmoid(gate * alpha))  # (..., d_mlp)
        return F.linear(hidden, self.experts_out[e], b_out)  # (..., d_model)

    def _expert_biases(self) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """(gate, in, out) biases of the experts ([E, d_mlp], [E, d_mlp], [E, d_model]) or Nones."""
        return self.experts_gate_bias, self.experts_in_bias, self.experts_out_bias

    def forward(self, x: Tensor) -> Tensor:
        """[batch, seq, d_model] -> [batch, seq, d_model]: the routed experts' weighted sum, plus the
        gated shared expert. Each expert runs on the tokens with a nonzero routing weight only, added
        in expert order (as transformers' ``index_add_``)."""
        batch, seq, d = x.shape
        weights = self.route(x).reshape(batch * seq, self.n_experts)  # (N, E)
        flat = x.reshape(batch * seq, d)  # (N, d_model)
        if self.hook_expert_out.active:  # each expert's weighted output, dense over the experts
            per_expert = flat.new_zeros(batch * seq, self.n_experts, d)  # (N, E, d_model)
            for e in torch.nonzero(weights.ne(0).any(dim=0)).flatten().tolist():
                rows = torch.nonzero(weights[:, e]).flatten()  # (n_e,)
                if self.routing == "topk_sigmoid":  # Llama 4: the weight scales the expert's input
                    per_expert[rows, e] = self.expert(e, flat[rows] * weights[rows, e, None])
                else:
                    per_expert[rows, e] = self.expert(e, flat[rows]) * weights[rows, e, None]
            per_expert = self.hook_expert_out(per_expert.reshape(batch, seq, self.n_experts, d))
            out = per_expert.sum(dim=2).reshape(batch * seq, d)  # (N, d_model)
        else:  # the same sum without the dense outputs, tokens sorted by expert once (moe_kernels)
            own = type(self).expert is MixtureOfExperts.expert and "expert" not in self.__dict__
            out = routed_sum(  # (fresh: this class's expert returns a new tensor each call)
                flat, weights, self.expert, scale_input=self.routing == "topk_sigmoid", fresh=own
            )
        if self.shared is not None:
            shared = self.shared(flat)  # (N, d_model)
            if self.shared_gate is not None:  # Qwen2-MoE's gate (DeepSeek's shared experts have none)
                shared = torch.sigmoid(self.shared_gate(flat)) * shared  # (N, d_model)
            shared = _fire(self.hook_shared_out, shared.reshape(batch, seq, d)).reshape(batch * seq, d)
            # (the routed sum is this call's own tensor: added to in place where no graph needs it)
            out = out + shared if out.requires_grad or shared.requires_grad else out.add_(shared)
        return out.reshape(batch, seq, d)  # (batch, seq, d_model)

    def extra_repr(self) -> str:
        shared = "" if self.shared is None else f", d_shared={self.shared.fc_in.out_features}"
        return (
            f"n_experts={self.n_experts}, top_k={self.top_k}, norm_topk={self.norm_topk}, "
            f"act={self.act_name!r}{shared}"
        )


def moe_of(d_model: int, spec: MLPSpec) -> MixtureOfExperts:
    """The :class:`MixtureOfExperts` an ``MLPSpec`` of kind ``"moe"`` describes, on ``d_model``."""
    if spec.kind != "moe" or spec.n_experts is None or spec.top_k is None:
        raise ValueError(f"moe_of needs an MLPSpec of kind 'moe'; got kind={spec.kind!r}")
    swiglu = None
    if spec.swiglu_limit is not None and spec.swiglu_alpha is not None:
        swiglu = (float(spec.swiglu_limit), float(spec.swiglu_alpha))
    return MixtureOfExperts(
        d_model, spec.d_mlp, spec.n_experts, spec.top_k,
        act=spec.act, norm_topk=spec.norm_topk, d_shared=spec.d_shared, routing=spec.routing,
        router_bias=spec.router_bias, bias=spec.bias, swiglu=swiglu,
        groups=None if spec.n_group is None else (spec.n_group, spec.topk_group or spec.n_group),
        routed_scale=spec.routed_scale, score_bias=spec.score_bias, shared_gate=spec.shared_gate,
    )  # fmt: skip
