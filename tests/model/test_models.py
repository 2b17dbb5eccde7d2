"""ModelConfig, Encoder and Decoder on small random models: shapes, masks, causality, cache, generate.

(Equality with transformers' BertModel and GPT2LMHeadModel is tested in test_pretrained.py, through
load_bert/load_gpt2 on checkpoints saved by transformers.)
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headspace import Decoder, Encoder, KVCache, ModelConfig
from headspace.model.block import Workspace
from headspace.nn.hooks import name_hook_points

B, S, H, DH, V, L = 2, 3, 7, 5, 13, 2  # batch, seq, n_heads, d_head, vocab, layers: distinct primes
D = H * DH  # d_model = 35


def encoder_config(**kw) -> ModelConfig:
    return ModelConfig(
        arch="encoder", vocab_size=V, d_model=D, n_layers=L, n_heads=H, d_mlp=11, max_seq_len=17, **kw
    )


def decoder_config(**kw) -> ModelConfig:
    args = {"vocab_size": V, "d_model": D, "n_layers": L, "n_heads": H, "d_mlp": 11, "max_seq_len": 19}
    return ModelConfig(arch="decoder", **{**args, **kw})


# ---------------------------------------------------------------------------------------------- config
def test_config_derives_fields_by_architecture() -> None:
    enc = ModelConfig(arch="encoder", vocab_size=V, d_model=D, n_heads=H)
    assert (enc.d_head, enc.n_kv_heads, enc.d_mlp) == (DH, H, 4 * D)
    assert (enc.act, enc.norm, enc.type_vocab_size, enc.tie_embeddings) == ("gelu", "post", 2, False)
    assert (enc.embed_ln, enc.final_ln) == (True, False)
    dec = ModelConfig(arch="decoder", vocab_size=V, d_model=D, n_heads=H, dropout=0.25)
    assert (dec.act, dec.norm, dec.type_vocab_size, dec.tie_embeddings) == ("gelu_tanh", "pre", 0, True)
    assert (dec.embed_ln, dec.final_ln, dec.emb_dropout) == (False, True, 0.25)


def test_config_json_round_trip() -> None:
    config = decoder_config(n_kv_heads=1, name="tiny", extra={"source": "test"})
    text = json.dumps(config.to_dict())
    again = ModelConfig.from_dict(json.loads(text))
    assert again == config
    assert again.to_dict()["d_head"] == DH


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"arch": "seq2seq"}, ["arch", "'seq2seq'", "encoder"]),
        ({"vocab_size": 0}, ["vocab_size", "0"]),
        ({"n_layers": 2.0}, ["n_layers", "2.0"]),
        ({"n_heads": 4}, ["d_model=35", "n_heads=4"]),
        ({"n_kv_heads": 3}, ["n_heads=7", "n_kv_heads=3"]),
        ({"act": "tanh"}, ["act", "'tanh'"]),
        ({"norm": "middle"}, ["norm", "'middle'"]),  # ("sandwich" is Gemma's since #27)
        ({"dropout": -0.1}, ["dropout", "-0.1"]),
        ({"ln_eps": 0}, ["ln_eps", "0"]),
        ({"pad_token_id": V}, ["pad_token_id", f"vocab_size={V}", str(V)]),
        ({"type_vocab_size": -1}, ["type_vocab_size", "-1"]),
        ({"bias": "yes"}, ["bias", "'yes'"]),
        ({"init_std": float("nan")}, ["init_std", "finite", "nan"]),
        ({"init_std": float("inf")}, ["init_std", "finite", "inf"]),
        ({"ln_eps": float("inf")}, ["ln_eps", "finite", "inf"]),
        ({"pruned_heads": [1]}, ["pruned_heads", "dict", "list"]),
        ({"pruned_heads": {6: [0]}}, ["pruned_heads", "n_layers=6", "layer 6"]),
        ({"pruned_heads": {"x": [0]}}, ["pruned_heads", "layer 'x'"]),
        ({"pruned_heads": {0: [7]}}, ["pruned_heads", "n_heads=7", "got 7 for layer 0"]),
        ({"pruned_heads": {0: 3}}, ["pruned_heads", "got 3 for layer 0"]),
        ({"pruned_heads": {0: list(range(7))}}, ["pruned_heads[0]", "all 7 heads"]),
        ({"pruned_heads": {0: [0], "0": [1]}}, ["layer 0 is given twice"]),
    ],
)
def test_config_validation_names_the_field(kwargs: dict, words: list[str]) -> None:
    args = {"vocab_size": V, "d_model": D, "n_heads": H, **kwargs}
    with pytest.raises(ValueError) as info:
        ModelConfig(**args)
    for word in words:
        assert word in str(info.value)


def test_config_pruned_heads_are_normalised_and_survive_json() -> None:
    config = decoder_config(pruned_heads={1: (4, 0, 4), 0: []})
    assert config.pruned_heads == {1: [0, 4]}  # sorted, deduplicated, empty layers dropped
    assert config.kept_heads(1) == [1, 2, 3, 5, 6] and config.kept_heads(0) == list(range(H))
    assert config.to_dict()["pruned_heads"] == {
        "1": [0, 4]
    }  # JSON's own key type: a stored config compares equal
    again = ModelConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and again.to_dict() == config.to_dict()
    assert "2 heads pruned" in config.summary()
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, n_layers=2\); got 2"):
        config.kept_heads(2)
    # grouped-query attention: the survivors of each key/value group must be equally many
    with pytest.raises(ValueError, match=r"pruned_heads\[0\].*unequal"):
        ModelConfig(vocab_size=V, d_model=6 * DH, n_heads=6, n_kv_heads=2, pruned_heads={0: [0]})
    ok = ModelConfig(vocab_size=V, d_model=6 * DH, n_heads=6, n_kv_heads=2, pruned_heads={0: [0, 1, 2]})
    assert ok.kept_heads(0) == [3, 4, 5]


def test_config_from_dict_lists_unknown_fields() -> None:
    data = encoder_config().to_dict() | {"hidden_size": 3, "n_embd": 4}
    with pytest.raises(ValueError, match=r"unknown fields \['hidden_size', 'n_embd'\]"):
        ModelConfig.from_dict(data)
    with pytest.raises(TypeError, match="expects a dict"):
        ModelConfig.from_dict([1])


def test_models_refuse_the_other_architecture() -> None:
    with pytest.raises(ValueError, match="Encoder needs ModelConfig\\(arch='encoder'\\); got arch='decoder'"):
        Encoder(decoder_config())
    with pytest.raises(TypeError, match=r"expects a headspace.ModelConfig; got dict"):
        Decoder({"arch": "decoder"})


# ---------------------------------------------------------------------------------------------- encoder
def test_encoder_shapes_and_hook_names() -> None:
    model = Encoder(encoder_config()).eval()
    tokens = torch.randint(0, V, (B, S))
    out = model(tokens, token_type_ids=torch.ones(B, S, dtype=torch.long))
    assert out.shape == (B, S, D)
    names = name_hook_points(model)
    for name in (
        "hook_embed",
        "blocks.1.attn.hook_pattern",
        "blocks.0.hook_resid_post",
        "blocks.1.mlp.hook_post",
    ):
        assert name in names


def test_encoder_padding_does_not_change_real_tokens() -> None:
    model = Encoder(encoder_config()).eval()
    tokens = torch.randint(1, V, (B, S))
    padded = torch.cat([tokens, torch.zeros(B, 4, dtype=torch.long)], dim=1)  # (B, S + 4)
    key_padding = torch.arange(S + 4)[None].expand(B, -1) < S  # (B, S + 4)
    with torch.no_grad():
        torch.testing.assert_close(model(padded, key_padding)[:, :S], model(tokens))


def test_encoder_is_bidirectional_and_token_types_matter() -> None:
    model = Encoder(encoder_config()).eval()
    tokens = torch.randint(0, V, (1, S))
    changed = tokens.clone()
    changed[0, -1] = (tokens[0, -1] + 1) % V
    with torch.no_grad():
        a, b = model(tokens), model(changed)
        assert not torch.allclose(a[0, 0], b[0, 0])  # the first token sees the last one
        c = model(tokens, token_type_ids=torch.ones_like(tokens))
        assert not torch.allclose(a, c)


def test_encoder_embedding_formula() -> None:
    """h_0 = LN(E_tok[t] + E_pos[i] + E_type[s])."""
    model = Encoder(encoder_config()).eval()
    tokens = torch.randint(0, V, (B, S))
    types = torch.randint(0, 2, (B, S))
    seen = {}
    model.hook_embed.add(lambda v, hp: seen.__setitem__("e", v))
    with torch.no_grad():
        model(tokens, token_type_ids=types)
        raw = model.tok_embed.weight[tokens] + model.pos_embed.weight[:S] + model.type_embed.weight[types]
        torch.testing.assert_close(seen["e"], model.embed_ln(raw))


@pytest.mark.parametrize(
    "kw", [{}, {"norm": "pre", "act": "gelu_tanh"}, {"act": "relu", "n_kv_heads": 1}, {"bias": False}]
)
def test_encoder_infer_equals_forward(kw: dict) -> None:
    model = Encoder(encoder_config(**kw)).eval()
    tokens = torch.randint(0, V, (B, 5))
    key_padding = torch.tensor([[True] * 5, [True, True, False, False, False]])
    with torch.inference_mode():
        for pad in (key_padding, None, torch.ones(B, 5, dtype=torch.bool)):
            torch.testing.assert_close(model.infer(tokens, pad), model(tokens, pad))
    seen = []
    model.blocks[0].attn.hook_pattern.add(lambda v, hp: seen.append(v))
    with torch.inference_mode():
        model.infer(tokens, key_padding)  # a hook is active: infer falls back to forward, the hook fires
    assert len(seen) == 1


@pytest.mark.parametrize("kw", [{}, {"norm": "pre", "act": "gelu_tanh"}, {"bias": False}])
def test_encoder_infer_shared_workspace(kw: dict) -> None:
    """One workspace reused across calls of different shapes: results equal forward, the input is
    never written, and a returned tensor is never workspace memory (a later call leaves it alone)."""
    model = Encoder(encoder_config(**kw)).eval()
    ws = Workspace()
    shapes = [(5, 11), (B, 7), (3, 13)]  # grows, shrinks, grows again
    with torch.inference_mode():
        results = []
        for batch, seq in shapes:
            tokens = torch.randint(0, V, (batch, seq))
            pad = torch.ones(batch, seq, dtype=torch.bool)
            pad[0, seq // 2 :] = False
            out = model.infer(tokens, pad, workspace=ws)
            torch.testing.assert_close(out, model(tokens, pad))
            results.append((tokens, pad, out, out.clone()))
        for _, _, out, copy in results:
            assert torch.equal(out, copy)
        block = model.blocks[0]
        x = torch.randn(B, 7, D)
        x_before = x.clone()
        first = block.infer(x, None, ws)
        torch.testing.assert_close(first, block(x))
        assert torch.equal(x, x_before)
        kept = first.clone()
        block.infer(torch.randn(B, 7, D), None, ws)
        assert torch.equal(first, kept)


def test_encoder_bad_inputs_name_the_argument() -> None:
    model = Encoder(encoder_config())
    with pytest.raises(TypeError, match=r"tokens must be an integer tensor .* got dtype torch.float32"):
        model(torch.zeros(B, S))
    with pytest.raises(TypeError, match=r"tokens must be an int64 tensor .* got list"):
        model([[1, 2]])
    with pytest.raises(ValueError, match=r"tokens must be 2-D \[batch, seq\]; got shape \[3\]"):
        model(torch.zeros(S, dtype=torch.long))
    with pytest.raises(ValueError, match=r"tokens contains id 13, outside \[0, vocab_size=13\)"):
        model(torch.full((B, S), V))
    with pytest.raises(
        ValueError, match=r"tokens has length 18, longer than the position table .*max_seq_len=17"
    ):
        model(torch.zeros(1, 18, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token_type_ids contains id 2, outside \[0, vocab_size=2\)"):
        model(torch.zeros(B, S, dtype=torch.long), token_type_ids=torch.full((B, S), 2))
    with pytest.raises(
        ValueError, match=r"token_type_ids must have the shape of tokens \[2, 3\]; got \[2, 2\]"
    ):
        model(torch.zeros(B, S, dtype=torch.long), token_type_ids=torch.zeros(B, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"key_padding must have shape \[batch, seq_k\] = \[2, 3\]"):
        model(torch.zeros(B, S, dtype=torch.long), torch.ones(B, S + 1, dtype=torch.bool))


# ---------------------------------------------------------------------------------------------- decoder
def test_decoder_shapes_tied_embeddings_and_causality() -> None:
    model = Decoder(decoder_config()).eval()
    tokens = torch.randint(0, V, (B, 5))
    with torch.no_grad():
        logits = model(tokens)
        assert logits.shape == (B, 5, V)
        assert model.W_U.data_ptr() == model.tok_embed.weight.data_ptr()  # tied: one tensor
        torch.testing.assert_close(logits, model.hidden_states(tokens) @ model.tok_embed.weight.T)
        changed = tokens.clone()
        changed[:, -1] = (tokens[:, -1] + 1) % V
        torch.testing.assert_close(model(changed)[:, :-1], logits[:, :-1])  # the past never sees the future


def test_decoder_untied_head() -> None:
    model = Decoder(decoder_config(tie_embeddings=False))
    assert model.lm_head is not None and model.W_U.shape == (D, V)
    assert model(torch.randint(0, V, (B, S))).shape == (B, S, V)


@settings(max_examples=10, deadline=None)
@given(
    batch=st.integers(1, 3), prompt=st.integers(1, 6), steps=st.integers(1, 5), n_kv=st.sampled_from([1, 7])
)
def test_cached_forward_equals_full_forward(batch: int, prompt: int, steps: int, n_kv: int) -> None:
    torch.manual_seed(prompt * 10 + steps)
    model = Decoder(decoder_config(n_kv_heads=n_kv)).eval()
    tokens = torch.randint(0, V, (batch, prompt + steps))
    with torch.no_grad():
        full = model(tokens)
        caches = model.make_kv_caches(batch, prompt + steps)
        parts = [model(tokens[:, :prompt], kv_caches=caches)]
        parts += [model(tokens[:, i : i + 1], kv_caches=caches) for i in range(prompt, prompt + steps)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full)


def test_generate_with_cache_equals_full_recompute() -> None:
    model = Decoder(decoder_config())
    prompt = torch.randint(0, V, (B, 4))
    for kwargs in (
        {"temperature": 0.0},
        {"temperature": 1.3, "seed": 7},
        {"temperature": 0.8, "top_k": 3, "seed": 1},
    ):
        cached = model.generate(prompt, 7, **kwargs)
        full = model.generate(prompt, 7, use_cache=False, **kwargs)
        assert cached.shape == (B, 11)
        assert torch.equal(cached[:, :4], prompt)
        assert torch.equal(cached, full), kwargs


LENGTHS = (5, 2, 3)  # a ragged batch of prompts: distinct lengths, the longest unpadded


def left_padded(lengths: tuple[int, ...] = LENGTHS, fill: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [batch, max_len], key_padding [batch, max_len]): random prompts, right-aligned."""
    seq = max(lengths)
    tokens = torch.full((len(lengths), seq), fill)  # (batch, seq)
    key_padding = torch.zeros(len(lengths), seq, dtype=torch.bool)  # (batch, seq)
    for i, n in enumerate(lengths):
        tokens[i, seq - n :] = torch.randint(0, V, (n,))
        key_padding[i, seq - n :] = True
    return tokens, key_padding


@pytest.mark.parametrize("n_kv", [1, 7])
def test_left_padded_logits_equal_each_prompt_alone(n_kv: int) -> None:
    model = Decoder(decoder_config(n_kv_heads=n_kv)).eval()
    tokens, key_padding = left_padded()
    positions = (key_padding.cumsum(dim=1) - 1).clamp(min=0)  # (batch, seq)
    seq = tokens.shape[1]
    with torch.no_grad():
        logits = model(tokens, key_padding, positions=positions)  # (batch, seq, V)
        for i, n in enumerate(LENGTHS):
            torch.testing.assert_close(logits[i, seq - n :], model(tokens[i : i + 1, seq - n :])[0])
        # without the per-row positions a padded row is shifted: the logits change
        assert not torch.allclose(model(tokens, key_padding)[1, -1], logits[1, -1])


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("n_kv", [1, 7])
def test_generate_left_padded_greedy_equals_each_prompt_alone(use_cache: bool, n_kv: int) -> None:
    model = Decoder(decoder_config(n_kv_heads=n_kv))
    tokens, key_padding = left_padded()
    seq, new = tokens.shape[1], 7
    out = model.generate(tokens, new, key_padding=key_padding, temperature=0, use_cache=use_cache)
    assert out.shape == (len(LENGTHS), seq + new)
    assert torch.equal(out[:, :seq], tokens)  # the prompts come back as given, padding included
    for i, n in enumerate(LENGTHS):
        alone = model.generate(tokens[i : i + 1, seq - n :], new, temperature=0, use_cache=use_cache)
        assert torch.equal(out[i, seq - n :], alone[0]), f"row {i} (prompt length {n})"
    # the ids at padded positions are never read
    other = tokens.masked_fill(~key_padding, V - 1)
    again = model.generate(other, new, key_padding=key_padding, temperature=0, use_cache=use_cache)
    assert torch.equal(again[:, seq:], out[:, seq:])
    # an all-True key_padding is the unpadded batch
    full = torch.ones_like(key_padding)
    assert torch.equal(
        model.generate(tokens, new, key_padding=full, temperature=0),
        model.generate(tokens, new, temperature=0),
    )


@pytest.mark.parametrize(
    "kwargs", [{"temperature": 1.0, "seed": 11}, {"temperature": 1.0, "top_k": 3, "seed": 2}]
)
def test_generate_left_padded_cache_equals_full_recompute(kwargs: dict) -> None:
    model = Decoder(decoder_config(n_kv_heads=1))
    tokens, key_padding = left_padded()
    cached = model.generate(tokens, 11, key_padding=key_padding, **kwargs)
    full = model.generate(tokens, 11, key_padding=key_padding, use_cache=False, **kwargs)
    assert cached.shape == (len(LENGTHS), 5 + 11)
    assert torch.equal(cached, full), kwargs
    assert torch.equal(cached, model.generate(tokens, 11, key_padding=key_padding, **kwargs))  # seeded


@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_left_padding_takes_no_position(use_cache: bool) -> None:
    """The limit is the longest real prompt + new tokens: padding columns may pass max_seq_len."""
    model = Decoder(decoder_config())  # max_seq_len = 19
    tokens, key_padding = left_padded()  # 5 columns, the longest prompt has 5 real tokens
    wide = torch.cat([torch.zeros(len(LENGTHS), 11, dtype=torch.long), tokens], dim=1)  # (3, 16)
    wide_padding = torch.cat([torch.zeros(len(LENGTHS), 11, dtype=torch.bool), key_padding], dim=1)
    new = 14  # 5 + 14 = 19 positions fit; 16 + 14 = 30 columns would not
    out = model.generate(wide, new, key_padding=wide_padding, temperature=0, use_cache=use_cache)
    assert out.shape == (len(LENGTHS), 16 + new)
    narrow = model.generate(tokens, new, key_padding=key_padding, temperature=0, use_cache=use_cache)
    assert torch.equal(out[:, 11:], narrow)  # extra padding changes nothing
    with pytest.raises(
        ValueError,
        match=r"the longest prompt's 5 real tokens \+ max_new_tokens 15 = 20 exceeds .*max_seq_len=19",
    ):
        model.generate(wide, 15, key_padding=wide_padding)
    with pytest.raises(ValueError, match=r"prompt_len 16 \+ max_new_tokens 14 = 30 exceeds"):
        model.generate(wide, new)  # without key_padding every column is a real token


def test_generate_is_reproducible_with_a_seed_and_greedy_is_argmax() -> None:
    model = Decoder(decoder_config())
    prompt = torch.randint(0, V, (1, 3))
    a = model.generate(prompt, 12, seed=3)
    assert torch.equal(a, model.generate(prompt, 12, seed=3))
    assert not torch.equal(a, model.generate(prompt, 12, seed=4))  # 13**12 sequences: seeds 3 and 4 differ
    greedy = model.generate(prompt, 5, temperature=0)
    model(greedy).sum().backward()  # generated tokens are ordinary tensors: they can feed training
    assert torch.equal(greedy, model.generate(prompt, 5, top_k=1, seed=9))  # top-1 sampling is greedy
    with torch.no_grad():
        step = model(greedy[:, :-1])[:, -1].argmax(-1)
    assert torch.equal(step, greedy[:, -1])
    assert model.training  # generate restores the mode


def test_generate_top_k_only_samples_the_k_best() -> None:
    model = Decoder(decoder_config())
    prompt = torch.randint(0, V, (1, 1))
    with torch.no_grad():
        top2 = set(model(prompt)[0, -1].topk(2).indices.tolist())
    firsts = {int(model.generate(prompt, 1, top_k=2, temperature=5.0, seed=s)[0, 1]) for s in range(20)}
    assert firsts <= top2 and len(firsts) == 2


def test_tokens_of_other_integer_dtypes_devices_and_bad_caches_are_named() -> None:
    model = Decoder(decoder_config()).eval()
    tokens = torch.randint(0, V, (B, S))
    for dtype in (torch.uint8, torch.int16):  # integer, but torch's embedding lookup takes only these two
        with pytest.raises(TypeError, match=rf"tokens must be an integer tensor \(int64 or int32\).*{dtype}"):
            model(tokens.to(dtype))
    assert torch.equal(model(tokens.int()), model(tokens))
    with pytest.raises(ValueError, match=r"tokens are on device meta but the model's weights are on cpu"):
        model(tokens.to("meta"))
    with pytest.raises(TypeError, match=r"kv_caches must hold one KVCache per block.*item 1 is NoneType"):
        model(tokens, kv_caches=[model.blocks[0].attn.make_kv_cache(B, 19), None])
    with pytest.raises(ValueError, match=r"capacity must be None or an int >= 1.*got '5'"):
        model.make_kv_caches(B, "5")
    with pytest.raises(ValueError, match=r"temperature must be a float >= 0, finite.*got nan"):
        model.generate(tokens, 2, temperature=float("nan"))
    with pytest.raises(TypeError, match=r"seed must be None or an int; got 1.5"):
        model.generate(tokens, 2, seed=1.5)


def test_decoder_bad_inputs() -> None:
    model = Decoder(decoder_config())
    prompt = torch.randint(0, V, (1, 10))
    with pytest.raises(ValueError, match=r"prompt_len 10 \+ max_new_tokens 10 = 20 exceeds .*max_seq_len=19"):
        model.generate(prompt, 10)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0; got -1"):
        model.generate(prompt, -1)
    with pytest.raises(ValueError, match="temperature must be a float >= 0"):
        model.generate(prompt, 1, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k must be None or an int >= 1; got 0"):
        model.generate(prompt, 1, top_k=0)
    with pytest.raises(ValueError, match="at least 1 token; got prompt_len=0"):
        model.generate(prompt[:, :0], 1)
    assert torch.equal(model.generate(prompt, 0), prompt)
    caches = model.make_kv_caches(1, 19)
    model(prompt, kv_caches=caches)
    with pytest.raises(
        ValueError, match="tokens has length 10 starting at position 10, longer than the position"
    ):
        model(prompt, kv_caches=caches)
    with pytest.raises(ValueError, match=r"kv_caches must be a list of 2 KVCache .*got 1"):
        model(prompt, kv_caches=caches[:1])
    with pytest.raises(ValueError, match="capacity=20 exceeds the position table"):
        model.make_kv_caches(1, 20)


def test_generate_bad_key_padding_names_it() -> None:
    model = Decoder(decoder_config())
    tokens, key_padding = left_padded()
    right = key_padding.flip(1)  # right padding: [T, T, F, F, F] ...
    with pytest.raises(ValueError, match=r"key_padding must be left padding: .*; row 1 is TTFFF"):
        model.generate(tokens, 2, key_padding=right)
    gap = key_padding.clone()
    gap[2, 3] = False  # [F, F, T, F, T]: a hole inside the prompt
    with pytest.raises(ValueError, match=r"key_padding must be left padding: .*; row 2 is FFTFT"):
        model.generate(tokens, 2, key_padding=gap)
    with pytest.raises(
        ValueError, match=r"key_padding must have shape \[batch, seq_k\] = \[3, 5\]; got \[3, 4\]"
    ):
        model.generate(tokens, 2, key_padding=key_padding[:, 1:])
    with pytest.raises(TypeError, match=r"key_padding must be a bool tensor .*got dtype torch.int64"):
        model.generate(tokens, 2, key_padding=key_padding.long())  # as forward says it
    empty = key_padding.clone()
    empty[1] = False
    with pytest.raises(ValueError, match=r"key_padding row 1 has no real token \(all False\)"):
        model.generate(tokens, 2, key_padding=empty)
    with pytest.raises(TypeError, match=r"key_padding must be a bool tensor .*got list"):
        model.generate(tokens, 2, key_padding=key_padding.tolist())
    with pytest.raises(ValueError, match=r"prompt_len 5 \+ max_new_tokens 15 = 20 exceeds"):  # padding counts
        model.generate(tokens, 15, key_padding=key_padding)


def test_decoder_bad_positions_name_them() -> None:
    model = Decoder(decoder_config())
    tokens = torch.randint(0, V, (B, S))
    positions = torch.arange(S).expand(B, S)  # (B, S)
    torch.testing.assert_close(model(tokens, positions=positions), model(tokens))  # the default positions
    with pytest.raises(
        ValueError, match=r"positions must have the shape of tokens \[batch, seq\] = \[2, 3\]"
    ):
        model(tokens, positions=positions[:, :2])
    with pytest.raises(TypeError, match=r"positions must be an integer tensor .*got dtype torch.float32"):
        model(tokens, positions=positions.float())
    with pytest.raises(ValueError, match=r"positions contains 19, outside the position table"):
        model(tokens, positions=positions + 17)


@pytest.mark.parametrize(
    "kw",
    [
        {},  # GPT-2-like: learned positions, LayerNorm, plain MLP
        {"positions": "rotary", "norm_kind": "rmsnorm", "mlp_kind": "gated", "act": "silu", "bias": False,
         "n_kv_heads": 1, "d_model": 42},  # Llama-like, multi-query (d_head 6: rotary pairs)
    ],
)  # fmt: skip
def test_forward_on_one_cached_token_is_the_plain_maths(kw: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-token cached call of forward runs the blocks themselves: it never describes or builds a
    decoding step behind its caller, and its hook points fire."""
    import headspace.decode.step as step_mod

    torch.manual_seed(0)
    model = Decoder(decoder_config(**kw)).eval()
    tokens = torch.randint(0, V, (B, 6))
    caches = model.make_kv_caches(B, 8)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("forward described a decoding step")

    monkeypatch.setattr(step_mod, "describe", refuse)
    monkeypatch.setattr(step_mod, "_layer_of", refuse)
    with torch.no_grad():
        model(tokens[:, :5], kv_caches=caches)
        seen = []
        remove = model.blocks[1].attn.hook_pattern.add(lambda value, hook: seen.append(value.shape))
        model(tokens[:, 5:], kv_caches=caches)
        remove()
    assert seen == [(B, H, 1, 6)] and caches[0].length == 6


def test_kv_cache_append_one_is_append_of_one_position() -> None:
    torch.manual_seed(0)
    a, b = KVCache(2, 3, 4, 5), KVCache(2, 3, 4, 5)
    for _ in range(4):
        k, v = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
        got = a.append_one(k, v)
        want = b.append(k.unsqueeze(2), v.unsqueeze(2))
        assert all(torch.equal(x, y) for x, y in zip(got, want)) and a.length == b.length
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
