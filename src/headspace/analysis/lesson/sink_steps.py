"""The lesson's learned-sink step (gpt-oss; :mod:`headspace.attention.sinks`).

A layer with ``attn.sinks`` [n_heads] adds one logit ``s_h`` per head to every row's softmax:

    p_ij = exp(a_ij) / (sum_k exp(a_ik) + exp(s_h))        sink_i = exp(s_h) / (sum_k exp(a_ik) + exp(s_h))

so the explained row's key weights sum to ``1 - sink_i``. The step ``"sink"`` shows ``s_h``, the sink's
mass for the explained token (``1 - sum_j p_ij``, the value ``hook_sink`` gives) and the same mass
recomputed from the row's scores and ``s_h`` (the two agree to float rounding). Layers without sinks get
no step. Registered on import (:mod:`.explain` imports this module).
"""

from __future__ import annotations

from typing import Any

import torch

from .scheme_steps import SchemeContext, SchemeStep, register_scheme_step

__all__ = ["sink_from_scores", "sink_step"]


def sink_from_scores(scores: torch.Tensor, sink_logit: float) -> float:
    """The sink's share of one row's softmax, ``exp(s) / (sum_k exp(a_k) + exp(s))``: ``scores`` [seq_k]
    (``-inf`` where masked), ``sink_logit`` ``s``; computed in float64 with the row maximum subtracted."""
    row = scores.detach().double().flatten()  # (seq_k,)
    column = torch.tensor([sink_logit], dtype=torch.float64)  # (1,)
    return float(torch.softmax(torch.cat([row, column]), dim=0)[-1])


def sink_step(c: SchemeContext) -> SchemeStep | None:
    """The learned-sink step for head ``c.head`` (None for a layer without ``sinks``, or without the
    explained row)."""
    sinks = getattr(c.attn, "sinks", None)
    if sinks is None or c.pattern is None or c.index is None:
        return None
    s = float(sinks.detach()[c.head])
    keys = float(c.pattern.detach().double().sum())
    mass = 1.0 - keys
    numbers: dict[str, Any] = {
        "sink_logit": s,
        "index": int(c.index),
        "sink_mass": mass,
        "key_weights_sum": keys,
    }
    lines = [
        f"head {c.head}'s learned sink logit s_h = {s:.4g} joins every row's softmax as one more column:",
        "p_ij = exp(a_ij) / (sum_k exp(a_ik) + exp(s_h)), and the sink takes",
        "exp(s_h) / (sum_k exp(a_ik) + exp(s_h)); its value goes nowhere (no v, nothing added to z)",
        f"token {c.index}: sink = {mass:.6f}, so the key weights sum to 1 - sink = {keys:.6f}",
    ]
    if c.scores is not None:
        again = sink_from_scores(c.scores, s)
        numbers["sink_from_scores"] = again
        lines.append(f"(from the row's scores and s_h: sink = {again:.6f})")
    return SchemeStep("sink", f"learned sink: the row sums to 1 - sink = {keys:.4f}", lines, numbers)


register_scheme_step("sink", sink_step)
