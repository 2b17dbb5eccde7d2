"""The atlas's importance column (issue 41): AtP* by default, exact or none on request, the method named
in ``atlas.json``, the sample check, the method in the shards' fingerprint, and a bar that moves.

Each test failed on 5223863 (no ``importance`` argument, no ``importance_method`` field, the exact bar
moved once per shard). The AtP* column is held to an independent first-order reference: the derivative
at ``t = 0`` of the corpus loss with head ``h``'s z moved to ``z + t (mean_h - z)``, by autograd through the
model's own logits and ``F.cross_entropy``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch.testing import assert_close

import headspace as hs
from headspace.analysis import atlas, mean_z
from headspace.cli import cli
from headspace.trace import hooked

A = importlib.import_module(
    "headspace.analysis.atlas.run"
)  # the module that runs the atlas (its progress_bar)
_spec = importlib.util.spec_from_file_location(
    "atlas_importance_tiny_gguf", Path(__file__).resolve().parents[1] / "pretrained" / "test_gguf.py"
)
_gguf_tests = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(_gguf_tests)  # type: ignore[union-attr]

L, H, V, WINDOW = 3, 4, 23, 12
KW: dict[str, Any] = dict(window=WINDOW, batch_size=2, shard_size=2, progress=False, induction_repeated=False)


def decoder(seed: int = 0, **extra: Any) -> hs.Decoder:
    torch.manual_seed(seed)
    cfg = hs.ModelConfig(
        arch="decoder", vocab_size=V, d_model=24, n_layers=L, n_heads=H, d_mlp=40, max_seq_len=32,
        dropout=0.0, attn_dropout=0.0, emb_dropout=0.0, **extra,
    )  # fmt: skip
    return hs.Decoder(cfg).eval()


def documents() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, V, (n,), generator=g) for n in (20, 7, 13)]


def first_order_reference(model: hs.Decoder, docs: list[torch.Tensor]) -> torch.Tensor:
    """d/dt at 0 of the mean next-token loss with head h's z at z + t (mean_h - z), every position."""
    seqs = [d[s : s + WINDOW] for d in docs for s in range(0, d.shape[0], WINDOW)]
    means = mean_z(model, [t[None] for t in seqs])  # (L, H, dh)
    n_pairs = sum(t.shape[0] - 1 for t in seqs)
    out = torch.zeros(L, H, dtype=torch.float64)
    for layer in range(L):
        for h in range(H):
            t = torch.zeros((), requires_grad=True)

            def move(z: torch.Tensor, point: Any, layer: int = layer, h: int = h, t: torch.Tensor = t):
                z = z.clone()  # (1, S, H, dh)
                z[:, :, h] = z[:, :, h] + t * (means[layer, h].to(z.dtype) - z[:, :, h])
                return z

            total = torch.zeros((), dtype=torch.float64)
            with hooked(model, {f"blocks.{layer}.attn.hook_z": move}):
                for s in seqs:
                    logits = model(s[None])[0].double()  # (S, V)
                    total = total + F.cross_entropy(logits[:-1], s[1:], reduction="sum")
            (g,) = torch.autograd.grad(total, t)
            out[layer, h] = float(g) / n_pairs
    return out


GEMMA_LIKE = dict(
    n_kv_heads=2, positions="rotary", norm_kind="rmsnorm", mlp_kind="gated", act="silu", bias=False,
    tie_embeddings=False, norm_offset=1.0, final_softcap=5.0, norm="sandwich", qk_norm="head",
    sliding_window=3, layer_types=["sliding"] * (L - 1) + ["full"],
)  # fmt: skip


@pytest.mark.parametrize("extra", [{}, {"n_kv_heads": 2}, GEMMA_LIKE], ids=["gpt2", "gqa", "gemma"])
def test_default_importance_is_atp_star_and_matches_the_first_order_reference(extra: dict) -> None:
    model = decoder(**extra)
    docs = documents()
    result = atlas(model, docs, **KW)
    assert result.importance_method == "atp*"
    d = result.to_dict()
    assert d["importance_method"] == "atp*" and d["importance_check"] is None
    assert_close(result.stats["ablation"], first_order_reference(model, docs), atol=2e-6, rtol=1e-4)
    exact = atlas(model, docs, importance="exact", **KW)
    assert exact.importance_method == "exact" and exact.clean_loss == pytest.approx(result.clean_loss)
    a, e = result.stats["ablation"].flatten(), exact.stats["ablation"].flatten()
    assert not torch.equal(a, e)  # an estimate, not the exact column under another name
    assert float(torch.corrcoef(torch.stack([a, e]))[0, 1]) > 0.5  # 0.76-0.97 on these random models


def test_importance_none_and_ablation_false_and_the_check() -> None:
    model, docs = decoder(), documents()
    for kw in ({"importance": "none"}, {"ablation": False}):
        r = atlas(model, docs, **kw, **KW)
        assert (
            r.importance_method == "none" and bool(r.stats["ablation"].isnan().all()) and r.clean_loss is None
        )
    checked = atlas(model, docs, importance="atp*", importance_check=15, **KW)
    c = checked.importance_check
    assert c is not None and (c["windows"], c["tokens"]) == (2, 20)  # first windows with >= 15 tokens
    from headspace.analysis.atlas_importance import agreement

    atp, exact = torch.tensor(c["atp*"]), torch.tensor(c["exact"])  # (L, H)
    assert agreement(atp, exact, c["top_k"]) == {k: c[k] for k in ("spearman", "top_k", "top_k_overlap")}
    assert -1.0 <= c["spearman"] <= 1.0 and c["top_k"] == 10
    for bad, match in (
        ({"importance": "fast"}, "importance must be one of"),
        ({"importance_check": 0}, "importance_check must be a positive int"),
        ({"importance": "none", "importance_check": 5}, "needs importance 'atp\\*' or 'exact'"),
    ):
        with pytest.raises(ValueError, match=match):
            atlas(model, docs, **bad, **KW)


def test_agreement_is_spearman_and_top_k_overlap() -> None:
    from headspace.analysis.atlas_importance import agreement

    exact = torch.tensor([[0.5, -0.4, 0.1], [0.05, float("nan"), -0.3]])
    same_order = exact * 2 + 0.0
    got = agreement(same_order, exact, 2)
    assert got["spearman"] == pytest.approx(1.0) and got["top_k_overlap"] == 1.0
    flipped = torch.tensor([[0.05, 0.1, -0.3], [0.5, float("nan"), -0.4]])
    got = agreement(flipped, exact, 2)
    assert got["top_k_overlap"] == 0.0 and got["spearman"] < 0


def test_resuming_with_another_method_is_refused(tmp_path: Path) -> None:
    model, docs = decoder(), documents()
    first = atlas(model, docs, out=tmp_path, **KW)
    assert first.importance_method == "atp*"
    shards = sorted((tmp_path / "shards").glob("ablation-*.json"))
    assert shards and all(json.loads(p.read_text())["fingerprint"]["importance"] == "atp*" for p in shards)
    with pytest.raises(ValueError, match="a shard of importance 'atp\\*'; this run asks for 'exact'") as e:
        atlas(model, docs, out=tmp_path, importance="exact", **KW)
    assert "\n" not in str(e.value)
    again = atlas(model, docs, out=tmp_path, **KW)  # the same method resumes
    assert torch.equal(again.stats["ablation"], first.stats["ablation"])


class Recorder:
    def __init__(self, total: Any = None, desc: str = "", **kw: Any) -> None:
        self.desc, self.total, self.updates = desc, total, []
        BARS.append(self)

    def update(self, n: int = 1) -> None:
        self.updates.append(n)

    def close(self) -> None:
        pass


BARS: list[Recorder] = []


def test_the_exact_bar_moves_within_a_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    BARS.clear()
    monkeypatch.setattr(A, "progress_bar", Recorder)
    docs = [documents()[0][:WINDOW]]  # one window, one shard, one batch
    atlas(decoder(), docs, **{**KW, "progress": True}, importance="exact")
    bar = next(b for b in BARS if "exact" in b.desc)
    assert sum(bar.updates) == bar.total == WINDOW and len(bar.updates) >= L  # a step per layer, not one


def _cli(out: Path, model: Path, corpus: Path, *extra: str) -> Any:
    args = ["atlas", "--model", str(model), "--corpus", str(corpus), "--out", str(out), "--window", "16"]
    return CliRunner().invoke(cli, [*args, "--shard-size", "1", "--batch-size", "2", *extra])


def test_cli_importance_flags(tmp_path: Path) -> None:
    model = _gguf_tests.write_tiny_llama(tmp_path / "tiny.gguf")
    corpus = tmp_path / "c.txt"
    corpus.write_text("the world turns, and the world is 12 worlds in one. " * 2)
    done = _cli(tmp_path / "a", model, corpus)
    assert done.exit_code == 0, done.output
    assert "importance: atp*" in done.output
    assert json.loads((tmp_path / "a" / "atlas.json").read_text())["importance_method"] == "atp*"
    done = _cli(tmp_path / "b", model, corpus, "--importance", "exact", "--importance-check", "20")
    assert done.exit_code == 0, done.output
    d = json.loads((tmp_path / "b" / "atlas.json").read_text())
    assert d["importance_method"] == "exact" and d["importance_check"]["tokens"] >= 20
    assert "importance check on" in done.output and "Spearman" in done.output
    refused = _cli(tmp_path / "c", model, corpus, "--importance", "none", "--importance-check", "5")
    assert refused.exit_code == 2 and "Traceback" not in refused.output
    assert "--importance-check compares atp* with exact" in refused.output
    resumed = _cli(tmp_path / "a", model, corpus, "--importance", "exact")
    assert resumed.exit_code == 2 and "a shard of importance 'atp*'" in resumed.output, resumed.output
