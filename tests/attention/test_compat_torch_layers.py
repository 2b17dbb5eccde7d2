"""The drop-in inside torch's own transformer layers, torch's exception classes case by case, TorchScript,
nested tensors and :func:`headspace.compat.swap_into`.

Every layer holding the drop-in is compared with the same torch layer holding torch's
``nn.MultiheadAttention`` with the same weights, in every mode: train/eval x grad/no_grad x
batch_first x masks (causal with ``is_causal``, float, key padding, both). In eval without grad torch's
own layer takes its fused fast path (and ``nn.TransformerEncoder`` its nested-tensor path); the layer
holding the drop-in must not take the fused kernel and must fire headspace's hook points.

Sizes are distinct primes where they can be: batch N=3, seq L=5 (memory S=7), embed 22 = 2 heads x 11,
feed-forward 19. Dropout is 0 so that train mode is deterministic.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import headspace as hs
from headspace.attention.compat import (
    MultiheadAttention,
    MultiheadAttentionTypeError,
    TorchScriptNotSupportedError,
    keep_off_torch_fast_path,
    swap_into,
)

N, L, S, H, DH, FF = 3, 5, 7, 2, 11, 19
E = H * DH

pytestmark = pytest.mark.filterwarnings(
    "ignore:The PyTorch API of nested tensors is in prototype stage",
    "ignore:enable_nested_tensor is True",
)

MODES = list(itertools.product(["train", "eval"], ["grad", "no_grad"]))


def randomise(module: nn.Module, seed: int = 1) -> None:
    """Non-trivial values everywhere (torch zero-initialises the attention biases)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(
                torch.randn(p.shape, generator=g) / E**0.5 + (1.0 if p.dim() == 1 and "norm" in str(p) else 0)
            )


def twin(ref: nn.Module) -> nn.Module:
    """A copy of ``ref`` whose every nn.MultiheadAttention is the drop-in (same weights)."""
    ours = swap_into(copy.deepcopy(ref))
    assert not any(type(m) is nn.MultiheadAttention for m in ours.modules())
    return ours


def padding(batch_first: bool) -> Tensor:
    kpm = torch.zeros(N, L, dtype=torch.bool)  # (N, L), True = padding (torch's convention)
    kpm[1, 3:] = True
    kpm[2, 1:] = True  # one real token: left-aligned, as TransformerEncoder's nested path needs
    return kpm


def causal(n: int, dtype: str) -> Tensor:
    mask = nn.Transformer.generate_square_subsequent_mask(n)  # float: 0 / -inf
    return mask.isinf() if dtype == "bool" else mask


def float_mask(l: int, s: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(l, s, generator=g)


@pytest.fixture
def fused_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count calls of torch's fused encoder-layer kernel (the layer fast path)."""
    calls: list[int] = []
    real = torch._transformer_encoder_layer_fwd

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", counting)
    return calls


def run(module: nn.Module, inputs: tuple[Tensor, ...], kwargs: dict, mode: tuple[str, str]) -> dict:
    """Output, and with grad the gradients of the inputs and of every parameter (by name)."""
    module.train(mode[0] == "train")
    inputs = tuple(x.clone().requires_grad_(mode[1] == "grad") for x in inputs)
    with torch.set_grad_enabled(mode[1] == "grad"):
        out = module(*inputs, **kwargs)
    if out.is_nested:
        out = out.to_padded_tensor(0.0)
    result = {"out": out.detach()}
    if mode[1] == "grad":
        module.zero_grad()
        cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
        (out * cot).sum().backward()
        result.update({f"grad {i}": x.grad for i, x in enumerate(inputs)})
        result.update({f"grad {n}": p.grad for n, p in module.named_parameters()})
    return result


def assert_equal_runs(ref: dict, ours: dict, where: str, where_out: Tensor | None = None) -> None:
    """Equal outputs (at ``where_out`` positions only, when given) and gradients."""
    assert ref.keys() == ours.keys(), where
    for name in ref:
        a, b = ours[name], ref[name]
        if name == "out" and where_out is not None:
            a, b = a[where_out], b[where_out]
        torch.testing.assert_close(a, b, msg=lambda m, n=name: f"{where} {n}: {m}")


def attention_modules(model: nn.Module) -> int:
    return sum(isinstance(m, MultiheadAttention) for m in model.modules())


def real_positions(kwargs: dict, out: Tensor, batch_first: bool) -> Tensor:
    """Output positions [N, L] (or [L, N]) that are real tokens of the query sequence."""
    kpm = kwargs.get("src_key_padding_mask", kwargs.get("tgt_key_padding_mask"))
    if kpm is None:
        return torch.ones(out.shape[:2], dtype=torch.bool)
    return ~kpm if batch_first else ~kpm.T


def check_layer(
    ref: nn.Module, inputs: tuple, kwargs: dict, mode: tuple[str, str], where: str, calls: list
) -> None:
    """``ref`` and its twin holding the drop-in give the same outputs and gradients; hooks fire.

    References: torch's layer with its fast paths off (``torch.backends.mha.set_fastpath_enabled(False)``)
    everywhere, and torch's layer as it runs by default wherever its output is finite. The two differ
    where torch's fast paths differ from its own slow path: with a float ``attn_mask`` of arbitrary
    values the fused encoder kernel returns NaN, and ``nn.TransformerEncoder``'s nested-tensor path
    returns 0 at padded positions; outputs at padded positions are compared with the default path only.
    """
    ours = twin(ref)
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        slow = run(ref, inputs, kwargs, mode)
    finally:
        torch.backends.mha.set_fastpath_enabled(before)
    default = run(ref, inputs, kwargs, mode)
    batch_first = next(m for m in ref.modules() if isinstance(m, nn.MultiheadAttention)).batch_first
    real = real_positions(kwargs, slow["out"], batch_first)
    finite = default["out"].isfinite().all(dim=-1)
    if not finite.all():
        assert "float" in where and mode == ("eval", "no_grad"), f"{where}: torch gave NaN"
    torch.testing.assert_close(
        slow["out"][real & finite], default["out"][real & finite], msg=f"{where}: torch's paths"
    )
    calls.clear()
    mine = run(ours, inputs, kwargs, mode)
    assert calls == [], f"{where}: the layer holding the drop-in took torch's fused kernel"
    assert_equal_runs(slow, mine, where, real)
    torch.testing.assert_close(
        mine["out"][finite], default["out"][finite], msg=f"{where}: torch's default path"
    )
    with hs.trace(ours, "*.hook_pattern") as t:  # traced: hook points fire, same numbers
        traced = run(ours, inputs, kwargs, mode)
    assert_equal_runs(mine, traced, where + " (traced)")
    assert len(t.calls) == attention_modules(ours) and set(t.calls.values()) == {1}, where


# ---------------------------------------------------------------------------------------------- encoder layer
ENCODER_MASKS = [
    "none",
    "causal bool + is_causal",
    "causal float + is_causal",
    "float",
    "padding",
    "padding + bool",
]


def encoder_masks(kind: str, batch_first: bool) -> dict:
    if kind == "none":
        return {}
    if kind.startswith("causal"):
        return {"src_mask": causal(L, "bool" if "bool" in kind else "float"), "is_causal": True}
    if kind == "float":
        return {"src_mask": float_mask(L, L, 3)}
    if kind == "padding":
        return {"src_key_padding_mask": padding(batch_first)}
    return {"src_key_padding_mask": padding(batch_first), "src_mask": causal(L, "bool")}


@pytest.mark.parametrize("mode", MODES, ids="-".join)
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_encoder_layer_holding_the_drop_in_equals_torch_in_every_mode(
    mode: tuple[str, str], batch_first: bool, norm_first: bool, fused_kernel_calls: list[int]
) -> None:
    torch.manual_seed(0)
    ref = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=batch_first, norm_first=norm_first)
    randomise(ref)
    x = torch.randn((N, L, E) if batch_first else (L, N, E))
    for kind in ENCODER_MASKS:
        where = f"{'-'.join(mode)} batch_first={batch_first} norm_first={norm_first} {kind}"
        check_layer(ref, (x,), encoder_masks(kind, batch_first), mode, where, fused_kernel_calls)


def test_the_drop_in_keeps_torch_off_its_fast_path_by_a_documented_check() -> None:
    """torch's reason for not taking the fast path is the hooks check; merge_masks is torch's too."""
    layer = swap_into(nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True)).eval()
    attn = layer.self_attn
    assert list(attn._forward_pre_hooks.values()) == [keep_off_torch_fast_path]
    x = torch.randn(N, L, E)
    kpm, mask = padding(True), causal(L, "bool")
    ref = nn.MultiheadAttention(E, H, batch_first=True)
    for args in [(mask, kpm, x), (None, kpm, x), (mask, None, x), (None, None, x)]:
        got, want = attn.merge_masks(*args), ref.merge_masks(*args)
        assert got[1] == want[1] and (got[0] is None) == (want[0] is None)
        if want[0] is not None:
            assert torch.equal(got[0], want[0])
    with torch.no_grad():  # the crash this guards against: AttributeError 'merge_masks' on the fast path
        attn._forward_pre_hooks.clear()
        fast = layer(x, src_key_padding_mask=kpm)  # torch's fused kernel on the drop-in's weights
        attn.register_forward_pre_hook(keep_off_torch_fast_path)
        slow = layer(x, src_key_padding_mask=kpm)
    real = ~kpm
    torch.testing.assert_close(slow[real], fast[real])


# ---------------------------------------------------------------------------------------------- decoder layer
DECODER_MASKS = ["none", "tgt causal + is_causal", "memory float", "paddings", "everything"]


def decoder_masks(kind: str) -> dict:
    tgt_kpm = padding(True)
    mem_kpm = torch.zeros(N, S, dtype=torch.bool)
    mem_kpm[0, 4:] = True
    if kind == "none":
        return {}
    if kind == "tgt causal + is_causal":
        return {"tgt_mask": causal(L, "float"), "tgt_is_causal": True}
    if kind == "memory float":
        return {"memory_mask": float_mask(L, S, 4)}
    if kind == "paddings":
        return {"tgt_key_padding_mask": tgt_kpm, "memory_key_padding_mask": mem_kpm}
    return {
        "tgt_mask": causal(L, "bool"),
        "tgt_is_causal": True,
        "memory_mask": float_mask(L, S, 4) > 1.5,
        "tgt_key_padding_mask": tgt_kpm,
        "memory_key_padding_mask": mem_kpm,
    }


@pytest.mark.parametrize("mode", MODES, ids="-".join)
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_decoder_layer_holding_the_drop_in_equals_torch_in_every_mode(
    mode: tuple[str, str], batch_first: bool, fused_kernel_calls: list[int]
) -> None:
    torch.manual_seed(0)
    ref = nn.TransformerDecoderLayer(E, H, FF, dropout=0.0, batch_first=batch_first)
    randomise(ref)
    tgt = torch.randn((N, L, E) if batch_first else (L, N, E))
    memory = torch.randn((N, S, E) if batch_first else (S, N, E))
    for kind in DECODER_MASKS:
        where = f"{'-'.join(mode)} batch_first={batch_first} {kind}"
        check_layer(ref, (tgt, memory), decoder_masks(kind), mode, where, fused_kernel_calls)


# ---------------------------------------------------------------------------------------------- encoder stack
@pytest.mark.parametrize("mode", MODES, ids="-".join)
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_transformer_encoder_with_nested_tensor_conversion_equals_torch(
    mode: tuple[str, str], batch_first: bool, fused_kernel_calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=batch_first)
        ref = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(E), enable_nested_tensor=True)
    randomise(ref)
    nested_calls: list[int] = []
    real = torch._nested_tensor_from_mask

    def counting(*args, **kwargs):
        nested_calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_nested_tensor_from_mask", counting)
    x = torch.randn((N, L, E) if batch_first else (L, N, E))
    for kind in ["none", "padding", "causal float + is_causal", "padding + bool"]:
        kwargs = encoder_masks(kind, batch_first)
        kwargs = {{"src_mask": "mask"}.get(k, k): v for k, v in kwargs.items()}
        nested_calls.clear()
        check_layer(
            ref, (x,), kwargs, mode, f"{'-'.join(mode)} batch_first={batch_first} {kind}", fused_kernel_calls
        )
        nested_path = mode == ("eval", "no_grad") and batch_first and kind == "padding"
        assert bool(nested_calls) == nested_path  # the nested-tensor conversion happened exactly there


def test_an_encoder_built_from_a_layer_holding_the_drop_in_converts_to_nested_and_works() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True)
    randomise(layer)
    ref = nn.TransformerEncoder(layer, 2).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "use_nested_tensor is False because ..." warning either
        ours = nn.TransformerEncoder(swap_into(copy.deepcopy(layer)), 2).eval()
    assert ours.use_nested_tensor
    x, kpm = torch.randn(N, L, E), padding(True)
    with torch.no_grad():
        torch.testing.assert_close(ours(x, src_key_padding_mask=kpm), ref(x, src_key_padding_mask=kpm))


# --------------------------------------------------------------------------------------------- nested tensors
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_nested_self_attention_equals_each_sequence_alone(layout: torch.layout) -> None:
    torch.manual_seed(0)
    attn = MultiheadAttention(E, H, batch_first=True).eval()
    randomise(attn)
    seqs = [torch.randn(n, E) for n in (3, 5, 1)]
    x = torch.nested.nested_tensor(seqs, layout=layout)
    with torch.no_grad():
        out, weights = attn(x, x, x, need_weights=False)
        assert weights is None and out.is_nested and out.layout == layout
        for got, seq in zip(out.unbind(), seqs):
            torch.testing.assert_close(got, attn(seq[None], seq[None], seq[None])[0][0])


@pytest.mark.parametrize("average", [True, False])
def test_nested_input_with_weights_equals_torch_nested_fast_path(average: bool) -> None:
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, batch_first=True).eval()
    randomise(ref)
    ours = swap_into(copy.deepcopy(ref))
    x = torch.nested.nested_tensor([torch.randn(n, E) for n in (3, 5, 1)])
    with torch.no_grad():
        want, want_w = ref(x, x, x, average_attn_weights=average)
        got, got_w = ours(x, x, x, average_attn_weights=average)
    for a, b in zip(got.unbind(), want.unbind()):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(got_w, want_w)


@pytest.mark.parametrize(
    "case, word",
    [
        ("cross", "query"),
        ("nested key only", "key"),
        ("with key_padding_mask", "query"),
        ("seq first", "query"),
        ("nested mask", "attn_mask"),
    ],
)
def test_other_nested_inputs_are_refused_by_name(case: str, word: str) -> None:
    attn = MultiheadAttention(E, H, batch_first=case != "seq first").eval()
    ref = nn.MultiheadAttention(E, H, batch_first=case != "seq first").eval()
    x = torch.nested.nested_tensor([torch.randn(3, E), torch.randn(5, E)])
    y = torch.nested.nested_tensor([torch.randn(2, E), torch.randn(4, E)])
    padded = torch.randn(2, 5, E)
    call: Callable[[nn.Module], object] = {
        "cross": lambda m: m(x, y, y, need_weights=False),
        "nested key only": lambda m: m(padded, x, x, need_weights=False),
        "with key_padding_mask": lambda m: m(x, x, x, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool)),
        "seq first": lambda m: m(x, x, x, need_weights=False),
        "nested mask": lambda m: m(padded, padded, padded, attn_mask=x, need_weights=False),
    }[case]
    with (
        torch.no_grad(),
        pytest.raises(
            TypeError, match=rf"^{word} is a nested tensor;.*padded tensors with a key_padding_mask"
        ) as info,
    ):
        call(attn)
    assert isinstance(info.value, MultiheadAttentionTypeError)
    if case != "nested mask":  # torch raises AssertionError for these; ours is one too
        with torch.no_grad(), pytest.raises(Exception) as torch_info:
            call(ref)
        assert isinstance(info.value, type(torch_info.value)) or isinstance(torch_info.value, AssertionError)


# ------------------------------------------------------------------------------------------ exception classes
def exception_cases(kdim: int | None) -> dict[str, Callable[[nn.Module], object]]:
    kd = kdim or E
    q, k = torch.randn(L, N, E), torch.randn(S, N, kd)
    qu, ku = q[:, 0], k[:, 0]
    b = torch.bool
    return {
        "batch sizes differ": lambda m: m(q, torch.randn(S, N + 1, kd), torch.randn(S, N + 1, kd)),
        "float64 query": lambda m: m(q.double(), k, k),
        "float64 key and value": lambda m: m(q, k.double(), k.double()),
        "attn_mask 0-D": lambda m: m(q, k, k, attn_mask=torch.tensor(False)),
        "attn_mask 1-D": lambda m: m(q, k, k, attn_mask=torch.zeros(S, dtype=b)),
        "attn_mask 2-D wrong": lambda m: m(q, k, k, attn_mask=torch.zeros(S, L, dtype=b)),
        "attn_mask 3-D wrong": lambda m: m(q, k, k, attn_mask=torch.zeros(N, L, S, dtype=b)),
        "attn_mask 4-D": lambda m: m(q, k, k, attn_mask=torch.zeros(N, H, L, S, dtype=b)),
        "unbatched attn_mask 1-D": lambda m: m(qu, ku, ku, attn_mask=torch.zeros(S, dtype=b)),
        "unbatched attn_mask 2-D wrong": lambda m: m(qu, ku, ku, attn_mask=torch.zeros(S, L, dtype=b)),
        "unbatched attn_mask 3-D wrong": lambda m: m(qu, ku, ku, attn_mask=torch.zeros(N * H, L, S, dtype=b)),
        "unbatched attn_mask 4-D": lambda m: m(qu, ku, ku, attn_mask=torch.zeros(1, H, L, S, dtype=b)),
        "key_padding_mask 1-D batched": lambda m: m(q, k, k, key_padding_mask=torch.zeros(S, dtype=b)),
        "key_padding_mask 3-D": lambda m: m(q, k, k, key_padding_mask=torch.zeros(N, S, 1, dtype=b)),
        "key_padding_mask wrong": lambda m: m(q, k, k, key_padding_mask=torch.zeros(N, S + 1, dtype=b)),
        "unbatched key_padding_mask 2-D": lambda m: m(
            qu, ku, ku, key_padding_mask=torch.zeros(1, S, dtype=b)
        ),
        "unbatched key_padding_mask wrong": lambda m: m(
            qu, ku, ku, key_padding_mask=torch.zeros(S + 1, dtype=b)
        ),
        "float64 attn_mask": lambda m: m(q, k, k, attn_mask=torch.zeros(L, S, dtype=torch.float64)),
        "float64 key_padding_mask": lambda m: m(
            q, k, k, key_padding_mask=torch.zeros(N, S, dtype=torch.float64)
        ),
        "int attn_mask": lambda m: m(q, k, k, attn_mask=torch.zeros(L, S, dtype=torch.int64)),
        "int key_padding_mask": lambda m: m(q, k, k, key_padding_mask=torch.zeros(N, S, dtype=torch.int32)),
        "list attn_mask": lambda m: m(q, k, k, attn_mask=[[0]]),
        "query width": lambda m: m(torch.randn(L, N, E + 1), k, k),
        "key width": lambda m: m(q, torch.randn(S, N, kd + 1), torch.randn(S, N, kd)),
        "value width": lambda m: m(q, k, torch.randn(S, N, kd + 1)),
        "key and value lengths differ": lambda m: m(q, k, torch.randn(S + 1, N, kd)),
        "query 1-D": lambda m: m(torch.randn(E), k, k),
        "query 4-D": lambda m: m(torch.randn(1, L, N, E), k, k),
        "key 2-D with a batched query": lambda m: m(q, ku, ku),
        "key 3-D with an unbatched query": lambda m: m(qu, k, k),
        "is_causal without attn_mask": lambda m: m(q, k, k, is_causal=True),
    }


@pytest.mark.parametrize("kdim", [None, 13], ids=["fused", "kdim"])
def test_exception_classes_match_torch_case_by_case(kdim: int | None) -> None:
    """AssertionError exactly where torch raises it (RuntimeError likewise); always ValueError/TypeError."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, kdim=kdim, vdim=kdim)
    ours = MultiheadAttention(E, H, kdim=kdim, vdim=kdim)
    mismatches = []
    for name, call in exception_cases(kdim).items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(Exception) as theirs:
                call(ref)
            with pytest.raises((ValueError, TypeError)) as mine:
                call(ours)
        for cls in (AssertionError, RuntimeError):
            if isinstance(theirs.value, cls) != isinstance(mine.value, cls):
                mismatches.append(
                    f"{name}: torch {type(theirs.value).__name__}, ours {type(mine.value).__mro__[:3]}"
                )
    assert not mismatches, "\n".join(mismatches)


# ------------------------------------------------------------------------------------------------ TorchScript
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_torchscript_is_refused_with_a_clear_error() -> None:
    attn = MultiheadAttention(E, H)
    for model in [attn, nn.Sequential(attn), swap_into(nn.TransformerEncoderLayer(E, H, FF))]:
        with pytest.raises(
            TorchScriptNotSupportedError, match=r"does not support TorchScript.*torch\.compile.*torch\.export"
        ):
            torch.jit.script(model)
    assert issubclass(TorchScriptNotSupportedError, TypeError)


# -------------------------------------------------------------------------------------------------- swap_into
def test_swap_into_replaces_every_torch_attention_of_an_encoder_sharing_its_parameters() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
    randomise(model)
    x, kpm = torch.randn(N, L, E), padding(True)
    expected = model(x, src_key_padding_mask=kpm)
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert swap_into(model) is model
    assert [type(m.self_attn) for m in model.layers] == [MultiheadAttention] * 3
    assert [n for n, _ in model.named_parameters()] == names
    assert all(a is b for a, b in zip(model.parameters(), params))  # the same Parameter objects
    out = model(x, src_key_padding_mask=kpm)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    before = model.layers[0].self_attn.W_Q.detach().clone()
    optimizer.step()  # the optimizer built before the swap updates the drop-in's weights
    assert not torch.equal(model.layers[0].self_attn.W_Q, before)
    with hs.trace(model, "*.hook_pattern") as t:
        model(x, src_key_padding_mask=kpm)
    assert t["layers.2.self_attn.hook_pattern"].shape == (N, H, L, L)
    assert swap_into(model) is model  # swapping again changes nothing


def test_swap_into_keeps_settings_sharing_and_modes() -> None:
    torch.manual_seed(0)
    shared = nn.MultiheadAttention(E, H, dropout=0.25, add_bias_kv=True, add_zero_attn=True, kdim=13, vdim=17)
    plain = nn.MultiheadAttention(E, H, bias=False, batch_first=True).eval()
    model = nn.ModuleDict({"a": shared, "b": shared, "c": nn.Sequential(plain)})
    swap_into(model)
    assert model["a"] is model["b"] and isinstance(model["a"], MultiheadAttention)
    a, c = model["a"], model["c"][0]
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])  # nothing left unmade
    assert (a.dropout, a.kdim, a.vdim, a.add_zero_attn, a.training) == (0.25, 13, 17, True, True)
    assert a.bias_k is shared.bias_k and a.k_proj_weight is shared.k_proj_weight
    assert c.in_proj_bias is None and c.batch_first and not c.training and c.out_proj is plain.out_proj
    q = torch.randn(N, L, E)
    plain_out = plain(q, q, q)
    torch.testing.assert_close(c(q, q, q)[0], plain_out[0])
    alone = swap_into(nn.MultiheadAttention(E, H))  # a bare torch module: its drop-in is returned
    assert isinstance(alone, MultiheadAttention)
    with pytest.raises(ValueError, match=r"holds no torch.nn.MultiheadAttention"):
        swap_into(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module; got str"):
        swap_into("model")  # type: ignore[arg-type]
