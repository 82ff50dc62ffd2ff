"""The selected op's Gluon kernels (nsa_flex/ops/selected_attention/gluon_kernels.py).

Gluon kernels do not run under Triton's CPU interpreter. On CPU: each kernel builds for sm_90a
(Triton ships ptxas) within Hopper's registers and shared memory, and takes its Triton twin's
arguments (the op launches either from one argument list; the twins' interpreted tests are in
test_selected_attention.py). On the GPU (marked gpu): the backward
with the Gluon kernel equals the one with the Triton kernel bit for bit, in every mode of the
block sums, and the selected op's fp64-oracle tests run through it on an H100.
"""

from __future__ import annotations

import pytest
import torch

from nsa_flex.ops.selected_attention import gluon_kernels, kernels, launch

from sm90_builds import SM90_SHARED_BYTES, build
from test_selected_attention import make_config, make_inputs, random_selection

gpu = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)
needs_gluon = pytest.mark.skipif(not gluon_kernels.HAS_GLUON, reason="needs Triton with Gluon")


def _bwd_args(G: int, gated: bool, dtype=torch.bfloat16, modes=(False, False, False), T: int = 256, Hkv: int = 2,
              n: int = 16, D: int = 128):
    """Grid, positional and constexpr arguments of one launch on CPU tensors of real dtypes and
    strides (modes: SUMS, ADD, ACC), in the chunks launch_config gives head dim D."""
    B, BL = 1, 64
    rows = launch.launch_config(G, D, D, dtype)["bwd_BT"] * G
    assert rows in gluon_kernels.BWD_ROWS
    Hq, BT = G * Hkv, rows // G
    q, do = torch.zeros(B, T, Hq, D, dtype=dtype), torch.zeros(B, T, Hq, D, dtype=dtype)
    k, v = torch.zeros(B, T, Hkv, D, dtype=dtype), torch.zeros(B, T, Hkv, D, dtype=dtype)
    lse, delta, gate = (torch.zeros(B, Hq, T) for _ in range(3))
    dqp = torch.zeros(B, T, Hq, n, D, dtype=dtype)
    W, Nv = 8, T // BL
    dkp, dvp = torch.zeros(W, BL, D), torch.zeros(W, BL, D)
    entries = torch.zeros(T * n, dtype=torch.int32)
    items = [torch.zeros(W, dtype=torch.int32) for _ in range(3)]
    bounds = [torch.zeros(Nv, dtype=torch.int32) for _ in range(2)]
    n_items = torch.zeros(B * Hkv * Nv, dtype=torch.int32)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    # The sums [B, Ts, Hkv, D]: the keys of the blocks before the last range (launch.sum_tokens).
    dk_sum, dv_sum = torch.zeros(B, T // 2, Hkv, D), torch.zeros(B, T // 2, Hkv, D)
    args = (q, k, v, do, lse, delta, gate, dqp, dkp, dvp, entries, *items, *bounds, n_items, dk, dv, dk_sum, dv_sum,
            Hkv, Nv, 0, T, D ** -0.5, q.stride(0), q.stride(1), G * q.stride(2), q.stride(2), *k.stride()[:3],
            *v.stride()[:3], *do.stride()[:3], *lse.stride(), *dqp.stride()[:4], *dk.stride()[:3], *dv.stride()[:3],
            *dk_sum.stride()[:3], *dv_sum.stride()[:3])
    sums, add, acc = modes
    return (W,), args, dict(N=n, G=G, GP=G, BT=BT, BL=BL, DK=D, DKP=D, DV=D, DVP=D, F32_DOT=False, IEEE=False,
                            SUMS=sums, ADD=add, ACC=acc, GATED=gated, num_warps=rows // 16)


def _fwd_args(G: int, dtype=torch.bfloat16, capped: bool = True, T: int = 256, Hkv: int = 2, n: int = 16,
              D: int = 128):
    """Grid, positional and constexpr arguments of one forward launch on CPU tensors."""
    B, BL = 1, 64
    Hq, BT = G * Hkv, gluon_kernels.FWD_ROWS // G
    q = torch.zeros(B, T, Hq, D, dtype=dtype)
    k, v = torch.zeros(B, T, Hkv, D, dtype=dtype), torch.zeros(B, T, Hkv, D, dtype=dtype)
    po, plse = torch.zeros(B, T, Hq, n, D, dtype=dtype), torch.zeros(B, T, Hq, n)
    W, Nv = 8, T // BL
    entries = torch.zeros(T * n, dtype=torch.int32)
    items = [torch.zeros(W, dtype=torch.int32) for _ in range(3)]
    bounds = [torch.zeros(Nv, dtype=torch.int32) for _ in range(2)]
    args = (q, k, v, po, plse, entries, *items, *bounds, Hkv, Nv, 0, D ** -0.5, q.stride(0), q.stride(1),
            G * q.stride(2), q.stride(2), *k.stride()[:3], *v.stride()[:3], *po.stride()[:4], *plse.stride()[:3])
    cap = launch.launch_config(G, D, D, dtype, launch.LONG_FROM_TOKENS)["fwd_maxnreg"] if capped else 0
    return (W,), args, dict(N=n, G=G, GP=G, BT=BT, BL=BL, DK=D, DKP=D, DV=D, DVP=D, F32_DOT=False, IEEE=False,
                            LATE_ROWS=D <= 64, num_warps=4, **({"maxnreg": cap} if cap else {}))


FWD_BUILDS = [(4, True, 128), (16, False, 128), (4, False, 64), (4, True, 64), (16, True, 64)]
BWD_BUILDS = [(4, False, "bfloat16", (False, False, False), 128), (4, True, "bfloat16", (True, True, True), 128),
              (16, False, "float16", (True, False, False), 128), (4, False, "bfloat16", (True, False, False), 64),
              (4, True, "bfloat16", (True, True, True), 64)]

_BUILD = """
import json, torch
from bench.kernel_regs import build_sm90
from nsa_flex.ops.selected_attention import gluon_kernels
from test_selected_gluon import BWD_BUILDS, FWD_BUILDS, _bwd_args, _fwd_args
got = {}
for G, capped, D in FWD_BUILDS:
    _, args, kwargs = _fwd_args(G, capped=capped, D=D)
    got[repr(("fwd", G, capped, D))] = build_sm90(gluon_kernels._fwd_gluon_kernel, args, kwargs)[1]
for G, gated, dtype, modes, D in BWD_BUILDS:
    _, args, kwargs = _bwd_args(G, gated, getattr(torch, dtype), modes, D=D)
    got[repr(("bwd", G, gated, dtype, modes, D))] = build_sm90(gluon_kernels._bwd_gluon_kernel, args, kwargs)[1]
print(json.dumps(got))
"""


@pytest.fixture(scope="module")
def sm90_builds() -> dict:
    """Every case's resources, built for sm_90a in one subprocess (tests/sm90_builds.py)."""
    return build(_BUILD)


@needs_gluon
@pytest.mark.parametrize("G, capped, D", FWD_BUILDS)
def test_gluon_forward_builds_for_sm90(sm90_builds, G, capped, D):
    """The forward compiles for Hopper within launch_config's register cap from 32k tokens on (168
    at D=128: three programs per SM, as the Triton forward; 128 at D=64, with the next chunks' row
    ids read late: four) with no spill, in ~68 KB of shared memory (36 KB at D=64)."""
    got = sm90_builds[repr(("fwd", G, capped, D))]
    assert got["spill_stores"] == 0, got
    assert got["registers"] <= ((168 if D == 128 else 128) if capped else 255), got
    assert 0 < got["shared_bytes"] <= SM90_SHARED_BYTES // (3 if D == 128 else 4), got


@needs_gluon
@pytest.mark.parametrize("G, gated, dtype, modes, D", BWD_BUILDS)
def test_gluon_backward_builds_for_sm90(sm90_builds, G, gated, dtype, modes, D):
    """It compiles for Hopper within one program's shared memory, spilling a few words at most
    (255 registers and ~200 KB: one 8-warp program per SM, as the Triton kernel; its earlier forms
    that spilled 80-96 bytes were slower). At D=64: 4 warps for 64-row chunks, ~68 KB. With the
    next chunks' row ids read under the dots, none of these builds spills (they spilled 4-24 bytes
    with those reads before the scores' dots)."""
    got = sm90_builds[repr(("bwd", G, gated, dtype, modes, D))]
    assert got["spill_stores"] <= 32, got
    assert 0 < got["shared_bytes"] <= SM90_SHARED_BYTES, got
    assert got["registers"] <= 255, got


def test_gluon_applies_only_where_written_for():
    """Not on CPU tensors, nor at other head dims or chunk shapes (the kernel's layouts are fixed);
    16-bit launch settings at both head dims give chunks the kernels are written for."""
    q = torch.zeros(1, 8, 4, 128, dtype=torch.bfloat16)
    assert not gluon_kernels.applies(q, q, 64)
    for D in gluon_kernels.HEAD_DIMS:
        tiles = launch.launch_config(4, D, D, torch.bfloat16)
        assert tiles["fwd_gluon"] == tiles["bwd_gluon"] == 1
        assert tiles["fwd_BT"] * 4 == gluon_kernels.FWD_ROWS and tiles["bwd_BT"] * 4 in gluon_kernels.BWD_ROWS


@pytest.mark.parametrize("gluon, triton", [("_fwd_gluon_kernel", "_fwd_kernel"), ("_bwd_gluon_kernel", "_bwd_kernel")])
def test_gluon_kernels_take_the_triton_kernels_arguments(gluon, triton):
    """The forward and the backward launch either kernel from one argument list: same names, same
    order; the Gluon forward adds one constexpr of its own at the end (LATE_ROWS, which only its
    launch passes)."""
    import inspect

    if not (gluon_kernels.HAS_GLUON and hasattr(kernels, triton)):
        pytest.skip("needs Triton with Gluon")
    names = lambda k: list(inspect.signature(k.fn).parameters)  # noqa: E731
    own = ["LATE_ROWS"] if gluon == "_fwd_gluon_kernel" else []
    assert names(getattr(gluon_kernels, gluon)) == names(getattr(kernels, triton)) + own


def _forward_both(G: int, T: int, dtype, range_tokens: int, D: int = 128):
    cfg = make_config(G, D, D, 16, 64)
    q, k, v, _ = make_inputs(1, T, cfg, dtype, seed=G + T, device="cuda")
    bi = random_selection(1, cfg.n_kv_heads, T, 16, 64, seed=G, drop=0.1).cuda()
    return [launch.forward(q, k, v, bi, None, D ** -0.5, 64, {"fwd_gluon": use, "range_tokens": range_tokens})
            for use in (1, 0)]


@gpu
@pytest.mark.parametrize("G, T, dtype, range_tokens, long, D", [
    (4, 3000, torch.bfloat16, 0, False, 128), (4, 3000, torch.bfloat16, 1024, True, 128),
    (16, 2000, torch.bfloat16, 512, True, 128), (2, 1500, torch.float16, 0, False, 128),
    (8, 4100, torch.bfloat16, 1024, False, 128), (4, 3000, torch.bfloat16, 1024, False, 64),
    (2, 1500, torch.float16, 0, False, 64), (16, 2000, torch.bfloat16, 512, False, 64),
    (4, 3000, torch.bfloat16, 1024, True, 64)])
def test_gluon_forward_equals_triton(G, T, dtype, range_tokens, long, D, monkeypatch):
    """o and lse with the Gluon forward equal the Triton kernel's bit for bit, with one token
    range or several, rows with fewer blocks, and the register cap of long sequences (its
    launches then go through the opaque op with maxnreg)."""
    x = torch.zeros(1, 1, 1, 128, dtype=dtype, device="cuda")
    if not gluon_kernels.applies(x, x, 64):
        pytest.skip("the Gluon kernels run on Hopper (sm_90) only")
    if long:
        monkeypatch.setattr(launch, "LONG_FROM_TOKENS", 1)
    got, want = _forward_both(G, T, dtype, range_tokens, D)
    for name, a, b in zip(("o", "lse"), got, want):
        assert torch.equal(a, b), f"{name}: largest difference {(a.float() - b.float()).abs().max().item()}"


def _backward_both(G: int, T: int, dtype, gated: bool, with_acc: bool, range_tokens: int, D: int = 128):
    cfg = make_config(G, D, D, 16, 64)
    q, k, v, do = make_inputs(1, T, cfg, dtype, seed=G + T, device="cuda")
    bi = random_selection(1, cfg.n_kv_heads, T, 16, 64, seed=G, drop=0.0).cuda()
    gen = torch.Generator(device="cuda").manual_seed(T)
    o = torch.randn(q.shape, dtype=dtype, device="cuda", generator=gen)
    lse = torch.rand(1, cfg.n_heads, T, device="cuda", generator=gen) + 3
    gate = torch.rand(1, cfg.n_heads, T, device="cuda", generator=gen) if gated else None
    delta = torch.randn(1, cfg.n_heads, T, device="cuda", generator=gen) if gated else None
    acc = tuple(torch.randn(x.shape, dtype=x.dtype, device="cuda", generator=gen) for x in (q, k, v))
    out = []
    for use in (1, 0):
        tiles = {"bwd_gluon": use, "range_tokens": range_tokens}
        out.append(launch.backward(do, q, k, v, o, lse, bi, None, D ** -0.5, 64, tiles, gate=gate, delta=delta,
                                   acc=tuple(x.clone() for x in acc) if with_acc else None))
    return out


@gpu
@pytest.mark.parametrize("G, T, dtype, gated, with_acc, range_tokens, D", [
    (4, 3000, torch.bfloat16, False, False, 0, 128), (4, 3000, torch.bfloat16, True, True, 1024, 128),
    (16, 2000, torch.bfloat16, True, False, 512, 128), (2, 1500, torch.float16, False, True, 0, 128),
    (8, 4100, torch.bfloat16, False, False, 1024, 128), (4, 3000, torch.bfloat16, False, False, 1024, 64),
    (4, 3000, torch.bfloat16, True, True, 0, 64), (16, 2000, torch.float16, False, True, 512, 64),
])
def test_gluon_backward_equals_triton(G, T, dtype, gated, with_acc, range_tokens, D):
    """dq, dk, dv with the Gluon kernel equal the Triton kernel's bit for bit (the same dots,
    roundings and sums), with one token range or several (the fp32 sums across ranges), gated
    or not, into fresh gradients or added to given ones (acc)."""
    x = torch.zeros(1, 1, 1, 128, dtype=dtype, device="cuda")
    if not gluon_kernels.applies(x, x, 64):
        pytest.skip("the Gluon kernel runs on Hopper (sm_90) only")
    got, want = _backward_both(G, T, dtype, gated, with_acc, range_tokens, D)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), f"{name}: largest difference {(a.float() - b.float()).abs().max().item()}"
