"""The inverse of a selection: for each (batch, kv head, key block), the (token, slot) pairs that chose it.

block_indices [B, Hkv, T, n] says which blocks each token reads; the block-centric kernels
need the opposite, a list per block. Blocks are "virtual": block j of the document holding
token t (packed documents, cu_seqlens) gets its own id with its own key range, so a single
sequence is one document and every kernel sees a flat list of key ranges.

Everything here is a pure tensor function of the inputs with sizes computable from shapes
only (no .item(), no .tolist()): it traces under torch.compile and CUDA graphs. The list is
built by one stable sort of B*Hkv*T*n keys (a radix sort on CUDA, on 16-bit keys where the rows
fit), so it is deterministic and O(T*n), with no dense [T, Nblk] intermediate.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from nsa_flex.blocks import document_of


class SelectionIndex(NamedTuple):
    """CSR of the selection, grouped by (batch, kv head, virtual block).

    Row r = (b * Hkv + h) * Nv + block. Entries hold t * entry_stride(s) + place, tokens ascending
    inside a row: each token's slots that read something come first in its row of gid_bhtn, in
    slot order, and the kernels keep a (token, place)'s partial at that place (s places a token,
    build_index's `slots`). Entries past offsets[-1] + counts[-1] are unused.
    """

    gid_bhtn: Tensor
    """[B, Hkv, T, s] int32: the virtual blocks each token reads, in slot order, then -1."""
    counts: Tensor
    """[B*Hkv*Nv] int32: entries per row."""
    offsets: Tensor
    """[B*Hkv*Nv] int32: first entry of each row (exclusive cumsum of counts)."""
    entries: Tensor
    """[B*Hkv*T*s] int32: t * entry_stride(s) + place, grouped by row."""
    blk_start: Tensor
    """[Nv] int32: first key token of each virtual block."""
    blk_end: Tensor
    """[Nv] int32: one past its last key token (blk_start == blk_end for spare blocks)."""


class WorkList(NamedTuple):
    """Work items: spans of at most `span` entries of one row, a static number of them.

    Item w covers entries [start[w], end[w]) of row blk[w]; blk[w] = -1 for surplus items.
    Row r's items are first_item[r] .. first_item[r] + n_items[r] - 1, in entry order. The items
    of rows with several come first (row by row), then the rows with one: only the first
    split_items_bound() items ever belong to a row with several, and only those write partials.
    """

    blk: Tensor
    start: Tensor
    end: Tensor
    first_item: Tensor
    n_items: Tensor


def entry_stride(slots: int) -> int:
    """What an entry's token is multiplied by: slots rounded up to a power of two, so that the
    kernels split an entry with a shift and a mask (with 14 places a division by 14 cost the
    selected op's Gluon kernels 2-3% at g4, 64k on an H100, docs/decisions.md)."""
    return 1 << max(0, slots - 1).bit_length()


def num_virtual_blocks(T: int, sel_block: int, n_docs: int) -> int:
    """Nv: a bound on the documents' blocks, sum of ceil(len_d / l') <= ceil(T / l') + n_docs."""
    return -(-T // sel_block) + n_docs


def build_index(block_indices: Tensor, sel_block: int, cu_seqlens: Tensor | None = None,
                positions: Tensor | None = None, seq_len: int | None = None, unique: bool = False,
                slots: int | None = None) -> SelectionIndex:
    """The SelectionIndex of block_indices [B, Hkv, T, n] (document-local ids with cu_seqlens, B == 1).

    Slots with -1, or with a block past the end of the token's document, read nothing. A token
    range of a longer sequence: positions [T] are its tokens' places in the sequence of seq_len
    tokens (default: the whole sequence, arange(T)); entries stay local (t - positions[0]) and
    the virtual blocks span the whole sequence. positions is a tensor, not an offset, so a
    compiled index serves every range of one length without recompiling. unique: no row lists a
    block twice (the selection op's own output), so the repeat check is left out (its n x n
    compares took ~160 us at g4, 64k on an H100, more than the sorts). slots (default n): the
    places a token has (SelectionIndex); a caller whose tokens each have at most `slots` slots
    that read something passes fewer than n (the gated node's selections, whose two local slots
    read nothing: launch.partial_slots), and the partials, the sort and the merges shrink by
    slots / n. A token's used slots past that many read nothing rather than reach another
    token's partials.
    """
    B, Hkv, T, n = block_indices.shape
    device = block_indices.device
    seq_len = T if seq_len is None else seq_len
    cu = _bounds(cu_seqlens, seq_len, device)
    n_docs = cu.shape[0] - 1
    Nv = num_virtual_blocks(seq_len, sel_block, n_docs)
    lens = cu[1:] - cu[:-1]
    doc_blocks = (lens + sel_block - 1) // sel_block
    last_blk = torch.cumsum(doc_blocks, 0)
    first_blk = last_blk - doc_blocks
    blk_start, blk_end = _virtual_blocks(cu, last_blk, first_blk, Nv, sel_block)

    t = torch.arange(T, device=device) if positions is None else positions
    doc_t = document_of(cu, t)
    j = block_indices.long()
    # A block listed twice in one row counts once (the reference's mask is a set): later copies
    # read nothing. n x n compares per row, no sort, so the compiled index stays plain pointwise.
    ok = (j >= 0) & (j * sel_block < lens[doc_t][:, None])
    if not unique:
        earlier = torch.ones(n, n, dtype=torch.bool, device=device).tril(-1)
        ok &= ~((j[..., :, None] == j[..., None, :]) & earlier).any(-1)
    # Each used slot's place among its token's used slots; the row keeps them there, in slot order
    # (the unused ones all go to one more place, cut off: -1 each).
    rank = torch.cumsum(ok.to(torch.int32), -1) - 1
    slots = n if slots is None else slots
    ok = ok & (rank < slots)
    gid = torch.where(ok, first_blk[doc_t][:, None] + j, -1)
    place = torch.where(ok, rank, slots).long()
    gid = torch.full((B, Hkv, T, slots + 1), -1, dtype=gid.dtype, device=device).scatter(-1, place, gid)[..., :slots]
    ok = gid >= 0

    # Row of every (b, h, t, slot); unused slots sort last into a spare row.
    rows = B * Hkv * Nv
    bh = torch.arange(B * Hkv, device=device).view(B, Hkv, 1, 1)
    # The narrowest key type that holds rows: a radix sort makes one pass per key byte, so int16
    # keys (up to 32767 rows: B * Hkv * ceil(T / l') at 64k, l' = 64 is 1025 per kv head) sort in
    # 2 passes against 8 for int64.
    key_dtype = torch.int16 if rows < 2 ** 15 - 1 else torch.int32
    key = torch.where(ok, bh * Nv + gid, rows).flatten().to(key_dtype)
    sorted_key, order = torch.sort(key, stable=True)
    # The flat position of an entry is ((b * Hkv + h) * T + t) * slots + place.
    low = order % (T * slots)
    entries = (low // slots * entry_stride(slots) + low % slots).to(torch.int32)
    # Row r's entries are the run of key r in the sorted keys; the run bounds by binary search (a
    # scatter-add of ones would serialise on the rows every token reads, block 0 and the local ones).
    bounds = torch.searchsorted(sorted_key.to(torch.int32), torch.arange(rows + 1, device=device, dtype=torch.int32))
    offsets = bounds[:rows]
    counts = bounds[1:] - offsets
    return SelectionIndex(gid.to(torch.int32), counts.to(torch.int32), offsets.to(torch.int32), entries,
                          blk_start, blk_end)


def work_list(index: SelectionIndex, span: int, T: int, n: int) -> WorkList:
    """Split every row of index into items of at most span entries (T tokens with at most n
    entries each: the index's slots).

    There are at most B*Hkv*(ceil(T*n / span) + Nv) items (each row wastes less than one item),
    a bound from shapes only: the grid has that many programs and the surplus ones exit at once.
    A long row (block 0, which every token reads) becomes many items.
    """
    rows = index.counts.shape[0]
    BH = rows // index.blk_start.shape[0]
    counts = index.counts.long()
    n_items = (counts + span - 1) // span
    # Rows with several items first (their items write partials: the partial buffers then need
    # only split_items_bound rows), then the others, each group in row order. Shapes stay static:
    # two cumulative counts, no compaction.
    split = n_items > 1
    last_split = torch.cumsum(torch.where(split, n_items, 0), 0)
    last_other = torch.cumsum(torch.where(split, 0, n_items), 0)
    n_split = last_split[-1:]
    first = torch.where(split, last_split - n_items, n_split + last_other - n_items)
    W = max_work_items(BH, T, n, span, index.blk_start.shape[0])
    w = torch.arange(W, device=counts.device)
    in_split = w < n_split
    row = torch.where(in_split, torch.searchsorted(last_split, w, right=True),
                      torch.searchsorted(last_other, w - n_split, right=True))
    surplus = row >= rows
    row = row.clamp(max=rows - 1)
    start = index.offsets.long()[row] + (w - first[row]) * span
    end = torch.minimum(start + span, index.offsets.long()[row] + counts[row])
    blk = torch.where(surplus, -1, row)
    return WorkList(blk.to(torch.int32), start.to(torch.int32), end.to(torch.int32), first.to(torch.int32),
                    n_items.to(torch.int32))


def max_work_items(BH: int, T: int, n: int, span: int, Nv: int) -> int:
    """The work list's length for BH (batch, kv head) pairs of T tokens, n slots and Nv blocks:
    each row wastes less than one item of `span` entries."""
    return BH * (-(-(T * n) // span) + Nv)


def split_items_bound(entries: int, span: int) -> int:
    """A bound on the items of rows with several, from shapes: such a row has c > span entries
    and ceil(c / span) < 2 c / span items, so all of them have fewer than 2 * entries / span."""
    return 2 * -(-entries // span)


def _bounds(cu_seqlens: Tensor | None, T: int, device) -> Tensor:
    """Document bounds [n_docs + 1] int64: one document [0, T) without cu_seqlens."""
    if cu_seqlens is None:
        # Made on the device: a host tensor copied in would wait for the stream (a sync per call).
        return torch.arange(2, dtype=torch.int64, device=device) * T
    return cu_seqlens.to(device=device, dtype=torch.int64)


def _virtual_blocks(cu: Tensor, last_blk: Tensor, first_blk: Tensor, Nv: int, sel_block: int):
    """([Nv] start, [Nv] end) int32 key range of each virtual block; empty past the last document's.

    last_blk / first_blk [n_docs]: one past the last, and the first, virtual block of each document.
    """
    n_docs = cu.shape[0] - 1
    vb = torch.arange(Nv, device=cu.device)
    doc = torch.zeros_like(vb) if n_docs == 1 else torch.searchsorted(last_blk, vb, right=True)
    spare = vb >= last_blk[-1]
    doc = doc.clamp(max=n_docs - 1)
    start = cu[doc] + (vb - first_blk[doc]) * sel_block
    end = torch.minimum(start + sel_block, cu[doc + 1])
    start = torch.where(spare, 0, start)
    end = torch.where(spare, 0, end)
    return start.to(torch.int32), end.to(torch.int32)
