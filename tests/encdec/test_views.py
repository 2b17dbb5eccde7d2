"""Per-head views of every attention layer, cross-attention included: W_Q reads the decoder's stream, W_K
and W_V the encoder's output; T5's ``head.qk(delta)`` is the QK circuit plus the head's bucket bias."""

from __future__ import annotations

import pytest
import torch

import headspace
from conftest import SIZES, inputs_of
from headspace.model.encdec import BucketQK, relative_bucket


@pytest.mark.parametrize("kind", ["bart", "whisper"])
def test_cross_attention_head_views_read_both_streams(tiny, kind: str) -> None:
    folder, _ = tiny(kind)
    m = headspace.load(folder)
    x = inputs_of(kind)
    y = torch.randint(0, SIZES[kind]["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(3))
    layer = m.decoder.blocks[1].cross_attn
    _, cache = m.run_with_cache(x, y)
    query = cache["decoder.blocks.1.hook_cross_in"]  # (B, T, d_model): the decoder's stream, normed
    memory = cache["encoder.hook_out"]  # (B, S, d_model): the encoder's output
    torch.testing.assert_close(memory, m.encode(x).detach())
    p = "decoder.blocks.1.cross_attn."
    for h, head in enumerate(layer.heads):
        assert head.W_Q.shape == (m.config.d_model, m.config.d_head)
        q = query @ head.W_Q + head.b_Q  # (B, T, dh)
        k = memory @ head.W_K + head.b_K  # (B, S, dh)
        v = memory @ head.W_V + head.b_V  # (B, S, dh)
        torch.testing.assert_close(cache[p + "hook_q"][:, :, h], q, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache[p + "hook_k"][:, :, h], k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache[p + "hook_v"][:, :, h], v, atol=1e-5, rtol=1e-5)
        scores = torch.einsum("btd,bsd->bts", q, k) * layer.scale  # (B, T, S)
        torch.testing.assert_close(cache[p + "hook_scores"][:, h], scores, atol=1e-5, rtol=1e-5)
        z = cache[p + "hook_pattern"][:, h] @ v  # (B, T, dh)
        torch.testing.assert_close(cache[p + "hook_result"][:, :, h], z @ head.W_O, atol=1e-5, rtol=1e-5)
        # the QK circuit [d_model (decoder), d_model (encoder)] gives the same scores
        qk = head.qk(augmented=True).AB  # (d + 1, d + 1)
        ones = torch.ones(*query.shape[:2], 1)
        aug_q, aug_k = torch.cat((query, ones), -1), torch.cat((memory, torch.ones(*memory.shape[:2], 1)), -1)
        torch.testing.assert_close(
            aug_q @ qk @ aug_k.transpose(1, 2) * layer.scale, scores, atol=1e-4, rtol=1e-4
        )


@pytest.mark.parametrize("stack", ["encoder", "decoder"])
def test_t5_head_qk_adds_the_bucket_bias(tiny, stack: str) -> None:
    folder, ref = tiny("t5")
    m = headspace.load(folder)
    x = inputs_of("t5")
    y = torch.randint(0, SIZES["t5"]["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(4))
    layer = getattr(m, stack).blocks[1].attn
    _, cache = m.run_with_cache(x, y)
    inp = cache[f"{stack}.blocks.1.hook_attn_in"][0]  # (S, d_model): the layer's input (after ln1), first row
    scores = cache[f"{stack}.blocks.1.attn.hook_scores"][0]  # (H, S, S)
    S = inp.shape[0]
    table = (
        getattr(ref, stack).block[0].layer[0].SelfAttention.relative_attention_bias.weight.detach()
    )  # (buckets, H)
    biases = set()
    for h, head in enumerate(layer.heads):
        for i in range(S):
            for j in range(S):
                if stack == "decoder" and j > i:
                    continue  # masked (causal)
                circuit = head.qk(i - j)
                assert isinstance(circuit, BucketQK)
                bucket = relative_bucket(
                    torch.tensor(j - i), bidirectional=stack == "encoder", num_buckets=8, max_distance=12
                )
                assert float(circuit.bias.detach()) == pytest.approx(float(table[bucket, h]), abs=1e-6)
                biases.add(round(float(circuit.bias.detach()), 5))
                torch.testing.assert_close(
                    circuit.score(inp[i], inp[j]), scores[h, i, j], atol=1e-4, rtol=1e-4
                )
                aug = head.qk(i - j, augmented=True).AB  # bias folded in: [x_i, 1] M [x_j, 1]^T
                one = torch.ones(1)
                got = torch.cat((inp[i], one)) @ aug @ torch.cat((inp[j], one))
                torch.testing.assert_close(got, scores[h, i, j], atol=1e-4, rtol=1e-4)
    assert len(biases) > 3  # the bias differs by offset: without it the scores above would not match
    plain = layer.heads[0].qk()  # no offset: the bias-free circuit
    assert not isinstance(plain, BucketQK)
    torch.testing.assert_close(plain.AB, layer.heads[0].W_Q @ layer.heads[0].W_K.T)


def test_t5_qk_takes_a_tensor_of_offsets(tiny) -> None:
    folder, _ = tiny("t5")
    head = headspace.load(folder).encoder.blocks[0].attn.heads[2]
    deltas = torch.arange(-5, 6)
    batched = head.qk(deltas)
    assert batched.bias.shape == (11,)
    for n, d in enumerate(deltas.tolist()):
        assert float(batched.bias[n].detach()) == float(head.qk(d).bias.detach())
