"""headspace.compat.MultiheadAttention against torch.nn.MultiheadAttention itself.

Sizes are distinct primes so that a swapped axis fails: batch N=3, seq_q L=5, seq_k S=7, num_heads H=2,
head_dim 11 (embed_dim 22), kdim 13, vdim 17.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from headspace import MultiHeadAttention
from headspace.attention.compat import MultiheadAttention

N, L, S, H, DH, KDIM, VDIM = 3, 5, 7, 2, 11, 13, 17
E = H * DH

CTOR_GRID = [
    dict(kdim=kd, vdim=vd, bias=bias, add_bias_kv=bkv, add_zero_attn=za)
    for (kd, vd), bias, bkv, za in itertools.product(
        [(None, None), (KDIM, VDIM)], [True, False], [False, True], [False, True]
    )
]


def ctor_id(kw: dict) -> str:
    return "-".join(
        [
            "kvdims" if kw["kdim"] else "samedims",
            "bias" if kw["bias"] else "nobias",
            *(["biaskv"] if kw["add_bias_kv"] else []),
            *(["zeroattn"] if kw["add_zero_attn"] else []),
        ]
    )


def make_pair(seed: int = 0, **kw) -> tuple[nn.MultiheadAttention, MultiheadAttention]:
    """torch's module and ours, built under the same seed (so, by init parity, with the same weights)."""
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(E, H, **kw)
    torch.manual_seed(seed)
    ours = MultiheadAttention(E, H, **kw)
    for name, p in ref.state_dict().items():
        assert torch.equal(p, ours.state_dict()[name]), name
    return ref, ours


def random_params(ref: nn.Module, ours: nn.Module, seed: int = 1) -> None:
    """Non-trivial values everywhere (torch zero-initialises biases), loaded into both."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / E**0.5)
    ours.load_state_dict(ref.state_dict())


# ---------------------------------------------------------------------------------------------- masks
MASK_KINDS = [
    "none",
    "attn_bool_2d",
    "attn_float_2d",
    "attn_bool_3d",
    "attn_float_3d",
    "kpm_bool",
    "kpm_float",
    "both_bool",
    "both_float",
    "mixed",
]


def bool_blocked(*shape: int, g: torch.Generator) -> Tensor:
    """torch convention (True = not allowed); key 0 always allowed, so no row is fully masked."""
    m = torch.rand(shape, generator=g) < 0.4
    m[..., 0] = False
    return m


def float_additive(*shape: int, g: torch.Generator) -> Tensor:
    m = torch.randn(shape, generator=g)
    m = m.masked_fill(torch.rand(shape, generator=g) < 0.3, float("-inf"))
    m[..., 0] = torch.randn(m[..., 0].shape, generator=g)
    return m


def make_masks(kind: str, batched: bool, n: int, l: int, s: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(7)
    heads_dim = (n * H,) if batched else (H,)
    kpm_shape = (n, s) if batched else (s,)
    out: dict[str, Tensor] = {}
    if kind in ("attn_bool_2d", "both_bool"):
        out["attn_mask"] = bool_blocked(l, s, g=g)
    if kind in ("attn_float_2d", "both_float", "mixed"):
        out["attn_mask"] = float_additive(l, s, g=g)
    if kind == "attn_bool_3d":
        out["attn_mask"] = bool_blocked(*heads_dim, l, s, g=g)
    if kind == "attn_float_3d":
        out["attn_mask"] = float_additive(*heads_dim, l, s, g=g)
    if kind in ("kpm_bool", "both_bool", "mixed"):
        out["key_padding_mask"] = bool_blocked(*kpm_shape, g=g)
    if kind in ("kpm_float", "both_float"):
        out["key_padding_mask"] = float_additive(*kpm_shape, g=g)
    return out


# ---------------------------------------------------------------------------------------------- inputs
def make_inputs(kind: str, batched: bool, batch_first: bool, kdim: int, vdim: int, s: int = S) -> tuple:
    """(query, key, value) leaves; 'self' makes query is key is value, 'shared_kv' key is value."""
    g = torch.Generator().manual_seed(3)
    l = s if kind == "self" else L

    def t(seq: int, dim: int) -> Tensor:
        shape = (seq, dim) if not batched else ((N, seq, dim) if batch_first else (seq, N, dim))
        return torch.randn(shape, generator=g).requires_grad_()

    q = t(l, E)
    if kind == "self":
        return q, q, q
    k = t(s, kdim)
    if kind == "shared_kv":
        return q, k, k
    return q, k, t(s, vdim)


def clone_inputs(qkv: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Fresh leaves with the same values and the same identity structure (q is k ...)."""
    memo: dict[int, Tensor] = {}
    out = []
    for x in qkv:
        if id(x) not in memo:
            memo[id(x)] = x.detach().clone().requires_grad_()
        out.append(memo[id(x)])
    return tuple(out)  # type: ignore[return-value]


def run_and_grad(module: nn.Module, qkv: tuple, cot: dict[str, Tensor], **kw) -> dict[str, Tensor]:
    """Forward, then backward with fixed cotangents; returns outputs and every gradient by name."""
    module.zero_grad()
    out, weights = module(*qkv, **kw)
    results = {"out": out.detach()}
    loss = (out * cot["out"]).sum()
    if weights is not None:
        results["weights"] = weights.detach()
        loss = loss + (weights * cot["weights"]).sum()
    loss.backward()
    seen = set()
    for name, x in zip("qkv", qkv):
        if id(x) not in seen:
            seen.add(id(x))
            results[f"grad_{name}"] = x.grad.detach().clone()
    for name, p in module.named_parameters():
        results[f"grad_{name}"] = p.grad.detach().clone()
    return results


def assert_same(ref: dict[str, Tensor], ours: dict[str, Tensor], where: str) -> None:
    assert ref.keys() == ours.keys(), where
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], msg=lambda m, n=name: f"{where} {n}: {m}")


def compare(ref: nn.Module, ours: nn.Module, qkv: tuple, where: str, **kw) -> None:
    with torch.no_grad():
        shapes = [None if t is None else t.shape for t in ref(*qkv, **kw)]
    g = torch.Generator().manual_seed(11)
    cot = {k: torch.randn(shape, generator=g) for k, shape in zip(("out", "weights"), shapes) if shape}
    a = run_and_grad(ref, clone_inputs(qkv), cot, **kw)
    b = run_and_grad(ours, clone_inputs(qkv), cot, **kw)
    assert_same(a, b, where)


WEIGHT_MODES = [
    dict(need_weights=False),
    dict(need_weights=True),
    dict(need_weights=True, average_attn_weights=False),
]


# ---------------------------------------------------------------------------------------------- the grid
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("ctor", CTOR_GRID, ids=ctor_id)
def test_outputs_weights_and_gradients_match_torch(ctor: dict, mask_kind: str) -> None:
    """Every constructor option x every mask kind, each over batch_first x batched/unbatched; the
    attention kind (self / shared key-value / cross) and the need_weights mode rotate along the grid so
    that every pairing of them with each option and mask kind is met. Outputs, weights, all gradients."""
    kinds = ["self", "shared_kv", "cross"] if ctor["kdim"] is None else ["cross"]
    offset = CTOR_GRID.index(ctor) + MASK_KINDS.index(mask_kind)
    for i, (batch_first, batched) in enumerate(itertools.product((False, True), (True, False))):
        ref, ours = make_pair(batch_first=batch_first, **ctor)
        random_params(ref, ours)
        kind = kinds[(offset + i) % len(kinds)]
        mode = WEIGHT_MODES[(offset // len(kinds) + i) % len(WEIGHT_MODES)]
        qkv = make_inputs(kind, batched, batch_first, ours.kdim, ours.vdim)
        l = qkv[0].shape[-2] if not batched else qkv[0].shape[1 if batch_first else 0]
        masks = make_masks(mask_kind, batched, N, l, S)
        where = f"batch_first={batch_first} batched={batched} {kind} {mode}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # 'mixed' warns about mismatched mask types, in both
            compare(ref, ours, qkv, where, **masks, **mode)


def test_mismatched_mask_types_warn_as_torch_does() -> None:
    ref, ours = make_pair(batch_first=True)
    q = torch.randn(N, L, E)
    masks = make_masks("mixed", True, N, L, L)
    with pytest.warns(UserWarning, match="mismatched key_padding_mask and attn_mask"):
        ref(q, q, q, **masks)
    with pytest.warns(UserWarning, match="mismatched key_padding_mask and attn_mask"):
        ours(q, q, q, **masks)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 4),
    l=st.integers(1, 6),
    s=st.integers(1, 6),
    heads=st.sampled_from([1, 2, 3]),
    dh=st.integers(1, 5),
    batch_first=st.booleans(),
    mask_kind=st.sampled_from(MASK_KINDS),
    need_weights=st.booleans(),
)
def test_random_shapes_match_torch(
    n: int, l: int, s: int, heads: int, dh: int, batch_first: bool, mask_kind: str, need_weights: bool
) -> None:
    e = heads * dh
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(e, heads, batch_first=batch_first)
    ours = MultiheadAttention(e, heads, batch_first=batch_first)
    random_params(ref, ours)
    q = torch.randn((n, l, e) if batch_first else (l, n, e))
    k = torch.randn((n, s, e) if batch_first else (s, n, e))
    g = torch.Generator().manual_seed(5)
    masks: dict[str, Tensor] = {}
    if "attn" in mask_kind or "both" in mask_kind or mask_kind == "mixed":
        shape = (l, s) if "3d" not in mask_kind else (n * heads, l, s)
        masks["attn_mask"] = bool_blocked(*shape, g=g) if "bool" in mask_kind else float_additive(*shape, g=g)
    if "kpm" in mask_kind or "both" in mask_kind or mask_kind == "mixed":
        masks["key_padding_mask"] = (
            float_additive(n, s, g=g) if mask_kind in ("kpm_float", "both_float") else bool_blocked(n, s, g=g)
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compare(ref, ours, (q, k, k), f"{n=} {l=} {s=} {heads=} {dh=}", need_weights=need_weights, **masks)


# ---------------------------------------------------------------------------------------------- is_causal
def causal_float(l: int, s: int) -> Tensor:
    return torch.full((l, s), float("-inf")).triu(1)  # (L, S) torch's generate_square_subsequent_mask


@pytest.mark.parametrize("mask_dtype", ["bool", "float"])
@pytest.mark.parametrize("with_kpm", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
def test_is_causal_with_its_mask_matches_torch(mask_dtype: str, with_kpm: bool, need_weights: bool) -> None:
    ref, ours = make_pair(batch_first=True)
    random_params(ref, ours)
    qkv = make_inputs("self", True, True, E, E, s=L)
    mask = causal_float(L, L) if mask_dtype == "float" else torch.ones(L, L, dtype=torch.bool).triu(1)
    kw: dict = dict(attn_mask=mask, is_causal=True, need_weights=need_weights)
    if with_kpm:
        kpm = torch.zeros(N, L, dtype=torch.bool)
        kpm[1, 3:] = True
        kw["key_padding_mask"] = (
            kpm if mask_dtype == "bool" else torch.zeros(N, L).masked_fill(kpm, float("-inf"))
        )
    compare(ref, ours, qkv, str(kw.keys()), **kw)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("add_bias_kv", [False, True])
def test_is_causal_hint_is_followed_like_torch(need_weights: bool, add_bias_kv: bool) -> None:
    """A mask that is *not* causal with is_causal=True: torch's fused path (no kpm, no weights) uses its
    top-left causal mask instead of the given one, the weights path uses the mask. We do the same, also
    for cross-attention with seq_q != seq_k and an appended bias_k/bias_v position."""
    ref, ours = make_pair(batch_first=False, add_bias_kv=add_bias_kv)
    random_params(ref, ours)
    qkv = make_inputs("shared_kv", True, False, E, E)  # L=5 queries, S=7 keys
    not_causal = bool_blocked(L, S, g=torch.Generator().manual_seed(2))
    compare(ref, ours, qkv, "hint", attn_mask=not_causal, is_causal=True, need_weights=need_weights)
    # and the hint really changes the answer in the fused path, so the comparison above is not vacuous
    a = ours(*qkv, attn_mask=not_causal, is_causal=True, need_weights=need_weights)[0]
    b = ours(*qkv, attn_mask=not_causal, is_causal=False, need_weights=need_weights)[0]
    assert torch.equal(a, b) == need_weights


def test_is_causal_needs_attn_mask_like_torch() -> None:
    ref, ours = make_pair()
    q = torch.randn(L, N, E)
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        ref(q, q, q, is_causal=True)
    with pytest.raises(ValueError, match="attn_mask") as err:
        ours(q, q, q, is_causal=True)
    assert isinstance(err.value, RuntimeError)


def test_is_causal_hint_leaves_the_replaced_mask_unchecked_like_torch() -> None:
    """Where the hint replaces attn_mask (no key padding, no weights asked for), torch checks neither its
    size nor its float dtype: a [2, 2] mask for a length-1 query, a float64 mask for float32 inputs, a
    [N * H, 2, 2] mask run, as the causal mask, in both. Asking for the weights uses the mask, and then
    both refuse it."""
    ref, ours = make_pair()
    random_params(ref, ours)
    q1 = torch.randn(1, N, E, generator=torch.Generator().manual_seed(5)).requires_grad_()  # (L=1, N, E)
    qk = torch.randn(1, N, E), torch.randn(S, N, E)
    wrong = {
        "[2, 2] bool": torch.ones(2, 2, dtype=torch.bool).triu(1),
        "[2, 2] float": causal_float(2, 2),
        "[1, 1] float64": torch.zeros(1, 1, dtype=torch.float64),
        "[N H, 2, 2] bool": torch.zeros(N * H, 2, 2, dtype=torch.bool),
    }
    for name, mask in wrong.items():
        compare(ref, ours, (q1, q1, q1), f"self {name}", attn_mask=mask, is_causal=True, need_weights=False)
        compare(ref, ours, (*qk, qk[1]), f"cross {name}", attn_mask=mask, is_causal=True, need_weights=False)
        with pytest.raises(RuntimeError):
            ref(q1, q1, q1, attn_mask=mask, is_causal=True, need_weights=True)
        with pytest.raises((ValueError, TypeError), match="attn_mask") as err:
            ours(q1, q1, q1, attn_mask=mask, is_causal=True, need_weights=True)
        assert isinstance(err.value, RuntimeError)
    # the rank and the kind of mask are still checked, by both
    for bad in (torch.zeros(2, dtype=torch.bool), torch.zeros(2, 2, dtype=torch.int64)):
        with pytest.raises(AssertionError):
            ref(q1, q1, q1, attn_mask=bad, is_causal=True, need_weights=False)
        with pytest.raises((ValueError, TypeError), match="attn_mask") as err2:
            ours(q1, q1, q1, attn_mask=bad, is_causal=True, need_weights=False)
        assert isinstance(err2.value, AssertionError)


def test_is_causal_hint_on_torchs_inference_fast_path_uses_the_mask_like_torch() -> None:
    """eval + no_grad + batch_first self-attention with a bool mask: torch's fast path ignores is_causal,
    uses attn_mask as given and checks its size. So does the drop-in (which never runs that path)."""
    ref, ours = make_pair(batch_first=True)
    random_params(ref, ours)
    ref.eval(), ours.eval()
    x = torch.randn(N, L, E)
    not_causal = bool_blocked(L, L, g=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a = ref(x, x, x, attn_mask=not_causal, is_causal=True, need_weights=False)[0]
        b = ours(x, x, x, attn_mask=not_causal, is_causal=True, need_weights=False)[0]
        as_given = ours(x, x, x, attn_mask=not_causal, need_weights=False)[0]
        with pytest.raises(RuntimeError):
            ref(x, x, x, attn_mask=torch.zeros(2, 2, dtype=torch.bool), is_causal=True, need_weights=False)
        with pytest.raises(ValueError, match="attn_mask") as err:
            ours(x, x, x, attn_mask=torch.zeros(2, 2, dtype=torch.bool), is_causal=True, need_weights=False)
    torch.testing.assert_close(b, a)
    torch.testing.assert_close(b, as_given)
    assert isinstance(err.value, RuntimeError)
    # and with grad (torch's general path) the hint replaces the same mask: the two paths really differ
    c = ours(x, x, x, attn_mask=not_causal, is_causal=True, need_weights=False)[0]
    torch.testing.assert_close(c, ref(x, x, x, attn_mask=not_causal, is_causal=True, need_weights=False)[0])
    assert not torch.allclose(c, b)


# ---------------------------------------------------------------------------------------------- dtypes
def cast_inputs(qkv: tuple[Tensor, Tensor, Tensor], dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """The inputs in ``dtype`` as fresh leaves, keeping their identity structure (q is k ...)."""
    memo: dict[int, Tensor] = {}
    for x in qkv:
        memo.setdefault(id(x), x.detach().to(dtype).requires_grad_())
    return memo[id(qkv[0])], memo[id(qkv[1])], memo[id(qkv[2])]


@pytest.mark.parametrize(
    "weights, bias",
    [(torch.float64, torch.float16), (torch.float32, torch.float16), (torch.float16, torch.float32)],
)
@pytest.mark.parametrize("kind", ["self", "shared_kv", "cross"])
def test_in_proj_bias_of_another_dtype_is_added_as_torch_adds_it(
    weights: torch.dtype, bias: torch.dtype, kind: str
) -> None:
    """A half in_proj_bias on float64 weights (or float32 on half ones): torch's batch_first path adds it
    to the projection in the weights' dtype (F.linear on a transposed input: matmul, then add_). The
    drop-in gives the same outputs, weights and gradients (half weights: outputs and weights), with the
    separate kdim/vdim projections too."""
    for ctor in (dict(), dict(kdim=KDIM, vdim=VDIM)):
        if ctor and kind != "cross":
            continue
        ref, ours = make_pair(batch_first=True, **ctor)
        random_params(ref, ours)
        for m in (ref, ours):
            m.to(weights)
            m.in_proj_bias = nn.Parameter(m.in_proj_bias.detach().to(bias))
        assert ours.in_proj_bias.dtype == bias and ours.out_proj.weight.dtype == weights
        qkv = cast_inputs(make_inputs(kind, True, True, ours.kdim, ours.vdim), weights)
        for mode in WEIGHT_MODES:
            if weights != torch.float16:
                compare(ref, ours, qkv, f"{kind} {ctor} {mode}", **mode)
                continue
            # half weights: the attention kernels round differently, a few half ulps apart (a missing
            # or misplaced bias would be off by its own size, ~0.2); forward only
            with torch.no_grad():
                a, b = ref(*qkv, **mode), ours(*qkv, **mode)
            torch.testing.assert_close(b[0], a[0], atol=4e-3, rtol=1e-2)
            torch.testing.assert_close(b[1], a[1], atol=4e-3, rtol=1e-2)
        out = ours(*qkv)[0]
        assert out.dtype == weights


def test_in_proj_bias_of_another_dtype_runs_where_torch_s_addmm_refuses_it() -> None:
    """A contiguous (seq, batch, embed) input sends torch's F.linear to addmm, which refuses the mixed
    dtypes; the same values laid out non-contiguously take torch's matmul-then-add path and run. The
    drop-in gives that answer whatever the layout."""
    ref, ours = make_pair(batch_first=False)
    random_params(ref, ours)
    for m in (ref, ours):
        m.double()
        m.in_proj_bias = nn.Parameter(m.in_proj_bias.detach().half())
    x = torch.randn(L, N, E, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="same dtype"):
        ref(x, x, x)
    x_strided = x.transpose(0, 1).contiguous().transpose(0, 1)  # (L, N, E), the same values
    assert not x_strided.is_contiguous()
    want, want_w = ref(x_strided, x_strided, x_strided)
    for inp in (x, x_strided):
        out, w = ours(inp, inp, inp)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(w, want_w)


# ---------------------------------------------------------------------------------------------- dead rows
@pytest.mark.parametrize("mask_dtype", ["bool", "float"])
def test_fully_masked_rows_give_zero_not_nan(mask_dtype: str) -> None:
    """torch: NaN rows. compat: zero weights, output = out_proj.bias there, finite gradients; the other
    rows (outputs and gradients) equal torch run on the live rows alone."""
    ref, ours = make_pair(batch_first=True)
    random_params(ref, ours)
    mask = bool_blocked(L, S, g=torch.Generator().manual_seed(4))
    dead = [1, 3]
    mask[dead] = True  # rows 1 and 3: every key blocked
    if mask_dtype == "float":
        mask = torch.randn(L, S).masked_fill(mask, float("-inf"))  # additive: rows 1 and 3 all -inf
    live = [i for i in range(L) if i not in dead]
    q, k, _ = make_inputs("shared_kv", True, True, E, E)

    with torch.no_grad():
        ref_out, ref_w = ref(q, k, k, attn_mask=mask)
    assert torch.isnan(ref_out[:, dead]).all() and torch.isnan(ref_w[:, dead]).all()

    out, w = ours(q, k, k, attn_mask=mask, average_attn_weights=False)
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
    assert torch.equal(w[:, :, dead], torch.zeros_like(w[:, :, dead]))
    torch.testing.assert_close(out[:, dead], ours.out_proj.bias.expand(N, len(dead), E))
    out.sum().backward()
    for name, p in ours.named_parameters():
        assert torch.isfinite(p.grad).all(), name

    # live rows: same as torch on the live queries only (outputs and gradients)
    q_live = q.detach()[:, live].clone()
    compare(ref, ours, (q_live, k, k), "live rows", attn_mask=mask[live])
    ours.zero_grad()
    q2, k2 = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    ours_out, _ = ours(q2, k2, k2, attn_mask=mask)
    ours_out[:, live].sum().backward()
    ref.zero_grad()
    q3, k3 = q_live.clone().requires_grad_(), k.detach().clone().requires_grad_()
    ref(q3, k3, k3, attn_mask=mask[live])[0].sum().backward()
    torch.testing.assert_close(k2.grad, k3.grad)
    torch.testing.assert_close(q2.grad[:, live], q3.grad)
    assert torch.equal(q2.grad[:, dead], torch.zeros_like(q2.grad[:, dead]))
    for (name, p), (_, r) in zip(ours.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, r.grad, msg=name)


def test_fully_padded_sample_leaves_other_samples_alone() -> None:
    ref, ours = make_pair(batch_first=True)
    random_params(ref, ours)
    q, k, _ = make_inputs("shared_kv", True, True, E, E)
    kpm = torch.zeros(N, S, dtype=torch.bool)
    kpm[0] = True  # sample 0: all padding
    out, w = ours(q, k, k, key_padding_mask=kpm)
    assert torch.equal(w[0], torch.zeros_like(w[0]))
    torch.testing.assert_close(out[0], ours.out_proj.bias.expand(L, E))
    compare(
        ref, ours, (q[1:].detach(), k[1:].detach(), k[1:].detach()), "other samples", key_padding_mask=kpm[1:]
    )


# ---------------------------------------------------------------------------------------------- state dicts
@pytest.mark.parametrize("ctor", CTOR_GRID, ids=ctor_id)
def test_state_dict_keys_and_init_match_torch_and_load_both_ways(ctor: dict) -> None:
    ref, ours = make_pair(**ctor)  # make_pair checks equal initial weights under one seed
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    random_params(ref, ours, seed=5)  # torch -> ours
    back = nn.MultiheadAttention(E, H, **ctor)
    back.load_state_dict(ours.state_dict())  # ours -> torch, strict
    for name, p in ref.state_dict().items():
        assert torch.equal(back.state_dict()[name], p), name


def test_torch_attributes_are_present() -> None:
    ref, ours = make_pair(
        kdim=KDIM, vdim=VDIM, add_bias_kv=True, add_zero_attn=True, batch_first=True, dropout=0.25
    )
    for attr in (
        "embed_dim",
        "num_heads",
        "head_dim",
        "kdim",
        "vdim",
        "dropout",
        "batch_first",
        "add_zero_attn",
    ):
        assert getattr(ours, attr) == getattr(ref, attr), attr
    assert ours._qkv_same_embed_dim == ref._qkv_same_embed_dim
    assert ours.in_proj_weight is None and ours.q_proj_weight.shape == ref.q_proj_weight.shape
    assert ours.bias_k.shape == ref.bias_k.shape
    assert type(ours.out_proj) is type(ref.out_proj)


def test_per_head_views_are_torch_parameters() -> None:
    ref, ours = make_pair()
    random_params(ref, ours)
    W = ours.in_proj_weight
    torch.testing.assert_close(ours.W_Q[1], W[DH : 2 * DH].T, rtol=0, atol=0)
    torch.testing.assert_close(ours.W_V[0], W[2 * E : 2 * E + DH].T, rtol=0, atol=0)
    torch.testing.assert_close(ours.W_O[1], ours.out_proj.weight[:, DH:].T, rtol=0, atol=0)
    torch.testing.assert_close(ours.b_K[1], ours.in_proj_bias[E + DH : 2 * E], rtol=0, atol=0)
    with torch.no_grad():
        ours.heads[1].W_O.zero_()  # writing through a head view edits out_proj.weight
    assert torch.equal(ours.out_proj.weight[:, DH:], torch.zeros(E, DH))


def test_head_ablation_hook_equals_zeroing_its_out_proj_columns_in_torch() -> None:
    ref, ours = make_pair(batch_first=True, add_bias_kv=True)
    random_params(ref, ours)
    q = torch.randn(N, L, E)
    seen: dict[str, tuple[int, ...]] = {}
    ours.hook_pattern.add(lambda t, hp: seen.update(pattern=tuple(t.shape)))

    def ablate(z: Tensor, hp: object) -> Tensor:
        z = z.clone()
        z[:, :, 1] = 0.0  # (N, L, H, dh): head 1
        return z

    ours.hook_z.add(ablate)
    out, _ = ours(q, q, q, need_weights=False)
    assert seen["pattern"] == (N, H, L, L + 1)  # the bias_k position is a key like the others
    with torch.no_grad():
        ref.out_proj.weight[:, DH:] = 0.0
    torch.testing.assert_close(out, ref(q, q, q, need_weights=False)[0])


def test_trace_collects_headspace_hook_points_batch_first_whatever_the_layout() -> None:
    from headspace.analysis.trace import trace

    ref, ours = make_pair(add_bias_kv=True)  # batch_first=False: (seq, batch, embed)
    random_params(ref, ours)
    q = torch.randn(L, N, E)
    with trace(ours) as t:
        out, w = ours(q, q, q, average_attn_weights=False)
    assert tuple(t["hook_result"].shape) == (N, L, H, E)
    torch.testing.assert_close(t["hook_result"].sum(dim=2) + ours.out_proj.bias, out.transpose(0, 1))
    torch.testing.assert_close(t["hook_pattern"], w)
    ref_out, ref_w = ref(q, q, q, average_attn_weights=False)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(w, ref_w)


# ---------------------------------------------------------------------------------------------- paths
@pytest.mark.parametrize("need_weights", [False, True])
def test_matches_torch_inference_fast_path(need_weights: bool) -> None:
    """eval + no_grad + batch_first + even num_heads: torch takes _native_multi_head_attention."""
    ref, ours = make_pair(batch_first=True)
    random_params(ref, ours)
    ref.eval(), ours.eval()
    x = torch.randn(N, L, E)
    kpm = torch.zeros(N, L, dtype=torch.bool)
    kpm[2, 4:] = True
    with torch.no_grad():
        a = ref(x, x, x, key_padding_mask=kpm, need_weights=need_weights)
        b = ours(x, x, x, key_padding_mask=kpm, need_weights=need_weights)
    torch.testing.assert_close(b[0], a[0])
    if need_weights:
        torch.testing.assert_close(b[1], a[1])


@pytest.mark.parametrize("need_weights", [False, True])
def test_dropout_in_training_uses_the_same_random_draws_as_torch(need_weights: bool) -> None:
    ref, ours = make_pair(batch_first=True, dropout=0.4)
    random_params(ref, ours)
    x = torch.randn(N, L, E)
    mask = bool_blocked(L, L, g=torch.Generator().manual_seed(9))
    torch.manual_seed(123)
    a = ref(x, x, x, attn_mask=mask, need_weights=need_weights)
    torch.manual_seed(123)
    b = ours(x, x, x, attn_mask=mask, need_weights=need_weights)
    torch.testing.assert_close(b[0], a[0])
    if need_weights:
        torch.testing.assert_close(b[1], a[1])  # the weights after dropout, as torch returns them
    torch.manual_seed(124)
    c = ours(x, x, x, attn_mask=mask, need_weights=need_weights)
    assert not torch.allclose(c[0], b[0])  # dropout is really on in training
    ours.eval()
    d1, d2 = ours(x, x, x, attn_mask=mask)[0], ours(x, x, x, attn_mask=mask)[0]
    assert torch.equal(d1, d2)  # and off in eval


def test_drop_in_replacement_inside_transformer_encoder_layer() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=19, dropout=0.0, batch_first=True)
    x = torch.randn(N, L, E)
    src_mask = nn.Transformer.generate_square_subsequent_mask(L)
    expected = layer(x, src_mask=src_mask, is_causal=True)
    swapped = MultiheadAttention(E, H, batch_first=True)
    swapped.load_state_dict(layer.self_attn.state_dict())
    layer.self_attn = swapped
    torch.testing.assert_close(layer(x, src_mask=src_mask, is_causal=True), expected)


def test_non_contiguous_and_broadcast_inputs() -> None:
    ref, ours = make_pair(kdim=KDIM, vdim=VDIM)
    random_params(ref, ours)
    q = torch.randn(N, L, E).transpose(0, 1)  # (L, N, E) non-contiguous
    k = torch.randn(1, N, KDIM).expand(S, N, KDIM)  # stride 0 along seq
    v = torch.randn(S, N, 2 * VDIM)[..., ::2]  # strided last dim
    mask = bool_blocked(N * H, L, S, g=torch.Generator().manual_seed(8))
    mask = mask.transpose(1, 2).contiguous().transpose(1, 2)  # (N H, L, S), strided like a transpose
    kpm = bool_blocked(N, S, g=torch.Generator().manual_seed(9)).T.contiguous().T  # (N, S), strided
    assert not mask.is_contiguous() and not kpm.is_contiguous()
    a = ours(q, k, v, attn_mask=mask, key_padding_mask=kpm)
    b = ours(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        attn_mask=mask.contiguous(),
        key_padding_mask=kpm.contiguous(),
    )
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])
    torch.testing.assert_close(a[0], ref(q, k, v, attn_mask=mask, key_padding_mask=kpm)[0])


def test_empty_batch_and_empty_query_give_torch_shapes() -> None:
    ref, ours = make_pair()
    for q, k in [(torch.randn(L, 0, E), torch.randn(S, 0, E)), (torch.randn(0, N, E), torch.randn(S, N, E))]:
        for need_weights in (False, True):
            a = ref(q, k, k, need_weights=need_weights)
            b = ours(q, k, k, need_weights=need_weights)
            assert b[0].shape == a[0].shape
            assert (b[1] is None) == (a[1] is None)
            if a[1] is not None:
                assert b[1].shape == a[1].shape


def test_gradcheck_float64() -> None:
    torch.manual_seed(0)
    m = MultiheadAttention(6, 2, add_bias_kv=True, add_zero_attn=True, kdim=5, vdim=3, dtype=torch.float64)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p))
    q = torch.randn(3, 2, 6, dtype=torch.float64, requires_grad=True)
    k = torch.randn(4, 2, 5, dtype=torch.float64, requires_grad=True)
    v = torch.randn(4, 2, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[False, True, False, True], [True, True, True, True], [False, False, True, False]])
    kpm = torch.tensor([[False, False, True, False], [False, False, False, False]])

    def f(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        out, w = m(q, k, v, attn_mask=mask, key_padding_mask=kpm, average_attn_weights=False)
        return out, w

    assert torch.autograd.gradcheck(f, (q, k, v))


# ---------------------------------------------------------------------------------------------- bad input
def bad_cases() -> list[tuple[str, Callable[[nn.Module], object], str, bool]]:
    """(id, call, word the message must name, whether our error is also an instance of torch's class)."""
    q, k = torch.randn(L, N, E), torch.randn(S, N, E)
    b, i64, f64 = torch.bool, torch.long, torch.float64

    def kw(**masks: Tensor) -> Callable[[nn.Module], object]:
        return lambda m: m(q, k, k, **masks)

    return [
        ("query 1-D", lambda m: m(torch.randn(E), k, k), "query", True),
        ("query 4-D", lambda m: m(torch.randn(1, L, N, E), k, k), "query", True),
        ("key 2-D with batched query", lambda m: m(q, torch.randn(S, E), k), "key", True),
        ("query width", lambda m: m(torch.randn(L, N, E + 1), k, k), "query", True),
        ("batch sizes differ", lambda m: m(q, *[torch.randn(S, N + 1, E)] * 2), "batch", True),
        ("key/value lengths differ", lambda m: m(q, k, torch.randn(S + 1, N, E)), "seq_k", True),
        ("int key_padding_mask", kw(key_padding_mask=torch.zeros(N, S, dtype=i64)), "key_padding_mask", True),
        ("int attn_mask", kw(attn_mask=torch.zeros(L, S, dtype=torch.int32)), "attn_mask", True),
        (
            "key_padding_mask shape",
            kw(key_padding_mask=torch.zeros(N, S + 1, dtype=b)),
            "key_padding_mask",
            True,
        ),
        (
            "key_padding_mask 1-D batched",
            kw(key_padding_mask=torch.zeros(S, dtype=b)),
            "key_padding_mask",
            True,
        ),
        ("attn_mask 2-D shape", kw(attn_mask=torch.zeros(S, L, dtype=b)), "attn_mask", True),
        ("attn_mask 3-D shape", kw(attn_mask=torch.zeros(N, L, S, dtype=b)), "attn_mask", True),
        ("attn_mask 4-D", kw(attn_mask=torch.zeros(N, H, L, S, dtype=b)), "attn_mask", True),
        (
            "unbatched 3-D attn_mask",
            lambda m: m(q[:, 0], k[:, 0], k[:, 0], attn_mask=torch.zeros(N * H, L, S)),
            "attn_mask",
            True,
        ),
        ("float64 attn_mask", kw(attn_mask=torch.zeros(L, S, dtype=f64)), "attn_mask", True),
        ("float64 query", lambda m: m(q.double(), k, k), "query", True),
    ]


@pytest.mark.parametrize("case", bad_cases(), ids=lambda c: c[0])
def test_bad_input_is_refused_like_torch_with_a_message_naming_it(case) -> None:
    _, call, word, same_class = case
    ref, ours = make_pair()
    with pytest.raises(Exception) as torch_err:
        call(ref)
    with pytest.raises((ValueError, TypeError), match=word) as ours_err:
        call(ours)
    if same_class:
        assert isinstance(ours_err.value, type(torch_err.value)), (
            type(ours_err.value),
            type(torch_err.value),
        )


def test_constructor_errors() -> None:
    with pytest.raises(AssertionError):
        nn.MultiheadAttention(10, 3)
    with pytest.raises(ValueError, match="divisible") as err:
        MultiheadAttention(10, 3)
    assert isinstance(err.value, AssertionError)
    with pytest.raises(ValueError, match="embed_dim"):
        MultiheadAttention(0, 2)
    with pytest.raises(TypeError, match="num_heads"):
        MultiheadAttention(8, 2.0)  # type: ignore[arg-type]


def test_key_length_zero_is_an_error() -> None:
    _, ours = make_pair()
    q = torch.randn(L, N, E)
    with pytest.raises(ValueError, match="seq_k"):
        ours(q, torch.randn(0, N, E), torch.randn(0, N, E))
    ref, with_zero = make_pair(add_zero_attn=True)  # one appended position: a valid (zero) key
    random_params(ref, with_zero)
    empty = torch.randn(0, N, E)
    compare(ref, with_zero, (q, empty, empty), "zero attention only")


def test_is_a_headspace_layer() -> None:
    assert issubclass(MultiheadAttention, MultiHeadAttention)
