"""Shared test setup: one CPU thread, Triton's interpreter without CUDA, the `gpu` marker, `seed`.

Test configuration, not library behaviour: the library reads no environment variables.
- TRITON_INTERPRET=1 (without CUDA, unless already set) runs the Triton kernels' tests on the
  CPU through Triton's interpreter. Triton reads it when a kernel is decorated, so it is set
  here, before any test module imports nsa_flex's kernels.
- One intra-op thread: the suite is thousands of small ops, which torch's default thread pool
  made several times slower on a busy 2-core machine. OMP_NUM_THREADS passes it on to the
  subprocesses some tests start.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


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
