"""The lesson's commands: ``headspace explain``, ``heads`` and ``subspaces``.

Each prints a rich terminal layout (tables, aligned numbers), writes PNG pictures to ``--out`` and, with
``--json``, prints the same numbers as the Python API instead. User errors are one line, exit code 2.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..core.defaults import (
    DECODER_OCCURRENCE,
    DECODER_PARAGRAPH,
    DECODER_SENTENCE,
    DECODER_TOKEN,
    DEFAULT_SENTENCE,
    DEFAULT_TOKEN,
    is_decoder,
)
from ..core.errors import UsageError
from .errors import read_input_file, reported
from .explain_encdec import ENCDEC_TARGET_HELP, explain_encoder_decoder, is_encoder_decoder
from .loader import at_precision, encoder_decoders_allowed, load_model
from .options import (
    TOKENS_HELP,
    choice_option,
    json_option,
    model_option,
    out_option,
    positive_int,
    precision_option,
)
from .output import check_writable_folder, clean, json_out, more_note
from .render import (
    console,
    explain_pictures,
    pattern_grid,
    piece_display,
    readable_explanation,
    render_explanation,
)
from .render_delta import delta_pictures, render_delta_explanation
from .shape import check_before_loading, check_loaded_shape

if TYPE_CHECKING:
    from rich.table import Table

    from ..analysis import CircuitSpectra, RotaryPlanes, SubspaceOverlaps

#: The largest --sentences file read (bytes): far more text than a head table needs.
MAX_SENTENCES_BYTES = 16 * 1024 * 1024


def _check_occurrence(tokens: Sequence[str], tok: str | int, occurrence: int | None) -> None:
    """``--occurrence N`` needs ``--token`` as text that occurs at least N times (one line, exit 2)."""
    if occurrence is None:
        return
    if not isinstance(tok, str):
        raise UsageError(f"--occurrence needs --token as text; --token {tok} is already one position")
    from ..analysis.lesson.explain import token_occurrences

    found = token_occurrences(tokens, tok)
    if found and occurrence > len(found):
        where = ", ".join(f"{n} at position {i}" for n, i in enumerate(found, start=1))
        raise UsageError(
            f"--occurrence {occurrence} of {tok!r} is out of range: it occurs {len(found)} time(s) "
            f"({where}); valid occurrences are 1..{len(found)}"
        )


def _check_sentence(sentence: str | None) -> None:
    """A SENTENCE given must hold a word (an empty one was read as a sentence without the token)."""
    if sentence is not None and not sentence.strip():
        raise UsageError(
            f"SENTENCE is empty ({sentence!r}); give at least one word (or leave it out for the default "
            "sentence)"
        )


@click.command("explain", epilog=TOKENS_HELP)
@click.argument("sentence", required=False, default=None)
@click.option(
    "--token",
    default=None,
    help=(
        "The token to follow (a token of the sentence, or its index). Default: an encoder follows "
        f"'{DEFAULT_TOKEN}'; a decoder its last token (without SENTENCE: the second '{DECODER_TOKEN}' of "
        f"'{DECODER_SENTENCE}')."
    ),
)
@click.option("--layer", type=int, default=None, help="Layer to explain (default: the best-ranked head's).")
@click.option(
    "--head", type=int, default=None, help="Head to explain (default: the best-ranked relational head)."
)
@click.option(
    "--occurrence",
    type=int,
    default=None,
    callback=positive_int,
    help="Which occurrence of --token to follow when it appears several times (1 = the first).",
)
@click.option(
    "--top",
    "top_heads",
    type=int,
    default=5,
    show_default=True,
    callback=positive_int,
    help="How many ranked heads to show per group (relational, positional); at least 1.",
)
@click.option("--target", default=None, help=ENCDEC_TARGET_HELP)
@model_option
@precision_option
@out_option
@json_option
def explain_cmd(
    sentence: str | None,
    token: str | None,
    layer: int | None,
    head: int | None,
    occurrence: int | None,
    top_heads: int,
    target: str | None,
    model_spec: str,
    model_precision: str,
    out_dir: Path | None,
    as_json: bool,
) -> None:
    """Walk one token through one head: x -> q, k, v -> scores -> softmax -> z -> concat -> W_O -> out.

    Without SENTENCE an encoder reads the coreference sentence (and follows "it"), a decoder a repeated
    phrase (and follows its last token, where the copying heads look back). An encoder-decoder (T5,
    BART, Marian with a tokenizer; whisper-base with SPEECH.WAV) walks one output token through one
    cross-attention head instead (--token: an output token or its index; --out: its pattern as a PNG)."""
    _check_sentence(sentence)
    if token is not None and not token.strip():
        raise UsageError(f"--token is empty ({token!r}); give a token of the sentence or its index")
    if out_dir is not None:
        check_writable_folder(out_dir)
    check_before_loading(model_spec, layer, head)
    with encoder_decoders_allowed():
        pretrained = load_model(model_spec)
    if is_encoder_decoder(pretrained):
        return explain_encoder_decoder(
            pretrained, model_spec, sentence, token=token, layer=layer, head=head, target=target,
            precision=model_precision, out_dir=out_dir, as_json=as_json,
        )  # fmt: skip
    if target is not None:
        raise UsageError(f"--target: only for encoder-decoders; --model {model_spec} is not one")
    pretrained = at_precision(pretrained, model_precision)
    from ..analysis.lesson.delta_walk import delta_layer, is_delta_walk

    check_loaded_shape(pretrained, layer, None if delta_layer(pretrained.model, layer) else head)  # own heads
    from ..analysis.lesson.explain import explain, tokenize_sentence

    decoder = is_decoder(pretrained)
    if sentence is None:
        sentence = DECODER_SENTENCE if decoder else DEFAULT_SENTENCE
        if decoder and token is None and occurrence is None:
            token, occurrence = DECODER_TOKEN, DECODER_OCCURRENCE
    tokenized = tokenize_sentence(pretrained, sentence)  # the command's one tokenization
    tokens = tokenized.tokens
    if token is None:  # an encoder follows "it"; a decoder its last token, which sees the whole text
        token = str(len(tokens) - 1) if decoder else DEFAULT_TOKEN
    tok: str | int = int(token) if token.isdigit() and token not in tokens else token
    _check_occurrence(tokens, tok, occurrence)
    e = explain(
        pretrained,
        sentence,
        tok,
        layer=layer,
        head=head,
        model_name=model_spec,
        occurrence=occurrence,
        tokenized=tokenized,
    )
    shown = readable_explanation(e, piece_display(pretrained))  # "Ġcat" -> "␣cat"; the JSON keeps "Ġcat"
    delta = is_delta_walk(e)  # a Gated DeltaNet head: the delta rule's walk (render_delta)
    pictures: list[Path] = []
    if out_dir is not None:
        pictures = delta_pictures(shown, out_dir) if delta else explain_pictures(shown, pretrained, out_dir)
    if as_json:
        d = e.to_dict(top=top_heads)
        d["pictures"] = [str(p) for p in pictures]
        json_out(clean(d))
        return
    (render_delta_explanation if delta else render_explanation)(shown, top_heads=top_heads)
    for p in pictures:
        click.echo(f"wrote {p}")


def _read_sentences(path: Path) -> list[str]:
    """The non-empty lines of a UTF-8 file: a regular file of at most :data:`MAX_SENTENCES_BYTES`."""
    data = read_input_file(path, "--sentences", "sentences file", MAX_SENTENCES_BYTES)
    with reported(f"cannot read sentences file {path}"):
        text = data.decode("utf-8")
    sentences = [line.strip() for line in text.splitlines() if line.strip()]
    if not sentences:
        raise UsageError(f"sentences file {path} holds no sentence (one sentence per line expected)")
    return sentences


@click.command("heads", epilog=TOKENS_HELP)
@click.argument("sentence", required=False, default=None)
@click.option(
    "--sentences",
    "sentences_file",
    type=click.Path(path_type=Path),
    default=None,
    help="A UTF-8 text file with one sentence per line (a regular file of at most 16 MB).",
)
@click.option(
    "--threshold", type=float, default=None, help="Role-label threshold (default: the analysis default)."
)
@choice_option("--mode", choices=["zero", "mean"], default="zero", help="Ablation for importance.")
@click.option("--no-importance", is_flag=True, help="Skip the ablation importance (one forward per head).")
@model_option
@precision_option
@out_option
@json_option
def heads_cmd(
    sentence: str | None,
    sentences_file: Path | None,
    threshold: float | None,
    mode: str,
    no_importance: bool,
    model_spec: str,
    model_precision: str,
    out_dir: Path | None,
    as_json: bool,
) -> None:
    """The layer x head table: role, entropy, importance and W_O weight of every head (a decoder's also
    with its induction score: its attention, on a repeated random sequence, to the token after the current
    token's first occurrence; heads scoring at least the threshold are labelled induction)."""
    if sentence is not None and sentences_file is not None:
        raise UsageError("give either SENTENCE or --sentences FILE, not both")
    _check_sentence(sentence)
    if out_dir is not None:
        check_writable_folder(out_dir)
    sentences = (
        _read_sentences(sentences_file) if sentences_file is not None else [sentence or DEFAULT_SENTENCE]
    )
    pretrained = at_precision(load_model(model_spec), model_precision)
    from ..analysis import head_importance, head_roles, wo_norms

    kw: dict[str, Any] = {} if threshold is None else {"threshold": threshold}
    # a decoder's heads also get the induction score (repeated random tokens: where copying heads look)
    roles = head_roles(pretrained, sentences, induction=_induction(pretrained), **kw)
    importance = (
        None if no_importance else head_importance(pretrained, sentences, mode=mode, progress=not as_json)
    )
    norms = wo_norms(pretrained)
    pictures = []
    if out_dir is not None:
        pictures.append(pattern_grid(pretrained, sentences[0], out_dir))
    if as_json:
        json_out(
            clean(
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
    console().print(_heads_table(model_spec, len(sentences), roles, importance, norms))
    for line in heads_legend(sentences, roles, importance):
        click.echo(line)
    for p in pictures:
        click.echo(f"wrote {p}")


#: The sentences ``heads`` names under its table (the rest are counted; --json lists them all).
SHOWN_SENTENCES = 3


def _induction(pretrained: Any) -> Any:
    """A decoder's induction scores [n_layers, n_heads] (:func:`headspace.analysis.induction_scores`),
    ``n`` tokens per copy: the default, or as many as fit a shorter ``max_seq_len`` (two copies after a
    BOS: ``(max_seq_len - 1) // 2``); False for an encoder (no induction column)."""
    if not is_decoder(pretrained):
        return False
    from ..analysis import induction_scores
    from ..analysis.lesson.roles import DEFAULT_INDUCTION_N

    max_len = getattr(pretrained.model.config, "max_seq_len", None)
    fits = (max_len - 1) // 2 if isinstance(max_len, int) and max_len >= 3 else DEFAULT_INDUCTION_N
    return induction_scores(pretrained, n=min(DEFAULT_INDUCTION_N, fits))


def heads_legend(sentences: Sequence[str], roles: Any, importance: Any) -> list[str]:
    """The lines under the ``heads`` table: the sentences measured on, and what each column means."""
    shown = [s if len(s) <= 70 else s[:67] + "..." for s in sentences[:SHOWN_SENTENCES]]
    cut = more_note(len(sentences), len(shown), "with --json")
    lines = [f"measured on {len(sentences)} sentence(s){cut}:", *(f"  {s!r}" for s in shown)]
    lines += [
        "columns, each a mean over the real query tokens of the sentences:",
        "  prev, self, next, first, last: the attention weight on the token just before the query, the",
        "    query itself, the token just after it, the first token ([CLS] / BOS), the last ([SEP] / EOS)",
        "  entropy: of the query's attention pattern, in nats (0 = all on one key, log n = even over n)",
        f"  role: the largest of those five weights if it is at least {roles.threshold}, else mixed",
    ]
    if roles.induction is not None:
        lines += [
            "  induction: on random tokens repeated twice (not the sentences), the weight from each token",
            "    of the second copy to the token after its first occurrence; at least the threshold: role",
            "    induction",
        ]
    if importance is None:
        lines.append("  importance: not measured (--no-importance)")
    else:
        change = "1 - the mean cosine of the sentence embeddings" if importance.metric == "cosine" else (
            "the increase of the next-token loss" if importance.metric == "loss" else importance.metric
        )  # fmt: skip
        lines += [
            f"  importance: {change} when the head's z is {importance.mode}-ablated",
            "    (larger: the head matters more)",
        ]
    lines.append("  |W_O[h]|: the Frobenius norm of the head's block of W_O (no input: the weights alone)")
    return lines


def _heads_table(model_spec: str, n_sentences: int, roles: Any, importance: Any, norms: Any) -> Any:
    """The rich table of ``headspace heads``: a row per head (layers apart), its role, attention masses,
    entropy, induction score (decoders), importance (None: skipped) and ``|W_O[h]|``."""
    from rich.table import Table

    t = Table(
        title=f"{model_spec}: every head over {n_sentences} sentence(s) (role threshold {roles.threshold})"
    )
    columns = ["layer", "head", "role", "prev", "self", "next", "first", "last", "entropy"]
    columns += ["induction"] if roles.induction is not None else []
    for col in (*columns, "importance", "|W_O\\[h]|"):  # escaped: rich read "[h]" as markup and hid it
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
                *([] if roles.induction is None else [f"{float(roles.induction[layer, h]):.2f}"]),
                imp,
                f"{float(norms[layer, h]):.2f}",
                end_section=h == max_heads - 1,
            )
    return t


@click.command("subspaces")
@click.option("--layer", type=int, default=None, help="One layer (default: all).")
@choice_option(
    "--which",
    choices=["q", "k", "v", "o"],
    default="q",
    help="Which subspaces: the column spaces of W_Q, W_K, W_V or W_O^T.",
)
@model_option
@precision_option
@out_option
@json_option
def subspaces_cmd(
    layer: int | None, which: str, model_spec: str, model_precision: str, out_dir: Path | None, as_json: bool
) -> None:
    """Head x head subspace overlap per layer beside the random baseline, and the QK/OV spectra."""
    if out_dir is not None:
        check_writable_folder(out_dir)
    check_before_loading(model_spec, layer)
    pretrained = at_precision(load_model(model_spec), model_precision)
    check_loaded_shape(pretrained, layer)
    from ..analysis import circuit_spectra, subspace_overlaps

    ov = subspace_overlaps(pretrained, which)
    spectra = circuit_spectra(pretrained)
    planes = None
    if getattr(pretrained.model, "rotary", None) is not None:  # RoPE: scores by frequency plane, on text
        from ..analysis import rotary_planes

        planes = rotary_planes(pretrained, [DECODER_PARAGRAPH])
    layers = range(ov.overlap.shape[0]) if layer is None else [layer]
    pictures = [] if out_dir is None else _subspace_pictures(out_dir, layers, which, ov, spectra, planes)
    if as_json:
        data = _subspaces_json(model_spec, layers, which, ov, spectra, planes)
        data["pictures"] = [str(p) for p in pictures]
        json_out(clean(data))
        return
    c = console()
    c.print(_subspaces_table(model_spec, layers, which, ov, spectra))
    if planes is not None:
        c.print(_rotary_table(planes, layers, model_spec))
    for p in pictures:
        click.echo(f"wrote {p}")


def _subspace_pictures(
    out_dir: Path,
    layers: Sequence[int],
    which: str,
    ov: SubspaceOverlaps,
    spectra: CircuitSpectra,
    planes: RotaryPlanes | None,
) -> list[Path]:
    """``subspaces --out``: per layer, its rotary planes (RoPE models), the overlap matrix and the QK/OV
    spectra as PNGs in ``out_dir``; returns their paths in that order."""
    from ..viz import plots

    pictures = []
    for i in layers:
        if planes is not None:
            pictures.append(
                plots.plot_rotary_planes(
                    planes.share[i],
                    planes.wavelengths[i],
                    out_dir / f"subspaces_L{i}_rotary.png",
                    split=planes.split,
                    title=f"layer {i}: each head's |score| by rotary plane",
                )
            )
        pictures.append(
            plots.plot_overlap(
                ov.overlap[i],
                out_dir / f"subspaces_L{i}_{which}.png",
                baseline=float(ov.random_expected[i]),
                title=f"layer {i}: overlap of the heads' W_{which.upper()} subspaces",
                label="mean cos^2 of principal angles",
            )
        )
        qk_rank, ov_rank = spectra.qk_effective_rank[i], spectra.ov_effective_rank[i]
        pictures.append(
            plots.plot_circuit_spectra(
                spectra.qk_singular_values[i],
                spectra.ov_singular_values[i],
                out_dir / f"subspaces_L{i}_spectra.png",
                title=f"layer {i}: singular values of each head's QK and OV circuits",
                head_labels=[
                    f"H{h}  eff. rank QK {float(a):.1f}, OV {float(b):.1f}"
                    for h, (a, b) in enumerate(zip(qk_rank, ov_rank))
                ],
            )
        )
    return pictures


def _subspaces_json(
    model_spec: str,
    layers: Sequence[int],
    which: str,
    ov: SubspaceOverlaps,
    spectra: CircuitSpectra,
    planes: RotaryPlanes | None,
) -> dict[str, Any]:
    """``subspaces --json`` (before ``pictures``): per layer the overlap matrix, its random baseline and
    off-diagonal mean, the QK/OV singular values and effective ranks; ``rotary_planes`` for RoPE models."""
    data: dict[str, Any] = {"model": model_spec, "which": which, "layers": []}
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
    if planes is not None:
        data["rotary_planes"] = _rotary_json(planes, layers)
    return data


def _subspaces_table(
    model_spec: str, layers: Sequence[int], which: str, ov: SubspaceOverlaps, spectra: CircuitSpectra
) -> Table:
    """The ``subspaces`` table: per layer the mean overlap of distinct heads, the random baseline, the
    most overlapping pair of heads, and the mean QK/OV effective ranks."""
    from rich.table import Table

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
        m = ov.overlap[i].clone()  # (n_heads, n_heads)
        n = m.shape[0]
        m.fill_diagonal_(float("nan"))
        flat = int(m.nan_to_num(-1).argmax())
        a, b = divmod(flat, n)
        pair = f"H{a}-H{b} {float(m[a, b]):.3f}"
        if m.isnan().all():  # one key/value head (Gemma 3's --which k or v), or one head left: no pair
            heads = int((~ov.overlap[i].diagonal().isnan()).sum())
            pair = f"- ({heads} {'head' if heads == 1 else 'heads'})"
        t.add_row(
            str(i),
            "-" if math.isnan(float(ov.mean_offdiag[i])) else f"{float(ov.mean_offdiag[i]):.3f}",
            f"{float(ov.random_expected[i]):.3f}",
            pair,
            f"{float(spectra.qk_effective_rank[i].nanmean()):.1f}",
            f"{float(spectra.ov_effective_rank[i].nanmean()):.1f}",
        )
    return t


def _rotary_json(planes: Any, layers: Any) -> dict[str, Any]:
    """The ``rotary_planes`` field of ``subspaces --json``: per layer and head, the shares by plane."""
    return {
        "text": DECODER_PARAGRAPH,
        "split_tokens": planes.split,
        "threshold": planes.threshold,
        "n_pairs": planes.n_pairs,
        "layers": [
            {
                "layer": i,
                "wavelengths": planes.wavelengths[i].tolist(),
                "share": planes.share[i].tolist(),
                "passthrough": planes.passthrough[i].tolist(),
                "slow": planes.slow[i].tolist(),
                "fast": planes.fast[i].tolist(),
                "labels": planes.labels[i],
            }
            for i in layers
        ],
    }


def _rotary_table(planes: Any, layers: Any, model_spec: str) -> Any:
    """Per layer: each head's fast-plane share (position) with its label, and the head leaning most on
    position."""
    from rich.table import Table

    t = Table(
        title=f"{model_spec}: rotary planes, each head's share of |score| on the fast planes (wavelength <= "
        f"{planes.split:g} tokens, the text's length: position) against the slow ones (content); "
        f"c = content, p = position, m = mixed (threshold {planes.threshold:g})"
    )
    for col in ("layer", "fast share per head (label)", "most positional head", "its top fast plane"):
        t.add_column(col, justify="right" if col == "layer" else "left")
    for i in layers:
        fast = planes.fast[i]
        labels = planes.labels[i]
        cells = [f"H{h} {v:.2f}{labels[h][0]}" for h, v in enumerate(fast.tolist()) if math.isfinite(v)]
        h = int(fast.nan_to_num(-1).argmax())
        waves = planes.wavelengths[i]  # (n_planes,)
        fast_share = planes.share[i, h].nan_to_num(-1).masked_fill(waves > planes.split, -1)  # (n_planes,)
        top = int(fast_share.argmax())
        top_cell = (
            f"plane {top}: {float(planes.share[i, h, top]):.2f} of |score|, "
            f"{float(waves[top]):.3g} tokens per turn"
            if float(fast_share[top]) >= 0
            else "no fast plane"
        )
        t.add_row(str(i), " ".join(cells), f"H{h} ({float(fast[h]):.2f})", top_cell)
    return t


COMMANDS = (explain_cmd, heads_cmd, subspaces_cmd)
