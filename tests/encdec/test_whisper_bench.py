"""benchmarks/whisper.py runs end to end (``--quick``: ~4 s of espeak-ng speech, one round) and every
system it times transcribes the same tokens as headspace in float32 (the int8 row may differ)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # Whisper base four ways on 2 busy cores: a minute or two

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "whisper.py"
RESULTS = SCRIPT.parent / "results"
#: the child imports this checkout's headspace whatever the working folder
ENV = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1] / "src")}


def test_whisper_benchmark_quick(tmp_path: Path) -> None:
    import ctranslate2  # noqa: F401  (a dev dependency: a missing one fails here, never skips)

    before = sorted(p.name for p in RESULTS.iterdir())
    out = tmp_path / "whisper.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)], capture_output=True,
                       text=True, timeout=900, cwd=tmp_path, env=ENV)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(out.read_text())
    rows = {row["system"]: row for row in d["rows"]}
    assert d["transcript"].lower().startswith("the history of the city")
    assert set(d["speculation"]) == {
        "verifies",
        "steps",
        "drafted",
        "accepted",
        "model_drafted",
        "model_accepted",
    }
    for name in (
        "headspace",
        "headspace (no speculation)",
        "headspace (n-gram drafts only)",
        "transformers (fp32, sdpa)",
        "ctranslate2 (float32)",
    ):
        assert rows[name]["same_tokens_as_headspace"] and rows[name]["median_s"] > 0
    assert "ctranslate2 (int8)" in rows and d["align_every_head_s"] > 0 and len(d["align_top_heads"]) == 8
    assert f"wrote {out}" in r.stdout and sorted(p.name for p in RESULTS.iterdir()) == before
    bad = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--save"], capture_output=True, text=True, env=ENV
    )
    assert bad.returncode == 2 and "never published" in bad.stderr
