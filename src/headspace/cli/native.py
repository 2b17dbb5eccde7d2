"""``headspace native build`` and ``headspace native status``: the native decoding step
(:mod:`headspace.kernels.native`) built once, up front, and what state it is in."""

from __future__ import annotations

from types import ModuleType

import click

from ..core.errors import UsageError


def _check_switch(native: ModuleType) -> None:
    """``HEADSPACE_NATIVE`` of an unknown value: one line, exit code 2 (:func:`native.enabled`)."""
    try:
        native.enabled()
    except ValueError as e:
        raise UsageError(str(e)) from None


@click.group("native")
def native_group() -> None:
    """The native decoding step: every block of a cached decoding step in one C++ call."""


@native_group.command("build")
def build_command() -> None:
    """Build the native decoding step now (once per machine) and wait; print its status and path.

    Exit 0 once it is loaded, else 2 with one line saying why."""
    from ..kernels import native

    _check_switch(native)
    cxx = native.compiler()
    path = native.library_path(cxx) if cxx is not None else None
    if path is not None and native.enabled() and not path.is_file():
        what = f"building the native decoding step into {path} (a C++ compile, once per machine)"
        click.echo(what, err=True)
    if not native.build():
        raise UsageError(f"the native decoding step is not loaded: expected loaded, got {native.status()}")
    click.echo(native.status())
    click.echo(str(path))


@native_group.command("status")
def status_command() -> None:
    """Print the native decoding step's status (not built, built, failed: why) and its library's path."""
    from ..kernels import native

    _check_switch(native)
    cxx = native.compiler()
    path = native.library_path(cxx) if cxx is not None else None
    if path is not None and path.is_file():
        native.start_build()  # found: checks it may be loaded (compiles nothing)
    click.echo(native.status())
    click.echo(str(path) if path is not None else "no library: no C++ compiler found")


COMMANDS = (native_group,)
