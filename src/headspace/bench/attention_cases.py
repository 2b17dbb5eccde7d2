"""The attention benchmark's cases: the layers compared (headspace's, torch's, nanoGPT-style, textbook),
the GEMM floor, each built as a :class:`Case` of one (seq, mode, dtype), and the float64 reference their
outputs are compared with.

The module docstring of :mod:`.attention` defines every case and the floor; :mod:`.attention` runs and
reports them and re-exports every name here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention.layer import MultiHeadAttention

CASES: tuple[str, ...] = (
    "headspace",
    "headspace_idle_hooks",
    "headspace_weights",
    "torch_mha",
    "torch_mha_weights",
    "nanogpt",
    "textbook",
    "gemm_floor",
)
MODES: tuple[str, ...] = ("forward", "backward")
#: The dtypes the benchmark runs in (``dtype=``): every case's weights, input and the floor's matrices.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _dtype_name(dtype: str | torch.dtype) -> str:
    """``"float32"`` / ``"bfloat16"`` from a name or a torch.dtype; anything else is refused, listing them."""
    for name, value in DTYPES.items():
        if dtype == name or dtype is value:
            return name
    raise ValueError(f"dtype must be one of {list(DTYPES)} (or the torch dtypes); got {dtype!r}")


LABELS: dict[str, str] = {
    "headspace": "headspace (fast path)",
    "headspace_idle_hooks": "headspace, idle hook points",
    "headspace_weights": "headspace need_weights=True",
    "torch_mha": "torch MHA",
    "torch_mha_weights": "torch MHA need_weights=True",
    "nanogpt": "nanoGPT-style fused QKV + SDPA",
    "textbook": "textbook per-head loop",
    "gemm_floor": "GEMM floor",
}

#: One-line definition of the floor, written into the JSON (the module docstring has the full list).
GEMM_FLOOR = (
    "plain torch.matmul(out=...) on preallocated tensors of the run's dtype; forward: X@W_qkv [BS,D]x[D,3D], "
    "Q@K^T [BH,S,dh]x[BH,dh,S], P@V [BH,S,S]x[BH,S,dh], Z@W_O [BS,D]x[D,D]; forward+backward adds "
    "dY@W_O^T, Z^T@dY, dZ@V^T, P^T@dZ, dS@K, dS^T@Q, dQKV@W_qkv^T, X^T@dQKV; no softmax, bias, mask, "
    "copy or allocation"
)


# ---------------------------------------------------------------------------------------------------
# The comparison modules
# ---------------------------------------------------------------------------------------------------
class NanoGPTAttention(nn.Module):
    """nanoGPT-style self-attention, one fused QKV Linear: ``y = SDPA(split(x W_attn + b)) W_proj + b``."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        """Notation used for tensor shapes: B batch, T seq, C d_model, nh n_heads, hs d_head.

        x [B, T, C] -> [B, T, C].
        """
        B, T, C = x.shape
        nh, hs = self.n_heads, C // self.n_heads
        q, k, v = self.c_attn(x).split(C, dim=2)  # (B, T, C) x 3
        q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.c_proj(y)


class TextbookAttention(nn.Module):
    """The per-head textbook layer: ``head_h = softmax(x W_Q^h (x W_K^h)^T / sqrt(dh)) x W_V^h``,
    ``y = concat_h(head_h) W_O``, with one ``nn.Linear`` per head and projection and a loop over heads.
    """

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        d_head = d_model // n_heads
        self.d_head = d_head
        self.q = nn.ModuleList(nn.Linear(d_model, d_head) for _ in range(n_heads))
        self.k = nn.ModuleList(nn.Linear(d_model, d_head) for _ in range(n_heads))
        self.v = nn.ModuleList(nn.Linear(d_model, d_head) for _ in range(n_heads))
        self.o = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        """Notation used for tensor shapes: batch, seq, d_model, d_head.

        x [batch, seq, d_model] -> [batch, seq, d_model].
        """
        heads = []
        for wq, wk, wv in zip(self.q, self.k, self.v):
            q, k, v = wq(x), wk(x), wv(x)  # (batch, seq, d_head) x 3
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_head)  # (batch, seq, seq)
            heads.append(torch.softmax(scores, dim=-1) @ v)  # (batch, seq, d_head)
        return self.o(torch.cat(heads, dim=-1))  # (batch, seq, d_model)


def copy_weights(src: MultiHeadAttention, dst: nn.Module) -> None:
    """Give a comparison module exactly the weights of ``src`` (so all cases compute one function)."""
    D, H, dh = src.d_model, src.n_heads, src.d_head
    with torch.no_grad():
        if isinstance(dst, nn.MultiheadAttention):
            dst.in_proj_weight.copy_(src.qkv_weight)  # both [3D, D]: q rows, k rows, v rows
            dst.in_proj_bias.copy_(src.qkv_bias)
            dst.out_proj.weight.copy_(src.o_weight)
            dst.out_proj.bias.copy_(src.o_bias)
        elif isinstance(dst, NanoGPTAttention):
            dst.c_attn.weight.copy_(src.qkv_weight)
            dst.c_attn.bias.copy_(src.qkv_bias)
            dst.c_proj.weight.copy_(src.o_weight)
            dst.c_proj.bias.copy_(src.o_bias)
        elif isinstance(dst, TextbookAttention):
            w = src.qkv_weight.view(3, H, dh, D)  # (q|k|v, head, d_head, d_model): [out, in] per head
            b = src.qkv_bias.view(3, H, dh)  # (q|k|v, head, d_head)
            for h in range(H):
                for i, lin in enumerate((dst.q[h], dst.k[h], dst.v[h])):
                    lin.weight.copy_(w[i, h])
                    lin.bias.copy_(b[i, h])
            dst.o.weight.copy_(src.o_weight)
            dst.o.bias.copy_(src.o_bias)
        else:
            raise TypeError(f"copy_weights: unsupported module {type(dst).__name__}")


# ---------------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------------
@dataclass
class Case:
    """One benchmark case: ``step()`` runs one timed unit of work; ``output()`` returns the layer output.

    ``module`` is the layer under test (None for the GEMM floor).
    """

    name: str
    step: Callable[[], None]
    output: Callable[[], Tensor]
    module: nn.Module | None = None


def _gemm_floor(
    batch: int, seq: int, d_model: int, n_heads: int, mode: str, gen: torch.Generator,
    dtype: torch.dtype = torch.float32,
) -> Case:  # fmt: skip
    """The bare matmuls of the layer on preallocated tensors (the definition is in the module docstring)."""
    B, S, D, H = batch, seq, d_model, n_heads
    dh = D // H

    def r(*shape: int) -> Tensor:
        return (torch.randn(*shape, generator=gen) * 0.1).to(dtype)

    x, w_qkv, w_o = r(B * S, D), r(D, 3 * D), r(D, D)
    q, kt, v = r(B * H, S, dh), r(B * H, dh, S), r(B * H, S, dh)
    qkv, scores, z, zo, y = r(B * S, 3 * D), r(B * H, S, S), r(B * H, S, dh), r(B * S, D), r(B * S, D)
    backward = mode == "backward"
    if backward:
        dy, dz, dw_o = r(B * S, D), r(B * S, D), r(D, D)  # output projection
        dzh, dp, dv, dq, dk = (
            r(B * H, S, dh),
            r(B * H, S, S),
            r(B * H, S, dh),
            r(B * H, S, dh),
            r(B * H, S, dh),
        )
        dqkv, dx, dw_qkv = r(B * S, 3 * D), r(B * S, D), r(D, 3 * D)  # input projection
        k, vt = (
            kt.transpose(1, 2),
            v.transpose(1, 2),
        )  # (B H, S, dh), (B H, dh, S): strided views, as in autograd

    def step() -> None:
        torch.matmul(x, w_qkv, out=qkv)
        torch.matmul(q, kt, out=scores)
        torch.matmul(scores, v, out=z)
        torch.matmul(zo, w_o, out=y)
        if backward:
            torch.matmul(dy, w_o.t(), out=dz)
            torch.matmul(zo.t(), dy, out=dw_o)
            torch.matmul(dzh, vt, out=dp)
            torch.matmul(scores.transpose(1, 2), dzh, out=dv)
            torch.matmul(dp, k, out=dq)
            torch.matmul(dp.transpose(1, 2), q, out=dk)
            torch.matmul(dqkv, w_qkv.t(), out=dx)
            torch.matmul(x.t(), dqkv, out=dw_qkv)

    return Case("gemm_floor", step, lambda: y.view(B, S, D))


def build_case(
    name: str, *, seq: int, batch: int, d_model: int, n_heads: int, mode: str, seed: int = 0,
    dtype: str | torch.dtype = "float32",
) -> Case:  # fmt: skip
    """Build one case with its own input (the same values for every case of one seed), in ``dtype``."""
    dt = DTYPES[_dtype_name(dtype)]
    if name not in CASES:
        raise ValueError(f"unknown benchmark case {name!r}; known cases: {list(CASES)}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}; got {mode!r}")
    gen = torch.Generator().manual_seed(seed)
    if name == "gemm_floor":
        return _gemm_floor(batch, seq, d_model, n_heads, mode, gen, dt)
    torch.manual_seed(seed)
    layer = MultiHeadAttention(d_model, n_heads)
    if name == "headspace_idle_hooks":
        removers = [hp.add(lambda value, hook: None) for hp in layer._hook_points]
        for remove in removers:
            remove()
    model: nn.Module = layer
    if name.startswith("torch_mha"):
        model = nn.MultiheadAttention(d_model, n_heads, batch_first=True)
    elif name == "nanogpt":
        model = NanoGPTAttention(d_model, n_heads)
    elif name == "textbook":
        model = TextbookAttention(d_model, n_heads)
    if model is not layer:
        copy_weights(layer, model)
    if dt != torch.float32:
        layer.to(dt)
        model.to(dt)
    x = torch.randn(batch, seq, d_model, generator=gen).to(dt)
    grad_y = torch.randn(batch, seq, d_model, generator=gen).to(dt)
    backward = mode == "backward"
    model.train(backward)
    params = list(model.parameters())
    if backward:
        x.requires_grad_(True)

    def call() -> tuple[Tensor, Tensor | None]:
        """(out, pattern or None); a need_weights caller holds the pattern until the step ends."""
        if name == "headspace_weights":
            return layer(x, need_weights=True)
        if name == "torch_mha":
            return model(x, x, x, need_weights=False)
        if name == "torch_mha_weights":
            return model(x, x, x, need_weights=True, average_attn_weights=False)
        return model(x), None

    def run() -> None:
        out, _pattern = call()
        if backward:
            out.backward(grad_y)

    if backward:

        def step() -> None:
            x.grad = None
            for p in params:
                p.grad = None
            run()
    else:

        def step() -> None:
            with torch.no_grad():
                run()

    def output() -> Tensor:
        with torch.no_grad():
            return call()[0]

    return Case(name, step, output, model)


def float64_reference(*, seq: int, batch: int, d_model: int, n_heads: int, seed: int = 0,
                      dtype: str | torch.dtype = "float32") -> Tensor:  # fmt: skip
    """The layer output of :func:`build_case`'s weights and input (rounded to ``dtype``, as every case
    sees them) computed in float64: what each case's output is compared with (``max_abs_error``)."""
    dt = DTYPES[_dtype_name(dtype)]
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    layer = MultiHeadAttention(d_model, n_heads).to(dt).double().eval()
    x = torch.randn(batch, seq, d_model, generator=gen).to(dt).double()
    with torch.no_grad():
        return layer(x)
