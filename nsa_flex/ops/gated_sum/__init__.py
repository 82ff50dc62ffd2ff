"""NSA's gated sum of its three branch outputs: the op nsa_flex::gated_sum.

o = g_cmp o_cmp + g_sel o_sel + g_win o_win per token and query head, read from the layouts the
branches leave: the compressed output as folded rows held from a row `head` on (the grouped
cuDNN call's output, a view; the rows before `head`, tokens before the first complete
compression block, are zero), the selected output unfolded (or folded, as the gated node keeps
it), the window output folded. Fused
by Inductor instead, the sum first padded the compressed output into a new [T, Hq, Dv] tensor
(kept for the backward beside cuDNN's own copy), and its backward wrote the selected branch's
output gradient once per launch that reads it (docs/decisions.md, "The gated sum as one op").

On CUDA the op runs the Triton kernels (kernels.py); elsewhere, or without Triton, the torch
twin (twin.py). impl="triton" forces the kernels, e.g. on CPU under Triton's interpreter in tests.
"""

# No `from __future__ import annotations` here: torch.library reads the ops' annotations.
import torch
from torch import Tensor
from torch.library import triton_op

from nsa_flex.folded import group_strides
from nsa_flex.ops.gated_sum import kernels, twin
from nsa_flex.ops.triton_utils import HAS_TRITON, dense, next_pow2, quiet_without_triton, runs_triton
from nsa_flex.validate import check_4d

if HAS_TRITON:
    from torch.library import wrap_triton

_IMPLS = ("auto", "triton", "torch")
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Folded rows per program: with Dv = 128, four [64, 128] fp32 tiles in flight.
_ROWS = 64


def gated_sum(cmp_rows: Tensor, head: int, o_sel: Tensor, o_win: Tensor, gates: Tensor, *,
              impl: str = "auto", sel_folded: bool = False) -> Tensor:
    """o [B, T, Hq, Dv] in o_sel's dtype, summed in fp32; differentiable in every tensor.

    cmp_rows [B, Hkv, R, Dv]: the compressed branch's folded rows head .. head + R - 1 (row t*G + g
    of kv head h is query head h*G + g at token t; rows before head are zero, rows past T*G are
    ignored), with 0 <= head <= T*G and head + R >= T*G. o_sel [B, T, Hq, Dv] unfolded, or with
    sel_folded folded [B, Hkv, T*G, Dv] as o_win (the gated node's own o_sel), o_win
    [B, Hkv, T*G, Dv] folded, gates [B, T, Hq, 3] (cmp, sel, win, after the sigmoid). impl: "auto"
    (Triton on CUDA, else the twin), "triton" or "torch".
    """
    _check_inputs(cmp_rows, head, o_sel, o_win, gates, impl, sel_folded)
    return torch.ops.nsa_flex.gated_sum(cmp_rows, head, o_sel, o_win, gates, impl, sel_folded)


def _forward_impl(cmp_rows: Tensor, head: int, o_sel: Tensor, o_win: Tensor, gates: Tensor, impl: str,
                  sel_folded: bool = False) -> Tensor:
    if not runs_triton(o_sel, impl):
        return twin.forward(cmp_rows, head, o_sel, o_win, gates, sel_folded)
    cmp_rows, o_sel, o_win, gates = dense(cmp_rows, o_sel, o_win, gates)
    B, T, Hq, Dv = out_shape(o_sel, gates)
    Hkv = o_win.shape[1]
    out = o_sel.new_empty(B, T, Hq, Dv)
    if B * T * Hq > 0:
        wrap_triton(kernels._sum_kernel)[_grid(T * Hq // Hkv, B * Hkv)](
            cmp_rows, o_sel, o_win, gates, out, T, Hkv, Hq // Hkv, head, cmp_rows.shape[2],
            *_bhr(cmp_rows), *group_strides(o_sel, Hq // Hkv, sel_folded), *_bhr(o_win), *gates.stride()[:3],
            *out.stride()[:3], ROWS=_ROWS, D=Dv, DP=max(16, next_pow2(Dv)), num_warps=4)
    return out


def _backward_impl(do: Tensor, cmp_rows: Tensor, head: int, o_sel: Tensor, o_win: Tensor, gates: Tensor,
                   impl: str, sel_folded: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if not runs_triton(o_sel, impl):
        return twin.backward(do, cmp_rows, head, o_sel, o_win, gates, sel_folded)
    do, cmp_rows, o_sel, o_win, gates = dense(do, cmp_rows, o_sel, o_win, gates)
    B, T, Hq, Dv = out_shape(o_sel, gates)
    Hkv = o_win.shape[1]
    d_cmp, d_sel, d_win, d_gates = (torch.empty_like(x) for x in (cmp_rows, o_sel, o_win, gates))
    # The grid reaches the compressed buffer's last row, which may lie past the sequence's.
    rows = max(T * Hq // Hkv, head + cmp_rows.shape[2])
    if B * T * Hq > 0:
        wrap_triton(kernels._sum_bwd_kernel)[_grid(rows, B * Hkv)](
            do, cmp_rows, o_sel, o_win, gates, d_cmp, d_sel, d_win, d_gates, T, Hkv, Hq // Hkv, head,
            cmp_rows.shape[2], *do.stride()[:3], *_bhr(cmp_rows), *group_strides(o_sel, Hq // Hkv, sel_folded),
            *_bhr(o_win), *gates.stride()[:3], *d_gates.stride()[:3], ROWS=_ROWS, D=Dv, DP=max(16, next_pow2(Dv)),
            num_warps=4)
    return d_cmp, d_sel, d_win, d_gates


def out_shape(o_sel: Tensor, gates: Tensor) -> tuple[int, int, int, int]:
    """The sum's [B, T, Hq, Dv], from the gates [B, T, Hq, 3] and o_sel's Dv (o_sel unfolded or folded)."""
    return (*gates.shape[:3], o_sel.shape[-1])


def backward_deltas(do: Tensor, cmp_rows: Tensor, head: int, o_sel: Tensor, o_win: Tensor,
                    gates: Tensor, cmp_apart: bool = False, sel_folded: bool = False) -> tuple[Tensor, ...]:
    """The gated sum's backward for a caller that takes the selected and window branches' output
    gradients as g_b dO inside their kernels (nsa_flex::gated_branches): (d cmp_rows, d gates,
    delta_sel [B, Hq, T], delta_win [B, Hkv, T*G], gate_sel, gate_win): the deltas rowsum(dO * o_b)
    and the two gates per row, fp32, in the layouts of those branches' lse. Triton kernels (CUDA,
    or CPU under the interpreter); arguments as gated_sum's, already checked.

    cmp_apart: d cmp_rows = g_cmp dO in a launch of its own after the rest, so that it is
    allocated once o_sel and o_win are no longer needed (one more read of dO): with the three
    branch outputs, q and o alive, one more [T, Hq, Dv] there was the op's peak at G=16, 64k
    (docs/decisions.md). sel_folded: o_sel folded, as gated_sum takes it."""
    do, cmp_rows, o_sel, o_win, gates = dense(do, cmp_rows, o_sel, o_win, gates)
    B, T, Hq, Dv = out_shape(o_sel, gates)
    Hkv = o_win.shape[1]
    d_gates = torch.empty_like(gates)
    delta_sel, gate_sel = (torch.empty(B, Hq, T, dtype=torch.float32, device=do.device) for _ in range(2))
    delta_win, gate_win = (torch.empty(B, Hkv, T * (Hq // Hkv), dtype=torch.float32, device=do.device)
                           for _ in range(2))
    rows = max(T * Hq // Hkv, head + cmp_rows.shape[2])

    def launch(d_cmp, sel, win, stats: bool, cmp_grad: bool):
        if B * T * Hq > 0:
            wrap_triton(kernels._sum_deltas_kernel)[_grid(rows, B * Hkv)](
                do, cmp_rows, sel, win, gates, d_cmp, d_gates, delta_sel, delta_win, gate_sel, gate_win, T, Hkv,
                Hq // Hkv, head, cmp_rows.shape[2], *do.stride()[:3], *_bhr(cmp_rows),
                *group_strides(o_sel, Hq // Hkv, sel_folded), *_bhr(o_win), *gates.stride()[:3],
                *d_gates.stride()[:3], ROWS=_ROWS, D=Dv, DP=max(16, next_pow2(Dv)), STATS=stats, CMP_GRAD=cmp_grad,
                num_warps=4)

    if cmp_apart:
        # The first launch stores no d cmp_rows (d_gates stands in for the pointer); the second reads
        # neither branch output, and do stands in for them: a tensor a traced launch takes counts as
        # read, and o_sel / o_win would be kept until it.
        launch(d_gates, o_sel, o_win, True, False)
        d_cmp = torch.empty_like(cmp_rows)
        launch(d_cmp, do, do, False, True)
    else:
        d_cmp = torch.empty_like(cmp_rows)
        launch(d_cmp, o_sel, o_win, True, True)
    return d_cmp, d_gates, delta_sel, delta_win, gate_sel, gate_win


def _grid(rows: int, bh: int) -> tuple[int, int]:
    return (-(-rows // _ROWS), bh)


def _bhr(x: Tensor) -> tuple[int, int, int]:
    """Strides of a folded [B, Hkv, rows, D] tensor's batch, head and row."""
    return x.stride(0), x.stride(1), x.stride(2)


with quiet_without_triton():
    _forward_op = triton_op("nsa_flex::gated_sum", mutates_args=())(_forward_impl)
    _backward_op = triton_op("nsa_flex::gated_sum_backward", mutates_args=())(_backward_impl)


@_forward_op.register_fake
def _forward_fake(cmp_rows, head, o_sel, o_win, gates, impl, sel_folded=False):
    return o_sel.new_empty(out_shape(o_sel, gates))


@_backward_op.register_fake
def _backward_fake(do, cmp_rows, head, o_sel, o_win, gates, impl, sel_folded=False):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (cmp_rows, o_sel, o_win, gates))


def _setup_context(ctx, inputs, output):
    cmp_rows, head, o_sel, o_win, gates, impl, sel_folded = inputs
    ctx.save_for_backward(cmp_rows, o_sel, o_win, gates)
    ctx.args = (head, impl, sel_folded)


def _backward(ctx, do):
    cmp_rows, o_sel, o_win, gates = ctx.saved_tensors
    head, impl, sel_folded = ctx.args
    d_cmp, d_sel, d_win, d_gates = torch.ops.nsa_flex.gated_sum_backward(do, cmp_rows, head, o_sel, o_win, gates,
                                                                          impl, sel_folded)
    return d_cmp, None, d_sel, d_win, d_gates, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _check_inputs(cmp_rows, head, o_sel, o_win, gates, impl, sel_folded: bool = False) -> None:
    """Shape, dtype and device checks; every error says what was wrong and what is allowed."""
    if impl not in _IMPLS:
        raise ValueError(f"impl={impl!r}; allowed: {', '.join(_IMPLS)}")
    if not isinstance(sel_folded, bool):
        raise TypeError(f"sel_folded={sel_folded!r}: True (o_sel folded [B, Hkv, T*G, Dv]) or False ([B, T, Hq, Dv])")
    sel_layout = "[B, Hkv, T*G, Dv] (sel_folded)" if sel_folded else "[B, T, Hq, Dv]"
    check_4d({"cmp_rows": (cmp_rows, "[B, Hkv, R, Dv]"), "o_sel": (o_sel, sel_layout),
              "o_win": (o_win, "[B, Hkv, T*G, Dv]"), "gates": (gates, "[B, T, Hq, 3]")}, "o_sel")
    if sel_folded:
        if o_sel.shape != o_win.shape:
            raise ValueError(f"o_sel {tuple(o_sel.shape)} with sel_folded must be folded as o_win "
                             f"{tuple(o_win.shape)}: [B, Hkv, T*G, Dv]")
        shape = out_shape(o_sel, gates)
    else:
        shape = tuple(o_sel.shape)
        if shape != out_shape(o_sel, gates):
            raise ValueError(f"o_sel {shape} must be [B, T, Hq, Dv] as the gates {tuple(gates.shape)} are "
                             "[B, T, Hq, 3]; a folded o_sel [B, Hkv, T*G, Dv] needs sel_folded=True")
    check_branch_outputs(cmp_rows, head, o_win, gates, shape, o_sel.dtype, runs_triton(o_sel, impl))


def check_branch_outputs(cmp_rows, head, o_win, gates, out_shape: tuple, dtype: torch.dtype, triton: bool) -> None:
    """The gated sum's inputs other than o_sel fit an output [B, T, Hq, Dv] = out_shape of `dtype`
    (o_sel's); 4-D tensors on one device already checked. triton: the kernels run (no fp64)."""
    B, T, Hq, Dv = out_shape
    Hkv = o_win.shape[1]
    if Hkv == 0 or Hq % Hkv != 0 or o_win.shape != (B, Hkv, T * (Hq // max(1, Hkv)), Dv):
        raise ValueError(f"o_win {tuple(o_win.shape)} must be [B, Hkv, T*G, Dv] for an output [B, T, Hq, Dv] = "
                         f"{out_shape} (Hkv dividing Hq)")
    rows = o_win.shape[2]
    if cmp_rows.shape[:2] != (B, Hkv) or cmp_rows.shape[3] != Dv:
        raise ValueError(f"cmp_rows {tuple(cmp_rows.shape)} must be [{B}, {Hkv}, R, {Dv}]")
    if isinstance(head, bool) or not isinstance(head, int) or not 0 <= head <= rows \
            or head + cmp_rows.shape[2] < rows:
        raise ValueError(f"head={head!r} with {cmp_rows.shape[2]} held rows must satisfy 0 <= head <= T*G = {rows} "
                         "and head + R >= T*G")
    if gates.shape != (B, T, Hq, 3):
        raise ValueError(f"gates {tuple(gates.shape)} must be [{B}, {T}, {Hq}, 3]")
    allowed = _DTYPES if triton else _DTYPES + (torch.float64,)
    if dtype not in allowed or cmp_rows.dtype != dtype or o_win.dtype != dtype or gates.dtype not in allowed:
        raise TypeError(f"cmp_rows, o_sel, o_win, gates have dtypes {cmp_rows.dtype}, {dtype}, {o_win.dtype}, "
                        f"{gates.dtype}; the outputs must share one of {', '.join(map(str, allowed))}, and gates be one")
