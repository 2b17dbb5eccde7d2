"""The explorer page's size and how fast Chromium opens it, for all-MiniLM-L6-v2 on 13, 128 and 512 tokens.

Run: ``python benchmarks/explorer.py [--runs 5] [--lengths 13 128 512] [--chromium /usr/bin/chromium]``.
For each length it builds the page (Python), writes it, then opens it ``--runs`` times in fresh headless
Chromium tabs and reports medians of: load (navigation start -> the page drawn and interactive, from the
page's own clock), the drawing alone, and the time to switch layer and token on the loaded page
(responsiveness). Prints a table and writes benchmarks/results/local/explorer.json (git-ignored) unless
``--out PATH``; only ``--save`` replaces the committed benchmarks/results/explorer.json. Target (issue 7):
512 tokens open in under 2 s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

import headspace
from headspace.bench.scripts import add_output_options, check_output_options, output_path
from headspace.viz.explorer import Explorer
from headspace.viz.explorer.page import HEADLESS_CHROMIUM_ARGS

os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
LAUNCH_ARGS = list(HEADLESS_CHROMIUM_ARGS)
TEXT = (
    "Attention lets every token look at every other token. Each head projects the tokens into its own "
    "small subspace with W_Q, W_K and W_V, scores the pairs, and W_O mixes what the heads found. "
)

RESULTS = Path(__file__).resolve().parent / "results"
"""The published results (committed); runs without --save write to RESULTS / "local"."""


def token_ids(pre: object, n: int) -> list[int]:
    """Exactly ``n`` token ids ([CLS] ... [SEP]) cut from a long text."""
    ids = pre.tokenizer.encode_ids([TEXT * (1 + n // 20)])[0]
    return [*ids[: n - 1], ids[-1]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="page loads per length (median reported)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[13, 128, 512])
    ap.add_argument("--chromium", default=os.environ.get("HEADSPACE_CHROMIUM", "/usr/bin/chromium"))
    add_output_options(ap, "explorer.json")
    args = ap.parse_args(argv)
    if args.runs <= 0 or any(n < 2 for n in args.lengths):
        ap.error(f"--runs must be positive and --lengths at least 2 tokens; got {args.runs}, {args.lengths}")
    check_output_options(ap, args, "explorer.json")
    out = output_path(args.out, args.save, "explorer.json", RESULTS)
    from playwright.sync_api import sync_playwright
    from tokenizers import Tokenizer

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    pre = headspace.load("minilm")
    vocab = Tokenizer.from_file(str(pre.tokenizer.path))
    rows = []
    # the pages (up to ~5 MB each) live only while they are measured
    with tempfile.TemporaryDirectory(prefix="explorer-bench-") as tmp, sync_playwright() as p:
        folder = Path(tmp)
        browser = p.chromium.launch(executable_path=args.chromium, headless=True, args=LAUNCH_ARGS)
        version = browser.version
        bar = tqdm(total=len(args.lengths) * args.runs, desc="page loads", unit="load")
        for n in args.lengths:
            ids = token_ids(pre, n)
            start = time.perf_counter()
            page = Explorer(pre.model, torch.tensor([ids]), labels=[vocab.id_to_token(i) for i in ids])
            path = page.save(folder / f"explorer_{n}.html")
            build_s = time.perf_counter() - start
            loads, draws, wall, switch_layer, switch_token = [], [], [], [], []
            for _ in range(args.runs):
                tab = browser.new_page(viewport={"width": 1500, "height": 1000})
                errors: list[str] = []
                tab.on("pageerror", lambda e, errors=errors: errors.append(str(e)))
                t0 = time.perf_counter()
                tab.goto(path.as_uri())
                tab.wait_for_selector("body[data-ready='true']", timeout=60_000)
                wall.append((time.perf_counter() - t0) * 1e3)
                loads.append(float(tab.evaluate("document.body.dataset.readyMs")))
                draws.append(float(tab.evaluate("document.body.dataset.renderMs")))
                switch_layer.append(
                    tab.evaluate(
                        "(() => { const t = performance.now(); "
                        "window.headspaceExplorer.select({layer: 3}); return performance.now() - t; })()"
                    )
                )
                switch_token.append(
                    tab.evaluate(
                        f"(() => {{ const t = performance.now(); "
                        f"window.headspaceExplorer.select({{token: {n // 2}}}); "
                        "return performance.now() - t; })()"
                    )
                )
                if errors:
                    raise RuntimeError(f"page errors at {n} tokens: {errors}")
                tab.close()
                bar.update(1)
            rows.append(
                {
                    "tokens": n,
                    "precision": page.data["precision"],
                    "file_mb": path.stat().st_size / 1e6,
                    "build_s": build_s,
                    "load_ms_median": statistics.median(loads),
                    "draw_ms_median": statistics.median(draws),
                    "wall_ms_median": statistics.median(wall),
                    "switch_layer_ms_median": statistics.median(switch_layer),
                    "switch_token_ms_median": statistics.median(switch_token),
                    "runs": args.runs,
                }
            )
        bar.close()
        browser.close()

    print(f"\nexplorer page, all-MiniLM-L6-v2, Chromium {version}, medians of {args.runs} loads")
    head = f"{'tokens':>6} {'stored':>8} {'file MB':>8} {'build s':>8} {'load ms':>8} {'draw ms':>8} "
    head += f"{'wall ms':>8} {'layer ms':>9} {'token ms':>9}"
    print(head)
    for r in rows:
        print(
            f"{r['tokens']:>6} {r['precision']:>8} {r['file_mb']:>8.2f} {r['build_s']:>8.2f} "
            f"{r['load_ms_median']:>8.0f} {r['draw_ms_median']:>8.0f} {r['wall_ms_median']:>8.0f} "
            f"{r['switch_layer_ms_median']:>9.0f} {r['switch_token_ms_median']:>9.0f}"
        )
    target = next((r for r in rows if r["tokens"] == 512), None)
    if target is not None:
        verdict = "meets" if target["load_ms_median"] < 2000 else "MISSES"
        print(f"512 tokens: {target['load_ms_median']:.0f} ms to open, {verdict} the < 2 s target")
    result = {
        "benchmark": "explorer",
        "model": "all-MiniLM-L6-v2",
        "chromium": version,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "load_ms": "navigation start -> page drawn and interactive (the page's performance.now())",
        "wall_ms": "Playwright goto -> body[data-ready] seen, measured in Python",
        "rows": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
