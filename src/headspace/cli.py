"""The ``headspace`` command (grows with the CLI issue)."""

from __future__ import annotations


def main() -> None:
    from .__main__ import main as demo

    demo()
