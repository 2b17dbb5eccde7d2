"""The families :func:`headspace.load` reads from a checkpoint folder, as data: ``headspace models``,
the README's table and docs/families.md are all generated from :data:`FAMILIES`.

One :class:`Family` per ``config.json`` ``model_type`` that
:data:`headspace.pretrained.registry.FOLDER_LOADERS` loads, no more and no fewer
(tests/pretrained/test_families_table.py checks the two sets are equal, and that the layout, the rotation
and the decoding route of a row are what loading a tiny checkpoint of that family builds).

``bound``: the exactness against transformers' eager forward as the row's ``tested_in`` file checks it,
``"<logits> / <patterns>"``: ``"1e-4 rel"`` is ``|ours - theirs| <= 1e-4 * max|theirs|`` on the logits,
``"1e-4 abs"`` an absolute 1e-4, ``"1e-5*"`` ``torch.testing.assert_close``'s float32 defaults (atol
1e-5, rtol 1.3e-6); the pattern figure is the largest absolute difference of any head's attention
pattern (``"-"``: not compared).

``decode``: each way (by configuration) :meth:`~headspace.pretrained.PretrainedDecoder.generate` runs
a new token:
``"native"`` (the C++ cached step once built, the Python one meanwhile), ``"python"`` (the Python cached
step: the native one refuses a field by name), ``"forward"`` (the whole forward with its KV cache: the
cached steps refuse a field by name), ``"encdec"`` (:meth:`headspace.EncoderDecoder.generate`, cached
self-attention) or ``"-"`` (an encoder: no decoding). :func:`decode_route` computes it for a loaded model.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from .families_rows import DECODE_ROUTES, FAMILIES, KINDS, ROTATIONS, Family

__all__ = ["DECODE_ROUTES", "FAMILIES", "KINDS", "ROTATIONS", "Family", "decode_route", "family"]


def family(model_type: str) -> Family:
    """The row of ``model_type``; ``KeyError`` naming the known ones where there is none."""
    for row in FAMILIES:
        if row.model_type == model_type:
            return row
    raise KeyError(f"no family {model_type!r}; known: {sorted(r.model_type for r in FAMILIES)}")


def as_json() -> list[dict[str, Any]]:
    """Every row as a dict (its tuples as lists), in :data:`FAMILIES` order."""
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(row).items()} for row in FAMILIES]


#: The marker comments around the generated part of a markdown file (:func:`sync_markdown`).
START, END = (
    "<!-- families:start (generated: python -m headspace.pretrained.families_table) -->",
    ("<!-- families:end -->"),
)
_KEY = (
    "exact: logits / patterns against transformers' eager forward (rel: of the largest logit; "
    "*: assert_close's float32 defaults); decode: the native or Python cached step or the forward "
    "(python/native: by the layout)"
)


def text_table(width: int = 100) -> str:
    """The plain-text table ``headspace models`` prints: one line per family (model_type, kind, layout,
    decode, bound), then its positions, norms and notes indented and wrapped to ``width`` columns."""
    import textwrap

    head = f"{'model_type':<12} {'kind':<15} {'layout':<16} {'decode':<14} exact (logits / patterns)"
    lines = [head, "-" * min(width, len(head))]
    for row in FAMILIES:
        layouts, decode = " or ".join(row.layouts), "/".join(row.decode)
        lines.append(f"{row.model_type:<12} {row.kind:<15} {layouts:<16} {decode:<14} {row.bound}")
        detail = "; ".join(x for x in (f"positions: {row.positions}", f"norms: {row.norm}", row.notes) if x)
        lines += textwrap.wrap(detail, width, initial_indent="    ", subsequent_indent="    ")
    lines += ["", *textwrap.wrap(_KEY, width)]
    return "\n".join(lines) + "\n"


def _md(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") or " " for c in cells) + " |"


def markdown_table() -> str:
    """The full markdown table (docs/families.md): one row per family, every column."""
    head = [
        "model_type",
        "kind",
        "positions",
        "layout",
        "norms",
        "notes",
        "decode",
        "exact (logits / patterns)",
    ]
    lines = [_md(head), "|" + "---|" * len(head)]
    for r in FAMILIES:
        lines.append(_md([f"`{r.model_type}`", r.kind, r.positions, " or ".join(r.layouts), r.norm, r.notes,
                          " or ".join(r.decode), r.bound]))  # fmt: skip
    return "\n".join([*lines, "", _KEY + "."]) + "\n"


def compact_table() -> str:
    """The README's short table: one row per block layout (``parallel`` also names the families that may
    be ``pre``; the encoder-decoders one row), its model_types grouped by how ``generate`` runs them."""
    groups: dict[str, dict[str, list[str]]] = {}
    for r in FAMILIES:
        key = r.kind if r.kind == "encoder-decoder" else r.layouts[0]
        label = "/".join(r.decode) + ("" if len(r.layouts) == 1 else f": {' / '.join(r.layouts)}")
        if r.kind == "encoder-decoder":
            label = f"{r.layouts[0]}-norm, {label}"
        groups.setdefault(key, {}).setdefault(label, []).append(f"`{r.model_type}`")
    lines = [_md(["layout", "model_types (how `generate` runs a token)"]), "|---|---|"]
    for key, by_label in groups.items():
        lines.append(
            _md([key, "; ".join(f"{', '.join(names)} ({label})" for label, names in by_label.items())])
        )
    return "\n".join(lines) + "\n"


def replace_generated(text: str, body: str, where: str) -> str:
    """``text`` with what lies between the :data:`START` and :data:`END` lines replaced by ``body``;
    ``ValueError`` naming ``where`` unless each marker is there exactly once, START first."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ValueError(f"{where}: expected one {START!r} line and then one {END!r} line; found "
                         f"{text.count(START)} and {text.count(END)}")  # fmt: skip
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{body}{END}{tail}"


#: Each generated file (relative to the repository root) and the function that makes its table.
GENERATED = {"README.md": compact_table, "docs/families.md": markdown_table}


def sync_markdown(root: str | Path, *, write: bool = False) -> list[str]:
    """The files of :data:`GENERATED` under ``root`` whose table differs from the generated one
    (written anew, atomically, where ``write``)."""
    from ..core.fileio import write_atomic

    stale = []
    for name, make in GENERATED.items():
        path = Path(root) / name
        text = path.read_text(encoding="utf-8")
        new = replace_generated(text, make(), str(path))
        if new != text:
            stale.append(name)
            if write:
                write_atomic(path, new)
    return stale


def decode_route(model: Any) -> str:
    """How ``model`` (a loaded :class:`~headspace.pretrained.PretrainedDecoder` or its ``.model``)
    decodes a new token, one of :data:`DECODE_ROUTES` but ``"encdec"`` and ``"-"``: ``"forward"``
    where it has no cached step or the Python step refuses a field, ``"python"`` where the native step
    refuses one or has no form of a part, else ``"native"``."""
    from ..decode import describe
    from ..decode.native import native_form
    from ..decode.python import prepare

    step = describe(getattr(model, "model", model))
    if step is None:
        return "forward"
    try:
        prepare(step)
    except ValueError:
        return "forward"
    try:
        return "python" if native_form(step) is None else "native"
    except ValueError:
        return "python"


def main(argv: list[str] | None = None) -> int:
    """``python -m headspace.pretrained.families_table [--write] [ROOT]``: the generated files that are
    stale (exit 1), or, with ``--write``, write them (exit 0)."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    write = "--write" in args
    roots = [a for a in args if a != "--write"]
    stale = sync_markdown(roots[0] if roots else ".", write=write)
    for name in stale:
        print(f"{name}: {'written' if write else 'stale (run with --write)'}")
    return 0 if write or not stale else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
