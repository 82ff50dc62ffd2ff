"""The streaming Triton kernel behind nsa_flex::select_blocks (CUDA only).

One program per (batch, kv head, BT query tokens). Its score tile holds the G heads of each
of its BT tokens as rows (BT * G' rows, G' = G rounded up to a power of two) and walks the
document's compression blocks in tiles of BS selection blocks (BS * R' columns, R = l' / d
compression blocks per selection block, R' rounded up): s = scale * q . k_cmp,
p = exp(s - lse) on visible blocks, summed over the group's heads, folded onto selection
blocks, and merged into a running top-n per token. Nothing of size [T, Tc] or [T, Ns] is
ever written to memory.

The fold. Compression block i covers stride units [i, i + m), m = l / d; selection block j
covers units [j R, j R + R). For i = j R + a the overlap with block j is min(a + m, R) - a
(weights w0) and with block j + 1 it is clamp(a + m - R, 0, R) (weights w1). So
importance_j = C0_j + C1_{j-1} with C_g = sum_a w_g(a) P_{jR+a}: one shift by one selection
block, carried across tiles. This needs m <= R + 1 (l <= l' + d); the paper's l=32, d=16,
l'=64 gives w0 = 2, 2, 2, 1 and w1 = 0, 0, 0, 1, i.e. the weights 1, 2, 2, 2, 1.

The top-n. Per token the program keeps a working set of NSUB tiles in registers: slot 0
holds the best n (value, id) pairs so far, the other slots tiles waiting. A tile joins only
if one of its scores beats a token's n-th best at the last merge (an equal score never does:
the earlier, lower id wins the tie); when the set is full, and at the end, n passes of
(max, lowest id among the max) merge it back into slot 0. Merging every NSUB - 1 tiles
instead of every tile keeps the n-pass cost off the hot loop. Forced blocks score +inf,
blocks after the query's own -inf.
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


def launch_config(G: int, Dk: int, n: int) -> dict[str, int]:
    """Tile sizes and launch settings for group size G, head dim Dk and n selected blocks.

    BT tokens per program: BT * G' score rows share each k_cmp tile (tl.dot needs >= 16);
    more rows amortise the per-tile work (on the H200 at 64k, G=16: 256 rows 16.1 ms against
    128 rows 23.6 ms with the first kernel revision, bench/results/ops_select_h200.json).
    BS selection blocks per tile (at least n: a tile-sized buffer holds the top n). NSUB
    tiles wait in registers between merges (about 4096 values per program).
    """
    GP = _next_pow2(G)
    rows = 64 if Dk > 128 else 256 if GP >= 8 else 128
    BT = max(1, rows // GP, 16 // GP)
    BS = max(16, _next_pow2(n))
    NSUB = max(2, min(16, 4096 // (BT * BS)))
    return {"BT": BT, "BS": BS, "NSUB": NSUB, "num_warps": 8 if BT * GP >= 128 else 4, "num_stages": 2}


def select_blocks_triton(q, k_cmp, lse, cu_seqlens, cu_seqlens_cmp, scale: float, config: NSAConfig,
                         tiles: dict[str, int] | None = None) -> torch.Tensor:
    """Launch the kernel; shapes and meaning as nsa_flex.ops.select_blocks. tiles overrides launch_config."""
    B, T, Hq, Dk = q.shape
    Tc, Hkv = k_cmp.shape[1], k_cmp.shape[2]
    G = Hq // Hkv
    R, m = config.sel_block // config.cmp_stride, config.cmp_block // config.cmp_stride
    if m > R + 1:
        raise ValueError(
            f"the Triton selection kernel needs cmp_block <= sel_block + cmp_stride, got cmp_block="
            f"{config.cmp_block}, sel_block={config.sel_block}, cmp_stride={config.cmp_stride}"
        )
    tiles = {**launch_config(G, Dk, config.n_selected), **(tiles or {})}
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
    wrap_triton(_select_kernel)[(n_programs, B * Hkv)](
        q, k_cmp, lse, out, cu, cu_cmp, prog_doc, prog_tok,
        T, Tc, n_blocks, Hkv, scale,
        *q.stride()[:3], *k_cmp.stride()[:3], *lse.stride(), *out.stride()[:3],
        G=G, GP=_next_pow2(G), BT=BT, DK=Dk, DKP=max(16, _next_pow2(Dk)),
        R=R, RP=_next_pow2(R), M_CMP=m, CMP_STRIDE=config.cmp_stride, CMP_BLOCK=config.cmp_block,
        SEL_BLOCK=config.sel_block, BS=BS, NSUB=tiles["NSUB"], N=config.n_selected,
        N_INIT=config.n_initial, N_LOCAL=config.n_local,
        VARLEN=cu_seqlens is not None, IEEE=q.dtype == torch.float32,
        num_warps=tiles["num_warps"], num_stages=tiles["num_stages"],
    )
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
