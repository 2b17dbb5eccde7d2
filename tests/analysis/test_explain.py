"""headspace.explain: the ranking of heads into relational and positional ones, token occurrences, and
the lesson on a model other than BERT (grouped-query attention, no biases, a decoder).

The ranking is pinned on hand-made patterns whose answer is known; the real MiniLM's default walk is
pinned in tests/cli/test_cli.py (it must send "it" to "animal", as the README says).
"""

from __future__ import annotations

import pytest
import torch

from headspace.analysis.explain import (
    FUNCTION,
    RELATIONAL,
    explain,
    find_token,
    key_role,
    rank_heads,
    special_positions,
    token_occurrences,
    value_norms,
)
from headspace.cli.render import kv_note, occurrence_note, render_explanation
from headspace.model.models import Decoder, ModelConfig

# [CLS] apple bird cat dog egg [SEP]; the explained token is "cat" (index 3)
TOKENS = ["[CLS]", "apple", "bird", "cat", "dog", "egg", "[SEP]"]
INDEX = 3
SPECIAL = {0, 6}


def one_hot_row(weights: dict[int, float], seq: int = len(TOKENS)) -> torch.Tensor:
    """A pattern row [seq] with the given weights and the rest spread evenly."""
    row = torch.zeros(seq)
    for j, w in weights.items():
        row[j] = w
    rest = [j for j in range(seq) if j not in weights]
    row[rest] = (1.0 - sum(weights.values())) / len(rest)
    return row


def patterns_from_rows(rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """One layer whose head h gives the token at INDEX the row rows[h]: [1, n_heads, seq, seq]."""
    seq = len(TOKENS)
    p = torch.full((1, len(rows), seq, seq), 1.0 / seq)
    for h, row in enumerate(rows):
        p[0, h, INDEX] = row
    return [p]


# head: (role, its row). Positional heads are heavier than the relational ones, so a ranking that
# lets them compete, or counts the token itself, [CLS] or [SEP] as content, puts them first.
HEADS = [
    ("previous", one_hot_row({2: 0.97})),
    ("first", one_hot_row({0: 0.95})),  # [CLS]
    ("relational", one_hot_row({1: 0.40})),  # "apple", two tokens back
    ("current", one_hot_row({3: 0.93})),  # the token itself
    ("last", one_hot_row({6: 0.91})),  # [SEP]
    ("relational", one_hot_row({5: 0.60})),  # "egg", two tokens on
    ("next", one_hot_row({4: 0.90})),
]


def test_key_role_names_where_the_top_key_lies() -> None:
    seq = len(TOKENS)
    roles = [key_role(j, INDEX, SPECIAL, seq) for j in range(seq)]
    assert roles == ["first", RELATIONAL, "previous", "current", "next", RELATIONAL, "last"]
    assert key_role(3, INDEX, {0, 3, 6}, seq) == "special"  # a special token in the middle
    assert key_role(0, 2, set(), 5) == "first"  # a decoder's first token: its attention sink
    assert key_role(0, 0, set(), 5) == "current"


def test_rank_heads_puts_relational_heads_first_and_labels_every_role() -> None:
    ranking = rank_heads(patterns_from_rows([row for _, row in HEADS]), TOKENS, INDEX, SPECIAL)
    assert [(f.head, f.role) for f in ranking] == [
        (5, "relational"),  # 0.60: the best relational head leads, though five heads are heavier
        (2, "relational"),  # 0.40
        (0, "previous"),  # 0.97: then the positional heads, by the weight of their top key
        (1, "first"),  # 0.95
        (3, "current"),  # 0.93
        (4, "last"),  # 0.91
        (6, "next"),  # 0.90
    ]
    assert ranking[0].focus_token == "egg" and ranking[0].flow == pytest.approx(0.60)
    assert not ranking[0].positional and all(f.positional for f in ranking[2:])
    # focus keeps its meaning: the largest weight on a content token (not itself, not [CLS]/[SEP])
    by_head = {f.head: f for f in ranking}
    assert by_head[0].focus == pytest.approx(0.97) and by_head[0].focus_token == "bird"
    assert by_head[1].focus_token != "[CLS]" and by_head[4].focus_token != "[SEP]"


def test_rank_heads_orders_relational_heads_by_content_flow_when_value_norms_are_given() -> None:
    """content flow = sum over content keys of weight x |v_j W_O[h]|: a weaker weight on a key whose
    value moves more comes first (head 2: 0.40 x 2 + 3 x 0.10 > head 5: 0.60 + 3 x 0.067)."""
    norms = torch.ones(len(HEADS), len(TOKENS))
    norms[2, 1] = 2.0  # head 2's top key "apple" carries a value twice as long
    ranking = rank_heads(patterns_from_rows([row for _, row in HEADS]), TOKENS, INDEX, SPECIAL, norms=[norms])
    assert [f.head for f in ranking[:2]] == [2, 5]
    assert ranking[0].flow == pytest.approx(0.80) and ranking[0].content_flow == pytest.approx(1.10)


def test_a_head_whose_top_key_is_a_function_word_is_not_relational() -> None:
    """A head that puts most weight on "the" (or a piece like "'t") relates no word: role "function",
    listed after the relational heads however heavy."""
    tokens = ["[CLS]", "the", "trophy", "'t", "fit", "it", "[SEP]"]
    rows = [one_hot_row({1: 0.9}, 7), one_hot_row({3: 0.8}, 7), one_hot_row({2: 0.3}, 7)]
    p = torch.full((1, 3, 7, 7), 1.0 / 7)
    for h, row in enumerate(rows):
        p[0, h, 5] = row
    ranking = rank_heads([p], tokens, 5, {0, 6})
    assert [(f.head, f.role) for f in ranking] == [(2, "relational"), (0, "function"), (1, "function")]
    assert ranking[0].focus_token == "trophy" and ranking[0].content_mass == pytest.approx(0.3 + 0.7 / 6 * 1)


def test_value_norms_follow_the_kv_group_of_each_query_head() -> None:
    torch.manual_seed(0)
    v = torch.randn(5, 2, 3)  # (seq, n_kv_heads, d_head)
    W_O = torch.randn(4, 3, 7)  # (n_heads, d_head, d_model): heads 0, 1 read kv head 0; 2, 3 kv head 1
    norms = value_norms(v, W_O)  # (n_heads, seq)
    assert norms.shape == (4, 5)
    for h in range(4):
        torch.testing.assert_close(norms[h], (v[:, h // 2] @ W_O[h]).norm(dim=-1))


def test_token_occurrences_and_the_chosen_one() -> None:
    tokens = ["[CLS]", "the", "cat", "saw", "The", "dog", "[SEP]"]
    assert token_occurrences(tokens, "the") == [1, 4]
    assert find_token(tokens, "the") == 1
    assert find_token(tokens, "the", 2) == 4
    with pytest.raises(
        ValueError, match=r"occurrence 3 of 'the' is out of range.*1 at position 1, 2 at position 4"
    ):
        find_token(tokens, "the", 3)
    with pytest.raises(ValueError, match="needs the token as text"):
        find_token(tokens, 2, 1)
    assert token_occurrences(["Ġthe", "▁the", "the"], "the") == [0, 1, 2]  # GPT-2 and SentencePiece marks
    assert special_positions(None, ["<|im_start|>", "hi", "<s>", "[SEP]", "x"]) == {0, 2, 3}


# ---------------------------------------------------------------------------------------------- any model
class WordTokenizer:
    """Whitespace words over a tiny vocabulary, with a BOS token: enough for explain() on any model."""

    def __init__(self, vocab: list[str]) -> None:
        self.vocab = vocab

    def tokens(self, sentence: str) -> list[str]:
        return ["<s>", *sentence.split()]


class TinyLoaded:
    """A LoadedModel: .model (blocks[i].attn), .tokenizer, .config and tokenize_padded only."""

    def __init__(self, model: torch.nn.Module, vocab: list[str]) -> None:
        self.model = model
        self.tokenizer = WordTokenizer(vocab)

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def tokenize_padded(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = [[self.tokenizer.vocab.index(t) for t in self.tokenizer.tokens(s)] for s in texts]
        tokens = torch.tensor(ids)  # (batch, seq): one length here
        return tokens, torch.ones_like(tokens, dtype=torch.bool)


@pytest.fixture(scope="module")
def gqa() -> TinyLoaded:
    torch.manual_seed(7)
    vocab = ["<s>", "the", "cat", "saw", "dog", "and", "it", "ran"]
    config = ModelConfig(
        arch="decoder", vocab_size=len(vocab), d_model=30, n_layers=2, n_heads=6, n_kv_heads=2, d_head=5,
        bias=False,
    )  # fmt: skip
    return TinyLoaded(Decoder(config).eval(), vocab)


def test_explain_runs_on_a_grouped_query_decoder_without_biases(gqa: TinyLoaded) -> None:
    e = explain(gqa, "the cat saw the dog and it ran", "the", occurrence=2, layer=1, head=4)
    assert (e.token_index, e.occurrence, e.occurrences) == (4, 2, [1, 4])
    assert (e.n_heads, e.n_kv_heads, e.kv_head, e.kv_shared_by) == (6, 2, 1, [3, 4, 5])
    assert not e.bias
    assert e.pattern[5:] == [0.0] * 4  # causal: nothing after the token
    assert {f.role for f in e.ranking} <= {
        RELATIONAL,
        FUNCTION,
        "previous",
        "current",
        "first",
        "last",
        "special",
    }
    assert len(e.ranking) == 12
    d = e.to_dict(top=2)
    assert [r["role"] for r in d["ranking"]] == [f.role for f in (*e.relational[:2], *e.positional[:2])]
    assert d["positional"] == [[f.layer, f.head] for f in e.positional]


def test_the_walk_names_the_kv_head_only_with_grouped_query_attention(gqa: TinyLoaded, capsys) -> None:
    e = explain(gqa, "the cat saw the dog and it ran", "it", layer=1, head=4)
    assert kv_note(e) == " (key/value head 1, shared by query heads 3-5)"
    render_explanation(e)
    out = capsys.readouterr().out
    assert "Layer 1, head 4 (key/value head 1, shared by query heads 3-5)" in out
    assert "q = x W_Q[4]   W_Q[4]" in out  # no biases in this model: none is written
    assert "k_j = x_j W_K[1], v_j = x_j W_V[1] for every token j" in out
    assert "6. out = concat W_O   W_O: [30, 30]" in out and "b_O" not in out
    assert occurrence_note(e) == ""  # "it" occurs once


def test_the_walk_of_a_rotary_model_holds_the_rotated_q_and_k_its_scores_use() -> None:
    from headspace.analysis.explain import explain as explain_fn

    torch.manual_seed(0)
    cfg = ModelConfig(
        arch="decoder", vocab_size=29, d_model=24, n_layers=2, n_heads=6, n_kv_heads=2, d_mlp=16,
        max_seq_len=16, positions="rotary", norm_kind="rmsnorm", mlp_kind="gated", act="silu",
    )  # fmt: skip
    model = Decoder(cfg).eval()

    class Words:  # a model with a tokenizer of one token per word
        def __init__(self) -> None:
            self.model, self.config, self.tokenizer = model, cfg, self

        def tokens(self, sentence: str) -> list[str]:
            return sentence.split()

        def tokenize_padded(self, texts):
            ids = torch.tensor([[hash(w) % 29 for w in t.split()] for t in texts])
            return ids, torch.ones_like(ids, dtype=torch.bool)

    e = explain_fn(Words(), "a b c d e f", "d", layer=1, head=4)
    assert e.rotary_dim == 4 and e.rope_theta == cfg.rope_theta and e.kv_head == 1
    scores = torch.tensor(e.k_rot) @ torch.tensor(e.q_rot) * e.scale  # (seq,)
    causal = torch.tensor([s is not None for s in e.scores])
    torch.testing.assert_close(scores[causal], torch.tensor([s for s in e.scores if s is not None]))
    assert not torch.allclose(torch.tensor(e.q_rot), torch.tensor(e.q))  # position 3 rotates q
