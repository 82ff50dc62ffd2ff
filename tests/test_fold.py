"""nsa_flex::fold (the folded GQA layout as an op) and nsa_flex::fold_pairs (some (batch, kv head)
pairs of it): the kernel, interpreted on CPU or on CUDA, against the torch fold, forward and
backward, and the argument checks."""

from __future__ import annotations

import importlib

import pytest
import torch

from interpreter import interpreter_mark
from nsa_flex import folded
from nsa_flex.ops.fold import fold, fold_pairs, kernels

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


def _check_pairs(impl, device):
    """Every run of pairs of B=2, Hkv=3 against the torch fold's rows of those pairs, bit for bit."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 37, 12, 24, generator=g).to(device)
    want = folded.fold(x, 3, 160).reshape(6, 160, 24)
    for first in range(6):
        for count in range(1, 7 - first):
            out = fold_pairs(x, 3, 160, first, count, impl=impl)
            assert out.is_contiguous() and torch.equal(out, want[first:first + count]), (first, count)


@interpreter
def test_pairs_kernel_interpreted_equals_torch_fold():
    _check_pairs("triton", "cpu")


def test_pairs_twin_equals_torch_fold():
    _check_pairs("torch", "cpu")


@gpu
def test_pairs_kernel_cuda_equals_torch_fold():
    _check_pairs("auto", "cuda")


@pytest.mark.parametrize("first, count", [(-1, 2), (5, 2), (0, 0), (6, 1), (True, 1), (0, 1.0)])
def test_pairs_out_of_range(first, count):
    with pytest.raises(ValueError, match=f"first={first!r}, count={count!r}: .* of the 6 \\(batch, kv head\\) pairs"):
        fold_pairs(torch.randn(2, 3, 6, 8), 3, 6, first, count)


def test_pairs_opcheck_cpu():
    torch.library.opcheck(torch.ops.nsa_flex.fold_pairs.default, (torch.randn(2, 5, 4, 8), 2, 12, 1, 2, "torch"))


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
