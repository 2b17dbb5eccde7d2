"""Header-first checks of the family loaders: a tensor of the wrong shape, or a missing one, is refused
from the safetensors header alone, before any tensor's payload is read.

Each folder is a tiny random checkpoint saved by transformers itself, whose ``model.safetensors`` is then
rewritten with one tensor one row too long (or without it). The tensor reader
(``headspace.pretrained.hf.safe_open``, through which every payload is read) is replaced by one that
fails, so a loader that reads any tensor before checking the header fails with that reader's error
instead of the shape error. A control shows the replaced reader is the one the loaders use: an intact
folder then fails on its first read.

gpt_neox, bloom, opt, gpt_bigcode and phi3 read every tensor before checking shapes at 5e3c064 (these
cases fail there); mixtral, diffllama and roberta checked their headers first already and guard the
shared frame (pretrained/family_frame.py) they now go through.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

import headspace as hs
from headspace.pretrained import hf as hf_module

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, L, H, DM, CTX = 61, 24, 2, 2, 37, 32  # vocab, hidden, layers, heads (d_head 12), mlp, context

#: family -> (config class, model class, config fields, the tensor the test breaks)
FAMILIES: dict[str, tuple[Any, Any, dict[str, Any], str]] = {
    "gpt_neox": (
        T.GPTNeoXConfig,
        T.GPTNeoXForCausalLM,
        dict(
            hidden_size=D,
            num_hidden_layers=L,
            num_attention_heads=H,
            intermediate_size=DM,
            rope_parameters={"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5},
        ),
        "gpt_neox.layers.1.mlp.dense_4h_to_h.weight",
    ),
    "bloom": (
        T.BloomConfig,
        T.BloomForCausalLM,
        dict(hidden_size=D, n_layer=L, n_head=H),
        "transformer.h.1.mlp.dense_4h_to_h.weight",
    ),
    "opt": (
        T.OPTConfig,
        T.OPTForCausalLM,
        dict(hidden_size=D, num_hidden_layers=L, num_attention_heads=H, ffn_dim=DM, word_embed_proj_dim=D),
        "model.decoder.layers.1.fc2.weight",
    ),
    "gpt_bigcode": (
        T.GPTBigCodeConfig,
        T.GPTBigCodeForCausalLM,
        dict(n_embd=D, n_layer=L, n_head=H, n_inner=DM, n_positions=CTX),
        "transformer.h.1.mlp.c_proj.weight",
    ),
    "phi3": (
        T.Phi3Config,
        T.Phi3ForCausalLM,
        dict(
            hidden_size=D,
            num_hidden_layers=L,
            num_attention_heads=H,
            num_key_value_heads=1,
            intermediate_size=DM,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        "model.layers.1.mlp.down_proj.weight",
    ),
    "mixtral": (
        T.MixtralConfig,
        T.MixtralForCausalLM,
        dict(
            hidden_size=D,
            num_hidden_layers=L,
            num_attention_heads=H,
            num_key_value_heads=1,
            intermediate_size=DM,
            num_local_experts=3,
            num_experts_per_tok=2,
        ),
        "model.layers.1.self_attn.o_proj.weight",
    ),
    "diffllama": (
        T.DiffLlamaConfig,
        T.DiffLlamaForCausalLM,
        dict(
            hidden_size=D,
            num_hidden_layers=L,
            num_attention_heads=2 * H,
            num_key_value_heads=H,
            head_dim=6,
            intermediate_size=DM,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=None,
        ),
        "model.layers.1.self_attn.lambda_q1",
    ),
    "roberta": (
        T.RobertaConfig,
        T.RobertaModel,
        dict(
            hidden_size=D,
            num_hidden_layers=L,
            num_attention_heads=H,
            intermediate_size=DM,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
        ),
        "encoder.layer.1.output.dense.weight",
    ),
}


def _checkpoint(root: Path, family: str) -> Path:
    """A tiny random checkpoint of ``family`` saved by transformers into ``root / family``."""
    config_cls, model_cls, fields, _ = FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(vocab_size=V, max_position_embeddings=CTX, **fields)
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # every zero-initialised parameter (biases, norms) made random
            if not p.any():
                p.normal_(0.0, 0.1)
    folder = root / family
    model.save_pretrained(folder)
    return folder


def _rewrite(folder: Path, change: Any) -> None:
    """``model.safetensors`` rewritten with ``change(tensors)`` applied (a valid file, new shapes)."""
    file = folder / "model.safetensors"
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


class _PayloadRead(Exception):
    pass


def _no_payload(*args: Any, **kwargs: Any) -> Any:
    raise _PayloadRead("a tensor's payload was read before the header was checked")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``saved(family)``: the family's checkpoint folder, built once per module."""
    root = tmp_path_factory.mktemp("header_first")
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = _checkpoint(root, family)
        return made[family]

    return get


@pytest.fixture
def copy_of(saved: Any, tmp_path: Path) -> Any:
    def copy(family: str) -> Path:
        target = tmp_path / family
        target.mkdir()
        for f in saved(family).iterdir():
            (target / f.name).write_bytes(f.read_bytes())
        return target

    return copy


@pytest.mark.parametrize("family", list(FAMILIES))
def test_wrong_shape_is_refused_before_any_payload_is_read(
    family: str, copy_of: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = copy_of(family)
    name = FAMILIES[family][3]
    shapes: dict[str, list[int]] = {}

    def grow(t: dict[str, torch.Tensor]) -> None:
        assert name in t, sorted(t)
        shapes["expected"] = list(t[name].shape)
        t[name] = torch.cat([t[name], t[name][:1]])  # one row too many: [rows + 1, ...]
        shapes["found"] = list(t[name].shape)

    _rewrite(folder, grow)
    monkeypatch.setattr(hf_module, "safe_open", _no_payload)
    with pytest.raises(ValueError) as info:
        hs.load(folder)
    message = str(info.value)
    assert "payload was read" not in message
    assert f"{name}: expected {shapes['expected']}, found {shapes['found']}" in message
    assert message.startswith(str(folder / "model.safetensors"))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_missing_tensor_is_refused_before_any_payload_is_read(
    family: str, copy_of: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = copy_of(family)
    name = FAMILIES[family][3]
    _rewrite(folder, lambda t: t.pop(name))
    monkeypatch.setattr(hf_module, "safe_open", _no_payload)
    with pytest.raises(ValueError) as info:
        hs.load(folder)
    message = str(info.value)
    assert "payload was read" not in message
    assert "missing tensor" in message and name in message
    assert "\n" not in message.split("missing tensor")[0]  # the first line says what is wrong


@pytest.mark.parametrize("family", ["gpt_neox", "mixtral"])
def test_the_replaced_reader_is_the_one_the_loaders_use(
    family: str, copy_of: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = copy_of(family)
    assert hs.load(folder).model.config.n_layers == L  # intact, with the real reader
    monkeypatch.setattr(hf_module, "safe_open", _no_payload)
    with pytest.raises(ValueError, match="payload was read"):
        hs.load(folder)


def test_pieces_that_cannot_be_fused_are_refused_in_one_line_before_any_payload_is_read(
    copy_of: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OPT's q, k, v are fused into one matrix; a q_proj one column too wide cannot be (torch's
    RuntimeError at 5e3c064, after reading every tensor): a one-line ValueError naming the file."""
    folder = copy_of("opt")
    name = "model.decoder.layers.1.self_attn.q_proj.weight"

    def widen(t: dict[str, torch.Tensor]) -> None:
        t[name] = torch.cat([t[name], t[name][:, :1]], dim=1)  # [d, d + 1]

    _rewrite(folder, widen)
    monkeypatch.setattr(hf_module, "safe_open", _no_payload)
    with pytest.raises(ValueError) as info:
        hs.load(folder)
    message = str(info.value)
    assert "\n" not in message and "payload was read" not in message
    assert message.startswith(f"{folder / 'model.safetensors'} does not match its config.json: ")
    assert f"{name} {[D, D + 1]}" in message  # the tensor named, with its shape
