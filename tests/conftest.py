"""Shared test setup: the `gpu` marker skips without CUDA; `seed` fixes the RNG per test."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed() -> int:
    """Seeds torch's CPU (and CUDA) generators with a fixed value; returns it."""
    value = 0
    torch.manual_seed(value)
    return value
