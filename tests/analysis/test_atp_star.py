"""AtP*: held to exact patching on tiny random decoders built here.

Identities: the written-out forward gives the model's metric; ``exact_effects`` equals ``patch`` pair by
pair and plain AtP equals ``attribution_patching`` pair by pair; the QK fix is exact where the model is
linear from the attention pattern on (a saturated softmax, where plain AtP misses the effect); GradDrop's
terms equal a reference built from the model's own hooks (block l's outputs detached); GradDrop finds a
component whose paths cancel in the gradient; the diagnostic's bound holds; ``headspace patch --method``.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
import transformers
from click.testing import CliRunner
from torch.testing import assert_close

import headspace as hs
from headspace.analysis.atp_star import atp_star as atp_star_fn
from headspace.analysis.patching import attribution_patching, patch
from headspace.analysis.tasks import Task
from headspace.analysis.trace import hooked, trace
from headspace.cli import cli

V = 41  # vocabulary
S = importlib.import_module("headspace.analysis.atp_star")  # the module (its name is also the function's)


def decoder(kind: str = "llama", n_layers: int = 3, seed: int = 0, **extra: object) -> hs.Decoder:
    """A random decoder with non-trivial norms and biases (llama: rotary, 2 kv heads for 4 query heads)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=V, d_model=24, n_layers=n_layers, d_mlp=40, max_seq_len=32, dropout=0.0,
                  attn_dropout=0.0, emb_dropout=0.0, **extra)  # fmt: skip
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


def make_task(
    n: int = 6, seq: int = 9, lengths: list[int] | None = None, seed: int = 3, where: tuple[int, ...] = (2, 4)
) -> Task:
    """Random pairs (tokens 2..V-1) differing at positions ``where``, right-padded to ``lengths``; answer
    token 0, other 1 (so neither appears in a prompt)."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(2, V, (n, seq), generator=g)
    corrupt = clean.clone()
    for pos in where:
        corrupt[:, pos] = torch.randint(2, V, (n,), generator=g)
    lens = torch.tensor(lengths or [seq] * n)
    for i, length in enumerate(lens.tolist()):
        clean[i, length:] = 0
        corrupt[i, length:] = 0
    answer, other = torch.zeros(n, dtype=torch.int64), torch.ones(n, dtype=torch.int64)
    return Task("random", clean, corrupt, lens, answer, other, [("", "")] * n)


def pair_metric(task: Task, i: int):
    a, b = int(task.answer[i]), int(task.other[i])
    return lambda logits: logits[:, a] - logits[:, b]


def per_pair_mean(fn, model: hs.Decoder, task: Task, site: str) -> torch.Tensor:
    """The mean over pairs of ``fn``'s (patched - corrupt) for one pair at a time (patching.py's)."""
    total = 0
    for i in range(len(task)):
        n = int(task.lengths[i])
        r = fn(model, task.clean[i : i + 1, :n], task.corrupt[i : i + 1, :n], pair_metric(task, i), site=site)
        d = r.patched_metric - r.corrupt_metric
        if site == "heads_pos":
            d = torch.nn.functional.pad(d, (0, task.clean.shape[1] - n))
        total = total + d
    return total / len(task)


# ------------------------------------------------------------------------------------------ identities
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_metrics_are_the_models(kind: str) -> None:
    model, task = decoder(kind), make_task(lengths=[9, 7, 9, 5, 8, 9])
    r = S.atp_star(model, task, "heads", batch_size=4)
    rows = torch.arange(len(task))
    for tokens, got in ((task.clean, r.clean_metric), (task.corrupt, r.corrupt_metric)):
        logits = model(tokens)[rows, task.last]  # (n, vocab)
        assert got == pytest.approx(float((logits[:, 0] - logits[:, 1]).mean().detach()), abs=1e-5)


@pytest.mark.parametrize("site", ["heads", "heads_pos", "mlp"])
def test_exact_effects_and_atp_equal_patching_pair_by_pair(site: str) -> None:
    """Batched over pairs of different lengths (padding), in batches of 2: the same numbers as patch()
    and attribution_patching() one pair at a time."""
    model, task = decoder(), make_task(n=3, lengths=[9, 5, 8])
    exact = S.exact_effects(model, task, site, batch_size=2)
    assert_close(exact.estimate, per_pair_mean(patch, model, task, site).float(), atol=1e-6, rtol=1e-5)
    atp = S.atp_star(model, task, site, method="atp", batch_size=2)
    ref = per_pair_mean(attribution_patching, model, task, site).float()
    assert_close(atp.estimate, ref, atol=1e-6, rtol=1e-5)
    assert_close(atp.score, ref.abs(), atol=1e-6, rtol=1e-5)
    assert exact.method == "exact" and atp.method == "atp"


def test_exact_effects_of_some_components_only() -> None:
    model, task = decoder(), make_task()
    full = S.exact_effects(model, task, "keys")
    some = S.exact_effects(model, task, "keys", [(2, 1), (0, 0)])
    assert_close(some.estimate[2, 1], full.estimate[2, 1])
    assert_close(some.estimate[0, 0], full.estimate[0, 0])
    assert int(torch.isnan(some.estimate).sum()) == some.estimate.numel() - 2
    with pytest.raises(ValueError, match=r"a keys component is an index into \[3, 2\]"):
        S.exact_effects(model, task, "keys", [(3, 0)])


# ------------------------------------------------------------------------------------------ QK fix
def saturated_one_layer() -> hs.Decoder:
    """One layer, no final norm, the MLP's weights 0: the metric is linear in the attention pattern. Its
    queries and keys scaled by 8 (scores by 64): a saturated softmax; values and readout scaled up so the
    effects are logits of order 1."""
    model = decoder("gpt2", n_layers=1, seed=1, final_ln=False)
    attn = model.blocks[0].attn
    hq = attn.n_heads * attn.d_head
    with torch.no_grad():
        for p in model.blocks[0].mlp.parameters():
            p.zero_()
        attn.qkv_weight[: 2 * hq] *= 8.0  # the query and key rows (n_kv_heads = n_heads)
        attn.qkv_weight[2 * hq :] *= 10.0  # the value rows
        model.tok_embed.weight[0] += 3.0 * torch.randn(model.tok_embed.weight.shape[1])  # W_U[:, answer]
    return model


@pytest.mark.parametrize("site", ["keys", "queries"])
def test_qk_fix_is_exact_where_plain_atp_misses_a_saturated_pattern(site: str) -> None:
    model, task = saturated_one_layer(), make_task(n=8, where=(2, 4, 8))  # the query's token too
    exact = S.exact_effects(model, task, site).estimate
    star = S.atp_star(model, task, site)
    plain = S.atp_star(model, task, site, method="atp").estimate
    biggest = exact.abs().argmax()
    assert float(exact.abs().max()) > 0.5  # a real effect, in logit units
    # AtP*: the pattern change exact, the rest linear (here: exactly linear)
    assert_close(star.estimate, exact, atol=1e-5, rtol=1e-4)
    assert_close(star.score, exact.abs(), atol=1e-5, rtol=1e-4)  # one layer: GradDrop has nothing to drop
    # plain AtP linearises through the saturated softmax: it misses most of the largest effect
    assert abs(float(plain.flatten()[biggest] - exact.flatten()[biggest])) > 0.5 * float(exact.abs().max())


# ------------------------------------------------------------------------------------------ GradDrop
def graddrop_reference(model: hs.Decoder, task: Task) -> torch.Tensor:
    """1/(L-1) sum_l |c_l| per head, c_l from the model's own forward with block l's attention and MLP
    outputs detached (hooks), the gradient at each head's z (hook_z), mean over pairs."""
    L = len(model.blocks)
    with trace(model, names="blocks.*.attn.hook_z") as t:
        model(task.clean)
    clean_z = [t[f"blocks.{j}.attn.hook_z"] for j in range(L)]  # (n, S, H, dh)
    rows = torch.arange(len(task))
    total = 0
    for drop in range(L):
        zs: dict[int, torch.Tensor] = {}
        hooks = {"hook_embed": lambda v, pt: v.detach().requires_grad_(True)}
        hooks.update(
            {f"blocks.{j}.attn.hook_z": (lambda v, pt, j=j, zs=zs: zs.__setitem__(j, v)) for j in range(L)}
        )
        hooks[f"blocks.{drop}.hook_attn_out"] = lambda v, pt: v.detach()
        hooks[f"blocks.{drop}.hook_mlp_out"] = lambda v, pt: v.detach()
        with torch.enable_grad(), hooked(model, hooks):
            logits = model(task.corrupt)[rows, task.last]
            metric = (logits[:, 0] - logits[:, 1]).mean()
            grads = torch.autograd.grad(metric, [zs[j] for j in range(L)], allow_unused=True)
        c = torch.stack(
            [
                torch.zeros(zs[j].shape[2])
                if g is None
                else ((clean_z[j] - zs[j].detach()) * g).sum((0, 1, 3))
                for j, g in enumerate(grads)
            ]
        )  # (L, H)
        total = total + c.abs()
    return total / (L - 1)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_graddrop_equals_dropping_each_blocks_outputs_by_hooks(kind: str) -> None:
    model, task = decoder(kind, n_layers=4), make_task()
    star = S.atp_star(model, task, "heads", batch_size=4)
    assert star.method == "atp*" and star.graddrop
    assert_close(star.score, graddrop_reference(model, task).float(), atol=1e-6, rtol=1e-4)


def linearised_change(model: hs.Decoder, task: Task, node: tuple[int, int]) -> torch.Tensor:
    """d/de of the final normalised stream at the pairs' last positions (summed over pairs) when head
    ``node``'s z in the corrupt run moves by e (z_clean - z_corrupt): [d_model], by autograd on the model's
    own forward with hooks."""
    layer, head = node
    name, rows = f"blocks.{layer}.attn.hook_z", torch.arange(len(task))
    with trace(model, names=name) as tc:
        model(task.clean)
    with trace(model, names=name) as tk:
        model(task.corrupt)
    delta = (tc[name] - tk[name])[:, :, head]  # (n, S, dh)
    final: dict[str, torch.Tensor] = {}

    def stream(eps: torch.Tensor) -> torch.Tensor:
        def move(z: torch.Tensor, pt: object) -> torch.Tensor:  # z (n, S, H, dh)
            z = z.clone()
            z[:, :, head] = z[:, :, head] + eps * delta
            return z

        hooks = {name: move, "blocks.2.hook_resid_post": lambda v, pt: final.__setitem__("x", v)}
        with hooked(model, hooks):
            model(task.corrupt)
        return model.ln_final(final["x"][rows, task.last]).sum(0)  # (d,)

    return torch.autograd.functional.jacobian(stream, torch.zeros(()))  # (d,)


def test_graddrop_recovers_a_component_whose_paths_cancel() -> None:
    """The readout u = W_U[answer] - W_U[other] is chosen orthogonal to the linearised change of the final
    stream that head (0, 1) causes: its direct and indirect paths cancel in AtP's estimate exactly (0), while
    its real effect and each path are not 0. GradDrop scores it by its paths."""
    model, task = decoder("gpt2", n_layers=3, seed=2), make_task(n=8)
    node = (0, 1)
    E = model.tok_embed.weight  # (vocab, d): tied, W_U = E^T; tokens 0 and 1 never occur in the prompts
    d = E.shape[1]

    def set_readout(u: torch.Tensor) -> None:
        with torch.no_grad():
            E[0] = E[1] + u  # M = h . (W_U[:, 0] - W_U[:, 1]) = h . u

    w = linearised_change(model, task, node)  # AtP(node) = u . w for the readout u
    r = torch.randn(d, generator=torch.Generator().manual_seed(0))
    set_readout(r - (r @ w) / (w @ w) * w)
    plain = S.atp_star(model, task, "heads", method="atp")
    star = S.atp_star(model, task, "heads")
    exact = S.exact_effects(model, task, "heads")
    assert abs(float(plain.estimate[node])) < 1e-4 * float(plain.score.max())  # cancelled: ranked last
    assert plain.ranking().index(node) >= len(plain.ranking()) - 2
    assert abs(float(exact.estimate[node])) > float(exact.score.median())  # but it matters
    assert float(star.score[node]) > 0.25 * abs(float(exact.estimate[node]))
    assert star.ranking().index(node) < plain.ranking().index(node) - 3


# ------------------------------------------------------------------------------------------ diagnostic
def test_binomial_upper_bound() -> None:
    for n in (1, 5, 40):
        assert S.binomial_upper_bound(0, n, 0.95) == pytest.approx(1 - 0.05 ** (1 / n), rel=1e-9)
    assert S.binomial_upper_bound(3, 3) == 1.0
    # P(X <= 2; 20, p) = 0.05 at p = 0.2826... (the Clopper-Pearson value, scipy's beta.ppf(0.95, 3, 18))
    assert S.binomial_upper_bound(2, 20, 0.95) == pytest.approx(0.28262, abs=1e-4)
    with pytest.raises(ValueError, match="need 0 <= hits <= n"):
        S.binomial_upper_bound(4, 3)


def test_diagnostic_counts_exactly_when_it_samples_every_component_below_k() -> None:
    model, task = decoder(), make_task()
    atp = S.atp_star(model, task, "heads", method="atp")
    exact = S.exact_effects(model, task, "heads")
    k, threshold = 3, float(exact.effect.abs().flatten().sort().values[-6])
    below = atp.ranking()[k:]
    truth = sum(abs(float(exact.effect[c])) > threshold for c in below)
    diag = S.atp_star_diagnostic(model, task, atp, k=k, threshold=threshold, samples=1000)
    assert diag.n_sampled == diag.n_below == len(below) and len(diag.hits) == truth
    assert diag.p_upper == truth / len(below) and atp.diagnostic == diag.to_dict()


def test_diagnostic_bound_holds_over_random_draws() -> None:
    """The bound on the false-negative fraction covers the true fraction in at least its confidence of
    the draws (here 0.8, over 20 seeds; exactly computed truth from every component's exact effect)."""
    model, task = decoder(seed=4), make_task(n=3, seq=7, seed=5)
    atp = S.atp_star(model, task, "heads_pos", method="atp")
    exact = S.exact_effects(model, task, "heads_pos")
    k = 10
    nonzero = exact.effect.abs().flatten()
    threshold = float(nonzero[nonzero > 0].quantile(0.6))
    below = atp.ranking()[k:]
    truth = sum(abs(float(exact.effect[c])) > threshold for c in below) / len(below)
    assert 0 < truth < 0.5
    covered = 0
    for seed in range(20):
        diag = S.atp_star_diagnostic(model, task, atp, k=k, threshold=threshold, samples=12, seed=seed,
                                     confidence=0.8)  # fmt: skip
        effects = {tuple(c): e for c, e in zip(diag.sampled, diag.sampled_effects)}
        assert all(abs(effects[c] - float(exact.effect[c])) < 1e-5 for c in effects)
        covered += truth <= diag.p_upper
    assert covered >= 0.8 * 20 - 2  # binomial slack: P(fewer) is small at 20 draws


def test_public_names() -> None:
    assert hs.analysis.atp_star is atp_star_fn is S.atp_star
    assert hs.analysis.exact_effects is S.exact_effects
    assert hs.analysis.atp_star_diagnostic is S.atp_star_diagnostic


def test_bad_arguments_are_refused_by_name() -> None:
    model, task = decoder(), make_task()
    with pytest.raises(ValueError, match=r"site must be one of \['heads', 'heads_pos', 'mlp'"):
        S.atp_star(model, task, "resid")
    with pytest.raises(ValueError, match=r"method must be one of \['atp', 'atp\*'\]; got 'exact'"):
        S.atp_star(model, task, method="exact")
    atp = S.atp_star(model, task, method="atp")
    with pytest.raises(ValueError, match=r"k must be an int in \[0, 12\)"):
        S.atp_star_diagnostic(model, task, atp, k=12, threshold=0.1)


# ------------------------------------------------------------------------------------------ CLI
WORDS = "<|endoftext|> When Mary and John went to the store , gave a drink".split()


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer x 4-head GPT-2 saved by transformers, with a word-level byte-level tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("models") / "gpt2"
    folder.mkdir()
    vocab: dict[str, int] = {}
    for w in WORDS:
        vocab[w] = len(vocab)
        if not w.startswith("<"):
            vocab["\u0120" + w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(vocab), n_positions=32, n_embd=16, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(str(folder))
    return folder


def test_cli_patch_method(gpt2_folder: Path) -> None:
    """--method atp* / atp print and write the estimates (atp*: ranked by its score); exact stays the
    default; the numbers are those of the Python functions on the same pair."""
    runner = CliRunner()
    args = ["patch", "--model", str(gpt2_folder), "--json"]
    exact = json.loads(runner.invoke(cli, args).output)
    assert exact["patch_method"] == "exact" and exact["method"] == "activation" and "score" not in exact
    star = runner.invoke(cli, [*args, "--method", "atp*"])
    assert star.exit_code == 0, star.output
    star = json.loads(star.output)
    model = hs.load(str(gpt2_folder))
    pair = {"clean": exact["tokens"] and "When Mary and John went to the store, John gave a drink to",
            "corrupt": "When Mary and John went to the store, Mary gave a drink to", "answer": " Mary",
            "other": " John"}  # fmt: skip
    task = hs.analysis.tasks.make_task(model, [pair])
    ref = S.atp_star(model, task, "heads")
    assert star["patch_method"] == "atp*" and star["method"] == "attribution"
    assert star["axes"] == ["layer", "head"]
    assert_close(torch.tensor(star["score"]), ref.score)
    assert_close(torch.tensor(star["head_patch_effect"]), ref.effect)
    assert [tuple(t["site"].values()) for t in star["top"]] == ref.ranking()[:8]
    text = runner.invoke(cli, ["patch", "--model", str(gpt2_folder), "--method", "atp", "--site", "keys"])
    assert text.exit_code == 0 and "by |estimated effect|" in text.output and "kv_head" in text.output


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--method", "atp**"], "--method must be one of exact, atp, atp*; got 'atp**'"),
        (
            ["--method", "atp*", "--site", "resid"],
            "--method atp* patches heads, heads_pos, mlp, queries, keys",
        ),
    ],
)
def test_cli_refuses_unknown_methods_in_one_line(monkeypatch: pytest.MonkeyPatch, args, needle) -> None:
    from headspace.cli import causal

    def no_load(spec: str) -> None:
        raise AssertionError("the model was loaded before the method was checked")

    monkeypatch.setattr(causal, "load_model", no_load)
    res = CliRunner().invoke(cli, ["patch", *args])
    assert res.exit_code == 2, res.output
    line = res.output.strip()
    assert line.startswith(f"error: {needle}") and len(line.splitlines()) == 1
