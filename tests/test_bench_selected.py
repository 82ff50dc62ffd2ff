"""`nsa-flex bench selected` on CPU: its input errors, its selections and its table (the timing itself needs CUDA)."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from nsa_flex.bench.selected import Row, markdown, random_selection
from nsa_flex.config import NSAConfig
from nsa_flex_cli.bench import app

runner = CliRunner()


def test_unknown_shape_is_refused_with_the_allowed_ones():
    result = runner.invoke(app, ["selected", "--shapes", "g4,g3"])
    assert result.exit_code == 2
    assert "g3" in result.output and "seeds-125m" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_cpu_is_refused_with_a_reason():
    result = runner.invoke(app, ["selected", "--shapes", "g4"])
    assert result.exit_code == 2
    assert "CUDA" in result.output


@pytest.mark.parametrize("T", [1, 64, 65, 1000])
def test_random_selection_is_a_valid_nsa_selection(T):
    cfg = NSAConfig(n_heads=4, n_kv_heads=2, head_dim=16)
    sel = random_selection(2, 2, T, cfg, "cpu", seed=3)
    n, L = cfg.n_selected, cfg.sel_block
    assert sel.shape == (2, 2, T, n) and sel.dtype == torch.int32
    own = torch.arange(T)[:, None] // L
    used = sel >= 0
    # Distinct past blocks only, ascending, -1 last; block 0, the own and the previous block always in.
    assert bool(((sel <= own) | ~used).all())
    assert bool((used[..., 1:] <= used[..., :-1]).all())
    s = sel.masked_fill(~used, 10**6)
    assert bool((s[..., 1:] > s[..., :-1]).logical_or(~used[..., 1:]).all())
    for forced in (torch.zeros_like(own), own, (own - 1).clamp(min=0)):
        assert bool((sel == forced[None, None]).any(-1).all())
    assert bool((used.sum(-1) == torch.clamp(own[:, 0] + 1, max=n)[None, None]).all())


def test_markdown_table_has_the_speedup_and_marks_errors():
    rows = [Row("g4", 8192, "selected-op", "fwd", 1.0), Row("g4", 8192, "flex-sel", "fwd", 3.0),
            Row("g4", 8192, "dense-cudnn", "fwd", None, "OutOfMemoryError"),
            Row("g4", 2048, "check", "fwd+bwd", None, "AssertionError")]
    md = markdown(rows)
    line = next(x for x in md.splitlines() if x.startswith("| g4 | 8192 | fwd |"))
    assert "| 1.000 | 3.000 | err | 3.00x |" in line
    assert "2048" not in md
