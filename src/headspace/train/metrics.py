"""Per-head measurements taken at every evaluation: what each head attends to and how much it matters.

For every (layer, head), on the evaluation batch:

* ``entropy``: mean entropy of its attention pattern (nats), and its role masses (mean attention on the
  previous / current / first / last token, as :func:`headspace.analysis.roles_from_patterns` measures
  them);
* ``wo_norm``: the Frobenius norm of its ``W_O[h]`` block;
* ``ablation_loss``: how much the evaluation loss rises when its output is zeroed (``z_h = 0``), and
  ``ablation_acc``: per relation, how much the accuracy of the answer part that needs the relation falls
  (synthetic tasks);
* ``relation_mass``: per relation, its mean attention on the ground-truth position of that relation, over
  the positions scored for it (synthetic tasks).

Every value is a nested list ``[layer][head]`` of floats, ready for ``metrics.jsonl``.

Memory and time. :func:`evaluate` runs the batch in chunks of rows (:func:`eval_chunk_rows`: at most
:data:`EVAL_CHUNK_TOKENS` tokens, and one layer's ``[rows, heads, seq, seq]`` pattern of at most
:data:`EVAL_CHUNK_PATTERN` numbers) and folds every pattern into sums as soon as it is computed, so its
peak memory is that of one chunk's forward pass whatever the size of the batch; the sums give the
numbers of the whole batch (to float rounding; a batch that fits one chunk gives them exactly as one
pass over it does). A head ablation reuses the chunk's clean pass: the blocks below the ablated layer
are replayed from it, and the ablated layer's attention output is ``z`` (``z_h = 0``) times ``W_O``
(its q, k, v and pattern do not change), so ablating a head of layer ``l`` runs only the MLP of ``l``
and the blocks above it; the heads of a layer are ablated together, one copy of the chunk each, in
passes of at most :data:`EVAL_CHUNK_TOKENS` tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..analysis import wo_norms
from ..analysis.lesson.roles import DEFAULT_THRESHOLD, RoleAccumulator
from ..analysis.trace.trace import attention_layers
from ..core.checks import is_int, nonfinite_count
from ..nn.hooks import HookPoint
from .tasks import IGNORE, Batch

#: The most tokens (rows x seq) one evaluation chunk runs through the model.
EVAL_CHUNK_TOKENS = 16384
#: The most numbers of one layer's pattern [rows, n_heads, seq, seq] in one evaluation chunk (8 MiB of
#: float32): a text run's chunk is then no larger than its training batch (32 windows).
EVAL_CHUNK_PATTERN = 1 << 21
#: The most numbers of a pattern folded into the head-role sums at once (their float64 temporaries).
ROLE_SLICE = 1 << 20


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


def relation_mass_sums(pattern: Tensor, relation_pos: Tensor) -> tuple[Tensor, Tensor]:
    """Summed attention on each relation's ground-truth key, per head, and the number of queries summed.

    Shapes: pattern [batch, n_heads, seq_q, seq_k], relation_pos [batch, seq, n_relations] -> (float64
    [n_heads, n_relations] on the CPU, int64 [n_relations]). Sums over chunks of a batch, divided by the
    summed counts, are :func:`relation_mass` of the whole batch.
    """
    B, H, S, _ = pattern.shape
    R = relation_pos.shape[-1]
    sums = torch.zeros(H, R, dtype=torch.float64)
    counts = torch.zeros(R, dtype=torch.long)
    for r in range(R):
        pos = relation_pos[..., r]  # (B, S)
        valid = pos >= 0  # (B, S)
        index = pos.clamp(min=0)[:, None, :, None].expand(B, H, S, 1)  # (B, H, S, 1)
        mass = pattern.gather(-1, index).squeeze(-1)  # (B, H, S)
        sums[:, r] = (mass * valid[:, None, :]).sum(dim=(0, 2)).double().cpu()
        counts[r] = int(valid.sum())
    return sums, counts


def relation_mass(pattern: Tensor, batch: Batch) -> Tensor:
    """Mean attention on each relation's ground-truth key, per head.

    Shapes: pattern [batch, n_heads, seq_q, seq_k], batch.relation_pos [batch, seq, n_relations]
    -> [n_heads, n_relations].
    """
    assert batch.relation_pos is not None
    sums, counts = relation_mass_sums(pattern, batch.relation_pos.to(pattern.device))
    return sums / counts.clamp(min=1)


def zero_head(attn: nn.Module, head: int) -> Any:
    """Zero one head's ``z`` (hence its output ``z_h W_O[h]``) while the returned remover is not called."""

    def ablate(z: Tensor, _hp: Any) -> Tensor:  # z: [batch, seq, n_heads, d_head]
        z = z.clone()
        z[:, :, head] = 0.0
        return z

    return attn.hook_z.add(ablate)


def eval_chunk_rows(n_rows: int, seq_len: int, max_heads: int) -> int:
    """Rows per evaluation chunk: the most within :data:`EVAL_CHUNK_TOKENS` and :data:`EVAL_CHUNK_PATTERN`.

    For a text model (seq 128, 4 heads) that is 32 windows; a synthetic task's 512 sequences of 24
    tokens fit one chunk.
    """
    seq_len, max_heads = max(1, seq_len), max(1, max_heads)
    by_tokens = EVAL_CHUNK_TOKENS // seq_len
    by_pattern = EVAL_CHUNK_PATTERN // (max_heads * seq_len * seq_len)
    return max(1, min(n_rows, by_tokens, by_pattern))


def _float32(x: float) -> float:
    """``x`` rounded to float32, as a mean computed in float32 is (so one chunk gives the same number)."""
    return float(torch.tensor(x, dtype=torch.float32))


class _Scores:
    """Loss and accuracies of one model variant, summed over the chunks of the batch."""

    def __init__(self, n_parts: int) -> None:
        self.loss_sum = 0.0  # sum over chunks of (mean loss x scored positions)
        self.n_scored = 0
        self.correct = 0
        self.part_correct = [0] * n_parts

    def add(self, task: Any, logits: Tensor, batch: Batch, synthetic: bool) -> None:
        scored = batch.targets != IGNORE  # (rows, seq)
        n = int(scored.sum())
        if n == 0:
            return
        self.loss_sum += float(task_loss(logits, batch.targets)) * n
        self.n_scored += n
        if synthetic:
            pred = logits.argmax(dim=-1)  # (rows, seq)
            self.correct += int((pred == batch.targets)[scored].sum())
            got = task.parts(pred)[scored]  # (n_scored, n_relations)
            want = task.parts(batch.targets)[scored]  # (n_scored, n_relations)
            for r, c in enumerate((got == want).sum(dim=0).tolist()):
                self.part_correct[r] += int(c)

    def loss(self) -> float:
        return _float32(self.loss_sum / self.n_scored) if self.n_scored else float("nan")

    def accuracy(self) -> float:
        return _float32(self.correct / self.n_scored) if self.n_scored else float("nan")

    def part_accuracy(self) -> list[float]:
        n = self.n_scored
        return [_float32(c / n) if n else float("nan") for c in self.part_correct]


def _block_stack(model: nn.Module, layers: list[nn.Module]) -> list[nn.Module] | None:
    """The blocks holding ``layers`` (each block's ``attn``), when they are one ``nn.ModuleList`` in order
    and each block has a ``hook_resid_post`` (:class:`~headspace.nn.hooks.HookPoint`: its output).

    None when the model is laid out otherwise: its ablations then run the whole model.
    """
    names = [name for name, _ in attention_layers(model)]
    parts = [name.rsplit(".", 2) for name in names]  # [container, index, "attn"]
    if not parts or any(len(p) != 3 or p[2] != "attn" for p in parts):
        return None
    if len({p[0] for p in parts}) != 1 or [p[1] for p in parts] != [str(i) for i in range(len(parts))]:
        return None
    stack = model.get_submodule(parts[0][0])
    if not isinstance(stack, nn.ModuleList) or len(stack) != len(layers):
        return None
    blocks = list(stack)
    for block, attn in zip(blocks, layers):
        if getattr(block, "attn", None) is not attn or "forward" in vars(block) or "forward" in vars(attn):
            return None
        if not isinstance(getattr(block, "hook_resid_post", None), HookPoint):  # its output is read there
            return None
    return blocks


def _replayed(
    model: nn.Module, tokens: Tensor, blocks: list[nn.Module], prev: Tensor | None, attn: nn.Module,
    attn_out: Tensor, layer: int,
) -> Tensor | None:  # fmt: skip
    """The model's logits with blocks ``< layer`` returning ``prev`` and ``attn`` returning ``attn_out``.

    None if the forward pass did not call each of them exactly once (a model whose forward does not run
    its blocks in order): the caller then runs the ablation on the whole model.
    """
    calls = [0] * (layer + 1)

    def replay(i: int, value: Tensor | None) -> Callable[..., Tensor | None]:
        def forward(*_args: Any, **_kwargs: Any) -> Tensor | None:
            calls[i] += 1
            return value

        return forward

    patched = [*blocks[:layer], attn]
    for i, module in enumerate(patched):
        module.forward = replay(i, prev if i < layer else attn_out)
    try:
        logits = model(tokens)  # (rows, seq, vocab)
    finally:
        for module in patched:
            del module.forward
    return logits if calls == [1] * (layer + 1) else None


class _Evaluation:
    """The sums of one evaluation, chunk by chunk (see :func:`evaluate`)."""

    def __init__(self, model: nn.Module, task: Any, batch: Batch, heads: bool) -> None:
        self.model, self.task, self.heads = model, task, heads
        self.layers = [attn for _, attn in attention_layers(model)]
        self.synthetic = batch.relation_pos is not None and hasattr(task, "parts")
        self.relations: tuple[str, ...] = tuple(task.relations) if self.synthetic else ()
        n_parts = len(self.relations)
        self.clean = _Scores(n_parts)
        self.ablated = [[_Scores(n_parts) for _ in range(a.n_heads)] for a in self.layers] if heads else []
        self.roles = RoleAccumulator([a.n_heads for a in self.layers])
        self.mass_sums = [torch.zeros(a.n_heads, n_parts, dtype=torch.float64) for a in self.layers]
        self.mass_counts = torch.zeros(n_parts, dtype=torch.long)
        self.blocks = _block_stack(model, self.layers) if heads else None

    def head_groups(self, per_pass: int) -> list[tuple[int, list[int]]]:
        """(layer, heads) ablated together in one pass, at most ``per_pass`` heads of a layer at a time."""
        if not self.heads:
            return []
        return [
            (layer, list(range(h, min(h + per_pass, attn.n_heads))))
            for layer, attn in enumerate(self.layers)
            for h in range(0, attn.n_heads, per_pass)
        ]

    def _fold_pattern(self, value: Tensor, layer: int, chunk: Batch) -> None:
        """One layer's pattern [rows, n_heads, seq, seq] into the role and relation sums."""
        p = value.detach().float()  # (rows, n_heads, seq, seq)
        bad = nonfinite_count(p)
        if bad:
            raise ValueError(
                f"patterns[{layer}] (layer {layer}) has {bad} non-finite values (NaN/Inf) of {p.numel()}; "
                "attention patterns must be finite probabilities"
            )
        rows, n_heads, seq_q, seq_k = p.shape
        # the role sums work on float64 copies: a few rows at a time keeps those small
        step = max(1, ROLE_SLICE // max(1, n_heads * seq_q * seq_k))
        for r in range(0, rows, step):
            part = p[r : r + step]  # (<= step, n_heads, seq, seq)
            real = torch.ones(part.shape[0], seq_k, dtype=torch.bool, device=p.device)
            self.roles.add(layer, part, real)
        if self.synthetic:
            assert chunk.relation_pos is not None
            sums, counts = relation_mass_sums(p, chunk.relation_pos)
            self.mass_sums[layer] += sums
            if layer == 0:
                self.mass_counts += counts

    def clean_pass(self, chunk: Batch) -> tuple[list[Tensor], list[Tensor]]:
        """The unablated model on ``chunk`` into the sums; returns (z per layer, output per block).

        The patterns are folded into sums inside their hook, so none outlives its attention call.
        """
        zs: list[Tensor] = []  # per layer (rows, seq, n_heads, d_head)
        outputs: list[Tensor] = []  # per block (rows, seq, d_model)
        removers: list[Callable[[], None]] = []
        if self.heads:
            fold = self._fold_pattern
            for i, attn in enumerate(self.layers):
                removers.append(attn.hook_pattern.add(lambda v, _hp, i=i: fold(v, i, chunk)))
                removers.append(attn.hook_z.add(lambda v, _hp: zs.append(v.detach())))
            for block in self.blocks or ():  # the block's output: what its hook_resid_post sees
                removers.append(block.hook_resid_post.add(lambda v, _hp: outputs.append(v.detach())))
        try:
            logits = self.model(chunk.tokens)  # (rows, seq, vocab)
        finally:
            for remove in removers:
                remove()
        self.clean.add(self.task, logits, chunk, self.synthetic)
        if self.blocks is not None and (len(zs) != len(self.layers) or len(outputs) != len(self.layers)):
            self.blocks = None  # the forward pass did not go through each block once, in order
        return zs, outputs

    def ablate(
        self, chunk: Batch, zs: list[Tensor], outputs: list[Tensor], layer: int, heads: list[int]
    ) -> None:
        """The model on ``chunk`` with each of ``heads`` of ``layer`` zeroed in turn, into their scores.

        The heads go through the model together, one copy of the chunk each.
        """
        attn = self.layers[layer]
        rows = chunk.tokens.shape[0]
        logits = None
        if self.blocks is not None:
            z = zs[layer].repeat(len(heads), 1, 1, 1)  # (len(heads) rows, seq, n_heads, d_head)
            for j, h in enumerate(heads):
                z[j * rows : (j + 1) * rows, :, h] = 0.0
            attn_out = attn.output_from_heads(z)  # (len(heads) rows, seq, d_model)
            prev = None if layer == 0 else outputs[layer - 1].repeat(len(heads), 1, 1)
            tokens = chunk.tokens.repeat(len(heads), 1)  # (len(heads) rows, seq)
            logits = _replayed(self.model, tokens, self.blocks, prev, attn, attn_out, layer)
            if logits is None:
                self.blocks = None
        for j, h in enumerate(heads):
            if logits is not None:
                logits_h = logits[j * rows : (j + 1) * rows]  # (rows, seq, vocab)
            else:
                remove = zero_head(attn, h)
                try:
                    logits_h = self.model(chunk.tokens)  # (rows, seq, vocab)
                finally:
                    remove()
            self.ablated[layer][h].add(self.task, logits_h, chunk, self.synthetic)

    def result(self) -> dict[str, Any]:
        layers, relations = self.layers, self.relations
        loss = self.clean.loss()
        out: dict[str, Any] = {"loss": loss}
        if self.synthetic:
            out["accuracy"] = self.clean.accuracy()
            out["part_accuracy"] = dict(zip(relations, self.clean.part_accuracy()))
        if not self.heads:
            return out
        roles = self.roles.result(DEFAULT_THRESHOLD)
        out["entropy"] = _rows(roles.entropy, layers)
        for target in ("previous", "current", "first"):
            out[f"role_{target}"] = _rows(roles.mass(target), layers)
        out["wo_norm"] = _rows(wo_norms(self.model), layers)
        if self.synthetic:
            masses = [s / self.mass_counts.clamp(min=1) for s in self.mass_sums]  # (n_heads, n_relations)
            out["relation_mass"] = {
                name: [[float(m[h, r]) for h in range(m.shape[0])] for m in masses]
                for r, name in enumerate(relations)
            }
        out["ablation_loss"] = [[s.loss() - loss for s in row] for row in self.ablated]
        if self.synthetic:
            before = self.clean.part_accuracy()
            after = [[s.part_accuracy() for s in row] for row in self.ablated]
            out["ablation_acc"] = {
                name: [[before[r] - parts[r] for parts in row] for row in after]
                for r, name in enumerate(relations)
            }
        return out


@torch.no_grad()
def evaluate(
    model: nn.Module,
    task: Any,
    batch: Batch,
    *,
    heads: bool = True,
    chunk_rows: int | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Loss, accuracy and (with ``heads``) the per-head measurements on one evaluation batch.

    The batch runs in chunks of ``chunk_rows`` rows (None: :func:`eval_chunk_rows`); the numbers are
    those of the whole batch (see the module docstring). ``on_progress(done, total)``, when given, is
    called with ``done = 0`` before the first forward pass and after every one (``total``: per chunk,
    one clean pass and, with ``heads``, the ablation passes: the heads of a layer go through the model
    together, as many as :data:`EVAL_CHUNK_TOKENS` allows).
    """
    if chunk_rows is not None and (not is_int(chunk_rows) or chunk_rows < 1):
        raise ValueError(f"chunk_rows must be None or an int >= 1; got {chunk_rows!r}")
    was_training = model.training
    model.eval()
    try:
        ev = _Evaluation(model, task, batch, heads)
        n_rows, seq = batch.tokens.shape
        if chunk_rows is None:
            chunk_rows = eval_chunk_rows(n_rows, seq, max((a.n_heads for a in ev.layers), default=1))
        starts = range(0, n_rows, chunk_rows)
        # the ablations of a layer's heads share passes of up to EVAL_CHUNK_TOKENS tokens
        groups = ev.head_groups(max(1, EVAL_CHUNK_TOKENS // max(1, seq * chunk_rows)))
        total, done = len(starts) * (1 + len(groups)), 0

        def passed() -> None:
            nonlocal done
            done += 1
            if on_progress is not None:
                on_progress(done, total)

        if on_progress is not None:
            on_progress(0, total)
        for start in starts:
            chunk = batch.rows(start, min(start + chunk_rows, n_rows))
            zs, outputs = ev.clean_pass(chunk)
            passed()
            for layer, heads_together in groups:
                ev.ablate(chunk, zs, outputs, layer, heads_together)
                passed()
        return ev.result()
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
