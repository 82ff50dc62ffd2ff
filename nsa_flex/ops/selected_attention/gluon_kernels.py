"""The selected op's forward and backward kernels in Gluon, for Hopper at 16-bit Dk = Dv of 64 or 128.

Same work and results as kernels._fwd_kernel and _bwd_kernel (bit for bit: the same dots with
the same operand layouts and roundings), in another order of their memory traffic. Built by
Triton 3.6 for sm_90, the Triton kernels' chunk loop waits for all of a chunk's gathered copies
(its query rows, and in the backward its output-gradient rows: cp.async) at the top of the
iteration and issues the next chunk's only after the chunk's dots and stores; with one 8-warp
backward program per SM nothing overlaps the gathers. Gluon states the schedule: chunk i+1's
copies go into the other buffer before the program waits for chunk i's (cp.async groups,
wait_group(1)); the entries, lse, delta and gate of later chunks are read into registers a chunk
or two early, in the backward while the chunk's last three dots run (the scores' registers are
free then: no spills at either head dim, and the kernel 3-6% faster than with those reads before
the scores' dots); in the backward P's exp runs under dP's dot, and dQ's dot goes first so that
its store runs under dV's and dK's. Partial o / dQ rows leave through shared memory as 16-byte
stores.

The backward's epilogue keeps the Triton kernel's rule (_finish_block, written again here): a
block's only item finishes the block itself, others write fp32 partials for _block_sum_kernel.
Gluon kernels do not run under Triton's CPU interpreter: the CPU tests build these for sm_90a
and interpret their Triton twins; the GPU tests compare the two bit for bit.
"""

from __future__ import annotations

import functools

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, warpgroup_mma, \
        warpgroup_mma_wait

    HAS_GLUON = True
except ImportError:  # no Triton, or one without Gluon: the Triton kernel runs
    HAS_GLUON = False

BWD_ROWS = (64, 128)
FWD_ROWS = 64
"""Query rows per chunk (BT * G') of the backward and forward kernels, the tiles they are written
for: the backward runs one warp per 16 rows (4 or 8 warps), the forward 4 warps."""

HEAD_DIMS = (64, 128)
"""Dk = Dv of the kernels (measured and GPU-tested at both)."""


def applies(q: torch.Tensor, v: torch.Tensor, BL: int) -> bool:
    """Whether the Gluon kernels can run: Hopper (sm_90), 16-bit, Dk = Dv in HEAD_DIMS, l' = 64
    (the callers check their chunks' rows against BWD_ROWS / FWD_ROWS)."""
    return (HAS_GLUON and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] in HEAD_DIMS
            and v.shape[-1] == q.shape[-1] and BL == 64 and _capability(q.device.index) == (9, 0))


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


if HAS_GLUON:

    @gluon.jit
    def _item(w, item_blk_ptr, item_start_ptr, item_end_ptr, blk_start_ptr, blk_end_ptr, Hkv, Nv):
        """(valid, block row, b, kv head h, first entry, end entry, first key, end key) of work item w."""
        blk = gl.load(item_blk_ptr + w)
        valid = blk >= 0
        blk = gl.maximum(blk, 0)
        vb = blk % Nv
        bh = blk // Nv
        start = gl.load(item_start_ptr + w)
        end = gl.where(valid, gl.load(item_end_ptr + w), start)
        return valid, blk, (bh // Hkv).to(gl.int64), bh % Hkv, start, end, gl.load(blk_start_ptr + vb), \
            gl.load(blk_end_ptr + vb)

    @gluon.jit
    def _block_to_shared(ptr, smem, b, h, kr, ke, s_b, s_t, s_h, col):
        """Keys kr [BL] of kv head h into smem [BL, D] (zero rows at and past ke)."""
        smem.store(gl.load(ptr + b * s_b + kr.to(gl.int64)[:, None] * s_t + h * s_h + col[None, :],
                           mask=(kr < ke)[:, None], other=0.0))

    @gluon.jit
    def _copy_q_rows(dst, q_ptr, b, h, t, g, ok, T0, sq_b, sq_t, sq_kv, sq_g, col, G: gl.constexpr):
        """Start the copy of query rows (token T0 + t, head h * G + g; zeros where not ok) into dst."""
        qa = b * sq_b + (T0 + t) * sq_t + h * sq_kv + g * sq_g
        async_copy.async_copy_global_to_shared(dst, q_ptr + qa[:, None] + col[None, :], mask=ok[:, None])

    @gluon.jit
    def _rows(entries_ptr, c0, end, N: gl.constexpr, G: gl.constexpr, GP: gl.constexpr, M: gl.constexpr,
              layout: gl.constexpr):
        """(token t, slot, group member g, row ok) of the M rows of the chunk at entry c0, in layout:
        row r is entry c0 + r // G' and group member r % G' (masked past G)."""
        r = gl.arange(0, M, layout=layout)
        e_ok = c0 + r // GP < end
        e = gl.load(entries_ptr + c0 + r // GP, mask=e_ok, other=0)
        g = r % GP
        return (e // N).to(gl.int64), e % N, g, e_ok & (g < G)

    @gluon.jit
    def _bwd_gluon_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, gate_ptr, dqp_ptr, dkp_ptr, dvp_ptr, entries_ptr,
        item_blk_ptr, item_start_ptr, item_end_ptr, blk_start_ptr, blk_end_ptr, n_items_ptr,
        dk_ptr, dv_ptr, dk_sum_ptr, dv_sum_ptr, Hkv, Nv, T0, T1, scale,
        sq_b, sq_t, sq_kv, sq_g, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sdo_b, sdo_t, sdo_h,
        sl_b, sl_h, sl_t, sdq_b, sdq_t, sdq_h, sdq_n, sdk_b, sdk_t, sdk_h, sdv_b, sdv_t, sdv_h,
        ssk_b, ssk_t, ssk_h, ssv_b, ssv_t, ssv_h,
        N: gl.constexpr, G: gl.constexpr, GP: gl.constexpr, BT: gl.constexpr, BL: gl.constexpr,
        DK: gl.constexpr, DKP: gl.constexpr, DV: gl.constexpr, DVP: gl.constexpr,
        F32_DOT: gl.constexpr, IEEE: gl.constexpr, SUMS: gl.constexpr, ADD: gl.constexpr,
        ACC: gl.constexpr = False, GATED: gl.constexpr = False,
    ):
        """Arguments and results as kernels._bwd_kernel's (launched with BT * G' / 16 warps; DK =
        DKP = DV = DVP; F32_DOT and IEEE are False where it applies): dQ partials [B,T',Hq,n,D] of the
        item's tokens; the item's dK/dV, finished here when it is its block's only item
        (_finish_block), else an fp32 partial [W, BL, D] for _block_sum_kernel."""
        LOG2E: gl.constexpr = 1.4426950408889634
        M: gl.constexpr = BT * GP
        D: gl.constexpr = DKP
        # One warp per 16 rows of the chunk (launched with M // 16 warps): 8 at 128 rows, 4 at 64.
        W: gl.constexpr = M // 16
        # Gathers and dQ stores: 16-byte vectors, 8 rows a warp (a row vector costs 2 registers).
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [W, 1], [1, 0])
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                         instr_shape=[16, BL, 16])
        mma_q: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, D, 16])
        # dK / dV [BL, D]: four warps down its 64 rows, the others across its columns.
        mma_kv: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, W // 4],
                                                          instr_shape=[16, D // (W // 4), 16])
        row_ld: gl.constexpr = gl.SliceLayout(1, ld)
        row_s: gl.constexpr = gl.SliceLayout(1, mma_s)
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        sh_md: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, D], dtype)
        sh_kd: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BL, D], dtype)
        sh_ml: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, BL], dtype)

        w = gl.program_id(0)
        valid, blk, b, h, start, end, ks, ke = _item(w, item_blk_ptr, item_start_ptr, item_end_ptr, blk_start_ptr,
                                                     blk_end_ptr, Hkv, Nv)

        q_buf = gl.allocate_shared_memory(dtype, [2, M, D], sh_md)
        do_buf = gl.allocate_shared_memory(dtype, [2, M, D], sh_md)
        k_smem = gl.allocate_shared_memory(dtype, [BL, D], sh_kd)
        v_smem = gl.allocate_shared_memory(dtype, [BL, D], sh_kd)
        p_smem = gl.allocate_shared_memory(dtype, [M, BL], sh_ml)
        ds_smem = gl.allocate_shared_memory(dtype, [M, BL], sh_ml)

        # The key block, once (zero rows past its end).
        kr = ks + gl.arange(0, BL, layout=row_ld)
        col = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        _block_to_shared(k_ptr, k_smem, b, h, kr, ke, sk_b, sk_t, sk_h, col)
        _block_to_shared(v_ptr, v_smem, b, h, kr, ke, sv_b, sv_t, sv_h, col)

        # Inductor may pass the float as fp64; keep the tiles fp32.
        sc = gl.cast(scale, gl.float32)
        scale2 = sc * LOG2E
        key = ks + gl.arange(0, BL, layout=gl.SliceLayout(0, mma_s))
        key_ok = key < ke
        dk_acc = gl.zeros([BL, D], gl.float32, layout=mma_kv)
        dv_acc = gl.zeros([BL, D], gl.float32, layout=mma_kv)
        s_zero = gl.zeros([M, BL], gl.float32, layout=mma_s)
        q_zero = gl.zeros([M, D], gl.float32, layout=mma_q)

        # Chunk 0's copies; its scores' row data; the gather rows of chunks 0 and 1.
        t, slot, g, ok = _rows(entries_ptr, start, end, N, G, GP, M, row_ld)
        da = b * sdo_b + (T0 + t) * sdo_t + (h * G + g) * sdo_h
        _copy_q_rows(q_buf.index(0), q_ptr, b, h, t, g, ok, T0, sq_b, sq_t, sq_kv, sq_g, col, G)
        async_copy.async_copy_global_to_shared(do_buf.index(0), do_ptr + da[:, None] + col[None, :],
                                               mask=ok[:, None])
        async_copy.commit_group()
        t_s, slot_s, g_s, ok_s = _rows(entries_ptr, start, end, N, G, GP, M, row_s)
        st = b * sl_b + (h * G + g_s) * sl_h + (T0 + t_s) * sl_t
        lse2 = gl.load(lse_ptr + st, mask=ok_s, other=0.0) * LOG2E
        delta = gl.load(delta_ptr + st, mask=ok_s, other=0.0)
        gate = gl.load(gate_ptr + st, mask=ok_s & GATED, other=0.0)
        tn, sn, gn, okn = _rows(entries_ptr, start + BT, end, N, G, GP, M, row_ld)
        t1, s1, g1, ok1 = tn, sn, gn, okn
        for i in range(gl.cdiv(end - start, BT)):
            c0 = start + i * BT
            cur = i % 2
            # Every warp is past chunk i-1's dots, which read the other buffers: refill them
            # with chunk i+1 (rows all masked past the item's end).
            gl.thread_barrier()
            da = b * sdo_b + (T0 + tn) * sdo_t + (h * G + gn) * sdo_h
            _copy_q_rows(q_buf.index(1 - cur), q_ptr, b, h, tn, gn, okn, T0, sq_b, sq_t, sq_kv, sq_g, col, G)
            async_copy.async_copy_global_to_shared(do_buf.index(1 - cur), do_ptr + da[:, None] + col[None, :],
                                                   mask=okn[:, None])
            async_copy.commit_group()
            # Chunk i's copies: every group but the one just committed.
            async_copy.wait_group(1)
            gl.thread_barrier()
            fence_async_shared()
            qs = q_buf.index(cur)
            dos = do_buf.index(cur)
            vis = ok_s[:, None] & key_ok[None, :] & (key[None, :] <= (T0 + t_s)[:, None])
            s = warpgroup_mma(qs, k_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dp = warpgroup_mma(dos, v_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            # P while dP's dot runs. A row with no visible key anywhere has lse -inf and none here.
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
            p = gl.where(vis, gl.exp2(s * scale2 - lse2[:, None]), 0.0)
            if GATED:
                p = p * gate[:, None]
            p_smem.store(p.to(dtype))
            dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp, ))
            ds_smem.store((p * (dp - delta[:, None])).to(dtype))
            gl.thread_barrier()
            fence_async_shared()
            # dQ's dot first: its store runs under dV's and dK's.
            dq = warpgroup_mma(ds_smem, k_smem, q_zero, use_acc=False, is_async=True)
            dv_acc = warpgroup_mma(p_smem.permute((1, 0)), dos, dv_acc, is_async=True)
            dk_acc = warpgroup_mma(ds_smem.permute((1, 0)), qs, dk_acc, is_async=True)
            # Read under the dots (the scores' registers are free now), used next iteration: chunk
            # i+2's gather rows, chunk i+1's score rows.
            tn, sn, gn, okn = _rows(entries_ptr, c0 + 2 * BT, end, N, G, GP, M, row_ld)
            tn_s, sn_s, gn_s, okn_s = _rows(entries_ptr, c0 + BT, end, N, G, GP, M, row_s)
            stn = b * sl_b + (h * G + gn_s) * sl_h + (T0 + tn_s) * sl_t
            lse2_n = gl.load(lse_ptr + stn, mask=okn_s, other=0.0) * LOG2E
            delta_n = gl.load(delta_ptr + stn, mask=okn_s, other=0.0)
            gate_n = gl.load(gate_ptr + stn, mask=okn_s & GATED, other=0.0)
            dq = warpgroup_mma_wait(num_outstanding=2, deps=(dq, ))
            row = b * sdq_b + t * sdq_t + (h * G + g) * sdq_h + slot * sdq_n
            gl.store(dqp_ptr + row[:, None] + col[None, :],
                     gl.convert_layout((dq * sc).to(dqp_ptr.dtype.element_ty), ld), mask=ok[:, None])
            dv_acc, dk_acc = warpgroup_mma_wait(num_outstanding=0, deps=(dv_acc, dk_acc))
            t_s, ok_s, lse2, delta, gate = tn_s, okn_s, lse2_n, delta_n, gate_n
            t, slot, g, ok = t1, s1, g1, ok1
            t1, s1, g1, ok1 = tn, sn, gn, okn
        async_copy.wait_group(0)
        dk_acc = dk_acc * sc
        r = gl.arange(0, BL, layout=gl.SliceLayout(1, mma_kv))
        c = gl.arange(0, D, layout=gl.SliceLayout(0, mma_kv))
        if valid:
            if gl.load(n_items_ptr + blk) == 1:
                _finish_block(dk_acc, dv_acc, dk_ptr, dv_ptr, dk_sum_ptr, dv_sum_ptr, b, h, ks, ke, T0, T1,
                              sdk_b, sdk_t, sdk_h, sdv_b, sdv_t, sdv_h, ssk_b, ssk_t, ssk_h, ssv_b, ssv_t, ssv_h,
                              r, c, SUMS, ADD, ACC)
            else:
                at = (w.to(gl.int64) * BL + r[:, None]) * D + c[None, :]
                gl.store(dkp_ptr + at, dk_acc)
                gl.store(dvp_ptr + at, dv_acc)

    @gluon.jit
    def _finish_block(dk_acc, dv_acc, dk_ptr, dv_ptr, dk_sum_ptr, dv_sum_ptr, b, h, ks, ke, T0, T1,
                      sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, ssk_b, ssk_t, ssk_h, ssv_b, ssv_t, ssv_h, r, c,
                      SUMS: gl.constexpr, ADD: gl.constexpr, ACC: gl.constexpr):
        """kernels._finish_block's rule, in Gluon (r, c: the sums' row and column ids in their layout):
        a block that starts at or after T1 is final already and left alone; one that starts in
        [T0, T1) goes to dk / dv (added to their content with ACC); one that starts before T0 goes
        to the fp32 sums (strides ssk_* / ssv_*; with ADD, the later ranges' sums are read and
        added first)."""
        live = ks < T1
        final = ks >= T0
        waits = ks < T0
        key = ks + r
        kt = key.to(gl.int64)[:, None]
        ok = ((key < ke) & live)[:, None]
        k_at = b * sk_b + kt * sk_t + h * sk_h + c[None, :]
        v_at = b * sv_b + kt * sv_t + h * sv_h + c[None, :]
        k_sum_at = b * ssk_b + kt * ssk_t + h * ssk_h + c[None, :]
        v_sum_at = b * ssv_b + kt * ssv_t + h * ssv_h + c[None, :]
        if ADD:
            dk_acc += gl.load(dk_sum_ptr + k_sum_at, mask=ok, other=0.0)
            dv_acc += gl.load(dv_sum_ptr + v_sum_at, mask=ok, other=0.0)
        if ACC:
            dk_out = dk_acc + gl.load(dk_ptr + k_at, mask=ok & final, other=0.0).to(gl.float32)
            dv_out = dv_acc + gl.load(dv_ptr + v_at, mask=ok & final, other=0.0).to(gl.float32)
        else:
            dk_out = dk_acc
            dv_out = dv_acc
        gl.store(dk_ptr + k_at, dk_out.to(dk_ptr.dtype.element_ty), mask=ok & final)
        gl.store(dv_ptr + v_at, dv_out.to(dv_ptr.dtype.element_ty), mask=ok & final)
        if SUMS:
            gl.store(dk_sum_ptr + k_sum_at, dk_acc, mask=ok & waits)
            gl.store(dv_sum_ptr + v_sum_at, dv_acc, mask=ok & waits)

    @gluon.jit
    def _fwd_gluon_kernel(
        q_ptr, k_ptr, v_ptr, po_ptr, plse_ptr, entries_ptr,
        item_blk_ptr, item_start_ptr, item_end_ptr, blk_start_ptr, blk_end_ptr, Hkv, Nv, T0, scale,
        sq_b, sq_t, sq_kv, sq_g, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
        so_b, so_t, so_h, so_n, sl_b, sl_t, sl_h,
        N: gl.constexpr, G: gl.constexpr, GP: gl.constexpr, BT: gl.constexpr, BL: gl.constexpr,
        DK: gl.constexpr, DKP: gl.constexpr, DV: gl.constexpr, DVP: gl.constexpr,
        F32_DOT: gl.constexpr, IEEE: gl.constexpr, LATE_ROWS: gl.constexpr = False,
    ):
        """Arguments and results as kernels._fwd_kernel's (4 warps, 64-row chunks, DK = DKP = DV =
        DVP): partial o and lse (base 2) of the item's tokens, chunk i+1's query rows copied
        while chunk i's dots run. LATE_ROWS: the next chunks' row ids are read under the P V dot
        rather than before the scores' dot; fewer registers live across the softmax (at D = 64 the
        kernel then fits 128 registers without spills: four programs per SM), where at D = 128 the
        early reads ran 1% faster (docs/decisions.md)."""
        LOG2E: gl.constexpr = 1.4426950408889634
        M: gl.constexpr = BT * GP
        D: gl.constexpr = DKP
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BL, 16])
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
        row_ld: gl.constexpr = gl.SliceLayout(1, ld)
        row_s: gl.constexpr = gl.SliceLayout(1, mma_s)
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        sh_md: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, D], dtype)
        sh_kd: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BL, D], dtype)

        w = gl.program_id(0)
        valid, blk, b, h, start, end, ks, ke = _item(w, item_blk_ptr, item_start_ptr, item_end_ptr, blk_start_ptr,
                                                     blk_end_ptr, Hkv, Nv)

        q_buf = gl.allocate_shared_memory(dtype, [2, M, D], sh_md)
        k_smem = gl.allocate_shared_memory(dtype, [BL, D], sh_kd)
        v_smem = gl.allocate_shared_memory(dtype, [BL, D], sh_kd)
        kr = ks + gl.arange(0, BL, layout=row_ld)
        col = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        _block_to_shared(k_ptr, k_smem, b, h, kr, ke, sk_b, sk_t, sk_h, col)
        _block_to_shared(v_ptr, v_smem, b, h, kr, ke, sv_b, sv_t, sv_h, col)

        scale2 = gl.cast(scale * LOG2E, gl.float32)
        key = ks + gl.arange(0, BL, layout=gl.SliceLayout(0, mma_s))
        key_ok = key < ke
        s_zero = gl.zeros([M, BL], gl.float32, layout=mma_s)
        o_zero = gl.zeros([M, D], gl.float32, layout=mma_o)

        t, slot, g, ok = _rows(entries_ptr, start, end, N, G, GP, M, row_ld)
        _copy_q_rows(q_buf.index(0), q_ptr, b, h, t, g, ok, T0, sq_b, sq_t, sq_kv, sq_g, col, G)
        async_copy.commit_group()
        t_s, slot_s, g_s, ok_s = _rows(entries_ptr, start, end, N, G, GP, M, row_s)
        tn, sn, gn, okn = _rows(entries_ptr, start + BT, end, N, G, GP, M, row_ld)
        t1, s1, g1, ok1 = tn, sn, gn, okn
        for i in range(gl.cdiv(end - start, BT)):
            c0 = start + i * BT
            cur = i % 2
            gl.thread_barrier()
            _copy_q_rows(q_buf.index(1 - cur), q_ptr, b, h, tn, gn, okn, T0, sq_b, sq_t, sq_kv, sq_g, col, G)
            async_copy.commit_group()
            if not LATE_ROWS:
                tn, sn, gn, okn = _rows(entries_ptr, c0 + 2 * BT, end, N, G, GP, M, row_ld)
                tn_s, sn_s, gn_s, okn_s = _rows(entries_ptr, c0 + BT, end, N, G, GP, M, row_s)
            async_copy.wait_group(1)
            gl.thread_barrier()
            fence_async_shared()
            s = warpgroup_mma(q_buf.index(cur), k_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
            s = s * scale2
            vis = ok_s[:, None] & key_ok[None, :] & (key[None, :] <= (T0 + t_s)[:, None])
            s = gl.where(vis, s, float("-inf"))
            m = gl.max(s, axis=1)
            m = gl.where(m == float("-inf"), 0.0, m)
            p = gl.exp2(s - m[:, None])
            l = gl.sum(p, axis=1)
            acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_op), v_smem, o_zero, use_acc=False, is_async=True)
            if LATE_ROWS:
                # Used next iteration: chunk i+2's gather rows, chunk i+1's score rows.
                tn, sn, gn, okn = _rows(entries_ptr, c0 + 2 * BT, end, N, G, GP, M, row_ld)
                tn_s, sn_s, gn_s, okn_s = _rows(entries_ptr, c0 + BT, end, N, G, GP, M, row_s)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            l_o = gl.convert_layout(l, gl.SliceLayout(1, mma_o))
            o = acc / gl.where(l_o > 0, l_o, 1.0)[:, None]
            lse = gl.where(l > 0, m + gl.log2(gl.where(l > 0, l, 1.0)), float("-inf"))
            row = b * so_b + t * so_t + (h * G + g) * so_h + slot * so_n
            gl.store(po_ptr + row[:, None] + col[None, :], gl.convert_layout(o.to(po_ptr.dtype.element_ty), ld),
                     mask=ok[:, None])
            gl.store(plse_ptr + b * sl_b + t_s * sl_t + (h * G + g_s) * sl_h + slot_s, lse, mask=ok_s)
            t_s, slot_s, g_s, ok_s = tn_s, sn_s, gn_s, okn_s
            t, slot, g, ok = t1, s1, g1, ok1
            t1, s1, g1, ok1 = tn, sn, gn, okn
        async_copy.wait_group(0)
