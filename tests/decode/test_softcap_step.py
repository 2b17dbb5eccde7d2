"""Gemma 2's score soft-capping in the cached decoding step (issue 38): the Python step computes
``cap * tanh(s / cap)`` before the mask and the softmax, as the forward does, so Gemma 2 decodes
through the step instead of a whole forward per token; the native step refuses the field by name.

Reference: a tiny random Gemma 2 built and saved by transformers 5 (eager attention), with small caps
(so that they bend) and a sliding window the decoded sequence crosses.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as T

import headspace as hs
from headspace.decode import Stepper, describe, native

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, H, HKV, DH, DM, W = 97, 42, 3, 6, 2, 10, 59, 5  # vocab, hidden, layers, heads, kv heads, ...


def build(folder: Path) -> T.Gemma2ForCausalLM:
    """A random transformers Gemma 2 saved into ``folder``, read back with eager attention."""
    torch.manual_seed(0)
    config = T.Gemma2Config(
        vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=HKV,
        head_dim=DH, intermediate_size=DM, max_position_embeddings=64, sliding_window=W,
        query_pre_attn_scalar=13, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=None,
    )  # fmt: skip
    model = T.Gemma2ForCausalLM(config).eval()
    with torch.no_grad():  # norms away from their start, so a swapped or skipped one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    return T.Gemma2ForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def test_gemma2_decodes_through_the_python_step_as_transformers(tmp_path: Path) -> None:
    ref = build(tmp_path)
    ours = hs.load(tmp_path)
    step = describe(ours.model)
    assert step is not None and [layer.softcap for layer in step.layers] == [2.0] * L
    assert ours.model.decode_plan() is not None  # generate takes the step
    assert native.native_form(step) is None  # generate's default: the Python step runs it
    with pytest.raises(
        ValueError, match="the native decoding step does not support the attention field 'softcap'"
    ):
        native.prepare(step)  # asked for by name
    stepper = Stepper(step)
    tokens = torch.randint(3, V, (2, 12))  # past the window (5)
    caches = ours.model.make_kv_caches(2, 16)
    with torch.no_grad():
        full = ours.model(tokens)  # (2, 12, V)
        ours.model(tokens[:, :4], kv_caches=caches)
        stepped = torch.stack([stepper.logits(tokens[:, i : i + 1], caches) for i in range(4, 12)], 1)
    assert stepper.backend_used == "python"
    scale = float(full.abs().max())
    torch.testing.assert_close(stepped, full[:, 4:], atol=1e-5 * scale, rtol=0)
    prompt = tokens[:1, :4]
    with torch.no_grad():
        expected = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=9,
                                do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
    assert torch.equal(ours.generate(prompt, 9, temperature=0), expected)
