"""Per-head measurements taken at every evaluation: what each head attends to and how much it matters.

For every (layer, head), on the evaluation batch:

* ``entropy``: mean entropy of its attention pattern (nats), and its role masses (mean attention on the
  previous / current / first / last token, from :func:`headspace.analysis.roles_from_patterns`);
* ``wo_norm``: the Frobenius norm of its ``W_O[h]`` block;
* ``ablation_loss``: how much the evaluation loss rises when its output is zeroed (``z_h = 0`` at the
  ``hook_z`` point), and ``ablation_acc``: per relation, how much the accuracy of the answer part that
  needs the relation falls (synthetic tasks);
* ``relation_mass``: per relation, its mean attention on the ground-truth position of that relation, over
  the positions scored for it (synthetic tasks).

Every value is a nested list ``[layer][head]`` of floats, ready for ``metrics.jsonl``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..analysis import roles_from_patterns, wo_norms
from ..trace import attention_layers
from .tasks import IGNORE, Batch


def task_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy over the scored positions; logits [batch, seq, vocab], targets [batch, seq]."""
    B, S, V = logits.shape
    return F.cross_entropy(logits.reshape(B * S, V), targets.reshape(B * S), ignore_index=IGNORE)


def part_accuracy(task: Any, logits: Tensor, batch: Batch) -> tuple[float, list[float]]:
    """(accuracy of whole answers, accuracy of each relation's answer part) over the scored positions."""
    pred = logits.argmax(dim=-1)  # (batch, seq)
    scored = batch.targets != IGNORE  # (batch, seq)
    whole = float((pred == batch.targets)[scored].float().mean())
    if not hasattr(task, "parts"):
        return whole, []
    got = task.parts(pred)[scored]  # (n_scored, n_relations)
    want = task.parts(batch.targets)[scored]  # (n_scored, n_relations)
    return whole, [float(x) for x in (got == want).float().mean(dim=0)]


def relation_mass(pattern: Tensor, batch: Batch) -> Tensor:
    """Mean attention on each relation's ground-truth key, per head.

    Shapes: pattern [batch, n_heads, seq_q, seq_k], batch.relation_pos [batch, seq, n_relations]
    -> [n_heads, n_relations].
    """
    assert batch.relation_pos is not None
    B, H, S, _ = pattern.shape
    R = batch.relation_pos.shape[-1]
    out = torch.zeros(H, R, dtype=torch.float64)
    for r in range(R):
        pos = batch.relation_pos[..., r]  # (B, S)
        valid = pos >= 0  # (B, S)
        index = pos.clamp(min=0)[:, None, :, None].expand(B, H, S, 1)  # (B, H, S, 1)
        mass = pattern.gather(-1, index).squeeze(-1)  # (B, H, S)
        out[:, r] = (mass * valid[:, None, :]).sum(dim=(0, 2)).double() / valid.sum().clamp(min=1)
    return out


class _Recorder:
    """Record every attention layer's pattern during one forward pass (explicit path)."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = [attn for _, attn in attention_layers(model)]
        self.patterns: list[Tensor] = []
        self._removers: list[Any] = []

    def __enter__(self) -> _Recorder:
        for attn in self.layers:

            def keep(value: Tensor, _hp: Any) -> None:
                self.patterns.append(value.detach())

            self._removers.append(attn.hook_pattern.add(keep))
        return self

    def __exit__(self, *exc: object) -> None:
        for remove in self._removers:
            remove()


def zero_head(attn: nn.Module, head: int) -> Any:
    """Zero one head's ``z`` (hence its output ``z_h W_O[h]``) while the returned remover is not called."""

    def ablate(z: Tensor, _hp: Any) -> Tensor:  # z: [batch, seq, n_heads, d_head]
        z = z.clone()
        z[:, :, head] = 0.0
        return z

    return attn.hook_z.add(ablate)


@torch.no_grad()
def evaluate(model: nn.Module, task: Any, batch: Batch, *, heads: bool = True) -> dict[str, Any]:
    """Loss, accuracy and (with ``heads``) the per-head measurements on one evaluation batch."""
    was_training = model.training
    model.eval()
    try:
        layers = [attn for _, attn in attention_layers(model)]
        with _Recorder(model) as rec:
            logits = model(batch.tokens)  # (batch, seq, vocab)
        loss = float(task_loss(logits, batch.targets))
        out: dict[str, Any] = {"loss": loss}
        synthetic = batch.relation_pos is not None and hasattr(task, "parts")
        if synthetic:
            whole, parts = part_accuracy(task, logits, batch)
            out["accuracy"] = whole
            out["part_accuracy"] = dict(zip(task.relations, parts))
        if not heads:
            return out
        patterns = [p.float().cpu() for p in rec.patterns]  # each (batch, n_heads, seq, seq)
        roles = roles_from_patterns(patterns)
        out["entropy"] = _rows(roles.entropy, layers)
        for target in ("previous", "current", "first"):
            out[f"role_{target}"] = _rows(roles.mass(target), layers)
        out["wo_norm"] = _rows(wo_norms(model), layers)
        if synthetic:
            masses = [relation_mass(p, batch.to("cpu")) for p in patterns]  # each (n_heads, n_relations)
            out["relation_mass"] = {
                name: [[float(m[h, r]) for h in range(m.shape[0])] for m in masses]
                for r, name in enumerate(task.relations)
            }
        ablation_loss: list[list[float]] = []
        ablation_acc: dict[str, list[list[float]]] = {name: [] for name in getattr(task, "relations", ())}
        for attn in layers:
            row_loss: list[float] = []
            row_acc: dict[str, list[float]] = {name: [] for name in ablation_acc}
            for h in range(attn.n_heads):
                remove = zero_head(attn, h)
                try:
                    ablated = model(batch.tokens)  # (batch, seq, vocab)
                finally:
                    remove()
                row_loss.append(float(task_loss(ablated, batch.targets)) - loss)
                if synthetic:
                    _, parts_ablated = part_accuracy(task, ablated, batch)
                    for name, before, after in zip(
                        task.relations, out["part_accuracy"].values(), parts_ablated
                    ):
                        row_acc[name].append(before - after)
            ablation_loss.append(row_loss)
            for name in ablation_acc:
                ablation_acc[name].append(row_acc[name])
        out["ablation_loss"] = ablation_loss
        if synthetic:
            out["ablation_acc"] = ablation_acc
        return out
    finally:
        model.train(was_training)


def _rows(values: Tensor, layers: list[Any]) -> list[list[float]]:
    """[n_layers, max_heads] (NaN-padded) -> ragged nested lists with each layer's real heads."""
    return [[float(values[i, h]) for h in range(attn.n_heads)] for i, attn in enumerate(layers)]


def relation_summary(task: Any, result: dict[str, Any]) -> dict[str, Any]:
    """For each relation: the head that serves it (largest accuracy drop when ablated) and its numbers.

    ``ablation_drop``: accuracy lost on the answer part that needs the relation when that head is
    ablated; ``other_drop``: the largest accuracy lost on any other relation's part.
    """
    summary: dict[str, Any] = {}
    names = list(task.relations)
    for name in names:
        drops = result["ablation_acc"][name]
        masses = result["relation_mass"][name]
        best = max(
            ((layer, h) for layer, row in enumerate(drops) for h in range(len(row))),
            key=lambda lh: (drops[lh[0]][lh[1]], masses[lh[0]][lh[1]]),
        )
        layer, h = best
        others = [result["ablation_acc"][o][layer][h] for o in names if o != name]
        summary[name] = {
            "head": [layer, h],
            "attention_mass": masses[layer][h],
            "ablation_drop": drops[layer][h],
            "other_drop": max(others) if others else 0.0,
            "part_accuracy": result["part_accuracy"][name],
        }
    return summary
