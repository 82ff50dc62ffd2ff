"""The streaming Triton kernel behind nsa_flex::select_blocks (CUDA only).

One program per (batch, kv head, BT query tokens) walks the document's compression blocks in
tiles of BS selection blocks (BS * R' compression blocks, R = l' / d per selection block, R'
rounded up to a power of two): s = scale * q . k_cmp, p = exp(s - lse) on visible blocks,
summed over the group's heads, folded onto selection blocks, and merged into a running top-n
per token. Nothing of size [T, Tc] or [T, Ns] is ever written to memory.

The score tile is transposed, s^T = k_cmp tile . q^T: rows are compression blocks, columns the
(token, head) pairs, ordered so that a token's heads sit in one thread's registers (the group
sum is register adds). Tiles that every token sees whole skip the causal mask. The top-n either
queues candidates per (token, tile column) and merges rarely, or (LISTS, long sequences) keeps
sorted lists per (token, tile column) with no merge during the walk; a program whose lists lost
a block walks again with the queues (see the kernel's docstring). Forced blocks score +inf,
blocks after the query's own -inf. The lists hold 32-bit keys: a score's bits with the low
`list_tile_bits` cleared, its tile in them. So a launch with lists ranks importance rounded
toward zero to 23 - list_tile_bits mantissa bits (17 at T = 64k with the paper's geometry, a
relative step of 2^-17, finer than the fp32 scores' own error); ties go to the lower block id.

The fold. Compression block i covers stride units [i, i + m), m = l / d; selection block j
covers units [j R, j R + R). For i = j R + a the overlap with block j is min(a + m, R) - a
(weights w0) and with block j + 1 it is clamp(a + m - R, 0, R) (weights w1). So
importance_j = C0_j + C1_{j-1} with C_g = sum_a w_g(a) P_{jR+a}: one shift by one selection
block, carried across tiles. This needs m <= R + 1 (l <= l' + d); the paper's l=32, d=16,
l'=64 gives w0 = 2, 2, 2, 1 and w1 = 0, 0, 0, 1, i.e. the weights 1, 2, 2, 2, 1.

Why this layout and these tiles: on the H200 (Triton 3.6, torch 2.11, bf16, Dk=128, paper
geometry; docs/records/select_kernel_variants_h200.json) it beat the first kernel (score
rows = (token, head) pairs, the group sum across threads) at every shape, 3.1x to 4.0x with
launch_config's tiles, with selections equal to the torch twin's up to near-ties. See
launch_config for the times.
"""

from __future__ import annotations

import torch

from nsa_flex.config import NSAConfig
from nsa_flex.ops.capped_launch import launch as launch_kernel
from nsa_flex.ops.triton_utils import next_pow2

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the CPU wheel of torch ships no Triton: the op runs its torch twin
    HAS_TRITON = False

# The lists' 32-bit keys keep the tile in their low bits: at most this many (4096 tiles, 4M tokens at
# the paper's geometry), so that importance keeps 11 mantissa bits or more. Longer sequences (and
# documents) walk with the exact queues.
MAX_LIST_TILE_BITS = 12


def list_tile_bits(blocks: int, BS: int) -> int:
    """Low bits of a list key that hold its tile: enough for every tile of BS selection blocks of a
    sequence of `blocks` selection blocks, at least 1. Those bits of each score are cleared before
    it is ranked (in both walks of a launch)."""
    tiles = -(-blocks // BS)
    return max(1, (tiles - 1).bit_length())


# The keys of select_blocks_triton's tiles (maxnreg: a cap on registers per thread, 0 for none).
TILE_KEYS = ("BT", "BS", "DEPTH", "LISTS", "ROTATE", "num_warps", "num_stages", "maxnreg")


def launch_config(G: int, Dk: int, n: int, blocks: int = 0) -> dict[str, int]:
    """Tile sizes and launch settings for group size G, head dim Dk, n selected blocks and
    sequences of up to `blocks` selection blocks.

    BT tokens per program give BT * G' score columns (G' = G rounded up to a power of two; q^T
    stays in shared memory): at most 128 columns and at most 16 tokens, so G=16 -> BT=8
    (128 columns), G=8 -> 16 (128), G=4 -> 16 (64), G <= 2 -> 16; 4 warps, 2 stages: the
    fastest settings measured on the H200 (docs/decisions.md, "The selection kernel").

    Fewer registers and less shared memory per program win. Built for sm_90 without a GPU
    (Triton 3.6), G=16 BT=8 with 4 warps takes 168 registers and 66 KB of shared memory with
    2 stages (three programs per SM; 82 KB, two, with 3 stages); BT=16 with 8 warps and 3
    stages about 170 registers and 115 KB (one). Not timed: G = 8 and G <= 2, and Dk != 128
    (Dk=192 pads to 256: twice the shared memory for q^T and each k_cmp tile). When
    overriding num_warps=8: with 64 score rows 8 warps split the columns in two halves, which
    should each hold whole groups (else the group sum crosses warps), e.g. BT >= 16 at G=16.

    BS selection blocks per tile: at least n (the top n live in one tile-wide row per token)
    and at least 16. DEPTH candidates wait per (token, tile column) between merges (DEPTH=8
    merges half as often on random inputs, but was no faster).

    LISTS = 6 sorted keys per (token, column) once a token walks 32 tiles or more (T >= 32k at
    the paper's geometry): on the H200, bf16, Dk=128, 2.64 against 2.93 ms with the queues alone
    at T=64k, G=4, 6.00 against 6.47 at G=16, 0.88 against 0.92 at 32k, G=4; at 16k, G=16 (16
    tiles) the queues alone were faster, 0.57 against 0.63 (docs/records/select_lists_h200.json).
    Random inputs lost a block in 0.3% of the programs (0.02% of the tokens); such a program
    walks again at once with the exact queues (in the same launch: see _select_kernel); 4 keys
    lost in 32% of them (3.42 ms), 8 in none (2.73 ms, more registers).

    The lists' keys are 32-bit (list_tile_bits): one max and one min a key, where 64-bit keys
    took pairs of instructions, and half the registers. Against 64-bit list keys (H100, bf16,
    the same launch otherwise; docs/records/select_list_keys_32bit_h100.json): 1.16-1.18 against
    1.26 ms at T=64k, Hq=12, Hkv=3, Dk=64 (seeds-125m's heads), 0.36-0.37 against 0.39-0.40 at
    32k, 1.96-2.02 against 2.20-2.23 at 64k, G=4, Dk=128, 5.39 against 5.58 at 64k, G=16.

    With them, 3 stages at G' <= 4, Dk <= 64: 1.11 against 1.15 ms at seeds-125m's heads, 64k;
    at G=4, Dk=128 2.09 against 2.00 (H100, docs/records/select_list_keys_32bit_settings_h100.json;
    BT=32 with 8 warps, 5 or 7 keys, DEPTH 2 and a cap of 112 no faster).

    With the lists the kernel holds both walks (the lists', and the queues' of a program that
    walks again). Built for sm_90 without a GPU: 174 registers uncapped at G' = 4, Dk = 128,
    161 at Dk = 64, 226 at G' = 8, 197 at G' = 16 (two programs per SM); capped at 128 (G' <= 4,
    Dk <= 128; 56 / 20 bytes of spills at G' = 4, Dk = 128 / 64) four programs fit, capped at 168
    (G' >= 8, Dk <= 128; 60 / 52 bytes of spills at G' = 8, Dk = 128 / 64, none at 16) three.
    With Dk > 128 shared memory allows two programs per SM at most (three at G' = 1): no cap.
    One slot per queue in the second walk (fewer registers) was slower: a program that walks
    again merges at every tile, and the launch waits for it. Times and records: docs/decisions.md,
    "The selection kernel". Inductor (torch 2.11) drops maxnreg from the kernels it launches, so a
    capped launch runs through nsa_flex::capped_launch, opaque to it.
    """
    GP = next_pow2(G)
    BT = max(1, min(16, 128 // GP))
    BS = max(16, next_pow2(n))
    fits = list_tile_bits(blocks, BS) <= MAX_LIST_TILE_BITS
    lists = 6 if blocks >= 32 * BS and fits else 0
    return {"BT": BT, "BS": BS, "DEPTH": 4, "LISTS": lists, "ROTATE": 1, "num_warps": 4,
            "num_stages": 3 if lists and GP <= 4 and Dk <= 64 else 2,
            "maxnreg": (128 if GP <= 4 else 168) if lists and Dk <= 128 else 0}


def select_blocks_triton(q, k_cmp, lse, cu_seqlens, cu_seqlens_cmp, scale: float, config: NSAConfig,
                         tiles: dict[str, int] | None = None) -> torch.Tensor:
    """Launch the kernel; shapes and meaning as nsa_flex.ops.select_blocks.

    tiles overrides launch_config's keys (TILE_KEYS; maxnreg caps the registers per thread).
    """
    tiles = tiles or {}
    unknown = sorted(set(tiles) - set(TILE_KEYS))
    if unknown:
        raise ValueError(f"unknown selection tile keys {unknown}; allowed: {', '.join(TILE_KEYS)}")
    B, T, Hq, Dk = q.shape
    Tc, Hkv = k_cmp.shape[1], k_cmp.shape[2]
    G = Hq // Hkv
    R, m = config.sel_block // config.cmp_stride, config.cmp_block // config.cmp_stride
    if m > R + 1:
        raise ValueError(
            f"the Triton selection kernel needs cmp_block <= sel_block + cmp_stride, got cmp_block="
            f"{config.cmp_block}, sel_block={config.sel_block}, cmp_stride={config.cmp_stride}"
        )
    # Tiles and queues sized by the blocks that exist: an n above Ns only adds unused (-1) slots.
    blocks = triton.cdiv(T, config.sel_block)
    n = min(config.n_selected, max(1, blocks))
    tiles = {**launch_config(G, Dk, n, blocks), **tiles}
    BT, BS = tiles["BT"], tiles["BS"]
    if BS < n:
        raise ValueError(f"tile of {BS} selection blocks cannot hold the top n={n}")
    if tiles["LISTS"] not in range(9):
        raise ValueError(f"LISTS (keys kept per token and tile column) must be 0 (exact queues only) to 8, "
                         f"got {tiles['LISTS']}")
    jt_bits = list_tile_bits(blocks, BS) if tiles["LISTS"] else 0
    if jt_bits > MAX_LIST_TILE_BITS:
        raise ValueError(f"LISTS={tiles['LISTS']} needs at most {2 ** MAX_LIST_TILE_BITS} tiles of {BS} selection "
                         f"blocks, got {T} tokens; use LISTS=0 (the exact queues) at this length")
    out = torch.empty((B, Hkv, T, n), dtype=torch.int32, device=q.device)
    if T == 0:
        return _pad_slots(out, config.n_selected)
    n_blocks = triton.cdiv(T, BT)
    if cu_seqlens is None:
        prog_doc = prog_tok = cu = cu_cmp = None
        n_programs = n_blocks
    else:
        cu, cu_cmp = cu_seqlens.to(torch.int32), cu_seqlens_cmp.to(torch.int32)
        prog_doc, prog_tok = _program_table(cu, BT, n_blocks)
        n_programs = prog_doc.shape[0]
    launch_kernel(
        _select_kernel, (n_programs, B * Hkv),
        q, k_cmp, lse, out, cu, cu_cmp, prog_doc, prog_tok, T, Tc, n_blocks, Hkv, scale,
        *q.stride()[:3], *k_cmp.stride()[:3], *lse.stride(), *out.stride()[:3],
        G=G, GP=next_pow2(G), BT=BT, TL=min(8, BT), DK=Dk, DKP=max(16, next_pow2(Dk)),
        R=R, RP=next_pow2(R), M_CMP=m, CMP_STRIDE=config.cmp_stride, CMP_BLOCK=config.cmp_block,
        SEL_BLOCK=config.sel_block, BS=BS, DEPTH=tiles["DEPTH"], N=n,
        N_INIT=config.n_initial, N_LOCAL=config.n_local,
        VARLEN=cu_seqlens is not None, IEEE=q.dtype == torch.float32,
        LISTS=tiles["LISTS"], ROTATE=bool(tiles["ROTATE"]), JT_BITS=jt_bits, REDO=True,
        num_warps=tiles["num_warps"], num_stages=tiles["num_stages"], writes=(out,),
        maxnreg=tiles["maxnreg"],
    )
    return _pad_slots(out, config.n_selected)


def _pad_slots(idx: torch.Tensor, n: int) -> torch.Tensor:
    """[..., k] -> [..., n] with -1 in the added slots (idx itself when k == n)."""
    return idx if idx.shape[-1] == n else torch.nn.functional.pad(idx, (0, n - idx.shape[-1]), value=-1)


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

    @triton.jit
    def _select_kernel(
        q_ptr, k_ptr, lse_ptr, out_ptr, cu_ptr, cu_cmp_ptr, prog_doc_ptr, prog_tok_ptr,
        T, Tc, n_blocks, Hkv, scale,
        sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sl_b, sl_h, sl_t, so_b, so_h, so_t,
        G: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr, TL: tl.constexpr, DK: tl.constexpr,
        DKP: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, M_CMP: tl.constexpr, CMP_STRIDE: tl.constexpr,
        CMP_BLOCK: tl.constexpr, SEL_BLOCK: tl.constexpr, BS: tl.constexpr, DEPTH: tl.constexpr,
        N: tl.constexpr, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr,
        VARLEN: tl.constexpr, IEEE: tl.constexpr, LISTS: tl.constexpr, ROTATE: tl.constexpr,
        JT_BITS: tl.constexpr, REDO: tl.constexpr,
    ):
        """Scores transposed, s^T = k_cmp tile . q^T: [BS*R' compression blocks, BT*G' columns].

        Columns are ordered (token // TL, head, token % TL): in the MMA accumulator a thread
        holds columns 8 apart, so with TL = 8 the group sum over the G' heads of a token adds
        registers of one thread (no shuffles). Rows are compression blocks in order; the fold
        onto selection blocks then reduces the (G times smaller) group sums. Tiles that every
        token sees whole skip the causal mask.

        The walk over the tiles and its top-n are `_walk`'s. With LISTS > 0 a program whose
        lists lost a block walks again at once with the exact queues (REDO; only measurements
        of how often the lists lose a block turn it off): in the same launch, so the few programs
        that do so overlap the others' work instead of running alone in a launch of their own.
        """
        BIG: tl.constexpr = 2147483647
        LOG2E: tl.constexpr = 1.4426950408889634
        b, h, tok0, bos, eos, cbos, clen = _program_range(
            cu_ptr, cu_cmp_ptr, prog_doc_ptr, prog_tok_ptr, T, Tc, n_blocks, Hkv, BT, VARLEN)
        # Inductor may hand a float scalar in as fp64; keep the loop-carried tiles fp32.
        scale2 = tl.cast(scale * LOG2E, tl.float32)

        # Score columns: (token // TL, head, token % TL).
        NC: tl.constexpr = BT * GP
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

        k_base = k_ptr + b * sk_b + h * sk_h
        top, lost = _walk(k_base, sk_t, cbos, clen, q_dn, lse2_n, col_last, scale2, tok_ok, own, n_tiles, n_whole,
                          GP, BT, TL, DK, DKP, R, RP, M_CMP, BS, DEPTH, N, N_INIT, N_LOCAL, IEEE, LISTS, ROTATE,
                          JT_BITS)
        if LISTS and REDO:
            if lost != 0:
                # The lists lost a block: the same walk with the exact queues (LISTS = 0).
                exact, unused = _walk(k_base, sk_t, cbos, clen, q_dn, lse2_n, col_last, scale2, tok_ok, own, n_tiles,
                                      n_whole, GP, BT, TL, DK, DKP, R, RP, M_CMP, BS, DEPTH, N, N_INIT, N_LOCAL, IEEE,
                                      0, ROTATE, JT_BITS)
                top = exact

        # Ascending ids, unused (-1: a -inf score) last.
        jb = tl.arange(0, BS)[None, :]
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

    @triton.jit
    def _list_key64(key, jb, BS: tl.constexpr, ROTATE: tl.constexpr, JT_BITS: tl.constexpr):
        """A 32-bit list key of column jb -> the 64-bit key (score bits << 32 | BIG - block id)."""
        BIG: tl.constexpr = 2147483647
        EMPTY: tl.constexpr = -36028797018963968
        jt = (1 << JT_BITS) - 1 - (key & ((1 << JT_BITS) - 1))
        if ROTATE:
            j = jt * BS + (jb + (BS - jt % BS)) % BS
        else:
            j = jt * BS + jb
        k = ((key & -(1 << JT_BITS)).to(tl.int64) << 32) | (BIG - j).to(tl.int64)
        return tl.where(key == -2147483648, EMPTY, k)

    @triton.jit
    def _walk(k_base, sk_t, cbos, clen, q_dn, lse2_n, col_last, scale2, tok_ok, own, n_tiles, n_whole,
              GP: tl.constexpr, BT: tl.constexpr, TL: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr,
              R: tl.constexpr, RP: tl.constexpr, M_CMP: tl.constexpr, BS: tl.constexpr, DEPTH: tl.constexpr,
              N: tl.constexpr, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr, IEEE: tl.constexpr,
              LISTS: tl.constexpr, ROTATE: tl.constexpr, JT_BITS: tl.constexpr):
        """The program's walk over its tiles: (top, lost). top [BT, BS] int64 keys holds each
        token's n best in its first N columns; lost (LISTS > 0) is nonzero when some list pushed
        out a block that beats a token's n-th best kept.

        The top-n works on int64 keys (score bits << 32 | BIG - block id): scores (importance
        times 2^32, see _select_kernel) are >= 0 or +-inf, so the larger key is the larger score,
        and of equal scores the lower id (the documented tie-break). LISTS = 0: the best n keys of
        each token sit in the n first columns of `top`, the n-th best score in `nth`. A score
        joins a queue of DEPTH slots per (token, tile column) only if it beats the token's n-th
        best (an equal score never does: the earlier, lower id wins); when some queue is full,
        and at the end, n passes of max over `top` and the queues rebuild `top`. Exact.

        LISTS > 0 instead keeps the LISTS largest keys of each (token, column) in LISTS sorted
        [BT, BS] tensors (a new key passes down them with a max and a min each; thread-local)
        and the largest block key a list pushed out; at the end n passes over the first list
        pick the n best. That is exact unless some column held more than LISTS of a token's n
        best, which `lost` tells.
        """
        BC: tl.constexpr = BS * RP
        NC: tl.constexpr = BT * GP
        TH: tl.constexpr = BT // TL
        BIG: tl.constexpr = 2147483647
        d = tl.arange(0, DKP)
        # Score rows: compression block j R + a of the tile's selection block j (a < R' padded).
        rr = tl.arange(0, BC)
        row_sel = rr // RP
        row_a = rr % RP
        a = tl.arange(0, RP)
        # Weights of compression block j R + a onto selection block j (w0) and j + 1 (w1).
        w0 = tl.where(a < R, tl.minimum(a + M_CMP, R) - a, 0).to(tl.float32)
        w1 = tl.where(a < R, tl.minimum(tl.maximum(a + M_CMP - R, 0), R), 0).to(tl.float32)
        jb = tl.arange(0, BS)[None, :]
        roll = (jb + (BS - 1)) % BS + tl.zeros([BT, BS], tl.int32)
        slot = tl.arange(0, DEPTH)[:, None, None]
        # The key of a -inf score with id BIG: below every key that holds a block.
        EMPTY: tl.constexpr = -36028797018963968
        EMPTY32: tl.constexpr = -2147483648
        top = tl.full([BT, BS], EMPTY, tl.int64)
        nth = tl.full([BT], float("-inf"), tl.float32)
        que = tl.full([DEPTH, BT, BS], EMPTY, tl.int64)
        fill = tl.zeros([BT, BS], tl.int32)
        carry = tl.zeros([BT, BS], tl.float32)
        # LISTS > 0: the LISTS largest keys of each (token, column), sorted, L0 the largest;
        # drop: the largest key of a block pushed out of a list.
        L0 = tl.full([BT, BS], EMPTY32, tl.int32)
        L1 = L0
        L2 = L0
        L3 = L0
        L4 = L0
        L5 = L0
        L6 = L0
        L7 = L0
        drop = L0
        for jt in range(0, n_tiles):
            c = (jt * BS + row_sel) * R + row_a
            c_ok = (row_a < R) & (c < clen)
            k_cd = tl.load(k_base + (cbos + c).to(tl.int64)[:, None] * sk_t + d[None, :],
                           mask=c_ok[:, None] & (d[None, :] < DK), other=0.0)
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
            if JT_BITS:
                # Launches with lists rank scores with their low JT_BITS bits cleared, in both walks:
                # one order, so a program that walks again selects as the lists would have.
                score = (score.to(tl.int32, bitcast=True) & -(1 << JT_BITS)).to(tl.float32, bitcast=True)
            if LISTS:
                if ROTATE:
                    # Column c takes the tile's block (c - jt) mod BS: blocks BS apart (a
                    # pattern every BS * l' tokens) spread over the columns' lists.
                    src = (jb + (BS - jt % BS)) % BS + tl.zeros([BT, BS], tl.int32)
                    score = tl.gather(score, src, axis=1)
                    j = jt * BS + src
                # One pass of insertion: each list keeps the larger, passes the smaller on.
                # 32-bit keys: the score's bits (low JT_BITS cleared above) and, in those bits, the
                # tile counted down: within a column a later tile holds a later block, so of equal
                # scores the earlier block wins, as with the 64-bit keys.
                x = score.to(tl.int32, bitcast=True) | ((1 << JT_BITS) - 1 - jt)
                L0, x = tl.maximum(L0, x), tl.minimum(L0, x)
                if LISTS > 1:
                    L1, x = tl.maximum(L1, x), tl.minimum(L1, x)
                if LISTS > 2:
                    L2, x = tl.maximum(L2, x), tl.minimum(L2, x)
                if LISTS > 3:
                    L3, x = tl.maximum(L3, x), tl.minimum(L3, x)
                if LISTS > 4:
                    L4, x = tl.maximum(L4, x), tl.minimum(L4, x)
                if LISTS > 5:
                    L5, x = tl.maximum(L5, x), tl.minimum(L5, x)
                if LISTS > 6:
                    L6, x = tl.maximum(L6, x), tl.minimum(L6, x)
                if LISTS > 7:
                    L7, x = tl.maximum(L7, x), tl.minimum(L7, x)
                # Keys >= 0 hold a score >= 0 (a block); -inf scores (no block) may go.
                drop = tl.maximum(drop, tl.where(x >= 0, x, EMPTY32))
            else:
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

        lost = 0
        if LISTS:
            # The n best of the lists: each column's best is its L0; taking it moves the column up.
            # 64-bit keys first: across columns the block id, not the tile, breaks a tie.
            L0 = _list_key64(L0, jb, BS, ROTATE, JT_BITS)
            L1 = _list_key64(L1, jb, BS, ROTATE, JT_BITS)
            L2 = _list_key64(L2, jb, BS, ROTATE, JT_BITS)
            L3 = _list_key64(L3, jb, BS, ROTATE, JT_BITS)
            L4 = _list_key64(L4, jb, BS, ROTATE, JT_BITS)
            L5 = _list_key64(L5, jb, BS, ROTATE, JT_BITS)
            L6 = _list_key64(L6, jb, BS, ROTATE, JT_BITS)
            L7 = _list_key64(L7, jb, BS, ROTATE, JT_BITS)
            drop = _list_key64(drop, jb, BS, ROTATE, JT_BITS)
            for k in tl.static_range(N):
                best = tl.max(L0, axis=1)[:, None]
                top = tl.where(jb == k, best, top)
                hit = L0 == best
                # Unused lists stay EMPTY, so shifting all eight is exact at any LISTS.
                L0 = tl.where(hit, L1, L0)
                L1 = tl.where(hit, L2, L1)
                L2 = tl.where(hit, L3, L2)
                L3 = tl.where(hit, L4, L3)
                L4 = tl.where(hit, L5, L4)
                L5 = tl.where(hit, L6, L5)
                L6 = tl.where(hit, L7, L6)
                L7 = tl.where(hit, EMPTY, L7)
            # Exact unless a list pushed out a block that beats the n-th kept (keys are unique).
            nth_key = tl.min(tl.where(jb < N, top, 9223372036854775807), axis=1)
            lost = tl.max(((tl.max(drop, axis=1) > nth_key) & tok_ok).to(tl.int32), axis=0)
        return top, lost
