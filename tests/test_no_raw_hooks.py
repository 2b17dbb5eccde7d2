"""Analyses read what they need through named hook points (``headspace.nn.hooks.HookPoint``), never through
raw torch module hooks (issue 37): ``register_forward_hook`` and its kin appear in ``src/`` only in the hook
machinery itself and in the allow-list below, each entry with its reason and its exact number of calls (so
an entry that is no longer needed fails here until it is removed)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "headspace"

#: torch's module hooks: register_forward_hook, register_forward_pre_hook, register_full_backward_hook,
#: register_full_backward_pre_hook, register_backward_hook, and the global register_module_* ones.
RAW_HOOK = re.compile(r"^register_(module_)?(forward|full_backward|backward)(_pre)?_hook$")

#: the hook machinery itself, free to use torch's hooks (among them the drop-in's do-nothing pre-hook that
#: keeps torch's encoder layer off its fused kernel: nn.hooks.keep_torch_fast_path_off)
MACHINERY = "nn/hooks.py"

#: path under src/headspace -> (number of raw hook uses, why it stays).
ALLOWED: dict[str, tuple[int, str]] = {
    # empty: what no tensor hook point carries (a call's keywords, a norm's input) is read through the
    # machinery's on_call (each_layer_qk's masks and positions, the atlas's post-attention norm input)
}


def raw_hook_uses(path: Path) -> list[int]:
    """Line numbers of every raw torch module hook named in ``path`` (attribute, name or import)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and RAW_HOOK.match(node.attr):
            lines.append(node.lineno)
        elif isinstance(node, ast.Name) and RAW_HOOK.match(node.id):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom):
            lines += [node.lineno for alias in node.names if RAW_HOOK.match(alias.name)]
    return sorted(lines)


def test_the_scan_finds_raw_hooks_in_every_form(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from torch.nn.modules.module import register_module_forward_hook\n"
        "m.register_forward_hook(f)\n"
        "m.attn.register_forward_pre_hook(f, with_kwargs=True)\n"
        "m.register_full_backward_hook(f)\n"
        "hook_point.add(f)\n"
        "t.register_hook(f)\n",  # a tensor's autograd hook is not a module hook
        encoding="utf-8",
    )
    assert raw_hook_uses(sample) == [1, 2, 3, 4]


def test_no_raw_torch_module_hooks_outside_the_hook_machinery_and_the_allow_list() -> None:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        uses = raw_hook_uses(path)
        if uses and path.relative_to(SRC).as_posix() != MACHINERY:
            found[path.relative_to(SRC).as_posix()] = uses
    unexpected = {p: lines for p, lines in found.items() if p not in ALLOWED}
    assert not unexpected, f"raw torch module hooks (use a HookPoint's add()): {unexpected}"
    counts = {p: len(found.get(p, [])) for p in ALLOWED}
    assert counts == {p: n for p, (n, _) in ALLOWED.items()}, "update ALLOWED: an entry no longer matches"
