"""nsa_flex::gated_branches: the window and selected branches with the gated sum as one node.

The node's torch twin in fp64 against the three ops composed by autograd (window_attention,
selected_attention, gated_sum), which have their own tests against the reference; the Triton
kernels (under Triton's interpreter on CPU) against the twin, output and every gradient, with
awkward groups, a compressed buffer held from a late row and gates that are negative or zero;
opcheck; the errors. The node reads q [B, T, Hq, D] itself (no folded copy).
"""

from __future__ import annotations

import pytest
import torch

from interpreter import QUIET_NUMPY, interpreter_mark, interpreter_skip
from nsa_flex import NSAConfig
from nsa_flex.folded import fold
from nsa_flex.ops import gated_sum, selected_attention, window_attention
from nsa_flex.ops.gated_branches import gated_branches
from nsa_flex.ops.window import kernels

interpreter = interpreter_mark(getattr(kernels, "_dq_kernel", None))
gpu = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


def local_selection(B, Hkv, T, n, LB, seed=0) -> torch.Tensor:
    """[B, Hkv, T, n] int64: block 0, the one before the own and the own block in every row (as the
    selection op forces them with n_local = 2), then random past blocks, -1 last."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((B, Hkv, T, n), -1, dtype=torch.int64)
    for t in range(T):
        own = t // LB
        for bh in range(B * Hkv):
            picks = {0, max(own - 1, 0), own}
            for j in torch.randperm(own + 1, generator=g).tolist():
                if len(picks) < n - 1:
                    picks.add(j)
            chosen = sorted(picks)
            out[bh // Hkv, bh % Hkv, t, :len(chosen)] = torch.tensor(chosen)
    return out


def make_case(B, T, Hkv, G, D, LB, W, n, head=5, signed=False, dtype=torch.float32, seed=1):
    cfg = NSAConfig(n_heads=G * Hkv, n_kv_heads=Hkv, head_dim=D, head_dim_v=D, sel_block=LB, cmp_block=16,
                    cmp_stride=16, n_selected=n, window=W)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, G * Hkv, D, generator=g)
    x = {"q": q, "k": torch.randn(B, T, Hkv, D, generator=g),
         "v": torch.randn(B, T, Hkv, D, generator=g),
         "cmp_rows": torch.randn(B, Hkv, T * G - head + 7, D, generator=g),
         "gates": torch.rand(B, T, G * Hkv, 3, generator=g)}
    if signed:
        x["gates"] = x["gates"] * 2 - 1
    # Zero gates: a branch whose output gradient is exactly zero for those rows.
    x["gates"][:, :5] = 0
    x = {name: t.to(dtype) for name, t in x.items()}
    do = torch.randn(B, T, G * Hkv, D, generator=g, dtype=dtype)
    return cfg, x, local_selection(B, Hkv, T, n, LB, seed), head, do


NAMES = ("q", "k", "v", "cmp_rows", "gates")


def node(cfg, x, bi, head, do, impl, partial_bytes=0):
    leaves = {name: t.detach().clone().requires_grad_() for name, t in x.items()}
    o = gated_branches(leaves["q"], leaves["k"], leaves["v"], bi, cfg, leaves["cmp_rows"], head, leaves["gates"],
                       impl=impl, partial_bytes=partial_bytes)
    return (o.detach(), *torch.autograd.grad(o, [leaves[n] for n in NAMES], do))


def three_ops(cfg, x, bi, head, do):
    """The same function through the three ops and autograd (their twins)."""
    leaves = {name: t.detach().clone().requires_grad_() for name, t in x.items()}
    G = cfg.n_heads // cfg.n_kv_heads
    o_win = window_attention(fold(leaves["q"], cfg.n_kv_heads), leaves["k"], leaves["v"], G, cfg.window,
                             impl="torch")
    o_sel = selected_attention(leaves["q"], leaves["k"], leaves["v"], bi, cfg, impl="torch")
    o = gated_sum(leaves["cmp_rows"], head, o_sel, o_win, leaves["gates"], impl="torch")
    return (o.detach(), *torch.autograd.grad(o, [leaves[n] for n in NAMES], do))


@pytest.mark.parametrize("G, Hkv, T, D, LB, W",
                         [(4, 2, 150, 16, 32, 64), (3, 1, 130, 16, 32, 64), (1, 2, 90, 32, 32, 70)],
                         ids=["G4", "G3-tiles-cross-blocks", "G1"])
def test_twin_equals_the_three_ops(G, Hkv, T, D, LB, W):
    cfg, x, bi, head, do = make_case(2, T, Hkv, G, D, LB, W, 5, signed=True, dtype=torch.float64)
    for name, got, want in zip(("o", *NAMES), node(cfg, x, bi, head, do, "torch"), three_ops(cfg, x, bi, head, do)):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10, msg=name)


KERNEL_CASES = [  # G, Hkv, T, D, LB, W, signed
    pytest.param(4, 2, 150, 64, 32, 64, False, id="G4-D64-l32"),
    pytest.param(3, 1, 200, 64, 32, 64, True, id="G3-signed-gates"),
    pytest.param(6, 1, 140, 64, 32, 70, False, id="G6"),
    pytest.param(4, 1, 260, 128, 64, 128, True, id="G4-D128-l64"),
]


@interpreter
@pytest.mark.parametrize("G, Hkv, T, D, LB, W, signed", KERNEL_CASES)
def test_kernels_interpreted(G, Hkv, T, D, LB, W, signed):
    """The kernels with launch_config's tiles against the twin: output and the gradients of q, k, v,
    the compressed rows and the gates (fp32 inputs, fp32 dots under the interpreter)."""
    cfg, x, bi, head, do = make_case(2 if D == 64 else 1, T, Hkv, G, D, LB, W, 6, signed=signed)
    for name, got, want in zip(("o", *NAMES), node(cfg, x, bi, head, do, "triton"),
                               node(cfg, x, bi, head, do, "torch")):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=name)


@interpreter
def test_partial_budget_splits_the_selected_op_into_ranges():
    """partial_bytes reaches the selected op in both passes: a budget of 64 tokens' partials runs
    three token ranges (the saved index says so, and the fake implementation agrees), and the
    output and every gradient match the one-range default."""
    cfg, x, bi, head, do = make_case(1, 150, 2, 4, 64, 32, 64, 6, signed=True)
    per_token = cfg.n_heads * 6 * 64 * 4  # n fp32 partials of Dv per (token, query head)
    budget = 64 * per_token
    args = (x["q"], x["k"], x["v"], bi, x["cmp_rows"], head, x["gates"], 4, cfg.window, cfg.sel_block, 0.125,
            "triton")
    counts = {b: torch.ops.nsa_flex.gated_branches(*args, partial_bytes=b)[7] for b in (0, budget)}
    assert counts[0].shape[0] == 1 and counts[budget].shape[0] == 3
    torch.library.opcheck(torch.ops.nsa_flex.gated_branches.default, args, {"partial_bytes": budget},
                          test_utils=("test_faketensor", ))
    for name, got, want in zip(("o", *NAMES), node(cfg, x, bi, head, do, "triton", budget),
                               node(cfg, x, bi, head, do, "triton")):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=name)


def test_return_branches_gives_o_sel_folded():
    """With return_branches the node's o_sel is folded [B, Hkv, T*G, Dv]: the selected op's own output
    folded; gated_sum reads it with sel_folded=True and makes the node's sum again."""
    _check_o_sel_folded("torch")


@interpreter
def test_kernels_interpreted_give_o_sel_folded():
    """As above with the kernels, which write o_sel over the window's local partial."""
    _check_o_sel_folded("triton")


def _check_o_sel_folded(impl):
    cfg, x, bi, head, _ = make_case(1, 150, 2, 4, 64, 32, 64, 6)
    o, o_sel, o_win = gated_branches(x["q"], x["k"], x["v"], bi, cfg, x["cmp_rows"], head, x["gates"], impl=impl,
                                     return_branches=True)
    want = fold(selected_attention(x["q"], x["k"], x["v"], bi, cfg, impl="torch"), 2)
    assert o_sel.shape == o_win.shape == (1, 2, 150 * 4, 64)
    torch.testing.assert_close(o_sel, want, atol=2e-5, rtol=2e-5)
    again = gated_sum(x["cmp_rows"], head, o_sel, o_win, x["gates"], impl="torch", sel_folded=True)
    torch.testing.assert_close(again, o, atol=2e-5, rtol=2e-5)


@gpu
@pytest.mark.parametrize("signed", [False, True], ids=["gates-0-1", "signed-gates"])
def test_kernels_gpu_against_fp64_twin(signed):
    """On CUDA in bf16, output and every gradient against the twin in fp64, within 2x the twin's own
    bf16 error plus rounding: gates in [0, 1) and of both signs, zeros among them, at the g4 shape's
    tiles (the whole-op oracle tests take sigmoid gates only)."""
    cfg, x, bi, head, do = make_case(1, 1000, 2, 4, 128, 64, 512, 16, signed=signed, seed=7)
    x = {name: t.to("cuda", torch.bfloat16) for name, t in x.items()}
    bi, do = bi.cuda(), do.to("cuda", torch.bfloat16)
    got = node(cfg, x, bi, head, do, "auto")
    low = node(cfg, x, bi, head, do, "torch")
    want = node(cfg, {n: t.double() for n, t in x.items()}, bi, head, do.double(), "torch")
    eps = torch.finfo(torch.bfloat16).eps
    for name, a, lo, w in zip(("o", *NAMES), got, low, want):
        err = (a.double() - w).abs().max().item()
        bound = 2 * (lo.double() - w).abs().max().item() + eps / 2 * w.abs().max().item()
        assert err <= bound, f"{name}: error {err:.3e} > bound {bound:.3e}"


def test_opcheck_cpu():
    cfg, x, bi, head, _ = make_case(1, 70, 1, 2, 16, 32, 64, 4)
    args = (x["q"], x["k"], x["v"], bi, x["cmp_rows"], head, x["gates"], 2, cfg.window, cfg.sel_block, 0.25,
            "torch")
    torch.library.opcheck(torch.ops.nsa_flex.gated_branches.default, args)


@interpreter
def test_fake_outputs_match_the_kernels_interpreted():
    """The kernel path's outputs, the saved inverse index among them, have the shapes and dtypes its
    fake implementation states (what torch.compile traces with)."""
    cfg, x, bi, head, _ = make_case(1, 70, 1, 2, 64, 32, 64, 4)
    args = (x["q"], x["k"], x["v"], bi, x["cmp_rows"], head, x["gates"], 2, cfg.window, cfg.sel_block, 0.125,
            "triton")
    torch.library.opcheck(torch.ops.nsa_flex.gated_branches.default, args, test_utils=("test_faketensor", ))


def test_errors_say_what_is_allowed():
    cfg, x, bi, head, _ = make_case(1, 70, 1, 2, 16, 32, 64, 4)
    args = (x["q"], x["k"], x["v"], bi, cfg, x["cmp_rows"], head, x["gates"])
    narrow = NSAConfig(**{**cfg.__dict__, "window": 48})
    with pytest.raises(ValueError, match="do not fit"):
        gated_branches(*args[:4], narrow, *args[5:])
    with pytest.raises(ValueError, match="gates"):
        gated_branches(*args[:7], x["gates"][..., :2])
    with pytest.raises(ValueError, match="impl="):
        gated_branches(*args, impl="cuda")
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="partial_bytes=.*allowed: a byte count > 0, or 0"):
            gated_branches(*args, partial_bytes=bad)


def test_backward_launches_refuse_what_they_cannot_take():
    """The launch functions the node calls check their extra arguments before any kernel runs."""
    from nsa_flex.ops import window as window_op
    from nsa_flex.ops.selected_attention import launch

    cfg, x, bi, head, do = make_case(1, 70, 1, 2, 64, 32, 64, 4)
    q, k, v = fold(x["q"], 1), x["k"], x["v"]
    wcfg = window_op.launch_config(64, 64)
    lse_w = torch.zeros(1, 1, 140)
    stats = torch.zeros(1, 2, 70)
    with pytest.raises(ValueError, match="needs delta"):
        window_op.backward(do, q, k, v, q, lse_w, 2, 64, 0.1, wcfg, gate=lse_w)
    with pytest.raises(ValueError, match="sel needs a gate"):
        window_op.backward(fold(do, 1), q, k, v, q, lse_w, 2, 64, 0.1, wcfg, sel=(stats, stats, stats, 32))
    with pytest.raises(ValueError, match="multiple of the dQ kernel's"):
        window_op.backward(do, q, k, v, q, lse_w, 2, 64, 0.1, wcfg, gate=lse_w, delta=lse_w,
                           sel=(stats, stats, stats, 48))
    with pytest.raises(ValueError, match="needs delta"):
        launch.backward(do, q, k, v, do, stats, bi, None, 0.1, 32, q_heads=2, gate=stats)
    with pytest.raises(ValueError, match="laid out as lse"):
        launch.backward(do, q, k, v, do, stats, bi, None, 0.1, 32, q_heads=2, gate=stats[:, :1], delta=stats)
    with pytest.raises(ValueError, match="acc must be"):
        launch.backward(do, q, k, v, do, stats, bi, None, 0.1, 32, q_heads=2, acc=(q, k[:, :5], v))


# ----- the grouped compressed call's backward inside the node -----

def grouped_case(B, T, Hkv, G, D, LB, W, n, dtype=torch.float64, seed=2):
    """(cfg, leaves q / k / v / k_cmp / v_cmp / gates, selection, do) for the node with the grouped
    compressed call."""
    cfg = NSAConfig(n_heads=G * Hkv, n_kv_heads=Hkv, head_dim=D, head_dim_v=D, sel_block=LB, n_selected=n, window=W)
    Tc = (T - cfg.cmp_block) // cfg.cmp_stride + 1
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, G * Hkv, D, generator=g, dtype=dtype)
    x = {"q": q,
         "k": torch.randn(B, T, Hkv, D, generator=g, dtype=dtype),
         "v": torch.randn(B, T, Hkv, D, generator=g, dtype=dtype),
         "k_cmp": torch.randn(B, Tc, Hkv, D, generator=g, dtype=dtype),
         "v_cmp": torch.randn(B, Tc, Hkv, D, generator=g, dtype=dtype),
         "gates": torch.rand(B, T, G * Hkv, 3, generator=g, dtype=dtype)}
    x = {name: t.requires_grad_() for name, t in x.items()}
    do = torch.randn(B, T, G * Hkv, D, generator=g, dtype=dtype)
    return cfg, x, local_selection(B, Hkv, T, n, LB, seed), do


def with_grouped(cfg, x, bi, impl, detached: bool, cudnn: bool = False):
    """The node's output: the grouped call made without a gradient and its backward in the node
    (detached), or the call through autograd and its output's gradient out of the node. The call
    reads q folded with the rows it reads past T*G (q_room, as the flex path makes it). cudnn: the
    call as cuDNN's (compressed_groups.cudnn_forward / cudnn_backward, whatever runs them)."""
    rows, grouped = _grouped_call(cfg, x, detached, cudnn)
    return gated_branches(x["q"], x["k"], x["v"], bi, cfg, rows.x, rows.head, gates=x["gates"], impl=impl,
                          grouped=grouped)


def _grouped_call(cfg, x, detached: bool = True, cudnn: bool = False):
    from nsa_flex.flex import compressed_groups

    T, G, Tc = x["k"].shape[1], cfg.n_heads // cfg.n_kv_heads, x["k_cmp"].shape[1]
    q_room = fold(x["q"], cfg.n_kv_heads, rows=compressed_groups.grouped_rows(T * G, cfg, Tc))
    scale = cfg.head_dim ** -0.5
    if detached:
        rows, _, grouped = compressed_groups.compressed_grouped_detached(q_room[:, :, :T * G], x["k_cmp"], x["v_cmp"],
                                                                         cfg, scale, cudnn, q_room=q_room)
        return rows, grouped
    rows, _ = compressed_groups.compressed_grouped(q_room[:, :, :T * G], x["k_cmp"], x["v_cmp"], cfg, scale,
                                                   q_room=q_room)
    return rows, None


@pytest.mark.parametrize("G,Hkv,T", [(4, 2, 150), (3, 1, 203), (16, 1, 64)], ids=["G4-T150", "G3-T203", "G16-T64"])
def test_node_takes_the_grouped_calls_backward(G, Hkv, T):
    """The node running the grouped compressed call's backward (the call made without a gradient of
    its own) against the call through autograd and the node taking its output's gradient: the same
    output and gradients of q, k, v, k_cmp, v_cmp and the gates, fp64, twins. A node that dropped
    the call's gradients would leave k_cmp / v_cmp without any."""
    cfg, x, bi, do = grouped_case(1, T, Hkv, G, 32, 32, 64, 4)
    o = with_grouped(cfg, x, bi, "torch", detached=True)
    o_ref = with_grouped(cfg, x, bi, "torch", detached=False)
    eps = torch.finfo(torch.float64).eps
    assert (o - o_ref).abs().max() <= 100 * eps
    names = list(x)
    grads = torch.autograd.grad(o, [x[n] for n in names], do)
    want = torch.autograd.grad(o_ref, [x[n] for n in names], do)
    # The grouped lse is fp32 (as cuDNN's): the backward's P carries up to a rounding of it.
    bound = 1e3 * eps + 64 * torch.finfo(torch.float32).eps
    for name, a, b in zip(names, grads, want):
        assert b.abs().max() > 0, name
        assert (a - b).abs().max() <= bound * b.abs().max(), name


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=[
    pytest.mark.skipif(interpreter_skip(getattr(kernels, "_dq_kernel", None)) is not None, reason="interpreter"),
    QUIET_NUMPY])])
@pytest.mark.parametrize("B,Hkv,G,T,split", [(2, 2, 4, 150, 1), (1, 1, 16, 64, 4)], ids=["rows", "heads"])
def test_node_folds_each_cudnn_calls_rows(B, Hkv, G, T, split, impl, monkeypatch):
    """The cuDNN path of the grouped call's backward in the node, cuDNN's calls done in torch: with
    CUDNN_BACKWARD_BYTES at one batch row (four calls of one row each) or a quarter of one (four
    calls of a row's heads), each call reads the queries of its own rows, folded for it, and the
    node's output and gradients equal the call through autograd (fp64 twins; fp32 under the
    interpreter, the node's kernels adding the four calls' dQ parts)."""
    from nsa_flex.flex import compressed_groups
    from nsa_flex.flex.compressed_groups import causal_attention_backward, causal_attention_lse

    def forward(q, k, v, scale):
        o, lse = causal_attention_lse(q, k, v, scale)
        return o, lse.unsqueeze(-1), None, None  # cuDNN's lse is [N, H, L, 1]

    seen = []

    def backward(do, q, k, v, o, lse, seed, offset, scale):
        seen.append(q.clone())
        return causal_attention_backward(do, q, k, v, o, lse, scale)

    monkeypatch.setattr(compressed_groups, "cudnn_forward", forward)
    monkeypatch.setattr(compressed_groups, "_backward_call", backward)
    dtype = torch.float64 if impl == "torch" else torch.float32
    cfg, x, bi, do = grouped_case(B, T, Hkv, G, 32 if impl == "torch" else 64, 32, 64, 4, dtype=dtype)
    Tc, dG = x["k_cmp"].shape[1], cfg.cmp_stride * G
    monkeypatch.setattr(compressed_groups, "CUDNN_BACKWARD_BYTES", 4 * dG * Tc * 2 * cfg.head_dim // split)
    o = with_grouped(cfg, x, bi, impl, detached=True, cudnn=True)
    o_ref = with_grouped(cfg, x, bi, "torch", detached=False)
    names = list(x)
    grads = torch.autograd.grad(o, [x[n] for n in names], do)
    want = torch.autograd.grad(o_ref, [x[n] for n in names], do)
    # Each call's queries: the rows (split 1) or heads (split 4) of the whole call's, in order.
    q4 = _grouped_call(cfg, x, detached=True)[1].q.detach()
    assert len(seen) == 4 and torch.equal(torch.cat(seen, 0 if split == 1 else 1), q4)
    eps = torch.finfo(dtype).eps
    bound = 1e3 * eps + 64 * torch.finfo(torch.float32).eps
    for name, a, b in zip(["o", *names], [o, *grads], [o_ref, *want]):
        assert b.abs().max() > 0, name
        assert (a - b).abs().max() <= bound * b.abs().max(), name


@gpu
@pytest.mark.parametrize("B,Hkv,G,T,split", [(2, 2, 4, 1000, 1), (1, 1, 16, 700, 4)], ids=["rows", "heads"])
def test_node_cudnn_calls_gpu_against_fp64_twin(B, Hkv, G, T, split, monkeypatch):
    """On CUDA in bf16 with cuDNN's grouped call, its backward in four calls (a batch row each, or a
    quarter of a row's heads each) that read their own rows of q, folded for them: output and every
    gradient against the fp64 twin, within 2x the bf16 twin's own error plus rounding."""
    from nsa_flex.flex import compressed_groups

    cfg, x, bi, do = grouped_case(B, T, Hkv, G, 128, 64, 512, 16, seed=4)
    Tc, dG = x["k_cmp"].shape[1], cfg.cmp_stride * G
    monkeypatch.setattr(compressed_groups, "CUDNN_BACKWARD_BYTES", 4 * dG * Tc * 2 * 128 // split)
    calls = []
    real = compressed_groups._backward_call
    monkeypatch.setattr(compressed_groups, "_backward_call", lambda *a: calls.append(a[1].shape) or real(*a))

    def run(dtype, impl, cudnn):
        leaves = {n: t.detach().to("cuda", dtype).requires_grad_() for n, t in x.items()}
        o = with_grouped(cfg, leaves, bi.cuda(), impl, detached=cudnn, cudnn=cudnn)
        return (o.detach(), *torch.autograd.grad(o, list(leaves.values()), do.to("cuda", dtype)))

    got = run(torch.bfloat16, "auto", True)
    assert len(calls) == 4 and all(shape[:2] == ((1, dG) if split == 1 else (1, dG // 4)) for shape in calls)
    low = run(torch.bfloat16, "torch", False)
    want = run(torch.float64, "torch", False)
    eps = torch.finfo(torch.bfloat16).eps
    for name, a, lo, w in zip(("o", *x), got, low, want):
        err = (a.double() - w).abs().max().item()
        bound = 2 * (lo.double() - w).abs().max().item() + eps / 2 * w.abs().max().item()
        assert err <= bound, f"{name}: error {err:.3e} > bound {bound:.3e}"


@interpreter
@pytest.mark.parametrize("apart", [False, True], ids=["d_cmp-with-deltas", "d_cmp-apart"])
def test_node_takes_the_grouped_calls_backward_interpreted(apart, monkeypatch):
    """The same with the node's Triton kernels (under the interpreter) in fp32 against its twin path,
    with d cmp_rows made with the deltas or apart (a bound of 1 byte makes every d cmp_rows large)."""
    from nsa_flex.flex import compressed_groups
    from nsa_flex.ops import gated_branches as node_module

    if apart:
        monkeypatch.setattr(compressed_groups, "CUDNN_BACKWARD_BYTES", 1)
    cfg, x, bi, do = grouped_case(1, 130, 1, 4, 64, 32, 64, 4, dtype=torch.float32)
    assert node_module._cmp_apart(x["q"], x["k_cmp"]) == apart
    o = with_grouped(cfg, x, bi, "triton", detached=True)
    o_ref = with_grouped(cfg, x, bi, "torch", detached=False)
    names = list(x)
    grads = torch.autograd.grad(o, [x[n] for n in names], do)
    want = torch.autograd.grad(o_ref, [x[n] for n in names], do)
    for name, a, b in zip(["o", *names], [o, *grads], [o_ref, *want]):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max(), name


def test_grouped_call_needs_cmp_rows_without_gradient():
    """The node given the grouped call refuses cmp_rows that need a gradient: the call's own
    gradients stand for it, and that one would be lost."""
    cfg, x, bi, _ = grouped_case(1, 100, 1, 4, 32, 32, 64, 4)
    rows, grouped = _grouped_call(cfg, x)
    with pytest.raises(ValueError, match="needs none"):
        gated_branches(x["q"], x["k"], x["v"], bi, cfg, rows.x.clone().requires_grad_(), rows.head, x["gates"],
                       impl="torch", grouped=grouped)


@interpreter
def test_backward_deltas_cmp_apart_equals_one_launch():
    """The gated sum's deltas with d cmp_rows in a launch of its own: every output equal to one
    launch's, bit for bit."""
    from nsa_flex.ops.gated_sum import backward_deltas

    cfg, x, bi, head, do = make_case(1, 70, 2, 3, 32, 32, 64, 4)
    T, Hkv, G = 70, 2, 3
    o_sel = torch.randn(1, T, Hkv * G, 32)
    o_win = torch.randn(1, Hkv, T * G, 32)
    one = backward_deltas(do, x["cmp_rows"], head, o_sel, o_win, x["gates"])
    apart = backward_deltas(do, x["cmp_rows"], head, o_sel, o_win, x["gates"], cmp_apart=True)
    for a, b in zip(apart, one):
        assert torch.equal(a, b)


def test_grouped_call_must_match_cmp_rows():
    """A grouped call whose queries do not cover cmp_rows' rows (here another call's) is refused,
    naming both shapes."""
    cfg, x, bi, _ = grouped_case(1, 100, 1, 4, 32, 32, 64, 4)
    rows, grouped = _grouped_call(cfg, x)
    short = grouped._replace(q=grouped.q[:, :, :-1])
    with pytest.raises(ValueError, match=r"grouped queries \(1, 64, 4, 32\) do not match cmp_rows"):
        gated_branches(x["q"], x["k"], x["v"], bi, cfg, rows.x, rows.head, x["gates"], impl="torch",
                       grouped=short)


def test_node_refuses_folded_queries():
    """The node reads q [B, T, Hq, Dk] itself: a folded q (the layout the Flex calls take) is
    refused, naming the shape it needs, not read as another shape."""
    cfg, x, bi, _ = grouped_case(1, 100, 1, 4, 32, 32, 64, 4)
    rows, grouped = _grouped_call(cfg, x)
    folded_q = fold(x["q"].detach(), 1)
    with pytest.raises(ValueError, match=r"q \(1, 1, 400, 32\) must be \[B, T, Hq, Dk\] = \[1, 100, 4, Dk\]"):
        gated_branches(folded_q, x["k"], x["v"], bi, cfg, rows.x, rows.head, x["gates"], impl="torch",
                       grouped=grouped)
