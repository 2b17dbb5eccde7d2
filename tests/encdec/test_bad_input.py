"""Encoder-decoder folders and inputs that do not fit are refused in one line naming what was expected."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import headspace
from conftest import inputs_of
from headspace.model.encdec import EncDecConfig


def _copy(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest)
    return dest


def _edit_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    hf = json.loads(path.read_text())
    hf.update(changes)
    path.write_text(json.dumps(hf))


def test_refuses_a_missing_and_a_misshaped_tensor(tiny, tmp_path: Path) -> None:
    folder = _copy(tiny("bart")[0], tmp_path / "bart")
    t = load_file(folder / "model.safetensors")
    del t["model.decoder.layers.1.encoder_attn.k_proj.weight"]
    t["model.encoder.layers.0.fc1.bias"] = torch.zeros(7)
    save_file(t, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"1 missing, 1 mis-shaped") as e:
        headspace.load(folder)
    assert "model.decoder.layers.1.encoder_attn.k_proj.weight" in str(e.value)


def test_refuses_an_untied_unembedding(tiny, tmp_path: Path) -> None:
    folder = _copy(tiny("whisper")[0], tmp_path / "whisper")
    t = load_file(folder / "model.safetensors")
    t["proj_out.weight"] = t["model.decoder.embed_tokens.weight"] + 1.0
    save_file(t, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"proj_out.weight differs from model.decoder.embed_tokens.weight"):
        headspace.load(folder)


@pytest.mark.parametrize(
    ("kind", "changes", "message"),
    [
        (
            "bart",
            {"decoder_attention_heads": 5},
            r"encoder_attention_heads=3 and decoder_attention_heads=5 differ",
        ),
        ("marian", {"share_encoder_decoder_embeddings": False}, r"share_encoder_decoder_embeddings=False"),
        ("t5", {"dense_act_fn": "mish"}, r"does not fit headspace: dense_act_fn='mish'"),
        ("t5", {"d_kv": "7"}, r"d_kv must be an int >= 1; got '7'"),
        ("whisper", {"activation_function": 3}, r"activation_function must be a string"),
    ],
)
def test_refuses_configs_it_cannot_represent(
    tiny, tmp_path: Path, kind: str, changes: dict, message: str
) -> None:
    folder = _copy(tiny(kind)[0], tmp_path / kind)
    _edit_config(folder, **changes)
    with pytest.raises(ValueError, match=message) as e:
        headspace.load(folder)
    assert "\n" not in str(e.value)


def test_refuses_reduced_precision_by_name(tiny) -> None:
    with pytest.raises(ValueError, match=r"float32' only for now; got 'bfloat16'"):
        headspace.load(tiny("t5")[0], precision="bfloat16")


def test_refuses_bad_inputs_in_one_line(tiny) -> None:
    m = headspace.load(tiny("whisper")[0])
    x = inputs_of("whisper")
    y = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(
        ValueError, match=r"input_features must be \[batch, n_mels=7, frames <= 22\]; got \[2, 7, 23\]"
    ):
        m(torch.randn(2, 7, 23), y)
    with pytest.raises(
        ValueError, match=r"input_features must be a float tensor \[batch, n_mels=7, frames\]"
    ):
        m(torch.zeros(2, 7, dtype=torch.long), y)
    with pytest.raises(ValueError, match=r"attention_mask is for token inputs; an audio encoder"):
        m(x, y, torch.ones(2, 22))
    bart = headspace.load(tiny("bart")[0])
    with pytest.raises(
        ValueError, match=r"attention_mask must be \[batch, seq\] = \[2, 9\] \(1: real token\); got \[2, 8\]"
    ):
        bart(inputs_of("bart"), y, torch.ones(2, 8))
    with pytest.raises(
        ValueError, match=r"decoder_input_ids must hold token ids in \[0, 37\); got ids 0..40"
    ):
        m(x, torch.tensor([[0, 40]]).expand(2, 2))
    with pytest.raises(
        ValueError, match=r"decoder_input_ids must be an int64 tensor \[batch, seq\]; got torch.float32"
    ):
        m(x, torch.zeros(2, 3))


def test_config_checks_name_the_field() -> None:
    base = dict(
        vocab_size=10, d_model=8, n_heads=2, d_head=4, d_mlp=16, n_encoder_layers=1, n_decoder_layers=1
    )
    with pytest.raises(
        ValueError, match=r"EncDecConfig.layout must be one of \['post', 'pre'\]; got 'sandwich'"
    ):
        EncDecConfig(**base, layout="sandwich")
    with pytest.raises(
        ValueError, match=r"EncDecConfig.eos_token_id must be a token id in \[0, 10\); got 10"
    ):
        EncDecConfig(**base, eos_token_id=10)
    with pytest.raises(ValueError, match=r"EncDecConfig.n_heads must be a positive int; got 0"):
        EncDecConfig(**{**base, "n_heads": 0})


def test_commands_refuse_an_encoder_decoder_by_name(tiny) -> None:
    from click.testing import CliRunner

    from headspace.cli import cli

    folder = tiny("t5")[0]
    res = CliRunner().invoke(cli, ["heads", "--model", str(folder)])
    assert res.exit_code == 2, res.output
    line = res.output.strip()
    assert len(line.splitlines()) == 1
    assert line.startswith(f"error: --model {folder}: an encoder-decoder (")
    assert "this command does not handle encoder-decoders yet (explain, align, patch, attribute, why" in line
