"""Issue 42: config.json fields that change the maths are read or refused by name; absurd sizes are
refused in one line before anything is allocated; a sliding window past the position table is no window.

References: tiny random models built and saved by transformers 5 in each test (eager attention), so
that "changes the maths" is transformers' own logits changing, not an assumption.

What each loader reads of ``config.json`` (everything else, e.g. ``architectures``, ``torch_dtype``,
``transformers_version``, ``use_cache``, ``pretraining_tp``, ``bos_token_id``, leaves transformers'
logits alone and is ignored):

* Llama family (:func:`headspace.pretrained.llama_config`): model_type, quantization_config,
  hidden_act / hidden_activation, vocab_size, hidden_size, num_hidden_layers, num_attention_heads,
  intermediate_size, num_key_value_heads, head_dim, max_position_embeddings, rope_parameters,
  rope_scaling, rope_theta, partial_rotary_factor, rope_local_base_freq, layer_types, sliding_window,
  use_sliding_window, max_window_layers, sliding_window_pattern, attention_bias, mlp_bias,
  use_bidirectional_attention, query_pre_attn_scalar, attn_logit_softcapping, final_logit_softcapping,
  no_rope_layers, no_rope_layer_interval, pad_token_id, rms_norm_eps, attention_dropout,
  initializer_range, tie_word_embeddings.
* GPT-2: activation_function, scale_attn_weights, scale_attn_by_inverse_layer_idx,
  add_cross_attention, vocab_size, n_embd, n_layer, n_head, n_inner, n_positions, the three dropouts,
  layer_norm_epsilon, tie_word_embeddings, initializer_range, pad_token_id.
* BERT: hidden_act, position_embedding_type, is_decoder, add_cross_attention, vocab_size, hidden_size,
  num_hidden_layers, num_attention_heads, intermediate_size, max_position_embeddings, type_vocab_size,
  the two dropouts, layer_norm_eps, initializer_range, pad_token_id.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T
from click.testing import CliRunner

from headspace.cli import cli
from headspace.kernels import native
from headspace.pretrained import load, load_llama

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, H, DH, DM, CTX = 97, 42, 6, 10, 58, 64  # vocab, hidden, heads, head_dim, mlp, context
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
# name -> (config class, model class, config arguments)
ARCHS: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, {"num_key_value_heads": 2}),
    "gemma3_text": (
        T.Gemma3TextConfig,
        T.Gemma3ForCausalLM,
        {
            "num_key_value_heads": 1,
            "sliding_window": 5,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "smollm3": (
        T.SmolLM3Config,
        T.SmolLM3ForCausalLM,
        {"num_key_value_heads": 2, "num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 5},
    ),
    "gpt2": (T.GPT2Config, T.GPT2LMHeadModel, {}),
    "bert": (T.BertConfig, T.BertModel, {}),
}
_SIZES = {
    "gpt2": dict(vocab_size=V, n_embd=48, n_layer=2, n_head=6, n_positions=CTX, bos_token_id=1,
                 eos_token_id=1),
    "bert": dict(vocab_size=V, hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
                 intermediate_size=64, max_position_embeddings=CTX),
}  # fmt: skip


def build(arch: str, folder: Path) -> Path:
    """A small random transformers model of ``arch`` saved into ``folder``."""
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    kw: dict[str, Any] = _SIZES.get(arch) or dict(
        vocab_size=V, hidden_size=D, num_hidden_layers=2, num_attention_heads=H, head_dim=DH,
        intermediate_size=DM, max_position_embeddings=CTX, bos_token_id=1, eos_token_id=None,
        pad_token_id=0, initializer_range=0.2,
    )  # fmt: skip
    model = model_cls(config_cls(**{**kw, **extra})).eval()
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {arch: build(arch, tmp_path_factory.mktemp(arch)) for arch in ARCHS}


def edited(src: Path, dst: Path, drop: tuple[str, ...] = (), **changes: Any) -> Path:
    """A copy of the checkpoint folder ``src`` whose config.json has ``changes`` and lacks ``drop``."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    for key in drop:
        config.pop(key, None)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def reference_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = T.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


# -------------------------------------------------------------------------- fields that change the maths
@pytest.mark.parametrize(
    ("arch", "scaling"),
    [("llama", YARN), ("llama", {"type": "linear", "factor": 2.0}), ("gemma3_text", YARN)],
)
def test_a_rope_scaling_beside_rope_parameters_is_refused_by_name(
    tmp_path: Path, saved: dict[str, Path], arch: str, scaling: dict[str, Any]
) -> None:
    """transformers applies a rope_scaling over the rope_parameters beside it (its logits change);
    headspace read rope_parameters alone and loaded plain RoPE without a word."""
    folder = edited(saved[arch], tmp_path / "m", rope_scaling=scaling)
    tokens = torch.randint(0, V, (1, 40))  # past original_max_position_embeddings: yarn bends them
    plain, scaled = reference_logits(saved[arch], tokens), reference_logits(folder, tokens)
    assert not torch.allclose(plain, scaled, atol=1e-3)  # the field changes transformers' maths
    with pytest.raises(ValueError) as info:
        load_llama(folder)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(folder / "config.json"))
    assert f"rope_scaling={scaling!r}" in message and "differs from rope_parameters=" in message


def test_a_repeated_rope_scaling_and_harmless_fields_load_and_equal_transformers(
    tmp_path: Path, saved: dict[str, Path]
) -> None:
    """Not every unread field is refused: ones that leave transformers' logits alone load."""
    params = json.loads((saved["llama"] / "config.json").read_text())["rope_parameters"]
    harmless = dict(
        architectures=["LlamaForCausalLM"], torch_dtype="float32", transformers_version="4.99.0",
        use_cache=False, pretraining_tp=1, bos_token_id=2, eos_token_id=[3, 4], _name_or_path="x",
        rope_scaling={"type": params["rope_type"]},  # the same settings in the old spelling
    )  # fmt: skip
    folder = edited(saved["llama"], tmp_path / "m", **harmless)
    tokens = torch.randint(0, V, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(load_llama(folder)(tokens), reference_logits(folder, tokens))


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_gpt2_and_bert_ignore_only_harmless_fields(tmp_path: Path, saved: dict[str, Path], arch: str) -> None:
    folder = edited(
        saved[arch], tmp_path / "m", architectures=["X"], torch_dtype="float32", use_cache=False,
        transformers_version="4.99.0", chunk_size_feed_forward=0, output_attentions=False,
    )  # fmt: skip
    tokens = torch.randint(0, V, (2, 12))
    model_cls = ARCHS[arch][1]
    ref = model_cls.from_pretrained(folder, attn_implementation="eager").eval()
    ours = load(folder)
    with torch.no_grad():
        if arch == "gpt2":
            torch.testing.assert_close(ours(tokens), ref(input_ids=tokens).logits)
        else:
            torch.testing.assert_close(ours.model(tokens), ref(input_ids=tokens).last_hidden_state)


def test_smollm3_without_no_rope_layers_takes_transformers_defaults(
    tmp_path: Path, saved: dict[str, Path]
) -> None:
    """A config without no_rope_layers / layer_types: transformers leaves RoPE out of every fourth layer
    (no_rope_layer_interval) and slides those; headspace rotated every layer and slid none."""
    folder = edited(saved["smollm3"], tmp_path / "m", drop=("no_rope_layers", "layer_types"))
    ours = load_llama(folder)
    assert ours.config.nope_layers == [3] and ours.config.layer_types == ["full"] * 3 + ["sliding"]
    tokens = torch.randint(0, V, (2, 13))  # longer than the window of 5
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), reference_logits(folder, tokens), rtol=1e-4, atol=1e-4)
    interval = edited(saved["smollm3"], tmp_path / "i", drop=("no_rope_layers", "layer_types"),
                      no_rope_layer_interval=2)  # fmt: skip
    assert load_llama(interval).config.nope_layers == [1, 3]


# ------------------------------------------------------------------------------------------- absurd sizes
_ABSURD = [
    ("llama", {"num_hidden_layers": 2**63}, "num_hidden_layers must be an int >= 1 and <= 1048576"),
    ("llama", {"num_hidden_layers": 10**12}, "num_hidden_layers must be an int >= 1 and <= 1048576"),
    ("llama", {"head_dim": 10**12}, "head_dim must be an int >= 1 and <= 1048576"),
    ("llama", {"hidden_size": 6 * 10**12, "head_dim": None},
     "hidden_size / num_attention_heads must be an int >= 1 and <= 1048576; got 1000000000000"),
    ("gemma3_text", {"num_hidden_layers": 2**63, "layer_types": None}, "num_hidden_layers must be an int"),
    ("smollm3", {"num_hidden_layers": 2**63, "layer_types": None, "no_rope_layers": None},
     "num_hidden_layers must be an int"),
    ("gpt2", {"n_layer": 2**63}, "n_layer must be an int >= 1 and <= 1048576"),
    ("bert", {"num_hidden_layers": 2**63}, "num_hidden_layers must be an int >= 1 and <= 1048576"),
]  # fmt: skip
# Loads each folder under an address-space limit a little above what the process holds already, and
# prints one JSON line per folder: the exception's type and message.
_CHILD = r"""
import json, resource, sys
from headspace.pretrained import load
with open("/proc/self/status") as f:
    held = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (held + (512 << 20),) * 2)
for folder in sys.argv[1:]:
    try:
        load(folder)
        print(json.dumps(["loaded", ""]))
    except BaseException as e:
        print(json.dumps([type(e).__name__, str(e)]))
"""


@pytest.mark.skipif(not os.path.isfile("/proc/self/status"), reason="reads VmSize from /proc")
def test_absurd_sizes_are_refused_in_one_line_before_allocating(
    tmp_path: Path, saved: dict[str, Path]
) -> None:
    """num_hidden_layers: 2**63 was an OverflowError, or a MemoryError after 45 s at 4.9 GB (Gemma 3:
    a list of layer types); head_dim 10**12 a RuntimeError from a rotation table. Each is now one line
    naming the field, raised within 512 MiB more than the process holds."""
    folders = [
        edited(saved[arch], tmp_path / f"{i}", **changes) for i, (arch, changes, _) in enumerate(_ABSURD)
    ]
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, *map(str, folders)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(results) == len(_ABSURD)
    for folder, (kind, message), (_, _, want) in zip(folders, results, _ABSURD, strict=True):
        assert kind == "ValueError", (folder, kind, message)
        assert want in message and "\n" not in message and str(folder / "config.json") in message
    # the command line: one line, exit code 2 (explain printed a traceback)
    res = CliRunner().invoke(cli, ["explain", "--model", str(folders[0])])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert res.stderr.strip().splitlines() == [
        f"error: {folders[0] / 'config.json'}: num_hidden_layers must be an int >= 1 and <= 1048576; "
        f"got {2**63} (more than any model has: refused before anything is built)"
    ]


# ------------------------------------------------------------------------------------------ sliding window
def test_a_sliding_window_past_the_position_table_is_no_window(
    tmp_path: Path, saved: dict[str, Path]
) -> None:
    """Gemma 3's sliding_window: 2**63 loaded as it came and generate raised a raw RuntimeError in the
    native step. A window at least the position table sees every earlier key of any sequence the
    model accepts: it is now the table's length (the layer types stay: they pick the RoPE bases), and
    every result equals transformers' with a window past the table (which cannot take 2**63 itself)."""
    folder = edited(saved["gemma3_text"], tmp_path / "m", sliding_window=2**63)
    ours = load_llama(folder)
    assert ours.config.sliding_window == CTX and ours.config.layer_types == ["sliding", "full"]
    assert load_llama(folder, max_seq_len=32).config.sliding_window == 32
    reference = edited(saved["gemma3_text"], tmp_path / "r", sliding_window=10**9)
    tokens = torch.randint(2, V, (1, 30))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), reference_logits(reference, tokens), rtol=1e-4, atol=1e-4)
    ref = T.AutoModelForCausalLM.from_pretrained(reference, attn_implementation="eager").eval()
    with torch.no_grad():
        want = ref.generate(tokens[:, :6], max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(tokens[:, :6], 12, temperature=0, native=False), want)
    if native.compiler() is not None and sys.platform != "win32" and native.build():
        assert torch.equal(ours.generate(tokens[:, :6], 12, temperature=0, native=True), want)
