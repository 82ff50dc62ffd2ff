"""BlockMask index tensors, both directions, emitted from block lists: no dense transpose.

FlexAttention's forward walks, for every query tile, a list of kv blocks (kv_num_blocks /
kv_indices, split into "partial" blocks that need mask_mod and "full" blocks that don't).
Its backward walks, for every kv block, a list of query tiles (q_num_blocks / q_indices).
`BlockMask.from_kv_blocks` derives the second from the first through a dense
[Q_blocks, KV_blocks] grid and an argsort (85 ms and ~16 GiB at T=64k with 16-row query
tiles). `transpose_blocks` here does it with one sort of the B*H*Q_blocks*W listed entries
and a scatter: O(T*n) work for the selected branch.

What the Triton kernels need (torch/_inductor/kernel/flex/templates, 2.11-2.13): each list
is read through its tensor's leading strides with the last dim taken as contiguous (so
make_block_mask makes every list contiguous), and only its first `num_blocks` entries are read.
The kv-side lists may be as narrow as the most blocks one query tile visits (n for the
selected branch at one token per tile; measured right on an H200). The q-side lists may not:
cut to a static bound below the number of query tiles, dK/dV came out wrong by 1e3-1e5 on
torch 2.11 (docs/records/flex_narrow_q_lists_h200.txt), so
they stay as wide as the query tiles (1.1 GiB of int32 each at T=64k, G=16, Hkv=4). Only
`BlockMask.to_dense` / `from_kv_blocks` read the width as the number of kv blocks; nsa-flex
calls neither on these masks.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

# "No entry" sentinel above every block and position id, kept clear of the int32 / int64
# extremes (Triton cannot build the negation of int64's minimum as a reduction's start value).
_BIG = 2**30
# Slots the dropped entries of transpose_blocks' scatter are spread over (see there).
_SPARE_SLOTS = 4096


def make_block_mask(seq_lengths, kv, full_kv, q, full_q, block_size, mask_mod) -> BlockMask:
    """The BlockMask constructor with all 11 arguments, in the order both torch 2.11 and 2.13 take.

    kv, full_kv, q, full_q are (num_blocks, indices) pairs; the full ones may be (None, None).
    Every index tensor is made contiguous: Flex's kernels step through a list assuming its
    last dim has stride 1, and a transposed view there gave wrong dK/dV on an H200 with no error
    (docs/records/flex_window_bwd_masks_h200.json).
    """
    kv, full_kv, q, full_q = (tuple(None if x is None else x.contiguous() for x in pair)
                              for pair in (kv, full_kv, q, full_q))
    return BlockMask(seq_lengths, kv[0], kv[1], full_kv[0], full_kv[1], q[0], q[1], full_q[0], full_q[1],
                     block_size, mask_mod)


def transpose_blocks(num_bhr: torch.Tensor, idx_bhrw: torch.Tensor, n_cols: int, width: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Row lists -> column lists: (num [B,H,R], idx [B,H,R,W]) -> (num [B,H,C], idx [B,H,C,width]).

    Entry j of row r is listed iff j < num[r]; listed column ids must be distinct per row.
    The column lists come out with ascending row ids. `width` must bound the entries any
    column gets (it is the static width of the result; entries past it are dropped, and the
    count is clamped to it); entries beyond a column's count are 0.
    Work: one sort, one binary search per column and one scatter over the B*H*R*W entries.
    """
    B, H, R, W = idx_bhrw.shape
    device = idx_bhrw.device
    n_seg = B * H * n_cols
    listed = torch.arange(W, device=device) < num_bhr[..., None].to(torch.int64)
    bh = torch.arange(B * H, device=device).view(B, H, 1, 1)
    seg = bh * n_cols + idx_bhrw.to(torch.int64)
    # Unlisted entries go to a spare segment n_seg, which sorts last and is dropped.
    seg = torch.where(listed, seg, n_seg)
    rows = torch.arange(R, device=device).view(1, 1, R, 1)
    key_sorted = torch.sort((seg * R + rows).flatten()).values
    seg_sorted, row_sorted = key_sorted // R, key_sorted % R
    # Segment starts by binary search in the sorted keys, not by atomic counts: most entries of
    # a sparse list are unlisted, and counting them into one slot serialised ~10^6 atomics.
    starts = torch.searchsorted(seg_sorted, torch.arange(n_seg + 1, device=device))
    counts = starts[1:] - starts[:-1]
    i = torch.arange(key_sorted.numel(), device=device)
    rank = i - starts[seg_sorted]
    # Dropped entries (the spare segment, any past `width`) land in a spare region, spread
    # over many slots for the same reason.
    spare = max(1, min(key_sorted.numel(), _SPARE_SLOTS))
    keep = (seg_sorted < n_seg) & (rank < width)
    dest = torch.where(keep, seg_sorted * width + rank, n_seg * width + i % spare)
    out = torch.zeros(n_seg * width + spare, dtype=torch.int32, device=device)
    out.scatter_(0, dest, row_sorted.to(torch.int32))
    num_out = torch.clamp(counts, max=width).to(torch.int32).view(B, H, n_cols)
    return num_out, out[: n_seg * width].view(B, H, n_cols, width)


def union_blocks(cand_bhrm: torch.Tensor, n_members_bhr: torch.Tensor, full_ok_bhrm: torch.Tensor,
                 width: int) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Per query tile, the union of its tokens' selected blocks, split into partial and full lists.

    cand [B,H,R,M]: block ids of the tile's member tokens concatenated (-1 = none); each
    member lists a block at most once. n_members [B,H,R]: members of the tile. full_ok
    [B,H,R,M]: the block lies entirely before the tile's first token (causally full).
    A block is full for the tile iff every member lists it and it is causally full; else
    partial. Returns ((num, idx [B,H,R,width]) partial, (num, idx) full), ascending ids.
    """
    big = _BIG
    x = torch.where(cand_bhrm < 0, big, cand_bhrm.to(torch.int32))
    x, order = torch.sort(x, dim=-1)
    full_ok = torch.gather(full_ok_bhrm, -1, order)
    M = x.shape[-1]
    first = torch.ones_like(x, dtype=torch.bool)
    first[..., 1:] = x[..., 1:] != x[..., :-1]
    first &= x != big
    # A block listed by all k members occupies sorted slots i .. i+k-1 from its first one i.
    k = n_members_bhr.to(torch.int64)[..., None]
    last = torch.clamp(torch.arange(M, device=x.device) + k - 1, max=M - 1)
    everyone = torch.gather(x, -1, last) == x
    full = first & everyone & full_ok
    partial = first & ~full
    return _compact(x, partial, width, big), _compact(x, full, width, big)


def _compact(x: torch.Tensor, keep: torch.Tensor, width: int, big: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept entries of each row first (ascending), as (num [...], idx [..., width]) with 0 padding."""
    kept = torch.sort(torch.where(keep, x, big), dim=-1).values
    if kept.shape[-1] < width:
        kept = torch.nn.functional.pad(kept, (0, width - kept.shape[-1]), value=big)
    kept = kept[..., :width]
    num = keep.sum(-1, dtype=torch.int32)
    return num, torch.where(kept == big, 0, kept).contiguous()


def interval_block_mask(q_len: int, kv_len: int, lo, hi, block_size: tuple[int, int], mask_mod,
                        device, *, chunks: int = 1, heads: int = 1,
                        widths: tuple[int | None, int | None] = (None, None)) -> BlockMask:
    """BlockMask of a mask where query t sees only keys in [lo(t), hi(t)] (hi < lo: none).

    lo and hi map the int64 tensor arange(q_len) to key positions. A kv block is listed for
    a query tile when it meets [min lo, max hi] over the tile's rows that see any key (exact
    when consecutive rows' intervals touch, as for causal, window and compressed masks;
    else a superset, which mask_mod keeps exact), and full when it lies inside every row's
    interval. So a tile's listed blocks are one run of block ids and its full blocks a run
    inside it: the kv-side lists are written from the runs' ends (no [Q_blocks, KV_blocks]
    grid, no sort of it: at T=64k, G=4 that grid's sorts took 0.5 ms of every compiled call
    on an H200), and the q-side lists come from them by transpose_blocks (one sort of the
    listed entries, a few per tile).

    chunks > 1: the query rows are split into `chunks` consecutive chunks that the caller
    passes as extra heads, q [B, heads, q_len, D] viewed as [B, heads * chunks, q_len / chunks, D]
    (head h * chunks + c = rows c * q_len / chunks ...). The mask is then [1, heads * chunks,
    q_len / chunks, kv_len] and its mask_mod maps a chunk's row back to the full row. See
    `query_chunks` for why. q_len must be a multiple of chunks * block_size[0].

    widths = (kv-side, q-side): static bounds on the kv blocks one query tile lists and the
    query tiles one kv block lists, when the caller knows them (the window: a few blocks).
    The lists are cut to that width. Besides memory, this matters to Inductor: when it
    autotunes the flex backward it benchmarks on fake masks in which every list is full to
    its width, so a full-width q side makes the window's benchmark dense attention, O(T^2)
    (torch/_inductor/kernel/flex/common.py, create_num_blocks_fake_generator).
    """
    qbs, kbs = block_size
    n_q, n_kv = -(-q_len // qbs), max(1, -(-kv_len // kbs))
    if chunks > 1 and q_len % (chunks * qbs):
        raise ValueError(f"{chunks} query chunks of {qbs}-row blocks do not divide {q_len} rows")
    t = torch.arange(q_len, device=device, dtype=torch.int64)
    lo_t, hi_t = lo(t), hi(t)
    seeing = hi_t >= lo_t
    big = _BIG

    def per_tile(x, fill, reduce):
        x = torch.nn.functional.pad(x, (0, n_q * qbs - q_len), value=fill)
        return reduce(x.view(n_q, qbs), dim=-1)

    # Keys the tile's seeing rows reach, cut to the keys that exist.
    union_lo = per_tile(torch.where(seeing, lo_t, big), big, torch.amin).clamp(min=0)
    union_hi = per_tile(torch.where(seeing, hi_t, -1), -1, torch.amax).clamp(max=kv_len - 1)
    # Keys every row of the tile sees.
    inter_lo = per_tile(lo_t, -big, torch.amax).clamp(min=0)
    inter_hi = per_tile(hi_t, big, torch.amin)
    touched = union_hi >= union_lo
    first = torch.where(touched, union_lo // kbs, 0)
    last = torch.where(touched, union_hi // kbs, -1)
    # Full: block c with c * kbs >= inter_lo and its last key (the last block may be short) <= inter_hi.
    f0 = (inter_lo + kbs - 1) // kbs
    f1 = torch.where(inter_hi >= kv_len - 1, n_kv - 1, torch.div(inter_hi + 1, kbs, rounding_mode="floor") - 1)
    # (A full block lies in every row's interval, so a tile with a full block touches it; this
    # also drops the empty block of kv_len = 0.)
    full_n = torch.where(touched, (f1 - f0 + 1).clamp(min=0), 0)
    has_full = full_n > 0
    # Partial: the run [first, last] less the full run [f0, f1] inside it: [first, fa) then (fb, last].
    fa = torch.where(has_full, f0, last + 1)
    fb = torch.where(has_full, f1, last)
    n_left, n_right = fa - first, last - fb
    kv_w = n_kv if widths[0] is None else min(widths[0], n_kv)
    k = torch.arange(kv_w, device=device, dtype=torch.int64)
    part_idx = torch.where(k < n_left[:, None], first[:, None] + k, fb[:, None] + 1 + k - n_left[:, None])
    full_idx = f0[:, None] + k

    def lists(num, idx):  # [n_q], [n_q, W] -> [1, chunks, n_q / chunks, W] int32, entries kept in range
        num = num.clamp(max=kv_w).to(torch.int32).view(1, chunks, n_q // chunks)
        idx = idx.clamp(0, n_kv - 1).to(torch.int32).view(1, chunks, n_q // chunks, kv_w)
        return num, idx

    def per_head(x):  # [1, chunks, ...] -> [1, heads * chunks, ...]
        if chunks == 1:
            return x
        return x.unsqueeze(1).expand(1, heads, *x.shape[1:]).reshape(1, heads * chunks, *x.shape[2:])

    q_w = n_q // chunks if widths[1] is None else min(widths[1], n_q // chunks)
    kv = lists(n_left + n_right, part_idx)
    full_kv = lists(full_n, full_idx)
    q, full_q = (transpose_blocks(*pair, n_kv, q_w) for pair in (kv, full_kv))
    kv, full_kv, q, full_q = (tuple(per_head(x) for x in pair) for pair in (kv, full_kv, q, full_q))
    if chunks > 1:
        mask_mod = chunked_mask_mod(mask_mod, chunks, q_len // chunks)
    return make_block_mask((q_len // chunks, kv_len), kv, full_kv, q, full_q, block_size, mask_mod)


def chunked_mask_mod(mask_mod, chunks: int, chunk_rows: int):
    """mask_mod over (head h * chunks + c, row r of chunk c) from one over the full rows c * chunk_rows + r."""

    def chunk_mask(b, h, q_idx, kv_idx):
        return mask_mod(b, h // chunks, (h % chunks) * chunk_rows + q_idx, kv_idx)

    return chunk_mask


def query_chunks(rows: int, q_block: int, max_chunks: int, min_rows: int) -> int:
    """How many chunks to split `rows` folded query rows into for a branch with few kv blocks.

    FlexAttention's backward computes dK/dV with one program per (head, kv block) that walks
    every query row of its head. The compressed branch has T/16 keys, so at T=64k that is
    32 blocks x 4 kv heads = 128 long programs for 132 SMs; passing the rows as `chunks`
    extra heads (keys copied per chunk: T/16 of them, cheap) gives chunks times more,
    shorter programs, and autograd sums the copies' gradients. On an H200 at T=64k, G=16
    the compressed branch's forward+backward went from 67.1 to 46.4 ms with 16 chunks
    (docs/records/flex_branch_variants_64k_h200.json). The largest power of two
    <= max_chunks that divides rows into whole q_block tiles of at least min_rows rows each.
    """
    chunks = 1
    while (chunks * 2 <= max_chunks and rows % (chunks * 2 * q_block) == 0
           and rows // (chunks * 2) >= min_rows):
        chunks *= 2
    return chunks
