"""GGUF weights dequantised straight into a Decoder's parameters (``read_gguf(into=...)``, ``load_gguf``).

``load_gguf`` makes the Decoder with empty parameters (:func:`headspace.pretrained.llama.empty_llama`)
and has the reader write each tensor into its own: the result must be bit-identical to reading the
tensors into a dict and converting them (``llama_from_tensors``), every check must still run, and the
peak memory of loading SmolLM2 must stay near its float32 weights.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_gguf import write_tiny_llama

from headspace.pretrained.gguf import load_gguf
from headspace.pretrained.gguf_format import GGUFError, _parse_header, read_gguf
from headspace.pretrained.llama import _all_finite_floats, empty_llama, llama_from_tensors

PEAK_BUDGET = 1.3  # peak resident memory added by loading SmolLM2, over its float32 weights


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("in-place") / "tiny.gguf")


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


def test_load_gguf_equals_converting_a_dict(tiny: Path) -> None:
    """In place or through a dict of tensors: the same bits, parameters and settings."""
    ours = load_gguf(tiny)
    g = read_gguf(tiny)
    ref = llama_from_tensors(g.hf_config, g.tensors, g.tokenizer, name="tiny", source=str(tiny))
    _same(ours.model.state_dict(), ref.model.state_dict())
    assert [(n, p.requires_grad) for n, p in ours.model.named_parameters()] == [
        (n, p.requires_grad) for n, p in ref.model.named_parameters()
    ]
    assert not any(t.is_meta for t in [*ours.model.parameters(), *ours.model.buffers()])
    assert ours.model.config.to_dict() == ref.model.config.to_dict()
    ids = torch.tensor([[1, 5, 9, 3]])
    assert torch.equal(ours.model(ids), ref.model(ids))


def test_read_gguf_into_writes_the_given_tensors(tiny: Path) -> None:
    plain = read_gguf(tiny)
    calls: list[tuple[dict[str, Any], dict[str, tuple[int, ...]]]] = []
    given: dict[str, torch.Tensor] = {}

    def into(config: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        calls.append((config, shapes))
        given.update({k: torch.full(s, 7.0) for k, s in shapes.items()})
        return given

    g = read_gguf(tiny, into=into)
    assert len(calls) == 1
    assert calls[0][0] == plain.hf_config
    assert calls[0][1] == {k: tuple(v.shape) for k, v in plain.tensors.items()}
    assert all(g.tensors[k].data_ptr() == given[k].data_ptr() for k in given)  # written in place
    _same(g.tensors, plain.tensors)


def test_a_wrong_destination_is_the_callers_error(tiny: Path) -> None:
    def giving(change: Any) -> Any:
        def into(config: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> Any:
            return change({k: torch.empty(s) for k, s in shapes.items()})

        return into

    name = "model.layers.0.mlp.up_proj.weight"
    cases = {
        "no tensor for": lambda d: {k: v for k, v in d.items() if k != name},
        "must be a contiguous float32": lambda d: d | {name: d[name].double()},
        "of shape": lambda d: d | {name: d[name][:-1]},
        "not contiguous": lambda d: d | {name: d[name].t().contiguous().t()},
    }
    for message, change in cases.items():
        with pytest.raises(ValueError, match=message) as info:
            read_gguf(tiny, into=giving(change))
        assert not isinstance(info.value, GGUFError)
    with pytest.raises(TypeError, match="must return a dict"):
        read_gguf(tiny, into=giving(lambda d: list(d.values())))

    class Refused(Exception):
        pass

    def refuse(config: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> Any:
        raise Refused("no")

    with pytest.raises(Refused):  # as it is, not wrapped as a malformed file
        read_gguf(tiny, into=refuse)


def test_a_file_is_checked_before_into_is_called(tiny: Path, tmp_path: Path) -> None:
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(tiny.read_bytes()[: tiny.stat().st_size // 2])

    def into(config: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> Any:
        raise AssertionError("into() called for a truncated file")

    with pytest.raises(GGUFError, match="truncated"):
        read_gguf(bad, into=into)


def test_a_nan_weight_in_a_gguf_is_refused_by_name(tiny: Path, tmp_path: Path) -> None:
    path = tmp_path / "nan.gguf"
    path.write_bytes(tiny.read_bytes())
    with path.open("rb") as f:
        header = _parse_header(f, path.stat().st_size, path)
    info = next(t for t in header.tensors if t.name == "blk.1.ffn_down.weight")  # F32
    with path.open("r+b") as f:
        f.seek(header.data_start + info.offset + 4 * 5)
        f.write(np.array([np.nan], dtype="<f4").tobytes())
    with pytest.raises(ValueError, match=r"weight 'model.layers.1.mlp.down_proj.weight' has 1 NaN/Inf"):
        load_gguf(path)


def test_finiteness_pass_is_exact_about_overflow_and_narrow_floats() -> None:
    big = torch.full((4,), 3e38)  # finite values whose float32 sum overflows
    assert not _all_finite_floats({"w": big}, ["w"])  # -> the exact check, which finds nothing wrong
    hf = {
        "model_type": "llama", "vocab_size": 8, "hidden_size": 4, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": 8, "tie_word_embeddings": True,
    }  # fmt: skip
    e = empty_llama(hf, {"model.embed_tokens.weight": (8, 4)} | _layer_shapes(), source="mem")
    for t in e.destinations.values():
        t.fill_(0.5)
    e.destinations["model.norm.weight"].copy_(big)
    assert e.finish().model.ln_final.weight[0].item() == pytest.approx(3e38)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        ok = torch.ones(3 << 20, dtype=dtype)
        assert _all_finite_floats({"w": ok}, ["w"])
        ok[-1] = math.inf
        assert not _all_finite_floats({"w": ok}, ["w"])
        ok[-1] = math.nan
        assert not _all_finite_floats({"w": ok}, ["w"])


def _layer_shapes() -> dict[str, tuple[int, ...]]:
    p = "model.layers.0."
    return {
        p + "self_attn.q_proj.weight": (4, 4),
        p + "self_attn.k_proj.weight": (4, 4),
        p + "self_attn.v_proj.weight": (4, 4),
        p + "self_attn.o_proj.weight": (4, 4),
        p + "mlp.gate_proj.weight": (8, 4),
        p + "mlp.up_proj.weight": (8, 4),
        p + "mlp.down_proj.weight": (4, 8),
        p + "input_layernorm.weight": (4,),
        p + "post_attention_layernorm.weight": (4,),
        "model.norm.weight": (4,),
    }


def test_empty_llama_checks_shapes_before_allocating() -> None:
    hf = {
        "model_type": "llama", "vocab_size": 8, "hidden_size": 4, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": 8, "tie_word_embeddings": True,
    }  # fmt: skip
    shapes = {"model.embed_tokens.weight": (8, 4)} | _layer_shapes()
    with pytest.raises(ValueError, match=r"mlp\.up_proj\.weight"):
        empty_llama(hf, shapes | {"model.layers.0.mlp.up_proj.weight": (8, 5)})
    with pytest.raises(ValueError, match="missing"):
        empty_llama(hf, {k: v for k, v in shapes.items() if "norm" not in k})
    with pytest.raises(ValueError, match="implies"):  # an absurd config, refused from the counts alone
        empty_llama(hf | {"num_hidden_layers": 10**6}, shapes)
    with pytest.raises(ValueError, match="tied"):
        empty_llama(hf, shapes | {"lm_head.weight": (8, 4)})


_PROBE = """
import json, sys, torch
torch.set_num_threads(2)
import headspace
from headspace.pretrained.gguf import load_gguf
def status(field):
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith(field + ":")).split()[1]) / 1024
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS (ru_maxrss would count the parent's resident set at the fork)
before = status("VmRSS")
model = load_gguf(sys.argv[1]).model
peak = status("VmHWM")
weights = sum(p.numel() for p in model.parameters()) * 4 / 2**20
print(json.dumps({"peak": peak - before, "after": status("VmRSS") - before, "weights": weights}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status and clear_refs")
def test_smollm2_load_peak_memory_stays_near_its_weights(smollm2_gguf: Path) -> None:
    path = smollm2_gguf
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(path)], capture_output=True, text=True, check=True, timeout=300
    )
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["peak"] <= PEAK_BUDGET * got["weights"], got
    assert got["after"] <= PEAK_BUDGET * got["weights"], got
