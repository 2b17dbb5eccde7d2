"""The engine a README command runs, timed alone in a fresh process: benchmarks/cli.py's same-run figure.

``python benchmarks/cli_engine.py COMMAND ARGS...`` takes the very argument list that
``python -m headspace COMMAND ARGS...`` takes, parses it with the command's own click parser (so every
default and option is the command's), sets threads as the command does (:mod:`headspace.core.threads`,
before torch is imported), loads the model, then times ONLY the engine call the command makes:

* ``circuit``: :func:`~headspace.analysis.circuits.edges.edge_scores` (EAP-IG, the command's steps, pairs
  and batch size) + :func:`~headspace.analysis.circuits.edges.faithfulness_curve` on the same task;
* ``heads``: :func:`~headspace.analysis.head_importance` on the command's sentences and ablation mode,
  and :func:`~headspace.analysis.head_roles` with the induction score (the table's other columns: the
  command computes both; each is its own part);
* ``atlas``: :func:`~headspace.analysis.atlas.run.atlas` (statistics + its importance pass, AtP* by
  default) over the command's corpus, window, batch and token limit, its shards in a fresh folder;
* ``generate``: ``model.generate`` with the command's prompt, tokens, temperature, top-k and seed
  (the prefill and the decode steps; nothing printed).

It prints one JSON line: ``{"command", "load_s", "engine_s", "parts": {name: seconds}}``; ``engine_s``
is None for a command with no engine of its own (explain, patch, attribute). The difference between the
command's wall time and ``load_s + engine_s`` of this probe is what the command spends beyond its engine
(imports, tokenizer, printing, plots, files).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENGINES = ("circuit", "heads", "atlas", "generate")
"""The commands with an engine this probe times (the rest report the load alone)."""


def command_params(argv: list[str]) -> dict[str, Any]:
    """The parameters ``headspace ARGV`` would run with: the command's click parser and defaults."""
    from headspace.cli import cli

    command = cli.commands[argv[0]]
    return dict(command.make_context(argv[0], list(argv[1:])).params)


def _circuit(model: Any, p: dict[str, Any]) -> dict[str, float]:
    from headspace.analysis.circuits import edges as C
    from headspace.cli.circuits import _task

    task = _task(model, p["task_spec"], p["pairs"])
    bounds = {"batch_size": p["batch_size"], "max_memory": p["max_memory"]}
    t0 = time.perf_counter()
    scores = C.edge_scores(model, task, p["method"], p["steps"], **bounds)
    t1 = time.perf_counter()
    C.faithfulness_curve(model, task, scores, **bounds)
    return {"edge_scores": t1 - t0, "faithfulness_curve": time.perf_counter() - t1}


def _heads(model: Any, p: dict[str, Any]) -> dict[str, float]:
    from headspace.analysis import head_importance, head_roles
    from headspace.cli.lesson import _induction, _read_sentences
    from headspace.core.defaults import DEFAULT_SENTENCE

    file = p["sentences_file"]
    sentences = _read_sentences(file) if file is not None else [p["sentence"] or DEFAULT_SENTENCE]
    kw: dict[str, Any] = {} if p["threshold"] is None else {"threshold": p["threshold"]}
    t0 = time.perf_counter()
    head_roles(model, sentences, induction=_induction(model), **kw)
    t1 = time.perf_counter()
    if p["no_importance"]:
        return {"head_roles": t1 - t0}
    head_importance(model, sentences, mode=p["mode"], progress=False)
    return {"head_roles": t1 - t0, "head_importance": time.perf_counter() - t1}


def _atlas(model: Any, p: dict[str, Any]) -> dict[str, float]:
    from headspace.analysis.atlas.run import atlas

    with tempfile.TemporaryDirectory(prefix="headspace-bench-engine-") as tmp:
        t0 = time.perf_counter()
        atlas(
            model, p["corpus"], window=p["window"], batch_size=p["batch_size"], top_k=p["top_k"],
            max_tokens=p["max_tokens"], ablation=not p["no_ablation"], out=Path(tmp) / "atl",
            shard_size=p["shard_size"], model_name=p["model_spec"], progress=False,
            importance=p["importance"], importance_check=p["importance_check"],
        )  # fmt: skip
        return {"atlas": time.perf_counter() - t0}


def _generate(model: Any, p: dict[str, Any]) -> dict[str, float]:
    prompt = p["target"] if p["prompt"] is None else p["prompt"]
    t0 = time.perf_counter()
    model.generate(
        prompt, p["max_new_tokens"], temperature=p["temperature"], top_k=p["top_k"], seed=p["seed"],
        chat=p["chat"],
    )  # fmt: skip
    return {"generate": time.perf_counter() - t0}


RUNS: dict[str, Callable[[Any, dict[str, Any]], dict[str, float]]] = {
    "circuit": _circuit, "heads": _heads, "atlas": _atlas, "generate": _generate,
}  # fmt: skip


def probe(argv: list[str]) -> dict[str, Any]:
    """Load the model of ``headspace ARGV`` and time its engine (see the module docstring)."""
    from headspace.core.threads import configure

    configure()  # as headspace.cli.main does, before torch is imported
    params = command_params(argv)
    from headspace.cli.loader import at_precision, load_model

    t0 = time.perf_counter()
    model = load_model(params["model_spec"])
    if "model_precision" in params:
        model = at_precision(model, params["model_precision"])
    load_s = time.perf_counter() - t0
    run = RUNS.get(argv[0])
    parts = {} if run is None else {k: round(v, 3) for k, v in run(model, params).items()}
    engine = round(sum(parts.values()), 3) if run is not None else None
    return {"command": argv[0], "load_s": round(load_s, 3), "engine_s": engine, "parts": parts}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python benchmarks/cli_engine.py COMMAND ARGS... (as after `python -m headspace`)")
        return 2
    print(json.dumps(probe(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
