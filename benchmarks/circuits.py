"""Circuit finding on SmolLM2: EAP, EAP-IG and a faithfulness curve, against one forward per edge, hook loops.

The issue's setting: SmolLM2-135M (30 layers x 9 heads, 3 key/value heads), IOI pairs from the built-in
templates (``--pairs``, default 64), float32. Three measured cases, each beside its slower equivalents:

* ``eap``: :func:`headspace.analysis.circuits.edge_scores` with ``method="eap"`` (a corrupt forward, a
  clean forward and backward, the score products in blocks of a few layers' receivers);
* ``eap-ig``: the same with ``method="eap-ig", steps=5`` (five forwards and backwards on the path);
* ``curve``: :func:`~headspace.analysis.circuits.faithfulness_curve` at MIB's ten sizes plus the empty
  circuit (the corrupt run, the full circuit the clean run, nine patched runs);
* ``naive`` beside each score method: the exact effect of each edge, one patched forward per edge
  (:func:`~headspace.analysis.graph.run_graph` with that edge missing), timed on ``--sample`` edges and
  extrapolated to every edge (x steps for EAP-IG's definition on the path is not counted: one forward
  per edge is what attribution replaces);
* ``hook_loop`` beside each: TransformerLens-style accumulation, one Python-level product per (sender,
  receiver) pair instead of one matrix product per receiver layer, timed on a sample of receivers and
  extrapolated; for the curve, each circuit's receivers assembled edge by edge in Python.

Targets (64 pairs): eap <= 10 s, eap-ig (5 steps) <= 40 s, the curve <= 30 s.

    python benchmarks/circuits.py                 # the table; JSON in benchmarks/results/local/
    python benchmarks/circuits.py --save          # publish: benchmarks/results/circuits.json
    python benchmarks/circuits.py --pairs 16 --model PATH --threads 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import headspace
from headspace.analysis.circuits import edges as C
from headspace.analysis.graph import graph_of, run_graph
from headspace.analysis.tasks import ioi_task
from headspace.bench import machine_info
from headspace.core.fileio import write_json

RESULTS = Path(__file__).resolve().parent / "results"
TARGETS = {"eap": 10.0, "eap-ig": 40.0, "curve": 30.0}


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


@torch.no_grad()
def naive_per_edge(module, task, n_sample: int) -> float:
    """Seconds per edge of the definition: one forward of every pair with that one edge corrupted."""
    graph = graph_of(module)
    e_clean, e_corrupt = module.embed(task.clean), module.embed(task.corrupt)
    corrupt = run_graph(module, graph, e_corrupt, task.last, keep_acts=True).acts
    edges = graph.valid.nonzero()[torch.randperm(graph.n_edges, generator=torch.Generator().manual_seed(0))]
    t0 = time.perf_counter()
    for u, r in edges[:n_sample].tolist():
        missing = torch.zeros_like(graph.valid)
        missing[u, r] = True
        run_graph(module, graph, e_clean, task.last, corrupt=corrupt, missing=missing)
    return (time.perf_counter() - t0) / n_sample


def hook_loop_accumulate(module, task, n_receivers: int) -> float:
    """Seconds per receiver of scoring edge by edge (one product per sender), extrapolated by the caller."""
    graph = graph_of(module)
    with torch.no_grad():
        clean = run_graph(module, graph, module.embed(task.clean), task.last, keep_acts=True).acts
        corrupt = run_graph(module, graph, module.embed(task.corrupt), task.last, keep_acts=True).acts
    delta = corrupt - clean
    grads = C._receiver_grads(module, graph, module.embed(task.clean), task, 1.0 / len(task))
    t0 = time.perf_counter()
    for r in range(n_receivers):
        for u in graph.valid[:, r].nonzero()[:, 0].tolist():
            float((delta[u] * grads[r]).sum())
    return (time.perf_counter() - t0) / n_receivers


@torch.no_grad()
def hook_loop_circuit_run(module, task, scores) -> float:
    """Seconds of one circuit run whose receiver inputs are assembled edge by edge in Python."""
    graph = graph_of(module)
    mask = C.find_circuit(scores, edges=max(1, graph.n_edges // 100)).edges
    missing = graph.valid & ~mask
    e_clean = module.embed(task.clean)
    corrupt = run_graph(module, graph, module.embed(task.corrupt), task.last, keep_acts=True).acts
    clean = run_graph(module, graph, e_clean, task.last, keep_acts=True).acts
    t0 = time.perf_counter()
    for r in range(len(graph.receivers)):  # what a hook on each receiver does: subtract each missing edge
        x = clean[0].clone()
        for u in missing[:, r].nonzero()[:, 0].tolist():
            x -= clean[u] - corrupt[u]
    run_graph(module, graph, e_clean, task.last, corrupt=corrupt, missing=missing)  # and the run itself
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--pairs", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--sample", type=int, default=3, help="edges / receivers timed for the extrapolations")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/local/circuits.json)")
    p.add_argument("--save", action="store_true", help="publish: write benchmarks/results/circuits.json")
    args = p.parse_args(argv)
    if min(args.pairs, args.steps, args.threads, args.batch_size, args.sample) < 1:
        p.error("--pairs, --steps, --threads, --batch-size and --sample must be positive")
    if args.save and args.out is not None:
        p.error("--save writes benchmarks/results/circuits.json; give either --save or --out")
    torch.set_num_threads(args.threads)
    model = headspace.load(args.model)
    module = model.model
    task = ioi_task(model, args.pairs)
    graph = graph_of(module)
    n_edges = graph.n_edges
    eap, t_eap = timed(lambda: C.edge_scores(model, task, "eap", batch_size=args.batch_size))
    _, t_ig = timed(lambda: C.edge_scores(model, task, "eap-ig", args.steps, batch_size=args.batch_size))
    curve, t_curve = timed(lambda: C.faithfulness_curve(model, task, eap, batch_size=args.batch_size))
    per_edge = naive_per_edge(module, task, args.sample)
    per_receiver = hook_loop_accumulate(module, task, args.sample)
    loop_run = hook_loop_circuit_run(module, task, eap)
    n_points = len(curve.fractions)
    n_recv = len(graph.receivers)
    rows = [
        {"case": "eap", "headspace_s": t_eap, "naive_s": per_edge * n_edges,
         "hook_loop_s": t_eap + per_receiver * n_recv, "target_s": TARGETS["eap"]},
        {"case": f"eap-ig ({args.steps} steps)", "headspace_s": t_ig, "naive_s": per_edge * n_edges,
         "hook_loop_s": t_ig + args.steps * per_receiver * n_recv, "target_s": TARGETS["eap-ig"]},
        {"case": f"faithfulness curve ({n_points} points)", "headspace_s": t_curve,
         "naive_s": None, "hook_loop_s": loop_run * n_points, "target_s": TARGETS["curve"]},
    ]  # fmt: skip
    print(
        f"\n{args.model}: {graph.n_layers} layers, {n_edges} edges, {len(task)} pairs, {args.threads} threads"
    )
    m_clean, m_corrupt = curve.clean_metric, curve.corrupt_metric
    print(
        f"metric clean {m_clean:+.3f}, corrupt {m_corrupt:+.3f}; CPR {curve.cpr:.3f}, CMD {curve.cmd:.3f}\n"
    )
    print("| case | headspace s | naive (1 forward / edge, extrapolated) s | hook loops s | target s | met |")
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        naive = "" if r["naive_s"] is None else f"{r['naive_s']:.0f}"
        met = "yes" if r["headspace_s"] <= r["target_s"] else "NO"
        cells = [
            r["case"],
            f"{r['headspace_s']:.1f}",
            naive,
            f"{r['hook_loop_s']:.1f}",
            f"{r['target_s']:.0f}",
            met,
        ]
        print("| " + " | ".join(cells) + " |")
    out = Path(args.out) if args.out else (RESULTS if args.save else RESULTS / "local") / "circuits.json"
    data = {
        "rows": rows,
        "machine": machine_info(),
        "settings": vars(args),
        "n_edges": n_edges,
        "curve": curve.to_dict(),
        "naive_s_per_edge": per_edge,
        "hook_loop_s_per_receiver": per_receiver,
    }
    write_json(out, data)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
