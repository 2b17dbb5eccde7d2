"""Tiny random Gemma 3 GGUF files (written with the `gguf` package), read by headspace and by transformers.

The real Gemma-3-270M is tests/pretrained/test_gemma3.py; these are fast and check what a file can get
wrong: the configuration transformers makes of the same metadata, every tensor (norms stored as 1 + w),
the SentencePiece vocabulary with its implied merges, files in parts, and hostile metadata.
"""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path
from typing import Any

import gguf  # a dev dependency (the K-quants' dequantisation): imported, not skipped
import numpy as np
import pytest
import torch

import headspace as hs
from headspace.pretrained.gguf_format import GGUFError, read_gguf

Q = gguf.GGMLQuantizationType

# hidden 256: every row a whole number of K-quant blocks; 7 layers: sliding 0-4 and 6, full 5; head_dim
# 256 as Gemma 3's (transformers always scales by 1/sqrt(256); headspace, as llama.cpp, by 1/sqrt(head_dim))
TINY = {"hidden": 256, "intermediate": 512, "layers": 7, "heads": 4, "kv_heads": 1, "head_dim": 256}
WINDOW = 5
CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
WORDS = ["▁the", "▁cat", "▁sat", "▁on", "▁mat", "at", "th", "he", "▁t", "▁c", "▁s", "▁m", "▁o", "on", "ca"]


def _vocab() -> tuple[list[str], list[int]]:
    """Control tokens, 256 byte pieces, the characters, two real-space runs (user-defined), words."""
    chars = sorted({c for w in WORDS for c in w})
    tokens = [*CONTROL, *(f"<0x{b:02X}>" for b in range(256)), *chars, "  ", "   ", "\n\n"]
    tokens += [w for w in WORDS if w not in tokens]
    types = [3] * len(CONTROL) + [6] * 256 + [1] * len(chars) + [4, 4, 4]
    types += [1] * (len(tokens) - len(types))
    return tokens, types


def _shapes() -> dict[str, tuple[int, ...]]:
    h, i, d = TINY["hidden"], TINY["intermediate"], TINY["head_dim"]
    q, kv = TINY["heads"] * d, TINY["kv_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (len(_vocab()[0]), h),
        "output_norm.weight": (h,),
    }
    for b in range(TINY["layers"]):
        shapes |= {
            f"blk.{b}.attn_norm.weight": (h,),
            f"blk.{b}.post_attention_norm.weight": (h,),
            f"blk.{b}.ffn_norm.weight": (h,),
            f"blk.{b}.post_ffw_norm.weight": (h,),
            f"blk.{b}.attn_q_norm.weight": (d,),
            f"blk.{b}.attn_k_norm.weight": (d,),
            f"blk.{b}.attn_q.weight": (q, h),
            f"blk.{b}.attn_k.weight": (kv, h),
            f"blk.{b}.attn_v.weight": (kv, h),
            f"blk.{b}.attn_output.weight": (h, q),
            f"blk.{b}.ffn_gate.weight": (i, h),
            f"blk.{b}.ffn_up.weight": (i, h),
            f"blk.{b}.ffn_down.weight": (h, i),
        }
    return shapes


def write_tiny_gemma3(path: Path, *, kv: dict[str, Any] | None = None, seed: int = 0) -> Path:
    """A tiny valid Gemma 3 GGUF (Q8_0 / Q4_K / Q6_K / F32 tensors), or with metadata ``kv`` changed
    (None deletes a key)."""
    rng = np.random.default_rng(seed)
    tokens, types = _vocab()
    arch = "gemma3"
    meta: dict[str, Any] = {
        "general.name": "tiny gemma",
        f"{arch}.block_count": TINY["layers"],
        f"{arch}.context_length": 64,
        f"{arch}.embedding_length": TINY["hidden"],
        f"{arch}.feed_forward_length": TINY["intermediate"],
        f"{arch}.attention.head_count": TINY["heads"],
        f"{arch}.attention.head_count_kv": TINY["kv_heads"],
        f"{arch}.attention.key_length": TINY["head_dim"],
        f"{arch}.attention.value_length": TINY["head_dim"],
        f"{arch}.rope.freq_base": 1e6,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.attention.sliding_window": WINDOW,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [-1000.0] * len(tokens),
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
    }
    for key, value in (kv or {}).items():
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, shape in _shapes().items():
        values = (rng.standard_normal(shape) * 0.05).astype(np.float32)  # [*shape]
        if len(shape) == 1:
            writer.add_tensor(name, values + 1.0)  # norms are stored as 1 + w
        elif "attn_q." in name or "ffn_down" in name:
            qtype = Q.Q4_K if "attn_q." in name else Q.Q6_K  # K-quants: random blocks with sane scales
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            blocks = rng.integers(0, 256, size=(shape[0], shape[1] // block, size), dtype=np.uint8)
            where = (0, 2) if qtype == Q.Q4_K else (208,)
            for start in where:
                scale = np.frombuffer(np.float16(rng.uniform(0.001, 0.01)).tobytes(), dtype=np.uint8)
                blocks[:, :, start : start + 2] = scale
            writer.add_tensor(name, blocks.reshape(shape[0], -1), raw_dtype=qtype)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, Q.Q8_0), raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3(tmp_path_factory.mktemp("gemma") / "tiny-gemma3.gguf")


@pytest.fixture(scope="module")
def hf(tiny: Path) -> Any:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    model = transformers.Gemma3ForCausalLM.from_pretrained(
        str(tiny.parent), gguf_file=tiny.name, dtype=torch.float32, attn_implementation="eager"
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny.parent), gguf_file=tiny.name)
    return model.eval(), tokenizer


def test_tiny_gemma3_config_and_tensors_equal_transformers(tiny: Path, hf: Any) -> None:
    g = read_gguf(tiny)
    model, _ = hf
    assert g.arch == "gemma3" and g.hf_config["model_type"] == "gemma3_text"
    c = model.config
    assert g.hf_config["layer_types"] == c.layer_types
    assert g.hf_config["sliding_window"] == c.sliding_window == WINDOW
    assert g.hf_config["query_pre_attn_scalar"] == c.query_pre_attn_scalar == TINY["head_dim"]
    assert g.hf_config["hidden_activation"] == c.hidden_activation
    assert g.hf_config["rope_theta"] == c.rope_parameters["full_attention"]["rope_theta"]
    assert g.hf_config["rope_local_base_freq"] == c.rope_parameters["sliding_attention"]["rope_theta"]
    ref = model.state_dict()
    assert set(g.tensors) == set(ref) - {"lm_head.weight"}
    for name, t in g.tensors.items():
        assert torch.equal(t, ref[name]), name  # dequantised alike, norms 1 + w -> w, Q/K not permuted


def test_tiny_gemma3_logits_and_generation_equal_transformers(tiny: Path, hf: Any) -> None:
    model, _ = hf
    ours = hs.load(tiny)
    ids = torch.tensor([[2, *range(270, 288)]])  # [1, 19]: longer than the window of 5
    with torch.no_grad():
        want = model(ids).logits
        got = ours.model(ids)
        assert (got - want).abs().max() <= 1e-4
        greedy = model.generate(ids[:, :4], max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert torch.equal(ours.model.generate(ids[:, :4], 12, temperature=0), greedy)
    # the sliding layers' caches hold the window (5 positions), the full layer's every one; a token at a
    # time past the window gives the full forward's logits
    caches = ours.model.make_kv_caches(1, 64)
    with torch.no_grad():
        steps = [ours.model(ids[:, :3], kv_caches=caches)]
        steps += [ours.model(ids[:, t : t + 1], kv_caches=caches) for t in range(3, ids.shape[1])]
    assert [c.k.shape[2] for c in caches] == [WINDOW] * 5 + [64] + [WINDOW]
    from headspace.decode.loop import generation_caches

    # and generate's own caches: the sliding layers' never stacked into full-length buffers
    assert [c.k.shape[2] for c in generation_caches(ours.model, 1, 64)] == [WINDOW] * 5 + [64] + [WINDOW]
    assert [c.held for c in caches] == [WINDOW] * 5 + [ids.shape[1]] + [WINDOW]
    assert (torch.cat(steps, 1) - want).abs().max() <= 1e-4


def test_tiny_gemma3_tokenizer_equals_transformers(tiny: Path, hf: Any) -> None:
    """Merges implied by the listing order, byte fallback, control tokens whole, BOS added."""
    g = read_gguf(tiny)
    _, tokenizer = hf
    texts = ["the cat sat on the mat", " the  cat", "<start_of_turn>the<end_of_turn>", "é🙂", "", "tt\n\nx"]
    for text in texts:
        assert g.tokenizer.encode(text).ids == tokenizer(text).input_ids, text
    assert g.tokenizer.encode("the cat").tokens == ["<bos>", "th", "e", "▁cat"]  # "th" is listed before "he"


def test_a_file_in_parts_reads_as_the_whole(tiny: Path, tmp_path: Path) -> None:
    data = tiny.read_bytes()
    cuts = [0, 1000, len(data) // 2, len(data)]
    parts = []
    for n, (a, b) in enumerate(itertools.pairwise(cuts)):
        parts.append(tmp_path / f"tiny.gguf.part{n:02d}")
        parts[-1].write_bytes(data[a:b])
    whole = read_gguf(tiny)
    digest = hashlib.sha256(data).hexdigest()
    for source, sha in ((parts, None), (parts, digest.upper()), (tiny, digest)):
        g = read_gguf(source, sha256=sha)
        assert all(torch.equal(g.tensors[k], whole.tensors[k]) for k in whole.tensors)
    with pytest.raises(GGUFError, match="SHA-256 is"):
        read_gguf(parts[::-1], sha256=digest)
    with pytest.raises(TypeError, match="non-empty list of part paths"):
        read_gguf([])
    with pytest.raises(GGUFError, match="not a regular file"):
        read_gguf([parts[0], tmp_path])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"gemma3.attention.sliding_window": None}, "'gemma3.attention.sliding_window' is missing"),
        ({"gemma3.attention.sliding_window": 0}, "outside the sane range"),
        ({"gemma3.final_logit_softcapping": 30.0}, "Gemma 3 has no soft-capping"),
        ({"tokenizer.ggml.unknown_token_id": None}, "needs tokenizer.ggml.unknown_token_id"),
        ({"tokenizer.ggml.token_type": [1, 1]}, "does not give one type for each"),
        ({"tokenizer.ggml.merges": ["▁ t"]}, "with tokenizer.ggml.merges"),
        ({"gemma3.attention.head_count_kv": 3}, "cannot be shared among 3"),
    ],
)
def test_hostile_gemma3_metadata_is_refused(change: dict[str, Any], message: str, tmp_path: Path) -> None:
    path = write_tiny_gemma3(tmp_path / "bad.gguf", kv=change)
    with pytest.raises(GGUFError, match=message):
        read_gguf(path)


def test_missing_byte_pieces_are_refused(tmp_path: Path) -> None:
    tokens, _types = _vocab()
    tokens[6] = "<0xZZ>"  # <0x00> gone
    path = write_tiny_gemma3(tmp_path / "bad.gguf", kv={"tokenizer.ggml.tokens": tokens})
    with pytest.raises(GGUFError, match="byte-fallback pieces such as '<0x00>'"):
        read_gguf(path)
