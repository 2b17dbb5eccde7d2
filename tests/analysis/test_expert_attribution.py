"""Direct logit attribution per expert (issue #39): on tiny Mixtral and Qwen2-MoE checkpoints written by
transformers, the experts and the shared expert add up to the layer's MLP part of the logit, the whole to
transformers' own logit difference, and one expert's part equals what removing that expert takes out."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import headspace as hs
from headspace.analysis.causal import direct_logit_attribution, expert_attribution
from headspace.analysis.causal.causal_inputs import centered, frozen_norm, last_resid

pytestmark = pytest.mark.usefixtures("single_thread")

_SPEC = importlib.util.spec_from_file_location(
    "moe_builders_for_experts", Path(__file__).resolve().parents[1] / "pretrained" / "test_moe_families.py"
)
families = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = families
_SPEC.loader.exec_module(families)


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    folder = tmp_path_factory.mktemp(request.param)
    return families.build(request.param, folder), hs.load(folder)


def test_experts_add_up_to_the_mlp_part_and_the_logit(built: tuple[Any, Any]) -> None:
    ref, ours = built
    torch.manual_seed(4)
    ids = torch.randint(3, families.V, (3, 8))
    r = expert_attribution(ours, ids, 5, 9)
    d = direct_logit_attribution(ours, ids, 5, 9)
    assert r.layers == [0, 1] and r.experts.shape == (2, families.E)
    torch.testing.assert_close(r.experts.sum(1) + r.shared, r.mlps, atol=1e-5, rtol=0)
    torch.testing.assert_close(r.mlps, d.mlps[r.layers], atol=1e-6, rtol=0)
    with torch.no_grad():
        logits = ref(ids).logits[:, -1]  # (3, vocab)
    torch.testing.assert_close(d.total, (logits[:, 5] - logits[:, 9]).mean(), atol=1e-4, rtol=0)
    assert int(r.chosen.sum()) == 2 * 3 * families.K  # every prompt's last token took k experts per layer
    assert all(abs(v) > 0 for _, _, v in r.top(3)) and r.to_dict()["kind"] == "expert_attribution"


def test_an_experts_part_is_what_removing_it_takes_out(built: tuple[Any, Any]) -> None:
    _, ours = built
    module = ours.model
    torch.manual_seed(5)
    ids = torch.randint(3, families.V, (2, 7))
    r = expert_attribution(ours, ids, 5, 9)
    layer = 1
    e = int(r.per_prompt["experts"][0, layer].abs().argmax())  # the largest expert of prompt 0
    u = module.W_U[:, 5] - module.W_U[:, 9]  # (d_model,)
    names = [f"blocks.{layer}.hook_mlp_out", last_resid(module)]  # the MLP's output, the final stream
    with torch.no_grad(), hs.trace(module, names=names) as clean:
        module(ids)
    module.blocks[layer].mlp.ablate_experts([e])
    try:
        with torch.no_grad(), hs.trace(module, names=names[:1]) as cut:
            module(ids)
    finally:
        module.blocks[layer].mlp.ablate_experts([])
    scale, _ = frozen_norm(module.ln_final, clean[names[1]][:, -1])  # (2, d_model)
    removed = clean[names[0]][:, -1] - cut[names[0]][:, -1]  # (2, d_model): w_e y_e
    want = ((centered(module.ln_final, removed) * scale) @ u).detach()  # (2,)
    torch.testing.assert_close(r.per_prompt["experts"][:, layer, e], want, atol=1e-5, rtol=0)
    assert float(want.abs().max()) > 1e-3  # the expert mattered


def test_a_model_without_experts_is_refused_by_name() -> None:
    config = hs.ModelConfig(
        arch="decoder", vocab_size=31, d_model=16, n_layers=1, n_heads=2, max_seq_len=16, positions="rotary",
        norm_kind="rmsnorm", mlp_kind="gated", act="silu", bias=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match="expert_attribution needs a mixture-of-experts MLP"):
        expert_attribution(hs.Decoder(config).eval(), torch.randint(0, 31, (1, 5)), 3)
