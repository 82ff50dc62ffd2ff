"""What the README's install and test commands rely on: base and dev dependencies, the CI script,
and the test setup of tests/conftest.py (one thread, Triton's interpreter on CPU)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_bench_plots_need_no_extra():
    assert any(dep.startswith("matplotlib") for dep in project()["dependencies"])


def test_dev_extra_installs_what_the_interpreter_needs():
    dev = project()["optional-dependencies"]["dev"]
    assert "triton==3.6.0; platform_system == 'Linux' and platform_machine == 'x86_64'" in dev
    assert "numpy<2.4" in dev


def test_ci_runs_the_readme_commands():
    lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "python3 -m pip install --quiet torch==2.13.0" in lines
    assert 'python3 -m pip install --quiet -e ".[dev]"' in lines
    assert lines[-1] == "python3 -m pytest -q"


def test_suite_runs_one_thread_and_the_interpreter_without_cuda():
    assert torch.get_num_threads() == 1
    if torch.cuda.is_available():
        return
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from nsa_flex.ops.select import kernels

    if kernels.HAS_TRITON:
        from triton.runtime.interpreter import InterpretedFunction

        assert isinstance(kernels._select_kernel, InterpretedFunction)


def test_every_package_folder_is_installed():
    """pyproject's package list names every folder of nsa_flex with an __init__.py (and the CLI):
    a non-editable install (pip install ., a wheel) ships only the listed ones, and an op left out
    there fails only outside the source tree."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "nsa_flex").rglob("__init__.py")}
    assert on_disk | {"nsa_flex_cli"} == listed
