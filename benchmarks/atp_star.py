"""AtP* against exact patching: how well AtP, AtP* and EAP-IG rank SmolLM2's heads and MLPs, and their cost.

Two tasks of clean/corrupt pairs (:mod:`headspace.analysis.tasks`): the built-in IOI task and a
capital-city task built here ("The capital of France is the city of" -> " Paris" against the corrupt
country's capital). For each task and site (every head's z; every MLP's output) the exact effect of
patching each component from the clean run into the corrupt run, batched over the pairs
(:func:`headspace.analysis.atp_star.exact_effects`), is the reference, and three estimates rank the
components:

* ``atp``: attribution patching, ``|mean over pairs of (a_clean - a_corrupt) . dM/da|``;
* ``atp*``: AtP* (GradDrop's ``1/(L-1) sum_l |c_l|``; the QK fix does not apply to z or MLP outputs);
* ``eap-ig``: EAP-IG (``edge_scores(..., "eap-ig")``, 5 steps), a node's score the sum of its outgoing
  edges' scores (= the integrated-gradients attribution of the node), by magnitude.

Edges: AtP over the circuit graph's edges (``atp_star(model, task, "edges", method="atp")``) is timed
beside EAP (``edge_scores(..., "eap")``) on the same pairs (issue 41: no slower than EAP).

Columns: Spearman correlation of each score with the exact ``|effect|``; top-k recall (the share of
the exact top k among the method's top k); false negatives (components with exact ``|effect|`` >=
``--threshold``, normalised to the clean-corrupt gap, that the method ranks below its top k); and the
AtP* diagnostic's bound on the false-negative fraction below its top k (``--samples`` drawn). Times are
one run each, ``--threads`` threads.

    python benchmarks/atp_star.py                      # the table; JSON in benchmarks/results/local/
    python benchmarks/atp_star.py --pairs 16           # fewer pairs (exact patching is the slow part)
    python benchmarks/atp_star.py --save               # publish: benchmarks/results/atp_star.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

import headspace
from headspace.analysis.atp_star import atp_star, atp_star_diagnostic, exact_effects
from headspace.analysis.circuits import edge_scores
from headspace.analysis.tasks import Task, ioi_task, make_task
from headspace.bench import machine_info
from headspace.bench.scripts import add_output_options, check_output_options, check_positive, output_path
from headspace.core.fileio import write_json

RESULTS = Path(__file__).resolve().parent / "results"
COUNTRIES = (
    "France:Paris Japan:Tokyo Italy:Rome Germany:Berlin Spain:Madrid Russia:Moscow Egypt:Cairo "
    "Canada:Ottawa China:Beijing England:London Greece:Athens Austria:Vienna Poland:Warsaw Ireland:Dublin "
    "Norway:Oslo Cuba:Havana Peru:Lima Kenya:Nairobi Portugal:Lisbon Sweden:Stockholm Hungary:Budapest"
).split()
CAPITAL_TEMPLATES = (
    "The capital of {c} is the city of",
    "Q: What is the capital of {c} called? A: It is",
    "{c} is a country. Its capital city is",
    "I flew to the capital of {c}, which is",
)


def capital_task(model: Any, n_pairs: int, seed: int = 0) -> Task:
    """Clean country -> its capital; corrupt: another country (its capital the ``other`` token). Only
    countries and capitals of one token each (with a leading space) are used."""
    tok = model.tokenizer
    pairs = [c.split(":") for c in COUNTRIES]
    ok = [(c, k) for c, k in pairs if len(tok.plain_ids(" " + c)) == 1 and len(tok.plain_ids(" " + k)) == 1]
    if len(ok) < 2:
        raise SystemExit(f"capital task: fewer than 2 one-token countries for this tokenizer ({ok})")
    g = torch.Generator().manual_seed(seed)
    rows: list[dict[str, str]] = []
    n = 0
    while len(rows) < n_pairs:
        i, j = torch.randperm(len(ok), generator=g)[:2].tolist()
        t = CAPITAL_TEMPLATES[n % len(CAPITAL_TEMPLATES)]
        n += 1
        if len(tok.plain_ids(t.format(c=ok[i][0]))) != len(tok.plain_ids(t.format(c=ok[j][0]))):
            continue  # a country that merges with the next character: not a same-length pair
        rows.append({"clean": t.format(c=ok[i][0]), "corrupt": t.format(c=ok[j][0]),
                     "answer": " " + ok[i][1], "other": " " + ok[j][1]})  # fmt: skip
    return make_task(model, rows, name="capitals")


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation of two flat score tensors (ranks by argsort; ties are rare)."""
    ra = a.double().argsort().argsort().double()
    rb = b.double().argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def compare(score: torch.Tensor, exact: torch.Tensor, effect: torch.Tensor, k: int, thr: float) -> dict:
    """Spearman, top-k recall and false negatives of ``score`` against exact |effect| (all flat)."""
    top = set(score.argsort(descending=True)[:k].tolist())
    true_top = set(exact.argsort(descending=True)[:k].tolist())
    big = (effect.abs() >= thr).nonzero().flatten().tolist()
    return {"spearman": spearman(score, exact), "recall": len(top & true_top) / k,
            "false_negatives": sum(i not in top for i in big), "n_above_threshold": len(big)}  # fmt: skip


def node_scores(es: Any, n_layers: int, n_heads: int) -> dict[str, torch.Tensor]:
    """EAP-IG's node scores: each sender's outgoing edges summed -> heads [L, H], MLPs [L]."""
    rows = torch.where(es.valid, es.scores, 0.0).sum(1)  # (n_senders,)
    idx = {name: i for i, name in enumerate(es.senders)}
    heads = torch.tensor([[rows[idx[f"L{l}H{h}"]] for h in range(n_heads)] for l in range(n_layers)])
    mlps = torch.tensor([rows[idx[f"mlp{l}"]] for l in range(n_layers)])
    return {"heads": heads, "mlp": mlps}


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    seconds = time.perf_counter() - t0
    what = " ".join(str(a) for a in args[2:] if isinstance(a, str))
    print(f"  {getattr(fn, '__name__', fn)} {what} {kwargs.get('method', '')}: {seconds:.1f} s", flush=True)
    return out, seconds


def run_task(model: Any, task: Task, args: argparse.Namespace) -> list[dict]:
    module = model.model
    L, H = len(module.blocks), module.blocks[0].attn.n_heads
    eap_ig, t_ig = timed(lambda: edge_scores(model, task, "eap-ig", steps=5, batch_size=args.batch))
    _, t_eap = timed(lambda: edge_scores(model, task, "eap", batch_size=args.batch))
    _, t_atp_edges = timed(lambda: atp_star(model, task, "edges", method="atp", batch_size=args.batch))
    eap_nodes = node_scores(eap_ig, L, H)
    rows = []
    for site, k in (("heads", args.k_heads), ("mlp", args.k_mlp)):
        exact, t_exact = timed(exact_effects, model, task, site, batch_size=args.batch)
        atp, t_atp = timed(atp_star, model, task, site, method="atp", batch_size=args.batch)
        star, t_star = timed(atp_star, model, task, site, batch_size=args.batch)
        diag = atp_star_diagnostic(model, task, star, k=k, threshold=args.threshold, samples=args.samples)
        ex, eff = exact.score.flatten(), exact.effect.flatten()
        scores = {"atp": atp.score.flatten(), "atp*": star.score.flatten(),
                  "eap-ig": eap_nodes[site].abs().flatten()}  # fmt: skip
        times = {"atp": t_atp, "atp*": t_star, "eap-ig": t_ig}
        for method, score in scores.items():
            row = {"task": task.name, "site": site, "method": method, "k": k, "seconds": times[method]}
            row.update(compare(score, ex, eff, k, args.threshold))
            rows.append(row)
        rows.append({"task": task.name, "site": site, "method": "exact", "k": k, "seconds": t_exact,
                     "diagnostic": diag.to_dict(), "eap_seconds": t_eap, "atp_edges_seconds": t_atp_edges,
                     "clean_metric": exact.clean_metric, "corrupt_metric": exact.corrupt_metric})  # fmt: skip
    return rows


def print_table(rows: list[dict], threshold: float) -> None:
    print(
        f"| task | site | method | Spearman | top-k recall | false negatives (|effect| >= {threshold}) | s |"
    )
    print("|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        if r["method"] == "exact":
            d = r["diagnostic"]
            print(f"| {r['task']} | {r['site']} | exact | | | | {r['seconds']:.1f} |")
            print(
                f"|  |  | edges: AtP {r['atp_edges_seconds']:.2f} s, EAP {r['eap_seconds']:.2f} s | | | | |"
            )
            print(f"|  |  | AtP* diagnostic: {d['n_sampled']} of {d['n_below']} below top {d['k']} patched, "
                  f"{len(d['hits'])} above {threshold}; false-negative fraction <= {d['p_upper']:.3f} "
                  f"({d['confidence']:.0%}) | | | | |")  # fmt: skip
            continue
        fn = f"{r['false_negatives']} of {r['n_above_threshold']}"
        print(f"| {r['task']} | {r['site']} | {r['method']} | {r['spearman']:.3f} | {r['recall']:.2f} "
              f"(k={r['k']}) | {fn} | {r['seconds']:.2f} |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--pairs", type=int, default=64, help="pairs per task")
    p.add_argument("--batch", type=int, default=32, help="pairs per forward pass")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--k-heads", type=int, default=20)
    p.add_argument("--k-mlp", type=int, default=5)
    p.add_argument("--threshold", type=float, default=0.05, help="|normalised effect| of a false negative")
    p.add_argument("--samples", type=int, default=30, help="components the diagnostic patches")
    p.add_argument("--tasks", default="ioi,capitals")
    add_output_options(p, "atp_star.json")
    args = p.parse_args(argv)
    check_positive(p, args, ["pairs", "batch", "threads", "k_heads", "k_mlp", "samples"])
    check_output_options(p, args, "atp_star.json")
    torch.set_num_threads(args.threads)
    model, t_load = timed(lambda: headspace.load(args.model))
    builders = {
        "ioi": lambda: ioi_task(model, args.pairs),
        "capitals": lambda: capital_task(model, args.pairs),
    }
    rows: list[dict] = []
    for name in args.tasks.split(","):
        if name not in builders:
            p.error(f"--tasks: unknown task {name!r}; tasks: {list(builders)}")
        rows += run_task(model, builders[name](), args)
    blocks = model.model.blocks
    print(f"\n{args.model}: {len(blocks)} layers x {blocks[0].attn.n_heads} heads, {args.pairs} pairs per "
          f"task, {args.threads} threads, float32 (load {t_load:.1f} s)\n")  # fmt: skip
    print_table(rows, args.threshold)
    out = output_path(args.out, args.save, "atp_star.json", RESULTS)
    write_json(out, {"rows": rows, "machine": machine_info(), "settings": vars(args)})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
