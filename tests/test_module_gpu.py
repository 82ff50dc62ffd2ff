"""NSAAttention with impl="flex" on CUDA: every gradient against the fp64 reference module, and a
compiled block (as training runs it) against eager.

The module runs the op's branches (in 16 bits the window and selected ones with the gated sum
as one node), then wo in a checkpointed region (NSAAttention._attend_flex): the backward
recomputes the gates, the sum and wo. These tests check that recomputation end to end,
parameters of the gate and wo included.
Run through the device tool; output recorded under docs/records/.
"""

from __future__ import annotations

import copy

import pytest
import torch

from nsa_flex import NSAAttention, NSAConfig
from nsa_flex.model import MODEL_PRESETS, NSALM
from nsa_flex.training.parallel import compile_blocks
from nsa_flex.flex.tuning import install_flex_tuning

pytestmark = pytest.mark.gpu

FP32_FLOOR_ULPS = 16  # as tests/test_flex_gpu.py: flex's fp32 kernels against cuBLAS math


def grads_of(module: NSAAttention, x: torch.Tensor, dy: torch.Tensor) -> dict:
    x = x.detach().clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    y = module(x)
    y.backward(dy.to(y.dtype))
    out = {"y": y.detach(), "x": x.grad.detach()}
    out |= {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [300, 2500])  # 2500: long enough for initial-block copies (two)
def test_module_flex_every_gradient_against_fp64_reference(T, dtype, monkeypatch):
    """fp32 runs the window's Flex call, so three branch outputs and the gated sum in the region;
    16 bits the gated node, whose sum the region makes again (_IntoGatedSum). Tolerance: twice the
    reference module's own error in that dtype, plus 16 fp32 ulps, plus in 16 bits 4 ulps of the
    dtype (of the layer's weight gradient for a bias: its gradient sums thousands of rounded terms,
    and the reference's own sum can land closer by chance)."""
    from nsa_flex import attention

    install_flex_tuning()
    joins = []
    real = attention._IntoGatedSum.apply
    monkeypatch.setattr(attention._IntoGatedSum, "apply", lambda *a: joins.append(a) or real(*a))
    torch.manual_seed(T)
    cfg = NSAConfig(n_heads=8, n_kv_heads=2, head_dim=64, n_selected=4, window=128)
    ref64 = NSAAttention(cfg, 128, impl="reference").to("cuda", torch.float64)
    with torch.no_grad():
        for p in ref64.parameters():
            p.normal_(0.0, 0.05)
    ref_lo = copy.deepcopy(ref64).to(dtype)
    flex_lo = copy.deepcopy(ref_lo)
    flex_lo.impl = "flex"
    x = torch.randn(2, T, 128, device="cuda", dtype=torch.float64)
    dy = torch.randn(2, T, 128, device="cuda", dtype=torch.float64)
    oracle = grads_of(ref64, x, dy)
    lo = grads_of(ref_lo, x.to(dtype), dy)
    ours = grads_of(flex_lo, x.to(dtype), dy)
    assert len(joins) == (dtype != torch.float32), "the gated node ran where it should not, or not"
    assert set(ours) == set(oracle)
    eps = torch.finfo(torch.float32).eps
    print(f"\nT={T} {dtype} {'':10} {'flex err':>10} {'tolerance':>10}")
    bad = {}
    for name, want in oracle.items():
        err = (ours[name].double() - want).abs().max().item()
        scale = want.abs().max().item()
        if dtype != torch.float32 and name.endswith(".bias"):
            # A bias's gradient is a sum over every token of the terms its layer's weight gradient
            # sums too; compress_k's output bias shifts every compressed key alike, which leaves
            # each softmax unchanged: its true gradient is 0, and a 16-bit sum of those terms
            # leaves rounding of their size.
            scale = max(scale, oracle[name[:-len("bias")] + "weight"].abs().max().item())
        floor = FP32_FLOOR_ULPS * eps + (0 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps)
        tol = 2 * (lo[name].double() - want).abs().max().item() + floor * scale
        print(f"{name:32} {err:10.3e} {tol:10.3e}")
        if not err <= tol:
            bad[name] = (err, tol)
    assert not bad, bad


def test_compiled_blocks_match_eager_bf16():
    """A small NSA LM, bf16 autocast: compiled blocks (fullgraph, as `nsa-flex train`) against fp32
    eager, per parameter no further than the eager bf16 run is (relative norm error, derived
    tolerance: 2x eager's own error plus 1e-3)."""
    install_flex_tuning()
    cfg = MODEL_PRESETS["seeds-125m"].replace(n_layers=2, max_seq_len=4096, impl="flex")
    torch.manual_seed(0)
    eager = NSALM(cfg, device="cuda")
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled)
    tokens = torch.randint(0, cfg.vocab_size, (2, 4097), device="cuda")
    grads = {}
    for name, model, low in (("fp32", eager, False), ("eager", eager, True), ("compiled", compiled, True)):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=low):
            loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        grads[name] = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    bad = {}
    print(f"\n{'parameter':40} {'compiled':>10} {'eager':>10}")
    for name, want in grads["fp32"].items():
        rel = {k: ((grads[k][name] - want).norm() / want.norm().clamp_min(1e-30)).item() for k in ("compiled", "eager")}
        print(f"{name:40} {rel['compiled']:10.2e} {rel['eager']:10.2e}")
        if not rel["compiled"] <= 2 * rel["eager"] + 1e-3:
            bad[name] = rel
    assert not bad, bad


def test_training_with_cuda_graphs_matches_without(tmp_path):
    """`nsa-flex train` with its blocks replayed as CUDA graphs (cuda_graphs on; auto on one GPU)
    gives the losses of the same run without them: same kernels, same data. Tolerance: the
    compiled bf16 run's own step-to-step nondeterminism (Flex's backward), 1e-3 relative."""
    from nsa_flex.training.config import build_config
    from nsa_flex.training.train import train

    base = {"preset": "tiny", "steps": 5, "seq_len": 256, "batch_size": 4, "warmup_steps": 2, "data": "kv",
            "resume": "none", "save_checkpoints": False, "tensorboard": False}
    losses = {}
    for graphs in ("on", "off"):
        cfg = build_config({}, {**base, "cuda_graphs": graphs, "out_dir": str(tmp_path / graphs)})
        losses[graphs] = train(cfg).losses
    print(losses)
    assert len(losses["on"]) == 5
    for on, off in zip(losses["on"], losses["off"]):
        assert abs(on - off) <= 1e-3 * abs(off), losses
