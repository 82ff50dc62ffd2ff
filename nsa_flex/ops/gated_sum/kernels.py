"""Triton kernels of nsa_flex::gated_sum: the gated sum of NSA's three branch outputs, each way in one pass.

A program takes ROWS folded rows r = t * G + g of one (batch, kv head h): token t, query head
h * G + g. It reads the branches where they lie: the compressed output as folded rows held from
row HEAD on (the grouped cuDNN call's own output, rows before HEAD are zero), the selected
output unfolded [B, T, Hq, Dv] or folded (through its batch, token, kv head and group-member
strides), the window output folded [B, Hkv, T * G, Dv], and the gates [B, T, Hq, 3]. So no
branch is copied into the other layout first: each byte is read once and each output written
once.

Forward: o = g_cmp o_cmp + g_sel o_sel + g_win o_win in fp32. Backward: each branch's output
gradient g_b dO (in the branch's layout and dtype) and the gates' gradients sum_d dO o_b, from
one read of dO and the three outputs. Rows of the compressed buffer past the sequence's last
row (padding of the grouped call) get zero gradients.
"""

from __future__ import annotations

from nsa_flex.ops.triton_utils import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rows(T, Hkv, G, ROWS: tl.constexpr):
        """(b, h, folded rows r [ROWS], token t, query head hq, group member g) of this program."""
        bh = tl.program_id(1)
        b = (bh // Hkv).to(tl.int64)
        h = (bh % Hkv).to(tl.int64)
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        t = r // G
        g = r % G
        return b, h, r, t, h * G + g, g

    @triton.jit
    def _sum_kernel(
        cmp_ptr, sel_ptr, win_ptr, gate_ptr, out_ptr, T, Hkv, G, HEAD, RC,
        sc_b, sc_h, sc_r, ss_b, ss_t, ss_h, ss_g, sw_b, sw_h, sw_r, sg_b, sg_t, sg_h, so_b, so_t, so_h,
        ROWS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    ):
        """o [B, T, Hq, D] of ROWS folded rows."""
        b, h, r, t, hq, g = _rows(T, Hkv, G, ROWS)
        d = tl.arange(0, DP)
        ok = r < T * G
        c = r - HEAD
        c_ok = ok & (c >= 0) & (c < RC)
        m = ok[:, None] & (d[None, :] < D)
        gate = gate_ptr + b * sg_b + t * sg_t + hq * sg_h
        g0 = tl.load(gate, mask=ok, other=0.0).to(tl.float32)
        g1 = tl.load(gate + 1, mask=ok, other=0.0).to(tl.float32)
        g2 = tl.load(gate + 2, mask=ok, other=0.0).to(tl.float32)
        x_cmp = tl.load(cmp_ptr + b * sc_b + h * sc_h + c[:, None] * sc_r + d[None, :],
                        mask=c_ok[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)
        x_sel = tl.load(sel_ptr + b * ss_b + h * ss_h + (t * ss_t + g * ss_g)[:, None] + d[None, :], mask=m,
                        other=0.0).to(tl.float32)
        x_win = tl.load(win_ptr + b * sw_b + h * sw_h + r[:, None] * sw_r + d[None, :], mask=m,
                        other=0.0).to(tl.float32)
        o = g0[:, None] * x_cmp + g1[:, None] * x_sel + g2[:, None] * x_win
        tl.store(out_ptr + b * so_b + t[:, None] * so_t + hq[:, None] * so_h + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _sum_bwd_kernel(
        do_ptr, cmp_ptr, sel_ptr, win_ptr, gate_ptr, dcmp_ptr, dsel_ptr, dwin_ptr, dgate_ptr, T, Hkv, G, HEAD, RC,
        sdo_b, sdo_t, sdo_h, sc_b, sc_h, sc_r, ss_b, ss_t, ss_h, ss_g, sw_b, sw_h, sw_r, sg_b, sg_t, sg_h,
        sdg_b, sdg_t, sdg_h,
        ROWS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    ):
        """The branches' output gradients g_b dO and the gates' gradients of ROWS folded rows.

        The grid also covers the compressed buffer's rows past the sequence (HEAD + RC > T G):
        those get zeros. Gradient tensors share their inputs' strides."""
        b, h, r, t, hq, g = _rows(T, Hkv, G, ROWS)
        d = tl.arange(0, DP)
        d_ok = d[None, :] < D
        ok = r < T * G
        c = r - HEAD
        c_ok = (c >= 0) & (c < RC)
        m = ok[:, None] & d_ok
        gate = gate_ptr + b * sg_b + t * sg_t + hq * sg_h
        g0 = tl.load(gate, mask=ok, other=0.0).to(tl.float32)
        g1 = tl.load(gate + 1, mask=ok, other=0.0).to(tl.float32)
        g2 = tl.load(gate + 2, mask=ok, other=0.0).to(tl.float32)
        do = tl.load(do_ptr + b * sdo_b + t[:, None] * sdo_t + hq[:, None] * sdo_h + d[None, :], mask=m,
                     other=0.0).to(tl.float32)
        at_cmp = b * sc_b + h * sc_h + c[:, None] * sc_r + d[None, :]
        at_sel = b * ss_b + h * ss_h + (t * ss_t + g * ss_g)[:, None] + d[None, :]
        at_win = b * sw_b + h * sw_h + r[:, None] * sw_r + d[None, :]
        x_cmp = tl.load(cmp_ptr + at_cmp, mask=(ok & c_ok)[:, None] & d_ok, other=0.0).to(tl.float32)
        x_sel = tl.load(sel_ptr + at_sel, mask=m, other=0.0).to(tl.float32)
        x_win = tl.load(win_ptr + at_win, mask=m, other=0.0).to(tl.float32)
        # Past the sequence do is 0 (masked), so the padding rows of the compressed buffer get zeros.
        tl.store(dcmp_ptr + at_cmp, (g0[:, None] * do).to(dcmp_ptr.dtype.element_ty), mask=c_ok[:, None] & d_ok)
        tl.store(dsel_ptr + at_sel, (g1[:, None] * do).to(dsel_ptr.dtype.element_ty), mask=m)
        tl.store(dwin_ptr + at_win, (g2[:, None] * do).to(dwin_ptr.dtype.element_ty), mask=m)
        dgate = dgate_ptr + b * sdg_b + t * sdg_t + hq * sdg_h
        ty = dgate_ptr.dtype.element_ty
        tl.store(dgate, tl.sum(do * x_cmp, axis=1).to(ty), mask=ok)
        tl.store(dgate + 1, tl.sum(do * x_sel, axis=1).to(ty), mask=ok)
        tl.store(dgate + 2, tl.sum(do * x_win, axis=1).to(ty), mask=ok)

    @triton.jit
    def _sum_deltas_kernel(
        do_ptr, cmp_ptr, sel_ptr, win_ptr, gate_ptr, dcmp_ptr, dgate_ptr, delta_sel_ptr, delta_win_ptr, gate_sel_ptr,
        gate_win_ptr, T, Hkv, G,
        HEAD, RC, sdo_b, sdo_t, sdo_h, sc_b, sc_h, sc_r, ss_b, ss_t, ss_h, ss_g, sw_b, sw_h, sw_r, sg_b, sg_t, sg_h,
        sdg_b, sdg_t, sdg_h,
        ROWS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, STATS: tl.constexpr = True,
        CMP_GRAD: tl.constexpr = True,
    ):
        """_sum_bwd_kernel for a caller that takes the selected and window branches' output
        gradients as g_b dO inside their own kernels (nsa_flex::gated_branches): the compressed
        branch's g_cmp dO and the gates' gradients as there, and in place of the other two
        gradients their deltas rowsum(dO * o_b) in fp32 (the gates' gradients before rounding):
        delta_sel [B, Hq, T], delta_win [B, Hkv, T G], dense; and their gates as fp32 rows in the
        same layouts (gate_sel, gate_win), which those kernels read as they read lse.

        STATS: the gates' gradients, the deltas and gate rows; CMP_GRAD: g_cmp dO (both, or one per
        launch: backward_deltas' cmp_apart).

        Its reads repeat _sum_bwd_kernel's: with them in a shared helper (the offsets its stores
        use coming back from a call that took the input pointers), Inductor's analysis counted
        every input of both kernels as written (tests/test_kernel_writes.py)."""
        b, h, r, t, hq, g = _rows(T, Hkv, G, ROWS)
        d = tl.arange(0, DP)
        d_ok = d[None, :] < D
        ok = r < T * G
        c = r - HEAD
        c_ok = (c >= 0) & (c < RC)
        m = ok[:, None] & d_ok
        gate = gate_ptr + b * sg_b + t * sg_t + hq * sg_h
        g0 = tl.load(gate, mask=ok, other=0.0).to(tl.float32)
        g1 = tl.load(gate + 1, mask=ok, other=0.0).to(tl.float32)
        g2 = tl.load(gate + 2, mask=ok, other=0.0).to(tl.float32)
        do = tl.load(do_ptr + b * sdo_b + t[:, None] * sdo_t + hq[:, None] * sdo_h + d[None, :], mask=m,
                     other=0.0).to(tl.float32)
        at_cmp = b * sc_b + h * sc_h + c[:, None] * sc_r + d[None, :]
        if CMP_GRAD:
            # Past the sequence do is 0 (masked), so the padding rows of the compressed buffer get zeros.
            tl.store(dcmp_ptr + at_cmp, (g0[:, None] * do).to(dcmp_ptr.dtype.element_ty),
                     mask=c_ok[:, None] & d_ok)
        if STATS:
            x_cmp = tl.load(cmp_ptr + at_cmp, mask=(ok & c_ok)[:, None] & d_ok, other=0.0).to(tl.float32)
            x_sel = tl.load(sel_ptr + b * ss_b + h * ss_h + (t * ss_t + g * ss_g)[:, None] + d[None, :], mask=m,
                            other=0.0).to(tl.float32)
            x_win = tl.load(win_ptr + b * sw_b + h * sw_h + r[:, None] * sw_r + d[None, :], mask=m,
                            other=0.0).to(tl.float32)
            d_sel = tl.sum(do * x_sel, axis=1)
            d_win = tl.sum(do * x_win, axis=1)
            dgate = dgate_ptr + b * sdg_b + t * sdg_t + hq * sdg_h
            ty = dgate_ptr.dtype.element_ty
            tl.store(dgate, tl.sum(do * x_cmp, axis=1).to(ty), mask=ok)
            tl.store(dgate + 1, d_sel.to(ty), mask=ok)
            tl.store(dgate + 2, d_win.to(ty), mask=ok)
            at_sel = (b * Hkv * G + hq) * T + t
            at_win = (b * Hkv + h) * T * G + r
            tl.store(delta_sel_ptr + at_sel, d_sel, mask=ok)
            tl.store(delta_win_ptr + at_win, d_win, mask=ok)
            tl.store(gate_sel_ptr + at_sel, g1, mask=ok)
            tl.store(gate_win_ptr + at_win, g2, mask=ok)
