"""The streaming Triton kernels behind nsa_flex::select_blocks (CUDA only).

Two kernels compute the same selection; the variant of launch_config picks one ("rows", what
the op runs, or "cols"). Both run one program per (batch, kv head, BT query tokens) and walk
the document's compression blocks in tiles of BS selection blocks (BS * R' compression
blocks, R = l' / d per selection block, R' rounded up to a power of two): s = scale * q . k_cmp,
p = exp(s - lse) on visible blocks, summed over the group's heads, folded onto selection
blocks, and merged into a running top-n per token. Nothing of size [T, Tc] or [T, Ns] is
ever written to memory.

rows (_select_kernel): the score tile's rows are the G' heads of each of the BT tokens
(BT * G' rows, G' = G rounded up to a power of two), its columns compression blocks. The group
sum adds rows that the MMA layout spreads over threads (shuffles every tile).

cols (_select_kernel_cols): the tile transposed, rows compression blocks and columns the
(token, head) pairs ordered so that a token's heads sit in one thread's registers: the group
sum is register adds. Tiles that every token sees whole skip the causal mask; the top-n
queues candidates per (token, tile column) and merges rarely (see the kernel's docstring).

The fold. Compression block i covers stride units [i, i + m), m = l / d; selection block j
covers units [j R, j R + R). For i = j R + a the overlap with block j is min(a + m, R) - a
(weights w0) and with block j + 1 it is clamp(a + m - R, 0, R) (weights w1). So
importance_j = C0_j + C1_{j-1} with C_g = sum_a w_g(a) P_{jR+a}: one shift by one selection
block, carried across tiles. This needs m <= R + 1 (l <= l' + d); the paper's l=32, d=16,
l'=64 gives w0 = 2, 2, 2, 1 and w1 = 0, 0, 0, 1, i.e. the weights 1, 2, 2, 2, 1.

The top-n of rows. Per token the program keeps a working set of NSUB tiles in registers:
slot 0 holds the best n (value, id) pairs so far, the other slots tiles waiting. A tile joins
only if one of its scores beats a token's n-th best at the last merge (an equal score never
does: the earlier, lower id wins the tie); when the set is full, and at the end, n passes of
(max, lowest id among the max) merge it back into slot 0. Merging every NSUB - 1 tiles
instead of every tile keeps the n-pass cost off the hot loop. In both kernels forced blocks
score +inf, blocks after the query's own -inf.
"""

from __future__ import annotations

import torch

from nsa_flex.config import NSAConfig

try:
    import triton
    import triton.language as tl
    from torch.library import wrap_triton

    HAS_TRITON = True
except ImportError:  # the CPU wheel of torch ships no Triton: the op runs its torch twin
    HAS_TRITON = False


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def launch_config(G: int, Dk: int, n: int, variant: str = "rows") -> dict[str, int | str]:
    """Tile sizes and launch settings for group size G, head dim Dk and n selected blocks.

    variant picks the kernel: "rows" (_select_kernel, the default until "cols" is measured on a
    GPU) or "cols" (_select_kernel_cols). The tiles dict of select_blocks_triton overrides any key.

    rows: BT tokens per program: BT * G' score rows share each k_cmp tile (tl.dot needs >= 16);
    more rows amortise the per-tile work (on the H200 at 64k, G=16: 256 rows 16.1 ms against
    128 rows 23.6 ms with the first kernel revision, bench/results/ops_select_h200.json).
    BS selection blocks per tile (at least n: a tile-sized buffer holds the top n). NSUB
    tiles wait in registers between merges (about 4096 values per program).

    cols: BT tokens per program give BT * G' score columns (q^T stays in shared memory): at
    most 256 for Dk <= 128 (64 KB), 128 above, and BT <= 32 (the top-n state is BT * BS
    entries over the program's threads; BT=64 at G=4 took 255 registers). With 64 score rows
    8 warps split the columns in two halves, which must each hold whole groups (else the group
    sum crosses warps): BT >= 16. DEPTH candidates wait per (token, tile column) between
    merges. num_stages=3: with 2, Triton 3.6 issues the next k_cmp tile's copy at the end of
    an iteration and waits for it at the start of the next (nothing overlaps the load). Built
    for sm_90 without a GPU (Triton 3.6): G=16, Dk=128 takes 171 registers and 115 KB of shared
    memory (one program per SM); BT=8 with 4 warps 168 registers and 82 KB (two per SM, three
    with num_stages=2: 66 KB).
    """
    GP = _next_pow2(G)
    BS = max(16, _next_pow2(n))
    if variant == "cols":
        cols = 128 if Dk > 128 else 256
        BT = max(16 // GP, min(32, cols // GP))
        return {"variant": "cols", "BT": BT, "BS": BS, "DEPTH": 4,
                "num_warps": 8 if BT >= 16 else 4, "num_stages": 3}
    if variant != "rows":
        raise ValueError(f"unknown selection kernel variant {variant!r}; use 'rows' or 'cols'")
    rows = 64 if Dk > 128 else 256 if GP >= 8 else 128
    BT = max(1, rows // GP, 16 // GP)
    NSUB = max(2, min(16, 4096 // (BT * BS)))
    return {"variant": "rows", "BT": BT, "BS": BS, "NSUB": NSUB,
            "num_warps": 8 if BT * GP >= 128 else 4, "num_stages": 2}


def select_blocks_triton(q, k_cmp, lse, cu_seqlens, cu_seqlens_cmp, scale: float, config: NSAConfig,
                         tiles: dict[str, int | str] | None = None) -> torch.Tensor:
    """Launch a kernel; shapes and meaning as nsa_flex.ops.select_blocks.

    tiles overrides launch_config (its "variant" key picks the kernel and the defaults).
    """
    B, T, Hq, Dk = q.shape
    Tc, Hkv = k_cmp.shape[1], k_cmp.shape[2]
    G = Hq // Hkv
    R, m = config.sel_block // config.cmp_stride, config.cmp_block // config.cmp_stride
    if m > R + 1:
        raise ValueError(
            f"the Triton selection kernel needs cmp_block <= sel_block + cmp_stride, got cmp_block="
            f"{config.cmp_block}, sel_block={config.sel_block}, cmp_stride={config.cmp_stride}"
        )
    tiles = tiles or {}
    tiles = {**launch_config(G, Dk, config.n_selected, tiles.get("variant", "rows")), **tiles}
    BT, BS = tiles["BT"], tiles["BS"]
    if BS < config.n_selected:
        raise ValueError(f"tile of {BS} selection blocks cannot hold the top n={config.n_selected}")
    out = torch.empty((B, Hkv, T, config.n_selected), dtype=torch.int32, device=q.device)
    if T == 0:
        return out
    n_blocks = triton.cdiv(T, BT)
    if cu_seqlens is None:
        prog_doc = prog_tok = cu = cu_cmp = None
        n_programs = n_blocks
    else:
        cu, cu_cmp = cu_seqlens.to(torch.int32), cu_seqlens_cmp.to(torch.int32)
        prog_doc, prog_tok = _program_table(cu, BT, n_blocks)
        n_programs = prog_doc.shape[0]
    common = dict(
        G=G, GP=_next_pow2(G), BT=BT, DK=Dk, DKP=max(16, _next_pow2(Dk)),
        R=R, RP=_next_pow2(R), M_CMP=m, CMP_STRIDE=config.cmp_stride, CMP_BLOCK=config.cmp_block,
        SEL_BLOCK=config.sel_block, BS=BS, N=config.n_selected,
        N_INIT=config.n_initial, N_LOCAL=config.n_local,
        VARLEN=cu_seqlens is not None, IEEE=q.dtype == torch.float32,
        num_warps=tiles["num_warps"], num_stages=tiles["num_stages"],
        # Optional register cap (more programs per SM, maybe spills), for tuning sweeps.
        **({"maxnreg": tiles["maxnreg"]} if "maxnreg" in tiles else {}),
    )
    args = (q, k_cmp, lse, out, cu, cu_cmp, prog_doc, prog_tok, T, Tc, n_blocks, Hkv, scale,
            *q.stride()[:3], *k_cmp.stride()[:3], *lse.stride(), *out.stride()[:3])
    if tiles["variant"] == "cols":
        wrap_triton(_select_kernel_cols)[(n_programs, B * Hkv)](
            *args, TL=min(8, BT), DEPTH=tiles["DEPTH"], **common)
    elif tiles["variant"] == "rows":
        wrap_triton(_select_kernel)[(n_programs, B * Hkv)](*args, NSUB=tiles["NSUB"], **common)
    else:
        raise ValueError(f"unknown selection kernel variant {tiles['variant']!r}; use 'rows' or 'cols'")
    return out


def _program_table(cu: torch.Tensor, BT: int, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed documents: (document, first token) of each program, -1 for spare programs.

    Each program's BT tokens lie in one document. There are at most cdiv(T, BT) + N such
    token blocks (a static bound: no host sync); the spare programs exit at once.
    """
    N = cu.shape[0] - 1
    lens = (cu[1:] - cu[:-1]).long()
    blocks = (lens + BT - 1) // BT
    ends = torch.cumsum(blocks, 0)
    p = torch.arange(n_blocks + N, device=cu.device)
    doc = torch.searchsorted(ends, p, right=True)
    used = doc < N
    doc = doc.clamp(max=N - 1)
    tok = cu.long()[doc] + (p - (ends[doc] - blocks[doc])) * BT
    return torch.where(used, doc, -1).to(torch.int32), tok.to(torch.int32)


if HAS_TRITON:

    @triton.jit
    def _program_range(cu_ptr, cu_cmp_ptr, prog_doc_ptr, prog_tok_ptr, T, Tc, n_blocks, Hkv,
                       BT: tl.constexpr, VARLEN: tl.constexpr):
        """(batch, kv head, first token, document token range [bos, eos), its compressed range) of this program."""
        pid_t = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = (pid_bh // Hkv).to(tl.int64)
        h = pid_bh % Hkv
        if VARLEN:
            doc = tl.load(prog_doc_ptr + pid_t)
            tok0 = tl.load(prog_tok_ptr + pid_t)
            # A spare program (doc -1) gets an empty token range and does nothing.
            spare = doc < 0
            doc = tl.maximum(doc, 0)
            bos = tl.load(cu_ptr + doc)
            eos = tl.where(spare, bos, tl.load(cu_ptr + doc + 1))
            cbos = tl.load(cu_cmp_ptr + doc)
            clen = tl.load(cu_cmp_ptr + doc + 1) - cbos
        else:
            # Later tokens do more work: start them first.
            tok0 = (n_blocks - 1 - pid_t) * BT
            bos = 0
            eos = T
            cbos = 0
            clen = Tc
        return b, h, tok0, bos, eos, cbos, clen

if HAS_TRITON:

    @triton.jit
    def _select_kernel(
        q_ptr, k_ptr, lse_ptr, out_ptr, cu_ptr, cu_cmp_ptr, prog_doc_ptr, prog_tok_ptr,
        T, Tc, n_blocks, Hkv, scale,
        sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sl_b, sl_h, sl_t, so_b, so_h, so_t,
        G: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr,
        R: tl.constexpr, RP: tl.constexpr, M_CMP: tl.constexpr, CMP_STRIDE: tl.constexpr,
        CMP_BLOCK: tl.constexpr, SEL_BLOCK: tl.constexpr, BS: tl.constexpr, NSUB: tl.constexpr,
        N: tl.constexpr, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr,
        VARLEN: tl.constexpr, IEEE: tl.constexpr,
    ):
        BC: tl.constexpr = BS * RP
        W: tl.constexpr = NSUB * BS
        BIG: tl.constexpr = 2147483647
        b, h, tok0, bos, eos, cbos, clen = _program_range(
            cu_ptr, cu_cmp_ptr, prog_doc_ptr, prog_tok_ptr, T, Tc, n_blocks, Hkv, BT, VARLEN)

        # Rows of the score tile: token-major, the G' heads of one token adjacent.
        r = tl.arange(0, BT * GP)
        row_t = tok0 + r // GP
        row_g = r % GP
        row_ok = (row_t < eos) & (row_g < G)
        row_tloc = row_t - bos
        head = h * G + row_g
        d = tl.arange(0, DKP)
        q_ptrs = q_ptr + b * sq_b + row_t.to(tl.int64)[:, None] * sq_t + head[:, None] * sq_h + d[None, :]
        q_rd = tl.load(q_ptrs, mask=row_ok[:, None] & (d[None, :] < DK), other=0.0)
        lse_r = tl.load(lse_ptr + b * sl_b + head * sl_h + row_t.to(tl.int64) * sl_t, mask=row_ok, other=0.0)

        tok = tok0 + tl.arange(0, BT)
        tok_ok = tok < eos
        own = (tok - bos) // SEL_BLOCK
        last_own = (tl.minimum(tok0 + BT, eos) - 1 - bos) // SEL_BLOCK
        n_tiles = tl.cdiv(last_own + 1, BS)

        a = tl.arange(0, RP)
        w0 = tl.where(a < R, tl.minimum(a + M_CMP, R) - a, 0).to(tl.float32)
        w1 = tl.where(a < R, tl.minimum(tl.maximum(a + M_CMP - R, 0), R), 0).to(tl.float32)
        jb = tl.arange(0, BS)
        col = tl.arange(0, BS)[None, :]
        sub = tl.arange(0, NSUB)[None, :, None]
        # Working set [BT, NSUB, BS]: sub-slot 0 holds the running top-n (descending), the
        # others tiles waiting to be merged. nth: each token's n-th best at the last merge.
        work_v = tl.full([BT, NSUB, BS], float("-inf"), tl.float32)
        work_i = tl.full([BT, NSUB, BS], -1, tl.int32)
        buf_i = tl.full([BT, BS], -1, tl.int32)
        nth = tl.full([BT], float("-inf"), tl.float32)
        fill = 1
        carry = tl.zeros([BT], tl.float32)
        for jt in range(0, n_tiles):
            j = jt * BS + jb
            c_sr = j[:, None] * R + a[None, :]
            c_ok_sr = (a[None, :] < R) & (c_sr < clen)
            c = tl.reshape(c_sr, [BC])
            c_ok = tl.reshape(c_ok_sr, [BC])
            k_ptrs = k_ptr + b * sk_b + (cbos + c).to(tl.int64)[None, :] * sk_t + h * sk_h + d[:, None]
            k_dc = tl.load(k_ptrs, mask=c_ok[None, :] & (d[:, None] < DK), other=0.0)
            if IEEE:
                s = tl.dot(q_rd, k_dc, input_precision="ieee")
            else:
                s = tl.dot(q_rd, k_dc)
            visible = row_ok[:, None] & c_ok[None, :] & (
                c[None, :] * CMP_STRIDE + CMP_BLOCK - 1 <= row_tloc[:, None]
            )
            # Inductor may hand a float scalar in as fp64; keep the loop-carried tiles fp32.
            s_scaled = (s * scale).to(tl.float32)
            p = tl.where(visible, tl.exp(s_scaled - lse_r[:, None]), 0.0)
            # [BT*GP, BC] -> group sum [BT, BC] -> [BT, BS, RP] -> weighted per selection block
            p_tc = tl.sum(tl.reshape(p, [BT, GP, BC]), axis=1)
            p_tsr = tl.reshape(p_tc, [BT, BS, RP])
            imp = tl.sum(p_tsr * w0[None, None, :], axis=2)
            if M_CMP > 1:
                c1 = tl.sum(p_tsr * w1[None, None, :], axis=2)
                prev = tl.gather(c1, tl.maximum(jb - 1, 0)[None, :] + tl.zeros([BT, BS], tl.int32), axis=1)
                imp += tl.where(jb[None, :] == 0, carry[:, None], prev)
                carry = tl.sum(tl.where(jb[None, :] == BS - 1, c1, 0.0), axis=1)

            valid = tok_ok[:, None] & (j[None, :] <= own[:, None])
            forced = valid & ((j[None, :] < N_INIT) | (j[None, :] > own[:, None] - N_LOCAL))
            score = tl.where(forced, float("inf"), tl.where(valid, imp, float("-inf")))
            # A tile joins the working set only if it beats some token's n-th best (equal
            # scores never do: the earlier, lower id wins the tie).
            if tl.max(tl.where(score > nth[:, None], 1, 0)) > 0:
                work_v = tl.where(sub == fill, score[:, None, :], work_v)
                work_i = tl.where(sub == fill, j[None, None, :], work_i)
                fill += 1
            if (fill == NSUB) | ((jt == n_tiles - 1) & (fill > 1)):
                # Merge: n passes of (max, lowest id among the max) over the working set.
                v2 = tl.reshape(work_v, [BT, W])
                i2 = tl.reshape(work_i, [BT, W])
                new_v = tl.full([BT, BS], float("-inf"), tl.float32)
                new_i = tl.full([BT, BS], -1, tl.int32)
                for k in range(N):
                    m = tl.max(v2, axis=1)
                    pick = tl.min(tl.where(v2 == m[:, None], i2, BIG), axis=1)
                    pick = tl.where(m == float("-inf"), -1, pick)
                    new_v = tl.where(col == k, m[:, None], new_v)
                    new_i = tl.where(col == k, pick[:, None], new_i)
                    v2 = tl.where(i2 == pick[:, None], float("-inf"), v2)
                nth = tl.min(tl.where(col < N, new_v, float("inf")), axis=1)
                buf_i = new_i
                work_v = tl.where(sub == 0, new_v[:, None, :], float("-inf"))
                work_i = tl.where(sub == 0, new_i[:, None, :], -1)
                fill = 1

        # Ascending ids, unused (-1) last.
        key = tl.where((buf_i < 0) | (col >= N), BIG, buf_i)
        res = tl.full([BT, BS], -1, tl.int32)
        for k in range(N):
            low = tl.min(key, axis=1)
            res = tl.where(col == k, low[:, None], res)
            key = tl.where(key == low[:, None], BIG, key)
        res = tl.where(res == BIG, -1, res)
        o_ptrs = out_ptr + b * so_b + h * so_h + tok.to(tl.int64)[:, None] * so_t + col
        tl.store(o_ptrs, res, mask=tok_ok[:, None] & (col < N))

    @triton.jit
    def _select_kernel_cols(
        q_ptr, k_ptr, lse_ptr, out_ptr, cu_ptr, cu_cmp_ptr, prog_doc_ptr, prog_tok_ptr,
        T, Tc, n_blocks, Hkv, scale,
        sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sl_b, sl_h, sl_t, so_b, so_h, so_t,
        G: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr, TL: tl.constexpr, DK: tl.constexpr,
        DKP: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, M_CMP: tl.constexpr, CMP_STRIDE: tl.constexpr,
        CMP_BLOCK: tl.constexpr, SEL_BLOCK: tl.constexpr, BS: tl.constexpr, DEPTH: tl.constexpr,
        N: tl.constexpr, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr,
        VARLEN: tl.constexpr, IEEE: tl.constexpr,
    ):
        """The "cols" variant: scores transposed, s^T = k_cmp tile . q^T, [BS*R' keys, BT*G' columns].

        Columns are ordered (token // TL, head, token % TL): in the MMA accumulator a thread
        holds columns 8 apart, so with TL = 8 the group sum over the G' heads of a token adds
        registers of one thread (no shuffles). Rows are compression blocks in order; the fold
        onto selection blocks then reduces the (G times smaller) group sums. Tiles that every
        token sees whole skip the causal mask.

        The top-n works on int64 keys (score bits << 32 | BIG - block id): scores (importance
        times 2^32, see below) are >= 0 or +-inf, so the larger key is the larger score, and
        of equal scores the lower id (the documented tie-break). The best n keys of each token
        sit in the n first columns of `top`, the n-th best score in `nth`. A score joins a queue
        of DEPTH slots per (token, tile column) only if it beats the token's n-th best (an equal
        score never does: the earlier, lower id wins); when some queue is full, and at the end,
        n passes of max over `top` and the queues rebuild `top`.
        """
        BC: tl.constexpr = BS * RP
        NC: tl.constexpr = BT * GP
        TH: tl.constexpr = BT // TL
        BIG: tl.constexpr = 2147483647
        LOG2E: tl.constexpr = 1.4426950408889634
        b, h, tok0, bos, eos, cbos, clen = _program_range(
            cu_ptr, cu_cmp_ptr, prog_doc_ptr, prog_tok_ptr, T, Tc, n_blocks, Hkv, BT, VARLEN)
        # Inductor may hand a float scalar in as fp64; keep the loop-carried tiles fp32.
        scale2 = tl.cast(scale * LOG2E, tl.float32)

        # Score columns: (token // TL, head, token % TL).
        cn = tl.arange(0, NC)
        col_t = tok0 + (cn // (GP * TL)) * TL + cn % TL
        col_g = (cn // TL) % GP
        col_ok = (col_t < eos) & (col_g < G)
        col_tloc = col_t - bos
        head = h * G + col_g
        d = tl.arange(0, DKP)
        q_ptrs = q_ptr + b * sq_b + col_t.to(tl.int64)[None, :] * sq_t + head[None, :] * sq_h + d[:, None]
        q_dn = tl.load(q_ptrs, mask=col_ok[None, :] & (d[:, None] < DK), other=0.0)
        lse_n = tl.load(lse_ptr + b * sl_b + head * sl_h + col_t.to(tl.int64) * sl_t, mask=col_ok, other=0.0)
        # p' = 2^32 p = exp2(s scale log2(e) - (lse log2(e) - 32)), one FMA and an ex2 an element.
        # The top-n only compares scores, so they stay scaled by 2^32: Triton's f32 exp2
        # (ex2.approx.ftz) flushes results below 2^-126 to zero, and p down to 2^-158 keeps its
        # value (torch.exp's denormals end at 2^-149), where tl.exp's denormal-safe ex2 takes
        # 7 instructions an element, not 3. +inf zeroes the padded columns without a mask.
        lse2_n = tl.where(col_ok, lse_n * LOG2E - 32.0, float("inf"))
        # Last compression block each column sees (i d + l - 1 <= t), -1 for none.
        col_last = tl.where(col_tloc >= CMP_BLOCK - 1, (col_tloc - (CMP_BLOCK - 1)) // CMP_STRIDE, -1)
        col_last = tl.where(col_ok, tl.minimum(col_last, clen - 1), -1)

        # Score rows: compression block j R + a of the tile's selection block j (a < R' padded).
        rr = tl.arange(0, BC)
        row_sel = rr // RP
        row_a = rr % RP

        tok = tok0 + tl.arange(0, BT)
        tok_ok = tok < eos
        own = (tok - bos) // SEL_BLOCK
        last_own = (tl.minimum(tok0 + BT, eos) - 1 - bos) // SEL_BLOCK
        n_tiles = tl.cdiv(last_own + 1, BS)
        # Tiles whose compression blocks the program's first token (hence every token) sees.
        tloc0 = tok0 - bos
        last0 = tl.where(tloc0 >= CMP_BLOCK - 1, (tloc0 - (CMP_BLOCK - 1)) // CMP_STRIDE, -1)
        n_whole = (tl.minimum(last0, clen - 1) + 1) // (BS * R)
        if RP != R:
            n_whole = 0

        a = tl.arange(0, RP)
        # Weights of compression block j R + a onto selection block j (w0) and j + 1 (w1).
        w0 = tl.where(a < R, tl.minimum(a + M_CMP, R) - a, 0).to(tl.float32)
        w1 = tl.where(a < R, tl.minimum(tl.maximum(a + M_CMP - R, 0), R), 0).to(tl.float32)
        jb = tl.arange(0, BS)[None, :]
        roll = (jb + (BS - 1)) % BS + tl.zeros([BT, BS], tl.int32)
        slot = tl.arange(0, DEPTH)[:, None, None]
        # The key of a -inf score with id BIG: below every key that holds a block.
        EMPTY: tl.constexpr = -36028797018963968
        top = tl.full([BT, BS], EMPTY, tl.int64)
        nth = tl.full([BT], float("-inf"), tl.float32)
        que = tl.full([DEPTH, BT, BS], EMPTY, tl.int64)
        fill = tl.zeros([BT, BS], tl.int32)
        carry = tl.zeros([BT, BS], tl.float32)
        for jt in range(0, n_tiles):
            c = (jt * BS + row_sel) * R + row_a
            c_ok = (row_a < R) & (c < clen)
            k_ptrs = k_ptr + b * sk_b + (cbos + c).to(tl.int64)[:, None] * sk_t + h * sk_h + d[None, :]
            k_cd = tl.load(k_ptrs, mask=c_ok[:, None] & (d[None, :] < DK), other=0.0)
            if IEEE:
                s = tl.dot(k_cd, q_dn, input_precision="ieee")
            else:
                s = tl.dot(k_cd, q_dn)
            p = tl.math.exp2(s * scale2 - lse2_n[None, :])
            if jt >= n_whole:
                visible = (c[:, None] <= col_last[None, :]) & (row_a < R)[:, None]
                p = tl.where(visible, p, 0.0)
            # Group sum [BC, NC] -> [BC, BT], then the fold [BS, R', BT] -> [BS, BT].
            p_ct = tl.reshape(tl.sum(tl.reshape(p, [BC, TH, GP, TL]), axis=2), [BC, BT])
            p_sat = tl.reshape(p_ct, [BS, RP, BT])
            c0 = tl.sum(p_sat * w0[None, :, None], axis=1)
            if M_CMP > 1:
                # Block j also gets C1 of block j - 1: a roll by one column, the wrapped column
                # carried to the next tile. C0 and C1 joined: one conversion to the top-n layout.
                c1 = tl.sum(p_sat * w1[None, :, None], axis=1)
                imp, c1 = tl.split(tl.permute(tl.join(c0, c1), [1, 0, 2]))
                rolled = tl.gather(c1, roll, axis=1)
                imp += tl.where(jb == 0, carry, rolled)
                carry = rolled
            else:
                imp = tl.trans(c0)

            j = jt * BS + jb
            valid = tok_ok[:, None] & (j <= own[:, None])
            forced = valid & ((j < N_INIT) | (j > own[:, None] - N_LOCAL))
            score = tl.where(forced, float("inf"), tl.where(valid, imp, float("-inf")))
            key = (score.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BIG - j).to(tl.int64)
            join = score > nth[:, None]
            que = tl.where((slot == fill[None, :, :]) & join[None, :, :], key[None, :, :], que)
            fill += join.to(tl.int32)
            if (tl.max(fill) == DEPTH) | (jt == n_tiles - 1):
                # Merge: n passes of max over top and the queues.
                new = tl.full([BT, BS], EMPTY, tl.int64)
                # Unrolled: a loop nested in the tile loop would keep Triton from pipelining its loads.
                for k in tl.static_range(N):
                    best = tl.max(tl.maximum(top, tl.max(que, axis=0)), axis=1)
                    new = tl.where(jb == k, best[:, None], new)
                    top = tl.where(top == best[:, None], EMPTY, top)
                    que = tl.where(que == best[None, :, None], EMPTY, que)
                top = new
                nth_key = tl.min(tl.where(jb < N, top, 9223372036854775807), axis=1)
                nth = (nth_key >> 32).to(tl.int32).to(tl.float32, bitcast=True)
                que = tl.full([DEPTH, BT, BS], EMPTY, tl.int64)
                fill = tl.zeros([BT, BS], tl.int32)

        # Ascending ids, unused (-1: a -inf score) last.
        top_i = BIG - top.to(tl.int32)
        unused = ((top >> 32).to(tl.int32).to(tl.float32, bitcast=True) == float("-inf")) | (jb >= N)
        key = tl.where(unused, BIG, top_i)
        res = tl.full([BT, BS], -1, tl.int32)
        for k in range(N):
            low = tl.min(key, axis=1)
            res = tl.where(jb == k, low[:, None], res)
            key = tl.where(key == low[:, None], BIG, key)
        res = tl.where(res == BIG, -1, res)
        o_ptrs = out_ptr + b * so_b + h * so_h + tok.to(tl.int64)[:, None] * so_t + jb
        tl.store(o_ptrs, res, mask=tok_ok[:, None] & (jb < N))
