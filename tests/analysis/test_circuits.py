"""Which heads work together: score decomposition, composition scores, edge scores and circuits.

Identities held here: a head's score is the sum of its parts (random models of each family, MiniLM as
BERT, a transformers GPT-2, SmolLM2); one part equals the maths written out by hand; composition scores
equal dense Frobenius norms written out by hand; the graph run equals the model's forward (every edge)
and the corrupt forward (no edge); the batched circuit run equals an edge-by-edge reference run written
here with loops; EAP and EAP-IG scores equal autograd derivatives of that reference run, one scalar per
edge; faithfulness is 1 and 0 exactly at the ends; bad tasks are refused by name.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import transformers  # a dev dependency: the reference models are built with it
from click.testing import CliRunner
from torch.testing import assert_close

import headspace as hs
from headspace.analysis import circuits as C
from headspace.analysis import tasks as T
from headspace.analysis.decomposition import composition_scores, score_decomposition
from headspace.analysis.graph import graph_grads, graph_of, run_graph
from headspace.cli import cli

V, S = 53, 9  # vocabulary, sequence length


def make_model(
    kind: str, dtype: torch.dtype = torch.float32, seed: int = 0, n_layers: int = 3
) -> torch.nn.Module:
    """A random model of one family, with non-trivial norms and biases."""
    torch.manual_seed(seed)
    common = dict(vocab_size=V, d_model=30, n_layers=n_layers, d_mlp=44, max_seq_len=32, dropout=0.0,
                  attn_dropout=0.0, emb_dropout=0.0)  # fmt: skip
    if kind == "gpt2":
        cfg = hs.ModelConfig(arch="decoder", n_heads=5, **common)
    elif kind == "bert":
        cfg = hs.ModelConfig(arch="encoder", n_heads=5, norm="post", **common)
    elif kind in ("gemma", "olmo2"):  # a norm after the attention, QK-norm per head / over all heads
        gemma = kind == "gemma"
        cfg = hs.ModelConfig(
            arch="decoder", n_heads=4, d_head=6, n_kv_heads=1 if gemma else 2, norm_kind="rmsnorm",
            mlp_kind="gated", act="gelu_tanh" if gemma else "silu", positions="rotary", bias=False,
            norm="sandwich" if gemma else "post_sublayer", qk_norm="head" if gemma else "all",
            norm_offset=1.0 if gemma else 0.0, **common,
        )  # fmt: skip
    else:  # a Llama-family decoder with q/k/v biases (Qwen2-like), rotary, 2 kv heads for 4 query heads
        cfg = hs.ModelConfig(
            arch="decoder",
            n_heads=4,
            d_head=6,
            n_kv_heads=2,
            norm_kind="rmsnorm",
            mlp_kind="gated",
            act="silu",
            positions="rotary",
            bias=True,
            **common,
        )
    model = (hs.Encoder if kind == "bert" else hs.Decoder)(cfg).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name or "bias" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


# ------------------------------------------------------------------------------- score decomposition
@pytest.mark.parametrize("kind", ["gpt2", "bert", "llama", "gemma", "olmo2"])
def test_score_parts_add_up_to_the_traced_score(kind: str) -> None:
    """Also through Gemma's sandwich norms and OLMo 2's post-sublayer ones (the heads reach the stream
    through a frozen norm) and QK-norm (the parts at the run's frozen norm scales)."""
    model = make_model(kind)
    tokens = torch.randint(0, V, (1, S), generator=torch.Generator().manual_seed(1))
    for layer, head, q in [(0, 1, 4), (2, 3, 8), (1, 0, 6)]:
        r = score_decomposition(model, tokens, layer, head, query=q)
        n_heads = model.blocks[0].attn.n_heads
        assert r.parts.shape == (2 + layer * (n_heads + 1),) * 2
        assert r.components[0] == "embed" and r.components[-1] == "bias"
        assert abs(r.total - r.score) <= 1e-4 * max(1.0, abs(r.score))
        with hs.trace(model, names=f"blocks.{layer}.attn.hook_pattern") as t:
            model(tokens)
        assert r.key == int(
            t[f"blocks.{layer}.attn.hook_pattern"][0, head, q].argmax()
        )  # key=None: the top key
    r64 = score_decomposition(make_model(kind, torch.float64), tokens, 2, 1, query=7, key=3)
    # float64 end to end, except that RMSNorm normalises in float32 (as transformers' does)
    assert abs(r64.total - r64.score) < (1e-10 if kind in ("gpt2", "bert") else 1e-6)


def test_one_part_is_the_maths_written_out_by_hand() -> None:
    """Layer 0 of a rotary RMSNorm model: parts[embed, embed] is scale * (e_i w / rms_i) W_Q R(i) . (e_j w /
    rms_j) W_K R(j), the biases and rotation of rotary.rotate applied at the two positions."""
    model = make_model("llama", torch.float64)
    tokens = torch.randint(0, V, (1, S), generator=torch.Generator().manual_seed(2))
    i, j, h = 7, 2, 3
    r = score_decomposition(model, tokens, 0, h, query=i, key=j)
    attn, ln = model.blocks[0].attn, model.blocks[0].ln1
    e = model.embed(tokens)[0]  # (S, d)
    x = e * ln.weight / torch.sqrt(e.pow(2).mean(-1, keepdim=True) + ln.eps)  # RMSNorm with its scale frozen
    g = h // (attn.n_heads // attn.n_kv_heads)
    q = attn.rotary.rotate((x @ attn.W_Q[h])[None, None], torch.arange(S))[0, 0]  # (S, dh), no bias
    k = attn.rotary.rotate((x @ attn.W_K[g])[None, None], torch.arange(S))[0, 0]
    # the frozen RMS scale is taken in float32, as the model's RMSNorm computes it
    assert_close(r.parts[0, 0], (q[i] @ k[j]) * attn.scale, rtol=1e-6, atol=1e-6)
    assert r.components == ["embed", "bias"]


@pytest.mark.slow
def test_score_decomposition_on_pretrained_models(smollm2, tmp_path: Path) -> None:
    minilm = hs.load("minilm")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=61, n_positions=17, n_embd=28, n_layer=3, n_head=7,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(tmp_path / "gpt2")
    gpt2 = hs.load_gpt2(tmp_path / "gpt2")
    cases = [
        (minilm, "The cat sat on the mat because it was tired.", 5, 11, 9),  # BERT
        (gpt2, torch.randint(0, 61, (1, 12), generator=torch.Generator().manual_seed(3)), 2, 6, 11),
        (smollm2, "When Mary and John went to the store, John gave a drink to", 18, 6, -1),
    ]
    for model, prompt, layer, head, q in cases:
        r = score_decomposition(model, prompt, layer, head, query=q)
        assert abs(r.total - r.score) <= 1e-4 * max(1.0, abs(r.score)), (layer, head, r.total, r.score)


def test_score_decomposition_refuses_bad_positions() -> None:
    model = make_model("gpt2")
    tokens = torch.randint(0, V, (1, S))
    with pytest.raises(ValueError, match=r"layer must be in \[-3, 3\)"):
        score_decomposition(model, tokens, 3, 0)
    with pytest.raises(ValueError, match="head must be in"):
        score_decomposition(model, tokens, 0, 5)
    with pytest.raises(ValueError, match="key must be at or before the query"):
        score_decomposition(model, tokens, 1, 0, query=2, key=5)
    with pytest.raises(ValueError, match="takes one prompt"):
        score_decomposition(model, torch.randint(0, V, (2, S)), 1, 0)


# ------------------------------------------------------------------------------- composition scores
def _dense_score(A: torch.Tensor, B: torch.Tensor) -> float:
    A, B = A.detach(), B.detach()
    return float(torch.linalg.norm(A @ B) / (torch.linalg.norm(A) * torch.linalg.norm(B)))


@pytest.mark.parametrize("fold", [False, True])
def test_composition_scores_equal_dense_products_by_hand(fold: bool) -> None:
    """GPT-2-shaped: Q = ||W_OV^s W_QK^t|| / (||W_OV^s|| ||W_QK^t||), K with W_QK^t transposed, V with W_OV^t
    (TransformerLens's all_composition_scores); folded: LN1's weight on the reader, W_O centred."""
    model = make_model("gpt2", torch.float64)
    c = composition_scores(model, fold_norms=fold)
    for (ls, hs_), (lt, ht) in [((0, 1), (2, 3)), ((1, 4), (2, 0)), ((0, 0), (1, 2))]:
        a_s, a_t = model.blocks[ls].attn, model.blocks[lt].attn
        w = model.blocks[lt].ln1.weight if fold else torch.ones(30, dtype=torch.float64)
        W_O_s = a_s.W_O[hs_] - (a_s.W_O[hs_].mean(-1, keepdim=True) if fold else 0)  # (dh, d)
        ov_s = a_s.W_V[hs_] * (model.blocks[ls].ln1.weight[:, None] if fold else 1) @ W_O_s
        W_O_t = a_t.W_O[ht] - (a_t.W_O[ht].mean(-1, keepdim=True) if fold else 0)
        qk_t = (w[:, None] * a_t.W_Q[ht]) @ (w[:, None] * a_t.W_K[ht]).T  # (d, d)
        ov_t = (w[:, None] * a_t.W_V[ht]) @ W_O_t
        assert c.q[0, ls, hs_, lt, ht].item() == pytest.approx(_dense_score(ov_s, qk_t), rel=1e-9)
        assert c.k[0, ls, hs_, lt, ht].item() == pytest.approx(_dense_score(ov_s, qk_t.T), rel=1e-9)
        assert c.v[ls, hs_, lt, ht].item() == pytest.approx(_dense_score(ov_s, ov_t), rel=1e-9)
    assert (c.q[0, 2, :, 1] == 0).all() and (c.v[1, :, 1] == 0).all()  # only earlier heads compose
    assert 0 < c.baseline["q"] < 1


def test_rotary_composition_uses_qk_at_each_offset() -> None:
    model = make_model("llama", torch.float64)
    c = composition_scores(model, offsets=[0, 3], fold_norms=False)
    a_s, a_t = model.blocks[0].attn, model.blocks[1].attn
    ov = a_s.heads[1].ov().AB  # (d, d)
    for n, delta in enumerate([0, 3]):
        qk = a_t.heads[2].qk(delta).AB  # W_Q R(delta) W_K^T
        assert c.q[n, 0, 1, 1, 2].item() == pytest.approx(_dense_score(ov, qk), rel=1e-9)
        assert c.k[n, 0, 1, 1, 2].item() == pytest.approx(_dense_score(ov, qk.T), rel=1e-9)
    assert c.q[0, 0, 1, 1, 2] != c.q[1, 0, 1, 1, 2]
    assert c.offsets == [0, 3]


@pytest.mark.parametrize("kind", ["gemma", "olmo2"])
def test_composition_scores_take_qk_norm_and_post_attention_gains(kind: str) -> None:
    """A model's norm gains inside the heads' circuits (QK-norm's, the post-attention norm's and, for
    sandwich blocks, the pre-attention LN1's) count as if they were in W_Q, W_K, W_V, W_O: the same
    model with every such gain moved into those weights (and the norms' gains made 1) has the same
    scores. (The RMS divisions the move changes are one number per token and head, which the ratios
    cancel.)"""
    a = make_model(kind, torch.float64)
    b = copy.deepcopy(a)
    with torch.no_grad():
        for block in b.blocks:
            attn = block.attn
            g_q, g_k = attn.qk_norm_gains()  # (H, dh), (Hkv, dh)
            attn.W_Q.mul_(g_q[:, None, :].clone())
            attn.W_K.mul_(g_k[:, None, :].clone())
            for norm in (attn.q_norm, attn.k_norm):
                norm.weight.fill_(1 - norm.offset)
            after = block.ln_attn_out if kind == "gemma" else block.ln1  # sandwich / post-sublayer
            attn.W_O.mul_((after.weight + after.offset).clone())
            after.weight.fill_(1 - after.offset)
            if kind == "gemma":  # the heads read ln1(x)
                w = (block.ln1.weight + block.ln1.offset).clone()  # (d,)
                for W in (attn.W_Q, attn.W_K, attn.W_V):
                    W.mul_(w[:, None])
                block.ln1.weight.fill_(1 - block.ln1.offset)
    ca, cb = composition_scores(a, offsets=[0, 2]), composition_scores(b, offsets=[0, 2])
    for x, y in ((ca.q, cb.q), (ca.k, cb.k), (ca.v, cb.v)):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    assert ca.q.max() > 0.05


# ---------------------------------------------------------------------------- the graph and circuits
def random_task(seed: int = 4, n: int = 5) -> T.Task:
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, V, (n, S), generator=g)
    corrupt = torch.randint(0, V, (n, S), generator=g)
    lengths = torch.tensor([S, S - 2, S, S - 4, S - 1][:n])
    ans = torch.randint(0, V, (n,), generator=g)
    return T.Task("random", clean, corrupt, lengths, ans, (ans + 1) % V, [("", "")] * n)


def reference_run(model, emb, last, mask, corrupt=None, eps=None, delta=None):
    """The circuit run written edge by edge with loops: each receiver's input is the sum over its
    senders of the sender's activation (this run's if the edge is in ``mask``, else ``corrupt``'s), plus
    the b_O constants, plus ``eps[u, r] * delta[u]`` per edge. Returns (logits [B, vocab], acts dict)."""
    graph = graph_of(model)
    sidx = {n: i for i, n in enumerate(graph.senders)}
    ridx = {n: i for i, n in enumerate(graph.receivers)}
    acts = {"embed": emb}
    const = torch.zeros_like(emb)

    def read(r_name):
        r = ridx[r_name]
        x = const.clone()
        for u_name, a in acts.items():
            u = sidx[u_name]
            if graph.valid[u, r]:
                x = x + (a if corrupt is None or mask[u, r] else corrupt[u_name])
                if eps is not None:
                    x = x + eps[u, r] * delta[u_name]
        return x

    B, Sq, _ = emb.shape
    causal = torch.ones(Sq, Sq, dtype=torch.bool).tril()
    for lay, block in enumerate(model.blocks):
        attn = block.attn
        group = attn.n_heads // attn.n_kv_heads
        kv = "H" if group == 1 else "KV"
        new = {}
        for h in range(attn.n_heads):
            g = h // group
            xq = block.ln1(read(f"L{lay}H{h}.q"))
            xk, xv = block.ln1(read(f"L{lay}{kv}{g}.k")), block.ln1(read(f"L{lay}{kv}{g}.v"))
            q, k, v = xq @ attn.W_Q[h], xk @ attn.W_K[g], xv @ attn.W_V[g]  # (B, S, dh) each
            if attn.b_Q is not None:
                q, k, v = q + attn.b_Q[h], k + attn.b_K[g], v + attn.b_V[g]
            if attn.rotary is not None:
                q = attn.rotary.rotate(q[:, None], torch.arange(Sq))[:, 0]
                k = attn.rotary.rotate(k[:, None], torch.arange(Sq))[:, 0]
            scores = (q @ k.transpose(-1, -2) * attn.scale).masked_fill(~causal, float("-inf"))
            new[f"L{lay}H{h}"] = torch.softmax(scores, -1) @ v @ attn.W_O[h]
        acts.update(new)
        if attn.b_O is not None:
            const = const + attn.b_O
        acts[f"mlp{lay}"] = block.mlp(block.ln2(read(f"mlp{lay}.in")))
    rows = read("logits")[torch.arange(B), last]
    return model.ln_final(rows) @ model.W_U, acts


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_graph_run_is_the_forward_with_every_edge_and_the_corrupt_forward_with_none(kind: str) -> None:
    model = make_model(kind)
    task = random_task()
    graph = graph_of(model)
    with torch.no_grad():
        clean = run_graph(model, graph, model.embed(task.clean), task.last, keep_acts=True)
        corrupt = run_graph(model, graph, model.embed(task.corrupt), task.last, keep_acts=True)
        rows = torch.arange(len(task))
        assert_close(clean.logits, model(task.clean)[rows, task.last], atol=1e-5, rtol=1e-5)
        none = run_graph(
            model, graph, model.embed(task.clean), task.last, corrupt=corrupt.acts, missing=graph.valid
        )
        assert_close(none.logits, model(task.corrupt)[rows, task.last], atol=1e-5, rtol=1e-5)
    heads = graph.n_heads
    assert graph.valid[0].all() and graph.valid[:, -1].all()  # embed feeds all, logits read all
    assert graph.valid[1, graph.per_layer - 1] and not graph.valid[1, 0]  # L0H0 -> mlp0.in, not L0H0.q
    assert not graph.valid[1 + heads, graph.per_layer - 1]  # mlp0 does not feed its own input


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_batched_circuit_run_equals_the_edge_by_edge_run(kind: str) -> None:
    model = make_model(kind, torch.float64)
    task = random_task()
    graph = graph_of(model)
    mask = torch.rand(graph.valid.shape, generator=torch.Generator().manual_seed(7)) < 0.5
    with torch.no_grad():
        e_clean, e_corrupt = model.embed(task.clean), model.embed(task.corrupt)
        corrupt = run_graph(model, graph, e_corrupt, task.last, keep_acts=True).acts
        got = run_graph(model, graph, e_clean, task.last, corrupt=corrupt, missing=graph.valid & ~mask).logits
        _, ref_corrupt = reference_run(model, e_corrupt, task.last, mask)
        want, _ = reference_run(model, e_clean, task.last, mask, corrupt=ref_corrupt)
    assert_close(got, want, atol=1e-10, rtol=1e-10)
    assert not torch.allclose(got, model(task.clean)[torch.arange(5), task.last].double())  # the patch acted


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("density", [0.03, 0.5, 0.97, "late"])
def test_patched_run_from_either_side_equals_the_edge_by_edge_run(kind: str, density: float | str) -> None:
    """Given the corrupt GraphRun (its residual streams), blocks that keep fewer edges start from the
    corrupt stream and add the kept edges; sparse circuits gather only their senders; blocks that keep
    no edge take the corrupt run's outputs ("late": only the last layer's MLP and the logits keep
    edges). Every density equals the loop reference, and the same run given only the corrupt
    activations."""
    model = make_model(kind, torch.float64)
    task = random_task()
    graph = graph_of(model)
    if density == "late":
        mask = torch.zeros_like(graph.valid)
        mask[::3, -2:] = True  # (n_senders, n_receivers): mlp2.in and the logits
    else:
        mask = torch.rand(graph.valid.shape, generator=torch.Generator().manual_seed(11)) < density
    with torch.no_grad():
        e_clean, e_corrupt = model.embed(task.clean), model.embed(task.corrupt)
        corrupt = run_graph(model, graph, e_corrupt, task.last, keep_acts=True)
        assert corrupt.resids is not None and len(corrupt.resids) == 2 * graph.n_layers + 1
        missing = graph.valid & ~mask
        got = run_graph(model, graph, e_clean, task.last, corrupt=corrupt, missing=missing).logits
        by_acts = run_graph(model, graph, e_clean, task.last, corrupt=corrupt.acts, missing=missing).logits
        _, ref_corrupt = reference_run(model, e_corrupt, task.last, mask)
        want, _ = reference_run(model, e_clean, task.last, mask, corrupt=ref_corrupt)
        none = run_graph(model, graph, e_clean, task.last, corrupt=corrupt, missing=graph.valid).logits
    assert_close(got, want, atol=1e-10, rtol=1e-10)
    assert_close(by_acts, want, atol=1e-10, rtol=1e-10)
    assert torch.equal(none, corrupt.logits)  # no edge kept: every receiver reads the corrupt stream


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("case", [10, 20, 45, "gather"])
def test_circuit_run_computes_only_what_reaches_the_logits(kind: str, case: int | str) -> None:
    """A patched run computes a head or MLP only where it changes (a receiver of it keeps an edge from
    a sender that changed) and is read (it keeps an edge into the logits or a computed node): the top-k
    circuits of EAP scores compute some heads of a layer (under GQA some key/value heads), and "gather"
    (one layer's attention reads only the embeddings and the previous MLP) gathers two rows of many.
    Equal to the loop reference with the corrupt GraphRun, with its activations only (every node that
    reaches the logits computed), with keep_acts (every sender's activation, nothing left out for not
    being read) and keep_inputs (every node computed), and given the corrupt run's mixed values (each
    head's delta from its own, as the curve runs it)."""
    from headspace.analysis.circuits.graph import run_rows
    from headspace.analysis.circuits.plan import plan_run

    model = make_model(kind, torch.float64)
    task = random_task()
    graph = graph_of(model)
    if case == "gather":
        mask = graph.valid.clone()
        lay, per = 2, graph.per_layer
        cols = slice(lay * per, lay * per + per - 1)  # layer 2's q/k/v receivers
        mask[:, cols] = False
        mask[[0, graph.attn_senders(lay) - 1], cols] = True  # the embeddings and mlp1 only
    else:
        mask = C.find_circuit(C.edge_scores(model, task, "eap"), edges=case).edges
    missing = graph.valid & ~mask
    plan = plan_run(model, graph, missing, resids=True, prune=True, full=False, dtype=torch.float64,
                 device=torch.device("cpu"))  # fmt: skip
    if case == "gather":  # every sender before layer 2 computed, two of them read
        assert plan.n_slots == len(graph.senders)
        rows = plan_run(model, graph, missing, resids=True, prune=True, full=False, dtype=torch.float64,
                     device=torch.device("cpu"), block=1).layers[2].near  # fmt: skip
        assert rows.slots is not None and rows.slots.tolist() == [0, graph.attn_senders(2) - 1]
    elif case == 20:
        assert any(lp.sel is not None and lp.sel.heads is not None for lp in plan.layers)  # some heads
        assert plan.n_slots < len(graph.senders)
    with torch.no_grad():
        e_clean, e_corrupt = model.embed(task.clean), model.embed(task.corrupt)
        corrupt = run_graph(model, graph, e_corrupt, task.last, keep_acts=True)
        _, ref_corrupt = reference_run(model, e_corrupt, task.last, mask)
        want, ref_acts = reference_run(model, e_clean, task.last, mask, corrupt=ref_corrupt)
        got = run_graph(model, graph, e_clean, task.last, corrupt=corrupt, missing=missing)
        by_acts = run_graph(model, graph, e_clean, task.last, corrupt=corrupt.acts, missing=missing)
        with_acts = run_graph(
            model, graph, e_clean, task.last, corrupt=corrupt, missing=missing, keep_acts=True
        )
        inputs = run_graph(
            model, graph, e_clean, task.last, corrupt=corrupt, missing=missing, keep_inputs=True
        )
        # given the corrupt run's mixed values too (as the curve does): the heads' deltas from them
        corrupt_z = run_rows(model, graph, e_corrupt, task.last, keep_acts=True)
        assert corrupt_z.zs is not None
        by_z = [
            run_rows(model, graph, e_clean, task.last, corrupt=corrupt_z, missing=missing, keep_acts=keep)
            for keep in (False, True)
        ]
    for run in (got, by_acts, with_acts, inputs):
        assert_close(run.logits, want, atol=1e-10, rtol=1e-10)
    for rows in by_z:
        assert_close(rows.rows @ model.W_U, want, atol=1e-10, rtol=1e-10)
    ref = torch.stack([ref_acts[n] for n in graph.senders])  # (n_senders, B, S, d)
    assert with_acts.acts is not None and with_acts.resids is not None and by_z[1].acts is not None
    assert_close(with_acts.acts, ref, atol=1e-10, rtol=1e-10)
    assert_close(by_z[1].acts, ref, atol=1e-10, rtol=1e-10)
    n_inputs = [t.shape[0] for t in inputs.inputs]  # per layer its q/k/v receivers, its MLP; the logits
    assert n_inputs == [graph.per_layer - 1, 1] * graph.n_layers + [1]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_blocks_shared_product_equals_each_layers_own(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The receivers of a few layers at a time take their part from the senders before those layers in
    one product (here forced wherever it reads fewer rows than the layers would), each layer its part
    from the block's earlier senders in another: equal to the loop reference at one, two and five
    layers a block (a five-layer model, half the edges)."""
    from headspace.analysis.circuits import plan as P
    from headspace.analysis.circuits.graph import run_rows

    model = make_model(kind, torch.float64, n_layers=5)
    task = random_task()
    graph = graph_of(model)
    mask = torch.rand(graph.valid.shape, generator=torch.Generator().manual_seed(5)) < 0.5
    missing = graph.valid & ~mask
    monkeypatch.setattr(P, "_SHARED_WRITES", 0)
    with torch.no_grad():
        e_clean, e_corrupt = model.embed(task.clean), model.embed(task.corrupt)
        corrupt = run_graph(model, graph, e_corrupt, task.last, keep_acts=True)
        _, ref_corrupt = reference_run(model, e_corrupt, task.last, mask)
        want, _ = reference_run(model, e_clean, task.last, mask, corrupt=ref_corrupt)
        for block in (1, 2, 5):
            plan = P.plan_run(model, graph, missing, resids=True, prune=True, full=False, dtype=torch.float64,
                           device=torch.device("cpu"), block=block)  # fmt: skip
            shared = [lp.far is not None and lp.far.coef is not None for lp in plan.layers]
            assert any(shared) == (block > 1), shared
            run = run_rows(model, graph, e_clean, task.last, corrupt=corrupt, missing=missing, plan=plan)
            assert_close(run.rows @ model.W_U, want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_graph_grads_equal_autograd_through_per_receiver_copies(kind: str) -> None:
    """graph_grads (one ordinary forward, each head's gradient pulled back through its own projection
    and LN1) equals autograd of run_graph whose receivers read their own copies of the stream."""
    model = make_model(kind, torch.float64)
    task = random_task()
    graph = graph_of(model)
    x = model.embed(task.clean).detach()

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return (logits[torch.arange(5), task.answer] - logits[torch.arange(5), task.other]).sum()

    got = graph_grads(model, graph, x, task.last, metric, keep_acts=True)
    with torch.enable_grad():
        run = run_graph(
            model, graph, x.clone().requires_grad_(True), task.last, keep_inputs=True, keep_acts=True
        )
        want = torch.cat(torch.autograd.grad(metric(run.logits), run.inputs), 0)  # (n_receivers, B, S, d)
    assert_close(got.grads, want, atol=1e-10, rtol=1e-8)
    assert_close(got.acts, run.acts.detach(), atol=1e-12, rtol=1e-12)
    assert_close(got.logits, run.logits.detach(), atol=1e-12, rtol=1e-12)
    again = graph_grads(model, graph, x, task.last, metric, out=got.grads.clone())
    assert_close(again.grads, 2 * want, atol=1e-10, rtol=1e-8)  # out= adds
    with pytest.raises(ValueError, match="out must be"):
        graph_grads(model, graph, x, task.last, metric, out=torch.zeros(3))


@pytest.mark.parametrize("norm", ["rms", "gemma-rms", "layernorm", "other"])
def test_norm_pullback_equals_autograd(norm: str) -> None:
    """The closed-form pullbacks of RMSNorm (both offsets) and LayerNorm, and the autograd fallback,
    equal autograd through the norm on one copy per gradient (float64, width 23)."""
    from headspace.analysis.graph import _norm_pullback
    from headspace.nn.norms import RMSNorm

    torch.manual_seed(3)
    d = 23
    module = {
        "rms": RMSNorm(d, 1e-5),
        "gemma-rms": RMSNorm(d, 1e-6, offset=1.0),
        "layernorm": torch.nn.LayerNorm(d, eps=1e-5),
        "other": torch.nn.Sequential(torch.nn.LayerNorm(d), torch.nn.Tanh()),
    }[norm].double()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    x = torch.randn(2, 7, d, dtype=torch.float64) * 3
    g = torch.randn(5, 2, 7, d, dtype=torch.float64)
    got = _norm_pullback(module, x, g)
    want = torch.stack([torch.autograd.functional.vjp(module, x, g[i])[1] for i in range(5)])
    assert_close(got, want, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize(
    ("kind", "method", "steps"), [("gpt2", "eap", 1), ("llama", "eap", 1), ("llama", "eap-ig", 2)]
)
def test_edge_scores_equal_autograd_of_the_edge_by_edge_run(kind: str, method: str, steps: int) -> None:
    """score(u -> v) = dM/d eps_uv of the reference run where edge (u, v) carries
    eps (a_u^corrupt - a_u^clean), one scalar per edge (EAP-IG: averaged over the embeddings on the path)."""
    model = make_model(kind, torch.float64)
    task = random_task(n=3)
    graph = graph_of(model)
    got = C.edge_scores(model, task, method, steps, batch_size=2)  # batches of 2 pairs: the sums must add
    ones = torch.ones_like(graph.valid)
    with torch.no_grad():
        e_clean, e_corrupt = model.embed(task.clean), model.embed(task.corrupt)
        _, a_clean = reference_run(model, e_clean, task.last, ones)
        _, a_corrupt = reference_run(model, e_corrupt, task.last, ones)
    delta = {k: a_corrupt[k] - a_clean[k] for k in a_clean}
    want = torch.zeros_like(got.scores)
    for k in range(1, steps + 1):
        eps = torch.zeros(graph.valid.shape, dtype=torch.float64, requires_grad=True)
        x = e_corrupt + (k / steps) * (e_clean - e_corrupt)
        logits, _ = reference_run(model, x, task.last, ones, eps=eps, delta=delta)
        metric = (logits[torch.arange(3), task.answer] - logits[torch.arange(3), task.other]).mean()
        want += torch.autograd.grad(metric, eps)[0] / steps
    tol = (
        {"atol": 1e-7, "rtol": 1e-4} if kind == "llama" else {"atol": 1e-10, "rtol": 1e-8}
    )  # RMSNorm: float32
    assert_close(got.scores, want * graph.valid, **tol)
    assert got.scores.abs().max() > 0


def test_faithfulness_is_one_and_zero_exactly_at_the_ends_and_the_curve_areas() -> None:
    model = make_model("llama")
    task = random_task()
    scores = C.edge_scores(model, task, "eap")
    graph = graph_of(model)
    full = C.faithfulness(model, task, graph.valid)
    empty = C.faithfulness(model, task, torch.zeros_like(graph.valid))
    assert full.faithfulness == 1.0 and empty.faithfulness == 0.0
    with torch.no_grad():
        rows = torch.arange(5)
        for prompts, value in ((task.clean, full.clean_metric), (task.corrupt, full.corrupt_metric)):
            logits = model(prompts)[rows, task.last]
            assert value == pytest.approx(
                float((logits[rows, task.answer] - logits[rows, task.other]).mean()), abs=1e-5
            )
    curve = C.faithfulness_curve(model, task, scores, fractions=[0.1, 0.5])
    assert (
        curve.fractions == [0.0, 0.1, 0.5, 1.0]
        and curve.faithfulness[0] == 0.0
        and curve.faithfulness[-1] == 1.0
    )
    f = curve.faithfulness
    assert curve.cpr == pytest.approx(0.05 * (f[0] + f[1]) + 0.2 * (f[1] + f[2]) + 0.25 * (f[2] + f[3]))
    d = [abs(1 - v) for v in f]
    assert curve.cmd == pytest.approx(0.05 * (d[0] + d[1]) + 0.2 * (d[1] + d[2]) + 0.25 * (d[2] + d[3]))
    circuit = C.find_circuit(scores, edges=int(0.5 * graph.n_edges + 0.5))
    assert curve.faithfulness[2] == pytest.approx(C.faithfulness(model, task, circuit).faithfulness)


def test_find_circuit_takes_the_top_edges_by_magnitude() -> None:
    model = make_model("gpt2")
    scores = C.edge_scores(model, random_task(), "eap")
    assert all(p.requires_grad for p in model.parameters())  # edge_scores put the flags back
    c = C.find_circuit(scores, edges=7)
    assert c.n_edges == 7 and len(c.listed) == 7
    kept = scores.scores[c.edges].abs()
    assert kept.min() >= scores.scores[scores.valid & ~c.edges].abs().max()
    assert [abs(v) for _, _, v in c.listed] == sorted((abs(v) for _, _, v in c.listed), reverse=True)
    t = C.find_circuit(scores, threshold=float(kept.min()))
    assert t.n_edges >= 7
    for bad, needle in [
        ({}, "exactly one of"),
        ({"edges": 0}, "edges must be an int in"),
        ({"edges": 3, "threshold": 1.0}, "exactly one of"),
        ({"threshold": -1.0}, "threshold must"),
    ]:
        with pytest.raises(ValueError, match=needle):
            C.find_circuit(scores, **bad)


def test_circuits_refuse_encoders_and_bad_methods() -> None:
    with pytest.raises(TypeError, match="need a decoder"):
        C.edge_scores(make_model("bert"), random_task())
    with pytest.raises(ValueError, match="method must be one of"):
        C.edge_scores(make_model("gpt2"), random_task(), "acdc")


# ------------------------------------------------------------------------------------------- tasks
@pytest.mark.slow
def test_ioi_task_and_bad_tasks_named(smollm2, tmp_path: Path) -> None:
    task = T.ioi_task(smollm2, 40)
    assert len(task) == 40 and (task.clean != task.corrupt).any(dim=1).all()
    tok = smollm2.tokenizer
    for p in range(4):
        clean = task.texts[p][0]
        io, s = tok.decode([int(task.answer[p])]), tok.decode([int(task.other[p])])
        assert clean.count(io.strip()) == 1 and clean.count(s.strip()) == 2  # IO once, S twice
    firsts = {
        task.texts[p][0].split(" and ")[0].split()[-1] == tok.decode([int(task.answer[p])]).strip()
        for p in range(10)
    }
    assert firsts == {True, False}  # both name orders
    good = {
        "clean": "When Mary and John went to the store, John gave a drink to",
        "corrupt": "When Mary and John went to the store, Mary gave a drink to",
        "answer": " Mary",
        "other": " John",
    }
    with pytest.raises(ValueError, match="is empty"):
        T.make_task(smollm2, [])
    with pytest.raises(ValueError, match="equal token lengths"):
        T.make_task(
            smollm2, [{**good, "corrupt": "When Mary and John went to the big store, Mary gave a drink to"}]
        )
    with pytest.raises(ValueError, match="must be one token"):
        T.make_task(smollm2, [{**good, "answer": " Mary Ann"}])
    with pytest.raises(ValueError, match="lacks \\['other'\\]"):
        T.make_task(smollm2, [{k: v for k, v in good.items() if k != "other"}])
    path = tmp_path / "task.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(good) + "\n")
    assert len(T.load_task(smollm2, path)) == 2
    path.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(ValueError, match="line 2 is not one JSON object"):
        T.load_task(smollm2, path)
    path.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        T.load_task(smollm2, path)
    with pytest.raises(ValueError, match="must be a regular file"):
        T.load_task(smollm2, tmp_path)


# --------------------------------------------------------------------------------------- the commands
NAMES = "Mary John Tom James Dan Sarah Paul Anna".split()


def tiny_gpt2(folder: Path) -> Path:
    """A 2-layer GPT-2 saved by transformers, with a word-level tokenizer knowing the IOI templates."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = {"<|endoftext|>"} | set(NAMES)
    for t in T.IOI_TEMPLATES:
        words |= set(
            t.replace(",", " , ")
            .replace(".", " . ")
            .replace("{A}", "")
            .replace("{B}", "")
            .replace("{S}", "")
            .split()
        )
    vocab: dict[str, int] = {}
    for w in sorted(words):
        vocab[w] = len(vocab)
        vocab["\u0120" + w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(vocab), n_positions=40, n_embd=24, n_layer=2, n_head=3,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(str(folder))
    return folder


def test_why_and_circuit_commands(tmp_path: Path) -> None:
    folder = tiny_gpt2(tmp_path / "gpt2")
    runner = CliRunner()
    res = runner.invoke(
        cli,
        [
            "why",
            "--model",
            str(folder),
            "When Mary and John went to the store, John gave a drink to",
            "--layer",
            "1",
            "--head",
            "2",
            "--json",
            "--out",
            str(tmp_path / "why.png"),
        ],
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert abs(data["total"] - data["score"]) < 1e-4 and (tmp_path / "why.png").stat().st_size > 0
    assert data["top"][0]["words"].startswith("query side: ")
    out = tmp_path / "circ"
    res = runner.invoke(
        cli,
        [
            "circuit",
            "--model",
            str(folder),
            "--task",
            "ioi",
            "--edges",
            "20",
            "--pairs",
            "6",
            "--method",
            "eap-ig",
            "--steps",
            "2",
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "CPR" in res.output and "faithfulness" in res.output
    summary = json.loads((out / "circuit.json").read_text())
    assert summary["kind"] == "circuit_summary" and len(summary["edges"]) == 20
    assert {p.name for p in out.iterdir()} == {
        "circuit.json",
        "curve.json",
        "faithfulness.png",
        "circuit.png",
    }
    from headspace.viz.explorer import load_results

    (view,) = load_results(out / "circuit.json")
    assert view["kind"] == "circuit_summary" and len(view["values"]) == 2 and len(view["values"][0]) == 4
    from headspace.viz.explorer import Explorer

    page = Explorer(hs.load(str(folder)), summary["prompt"], results=[out / "circuit.json"]).save(
        tmp_path / "p.html"
    )
    assert "circuit_summary" in page.read_text()  # the page carries the circuit's view
    res = runner.invoke(
        cli, ["circuit", "--model", str(folder), "--task", str(tmp_path / "none.jsonl"), "--out", str(out)]
    )
    assert res.exit_code == 2 and "must be a regular file" in res.output


def test_benchmark_script_runs_tiny(tmp_path: Path) -> None:
    """benchmarks/circuits.py end to end on a tiny GPT-2 folder; its JSON holds what its table prints."""
    import importlib.util

    folder = tiny_gpt2(tmp_path / "gpt2")
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "circuits.py"
    spec = importlib.util.spec_from_file_location("bench_circuits_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "circuits.json"
    argv = ["--model", str(folder), "--pairs", "3", "--steps", "2", "--sample", "1", "--threads", "1"]
    assert script.main([*argv, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["case"] for r in data["rows"]] == ["eap", "eap-ig (2 steps)", "faithfulness curve (11 points)"]
    assert all(r["headspace_s"] > 0 and r["hook_loop_s"] > 0 for r in data["rows"])
    assert data["curve"]["faithfulness"][0] == 0.0 and data["curve"]["faithfulness"][-1] == 1.0


def test_atp_star_benchmark_script_runs_tiny(tmp_path: Path) -> None:
    """benchmarks/atp_star.py end to end on the tiny GPT-2 folder (the IOI task): its JSON holds a row per
    site with each method's rank correlation to exact patching and its cost."""
    import importlib.util

    folder = tiny_gpt2(tmp_path / "gpt2")
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "atp_star.py"
    spec = importlib.util.spec_from_file_location("bench_atp_star_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "atp_star.json"
    argv = ["--model", str(folder), "--tasks", "ioi", "--pairs", "4", "--batch", "2", "--threads", "1"]
    argv += ["--k-heads", "2", "--k-mlp", "1", "--samples", "2", "--out", str(out)]
    assert script.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["rows"] and data["settings"]["pairs"] == 4
    assert {r["task"] for r in data["rows"]} == {"ioi"}
    methods = {"exact", "atp", "atp*", "eap-ig"}
    assert {(r["site"], r["method"]) for r in data["rows"]} == {
        (s, m) for s in ("heads", "mlp") for m in methods
    }
    exact_rows = [r for r in data["rows"] if r["method"] == "exact"]
    assert all(r["atp_edges_seconds"] > 0 and r["eap_seconds"] > 0 for r in exact_rows)  # side by side
