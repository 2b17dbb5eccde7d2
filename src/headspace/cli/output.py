"""JSON output of the commands: strict JSON (NaN/Inf become null), one document on stdout."""

from __future__ import annotations

import json
import math
from typing import Any

import click


def json_out(data: Any) -> None:
    click.echo(json.dumps(data, allow_nan=False, default=lambda o: None))


def clean(x: Any) -> Any:
    """Replace NaN/Inf by None, recursively, for strict JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    return x
