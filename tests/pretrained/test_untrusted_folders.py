"""Model folders are untrusted input: refused early, cheaply and with a message naming file and problem.

* a config implying far more parameters than the weights hold is refused from the config and the
  safetensors header alone, before the expected tensors are listed or a model is built;
* only regular files are read (a FIFO cannot hang, a link to /dev/zero cannot fill memory), with caps;
* the safetensors header is parsed and checked here (length, JSON, dtypes, byte ranges);
* names, shapes and dtypes are checked from the header before any tensor is read or converted;
* every config field read is checked for type and range, naming the field;
* malformed files (tokenizer.json, model.safetensors) are one clear ValueError, never a traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import headspace
from headspace.cli.loader import one_line
from headspace.pretrained import bert as bert_module
from headspace.pretrained import gpt2 as gpt2_module
from headspace.pretrained import hf, load_bert, load_gpt2


# ---------------------------------------------------------------------------------------------------- folders
@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny BERT folder (with a word-level tokenizer.json) and a tiny GPT-2 folder, made once."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("templates")
    torch.manual_seed(0)
    bert = transformers.BertModel(
        transformers.BertConfig(
            vocab_size=97,
            hidden_size=35,
            num_hidden_layers=2,
            num_attention_heads=7,
            intermediate_size=11,
            max_position_embeddings=19,
        )
    )
    bert.save_pretrained(root / "bert")
    words = ["[PAD]", "[UNK]"] + [f"w{i}" for i in range(95)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(root / "bert" / "tokenizer.json"))
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=97, n_positions=23, n_embd=35, n_layer=2, n_head=7)
    )
    gpt2.save_pretrained(root / "gpt2")
    return {"bert": root / "bert", "gpt2": root / "gpt2"}


@pytest.fixture
def bert(templates: dict[str, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(templates["bert"], tmp_path / "bert"))


@pytest.fixture
def gpt2(templates: dict[str, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(templates["gpt2"], tmp_path / "gpt2"))


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    text = json.dumps(config).replace("Infinity", "1e400")  # JSON has no inf; 1e400 parses to it
    (folder / "config.json").write_text(text)


@contextmanager
def no_hang(seconds: int = 20) -> Iterator[None]:
    """Fail (instead of hanging the suite) when the block blocks longer than ``seconds``."""

    def alarm(*_) -> None:
        raise TimeoutError(f"blocked for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def nothing_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a loader lists the expected tensors, reads a tensor or builds a model."""

    def forbidden(what: str):
        def fail(*args, **kwargs):
            raise AssertionError(f"{what} was called before the folder was refused")

        return fail

    monkeypatch.setattr(bert_module, "_bert_expected", forbidden("_bert_expected"))
    monkeypatch.setattr(gpt2_module, "_gpt2_expected", forbidden("_gpt2_expected"))
    monkeypatch.setattr(bert_module, "Encoder", forbidden("Encoder"))
    monkeypatch.setattr(gpt2_module, "Decoder", forbidden("Decoder"))
    monkeypatch.setattr(hf, "safe_open", forbidden("safe_open"))


# -------------------------------------------------------------------------------------------- parameter count
def test_a_million_layer_bert_config_is_refused_from_config_and_header_alone(
    bert: Path, nothing_built
) -> None:
    edit_config(bert, num_hidden_layers=1_000_000)
    assert (bert / "config.json").stat().st_size < 1000
    held = sum(t.numel() for t in load_file(str(bert / "model.safetensors")).values())
    with pytest.raises(ValueError) as info:
        load_bert(bert)
    message = str(info.value)
    per_layer = 3 * (35 * 35 + 35) + (35 * 35 + 35) + 2 * 35 + (11 * 35 + 11) + (35 * 11 + 35) + 2 * 35
    base = 97 * 35 + 19 * 35 + 2 * 35 + 2 * 35  # word, position, type embeddings; embedding LayerNorm
    assert f"implies {base + 1_000_000 * per_layer:,} parameters" in message
    assert f"holds {held:,} values" in message
    assert "num_hidden_layers=1000000" in message and "model.safetensors" in message


def test_a_million_layer_gpt2_config_is_refused_from_config_and_header_alone(
    gpt2: Path, nothing_built
) -> None:
    edit_config(gpt2, n_layer=1_000_000)
    with pytest.raises(
        ValueError, match=r"n_layer=1000000.* implies [\d,]+ parameters in 12,000,004 tensors"
    ):
        load_gpt2(gpt2)


def test_a_config_implying_more_parameters_lists_the_mismatches_too(gpt2: Path) -> None:
    edit_config(gpt2, n_embd=42)
    with pytest.raises(ValueError) as info:
        load_gpt2(gpt2)
    first = str(info.value).splitlines()[0]
    assert "implies" in first and "holds" in first and "mis-shaped" in first
    assert "wte.weight: expected [97, 42], found [97, 35]" in str(info.value)


# ----------------------------------------------------------------------------------------- regular files only
@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors"])
def test_a_link_to_dev_zero_is_refused_unread(bert: Path, name: str) -> None:
    (bert / name).unlink()
    os.symlink("/dev/zero", bert / name)
    with (
        no_hang(),
        pytest.raises(ValueError, match=rf"{name} .*a character device .*/dev/zero.*not a regular file"),
    ):
        load_bert(bert)


@pytest.mark.parametrize(
    "name", ["config.json", "tokenizer.json", "model.safetensors", "sentence_bert_config.json"]
)
def test_a_fifo_is_refused_without_blocking(bert: Path, name: str) -> None:
    (bert / name).unlink(missing_ok=True)
    os.mkfifo(bert / name)
    with no_hang(), pytest.raises(ValueError, match=rf"{name} .*named pipe.*not a regular file"):
        load_bert(bert)
    with no_hang(), pytest.raises(ValueError, match="not a regular file"):
        headspace.load(bert)  # the registry reads config.json through the same reader


def test_a_dangling_link_and_a_folder_are_named(bert: Path) -> None:
    (bert / "tokenizer.json").unlink()
    os.symlink(bert / "nowhere.json", bert / "tokenizer.json")
    with pytest.raises(
        ValueError, match=r"tokenizer.json \(the tokenizer\) is a symbolic link to .*nowhere.json"
    ):
        load_bert(bert)
    (bert / "tokenizer.json").unlink()
    (bert / "config.json").unlink()
    (bert / "config.json").mkdir()
    with pytest.raises(ValueError, match=r"config.json \(the model configuration\) is a folder"):
        load_bert(bert)


def test_json_files_are_read_with_a_size_cap(bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf, "MAX_JSON_BYTES", 100)
    with pytest.raises(ValueError, match=r"config.json: \d+ bytes, more than the 100 bytes allowed"):
        load_bert(bert)


def test_a_tokenizer_json_is_read_with_a_size_cap(bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(headspace.tokenization, "MAX_TOKENIZER_BYTES", 100)
    with pytest.raises(ValueError, match=r"tokenizer.json: \d+ bytes, more than the 100 bytes allowed"):
        load_bert(bert)


# ------------------------------------------------------------------------------------------------- the header
def write_header(path: Path, header: dict, data: bytes = b"", *, length: int | None = None) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


@pytest.mark.parametrize(
    "case, pattern",
    [
        ("empty", r"0 bytes, too short for the 8-byte header length"),
        ("seven bytes", r"7 bytes, too short"),
        ("random bytes", r"header of [\d,]+ bytes, but the file holds [\d,]+ bytes after them"),
        ("header length past 100 MB", r"header of 1,099,511,627,776 bytes.*at most 104,857,600"),
        ("header longer than the file", r"header of 500 bytes, but the file holds 2 bytes after them"),
        ("header not JSON", r"its header is not JSON"),
        ("header a list", r"its header is a JSON list, not an object"),
        ("unknown dtype", r"tensor 'w' in the safetensors header has dtype 'F128'; known dtypes"),
        ("bad shape", r"tensor 'w' .* has shape \[2, -1\]; expected a list of ints >= 0"),
        (
            "offsets past the end",
            r"tensor 'w' .* claims bytes \[0, 4,000\) of the data, but the file holds 16",
        ),
        ("offsets reversed", r"tensor 'w' .* has data_offsets \[8, 4\]"),
        (
            "size not the shape's",
            r"tensor 'w' .*shape \[2, 2\] of F32 needs 16 bytes, but its data_offsets span 8",
        ),
        ("overlapping", r"the data of tensors 'a' and 'b' overlap"),
        ("truncated", r"claims bytes .* but the file holds .* \(truncated or forged\)"),
    ],
)
def test_bad_safetensors_files_are_refused_from_the_header(
    bert: Path, nothing_built, case: str, pattern: str
) -> None:
    weights = bert / "model.safetensors"
    data16 = bytes(16)
    if case == "empty":
        weights.write_bytes(b"")
    elif case == "seven bytes":
        weights.write_bytes(b"\x01" * 7)
    elif case == "random bytes":
        weights.write_bytes(
            torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1))
            .byte()
            .numpy()
            .tobytes()
        )
    elif case == "header length past 100 MB":
        write_header(weights, {}, length=1 << 40)
    elif case == "header longer than the file":
        write_header(weights, {}, length=500)
    elif case == "header not JSON":
        weights.write_bytes(struct.pack("<Q", 5) + b"{nope" + data16)
    elif case == "header a list":
        weights.write_bytes(struct.pack("<Q", 2) + b"[]" + data16)
    elif case == "unknown dtype":
        write_header(weights, {"w": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, data16)
    elif case == "bad shape":
        write_header(weights, {"w": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 8]}}, data16)
    elif case == "offsets past the end":
        write_header(weights, {"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}, data16)
    elif case == "offsets reversed":
        write_header(weights, {"w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}}, data16)
    elif case == "size not the shape's":
        write_header(weights, {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8]}}, data16)
    elif case == "overlapping":
        entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
        write_header(weights, {"a": entry, "b": {**entry, "data_offsets": [4, 12]}}, data16)
    elif case == "truncated":
        raw = weights.read_bytes()
        weights.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match=pattern) as info:
        load_bert(bert)
    assert str(info.value).startswith(str(weights)) or str(weights) in str(info.value).splitlines()[0]


# -------------------------------------------------------------------------------------- shapes before reading
def test_shapes_and_dtypes_are_checked_from_the_header_before_reading_any_tensor(
    bert: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = bert / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["encoder.layer.1.intermediate.dense.weight"] = torch.zeros(13, 35, dtype=torch.float16)
    tensors["encoder.layer.0.output.dense.weight"] = torch.zeros(35, 11, dtype=torch.int32)
    save_file(tensors, str(weights))

    def no_reading(*args, **kwargs):
        raise AssertionError("a tensor was read before the names and shapes were checked")

    monkeypatch.setattr(hf, "safe_open", no_reading)
    with pytest.raises(
        ValueError, match=r"encoder.layer.1.intermediate.dense.weight: expected \[11, 35\], found \[13, 35\]"
    ):
        load_bert(bert)
    tensors["encoder.layer.1.intermediate.dense.weight"] = torch.zeros(11, 35, dtype=torch.float16)
    save_file(tensors, str(weights))
    with pytest.raises(ValueError, match=r"encoder.layer.0.output.dense.weight \(torch.int32\)"):
        load_bert(bert)


def test_tensors_are_read_one_at_a_time_and_only_the_needed_ones(
    bert: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = bert / "model.safetensors"
    tensors = load_file(str(weights))
    half = {k: v.half() for k, v in tensors.items()}
    half["cls.predictions.bias"] = torch.zeros(97, dtype=torch.float16)  # an ignored task head: never read
    save_file(half, str(weights))
    read: list[str] = []
    real = hf.safe_open

    class Spy:
        def __init__(self, *args, **kwargs) -> None:
            self.f = real(*args, **kwargs)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, name: str) -> torch.Tensor:
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(hf, "safe_open", Spy)
    model = load_bert(bert)
    assert len(read) == len(set(read)) and set(read) == set(tensors)  # each once; the task head never
    assert model.ignored == ["cls.predictions.bias"]
    assert model.model.tok_embed.weight.dtype == torch.float32


# ---------------------------------------------------------------------------------------------- config fields
@pytest.mark.parametrize(
    "changes, pattern",
    [
        ({"num_hidden_layers": "2"}, r"num_hidden_layers must be an int >= 1; got '2' \(str\)"),
        ({"num_hidden_layers": 2.0}, r"num_hidden_layers must be an int >= 1; got 2.0 \(float\)"),
        ({"num_hidden_layers": True}, r"num_hidden_layers must be an int >= 1; got True \(bool\)"),
        ({"num_hidden_layers": 0}, r"num_hidden_layers must be an int >= 1; got 0"),
        ({"hidden_size": [35]}, r"hidden_size must be an int >= 1; got \[35\] \(list\)"),
        ({"hidden_act": ["gelu"]}, r"hidden_act must be a string; got \['gelu'\] \(list\)"),
        ({"position_embedding_type": {"a": 1}}, r"position_embedding_type must be a string \(or null\)"),
        ({"is_decoder": "false"}, r"is_decoder must be true or false .*got 'false' \(str\)"),
        (
            {"hidden_dropout_prob": "0.1"},
            r"hidden_dropout_prob must be a finite number in \[0, 1\); got '0.1'",
        ),
        (
            {"attention_probs_dropout_prob": 1.5},
            r"attention_probs_dropout_prob must be a finite number in \[0, 1\)",
        ),
        ({"layer_norm_eps": -1e-12}, r"layer_norm_eps must be a finite number in \(0, inf\)"),
        ({"type_vocab_size": -1}, r"config.json: type_vocab_size must be an int >= 0; got -1"),
        ({"pad_token_id": 97}, r"pad_token_id must be < vocab_size=97; got 97"),
        ({"pad_token_id": "0"}, r"pad_token_id must be an int >= 0 \(or null\); got '0'"),
        ({"num_attention_heads": 4}, r"hidden_size=35 must be divisible by num_attention_heads=4"),
        ({"max_position_embeddings": None}, r"max_position_embeddings must be an int >= 1; got None"),
    ],
)
def test_bert_config_fields_of_the_wrong_type_or_range_are_named(
    bert: Path, changes: dict, pattern: str
) -> None:
    edit_config(bert, **changes)
    with pytest.raises(ValueError, match=pattern):
        load_bert(bert)


@pytest.mark.parametrize(
    "changes, pattern",
    [
        (
            {"tie_word_embeddings": "false"},
            r"tie_word_embeddings must be true or false .*got 'false' \(str\)",
        ),
        ({"tie_word_embeddings": 0}, r"tie_word_embeddings must be true or false .*got 0 \(int\)"),
        ({"activation_function": ["gelu_new"]}, r"activation_function must be a string; got \['gelu_new'\]"),
        ({"n_head": "7"}, r"n_head must be an int >= 1; got '7' \(str\)"),
        ({"n_inner": 44.0}, r"n_inner must be an int >= 1 \(or null\); got 44.0 \(float\)"),
        ({"n_positions": 1e3}, r"n_positions must be an int >= 1; got 1000.0"),
        ({"scale_attn_weights": "true"}, r"scale_attn_weights must be true or false"),
        ({"resid_pdrop": None}, r"resid_pdrop must be a finite number in \[0, 1\); got None"),
        ({"layer_norm_epsilon": 1e400}, r"layer_norm_epsilon must be a finite number in \(0, inf\); got inf"),
    ],
)
def test_gpt2_config_fields_of_the_wrong_type_or_range_are_named(
    gpt2: Path, changes: dict, pattern: str
) -> None:
    edit_config(gpt2, **changes)
    with pytest.raises(ValueError, match=pattern):
        load_gpt2(gpt2)


def test_tie_word_embeddings_false_as_a_boolean_still_works(gpt2: Path) -> None:
    tensors = load_file(str(gpt2 / "model.safetensors"))
    tensors["lm_head.weight"] = torch.randn(97, 35)
    save_file(tensors, str(gpt2 / "model.safetensors"))
    edit_config(gpt2, tie_word_embeddings=False)
    assert load_gpt2(gpt2).model.lm_head is not None


@pytest.mark.parametrize(
    "arch, changes",
    [
        ("bert", {"num_hidden_layers": "2"}),  # a field of the wrong type
        ("bert", {"hidden_act": "swiglu"}),  # a value headspace cannot represent
        ("bert", {"max_position_embeddings": 10**9}),  # refused by ModelConfig itself
        ("gpt2", {"n_head": "7"}),
        ("gpt2", {"activation_function": "swiglu"}),
        ("gpt2", {"vocab_size": None}),
        ("llama", {"hidden_act": "swiglu"}),
        ("llama", {"vocab_size": 0}),
    ],
)
def test_config_errors_name_the_config_file_with_its_folder(
    bert: Path, gpt2: Path, tmp_path: Path, arch: str, changes: dict
) -> None:
    """A message about config.json begins with the file's path, so a user with several model folders
    knows which one is meant (not a bare "config.json: ...")."""
    if arch == "llama":
        folder = tmp_path / "llama"
        folder.mkdir()
        config = {"model_type": "llama", "vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "intermediate_size": 40}  # fmt: skip
        (folder / "config.json").write_text(json.dumps(config))
        (folder / "model.safetensors").write_bytes(b"")  # never read: the config is refused first
    else:
        folder = {"bert": bert, "gpt2": gpt2}[arch]
    edit_config(folder, **changes)
    with pytest.raises(ValueError) as info:
        headspace.load(folder)
    message = str(info.value)
    assert message.startswith(str(folder / "config.json")), message
    assert not message.startswith("config.json")


def test_sentence_bert_config_max_seq_length_is_checked_naming_the_file(bert: Path) -> None:
    (bert / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": "256"}))
    with pytest.raises(ValueError, match=r"sentence_bert_config.json: max_seq_length must be an int >= 1"):
        load_bert(bert)
    (bert / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 7}))
    assert load_bert(bert).max_length == 7


# -------------------------------------------------------------------------------------------- malformed files
@pytest.mark.parametrize(
    "content, pattern",
    [
        (b"{not json", r"not a valid tokenizer.json"),
        (b"{}", r"not a valid tokenizer.json"),
        (b'{"model": 3}', r"not a valid tokenizer.json"),
        (b"\xff\xfe\x00garbage", r"not a valid tokenizer.json: not UTF-8"),
        (b"", r"not a valid tokenizer.json"),
    ],
)
def test_a_corrupt_tokenizer_json_is_a_clear_error_naming_it(
    bert: Path, content: bytes, pattern: str
) -> None:
    (bert / "tokenizer.json").write_bytes(content)
    with pytest.raises(ValueError, match=pattern) as info:
        load_bert(bert)
    assert str(bert / "tokenizer.json") in str(info.value)


def test_no_tokenizer_json_is_fine(bert: Path) -> None:
    (bert / "tokenizer.json").unlink()
    assert load_bert(bert).tokenizer is None


def test_safetensors_data_that_its_reader_refuses_is_a_clear_error(
    bert: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuses(*args, **kwargs):
        raise RuntimeError("SafetensorError: invalid metadata")  # what safetensors' own parser might say

    monkeypatch.setattr(hf, "safe_open", refuses)
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file: .*invalid"):
        load_bert(bert)


# --------------------------------------------------------------------------------------------------- messages
def test_the_mismatch_report_summarises_on_its_first_line_and_joins_with_semicolons(bert: Path) -> None:
    weights = bert / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["encoder.layer.1.output.dense.bias"]
    tensors["encoder.layer.0.attention.self.rotary.weight"] = torch.zeros(3, 5)
    tensors["encoder.layer.0.output.dense.weight"] = torch.zeros(35, 12)
    save_file(tensors, str(weights))
    with pytest.raises(ValueError) as info:
        load_bert(bert)
    lines = str(info.value).splitlines()
    assert "1 missing, 1 unexpected, 1 mis-shaped tensors" in lines[0] and not lines[0].endswith(":")
    joined = one_line(info.value)  # what the CLI prints
    assert (
        "tensors); missing tensors (1): encoder.layer.1.output.dense.bias [35]; unexpected tensors (1)"
        in joined
    )
    assert "encoder.layer.0.output.dense.weight: expected [35, 11], found [35, 12]" in joined
    assert ":;" not in joined


def test_the_nan_report_summarises_on_its_first_line(bert: Path) -> None:
    weights = bert / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["embeddings.word_embeddings.weight"][0, 0] = float("nan")
    tensors["encoder.layer.1.attention.self.key.bias"][:] = float("inf")
    save_file(tensors, str(weights))
    with pytest.raises(ValueError) as info:
        load_bert(bert)
    first = str(info.value).splitlines()[0]
    assert (
        "2 weights have NaN/Inf values" in first and "key.bias" in first and ":;" not in one_line(info.value)
    )


def test_a_text_tokenizer_from_a_tokenizer_in_memory_leaves_the_original_alone(bert: Path) -> None:
    from tokenizers import Tokenizer

    from headspace.pretrained.tokenization import TextTokenizer

    original = Tokenizer.from_file(str(bert / "tokenizer.json"))
    original.enable_padding(length=9)
    tok = TextTokenizer.from_tokenizer(original, pad_id=0)
    assert tok.encode_ids(["w1 w2"]) == [[3, 4]]  # padding off on the copy
    assert len(original.encode("w1 w2").ids) == 9  # and still on in the caller's object
    with pytest.raises(TypeError, match=r"tokenizer must be a tokenizers.Tokenizer; got str"):
        TextTokenizer.from_tokenizer("tokenizer.json")  # type: ignore[arg-type]
