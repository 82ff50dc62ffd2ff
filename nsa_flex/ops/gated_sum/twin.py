"""The torch twin of nsa_flex::gated_sum: the same formulas on dense tensors (any device, fp32
math, fp64 stays fp64). The CPU path and the tests' second opinion."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from nsa_flex.folded import FoldedRows, fold, unfold


def forward(cmp_rows: Tensor, head: int, o_sel: Tensor, o_win: Tensor, gates: Tensor,
            sel_folded: bool = False) -> Tensor:
    """o [B, T, Hq, Dv] in o_sel's dtype: arguments as nsa_flex.ops.gated_sum."""
    T = gates.shape[1]
    o_sel = unfold(o_sel, T) if sel_folded else o_sel
    acc = torch.promote_types(o_sel.dtype, torch.float32)
    g = gates.to(acc)
    o = g[..., 0:1] * unfold(FoldedRows(cmp_rows, head).dense(o_win.shape[2]), T).to(acc) \
        + g[..., 1:2] * o_sel.to(acc) + g[..., 2:3] * unfold(o_win, T).to(acc)
    return o.to(o_sel.dtype)


def backward(do: Tensor, cmp_rows: Tensor, head: int, o_sel: Tensor, o_win: Tensor,
             gates: Tensor, sel_folded: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(d cmp_rows, d o_sel, d o_win, d gates), each in its input's shape and dtype."""
    T = gates.shape[1]
    o_sel = unfold(o_sel, T) if sel_folded else o_sel
    Hkv, rows = o_win.shape[1], o_win.shape[2]
    acc = torch.promote_types(o_sel.dtype, torch.float32)
    g, do_ = gates.to(acc), do.to(acc)
    o_cmp = unfold(FoldedRows(cmp_rows, head).dense(rows), T).to(acc)
    d_cmp = fold(g[..., 0:1] * do_, Hkv)[:, :, head:]
    # Rows of the compressed buffer past the sequence's last row (padding) get zeros.
    d_cmp = F.pad(d_cmp, (0, 0, 0, cmp_rows.shape[2] - d_cmp.shape[2]))
    d_gates = torch.stack([(do_ * o_cmp).sum(-1), (do_ * o_sel.to(acc)).sum(-1),
                           (do_ * unfold(o_win, T).to(acc)).sum(-1)], dim=-1)
    d_sel = g[..., 1:2] * do_
    return (d_cmp.to(cmp_rows.dtype), (fold(d_sel, Hkv) if sel_folded else d_sel).to(o_sel.dtype),
            fold(g[..., 2:3] * do_, Hkv).to(o_win.dtype), d_gates.to(gates.dtype))

