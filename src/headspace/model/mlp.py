"""The position-wise MLPs of a block: :class:`FeedForward` (plain) and :class:`GatedFeedForward` (SwiGLU,
GeGLU), and what a trace keeps of their hook points (:class:`DeferredMLP`).

    plain MLP:  MLP(x) = act(x W_in + b_in) W_out + b_out    (W_in: [d_model, d_mlp], W_out: [d_mlp, d_model])
    gated MLP:  MLP(x) = (act(x W_gate + b_gate) * (x W_in + b_in)) W_out + b_out

Built from an :class:`~headspace.nn.spec.MLPSpec` by :class:`~headspace.block.TransformerBlock`; the old
path ``headspace.model.block.FeedForward`` (and the other names here) keeps working.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.checks import check_positive_int
from ..kernels.bf16 import is_bf16
from ..kernels.int8 import is_int8
from ..nn.hooks import HookPoint, Memo, Recomputed, note_source, resolve, source_of

#: Activation names accepted by :class:`FeedForward`, :class:`GatedFeedForward` and the models' configs.
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")


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


def _fire(hook: HookPoint, value: Tensor) -> Tensor:
    """``hook(value)`` while the hook point has a function, ``value`` itself (no module call) otherwise."""
    return hook(value) if hook.fns else value


def _defers(points: tuple[HookPoint, ...]) -> bool:
    """Whether some point of ``points`` fires and every one that fires only records a Deferred."""
    live = [p for p in points if p.active]
    return bool(live) and all(p.defers for p in live)


def _copy(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().clone()


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
        if any(p.fns for p in self._points()):
            if self._may_defer(x):
                return self._forward_deferred(x)
        elif type(self)._hidden in _OWN_HIDDEN and type(self.act) in _IN_PLACE:
            return self.fc_out(self._hidden_in_place(x))  # (batch, seq, d_model)
        return self.fc_out(_fire(self.hook_post, self._hidden(x)))  # (batch, seq, d_model)

    def _hidden_in_place(self, x: Tensor) -> Tensor:
        """:meth:`_hidden` while no hook point watches: the activation (and the gate's product) written
        over the fresh linear outputs where no autograd graph needs them; the same values, bit for bit.
        [batch, seq, d_model] -> [batch, seq, d_mlp]."""
        gated = "fc_gate" in self._modules
        pre = (self.fc_gate if gated else self.fc_in)(x)  # (batch, seq, d_mlp)
        if (
            pre.requires_grad
            or type(self.fc_in) is not nn.Linear
            or (gated and type(self.fc_gate) is not nn.Linear)
        ):
            hidden = self.act(pre)  # (batch, seq, d_mlp)
            return hidden * self.fc_in(x) if gated else hidden
        hidden = _IN_PLACE[type(self.act)](pre, self.act)  # (batch, seq, d_mlp): pre, activated
        return hidden.mul_(self.fc_in(x)) if gated else hidden

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


def _gelu_(t: Tensor, act: nn.Module) -> Tensor:
    return torch.ops.aten.gelu_(t, approximate=act.approximate)


#: The activation modules with an in-place twin (same values): what :meth:`_FeedForwardLayers.forward`
#: writes over the fresh linear output while nothing watches it.
_IN_PLACE = {
    nn.GELU: _gelu_,
    nn.SiLU: lambda t, act: F.silu(t, inplace=True),
    nn.ReLU: lambda t, act: t.relu_(),
}


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


#: The hidden-unit functions :meth:`_FeedForwardLayers._hidden_in_place` stands in for.
_OWN_HIDDEN = (FeedForward._hidden, GatedFeedForward._hidden)
