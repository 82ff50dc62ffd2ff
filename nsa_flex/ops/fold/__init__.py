"""The folded GQA layout as an op, nsa_flex::fold: q [B, T, Hq, D] -> [B, Hkv, R, D] (nsa_flex.folded);
nsa_flex::fold_pairs, some (batch, kv head) pairs of it.

Compiled, a fold written in torch is a pointwise node that Inductor does not store once: each
kernel launch outside Inductor's own code (the grouped cuDNN call, the Flex calls, each token
range of the selected op) got its own copy, six at T=64k in inference (docs/decisions.md, "The
gated sum as one op"). An op's output is one buffer that every reader shares.

On CUDA the op runs the Triton kernel (kernels.py); elsewhere, or without Triton, its torch twin
nsa_flex.folded.fold. impl="triton" forces the kernel, e.g. on CPU under Triton's interpreter.
"""

# No `from __future__ import annotations` here: torch.library reads the ops' annotations.
import torch
from torch import Tensor
from torch.library import triton_op

from nsa_flex import folded
from nsa_flex.ops.fold import kernels
from nsa_flex.ops.triton_utils import HAS_TRITON, dense, next_pow2, quiet_without_triton, runs_triton

if HAS_TRITON:
    from torch.library import wrap_triton

_IMPLS = ("auto", "triton", "torch")
_ROWS = 64


def fold(x: Tensor, Hkv: int, rows: int | None = None, *, impl: str = "auto") -> Tensor:
    """x [B, T, Hq, D] -> contiguous [B, Hkv, rows, D] (rows >= T*G, default T*G; zeros past T*G):
    row t*G + g of kv head h is query head h*G + g at token t. Differentiable."""
    rows = _check(x, Hkv, rows, impl)
    return torch.ops.nsa_flex.fold(x, Hkv, rows, impl)


def _check(x, Hkv, rows, impl: str) -> int:
    """The rows per kv head (rows, or T*G for None) of valid arguments; else a ValueError / TypeError."""
    if impl not in _IMPLS:
        raise ValueError(f"impl={impl!r}; allowed: {', '.join(_IMPLS)}")
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor [B, T, Hq, D], got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"x must be a [B, T, Hq, D] tensor, got shape {tuple(x.shape)}")
    B, T, Hq, D = x.shape
    if isinstance(Hkv, bool) or not isinstance(Hkv, int) or Hkv <= 0 or Hq % Hkv:
        raise ValueError(f"Hkv={Hkv!r} must be a positive divisor of x's {Hq} heads")
    rows = T * (Hq // Hkv) if rows is None else rows
    if rows < T * (Hq // Hkv):
        raise ValueError(f"rows={rows} must be at least T*G = {T * (Hq // Hkv)}")
    return rows


def _fold_impl(x: Tensor, Hkv: int, rows: int, impl: str) -> Tensor:
    if not runs_triton(x, impl):
        # A new tensor: the fold is a view of x where G or T is 1, and an op's output may not alias its input.
        return folded.fold(x, Hkv, rows).clone(memory_format=torch.contiguous_format)
    B, _, _, D = x.shape
    return _launch(x, Hkv, rows, 0, B * Hkv).view(B, Hkv, rows, D)


def fold_pairs(x: Tensor, Hkv: int, rows: int, first: int, count: int, *, impl: str = "auto") -> Tensor:
    """fold(x, Hkv, rows) of `count` (batch, kv head) pairs from pair `first` on (pair b * Hkv + h):
    contiguous [count, rows, D], the rest never written. Not differentiable: the grouped cuDNN
    call's backward folds, call by call, the rows that call reads (ops.gated_branches)."""
    rows = _check(x, Hkv, rows, impl)
    pairs = x.shape[0] * Hkv
    if any(isinstance(i, bool) or not isinstance(i, int) for i in (first, count)) \
            or not 0 <= first < first + count <= pairs:
        raise ValueError(f"first={first!r}, count={count!r}: the pairs must be count >= 1 of the {pairs} (batch, kv "
                         "head) pairs from first on")
    return torch.ops.nsa_flex.fold_pairs(x, Hkv, rows, first, count, impl)


def _fold_pairs_impl(x: Tensor, Hkv: int, rows: int, first: int, count: int, impl: str) -> Tensor:
    if not runs_triton(x, impl):
        B, _, _, D = x.shape
        return folded.fold(x, Hkv, rows).reshape(B * Hkv, rows, D)[first:first + count].clone()
    return _launch(x, Hkv, rows, first, count)


def _launch(x: Tensor, Hkv: int, rows: int, first: int, count: int) -> Tensor:
    """The kernel's folded rows of pairs first .. first + count - 1: [count, rows, D]."""
    x, = dense(x)
    _, T, Hq, D = x.shape
    out = torch.empty(count, rows, D, dtype=x.dtype, device=x.device)
    if count * rows * D > 0:
        wrap_triton(kernels._fold_kernel)[(-(-rows // _ROWS), count)](
            x, out, T, Hkv, Hq // Hkv, rows, first, *x.stride()[:3], *out.stride()[:2], ROWS=_ROWS, D=D,
            DP=max(16, next_pow2(D)), num_warps=4)
    return out


with quiet_without_triton():
    _fold_op = triton_op("nsa_flex::fold", mutates_args=())(_fold_impl)
    _fold_pairs_op = triton_op("nsa_flex::fold_pairs", mutates_args=())(_fold_pairs_impl)


@_fold_op.register_fake
def _fold_fake(x, Hkv, rows, impl):
    return x.new_empty(x.shape[0], Hkv, rows, x.shape[3])


@_fold_pairs_op.register_fake
def _fold_pairs_fake(x, Hkv, rows, first, count, impl):
    return x.new_empty(count, rows, x.shape[3])


def _setup_context(ctx, inputs, output):
    x, Hkv = inputs[0], inputs[1]
    ctx.T, ctx.used = x.shape[1], x.shape[1] * (x.shape[2] // Hkv)


def _backward(ctx, grad):
    # The unfold of the T*G rows that hold x (compiled, Inductor fuses it with the gradient's sum).
    return folded.unfold(grad[:, :, :ctx.used], ctx.T), None, None, None


_fold_op.register_autograd(_backward, setup_context=_setup_context)
