"""Triton kernels of nsa_flex::window_attention: the sliding window over folded queries.

Query rows are folded (row r = t*G + g of kv head h is query head h*G + g at token t), so a tile
of BM rows holds BM/G tokens that share one kv head and one run of keys: the tokens t0..t1 of
a tile see keys t0-W+1 .. t1, BM/G + W - 1 keys in all. Each loop over keys runs in three parts,
by blocks of BN keys: the blocks the window's start cuts (masked), those every row sees whole
(no mask) and those the diagonal cuts (masked). The kernels address a row by (batch, kv head,
token, group member) strides, so q (and dQ) may be folded or q's own [B, T, Hq, D]; the gated
node passes the latter and keeps no folded copy.

Forward: one program per row tile, an online softmax in base 2; o in the inputs' dtype and the
row's lse (fp32, base 2). Backward, two launches, no atomics: _dq_kernel per row tile (dQ, and
delta = rowsum(dO * O) for its rows), then _dkdv_kernel per key block, walking the row tiles
that see the block (all G heads of its kv head: no GQA reduction afterwards). Called from
nsa_flex::gated_branches (GATED), the backward starts from the gated sum's dO: P' = g P with the
branch's gate per row stands for its output gradient g dO, and with SEL = l' the kernels add the
selected branch's term over each row's two local blocks, sharing the scores and dP.

Under Triton's interpreter (CPU tests) the dots run in fp32 (F32_DOT): its dot misreads
16-bit inputs.
"""

from __future__ import annotations

from nsa_flex.ops.triton_utils import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    from nsa_flex.ops.triton_utils import dot

    @triton.jit
    def _row_tile(ptr, b, h, rows, rows_ok, s_b, s_h, s_r, D: tl.constexpr):
        """[BM, D] folded rows of (b, h), zero past the last row."""
        d = tl.arange(0, D)
        return tl.load(ptr + b * s_b + h * s_h + rows.to(tl.int64)[:, None] * s_r + d[None, :],
                       mask=rows_ok[:, None], other=0.0)

    @triton.jit
    def _key_tile_t(ptr, b, h, keys, T, s_b, s_t, s_h, D: tl.constexpr):
        """[D, BN]: keys `keys` of (b, h) transposed, zero past T."""
        d = tl.arange(0, D)
        return tl.load(ptr + b * s_b + keys.to(tl.int64)[None, :] * s_t + h * s_h + d[:, None],
                       mask=keys[None, :] < T, other=0.0)

    @triton.jit
    def _row_program(T, R, Hkv, G: tl.constexpr, BM: tl.constexpr, BH0):
        """(bh, b, kv head h, rows [BM], rows < R, their tokens, first token t0, last token t1 < T)
        of the row tile program_id(0) of (b, h) = BH0 + program_id(1)."""
        bh = BH0 + tl.program_id(1)
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        t0 = tl.program_id(0) * BM // G
        t1 = tl.minimum((tl.program_id(0) * BM + BM - 1) // G, T - 1)
        return bh, (bh // Hkv).to(tl.int64), bh % Hkv, rows, rows < R, rows // G, t0, t1

    @triton.jit
    def _row_parts(t0, t1, W, BN: tl.constexpr):
        """Key block starts of a tile of tokens t0..t1: (first, first unmasked, first cut by the
        diagonal, end). Blocks in [first, mid_lo) are cut by the window's start, [mid_lo,
        mid_hi) are whole for every row, [mid_hi, end) are cut by the diagonal."""
        first = (tl.maximum(t0 - W + 1, 0) // BN) * BN
        mid_lo = first + tl.cdiv(tl.maximum(t1 - W + 1 - first, 0), BN) * BN
        mid_hi = tl.maximum(first + ((t0 + 1 - first) // BN) * BN, mid_lo)
        end = t1 + 1
        return first, mid_lo, tl.minimum(mid_hi, tl.cdiv(end - first, BN) * BN + first), end

    @triton.jit
    def _fwd_step(q, acc, m_i, l_i, b, h, n0, tok, K, V, T, W, scale2, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh,
                  MASKED: tl.constexpr, BN: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  F32_DOT: tl.constexpr, LOCAL: tl.constexpr = 0, LOC_MODE: tl.constexpr = 0):
        """One block of keys into the online softmax. MASKED: the window's mask; with LOCAL > 0,
        LOC_MODE 1 / 2 also keeps only the keys at or after / before each row's first local key,
        the first of selection block tok // LOCAL - 1."""
        keys = n0 + tl.arange(0, BN)
        kt = _key_tile_t(K, b, h, keys, T, s_kb, s_kt, s_kh, DK)
        s = dot(q, kt, F32_DOT, False) * scale2
        if MASKED:
            seen = (keys[None, :] <= tok[:, None]) & (keys[None, :] > tok[:, None] - W)
            if LOCAL > 0:
                if LOC_MODE == 1:
                    seen = seen & (keys[None, :] >= ((tok // LOCAL - 1) * LOCAL)[:, None])
                if LOC_MODE == 2:
                    seen = seen & (keys[None, :] < ((tok // LOCAL - 1) * LOCAL)[:, None])
            s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row the window's start cuts may see no key yet: subtract 0, not -inf (no NaN).
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.trans(_key_tile_t(V, b, h, keys, T, s_vb, s_vt, s_vh, DV))
        acc = acc * alpha[:, None] + dot(p.to(vt.dtype), vt, F32_DOT, False)
        return acc, m_new, l_i

    @triton.jit
    def _fwd_kernel(Q, K, V, O, LSE, O_LOC, LSE_LOC, T, R, Hkv, W, scale2,
                    s_qb, s_qh, s_qt, s_qg, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_ob, s_oh, s_or,
                    G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                    LOCAL: tl.constexpr, CROSS: tl.constexpr, F32_DOT: tl.constexpr):
        """o [B, Hkv, R, DV] and lse [B, Hkv, R] (base 2) of the BM rows of tile program_id(0); Q's
        rows by (s_qb, s_qh, s_qt, s_qg) (see _rows4).

        LOCAL (> 0, NSA's selection block l'): a row of token t has the local keys of selection
        blocks t // l' - 1 and t // l' up to t, which the window holds whole (W >= 2 l'). Those
        blocks come first in the tile's walk, and the softmax over them alone, the selected
        branch's partial over the two local blocks, goes to O_LOC / LSE_LOC (O's layout) before the
        walk goes on: no extra dot. CROSS: the tile's tokens may lie in two selection blocks
        (then the later rows' local keys start one block later, and a loop more walks the keys
        they skipped)."""
        # Under Inductor a float argument arrives as a constexpr (a Python float, fp64 in the
        # arithmetic): fp32 it must be, for the loop-carried row max.
        sc2 = tl.cast(scale2, tl.float32)
        bh, b, h, rows, rows_ok, tok, t0, t1 = _row_program(T, R, Hkv, G, BM, 0)
        q = _rows4(Q, b, h, rows, rows_ok, s_qb, s_qh, s_qt, s_qg, G, DK)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, DV], tl.float32)
        first, mid_lo, mid_hi, end = _row_parts(t0, t1, W, BN)
        dv = tl.arange(0, DV)
        out_rows = b * s_ob + h * s_oh + rows.to(tl.int64)[:, None] * s_or + dv[None, :]
        if LOCAL > 0:
            lo = tl.maximum((t0 // LOCAL - 1) * LOCAL, 0)
            # CROSS: a tile's tokens may cross a selection block's end (G not a power of two), so
            # its rows' local keys start at two places; each row keeps its own (mode 1).
            for n0 in range(lo, end, BN):
                acc, m_i, l_i = _fwd_step(q, acc, m_i, l_i, b, h, n0, tok, K, V, T, W, sc2, s_kb, s_kt, s_kh,
                                          s_vb, s_vt, s_vh, True, BN, DK, DV, F32_DOT, LOCAL if CROSS else 0, 1)
            l_loc = tl.where(rows_ok, l_i, 1.0)
            tl.store(O_LOC + out_rows, (acc / l_loc[:, None]).to(O_LOC.dtype.element_ty), mask=rows_ok[:, None])
            tl.store(LSE_LOC + bh.to(tl.int64) * R + rows, m_i + tl.math.log2(l_loc), mask=rows_ok)
            if CROSS:
                # The rows of the later block skipped [lo, their first local key): a loop of its
                # own, compiled only here (it costs registers: 168 against 127 at D=64, a program
                # per SM fewer).
                for n0 in range(lo, tl.maximum((t1 // LOCAL - 1) * LOCAL, lo), BN):
                    acc, m_i, l_i = _fwd_step(q, acc, m_i, l_i, b, h, n0, tok, K, V, T, W, sc2, s_kb, s_kt, s_kh,
                                              s_vb, s_vt, s_vh, True, BN, DK, DV, F32_DOT, LOCAL, 2)
            # The rest of the window lies before lo: no block there is cut by the diagonal.
            mid_lo = tl.minimum(mid_lo, lo)
            mid_hi = lo
            end = lo
        for n0 in range(first, mid_lo, BN):
            acc, m_i, l_i = _fwd_step(q, acc, m_i, l_i, b, h, n0, tok, K, V, T, W, sc2, s_kb, s_kt, s_kh,
                                      s_vb, s_vt, s_vh, True, BN, DK, DV, F32_DOT)
        for n0 in range(mid_lo, mid_hi, BN):
            acc, m_i, l_i = _fwd_step(q, acc, m_i, l_i, b, h, n0, tok, K, V, T, W, sc2, s_kb, s_kt, s_kh,
                                      s_vb, s_vt, s_vh, False, BN, DK, DV, F32_DOT)
        for n0 in range(mid_hi, end, BN):
            acc, m_i, l_i = _fwd_step(q, acc, m_i, l_i, b, h, n0, tok, K, V, T, W, sc2, s_kb, s_kt, s_kh,
                                      s_vb, s_vt, s_vh, True, BN, DK, DV, F32_DOT)
        # Every real row sees its own key, so l_i > 0 there; pad rows are not stored.
        l_safe = tl.where(rows_ok, l_i, 1.0)
        tl.store(O + out_rows, (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=rows_ok[:, None])
        tl.store(LSE + bh.to(tl.int64) * R + rows, m_i + tl.math.log2(l_safe), mask=rows_ok)

    @triton.jit
    def _rows4(ptr, b, h, rows, rows_ok, s_b, s_h, s_t, s_g, G: tl.constexpr, D: tl.constexpr):
        """[BM, D] rows of folded row index `rows` of (b, h) in a tensor addressed by (batch, kv head,
        token, group member) strides: folded [B, Hkv, R, D] (s_t = G s_r, s_g = s_r) or unfolded
        [B, T, Hq, D] (s_h = G s_hq, s_g = s_hq). Zero past the last row."""
        d = tl.arange(0, D)
        r = rows.to(tl.int64)
        return tl.load(ptr + b * s_b + h * s_h + (r // G)[:, None] * s_t + (r % G)[:, None] * s_g + d[None, :],
                       mask=rows_ok[:, None], other=0.0)

    @triton.jit
    def _sel_stats(LSES, DELTAS, GS, b, h, rows, rows_ok, s_lb, s_lh, s_lt, G: tl.constexpr):
        """The selected branch's (lse base 2, delta, gate) at folded rows `rows` of (b, h), from [B, Hq, T]
        fp32 rows (lse in natural log); pad rows: lse +inf, delta and gate 0."""
        LOG2E: tl.constexpr = 1.4426950408889634
        r = rows.to(tl.int64)
        stat = b * s_lb + (h * G + r % G) * s_lh + (r // G) * s_lt
        return (tl.load(LSES + stat, mask=rows_ok, other=float("inf")) * LOG2E,
                tl.load(DELTAS + stat, mask=rows_ok, other=0.0), tl.load(GS + stat, mask=rows_ok, other=0.0))

    @triton.jit
    def _local_keys(keys, tok, SEL: tl.constexpr):
        """[rows, keys]: key s lies in token t's local selection blocks: (t // l' - 1) l' <= s <= t."""
        return (keys[None, :] <= tok[:, None]) & (keys[None, :] >= ((tok // SEL - 1) * SEL)[:, None])

    @triton.jit
    def _dq_step(q, do, lse2, delta, gw, dq, b, h, n0, tok, K, V, T, W, scale2, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh,
                 MASKED: tl.constexpr, BN: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                 F32_DOT: tl.constexpr, GATED: tl.constexpr = False, SEL: tl.constexpr = 0, lse_s2=None,
                 delta_s=None, gs=None):
        """One block of keys into dQ. GATED: do is the gated sum's dO and gw the window's gate per
        row (P' = g P: the branch's output gradient g dO, never written). SEL > 0: the selected
        branch's term over each row's local keys too (its lse base 2, delta and gate per row),
        sharing the scores and dP."""
        keys = n0 + tl.arange(0, BN)
        kt = _key_tile_t(K, b, h, keys, T, s_kb, s_kt, s_kh, DK)
        s = dot(q, kt, F32_DOT, False) * scale2
        p = tl.math.exp2(s - lse2[:, None])
        if MASKED:
            seen = (keys[None, :] <= tok[:, None]) & (keys[None, :] > tok[:, None] - W)
            p = tl.where(seen, p, 0.0)
        if GATED:
            p = p * gw[:, None]
        vt = _key_tile_t(V, b, h, keys, T, s_vb, s_vt, s_vh, DV)
        dp = dot(do, vt, F32_DOT, False)
        if SEL > 0:
            ps = tl.where(_local_keys(keys, tok, SEL), tl.math.exp2(s - lse_s2[:, None]), 0.0) * gs[:, None]
            ds = (p + ps) * dp - (p * delta[:, None] + ps * delta_s[:, None])
        else:
            ds = p * (dp - delta[:, None])
        return dq + dot(ds.to(kt.dtype), tl.trans(kt), F32_DOT, False)

    @triton.jit
    def _dq_kernel(Q, K, V, O, DO, LSE, DQ, DELTA, GW, LSES, DELTAS, GS, X, RQ, T, R, Hkv, W, scale, scale2,
                   BH0, XH, XG, XN, s_qb, s_qh, s_qt, s_qg, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_ob, s_oh, s_or,
                   s_db, s_dh, s_dt, s_dg, s_lb, s_lh, s_lt, s_xb, s_xj, s_xs,
                   G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                   GATED: tl.constexpr, SEL: tl.constexpr, F32_DOT: tl.constexpr, ADD: tl.constexpr = False):
        """dQ of a row tile (zero at rows R .. RQ - 1) of (b, h) = BH0 + program_id(1), in q's layout:
        Q and DQ by (s_qb, s_qh, s_qt, s_qg), folded or q's own [B, T, Hq, DK] (see _rows4); DO's
        rows by (s_db, s_dh, s_dt, s_dg). Without GATED: DO is the
        window's output gradient and the kernel writes delta of its rows from O. GATED: DO is the
        gated sum's, GW the window's gate per row ([B, Hkv, R] fp32, LSE's layout), DELTA holds
        delta = rowsum(dO * O) already (O unread), and with SEL > 0 the selected branch's term over
        the local keys (LSES, DELTAS, GS: its lse, delta and gate, [B, Hq, T] fp32). ADD: another
        gradient of these rows is added before the one rounding (_added_rows; X unread without)."""
        sc = tl.cast(scale, tl.float32)
        sc2 = tl.cast(scale2, tl.float32)
        bh, b, h, rows, rows_ok, tok, t0, t1 = _row_program(T, R, Hkv, G, BM, BH0)
        q = _rows4(Q, b, h, rows, rows_ok, s_qb, s_qh, s_qt, s_qg, G, DK)
        do = _rows4(DO, b, h, rows, rows_ok, s_db, s_dh, s_dt, s_dg, G, DV)
        if GATED:
            delta = tl.load(DELTA + bh.to(tl.int64) * R + rows, mask=rows_ok, other=0.0)
            gw = tl.load(GW + bh.to(tl.int64) * R + rows, mask=rows_ok, other=0.0)
        else:
            o = _row_tile(O, b, h, rows, rows_ok, s_ob, s_oh, s_or, DV)
            delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
            tl.store(DELTA + bh.to(tl.int64) * R + rows, delta, mask=rows_ok)
            gw = delta
        lse2 = tl.load(LSE + bh.to(tl.int64) * R + rows, mask=rows_ok, other=0.0)
        dq = tl.zeros([BM, DK], tl.float32)
        first, mid_lo, mid_hi, end = _row_parts(t0, t1, W, BN)
        if SEL > 0:
            lse_s2, delta_s, gs = _sel_stats(LSES, DELTAS, GS, b, h, rows, rows_ok, s_lb, s_lh, s_lt, G)
            # From the key block of the tile's first local key on, the selected term too. Local keys
            # lie in the window (W >= 2 l') and start before the diagonal's blocks (l' >= BN), so
            # the blocks before them split as without it: cut by the window's start, then whole.
            lo = tl.maximum((tl.maximum((t0 // SEL - 1) * SEL, 0) // BN) * BN, first)
            for n0 in range(first, tl.minimum(mid_lo, lo), BN):
                dq = _dq_step(q, do, lse2, delta, gw, dq, b, h, n0, tok, K, V, T, W, sc2, s_kb, s_kt, s_kh, s_vb,
                              s_vt, s_vh, True, BN, DK, DV, F32_DOT, GATED)
            for n0 in range(tl.minimum(mid_lo, lo), lo, BN):
                dq = _dq_step(q, do, lse2, delta, gw, dq, b, h, n0, tok, K, V, T, W, sc2, s_kb, s_kt, s_kh, s_vb,
                              s_vt, s_vh, False, BN, DK, DV, F32_DOT, GATED)
            for n0 in range(lo, end, BN):
                dq = _dq_step(q, do, lse2, delta, gw, dq, b, h, n0, tok, K, V, T, W, sc2, s_kb, s_kt, s_kh, s_vb,
                              s_vt, s_vh, True, BN, DK, DV, F32_DOT, GATED, SEL, lse_s2, delta_s, gs)
        else:
            for n0 in range(first, mid_lo, BN):
                dq = _dq_step(q, do, lse2, delta, gw, dq, b, h, n0, tok, K, V, T, W, sc2, s_kb, s_kt, s_kh, s_vb,
                              s_vt, s_vh, True, BN, DK, DV, F32_DOT, GATED)
            for n0 in range(mid_lo, mid_hi, BN):
                dq = _dq_step(q, do, lse2, delta, gw, dq, b, h, n0, tok, K, V, T, W, sc2, s_kb, s_kt, s_kh, s_vb,
                              s_vt, s_vh, False, BN, DK, DV, F32_DOT, GATED)
            for n0 in range(mid_hi, end, BN):
                dq = _dq_step(q, do, lse2, delta, gw, dq, b, h, n0, tok, K, V, T, W, sc2, s_kb, s_kt, s_kh, s_vb,
                              s_vt, s_vh, True, BN, DK, DV, F32_DOT, GATED)
        dk_ = tl.arange(0, DK)
        dq = dq * sc
        if ADD:
            dq += _added_rows(X, bh - BH0, rows, XH, XG, XN, s_xb, s_xj, s_xs, DK)
        r = rows.to(tl.int64)
        tl.store(DQ + b * s_qb + h * s_qh + (r // G)[:, None] * s_qt + (r % G)[:, None] * s_qg + dk_[None, :],
                 dq.to(DQ.dtype.element_ty), mask=(rows < RQ)[:, None])

    @triton.jit
    def _added_rows(X, i, rows, XH, XG, XN, s_xb, s_xj, s_xs, D: tl.constexpr):
        """[BM, D] fp32: the rows of another gradient of the folded q, laid out as the grouped
        compressed call's dQ (flex.compressed_groups): folded row XH + s * XG + j is X[i, j, s],
        for XN rows from row XH on; zero elsewhere. i: the (b, kv head)'s place in X."""
        x = rows - XH
        ok = (x >= 0) & (x < XN)
        x = tl.maximum(x, 0).to(tl.int64)
        d = tl.arange(0, D)
        at = X + i.to(tl.int64) * s_xb + (x % XG)[:, None] * s_xj + (x // XG)[:, None] * s_xs + d[None, :]
        return tl.load(at, mask=ok[:, None], other=0.0).to(tl.float32)

    @triton.jit
    def _dkdv_step(k, v, dk, dv, b, h, r0, keys, Q, DO, LSE, DELTA, GW, LSES, DELTAS, GS, bh, R, W, scale2,
                   s_qb, s_qh, s_qt, s_qg, s_db, s_dh, s_dt, s_dg, s_lb, s_lh, s_lt,
                   MASKED: tl.constexpr, G: tl.constexpr, BM: tl.constexpr, DK: tl.constexpr,
                   DV: tl.constexpr, F32_DOT: tl.constexpr, GATED: tl.constexpr, SEL: tl.constexpr):
        """One row tile into dK, dV (GATED, SEL as _dq_step's)."""
        rows = r0 + tl.arange(0, BM)
        rows_ok = rows < R
        q = _rows4(Q, b, h, rows, rows_ok, s_qb, s_qh, s_qt, s_qg, G, DK)
        do = _rows4(DO, b, h, rows, rows_ok, s_db, s_dh, s_dt, s_dg, G, DV)
        # Pad rows: lse +inf makes their probabilities 0.
        lse2 = tl.load(LSE + bh.to(tl.int64) * R + rows, mask=rows_ok, other=float("inf"))
        delta = tl.load(DELTA + bh.to(tl.int64) * R + rows, mask=rows_ok, other=0.0)
        # [BN, BM]: keys down, rows across.
        st = dot(k, tl.trans(q), F32_DOT, False) * scale2
        pt = tl.math.exp2(st - lse2[None, :])
        if MASKED:
            tok = rows // G
            seen = (keys[:, None] <= tok[None, :]) & (keys[:, None] > tok[None, :] - W)
            pt = tl.where(seen, pt, 0.0)
        if GATED:
            pt = pt * tl.load(GW + bh.to(tl.int64) * R + rows, mask=rows_ok, other=0.0)[None, :]
        if SEL > 0:
            lse_s2, delta_s, gs = _sel_stats(LSES, DELTAS, GS, b, h, rows, rows_ok, s_lb, s_lh, s_lt, G)
            pst = tl.where(tl.trans(_local_keys(keys, rows // G, SEL)), tl.math.exp2(st - lse_s2[None, :]),
                           0.0) * gs[None, :]
            pd = pt * delta[None, :] + pst * delta_s[None, :]
            pt = pt + pst
            dv += dot(pt.to(do.dtype), do, F32_DOT, False)
            dst = pt * dot(v, tl.trans(do), F32_DOT, False) - pd
        else:
            dv += dot(pt.to(do.dtype), do, F32_DOT, False)
            dst = pt * (dot(v, tl.trans(do), F32_DOT, False) - delta[None, :])
        dk += dot(dst.to(q.dtype), q, F32_DOT, False)
        return dk, dv

    @triton.jit
    def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK_, DV_, GW, LSES, DELTAS, GS, T, R, Hkv, W, scale, scale2,
                     s_qb, s_qh, s_qt, s_qg, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_ob, s_oh, s_or,
                     s_db, s_dh, s_dt, s_dg, s_lb, s_lh, s_lt,
                     G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                     GATED: tl.constexpr, SEL: tl.constexpr, F32_DOT: tl.constexpr):
        """dK, dV [B, T, Hkv, D] (k's and v's strides) of key block program_id(0): the rows of
        tokens s0 .. s0 + BN + W - 2 see some of its keys. DO, GATED, SEL as _dq_kernel's."""
        sc = tl.cast(scale, tl.float32)
        sc2 = tl.cast(scale2, tl.float32)
        bh = tl.program_id(1)
        b = (bh // Hkv).to(tl.int64)
        h = bh % Hkv
        s0 = tl.program_id(0) * BN
        keys = s0 + tl.arange(0, BN)
        keys_ok = keys < T
        dk_ = tl.arange(0, DK)
        dv_ = tl.arange(0, DV)
        k_ptrs = K + b * s_kb + keys.to(tl.int64)[:, None] * s_kt + h * s_kh
        v_ptrs = V + b * s_vb + keys.to(tl.int64)[:, None] * s_vt + h * s_vh
        k = tl.load(k_ptrs + dk_[None, :], mask=keys_ok[:, None], other=0.0)
        v = tl.load(v_ptrs + dv_[None, :], mask=keys_ok[:, None], other=0.0)
        dk = tl.zeros([BN, DK], tl.float32)
        dv = tl.zeros([BN, DV], tl.float32)
        # Row tiles by their tokens: [r_first, r_lo) see the diagonal cut the block, [r_lo, r_hi)
        # see it whole, [r_hi, r_end) see the window's start cut it.
        t_last = tl.minimum(s0 + BN - 1 + W - 1, T - 1)
        r_first = (s0 * G // BM) * BM
        r_end = (t_last + 1) * G
        r_stop = r_first + tl.cdiv(r_end - r_first, BM) * BM
        # A tile is whole when its first token >= s0 + BN - 1 and its last token <= s0 + W - 1.
        r_lo = r_first + tl.cdiv(tl.maximum((s0 + BN - 1) * G - r_first, 0), BM) * BM
        r_hi = tl.maximum(r_first + (((s0 + W) * G - r_first) // BM) * BM, r_lo)
        r_hi = tl.minimum(r_hi, r_stop)
        r_lo = tl.minimum(r_lo, r_hi)
        if SEL > 0:
            # Tokens before ((s0 + BN - 1) // l' + 2) l' hold some of the block's keys among their
            # local ones: those tiles come first, masked, with the selected term; the rest as below.
            r_loc = r_first + tl.cdiv(tl.maximum(((s0 + BN - 1) // SEL + 2) * SEL * G - r_first, 0), BM) * BM
            r_loc = tl.minimum(r_loc, r_stop)
            for r0 in range(r_first, r_loc, BM):
                dk, dv = _dkdv_step(k, v, dk, dv, b, h, r0, keys, Q, DO, LSE, DELTA, GW, LSES, DELTAS, GS, bh, R, W,
                                    sc2, s_qb, s_qh, s_qt, s_qg, s_db, s_dh, s_dt, s_dg, s_lb, s_lh,
                                    s_lt, True, G, BM, DK, DV, F32_DOT, GATED, SEL)
            r_lo = tl.maximum(r_lo, r_loc)
            r_hi = tl.maximum(r_hi, r_loc)
            r_first = r_loc
        for r0 in range(r_first, r_lo, BM):
            dk, dv = _dkdv_step(k, v, dk, dv, b, h, r0, keys, Q, DO, LSE, DELTA, GW, LSES, DELTAS, GS, bh, R, W, sc2,
                                s_qb, s_qh, s_qt, s_qg, s_db, s_dh, s_dt, s_dg, s_lb, s_lh, s_lt,
                                True, G, BM, DK, DV, F32_DOT, GATED, 0)
        for r0 in range(r_lo, r_hi, BM):
            dk, dv = _dkdv_step(k, v, dk, dv, b, h, r0, keys, Q, DO, LSE, DELTA, GW, LSES, DELTAS, GS, bh, R, W, sc2,
                                s_qb, s_qh, s_qt, s_qg, s_db, s_dh, s_dt, s_dg, s_lb, s_lh, s_lt,
                                False, G, BM, DK, DV, F32_DOT, GATED, 0)
        for r0 in range(r_hi, r_end, BM):
            dk, dv = _dkdv_step(k, v, dk, dv, b, h, r0, keys, Q, DO, LSE, DELTA, GW, LSES, DELTAS, GS, bh, R, W, sc2,
                                s_qb, s_qh, s_qt, s_qg, s_db, s_dh, s_dt, s_dg, s_lb, s_lh, s_lt,
                                True, G, BM, DK, DV, F32_DOT, GATED, 0)
        tl.store(DK_ + b * s_kb + keys.to(tl.int64)[:, None] * s_kt + h * s_kh + dk_[None, :],
                 (dk * sc).to(DK_.dtype.element_ty), mask=keys_ok[:, None])
        tl.store(DV_ + b * s_vb + keys.to(tl.int64)[:, None] * s_vt + h * s_vh + dv_[None, :],
                 dv.to(DV_.dtype.element_ty), mask=keys_ok[:, None])
