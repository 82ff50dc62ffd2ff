"""The window op's Gluon kernels (nsa_flex/ops/window/gluon_kernels.py): dK/dV and the forward.

On CPU: they build for sm_90a within Hopper's registers and shared memory (tests/sm90_builds.py),
and the dK/dV kernel takes its Triton twin's arguments (the twins' interpreted tests are in
test_window_attention.py). On the GPU (marked gpu): the backward with the Gluon dK/dV kernel
against the backward with the Triton one, in the op's gated mode with and without the local-slot
term, and in the plain mode; the forward against the Triton forward, with and without the local
partial; the window op's and the gated node's oracle tests run through both on an H100 too.
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


def _dkdv_args(G: int, gated: bool, sel: int, dtype=torch.bfloat16, T: int = 1024, Hkv: int = 2, W: int = 512,
               D: int = 128):
    """Positional and constexpr arguments of one launch on CPU tensors of real dtypes and strides,
    as window_op.backward makes them (gated: dO and q unfolded [B, T, Hq, D], as the gated node
    gives them)."""
    B = 1
    R, Hq = T * G, G * Hkv
    q = torch.zeros(B, T, Hq, D, dtype=dtype) if gated else torch.zeros(B, Hkv, R, D, dtype=dtype)
    o = torch.zeros(B, Hkv, R, D, dtype=dtype)
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
            *window_op._row_strides(q, G, not gated), *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *do_rows,
            *sel_rows[0].stride())
    BM = window_op.launch_config(D, D)["kv_gluon_BM"]
    return args, dict(G=G, BM=BM, BN=gluon_kernels.DKDV_KEYS, DK=D, DV=D, GATED=gated, SEL=sel,
                      F32_DOT=False, num_warps=BM // 16)


BUILDS = [(4, True, 64, "bfloat16", 128), (16, True, 64, "float16", 128), (4, False, 0, "bfloat16", 128),
          (1, True, 64, "bfloat16", 128), (4, True, 64, "bfloat16", 64), (4, False, 0, "float16", 64)]


def _fwd_args(G: int, local: int, dtype=torch.bfloat16, D: int = 128, T: int = 1024, Hkv: int = 2, W: int = 512):
    """Positional and constexpr arguments of one forward launch on CPU tensors, as window_op.forward
    makes them (the TMA descriptors as the opaque op's body makes them; with a local partial q
    unfolded [B, T, Hq, D], as the gated node gives it, else folded)."""
    from nsa_flex.ops.capped_launch import TmaView, tma_descriptor

    B, BM, BN = 1, gluon_kernels.FWD_ROWS, gluon_kernels.FWD_KEYS
    R = T * G
    q = torch.zeros(B, T, G * Hkv, D, dtype=dtype) if local else torch.zeros(B, Hkv, R, D, dtype=dtype)
    k, v = torch.zeros(B, T, Hkv, D, dtype=dtype), torch.zeros(B, T, Hkv, D, dtype=dtype)
    o, lse = torch.zeros(B, Hkv, R, D, dtype=dtype), torch.zeros(B, Hkv, R)
    o_loc, lse_loc = (torch.zeros_like(o), torch.zeros_like(lse)) if local else (q.new_empty(0), torch.empty(0))
    kv = lambda x: tma_descriptor(TmaView(x, (B * T, Hkv * D), (Hkv * D, 1), (BN, D)))  # noqa: E731
    args = (q, kv(k), kv(v), o, lse, o_loc, lse_loc, T, R, Hkv, W, D ** -0.5 * math.log2(math.e),
            *window_op._row_strides(q, G, not local))
    return args, dict(G=G, BM=BM, BN=BN, D=D, NB=gluon_kernels.FWD_BUFFERS, LOCAL=local, num_warps=4,
                      maxnreg=gluon_kernels.FWD_MAXNREG)


def _dq_args(G: int, sel: int, dtype=torch.bfloat16, T: int = 1024, Hkv: int = 2, W: int = 512, D: int = 128,
             add: bool = False):
    """Positional and constexpr arguments of one gated dQ launch on CPU tensors, as window_op.backward
    makes them (dO and q unfolded [B, T, Hq, D], dQ in q's layout; the TMA descriptors as the opaque
    op's body makes them);
    add: with the grouped compressed call's dQ added (its [B*Hkv, 16 G, T / 16 - 1, D] rows from
    row 15 G on)."""
    from nsa_flex.ops.capped_launch import tma_descriptor

    B = 1
    R, Hq = T * G, G * Hkv
    q = torch.zeros(B, T, Hq, D, dtype=dtype)
    k, v = torch.zeros(B, T, Hkv, D, dtype=dtype), torch.zeros(B, T, Hkv, D, dtype=dtype)
    do, dq = torch.zeros(B, T, Hq, D, dtype=dtype), torch.zeros_like(q)
    lse, delta, gate = (torch.zeros(B, Hkv, R) for _ in range(3))
    sel_rows = [torch.zeros(B, Hq, T) for _ in range(3)]
    do_rows = (do.stride(0), G * do.stride(2), do.stride(1), do.stride(2))
    x = torch.zeros(B * Hkv, T // 16 - 1, 16 * G, D, dtype=dtype).transpose(1, 2)
    [(bh0, n, x, x_args)] = window_op._dq_launches(([(0, x)], 15 * G) if add else None, B * Hkv, lse)
    args = (tma_descriptor(window_op._kv_tiles(k)), tma_descriptor(window_op._kv_tiles(v)), q, do, dq, lse, delta,
            gate, *sel_rows, x, R, T, R, Hkv, W, D ** -0.5, D ** -0.5 * math.log2(math.e), bh0, *x_args[:3],
            *window_op._row_strides(q, G, False), *do_rows, *sel_rows[0].stride(), *x_args[3:])
    return args, dict(G=G, BM=gluon_kernels.FWD_ROWS, BN=gluon_kernels.FWD_KEYS, D=D, NB=gluon_kernels.FWD_BUFFERS,
                      SEL=sel, ADD=add, num_warps=4, maxnreg=gluon_kernels.FWD_MAXNREG)


DQ_BUILDS = [(4, 64, "bfloat16", 128, False), (16, 64, "float16", 128, False), (4, 0, "bfloat16", 128, False),
             (1, 64, "bfloat16", 128, False), (4, 64, "bfloat16", 64, False), (4, 64, "bfloat16", 128, True),
             (16, 64, "bfloat16", 128, True), (4, 64, "bfloat16", 64, True)]


FWD_BUILDS = [(4, 64, "bfloat16", 128), (16, 64, "float16", 128), (4, 0, "bfloat16", 128), (1, 64, "bfloat16", 128),
              (4, 64, "bfloat16", 64)]

_BUILD = """
import json, torch
from bench.kernel_regs import build_sm90
from nsa_flex.ops.window import gluon_kernels
from test_window_gluon import BUILDS, _dkdv_args
got = {}
for G, gated, sel, dtype, D in BUILDS:
    args, kwargs = _dkdv_args(G, gated, sel, getattr(torch, dtype), D=D)
    got[repr((G, gated, sel, dtype, D))] = build_sm90(gluon_kernels._window_dkdv_gluon_kernel, args, kwargs)[1]
from test_window_gluon import FWD_BUILDS, _fwd_args
for G, local, dtype, D in FWD_BUILDS:
    args, kwargs = _fwd_args(G, local, getattr(torch, dtype), D)
    got[repr(("fwd", G, local, dtype, D))] = build_sm90(gluon_kernels._window_fwd_gluon_kernel, args, kwargs)[1]
from test_window_gluon import DQ_BUILDS, _dq_args
for G, sel, dtype, D, add in DQ_BUILDS:
    args, kwargs = _dq_args(G, sel, getattr(torch, dtype), D=D, add=add)
    got[repr(("dq", G, sel, dtype, D, add))] = build_sm90(gluon_kernels._window_dq_gluon_kernel, args, kwargs)[1]
print(json.dumps(got))
"""


@pytest.fixture(scope="module")
def sm90_builds() -> dict:
    return build(_BUILD)


@needs_gluon
@pytest.mark.parametrize("G, gated, sel, dtype, D", BUILDS)
def test_dkdv_gluon_builds_for_sm90(sm90_builds, G, gated, sel, dtype, D):
    """It compiles for Hopper in launch_config's tiles, spilling a few words at most: at D = 128
    128-row tiles, 8 warps, 192 KB (one program per SM; as built when timed: 12 bytes at G=4 with
    the local-slot term, none without); at D = 64 64-row tiles, 4 warps, 64 KB and 255 registers
    or fewer (two programs per SM; 4 bytes with the local-slot term)."""
    got = sm90_builds[repr((G, gated, sel, dtype, D))]
    assert got["registers"] <= 255, got
    assert got["spill_stores"] <= 32, got
    assert 0 < got["shared_bytes"] <= SM90_SHARED_BYTES // (1 if D == 128 else 2), got


@needs_gluon
@pytest.mark.parametrize("G, local, dtype, D", FWD_BUILDS)
def test_fwd_gluon_builds_for_sm90(sm90_builds, G, local, dtype, D):
    """The warp-specialised forward compiles for Hopper at its cap of 128 registers a thread (which
    warp_specialize splits between the loader warp and the warpgroup) without spills, within the
    shared memory of two programs per SM (as built: 90 KB)."""
    got = sm90_builds[repr(("fwd", G, local, dtype, D))]
    assert got["registers"] <= gluon_kernels.FWD_MAXNREG, got
    assert got["spill_stores"] == 0, got
    assert 0 < got["shared_bytes"] <= SM90_SHARED_BYTES // 2, got


@needs_gluon
@pytest.mark.parametrize("G, sel, dtype, D, add", DQ_BUILDS)
def test_dq_gluon_builds_for_sm90(sm90_builds, G, sel, dtype, D, add):
    """The warp-specialised dQ kernel compiles for Hopper at its cap of 128 registers a thread (split
    between the loader warp and the warpgroup), spilling a few words at most (as built: 32 bytes at
    G=4 with the local-slot term, 16 at G=1, none otherwise), within the shared memory of two
    programs per SM (as built: 104 KB)."""
    got = sm90_builds[repr(("dq", G, sel, dtype, D, add))]
    assert got["registers"] <= gluon_kernels.FWD_MAXNREG, got
    assert got["spill_stores"] <= 32, got
    assert 0 < got["shared_bytes"] <= SM90_SHARED_BYTES // 2, got


def test_fwd_gluon_applies_only_where_written_for():
    """Asked for at D = 128 (the launch config; D = 64 runs too when asked); never on CPU tensors; on
    the GPU not at groups that are not powers of two, at other head dims or where a 64-row tile
    could hold tokens of two selection blocks."""
    assert window_op.launch_config(128, 128)["fwd_gluon"] == 1
    assert window_op.launch_config(64, 64)["fwd_gluon"] == 0
    q = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16)
    assert not gluon_kernels.forward_applies(q, q, 4, 64)
    if torch.cuda.is_available() and gluon_kernels.applies(q.cuda(), q.cuda(), 4):
        x = q.cuda()
        assert gluon_kernels.forward_applies(x, x, 4, 64) and gluon_kernels.forward_applies(x, x, 16, 0)
        assert not gluon_kernels.forward_applies(x, x, 3, 64)
        assert gluon_kernels.forward_applies(x[..., :64], x[..., :64], 4, 64)
        assert not gluon_kernels.forward_applies(x[..., :96], x[..., :96], 4, 0)
        assert not gluon_kernels.forward_applies(x, x, 128, 64)  # 64 rows hold half a token
        assert not gluon_kernels.forward_applies(x, x, 1, 32)  # a tile of 64 tokens spans two 32-token blocks


def test_dkdv_gluon_takes_the_triton_kernels_arguments():
    """window_op.backward launches either kernel from one argument list: same names, same order."""
    if not (gluon_kernels.HAS_GLUON and hasattr(kernels, "_dkdv_kernel")):
        pytest.skip("needs Triton with Gluon")
    names = lambda k: list(inspect.signature(k.fn).parameters)  # noqa: E731
    assert names(gluon_kernels._window_dkdv_gluon_kernel) == names(kernels._dkdv_kernel)


def test_dkdv_gluon_applies_only_where_written_for():
    """The dK/dV kernel asked for at D = 128 (128-row tiles) and D = 64 (64-row tiles), the dQ kernel
    at D = 128 (D = 64 runs when asked); never on CPU tensors, at other head dims or at groups that
    are not powers of two."""
    assert window_op.launch_config(128, 128)["kv_gluon"] == window_op.launch_config(128, 128)["dq_gluon"] == 1
    assert window_op.launch_config(64, 64)["kv_gluon"] == 1 and window_op.launch_config(64, 64)["dq_gluon"] == 0
    assert [window_op.launch_config(D, D)["kv_gluon_BM"] for D in (128, 64)] == [128, 64]
    q = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16)
    assert not gluon_kernels.applies(q, q, 4)
    if torch.cuda.is_available() and gluon_kernels.applies(q.cuda(), q.cuda(), 4):
        x = q.cuda()
        assert not gluon_kernels.applies(x, x, 3)
        assert gluon_kernels.applies(x[..., :64], x[..., :64], 4)
        assert not gluon_kernels.applies(x[..., :96], x[..., :96], 4)


def test_dkdv_gluon_rows_outside_its_tiles_rejected():
    """A launch config asking the Gluon dK/dV kernel for a tile height it is not written for fails
    with the heights it takes, on any device (before any kernel is chosen)."""
    q = torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16)
    k = v = torch.zeros(1, 8, 1, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 1, 8)
    cfg = {**window_op.launch_config(64, 64), "kv_gluon": 1, "kv_gluon_BM": 32}
    with pytest.raises(ValueError, match=r"kv_gluon_BM=32; the Gluon dK/dV kernel's tiles take 64 or 128 rows"):
        window_op.backward(q, q, k, v, q, lse, 1, 4, 0.125, cfg)


def _backward_both(T: int, Hkv: int, G: int, dtype, sel: bool, seed: int, key: str = "kv_gluon", pad: int = 0,
                   D: int = 128, rows: int = 128, add: bool = False):
    """The window backward in the gated node's mode (gate, delta, dO unfolded; with sel, the local
    slots' term) with launch_config's `key` (kv_gluon: the dK/dV kernel; dq_gluon: the dQ kernel)
    1 and 0, the other Gluon kernel off, on one set of inputs; q with `pad` rows past T * G; `rows`
    the Gluon dK/dV kernel's tile rows (kv_gluon_BM); add: with rows of another dQ added (the
    grouped compressed call's layout, one part per (b, kv head), from row 15 G on)."""
    W, L = 512, 64
    R, Hq = T * G, Hkv * G
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, Hkv, R + pad, D, device="cuda", generator=gen).to(dtype)
    k, v = (torch.randn(1, T, Hkv, D, device="cuda", generator=gen).to(dtype) for _ in range(2))
    cfg = {**window_op.launch_config(D, D), "kv_gluon": 0, "dq_gluon": 0, "kv_gluon_BM": rows}
    o, lse, _, _ = window_op.forward(q, k, v, G, W, D ** -0.5, cfg, L)
    do = torch.randn(1, T, Hq, D, device="cuda", generator=gen).to(dtype)
    do_fold = do.view(1, T, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(1, Hkv, R, D)
    delta = (do_fold.float() * o.float()).sum(-1)
    gate = torch.rand(1, Hkv, R, device="cuda", generator=gen)
    by_head = lambda x: x.view(1, Hkv, T, G).permute(0, 1, 3, 2).reshape(1, Hq, T)  # noqa: E731
    sel_rows = (by_head(lse) / math.log2(math.e) + 0.3 * torch.rand(1, Hq, T, device="cuda", generator=gen),
                0.7 * by_head(delta), torch.rand(1, Hq, T, device="cuda", generator=gen), L)
    extra = None
    if add:
        Tc = max(1, (T - 16) // 16 + 1)
        x = torch.randn(Hkv, Tc, 16 * G, D, device="cuda", generator=gen).to(dtype).transpose(1, 2)
        extra = ([(i, x[i:i + 1]) for i in range(Hkv)], min(R, 15 * G))
    return [window_op.backward(do, q, k, v, o, lse, G, W, D ** -0.5, {**cfg, key: use}, gate=gate, delta=delta,
                               sel=sel_rows if sel else None, add=extra) for use in (1, 0)]


def _plain_both(T: int, Hkv: int, G: int, dtype, seed: int, D: int = 128):
    """The window op's own backward (no gate: dO folded, delta from O) with the Gluon and the Triton kernels."""
    W = 512
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, Hkv, T * G + 5, D, device="cuda", generator=gen).to(dtype)
    k, v = (torch.randn(1, T, Hkv, D, device="cuda", generator=gen).to(dtype) for _ in range(2))
    cfg = window_op.launch_config(D, D)
    o, lse, _, _ = window_op.forward(q, k, v, G, W, D ** -0.5, cfg)
    do = torch.randn(o.shape, device="cuda", generator=gen).to(dtype)
    return [window_op.backward(do, q, k, v, o, lse, G, W, D ** -0.5, {**cfg, "kv_gluon": use}) for use in (1, 0)]


@gpu
@pytest.mark.parametrize("T, Hkv, G, dtype, D", [
    (3001, 2, 2, torch.bfloat16, 128), (1000, 2, 8, torch.bfloat16, 128), (777, 3, 4, torch.float16, 128),
    (130, 1, 4, torch.bfloat16, 128), (4099, 1, 16, torch.bfloat16, 128), (2048, 2, 1, torch.float16, 128),
    (3001, 3, 4, torch.bfloat16, 64), (1000, 1, 16, torch.float16, 64)])
@pytest.mark.parametrize("sel", [False, True], ids=["window", "local-slots"])
@pytest.mark.parametrize("rows", [128, 64])
def test_dkdv_gluon_against_triton(T, Hkv, G, dtype, D, sel, rows):
    """dQ is the same kernel's (equal). Without the local-slot term dK and dV equal the Triton
    kernel's bit for bit: the same products, summed in the same order (a 128-row dot adds its rows
    as two 64-row tiles do). With it, dS is p dP - (p delta + p_s delta_s) in both, but the kernels
    compute it from differently fused fp32 arithmetic; a dS element may round to a neighbouring
    16-bit value, a relative 2^-8 of that element, and a gradient sums ~(W + 64) G of them: the
    largest difference stays within 2^-7 of the gradient's largest element and the relative L2
    difference within 2^-10 (measured on an H100: 2^-10 and 2^-15)."""
    x = torch.zeros(1, 1, 1, D, dtype=dtype, device="cuda")
    if not gluon_kernels.applies(x, x, G):
        pytest.skip("the Gluon kernel runs on Hopper (sm_90) only")
    got, want = _backward_both(T, Hkv, G, dtype, sel, seed=T + G, D=D, rows=rows)
    assert torch.equal(got[0], want[0]), "dq"
    _compare(got[1:], want[1:], exact=not sel)


@gpu
@pytest.mark.parametrize("T, Hkv, G, dtype, D", [(3001, 2, 4, torch.bfloat16, 128), (1000, 1, 16, torch.float16, 128),
                                                 (3001, 3, 4, torch.bfloat16, 64)])
def test_dkdv_gluon_plain_mode_equals_triton(T, Hkv, G, dtype, D):
    """The window op's own backward (dO folded, delta written by the dQ kernel from O; pad rows of
    q past T * G): dQ, dK and dV equal the Triton kernel's bit for bit."""
    x = torch.zeros(1, 1, 1, D, dtype=dtype, device="cuda")
    if not gluon_kernels.applies(x, x, G):
        pytest.skip("the Gluon kernel runs on Hopper (sm_90) only")
    got, want = _plain_both(T, Hkv, G, dtype, seed=T, D=D)
    _compare(got, want, exact=True)


def _compare(got, want, exact: bool, names=None):
    for name, a, b in zip(names or ("dq", "dk", "dv")[-len(got):], got, want):
        assert torch.isfinite(a).all(), name
        if exact:
            assert torch.equal(a, b), f"{name}: largest difference {(a.float() - b.float()).abs().max().item()}"
            continue
        diff = (a.float() - b.float()).abs()
        assert diff.max() <= 2.0 ** -7 * b.float().abs().max(), f"{name}: largest difference {diff.max().item()}"
        assert diff.norm() <= 2.0 ** -10 * b.float().norm(), f"{name}: relative L2 {(diff.norm() / b.float().norm())}"


@gpu
@pytest.mark.parametrize("B, T, Hkv, G, W, dtype, D", [
    (2, 3001, 2, 4, 512, torch.bfloat16, 128), (1, 1000, 2, 8, 512, torch.bfloat16, 128),
    (1, 777, 3, 2, 128, torch.float16, 128), (2, 130, 1, 4, 512, torch.bfloat16, 128),
    (1, 4099, 1, 16, 512, torch.bfloat16, 128), (1, 2048, 2, 1, 300, torch.float16, 128),
    (1, 5, 1, 16, 512, torch.bfloat16, 128), (1, 1, 2, 4, 512, torch.bfloat16, 128),
    (2, 1500, 3, 4, 512, torch.bfloat16, 64), (1, 333, 2, 16, 200, torch.float16, 64)])
@pytest.mark.parametrize("local", [0, 64], ids=["window", "local-partial"])
def test_fwd_gluon_against_triton(B, T, Hkv, G, W, dtype, D, local):
    """o, lse (and the local partial's o, lse) of the Gluon forward against the Triton forward's on the
    same inputs, q with pad rows past T * G. Both keep the softmax in fp32 and round P to 16 bits
    for the P V dot, but their fp32 arithmetic is fused differently (and at D = 64 the Triton
    kernel walks 32-key blocks, so its running maxima differ): any P element may round to the
    neighbouring 16-bit value, a relative 2^-8 of it. o = sum_j P_j v_j / l then differs by at most
    2^-8 sum_j P_j |v_j| / l (every term off by 2^-8 of itself: the forward of |v|, 1% of slack for
    its own roundings) plus one 16-bit rounding of o (2^-7 of it); lse (fp32, no 16-bit step)
    within 2^-16 relative.
    (Measured on an H100 at these shapes: o within 0.004, lse within 2e-6; the local partial, the
    first blocks' softmax, equal bit for bit at D = 128.)"""
    if local and W < 2 * local:
        pytest.skip("the local partial needs W >= 2 l'")
    x = torch.zeros(1, 1, 1, D, dtype=dtype, device="cuda")
    if not gluon_kernels.forward_applies(x, x, G, local):
        pytest.skip("the Gluon forward runs on Hopper (sm_90) only")
    gen = torch.Generator(device="cuda").manual_seed(T + G)
    q = torch.randn(B, Hkv, T * G + 3, D, device="cuda", generator=gen).to(dtype)
    k, v = (torch.randn(B, T, Hkv, D, device="cuda", generator=gen).to(dtype) for _ in range(2))
    cfg = window_op.launch_config(D, D)
    got, want = (window_op.forward(q, k, v, G, W, D ** -0.5, {**cfg, "fwd_gluon": use}, local) for use in (1, 0))
    names = ("o", "lse", "o_loc", "lse_loc") if local else ("o", "lse")
    o_abs = window_op.forward(q, k, v.abs(), G, W, D ** -0.5, {**cfg, "fwd_gluon": 0}, local)
    for i, (name, a, b) in enumerate(zip(names, got, want)):
        assert a.shape == b.shape and torch.isfinite(a).all(), name
        a, b = a.float(), b.float()
        diff = (a - b).abs()
        if name.startswith("o"):
            bound = 1.01 * 2.0 ** -8 * o_abs[i].float() + 2.0 ** -7 * b.abs()
            assert (diff <= bound).all(), f"{name}: largest difference {diff.max()}, over by {(diff - bound).max()}"
        else:
            assert (diff <= 2.0 ** -16 * (1 + b.abs())).all(), f"{name}: largest difference {diff.max()}"


@gpu
@pytest.mark.parametrize("T, Hkv, G, dtype, D", [
    (3001, 2, 2, torch.bfloat16, 128), (1000, 2, 8, torch.bfloat16, 128), (777, 3, 4, torch.float16, 128),
    (130, 1, 4, torch.bfloat16, 128), (4099, 1, 16, torch.bfloat16, 128), (2048, 2, 1, torch.float16, 128),
    (5, 1, 4, torch.bfloat16, 128), (3001, 3, 4, torch.bfloat16, 64), (1000, 1, 16, torch.float16, 64)])
@pytest.mark.parametrize("sel, add", [(False, False), (True, False), (True, True)],
                         ids=["window", "local-slots", "local-slots-added-rows"])
def test_dq_gluon_against_triton(T, Hkv, G, dtype, D, sel, add):
    """The gated node's dQ from the Gluon kernel against the Triton one's, on the same inputs (q with
    pad rows past T * G, which get zeros in both). Both form dS from the same fp32 quantities, fused
    differently, and round it to 16 bits for the dS K dot: a dS element may land on the neighbouring
    16-bit value, a relative 2^-8 of it, and a dQ element sums ~(W + 64) of them: as for the dK/dV
    kernel, the largest difference within 2^-7 of dQ's largest element and the relative L2
    difference within 2^-10. dK and dV (the dK/dV kernel's, not this one's) equal. With another
    dQ's rows added (the grouped compressed call's) in both before the rounding."""
    x = torch.zeros(1, 1, 1, D, dtype=dtype, device="cuda")
    if not gluon_kernels.applies(x, x, G):
        pytest.skip("the Gluon kernel runs on Hopper (sm_90) only")
    got, want = _backward_both(T, Hkv, G, dtype, sel, seed=T + G, key="dq_gluon", pad=3, D=D, add=add)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), "dk, dv"
    if not add:  # (the added rows reach past T * G)
        assert (got[0][:, :, T * G:] == 0).all(), "pad rows of dq"
    _compare(got[:1], want[:1], exact=False, names=("dq",))


@gpu
@pytest.mark.parametrize("B, T, Hkv, G, D", [(2, 3001, 2, 4, 128), (1, 1000, 1, 16, 128), (1, 777, 3, 4, 64),
                                             (1, 130, 2, 1, 128)])
def test_gluon_launches_read_q_unfolded(B, T, Hkv, G, D):
    """The gated node's launches with q [B, T, Hq, D] read in place (folded=False) against the same
    launches with q folded, launch_config's kernels (Gluon where they apply): o, lse, the local
    partial, dQ (in q's layout), dK and dV equal bit for bit, with the local-slot term and the
    grouped call's dQ rows added."""
    dtype, W, L = torch.bfloat16, 512, 64
    R, Hq = T * G, Hkv * G
    x = torch.zeros(1, 1, 1, D, dtype=dtype, device="cuda")
    if not gluon_kernels.forward_applies(x, x, G, L):
        pytest.skip("the Gluon kernels run on Hopper (sm_90) only")
    gen = torch.Generator(device="cuda").manual_seed(T + G)
    q = torch.randn(B, T, Hq, D, device="cuda", generator=gen).to(dtype)
    q_fold = q.view(B, T, Hkv, G, D).transpose(1, 2).reshape(B, Hkv, R, D)
    k, v = (torch.randn(B, T, Hkv, D, device="cuda", generator=gen).to(dtype) for _ in range(2))
    cfg = window_op.launch_config(D, D)
    fwd = [window_op.forward(xq, k, v, G, W, D ** -0.5, cfg, L, folded=f) for xq, f in ((q_fold, True), (q, False))]
    for name, a, b in zip(("o", "lse", "o_loc", "lse_loc"), *fwd):
        assert torch.equal(a, b), name
    o, lse = fwd[0][:2]
    do = torch.randn(B, T, Hq, D, device="cuda", generator=gen).to(dtype)
    gate, delta = torch.rand(B, Hkv, R, device="cuda", generator=gen), torch.randn(B, Hkv, R, device="cuda")
    by_head = lambda y: y.view(B, Hkv, T, G).permute(0, 1, 3, 2).reshape(B, Hq, T)  # noqa: E731
    sel = (by_head(lse) / math.log2(math.e) + 0.3, 0.7 * by_head(delta), torch.rand(B, Hq, T, device="cuda"), L)
    Tc = max(1, (T - 16) // 16 + 1)
    xa = torch.randn(B * Hkv, Tc, 16 * G, D, device="cuda", generator=gen).to(dtype).transpose(1, 2)
    add = ([(i, xa[i:i + 1]) for i in range(B * Hkv)], min(R, 15 * G))
    bwd = [window_op.backward(do, xq, k, v, o, lse, G, W, D ** -0.5, cfg, gate=gate, delta=delta, sel=sel, add=add,
                              folded=f) for xq, f in ((q_fold, True), (q, False))]
    dq_fold = bwd[0][0][:, :, :R].reshape(B, Hkv, T, G, D).transpose(1, 2).reshape(B, T, Hq, D)
    assert torch.equal(dq_fold, bwd[1][0]), "dq"
    assert torch.equal(bwd[0][1], bwd[1][1]) and torch.equal(bwd[0][2], bwd[1][2]), "dk, dv"
