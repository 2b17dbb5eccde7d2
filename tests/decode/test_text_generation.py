"""generate as people use it (headspace.pretrained.generation): a pretrained decoder stops at its
end-of-text and end-of-turn tokens, leaves control tokens out of its text, puts a prompt in its chat
template (rendered in a sandbox) and streams its text as it comes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from headspace.pretrained.generation import TextStream, render_chat, stop_token_ids
from headspace.pretrained.tokenization import TextTokenizer

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


def word_tokenizer(folder: Path) -> TextTokenizer:
    """A word-level tokenizer.json in ``folder``: w0 .. w9 (ids 1 .. 10), then the added tokens
    <|im_end|> (11, special), <start_of_image> (12), <b> (13), [multimodal] (14), </s> (15: all four not
    flagged special, as a GGUF's user-defined tokens), <end_of_turn> (16, special)."""
    words = ["<unk>"] + [f"w{i}" for i in range(10)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken("<|im_end|>", special=True)])
    tok.add_tokens(
        [AddedToken(t, special=False) for t in ("<start_of_image>", "<b>", "[multimodal]", "</s>")]
    )
    tok.add_special_tokens([AddedToken("<end_of_turn>", special=True)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return TextTokenizer(folder / "tokenizer.json")


def test_control_tokens_are_left_out_of_the_text_and_html_tags_kept(tmp_path: Path) -> None:
    tok = word_tokenizer(tmp_path)
    ids = [2, 12, 3, 11, 13, 4, 14, 15, 16]  # w1 <start_of_image> w2 <|im_end|> <b> w3 [multimodal] </s> ...
    assert tok.decode(ids) == "w1 w2 <b> w3 </s>"  # (WordLevel joins pieces with spaces)
    assert tok.decode(ids, skip_special_tokens=False).split() == [
        "w1", "<start_of_image>", "w2", "<|im_end|>", "<b>", "w3", "[multimodal]", "</s>", "<end_of_turn>"
    ]  # fmt: skip
    assert tok.control_ids == {11, 12, 14, 16}


def test_stop_tokens_come_from_the_folder_the_gguf_and_the_template(tmp_path: Path) -> None:
    tok = word_tokenizer(tmp_path)
    # named end tokens that are special: <|im_end|>, <end_of_turn>; </s> is not special here: text
    assert stop_token_ids(tok, {}, {}, None, 17) == [11, 16]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4, 50256]}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "w9"}}))
    tok = TextTokenizer(tmp_path / "tokenizer.json")
    # + generation_config's list (50256: outside the vocabulary, never sampled, left out), eos_token w9
    assert stop_token_ids(tok, {}, {}, None, 17) == [3, 4, 10, 11, 16]
    # + a GGUF's eos / eot and a config.json's eos_token_id
    assert stop_token_ids(tok, {"eos": 5, "eot": 6, "bos": 7}, {"eos_token_id": [8]}, None, 17) == [
        3, 4, 5, 6, 8, 10, 11, 16
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"config.json's eos_token_id must be a token id"):
        stop_token_ids(tok, {}, {"eos_token_id": "w1"}, None, 17)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "2"}))
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id must be a token id >= 0"):
        TextTokenizer(tmp_path / "tokenizer.json").folder_settings()
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(ValueError, match=r"generation_config.json: not valid JSON"):
        TextTokenizer(tmp_path / "tokenizer.json").folder_settings()


def test_a_chat_templates_end_of_turn_token_stops(tmp_path: Path) -> None:
    words = ["<unk>", "a"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|start|>", "<|msg_end|>")])
    ours = TextTokenizer.from_tokenizer(tok)
    template = "{% for m in messages %}<|start|>{{ m['content'] }}<|msg_end|>{% endfor %}"
    assert ours.end_ids == frozenset()  # no known name
    assert stop_token_ids(ours, {}, {}, template, 4) == [3]  # the template's token named as an end
    assert stop_token_ids(ours, {}, {}, None, 4) == []


def test_the_chat_template_renders_as_transformers_renders_it() -> None:
    chat = pytest.importorskip("transformers.utils.chat_template_utils")
    user = "What is the capital of France?"
    ours = render_chat(SMOLLM2_TEMPLATE, user, bos_token=None, eos_token=None)
    theirs = chat.render_jinja_template(
        conversations=[[{"role": "user", "content": user}]],
        chat_template=SMOLLM2_TEMPLATE,
        add_generation_prompt=True,
    )
    theirs = theirs[0][0] if isinstance(theirs, tuple) else theirs
    assert ours == theirs
    assert ours.endswith(f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # the classic escape: refused by the sandbox
        "{% set _ = messages.append({'role': 'x'}) %}",  # immutable: no changing what it is given
        "{{ raise_exception('only user and assistant roles') }}",
        "{% for %}",
    ],
)
def test_a_chat_template_that_fails_or_escapes_is_one_line(template: str) -> None:
    with pytest.raises(ValueError, match=r"^the model's chat template failed: \w+") as e:
        render_chat(template, "hi", bos_token="<s>", eos_token="</s>")
    assert "\n" not in str(e.value)


def test_a_stream_holds_back_incomplete_characters_and_adds_up(smollm2) -> None:
    tok = smollm2.tokenizer
    text = "Un chat 🐱 noir, ça va? 東京"
    ids = tok.plain_ids(text)
    assert len(ids) > len(text.split())  # (the emoji and the kanji are several byte tokens)
    pieces: list[str] = []
    stream = TextStream(tok, pieces.append, ids[:2], stops={2})
    stream.start()
    for i in [*ids[2:], 2, 5]:  # then a stop token, and a token after it (not taken)
        stream(torch.tensor([i]))
    assert stream.finish() == text == "".join(pieces)
    assert pieces[0] == tok.decode(ids[:2]) and len(pieces) > 5
    assert not any("\ufffd" in p for p in pieces)


def test_smollm2_stops_at_im_end_with_the_tokens_before_unchanged(smollm2) -> None:
    names = {smollm2.tokenizer.token_of(i) for i in smollm2.stop_token_ids}
    assert {"<|im_end|>", "<|endoftext|>"} <= names
    prompt = "What is the capital of France?"
    reply = smollm2.generate(prompt, 16, temperature=0, chat=True)
    rendered = render_chat(smollm2.chat_template, prompt, bos_token=None, eos_token=None)
    ids = torch.tensor([smollm2.tokenizer.plain_ids(rendered)])  # (1, prompt_len)
    free = smollm2.model.generate(ids, 16, temperature=0)  # today's call: no stop tokens
    new = free[0, ids.shape[1] :].tolist()
    end = smollm2.tokenizer.id_of("<|im_end|>")
    assert end in new  # without stops the model ends its turn, then runs on into invented turns
    tail = smollm2.tokenizer.decode(new[new.index(end) :], skip_special_tokens=False)
    assert "<|im_start|>" in tail  # and it opens turns of its own invention
    assert reply == smollm2.tokenizer.decode(new[: new.index(end)]) and "Paris" in reply
    stopped = smollm2.model.generate(ids, 16, temperature=0, stop_tokens=smollm2.stop_token_ids)
    assert torch.equal(stopped[0], free[0, : ids.shape[1] + new.index(end) + 1])  # ends on <|im_end|>


def test_smollm2_streams_text_and_batched_rows_stop_on_their_own(smollm2) -> None:
    pieces: list[str] = []
    prompt = "The capital of France is"
    steps: list[torch.Tensor] = []
    text = smollm2.generate(prompt, 6, temperature=0, stop_tokens=None, on_text=pieces.append,
                            on_token=steps.append)  # fmt: skip
    assert "".join(pieces) == text and pieces[0] == prompt and len(pieces) >= 3
    assert len(steps) == 6 and text == smollm2.tokenizer.decode(smollm2.tokenize(prompt)[0].tolist()
                                                               + [int(t) for t in steps])  # fmt: skip
    prompts = ["What is the capital of France?", "Name a colour."]
    replies = smollm2.generate(prompts, 10, temperature=0, chat=True)
    assert replies == [smollm2.generate(p, 10, temperature=0, chat=True) for p in prompts]
    assert replies[0] == "The capital of France is Paris."  # stopped after 8 of 10 tokens, the other ran on
    with pytest.raises(TypeError, match="on_text streams one prompt's text"):
        smollm2.generate(prompts, 3, on_text=print)
