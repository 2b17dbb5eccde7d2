"""What every ``benchmarks/*.py`` script shares: where its results go, and its argument checks.

Every script under ``benchmarks/`` writes one JSON document. By default it goes to
``benchmarks/results/local/NAME`` (git-ignored); ``--save`` publishes it as the committed
``benchmarks/results/NAME``; ``--out PATH`` puts it anywhere else. A smoke run (``--quick`` and the
like) is never published. :func:`check_positive` refuses a size or count below 1. The scripts share
these helpers instead of each carrying a copy.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path


def add_output_options(parser: argparse.ArgumentParser, name: str, *, note: str = "") -> None:
    """Add ``--out PATH`` and ``--save`` to ``parser`` for the results file ``name`` (``"decode.json"``).

    ``note`` is added to ``--out``'s default in its help (``", with --quick attention_quick.json there"``).
    """
    parser.add_argument(
        "--out", default=None, help=f"JSON output path (default: benchmarks/results/local/{name}{note})"
    )
    parser.add_argument("--save", action="store_true", help=f"publish: write benchmarks/results/{name}")


def check_output_options(
    parser: argparse.ArgumentParser, args: argparse.Namespace, name: str, *, smoke: str | None = None
) -> None:
    """Refuse (``parser.error``, exit status 2) ``--save`` with ``--out``, and ``--save`` with the smoke
    flag ``smoke`` (the attribute name, ``"quick"`` for ``--quick``) when one is given."""
    if args.save and args.out is not None:
        parser.error(f"--save writes benchmarks/results/{name}; give either --save or --out")
    if smoke is not None and args.save and getattr(args, smoke):
        flag = "--" + smoke.replace("_", "-")
        parser.error(f"--save publishes a full run; a {flag} smoke run is never published")


def output_path(out: str | None, save: bool, name: str, results: Path) -> Path:
    """``out`` as given; else ``results / name`` with ``save``, ``results / "local" / name`` without.

    ``results`` is the script's published folder (``benchmarks/results``, found from the script's path).
    """
    if out is not None:
        return Path(out)
    return (results if save else results / "local") / name


def check_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, names: Iterable[str]) -> None:
    """Refuse (``parser.error``) the first of ``names`` (attributes of ``args``; ``--the-option`` in the
    message) whose value is 0 or negative; a value left None (a default chosen later) is not checked."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive; got {value}")
