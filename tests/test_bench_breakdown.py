"""`nsa-flex bench breakdown` on CPU: its input errors, the kernel families, the floors and the tables
(the timing and the profile need CUDA)."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from nsa_flex.bench.breakdown import HBM_GBPS, Profile, Row, family, floor_ms, markdown, profile_markdown
from nsa_flex.bench.flops import BWD_FACTOR, nsa_flops
from nsa_flex.config import PRESETS
from nsa_flex_cli.bench import app

runner = CliRunner()


def test_unknown_preset_is_refused_with_the_allowed_ones():
    result = runner.invoke(app, ["breakdown", "--preset", "g5"])
    assert result.exit_code == 2
    assert "g5" in result.output and "g4" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_cpu_is_refused_with_a_reason():
    result = runner.invoke(app, ["breakdown", "-T", "1k"])
    assert result.exit_code == 2
    assert "CUDA" in result.output


@pytest.mark.parametrize("kernel,expected", [
    ("_fwd_kernel", "selected op"), ("_slot_kernel", "selected op"), ("_slot_gated_kernel", "selected op"), ("_block_sum_kernel", "selected op"),
    ("_delta_kernel", "selected op"), ("_sum_bwd_kernel", "elementwise / reductions"),
    ("_fold_kernel", "elementwise / reductions"),
    ("_select_kernel", "selection op"), ("triton_tem_fused_flex_attention_backward_12", "flex attention"),
    ("void at_cuda_detail::cub::detail::radix_sort::DeviceRadixSortOnesweepKernel<x>", "sort / scan (index)"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "cuDNN / GEMM"),
    ("triton_poi_fused_clone_0", "elementwise / reductions"), ("Memset (Device)", "copies / fills"),
    ("some_kernel", "other"),
])
def test_kernel_families(kernel, expected):
    assert family(kernel) == expected


def test_floors_scale_with_flops_and_bytes():
    cfg, T = PRESETS["g4"], 4096
    x = {"q": torch.empty(1, T, cfg.n_heads, cfg.head_dim, dtype=torch.bfloat16)}
    rate = {"fwd": 500.0, "fwd+bwd": 400.0}  # TFLOP/s
    sel = floor_ms("sel", cfg, T, "fwd", rate, x)
    assert sel == pytest.approx(nsa_flops(1, T, cfg, ("sel",)) / 500e9)
    assert floor_ms("sel", cfg, T, "fwd+bwd", rate, x) == pytest.approx(sel * 500 / 400 * (1 + BWD_FACTOR))
    one = T * cfg.n_heads * cfg.head_dim * 2
    assert floor_ms("bytes", cfg, T, "fwd", rate, x) == pytest.approx(2 * one / HBM_GBPS / 1e6)
    assert floor_ms("sum", cfg, T, "fwd", rate, x) == pytest.approx(4 * one / HBM_GBPS / 1e6)
    # The selection has no backward, and no floor without dense's rate.
    assert floor_ms("scores", cfg, T, "fwd+bwd", rate, x) is None
    assert floor_ms("cmp", cfg, T, "fwd", {}, x) is None


def test_tables_give_the_ratio_to_the_floor_and_mark_errors():
    rows = [Row(16384, "window branch", "fwd", 0.3, 0.1), Row(16384, "window branch", "fwd+bwd", 1.0, 0.5),
            Row(16384, "selection op", "fwd", None, None, error="OutOfMemoryError")]
    md = markdown(rows)
    assert "| 16384 | window branch | 0.300 | 1.000 | 3.0x | 2.0x |" in md
    assert "| 16384 | selection op | err | - | - | - |" in md
    p = Profile(16384, {"selected op": 2.0, "total": 3.0}, [("_bwd_kernel", 1.5, 2)])
    text = profile_markdown(p)
    assert text.index("| total | 3.000 |") < text.index("| selected op | 2.000 |")
    assert "| `_bwd_kernel` | 1.500 | 2 |" in text
