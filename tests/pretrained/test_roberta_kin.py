"""xlm-roberta and camembert: RoBERTa's architecture under other model_types, loaded by load_roberta.

References: tiny random checkpoints built and saved by transformers 5 itself (odd sizes, every LayerNorm,
bias and position row moved off its start, a non-default ``pad_token_id``), read back with
``headspace.load`` and compared with transformers' eager forward: states within 1e-4 of their largest
magnitude, every head's pattern within 1e-5, on a right-padded batch (the real tokens' rows).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

import headspace as hs
from headspace.pretrained import PretrainedEncoder

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, H, DM, CTX, PAD = 71, 36, 2, 3, 23, 30, 3
KIN = {
    "xlm-roberta": (T.XLMRobertaConfig, T.XLMRobertaModel),
    "camembert": (T.CamembertConfig, T.CamembertModel),
}


@pytest.mark.parametrize("model_type", list(KIN))
def test_states_and_every_head_pattern_equal_transformers(tmp_path: Path, model_type: str) -> None:
    config_cls, model_cls = KIN[model_type]
    torch.manual_seed(0)
    kw = dict(vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, intermediate_size=DM,
              max_position_embeddings=CTX, pad_token_id=PAD, bos_token_id=0, eos_token_id=2,
              layer_norm_eps=1e-6, initializer_range=0.3)  # fmt: skip
    model = model_cls(config_cls(**kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias") or "position" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(tmp_path / model_type)
    ref: Any = model_cls.from_pretrained(tmp_path / model_type, attn_implementation="eager").eval()
    ours = hs.load(tmp_path / model_type)
    assert isinstance(ours, PretrainedEncoder)
    assert ours.config.extra["model_type"] == model_type and ours.config.extra["position_offset"] == PAD + 1
    tokens = torch.randint(PAD + 1, V, (2, 11), generator=torch.Generator().manual_seed(1))
    real = torch.ones(2, 11, dtype=torch.bool)
    tokens[1, 7:], real[1, 7:] = PAD, False
    with torch.no_grad():
        want = ref(input_ids=tokens, attention_mask=real.long(), output_attentions=True)
        with hs.trace(ours.model, names="*.hook_pattern") as t:
            got = ours.model(tokens, real)
    states = want.last_hidden_state
    torch.testing.assert_close(got[real], states[real], atol=1e-4 * float(states.abs().max()), rtol=0)
    for layer in range(L):
        ours_p, theirs = t.pattern(layer).transpose(1, 2), want.attentions[layer].transpose(1, 2)
        torch.testing.assert_close(ours_p[real], theirs[real], atol=1e-5, rtol=0)  # (real, H, 11)
