"""``headspace patch`` and ``headspace attribute``: which heads cause the answer, from the command line.

``patch`` runs activation patching (:func:`headspace.analysis.patching.patch`) of a clean prompt into a
corrupt one and prints the top sites (``--method atp`` / ``atp*``: the estimates of attribution patching
and of AtP*, :mod:`headspace.analysis.atp_star`, instead of the patched runs); ``attribute`` prints the
logit lens and the heads and MLPs that write the answer directly (:mod:`headspace.analysis.attribution`).
Both write pictures to ``--out`` and the same numbers as JSON with ``--json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from ..core.errors import UsageError
from .answers import warn_if_not_continuation
from .encdec_inputs import is_encdec_spec, refuse_target, target_option
from .loader import at_precision, load_model
from .options import (
    TOKENS_HELP,
    checked_memory,
    choice_option,
    decoder_model_option,
    json_option,
    max_memory_option,
    out_option,
    precision_option,
)
from .output import check_writable_folder, clean, json_out, more_note

#: The indirect-object prompt pair of the README's worked example.
DEFAULT_CLEAN = "When Mary and John went to the store, John gave a drink to"
DEFAULT_CORRUPT = "When Mary and John went to the store, Mary gave a drink to"
#: ``headspace patch --method``
PATCH_METHODS = ("exact", "atp", "atp*")
_STAR_SITES = ("heads", "heads_pos", "mlp", "queries", "keys")


def _check_distinct(clean_text: str | None, corrupt_text: str | None, answer: str, other: str | None) -> None:
    """Refuse, before the model loads, a prompt pair or an answer pair that would measure nothing (the
    analysis refuses the same after tokenization too, e.g. two spellings of one token)."""
    if clean_text is not None and clean_text == corrupt_text:
        raise UsageError(
            f"--clean and --corrupt are the same prompt ({clean_text!r}): patching one into the other "
            "changes nothing and every effect would be 0; give a corrupt prompt that differs (e.g. one name "
            "swapped)"
        )
    if other is not None and answer == other:
        raise UsageError(
            f"--answer and --other are the same token ({answer!r}): logit(answer) - logit(other) is then 0 "
            "in every run; give two different tokens (e.g. --answer ' Mary' --other ' John')"
        )


def _shown(text: str | None) -> str:
    """A token's text in quotes as the command line prints tokens (a space as ␣: options.TOKENS_HELP)."""
    from ..pretrained.tokenization import readable_token

    return "none" if text is None else f"'{readable_token(text)}'"


def _site_name(axes: tuple[str, ...], index: tuple[int, ...], tokens: list[str] | None) -> str:
    parts = []
    for axis, i in zip(axes, index):
        if axis == "position" and tokens is not None:
            parts.append(f"pos {i} {_shown(tokens[i])}")
        else:
            parts.append(f"{axis} {i}")
    return ", ".join(parts)


def _metric_shown(model: Any, name: str, answer: str, other: str) -> str:
    """The metric's name with its tokens as the command line prints them (``logit('␣Mary') - ...``)."""
    from ..analysis.causal.causal_inputs import is_decoder, stack_of, token_id, token_str

    if not is_decoder(stack_of(model, "patch")):  # an encoder's metric names no token
        return name
    a, b = (token_str(model, token_id(model, t)) for t in (answer, other))
    return f"logit({_shown(a)}) - logit({_shown(b)})"


@click.command("patch", epilog=TOKENS_HELP)
@click.option("--clean", "clean_text", default=DEFAULT_CLEAN, show_default=True, help="The clean prompt.")
@click.option(
    "--corrupt", "corrupt_text", default=DEFAULT_CORRUPT, show_default=True, help="The corrupt one."
)
@click.option("--answer", default=" Mary", show_default=True, help="The clean answer (one token).")
@click.option("--other", default=" John", show_default=True, help="The competing answer (one token).")
@choice_option(
    "--site",
    choices=["heads", "heads_pos", "resid", "mlp", "queries", "keys"],
    default="heads",
    help="What to patch: each head's z, per position, the residual stream per position, each MLP, each "
    "head's query, each key/value head's key.",
)
@click.option(
    "--method",
    default="exact",
    show_default=True,
    help="exact|atp|atp*. exact: the patched runs; atp: attribution patching's first-order estimate; "
    "atp*: AtP* (exact attention patterns for queries/keys, GradDrop), ranked by its score.",
)
@click.option("--top", type=click.IntRange(1, None), default=10, show_default=True, help="Sites to list.")
@target_option
@decoder_model_option
@precision_option
@out_option
@json_option
@max_memory_option
def patch_cmd(
    clean_text: str, corrupt_text: str, answer: str, other: str, site: str, method: str, top: int,
    target: str | None, model_spec: str, model_precision: str, out_dir: Path | None, as_json: bool,
    max_memory: str | None,
) -> None:  # fmt: skip
    """Activation patching: put each site's clean activation into the corrupt run, read logit(answer) -
    logit(other); 1 = the clean answer restored, 0 = no effect. --method atp / atp* estimate the same
    effects from gradients (two forwards and one backward; AtP* adds GradDrop's backward passes). On an
    encoder-decoder (--clean/--corrupt WAV files or source sentences) each cross-attention head."""
    _check_distinct(clean_text, corrupt_text, answer, other)
    checked_memory(max_memory)
    _check_method(method, site)
    if out_dir is not None:
        check_writable_folder(out_dir)
    if is_encdec_spec(model_spec):
        from .encdec_commands import patch_encoder_decoder

        return patch_encoder_decoder(
            model_spec, clean_text, corrupt_text, site=site, method=method, target=target, top=top,
            precision=model_precision, out_dir=out_dir, as_json=as_json,
        )  # fmt: skip
    refuse_target(target, model_spec)
    from ..analysis.causal.patching import EFFECT_KEYS

    model = at_precision(load_model(model_spec), model_precision)
    warn_if_not_continuation(model, clean_text, {"--answer": answer, "--other": other})
    r = _patched(model, method, clean_text, corrupt_text, site, answer, other, max_memory)
    pictures = []
    if out_dir is not None:
        from ..viz.causal_plots import plot_patch_effect

        what = "patching" if method == "exact" else f"{method} estimate of patching"
        title = f"{model_spec}: {what} {site} ({r.metric_name})"
        pictures.append(
            plot_patch_effect(
                r.effect, r.axes, Path(out_dir) / f"patch_{site}.png", title=title, tokens=r.tokens
            )
        )
    ranked = r.top(top)
    if as_json:
        data = {
            "site": site,
            # PatchResult's word (the explorer reads it): real patched runs, or an estimate of them
            "method": "activation" if method == "exact" else "attribution",
            "patch_method": method,
            "axes": list(r.axes),
            EFFECT_KEYS.get(site, f"{site}_patch_effect"): r.effect.tolist(),
            "patched_metric": r.patched_metric.tolist(),
            "clean_metric": r.clean_metric,
            "corrupt_metric": r.corrupt_metric,
            "metric": r.metric_name,
            "tokens": r.tokens,
            "first_difference": r.first_difference,
            "top": [{"site": dict(zip(r.axes, idx)), "effect": value} for idx, value in ranked],
            "pictures": [str(p) for p in pictures],
        }
        if getattr(r, "score", None) is not None:
            data["score"] = r.score.tolist()  # AtP*'s ranking (GradDrop's mean |c_l|, metric units)
        json_out(clean(data))
        return
    click.echo(f"clean:   {clean_text!r}\ncorrupt: {corrupt_text!r}")
    metric = _metric_shown(model, r.metric_name, answer, other)
    click.echo(f"metric {metric}: clean {r.clean_metric:+.3f}, corrupt {r.corrupt_metric:+.3f}")
    by = {"exact": "|effect|", "atp": "|estimated effect|", "atp*": "AtP* score (GradDrop)"}[method]
    cut = more_note(r.effect.numel(), len(ranked), "with --top N or --json")
    click.echo(f"top {len(ranked)} sites by {by}{cut} (1 = clean restored, 0 = no effect):")
    for idx, value in ranked:
        click.echo(f"  {_site_name(r.axes, idx, r.tokens):<34} {value:+.3f}")
    for p in pictures:
        click.echo(f"wrote {p}")


def _check_method(method: str, site: str) -> None:
    """Refuse, before the model loads, a site the method does not patch."""
    if method not in PATCH_METHODS:
        raise UsageError(f"--method must be one of {', '.join(PATCH_METHODS)}; got {method!r}")
    if site == "resid" and method == "atp*":
        raise UsageError(
            f"--method atp* patches {', '.join(_STAR_SITES)}; got --site resid (use --method exact or atp)"
        )


@dataclass
class _Shown:
    """What ``patch`` prints of a result: PatchResult's fields, from an AtP* / exact_effects result."""

    axes: tuple[str, ...]
    effect: Any
    patched_metric: Any
    clean_metric: float
    corrupt_metric: float
    metric_name: str
    tokens: list[str] | None
    first_difference: int
    score: Any
    ranked: list[tuple[tuple[int, ...], float]]

    def top(self, k: int) -> list[tuple[tuple[int, ...], float]]:
        return self.ranked[:k]


def _patched(model: Any, method: str, clean_text: str, corrupt_text: str, site: str, answer: str,
             other: str, max_memory: str | None) -> Any:  # fmt: skip
    """The result of ``--method`` on one prompt pair: a PatchResult (exact and atp of patching.py's
    sites) or an :class:`_Shown` of :mod:`..analysis.atp_star`'s (atp*, and queries/keys)."""
    from ..analysis.causal.patching import attribution_patching, patch
    from ..analysis.circuits.atp_star import atp_star, exact_effects

    if site in ("heads", "heads_pos", "resid", "mlp") and method != "atp*":
        fn = patch if method == "exact" else attribution_patching
        return fn(
            model, clean_text, corrupt_text, site=site, answer=answer, other=other, max_memory=max_memory
        )
    from ..analysis.circuits.tasks import make_task

    pair = {"clean": clean_text, "corrupt": corrupt_text, "answer": answer, "other": other}
    task = make_task(model, [pair], name="pair")
    if method == "exact":
        r = exact_effects(model, task, site)
    else:
        r = atp_star(model, task, site, method=method)
    ids = task.clean[0, : int(task.lengths[0])].tolist()
    tokens = [model.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    diff = (task.clean[0] != task.corrupt[0]).nonzero()
    return _Shown(
        axes=r.axes, effect=r.effect, patched_metric=r.estimate + r.corrupt_metric,
        clean_metric=r.clean_metric, corrupt_metric=r.corrupt_metric,
        metric_name=f"logit({answer!r}) - logit({other!r})", tokens=tokens,
        first_difference=int(diff[0, 0]) if len(diff) else len(ids),
        score=r.score if method == "atp*" else None, ranked=r.top(len(r.ranking())),
    )  # fmt: skip


@click.command("attribute", epilog=TOKENS_HELP)
@click.argument("prompt", required=False, default="The capital of France is")
@click.option("--answer", default=" Paris", show_default=True, help="The answer token.")
@click.option("--other", default=None, help="A competing token: attribute the logit difference.")
@click.option("--top", type=click.IntRange(1, None), default=10, show_default=True, help="Parts to list.")
@target_option
@decoder_model_option
@precision_option
@out_option
@json_option
@max_memory_option
def attribute_cmd(
    prompt: str, answer: str, other: str | None, top: int, target: str | None, model_spec: str,
    model_precision: str, out_dir: Path | None, as_json: bool, max_memory: str | None,
) -> None:  # fmt: skip
    """The logit lens of PROMPT and the heads and MLPs that write --answer directly (direct logit
    attribution: the parts add up to the model's logit).

    The answer's rank counts from 1 (1 = the top token), in the table and in --json's answer_rank. On an
    encoder-decoder PROMPT is the source (a sentence, or a WAV file) and --answer an output token."""
    _check_distinct(None, None, answer, other)
    checked_memory(max_memory)
    if out_dir is not None:
        check_writable_folder(out_dir)
    if is_encdec_spec(model_spec):
        from .encdec_commands import attribute_encoder_decoder

        return attribute_encoder_decoder(
            model_spec, prompt, answer=answer, target=target, top=top, precision=model_precision,
            out_dir=out_dir, as_json=as_json,
        )  # fmt: skip
    refuse_target(target, model_spec)
    from ..analysis.causal.attribution import direct_logit_attribution, logit_lens

    model = at_precision(load_model(model_spec), model_precision)
    warn_if_not_continuation(model, prompt, {"--answer": answer, "--other": other})
    dla = direct_logit_attribution(model, prompt, answer, other, max_memory=max_memory)
    lens = logit_lens(model, prompt, answer, top=5, max_memory=max_memory)
    heads = dla.top_heads(top)
    order = dla.mlps.abs().argsort(descending=True)[:top]
    mlps = [(int(i), float(dla.mlps[i])) for i in order]
    pictures = []
    if out_dir is not None:
        from ..viz.causal_plots import plot_attribution

        title = f"{model_spec}: direct attribution of {dla.answer_token!r} after {prompt!r}"
        pictures.append(plot_attribution(dla.heads, dla.mlps, Path(out_dir) / "attribution.png", title=title))
    if as_json:
        data = {
            "prompt": prompt,
            "answer": dla.answer_token,
            "other": dla.other_token,
            "logit": float(dla.logit),
            "total": float(dla.total),
            "embed": float(dla.embed),
            "head_attribution": dla.heads.tolist(),
            "mlp_attribution": dla.mlps.tolist(),
            "attention_bias_attribution": dla.attn_biases.tolist(),
            "norm_bias_attribution": float(dla.norm_bias),
            "top_heads": [{"layer": a, "head": b, "attribution": v} for a, b, v in heads],
            "top_mlps": [{"layer": a, "attribution": v} for a, v in mlps],
            "logit_lens": [_lens_row(lens, i) for i in range(len(lens.top_tokens[0]))],
            "pictures": [str(p) for p in pictures],
        }
        json_out(clean(data))
        return
    what = f"logit({_shown(dla.answer_token)})" + (
        "" if other is None else f" - logit({_shown(dla.other_token)})"
    )
    click.echo(
        f"prompt: {prompt!r}   {what} = {float(dla.logit):+.3f} (parts add up to {float(dla.total):+.3f})"
    )
    click.echo("logit lens (the stream after each layer read through the final norm and W_U):")
    for i, toks in enumerate(lens.top_tokens[0]):
        label = "embed" if i == 0 else f"layer {i - 1}"
        shown = ", ".join(f"{_shown(t)} {float(p):.2f}" for t, p in zip(toks[:3], lens.top_probs[0, i, :3]))
        rank, prob = int(lens.answer_rank[0, i]) + 1, float(lens.answer_prob[0, i])  # 1 = the top token
        click.echo(f"  {label:<9} answer rank {rank:>6}  p={prob:.3f}  top: {shown}")
    n_heads, n_mlps = dla.heads.numel(), dla.mlps.numel()
    hint = "with --top N or --json"
    click.echo(f"top {len(heads)} heads by direct attribution{more_note(n_heads, len(heads), hint)}:")
    for layer, head, value in heads:
        click.echo(f"  layer {layer:>2} head {head:>2}  {value:+.3f}")
    click.echo(f"top {len(mlps)} MLPs{more_note(n_mlps, len(mlps), hint)}:")
    for layer, value in mlps:
        click.echo(f"  layer {layer:>2} MLP      {value:+.3f}")
    click.echo(
        f"embeddings {float(dla.embed):+.3f}, biases {float(dla.attn_biases.sum() + dla.norm_bias):+.3f}"
    )
    for p in pictures:
        click.echo(f"wrote {p}")


def _lens_row(lens: Any, i: int) -> dict[str, Any]:
    return {
        "layer": i,
        "top_tokens": lens.top_tokens[0][i],
        "top_probs": lens.top_probs[0, i].tolist(),
        "answer_rank": int(lens.answer_rank[0, i]) + 1,  # from 1 (LogitLens.answer_rank counts from 0)
        "answer_prob": float(lens.answer_prob[0, i]),
    }


COMMANDS = (patch_cmd, attribute_cmd)
