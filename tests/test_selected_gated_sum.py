"""nsa_flex::selected_gated_sum: the selected op's forward with the gated sum as its merge's epilogue.

It must give what the two ops give in turn, selected_attention then gated_sum: its Triton kernels
(under Triton's interpreter on CPU, or on CUDA) against those two ops' kernels, its twin against
theirs, and the composition against the fp64 oracle of the selected branch and the plain gated
sum. The whole flex path without gradients (which takes this op) against the path with them.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from interpreter import interpreter_mark
from nsa_flex.folded import fold
from nsa_flex.ops.gated_sum import gated_sum
from nsa_flex.ops.selected_attention import launch, merge_kernels, selected_attention
from test_gated_sum import plain_sum
from test_selected_attention import make_config, make_inputs, oracle, poisoned, random_selection  # noqa: F401

op = importlib.import_module("nsa_flex.ops.selected_attention")
gpu = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)
interpreter = interpreter_mark(getattr(merge_kernels, "_slot_gated_kernel", None))


def branch_outputs(B, T, cfg, dtype, head, extra, seed=0, device="cpu"):
    """Random o_cmp rows (held from row `head` on, `extra` padding rows), o_win folded, gates."""
    g = torch.Generator().manual_seed(seed)
    rows, Hkv, Dv = T * cfg.group_size, cfg.n_kv_heads, cfg.dv
    rnd = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    gates = torch.sigmoid(torch.randn(B, T, cfg.n_heads, 3, generator=g)).to(device=device, dtype=dtype)
    return rnd(B, Hkv, rows - head + extra, Dv), head, rnd(B, Hkv, rows, Dv), gates


def two_ops(q, k, v, bi, cfg, cmp_rows, head, o_win, gates, impl, cu=None, folded=False):
    o_sel = selected_attention(q, k, v, bi, cfg, cu_seqlens=cu, impl=impl, folded=folded)
    return gated_sum(cmp_rows, head, o_sel, o_win, gates, impl=impl)


CASES = [  # B, T, G, Dk, Dv, n, L, dtype, head, extra, pad_rows
    pytest.param(1, 70, 2, 32, 24, 4, 16, torch.float32, 15 * 2, 3 * 2, 0, id="G2-fp32"),
    pytest.param(2, 61, 3, 32, 24, 5, 16, torch.float32, 0, 0, 9, id="G3-pad-heads-B2-no-head-pad-rows"),
    pytest.param(1, 90, 4, 64, 64, 4, 32, torch.bfloat16, 31 * 4, 5 * 4, 64, id="G4-bf16-head-padding"),
    pytest.param(1, 40, 1, 32, 32, 3, 16, torch.float16, 40, 1, 0, id="G1-fp16-head-all-rows"),
]


@pytest.mark.parametrize("B, T, G, Dk, Dv, n, L, dtype, head, extra, pad_rows", CASES)
def test_twin_equals_the_two_ops(B, T, G, Dk, Dv, n, L, dtype, head, extra, pad_rows):
    cfg = make_config(G, Dk, Dv, n, L)
    q, k, v, _ = make_inputs(B, T, cfg, dtype, seed=T)
    bi = random_selection(B, cfg.n_kv_heads, T, n, L, seed=T)
    cmp_rows, head, o_win, gates = branch_outputs(B, T, cfg, dtype, head, extra, seed=T)
    got = op.selected_gated_sum(q, k, v, bi, cfg, cmp_rows, head, o_win, gates, impl="torch")
    assert torch.equal(got, two_ops(q, k, v, bi, cfg, cmp_rows, head, o_win, gates, "torch"))


@interpreter
@pytest.mark.parametrize("B, T, G, Dk, Dv, n, L, dtype, head, extra, pad_rows", CASES)
def test_kernels_interpreted_equal_the_two_ops(B, T, G, Dk, Dv, n, L, dtype, head, extra, pad_rows, poisoned):
    """q folded with pad_rows rows past T*G: the fused kernels equal selected_attention's kernels then
    gated_sum's (o_sel rounded to the dtype in both, the same fp32 sum), and the fp64 composition."""
    cfg = make_config(G, Dk, Dv, n, L)
    q, k, v, _ = make_inputs(B, T, cfg, dtype, seed=T + 1)
    bi = random_selection(B, cfg.n_kv_heads, T, n, L, seed=T + 1)
    cmp_rows, head, o_win, gates = branch_outputs(B, T, cfg, dtype, head, extra, seed=T + 1)
    q_fold = fold(q, cfg.n_kv_heads, rows=T * G + pad_rows)
    got = op.selected_gated_sum(q_fold, k, v, bi, cfg, cmp_rows, head, o_win, gates, impl="triton", folded=True)
    want = two_ops(q_fold, k, v, bi, cfg, cmp_rows, head, o_win, gates, "triton", folded=True)
    assert torch.equal(got, want)
    _check_against_fp64(got, q, k, v, bi, cfg, cmp_rows, head, o_win, gates)


@interpreter
@pytest.mark.parametrize("R, cu", [(32, None), (45, [0, 40, 41, 41, 130])], ids=["ranges", "ranges-documents"])
def test_kernels_interpreted_token_ranges(R, cu, poisoned):
    """Token ranges (each merged and summed at its absolute tokens), packed documents."""
    cfg = make_config(2, 32, 24, 4, 16)
    T = 130 if cu else 100
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    q, k, v, _ = make_inputs(1, T, cfg, torch.float32, seed=R)
    bi = random_selection(1, 2, T, 4, 16, seed=R, cu_seqlens=cu)
    cmp_rows, head, o_win, gates = branch_outputs(1, T, cfg, torch.float32, 2 * 17, 4, seed=R)
    scale = q.shape[-1] ** -0.5
    got = launch.forward_gated(q, k, v, bi, cu, scale, 16, cmp_rows, head, o_win, gates, tiles=dict(range_tokens=R))
    o_sel, _ = launch.forward(q, k, v, bi, cu, scale, 16, dict(range_tokens=R))
    assert torch.equal(got, gated_sum(cmp_rows, head, o_sel, o_win, gates, impl="triton"))
    _check_against_fp64(got, q, k, v, bi, cfg, cmp_rows, head, o_win, gates, cu)


@gpu
@pytest.mark.parametrize("G, dtype", [(4, torch.bfloat16), (16, torch.float16), (3, torch.float32)])
def test_kernels_gpu_equal_the_two_ops(G, dtype):
    cfg = make_config(G, 128, 128, 16, 64, Hkv=2)
    T = 1000
    q, k, v, _ = make_inputs(1, T, cfg, dtype, seed=G, device="cuda")
    bi = random_selection(1, 2, T, 16, 64, seed=G).to("cuda")
    cmp_rows, head, o_win, gates = branch_outputs(1, T, cfg, dtype, 31 * G, 5 * G, seed=G, device="cuda")
    got = op.selected_gated_sum(q, k, v, bi, cfg, cmp_rows, head, o_win, gates)
    want = two_ops(q, k, v, bi, cfg, cmp_rows, head, o_win, gates, "auto")
    # The same fp32 terms summed by two kernels: within one rounding of a 16-bit output, a few
    # ulps of an fp32 one (the compiler may contract the products into FMAs differently).
    eps = torch.finfo(dtype).eps * (4 if dtype == torch.float32 else 1)
    torch.testing.assert_close(got, want, rtol=eps, atol=eps * want.abs().max().item())
    _check_against_fp64(got, q, k, v, bi, cfg, cmp_rows, head, o_win, gates)


def _check_against_fp64(got, q, k, v, bi, cfg, cmp_rows, head, o_win, gates, cu=None):
    """got against the fp64 selected branch summed with the others in fp64: within 2x the error
    of the same composition in the inputs' dtype, plus half an epsilon and a few fp32 ulps."""
    do = torch.zeros(got.shape, dtype=q.dtype, device=q.device)
    want = plain_sum(cmp_rows.double(), head, oracle(q, k, v, do, bi, cfg, torch.float64, cu)[0], o_win.double(),
                     gates.double())
    low = plain_sum(cmp_rows, head, oracle(q, k, v, do, bi, cfg, q.dtype, cu)[0], o_win, gates)
    err = (got.double() - want).abs().max().item()
    ref_err = (low.double() - want).abs().max().item()
    bound = 2 * ref_err + torch.finfo(q.dtype).eps / 2 * want.abs().max().item() + 64 * 2.0 ** -24
    assert math.isfinite(err) and err <= bound, f"error {err:.3e} > bound {bound:.3e} (ref {ref_err:.3e})"


def test_refuses_gradients():
    cfg = make_config(2, 32, 24, 4, 16)
    q, k, v, _ = make_inputs(1, 40, cfg, torch.float32)
    bi = random_selection(1, 2, 40, 4, 16)
    cmp_rows, head, o_win, gates = branch_outputs(1, 40, cfg, torch.float32, 0, 0)
    with pytest.raises(RuntimeError, match="no backward.*torch.no_grad"):
        op.selected_gated_sum(q.requires_grad_(), k, v, bi, cfg, cmp_rows, head, o_win, gates)
    with torch.no_grad():
        op.selected_gated_sum(q, k, v, bi, cfg, cmp_rows, head, o_win, gates)


@pytest.mark.parametrize("change, error, message", [
    (dict(gates=torch.rand(1, 40, 4, 2)), ValueError, "gates .* must be \\[1, 40, 4, 3\\]"),
    (dict(head=81), ValueError, "head=81"),
    (dict(o_win=torch.randn(1, 2, 79, 24)), ValueError, "o_win .* must be \\[B, Hkv, T\\*G, Dv\\]"),
    (dict(cmp_rows=torch.randn(1, 2, 80, 24).double()), TypeError, "dtypes"),
    (dict(cmp_rows=torch.randn(1, 80, 24)), ValueError, "cmp_rows must be"),
    (dict(q=torch.randn(1, 40, 4, 16)), ValueError, "do not fit"),
], ids=["gates", "head", "o_win", "cmp-dtype", "cmp-dims", "q-dim"])
def test_bad_inputs(change, error, message):
    cfg = make_config(2, 32, 24, 4, 16)
    q, k, v, _ = make_inputs(1, 40, cfg, torch.float32)
    cmp_rows, head, o_win, gates = branch_outputs(1, 40, cfg, torch.float32, 0, 0)
    args = dict(q=q, k=k, v=v, block_indices=random_selection(1, 2, 40, 4, 16), config=cfg, cmp_rows=cmp_rows,
                cmp_head=head, o_win=o_win, gates=gates)
    args.update({("cmp_head" if name == "head" else name): x for name, x in change.items()})
    with pytest.raises(error, match=message):
        op.selected_gated_sum(**args)


def test_opcheck_cpu():
    cfg = make_config(2, 32, 24, 4, 16)
    q, k, v, _ = make_inputs(1, 40, cfg, torch.float32)
    cmp_rows, head, o_win, gates = branch_outputs(1, 40, cfg, torch.float32, 2 * 17, 4)
    q_fold = fold(q, 2, rows=80 + 6)
    bi = random_selection(1, 2, 40, 4, 16).int()
    torch.library.opcheck(torch.ops.nsa_flex.selected_gated_sum.default,
                          (q_fold, k, v, bi, None, 0.2, 16, "auto", 4, cmp_rows, head, o_win, gates, None, None))

