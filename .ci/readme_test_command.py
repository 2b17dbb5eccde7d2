"""Print the README's test command: the one line of its Quick start code blocks marked ``# run the tests``.

``.ci/run`` runs what this prints, so CI runs exactly the command the README gives a reader (install
everything the tests need, then the tests) and the two cannot drift apart. Standard library only: it
runs before anything is installed. Exits 1, saying why, unless the Quick start's fenced code blocks
hold exactly one such line.

Usage: python3 .ci/readme_test_command.py [README.md]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

MARK = "# run the tests"
README = Path(__file__).resolve().parent.parent / "README.md"


class ReadmeCommandError(ValueError):
    """The README's Quick start does not hold exactly one test command."""


def quick_start(text: str) -> str:
    """The text of the README's ``## Quick start`` section (up to the next ``## `` heading)."""
    m = re.search(r"^## Quick start[ \t]*\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    if m is None:
        raise ReadmeCommandError("README.md has no '## Quick start' section")
    return m.group(1)


def test_command(text: str) -> str:
    """The command of the one Quick start line that ends with ``# run the tests``, without the comment."""
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", quick_start(text), flags=re.M | re.S)
    lines = [line for block in blocks for line in block.splitlines() if line.rstrip().endswith(MARK)]
    if len(lines) != 1:
        raise ReadmeCommandError(
            f"README.md's Quick start code blocks have {len(lines)} lines ending in {MARK!r}; expected 1"
        )
    command = lines[0].rstrip()[: -len(MARK)].strip()
    if not command:
        raise ReadmeCommandError(f"README.md's line marked {MARK!r} holds no command")
    return command


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else README
    try:
        print(test_command(path.read_text(encoding="utf-8")))
    except ReadmeCommandError as e:
        print(f"{Path(__file__).name}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
