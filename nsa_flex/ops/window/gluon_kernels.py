"""The window op's forward and dK/dV kernels in Gluon, for Hopper at 16-bit Dk = Dv.

_window_fwd_gluon_kernel does kernels._fwd_kernel's work (one program per 64-row tile, an online softmax
over its band of keys; with LOCAL the partial over each row's two local selection blocks first)
warp-specialised: one loader warp issues the TMA loads of each 64-key block's K and V into a ring
of buffers, and a warpgroup stages the tile's query rows in shared memory (by pointer: q may be
folded or q's own [B, T, Hq, D], which no 2D TMA tile reads) and runs the dots (wgmma) and the
softmax, so the loads never wait on the softmax. Its sums run in another order than the Triton kernel's (the
P V dot accumulates into the rescaled output), so o and lse agree with it to rounding, not bit
for bit.

_window_dq_gluon_kernel is the gated node's dQ (kernels._dq_kernel with GATED) in the same form: the
loader warp's ring of K / V blocks, and a warpgroup that stages its tile's q and dO rows in shared
memory once, issues S = q K^T and dP = dO V^T together per block and adds dS K from registers.
Without the local-slot term its dQ equals the Triton kernel's bit for bit; with it dS comes from
differently fused fp32 arithmetic, as in the dK/dV kernel.

_window_dkdv_gluon_kernel does kernels._dkdv_kernel's work (one program per key block, walking the row
tiles that see it; the gated and local-slot terms) in another schedule. The Triton kernel holds
K, V, P and dS in registers with 4 warps and 64-row tiles (255 registers with spills at D = 128,
two programs per SM). This one keeps its dots' operands in shared memory and walks BM-row tiles
with one warp per 16 rows (128 rows and 8 warps at D = 128, one program per SM; 64 and 4 at
D = 64, two): tile i+1's query and output-gradient rows are copied (cp.async) into a second
buffer while tile i's four dots run, its row statistics are read while the dV and dK dots run
(where the scores' registers are free), dP's dot runs under P's exp, and P and dS reach the dV
and dK dots through shared memory.

Same products, each summed in the same order (a 128-row dot adds its rows as two 64-row tiles
do), so without the local-slot term dK and dV equal the Triton kernel's bit for bit; with it dS
comes from differently fused fp32 arithmetic and may differ in its last bit. Gluon kernels do not
run under Triton's CPU interpreter: the CPU tests build this for sm_90a and interpret its Triton
twin; the GPU tests compare the two. (A dQ kernel in that form was slower than the Triton
one: docs/decisions.md, "The window branch".)
"""

from __future__ import annotations

import torch

from nsa_flex.ops.selected_attention.gluon_kernels import HAS_GLUON, _capability

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, mbarrier, tma, \
        warpgroup_mma, warpgroup_mma_wait

DKDV_KEYS = 64
"""Keys per block of the Gluon dK/dV kernel (its rows a tile: launch_config's kv_gluon_BM)."""
DKDV_ROWS = (64, 128)
"""The dK/dV kernel's tile heights: its layouts put four warps down the key block (one warp per 16
rows, so at least 64 rows) and are built and GPU-tested at these."""
FWD_ROWS = 64
"""Folded rows per tile of the Gluon forward (one consumer warpgroup, 64-key blocks)."""
FWD_KEYS = 64
FWD_BUFFERS = 2
"""K / V blocks in flight in the forward's ring (3 measured the same as 2)."""
FWD_MAXNREG = 128
"""The forward's registers per thread, which warp_specialize splits: 24 for the loader warp, the
rest to the consumer warpgroup (two programs per SM)."""


def _runs_on(q: torch.Tensor, v: torch.Tensor, group: int, head_dims: tuple[int, ...]) -> bool:
    """Hopper (sm_90), 16-bit, Dk = Dv in head_dims, G a power of two (the groups the GPU tests
    compared with the Triton kernels), not traced by Dynamo itself (Inductor cannot launch a Gluon
    kernel; the ops' bodies run below Dynamo)."""
    return (HAS_GLUON and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] in head_dims
            and v.shape[-1] == q.shape[-1] and group & (group - 1) == 0 and _capability(q.device.index) == (9, 0)
            and not torch.compiler.is_dynamo_compiling())


def applies(q: torch.Tensor, v: torch.Tensor, group: int) -> bool:
    """Whether the Gluon dK/dV and dQ kernels can run: _runs_on at Dk = Dv of 64 or 128 (launch_config
    asks for them at 128; at 64 they run when asked)."""
    return _runs_on(q, v, group, (64, 128))


def forward_applies(q: torch.Tensor, v: torch.Tensor, group: int, local_block: int) -> bool:
    """Whether the Gluon forward can run: _runs_on at Dk = Dv of 64 or 128, and with a local partial
    its 64-row tiles never hold tokens of two selection blocks (l' a multiple of 64 / G)."""
    return _runs_on(q, v, group, (64, 128)) and (local_block == 0 or (
        group <= FWD_ROWS and local_block % FWD_KEYS == 0 and local_block % (FWD_ROWS // group) == 0))


if HAS_GLUON:

    @gluon.jit
    def _fwd_block(i, start0, n_first, first, BN: gl.constexpr):
        """First key of the tile's i-th block: the n_first blocks from start0 (the local blocks,
        which end at the tile's last token), then the rest of the band from first."""
        kb = first + (i - n_first) * BN
        if i < n_first:
            kb = start0 + i * BN
        return kb

    @gluon.jit
    def _tile_band(T, Hkv, W, BH0, G: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr):
        """(bh, b, kv head h, first row, first token t0, last token t1 < T, first key block of the
        band) of the BM-row tile program_id(0) of (b, h) = BH0 + program_id(1)."""
        bh = BH0 + gl.program_id(1)
        row0 = gl.program_id(0) * BM
        t0 = row0 // G
        t1 = gl.minimum((row0 + BM - 1) // G, T - 1)
        return bh, bh // Hkv, bh % Hkv, row0, t0, t1, (gl.maximum(t0 - W + 1, 0) // BN) * BN

    @gluon.jit
    def _kv_loader(k_desc, v_desc, k_bufs, v_bufs, ready, empty, k_row, k_col, start0, n_first, first, n_blocks,
                   BN: gl.constexpr):
        """Each block's K and V (_fwd_block's order) into the ring as its buffers come free. K / V
        of kv head h are columns h*D.. of k viewed as [B*T, Hkv*D]; rows past a batch row's last
        token are the next row's (or TMA's zeros past the end), which the diagonal's mask hides."""
        NB: gl.constexpr = k_bufs.type.shape[0]
        for i in range(n_blocks):
            idx = i % NB
            mbarrier.wait(empty.index(idx), ((i // NB) & 1) ^ 1)
            kb = _fwd_block(i, start0, n_first, first, BN)
            bar = ready.index(idx)
            mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [k_row + kb, k_col], bar, k_bufs.index(idx))
            tma.async_copy_global_to_shared(v_desc, [k_row + kb, k_col], bar, v_bufs.index(idx))

    @gluon.jit
    def _row_at(b, h, r, s_b, s_h, s_t, s_g, G: gl.constexpr):
        """Offsets of folded rows r of (b, kv head h), token r // G and group member r % G, in a
        tensor with (batch, kv head, token, member) strides: folded or q's own [B, T, Hq, D]
        layout (kernels._rows4)."""
        r64 = r.to(gl.int64)
        return b * s_b + h * s_h + (r64 // G) * s_t + (r64 % G) * s_g

    @gluon.jit
    def _rows_to_smem(dst, ptr, b, h, r, ok, s_b, s_h, s_t, s_g, col, G: gl.constexpr):
        """Load folded rows r (zeros where not ok; _row_at) and store them into dst, visible to the
        warpgroup's wgmma."""
        at = _row_at(b, h, r, s_b, s_h, s_t, s_g, G)
        dst.store(gl.load(ptr + at[:, None] + col[None, :], mask=ok[:, None], other=0.0))
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _fwd_step(q_smem, k_bufs, v_bufs, ready, empty, i, kb, acc, m_i, l_i, tok, t0, t1, W, scale2,
                  BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr):
        """Block i (keys kb..) into the online softmax (base 2), as kernels._fwd_step: only the
        blocks the window's start or the diagonal cut are masked. The layouts are the consumer's:
        rows (tok) slice the scores', acc is the output's."""
        s_layout: gl.constexpr = tok.type.layout.parent
        o_layout: gl.constexpr = acc.type.layout
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        NB: gl.constexpr = k_bufs.type.shape[0]
        idx = i % NB
        mbarrier.wait(ready.index(idx), (i // NB) & 1)
        s = warpgroup_mma(q_smem, k_bufs.index(idx).permute((1, 0)), gl.zeros([BM, BN], gl.float32, s_layout),
                          use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        s = s * scale2
        if (kb + BN - 1 > t0) | (kb <= t1 - W):
            keys = kb + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
            seen = (keys[None, :] <= tok[:, None]) & (keys[None, :] > tok[:, None] - W)
            s = gl.where(seen, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        # A row the window's start cuts may see no key yet: subtract 0, not -inf (no NaN).
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_sub[:, None])
        alpha = gl.exp2(m_i - m_sub)
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
        acc = warpgroup_mma(p_op, v_bufs.index(idx), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        # Both dots of the block are done: its buffers go back to the loader.
        mbarrier.arrive(empty.index(idx), count=1)
        return acc, m_new, l_i

    @gluon.jit
    def _fwd_store(O, LSE, acc, m_i, l_i, bh, row0, R, BM: gl.constexpr, D: gl.constexpr):
        """o = acc / l (16-byte stores) and lse = m + log2(l) of the tile's rows below R; O
        [B, Hkv, R, D] and LSE [B, Hkv, R] contiguous (layouts: the consumer's)."""
        o_layout: gl.constexpr = acc.type.layout
        st: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        # Every real row sees its own key, so l > 0 there; pad rows are not stored.
        l_safe = gl.where(l_i > 0, l_i, 1.0)
        o = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
        o = gl.convert_layout(o.to(O.dtype.element_ty), st)
        r = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, st))
        c = gl.arange(0, D, layout=gl.SliceLayout(0, st))
        gl.store(O + (bh.to(gl.int64) * R + r)[:, None] * D + c[None, :], o, mask=(r < R)[:, None])
        rows = row0 + gl.arange(0, BM, layout=m_i.type.layout)
        gl.store(LSE + bh.to(gl.int64) * R + rows, m_i + gl.log2(l_safe), mask=rows < R)

    @gluon.jit
    def _fwd_consumer(q_smem, k_bufs, v_bufs, ready, empty, Q, O, LSE, O_LOC, LSE_LOC, bh, b, h, row0, R, t0, t1, W,
                      scale2, start0, n_first, first, n_blocks, s_qb, s_qh, s_qt, s_qg, G: gl.constexpr,
                      BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, LOCAL: gl.constexpr):
        """The consumer warpgroup: the tile's query rows into shared memory (while the loader warp
        fills the K / V ring), the local blocks (with LOCAL; their softmax stored as the local
        partial), then the rest of the band; o and lse."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, BN, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, D, 16])
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        r = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, ld))
        _rows_to_smem(q_smem, Q, b, h, r, r < R, s_qb, s_qh, s_qt, s_qg, gl.arange(0, D, layout=gl.SliceLayout(0, ld)),
                      G)
        sc2 = gl.cast(scale2, gl.float32)
        tok = (row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))) // G
        m_i = gl.full([BM], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BM], gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BM, D], gl.float32, layout=o_layout)
        for i in range(n_first):
            acc, m_i, l_i = _fwd_step(q_smem, k_bufs, v_bufs, ready, empty, i, start0 + i * BN, acc, m_i, l_i, tok,
                                      t0, t1, W, sc2, BM, BN, D)
        if LOCAL > 0:
            _fwd_store(O_LOC, LSE_LOC, acc, m_i, l_i, bh, row0, R, BM, D)
        for i in range(n_first, n_blocks):
            acc, m_i, l_i = _fwd_step(q_smem, k_bufs, v_bufs, ready, empty, i, first + (i - n_first) * BN, acc, m_i,
                                      l_i, tok, t0, t1, W, sc2, BM, BN, D)
        _fwd_store(O, LSE, acc, m_i, l_i, bh, row0, R, BM, D)

    @gluon.jit
    def _window_fwd_gluon_kernel(
            Q, k_desc, v_desc, O, LSE, O_LOC, LSE_LOC, T, R, Hkv, W, scale2, s_qb, s_qh, s_qt, s_qg,
            G: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, NB: gl.constexpr,
            LOCAL: gl.constexpr):
        """o [B, Hkv, R, D], lse [B, Hkv, R] (base 2) and with LOCAL (l') the local partial
        (O_LOC, LSE_LOC in o's and lse's layouts) of the BM-row tile program_id(0) of (b, kv head)
        program_id(1), as kernels._fwd_kernel gives them (no tile may cross a selection block:
        forward_applies). Q: queries by (batch, kv head, token, member) strides (folded or unfolded,
        see kernels._rows4); k_desc / v_desc: k, v as [B*T, Hkv*D] in [BN, D] tiles. 4 warps and a
        loader warp."""
        bh, b, h, row0, t0, t1, first = _tile_band(T, Hkv, W, 0, G, BM, BN)
        start0 = first
        if LOCAL > 0:
            # The local blocks (the token's own and the one before) lead, so their softmax is the
            # state after them; the window holds them whole (W >= 2 l').
            start0 = gl.maximum((t0 // LOCAL - 1) * LOCAL, 0)
        n_first = gl.cdiv(t1 + 1 - start0, BN)
        n_blocks = n_first + (start0 - first) // BN
        q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [BM, D],
                                           gl.NVMMASharedLayout.get_default_for([BM, D], Q.dtype.element_ty))
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [NB] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [NB] + v_desc.block_type.shape, v_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NB):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        gl.warp_specialize([
            (_fwd_consumer, (q_smem, k_bufs, v_bufs, ready, empty, Q, O, LSE, O_LOC, LSE_LOC, bh, b.to(gl.int64), h,
                             row0, R, t0, t1, W, scale2, start0, n_first, first, n_blocks, s_qb, s_qh, s_qt, s_qg, G,
                             BM, BN, D, LOCAL)),
            (_kv_loader, (k_desc, v_desc, k_bufs, v_bufs, ready, empty, b * T, h * D, start0, n_first, first,
                          n_blocks, BN)),
        ], [1], [24])

    @gluon.jit
    def _dq_consumer(q_smem, do_smem, k_bufs, v_bufs, ready, empty, Q, DO, DQ, LSE, DELTA, GW, LSES, DELTAS, GS, X,
                     bh, b, h, row0, R, RQ, t0, t1, W, scale, scale2, first, lo, n_blocks, xi, XH, XG, XN, s_qb,
                     s_qh, s_qt, s_qg, s_db, s_dh, s_dt, s_dg, s_lb, s_lh, s_lt, s_xb, s_xj, s_xs, G: gl.constexpr,
                     BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, SEL: gl.constexpr, ADD: gl.constexpr):
        """The dQ warpgroup: the tile's q and dO rows into shared memory, then per key block S = q K^T
        and dP = dO V^T (both issued before either is waited for), dS in fp32 and dQ += dS K (dS
        from registers); the block's buffers go back to the loader once its dQ dot is done. ADD:
        X's rows added before the rounding (kernels._added_rows; this (b, h) is X[xi])."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, BN, 16])
        q_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, D, 16])
        a_q: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=q_layout, k_width=2)
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        NB: gl.constexpr = k_bufs.type.shape[0]
        dtype: gl.constexpr = Q.dtype.element_ty
        sc = gl.cast(scale, gl.float32)
        sc2 = gl.cast(scale2, gl.float32)
        r = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, ld))
        c = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        # Rows past R (a folded q's pad rows) are zeros, so their P, dS and dQ are too.
        ok = (r < R)[:, None]
        q_at = _row_at(b, h, r, s_qb, s_qh, s_qt, s_qg, G)[:, None] + c[None, :]
        q = gl.load(Q + q_at, mask=ok, other=0.0)
        do = gl.load(DO + _row_at(b, h, r, s_db, s_dh, s_dt, s_dg, G)[:, None] + c[None, :],
                     mask=ok, other=0.0)
        q_smem.store(q)
        do_smem.store(do)
        fence_async_shared()
        gl.thread_barrier()
        rs = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
        tok = rs // G
        lse2, delta, gw, lse_s2, delta_s, gs = _row_stats(LSE, DELTA, GW, LSES, DELTAS, GS, bh, b, h, rs, rs < R, R,
                                                          s_lb, s_lh, s_lt, G, True, SEL)
        dq = gl.zeros([BM, D], gl.float32, layout=q_layout)
        s_zero = gl.zeros([BM, BN], gl.float32, layout=s_layout)
        for i in range(n_blocks):
            kb = first + i * BN
            idx = i % NB
            mbarrier.wait(ready.index(idx), (i // NB) & 1)
            k_buf = k_bufs.index(idx)
            s = warpgroup_mma(q_smem, k_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dp = warpgroup_mma(do_smem, v_bufs.index(idx).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
            s = s * sc2
            p = gl.exp2(s - lse2[:, None])
            keys = kb + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
            if (kb + BN - 1 > t0) | (kb <= t1 - W):
                seen = (keys[None, :] <= tok[:, None]) & (keys[None, :] > tok[:, None] - W)
                p = gl.where(seen, p, 0.0)
            p = p * gw[:, None]
            dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp, ))
            if SEL > 0:
                if kb >= lo:
                    # The selected branch's term over each row's local keys (kernels._dq_step).
                    local = (keys[None, :] <= tok[:, None]) & (keys[None, :] >= ((tok // SEL - 1) * SEL)[:, None])
                    ps = gl.where(local, gl.exp2(s - lse_s2[:, None]), 0.0) * gs[:, None]
                    ds = (p + ps) * dp - (p * delta[:, None] + ps * delta_s[:, None])
                else:
                    ds = p * (dp - delta[:, None])
            else:
                ds = p * (dp - delta[:, None])
            dq = warpgroup_mma(gl.convert_layout(ds.to(dtype), a_q), k_buf, dq, is_async=True)
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
            mbarrier.arrive(empty.index(idx), count=1)
        dq = gl.convert_layout(dq * sc, ld)
        if ADD:
            x = r - XH
            x_ok = (x >= 0) & (x < XN)
            x = gl.maximum(x, 0).to(gl.int64)
            at = X + xi.to(gl.int64) * s_xb + (x % XG)[:, None] * s_xj + (x // XG)[:, None] * s_xs + c[None, :]
            dq += gl.load(at, mask=x_ok[:, None], other=0.0).to(gl.float32)
        # dQ in q's layout (the launch makes it so).
        gl.store(DQ + q_at, dq.to(DQ.dtype.element_ty), mask=(r < RQ)[:, None])

    @gluon.jit
    def _window_dq_gluon_kernel(
            k_desc, v_desc, Q, DO, DQ, LSE, DELTA, GW, LSES, DELTAS, GS, X, RQ, T, R, Hkv, W, scale, scale2, BH0,
            XH, XG, XN, s_qb, s_qh, s_qt, s_qg, s_db, s_dh, s_dt, s_dg, s_lb, s_lh, s_lt, s_xb, s_xj, s_xs,
            G: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, NB: gl.constexpr,
            SEL: gl.constexpr, ADD: gl.constexpr):
        """dQ (q's layout: Q and DQ by (s_qb, s_qh, s_qt, s_qg), RQ rows a kv head, zero at rows
        R .. RQ - 1) of the BM-row tile program_id(0) of
        (b, kv head) BH0 + program_id(1), as kernels._dq_kernel gives it in the gated node's mode
        (GATED: DO the gated sum's output gradient by (s_db, s_dh, s_dt, s_dg), GW the window's gate
        and DELTA its delta per row; SEL and ADD as there). k_desc / v_desc: k, v as [B*T, Hkv*D] in
        [BN, D] tiles. 4 warps and a loader warp."""
        bh, b, h, row0, t0, t1, first = _tile_band(T, Hkv, W, BH0, G, BM, BN)
        n_blocks = gl.maximum(gl.cdiv(t1 + 1 - first, BN), 0)
        lo = first
        if SEL > 0:
            # From the key block of the tile's first local key on, the selected term too.
            lo = gl.maximum((gl.maximum((t0 // SEL - 1) * SEL, 0) // BN) * BN, first)
        rows_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D], Q.dtype.element_ty)
        q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [BM, D], rows_layout)
        do_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [BM, D], rows_layout)
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [NB] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [NB] + v_desc.block_type.shape, v_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NB):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        gl.warp_specialize([
            (_dq_consumer, (q_smem, do_smem, k_bufs, v_bufs, ready, empty, Q, DO, DQ, LSE, DELTA, GW, LSES, DELTAS,
                            GS, X, bh, b.to(gl.int64), h, row0, R, RQ, t0, t1, W, scale, scale2, first, lo, n_blocks,
                            bh - BH0, XH, XG, XN, s_qb, s_qh, s_qt, s_qg, s_db, s_dh, s_dt, s_dg, s_lb, s_lh, s_lt, s_xb,
                            s_xj, s_xs, G, BM, BN, D, SEL, ADD)),
            (_kv_loader, (k_desc, v_desc, k_bufs, v_bufs, ready, empty, b * T, h * D, first, n_blocks, first,
                          n_blocks, BN)),
        ], [1], [24])

    @gluon.jit
    def _rows_to_shared(dst, ptr, b, h, r, ok, s_b, s_h, s_t, s_g, col, G: gl.constexpr):
        """Start the copy of folded rows r (token r // G, group member r % G; zeros where not ok) of a
        tensor with (batch, kv head, token, member) strides into dst."""
        at = _row_at(b, h, r, s_b, s_h, s_t, s_g, G)
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
    def _window_dkdv_gluon_kernel(
            Q, K, V, DO, LSE, DELTA, DK_, DV_, GW, LSES, DELTAS, GS, T, R, Hkv, W, scale, scale2, s_qb, s_qh, s_qt,
            s_qg, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_ob, s_oh, s_or, s_db, s_dh, s_dt, s_dg, s_lb, s_lh, s_lt,
            G: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, DK: gl.constexpr, DV: gl.constexpr,
            GATED: gl.constexpr, SEL: gl.constexpr, F32_DOT: gl.constexpr):
        """Arguments and results as kernels._dkdv_kernel's (BM rows a tile, 64 or 128, launched with
        BM / 16 warps; BN = 64 keys, DK = DV of 64 or 128; F32_DOT False): dK, dV of key block
        program_id(0)."""
        D: gl.constexpr = DK
        # One warp per 16 rows of the tile; dK / dV [BN, D]: four warps down its 64 rows, the
        # others across its columns.
        NW: gl.constexpr = BM // 16
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [NW, 1], [1, 0])
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                         instr_shape=[16, BN, 16])
        mma_kv: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, NW // 4],
                                                          instr_shape=[16, D // (NW // 4), 16])
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
        _rows_to_shared(q_buf.index(0), Q, b, h, r, r < R, s_qb, s_qh, s_qt, s_qg, col, G)
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
            _rows_to_shared(q_buf.index(1 - cur), Q, b, h, rn, okn, s_qb, s_qh, s_qt, s_qg, col, G)
            _rows_to_shared(do_buf.index(1 - cur), DO, b, h, rn, okn, s_db, s_dh, s_dt, s_dg, col, G)
            async_copy.commit_group()
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
            # Tile i+1's row statistics under the dots (read here, where the scores' registers
            # are free).
            rs = rs + BM
            lse2, delta, gw, lse_s2, delta_s, gs = _row_stats(LSE, DELTA, GW, LSES, DELTAS, GS, bh, b, h, rs,
                                                              (rs < R) & (r0 + BM < r_end), R, s_lb, s_lh, s_lt, G,
                                                              GATED, SEL)
            dv_acc, dk_acc = warpgroup_mma_wait(num_outstanding=0, deps=(dv_acc, dk_acc))
        async_copy.wait_group(0)
        kk = s0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma_kv))
        c = gl.arange(0, D, layout=gl.SliceLayout(0, mma_kv))
        kk64 = kk.to(gl.int64)
        ok = (kk < T)[:, None]
        gl.store(DK_ + b * s_kb + kk64[:, None] * s_kt + h * s_kh + c[None, :], (dk_acc * sc).to(DK_.dtype.element_ty),
                 mask=ok)
        gl.store(DV_ + b * s_vb + kk64[:, None] * s_vt + h * s_vh + c[None, :], dv_acc.to(DV_.dtype.element_ty),
                 mask=ok)
