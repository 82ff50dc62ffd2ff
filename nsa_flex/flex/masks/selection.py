"""Selected-blocks mask in the folded GQA layout, built from the top-n block indices.

Folded layout: the G query heads of kv head h become rows of one sequence,
q [B, T, Hq, D] -> [B, Hkv, T*G, D], row rho = t*G + g. A 16-row query tile then holds the
G heads of 16/G tokens (one token at G=16), which share one list of kv blocks: the paper's
group-centric kernel expressed as a BlockMask. The mask's head dim is Hkv, the number of
heads of the folded query, so the GPU (h % H_mask) and CPU (h // G) head mappings agree.

The mask_mod is exact on its own (a bit set of the selected blocks per token, plus
causality), so eager, CPU and GPU flex agree; the block lists only skip work.

Initial-block copies (long sequences): every token selects the first n_initial blocks, so
in the backward the one dK/dV program of block 0 would walk every query tile alone (25 ms
of a 123 ms forward+backward at T=64k, G=16 on an H200). With `InitialCopies` the keys of
those blocks are appended after the (l'-padded) keys once per span of `tokens` query
tokens, and each span's tiles list their own copy instead of block 0: the same keys and
the same one softmax, but many short programs; autograd sums the copies' dK/dV back.

Packed documents: block ids are document-local, so a selected block covers
[start + j*l', start + (j+1)*l') and may straddle two of the mask's l'-token kv blocks;
those kv blocks are listed, all as partial (mask_mod applied everywhere: correct, a little
slower than the full-block path of single sequences).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

from nsa_flex.blocks import distinct_block_indices, num_sel_blocks
from nsa_flex.config import NSAConfig
from nsa_flex.flex.masks.documents import Documents
from nsa_flex.flex.blockmask import interval_block_mask, make_block_mask, transpose_blocks, union_blocks

WORD = 32


def selection_bits(block_indices: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """[B, Hkv, T, n] block ids (-1 = unused) -> [B, Hkv, T, ceil(Ns/32)] int32 bit sets.

    A repeated id sets its bit once (a sum of its bits would carry into the next block's).
    """
    return _bits_of_distinct(distinct_block_indices(block_indices, n_blocks), n_blocks)


def _bits_of_distinct(block_indices: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """selection_bits of ids already distinct per row (distinct_block_indices)."""
    words = -(-n_blocks // WORD)
    idx = block_indices.to(torch.int64)
    ok = idx >= 0
    word = torch.where(ok, idx // WORD, words)
    bit = torch.where(ok, torch.bitwise_left_shift(torch.ones_like(idx), idx % WORD), 0)
    bits = torch.zeros(*idx.shape[:-1], words + 1, dtype=torch.int64, device=idx.device)
    # Distinct ids set distinct bits, so the sum is their bitwise or.
    bits = bits.scatter_add_(-1, word, bit)[..., :words]
    # Reinterpret the 32-bit patterns as int32 (two's complement).
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)


@dataclass(frozen=True)
class InitialCopies:
    """Where the copies of the forced initial blocks sit among the selected branch's keys.

    Copy c holds keys [0, keys) again at positions start + c*keys ...; query token t uses copy
    t // tokens and no longer block 0 itself. start is T rounded up to l', so copies begin on
    a kv-block boundary (the padding keys in between are never visible).
    """

    tokens: int
    count: int
    keys: int
    start: int

    @property
    def kv_len(self) -> int:
        return self.start + self.count * self.keys


def initial_copies(T: int, G: int, config: NSAConfig, q_block: int, tokens: int) -> InitialCopies | None:
    """The copy layout for length T, or None where one copy would serve every token anyway.

    tokens (query tokens per copy) is rounded up so that no query tile straddles two spans.
    """
    per_tile = max(1, q_block // G) if q_block % G == 0 else q_block
    tokens = -(-max(tokens, per_tile) // per_tile) * per_tile
    count = -(-T // tokens)
    keys = config.n_initial * config.sel_block
    if count <= 1 or keys > T:
        return None
    return InitialCopies(tokens=tokens, count=count, keys=keys, start=num_sel_blocks(T, config) * config.sel_block)


def selection_mask_mod(bits: torch.Tensor, G: int, sel_block: int, docs: Documents | None = None,
                       copies: InitialCopies | None = None):
    """mask_mod over folded rows: row rho (token t = rho // G) sees key s iff s <= t and block(s) is selected.

    With documents, block(s) is document-local and s must lie in t's document. With copies,
    key positions past copies.start are copies of the initial keys, and token t sees the
    initial blocks only through its own copy.
    """

    def sel_mask(b, h, q_idx, kv_idx):
        t = q_idx // G
        blk = kv_idx // sel_block
        word = bits[b, h, t, blk // WORD]
        return (kv_idx <= t) & (((word >> (blk % WORD)) & 1) != 0)

    if copies is not None:
        if docs is not None:
            raise ValueError("initial-block copies are for single sequences, not packed documents")
        n_initial = copies.keys // sel_block

        def sel_copies_mask(b, h, q_idx, kv_idx):
            t = q_idx // G
            rel = kv_idx - copies.start
            in_copy = rel >= 0
            rel = torch.where(in_copy, rel, 0)
            src = torch.where(in_copy, rel % copies.keys, kv_idx)
            blk = src // sel_block
            word = bits[b, h, t, blk // WORD]
            own = torch.where(in_copy, rel // copies.keys == t // copies.tokens, blk >= n_initial)
            return own & (src <= t) & (((word >> (blk % WORD)) & 1) != 0)

        return sel_copies_mask

    if docs is None:
        return sel_mask

    def sel_doc_mask(b, h, q_idx, kv_idx):
        t = q_idx // G
        same_doc = docs.q_doc[t] == docs.q_doc[kv_idx]
        # Keys of earlier documents would give negative local blocks: clamp, same_doc drops them.
        blk = torch.clamp(kv_idx - docs.q_start[t], min=0) // sel_block
        word = bits[b, h, t, blk // WORD]
        return same_doc & (kv_idx <= t) & (((word >> (blk % WORD)) & 1) != 0)

    return sel_doc_mask


def tokens_per_tile(G: int, q_block: int) -> int:
    """Most tokens one tile of q_block folded rows can touch (a tile starts at a multiple of q_block)."""
    starts = range(0, G, math.gcd(q_block, G))
    return max((a + q_block - 1) // G + 1 for a in starts)


def selection_block_mask(block_indices: torch.Tensor, T: int, G: int, config: NSAConfig,
                         q_block: int = 16, docs: Documents | None = None,
                         copies: InitialCopies | None = None, full_blocks: bool = True) -> BlockMask:
    """BlockMask [B, Hkv, T*G, T] of the selected branch, folded layout, from [B, Hkv, T, n] indices.

    Query tiles of q_block rows, kv blocks of l' tokens. A kv block is "full" for a tile when
    every token of the tile selected it and it ends before the tile's first token; the
    rest of the union is "partial" (mask_mod applied). Both directions are emitted from the
    indices with O(T*n) sort/scatter work. With copies the keys are [B, Hkv, copies.kv_len]
    (see InitialCopies) and the initial blocks are listed as each tile's own copy. full_blocks=False
    lists every block as partial (no full-block lists kept).

    On CUDA (single sequences) the lists come from `selection_lists` compiled once per shape:
    eagerly its ~60 small sort/scatter/elementwise kernels were launch-bound at 8k.
    """
    build = _COMPILED_LISTS if block_indices.is_cuda and docs is None else selection_lists
    partial_kv, full_kv, partial_q, full_q, bits = build(block_indices, T, G, config, q_block, docs, copies,
                                                         full_blocks)
    mask_mod = selection_mask_mod(bits, G, config.sel_block, docs, copies)
    kv_len = T if copies is None else copies.kv_len
    return make_block_mask((T * G, kv_len), partial_kv, full_kv, partial_q, full_q, (q_block, config.sel_block),
                           mask_mod)


def selection_lists(block_indices: torch.Tensor, T: int, G: int, config: NSAConfig, q_block: int,
                    docs: Documents | None, copies: InitialCopies | None, full_blocks: bool = True):
    """The tensors of selection_block_mask: (partial kv, full kv, partial q, full q) lists as (num, idx), and
    the selection bits of its mask_mod. full_blocks=False: the full lists are (None, None)."""
    L = config.sel_block
    device = block_indices.device
    n_blocks = num_sel_blocks(T, config)
    # Each id once, and no wider than the blocks that exist: repeats would corrupt the bits and
    # the full-block test of union_blocks, and an n above Ns would only widen every list.
    block_indices = distinct_block_indices(block_indices, n_blocks)
    B, Hkv, _, n = block_indices.shape
    rows = T * G
    n_tiles = -(-rows // q_block)
    R = min(tokens_per_tile(G, q_block), T)

    r0 = torch.arange(n_tiles, device=device, dtype=torch.int64) * q_block
    t_lo = r0 // G
    t_hi = (torch.clamp(r0 + q_block, max=rows) - 1) // G
    j = torch.arange(R, device=device, dtype=torch.int64)
    member = j[None, :] <= (t_hi - t_lo)[:, None]  # [n_tiles, R]
    tok = torch.clamp(t_lo[:, None] + j[None, :], max=T - 1)
    cand = block_indices[:, :, tok, :].to(torch.int64)  # [B, Hkv, n_tiles, R, n]
    if docs is None and full_blocks:
        full_ok = (cand + 1) * L - 1 <= t_lo[:, None, None]
    elif docs is None:
        full_ok = torch.zeros_like(cand, dtype=torch.bool)
    else:
        cand = _global_blocks(cand, tok, docs, L)
        full_ok = torch.zeros_like(cand, dtype=torch.bool)
    # A block starting after its token holds no key that token sees: leave it out.
    useful = member[..., None] & (cand >= 0) & (cand * L <= tok[..., None])
    cand = torch.where(useful, cand, -1)
    if copies is not None:
        n_initial = copies.keys // L
        copy_block = n_blocks + (tok // copies.tokens)[..., None] * n_initial + cand
        cand = torch.where((cand >= 0) & (cand < n_initial), copy_block, cand)
        n_blocks += copies.count * n_initial
    cand = cand.flatten(-2)
    n_members = (t_hi - t_lo + 1).expand(B, Hkv, n_tiles)
    width = min(cand.shape[-1], n_blocks)
    partial_kv, full_kv = union_blocks(cand, n_members, full_ok.flatten(-2), width)

    # Column lists as wide as the number of query tiles. Random selections bound only one of
    # the two lists (at one token per tile a block is partial for its own tokens' tiles alone),
    # but Flex's backward on torch 2.11 gave wrong dK/dV with any q-side list cut below the
    # number of tiles (docs/records/flex_narrow_q_lists_h200.txt).
    partial_q = transpose_blocks(*partial_kv, n_blocks, n_tiles)
    if full_blocks:
        full_q = transpose_blocks(*full_kv, n_blocks, n_tiles)
    else:
        full_kv = full_q = (None, None)
    bits = _bits_of_distinct(block_indices, num_sel_blocks(T, config))
    return partial_kv, full_kv, partial_q, full_q, bits


_COMPILED_LISTS = torch.compile(selection_lists, dynamic=False)


def _global_blocks(local_bhtrn: torch.Tensor, tok_tr: torch.Tensor, docs: Documents, L: int) -> torch.Tensor:
    """Document-local block ids -> the global l'-token kv blocks they cover, [..., 2n], each once per token."""
    start = docs.q_start[tok_tr][..., None]  # [n_tiles, R, 1]
    first = start + local_bhtrn * L
    last = torch.minimum(first + L - 1, tok_tr[..., None])
    ok = local_bhtrn >= 0
    pair = torch.cat([torch.where(ok, first // L, -1), torch.where(ok & (last >= first), last // L, -1)], -1)
    big = 2**30
    pair = torch.sort(torch.where(pair < 0, big, pair), dim=-1).values
    dup = torch.zeros_like(pair, dtype=torch.bool)
    dup[..., 1:] = pair[..., 1:] == pair[..., :-1]
    return torch.where(dup | (pair == big), -1, pair)
