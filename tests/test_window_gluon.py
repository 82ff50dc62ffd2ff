"""The window op's Gluon dK/dV kernel (nsa_flex/ops/window/gluon_kernels.py).

On CPU: it builds for sm_90a within Hopper's registers and shared memory (tests/sm90_builds.py)
and takes its Triton twin's arguments (the twin's interpreted tests are in
test_window_attention.py). On the GPU (marked gpu): the backward with it against the backward
with the Triton kernel, in the op's gated mode with and without the local-slot term, and in the
plain mode; the window op's and the gated node's oracle tests run through it on an H100 too.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

import nsa_flex.ops.window as window_op
from nsa_flex.ops.window import gluon_kernels, kernels

from sm90_builds import SM90_SHARED_BYTES, build

gpu = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)
needs_gluon = pytest.mark.skipif(not gluon_kernels.HAS_GLUON, reason="needs Triton with Gluon")


def _dkdv_args(G: int, gated: bool, sel: int, dtype=torch.bfloat16, T: int = 1024, Hkv: int = 2, W: int = 512):
    """Positional and constexpr arguments of one launch on CPU tensors of real dtypes and strides,
    as window_op.backward makes them (gated: dO unfolded [B, T, Hq, D])."""
    B, D = 1, 128
    R, Hq = T * G, G * Hkv
    q = torch.zeros(B, Hkv, R, D, dtype=dtype)
    k, v = torch.zeros(B, T, Hkv, D, dtype=dtype), torch.zeros(B, T, Hkv, D, dtype=dtype)
    lse, delta, gate = (torch.zeros(B, Hkv, R) for _ in range(3))
    sel_rows = [torch.zeros(B, Hq, T) for _ in range(3)]
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    if gated:
        do = torch.zeros(B, T, Hq, D, dtype=dtype)
        do_rows = (do.stride(0), G * do.stride(2), do.stride(1), do.stride(2))
    else:
        do = torch.zeros(B, Hkv, R, D, dtype=dtype)
        do_rows = (do.stride(0), do.stride(1), G * do.stride(2), do.stride(2))
    args = (q, k, v, do, lse, delta, dk, dv, gate, *sel_rows, T, R, Hkv, W, D ** -0.5, D ** -0.5 * math.log2(math.e),
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *q.stride()[:3], *do_rows, *sel_rows[0].stride())
    return args, dict(G=G, BM=gluon_kernels.DKDV_ROWS, BN=gluon_kernels.DKDV_KEYS, DK=D, DV=D, GATED=gated, SEL=sel,
                      F32_DOT=False, num_warps=8)


BUILDS = [(4, True, 64, "bfloat16"), (16, True, 64, "float16"), (4, False, 0, "bfloat16"), (1, True, 64, "bfloat16")]

_BUILD = """
import json, torch
from bench.kernel_regs import build_sm90
from nsa_flex.ops.window import gluon_kernels
from test_window_gluon import BUILDS, _dkdv_args
got = {}
for G, gated, sel, dtype in BUILDS:
    args, kwargs = _dkdv_args(G, gated, sel, getattr(torch, dtype))
    got[repr((G, gated, sel, dtype))] = build_sm90(gluon_kernels._dkdv_gluon_kernel, args, kwargs)[1]
print(json.dumps(got))
"""


@pytest.fixture(scope="module")
def sm90_builds() -> dict:
    return build(_BUILD)


@needs_gluon
@pytest.mark.parametrize("G, gated, sel, dtype", BUILDS)
def test_dkdv_gluon_builds_for_sm90(sm90_builds, G, gated, sel, dtype):
    """It compiles for Hopper within one 8-warp program's registers and shared memory (192 KB: one
    program per SM), spilling a few words at most (as built when timed: 16 bytes at G=4 with the
    local-slot term, none without; 20 at G=1)."""
    got = sm90_builds[repr((G, gated, sel, dtype))]
    assert got["registers"] <= 255, got
    assert got["spill_stores"] <= 32, got
    assert 0 < got["shared_bytes"] <= SM90_SHARED_BYTES, got


def test_dkdv_gluon_takes_the_triton_kernels_arguments():
    """window_op.backward launches either kernel from one argument list: same names, same order."""
    if not (gluon_kernels.HAS_GLUON and hasattr(kernels, "_dkdv_kernel")):
        pytest.skip("needs Triton with Gluon")
    names = lambda k: list(inspect.signature(k.fn).parameters)  # noqa: E731
    assert names(gluon_kernels._dkdv_gluon_kernel) == names(kernels._dkdv_kernel)


def test_dkdv_gluon_applies_only_where_written_for():
    """Asked for at D = 128 only; never on CPU tensors, at D = 64 or at groups that are not powers of two."""
    assert window_op.launch_config(128, 128)["kv_gluon"] == 1
    assert window_op.launch_config(64, 64)["kv_gluon"] == 0
    q = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16)
    assert not gluon_kernels.applies(q, q, 4)
    if torch.cuda.is_available():
        x = q.cuda()
        assert not gluon_kernels.applies(x, x, 3)
        assert not gluon_kernels.applies(x[..., :64], x[..., :64], 4)


def _backward_both(T: int, Hkv: int, G: int, dtype, sel: bool, seed: int):
    """The window backward in the gated node's mode (gate, delta, dO unfolded; with sel, the local
    slots' term) with the Gluon and the Triton dK/dV kernel, on one set of inputs."""
    D, W, L = 128, 512, 64
    R, Hq = T * G, Hkv * G
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, Hkv, R, D, device="cuda", generator=gen).to(dtype)
    k, v = (torch.randn(1, T, Hkv, D, device="cuda", generator=gen).to(dtype) for _ in range(2))
    cfg = window_op.launch_config(D, D)
    o, lse, _, _ = window_op.forward(q, k, v, G, W, D ** -0.5, cfg, L)
    do = torch.randn(1, T, Hq, D, device="cuda", generator=gen).to(dtype)
    do_fold = do.view(1, T, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(1, Hkv, R, D)
    delta = (do_fold.float() * o.float()).sum(-1)
    gate = torch.rand(1, Hkv, R, device="cuda", generator=gen)
    by_head = lambda x: x.view(1, Hkv, T, G).permute(0, 1, 3, 2).reshape(1, Hq, T)  # noqa: E731
    sel_rows = (by_head(lse) / math.log2(math.e) + 0.3 * torch.rand(1, Hq, T, device="cuda", generator=gen),
                0.7 * by_head(delta), torch.rand(1, Hq, T, device="cuda", generator=gen), L)
    return [window_op.backward(do, q, k, v, o, lse, G, W, D ** -0.5, {**cfg, "kv_gluon": use}, gate=gate, delta=delta, sel=sel_rows if sel else None) for use in (1, 0)]


def _plain_both(T: int, Hkv: int, G: int, dtype, seed: int):
    """The window op's own backward (no gate: dO folded, delta from O) with the Gluon and the Triton kernels."""
    D, W = 128, 512
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, Hkv, T * G + 5, D, device="cuda", generator=gen).to(dtype)
    k, v = (torch.randn(1, T, Hkv, D, device="cuda", generator=gen).to(dtype) for _ in range(2))
    cfg = window_op.launch_config(D, D)
    o, lse, _, _ = window_op.forward(q, k, v, G, W, D ** -0.5, cfg)
    do = torch.randn(o.shape, device="cuda", generator=gen).to(dtype)
    return [window_op.backward(do, q, k, v, o, lse, G, W, D ** -0.5, {**cfg, "kv_gluon": use}) for use in (1, 0)]


@gpu
@pytest.mark.parametrize("T, Hkv, G, dtype", [
    (3001, 2, 2, torch.bfloat16), (1000, 2, 8, torch.bfloat16), (777, 3, 4, torch.float16), (130, 1, 4, torch.bfloat16),
    (4099, 1, 16, torch.bfloat16), (2048, 2, 1, torch.float16)])
@pytest.mark.parametrize("sel", [False, True], ids=["window", "local-slots"])
def test_dkdv_gluon_against_triton(T, Hkv, G, dtype, sel):
    """dQ is the same kernel's (equal). Without the local-slot term dK and dV equal the Triton
    kernel's bit for bit: the same products, summed in the same order (a 128-row dot adds its rows
    as two 64-row tiles do). With it, dS is p dP - (p delta + p_s delta_s) in both, but the kernels
    compute it from differently fused fp32 arithmetic; a dS element may round to a neighbouring
    16-bit value, a relative 2^-8 of that element, and a gradient sums ~(W + 64) G of them: the
    largest difference stays within 2^-7 of the gradient's largest element and the relative L2
    difference within 2^-10 (measured on an H100: 2^-10 and 2^-15)."""
    x = torch.zeros(1, 1, 1, 128, dtype=dtype, device="cuda")
    if not gluon_kernels.applies(x, x, G):
        pytest.skip("the Gluon kernel runs on Hopper (sm_90) only")
    got, want = _backward_both(T, Hkv, G, dtype, sel, seed=T + G)
    assert torch.equal(got[0], want[0]), "dq"
    _compare(got[1:], want[1:], exact=not sel)


@gpu
@pytest.mark.parametrize("T, Hkv, G, dtype", [(3001, 2, 4, torch.bfloat16), (1000, 1, 16, torch.float16)])
def test_dkdv_gluon_plain_mode_equals_triton(T, Hkv, G, dtype):
    """The window op's own backward (dO folded, delta written by the dQ kernel from O; pad rows of
    q past T * G): dQ, dK and dV equal the Triton kernel's bit for bit."""
    x = torch.zeros(1, 1, 1, 128, dtype=dtype, device="cuda")
    if not gluon_kernels.applies(x, x, G):
        pytest.skip("the Gluon kernel runs on Hopper (sm_90) only")
    got, want = _plain_both(T, Hkv, G, dtype, seed=T)
    _compare(got, want, exact=True)


def _compare(got, want, exact: bool):
    for name, a, b in zip(("dq", "dk", "dv")[-len(got):], got, want):
        assert torch.isfinite(a).all(), name
        if exact:
            assert torch.equal(a, b), f"{name}: largest difference {(a.float() - b.float()).abs().max().item()}"
            continue
        diff = (a.float() - b.float()).abs()
        assert diff.max() <= 2.0 ** -7 * b.float().abs().max(), f"{name}: largest difference {diff.max().item()}"
        assert diff.norm() <= 2.0 ** -10 * b.float().norm(), f"{name}: relative L2 {(diff.norm() / b.float().norm())}"
