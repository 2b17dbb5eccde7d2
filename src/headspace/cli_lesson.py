"""The lesson's commands: ``headspace explain``, ``heads``, ``subspaces`` and ``bench``.

Each prints a rich terminal layout (tables, aligned numbers), writes PNG pictures to ``--out`` and, with
``--json``, prints the same numbers as the Python API instead. User errors are one line, exit code 2.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from .errors import UsageError
from .explain import DEFAULT_SENTENCE, DEFAULT_TOKEN, Explanation, explain

KNOWN_MODELS = ("minilm",)


def load_model(spec: str) -> Any:
    """``minilm`` (bundled all-MiniLM-L6-v2) or a folder with a Hugging Face BERT or GPT-2 checkpoint."""
    from . import pretrained

    known = sorted(pretrained.MODELS)
    if spec.strip().lower() in pretrained.MODELS:
        try:
            return pretrained.load(spec)
        except (ImportError, FileNotFoundError, ValueError) as e:
            raise UsageError(str(e).splitlines()[0]) from None
    path = Path(spec)
    if not path.is_dir():
        raise UsageError(
            f"unknown model {spec!r}: give one of {known} or a folder with config.json and model.safetensors"
        )
    cfg = path / "config.json"
    try:
        model_type = json.loads(cfg.read_text(encoding="utf-8")).get("model_type", "")
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {cfg}: {e}") from None
    loaders = {"bert": pretrained.load_bert, "gpt2": pretrained.load_gpt2}
    if model_type not in loaders:
        raise UsageError(
            f"{cfg} has model_type {model_type!r}; supported model types: {sorted(loaders)} "
            f"(or one of {known})"
        )
    try:
        return loaders[model_type](path)
    except (OSError, ValueError) as e:
        raise UsageError(str(e).splitlines()[0]) from None


def _console():
    from rich.console import Console

    console = Console(highlight=False)
    # piped or captured output gets a width that fits the tables instead of the 80-column default
    return console if console.is_terminal else Console(highlight=False, width=150)


def _vec(values: Sequence[float], n: int = 8) -> str:
    shown = " ".join(f"{v:+.3f}" for v in values[:n])
    return f"[{shown}{' ...' if len(values) > n else ''}]"


def _norm(values: Sequence[float]) -> float:
    return math.sqrt(sum(v * v for v in values))


def _bar(x: float, width: int = 24) -> str:
    n = max(0, min(width, round(x * width)))
    return "█" * n + "·" * (width - n)


def render_explanation(e: Explanation, *, top_heads: int = 5) -> None:
    """Print the pipeline of an :class:`Explanation` in order, with real shapes and values."""
    from rich.panel import Panel
    from rich.table import Table

    c = _console()
    tok = e.tokens[e.token_index]
    c.print(
        Panel.fit(
            f"[bold]{e.model or 'model'}[/]: {e.n_layers} layers x {e.n_heads} heads, d_model={e.d_model}, "
            f"d_head={e.d_head}\nsentence: {e.sentence}\ntokens: "
            + " ".join(f"[reverse]{t}[/]" if i == e.token_index else t for i, t in enumerate(e.tokens)),
            title="headspace explain",
        )
    )
    if e.ranking:
        t = Table(title=f"heads ranked by where '{tok}' attends (largest weight on a content token)")
        for col in ("layer", "head", "focus", "on", "top attended tokens"):
            t.add_column(col, justify="right" if col in ("layer", "head", "focus") else "left")
        for f in e.ranking[:top_heads]:
            top = ", ".join(f"{a.token} {a.weight:.2f}" for a in f.top)
            t.add_row(str(f.layer), str(f.head), f"{f.focus:.3f}", f.focus_token, top)
        c.print(t)
    L, H, dh, dm = e.layer, e.head, e.d_head, e.d_model
    c.print(f"\n[bold]Layer {L}, head {H}[/] (key/value head {e.kv_head}) for token {e.token_index} '{tok}'")
    c.print(f"1. x, the token's input to the attention      [{dm}]   |x| = {_norm(e.x):.3f}  {_vec(e.x)}")
    c.print(
        f"2. q = x W_Q[{H}] + b_Q[{H}]   W_Q[{H}]: [{dm}, {dh}]  -> q [{dh}]  "
        f"|q| = {_norm(e.q):.3f}  {_vec(e.q)}"
    )
    c.print(
        f"   k_j = x_j W_K[{e.kv_head}] + b_K, v_j = x_j W_V[{e.kv_head}] + b_V for every token j "
        f"-> k, v [{len(e.tokens)}, {dh}]"
    )
    t = Table(title=f"3. scores q.k_j / sqrt({dh}) and the softmax over the {len(e.tokens)} tokens")
    for col in ("j", "token", "|k_j|", "score", "softmax", ""):
        t.add_column(col, justify="left" if col in ("token", "") else "right")
    for j, token in enumerate(e.tokens):
        s = e.scores[j]
        p = e.pattern[j]
        style = "bold" if j == e.top[0].index else ""
        t.add_row(
            str(j),
            token + (" <- query" if j == e.token_index else ""),
            f"{_norm(e.k[j]):.2f}",
            "masked" if s is None else f"{s:+.3f}",
            f"{p:.4f}",
            _bar(p),
            style=style,
        )
    c.print(t)
    c.print("   top attended: " + ", ".join(f"[bold]{a.token}[/] {a.weight:.3f}" for a in e.top[:3]))
    c.print(
        f"4. z = sum_j softmax_j v_j                         [{dh}]   |z| = {_norm(e.z):.3f}  {_vec(e.z)}"
    )
    c.print(
        f"5. concat of the {e.n_heads} heads' z for this token    [{e.n_heads} x {dh} = {e.n_heads * dh}]"
        f"  {_vec(e.concat)}"
    )
    c.print(
        f"6. out = concat W_O + b_O   W_O: [{e.n_heads * dh}, {dm}]  -> out [{dm}]  "
        f"|out| = {_norm(e.out):.3f}  {_vec(e.out)}"
    )
    t = Table(title=f"7. how W_O weighs the heads of layer {L} for '{tok}' (share of sum_h |z_h W_O\\[h]|)")
    for col in ("head", "|z_h W_O\\[h]|", "share", ""):
        t.add_column(col, justify="left" if col == "" else "right")
    order = sorted(range(e.n_heads), key=lambda h: -e.head_shares[h])
    for h in order:
        t.add_row(
            f"{h}{' *' if h == H else ''}",
            f"{e.head_contributions[h]:.3f}",
            f"{e.head_shares[h]:.3f}",
            _bar(e.head_shares[h] * 2),
        )
    c.print(t)


def explain_pictures(e: Explanation, pretrained: Any, out: Path) -> list[Path]:
    """PNG pictures of an explanation: the head's pattern, the token's row, q/k/v/z cells, W_O shares."""
    import torch

    from .explain import record, tokenize_one
    from .viz import plots

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


def _json_out(data: Any) -> None:
    click.echo(json.dumps(data, allow_nan=False, default=lambda o: None))


def _clean(x: Any) -> Any:
    """Replace NaN/Inf by None, recursively, for strict JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


model_option = click.option(
    "--model",
    "model_spec",
    default="minilm",
    show_default=True,
    help="'minilm' (bundled all-MiniLM-L6-v2) or a folder with a Hugging Face BERT/GPT-2 checkpoint.",
)
json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print the numbers as JSON instead of tables."
)
out_option = click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder for PNG pictures (created if needed).",
)


def _check_range(name: str, value: int | None, n: int) -> None:
    if value is not None and not 0 <= value < n:
        raise UsageError(f"{name} {value} is out of range: valid {name}s are 0..{n - 1}")


@click.command("explain")
@click.argument("sentence", required=False, default=DEFAULT_SENTENCE)
@click.option(
    "--token",
    default=DEFAULT_TOKEN,
    show_default=True,
    help="The token to follow (a token of the sentence, or its index).",
)
@click.option("--layer", type=int, default=None, help="Layer to explain (default: the best-ranked head's).")
@click.option(
    "--head", type=int, default=None, help="Head to explain (default: ranked by where the token attends)."
)
@click.option(
    "--top", "top_heads", type=int, default=5, show_default=True, help="How many ranked heads to show."
)
@model_option
@out_option
@json_option
def explain_cmd(
    sentence: str,
    token: str,
    layer: int | None,
    head: int | None,
    top_heads: int,
    model_spec: str,
    out_dir: Path | None,
    as_json: bool,
) -> None:
    """Walk one token through one head: x -> q, k, v -> scores -> softmax -> z -> concat -> W_O -> out."""
    pretrained = load_model(model_spec)
    cfg = pretrained.model.config
    _check_range("layer", layer, cfg.n_layers)
    _check_range("head", head, cfg.n_heads)
    from .explain import find_token, token_strings

    tokens = token_strings(pretrained, sentence)
    tok: str | int = int(token) if token.isdigit() and token not in tokens else token
    try:
        find_token(tokens, tok)
        e = explain(pretrained, sentence, tok, layer=layer, head=head, model_name=model_spec)
    except ValueError as err:
        raise UsageError(str(err)) from None
    pictures = explain_pictures(e, pretrained, out_dir) if out_dir is not None else []
    if as_json:
        d = e.to_dict()
        d["ranking"] = d["ranking"][: max(top_heads, 0)] if top_heads >= 0 else d["ranking"]
        d["pictures"] = [str(p) for p in pictures]
        _json_out(_clean(d))
        return
    render_explanation(e, top_heads=top_heads)
    for p in pictures:
        click.echo(f"wrote {p}")


def _read_sentences(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read sentences file {path}: {e.__class__.__name__}: {e}") from None
    sentences = [line.strip() for line in text.splitlines() if line.strip()]
    if not sentences:
        raise UsageError(f"sentences file {path} holds no sentence (one sentence per line expected)")
    return sentences


@click.command("heads")
@click.argument("sentence", required=False, default=None)
@click.option(
    "--sentences",
    "sentences_file",
    type=click.Path(path_type=Path),
    default=None,
    help="A UTF-8 text file with one sentence per line.",
)
@click.option(
    "--threshold", type=float, default=None, help="Role-label threshold (default: the analysis default)."
)
@click.option(
    "--mode",
    type=click.Choice(["zero", "mean"]),
    default="zero",
    show_default=True,
    help="Ablation for importance.",
)
@click.option("--no-importance", is_flag=True, help="Skip the ablation importance (one forward per head).")
@model_option
@out_option
@json_option
def heads_cmd(
    sentence: str | None,
    sentences_file: Path | None,
    threshold: float | None,
    mode: str,
    no_importance: bool,
    model_spec: str,
    out_dir: Path | None,
    as_json: bool,
) -> None:
    """The layer x head table: role, entropy, importance and W_O weight of every head."""
    if sentence is not None and sentences_file is not None:
        raise UsageError("give either SENTENCE or --sentences FILE, not both")
    sentences = (
        _read_sentences(sentences_file) if sentences_file is not None else [sentence or DEFAULT_SENTENCE]
    )
    pretrained = load_model(model_spec)
    from .analysis import head_importance, head_roles, wo_norms

    kw = {} if threshold is None else {"threshold": threshold}
    try:
        roles = head_roles(pretrained, sentences, **kw)
        importance = (
            None if no_importance else head_importance(pretrained, sentences, mode=mode, progress=not as_json)
        )
    except ValueError as err:
        raise UsageError(str(err)) from None
    norms = wo_norms(pretrained)
    pictures = []
    if out_dir is not None:
        pictures.append(_pattern_grid(pretrained, sentences[0], out_dir))
    if as_json:
        _json_out(
            _clean(
                {
                    "model": model_spec,
                    "sentences": sentences,
                    "roles": roles.to_dict(),
                    "importance": None if importance is None else importance.to_dict(),
                    "wo_norm": norms.tolist(),
                    "pictures": [str(p) for p in pictures],
                }
            )
        )
        return
    from rich.table import Table

    t = Table(
        title=f"{model_spec}: every head over {len(sentences)} sentence(s) (role threshold {roles.threshold})"
    )
    for col in (
        "layer",
        "head",
        "role",
        "prev",
        "self",
        "next",
        "first",
        "last",
        "entropy",
        "importance",
        "|W_O[h]|",
    ):
        t.add_column(col, justify="left" if col == "role" else "right")
    n_layers, max_heads = norms.shape
    for layer in range(n_layers):
        for h in range(max_heads):
            if math.isnan(float(norms[layer, h])):
                continue
            imp = "-" if importance is None else f"{float(importance.scores[layer, h]):.4f}"
            t.add_row(
                str(layer),
                str(h),
                roles.labels[layer][h],
                *(
                    f"{float(roles.mass(k)[layer, h]):.2f}"
                    for k in ("previous", "current", "next", "first", "last")
                ),
                f"{float(roles.entropy[layer, h]):.2f}",
                imp,
                f"{float(norms[layer, h]):.2f}",
                end_section=h == max_heads - 1,
            )
    _console().print(t)
    for p in pictures:
        click.echo(f"wrote {p}")


def _pattern_grid(pretrained: Any, sentence: str, out: Path) -> Path:
    import torch

    from .explain import record, token_strings, tokenize_one
    from .viz import plots

    ids, pad = tokenize_one(pretrained, sentence)
    model = pretrained.model

    def run() -> None:
        with torch.inference_mode():
            model(ids) if pad is None else model(ids, pad)

    patterns = [p[0] for p in record(model, run)["pattern"]]  # each (n_heads, seq, seq)
    return plots.plot_pattern_grid(
        patterns,
        token_strings(pretrained, sentence),
        out / "heads_patterns.png",
        title=f"every head's pattern: {sentence[:60]}",
    )


@click.command("subspaces")
@click.option("--layer", type=int, default=None, help="One layer (default: all).")
@click.option(
    "--which",
    type=click.Choice(["q", "k", "v", "o"]),
    default="q",
    show_default=True,
    help="Which subspaces: the column spaces of W_Q, W_K, W_V or W_O^T.",
)
@model_option
@out_option
@json_option
def subspaces_cmd(
    layer: int | None, which: str, model_spec: str, out_dir: Path | None, as_json: bool
) -> None:
    """Head x head subspace overlap per layer beside the random baseline, and the QK/OV spectra."""
    pretrained = load_model(model_spec)
    _check_range("layer", layer, pretrained.model.config.n_layers)
    from .analysis import circuit_spectra, subspace_overlaps
    from .viz import plots

    ov = subspace_overlaps(pretrained, which)
    spectra = circuit_spectra(pretrained)
    layers = range(ov.overlap.shape[0]) if layer is None else [layer]
    pictures = []
    if out_dir is not None:
        for i in layers:
            pictures.append(
                plots.plot_overlap(
                    ov.overlap[i],
                    out_dir / f"subspaces_L{i}_{which}.png",
                    baseline=float(ov.random_expected[i]),
                    title=f"layer {i}: overlap of the heads' W_{which.upper()} subspaces",
                    label="mean cos^2 of principal angles",
                )
            )
            n = spectra.qk_singular_values.shape[1]
            pictures.append(
                plots.plot_spectra(
                    [*spectra.qk_singular_values[i], *spectra.ov_singular_values[i]],
                    out_dir / f"subspaces_L{i}_spectra.png",
                    title=f"layer {i}: QK and OV circuit singular values",
                    labels=[f"QK H{h}" for h in range(n)] + [f"OV H{h}" for h in range(n)],
                )
            )
    if as_json:
        data = {"model": model_spec, "which": which, "layers": []}
        for i in layers:
            data["layers"].append(
                {
                    "layer": i,
                    "overlap": ov.overlap[i].tolist(),
                    "random_expected": float(ov.random_expected[i]),
                    "mean_offdiag": float(ov.mean_offdiag[i]),
                    "qk_singular_values": spectra.qk_singular_values[i].tolist(),
                    "ov_singular_values": spectra.ov_singular_values[i].tolist(),
                    "qk_effective_rank": spectra.qk_effective_rank[i].tolist(),
                    "ov_effective_rank": spectra.ov_effective_rank[i].tolist(),
                }
            )
        data["pictures"] = [str(p) for p in pictures]
        _json_out(_clean(data))
        return
    from rich.table import Table

    c = _console()
    t = Table(
        title=f"{model_spec}: W_{which.upper()} subspace overlap between heads "
        "(1 = same subspace, 0 = orthogonal)"
    )
    for col in (
        "layer",
        "mean overlap (distinct heads)",
        "random baseline",
        "max pair",
        "QK eff. rank",
        "OV eff. rank",
    ):
        t.add_column(col, justify="right")
    for i in layers:
        m = ov.overlap[i].clone()
        n = m.shape[0]
        m.fill_diagonal_(float("nan"))
        flat = int(m.nan_to_num(-1).argmax())
        a, b = divmod(flat, n)
        t.add_row(
            str(i),
            f"{float(ov.mean_offdiag[i]):.3f}",
            f"{float(ov.random_expected[i]):.3f}",
            f"H{a}-H{b} {float(m[a, b]):.3f}",
            f"{float(spectra.qk_effective_rank[i].nanmean()):.1f}",
            f"{float(spectra.ov_effective_rank[i].nanmean()):.1f}",
        )
    c.print(t)
    for p in pictures:
        click.echo(f"wrote {p}")


@click.command("bench")
@click.option("--seq", "seqs", type=int, multiple=True, help="Sequence length(s); repeat the option.")
@click.option("--batch", type=int, default=8, show_default=True)
@click.option("--repeats", type=int, default=None, help="Timed steps per case (default: by size).")
@click.option("--quick", is_flag=True, help="3 repeats and no memory measurement.")
@click.option("--no-memory", is_flag=True, help="Skip the peak-memory subprocesses.")
@json_option
def bench_cmd(
    seqs: tuple[int, ...], batch: int, repeats: int | None, quick: bool, no_memory: bool, as_json: bool
) -> None:
    """Run the attention benchmark (headspace vs torch MHA, nanoGPT-style, textbook, GEMM floor)."""
    from . import bench

    for name, values in (("--seq", seqs), ("--batch", (batch,)), ("--repeats", (repeats or 1,))):
        for v in values:
            if v <= 0:
                raise UsageError(f"{name} must be a positive integer; got {v}")
    kwargs: dict[str, Any] = {"batch": batch, "progress": not as_json}
    if seqs:
        kwargs["seqs"] = tuple(seqs)
    if quick:
        kwargs["repeats"] = 3
        kwargs["measure_memory"] = False
    if repeats is not None:
        kwargs["repeats"] = repeats
    if no_memory:
        kwargs["measure_memory"] = False
    rows = bench.run_attention_benchmark(**kwargs)
    if as_json:
        _json_out(_clean(rows))
    else:
        click.echo(bench.format_table(rows))


COMMANDS = (explain_cmd, heads_cmd, subspaces_cmd, bench_cmd)
