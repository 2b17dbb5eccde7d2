"""The atlas on a model with learned sinks (a tiny gpt-oss built by transformers): each head's sink mass
(the mean over the corpus of ``1 - sum_j p_j``) beside its first-token mass, both equal to the same means
taken from transformers' own attention weights; NaN (null in atlas.json, absent from the page) for a model
without sinks."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

import headspace as hs
from headspace.analysis import atlas
from headspace.viz.atlas.page import atlas_page_data

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, H, DH, DM, E, K, W = 29, 24, 2, 4, 6, 10, 3, 2, 3  # vocab, hidden, layers, heads, ..., window


def build_gpt_oss(folder: Path) -> Any:
    """A random gpt-oss (sliding then full layer) saved into ``folder``, every parameter random (the
    zero-initialised sinks too); returns transformers' model read back with eager attention."""
    torch.manual_seed(6)
    config = T.GptOssConfig(
        vocab_size=V, hidden_size=D, intermediate_size=DM, num_hidden_layers=L, num_attention_heads=H,
        num_key_value_heads=2, head_dim=DH, num_local_experts=E, num_experts_per_tok=K, sliding_window=W,
        max_position_embeddings=32, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, pad_token_id=0, eos_token_id=None,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = T.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1.0 if ("router" in name or "sinks" in name) else 0.3
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else scale * torch.randn_like(p))
    model.save_pretrained(folder)
    return T.GptOssForCausalLM.from_pretrained(
        folder, attn_implementation="eager", experts_implementation="eager"
    ).eval()


def documents() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, V, (n,), generator=g) for n in (13, 5, 9)]


def reference_means(ref: Any, docs: list[torch.Tensor], window: int) -> dict[str, torch.Tensor]:
    """sink (every query) and first (queries i >= 1) per [layer, head], from transformers' weights."""
    sink = torch.zeros(L, H, dtype=torch.float64)
    first = torch.zeros(L, H, dtype=torch.float64)
    n_all = n_later = 0
    for d in docs:
        for s in range(0, d.shape[0], window):
            t = d[s : s + window]
            with torch.no_grad():
                att = ref(input_ids=t[None], output_attentions=True).attentions
            for layer in range(L):
                p = att[layer][0].double()  # (H, n, n)
                sink[layer] += (1 - p.sum(-1)).sum(-1)
                first[layer] += p[:, 1:, 0].sum(-1)
            n_all += t.shape[0]
            n_later += t.shape[0] - 1
    return {"sink": sink / n_all, "first": first / n_later}


def test_atlas_sink_mass_beside_first_token_mass_equals_transformers(tmp_path: Path) -> None:
    ref = build_gpt_oss(tmp_path / "gpt_oss")
    model = hs.load(tmp_path / "gpt_oss").model
    docs = documents()
    result = atlas(model, docs, window=7, batch_size=2, top_k=2, ablation=False, progress=False)
    want = reference_means(ref, docs, 7)
    torch.testing.assert_close(result.stats["sink"], want["sink"], atol=2e-6, rtol=0)
    torch.testing.assert_close(result.stats["first"], want["first"], atol=2e-6, rtol=0)
    assert float(result.stats["sink"].min()) > 0.01  # the sinks took mass in every head
    # the repeated-token induction score recomputes patterns without the sinks: NaN, not a wrong number
    assert bool(result.stats["induction_repeated"].isnan().all())
    d = json.loads(json.dumps(result.to_dict()))
    assert list(d).index("sink") == list(d).index("first") + 1  # beside the first-token mass
    assert len(d["sink"]) == L and all(len(row) == H for row in d["sink"])
    assert "sink" in atlas_page_data(d)["stat_names"]


def test_atlas_sink_is_nan_for_a_model_without_sinks() -> None:
    torch.manual_seed(0)
    cfg = hs.ModelConfig(arch="decoder", vocab_size=V, d_model=D, n_layers=L, n_heads=H, d_mlp=DM,
                         max_seq_len=32, dropout=0.0, attn_dropout=0.0, emb_dropout=0.0)  # fmt: skip
    result = atlas(hs.Decoder(cfg).eval(), documents(), window=7, batch_size=2, ablation=False,
                   induction_repeated=False, progress=False)  # fmt: skip
    assert all(math.isnan(v) for v in result.stats["sink"].flatten().tolist())
    d = json.loads(json.dumps(result.to_dict()))
    assert all(v is None for row in d["sink"] for v in row)
    assert "sink" not in atlas_page_data(d)["stat_names"]
