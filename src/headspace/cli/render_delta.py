"""The terminal layout and the pictures of ``headspace explain`` on a Gated DeltaNet head (issue #39).

The walk of :mod:`headspace.analysis.lesson.delta_walk`: x -> q, k, v (after the convolution) -> the delta
rule's effective weights ``w_tj`` (not a softmax) -> ``o_t = sum_j w_tj v_j`` -> the gated norm ``z`` ->
``z W_O``, every line within :data:`~.render.EXPLAIN_WIDTH` columns.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .render import (
    EXPLAIN_WIDTH,
    _bar,
    _norm,
    _render_heads,
    _step,
    _vec,
    console,
    head_share_table,
    token_label,
    vector_pictures,
)

if TYPE_CHECKING:
    from ..analysis.lesson.explain import Explanation


def _weights_table(e: Explanation) -> Any:
    """Step 4: each token's q.k, decay product, write strength, weight without erasures and weight."""
    from rich.table import Table

    step = e.scheme_steps[0].numbers
    t = Table()
    for col in ("j", "token", "q.k_j", "D_tj", "beta_j", "no erasure", "w_tj", "|w_tj|"):
        t.add_column(col, justify="left" if col in ("token", "|w_tj|") else "right")
    biggest = max((abs(w) for w in e.pattern), default=0.0) or 1.0
    for j in range(e.token_index + 1):
        t.add_row(
            str(j),
            e.tokens[j] + (" <- query" if j == e.token_index else ""),
            f"{e.scores[j]:+.3f}",
            f"{step['decays'][j]:.3e}",
            f"{step['betas'][j]:.4f}",
            f"{step['no_erase'][j]:+.3e}",
            f"{e.pattern[j]:+.3e}",
            _bar(abs(e.pattern[j]) / biggest, width=16),
            style="bold" if j == e.top[0].index else "",
        )
    return t


def render_delta_explanation(e: Explanation, *, top_heads: int = 5) -> None:
    """Print the walk of a DeltaNet head (an ``Explanation`` with the ``"delta_rule"`` step)."""
    from rich.markup import escape

    c = console(EXPLAIN_WIDTH)
    _render_heads(c, e, top_heads)
    c.print("(the head ranking covers the softmax layers only: a DeltaNet layer has no softmax pattern)")
    H, g, dk, dm, tok = e.head, e.kv_head, e.d_head, e.d_model, e.tokens[e.token_index]
    dv, step = len(e.z), e.scheme_steps[0]
    c.print(f"\n[bold]Layer {e.layer}, value head {H}[/] (Gated DeltaNet; query/key head {g}) for token "
            f"{e.token_index} '{escape(tok)}'")  # fmt: skip
    _step(c, f"1. x, the token's input to the layer   [{dm}]   |x| = {_norm(e.x):.3f}", _vec(e.x))
    _step(c, f"2. q = silu(conv(x W_Q[{g}]))   [{dk}]   |q| = {_norm(e.q):.3f}", _vec(e.q))
    n = len(e.tokens)
    c.print(f"   k_j = silu(conv(x W_K[{g}])), v_j = silu(conv(x W_V[{H}])) for every token j -> "
            f"k [{n}, {dk}], v [{n}, {dv}]")  # fmt: skip
    c.print("   (conv: a causal convolution mixing each feature with the same feature of the last tokens)")
    c.print(f"   q and k are scaled to unit length, then q by 1/sqrt({dk}): q.k_j = cosine / sqrt({dk})")
    c.print(f"3. {escape(step.title)}")
    for line in step.lines:
        c.print(f"    {escape(line)}")
    c.print(f"4. the effective weights of token {e.token_index} over the {e.token_index + 1} tokens up to it")
    c.print(_weights_table(e))
    labels = [token_label(e.tokens, a.index) for a in e.top[:3]]
    c.print(
        "   largest |w|: " + ", ".join(f"[bold]{escape(t)}[/] {a.weight:+.3e}" for t, a in zip(labels, e.top))
    )
    o = step.numbers["o_from_weights"]
    _step(c, f"5. o = sum_j w_tj v_j   [{dv}]   |o| = {_norm(o):.4f}", _vec(o))
    _step(c, f"   gate = silu(x W_Z[{H}])   [{dv}]", _vec(e.gate))
    rms = step.numbers["rms"]
    _step(
        c,
        f"6. z = o / rms(o) * w_norm * gate   rms(o) = {rms:.4f}   [{dv}]   |z| = {_norm(e.z):.3f}",
        _vec(e.z),
    )
    _step(c, f"7. out = sum_h z_h W_O\\[h]   W_O: [{e.n_heads} x {dv}, {dm}]  -> out [{dm}]  |out| = "
             f"{_norm(e.out):.3f}", _vec(e.out))  # fmt: skip
    _render_shares(c, e, tok)


def _render_shares(c: Any, e: Explanation, tok: str) -> None:
    """Step 8: how W_O weighs the value heads for the token."""
    from rich.markup import escape

    head_share_table(c, e, 8, escape(tok))


def delta_pictures(e: Explanation, out: Path) -> list[Path]:
    """PNG pictures of a DeltaNet walk: q, k, v and z as cells, and how W_O weighs the heads (the
    effective weights are signed and unnormalised: no softmax picture)."""
    return vector_pictures(e, out)
