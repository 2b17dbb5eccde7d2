"""The bad-input contract of MultiHeadAttention (docs/design.md, the bad-input contract, items 1-9 and 11).

Every error is checked for its type and for its message: it must name the argument, say what was
expected and show what came. Device mismatches use the ``meta`` device, so they run on a CPU-only box.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from headspace import KVCache, MultiHeadAttention

pytestmark = pytest.mark.usefixtures("single_thread")

B, SQ, SK, D_MODEL, N_HEADS, KDIM, VDIM = 2, 3, 5, 12, 6, 11, 13


def raises(exc: type[Exception], fn: Callable[[], Any], *fragments: str) -> str:
    """Call ``fn``; assert it raises ``exc`` whose message contains every fragment. Returns the message."""
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    return msg


@pytest.fixture
def layer() -> MultiHeadAttention:
    return MultiHeadAttention(D_MODEL, N_HEADS, n_kv_heads=2)


@pytest.fixture
def cross() -> MultiHeadAttention:
    return MultiHeadAttention(D_MODEL, N_HEADS, kdim=KDIM, vdim=VDIM)


def x(*shape: int, **kw: Any) -> torch.Tensor:
    return torch.randn(*shape, **kw)


# --- 1. config
def test_d_model_not_divisible_by_n_heads() -> None:
    raises(ValueError, lambda: MultiHeadAttention(10, 3), "d_model=10", "n_heads=3", "d_head")
    # an explicit d_head makes it legal
    assert MultiHeadAttention(10, 3, d_head=4).W_Q.shape == (3, 10, 4)


def test_integer_weight_dtype_is_refused_by_name() -> None:
    raises(
        TypeError,
        lambda: MultiHeadAttention(D_MODEL, N_HEADS, dtype=torch.int64),
        "dtype",
        "floating",
        "int64",
    )
    assert MultiHeadAttention(D_MODEL, N_HEADS, dtype=torch.float64).o_weight.dtype == torch.float64


def test_n_heads_not_divisible_by_n_kv_heads() -> None:
    raises(ValueError, lambda: MultiHeadAttention(12, 6, n_kv_heads=4), "n_heads=6", "n_kv_heads=4", "divide")


@pytest.mark.parametrize(
    ("kwargs", "name", "shown"),
    [
        ({"d_model": 0}, "d_model", "0"),
        ({"n_heads": -2}, "n_heads", "-2"),
        ({"d_model": 12.0}, "d_model", "12.0"),
        ({"n_heads": True}, "n_heads", "True"),
        ({"d_head": 0}, "d_head", "0"),
        ({"n_kv_heads": 0}, "n_kv_heads", "0"),
        ({"kdim": 0}, "kdim", "0"),
        ({"vdim": -3}, "vdim", "-3"),
        ({"kdim": 2.5}, "kdim", "2.5"),
        ({"dropout": 1.0}, "dropout", "1.0"),
        ({"dropout": -0.1}, "dropout", "-0.1"),
        ({"dropout": float("nan")}, "dropout", "nan"),
        ({"scale": float("inf")}, "scale", "inf"),
    ],
)
def test_bad_constructor_values(kwargs: dict[str, Any], name: str, shown: str) -> None:
    args = {"d_model": 12, "n_heads": 6, **kwargs}
    msg = raises(ValueError, lambda: MultiHeadAttention(**args), name, shown)
    assert "must be" in msg


def test_dropout_of_the_wrong_type() -> None:
    raises(TypeError, lambda: MultiHeadAttention(12, 6, dropout="0.1"), "dropout", "float", "str")


# --- 2. shapes
@pytest.mark.parametrize(
    ("args", "name", "expected", "came"),
    [
        (lambda: (x(B, SQ, D_MODEL + 1),), "query", "d_model=12", "[2, 3, 13]"),
        (lambda: (x(D_MODEL),), "query", "3-D", "1-D tensor of shape [12]"),
        (lambda: (x(1, B, SQ, D_MODEL),), "query", "3-D", "4-D tensor of shape [1, 2, 3, 12]"),
        (lambda: (x(SQ, D_MODEL),), "query", "3-D", "unsqueeze(0)"),
        (lambda: (x(B, SQ, D_MODEL), x(B, SK, D_MODEL - 1)), "key", "kdim=12", "[2, 5, 11]"),
        (lambda: (x(B, SQ, D_MODEL), x(B, SK, D_MODEL), x(B, SK, 7)), "value", "vdim=12", "[2, 5, 7]"),
        (lambda: (x(B, SQ, D_MODEL), x(B, SK)), "key", "3-D", "2-D tensor of shape [2, 5]"),
        (
            lambda: (x(B, SQ, D_MODEL), x(B + 1, SK, D_MODEL)),
            "batch size",
            "query [2, 3, 12]",
            "key [3, 5, 12]",
        ),
        (
            lambda: (x(B, SQ, D_MODEL), x(B, SK, D_MODEL), x(B + 1, SK, D_MODEL)),
            "batch size",
            "value [3, 5, 12]",
            "key [2, 5, 12]",
        ),
        (
            lambda: (x(B, SQ, D_MODEL), x(B, SK, D_MODEL), x(B, SK + 1, D_MODEL)),
            "seq_k",
            "key [2, 5, 12]",
            "value [2, 6, 12]",
        ),
    ],
)
def test_bad_input_shapes(
    layer: MultiHeadAttention, args: Callable, name: str, expected: str, came: str
) -> None:
    raises(ValueError, lambda: layer(*args()), name, expected, came)


def test_cross_attention_dims_named(cross: MultiHeadAttention) -> None:
    q = x(B, SQ, D_MODEL)
    raises(ValueError, lambda: cross(q, x(B, SK, D_MODEL), x(B, SK, VDIM)), "key", "kdim=11", "[2, 5, 12]")
    raises(ValueError, lambda: cross(q, x(B, SK, KDIM), x(B, SK, KDIM)), "value", "vdim=13", "[2, 5, 11]")
    # self-attention on a layer whose key/value dims differ from d_model cannot work: say so
    raises(ValueError, lambda: cross(q), "kdim=11", "vdim=13", "d_model=12", "key and value")


def test_non_tensor_inputs(layer: MultiHeadAttention) -> None:
    raises(TypeError, lambda: layer([[1.0] * D_MODEL]), "query", "tensor", "list")
    raises(TypeError, lambda: layer(x(B, SQ, D_MODEL), "keys"), "key", "tensor", "str")


def test_value_without_key(layer: MultiHeadAttention) -> None:
    raises(ValueError, lambda: layer(x(B, SQ, D_MODEL), None, x(B, SK, D_MODEL)), "value", "key")


# --- 3. dtype/device
def test_dtype_mismatch_names_the_tensor(layer: MultiHeadAttention) -> None:
    q = x(B, SQ, D_MODEL)
    raises(TypeError, lambda: layer(q.double()), "query", "torch.float64", "torch.float32")
    raises(TypeError, lambda: layer(q, q.half()), "key", "torch.float16", "torch.float32")
    raises(TypeError, lambda: layer(q, q, q.double()), "value", "torch.float64", "torch.float32")
    f64 = MultiHeadAttention(D_MODEL, N_HEADS, dtype=torch.float64)
    raises(TypeError, lambda: f64(q), "query", "torch.float32", "torch.float64")


def test_float_mask_dtype_mismatch(layer: MultiHeadAttention) -> None:
    q = x(B, SQ, D_MODEL)
    m = torch.zeros(SQ, SQ, dtype=torch.float64)
    raises(TypeError, lambda: layer(q, attn_mask=m), "attn_mask", "torch.float64", "torch.float32")


def test_device_mismatch_names_the_tensor(layer: MultiHeadAttention) -> None:
    q = x(B, SQ, D_MODEL)
    meta = x(B, SQ, D_MODEL, device="meta")
    raises(ValueError, lambda: layer(meta), "query", "meta", "cpu")
    raises(ValueError, lambda: layer(q, meta), "key", "meta", "cpu")
    raises(ValueError, lambda: layer(q, q, meta), "value", "meta", "cpu")
    pad = torch.ones(B, SQ, dtype=torch.bool, device="meta")
    raises(ValueError, lambda: layer(q, key_padding=pad), "key_padding", "meta", "cpu")
    mask = torch.ones(SQ, SQ, dtype=torch.bool, device="meta")
    raises(ValueError, lambda: layer(q, attn_mask=mask), "attn_mask", "meta", "cpu")


# --- 4. masks
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.int8])
def test_integer_attn_mask_refused(layer: MultiHeadAttention, dtype: torch.dtype) -> None:
    m = torch.ones(SQ, SQ, dtype=dtype)
    raises(
        TypeError, lambda: layer(x(B, SQ, D_MODEL), attn_mask=m), "attn_mask", "bool", str(dtype), "polarity"
    )


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.float32])
def test_non_bool_key_padding_refused(layer: MultiHeadAttention, dtype: torch.dtype) -> None:
    pad = torch.ones(B, SQ, dtype=dtype)
    raises(TypeError, lambda: layer(x(B, SQ, D_MODEL), key_padding=pad), "key_padding", "bool", str(dtype))


@pytest.mark.parametrize(
    "shape",
    [(SQ + 1, SQ), (SQ, SQ + 1), (B + 1, SQ, SQ), (B, N_HEADS + 1, SQ, SQ), (SQ,), (1, B, N_HEADS, SQ, SQ)],
)
def test_unbroadcastable_attn_mask_lists_accepted_shapes(layer: MultiHeadAttention, shape: tuple) -> None:
    m = torch.ones(shape, dtype=torch.bool)
    msg = raises(ValueError, lambda: layer(x(B, SQ, D_MODEL), attn_mask=m), "attn_mask", str(list(shape)))
    for accepted in ("[seq_q, seq_k]", "[batch, seq_q, seq_k]", "[batch, n_heads, seq_q, seq_k]"):
        assert accepted in msg
    assert re.search(r"batch=2.*n_heads=6.*seq_q=3.*seq_k=3", msg)


@pytest.mark.parametrize("shape", [(B, SQ + 1), (SQ,), (B, 1, SQ), (1, SQ)])
def test_key_padding_of_the_wrong_shape(layer: MultiHeadAttention, shape: tuple) -> None:
    pad = torch.ones(shape, dtype=torch.bool)
    raises(
        ValueError,
        lambda: layer(x(B, SQ, D_MODEL), key_padding=pad),
        "key_padding",
        "[2, 3]",
        str(list(shape)),
    )


def test_non_tensor_masks(layer: MultiHeadAttention) -> None:
    q = x(B, SQ, D_MODEL)
    raises(TypeError, lambda: layer(q, attn_mask=[[True] * SQ] * SQ), "attn_mask", "tensor", "list")
    raises(TypeError, lambda: layer(q, key_padding=[[True] * SQ] * B), "key_padding", "tensor", "list")


def test_float_mask_mixed_with_bool_padding_refused(layer: MultiHeadAttention) -> None:
    q = x(B, SQ, D_MODEL)
    m = torch.zeros(SQ, SQ)
    pad = torch.ones(B, SQ, dtype=torch.bool)
    raises(
        TypeError, lambda: layer(q, attn_mask=m, key_padding=pad), "attn_mask", "float", "key_padding", "bool"
    )


# --- 5. causal rule
def test_is_causal_with_explicit_mask_is_and_not_an_error(layer: MultiHeadAttention) -> None:
    """The one documented rule (masks.py): is_causal is ANDed with any mask, never refused or ignored."""
    q = x(B, SQ, D_MODEL)
    m = torch.ones(SQ, SQ, dtype=torch.bool)
    m[2, 0] = False
    _, p = layer(q, attn_mask=m, is_causal=True, need_weights=True)
    allowed = m & torch.ones(SQ, SQ, dtype=torch.bool).tril()
    assert ((p != 0) == allowed).all()


# --- 7. empty keys
def test_key_length_zero(layer: MultiHeadAttention, cross: MultiHeadAttention) -> None:
    q = x(B, SQ, D_MODEL)
    raises(ValueError, lambda: layer(q, x(B, 0, D_MODEL)), "seq_k", "at least 1", "[2, 0, 12]")
    raises(ValueError, lambda: cross(q, x(B, 0, KDIM), x(B, 0, VDIM)), "seq_k", "at least 1", "[2, 0, 11]")
    raises(
        ValueError, lambda: layer(q, x(B, 0, D_MODEL), need_weights=True), "seq_k", "at least 1", "[2, 0, 12]"
    )


# --- 9. KV cache
def _cache_state(cache: KVCache) -> tuple[int, torch.Tensor]:
    return cache.length, cache.k.clone()


def test_kv_cache_overflow_leaves_the_cache_intact(layer: MultiHeadAttention) -> None:
    cache = layer.make_kv_cache(B, capacity=4)
    with torch.no_grad():
        layer(x(B, 3, D_MODEL), kv_cache=cache, is_causal=True)
        before = _cache_state(cache)
        raises(
            ValueError,
            lambda: layer(x(B, 2, D_MODEL), kv_cache=cache),
            "kv_cache",
            "overflow",
            "capacity 4",
            "3",
        )
    assert cache.length == before[0] and torch.equal(cache.k, before[1])


def test_kv_cache_batch_change(layer: MultiHeadAttention) -> None:
    cache = layer.make_kv_cache(B, capacity=4)
    with torch.no_grad():
        raises(
            ValueError, lambda: layer(x(B + 1, 1, D_MODEL), kv_cache=cache), "kv_cache", "batch=2", "batch=3"
        )
    assert cache.length == 0


def test_kv_cache_dtype_and_device_change(layer: MultiHeadAttention) -> None:
    cache = layer.make_kv_cache(B, capacity=4)
    layer64 = MultiHeadAttention(D_MODEL, N_HEADS, n_kv_heads=2, dtype=torch.float64)
    with torch.no_grad():
        raises(
            ValueError,
            lambda: layer64(x(B, 1, D_MODEL, dtype=torch.float64), kv_cache=cache),
            "kv_cache",
            "torch.float32",
            "torch.float64",
        )
        meta_cache = KVCache(B, 2, layer.d_head, 4, device="meta")
        raises(ValueError, lambda: layer(x(B, 1, D_MODEL), kv_cache=meta_cache), "kv_cache", "meta", "cpu")
    assert cache.length == 0 and meta_cache.length == 0


def test_kv_cache_of_another_layer_shape(layer: MultiHeadAttention) -> None:
    other = MultiHeadAttention(D_MODEL, N_HEADS).make_kv_cache(B, capacity=4)  # 6 kv heads, not 2
    with torch.no_grad():
        raises(
            ValueError,
            lambda: layer(x(B, 1, D_MODEL), kv_cache=other),
            "kv_cache",
            "[2, 6, 4, 2]",
            "[2, 2, 1, 2]",
        )
    assert other.length == 0


def test_kv_cache_refused_with_a_bad_mask_leaves_the_cache_intact(layer: MultiHeadAttention) -> None:
    cache = layer.make_kv_cache(B, capacity=4)
    with torch.no_grad():
        layer(x(B, 1, D_MODEL), kv_cache=cache)
        bad_pad = torch.ones(B, 1, dtype=torch.bool)  # must cover the 2 positions (cached + new)
        raises(
            ValueError,
            lambda: layer(x(B, 1, D_MODEL), kv_cache=cache, key_padding=bad_pad),
            "key_padding",
            "[2, 2]",
        )
    assert cache.length == 1


def test_kv_cache_misuse(layer: MultiHeadAttention) -> None:
    q = x(B, 1, D_MODEL)
    cache = layer.make_kv_cache(B, capacity=4)
    raises(ValueError, lambda: layer(q, q, kv_cache=cache), "kv_cache", "self-attention", "key=None")
    raises(TypeError, lambda: layer(q, kv_cache="cache"), "kv_cache", "KVCache", "str")
    for name, bad in (("capacity", 0), ("batch", -1), ("capacity", 2.5)):
        kwargs = {"batch": B, "n_kv_heads": 2, "d_head": 2, "capacity": 4, name: bad}
        raises(ValueError, lambda kwargs=kwargs: KVCache(**kwargs), name, "positive int", repr(bad))


# --- 11. finite
def test_check_finite_is_off_by_default_and_documented(layer: MultiHeadAttention) -> None:
    assert layer.check_finite is False
    doc = MultiHeadAttention.__doc__ or ""
    assert "check_finite" in doc and "default False" in doc
    q = x(B, SQ, D_MODEL)
    q[0, 1, 2] = float("nan")
    out = layer(q)  # no check: NaN flows through (to the rows that read position 1 of sample 0)
    assert torch.isnan(out[0]).any() and torch.isfinite(out[1]).all()


@pytest.mark.parametrize("need_weights", [False, True])
def test_check_finite_names_the_tensor_and_the_index(need_weights: bool) -> None:
    layer = MultiHeadAttention(D_MODEL, N_HEADS, check_finite=True)
    q = x(B, SQ, D_MODEL)
    bad_q = q.clone()
    bad_q[1, 2, 5] = float("nan")
    raises(
        ValueError, lambda: layer(bad_q, need_weights=need_weights), "query", "nan", "(1, 2, 5)", "[2, 3, 12]"
    )
    k = x(B, SK, D_MODEL)
    bad_k = k.clone()
    bad_k[0, 4, 0] = float("inf")
    raises(ValueError, lambda: layer(q, bad_k, k, need_weights=need_weights), "key", "inf", "(0, 4, 0)")
    bad_v = k.clone()
    bad_v[1, 0, 3] = float("-inf")
    raises(ValueError, lambda: layer(q, k, bad_v, need_weights=need_weights), "value", "-inf", "(1, 0, 3)")
    assert torch.isfinite(layer(q, k, k, need_weights=need_weights)[0]).all()


def test_check_finite_catches_non_finite_weights() -> None:
    layer = MultiHeadAttention(D_MODEL, N_HEADS, check_finite=True)
    with torch.no_grad():
        layer.W_V[3, 0, 1] = float("nan")
    raises(ValueError, lambda: layer(x(B, SQ, D_MODEL)), "output", "weights", "nan")


def test_check_finite_float_mask() -> None:
    """-inf is a legal additive mask entry (it blocks); NaN and +inf are not."""
    layer = MultiHeadAttention(D_MODEL, N_HEADS, check_finite=True)
    q = x(B, SQ, D_MODEL)
    m = torch.zeros(SQ, SQ)
    m[0, 2] = float("-inf")
    assert torch.isfinite(layer(q, attn_mask=m)).all()
    for bad in (float("nan"), float("inf")):
        m_bad = m.clone()
        m_bad[2, 1] = bad
        raises(ValueError, lambda m_bad=m_bad: layer(q, attn_mask=m_bad), "attn_mask", str(bad), "(2, 1)")


def test_hook_returning_a_wrong_shape(layer: MultiHeadAttention) -> None:
    layer.hook_pattern.name = "attn.hook_pattern"
    remove = layer.hook_pattern.add(lambda t, hp: t[..., :-1])
    raises(ValueError, lambda: layer(x(B, SQ, D_MODEL)), "attn.hook_pattern", "[2, 6, 3, 3]", "[2, 6, 3, 2]")
    remove()
    layer.hook_z.add(lambda t, hp: "not a tensor")
    raises(ValueError, lambda: layer(x(B, SQ, D_MODEL)), "hook", "None or a tensor", "str")
