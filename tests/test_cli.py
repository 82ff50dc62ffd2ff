"""The CLI shell: bad choices are errors that list the allowed values; the demo names the path that ran."""

from __future__ import annotations

import pytest
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
