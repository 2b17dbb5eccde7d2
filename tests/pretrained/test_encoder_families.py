"""RoBERTa against transformers 5 itself: BERT whose learned positions start past the padding index.

References: tiny random checkpoints built and saved by transformers (odd sizes, every LayerNorm and
bias random, a non-default ``pad_token_id`` so that the offset ``pad_token_id + 1`` is not RoBERTa's
usual 2), read back with ``headspace.load`` and compared with transformers' eager forward: hidden
states within 1e-4 of their largest magnitude, every head's pattern within 1e-5, with and without
padding in the batch (padding rows: the real queries' rows; a padding token's own row is never
attended to and reads another position row in RoBERTa).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

import headspace as hs
from headspace.pretrained import PretrainedEncoder

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, H, DM, CTX, PAD = (
    83,
    48,
    3,
    4,
    37,
    40,
    5,
)  # vocab, hidden, layers, heads (d_head 12), mlp, table, pad


def _config(**over: Any) -> Any:
    kw = dict(vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, intermediate_size=DM,
              max_position_embeddings=CTX, pad_token_id=PAD, bos_token_id=0, eos_token_id=2,
              type_vocab_size=2, layer_norm_eps=1e-6, hidden_act="gelu_new",
              initializer_range=0.3)  # fmt: skip
    return T.RobertaConfig(**{**kw, **over})


def _randomise(model: Any) -> None:
    with torch.no_grad():  # LayerNorms, biases and positions away from their start, so a wrong one shows
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias") or "position" in name:
                p.add_(torch.randn_like(p) * 0.3)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    torch.manual_seed(0)
    model = T.RobertaModel(_config())
    _randomise(model)
    folder = tmp_path_factory.mktemp("roberta")
    model.save_pretrained(folder)
    return folder, T.RobertaModel.from_pretrained(folder, attn_implementation="eager").eval()


def _batch(padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [2, 13], key_padding [2, 13]): real tokens avoid PAD; padded: row 1 ends in 5 PADs."""
    tokens = torch.randint(PAD + 1, V, (2, 13), generator=torch.Generator().manual_seed(1))
    real = torch.ones(2, 13, dtype=torch.bool)
    if padded:
        tokens[1, 8:] = PAD
        real[1, 8:] = False
    return tokens, real


@pytest.mark.parametrize("padded", [False, True])
def test_states_and_every_head_pattern_equal_transformers(saved: tuple[Path, Any], padded: bool) -> None:
    folder, ref = saved
    ours = hs.load(folder)
    assert isinstance(ours, PretrainedEncoder) and ours.config.extra["position_offset"] == PAD + 1
    tokens, real = _batch(padded)
    types = torch.randint(0, 2, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(input_ids=tokens, attention_mask=real.long(), token_type_ids=types, output_attentions=True)
        with hs.trace(ours.model, names="*.hook_pattern") as t:
            got = ours.model(tokens, real, types)
    bound = 1e-4 * float(want.last_hidden_state.abs().max())
    torch.testing.assert_close(got[real], want.last_hidden_state[real], atol=bound, rtol=0)
    for layer in range(L):
        ours_p, theirs = t.pattern(layer), want.attentions[layer]  # (2, H, 13, 13)
        torch.testing.assert_close(
            ours_p.transpose(1, 2)[real], theirs.transpose(1, 2)[real], atol=1e-5, rtol=0
        )
    assert ours.pooler is not None
    pooled = torch.tanh(ours.pooler(got[:, 0]))  # (2, D): the first token is real in both rows
    torch.testing.assert_close(pooled, want.pooler_output, atol=1e-5, rtol=0)


def test_position_table_is_shifted_past_the_padding_index(saved: tuple[Path, Any]) -> None:
    folder, ref = saved
    ours = hs.load(folder)
    table = ref.embeddings.position_embeddings.weight  # [CTX, D]
    assert ours.config.max_seq_len == CTX - PAD - 1
    torch.testing.assert_close(ours.model.pos_embed.weight, table[PAD + 1 :], atol=0, rtol=0)


def test_a_masked_lm_checkpoint_loads_its_encoder_and_lists_its_head(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = T.RobertaForMaskedLM(_config(type_vocab_size=1, pad_token_id=1))
    _randomise(model)
    model.save_pretrained(tmp_path / "mlm")
    ref = T.RobertaForMaskedLM.from_pretrained(tmp_path / "mlm", attn_implementation="eager").eval()
    ours = hs.load(tmp_path / "mlm")
    assert ours.config.extra["position_offset"] == 2 and any(n.startswith("lm_head.") for n in ours.ignored)
    tokens = torch.randint(2, V, (1, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ref.roberta(input_ids=tokens).last_hidden_state
        got = ours.model(tokens)
    torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        (
            "max_position_embeddings",
            PAD + 1,
            "max_position_embeddings=6 leaves no position past pad_token_id=5",
        ),
        ("position_embedding_type", "relative_key", "position_embedding_type"),
        ("is_decoder", True, "is_decoder"),
    ],
)
def test_what_headspace_cannot_run_is_refused_by_field_name(
    saved: tuple[Path, Any], tmp_path: Path, key: str, value: Any, match: str
) -> None:
    folder = tmp_path / "roberta"
    shutil.copytree(saved[0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(ValueError, match=match) as info:
        hs.load(folder)
    assert "\n" not in str(info.value)


def test_sentence_transformers_max_seq_length_is_read_as_for_bert(
    saved: tuple[Path, Any], tmp_path: Path
) -> None:
    folder = tmp_path / "st"
    shutil.copytree(saved[0], folder)
    assert hs.load(folder).max_length == CTX - PAD - 1  # the shifted table's length
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 7}))
    assert hs.load(folder).max_length == 7
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": "7"}))
    with pytest.raises(ValueError, match=r"sentence_bert_config.json: max_seq_length must be an int >= 1"):
        hs.load(folder)
