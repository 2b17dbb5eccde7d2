"""The int8 screen of greedy's argmax (headspace.model.encdec.screen): the same tokens as the full float32
product, on near-ties and outlier channels, and through generate with the screen forced on and off (a
registered hook seeing the same values either way)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import headspace
from conftest import inputs_of
from headspace.kernels.cpu import force_fallback, int8_products_exact
from headspace.model.encdec.generate import _screen
from headspace.model.encdec.screen import ScreenedArgmax, screen_usable

#: kernels: CI runs these again under emulated lesser CPUs and with every fallback forced
#: (HEADSPACE_FORCE_FALLBACK=all: then the screen is off and the forced test below checks it)
pytestmark = pytest.mark.kernels


def _needs_screen() -> None:
    if not screen_usable(torch.zeros(1)):
        pytest.skip("no int8 product sums the worst case exactly on this CPU, or the int8 fallback is forced")


def _weights(vocab: int = 3000, d: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, d, generator=g) * 0.05
    w[1::2] = w[0::2][: w[1::2].shape[0]] + torch.randn(w[1::2].shape, generator=g) * 1e-4  # near-twins
    return w, torch.randn(vocab, generator=g)


@pytest.mark.parametrize("product", ["fbgemm", "int_mm"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_screen_gives_the_full_argmax(with_bias: bool, product: str) -> None:
    _needs_screen()
    w, b = _weights()
    bias = b if with_bias else None
    g = torch.Generator().manual_seed(1)
    h = torch.randn(64, w.shape[1], generator=g) * 3
    h[:, 5] = 200.0  # one channel far above the rest (as Whisper's final stream has)
    h[::3, 7] = -150.0
    screened = ScreenedArgmax(w, bias)
    if product == "int_mm":
        if not int8_products_exact()[1]:
            pytest.skip("torch._int_mm saturates the worst case on this CPU (no VNNI)")
        screened.packed = None  # torch._int_mm's product instead of fbgemm's
    elif screened.packed is None:
        pytest.skip("fbgemm's product is not in this torch or does not sum the worst case exactly here")
    want = F.linear(h, w, bias).argmax(-1)
    assert screened(h).tolist() == want.tolist()
    keep = screened.candidates(h)
    assert keep[torch.arange(h.shape[0]), want].all()
    assert keep.sum(1).float().mean() < w.shape[0] / 50  # it screens: few rows are computed in float


def test_screen_is_rebuilt_when_the_weights_change(tiny) -> None:
    _needs_screen()
    folder, _ = tiny("bart")
    m = headspace.load(folder)
    x = inputs_of("bart", batch=2)
    first = m.generate(x, 6, screen=True)
    kept = m.__dict__["_screened_argmax"]
    with torch.no_grad():
        m.tok_embed.weight[first[0, 1]] -= 100.0  # that token can no longer win
    assert not kept.fits(m.tok_embed.weight, m.logits_bias)
    again = m.generate(x, 6, screen=True)
    assert again.tolist() == m.generate(x, 6, screen=False).tolist()
    assert m.__dict__["_screened_argmax"] is not kept


@pytest.mark.parametrize("kind", ["whisper", "bart", "t5"])
def test_generate_same_tokens_and_hook_values_with_screen_on_and_off(tiny, kind: str) -> None:
    folder, _ = tiny(kind)
    m = headspace.load(folder)
    x = inputs_of(kind, batch=3)
    seen: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    tokens = {}
    for on in (False, True):
        point = m.hook_points()["decoder.blocks.0.attn.hook_pattern"]
        remove = point.add(lambda v, _p, on=on: seen[on].append(v.clone()))
        try:
            tokens[on] = m.generate(x, 8, screen=on)
        finally:
            remove()
    assert tokens[True].tolist() == tokens[False].tolist()
    assert len(seen[True]) == len(seen[False]) > 1
    for a, b in zip(seen[True], seen[False], strict=True):
        assert torch.equal(a, b)


def test_screen_follows_the_output_scale(tiny) -> None:
    folder, _ = tiny("t5")  # T5 scales the stream by d_model ** -0.5 before the tied unembedding
    m = headspace.load(folder)
    x = inputs_of("t5", batch=2)
    assert m.generate(x, 8, screen=True).tolist() == m.generate(x, 8, screen=False).tolist()


def test_the_two_int8_products_are_the_exact_integer_products() -> None:
    _needs_screen()
    w, _ = _weights(vocab=1000)
    screened = ScreenedArgmax(w, None)
    if screened.packed is None or not int8_products_exact()[1]:
        pytest.skip("fbgemm's exact product or an exact torch._int_mm is missing on this CPU")
    g = torch.Generator().manual_seed(2)
    ints = torch.randint(-127, 128, (4, w.shape[1]), generator=g).float()
    want = (ints @ screened.q_t.float()) * screened.row_scale  # integer sums below 2**24: exact in float
    fbgemm = screened.scaled_dots(ints)
    screened.packed = None
    assert torch.equal(fbgemm, want)
    assert torch.equal(screened.scaled_dots(ints), want)


def test_the_forced_int8_fallback_turns_the_screen_off_with_the_same_tokens(tiny) -> None:
    folder, _ = tiny("bart")
    m = headspace.load(folder)
    x = inputs_of("bart", batch=2)
    with force_fallback("int8"):
        assert not screen_usable(m.tok_embed.weight) and _screen(m, True) is None
        forced = m.generate(x, 6, screen=True)
    assert forced.tolist() == m.generate(x, 6, screen=False).tolist()


def test_an_inexact_int8_product_is_never_used(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where neither fbgemm's nor torch._int_mm's product sums the worst case exactly (a CPU without VNNI,
    as ATEN_CPU_CAPABILITY=avx2 emulates for _int_mm), the screen is off and the tokens are the full
    product's; where only _int_mm is inexact and fbgemm's pack fails, generate drops the screen too."""
    import headspace.model.encdec.generate as generate
    import headspace.model.encdec.screen as screen

    folder, _ = tiny("bart")
    m = headspace.load(folder)
    x = inputs_of("bart", batch=2)
    full = m.generate(x, 6, screen=False).tolist()
    monkeypatch.setattr(screen, "_fbgemm_exact", lambda: False)
    monkeypatch.setattr(screen, "int8_products_exact", lambda: (False, False))
    assert not screen_usable(m.tok_embed.weight) and _screen(m, True) is None
    assert m.generate(x, 6, screen=True).tolist() == full
    monkeypatch.setattr(screen, "screen_usable", lambda w: True)  # the gate passed, the pack failed
    monkeypatch.setattr(generate, "screen_usable", lambda w: True)
    monkeypatch.setattr(screen, "_fbgemm_pack", lambda q, s: None)
    monkeypatch.setattr(generate, "int8_products_exact", lambda: (False, False))
    m.__dict__.pop("_screened_argmax", None)
    assert _screen(m, True) is None
    assert m.generate(x, 6, screen=True).tolist() == full
