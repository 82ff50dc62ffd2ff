"""nsa_flex::gated_sum: the torch twin against the plain gated sum in fp64, the Triton kernels
(under Triton's interpreter on CPU, or on CUDA) against the twin, the op's checks and opcheck.

The oracle is the gated sum written out on dense tensors (the compressed output padded in
front, unfolded), differentiated by autograd. The kernels sum in fp32 as the twin does, so
in fp32 they agree with it to a few ulps; in 16 bits to one rounding of the output.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from interpreter import interpreter_mark
from nsa_flex.folded import FoldedRows, fold, unfold
from nsa_flex.ops.gated_sum import gated_sum, kernels

gpu = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)
interpreter = interpreter_mark(getattr(kernels, "_sum_kernel", None))


def make_inputs(B, T, Hkv, G, Dv, head, extra, dtype, seed=0, device="cpu"):
    """cmp_rows holds rows head .. T*G + extra - 1 (extra padding rows past the sequence)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)  # noqa: E731
    rows = T * G
    return dict(cmp_rows=rnd(B, Hkv, rows - head + extra, Dv), head=head, o_sel=rnd(B, T, Hkv * G, Dv),
                o_win=rnd(B, Hkv, rows, Dv),
                gates=torch.sigmoid(rnd(B, T, Hkv * G, 3).double()).to(dtype))


def plain_sum(cmp_rows, head, o_sel, o_win, gates):
    T = o_sel.shape[1]
    o_cmp = F.pad(cmp_rows[:, :, :o_win.shape[2] - head], (0, 0, head, 0))
    return gates[..., 0:1] * unfold(o_cmp, T) + gates[..., 1:2] * o_sel + gates[..., 2:3] * unfold(o_win, T)


SHAPES = [  # B, T, Hkv, G, Dv, head, extra
    pytest.param(1, 37, 2, 4, 24, 31 * 4, 5 * 4, id="G4-head-padding"),
    pytest.param(2, 19, 1, 3, 16, 0, 0, id="G3-B2-no-head"),
    pytest.param(1, 9, 3, 1, 40, 9, 2, id="G1-head-all-rows"),
    pytest.param(1, 130, 2, 16, 32, 31 * 16, 7 * 16, id="G16-two-tiles"),
]


def _grads(fn, x, do):
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items() if n != "head"}
    o = fn(**leaves, head=x["head"])
    grads = torch.autograd.grad(o, list(leaves.values()), do)
    return o.detach(), dict(zip(leaves, grads))


@pytest.mark.parametrize("B,T,Hkv,G,Dv,head,extra", SHAPES)
def test_twin_equals_the_plain_sum(B, T, Hkv, G, Dv, head, extra):
    x = make_inputs(B, T, Hkv, G, Dv, head, extra, torch.float64, seed=1)
    do = torch.randn(B, T, Hkv * G, Dv, dtype=torch.float64)
    o, grads = _grads(lambda **a: gated_sum(**a, impl="torch"), x, do)
    o_ref, grads_ref = _grads(plain_sum, x, do)
    eps = torch.finfo(torch.float64).eps
    assert (o - o_ref).abs().max() <= 8 * eps
    for name in grads_ref:
        assert (grads[name] - grads_ref[name]).abs().max() <= 64 * eps, name
    # Padding rows of the compressed buffer get exact zeros.
    assert torch.equal(grads["cmp_rows"][:, :, T * G - head:], torch.zeros_like(grads["cmp_rows"][:, :, T * G - head:]))


def _check_kernels(B, T, Hkv, G, Dv, head, extra, dtype, device):
    x = make_inputs(B, T, Hkv, G, Dv, head, extra, dtype, seed=2, device=device)
    do = torch.randn(B, T, Hkv * G, Dv, device=device, dtype=torch.float64).to(dtype)
    o, grads = _grads(lambda **a: gated_sum(**a, impl="triton"), x, do)
    o_ref, grads_ref = _grads(lambda **a: gated_sum(**a, impl="torch"), x, do)
    assert o.dtype == dtype and o.shape == o_ref.shape
    # Both sum in fp32 and round once to the dtype; fp32 differs by FMA contraction only.
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    assert (o.double() - o_ref.double()).abs().max() <= tol * o_ref.double().abs().max()
    for name, ref in grads_ref.items():
        assert grads[name].dtype == ref.dtype and grads[name].shape == ref.shape, name
        # gates' grads are sums over Dv: scale the bound by the sum's size.
        assert (grads[name].double() - ref.double()).abs().max() <= tol * ref.double().abs().max().clamp_min(1), name
    pad = grads["cmp_rows"][:, :, T * G - head:]
    assert torch.equal(pad, torch.zeros_like(pad))


@interpreter
@pytest.mark.parametrize("B,T,Hkv,G,Dv,head,extra", SHAPES)
def test_kernels_interpreted_equal_the_twin(B, T, Hkv, G, Dv, head, extra):
    _check_kernels(B, T, Hkv, G, Dv, head, extra, torch.float32, "cpu")


@interpreter
def test_kernels_interpreted_catch_a_shifted_head():
    """The comparison can fail: the compressed rows read one row off (head - 1) differ from the twin."""
    x = make_inputs(1, 37, 2, 4, 24, 31 * 4, 20, torch.float32, seed=3)
    good = gated_sum(**x, impl="torch")
    shifted = gated_sum(**{**x, "head": x["head"] - 1}, impl="triton")
    assert (good - shifted).abs().max() > 1e-3


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("B,T,Hkv,G,Dv,head,extra", SHAPES)
def test_kernels_cuda_equal_the_twin(B, T, Hkv, G, Dv, head, extra, dtype):
    _check_kernels(B, T, Hkv, G, Dv, head, extra, dtype, "cuda")


@gpu
def test_compiled_fullgraph_cuda():
    x = make_inputs(1, 300, 2, 4, 64, 31 * 4, 4 * 4, torch.bfloat16, seed=4, device="cuda")
    do = torch.randn(1, 300, 8, 64, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(lambda **a: gated_sum(**a), fullgraph=True, dynamic=False)
    o, grads = _grads(compiled, x, do)
    o_ref, grads_ref = _grads(lambda **a: gated_sum(**a, impl="torch"), x, do)
    assert (o.float() - o_ref.float()).abs().max() <= 1.6e-2 * o_ref.float().abs().max()
    for name, ref in grads_ref.items():
        assert (grads[name].float() - ref.float()).abs().max() <= 1.6e-2 * ref.float().abs().max().clamp_min(1), name


def _check_folded_sel(x, impl, exact):
    """gated_sum with o_sel folded (sel_folded=True) against the same sum with o_sel unfolded: the
    same output, and o_sel's gradient the folded one's."""
    Hkv = x["o_win"].shape[1]
    do = torch.randn(x["gates"].shape[:3] + x["o_sel"].shape[-1:], dtype=torch.float64).to(x["o_sel"].dtype)
    o, grads = _grads(lambda **a: gated_sum(**a, impl=impl), x, do)
    folded = {**x, "o_sel": fold(x["o_sel"], Hkv).contiguous()}
    o_f, grads_f = _grads(lambda **a: gated_sum(**a, impl=impl, sel_folded=True), folded, do)
    grads["o_sel"] = fold(grads["o_sel"], Hkv)
    close = torch.equal if exact else (lambda a, b: (a - b).abs().max() <= 8 * torch.finfo(a.dtype).eps * b.abs().max())
    assert o_f.shape == o.shape and close(o_f, o)
    for name, ref in grads.items():
        assert grads_f[name].shape == ref.shape and close(grads_f[name], ref), name


@pytest.mark.parametrize("B,T,Hkv,G,Dv,head,extra", SHAPES)
def test_twin_folded_sel_equals_unfolded(B, T, Hkv, G, Dv, head, extra):
    _check_folded_sel(make_inputs(B, T, Hkv, G, Dv, head, extra, torch.float64, seed=6), "torch", exact=False)


@interpreter
@pytest.mark.parametrize("B,T,Hkv,G,Dv,head,extra", SHAPES)
def test_kernels_interpreted_folded_sel_equal_unfolded(B, T, Hkv, G, Dv, head, extra):
    """The kernels read o_sel by (batch, token, kv head, group member) strides: either layout, the
    same fp32 sums, bit for bit."""
    _check_folded_sel(make_inputs(B, T, Hkv, G, Dv, head, extra, torch.float32, seed=7), "triton", exact=True)


@interpreter
def test_kernels_interpreted_catch_a_folded_sel_read_unfolded():
    """The comparison can fail: a folded o_sel read as if unfolded (its storage viewed [B, T, Hq, Dv])
    gives another sum."""
    x = make_inputs(1, 37, 2, 4, 24, 31 * 4, 20, torch.float32, seed=8)
    folded = fold(x["o_sel"], 2).contiguous()
    wrong = gated_sum(**{**x, "o_sel": folded.view(x["o_sel"].shape)}, impl="triton")
    assert (wrong - gated_sum(**x, impl="triton")).abs().max() > 1e-3


def test_folded_rows_dense():
    x = torch.arange(2 * 6 * 3, dtype=torch.float32).view(1, 2, 6, 3)
    d = FoldedRows(x, 2).dense(7)
    assert torch.equal(d[:, :, :2], torch.zeros(1, 2, 2, 3)) and torch.equal(d[:, :, 2:], x[:, :, :5])
    whole = FoldedRows(x, 0).dense(6)  # all rows held: a view, no copy
    assert torch.equal(whole, x) and whole.data_ptr() == x.data_ptr()


def test_opcheck_cpu():
    """Schema, fake and autograd registrations (the twin's body: opcheck runs the op on fake tensors,
    which Triton's interpreter cannot read)."""
    x = make_inputs(1, 37, 2, 4, 24, 31 * 4, 20, torch.float32, seed=5)
    args = tuple(x[n] for n in ("cmp_rows", "head", "o_sel", "o_win", "gates"))
    torch.library.opcheck(torch.ops.nsa_flex.gated_sum.default,
                          (args[0].requires_grad_(), args[1], *(a.requires_grad_() for a in args[2:]), "torch"))
    folded = fold(x["o_sel"], 2).contiguous().requires_grad_()
    torch.library.opcheck(torch.ops.nsa_flex.gated_sum.default,
                          (args[0], args[1], folded, args[3], args[4], "torch", True))


@pytest.mark.parametrize("change, error, message", [
    (dict(o_sel=torch.randn(2, 8, 4)), ValueError, "o_sel must be"),
    (dict(o_win=torch.randn(1, 2, 36, 24)), ValueError, "o_win .* must be"),
    (dict(cmp_rows=torch.randn(1, 3, 40, 24)), ValueError, "cmp_rows .* must be"),
    (dict(head=200), ValueError, "head=200"),
    (dict(head=-1), ValueError, "head=-1"),
    (dict(cmp_rows=torch.randn(1, 2, 3, 24)), ValueError, "head \\+ R >= T\\*G"),
    (dict(gates=torch.rand(1, 37, 8, 2)), ValueError, "gates .* must be"),
    (dict(o_win=torch.randn(1, 2, 148, 24).half()), TypeError, "dtypes"),
    (dict(impl="cuda"), ValueError, "allowed"),
    (dict(o_sel=torch.randn(1, 2, 148, 24)), ValueError, "folded o_sel .* needs sel_folded=True"),
    (dict(sel_folded=True), ValueError, "with sel_folded must be folded as o_win"),
    (dict(sel_folded=1), TypeError, "sel_folded=1"),
], ids=["sel-dims", "win-rows", "cmp-heads", "head-past", "head-negative", "too-few-rows", "gates", "dtype", "impl",
        "folded-sel-without-flag", "unfolded-sel-with-flag", "flag-type"])
def test_bad_inputs(change, error, message):
    x = make_inputs(1, 37, 2, 4, 24, 31 * 4, 20, torch.float32)
    with pytest.raises(error, match=message):
        gated_sum(**{**x, **change})
