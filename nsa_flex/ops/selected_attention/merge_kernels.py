"""Triton kernels of nsa_flex::selected_attention that work per token: the slots' merge and sum.

kernels.py leaves n partials per (token, query head) of a range: the forward's block-local o and
lse, the backward's dQ, one per place of the token's row of the index (index.SelectionIndex:
its used slots first). _slot_kernel merges the forward's in fp32 (softmax-weighted by their
lse, with the window op's local partial where given) or sums the dQ partials; _slot_gated_kernel
merges like it and adds the gated sum of the three branches (forward without gradients).
_delta_kernel computes the backward's delta = rowsum(dO * O). Strides and token ranges as in
kernels.py.
"""

from __future__ import annotations

from nsa_flex.ops.triton_utils import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _slot_kernel(
        part_ptr, plse_ptr, gid_ptr, out_ptr, lse_ptr, loc_ptr, loc_lse_ptr, T, TG, T0, Hkv,
        sp_b, sp_t, sp_h, sp_n, spl_b, spl_t, spl_h, sg_b, sg_h, sg_t,
        so_b, so_t, so_kv, so_g, sl_b, sl_h, sl_t, sx_b, sx_h, sx_r, sxl_b, sxl_h,
        N: tl.constexpr, NP: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
        DP: tl.constexpr, MERGE: tl.constexpr, LOCAL: tl.constexpr, ACC: tl.constexpr = False,
        LOCAL_IN_OUT: tl.constexpr = False,
    ):
        """One (b, t, kv head h) of the range: for each of its G query heads, the n slots' partials
        [n, D] -> out [D] in out's dtype at token T0 + t (part, plse, gid: [B, T', ...] of the
        range, T' = T; out, lse: whole). out's query head h * G + g lies at h * so_kv + g * so_g
        (unfolded [B, T, Hq, D] or folded [B, Hkv, R, D] rows).

        The slots are walked one by one with the G heads' [G, D] rows in registers, so the sum
        needs no exchange between threads, and the slots' block ids are read once for the G heads.
        MERGE: softmax-weighted by the partial lse (base 2); also writes the global lse (natural
        log, -inf when no slot saw a key). LOCAL: one more partial, the window op's over the
        token's two local blocks (loc [B, Hkv, R, D] folded, loc_lse [B, Hkv, R] base 2, rows at
        absolute tokens; the index left those slots out). LOCAL_IN_OUT: out is that partial's own
        buffer (folded): each program reads its rows there before it writes them (loc unread).
        Else a plain sum (dQ). Slots that read nothing
        (gid -1) were never written and are not loaded. The grid covers TG >= T tokens: tokens
        t >= T (rows of a folded buffer past the sequence) get zeros. ACC (sum only): out holds
        another gradient of these rows already, which the sum adds to.
        """
        b, h, t, g, d, hq, g_ok, rows, row_ok = _slot_program(TG, Hkv, sp_b, sp_t, sp_h, G, GP, D, DP)
        # Here, not in _slot_program: a pointer passed into a call whose results address a store
        # counts as written in Inductor's analysis of the kernel (tests/test_kernel_writes.py).
        gid_row = gid_ptr + b * sg_b + h * sg_h + t * sg_t
        live = t < T
        out_at = out_ptr + b * so_b + (T0 + t) * so_t + h * so_kv + g[:, None] * so_g + d[None, :]
        if MERGE:
            plse_row = plse_ptr + b * spl_b + t * spl_t + hq * spl_h
            loc_rows, loc_lse = _local_rows(loc_ptr, loc_lse_ptr, b, h, T0 + t, g, d, sx_b, sx_h, sx_r, sxl_b,
                                            sxl_h, G)
            if LOCAL_IN_OUT:
                loc_rows = out_at
            out, lse = _merged(part_ptr, plse_row, gid_row, rows, row_ok, g_ok, live, sp_n, loc_rows, loc_lse,
                               N, NP, GP, DP, LOCAL)
            tl.store(lse_ptr + b * sl_b + hq * sl_h + (T0 + t) * sl_t, lse, mask=g_ok)
        else:
            out = tl.zeros([GP, DP], tl.float32)
            for slot in tl.static_range(N):
                ok = tl.load(gid_row + slot, mask=live, other=-1) >= 0
                out += tl.load(part_ptr + rows + slot * sp_n, mask=row_ok & ok, other=0.0).to(tl.float32)
        if ACC:
            out += tl.load(out_at, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _slot_program(TG, Hkv, sp_b, sp_t, sp_h, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                      DP: tl.constexpr):
        """This slot program's (b, kv head h, token t of TG, head offsets g, d, query heads hq, g ok,
        partial row offsets [G', D'], their mask): one program per (b, t, h)."""
        pid = tl.program_id(0)
        h = pid % Hkv
        t = ((pid // Hkv) % TG).to(tl.int64)
        b = (pid // Hkv // TG).to(tl.int64)
        g = tl.arange(0, GP)
        d = tl.arange(0, DP)
        hq = h * G + g
        g_ok = g < G
        rows = b * sp_b + t * sp_t + hq[:, None] * sp_h + d[None, :]
        row_ok = g_ok[:, None] & (d[None, :] < D)
        return b, h, t, g, d, hq, g_ok, rows, row_ok

    @triton.jit
    def _local_rows(loc_ptr, loc_lse_ptr, b, h, tok, g, d, sx_b, sx_h, sx_r, sxl_b, sxl_h, G: tl.constexpr):
        """(loc row pointers [G', D'], loc lse pointers [G']) of token tok's G heads in the window
        op's local partial (folded rows tok * G + g of kv head h; loc_lse rows dense)."""
        r = (tok * G + g).to(tl.int64)
        return (loc_ptr + b * sx_b + h * sx_h + r[:, None] * sx_r + d[None, :],
                loc_lse_ptr + b * sxl_b + h * sxl_h + r)

    @triton.jit
    def _merged(part_ptr, plse_row, gid_row, rows, row_ok, g_ok, live, sp_n, loc_rows, loc_lse, N: tl.constexpr,
                NP: tl.constexpr, GP: tl.constexpr, DP: tl.constexpr, LOCAL: tl.constexpr):
        """(o [G', D'] fp32, lse [G'] natural log) of one (b, t, kv head): the n slots' partials
        softmax-weighted by their partial lse (base 2), and with LOCAL the local blocks' partial at
        loc_rows / loc_lse (pointers). lse is -inf and o zero when no slot saw a key. Slots that
        read nothing (gid -1) were never written and are not loaded."""
        LN2: tl.constexpr = 0.6931471805599453
        n = tl.arange(0, NP)
        used = tl.load(gid_row + n, mask=(n < N) & live, other=-1) >= 0
        plse = tl.load(plse_row[:, None] + n[None, :], mask=g_ok[:, None] & used[None, :], other=float("-inf"))
        m = tl.max(plse, axis=1)
        if LOCAL:
            lse_l = tl.load(loc_lse, mask=g_ok & live, other=float("-inf"))
            m = tl.maximum(m, lse_l)
        m = tl.where(m == float("-inf"), 0.0, m)
        den = tl.sum(tl.math.exp2(plse - m[:, None]), axis=1)
        acc = tl.zeros([GP, DP], tl.float32)
        if LOCAL:
            w_l = tl.math.exp2(lse_l - m)
            den += w_l
            acc += tl.load(loc_rows, mask=row_ok & live, other=0.0).to(tl.float32) * w_l[:, None]
        for slot in tl.static_range(N):
            ok = tl.load(gid_row + slot, mask=live, other=-1) >= 0
            w = tl.math.exp2(tl.load(plse_row + slot, mask=g_ok & ok, other=float("-inf")) - m)
            part = tl.load(part_ptr + rows + slot * sp_n, mask=row_ok & ok, other=0.0).to(tl.float32)
            acc += part * w[:, None]
        out = acc / tl.where(den > 0, den, 1.0)[:, None]
        lse = tl.where(den > 0, (m + tl.math.log2(tl.where(den > 0, den, 1.0))) * LN2, float("-inf"))
        return out, lse

    @triton.jit
    def _slot_gated_kernel(
        part_ptr, plse_ptr, gid_ptr, cmp_ptr, win_ptr, gate_ptr, out_ptr, loc_ptr, loc_lse_ptr, T, T0, Hkv, HEAD, RC,
        sp_b, sp_t, sp_h, sp_n, spl_b, spl_t, spl_h, sg_b, sg_h, sg_t,
        sc_b, sc_h, sc_r, sw_b, sw_h, sw_r, sgt_b, sgt_t, sgt_h, so_b, so_t, so_h, sx_b, sx_h, sx_r, sxl_b, sxl_h,
        N: tl.constexpr, NP: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
        DP: tl.constexpr, LOCAL: tl.constexpr,
    ):
        """_slot_kernel's merge with the gated sum as its epilogue (no autograd: forward only).

        One (b, t, kv head h) of the range: o_sel of its G query heads merged as _slot_kernel does
        and rounded to out's dtype, then o = g_cmp o_cmp + g_sel o_sel + g_win o_win in fp32, the
        same expression as nsa_flex::gated_sum's kernel, into out [B, T, Hq, D] at token T0 + t.
        o_cmp: folded rows from row HEAD on (RC of them, earlier rows zero), o_win folded
        [B, Hkv, T*G, D], gates [B, T, Hq, 3]. So o_sel is never written to memory and read back.
        """
        b, h, t, g, d, hq, g_ok, rows, row_ok = _slot_program(T, Hkv, sp_b, sp_t, sp_h, G, GP, D, DP)
        gid_row = gid_ptr + b * sg_b + h * sg_h + t * sg_t
        plse_row = plse_ptr + b * spl_b + t * spl_t + hq * spl_h
        loc_rows, loc_lse = _local_rows(loc_ptr, loc_lse_ptr, b, h, T0 + t, g, d, sx_b, sx_h, sx_r, sxl_b, sxl_h,
                                        G)
        o_sel, _ = _merged(part_ptr, plse_row, gid_row, rows, row_ok, g_ok, t >= 0, sp_n, loc_rows, loc_lse,
                           N, NP, GP, DP, LOCAL)
        x_sel = o_sel.to(out_ptr.dtype.element_ty).to(tl.float32)
        r = (T0 + t) * G + g
        c = r - HEAD
        c_ok = g_ok & (c >= 0) & (c < RC)
        gate = gate_ptr + b * sgt_b + (T0 + t) * sgt_t + hq * sgt_h
        g0 = tl.load(gate, mask=g_ok, other=0.0).to(tl.float32)
        g1 = tl.load(gate + 1, mask=g_ok, other=0.0).to(tl.float32)
        g2 = tl.load(gate + 2, mask=g_ok, other=0.0).to(tl.float32)
        x_cmp = tl.load(cmp_ptr + b * sc_b + h * sc_h + c[:, None] * sc_r + d[None, :],
                        mask=c_ok[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)
        x_win = tl.load(win_ptr + b * sw_b + h * sw_h + r[:, None] * sw_r + d[None, :], mask=row_ok,
                        other=0.0).to(tl.float32)
        o = g0[:, None] * x_cmp + g1[:, None] * x_sel + g2[:, None] * x_win
        tl.store(out_ptr + b * so_b + (T0 + t) * so_t + hq[:, None] * so_h + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _delta_kernel(
        do_ptr, o_ptr, delta_ptr, T, Hq,
        sdo_b, sdo_t, sdo_h, so_b, so_t, so_h, sd_b, sd_h, sd_t,
        TB: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    ):
        """delta [B, Hq, T] = rowsum(dO * O) in fp32 for TB tokens (all their heads) of batch entry b.

        One pass over dO and O ([B, T, Hq, D], any strides), the transposed fp32 rows written
        directly: a torch expression made fp32 copies of both and reduced them at ~1.6 TB/s."""
        pid = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        r = tl.arange(0, TB * HP)
        t = (pid * TB + r // HP).to(tl.int64)
        hq = r % HP
        d = tl.arange(0, DP)
        ok = (t < T) & (hq < Hq)
        m = ok[:, None] & (d[None, :] < D)
        do = tl.load(do_ptr + b * sdo_b + t[:, None] * sdo_t + hq[:, None] * sdo_h + d[None, :], mask=m, other=0.0)
        o = tl.load(o_ptr + b * so_b + t[:, None] * so_t + hq[:, None] * so_h + d[None, :], mask=m, other=0.0)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
        tl.store(delta_ptr + b * sd_b + hq * sd_h + t * sd_t, delta, mask=ok)
