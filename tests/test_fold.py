"""nsa_flex::fold (the folded GQA layout as an op): the kernel, interpreted on CPU or on CUDA,
against the torch fold, forward and backward, and its argument checks."""

from __future__ import annotations

import importlib

import pytest
import torch

from interpreter import interpreter_mark
from nsa_flex import folded
from nsa_flex.ops.fold import fold, kernels

gpu = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)
interpreter = interpreter_mark(getattr(kernels, "_fold_kernel", None))

CASES = pytest.mark.parametrize("B,T,Hkv,G,D,extra", [(1, 37, 2, 4, 24, 20), (2, 19, 3, 3, 16, 0),
                                                      (1, 70, 1, 16, 64, 100)],
                                ids=["G4-pad", "G3-B2", "G16-pad-two-tiles"])


def _check(B, T, Hkv, G, D, extra, dtype, device):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(B, T, Hkv * G, D, generator=g).to(device=device, dtype=dtype)
    rows = T * G + extra
    a, b = (x.detach().clone().requires_grad_() for _ in range(2))
    out = fold(a, Hkv, rows, impl="triton")
    want = folded.fold(b, Hkv, rows)
    assert out.is_contiguous() and torch.equal(out, want)
    grad = torch.randn(out.shape, generator=g).to(device=device, dtype=dtype)
    ga, = torch.autograd.grad(out, a, grad)
    gb, = torch.autograd.grad(want, b, grad)
    assert torch.equal(ga, gb)


@interpreter
@CASES
def test_kernel_interpreted_equals_torch_fold(B, T, Hkv, G, D, extra):
    _check(B, T, Hkv, G, D, extra, torch.float32, "cpu")


@interpreter
def test_kernel_interpreted_zeroes_rows_past_the_sequence(monkeypatch):
    """The padding rows are written, not left over from the allocation (which starts as NaN here)."""
    # The module itself: nsa_flex.ops exports the function under the same name.
    op = importlib.import_module("nsa_flex.ops.fold")
    real = torch.empty
    monkeypatch.setattr(op.torch, "empty", lambda *a, **k: real(*a, **k).fill_(float("nan")))
    out = fold(torch.randn(1, 5, 4, 16), 2, 30, impl="triton")
    assert torch.equal(out[:, :, 10:], torch.zeros(1, 2, 20, 16))


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@CASES
def test_kernel_cuda_equals_torch_fold(B, T, Hkv, G, D, extra, dtype):
    _check(B, T, Hkv, G, D, extra, dtype, "cuda")


@pytest.mark.parametrize("args, message", [
    ((torch.randn(2, 3, 4), 2), "must be a \\[B, T, Hq, D\\] tensor, got shape"),
    ((torch.randn(1, 3, 4, 8), 3), "positive divisor"),
    ((torch.randn(1, 3, 4, 8), 2, 5), "at least T\\*G = 6"),
], ids=["dims", "heads", "rows"])
def test_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        fold(*args)


def test_opcheck_cpu():
    torch.library.opcheck(torch.ops.nsa_flex.fold.default, (torch.randn(1, 5, 4, 8, requires_grad=True), 2, 12, "torch"))
