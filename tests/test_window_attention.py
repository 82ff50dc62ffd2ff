"""nsa_flex::window_attention: the torch twin and the Triton kernels (under Triton's interpreter on
CPU, or on CUDA) against the reference's window branch in fp64, causality, the op's checks,
opcheck and a fullgraph compile.

The oracle is nsa_flex.reference's attention under its window mask, on the unfolded queries,
differentiated by autograd; the tolerance is derived as in test_selected_attention (2x the
same computation's error in the inputs' dtype, plus rounding floors).
"""

from __future__ import annotations

import math

import pytest
import torch

from interpreter import QUIET_NUMPY, interpreter_mark, interpreter_skip
from nsa_flex import reference
from nsa_flex.folded import fold, unfold
from nsa_flex.ops import window as window_op
from nsa_flex.ops.window import kernels, window_and_local, window_attention

gpu = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)
interpreter = interpreter_mark(getattr(kernels, "_fwd_kernel", None))


def make_inputs(B, T, Hkv, G, Dk, Dv, dtype, extra=0, seed=0, device="cpu"):
    """(q folded [B, Hkv, T*G + extra, Dk] with zero pad rows, k, v, dO folded)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hkv * G, Dk, generator=g)
    k, v = torch.randn(B, T, Hkv, Dk, generator=g), torch.randn(B, T, Hkv, Dv, generator=g)
    do = torch.randn(B, Hkv, T * G, Dv, generator=g)
    q_fold = fold(q, Hkv, rows=T * G + extra)
    return [x.to(device=device, dtype=dtype) for x in (q_fold, k, v, do)]


def oracle(q, k, v, do, G, W, dtype):
    """(o, dq, dk, dv) of the reference's window attention in `dtype`: o and dq folded as q."""
    q, k, v, do = (x.detach().to(dtype).requires_grad_() for x in (q, k, v, do))
    T = k.shape[1]
    t = torch.arange(T, device=q.device)
    mask = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - W)
    q_bhtd = unfold(q[:, :, :T * G], T).transpose(1, 2)
    o, _ = reference._attend(q_bhtd, reference._heads(k, G, dtype), reference._heads(v, G, dtype), mask,
                             q.shape[-1] ** -0.5)
    o = fold(o.transpose(1, 2), k.shape[2])
    return (o.detach(), *torch.autograd.grad(o, (q, k, v), do))


def run_op(q, k, v, do, G, W, impl):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = window_attention(q, k, v, G, W, impl=impl)
    return (o.detach(), *torch.autograd.grad(o, (q, k, v), do))


def check(got, q, k, v, do, G, W):
    """got = (o, dq, dk, dv) against the fp64 oracle: within 2x the dtype's own error + rounding floors."""
    dtype = q.dtype
    want = oracle(q, k, v, do, G, W, torch.float64)
    low = oracle(q, k, v, do, G, W, dtype)
    big = {name: x.abs().max().item() for name, x in zip("qkvd", (q, k, v, do))}
    ds = big["d"] * big["v"] * q.shape[-1] ** -0.5
    for name, x, w, lo, m in zip(("o", "dq", "dk", "dv"), got, want, low,
                                 (big["v"], ds * big["k"], ds * big["q"], big["d"])):
        assert x.dtype == dtype and x.shape == w.shape, name
        err = (x.double() - w.double()).abs().max().item()
        ref_err = (lo.double() - w.double()).abs().max().item()
        bound = 2 * ref_err + torch.finfo(dtype).eps / 2 * w.abs().max().item() + 16 * 2.0 ** -24 * m
        assert math.isfinite(err) and err <= bound, f"{name}: error {err:.3e} > bound {bound:.3e}"


@pytest.fixture
def poisoned(monkeypatch):
    """The kernels' buffers start as NaN: any element read before written shows up."""
    real = torch.empty

    def empty(*args, **kwargs):
        return real(*args, **kwargs).fill_(math.nan)

    def empty_like(*args, **kwargs):
        return torch.full_like(*args, math.nan, **kwargs)

    monkeypatch.setattr(window_op.torch, "empty", empty)
    monkeypatch.setattr(window_op.torch, "empty_like", empty_like)


TWIN_CASES = [  # B, T, Hkv, G, Dk, Dv, W, extra
    pytest.param(1, 1, 1, 1, 16, 16, 512, 0, id="T1"),
    pytest.param(2, 63, 2, 4, 32, 24, 16, 3, id="G4-W16-pad"),
    pytest.param(1, 300, 1, 3, 16, 32, 100, 0, id="G3-Dv-wider-chunks"),
    pytest.param(1, 111, 1, 16, 16, 16, 1, 0, id="G16-W1"),
]


@pytest.mark.parametrize("B,T,Hkv,G,Dk,Dv,W,extra", TWIN_CASES)
def test_twin_matches_reference(B, T, Hkv, G, Dk, Dv, W, extra):
    q, k, v, do = make_inputs(B, T, Hkv, G, Dk, Dv, torch.float64, extra, seed=1)
    got = run_op(q, k, v, do, G, W, "torch")
    want = oracle(q, k, v, do, G, W, torch.float64)
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10, msg=name)
    assert torch.equal(got[1][:, :, T * G:], torch.zeros_like(got[1][:, :, T * G:]))


KERNEL_CASES = [  # B, T, Hkv, G, Dk, Dv, W, extra, dtype
    pytest.param(1, 150, 2, 4, 64, 64, 40, 0, torch.float32, id="G4-W40-fp32"),
    pytest.param(2, 77, 1, 3, 64, 128, 20, 5, torch.float32, id="G3-Dv128-pad-B2"),
    pytest.param(1, 200, 1, 1, 128, 64, 130, 0, torch.float32, id="G1-Dk128-W130"),
    pytest.param(1, 45, 1, 16, 64, 64, 512, 0, torch.bfloat16, id="G16-W-past-T-bf16"),
    pytest.param(1, 70, 2, 2, 64, 64, 1, 2, torch.float16, id="G2-W1-fp16"),
]


@interpreter
@pytest.mark.parametrize("B,T,Hkv,G,Dk,Dv,W,extra,dtype", KERNEL_CASES)
def test_kernels_interpreted(B, T, Hkv, G, Dk, Dv, W, extra, dtype, poisoned):
    q, k, v, do = make_inputs(B, T, Hkv, G, Dk, Dv, dtype, extra, seed=2)
    got = run_op(q, k, v, do, G, W, "triton")
    check(got, q, k, v, do, G, W)
    # dQ of the rows past T*G: exact zeros (the buffers started as NaN).
    assert torch.equal(got[1][:, :, T * G:], torch.zeros_like(got[1][:, :, T * G:]))


@interpreter
def test_backward_adds_another_gradient_of_the_rows_interpreted(poisoned):
    """backward(add=...) (the gated node's grouped compressed dQ): dQ plus the added rows, row
    head + s * dG + j of (b, kv head) bh0 + i being X[i, j, s], the same whether X comes in one part
    or per (b, kv head), within one rounding of the sum made after (dQ is rounded once, not twice);
    rows outside [head, head + Tc * dG) and dK / dV as without it."""
    B, T, Hkv, G, D, W = 2, 40, 2, 4, 32, 24
    q, k, v, do = make_inputs(B, T, Hkv, G, D, D, torch.float32, extra=5, seed=4)
    o, lse, *_ = window_op.forward(q, k, v, G, W, D ** -0.5, window_op.launch_config(D, D))
    cfg = window_op.launch_config(D, D)
    head, dG, Tc = 7, 8, 18  # rows 7 .. 150 of the 165
    x = torch.randn(B * Hkv, Tc, dG, D, generator=torch.Generator().manual_seed(5)).transpose(1, 2)
    plain = window_op.backward(do, q, k, v, o, lse, G, W, D ** -0.5, cfg)
    one = window_op.backward(do, q, k, v, o, lse, G, W, D ** -0.5, cfg, add=([(0, x)], head))
    split = window_op.backward(do, q, k, v, o, lse, G, W, D ** -0.5, cfg,
                               add=([(i, x[i:i + 1]) for i in range(B * Hkv)], head))
    for a, b in zip(one, split):
        assert torch.equal(a, b)
    want = plain[0].clone().view(B * Hkv, -1, D)
    want[:, head:head + Tc * dG] += x.transpose(1, 2).reshape(B * Hkv, Tc * dG, D)
    want = want.view_as(plain[0])
    assert (one[0] - want).abs().max() <= 4 * torch.finfo(torch.float32).eps * want.abs().max()
    assert torch.equal(one[0][:, :, :head], plain[0][:, :, :head])
    assert torch.equal(one[0][:, :, head + Tc * dG:], plain[0][:, :, head + Tc * dG:])
    assert torch.equal(one[1], plain[1]) and torch.equal(one[2], plain[2])
    with pytest.raises(ValueError, match="cover 3 .* of 4"):
        window_op.backward(do, q, k, v, o, lse, G, W, D ** -0.5, cfg, add=([(0, x[:3])], head))


@interpreter
@pytest.mark.parametrize("G, LB", [(4, 32), (3, 32)], ids=["G4", "G3-tiles-cross-blocks"])
def test_launches_read_q_unfolded_interpreted(G, LB, poisoned):
    """forward / backward(folded=False) read q [B, T, Hq, D] in place (the gated node's q) and give
    dQ in that layout: o, lse, the local partial, dQ (unfolded), dK and dV equal the folded q's bit
    for bit, in the gated mode with the local-slot term and another dQ's rows added (the node's
    backward), B = 2 so that batch strides differ from the folded ones."""
    B, T, Hkv, D, W = 2, 100, 2, 32, 64
    R, Hq = T * G, Hkv * G
    q, k, v, _ = make_inputs(B, T, Hkv, G, D, D, torch.float32, seed=6)
    q_btd = unfold(q, T).contiguous()
    cfg = window_op.launch_config(D, D)
    cfg = {**cfg, "fwd_BN": 16, "dq_BN": 16}
    fwd = [window_op.forward(x, k, v, G, W, D ** -0.5, cfg, LB, folded=f) for x, f in ((q, True), (q_btd, False))]
    for name, a, b in zip(("o", "lse", "o_loc", "lse_loc"), *fwd):
        assert torch.equal(a, b), name
    o, lse = fwd[0][:2]
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(B, T, Hq, D, generator=gen)
    gate, delta = torch.rand(B, Hkv, R, generator=gen), torch.randn(B, Hkv, R, generator=gen)
    sel = (torch.randn(B, Hq, T, generator=gen), torch.randn(B, Hq, T, generator=gen),
           torch.rand(B, Hq, T, generator=gen), LB)
    x = torch.randn(B * Hkv, 12, 8 * G, D, generator=gen).transpose(1, 2)
    add = ([(0, x)], 5)
    bwd = [window_op.backward(do, xq, k, v, o, lse, G, W, D ** -0.5, cfg, gate=gate, delta=delta, sel=sel, add=add,
                              folded=f) for xq, f in ((q, True), (q_btd, False))]
    assert bwd[1][0].shape == q_btd.shape and torch.equal(unfold(bwd[0][0], T), bwd[1][0]), "dq"
    assert torch.equal(bwd[0][1], bwd[1][1]) and torch.equal(bwd[0][2], bwd[1][2]), "dk, dv"
    assert bwd[0][0].abs().max() > 0 and bwd[0][1].abs().max() > 0


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=[
    pytest.mark.skipif(interpreter_skip(getattr(kernels, "_fwd_kernel", None)) is not None, reason="interpreter"),
    QUIET_NUMPY])])
@pytest.mark.parametrize("local", [0, 32], ids=["window", "window-and-local"])
def test_op_reads_q_unfolded(impl, local):
    """The public op with folded=False (q [B, T, Hq, D], as the forward without gradients gives it):
    o, the local partial and every gradient equal the folded q's bit for bit (dQ unfolded), B = 2,
    the twin in fp64 and the kernels under the interpreter in fp32."""
    dtype = torch.float64 if impl == "torch" else torch.float32
    q, k, v, _, _ = reads_q_unfolded(impl, local, 2, 100, 2, 4, 64, 64, dtype, "cpu")
    with pytest.raises(ValueError, match="expected \\[2, 100, 8, 64\\]"):
        window_attention(q, k, v, 4, 64, impl=impl, folded=False)


@gpu
@pytest.mark.parametrize("local", [0, 64], ids=["window", "window-and-local"])
@pytest.mark.parametrize("T, G, D", [(1000, 4, 128), (777, 16, 128), (1000, 3, 64)])
def test_op_reads_q_unfolded_gpu(T, G, D, local):
    """As test_op_reads_q_unfolded with the CUDA kernels in bf16 at the op's window (512): the
    in-place launches equal the folded ones bit for bit, and the folded ones the fp64 oracle."""
    q, k, v, do, got = reads_q_unfolded("auto", local, 2, T, 2, G, D, 512, torch.bfloat16, "cuda")
    check((got[0], *got[3:]), q, k, v, do, G, 512)


def reads_q_unfolded(impl, local, B, T, Hkv, G, D, W, dtype, device):
    """Runs the op on folded q and on q [B, T, Hq, D] in place; asserts every output and gradient
    equal (dQ unfolded). Returns the folded q, k, v, dO and the folded run's (o, o_loc, lse_loc, dq,
    dk, dv)."""
    q, k, v, do = make_inputs(B, T, Hkv, G, D, D, dtype, seed=8, device=device)
    q_btd = unfold(q, T).contiguous()

    def run(x, folded):
        x, kk, vv = (t.detach().clone().requires_grad_() for t in (x, k, v))
        if local:
            o, o_loc, lse_loc = window_and_local(x, kk, vv, G, W, local, impl=impl, folded=folded)
        else:
            o, o_loc, lse_loc = window_attention(x, kk, vv, G, W, impl=impl, folded=folded), None, None
        return (o, o_loc, lse_loc, *torch.autograd.grad(o, (x, kk, vv), do))

    a, b = run(q, True), run(q_btd, False)
    for name, x, y in zip(("o", "o_loc", "lse_loc", "dq", "dk", "dv"), a, b):
        if name == "dq":
            x = unfold(x, T)
        assert (x is None and y is None) or torch.equal(x, y), name
    assert a[3].abs().max() > 0
    return q, k, v, do, a


SMALL_TILES = [  # (G, row tiles, fwd / dq key blocks, dK/dV key blocks)
    pytest.param(3, 32, 16, 32, id="G3-rows-split-tokens"),
    # One token per 16-row tile: tiles start at every token, so every edge of the loops' parts occurs.
    pytest.param(16, 16, 16, 16, id="G16-token-tiles"),
]


@interpreter
@pytest.mark.parametrize("G, BM, BN, kv_BN", SMALL_TILES)
def test_kernels_interpreted_other_tiles(G, BM, BN, kv_BN, poisoned):
    """Smaller tiles than launch_config's: row tiles that split a token's heads, and tiles of one token."""
    cfg = {"fwd_BM": BM, "fwd_BN": BN, "fwd_warps": 4, "fwd_stages": 1, "dq_BM": BM, "dq_BN": BN, "dq_warps": 4,
           "dq_stages": 1, "kv_BM": 16, "kv_BN": kv_BN, "kv_warps": 4, "kv_stages": 1}
    q, k, v, do = make_inputs(1, 90, 1, G, 64, 64, torch.float32, 4, seed=3)
    scale = 64 ** -0.5
    for W in (50, 48):
        o, lse, _, _ = window_op.forward(q, k, v, G, W, scale, cfg)
        check((o, *window_op.backward(do, q, k, v, o, lse, G, W, scale, cfg)), q, k, v, do, G, W)


@interpreter
@pytest.mark.parametrize("W", [15, 16, 17, 63, 64, 65, 127, 128])
def test_kernels_interpreted_window_edges(W):
    """Windows just under, at and past multiples of the tiles: the loops' whole and cut parts meet
    at the window's start and at the diagonal, one key or one token either way."""
    q, k, v, do = make_inputs(1, 260, 1, 4, 64, 64, torch.float32, seed=W)
    check(run_op(q, k, v, do, 4, W, "triton"), q, k, v, do, 4, W)


@interpreter
def test_kernels_interpreted_causal():
    """Keys after a token or W and more before it change nothing of its output or its dQ."""
    T, G, W = 96, 2, 24
    q, k, v, do = make_inputs(1, T, 1, G, 64, 64, torch.float32, seed=4)
    t = 50
    k2, v2 = k.clone(), v.clone()
    for x in (k2, v2):
        x[:, t + 1:] = 7.0
        x[:, :t - W + 1] = -5.0
    a, b = run_op(q, k, v, do, G, W, "triton"), run_op(q, k2, v2, do, G, W, "triton")
    rows = slice(t * G, (t + 1) * G)
    torch.testing.assert_close(a[0][:, :, rows], b[0][:, :, rows], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a[1][:, :, rows], b[1][:, :, rows], atol=1e-6, rtol=1e-6)
    assert (a[0][:, :, (t + 2) * G:] - b[0][:, :, (t + 2) * G:]).abs().max() > 1e-3


def _op_args():
    q, k, v, _ = make_inputs(1, 40, 2, 2, 16, 24, torch.float32, extra=4, seed=5)
    return (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), 2, 9, 0.25, "auto", 0)


def test_opcheck_cpu():
    torch.library.opcheck(torch.ops.nsa_flex.window_attention.default, _op_args())
    q, k, v, *rest = _op_args()
    q_btd = unfold(q.detach()[:, :, :80], 40).contiguous().requires_grad_()
    torch.library.opcheck(torch.ops.nsa_flex.window_attention.default, (q_btd, k, v, *rest, False))


@pytest.mark.parametrize("change, error, message", [
    (dict(impl="cuda"), ValueError, "impl='cuda'"),
    (dict(group=0), ValueError, "group=0"),
    (dict(window=0), ValueError, "window=0"),
    (dict(window=True), ValueError, "window=True"),
    (dict(q=lambda q: q[:, :, :70]), ValueError, "does not fit"),
    (dict(v=lambda v: v[:, :30]), ValueError, "does not fit"),
    (dict(k=lambda k: k.double()), TypeError, "must match"),
    (dict(q=lambda q: q[0]), ValueError, "q"),
    (dict(impl="triton", q=lambda q: q[..., :16], k=lambda k: k[..., :16]), ValueError, "Dk, Dv in"),
])
def test_bad_inputs(change, error, message):
    q, k, v, _ = make_inputs(1, 40, 2, 2, 64, 64, torch.float32)
    args = {"q": q, "k": k, "v": v, "group": 2, "window": 9, "impl": "auto"}
    for key, value in change.items():
        args[key] = value(args[key]) if callable(value) else value
    with pytest.raises(error, match=message):
        window_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("group"), args.pop("window"), **args)


def test_kernels_apply_only_on_cuda_16_bit():
    q, k, v, _ = make_inputs(1, 8, 1, 2, 64, 64, torch.bfloat16)
    assert not window_op.kernels_apply(q, k, v)


GPU_CASES = [  # T, Hkv, G, Dk, Dv, dtype
    (1000, 2, 1, 64, 64, torch.bfloat16), (1000, 2, 4, 128, 128, torch.bfloat16), (1000, 1, 16, 128, 64, torch.float16),
    (4096, 3, 4, 64, 64, torch.bfloat16), (4096, 2, 2, 64, 128, torch.bfloat16), (4099, 4, 4, 128, 128, torch.float16),
    (1000, 2, 3, 128, 128, torch.bfloat16),
]


@gpu
@pytest.mark.parametrize("T, Hkv, G, Dk, Dv, dtype", GPU_CASES)
def test_kernels_gpu(T, Hkv, G, Dk, Dv, dtype):
    q, k, v, do = make_inputs(1, T, Hkv, G, Dk, Dv, dtype, extra=3 * G, seed=T + G, device="cuda")
    got = run_op(q, k, v, do, G, 512, "auto")
    check(got, q, k, v, do, G, 512)
    assert torch.equal(got[1][:, :, T * G:], torch.zeros_like(got[1][:, :, T * G:]))


@gpu
def test_compile_fullgraph_cuda():
    """fwd + bwd under torch.compile(fullgraph=True) equal the eager op: one frame, no recompile."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")

    @torch.compile(backend=counter, fullgraph=True, dynamic=False)
    def step(q, k, v):
        return window_attention(q * 1.0, k, v, 4, 512) + 0

    for seed in (0, 1):
        q, k, v, do = make_inputs(1, 2000, 2, 4, 128, 128, torch.bfloat16, seed=seed, device="cuda")
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        o = step(*x)
        got = (o, *torch.autograd.grad(o, x, do))
        for a, b in zip(got, run_op(q, k, v, do, 4, 512, "auto")):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    assert counter.frame_count == 1


def test_win_impl_choice_and_its_errors():
    from nsa_flex.flex.branches import window_impl
    from nsa_flex.flex.tuning import FlexTiles

    q, k, v, _ = make_inputs(1, 20, 1, 4, 64, 64, torch.bfloat16)
    # On CPU None takes Flex; documents always take Flex.
    assert window_impl(q, k, v, FlexTiles()) == "flex"
    assert window_impl(q, k, v, FlexTiles(win_impl="torch")) == "torch"
    with pytest.raises(ValueError, match="win_impl='triton' needs CUDA tensors"):
        window_impl(q, k, v, FlexTiles(win_impl="triton"))
    with pytest.raises(ValueError, match="packed documents"):
        window_impl(q, k, v, FlexTiles(win_impl="torch"), docs=object())
    with pytest.raises(ValueError, match="win_impl='cudnn'.*allowed None"):
        FlexTiles(win_impl="cudnn")


@pytest.mark.parametrize("cmp_impl", [None, "torch"], ids=["fold", "q-room"])
@pytest.mark.parametrize("W", [40, 64], ids=["window", "window-and-local"])
def test_whole_op_with_window_op_equals_the_reference(cmp_impl, W):
    """nsa_flex without gradients with win_impl="torch" (the window op and the selected op reading q
    in place; with W = 64 the window op also gives the local blocks' partial): output and
    selection equal the reference's in fp64."""
    from naive import random_inputs
    from nsa_flex import NSAConfig
    from nsa_flex.flex import nsa_flex
    from nsa_flex.flex.tuning import FlexTiles
    from nsa_flex.reference import nsa_reference

    cfg = NSAConfig(n_heads=8, n_kv_heads=2, head_dim=32, head_dim_v=24, window=W, n_selected=4, sel_block=32)
    x = random_inputs(cfg, 150, B=1, seed=12)
    o_ref, sel_ref = nsa_reference(**x, config=cfg)
    with torch.no_grad():
        o, sel = nsa_flex(**x, config=cfg, tiles=FlexTiles(win_impl="torch", cmp_impl=cmp_impl))
    assert torch.equal(sel.long(), sel_ref.long())
    assert (o - o_ref).abs().max() <= 100 * torch.finfo(torch.float64).eps


# ----- the local blocks' partial (window_and_local) and its merge in the selected op -----

def local_oracle(q, k, G, LB, v):
    """(o_loc, lse_loc base 2) in fp64: softmax over keys (t // LB - 1) * LB .. t of each row."""
    T = k.shape[1]
    t = torch.arange(T)
    mask = (t[None, :] <= t[:, None]) & (t[None, :] >= (t[:, None] // LB - 1) * LB)
    q_bhtd = unfold(q[:, :, :T * G].double(), T).transpose(1, 2)
    kh, vh = reference._heads(k, G, torch.float64), reference._heads(v, G, torch.float64)
    scores = (q_bhtd @ kh.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~mask, float("-inf"))
    o = scores.softmax(-1) @ vh
    return fold(o.transpose(1, 2), k.shape[2]), fold(scores.logsumexp(-1).transpose(1, 2)[..., None], k.shape[2])[
        ..., 0] / math.log(2)


@pytest.mark.parametrize("G, LB, W", [(4, 16, 40), (1, 32, 64), (16, 16, 100), (3, 16, 32)],
                         ids=["G4-l16", "G1-l32", "G16-l16", "G3-l16"])
def test_local_partial_twin_matches_reference(G, LB, W):
    q, k, v, _ = make_inputs(1, 130, 2, G, 16, 24, torch.float64, extra=3, seed=6)
    o, _, o_loc, lse_loc = window_op.twin.forward(q, k, v, G, W, 0.25 * 0 + 16 ** -0.5, LB)
    want_o, want_lse = local_oracle(q, k, G, LB, v)
    torch.testing.assert_close(o_loc, want_o, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse_loc.double(), want_lse, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(o, window_op.twin.forward(q, k, v, G, W, 16 ** -0.5)[0], atol=0, rtol=0)


def _local_cfg(BM, BN):
    return {"fwd_BM": BM, "fwd_BN": BN, "fwd_warps": 4, "fwd_stages": 1, "dq_BM": 64, "dq_BN": 64, "dq_warps": 4,
            "dq_stages": 1, "kv_BM": 64, "kv_BN": 64, "kv_warps": 4, "kv_stages": 1}


LOCAL_KERNEL_CASES = [  # G, LB, W, BM, BN
    pytest.param(4, 32, 64, 64, 16, id="G4-l32-W2l"),
    pytest.param(2, 16, 50, 32, 16, id="G2-l16-one-block-per-tile"),
    pytest.param(16, 32, 512, 64, 32, id="G16-l32-W-past-T"),
    # Tiles whose tokens cross a selection block's end: G not a power of two, or l' < BM / G.
    pytest.param(3, 16, 40, 64, 16, id="G3-l16-tiles-cross-blocks"),
    pytest.param(6, 32, 64, 32, 16, id="G6-l32-W2l"),
    pytest.param(1, 16, 48, 64, 16, id="G1-l16-tile-over-four-blocks"),
]


@interpreter
@pytest.mark.parametrize("G, LB, W, BM, BN", LOCAL_KERNEL_CASES)
def test_local_partial_kernels_interpreted(G, LB, W, BM, BN, poisoned):
    """The forward with the local partial: o and lse as without it (the same sums, in another
    order), o_loc and lse_loc as the twin's."""
    q, k, v, _ = make_inputs(1, 150, 1, G, 64, 64, torch.float32, extra=2, seed=7)
    scale = 64 ** -0.5
    o, lse, o_loc, lse_loc = window_op.forward(q, k, v, G, W, scale, _local_cfg(BM, BN), LB)
    o0, lse0, _, _ = window_op.forward(q, k, v, G, W, scale, _local_cfg(BM, BN))
    want_o, want_lse, want_ol, want_ll = window_op.twin.forward(q.double(), k.double(), v.double(), G, W, scale, LB)
    torch.testing.assert_close(o, o0, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(lse, lse0, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(o_loc.double(), want_ol, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(lse_loc.double(), want_ll.double(), atol=2e-6, rtol=2e-6)


@interpreter
@pytest.mark.parametrize("Dk, Dv, LB", [(64, 64, 32), (64, 64, 64), (128, 128, 64)], ids=["D64-l32", "D64-l64", "D128-l64"])
def test_window_and_local_with_launch_settings_interpreted(Dk, Dv, LB, poisoned):
    """window_and_local through the op with launch_config's tiles for these head dims (32-key
    forward blocks three stages deep at D=64, which also let l' = 32 in): o, o_loc and lse_loc as
    the twin's in fp64."""
    G, W = 4, 2 * LB + 8
    q, k, v, _ = make_inputs(1, 150, 1, G, Dk, Dv, torch.float32, extra=2, seed=9)
    assert window_op.local_fits(W, LB, Dk, Dv)
    o, o_loc, lse_loc = window_op.window_and_local(q, k, v, G, W, LB, impl="triton")
    want_o, _, want_ol, want_ll = window_op.twin.forward(q.double(), k.double(), v.double(), G, W, Dk ** -0.5, LB)
    torch.testing.assert_close(o.double(), want_o, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(o_loc.double(), want_ol, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(lse_loc.double(), want_ll.double(), atol=2e-6, rtol=2e-6)


def test_tiles_cross():
    """Whether a row tile may hold tokens of two selection blocks, the case the forward's extra loop is for."""
    assert not window_op.tiles_cross(4, 64, 64) and not window_op.tiles_cross(16, 64, 64)
    assert not window_op.tiles_cross(1, 64, 64) and not window_op.tiles_cross(2, 16, 32)
    assert window_op.tiles_cross(3, 64, 64) and window_op.tiles_cross(6, 64, 64)
    assert window_op.tiles_cross(1, 16, 64)  # 64 tokens a tile, blocks of 16
    assert window_op.tiles_cross(128, 64, 64)  # a token's rows fill more than one tile


def test_local_fits():
    assert window_op.local_fits(512, 64) and window_op.local_fits(128, 64) and window_op.local_fits(512, 128)
    assert not window_op.local_fits(100, 64)  # the window would not hold the previous block whole
    # The forward's key blocks: 64 at D=128 (they do not tile l' = 32), 32 at D=64.
    assert not window_op.local_fits(512, 32, 128, 128) and not window_op.local_fits(512, 32, 64, 128)
    assert window_op.local_fits(512, 32, 64, 64) and not window_op.local_fits(512, 16, 64, 64)
    assert not window_op.local_fits(512, 0)
    q, k, v, _ = make_inputs(1, 40, 1, 4, 64, 64, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        window_op.window_and_local(q, k, v, 4, 100, 64)
    for bad in (0, -64, 64.0, True):
        with pytest.raises(ValueError, match="sel_block=.*an int >= 1"):
            window_op.window_and_local(q, k, v, 4, 512, bad)


def _local_merge_case(G: int, seed: int):
    """(q, k, v, o_loc, lse_loc, bi, scale, l', T, tiles) for the selected op's merge of the window op's
    local partial: T=250, two kv heads, D=64, the window's partial over l'=32-token blocks, and a
    selection as the selection op forces it (n_initial = 1, n_local = 2): block 0, the one before
    the own and the own block in every row, then one random block of the past. Token ranges of 96
    tokens: the partial is read at absolute tokens."""
    from test_selected_attention import random_selection

    LB, W, T = 32, 64, 250
    q, k, v, _ = make_inputs(1, T, 2, G, 64, 64, torch.float32, seed=seed)
    scale = 64 ** -0.5
    _, _, o_loc, lse_loc = window_op.forward(q, k, v, G, W, scale, _local_cfg(64, 16), LB)
    own = (torch.arange(T) // LB).view(1, 1, T)
    past = random_selection(1, 2, T, 4, LB, seed=seed)[..., 1]
    bi = torch.stack([torch.zeros_like(past), (own - 1).clamp_min(0).expand_as(past), own.expand_as(past), past],
                     -1).int()
    return q, k, v, o_loc, lse_loc, bi, scale, LB, T, {"range_tokens": 96}


@interpreter
@pytest.mark.parametrize("gated", [False, True], ids=["selected", "selected-gated-sum"])
@pytest.mark.parametrize("G", [4, 3])
def test_selected_op_merges_the_local_partial_interpreted(gated, G):
    """The selected op's kernels with the window op's local partial (those slots skipped) equal
    the same kernels without it, forward; into the gated sum's epilogue too. The selection lists
    both local blocks of every token, as the selection op's does."""
    from nsa_flex.ops.selected_attention import launch

    q, k, v, o_loc, lse_loc, bi, scale, LB, T, tiles = _local_merge_case(G, seed=8)
    if not gated:
        o, lse = launch.forward(q, k, v, bi, None, scale, LB, tiles, q_heads=2 * G, local=(o_loc, lse_loc))
        o0, lse0 = launch.forward(q, k, v, bi, None, scale, LB, tiles, q_heads=2 * G)
        torch.testing.assert_close(lse, lse0, atol=2e-6, rtol=2e-6)
    else:
        from test_gated_sum import make_inputs as branch_inputs

        x = branch_inputs(1, T, 2, G, 64, 0, 0, torch.float32, seed=8)
        args = (x["cmp_rows"], x["head"], x["o_win"], x["gates"])
        o = launch.forward_gated(q, k, v, bi, None, scale, LB, *args, tiles, q_heads=2 * G, local=(o_loc, lse_loc))
        o0 = launch.forward_gated(q, k, v, bi, None, scale, LB, *args, tiles, q_heads=2 * G)
    torch.testing.assert_close(o, o0, atol=2e-6, rtol=2e-6)


@interpreter
@pytest.mark.parametrize("G", [4, 3], ids=["G4", "G3"])
def test_selected_op_writes_over_the_local_partial_interpreted(G):
    """forward(into_local=True) writes o folded over the local partial's own buffer, each row
    merged where the partial's row lay: bit for bit the unfolded o (and the same lse) of the merge
    into a buffer of its own, across token ranges; and it needs that partial."""
    from nsa_flex.folded import fold
    from nsa_flex.ops.selected_attention import launch

    q, k, v, o_loc, lse_loc, bi, scale, LB, T, tiles = _local_merge_case(G, seed=9)
    o0, lse0 = launch.forward(q, k, v, bi, None, scale, LB, tiles, q_heads=2 * G, local=(o_loc, lse_loc))
    buffer = o_loc.clone()
    o, lse = launch.forward(q, k, v, bi, None, scale, LB, tiles, q_heads=2 * G, local=(buffer, lse_loc),
                            into_local=True)
    assert o.data_ptr() == buffer.data_ptr() and o.shape == (1, 2, T * G, 64)
    assert not torch.equal(o, o_loc)  # the partial was overwritten, not left beside o
    assert torch.equal(o, fold(o0, 2)) and torch.equal(lse, lse0)
    with pytest.raises(ValueError, match="into_local needs the window op's local partial"):
        launch.forward(q, k, v, bi, None, scale, LB, tiles, q_heads=2 * G, into_local=True)


def test_selected_op_refuses_a_local_partial_that_does_not_fit():
    from nsa_flex import NSAConfig

    cfg = NSAConfig(n_heads=4, n_kv_heads=1, head_dim=16, head_dim_v=16, sel_block=32, cmp_block=16, cmp_stride=16,
                    n_selected=4)
    q, k, v, _ = make_inputs(1, 40, 1, 4, 16, 16, torch.float32)
    bi = torch.zeros(1, 1, 40, 4, dtype=torch.int32)
    bad = (torch.zeros(1, 1, 159, 16), torch.zeros(1, 1, 159))
    from nsa_flex.ops.selected_attention import _with_window_local

    with pytest.raises(ValueError, match="local: o_loc"):
        _with_window_local(q, k, v, bi, cfg, bad, folded=True)


def test_public_selected_ops_take_no_local_partial():
    """The local partial is trusted, not checked against the selection: only the flex path, which
    knows its selection lists the local blocks, may hand it in; the public ops refuse it."""
    from nsa_flex.ops import selected_attention, selected_gated_sum

    q = torch.zeros(1, 40, 4, 16)
    with pytest.raises(TypeError, match="local"):
        selected_attention(q, q[:, :, :1], q[:, :, :1], torch.zeros(1, 1, 40, 4, dtype=torch.int32), None,
                           local=(q, q))
    with pytest.raises(TypeError, match="local"):
        selected_gated_sum(q, q, q, q, None, q, 0, q, q, local=(q, q))
