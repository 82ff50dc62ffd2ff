"""The CLI shell: bad choices are errors that list the allowed values; the demo names the path that ran."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from nsa_flex_cli.main import app


@pytest.mark.parametrize("flag, allowed", [
    pytest.param("--impl", "allowed flex, reference", id="impl"),
    pytest.param("--parallel", "allowed none, ddp, fsdp", id="parallel"),
    pytest.param("--precision", "allowed fp32, bf16, fp16", id="precision"),
])
def test_memory_rejects_unknown_choices(flag, allowed):
    result = CliRunner().invoke(app, ["memory", "--preset", "tiny", flag, "bogus"])
    assert result.exit_code == 2, result.output
    assert f"{flag.removeprefix('--')}='bogus': {allowed}" in result.output
    assert "| total |" not in result.output


@pytest.mark.parametrize("impl, ran", [("flex", "reference (asked for impl=flex)"), ("auto", "reference")])
def test_demo_on_cpu_runs_and_names_the_path(impl, ran):
    result = CliRunner().invoke(app, ["demo", "--impl", impl, "-T", "64", "--steps", "1"])
    assert result.exit_code == 0, result.output
    assert f"ran: impl={ran}" in result.output
    assert "output finite: True" in result.output and "Traceback" not in result.output


def test_threads_option_and_default(monkeypatch):
    from nsa_flex_cli import main

    before = torch.get_num_threads()
    try:
        assert CliRunner().invoke(app, ["--threads", "3", "info"]).exit_code == 0
        assert torch.get_num_threads() == 3
        monkeypatch.setattr(main.os, "sched_getaffinity", lambda pid: {0, 1})
        assert main.default_threads() == 1
        assert CliRunner().invoke(app, ["info"]).exit_code == 0
        assert torch.get_num_threads() == 1
        monkeypatch.setattr(main.os, "sched_getaffinity", lambda pid: set(range(64)))
        assert main.default_threads() == 4
    finally:
        torch.set_num_threads(before)


def test_cli_hides_the_eager_flex_warning(tmp_path):
    # A fresh process: torch warns about eager flex only once per process.
    cmd = [sys.executable, "-m", "nsa_flex_cli.main", "bench", "attention", "--device", "cpu",
           "-T", "64", "--impls", "nsa-flex", "--modes", "fwd", "--iters", "1", "--warmup", "0",
           "--check-seq-len", "64", "-o", str(tmp_path), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| nsa-flex | fwd |" in proc.stdout
    assert "flex_attention called without torch.compile" not in proc.stderr, proc.stderr[-3000:]
    assert "UserWarning" not in proc.stderr


def test_generate_samples_by_default():
    result = CliRunner().invoke(app, ["generate", "-p", "def ", "-n", "4"])
    assert result.exit_code == 0, result.output
    assert "sampling at temperature 0.8, top-k 20, seed 0" in result.output
    greedy = CliRunner().invoke(app, ["generate", "-p", "def ", "-n", "4", "--temperature", "0"])
    assert greedy.exit_code == 0 and "; greedy" in greedy.output
