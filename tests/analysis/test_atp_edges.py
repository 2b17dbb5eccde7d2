"""AtP over the circuit graph's edges (issue 41): ``atp_star(model, task, site="edges", method="atp")``.

Held to exact edge patching (``run_graph`` with one edge carrying the clean sender's output into the
corrupt run) on tiny random decoders: equal to first order where the clean and corrupt tokens' embeddings
differ by little, and ranking the edges like exact patching on random pairs; EAP with the runs swapped is
the same number. Each test failed on 5223863 (no ``site="edges"``).
"""

from __future__ import annotations

import pytest
import torch

import headspace as hs
from headspace.analysis.atp_star import atp_star
from headspace.analysis.circuits.edges import _metric, edge_scores
from headspace.analysis.graph import graph_of, run_graph
from headspace.analysis.tasks import Task

V = 41


def decoder(kind: str, seed: int = 0) -> hs.Decoder:
    torch.manual_seed(seed)
    common = dict(vocab_size=V, d_model=24, n_layers=3, d_mlp=40, max_seq_len=32, dropout=0.0,
                  attn_dropout=0.0, emb_dropout=0.0)  # fmt: skip
    if kind == "gpt2":
        cfg = hs.ModelConfig(arch="decoder", n_heads=4, **common)
    else:
        cfg = hs.ModelConfig(
            arch="decoder", n_heads=4, d_head=6, n_kv_heads=2, norm_kind="rmsnorm", mlp_kind="gated",
            act="silu", positions="rotary", bias=True, **common,
        )  # fmt: skip
    model = hs.Decoder(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name or "bias" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def task(n: int = 5, seq: int = 8, seed: int = 3, swap_to: int | None = None) -> Task:
    """Random pairs (tokens 4..V-1) that differ at positions 2 and 5 (there token ``swap_to`` in the
    corrupt prompt, when given); answer token 0, other 1."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(4, V, (n, seq), generator=g)
    corrupt = clean.clone()
    for pos in (2, 5):
        corrupt[:, pos] = torch.randint(4, V, (n,), generator=g) if swap_to is None else swap_to
        if swap_to is not None:
            clean[:, pos] = 2
    lens = torch.tensor([seq] * n)
    answer, other = torch.zeros(n, dtype=torch.int64), torch.ones(n, dtype=torch.int64)
    return Task("edges", clean, corrupt, lens, answer, other, [("", "")] * n)


def exact_edge_effects(model: hs.Decoder, t: Task, edges: list[tuple[int, int]]) -> torch.Tensor:
    """M(corrupt run, edge u -> v carrying u's clean output) - M(corrupt run), mean over pairs, per edge."""
    graph = graph_of(model)
    last = t.last
    with torch.no_grad():
        e_clean, e_corrupt = model.embed(t.clean), model.embed(t.corrupt)
        clean = run_graph(model, graph, e_clean, last, keep_acts=True)
        base = _metric(run_graph(model, graph, e_corrupt, last).logits, t)
        out = []
        for u, v in edges:
            one = torch.zeros_like(graph.valid)
            one[u, v] = True
            patched = run_graph(model, graph, e_corrupt, last, corrupt=clean.acts, missing=one)
            out.append(float((_metric(patched.logits, t) - base).mean()))
    return torch.tensor(out, dtype=torch.float64)


def sample_edges(valid: torch.Tensor, n: int, seed: int = 0) -> list[tuple[int, int]]:
    idx = valid.nonzero().tolist()
    g = torch.Generator().manual_seed(seed)
    return [tuple(idx[i]) for i in torch.randperm(len(idx), generator=g)[:n].tolist()]  # type: ignore[misc]


def first_order_error(kind: str, step: float) -> tuple[float, float]:
    """(max |AtP - exact| over 60 edges, max |exact|) where the corrupt token's embedding is ``step`` away
    from the clean one's (float64)."""
    model = decoder(kind).double()
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        noise = torch.randn(24, generator=g, dtype=torch.float64)
        model.tok_embed.weight[3] = model.tok_embed.weight[2] + step * noise
    t = task(swap_to=3)
    got = atp_star(model, t, site="edges", method="atp")
    assert got.method == "atp" and got.scores.shape == graph_of(model).valid.shape
    edges = sample_edges(got.valid, 60)
    exact = exact_edge_effects(model, t, edges)
    est = torch.tensor([float(got.scores[u, v]) for u, v in edges], dtype=torch.float64)
    return float((est - exact).abs().max()), float(exact.abs().max())


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_edge_atp_equals_exact_edge_patching_to_first_order(kind: str) -> None:
    err4, scale4 = first_order_error(kind, 1e-4)
    err5, scale5 = first_order_error(kind, 1e-5)
    assert scale5 > 1e-7 and 8 < scale4 / scale5 < 12  # the effects are first order in the step
    assert err5 < 2e-3 * scale5  # and AtP gets them: the rest is second order,
    assert err5 < 0.2 * err4  # falling with the step's square


def test_edge_atp_ranks_like_exact_patching_and_is_eap_with_the_runs_swapped() -> None:
    model = decoder("llama", seed=1)
    t = task(n=6)
    got = atp_star(model, t, site="edges", method="atp")
    edges = sample_edges(got.valid, 80, seed=2)
    exact = exact_edge_effects(model, t, edges)
    est = torch.tensor([float(got.scores[u, v]) for u, v in edges], dtype=torch.float64)
    assert float(torch.corrcoef(torch.stack([est, exact]))[0, 1]) > 0.8
    swapped = Task("swapped", t.corrupt, t.clean, t.lengths, t.answer, t.other, t.texts)
    eap = edge_scores(model, swapped, "eap")  # gradient at swapped.clean = the corrupt run
    torch.testing.assert_close(got.scores, eap.scores, atol=1e-6, rtol=1e-5)
    assert got.clean_metric == pytest.approx(eap.corrupt_metric, abs=1e-5)


def test_edges_refuse_the_fixes_by_name() -> None:
    model, t = decoder("gpt2"), task(n=2)
    for kw in ({}, {"method": "atp*"}, {"method": "atp", "graddrop": True}):
        with pytest.raises(ValueError, match="site 'edges' takes method='atp'"):
            atp_star(model, t, site="edges", **kw)
    with pytest.raises(ValueError, match="method must be one of"):
        atp_star(model, t, site="edges", method="eap")
