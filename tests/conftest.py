"""Shared fixtures: every test starts from the same random state, so a failure reproduces."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Seed Python, NumPy and torch before each test."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
