"""The greedy token of the unembedding, found by an int8 screen and certified by float32 logits.

Greedy decoding needs only ``argmax_i logits_i`` of ``logits = h @ W_U + b_U`` (``W`` = the tied token
embedding [vocab, d_model], read as ``h @ W^T``). Reading all of ``W`` in float32 at each step is the
largest memory read of a decoding step (Whisper base: 51865 x 512 floats, 106 MB). The screen reads an
int8 copy of it instead (a quarter of the bytes) and keeps the argmax exact:

    W_i ~ s_i q_i       s_i = max_k |W_ik| / 127,  q_i = round(W_i / s_i)   (int8, per row, made once)
    h   ~ t p + u r     t = max_k |h_k| / 127,     p = round(h / t)         (int8, per step)
                        u = max_k |h - t p|_k / 127,  r = round((h - t p) / u)   (the remainder, int8)
    a_i = s_i (t (p . q_i) + u (r . q_i)) + b_i     (exact int32 products of one [2, d] x [d, vocab] GEMM)
    |logit_i - a_i| <= e_i = u/2 ||W_i||_1 + d_i ||t p + u r||_1 + slack    (Hoelder)

with ``d_i = max_k |W_ik - s_i q_ik|`` (at most ``s_i / 2``). The remainder pass keeps the bound tight
when a few channels of ``h`` are far larger than the rest (Whisper's final stream has one near 200).

With ``E = max_i e_i`` (the rows' largest ``||W_i||_1`` and ``d_i``), every row whose upper bound
``a_i + E`` reaches the best lower bound ``max_j a_j - E`` may be the argmax;
only those rows' float32 logits are computed (``F.linear`` on the rows gathered), and their argmax
(the lowest index among ties, as ``torch.argmax``) is the token. A row left out has a logit provably below
another row's, so the token equals ``argmax`` of the full float32 logits, unless two logits lie within
float32 rounding of each other (the rows' products may sum in another order than the full product's).
``slack`` covers the float32 rounding of both products (``1e-4 (max|h| ||W_i||_1 + max_j |a_j|)``, far above).
When the candidates exceed an eighth of the vocabulary, the full product is taken instead.

The int8 product runs on fbgemm (torch's quantized ``linear_dynamic``) where it is there and sums the
worst case exactly, else on ``torch._int_mm`` where it does (:func:`headspace.kernels.cpu.
int8_products_exact`; CPUs without VNNI saturate pairs in int16), else the screen is off (the full
product), as it is when the ``int8`` fallback is forced (``HEADSPACE_FORCE_FALLBACK=int8`` or ``all``).
fbgemm quantizes its input itself (per tensor, ``scale = (max - min) / 255``): the input
is ``[p, -127, 128]`` against two zero columns of the weight, so that ``scale`` is exactly 1 and ``p`` passes
unchanged; a probe at build time checks that the products are the exact integer ones, else ``_int_mm``.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ...kernels.cpu import forced, int8_products_exact

#: the share of the vocabulary above which the screen gives way to the full float32 product
MAX_CANDIDATE_SHARE = 1 / 8
#: relative slack added to each bound (module docstring): float32 rounding is ~1e-7 relative
SLACK = 1e-4


class ScreenedArgmax:
    """``argmax(h @ W^T + b)`` per row of h [batch, d_model], by the int8 screen (module docstring).

    ``weight`` [vocab, d_model] and ``bias`` [vocab] (or None) are read, never copied in float; the int8
    copy ``q`` [vocab, d_model], the row scales ``s`` [vocab] and the rows' L1 norms are made once.
    :meth:`fits` says whether this screen still matches the weights (an in-place edit changes them).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        w = weight.detach()
        self.weight, self.bias = w, None if bias is None else bias.detach()
        self.key = self._key(weight, bias)
        tiny = torch.finfo(w.dtype).tiny
        a = w.abs()  # (vocab, d_model)
        self.row_scale = a.amax(1).clamp_min(tiny) / 127  # (vocab,)
        self.row_l1 = a.sum(1)  # (vocab,)
        ratio = torch.div(w, self.row_scale[:, None], out=a)  # (vocab, d_model): |.| <= 127, a reused
        qf = ratio.round()  # (vocab, d_model)
        # d_i = max_k |W_ik - s_i q_ik| = s_i max_k |W_ik / s_i - q_ik| (to float32 rounding: in the slack)
        self.row_err = ratio.sub_(qf).abs_().amax(1) * self.row_scale  # (vocab,)
        q = qf.to(torch.int8)  # (vocab, d_model)
        del a, ratio, qf
        self.q_t = q.T  # (d_model, vocab): a transposed view, as the int8 product reads it fastest
        self.packed = _fbgemm_pack(q, self.row_scale)
        self.max_l1, self.max_err = self.row_l1.max(), self.row_err.max()  # (), ()

    @staticmethod
    def _key(weight: Tensor, bias: Tensor | None) -> tuple[int, ...]:
        b = () if bias is None else (bias.data_ptr(), bias._version)
        return (weight.data_ptr(), weight._version, *b)

    def fits(self, weight: Tensor, bias: Tensor | None) -> bool:
        """Whether the screen was made from these weights, unchanged since."""
        return self.key == self._key(weight, bias)

    def candidates(self, h: Tensor) -> Tensor:
        """bool [batch, vocab]: the rows that may hold the argmax of ``h`` [batch, d_model]."""
        tiny = torch.finfo(h.dtype).tiny
        t = h.abs().amax(1, keepdim=True).clamp_min(tiny) / 127  # (batch, 1)
        p = torch.round(h / t)  # (batch, d_model): integers in [-127, 127]
        rest = h - t * p  # (batch, d_model)
        u = rest.abs().amax(1, keepdim=True).clamp_min(tiny) / 127  # (batch, 1)
        r = torch.round(rest / u)  # (batch, d_model): integers in [-127, 127]
        B = h.shape[0]
        dot = self.scaled_dots(torch.cat((p, r)))  # (2 batch, vocab)
        approx = t * dot[:B] + u * dot[B:]  # (batch, vocab)
        if self.bias is not None:
            approx = approx + self.bias
        h_l1 = (t * p + u * r).abs().sum(1, keepdim=True)  # (batch, 1)
        h_max = h.abs().amax(1, keepdim=True)  # (batch, 1)
        # one bound E >= e_i for every row (the rows' largest ||W_i||_1 and d_i): fewer passes over vocab
        err = (u / 2 + SLACK * h_max) * self.max_l1 + h_l1 * self.max_err  # (batch, 1)
        err = err + SLACK * approx.abs().amax(1, keepdim=True)  # (batch, 1)
        return approx >= approx.amax(1, keepdim=True) - 2 * err  # a_i + E >= max_j a_j - E

    def scaled_dots(self, ints: Tensor) -> Tensor:
        """``s_i (x . q_i)`` [rows, vocab] of float rows ``ints`` [rows, d_model] holding integers in
        [-127, 127]: the integer products are exact (int32), then scaled once in float."""
        if self.packed is not None:
            return _fbgemm_dots(ints, self.packed)
        dot = torch._int_mm(ints.to(torch.int8), self.q_t)  # (rows, vocab): exact int32
        return dot.to(ints.dtype) * self.row_scale  # (rows, vocab)

    def __call__(self, h: Tensor) -> Tensor:
        """The greedy tokens [batch] of ``h`` [batch, d_model] (module docstring)."""
        keep = self.candidates(h)  # (batch, vocab)
        out = torch.empty(h.shape[0], dtype=torch.long, device=h.device)
        limit = MAX_CANDIDATE_SHARE * self.weight.shape[0]
        for b in range(h.shape[0]):
            rows = keep[b].nonzero()[:, 0]  # (n,): ascending
            if rows.numel() > limit:
                out[b] = F.linear(h[b], self.weight, self.bias).argmax()
                continue
            bias = None if self.bias is None else self.bias[rows]
            out[b] = rows[F.linear(h[b], self.weight[rows], bias).argmax()]
        return out


def _fbgemm_dots(ints: Tensor, packed: Any) -> Tensor:
    """fbgemm's ``s_i (x . q_i)`` [rows, vocab] of integer rows ``ints`` [rows, d_model] (docstring above)."""
    edge = ints.new_tensor([-127.0, 128.0]).expand(ints.shape[0], 2)  # (rows, 2): scale 1, zero point 127
    x = torch.cat((ints, edge), 1)  # (rows, d_model + 2)
    return torch.ops.quantized.linear_dynamic(x, packed, False)  # (rows, vocab)


def _fbgemm_pack(q: Tensor, scale: Tensor) -> Any | None:
    """fbgemm's packed weight of ``q`` [vocab, d_model] (int8) with row scales ``scale`` [vocab] and two zero
    columns, or None where fbgemm is missing or a probe's products are not the exact integer ones."""
    V = q.shape[0]
    if not _fbgemm_exact():
        return None
    try:
        with warnings.catch_warnings():  # torch's quantized tensors warn that they are deprecated
            warnings.simplefilter("ignore")
            qz = torch.cat((q, q.new_zeros(V, 2)), 1)  # (vocab, d_model + 2)
            zeros = torch.zeros(V, dtype=torch.long)
            qw = torch._make_per_channel_quantized_tensor(qz, scale.double(), zeros, 0)
            packed = torch.ops.quantized.linear_prepack(qw, None)
            probe = torch.randint(-127, 128, (2, q.shape[1]), generator=torch.Generator().manual_seed(0))
            got = _fbgemm_dots(probe.float(), packed)  # (2, vocab)
    except (RuntimeError, AttributeError, NotImplementedError):
        return None
    rows = min(V, 4096)  # the probe's rows: fbgemm treats every row alike
    want = (probe.float() @ q[:rows].float().T) * scale[:rows]  # (2, rows): integer sums < 2**24: exact
    return packed if torch.equal(got[:, :rows], want) else None


@functools.lru_cache(maxsize=1)
def _fbgemm_exact() -> bool:
    """Whether fbgemm's product sums the screen's worst case exactly, asked of the kernel once per process.

    On a CPU without VNNI, u8 x s8 kernels sum neighbouring pairs of products in saturating int16
    (``vpmaddubsw``); the screen's input ``p + 127`` reaches 254 against weights of 127 (2 x 254 x 127 >
    32767), so there the random probe of :func:`_fbgemm_pack` could pass while a real step saturates."""
    k, n = 64, 32
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qz = torch.cat(
                (torch.full((n, k), 127, dtype=torch.int8), torch.zeros(n, 2, dtype=torch.int8)), 1
            )
            qw = torch._make_per_channel_quantized_tensor(qz, torch.ones(n, dtype=torch.double),
                                                          torch.zeros(n, dtype=torch.long), 0)  # fmt: skip
            packed = torch.ops.quantized.linear_prepack(qw, None)
            for rows in (1, 64):
                for sign in (1.0, -1.0):
                    got = _fbgemm_dots(torch.full((rows, k), 127.0 * sign), packed)  # (rows, n)
                    if not bool((got == sign * 127 * 127 * k).all()):
                        return False
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return True


def screen_usable(weight: Tensor) -> bool:
    """Whether the screen runs here: a float32 CPU weight, the ``int8`` fallback not forced
    (``HEADSPACE_FORCE_FALLBACK``, :mod:`headspace.kernels.cpu`: then the full product), and an int8
    product that sums the worst case exactly (fbgemm's, else ``torch._int_mm``'s)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or forced("int8"):
        return False
    return _fbgemm_exact() or int8_products_exact()[1]


__all__ = ["MAX_CANDIDATE_SHARE", "ScreenedArgmax", "screen_usable"]
