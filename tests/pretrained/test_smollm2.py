"""SmolLM2-135M-Instruct on headspace's layers against transformers' LlamaForCausalLM on the same GGUF file.

Reference: ``LlamaForCausalLM.from_pretrained(folder, gguf_file=..., dtype=torch.float32)`` with eager
attention (tests/conftest.py loads it once). Tolerances, from the issue: logits <= 2e-4 max abs (logits
reach ~33; transformers' own eager and sdpa paths differ by 6e-5), per-head patterns <= 5e-5.
"""

from __future__ import annotations

import pytest
import torch

import headspace as hs
from headspace.analysis import attribution, patching

pytestmark = pytest.mark.slow  # the whole module (pyproject.toml: -m slow runs it)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "When Mary and John went to the store, John gave a drink to",
    "1 2 3 4 5 6 7 8",
    "Les feuilles mortes se ramassent à la pelle",
    "東京は日本の首都です。",
    "Emoji 🙂🚀 and    spaces\tand tabs",
    "The quick brown fox jumps over the lazy dog.",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "In 1969, Neil Armstrong",
    "A",
]


def _hf_ids(tokenizer, text: str) -> torch.Tensor:
    return tokenizer(text, return_tensors="pt").input_ids


def test_smollm2_is_the_documented_shape(smollm2) -> None:
    c = smollm2.config
    assert (c.n_layers, c.n_heads, c.n_kv_heads, c.d_model, c.d_head) == (30, 9, 3, 576, 64)
    attn = smollm2.model.blocks[0].attn
    assert attn.W_Q.shape == (9, 576, 64) and attn.W_K.shape == (3, 576, 64)
    head = attn.heads[4]
    assert head.kv_index == 1 and head.W_K.data_ptr() == attn.W_K[1].data_ptr()  # the group's storage


@pytest.mark.parametrize("text", PROMPTS)
def test_logits_equal_transformers(smollm2, smollm2_hf, smollm2_hf_tokenizer, text: str) -> None:
    ids = _hf_ids(smollm2_hf_tokenizer, text)
    ours, _ = smollm2.tokenize_padded([text])
    assert torch.equal(ours, ids)  # the same token ids from the GGUF metadata
    with torch.no_grad():
        want = smollm2_hf(ids).logits
        got = smollm2.model(ids)
    assert (got - want).abs().max() <= 2e-4


def test_left_padded_batch_equals_transformers(smollm2, smollm2_hf, smollm2_hf_tokenizer) -> None:
    texts = PROMPTS[:4]
    rows = [smollm2.tokenizer.encode_ids([t])[0] for t in texts]
    tokens, real = smollm2.tokenizer.pad(rows, side="left", fill_id=0)  # (batch, seq) x 2
    positions = (real.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        want = smollm2_hf(tokens, attention_mask=real.long(), position_ids=positions).logits
        got = smollm2.model(tokens, real, positions=positions)
    assert (got - want)[real].abs().max() <= 2e-4  # real positions only: padded ones are never read


def test_every_heads_pattern_equals_transformers(smollm2, smollm2_hf, smollm2_hf_tokenizer) -> None:
    ids = _hf_ids(smollm2_hf_tokenizer, PROMPTS[2])
    with torch.no_grad():
        want = smollm2_hf(ids, output_attentions=True).attentions  # per layer [1, heads, seq, seq]
    with hs.trace(smollm2.model, names="*.attn.hook_pattern") as t:
        smollm2.model(ids)
    worst = max(float((t.pattern(i) - want[i]).abs().max()) for i in range(30))
    assert worst <= 5e-5


def test_greedy_generation_equals_transformers(smollm2, smollm2_hf, smollm2_hf_tokenizer) -> None:
    ids = _hf_ids(smollm2_hf_tokenizer, "Once upon a time")
    with torch.no_grad():
        want = smollm2_hf.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    got = smollm2.model.generate(ids, 32, temperature=0)
    assert torch.equal(got, want)


def test_direct_attribution_adds_up_on_smollm2(smollm2) -> None:
    r = attribution.direct_logit_attribution(smollm2, "The capital of France is", " Paris", " London")
    assert r.heads.shape == (30, 9)
    assert abs(float(r.total - r.logit)) <= 1e-4


def test_head_patching_equals_transformers_with_a_pre_hook_on_o_proj(smollm2, smollm2_hf) -> None:
    clean = "When Mary and John went to the store, John gave a drink to"
    corrupt = "When Mary and John went to the store, Mary gave a drink to"
    r = patching.patch(smollm2, clean, corrupt, answer=" Mary", other=" John")
    a, b = smollm2.tokenizer.plain_ids(" Mary")[0], smollm2.tokenizer.plain_ids(" John")[0]
    c_ids, _ = smollm2.tokenize_padded([clean])
    k_ids, _ = smollm2.tokenize_padded([corrupt])
    for layer, head in [(0, 0), (14, 4), (29, 8), int(r.effect.abs().argmax()).__divmod__(9)]:
        proj = smollm2_hf.model.layers[layer].self_attn.o_proj
        stored: dict[str, torch.Tensor] = {}
        keep = proj.register_forward_pre_hook(
            lambda mod, args, stored=stored: stored.__setitem__("z", args[0])
        )
        with torch.no_grad():
            smollm2_hf(c_ids)
        keep.remove()

        def swap(mod, args, stored=stored, head=head):
            z = args[0].clone()
            z[..., head * 64 : (head + 1) * 64] = stored["z"][..., head * 64 : (head + 1) * 64]
            return (z,)

        handle = proj.register_forward_pre_hook(swap)
        with torch.no_grad():
            logits = smollm2_hf(k_ids).logits[0, -1]
        handle.remove()
        assert r.patched_metric[layer, head] == pytest.approx(float(logits[a] - logits[b]), abs=2e-4)
