"""Induction scores (headspace.analysis.induction_scores, head_roles(..., induction=...)): a head built to be
an induction head scores ~1 and gets the label; random models score in [0, 1], reproducibly per seed; the
score is the traced pattern's mass on the token after the first occurrence."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

import headspace as hs
from headspace import MultiHeadAttention, analysis
from headspace.analysis import induction_scores, repeated_tokens
from headspace.analysis.trace import trace

pytestmark = pytest.mark.usefixtures("single_thread")

V, P = 16, 25  # vocabulary, longest sequence (a BOS and two copies of 12 tokens)
D = (
    V + P + V
)  # slots: the token one-hot, the position one-hot, the previous token's one-hot (written by layer 0)


class HandMadeInduction(nn.Module):
    """Two causal attention layers wired by hand into the textbook induction circuit.

    Layer 0, one head: a previous-token head (query i matches key i - 1 by position) that copies the
    previous token's one-hot into the third slot. Layer 1, head 0: an induction head, whose query is the
    current token and whose key is the *previous* token of each position, so that query i attends to the
    position after an earlier occurrence of its token; head 1 has zero q/k weights (uniform attention).
    (Position 0 has no previous token and copies its own: a BOS there keeps it from matching a query.)
    """

    def __init__(self, c: float = 10.0) -> None:
        super().__init__()
        self.prev = MultiHeadAttention(D, 1, d_head=P, bias=False)
        self.induct = MultiHeadAttention(D, 2, d_head=V, bias=False)
        with torch.no_grad():
            a = self.prev
            for w in (a.W_Q, a.W_K, a.W_V, a.W_O):
                w.zero_()
            a.W_Q[0][V : V + P] = c * torch.eye(P)  # q_i = c e_i
            a.W_K[0][V : V + P - 1, 1:] = c * torch.eye(
                P - 1
            )  # k_j = c e_{j+1}: q_i . k_j large iff j = i - 1
            a.W_V[0][:V, :V] = torch.eye(V)  # v_j = token one-hot of j
            a.W_O[0][:V, V + P :] = torch.eye(V)  # into the previous-token slot
            b = self.induct
            for w in (b.W_Q, b.W_K):
                w.zero_()
            b.W_Q[0][:V] = c * torch.eye(V)  # q_i = c e_{t_i}
            b.W_K[0][V + P :] = c * torch.eye(V)  # k_j = c e_{t_{j-1}}
        self.embed = torch.cat([torch.eye(V), torch.zeros(V, P + V)], dim=1)  # (V, D)
        self.position = torch.cat([torch.zeros(P, V), torch.eye(P), torch.zeros(P, V)], dim=1)  # (P, D)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed[tokens] + self.position[: tokens.shape[1]]  # (batch, seq, D)
        x = x + self.prev(x, is_causal=True)
        return x + self.induct(x, is_causal=True)


def test_the_hand_made_induction_head_scores_near_one_and_gets_the_label() -> None:
    model = HandMadeInduction().eval()
    scores = induction_scores(model, n=12, batch=3, seed=0, bos=0, vocab_size=V)
    assert scores.shape == (2, 2) and torch.isnan(scores[0, 1])  # layer 0 has one head
    assert float(scores[1, 0]) > 0.99  # the induction head
    assert float(scores[0, 0]) < 0.01  # the previous-token head looks at i - 1, not i - n + 1
    assert float(scores[1, 1]) < 0.2  # uniform attention: about 1 / (keys before the query)
    tokens = repeated_tokens(V, 12, 2, seed=3, bos=0)
    roles = analysis.head_roles(model, tokens, induction=scores)
    assert roles.labels[1][0] == "induction" and roles.heads_with("induction") == [(1, 0)]
    assert roles.labels[0][0] == "previous"  # the positional label where the score is low
    assert roles.induction is not None and torch.equal(roles.induction[1, :1], scores[1, :1])
    assert roles.to_dict()["induction"][0][1] is None  # NaN (no such head) -> None in JSON
    assert "induction score" in roles._repr_html_()


def test_induction_score_is_the_traced_mass_on_the_token_after_the_first_occurrence() -> None:
    torch.manual_seed(3)
    config = hs.ModelConfig(
        arch="decoder", vocab_size=40, d_model=24, n_layers=2, n_heads=4, n_kv_heads=2, d_head=6, d_mlp=20,
        max_seq_len=64, positions="rotary", norm_kind="rmsnorm", mlp_kind="gated", act="silu", bias=False,
    )  # fmt: skip
    model = hs.Decoder(config).eval()
    n, bos = 9, 7
    scores = induction_scores(model, n=n, batch=2, seed=5, bos=bos)
    tokens = repeated_tokens(40, n, 2, seed=5, bos=bos)
    with torch.no_grad(), trace(model, "*hook_pattern") as t:
        model(tokens)
    queries = torch.arange(1 + n, 1 + 2 * n)
    for layer in range(2):
        p = t.pattern(layer)  # (2, 4, 19, 19)
        want = p[:, :, queries, queries - n + 1].mean(dim=(0, 2))  # (4,)
        assert_close(scores[layer], want)
    assert ((scores >= 0) & (scores <= 1)).all()


def test_random_model_scores_are_in_0_1_and_reproducible_per_seed() -> None:
    config = hs.ModelConfig(arch="decoder", vocab_size=97, d_model=32, n_layers=3, n_heads=4, max_seq_len=128)
    model = hs.Decoder(config).eval()
    a = induction_scores(model, seed=11)
    assert a.shape == (3, 4) and a.dtype == torch.float32
    assert ((a >= 0) & (a <= 1)).all()
    assert torch.equal(a, induction_scores(model, seed=11))
    assert not torch.equal(a, induction_scores(model, seed=12))
    roles = analysis.head_roles(model, torch.randint(0, 97, (2, 9)), induction=True)
    assert roles.induction is not None and torch.equal(roles.induction, induction_scores(model))
    assert analysis.head_roles(model, torch.randint(0, 97, (2, 9))).induction is None  # default: not computed


def test_repeated_tokens_two_copies_of_distinct_ids_after_the_bos() -> None:
    tokens = repeated_tokens(30, 10, 4, seed=2, bos=0, exclude=[5])
    assert tokens.shape == (4, 21) and (tokens[:, 0] == 0).all()
    assert torch.equal(tokens[:, 1:11], tokens[:, 11:])
    for row in tokens[:, 1:11]:
        assert len(set(row.tolist())) == 10 and not {0, 5} & set(row.tolist())
    assert torch.equal(tokens, repeated_tokens(30, 10, 4, seed=2, bos=0, exclude=[5]))
    small = repeated_tokens(3, 8, 1, seed=0)  # fewer ids than n: drawn with replacement
    assert small.shape == (1, 16) and torch.equal(small[:, :8], small[:, 8:])


def test_induction_bad_input() -> None:
    model = hs.Decoder(hs.ModelConfig(arch="decoder", vocab_size=11, d_model=8, n_heads=2, max_seq_len=16))
    with pytest.raises(ValueError, match=r"the repeated sequence has 100 tokens .* more than max_seq_len=16"):
        induction_scores(model)
    with pytest.raises(ValueError, match=r"bos must be 'auto', None or a token id in \[0, 11\)"):
        induction_scores(model, n=4, bos=11)
    with pytest.raises(TypeError, match=r"has no config\.vocab_size"):
        induction_scores(MultiHeadAttention(8, 2), n=3)
    with pytest.raises(ValueError, match="n must be a positive int"):
        induction_scores(model, n=0)
    with pytest.raises(ValueError, match=r"induction must have shape \[n_layers, n_heads\] = \[6, 2\]"):
        analysis.head_roles(model, torch.randint(0, 11, (1, 5)), induction=torch.zeros(2, 2))
    with pytest.raises(TypeError, match="induction must be a bool or the scores"):
        analysis.head_roles(model, torch.randint(0, 11, (1, 5)), induction="yes")


@pytest.mark.slow
def test_smollm2_has_induction_heads(smollm2_gguf) -> None:
    from headspace.pretrained.gguf_format import read_gguf
    from headspace.pretrained.llama import llama_from_tensors

    g = read_gguf(smollm2_gguf)
    model = llama_from_tensors(g.hf_config, g.tensors, g.tokenizer, name="smollm2")
    scores = induction_scores(model, n=30, batch=2, seed=0, bos=1)
    assert scores.shape == (30, 9) and ((scores >= 0) & (scores <= 1)).all()
    assert float(scores.max()) > 0.5  # a 135M-parameter model has strong induction heads
    assert float(scores.median()) < 0.2  # ... and most heads are not
