"""nsa_flex.training.memory: the exact parts (params, grads, optimizer) against a real model and AdamW (CPU).

Activation and mask terms are estimates; bench/train_gpu.py checks the total against
torch.cuda.max_memory_allocated on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from nsa_flex.training.memory import count_params, estimate, persistent_bytes
from nsa_flex.model import MODEL_PRESETS, NSALM
from nsa_flex.training.optim import build_optimizer

TINY = MODEL_PRESETS["tiny"]


@pytest.fixture(autouse=True)
def fixed_seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("attention", ["nsa", "dense"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_params_grads_optimizer_are_exact(attention, tie):
    config = TINY.replace(attention=attention, tie_embeddings=tie)
    model = NSALM(config, device="cpu")
    optimizer = build_optimizer(model, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, device=torch.device("cpu"))
    tokens = torch.randint(0, config.vocab_size, (2, 64))
    model.loss(tokens, tokens).backward()
    optimizer.step()
    measured = persistent_bytes(model, optimizer)
    est = estimate(config, batch_size=2, seq_len=64, precision="fp32", compiled=False, impl="reference")
    assert (est.params, est.grads, est.optimizer) == (measured["params"], measured["grads"], measured["optimizer"])
    assert count_params(config).total == model.num_params()


def test_estimate_scaling():
    big = MODEL_PRESETS["seeds-125m"]
    dense = [estimate(big.replace(attention="dense"), batch_size=1, seq_len=T).activations for T in (2048, 8192)]
    assert dense[1] == pytest.approx(4 * dense[0], rel=0.01)
    # The flex path's masks are small next to the activations; the reference's grow as T^2.
    flex = estimate(big, batch_size=16, seq_len=2048)
    assert flex.masks < 0.05 * flex.activations
    ref = [estimate(big, batch_size=1, seq_len=T, impl="reference").masks for T in (1024, 2048)]
    assert ref[1] > 3.5 * ref[0]
    ckpt = estimate(big, batch_size=16, seq_len=2048, activation_checkpointing=True)
    assert ckpt.activations < flex.activations / 4
    fsdp = estimate(big, batch_size=16, seq_len=2048, parallel="fsdp", world_size=4)
    assert fsdp.optimizer == pytest.approx(flex.optimizer / 4, rel=1e-6)
    assert estimate(big, batch_size=1, seq_len=2048, precision="fp32").weight_casts == 0
    with pytest.raises(ValueError, match="precision='fp8'"):
        estimate(big, batch_size=1, seq_len=2048, precision="fp8")


def test_block_centric_selected_branch_counts_its_buffers():
    """At G <= 8 the selected branch is block-centric: no BlockMask lists (the selection and the
    saved inverse index instead), a workspace of n bf16
    partials per (token, query head) of one token range: linear in T up to the range, then flat
    (PARTIAL_BYTES); the Flex path and dense attention have none."""
    from nsa_flex.ops.selected_attention.launch import PARTIAL_BYTES

    big = MODEL_PRESETS["seeds-125m"]  # G = 4
    T, n, Hq = 8192, big.nsa.n_selected, big.nsa.n_heads
    block = estimate(big, batch_size=1, seq_len=T)
    flex = estimate(big, batch_size=1, seq_len=T, sel_impl="flex")
    assert flex.workspace == 0 and estimate(big.replace(attention="dense"), batch_size=1, seq_len=T).workspace == 0
    # The selection and, from the gated node, the inverse index its backward reuses (int32 each).
    assert block.masks == big.n_layers * 12 * big.nsa.n_kv_heads * T * n < flex.masks
    # The backward's dQ partials (bf16, n per token and query head) bound it from below.
    assert block.workspace >= 2 * T * Hq * n * big.nsa.head_dim
    assert estimate(big, batch_size=1, seq_len=2 * T).workspace == pytest.approx(2 * block.workspace, rel=0.02)
    # Past one range the partials stop growing: what grows is the index and the fp32 dK/dV sums.
    long = [estimate(big, batch_size=1, seq_len=L).workspace for L in (1 << 16, 1 << 17)]
    assert long[0] < 2 * big.sel_partial_bytes + (1 << 28) and long[1] - long[0] < long[0] / 2
    # The model's budget sets the ranges: at the op's own (PARTIAL_BYTES) 64k takes two ranges.
    op_budget = estimate(big.replace(sel_partial_bytes=PARTIAL_BYTES), batch_size=1, seq_len=1 << 16).workspace
    assert PARTIAL_BYTES < big.sel_partial_bytes and op_budget < long[0] - (512 << 20)
    assert block.total == sum(b for name, b in block.rows() if name != "total")


def test_memory_command():
    from nsa_flex_cli.main import app

    result = CliRunner().invoke(app, ["memory", "--preset", "seeds-125m", "-T", "8192", "-B", "4"])
    assert result.exit_code == 0, result.output
    assert "| total |" in result.output and "128,640,432 parameters" in result.output
    bad = CliRunner().invoke(app, ["memory", "--preset", "nope"])
    assert bad.exit_code == 2 and "unknown preset 'nope'" in bad.output
