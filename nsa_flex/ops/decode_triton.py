"""The Triton kernels behind nsa_flex::decode_attend: one query token per sequence, four launches.

The G query heads of a kv head share its keys and its selection, so every program takes them
as the rows of one tile ([G', D], G' = G rounded up to a power of two, at least 16 for tl.dot).

A  split-K over the compressed cache, grid (B*Hkv, SPLITS): the entries visible at pos (entry
   i iff i*d + l - 1 <= pos) are cut into SPLITS ranges of whole tiles; each program writes
   the raw scaled scores s [B*Hkv, G, Tc] (fp32) and its flash partial (m, l, acc).
B  importance, grid (B*Hkv, selection-block tiles): lse of each row from A's (m, l); then
   p = exp(s - lse) summed over the G rows and folded onto selection blocks: selection block j
   collects compression block i = (j - k) R + a (R = l'/d, a < R) with weight w_k(a), the
   number of d-token chunks block i shares with block j. Tiles after the query's own block
   do nothing.
C  selected + window attention, grid (B*Hkv, n + window chunks). A selection program first
   takes the top n of the importance (n passes of max over int64 keys: score bits above the
   reversed block id, the key of select_blocks_one, so ties go to the lower id; forced blocks
   score +inf, blocks after the query's own are out) and keeps the pick of its slot; then it
   attends over that block's tokens <= pos. A window program attends over one chunk of the
   last w tokens. Each writes a flash partial.
D  combine, grid (B*Hkv, G): merges A's partials (cmp branch), C's selection and window
   partials (a softmax each), applies the gates in fp32 and writes o in q's dtype.

Scores and softmax in fp32; probabilities are rounded to the cache dtype before the PV dot,
as flash does. Scratch (scores, partials, importance) is allocated per call, so under
torch.compile it lives in the CUDA graph's pool. Work depends on pos (a tensor), never the
grid: one graph serves every position.

Limits: a selection program holds the whole importance row of its sequence, next_pow2(T / l')
int64 keys (4096 at 128k tokens: 32 per thread); far longer caches want a tiled top-n. Slot k
runs k + 1 passes, so the last slot sets the kernel's latency.
"""

from __future__ import annotations

import torch

from nsa_flex.blocks import num_sel_blocks
from nsa_flex.config import NSAConfig

try:
    import triton
    import triton.language as tl
    from torch.library import wrap_triton

    HAS_TRITON = True
except ImportError:  # the CPU wheel of torch ships no Triton: the op runs its torch twin
    HAS_TRITON = False

_TARGET_PROGRAMS = 1024
"""Kernel A programs to aim for (about eight per SM on an H100/H200): sets the split count. At
B=8, 64k, four times the splits of 256 took the op from 82 to 78 us; at B=1 the split count is
capped by the tiles anyway (bench/results/2026-11-22_h200_decode_tiles.json)."""


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def launch_config(B: int, Hkv: int, Tc: int, config: NSAConfig) -> dict[str, int]:
    """Tile sizes: BC compressed entries per tile of A, SPLITS of A, BS selection blocks per
    program of B (16 at l'/d = 4: 17 against 22 us at B=8, 64k), BN tokens per tile of C and WCH window tokens per program of C (one
    selection block's worth, so selection and window programs do equal work)."""
    BC = 64
    RP = _next_pow2(config.sel_block // config.cmp_stride)
    BN = max(16, min(64, _next_pow2(config.sel_block)))
    return {"BC": BC, "SPLITS": max(1, min(_cdiv(Tc, BC), _cdiv(_TARGET_PROGRAMS, B * Hkv))),
            "BS": max(1, 64 // RP), "BN": BN, "WCH": BN * _cdiv(config.sel_block, BN),
            "num_warps": 4, "num_stages": 2}


def decode_attend_triton(q, k, v, k_win, v_win, k_cmp, v_cmp, pos, gates, scale: float, config: NSAConfig,
                         tiles: dict[str, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches A-D; arguments and result as nsa_flex.ops.decode_attend (q [B,Hkv,G,Dk]).

    CUDA tensors, or CPU tensors under the Triton interpreter (tests): there tl.dot runs in
    fp32, since the interpreter's dot misreads bf16 (its raw 16-bit patterns).
    """
    B, Hkv, G, Dk = q.shape
    T, Tc, Dv = k.shape[2], k_cmp.shape[2], v.shape[-1]
    for name, x in (("k", k), ("v", v), ("k_win", k_win), ("v_win", v_win), ("k_cmp", k_cmp), ("v_cmp", v_cmp)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (stride {x.stride(-1)})")
    cfg = {**launch_config(B, Hkv, Tc, config), **(tiles or {})}
    BC, SPLITS, BS, BN, WCH = (cfg[name] for name in ("BC", "SPLITS", "BS", "BN", "WCH"))
    NS, N, R = num_sel_blocks(T, config), config.n_selected, config.sel_block // config.cmp_stride
    m_cmp = config.cmp_block // config.cmp_stride
    w = min(config.window, T)
    NW = _cdiv(w, WCH)
    dev, f32 = q.device, torch.float32
    ROWS, DKP, DVP = max(16, _next_pow2(G)), max(16, _next_pow2(Dk)), max(16, _next_pow2(Dv))
    out_dtype, q = q.dtype, q.to(k.dtype).contiguous()
    gates, pos = gates.to(f32).contiguous(), pos.contiguous()
    BH = B * Hkv
    s = torch.empty((BH, G, Tc), dtype=f32, device=dev)
    m_a, l_a = (torch.empty((BH, SPLITS, ROWS), dtype=f32, device=dev) for _ in range(2))
    acc_a = torch.empty((BH, SPLITS, ROWS, DVP), dtype=f32, device=dev)
    imp = torch.empty((BH, NS), dtype=f32, device=dev)
    m_c, l_c = (torch.empty((BH, N + NW, ROWS), dtype=f32, device=dev) for _ in range(2))
    acc_c = torch.empty((BH, N + NW, ROWS, DVP), dtype=f32, device=dev)
    blocks = torch.empty((B, Hkv, N), dtype=torch.int64, device=dev)
    o = torch.empty((B, Hkv, G, Dv), dtype=out_dtype, device=dev)
    dims = dict(G=G, ROWS=ROWS, DK=Dk, DKP=DKP, DV=Dv, DVP=DVP)
    dots = dict(F32_DOT=dev.type == "cpu", IEEE=k.dtype == torch.float32)
    launch = dict(num_warps=cfg["num_warps"])
    wrap_triton(_cmp_split_kernel)[(BH, SPLITS)](
        q, k_cmp, v_cmp, pos, s, m_a, l_a, acc_a, Hkv, Tc, scale,
        *q.stride()[:3], *k_cmp.stride()[:3], *v_cmp.stride()[:3],
        **dims, **dots, BC=BC, SPLITS=SPLITS, CMP_BLOCK=config.cmp_block, CMP_STRIDE=config.cmp_stride,
        num_stages=cfg["num_stages"], **launch,
    )
    wrap_triton(_importance_kernel)[(BH, _cdiv(NS, BS))](
        s, m_a, l_a, pos, imp, Hkv, T, Tc, NS,
        G=G, GP=_next_pow2(G), ROWS=ROWS, SPLITS=SPLITS, SPP=_next_pow2(SPLITS), BS=BS, R=R, RP=_next_pow2(R),
        M_CMP=m_cmp, KMAX=(R + m_cmp - 2) // R, CMP_BLOCK=config.cmp_block, CMP_STRIDE=config.cmp_stride,
        SEL_BLOCK=config.sel_block, **launch,
    )
    wrap_triton(_sel_win_kernel)[(BH, N + NW)](
        q, k, v, k_win, v_win, pos, imp, blocks, m_c, l_c, acc_c, Hkv, T, NS, w, scale,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *k_win.stride()[:3], *v_win.stride()[:3],
        **dims, **dots, N=N, NSP=_next_pow2(NS), N_INIT=config.n_initial, N_LOCAL=config.n_local,
        SEL_BLOCK=config.sel_block, WCH=WCH, BN=BN, num_stages=cfg["num_stages"], **launch,
    )
    wrap_triton(_combine_kernel)[(BH, G)](
        m_a, l_a, acc_a, m_c, l_c, acc_c, gates, o,
        G=G, ROWS=ROWS, DV=Dv, DVP=DVP, SPLITS=SPLITS, SPP=_next_pow2(SPLITS), N=N, NP=N + NW,
        NPP=_next_pow2(N + NW), num_warps=4,
    )
    return o, blocks


if HAS_TRITON:

    @triton.jit
    def _dot(a, b, F32_DOT: tl.constexpr, IEEE: tl.constexpr):
        if F32_DOT:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        elif IEEE:
            return tl.dot(a, b, input_precision="ieee")
        else:
            return tl.dot(a, b)

    @triton.jit
    def _load_q(q_ptr, b, h, sq_b, sq_h, sq_g, G: tl.constexpr, ROWS: tl.constexpr, DK: tl.constexpr,
                DKP: tl.constexpr):
        g = tl.arange(0, ROWS)
        d = tl.arange(0, DKP)
        ptrs = q_ptr + b * sq_b + h * sq_h + g[:, None] * sq_g + d[None, :]
        return tl.load(ptrs, mask=(g[:, None] < G) & (d[None, :] < DK), other=0.0)

    @triton.jit
    def _load_pos(pos_ptr, b, T):
        # A position past the cache is a caller's bug; clamped, it cannot read out of bounds.
        return tl.minimum(tl.load(pos_ptr + b), T - 1)

    @triton.jit
    def _n_visible(pos, Tc, CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr):
        """Compressed entries visible at pos: i*d + l - 1 <= pos."""
        n = tl.where(pos >= CMP_BLOCK - 1, (pos - (CMP_BLOCK - 1)) // CMP_STRIDE + 1, 0)
        return tl.minimum(n, Tc)

    @triton.jit
    def _flash_init(ROWS: tl.constexpr, DVP: tl.constexpr):
        """An online softmax that has seen no key: (m = -inf, l = 0, acc = 0) per row."""
        return (tl.full([ROWS], float("-inf"), tl.float32), tl.zeros([ROWS], tl.float32),
                tl.zeros([ROWS, DVP], tl.float32))

    @triton.jit
    def _flash_step(q_rd, k_ptrs, v_ptrs, ok, m, l, acc, scale, k_mask, v_mask,
                    F32_DOT: tl.constexpr, IEEE: tl.constexpr):
        """One key tile of an online softmax: keys where ok ([BN] columns), returns (m, l, acc, s)."""
        k_dn = tl.load(k_ptrs, mask=k_mask, other=0.0)
        s = (_dot(q_rd, k_dn, F32_DOT, IEEE) * scale).to(tl.float32)
        s = tl.where(ok[None, :], s, float("-inf"))
        # Every tile holds a visible key, so m_new is finite and no row turns NaN.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        v_nd = tl.load(v_ptrs, mask=v_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v_nd.dtype), v_nd, F32_DOT, IEEE)
        return m_new, l * alpha + tl.sum(p, axis=1), acc, s

    @triton.jit
    def _store_partial(m_ptr, l_ptr, acc_ptr, idx, m, l, acc, ROWS: tl.constexpr, DVP: tl.constexpr):
        g = tl.arange(0, ROWS)
        tl.store(m_ptr + idx * ROWS + g, m)
        tl.store(l_ptr + idx * ROWS + g, l)
        tl.store(acc_ptr + (idx * ROWS + g)[:, None] * DVP + tl.arange(0, DVP)[None, :], acc)

    @triton.jit
    def _cmp_split_kernel(
        q_ptr, kc_ptr, vc_ptr, pos_ptr, s_ptr, m_ptr, l_ptr, acc_ptr, Hkv, Tc, scale,
        sq_b, sq_h, sq_g, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
        G: tl.constexpr, ROWS: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr, DV: tl.constexpr,
        DVP: tl.constexpr, F32_DOT: tl.constexpr, IEEE: tl.constexpr, BC: tl.constexpr, SPLITS: tl.constexpr,
        CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr,
    ):
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = (bh // Hkv).to(tl.int64)
        h = bh % Hkv
        n_vis = _n_visible(tl.load(pos_ptr + b), Tc, CMP_BLOCK, CMP_STRIDE)
        n_tiles = tl.cdiv(n_vis, BC)
        per = tl.cdiv(n_tiles, SPLITS)
        q_rd = _load_q(q_ptr, b, h, sq_b, sq_h, sq_g, G, ROWS, DK, DKP)
        g = tl.arange(0, ROWS)
        dk = tl.arange(0, DKP)
        dv = tl.arange(0, DVP)
        m, l, acc = _flash_init(ROWS, DVP)
        cc = tl.arange(0, BC)
        # 64-bit scalar bases, 32-bit tile offsets: [D, BC] tensors of 64-bit offsets cost registers.
        k_base = kc_ptr + b * sk_b + h * sk_h
        v_base = vc_ptr + b * sv_b + h * sv_h
        s_base = s_ptr + bh.to(tl.int64) * G * Tc
        for t in range(split * per, tl.minimum(split * per + per, n_tiles)):
            c0 = t * BC
            ok = c0 + cc < n_vis
            k_ptrs = k_base + c0.to(tl.int64) * sk_t + cc[None, :] * sk_t + dk[:, None]
            v_ptrs = v_base + c0.to(tl.int64) * sv_t + cc[:, None] * sv_t + dv[None, :]
            m, l, acc, s = _flash_step(q_rd, k_ptrs, v_ptrs, ok, m, l, acc, scale,
                                       ok[None, :] & (dk[:, None] < DK), ok[:, None] & (dv[None, :] < DV),
                                       F32_DOT, IEEE)
            tl.store(s_base + c0 + g[:, None] * Tc + cc[None, :], s, mask=(g[:, None] < G) & ok[None, :])
        _store_partial(m_ptr, l_ptr, acc_ptr, bh * SPLITS + split, m, l, acc, ROWS, DVP)

    @triton.jit
    def _importance_kernel(
        s_ptr, m_ptr, l_ptr, pos_ptr, imp_ptr, Hkv, T, Tc, NS,
        G: tl.constexpr, GP: tl.constexpr, ROWS: tl.constexpr, SPLITS: tl.constexpr, SPP: tl.constexpr,
        BS: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, M_CMP: tl.constexpr, KMAX: tl.constexpr,
        CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, SEL_BLOCK: tl.constexpr,
    ):
        bh = tl.program_id(0)
        j0 = tl.program_id(1) * BS
        pos = _load_pos(pos_ptr, bh // Hkv, T)
        own = pos // SEL_BLOCK
        if j0 <= own:
            n_vis = _n_visible(pos, Tc, CMP_BLOCK, CMP_STRIDE)
            # lse of each row from A's partials (unused where nothing is visible: then no s is read).
            g = tl.arange(0, GP)
            sp = tl.arange(0, SPP)
            part = bh * SPLITS * ROWS + sp[:, None] * ROWS + g[None, :]
            m_sg = tl.load(m_ptr + part, mask=sp[:, None] < SPLITS, other=float("-inf"))
            l_sg = tl.load(l_ptr + part, mask=sp[:, None] < SPLITS, other=0.0)
            m_g = tl.max(m_sg, axis=0)
            m_g = tl.where(m_g == float("-inf"), 0.0, m_g)
            den = tl.sum(l_sg * tl.exp(m_sg - m_g[None, :]), axis=0)
            lse = m_g + tl.log(tl.where(den > 0, den, 1.0))
            j = j0 + tl.arange(0, BS)
            a = tl.arange(0, RP)
            s_base = s_ptr + bh.to(tl.int64) * G * Tc
            imp = tl.zeros([BS], tl.float32)
            for kk in tl.static_range(KMAX + 1):
                # Compression block i = (j - kk) R + a shares w(a) chunks with selection block j.
                w = tl.minimum(a - kk * R + M_CMP, R) - tl.maximum(a - kk * R, 0)
                w = tl.where(a < R, tl.maximum(w, 0), 0).to(tl.float32)
                c_sr = (j[:, None] - kk) * R + a[None, :]
                ok_sr = (a[None, :] < R) & (c_sr >= 0) & (c_sr < n_vis) & (j[:, None] <= own)
                c = tl.reshape(c_sr, [BS * RP])
                ok = (g[:, None] < G) & tl.reshape(ok_sr, [BS * RP])[None, :]
                s = tl.load(s_base + g[:, None] * Tc + c[None, :], mask=ok, other=0.0)
                p_c = tl.sum(tl.where(ok, tl.exp(s - lse[:, None]), 0.0), axis=0)
                imp += tl.sum(tl.reshape(p_c, [BS, RP]) * w[None, :], axis=1)
            tl.store(imp_ptr + bh * NS + j, imp, mask=(j <= own) & (j < NS))

    @triton.jit
    def _top_pick(imp_ptr, bh, NS, own, slot, NSP: tl.constexpr, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr):
        """The block in place `slot` of the top n (descending key), -1 if fewer blocks are valid."""
        j = tl.arange(0, NSP)
        valid = j <= own
        imp = tl.load(imp_ptr + bh * NS + j, mask=valid, other=0.0)
        forced = valid & ((j < N_INIT) | (j > own - N_LOCAL))
        score = tl.where(forced, float("inf"), imp)
        # Importance is >= 0, so its int32 bits order like the value; the reversed id below
        # makes keys unique with ties to the lower block id.
        key = score.to(tl.int32, bitcast=True).to(tl.int64) * 4294967296 + (NS - 1 - j)
        key = tl.where(valid, key, -1)
        top = tl.max(key, axis=0)
        for _ in range(0, slot):
            key = tl.where(key == top, -1, key)
            top = tl.max(key, axis=0)
        return tl.where(top >= 0, NS - 1 - (top % 4294967296), -1)

    @triton.jit
    def _sel_win_kernel(
        q_ptr, k_ptr, v_ptr, kw_ptr, vw_ptr, pos_ptr, imp_ptr, blocks_ptr, m_ptr, l_ptr, acc_ptr,
        Hkv, T, NS, w, scale, sq_b, sq_h, sq_g, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
        skw_b, skw_h, skw_t, svw_b, svw_h, svw_t,
        G: tl.constexpr, ROWS: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr, DV: tl.constexpr,
        DVP: tl.constexpr, F32_DOT: tl.constexpr, IEEE: tl.constexpr, N: tl.constexpr, NSP: tl.constexpr,
        N_INIT: tl.constexpr, N_LOCAL: tl.constexpr, SEL_BLOCK: tl.constexpr, WCH: tl.constexpr,
        BN: tl.constexpr,
    ):
        bh = tl.program_id(0)
        part = tl.program_id(1)
        b = (bh // Hkv).to(tl.int64)
        h = bh % Hkv
        pos = _load_pos(pos_ptr, b, T)
        if part < N:
            blk = _top_pick(imp_ptr, bh, NS, pos // SEL_BLOCK, part, NSP, N_INIT, N_LOCAL)
            tl.store(blocks_ptr + bh * N + part, blk)
            lo = tl.maximum(blk, 0) * SEL_BLOCK
            hi = tl.where(blk >= 0, tl.minimum(lo + SEL_BLOCK, pos + 1), lo)
            k_base = k_ptr + b * sk_b + h * sk_h
            v_base = v_ptr + b * sv_b + h * sv_h
            skt = sk_t
            svt = sv_t
        else:
            start = pos - w + 1 + (part - N) * WCH
            lo = tl.maximum(start, 0)
            hi = tl.minimum(start + WCH, pos + 1)
            k_base = kw_ptr + b * skw_b + h * skw_h
            v_base = vw_ptr + b * svw_b + h * svw_h
            skt = skw_t
            svt = svw_t
        q_rd = _load_q(q_ptr, b, h, sq_b, sq_h, sq_g, G, ROWS, DK, DKP)
        dk = tl.arange(0, DKP)
        dv = tl.arange(0, DVP)
        m, l, acc = _flash_init(ROWS, DVP)
        tt = tl.arange(0, BN)
        for t0 in range(lo, hi, BN):
            ok = t0 + tt < hi
            k_ptrs = k_base + t0 * skt + tt[None, :] * skt + dk[:, None]
            v_ptrs = v_base + t0 * svt + tt[:, None] * svt + dv[None, :]
            m, l, acc, _ = _flash_step(q_rd, k_ptrs, v_ptrs, ok, m, l, acc, scale,
                                       ok[None, :] & (dk[:, None] < DK), ok[:, None] & (dv[None, :] < DV),
                                       F32_DOT, IEEE)
        _store_partial(m_ptr, l_ptr, acc_ptr, bh * tl.num_programs(1) + part, m, l, acc, ROWS, DVP)

    @triton.jit
    def _merge(m_ptr, l_ptr, acc_ptr, first, last, PP: tl.constexpr, ROWS: tl.constexpr, DVP: tl.constexpr):
        """Softmax-merges the flash partials first..last-1 of one row (pointers at that row): [DVP]."""
        i = tl.arange(0, PP)
        ok = (i >= first) & (i < last)
        m = tl.load(m_ptr + i * ROWS, mask=ok, other=float("-inf"))
        top = tl.max(m, axis=0)
        wt = tl.where(ok, tl.exp(m - tl.where(top == float("-inf"), 0.0, top)), 0.0)
        den = tl.sum(tl.load(l_ptr + i * ROWS, mask=ok, other=0.0) * wt, axis=0)
        acc = tl.load(acc_ptr + i[:, None] * (ROWS * DVP) + tl.arange(0, DVP)[None, :], mask=ok[:, None], other=0.0)
        # No visible key (the cmp branch before the first block): the branch gives 0.
        return tl.sum(acc * wt[:, None], axis=0) / tl.where(den > 0, den, 1.0)

    @triton.jit
    def _combine_kernel(
        m_a, l_a, acc_a, m_c, l_c, acc_c, gates_ptr, o_ptr,
        G: tl.constexpr, ROWS: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr, SPLITS: tl.constexpr,
        SPP: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, NPP: tl.constexpr,
    ):
        bh = tl.program_id(0)
        g = tl.program_id(1)
        ra = bh * SPLITS * ROWS + g
        o_cmp = _merge(m_a + ra, l_a + ra, acc_a + ra * DVP, 0, SPLITS, SPP, ROWS, DVP)
        rc = bh * NP * ROWS + g
        o_sel = _merge(m_c + rc, l_c + rc, acc_c + rc * DVP, 0, N, NPP, ROWS, DVP)
        o_win = _merge(m_c + rc, l_c + rc, acc_c + rc * DVP, N, NP, NPP, ROWS, DVP)
        gate = gates_ptr + (bh * G + g) * 3
        o = tl.load(gate) * o_cmp + tl.load(gate + 1) * o_sel + tl.load(gate + 2) * o_win
        dv = tl.arange(0, DVP)
        tl.store(o_ptr + (bh * G + g) * DV + dv, o.to(o_ptr.dtype.element_ty), mask=dv < DV)
