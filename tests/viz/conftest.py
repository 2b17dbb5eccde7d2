"""The headless Chromium the explorer's page tests open pages in (``browser``), shared by the test modules.

Without Chromium at ``HEADSPACE_CHROMIUM`` (default ``/usr/bin/chromium``) a test using ``browser`` skips,
unless ``HEADSPACE_REQUIRE_BROWSER`` is set (as CI sets it): then it fails, so CI never skips it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from headspace.viz.explorer.page import HEADLESS_CHROMIUM_ARGS

CHROMIUM = os.environ.get("HEADSPACE_CHROMIUM", "/usr/bin/chromium")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not (Path(CHROMIUM).is_file() and shutil.which(CHROMIUM)):
        if os.environ.get("HEADSPACE_REQUIRE_BROWSER"):
            raise RuntimeError(f"HEADSPACE_REQUIRE_BROWSER is set but no Chromium at {CHROMIUM}")
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    from playwright import sync_api

    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=list(HEADLESS_CHROMIUM_ARGS))
        yield b
        b.close()
