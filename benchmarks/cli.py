"""The README's commands as a new user runs them: wall time quiet and beside one competing process.

Each command runs as ``python -m headspace ...`` in a subprocess (import, model load and all), once on
the machine as it is (``quiet``) and once while a child process spins on one core (``busy``: one
CPU-bound competitor, issue 41). Beside each command's quiet time stands what it should cost: the
model's load (``python -c "headspace.load(MODEL)"``, timed the same way) plus its engine's time, taken
IN THE SAME RUN right after the command: ``cli_engine.py`` (beside this script) parses the command's own
argument list with its click parser, loads the model and times only the engine call the command makes
(``engine_run_s``, its parts in the row's ``engine_parts``):

* ``circuit --task ioi --edges 200``: EAP-IG (5 steps) + the faithfulness curve;
* ``atlas --corpus`` (a small corpus of this checkout's docs): the statistics and the default importance
  pass, AtP*, over the same corpus;
* ``heads``: the importance engine (``head_importance``) on the command's sentence;
* ``generate --tokens N``: the prefill plus the decode steps (``model.generate``);
* ``explain``, ``patch`` and ``attribute`` as the README's first commands run them (no engine of their
  own: their rows give the wall time beside the load only).

The engine figures of the project's published benchmarks (``circuits.json``, ``atlas.json``'s
statistics and ``importance`` parts, ``heads.json``, ``decode.json``; other days, other machine states)
stand in a second column (``engine_published_s``, ``quiet_over_published``) and are the fallback when
the same-run probe failed (``engine_source`` says which ``engine_s`` is). ``quiet_over_probe`` sets the
command's wall time beside the probe's whole process (interpreter, imports, load and engine, nothing
else): on a loaded machine, where one load figure at the start of a run drifts, the steadier ratio of
what the command spends beyond its engine.

``--readme`` writes the README's timing sentence (between its ``cli-timings`` markers) from the published
``cli.json``, so that the README's figures are this script's; a test holds the two equal.

Targets (issue 41): quiet within 30% of load + engine (``quiet_over_expected <= 1.3``), busy at most
2.5x quiet (``busy_over_quiet <= 2.5``). The machine's load average is recorded with every row: a
loaded machine's figures say so.

``--quick``: the smoke run: ``--model`` (a small checkpoint folder), tiny sizes, no published engine
figures (the same-run ones are taken).

Usage: python benchmarks/cli.py [--model smollm2] [--commands heads,circuit,atlas,generate,...]
       [--no-busy] [--quick] [--out PATH | --save] [--readme]
Writes benchmarks/results/local/cli.json (git-ignored) unless ``--out PATH``; only ``--save`` replaces
the committed benchmarks/results/cli.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from headspace.bench.scripts import add_output_options, check_output_options, output_path
from headspace.core.fileio import write_json

RESULTS = Path(__file__).resolve().parent / "results"
"""The published results (committed); runs without --save write to RESULTS / "local"."""
ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("circuit", "atlas", "heads", "generate", "explain", "patch", "attribute")
#: The commands whose engine ``cli_engine.py`` times in the same run (the rest have no engine of their own).
ENGINES = ("circuit", "atlas", "heads", "generate")
#: The README's markers around the sentence :func:`readme_sentence` writes.
MARKERS = ("<!-- cli-timings:start -->", "<!-- cli-timings:end -->")
EXPLAIN = "The trophy didn't fit in the suitcase because it was too big"
#: The quick run's explain and attribute arguments: words a small test tokenizer knows (the IOI templates').
QUICK_PROMPT = "When Mary and John went to the store, John gave a drink to"
QUICK_EXPLAIN = [QUICK_PROMPT, "--token", "John"]
QUICK_ATTRIBUTE = [QUICK_PROMPT, "--answer", " Mary"]
PROMPT = "The capital of France is"
GENERATE_TOKENS = 32


def _published(name: str) -> dict[str, Any] | None:
    path = RESULTS / name
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def engine_circuit() -> float | None:
    """EAP-IG (5 steps) + the faithfulness curve, seconds, from circuits.json."""
    doc = _published("circuits.json")
    rows = {r["case"]: r["headspace_s"] for r in (doc or {}).get("rows", [])}
    parts = [v for k, v in rows.items() if k.startswith(("eap-ig", "faithfulness curve"))]
    return sum(parts) if len(parts) == 2 else None


def engine_atlas(tokens: int) -> float | None:
    """``tokens`` at atlas.json's statistics rate plus the rate of the default importance pass (AtP*),
    seconds; None when the published atlas.json lacks either part."""
    parts = (_published("atlas.json") or {}).get("parts", {})
    if "stats" not in parts or "importance" not in parts:
        return None
    return tokens / parts["stats"]["tokens_per_s"] + tokens / parts["importance"]["tokens_per_s"]


def engine_heads() -> float | None:
    """``head_importance`` on the command's sentence, seconds, from heads.json."""
    rows = (_published("heads.json") or {}).get("rows", [])
    return next((r["wall_s"] for r in rows if r["case"] == "engine"), None)


def engine_generate(prompt_tokens: int, tokens: int) -> float | None:
    """The prefill of ``prompt_tokens`` and ``tokens`` decode steps (batch 1), seconds, from decode.json."""
    rows = (_published("decode.json") or {}).get("smollm2", {}).get("rows", [])
    row = next((r for r in rows if r["model"] == "headspace" and r["precision"] == "float32"), None)
    if row is None:
        return None
    return prompt_tokens / row["prefill_tokens_per_s"] + tokens * row["decode_ms_batch1"] / 1000


def corpus(folder: Path, max_chars: int) -> int:
    """A small corpus in ``folder``: the first ``max_chars`` characters of three of this checkout's docs
    (three short files, as in issue 41). Returns the characters written."""
    folder.mkdir(parents=True, exist_ok=True)
    total = 0
    for name in ("README.md", "docs/cli.md", "docs/atlas.md"):
        text = (ROOT / name).read_text(encoding="utf-8")[: max_chars // 3]
        (folder / Path(name).with_suffix(".txt").name).write_text(text, encoding="utf-8")
        total += len(text)
    return total


def atlas_tokens(path: Path, chars: int) -> int:
    """The tokens the atlas command read (its ``atlas.json``'s ``n_tokens``); about ``chars / 4`` when it
    wrote none."""
    try:
        return int(json.loads(path.read_text(encoding="utf-8"))["n_tokens"])
    except (OSError, ValueError, KeyError, TypeError):
        return chars // 4


def command_lines(model: str, work: Path, quick: bool) -> dict[str, list[str]]:
    """The argument lists of each command (after ``python -m headspace``), sized for ``quick`` or not."""
    small = ["--pairs", "4", "--steps", "1", "--edges", "5"] if quick else []
    return {
        "circuit": ["circuit", "--model", model, "--task", "ioi", "--out", str(work / "ioi"), *small]
        + ([] if quick else ["--edges", "200"]),
        "atlas": ["atlas", "--model", model, "--corpus", str(work / "notes"), "--out", str(work / "atl")]
        + (["--tokens", "16", "--window", "8"] if quick else []),
        "heads": ["heads", "--model", model],
        "generate": ["generate", "--model", model, PROMPT, "--tokens", str(4 if quick else GENERATE_TOKENS)],
        "explain": ["explain", "--model", model, *(QUICK_EXPLAIN if quick else [EXPLAIN, "--token", "it"])],
        "patch": ["patch", "--model", model],
        "attribute": ["attribute", "--model", model, *(QUICK_ATTRIBUTE if quick else [])],
    }


def timed_run(argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    """``python argv`` in a subprocess: wall seconds, exit code, the machine's 1-minute load after."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        print(done.stderr[-2000:], file=sys.stderr)
    return {"wall_s": round(wall, 2), "rc": done.returncode, "load_1m": round(os.getloadavg()[0], 2)}


class Spinner:
    """One CPU-bound competitor: a child Python process spinning until :meth:`stop` (a context manager)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Spinner:
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.5)  # running before the command measures the machine
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


def engine_run(argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    """The same-run engine figure of ``headspace ARGV``: :mod:`cli_engine` (beside this script) in a
    fresh process, the command's own arguments, only the engine call timed. Its JSON line, or
    ``{"engine_s": None}`` when the probe failed (its stderr printed)."""
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve().parent / "cli_engine.py"), *argv],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    wall = round(time.perf_counter() - t0, 2)
    if done.returncode != 0:
        print(done.stderr[-2000:], file=sys.stderr)
        return {"engine_s": None}
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "wall_s": wall}


def measure(
    names: list[str], lines: dict[str, list[str]], model: str, modes: list[str], env: dict[str, str]
) -> list[dict[str, Any]]:
    """One row per (command, mode), with the load time of the same mode; each quiet row also holds the
    same-run engine figure (``engine_run_s``, its parts, the probe's own load ``engine_load_s`` and its
    process's wall time ``engine_wall_s``), taken right after the command on the same machine state."""
    rows = []
    load = ["-c", f"import headspace as hs; hs.load({model!r})"]
    for mode in modes:
        with Spinner() if mode == "busy" else _nothing():
            load_s = timed_run(load, env)["wall_s"]
            for name in names:
                run = timed_run(["-m", "headspace", *lines[name]], env)
                row = {"command": name, "mode": mode, "load_s": load_s, **run}
                if mode == "quiet" and name in ENGINES:
                    probe = engine_run(lines[name], env)
                    row.update(
                        engine_run_s=probe.get("engine_s"), engine_load_s=probe.get("load_s"),
                        engine_parts=probe.get("parts"), engine_wall_s=probe.get("wall_s"),
                    )  # fmt: skip
                rows.append(row)
    return rows


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def summarise(rows: list[dict[str, Any]], engines: dict[str, float | None]) -> list[dict[str, Any]]:
    """A row per command: quiet and busy wall, load + engine, and the two ratios of the targets."""
    table = []
    for name in dict.fromkeys(r["command"] for r in rows):
        by = {r["mode"]: r for r in rows if r["command"] == name}
        quiet, busy, published = by.get("quiet"), by.get("busy"), engines.get(name)
        same_run = None if quiet is None else quiet.get("engine_run_s")
        engine = same_run if same_run is not None else published
        expected = None if engine is None or quiet is None else round(quiet["load_s"] + engine, 2)
        table.append({
            "command": name, "quiet_s": quiet and quiet["wall_s"], "busy_s": busy and busy["wall_s"],
            "load_s": quiet and quiet["load_s"], "engine_s": None if engine is None else round(engine, 2),
            "expected_s": expected,
            "quiet_over_expected": None if expected is None else round(quiet["wall_s"] / expected, 2),
            "busy_over_quiet": None if not (quiet and busy) else round(busy["wall_s"] / quiet["wall_s"], 2),
            "ok": all(r["rc"] == 0 for r in by.values()),
            "engine_source": None if engine is None else "same run" if same_run is not None else "published",
            "engine_run_s": same_run,
            "engine_published_s": None if published is None else round(published, 2),
            "quiet_over_published": _ratio(quiet, published),
            "quiet_over_probe": None if not (quiet and quiet.get("engine_wall_s"))
            else round(quiet["wall_s"] / quiet["engine_wall_s"], 2),
        })  # fmt: skip
    return table


def _ratio(quiet: dict[str, Any] | None, engine: float | None) -> float | None:
    """``quiet``'s wall time over its load + ``engine`` (None where either is missing)."""
    if quiet is None or engine is None:
        return None
    return round(quiet["wall_s"] / (quiet["load_s"] + engine), 2)


def _cell(v: Any) -> str:
    return "-" if v is None else f"{v}"


def print_table(table: list[dict[str, Any]], say: Callable[[str], None] = print) -> None:
    """The Markdown table of :func:`summarise`'s rows."""
    cols = ("command", "quiet_s", "busy_s", "load_s", "engine_s", "expected_s", "quiet_over_expected",
            "busy_over_quiet", "ok", "engine_source", "engine_published_s", "quiet_over_published",
            "quiet_over_probe")  # fmt: skip
    say("| " + " | ".join(cols) + " |")
    say("|" + "|".join("---" for _ in cols) + "|")
    for row in table:
        say("| " + " | ".join(_cell(row[c]) for c in cols) + " |")


def readme_sentence(doc: dict[str, Any]) -> str:
    """The README's timing sentence from a ``cli.json`` document: each command's quiet wall time, and
    the load and the machine it was measured on."""
    quiet = {r["command"]: r for r in doc["table"] if r["quiet_s"] is not None}
    order = [
        c for c in ("explain", "patch", "attribute", "heads", "generate", "circuit", "atlas") if c in quiet
    ]
    load = next(iter(quiet.values()))["load_s"] if quiet else None
    parts = ", ".join(f"`{c}` {quiet[c]['quiet_s']:.1f} s" for c in order)
    m = doc.get("machine", {})
    facts = (m.get("date"), m.get("cpu_model") or m.get("cpu"), f"{m.get('cores')} cores",
             m.get("torch") and f"torch {m['torch']}")  # fmt: skip
    on = ", ".join(str(x) for x in facts if x)
    return (
        f"Timed by `python benchmarks/cli.py --save` ({on}), each a fresh process, model `{doc['model']}` "
        f"(its load alone: {load} s): {parts}."
    )


def write_readme(doc: dict[str, Any], readme: Path = ROOT / "README.md") -> None:
    """Replace the README's sentence between :data:`MARKERS` with :func:`readme_sentence`."""
    text = readme.read_text(encoding="utf-8")
    start, end = text.index(MARKERS[0]), text.index(MARKERS[1])
    new = text[: start + len(MARKERS[0])] + readme_sentence(doc) + text[end:]
    readme.write_text(new, encoding="utf-8")


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument(
        "--commands", default=",".join(COMMANDS), help="comma-separated, of " + ", ".join(COMMANDS)
    )
    ap.add_argument("--no-busy", action="store_true", help="only the quiet run")
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, no published engine figures")
    ap.add_argument("--readme", action="store_true", help="write the README's timing sentence from cli.json")
    add_output_options(ap, "cli.json")
    args = ap.parse_args(argv)
    if args.readme:
        write_readme(_published("cli.json") or ap.error("no published benchmarks/results/cli.json"))
        return 0
    check_output_options(ap, args, "cli.json", smoke="quick")
    names = [n.strip() for n in args.commands.split(",") if n.strip()]
    if not names or set(names) - set(COMMANDS):
        ap.error(f"--commands must name some of {', '.join(COMMANDS)}; got {args.commands!r}")
    out = output_path(args.out, args.save, "cli.json", RESULTS)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "HEADSPACE_THREADS")}
    modes = ["quiet"] if args.no_busy else ["quiet", "busy"]
    with tempfile.TemporaryDirectory(prefix="headspace-bench-cli-") as tmp:
        work = Path(tmp)
        chars = corpus(work / "notes", 200 if args.quick else 900)
        rows = measure(names, command_lines(args.model, work, args.quick), args.model, modes, env)
        tokens = atlas_tokens(work / "atl" / "atlas.json", chars)
    engines = {} if args.quick else {
        "circuit": engine_circuit(), "atlas": engine_atlas(tokens), "heads": engine_heads(),
        "generate": engine_generate(len(PROMPT.split()) + 1, GENERATE_TOKENS),
    }  # fmt: skip
    table = summarise(rows, engines)
    print(f"{args.model}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at the end")
    print_table(table)
    doc = {
        "benchmark": "cli", "model": args.model, "quick": args.quick, "rows": rows, "table": table,
        "machine": {"cpu": platform.processor() or platform.machine(), "cpu_model": _cpu_model(),
                    "cores": os.cpu_count(), "python": platform.python_version(), "torch": _torch_version(),
                    "date": time.strftime("%Y-%m-%d")},
        "targets": {"quiet_over_expected": 1.3, "busy_over_quiet": 2.5},
    }  # fmt: skip
    write_json(out, doc)
    print(f"wrote {out}")
    return 0 if all(r["ok"] for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
