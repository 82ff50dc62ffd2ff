"""The window op's dK/dV kernel in Gluon, for Hopper at 16-bit Dk = Dv = 128.

_dkdv_gluon_kernel does kernels._dkdv_kernel's work (one program per key block, walking the row
tiles that see it; the gated and local-slot terms) in another schedule. The Triton kernel holds
K, V, P and dS in registers with 4 warps and 64-row tiles (255 registers with spills at D = 128,
two programs per SM). This one keeps its dots' operands in shared memory and walks 128-row tiles
with 8 warps: tile i+1's query and output-gradient rows are copied (cp.async) into a second
buffer while tile i's four dots run, dP's dot runs under P's exp, and P and dS reach the dV and
dK dots through shared memory.

Same products, each summed in the same order (a 128-row dot adds its rows as two 64-row tiles
do), so without the local-slot term dK and dV equal the Triton kernel's bit for bit; with it dS
comes from differently fused fp32 arithmetic and may differ in its last bit. Gluon kernels do not
run under Triton's CPU interpreter: the CPU tests build this for sm_90a and interpret its Triton
twin; the GPU tests compare the two. (The dQ kernel in the same form was slower than the Triton
one: docs/decisions.md, "The window branch".)
"""

from __future__ import annotations

import torch

from nsa_flex.ops.selected_attention.gluon_kernels import HAS_GLUON, _capability

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, warpgroup_mma, \
        warpgroup_mma_wait

DKDV_ROWS = 128
"""Folded rows per tile of the Gluon dK/dV kernel (launched with 8 warps, 64-key blocks)."""
DKDV_KEYS = 64


def applies(q: torch.Tensor, v: torch.Tensor, group: int) -> bool:
    """Whether the Gluon dK/dV kernel can run: Hopper (sm_90), 16-bit, Dk = Dv = 128, G a power of
    two (the groups the GPU tests compared with the Triton kernel), not traced by Dynamo itself
    (Inductor cannot launch a Gluon kernel; the ops' bodies run below Dynamo)."""
    return (HAS_GLUON and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] == 128
            and v.shape[-1] == 128 and group & (group - 1) == 0 and _capability(q.device.index) == (9, 0)
            and not torch.compiler.is_dynamo_compiling())


if HAS_GLUON:

    @gluon.jit
    def _rows_to_shared(dst, ptr, b, h, r, ok, s_b, s_h, s_t, s_g, col, G: gl.constexpr):
        """Start the copy of folded rows r (token r // G, group member r % G; zeros where not ok) of a
        tensor with (batch, kv head, token, member) strides into dst."""
        r64 = r.to(gl.int64)
        at = b * s_b + h * s_h + (r64 // G) * s_t + (r64 % G) * s_g
        async_copy.async_copy_global_to_shared(dst, ptr + at[:, None] + col[None, :], mask=ok[:, None])

    @gluon.jit
    def _row_stats(LSE, DELTA, GW, LSES, DELTAS, GS, bh, b, h, r, ok, R, s_lb, s_lh, s_lt,
                   G: gl.constexpr, GATED: gl.constexpr, SEL: gl.constexpr):
        """(lse base 2, delta, gate, selected lse base 2, delta, gate) of folded rows r: as the
        Triton kernel reads them (pad rows: lse +inf, the rest 0; the selected ones only with SEL)."""
        LOG2E: gl.constexpr = 1.4426950408889634
        at = bh.to(gl.int64) * R + r
        lse2 = gl.load(LSE + at, mask=ok, other=float("inf"))
        delta = gl.load(DELTA + at, mask=ok, other=0.0)
        gw = gl.load(GW + at, mask=ok & GATED, other=0.0)
        r64 = r.to(gl.int64)
        stat = b * s_lb + (h * G + r64 % G) * s_lh + (r64 // G) * s_lt
        sel = ok & (SEL > 0)
        lse_s2 = gl.load(LSES + stat, mask=sel, other=float("inf")) * LOG2E
        delta_s = gl.load(DELTAS + stat, mask=sel, other=0.0)
        gs = gl.load(GS + stat, mask=sel, other=0.0)
        return lse2, delta, gw, lse_s2, delta_s, gs

    @gluon.jit
    def _dkdv_gluon_kernel(Q, K, V, DO, LSE, DELTA, DK_, DV_, GW, LSES, DELTAS, GS, T, R, Hkv, W, scale, scale2,
                           s_qb, s_qh, s_qr, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_ob, s_oh, s_or,
                           s_db, s_dh, s_dt, s_dg, s_lb, s_lh, s_lt,
                           G: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, DK: gl.constexpr, DV: gl.constexpr,
                           GATED: gl.constexpr, SEL: gl.constexpr, F32_DOT: gl.constexpr):
        """Arguments and results as kernels._dkdv_kernel's (8 warps, BM = 128 rows a tile, BN = 64
        keys, DK = DV = 128; F32_DOT False): dK, dV of key block program_id(0)."""
        D: gl.constexpr = DK
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [8, 1], [1, 0])
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                         instr_shape=[16, BN, 16])
        mma_kv: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                          instr_shape=[16, D // 2, 16])
        row_ld: gl.constexpr = gl.SliceLayout(1, ld)
        row_s: gl.constexpr = gl.SliceLayout(1, mma_s)
        dtype: gl.constexpr = Q.dtype.element_ty
        sh_md: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D], dtype)
        sh_kd: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], dtype)
        sh_ml: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], dtype)

        # Inductor may pass the floats as fp64; keep the tiles fp32.
        sc = gl.cast(scale, gl.float32)
        sc2 = gl.cast(scale2, gl.float32)
        bh = gl.program_id(1)
        b = (bh // Hkv).to(gl.int64)
        h = bh % Hkv
        s0 = gl.program_id(0) * BN

        q_buf = gl.allocate_shared_memory(dtype, [2, BM, D], sh_md)
        do_buf = gl.allocate_shared_memory(dtype, [2, BM, D], sh_md)
        k_smem = gl.allocate_shared_memory(dtype, [BN, D], sh_kd)
        v_smem = gl.allocate_shared_memory(dtype, [BN, D], sh_kd)
        p_smem = gl.allocate_shared_memory(dtype, [BM, BN], sh_ml)
        ds_smem = gl.allocate_shared_memory(dtype, [BM, BN], sh_ml)

        col = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        kr = s0 + gl.arange(0, BN, layout=row_ld)
        kr64 = kr.to(gl.int64)
        k_smem.store(gl.load(K + b * s_kb + kr64[:, None] * s_kt + h * s_kh + col[None, :], mask=(kr < T)[:, None],
                             other=0.0))
        v_smem.store(gl.load(V + b * s_vb + kr64[:, None] * s_vt + h * s_vh + col[None, :], mask=(kr < T)[:, None],
                             other=0.0))
        key = s0 + gl.arange(0, BN, layout=gl.SliceLayout(0, mma_s))

        # The row tiles that see the block, as the Triton kernel splits them (with BM rows a tile):
        # masked before r_lo and from r_hi on, the local-slot term before r_loc (masked too).
        t_last = gl.minimum(s0 + BN - 1 + W - 1, T - 1)
        r_first = (s0 * G // BM) * BM
        r_end = (t_last + 1) * G
        r_stop = r_first + gl.cdiv(r_end - r_first, BM) * BM
        r_lo = r_first + gl.cdiv(gl.maximum((s0 + BN - 1) * G - r_first, 0), BM) * BM
        r_hi = gl.maximum(r_first + (((s0 + W) * G - r_first) // BM) * BM, r_lo)
        r_hi = gl.minimum(r_hi, r_stop)
        r_lo = gl.minimum(r_lo, r_hi)
        r_loc = r_first
        if SEL > 0:
            r_loc = gl.minimum(r_first + gl.cdiv(gl.maximum(((s0 + BN - 1) // SEL + 2) * SEL * G - r_first, 0), BM)
                               * BM, r_stop)

        dk_acc = gl.zeros([BN, D], gl.float32, layout=mma_kv)
        dv_acc = gl.zeros([BN, D], gl.float32, layout=mma_kv)
        s_zero = gl.zeros([BM, BN], gl.float32, layout=mma_s)

        # Tile 0's copies and row statistics.
        r = r_first + gl.arange(0, BM, layout=row_ld)
        _rows_to_shared(q_buf.index(0), Q, b, h, r, r < R, s_qb, s_qh, G * s_qr, s_qr, col, G)
        _rows_to_shared(do_buf.index(0), DO, b, h, r, r < R, s_db, s_dh, s_dt, s_dg, col, G)
        async_copy.commit_group()
        rs = r_first + gl.arange(0, BM, layout=row_s)
        lse2, delta, gw, lse_s2, delta_s, gs = _row_stats(LSE, DELTA, GW, LSES, DELTAS, GS, bh, b, h, rs, rs < R, R,
                                                          s_lb, s_lh, s_lt, G, GATED, SEL)
        for r0 in range(r_first, r_end, BM):
            i = (r0 - r_first) // BM
            cur = i % 2
            # Every warp is past tile i-1's dots, which read the other buffers: refill them with
            # tile i+1 (all rows masked past the last).
            gl.thread_barrier()
            rn = r0 + BM + gl.arange(0, BM, layout=row_ld)
            okn = (rn < R) & (r0 + BM < r_end)
            _rows_to_shared(q_buf.index(1 - cur), Q, b, h, rn, okn, s_qb, s_qh, G * s_qr, s_qr, col, G)
            _rows_to_shared(do_buf.index(1 - cur), DO, b, h, rn, okn, s_db, s_dh, s_dt, s_dg, col, G)
            async_copy.commit_group()
            rsn = rs + BM
            nxt = _row_stats(LSE, DELTA, GW, LSES, DELTAS, GS, bh, b, h, rsn, (rsn < R) & (r0 + BM < r_end), R,
                             s_lb, s_lh, s_lt, G, GATED, SEL)
            async_copy.wait_group(1)
            gl.thread_barrier()
            fence_async_shared()
            qs = q_buf.index(cur)
            dos = do_buf.index(cur)
            s = warpgroup_mma(qs, k_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dp = warpgroup_mma(dos, v_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
            # [BM, BN]: rows down, keys across. Pad rows have lse +inf: P is 0 there.
            s = s * sc2
            p = gl.exp2(s - lse2[:, None])
            tok = rs // G
            if (r0 < r_lo) | (r0 >= r_hi) | (r0 < r_loc):
                seen = (key[None, :] <= tok[:, None]) & (key[None, :] > tok[:, None] - W)
                p = gl.where(seen, p, 0.0)
            if GATED:
                p = p * gw[:, None]
            if SEL > 0:
                # The selected branch's term over each row's local keys (Triton's _dkdv_step).
                pd = p * delta[:, None]
                if r0 < r_loc:
                    local = (key[None, :] <= tok[:, None]) & (key[None, :] >= ((tok // SEL - 1) * SEL)[:, None])
                    ps = gl.where(local, gl.exp2(s - lse_s2[:, None]), 0.0) * gs[:, None]
                    pd = pd + ps * delta_s[:, None]
                    p = p + ps
                p_smem.store(p.to(dtype))
                dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp, ))
                ds = p * dp - pd
            else:
                p_smem.store(p.to(dtype))
                dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp, ))
                ds = p * (dp - delta[:, None])
            ds_smem.store(ds.to(dtype))
            gl.thread_barrier()
            fence_async_shared()
            dv_acc = warpgroup_mma(p_smem.permute((1, 0)), dos, dv_acc, is_async=True)
            dk_acc = warpgroup_mma(ds_smem.permute((1, 0)), qs, dk_acc, is_async=True)
            dv_acc, dk_acc = warpgroup_mma_wait(num_outstanding=0, deps=(dv_acc, dk_acc))
            rs = rsn
            lse2, delta, gw, lse_s2, delta_s, gs = nxt
        async_copy.wait_group(0)
        kk = s0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma_kv))
        c = gl.arange(0, D, layout=gl.SliceLayout(0, mma_kv))
        kk64 = kk.to(gl.int64)
        ok = (kk < T)[:, None]
        gl.store(DK_ + b * s_kb + kk64[:, None] * s_kt + h * s_kh + c[None, :], (dk_acc * sc).to(DK_.dtype.element_ty),
                 mask=ok)
        gl.store(DV_ + b * s_vb + kk64[:, None] * s_vt + h * s_vh + c[None, :], dv_acc.to(DV_.dtype.element_ty),
                 mask=ok)
