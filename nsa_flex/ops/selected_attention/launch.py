"""Host side of the Triton path: tiles, buffers and the launches of kernels.py.

Runs on CUDA tensors, or on CPU tensors under Triton's interpreter (tests). No host syncs:
every grid and buffer size is a function of the shapes.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
from torch import Tensor

from nsa_flex.folded import group_strides
from nsa_flex.ops.capped_launch import launch
from nsa_flex.ops.selected_attention import gluon_kernels, kernels, merge_kernels
from nsa_flex.ops.selected_attention.index import SelectionIndex, WorkList, build_index, entry_stride, \
    max_work_items, num_virtual_blocks, split_items_bound, work_list
from nsa_flex.ops.triton_utils import dense, next_pow2

if kernels.HAS_TRITON:
    from torch.library import wrap_triton

TILE_KEYS = ("fwd_BT", "bwd_BT", "fwd_chunks", "bwd_chunks", "fwd_warps", "bwd_warps", "fwd_stages", "bwd_stages",
             "fwd_maxnreg", "bwd_maxnreg", "range_tokens", "partial_bytes", "fwd_gluon", "bwd_gluon")

# The partial buffers (o in the forward, dQ in the backward: partial_slots() partials per token
# and query head) of one token range stay under this many bytes; longer sequences run range by range.
# They are the op's peak: with 1 GiB (four ranges at g4, 64k) the g4 op's fwd+bwd peaked at 1838 MiB
# over its inputs against dense cuDNN's 1672, with 640 MiB (six) at 1542, for 0.2-1.2 ms more of
# 26 (H200; fewer ranges are faster: fuller work items, fewer index builds, docs/decisions.md).
# tiles["partial_bytes"] sets another (a model in training, where the activations are the peak,
# takes more: NSAModelConfig.sel_partial_bytes).
PARTIAL_BYTES = 640 << 20


# From this many tokens (B * T) on, the long-sequence settings (H100, the g4 op, docs/decisions.md):
# - the forward's register cap. A capped launch goes through an opaque op (ops/capped_launch.py),
#   which costs host time: with the cap the op's forward took 1.81 against 1.63 ms at 8k tokens,
#   2.46 against 2.52 at 16k, 5.24 against 5.47 at 32k and 12.28 against 13.01 at 64k;
# - backward items of 64 chunks (2048 tokens at 128 rows, 1024 at 64): fewer fp32 dK/dV partials
#   for the block sum to read. 32 chunks against 16 at 16-bit D=128: fwd+bwd 32.19 against 32.40 ms
#   at 64k, 13.77 against 13.82 at 32k, 64 MiB less peak; 64 against 32 (H200, kernels alone): the
#   backward 7.64 against 7.74 ms at 64k; at D=64 (seeds-125m's heads, 5 stages) 1.22 against 1.27
#   ms at 8k tokens x 4, 2.66 against 2.92 at 64k.
LONG_FROM_TOKENS = 32768


def launch_config(G: int, Dk: int, Dv: int, dtype: torch.dtype, tokens: int = 0) -> dict[str, int]:
    """Tiles and launch settings for group G, head dims Dk / Dv, the input dtype and B * T tokens.

    BT tokens per chunk give M = BT * G' query rows per tl.dot (G' = G rounded up to a power
    of two): M = 64 for 16-bit inputs with padded head dims <= 128, else 32 (fp32, or Dk = 192
    padded to 256: the dots' operands in shared memory stay well under Hopper's 227 KB). M >= 32
    keeps tl.dot's 16-row minimum; G' > 32 takes one token per chunk.

    A forward item walks fwd_chunks chunks with one load of K/V (K/V bytes per token shrink by
    BT * fwd_chunks against the token-centric loop). Each chunk moves its M query rows in and M
    partial rows out, so at 8 chunks the block's K/V are ~1/8 of the item's traffic. A backward
    item walks bwd_chunks chunks with dK/dV in registers; a block's only item then writes them,
    others one fp32 [l', Dk + Dv] partial each: 32 chunks make that write ~3% of the item's
    traffic while block 0 (read by all T tokens) still splits into T / (32 BT) items; from
    LONG_FROM_TOKENS tokens on 64 chunks, so that at T=64k nearly every other block has one item.
    The backward holds two [l', D] accumulators: 8 warps once padded Dk + Dv >= 256.

    Compiled for sm_90 without a GPU (Triton 3.6, ptxas -v, bf16, l' = 64): forward 127-190
    registers, 49-99 KB shared memory, no spills; backward at Dk = Dv = 64 with 4 warps 240
    registers, 66 KB; at 128/128 with 8 warps 254-255 registers (G=16: no spill, G=4: 60 bytes),
    132 KB; at 192/128 (M = 32) 244 registers, 123 KB. fp32 (IEEE FMA dots, M = 32) spills but
    stays within shared memory (164 KB for the backward at 192/128).

    The backward pipelines 3 stages for 16-bit inputs with padded head dims <= 128 (15.65 against
    16.28 ms at T=64k, G=4, D=128 on an H100); wider tiles keep 2, within shared memory. With both
    head dims <= 64 it takes 5: its gathered rows are then loaded two chunks ahead, while with 3
    or 4 stages Triton issues a chunk's loads after the previous chunk's dots and waits for them
    at once (backward kernel 2.01 against 2.14 ms at T=64k, Hq=12, Hkv=3, D=64 on an H200; the
    forward and the D=128 backward lost more in programs per SM than they gained, docs/decisions.md).

    Both kernels are latency-bound (profiled at T=16k, G=4, D=128: one or two programs per SM,
    0.8-1.2 TB/s), so deeper pipelines and bigger chunks pay where they fit. At 16-bit with
    Dk = Dv = 128 the backward takes M = 128 rows per chunk (16 chunks per item, the same 512-token
    span; 64 from LONG_FROM_TOKENS tokens on) and the forward 4 stages: at T=16k / 64k, G=4 on an
    H200 the backward took 2.37 / 10.26 ms against 2.97 / 12.63 with M = 64, the forward 1.43 /
    6.00 against 1.51 / 6.69 with 2 stages (docs/decisions.md).

    At 16-bit with Dk = Dv = 128 the forward takes 210 registers at G=4 (195 at G=16) and 74 KB
    of shared memory: two programs per SM. Capped at 168 registers it fits three (40 bytes of
    spills at G=4, none at G=16): on an H200 the forward kernel took 3.39 against 3.82 ms at
    T=64k, G=4, 1.66 against 1.86 at 32k, 11.40 against 14.06 at 64k, G=16 (torch profiler,
    docs/records/selected_forward_maxnreg_kernels_h200.json). At 16-bit D = 64 the Gluon forward
    (the next chunks' row ids read under its P V dot) fits a cap of 128 without spills, four
    programs per SM: 1.33 against 1.43 ms uncapped at T=64k, Hq=12, Hkv=3 (H100; the Triton
    forward there takes 127 registers either way). Inductor (torch 2.11) drops maxnreg from the
    kernels it launches, so a capped launch runs through nsa_flex::capped_launch, opaque to it;
    that op's host time outweighs the saving below LONG_FROM_TOKENS tokens.

    range_tokens (0: from the partial budget, see range_tokens()) overrides the token range length;
    partial_bytes (0: PARTIAL_BYTES) is that budget.
    fwd_gluon / bwd_gluon 1: the forward / backward runs gluon_kernels' kernel where it applies
    (Hopper, 16-bit, Dk = Dv of 64 or 128, the chunks above, G a power of two): their gathers
    overlap the dots, 2.99 / 4.93 against 3.59 / 6.16 ms at T=64k, G=4 on an H100, and 1.41 /
    1.86 against 1.58 / 2.00 at seeds-125m's heads (D=64; the gated backward 2.09 against 2.06),
    bit for bit the same results (docs/decisions.md); 0: the Triton kernels everywhere.
    """
    GP = next_pow2(G)
    DKP, DVP = max(16, next_pow2(Dk)), max(16, next_pow2(Dv))
    narrow = dtype != torch.float32 and max(DKP, DVP) <= 128
    BT = max(1, (64 if narrow else 32) // GP)
    wide_rows = narrow and DKP + DVP == 256  # 16-bit, Dk = Dv = 128: measured (launch sweep)
    long = tokens >= LONG_FROM_TOKENS
    small = narrow and max(DKP, DVP) <= 64
    return {"fwd_BT": BT, "bwd_BT": max(1, 128 // GP) if wide_rows else BT, "fwd_chunks": 8,
            "bwd_chunks": 64 if long else 16 if wide_rows else 32, "fwd_warps": 4,
            "bwd_warps": 8 if DKP + DVP >= 256 else 4, "fwd_stages": 4 if wide_rows else 2,
            "bwd_stages": 5 if small else 3 if narrow else 2,
            "fwd_maxnreg": 168 if wide_rows and long else 128 if small and long else 0, "bwd_maxnreg": 0, "range_tokens": 0, "partial_bytes": 0, "fwd_gluon": 1, "bwd_gluon": 1}


def partial_slots(n: int, skip_local: bool) -> int:
    """Places a token has in the index and the partials (index.build_index's `slots`): n, or with
    skip_local n - 2. There each token's two local slots read nothing (the window op's local
    partial stands for them), and the selection lists both (the gated node's contract) with no
    block twice, so at most n - 2 of its slots read a block: at g4, 64k the dQ partials of a
    range take 896 MiB instead of 1 GiB (docs/decisions.md)."""
    return max(1, n - 2) if skip_local else n


def partial_dtype(dtype: torch.dtype) -> torch.dtype:
    """The partial o / dQ buffers' dtype: the inputs' own. A 16-bit partial is one rounding of a
    block's normalised output (or a slot's dQ) before the fp32 merge, against fp32 partials it
    halves the op's largest buffers and their traffic."""
    return dtype


def range_tokens(B: int, T: int, Hq: int, n: int, D: int, dtype: torch.dtype, tiles: dict | None = None) -> int:
    """Tokens per range: the partial buffer [B, range, Hq, n, D] (n partial slots a token,
    partial_slots) within tiles["partial_bytes"]
    (0 or absent: PARTIAL_BYTES), a multiple of 64 tokens (at least 64), or all T when that fits
    (at least 1: T = 0 has no ranges). The fewest ranges that fit, of even length: at seeds-125m's
    heads and 64k, 16 slots, three of 21888 tokens (513 MiB of partials) rather than 27264, 27264
    and 11008 (639 MiB, the op's peak). tiles["range_tokens"] > 0 overrides."""
    tiles = tiles or {}
    fixed = tiles.get("range_tokens", 0)
    if fixed:
        return max(1, min(T, int(fixed)))
    per_token = B * Hq * n * D * partial_dtype(dtype).itemsize
    fit = (tiles.get("partial_bytes", 0) or PARTIAL_BYTES) // max(1, per_token)
    if fit >= T:
        return max(1, T)
    longest = max(64, fit // 64 * 64)
    ranges = -(-T // longest)
    even = -(-T // ranges)
    return -(-even // 64) * 64  # <= longest: even <= longest, a multiple of 64


def workspace_bytes(B: int, T: int, Hq: int, Hkv: int, n: int, Dk: int, Dv: int, sel_block: int,
                    dtype: torch.dtype, partial_bytes: int = 0, skip_local: bool = False) -> int:
    """The op's own buffers while its forward or backward runs (the larger), for memory estimates;
    partial_bytes as the tile key (0: PARTIAL_BYTES), skip_local as forward / backward take it."""
    cfg = launch_config(Hq // Hkv, Dk, Dv, dtype, B * T)
    slots = partial_slots(n, skip_local)
    R = min(T, range_tokens(B, T, Hq, slots, max(Dk, Dv), dtype, {"partial_bytes": partial_bytes}))
    part = partial_dtype(dtype).itemsize
    # Index of one range: entries and block ids (int32), the sort's keys (16-bit, sorted, an int32
    # copy for the row search) and its int64 order.
    index = 24 * B * Hkv * R * slots
    forward = B * R * Hq * slots * (part * Dv + 4)
    span = cfg["bwd_BT"] * cfg["bwd_chunks"]
    items = _partial_items(B * Hkv, R, slots, span, num_virtual_blocks(T, sel_block, 1))
    pad = lambda d: max(16, next_pow2(d))  # noqa: E731
    dkv = 4 * items * pad(sel_block) * (pad(Dk) + pad(Dv))
    # dQ partials, dK/dV partials, fp32 dK/dV sums across ranges (sum_tokens, packed: its bound for
    # any documents), delta.
    ranges = 4 * B * sum_tokens(T, _ranges(T, R)[-1][0], sel_block, True) * Hkv * (Dk + Dv) if R < T else 0
    backward = B * R * Hq * slots * part * Dk + dkv + ranges + 4 * B * T * Hq
    return int(index + max(forward, backward))


def _partial_items(BH: int, R: int, n: int, span: int, Nv: int) -> int:
    """Rows of the backward's fp32 dK/dV partial buffers for a range of R tokens with at most n
    used slots each: only the items of
    blocks with several write one, and the work list puts those first (index.split_items_bound);
    at most all of its items."""
    return min(max_work_items(BH, R, n, span, Nv), split_items_bound(BH * R * n, span))


def _tiles(q: Tensor, k: Tensor, v: Tensor, G: int, tiles: dict | None) -> dict:
    tiles = tiles or {}
    unknown = sorted(set(tiles) - set(TILE_KEYS))
    if unknown:
        raise ValueError(f"unknown selected_attention tile keys {unknown}; allowed: {', '.join(TILE_KEYS)}")
    return {**launch_config(G, q.shape[-1], v.shape[-1], q.dtype, k.shape[0] * k.shape[1]), **tiles}


def query_heads(q: Tensor, q_heads: int) -> int:
    """Hq: q's third dim when q is [B, T, Hq, Dk] (q_heads 0), else q_heads (q folded [B, Hkv, R, Dk])."""
    return q_heads or q.shape[2]


def _launch(cfg: dict, pass_: str) -> dict:
    """Triton launch options of the forward ("fwd") or backward ("bwd") kernel; maxnreg 0: no cap."""
    return {"num_warps": cfg[f"{pass_}_warps"], "num_stages": cfg[f"{pass_}_stages"],
            "maxnreg": cfg[f"{pass_}_maxnreg"]}


def _gluon_runs(cfg: dict, pass_: str, q: Tensor, v: Tensor, consts: dict) -> bool:
    """Whether the forward ("fwd") or backward ("bwd") launches its Gluon kernel: asked for
    (cfg[pass_ + "_gluon"]), written for these inputs and chunks, G a power of two (the groups the
    GPU tests compared with the Triton kernels; padded groups keep those), and not traced by
    Dynamo itself (Inductor cannot launch a Gluon kernel; the ops' bodies run below Dynamo)."""
    rows = (gluon_kernels.FWD_ROWS, ) if pass_ == "fwd" else gluon_kernels.BWD_ROWS
    return (bool(cfg[f"{pass_}_gluon"]) and cfg[f"{pass_}_BT"] * consts["GP"] in rows and consts["GP"] == consts["G"]
            and gluon_kernels.applies(q, v, consts["BL"]) and not torch.compiler.is_dynamo_compiling())


def _pass_kernel(cfg: dict, pass_: str, q: Tensor, v: Tensor, consts: dict):
    """(kernel, launch options) of the forward ("fwd") or backward ("bwd") pass. Where _gluon_runs,
    the Gluon kernel (its layouts are written for 4 / 8 warps; it takes the Triton kernel's
    arguments) through the opaque op, which Inductor cannot replace; else the Triton kernel."""
    fwd = pass_ == "fwd"
    if _gluon_runs(cfg, pass_, q, v, consts):
        kernel = gluon_kernels._fwd_gluon_kernel if fwd else gluon_kernels._bwd_gluon_kernel
        warps = 4 if fwd else cfg["bwd_BT"] * consts["GP"] // 16
        late = dict(LATE_ROWS=consts["DKP"] <= 64) if fwd else {}
        return kernel, dict(opaque=True, num_warps=warps, maxnreg=cfg[f"{pass_}_maxnreg"], **late)
    return (kernels._fwd_kernel if fwd else kernels._bwd_kernel), _launch(cfg, pass_)


def _constexprs(q: Tensor, v: Tensor, G: int, sel_block: int, n: int, BT: int) -> dict:
    Dk, Dv = q.shape[-1], v.shape[-1]
    return dict(N=n, G=G, GP=next_pow2(G), BT=BT, BL=max(16, next_pow2(sel_block)), DK=Dk, DKP=max(16, next_pow2(Dk)),
                DV=Dv, DVP=max(16, next_pow2(Dv)), F32_DOT=q.device.type == "cpu", IEEE=q.dtype == torch.float32)


def _range_of(block_indices: Tensor, t0: int, t1: int) -> Tensor:
    """The selection of tokens [t0, t1), dense. A strided slice would give the index tensors
    (gid_bhtn) strides with gaps, which the kernels receive as numbers fixed at trace time; under
    torch.compile Inductor may lay such an intermediate out densely, and the kernels would then
    read past it."""
    return block_indices[:, :, t0:t1].contiguous()


def _ranges(T: int, R: int):
    """Token ranges [t0, t1) of at most R tokens covering [0, T)."""
    return [(t0, min(T, t0 + R)) for t0 in range(0, T, R)]


def sum_tokens(T: int, t0: int, sel_block: int, packed: bool) -> int:
    """Key rows of the backward's fp32 dK/dV sums when the last range starts at token t0: only
    blocks that start before t0 wait for earlier ranges. They end by the block boundary at or
    after t0 (a single sequence's blocks start at multiples of sel_block); with packed documents
    (blocks start at any token, cu_seqlens not read on the host) by t0 - 1 + sel_block."""
    end = t0 - 1 + sel_block if packed else -(-t0 // sel_block) * sel_block
    return min(T, end)


class SavedIndex(NamedTuple):
    """The forward's SelectionIndex of every token range, packed for the backward, which then
    builds only its work items (the index is the same; its sort and repeat check are ~90 us a
    range at g4, 64k). Range i of ranges [t0, t1) (_ranges) is gid[:, :, t0:t1], counts[i],
    offsets[i] and entries[B*Hkv*s*t0 : B*Hkv*s*t1]; blk_start / blk_end are every range's."""

    gid: Tensor
    """[B, Hkv, T, s] int32 (s = partial_slots)."""
    entries: Tensor
    """[B*Hkv*T*s] int32."""
    counts: Tensor
    """[ranges, B*Hkv*Nv] int32."""
    offsets: Tensor
    """[ranges, B*Hkv*Nv] int32."""
    blk_start: Tensor
    """[Nv] int32."""
    blk_end: Tensor
    """[Nv] int32."""


def saved_index_shapes(B: int, T: int, Hkv: int, n: int, sel_block: int, q: Tensor, k: Tensor, v: Tensor,
                       q_heads: int = 0, tiles: dict | None = None, skip_local: bool = False) -> SavedIndex:
    """The shapes of forward(keep_index=True)'s SavedIndex for these inputs, tiles and skip_local
    (one sequence a row), as tuples in its fields: for fake implementations."""
    Hq = query_heads(q, q_heads)
    cfg = _tiles(q, k, v, Hq // Hkv, tiles)
    slots = partial_slots(n, skip_local)
    R = range_tokens(B, T, Hq, slots, max(q.shape[-1], v.shape[-1]), q.dtype, cfg)
    Nv = num_virtual_blocks(T, sel_block, 1)
    ranges = len(_ranges(T, R)) if T > 0 else 0
    return SavedIndex((B, Hkv, T, slots), (B * Hkv * T * slots, ), (ranges, B * Hkv * Nv), (ranges, B * Hkv * Nv),
                      (Nv, ), (Nv, ))


def _pack(indices: list[SelectionIndex]) -> SavedIndex:
    return SavedIndex(torch.cat([i.gid_bhtn for i in indices], 2), torch.cat([i.entries for i in indices]),
                      torch.stack([i.counts for i in indices]), torch.stack([i.offsets for i in indices]),
                      indices[0].blk_start, indices[0].blk_end)


def _unpack(saved: SavedIndex, i: int, t0: int, t1: int) -> SelectionIndex:
    B, Hkv, _, n = saved.gid.shape
    # The range's own dense tensors (see _range_of on strided views).
    return SelectionIndex(saved.gid[:, :, t0:t1].contiguous(), saved.counts[i], saved.offsets[i],
                          saved.entries[B * Hkv * n * t0:B * Hkv * n * t1], saved.blk_start, saved.blk_end)


def forward(q, k, v, block_indices, cu_seqlens, scale: float, sel_block: int, tiles=None, q_heads: int = 0,
            local=None, keep_index: bool = False, unique: bool = False, into_local: bool = False):
    """(o [B,T,Hq,Dv] in q's dtype, lse [B,Hq,T] fp32 natural log) on the Triton path; with
    keep_index also the ranges' SavedIndex, which backward(index=) takes instead of
    building the index again.

    q [B, T, Hq, Dk], or with q_heads > 0 folded [B, Hkv, R >= T * G, Dk] (Hq = q_heads). local:
    None, or (o_loc, lse_loc) from the window op (ops.window.window_and_local): the partial over
    each token's two local blocks, merged in place of the slots that list them. unique: no token
    lists a block twice (the selection op's own output; build_index then skips its repeat check).
    into_local (with local): o is written over o_loc, folded [B, Hkv, T*G, Dv] as the window op
    gave it, each row merged where it lies: no second [T, Hq, Dv] beside the partial."""
    B, T, Hkv = k.shape[:3]
    Hq = query_heads(q, q_heads)
    G = Hq // Hkv
    if into_local:
        if local is None or local[0].shape != (B, Hkv, T * G, v.shape[-1]) or not local[0].is_contiguous():
            raise ValueError("forward: into_local needs the window op's local partial, o_loc [B, Hkv, T*G, Dv] "
                             "contiguous")
        o = local[0]
    else:
        o = torch.empty(B, T, Hq, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    indices = []
    for po, plse, index, t0 in _forward_ranges(q, k, v, block_indices, cu_seqlens, scale, sel_block, tiles, q_heads,
                                               local is not None, unique):
        _slot_sum(po, plse, index, o, group_strides(o, G, into_local), lse, t0, local=local, local_in_out=into_local)
        indices.append(index)
    if not keep_index:
        return o, lse
    if not indices:  # T = 0: no ranges, an index of saved_index_shapes' empty shapes
        shapes = saved_index_shapes(B, T, Hkv, block_indices.shape[-1], sel_block, q, k, v, q_heads, tiles,
                                    local is not None)
        return o, lse, SavedIndex(*(torch.zeros(shape, dtype=torch.int32, device=q.device) for shape in shapes))
    return o, lse, _pack(indices)


def forward_gated(q, k, v, block_indices, cu_seqlens, scale: float, sel_block: int, cmp_rows, head: int, o_win,
                  gates, tiles=None, q_heads: int = 0, local=None):
    """o = g_cmp o_cmp + g_sel o_sel + g_win o_win [B,T,Hq,Dv] in q's dtype on the Triton path: the
    forward with nsa_flex::gated_sum as the slot merge's epilogue (shapes as gated_sum takes them;
    local as forward's)."""
    cmp_rows, o_win, gates = dense(cmp_rows, o_win, gates)
    B, T, Hkv = k.shape[:3]
    Hq = query_heads(q, q_heads)
    o = torch.empty(B, T, Hq, v.shape[-1], dtype=q.dtype, device=q.device)
    for po, plse, index, t0 in _forward_ranges(q, k, v, block_indices, cu_seqlens, scale, sel_block, tiles, q_heads,
                                               local is not None):
        _, Tr, _, _, D = po.shape
        if B * Tr * Hq == 0:
            continue
        gid = index.gid_bhtn
        n = gid.shape[-1]
        GP = next_pow2(Hq // Hkv)
        DP = max(16, next_pow2(D))
        loc, loc_lse, loc_strides = _local_args(local, index)
        wrap_triton(merge_kernels._slot_gated_kernel)[(B * Tr * Hkv,)](
            po, plse, gid, cmp_rows, o_win, gates, o, loc, loc_lse, Tr, t0, Hkv, head, cmp_rows.shape[2],
            *po.stride()[:4], *plse.stride()[:3], *gid.stride()[:3], *cmp_rows.stride()[:3], *o_win.stride()[:3],
            *gates.stride()[:3], *o.stride()[:3], *loc_strides, N=n, NP=next_pow2(n), G=Hq // Hkv, GP=GP, D=D, DP=DP,
            LOCAL=local is not None, num_warps=_slot_warps(GP, DP))
    return o


def _local_args(local, index: SelectionIndex):
    """(loc, loc_lse, their 5 strides) for a merge kernel: the local partial's, or with none the
    index's int32 row counts and offsets in their place (never read; no other argument aliases them)."""
    if local is None:
        return index.counts, index.offsets, (0, 0, 0, 0, 0)
    o_loc, lse_loc = local
    return o_loc, lse_loc, (*o_loc.stride()[:3], *lse_loc.stride()[:2])


def without_local(block_indices: Tensor, sel_block: int, t0: int) -> Tensor:
    """block_indices [B, Hkv, T', n] of tokens t0 .. t0 + T' - 1 with every slot listing the token's
    own selection block or the one before set to -1 (unused): the window op's local partial
    covers those two blocks."""
    own = (torch.arange(block_indices.shape[2], device=block_indices.device) + t0) // sel_block
    own = own.view(1, 1, -1, 1)
    local = (block_indices == own) | (block_indices == own - 1)
    return torch.where(local, -1, block_indices)


def _forward_ranges(q, k, v, block_indices, cu_seqlens, scale: float, sel_block: int, tiles, q_heads: int,
                    skip_local: bool = False, unique: bool = False):
    """The forward kernel range by range: yields (partial o [B, T', Hq, n, Dv], partial lse [B, T', Hq, n],
    the range's SelectionIndex, its first token) for the caller's slot merge. skip_local: the
    slots of each token's two local blocks read nothing (without_local). unique: as forward's."""
    q, k, v = dense(q, k, v)
    B, T, Hkv = k.shape[:3]
    Hq = query_heads(q, q_heads)
    G, n, Dv = Hq // Hkv, block_indices.shape[-1], v.shape[-1]
    slots = partial_slots(n, skip_local)
    cfg = _tiles(q, k, v, G, tiles)
    consts = _constexprs(q, v, G, sel_block, entry_stride(slots), cfg["fwd_BT"])
    R = range_tokens(B, T, Hq, slots, max(q.shape[-1], Dv), q.dtype, cfg)
    kernel, how = _pass_kernel(cfg, "fwd", q, v, consts)
    for t0, t1 in _ranges(T, R):
        selection = _range_of(block_indices, t0, t1)
        if skip_local:
            selection = without_local(selection, sel_block, t0)
        index, items = index_and_items(selection, sel_block, cu_seqlens, cfg["fwd_BT"] * cfg["fwd_chunks"], t0, T,
                                       unique, slots)
        # The range's own buffers (not views of one buffer): see kernels.py on views.
        po = torch.empty(B, t1 - t0, Hq, slots, Dv, dtype=partial_dtype(q.dtype), device=q.device)
        plse = torch.empty(B, t1 - t0, Hq, slots, dtype=torch.float32, device=q.device)
        if items.blk.shape[0] > 0:
            launch(kernel, (items.blk.shape[0],),
                   q, k, v, po, plse, index.entries, items.blk, items.start, items.end, index.blk_start,
                   index.blk_end, Hkv, index.blk_start.shape[0], t0, scale, *group_strides(q, G, q_heads > 0),
                   *k.stride()[:3], *v.stride()[:3], *po.stride()[:4], *plse.stride()[:3], writes=(po, plse),
                   **consts, **how)
        yield po, plse, index, t0


def backward(do, q, k, v, o, lse, block_indices, cu_seqlens, scale: float, sel_block: int, tiles=None,
             q_heads: int = 0, *, gate=None, delta=None, skip_local: bool = False, acc=None,
             index: SavedIndex | None = None):
    """(dq, dk, dv) in the inputs' dtypes on the Triton path, dq in q's layout (a folded q's rows past
    T * G get zeros); lse and q_heads as forward takes and returns them.

    gate [B, Hq, T] fp32 (lse's layout): do is the gated sum's output gradient, the branch's being
    gate * dO, which the kernel takes as P' = g P (nothing written); delta must then be given. delta:
    rowsum(dO * O) [B, Hq, T] fp32 (computed here when None). skip_local: the slots of each token's
    two local blocks are left out (without_local): the window's backward took them. acc: None, or
    (dq, dk, dv) holding another gradient of q, k, v in these layouts (contiguous); the sums are
    added to them in place and they are returned. index: the forward's SavedIndex of this
    selection (forward(keep_index=True) with the same inputs, tiles and skip_local): only the work
    items are built."""
    q, k, v = dense(q, k, v)
    B, T, Hkv = k.shape[:3]
    Hq, Dk = query_heads(q, q_heads), q.shape[-1]
    G, n = Hq // Hkv, block_indices.shape[-1]
    folded = q_heads > 0
    slots = partial_slots(n, skip_local)
    cfg = _tiles(q, k, v, G, tiles)
    consts = _constexprs(q, v, G, sel_block, entry_stride(slots), cfg["bwd_BT"])
    R = range_tokens(B, T, Hq, slots, max(Dk, v.shape[-1]), q.dtype, cfg)
    ranges = _ranges(T, R)
    if index is not None and index.counts.shape[0] != len(ranges):
        raise ValueError(f"backward: the saved index has {index.counts.shape[0]} token ranges, these inputs "
                         f"{len(ranges)}; save it from forward with the same inputs and tiles")
    do, lse = dense(do, lse)
    if gate is not None and delta is None:
        raise ValueError("backward: a gate needs delta = rowsum(dO * o_sel) [B, Hq, T]")
    # delta = rowsum(dO * O) in fp32, [B, Hq, T] like lse (the kernel reads both at one offset).
    delta = _delta(do, o) if delta is None else dense(delta)[0]
    if gate is not None:
        gate, = dense(gate)
        if gate.shape != lse.shape or gate.stride() != lse.stride():
            raise ValueError(f"backward: gate {tuple(gate.shape)} must be laid out as lse {tuple(lse.shape)}")
    if acc is None:
        dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    else:
        dq, dk, dv = acc
        if (dq.shape, dk.shape, dv.shape) != (q.shape, k.shape, v.shape) or not all(x.is_contiguous() for x in acc):
            raise ValueError("backward: acc must be contiguous gradients shaped like q, k and v")
    kernel, how = _pass_kernel(cfg, "bwd", q, v, consts)
    # Several ranges run last first: a block is final in the range holding its first key (no
    # earlier token selects it), and until then its dK/dV wait in fp32 sums [B, Ts, Hkv, Dk / Dv].
    # So the sums hold only the blocks that earlier ranges still reach (those starting before the
    # last range: Ts keys, sum_tokens), and each block is written to dk / dv once (see
    # _block_sum_kernel).
    sums = len(ranges) > 1
    dk_sum = dv_sum = None
    if sums:
        Ts = sum_tokens(T, ranges[-1][0], sel_block, cu_seqlens is not None)
        dk_sum = torch.empty(B, Ts, Hkv, Dk, dtype=torch.float32, device=q.device)
        dv_sum = torch.empty(B, Ts, Hkv, v.shape[-1], dtype=torch.float32, device=q.device)
    span = cfg["bwd_BT"] * cfg["bwd_chunks"]
    for i, (t0, t1) in enumerate(reversed(ranges)):
        if index is None:
            selection = _range_of(block_indices, t0, t1)
            if skip_local:
                selection = without_local(selection, sel_block, t0)
            range_index, items = index_and_items(selection, sel_block, cu_seqlens, span, t0, T, slots=slots)
        else:
            range_index = _unpack(index, len(ranges) - 1 - i, t0, t1)
            items = work_items(range_index, span, t1 - t0, slots)
        W, Nv = items.blk.shape[0], range_index.blk_start.shape[0]
        dqp = torch.empty(B, t1 - t0, Hq, slots, Dk, dtype=partial_dtype(q.dtype), device=q.device)
        P = _partial_items(B * Hkv, t1 - t0, slots, span, Nv)
        dkp = torch.empty(P, consts["BL"], consts["DKP"], dtype=torch.float32, device=q.device)
        dvp = torch.empty(P, consts["BL"], consts["DVP"], dtype=torch.float32, device=q.device)
        # One range: no sums; the index's counts and offsets (int32 tensors no other argument
        # aliases) stand in for them, never read or written.
        sum_k, sum_v = (dk_sum, dv_sum) if sums else (range_index.counts, range_index.offsets)
        sum_strides = (*dk_sum.stride()[:3], *dv_sum.stride()[:3]) if sums else (0,) * 6
        finish = dict(SUMS=sums, ADD=i > 0, ACC=acc is not None)
        if W > 0:
            # A block's only item finishes it (dk, dv or the sums); the others write partials.
            launch(kernel, (W,),
                   q, k, v, do, lse, delta, delta if gate is None else gate, dqp, dkp, dvp, range_index.entries,
                   items.blk, items.start, items.end, range_index.blk_start, range_index.blk_end, items.n_items,
                   dk, dv, sum_k, sum_v, Hkv, Nv, t0, t1, scale, *group_strides(q, G, folded),
                   *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *lse.stride(),
                   *dqp.stride()[:4], *dk.stride()[:3], *dv.stride()[:3], *sum_strides,
                   writes=(dqp, dkp, dvp, dk, dv) + ((dk_sum, dv_sum) if sums else ()),
                   GATED=gate is not None, **finish, **consts, **how)
        if B * Hkv * Nv > 0:
            # The blocks with no item or several.
            wrap_triton(kernels._block_sum_kernel)[(B * Hkv * Nv,)](
                dkp, dvp, dk, dv, sum_k, sum_v, items.first_item, items.n_items, range_index.blk_start,
                range_index.blk_end, Hkv, Nv, t0, t1, *dk.stride()[:3], *dv.stride()[:3], *sum_strides, BL=consts["BL"],
                DK=Dk, DKP=consts["DKP"], DV=consts["DV"], DVP=consts["DVP"], **finish,
                num_warps=8 if consts["DKP"] + consts["DVP"] > 256 else 4)
        # The last range also zeroes a folded dq's rows past the sequence (keeps them, with acc).
        pad = q.shape[2] // G - T if folded and t1 == T else 0
        _slot_sum(dqp, None, range_index, dq, group_strides(dq, G, folded), None, t0, pad, acc=acc is not None)
    tail = q.shape[2] % G if folded else 0
    if tail and acc is None:
        # A folded q's last rows past its last whole token (R not a multiple of G): no token of
        # the slot sum reaches them.
        dq[:, :, q.shape[2] - tail:].zero_()
    return dq, dk, dv


def _delta(do: Tensor, o: Tensor) -> Tensor:
    """rowsum(dO * O) in fp32 as [B, Hq, T]: one pass over dO and O, ~64 rows per program."""
    o, = dense(o)
    B, T, Hq, D = o.shape
    delta = torch.empty(B, Hq, T, dtype=torch.float32, device=o.device)
    HP = next_pow2(Hq)
    TB = max(1, 64 // HP)
    if B * T * Hq > 0:
        wrap_triton(merge_kernels._delta_kernel)[(-(-T // TB), B)](
            do, o, delta, T, Hq, *do.stride()[:3], *o.stride()[:3], *delta.stride(), TB=TB, HP=HP, D=D,
            DP=max(16, next_pow2(D)), num_warps=4)
    return delta


def _index_and_items(block_indices, sel_block: int, cu_seqlens, span: int, positions, seq_len: int, unique: bool,
                     slots: int):
    index = build_index(block_indices, sel_block, cu_seqlens, positions, seq_len, unique, slots)
    return index, work_list(index, span, block_indices.shape[2], slots)


_COMPILED = {fn: torch.compile(fn, dynamic=False) for fn in (_index_and_items, work_list)}


def _compiled_or_plain(fn, x: Tensor, *args):
    """fn(*args), compiled once per shape on CUDA: eagerly the index's ~60 small kernels take more
    host time than the attention takes on the GPU at 8k tokens. While an outer torch.compile
    traces the op (or on CPU) the plain function runs, and the outer graph fuses it."""
    compiled = _COMPILED.get(fn)
    if compiled is not None and x.is_cuda and not _tracing(x):
        try:
            return compiled(*args)
        except Exception as exc:  # a compiler bug of this torch version: the same function, eagerly
            _COMPILED[fn] = None
            warnings.warn(f"selected_attention: compiling {fn.__name__} failed on torch {torch.__version__} "
                          f"({type(exc).__name__}: {exc}); it runs eagerly from now on (same result, more host "
                          f"time)")
    return fn(*args)


def index_and_items(block_indices, sel_block: int, cu_seqlens, span: int, t0: int, seq_len: int,
                    unique: bool = False, slots: int = 0):
    """(SelectionIndex, WorkList) of the token range [t0, t0 + T') whose selection is block_indices
    [B, Hkv, T', n] (see _compiled_or_plain; unique and slots as build_index takes them, 0: n)."""
    positions = None
    if cu_seqlens is not None:  # a single sequence needs no positions (every token is in it)
        positions = torch.arange(t0, t0 + block_indices.shape[2], device=block_indices.device)
    return _compiled_or_plain(_index_and_items, block_indices, block_indices, sel_block, cu_seqlens, span, positions,
                              seq_len, unique, slots or block_indices.shape[-1])


def work_items(index: SelectionIndex, span: int, T: int, n: int) -> WorkList:
    """The WorkList of a range's index, its tokens' used slots at most n (see _compiled_or_plain)."""
    return _compiled_or_plain(work_list, index.entries, index, span, T, n)


def _tracing(x: Tensor) -> bool:
    """True while torch.compile traces the op: Dynamo itself, or AOTAutograd / Inductor running the
    op's body on fake or functional tensors (where torch.compiler.is_compiling() is False). A
    nested compile there fails, and the outer graph takes the plain functions anyway."""
    return torch.compiler.is_compiling() or type(x) is not Tensor or torch._guards.TracingContext.try_get() is not None


def _slot_sum(part, plse, index: SelectionIndex, out, out_strides, lse, t0: int, pad: int = 0, local=None,
              acc: bool = False, local_in_out: bool = False) -> None:
    """out[b, t0 + t, hq] = the partials of (b, t, hq) of the range (one a place of its index row)
    merged (forward, plse given; with the local partial when given, as forward takes it) or summed
    (dQ, plse None);
    out_strides as nsa_flex.folded.group_strides gives them. pad: that many tokens after the range
    get zeros (rows of a folded dQ past the sequence). acc (sum only): add to what out holds.
    local_in_out: out is the local partial's own buffer (forward(into_local=True)), read there row
    by row."""
    B, T, Hq, _, D = part.shape
    if B * (T + pad) * Hq == 0:
        return
    merge = plse is not None
    gid = index.gid_bhtn
    n = gid.shape[-1]
    Hkv = gid.shape[1]
    G = Hq // Hkv
    # Without merge the lse pointers are never read or written: pass the index's block ids (an
    # int32 tensor no other argument aliases) in their place.
    plse_ = plse if merge else index.blk_start
    lse_ = lse if merge else index.blk_end
    sp = plse_.stride()[:3] if merge else (0, 0, 0)
    sl = lse_.stride()[:3] if merge else (0, 0, 0)
    GP, DP = next_pow2(G), max(16, next_pow2(D))
    loc, loc_lse, loc_strides = _local_args(local, index)
    if local_in_out:
        # out holds the partial: loc is never read, and the lse rows (alive anyway) stand in for it,
        # so that no launch takes the one buffer twice.
        loc = loc_lse
    wrap_triton(merge_kernels._slot_kernel)[(B * (T + pad) * Hkv,)](
        part, plse_, gid, out, lse_, loc, loc_lse, T, T + pad, t0, Hkv, *part.stride()[:4], *sp, *gid.stride()[:3],
        *out_strides, *sl, *loc_strides, N=n, NP=next_pow2(n), G=G, GP=GP, D=D, DP=DP, MERGE=merge,
        LOCAL=local is not None, ACC=acc, LOCAL_IN_OUT=local_in_out, num_warps=_slot_warps(GP, DP))


def _slot_warps(GP: int, DP: int) -> int:
    """Warps of a slot kernel program ([G', D'] rows): ~8 elements (16 bytes of 16-bit partials)
    per thread and load."""
    return max(1, min(8, GP * DP // 256))
