"""``headspace why`` and ``headspace circuit``: why a head attends where it does; which heads work together.

``why`` splits one head's pre-softmax score over pairs of parts of the residual stream
(:func:`headspace.analysis.decomposition.score_decomposition`) and prints the largest pairs in words;
``circuit`` scores every edge of a decoder's head/MLP graph on a task (EAP or EAP-IG,
:mod:`headspace.analysis.circuits`), keeps the top ``--edges`` and writes the faithfulness curve (plot +
JSON), the circuit as a picture and a ``circuit.json`` the explorer page shows (``headspace view --result``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from .encdec_inputs import is_encdec_spec, refuse_target, target_option
from .errors import check_input
from .loader import at_precision, load_model
from .options import (
    TOKENS_HELP,
    checked_memory,
    choice_option,
    decoder_model_option,
    json_option,
    max_memory_option,
    model_option,
    precision_option,
)
from .output import check_writable_folder, clean, json_out, more_note
from .shape import check_before_loading, check_loaded_shape

OUT_HELP = "Folder for circuit.json, curve.json, faithfulness.png and circuit.png (created if needed)."
#: The edges ``circuit`` prints (all of them are in circuit.json; every head of the circuit is printed).
TOP_EDGES = 10
DEFAULT_WHY = "When Mary and John went to the store, John gave a drink to"


def describe(component: str, token: str, roles: dict[str, str] | None = None) -> str:
    """A component in words: ``"L17H3's output at ␣the (a previous head)"``, ``"the embedding of ␣a"``;
    ``token`` as the command line prints tokens (:data:`.options.TOKENS_HELP`: a space as ␣, no quotes)."""
    from ..pretrained.tokenization import readable_token

    token = readable_token(token)
    if component == "embed":
        return f"the embedding of {token}"
    if component == "bias":
        return "the bias terms"
    if component.startswith("mlp"):
        return f"MLP {component[3:]}'s output at {token}"
    role = (roles or {}).get(component)
    shown = f" (a {role} head)" if role and role != "mixed" else ""
    return f"{component}'s output at {token}{shown}"


def _roles(model: Any, prompt: str, layer: int) -> dict[str, str]:
    """Each earlier head's role label on this prompt (:func:`headspace.analysis.head_roles`)."""
    from ..analysis import head_roles

    labels = head_roles(model, [prompt]).labels
    return {f"L{i}H{h}": lab for i, row in enumerate(labels[:layer]) for h, lab in enumerate(row)}


@click.command("why", epilog=TOKENS_HELP)
@click.argument("text", required=False, default=DEFAULT_WHY)
@click.option("--layer", type=int, required=True, help="The head's layer.")
@click.option("--head", type=int, required=True, help="The head.")
@click.option("--token", "query", type=int, default=-1, show_default=True, help="The query position.")
@click.option(
    "--key", type=int, default=None, help="The key position (default: where the head attends most)."
)
@click.option("--top", type=click.IntRange(1, None), default=5, show_default=True, help="Pairs to list.")
@click.option("--out", "out_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="PNG file for the heatmap of the parts.")  # fmt: skip
@target_option
@model_option
@precision_option
@json_option
def why_cmd(
    text: str, layer: int, head: int, query: int, key: int | None, top: int, out_file: Path | None,
    target: str | None, model_spec: str, model_precision: str, as_json: bool,
) -> None:  # fmt: skip
    """Why a head attends where it does: its score of the query on the key split exactly over
    (query-side part) x (key-side part): embeddings, earlier heads, earlier MLPs, biases. On an
    encoder-decoder (TEXT: a source sentence or a WAV file) a cross-attention head of the decoder: --token
    a decoder position, --key a source position."""
    if is_encdec_spec(model_spec):
        from .encdec_commands import why_encoder_decoder

        return why_encoder_decoder(
            model_spec, text, layer=layer, head=head, query=query, key=key, top=top, target=target,
            precision=model_precision, as_json=as_json,
        )  # fmt: skip
    refuse_target(target, model_spec)
    if out_file is not None:
        check_writable_folder(out_file.parent, "--out", out_file)
    check_before_loading(model_spec, layer, head, from_end=True)
    from ..analysis.circuits.decomposition import score_decomposition

    model = at_precision(load_model(model_spec), model_precision)
    check_loaded_shape(model, layer, head, from_end=True)  # a .gguf file's shape is known only now
    r = score_decomposition(model, text, layer, head, query, key)
    roles = _roles(model, text, r.layer)
    pairs = r.top_pairs(top)
    qt, kt = r.tokens[r.query], r.tokens[r.key]
    words = [
        f"query side: {describe(a, qt, roles)} x key side: {describe(b, kt, roles)}" for a, b, _ in pairs
    ]
    picture = None
    if out_file is not None:
        from ..viz.circuit_plots import plot_score_decomposition

        picture = plot_score_decomposition(r, out_file)
    if as_json:
        listed = [
            {"query_side": a, "key_side": b, "value": v, "words": w} for (a, b, v), w in zip(pairs, words)
        ]
        data = {
            "layer": r.layer, "head": r.head, "query": r.query, "key": r.key, "query_token": qt,
            "key_token": kt, "score": r.score, "total": r.total, "pattern": r.pattern,
            "components": r.components, "parts": r.parts.tolist(), "top": listed,
            "picture": None if picture is None else str(picture),
        }  # fmt: skip
        json_out(clean(data))
        return
    from ..pretrained.tokenization import readable_token

    q_shown, k_shown = readable_token(qt), readable_token(kt)
    click.echo(f"layer {r.layer} head {r.head}: query {r.query} {q_shown} -> key {r.key} {k_shown}")
    click.echo(f"score {r.score:+.4f} (attention weight {r.pattern:.3f}); the parts add up to {r.total:+.4f}")
    n_pairs = r.parts.numel()
    note = more_note(n_pairs, len(pairs), "with --top N or --json")
    click.echo(f"top {len(pairs)} pairs of parts{note}:")
    for (_, _, v), w in zip(pairs, words):
        click.echo(f"  {v:+8.4f}  {w}")
    if picture is not None:
        click.echo(f"wrote {picture}")


def circuit_summary(
    model: Any, task: Any, scores: Any, circuit: Any, curve: Any, faith: Any
) -> dict[str, Any]:
    """The ``circuit.json`` the explorer reads (kind ``"circuit_summary"``, see its circuit view)."""
    import torch

    from ..analysis.circuits.graph import graph_of

    g = graph_of(model)
    graph_layers, n_heads = g.n_layers, g.n_heads
    node = torch.zeros(graph_layers, n_heads + 1, dtype=torch.float64)  # (n_layers, n_heads + 1)
    group = n_heads // g.n_kv_heads
    for s, r, v in circuit.listed:
        for name in (s, r.split(".")[0]):
            if name.startswith("mlp"):
                node[int(name[3:]), n_heads] += abs(v)
            elif name.startswith("L") and "KV" in name:
                lay, kv = (int(x) for x in name[1:].split("KV"))
                node[lay, kv * group : (kv + 1) * group] += abs(v) / group  # shared by its group
            elif name.startswith("L"):
                lay, h = (int(x) for x in name[1:].split("H"))
                node[lay, h] += abs(v)
    return {
        "kind": "circuit_summary", "task": task.name, "method": scores.method, "steps": scores.steps,
        "n_pairs": len(task), "n_layers": graph_layers, "n_heads": n_heads, "node_scores": node.tolist(),
        "edges": [list(e) for e in circuit.listed], "faithfulness": faith.faithfulness, "cpr": curve.cpr,
        "cmd": curve.cmd, "curve": curve.to_dict(), "prompt": task.texts[0][0],
        "clean_metric": faith.clean_metric, "corrupt_metric": faith.corrupt_metric,
    }  # fmt: skip


def _task(model: Any, spec: str, pairs: int) -> Any:
    from ..analysis.circuits.tasks import ioi_task, load_task

    if spec == "ioi":
        return ioi_task(model, pairs)
    task = load_task(model, spec)
    return task.subset(slice(0, pairs)) if len(task) > pairs else task


@click.command("circuit")
@click.option("--task", "task_spec", default="ioi", show_default=True,
              help="'ioi' (built in) or a JSONL file of {clean, corrupt, answer, other} lines.")  # fmt: skip
@click.option("--edges", type=click.IntRange(1, None), default=200, show_default=True, help="Edges kept.")
@choice_option("--method", choices=("eap", "eap-ig"), default="eap-ig", help="Edge scores.")
@click.option("--steps", type=click.IntRange(1, None), default=5, show_default=True, help="EAP-IG's steps.")
@click.option(
    "--pairs", type=click.IntRange(1, None), default=64, show_default=True, help="Pairs of the task."
)
@click.option(
    "--batch-size", type=click.IntRange(1, None), default=32, show_default=True, help="Pairs a pass."
)
@json_option
@decoder_model_option
@precision_option
@click.option(
    "--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), required=True, help=OUT_HELP
)
@max_memory_option
def circuit_cmd(
    task_spec: str, edges: int, method: str, steps: int, pairs: int, batch_size: int, out_dir: Path,
    model_spec: str, model_precision: str, as_json: bool, max_memory: str | None,
) -> None:  # fmt: skip
    """Find a circuit: score every edge (EAP / EAP-IG), keep the top --edges, measure its faithfulness by
    running it (edges outside carry the corrupt run's values), and the faithfulness curve (MIB's CPR/CMD)."""
    check_writable_folder(out_dir)
    checked_memory(max_memory)
    if task_spec != "ioi":
        check_input(task_spec, "--task", "task file")
    from ..analysis.circuits import edges as C
    from ..analysis.circuits.graph import graph_of
    from ..core.fileio import write_atomic
    from ..viz.circuit_plots import plot_circuit, plot_faithfulness_curve

    model = at_precision(load_model(model_spec), model_precision)
    graph_of(model)  # a decoder of pre-norm blocks, said before any task is built for it
    task = _task(model, task_spec, pairs)
    bounds = {"batch_size": batch_size, "max_memory": max_memory}
    scores = C.edge_scores(model, task, method, steps, **bounds)
    n = min(edges, int(scores.valid.sum()))
    circuit = C.find_circuit(scores, edges=n)
    curve, faith = C.curve_and_faithfulness(model, task, scores, circuit, **bounds)  # one pass for both
    summary = circuit_summary(model, task, scores, circuit, curve, faith)
    out_dir.mkdir(parents=True, exist_ok=True)
    import json

    written = [
        write_atomic(out_dir / "circuit.json", json.dumps(clean(summary))),
        write_atomic(out_dir / "curve.json", json.dumps(clean(curve.to_dict()))),
        plot_faithfulness_curve([curve], out_dir / "faithfulness.png", title=f"{model_spec}: {task.name}"),
    ]
    g = model.config
    title = f"{model_spec} {task.name}: top {n} edges, faithfulness {faith.faithfulness:.3f}"
    png = out_dir / "circuit.png"
    written.append(plot_circuit(circuit, g.n_layers, g.n_heads, png, n_kv_heads=g.n_kv_heads, title=title))
    if as_json:
        json_out(clean({**summary, "files": [str(p) for p in written]}))
        return
    m_clean, m_corrupt = faith.clean_metric, faith.corrupt_metric
    click.echo(f"task {task.name}: {len(task)} pairs; metric clean {m_clean:+.3f}, corrupt {m_corrupt:+.3f}")
    n_all = int(scores.valid.sum())
    click.echo(f"{method} scores over {n_all} edges; top {n} kept: faithfulness {faith.faithfulness:.3f}")
    click.echo(f"curve: CPR {curve.cpr:.3f} (higher is better), CMD {curve.cmd:.3f} (lower is better)")
    edges_shown = circuit.listed[:TOP_EDGES]
    note = more_note(len(circuit.listed), len(edges_shown), "in circuit.json")
    click.echo(f"top {len(edges_shown)} of the {len(circuit.listed)} edges kept{note}:")
    for s, r, v in edges_shown:
        click.echo(f"  {s:>8} -> {r:<12} {v:+.4f}")
    heads = circuit.heads()
    click.echo(f"heads in the circuit ({len(heads)}): " + ", ".join(heads))
    for p in written:
        click.echo(f"wrote {p}")
    click.echo(
        f"on the explorer page: headspace view --model {model_spec} --result {out_dir / 'circuit.json'}"
    )


COMMANDS = (why_cmd, circuit_cmd)
