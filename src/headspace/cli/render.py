"""The terminal layout and the pictures of ``headspace explain`` (and the pattern grid of ``heads``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..analysis.lesson.explain import Explanation


def piece_display(pretrained: Any) -> Callable[[str], str]:
    """How this model's token pieces are printed: its tokenizer's ``readable`` (``"Ġcat"`` -> ``"␣cat"``,
    :data:`.options.TOKENS_HELP`), or :func:`~headspace.tokenization.readable_token`."""
    from ..pretrained.tokenization import readable_token

    return getattr(getattr(pretrained, "tokenizer", None), "readable", readable_token)


def readable_explanation(e: Explanation, show: Callable[[str], str]) -> Explanation:
    """A copy of ``e`` whose token strings are ``show(token)``, for the terminal and the pictures (the JSON
    keeps the tokenizer's own pieces, as the Python API gives them)."""

    def attended(items: Sequence[Any]) -> list[Any]:
        return [dataclasses.replace(a, token=show(a.token)) for a in items]

    ranking = [
        dataclasses.replace(f, focus_token=show(f.focus_token), top=attended(f.top)) for f in e.ranking
    ]
    return dataclasses.replace(e, tokens=[show(t) for t in e.tokens], top=attended(e.top), ranking=ranking)


#: The widest line ``explain`` prints (its steps are composed to fit; its tables are made to).
EXPLAIN_WIDTH = 100


def console(width: int | None = None) -> Any:
    """A rich console: a terminal's own width (at most ``width``), else (piped, captured) ``width`` or,
    without it, 150 columns, wide enough for the tables instead of the 80-column default."""
    from rich.console import Console

    console = Console(highlight=False)
    if console.is_terminal:
        return console if width is None else Console(highlight=False, width=min(console.width, width))
    return Console(highlight=False, width=150 if width is None else width)


def token_label(tokens: Sequence[str], j: int) -> str:
    """Token ``j`` as the terminal shows it: its text, and ``@j`` (its position) when the same text
    occurs more than once in ``tokens`` (``␣cat@2 0.575, ␣cat@13 0.055``)."""
    return f"{tokens[j]}@{j}" if tokens.count(tokens[j]) > 1 else tokens[j]


def _step(c: Any, text: str, vector: str = "", width: int = EXPLAIN_WIDTH) -> None:
    """Print one step of the walk: ``text`` and its ``vector`` on one line when they fit in ``width``
    columns, else the vector on the next line, indented under the step."""
    if not vector:
        c.print(text)
    elif len(text) + 2 + len(vector) <= width:
        c.print(f"{text}  {vector}")
    else:
        c.print(text)
        c.print(f"    {vector}")


def _vec(values: Sequence[float], n: int = 8) -> str:
    shown = " ".join(f"{v:+.3f}" for v in values[:n])
    return f"[{shown}{' ...' if len(values) > n else ''}]"


def _norm(values: Sequence[float]) -> float:
    return math.sqrt(sum(v * v for v in values))


def _bar(x: float, width: int = 24) -> str:
    n = max(0, min(width, round(x * width)))
    return "█" * n + "·" * (width - n)


def _heads_table(heads: Sequence[Any], tokens: Sequence[str], *, relational: bool) -> Any:
    """A group of ranked heads: layer, head, role, content flow (relational) or top weight, the top key
    and the top attended tokens (a repeated token with its position, :func:`token_label`)."""
    from rich.table import Table

    t = Table()
    values = ("content flow", "flow") if relational else ("weight",)
    cols = ("layer", "head", "role", *values, "on", "top attended tokens")
    for col in cols:
        numeric = col in ("layer", "head", "content flow", "flow", "weight")
        t.add_column(col, justify="right" if numeric else "left")
    for f in heads:
        top = ", ".join(f"{token_label(tokens, a.index)} {a.weight:.2f}" for a in f.top)
        key = f.top[0]
        shown = (f"{f.content_flow:.3f}", f"{f.flow:.3f}") if relational else (f"{key.weight:.3f}",)
        t.add_row(str(f.layer), str(f.head), f.role, *shown, token_label(tokens, key.index), top)
    return t


def occurrence_note(e: Explanation) -> str:
    """Which occurrence of the token is explained, when the sentence holds it more than once."""
    if len(e.occurrences) < 2:
        return ""
    where = ", ".join(str(i) for i in e.occurrences)
    return (
        f"'{e.token}' occurs {len(e.occurrences)} times (positions {where}): this is occurrence "
        f"{e.occurrence}, position {e.token_index}; choose another with --occurrence N"
    )


def kv_note(e: Explanation) -> str:
    """' (key/value head g, shared by query heads a-b)' with grouped-query attention, else ''."""
    if e.n_kv_heads >= e.n_heads:
        return ""
    shared = e.kv_shared_by
    heads = f"{shared[0]}-{shared[-1]}" if len(shared) > 2 else " and ".join(map(str, shared))
    return f" (key/value head {e.kv_head}, shared by query heads {heads})"


def rotation_lines(e: Explanation) -> list[str]:
    """Step 2b of the walk for rotary positions (RoPE): q and every k turned by their positions.

    Each pair of features (a plane) turns by the angle position x inv_freq[plane]; the score of query i
    on key j then depends on the positions only through the offset i - j. Lengths do not change. Every
    line fits :data:`EXPLAIN_WIDTH` columns but the vector, which :func:`_step` places.
    """
    dh, i = len(e.q_rot) or e.d_head, e.token_index  # (latent attention: q is qk_head_dim wide)
    rd = e.rotary_dim if e.rotary_dim is not None else dh
    part = f"all {dh} features" if rd >= dh else f"the first {rd} of {dh} features (the rest pass through)"
    if any(s.scheme == "latent" for s in e.scheme_steps):  # MLA: the last rd features rotate (2x)
        part = f"the last {rd} of {dh} features (the rest pass through)"
    theta = f"{e.rope_theta:g}" if e.rope_theta is not None else "?"
    q, k = ("q_n", "k_n,j") if e.q_normed else ("q", "k_j")
    # YaRN / LongRoPE scale cos and sin by an attention factor: the rotation then changes lengths
    scaled = [s.numbers["attention_factor"] for s in e.scheme_steps if s.scheme == "rope_scaling"]
    same = f"(= |{q}|)" if not scaled or scaled[0] == 1.0 else f"(|{q}| was {_norm(e.q):.3f})"
    return [
        f"2b. rotary positions (RoPE, base {theta}): q and every k_j turn, {rd // 2} planes of 2 features,",
        f"    {part}; plane p by the angle position x {theta}^(-2p/{rd}) (before any rope scaling)",
        f"    q_rot = {q} R({i})   [{dh}]   |q_rot| = {_norm(e.q_rot):.3f} {same}",
        f"    k_rot_j = {k} R(j): cached this way, so the score q_rot.k_rot_j depends on {i} - j only",
        f"    (key/value head {e.kv_head})",
    ]


#: steps of the block after the attention (a mixture of experts), printed after step 7 as 8, 9 ...
AFTER_STEPS = ("experts",)


def scheme_lines(e: Explanation) -> list[str]:
    """The positional scheme's steps (:mod:`headspace.analysis.lesson.scheme_steps`): each step's title as
    ``2c.``, ``2d.`` ..., its lines indented under it."""
    out = []
    for n, step in enumerate(s for s in e.scheme_steps if s.scheme not in AFTER_STEPS):
        out.append(f"2{chr(ord('c') + n)}. {step.title}")
        out.extend(f"    {line}" for line in step.lines)
    return out


def qk_norm_lines(e: Explanation) -> list[str]:
    """Step 2a of the walk for QK-norm (Gemma 3, Qwen3, OLMo 2): q and every k normalised first."""
    dh = e.d_head
    over = f"its {dh} features" if e.qk_norm == "head" else "all heads' features at once"
    return [
        f"2a. QK-norm: q_n = q / rms(q) * g_q, an RMSNorm over {over} (its own weight g_q [{dh}]),",
        "    before any rotation: the scores' size is set by g_q and g_k, not by |q| and |k|",
        f"    q_n   [{dh}]   |q_n| = {_norm(e.q_normed):.3f} (|q| was {_norm(e.q):.3f})",
        f"    k_n,j = k_j / rms(k_j) * g_k for every token j (key/value head {e.kv_head}'s norm, shared",
        "    by its query heads)",
    ]


def window_line(e: Explanation) -> str:
    """What a sliding window hides from the query (empty for a layer that sees every earlier key); two
    lines, each within :data:`EXPLAIN_WIDTH` columns."""
    if e.window is None:
        return ""
    i, w = e.token_index, e.window
    if e.window_sides == "both":  # a bidirectional encoder's band (ModernBERT's local layers)
        hidden = [j for j in range(len(e.tokens)) if abs(i - j) >= w]
        return (
            f"   window: key j is visible iff |{i} - j| < {w} (both sides): {len(hidden)} keys are\n"
            f"   outside this layer's window of {w} and get no weight"
        )
    outside = [j for j in range(len(e.tokens)) if j <= i - w]
    if not outside:
        return (
            f"   window: this layer sees key j iff {i} - {w} < j <= {i};\n"
            f"   its window of {w} covers all {i + 1} tokens up to the query"
        )
    far = outside[0]
    return (
        f"   window: key j is visible iff {i} - {w} < j <= {i}: {len(outside)} keys are outside this\n"
        f"   layer's window of {w} (key {far} is {i - far} tokens back) and get no weight"
    )


def _render_heads(c: Any, e: Explanation, top_heads: int) -> None:
    """The sentence's panel, the occurrence note and the two groups of ranked heads."""
    from rich.panel import Panel

    tok = e.tokens[e.token_index]
    c.print(
        Panel.fit(
            f"[bold]{e.model or 'model'}[/]: {e.n_layers} layers x {e.n_heads} heads, d_model={e.d_model}, "
            f"d_head={e.d_head}\nsentence: {e.sentence}\ntokens: "
            + " ".join(f"[reverse]{t}[/]" if i == e.token_index else t for i, t in enumerate(e.tokens)),
            title="headspace explain",
        )
    )
    note = occurrence_note(e)
    if note:
        c.print(note)
    if e.relational:
        shown = min(top_heads, len(e.relational))
        c.print(
            f"relational heads ({shown} of {len(e.relational)}): '{tok}' attends most to another content word"
        )
        c.print("ranked by content flow = sum over content words j of weight_j x |v_j W_O\\[h]|;")
        c.print("flow: the same for the top key alone")
        c.print(_heads_table(e.relational[:top_heads], e.tokens, relational=True))
    if e.positional:
        shown = min(top_heads, len(e.positional))
        c.print(f"positional heads, function-word ones included ({shown} of {len(e.positional)}): '{tok}'")
        c.print(
            "attends most to itself, a neighbour, a special token or a function word; ranked by that weight"
        )
        c.print(_heads_table(e.positional[:top_heads], e.tokens, relational=False))
    if any(e.tokens.count(t) > 1 for t in e.tokens):
        c.print("a token that occurs more than once is shown with its position: token@position")


def _render_query(c: Any, e: Explanation) -> bool:
    """Steps 1, 2 (and 2a, 2b): x, q, the keys and values; returns whether q and k are rotated."""
    H, g, dh, dm = e.head, e.kv_head, len(e.q), e.d_model  # (latent attention: qk_head_dim, not d_head)
    tok = e.tokens[e.token_index]
    kv = (
        f"k, v [{len(e.tokens)}, {dh}]"
        if len(e.v[0]) == dh
        else f"k [{len(e.tokens)}, {dh}], v [.., {len(e.v[0])}]"
    )
    c.print(f"\n[bold]Layer {e.layer}, head {H}[/]{kv_note(e)} for token {e.token_index} '{tok}'")
    _step(c, f"1. x, the token's input to the attention   [{dm}]   |x| = {_norm(e.x):.3f}", _vec(e.x))
    b_q, b_k, b_v = (f" + b_Q[{H}]", f" + b_K[{g}]", f" + b_V[{g}]") if e.bias else ("", "", "")
    _step(
        c, f"2. q = x W_Q[{H}]{b_q}   W_Q[{H}]: [{dm}, {dh}]  -> q [{dh}]  |q| = {_norm(e.q):.3f}", _vec(e.q)
    )
    c.print(f"   k_j = x_j W_K[{g}]{b_k}, v_j = x_j W_V[{g}]{b_v} for every token j -> {kv}")
    if e.q_normed:
        *lines, last = qk_norm_lines(e)
        for line in lines[:2]:
            c.print(line)
        _step(c, lines[2], _vec(e.q_normed))
        c.print(lines[3])
        c.print(last)
    rotated = bool(e.q_rot)
    if rotated:
        lines = rotation_lines(e)
        c.print(lines[0])
        c.print(lines[1])
        _step(c, lines[2], _vec(e.q_rot))
        for line in lines[3:]:
            c.print(line)
    from rich.markup import escape

    for line in scheme_lines(e):
        c.print(escape(line))
    return rotated


def _scores_table(e: Explanation, rotated: bool) -> Any:
    """Step 3: each key's |k|, score and softmax weight, the top key in bold."""
    from rich.table import Table

    k_name = "k_rot_j" if rotated else "k_n,j" if e.q_normed else "k_j"
    t = Table()
    for col in ("j", "token", f"|{k_name}|", "score", "softmax", ""):
        t.add_column(col, justify="left" if col in ("token", "") else "right")
    for j, token in enumerate(e.tokens):
        s = e.scores[j]
        p = e.pattern[j]
        t.add_row(
            str(j),
            token + (" <- query" if j == e.token_index else ""),
            f"{_norm(e.k_rot[j] if rotated else e.k[j]):.2f}",
            "masked" if s is None else f"{s:+.3f}",
            f"{p:.4f}",
            _bar(p),
            style="bold" if j == e.top[0].index else "",
        )
    return t


def _render_output(c: Any, e: Explanation) -> None:
    """Steps 4-7: z, the concatenation, the output through W_O and how W_O weighs the heads."""

    dh, dm, tok = len(e.z), e.d_model, e.tokens[e.token_index]  # (differential: a pair's 2 d_head)
    if e.gate:  # an output gate (Qwen3-Next): z is the gated output, the input of W_O
        _step(c, f"   gate = sigmoid(x W_G[{e.head}])   [{len(e.gate)}]", _vec(e.gate))
    mix = "(sum_j softmax_j v_j) * gate" if e.gate else "sum_j softmax_j v_j"
    _step(c, f"4. z = {mix}   [{dh}]   |z| = {_norm(e.z):.3f}", _vec(e.z))
    width = e.n_heads * dh
    _step(
        c,
        f"5. concat of the {e.n_heads} heads' z for this token   [{e.n_heads} x {dh} = {width}]",
        _vec(e.concat),
    )
    b_o = " + b_O" if e.out_bias else ""
    rows, concat = e.n_heads * e.d_head, "concat"
    if rows != width:  # differential attention: W_O reads each pair's normed z_j - lambda z_(j+P) (2x)
        concat = f"\\[y_0 .. y_{e.n_heads // 2 - 1}]"  # (escaped: rich markup)
    out = f"6. out = {concat} W_O{b_o}   W_O: [{rows}, {dm}]  -> out [{dm}]  |out| = {_norm(e.out):.3f}"
    _step(c, out, _vec(e.out))
    head_share_table(c, e, 7, tok)


def render_explanation(e: Explanation, *, top_heads: int = 5) -> None:
    """Print the pipeline of an :class:`Explanation` in order, with real shapes and values, in at most
    :data:`EXPLAIN_WIDTH` columns (a vector that does not fit beside its step goes under it)."""
    c = console(EXPLAIN_WIDTH)
    _render_heads(c, e, top_heads)
    rotated = _render_query(c, e)
    q_name, k_name = ("q_rot", "k_rot_j") if rotated else ("q_n", "k_n,j") if e.q_normed else ("q", "k_j")
    root = 1.0 / (e.scale * e.scale)  # the scale is 1 / sqrt(root): d_head, or Gemma's query_pre_attn_scalar
    root_text = f"{root:.0f}" if abs(root - round(root)) < 1e-6 else f"{root:.4g}"
    alibi = " - m_h (i - j) (ALiBi, 2c)" if any(st.scheme == "alibi" for st in e.scheme_steps) else ""
    c.print(
        f"3. scores {q_name}.{k_name} / sqrt({root_text}){alibi} and the softmax over the {len(e.tokens)} "
        "tokens"
    )
    c.print(_scores_table(e, rotated))
    if e.window is not None:
        c.print(window_line(e))
    labels = [token_label(e.tokens, a.index) for a in e.top[:3]]
    c.print("   top attended: " + ", ".join(f"[bold]{t}[/] {a.weight:.3f}" for t, a in zip(labels, e.top)))
    _render_output(c, e)
    from rich.markup import escape

    for n, step in enumerate((s for s in e.scheme_steps if s.scheme in AFTER_STEPS), start=8):
        c.print(escape(f"{n}. {step.title}"))  # the block after its attention: a mixture of experts
        for line in step.lines:
            c.print(escape(f"    {line}"))


def explain_pictures(e: Explanation, pretrained: Any, out: Path) -> list[Path]:
    """PNG pictures of an explanation: the head's pattern, the token's row, q/k/v/z cells, W_O shares."""
    import torch

    from ..analysis.lesson.explain import record, tokenize_one
    from ..viz import plots

    ids, pad = tokenize_one(pretrained, e.sentence)
    model = pretrained.model

    def run() -> None:
        with torch.inference_mode():
            model(ids) if pad is None else model(ids, pad)

    pattern = record(model, run)["pattern"][e.layer][0, e.head]  # (seq, seq)
    tag = f"L{e.layer}_H{e.head}"
    tok = e.tokens[e.token_index]
    return [
        plots.plot_pattern(
            pattern,
            e.tokens,
            out / f"explain_{tag}_pattern.png",
            title=f"layer {e.layer}, head {e.head}: attention pattern",
            highlight=e.token_index,
        ),
        plots.plot_attention_row(
            e.pattern,
            e.tokens,
            out / f"explain_{tag}_row.png",
            title=f"layer {e.layer}, head {e.head}: where '{tok}' attends",
            query=e.token_index,
        ),
        *vector_pictures(e, out),
    ]


def vector_pictures(e: Explanation, out: Path) -> list[Path]:
    """The walk's q, k, v and z as cells, and how W_O weighs the heads (every walk has both)."""
    from ..viz import plots

    tag, tok = f"L{e.layer}_H{e.head}", e.tokens[e.token_index]
    return [
        plots.plot_vectors(
            {"q": e.q, "k": e.k, "v": e.v, "z": e.z},
            out / f"explain_{tag}_qkvz.png",
            title=f"layer {e.layer}, head {e.head}: q of '{tok}', k and v of every token, z",
            row_labels=e.tokens,
        ),
        plots.plot_head_shares(
            e.head_shares,
            out / f"explain_L{e.layer}_wo_shares.png",
            title=f"layer {e.layer}: how W_O weighs the heads for '{tok}'",
            highlight=e.head,
        ),
    ]


def pattern_grid(pretrained: Any, sentence: str, out: Path) -> Path:
    import torch

    from ..analysis.lesson.explain import record, token_strings, tokenize_one
    from ..viz import plots

    ids, pad = tokenize_one(pretrained, sentence)
    model = pretrained.model

    def run() -> None:
        with torch.inference_mode():
            model(ids) if pad is None else model(ids, pad)

    patterns = [p[0] for p in record(model, run)["pattern"]]  # each (n_heads, seq, seq)
    show = piece_display(pretrained)
    return plots.plot_pattern_grid(
        patterns,
        [show(t) for t in token_strings(pretrained, sentence)],
        out / "heads_patterns.png",
        title=f"every head's pattern: {sentence[:60]}",
    )


def head_share_table(c: Any, e: Any, number: int, tok: str) -> None:
    """Step ``number`` of the walk: how W_O weighs the heads of the explained layer for the token ``tok``
    (each head's ``|z_h W_O[h]|`` and its share of the sum, the explained head starred)."""
    c.print(
        f"{number}. how W_O weighs the heads of layer {e.layer} for '{tok}' (share of sum_h |z_h W_O\\[h]|)"
    )
    from rich.table import Table

    t = Table()
    for col in ("head", "|z_h W_O\\[h]|", "share", ""):
        t.add_column(col, justify="left" if col == "" else "right")
    for h in sorted(range(e.n_heads), key=lambda h: -e.head_shares[h]):
        t.add_row(
            f"{h}{' *' if h == e.head else ''}",
            f"{e.head_contributions[h]:.3f}",
            f"{e.head_shares[h]:.3f}",
            _bar(e.head_shares[h] * 2),
        )
    c.print(t)
