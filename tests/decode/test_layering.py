"""Decoding sits above the model at run time (issue #37): the KV cache lives below the attention layer
(``headspace.nn.kv_cache``), the model never imports ``headspace.decode``, and ``Decoder.generate`` /
``decode_plan`` still work whichever path the model class was imported by."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import headspace
import headspace.decode
from headspace.model import decoding as registry


def _fresh(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_the_kv_cache_lives_below_the_attention_layer_and_keeps_its_old_paths() -> None:
    import headspace.decode.kv_cache as old
    import headspace.nn.kv_cache as new

    assert old is new and new.__name__ == "headspace.nn.kv_cache"
    assert headspace.decode.KVCache is new.KVCache is headspace.KVCache
    from headspace.attention.layer import KVCache

    assert KVCache is new.KVCache


def test_the_model_imports_no_decoding_until_it_decodes() -> None:
    code = (
        "import sys\n"
        "from headspace.model.models import Decoder, ModelConfig\n"
        "import headspace.attention, headspace.model.block\n"
        "print(sorted(m for m in sys.modules if m.startswith('headspace.decode')))\n"
        "import torch\n"
        "torch.manual_seed(0)\n"
        "c = ModelConfig(arch='decoder', vocab_size=40, d_model=16, n_heads=2, n_layers=2, max_seq_len=16)\n"
        "m = Decoder(c)\n"
        "out = m.generate(torch.tensor([[1, 2, 3]]), 4, temperature=0)\n"
        "print(tuple(out.shape), 'headspace.decode' in sys.modules)\n"
    )
    before, after = _fresh(code).splitlines()
    assert before == "[]"  # the model, its blocks and attention import nothing of headspace.decode
    assert after == "(1, 7) True"  # the first generate loaded it (headspace/__init__'s loader)


def test_generate_and_decode_plan_run_the_registered_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    config = headspace.ModelConfig(
        arch="decoder", vocab_size=40, d_model=16, n_heads=2, n_layers=1, max_seq_len=16
    )
    model = headspace.Decoder(config).eval()
    tokens = torch.tensor([[1, 2, 3]])
    plan = model.decode_plan()
    assert isinstance(plan, headspace.decode.Stepper)
    assert torch.equal(
        model.generate(tokens, 3, temperature=0), headspace.decode.generate(model, tokens, 3, temperature=0)
    )
    seen: list[str] = []

    def generate(model: object, tokens: torch.Tensor, new: int, **options: object) -> torch.Tensor:
        seen.append(f"generate {new} {sorted(options)}")
        return tokens

    def plan_of(model: object, pack_rows: int | None = None) -> None:
        seen.append(f"plan {pack_rows}")

    monkeypatch.setattr(registry, "_provided", [registry.Decoding(generate=generate, plan=plan_of)])
    assert model.generate(tokens, 2, seed=1) is tokens
    assert model.decode_plan(4) is None
    assert seen == ["generate 2 ['seed']", "plan 4"]


def test_no_decoding_registered_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_provided", [])
    monkeypatch.setattr(registry, "_loaders", [])
    with pytest.raises(
        RuntimeError, match=r"^Decoder.generate and decode_plan need .*import headspace.decode$"
    ):
        registry.decoding()
    with pytest.raises(TypeError, match="provide_decoding expects"):
        registry.provide_decoding(object())  # type: ignore[arg-type]
