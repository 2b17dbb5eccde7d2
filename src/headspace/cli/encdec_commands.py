"""``headspace patch``, ``attribute`` and ``why`` on an encoder-decoder (issue #40): ``--model whisper-base``
with WAV files, or a T5 / BART / Marian folder (with its ``tokenizer.json``) with source sentences.

- ``patch --clean A --corrupt B``: each cross-attention head's ``z`` from the clean run put into the corrupt
  run (:func:`headspace.analysis.causal.encdec_patching.patch_cross_heads`), both runs reading the clean
  output's tokens; the metric is the log-probability of the clean output and its end
  (:func:`.encdec_inputs.output_logprob`); ``restored = effect / (clean - corrupt)``.
- ``attribute SOURCE``: the logit of one output token split over the decoder's self-attention heads,
  cross-attention heads, MLPs, biases and embedding (:func:`~headspace.analysis.causal.encdec_dla.
  encdec_logit_attribution`; pre-LN models only: T5, Whisper).
- ``why SOURCE --layer L --head H``: a cross-attention score from a decoder position to a source position
  split over (query part, key part) pairs (:func:`~headspace.analysis.circuits.encdec_why.why_cross_score`;
  pre-LN models only).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ..core.errors import UsageError
from .encdec_inputs import given, load_encdec, output_logprob, piece, refuse_given, source_needed, source_run
from .errors import check_index, reported
from .output import clean, json_out, more_note

#: The cross-attention heads' effects in ``patch --json`` (as ``heads_patch_effect`` for decoders).
EFFECT_KEY = "cross_heads_patch_effect"


def patch_encoder_decoder(
    spec: str, clean_source: str, corrupt_source: str, *, site: str, method: str, target: str | None,
    top: int, precision: str, out_dir: Path | None, as_json: bool,
) -> None:  # fmt: skip
    """``headspace patch`` on an encoder-decoder (module docstring): the table, or ``--json``, and with
    ``--out`` the heatmap of the restored fractions (``patch_cross_heads.png``)."""
    import torch

    from ..analysis.causal.encdec_patching import patch_cross_heads
    from .encdec_inputs import source_inputs

    refuse_given(
        "patch", {"answer": "--answer", "other": "--other"}, "measures the clean output's log-probability"
    )
    if site != "heads" or method != "exact":
        flag = f"--site {site}" if site != "heads" else f"--method {method}"
        raise UsageError(f"{flag}: patch on an encoder-decoder patches each cross-attention head's z exactly "
                         "(--site heads --method exact)")  # fmt: skip
    if given("clean_text", "corrupt_text") != ["clean_text", "corrupt_text"]:
        raise UsageError(f"--model {spec}: an encoder-decoder; patch needs --clean and --corrupt (WAV files "
                         "for Whisper, source sentences for T5, BART and Marian)")  # fmt: skip
    model = load_encdec(spec, precision)
    run = source_run(model, clean_source, "--clean", target)
    corrupt = source_inputs(model, corrupt_source, "--corrupt")
    metric = output_logprob(run, model.config.eos_token_id)
    with reported():
        r = patch_cross_heads(model, run.inputs, corrupt, run.decoder_ids, metric)
    gap = r.clean - r.corrupt
    restored = r.effects / gap if gap != 0 else torch.full_like(r.effects, float("nan"))  # [L, H]
    n_heads = r.effects.shape[1]
    order = [divmod(int(i), n_heads) for i in r.effects.flatten().abs().argsort(descending=True)][:top]
    output = [piece(model, t) for t in run.text]
    pictures = []
    if out_dir is not None:
        from ..viz.causal_plots import plot_patch_effect

        title = f"{spec}: patching cross-attention heads (restored fraction of the output's log-probability)"
        path = Path(out_dir) / "patch_cross_heads.png"
        pictures.append(plot_patch_effect(restored, ("layer", "head"), path, title=title))
    metric_name = f"log-probability of the clean output ({len(run.text)} tokens and the end)"
    if as_json:
        json_out(clean({
            "site": "cross_heads", "method": "activation", "patch_method": "exact", "axes": ["layer", "head"],
            EFFECT_KEY: r.effects.tolist(), "restored": restored.tolist(), "clean_metric": r.clean,
            "corrupt_metric": r.corrupt, "metric": metric_name, "output": output,
            "top": [{"site": {"layer": a, "head": b}, "effect": float(r.effects[a, b]),
                     "restored": float(restored[a, b])} for a, b in order],
            "pictures": [str(p) for p in pictures],
        }))  # fmt: skip
        return
    click.echo(
        f"clean:   {clean_source!r} -> output {''.join(output).strip()!r}\ncorrupt: {corrupt_source!r}"
    )
    click.echo(f"metric {metric_name}: clean {r.clean:+.3f}, corrupt {r.corrupt:+.3f}")
    cut = more_note(r.effects.numel(), len(order), "with --top N or --json")
    click.echo(
        f"top {len(order)} cross-attention heads by |effect|{cut} (restored: 1 = clean, 0 = no effect):"
    )
    for a, b in order:
        click.echo(f"  decoder layer {a:>2} cross head {b:>2}  effect {float(r.effects[a, b]):+9.3f}  "
                   f"restored {float(restored[a, b]):+.3f}")  # fmt: skip
    for p in pictures:
        click.echo(f"wrote {p}")


def _pick_token(model: Any, text: list[int], answer: str | None) -> int:
    """The output token's index: ``--answer`` an index or an output token's text; default the middle."""
    from ..analysis.lesson.cross_explain import _pick

    token: int | str | None = answer
    if answer is not None and answer.strip().isdigit():
        token = int(answer.strip())
    with reported("--answer"):
        return _pick(model, text, token)


def attribute_encoder_decoder(
    spec: str, source: str, *, answer: str | None, target: str | None, top: int, precision: str,
    out_dir: Path | None, as_json: bool,
) -> None:  # fmt: skip
    """``headspace attribute`` on an encoder-decoder (module docstring): the output token ``--answer`` (its
    text or index among the output tokens; default the middle one) at the decoder row that predicts it."""
    from ..analysis.causal.encdec_dla import encdec_logit_attribution

    refuse_given("attribute", {"other": "--other"}, "splits one output token's logit")
    model = load_encdec(spec, precision)
    if not given("prompt"):
        raise source_needed(model, spec, "attribute", "its argument (PROMPT)")
    run = source_run(model, source, "PROMPT", target)
    k = _pick_token(model, run.text, answer if given("answer") else None)
    with reported():
        a = encdec_logit_attribution(
            model, run.inputs, run.decoder_ids, run.text[k], position=run.rows.start + k
        )
    parts = [("self", i, h, float(a.self_heads[i, h])) for i in range(a.self_heads.shape[0])
             for h in range(a.self_heads.shape[1])]  # fmt: skip
    parts += [("cross", i, h, float(a.cross_heads[i, h])) for i in range(a.cross_heads.shape[0])
              for h in range(a.cross_heads.shape[1])]  # fmt: skip
    heads = sorted(parts, key=lambda p: -abs(p[3]))[:top]
    mlps = sorted(enumerate(a.mlps.tolist()), key=lambda p: -abs(p[1]))[:top]
    output, word = [piece(model, t) for t in run.text], piece(model, run.text[k])
    biases = float(a.self_biases.sum() + a.cross_biases.sum()) + a.norm_bias
    pictures = []
    if out_dir is not None:
        from ..viz.causal_plots import plot_attribution

        title = f"{spec}: direct attribution of output token {k} {word!r} (cross-attention heads)"
        pictures.append(
            plot_attribution(a.cross_heads, a.mlps, Path(out_dir) / "attribution.png", title=title)
        )
    if as_json:
        d = a.to_dict()
        d.update(output=output, index=k, answer=word, pictures=[str(p) for p in pictures],
                 top_heads=[{"kind": s, "layer": i, "head": h, "attribution": v} for s, i, h, v in heads],
                 top_mlps=[{"layer": i, "attribution": v} for i, v in mlps])  # fmt: skip
        json_out(clean(d))
        return
    click.echo(f"source: {source!r} -> output {''.join(output).strip()!r}")
    click.echo(f"output token {k} {word!r} at decoder position {a.position}: logit {a.logit:+.3f} "
               f"(parts add up to {a.total:+.3f})")  # fmt: skip
    hint = "with --top N or --json"
    click.echo(f"top {len(heads)} heads by direct attribution{more_note(len(parts), len(heads), hint)}:")
    for s, i, h, v in heads:
        click.echo(f"  decoder layer {i:>2} {s + ' head':<10} {h:>2}  {v:+.3f}")
    click.echo(f"top {len(mlps)} MLPs{more_note(a.mlps.numel(), len(mlps), hint)}:")
    for i, v in mlps:
        click.echo(f"  decoder layer {i:>2} MLP  {v:+.3f}")
    click.echo(f"embeddings {a.embed:+.3f}, biases {biases:+.3f}")
    for p in pictures:
        click.echo(f"wrote {p}")


def why_encoder_decoder(
    spec: str, source: str, *, layer: int, head: int, query: int, key: int | None, top: int,
    target: str | None, precision: str, as_json: bool,
) -> None:  # fmt: skip
    """``headspace why`` on a cross-attention head (module docstring): ``--token`` the decoder position
    (the prompt, then the output tokens; default the last), ``--key`` the source position (default: where
    the head attends most from that position)."""
    import torch

    from ..analysis.circuits.encdec_why import why_cross_score
    from ..analysis.trace.trace import trace

    refuse_given("why", {"out_file": "--out"}, "prints the parts (no heatmap)")
    model = load_encdec(spec, precision)
    if not given("text"):
        raise source_needed(model, spec, "why", "its argument (TEXT)")
    check_index("layer", layer, model.config.n_decoder_layers)
    check_index("head", head, model.config.n_heads)
    run = source_run(model, source, "TEXT", target)
    dec = run.decoder_ids  # [1, seq_dec]
    check_index("token", query, dec.shape[1], from_end=True)
    name = f"decoder.blocks.{layer}.cross_attn.hook_pattern"
    with torch.no_grad(), trace(model, names=[name]) as t:
        model(run.inputs, dec)
    pattern = t[name][0, head, query % dec.shape[1]]  # [seq_k]
    if key is None:
        key = int(pattern.argmax())
    check_index("key", key, pattern.shape[0], from_end=True)
    with reported():
        s = why_cross_score(model, run.inputs, dec, layer=layer, head=head, query=query, key=key)
    reads, at = (
        piece(model, int(dec[0, s.query])),
        run.sources[s.key] if s.key < len(run.sources) else f"#{s.key}",
    )
    pairs = s.top(top)
    if as_json:
        d = s.to_dict()
        d.update(query_token=reads, key_source=at, pattern=float(pattern[s.key]),
                 top=[{"query_side": a, "key_side": b, "value": v} for a, b, v in pairs])  # fmt: skip
        json_out(clean(d))
        return
    click.echo(f"decoder layer {s.layer} cross-attention head {s.head}: query position {s.query} (reads "
               f"{reads!r}) -> source position {s.key} ({at!r})")  # fmt: skip
    click.echo(f"score {s.score:+.4f} (attention weight {float(pattern[s.key]):.3f}); the parts add up to "
               f"{s.total:+.4f}")  # fmt: skip
    note = more_note(s.matrix.numel(), len(pairs), "with --top N or --json")
    click.echo(f"top {len(pairs)} pairs of parts{note}:")
    for a, b, v in pairs:
        click.echo(f"  {v:+8.4f}  query side: {a} x key side: {b}")


__all__ = ["attribute_encoder_decoder", "patch_encoder_decoder", "why_encoder_decoder"]
