"""Shared fixtures: every test starts from the same random state, so a failure reproduces."""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Seed Python, NumPy and torch before each test."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def single_thread() -> Iterator[None]:
    """Run a module's tests on one intra-op thread, then restore the previous count.

    For modules of many tiny-tensor tests: there, thread hand-off costs more than the work itself, and on
    a shared 2-core machine it made such a module about ten times slower. Opt in with
    ``pytestmark = pytest.mark.usefixtures("single_thread")``.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
