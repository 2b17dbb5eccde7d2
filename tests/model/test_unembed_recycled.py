"""The decoder's logits in recycled memory (issue 38, speed: headspace.model.unembed_recycled): a second
forward writes its logits into the pages of the first one's, once those are dropped, instead of faulting
fresh memory in; the logits are F.linear's bit for bit, and every case that must see the ordinary product
(autograd, a module hook on the unembedding, an int8 unembedding, small logits) gets it."""

from __future__ import annotations

import resource
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from headspace import Decoder, ModelConfig
from headspace.kernels.workspace import THREAD_SCRATCH_MIN_BYTES, release_thread_workspace
from headspace.model.unembed_recycled import recycled_logits

# logits of 2 x 64 positions over 65,536 words: 33.5 MB, past THREAD_SCRATCH_MIN_BYTES (32 MiB)
VOCAB, BATCH, SEQ = 65536, 2, 64


def _decoder(tie: bool, bias: bool = False) -> Decoder:
    torch.manual_seed(0)
    config = ModelConfig(
        arch="decoder", vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, d_mlp=24, max_seq_len=SEQ,
        tie_embeddings=tie,
    )  # fmt: skip
    model = Decoder(config).eval()
    if bias:  # (GPT-J, Phi: an unembedding bias)
        model.lm_head = torch.nn.Linear(16, VOCAB, bias=True)
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _counting_faults(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """fn()'s result and the minor page faults the process took while it ran."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    out = fn()
    return out, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_the_logits_are_past_the_recycling_size() -> None:
    assert BATCH * SEQ * VOCAB * 4 >= THREAD_SCRATCH_MIN_BYTES


@pytest.mark.parametrize("tie, bias", [(True, False), (False, False), (False, True)])
def test_a_second_forward_faults_no_fresh_logits_in(tie: bool, bias: bool) -> None:
    model, tokens = _decoder(tie, bias), _tokens()
    pages = BATCH * SEQ * VOCAB * 4 // 4096  # 8192 pages of logits
    try:
        with torch.inference_mode():
            first = model(tokens)
            want = first.clone()
            del first  # dropped: its memory may serve the next logits
            faults = []
            for _ in range(3):
                got, n = _counting_faults(lambda: model(tokens))
                faults.append(n)
                assert torch.equal(got, want)  # the same logits, bit for bit
                del got
    finally:
        release_thread_workspace()
    # a fresh 33.5 MB result faults in each of its 8192 pages (glibc maps it afresh every time)
    assert min(faults) < pages // 4, faults


@pytest.mark.parametrize("bias", [False, True])
def test_recycled_logits_are_f_linear_bit_for_bit(bias: bool) -> None:
    torch.manual_seed(2)
    h = torch.randn(BATCH, SEQ, 16)
    w = torch.randn(VOCAB, 16)
    b = torch.randn(VOCAB) if bias else None
    try:
        with torch.no_grad():
            got = recycled_logits(h, w, b)
        assert got is not None and got.shape == (BATCH, SEQ, VOCAB)
        assert torch.equal(got, F.linear(h, w, b))
    finally:
        release_thread_workspace()


def test_the_ordinary_product_where_it_must_be() -> None:
    h, w = torch.randn(BATCH, SEQ, 16), torch.randn(VOCAB, 16)
    assert recycled_logits(h[:, :8], w, None) is None  # small logits: torch.empty is as good
    assert recycled_logits(h.transpose(0, 1), w, None) is None  # not contiguous
    assert recycled_logits(h.double(), w.double(), None) is None  # float32 only
    wg = w.clone().requires_grad_()
    assert recycled_logits(h, wg, None) is None  # autograd records the product
    with torch.no_grad():
        assert recycled_logits(h, wg, None) is not None
    release_thread_workspace()


def test_autograd_and_module_hooks_see_the_ordinary_unembedding() -> None:
    model, tokens = _decoder(tie=False), _tokens()
    with torch.no_grad():
        want = model(tokens)
    logits = model(tokens)  # grad mode: the product is recorded
    assert logits.grad_fn is not None and torch.equal(logits.detach(), want)
    logits[:, -1, :3].sum().backward()
    assert model.lm_head.weight.grad is not None
    seen = []
    handle = model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(out))
    try:
        with torch.no_grad():
            hooked = model(tokens)
    finally:
        handle.remove()
        release_thread_workspace()
    assert len(seen) == 1 and seen[0] is hooked  # the module ran, and its hook saw the logits
    assert torch.equal(hooked, want)


def test_a_watched_final_residual_gives_the_same_logits() -> None:
    model, tokens = _decoder(tie=True), _tokens()
    seen = []
    try:
        with torch.no_grad():
            fast = model(tokens).clone()
            remove = model.hook_resid_final.add(lambda t, hook: seen.append(t.clone()))
            try:
                hooked = model(tokens)
            finally:
                remove()
    finally:
        release_thread_workspace()
    assert len(seen) == 1 and torch.equal(hooked, fast)


def test_an_int8_unembedding_keeps_its_own_kernel() -> None:
    model, tokens = _decoder(tie=False), _tokens()
    with torch.no_grad():
        plain = model(tokens)
        model.to_precision("int8")
        quantised = model(tokens)
    release_thread_workspace()
    assert quantised.untyped_storage().resizable()  # torch's own memory: the int8 kernel's output
    assert not torch.equal(quantised, plain)  # the int8 product, not the float32 one
    torch.testing.assert_close(quantised, plain, rtol=0, atol=0.05 * plain.abs().max().item())
