"""The cache update of one decode step in one launch: the op nsa_flex::cache_step.

A decode step writes the new token's keys/values into the cache (the selected branch's, the
window's where they are separate, and the cmp branch's un-rotated ones into the tail ring)
and, one step in d, compresses the block that token completes (phi, as nsa_flex::phi_step).
As separate ops that was an Inductor scatter kernel and one phi_step launch each for k and
v; on an H200 at B=1 each launch cost ~1.7 us of a ~33 us step, mostly latency
(docs/records/decode_separate_cache_ops_h200.json). Here one Triton launch writes the tokens and,
where a block completes, runs phi as two matmuls over blocks of (sequence, kv head) rows, w1
split by tokens over several programs (_phi_rows). The programs of a block of rows count
themselves in NSACache.phi_count; the last finishes phi.

Why the split: phi in one program per head, going over w1 (1 MB at H1 = D = 128) tile after
tile, took ~28 us where a block completed, and the compressed pass waits for the new entry.
Split over programs, the cache update costs the step 0.5 us at B=8 and 1.5 us at B=1, 64k
(docs/decisions.md, "Decode: the cache update").

Off CUDA, without Triton, or with head/hidden widths that are not powers of two >= 16 (the
phi kernel's tiles), the op runs its torch twin: the scatter writes (write_token_torch) and
phi_step's twin.
"""

# No `from __future__ import annotations` here: torch.library reads the op's annotations.
from typing import Optional

import torch
from torch import Tensor, nn
from torch.library import custom_op

from nsa_flex.ops import triton_utils
from nsa_flex.ops.triton_utils import next_pow2
from nsa_flex.ops.decode import kernels
from nsa_flex.ops.decode.phi_step import _DTYPES, _phi_step_torch, phi_chunk_tokens, phi_params

if kernels.HAS_TRITON:
    import triton
    import triton.language as tl
    from torch.library import wrap_triton

    from nsa_flex.ops.triton_utils import global_time, pdl_wait, store_trace
    from nsa_flex.ops.decode.phi_step import _phi_fresh


def cache_step(tokens: tuple[Tensor, ...], caches: tuple[Optional[Tensor], ...], pos: Tensor, phi_k: nn.Module,
               phi_v: nn.Module, cmp_block: int, cmp_stride: int, *, phi_count: Optional[Tensor] = None) -> None:
    """Writes one token per sequence at positions pos [B] and compresses where a block completes.

    tokens: (k, v, k_win, v_win, k_cmp, v_cmp), each [B, Hkv, D] (k_win/v_win None without
    separate window projections; k_cmp/v_cmp are phi's un-rotated inputs); caches: (k, v, k_win,
    v_win, k_tail, v_tail, k_cmp, v_cmp) of an NSACache (k_win/v_win None likewise), updated in
    place; phi_k, phi_v: the layer's Compressors. phi_count: the NSACache's (see check_phi_count),
    where the programs sharing a completed block's phi count themselves; without it the kernel
    counts in a zeroed tensor of its own (one more launch).
    """
    check_tokens(tokens, caches)
    check_phi_count(phi_count, caches[0])
    k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok = tokens
    k, v, k_win, v_win, k_tail, v_tail, k_cmp, v_cmp = caches
    torch.ops.nsa_flex.cache_step(k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok, k, v, k_win, v_win, k_tail, v_tail,
                                  k_cmp, v_cmp, pos, phi_count, *phi_params(phi_k), *phi_params(phi_v), cmp_block,
                                  cmp_stride)


def check_tokens(tokens: tuple[Optional[Tensor], ...], caches: tuple[Optional[Tensor], ...]) -> None:
    """The window pair: tokens and caches both given (separate K/V) or both None."""
    if (tokens[2] is None) != (caches[2] is None) or (tokens[3] is None) != (caches[3] is None):
        raise ValueError("window tokens and window caches must both be given (separate K/V) or both be None")


def check_phi_count(phi_count: Optional[Tensor], k: Tensor) -> None:
    """phi_count: None, or int32 [B, Hkv, 2] on the cache's device, as NSACache allocates it.

    The kernel's programs of a (sequence, kv head, keys or values) count themselves in there, and
    the last one to arrive finishes phi and sets the count back to 0; so it must hold zeros when
    first given (NSACache zero-fills it) and serve one cache only.
    """
    if phi_count is None:
        return
    want = (k.shape[0], k.shape[1], 2)
    if phi_count.dtype != torch.int32 or tuple(phi_count.shape) != want or phi_count.device != k.device \
            or not phi_count.is_contiguous():
        raise ValueError(f"phi_count must be a contiguous int32 tensor of shape {list(want)} on {k.device} "
                         f"(NSACache.phi_count); got {phi_count.dtype} {list(phi_count.shape)} on {phi_count.device}")


def write_token_torch(tokens: tuple[Optional[Tensor], ...], caches: tuple[Optional[Tensor], ...], pos: Tensor,
                      cmp_block: int) -> None:
    """The token's writes alone, as scatter ops (the twin's, and decode's impl="torch" path):
    tokens and caches as cache_step's; the tail ring slot of position p is p % l."""
    k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok = tokens
    k, v, k_win, v_win, k_tail, v_tail, _, _ = caches
    b = torch.arange(pos.shape[0], device=pos.device)
    for cache, tok in ((k, k_tok), (v, v_tok), (k_win, kw_tok), (v_win, vw_tok)):
        if cache is not None:
            cache[b, :, pos] = tok.to(cache.dtype)
    slot_b = torch.remainder(pos, cmp_block)
    k_tail[b, :, slot_b] = kc_tok.to(k_tail.dtype)
    v_tail[b, :, slot_b] = vc_tok.to(v_tail.dtype)


def _cache_step_impl(
    k_tok: Tensor, v_tok: Tensor, kw_tok: Optional[Tensor], vw_tok: Optional[Tensor], kc_tok: Tensor, vc_tok: Tensor,
    k: Tensor, v: Tensor, k_win: Optional[Tensor], v_win: Optional[Tensor], k_tail: Tensor, v_tail: Tensor,
    k_cmp: Tensor, v_cmp: Tensor, pos: Tensor, phi_count: Optional[Tensor],
    pe_k: Tensor, w1_k: Tensor, b1_k: Optional[Tensor], w2_k: Tensor, b2_k: Optional[Tensor],
    pe_v: Tensor, w1_v: Tensor, b1_v: Optional[Tensor], w2_v: Tensor, b2_v: Optional[Tensor],
    cmp_block: int, cmp_stride: int,
) -> None:
    run_cache_step(k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok, k, v, k_win, v_win, k_tail, v_tail, k_cmp, v_cmp,
                   pos, phi_count, pe_k, w1_k, b1_k, w2_k, b2_k, pe_v, w1_v, b1_v, w2_v, b2_v, cmp_block, cmp_stride)


def run_cache_step(k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok, k, v, k_win, v_win, k_tail, v_tail, k_cmp, v_cmp,
                   pos, phi_count, pe_k, w1_k, b1_k, w2_k, b2_k, pe_v, w1_v, b1_v, w2_v, b2_v, cmp_block: int,
                   cmp_stride: int) -> tuple[Tensor, ...]:
    """The op's body. Returns the tensors the Triton kernel reads (copies made for it included):
    a caller that launches more kernels right after it keeps them alive until those have
    launched, so that no allocation of theirs can take that memory while the kernel, which lets
    the next one start early (PDL), may still read it. Empty on the torch path."""
    caches = (k, v, k_win, v_win, k_tail, v_tail, k_cmp, v_cmp)
    widths = (k.shape[-1], v.shape[-1], w1_k.shape[0], w1_v.shape[0], w2_k.shape[0], w2_v.shape[0])
    usable = (kernels.HAS_TRITON and k.device.type == "cuda" and w1_k.dtype in _DTYPES
              and w1_v.dtype in _DTYPES and all(x is None or x.is_contiguous() for x in caches)
              and all(n >= 16 and n & (n - 1) == 0 for n in widths)
              and w2_k.shape[0] == k.shape[-1] and w2_v.shape[0] == v.shape[-1])
    if usable:
        return cache_step_triton(k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok, *caches, pos, phi_count,
                                  (pe_k, w1_k, b1_k, w2_k, b2_k), (pe_v, w1_v, b1_v, w2_v, b2_v), cmp_block,
                                  cmp_stride)
    write_token_torch((k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok), caches, pos, cmp_block)
    _phi_step_torch(k_tail, k_cmp, pos, pe_k, w1_k, b1_k, w2_k, b2_k, cmp_block, cmp_stride)
    _phi_step_torch(v_tail, v_cmp, pos, pe_v, w1_v, b1_v, w2_v, b2_v, cmp_block, cmp_stride)
    return ()


# A custom_op, opaque to Inductor, not a triton_op: Inductor launches a triton_op's kernels
# itself and drops launch_pdl on the way (ops/decode/kernels.py, pdl_wait).
_cache_step_op = custom_op(
    "nsa_flex::cache_step",
    mutates_args=("k", "v", "k_win", "v_win", "k_tail", "v_tail", "k_cmp", "v_cmp", "phi_count"),
)(_cache_step_impl)


@_cache_step_op.register_fake
def _cache_step_fake(*args) -> None:
    return None


def phi_rows(rows: int) -> int:
    """Rows (sequence x kv head) per program of phi's matmuls: a power of two, 16 to 64."""
    return min(64, max(16, next_pow2(rows)))


def cache_step_triton(k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok, k, v, k_win, v_win, k_tail, v_tail, k_cmp,
                       v_cmp, pos, phi_count, phi_k, phi_v, cmp_block: int, cmp_stride: int, *,
                       phi_tokens: Optional[int] = None, rows: Optional[int] = None,
                       trace: Optional[Tensor] = None) -> tuple[Tensor, ...]:
    """phi_tokens, rows: tokens and rows per phi program (tests; by default w1's slice is at
    most 64 KB, 2 tokens at H1 = D = 128 in bf16, so that it fits in shared memory; phi_rows). Without phi_count the kernel counts in a zeroed tensor of its own (one more
    launch). trace: an int64 [programs, 5] tensor for the programs' timeline (kernels.store_trace;
    bench/decode_timeline_gpu.py)."""
    B, Hkv, T, Dk = k.shape
    Dv = v.shape[-1]
    separate = k_win is not None
    toks = [x if x.stride(-1) == 1 else x.contiguous() for x in (k_tok, v_tok, kc_tok, vc_tok)]
    k_tok, v_tok, kc_tok, vc_tok = toks
    kw_tok, vw_tok = (x if x.stride(-1) == 1 else x.contiguous() for x in (kw_tok, vw_tok)) if separate else (k_tok,
                                                                                                               v_tok)
    k_win, v_win = (k_win, v_win) if separate else (k, v)
    (pe_k, w1_k, b1_k, w2_k, b2_k), (pe_v, w1_v, b1_v, w2_v, b2_v) = (
        (pe.contiguous(), w1.contiguous(), b1, w2.contiguous(), b2) for pe, w1, b1, w2, b2 in (phi_k, phi_v))
    H1 = max(w1_k.shape[0], w1_v.shape[0])
    RB = rows or phi_rows(B * Hkv)
    tpc = phi_tokens or phi_chunk_tokens(cmp_block, H1, max(Dk, Dv),
                                         (1 << 16) // max(w1_k.element_size(), w1_v.element_size()))
    chunks = -(-cmp_block // tpc)
    nrb = -(-B * Hkv // RB)
    if phi_count is None:
        phi_count = torch.zeros((B, Hkv, 2), dtype=torch.int32, device=k.device)
    # The chunks' first-layer sums, per side and block of rows.
    parts = torch.empty((2, nrb, chunks, RB, H1), dtype=torch.float32, device=k.device)
    kernels.check_trace(trace, nrb * 2 * chunks)
    wrap_triton(_cache_step_kernel)[(nrb, 2 * chunks)](
        k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok, k, v, k_win, v_win, k_tail, v_tail, k_cmp, v_cmp, pos,
        phi_count, parts,
        pe_k, w1_k, w1_k if b1_k is None else b1_k, w2_k, w2_k if b2_k is None else b2_k,
        pe_v, w1_v, w1_v if b1_v is None else b1_v, w2_v, w2_v if b2_v is None else b2_v,
        B * Hkv, T, k_cmp.shape[2],
        *(s for x in (k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok) for s in x.stride()[:2]),
        HKV=Hkv, L=cmp_block, STRIDE=cmp_stride, DK=Dk, DV=Dv, H1K=w1_k.shape[0], H1V=w1_v.shape[0], H1=H1,
        SEPARATE=separate, HAS_B1K=b1_k is not None, HAS_B2K=b2_k is not None, HAS_B1V=b1_v is not None,
        HAS_B2V=b2_v is not None, RB=RB, TPC=tpc, CHUNKS=chunks, F32_DOT=k.device.type == "cpu",
        trace_ptr=pos if trace is None else trace, TRACE=trace is not None, num_warps=8,
        **triton_utils.pdl_launch(k.device, True),
    )
    return (k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok, pe_k, w1_k, w2_k, pe_v, w1_v, w2_v, parts)


if kernels.HAS_TRITON:

    @triton.jit
    def _cache_step_kernel(
        kt_ptr, vt_ptr, kwt_ptr, vwt_ptr, kct_ptr, vct_ptr, k_ptr, v_ptr, kw_ptr, vw_ptr, ktail_ptr, vtail_ptr,
        kc_ptr, vc_ptr, pos_ptr, count_ptr, parts_ptr, pe_k, w1_k, b1_k, w2_k, b2_k, pe_v, w1_v, b1_v, w2_v, b2_v,
        BH, T, Tc,
        skt_b, skt_h, svt_b, svt_h, skwt_b, skwt_h, svwt_b, svwt_h, skct_b, skct_h, svct_b, svct_h,
        HKV: tl.constexpr, L: tl.constexpr, STRIDE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        H1K: tl.constexpr, H1V: tl.constexpr, H1: tl.constexpr, SEPARATE: tl.constexpr, HAS_B1K: tl.constexpr,
        HAS_B2K: tl.constexpr, HAS_B1V: tl.constexpr, HAS_B2V: tl.constexpr, RB: tl.constexpr, TPC: tl.constexpr,
        CHUNKS: tl.constexpr, F32_DOT: tl.constexpr, PDL: tl.constexpr, trace_ptr, TRACE: tl.constexpr,
    ):
        """Program (block of RB rows = sequence * kv head, chunk * 2 + side), side 0 the keys,
        side 1 the values: chunk 0 writes the rows' tokens; where a row's pos completes a block,
        each chunk's program multiplies the rows' inputs over its TPC tokens by w1's slice, and
        the last of them finishes phi for the block of rows (_phi_rows). With PDL it is
        launched before the kernel ahead of it ends and waits for it first (the tokens come from
        there), then lets decode_attend's first kernel launch."""
        t_entry = global_time(tl.program_id(0)) if TRACE else 0
        rb = tl.program_id(0) + pdl_wait(tl.program_id(0), PDL)
        t_rel = global_time(rb) if TRACE else 0
        side = tl.program_id(1) % 2
        chunk = tl.program_id(1) // 2
        r = rb * RB + tl.arange(0, RB)
        ok = r < BH
        b = r // HKV
        h = r % HKV
        # A position past the cache is a caller's bug (decode checks it eagerly); clamped, it
        # cannot write out of bounds.
        pos = tl.minimum(tl.load(pos_ptr + b, mask=ok, other=0), T - 1)
        sync = side * tl.num_programs(0) + rb
        count, parts = count_ptr + sync, parts_ptr + sync.to(tl.int64) * CHUNKS * RB * H1
        if side == 0:
            _write_compress(kt_ptr + b * skt_b + h * skt_h, kwt_ptr + b * skwt_b + h * skwt_h,
                            kct_ptr + b * skct_b + h * skct_h, k_ptr, kw_ptr, ktail_ptr, kc_ptr, r, ok, pos, T, Tc,
                            pe_k, w1_k, b1_k, w2_k, b2_k, count, parts, chunk, L, STRIDE, DK, H1K, SEPARATE,
                            HAS_B1K, HAS_B2K, RB, TPC, CHUNKS, F32_DOT)
        else:
            _write_compress(vt_ptr + b * svt_b + h * svt_h, vwt_ptr + b * svwt_b + h * svwt_h,
                            vct_ptr + b * svct_b + h * svct_h, v_ptr, vw_ptr, vtail_ptr, vc_ptr, r, ok, pos, T, Tc,
                            pe_v, w1_v, b1_v, w2_v, b2_v, count, parts, chunk, L, STRIDE, DV, H1V, SEPARATE,
                            HAS_B1V, HAS_B2V, RB, TPC, CHUNKS, F32_DOT)
        store_trace(trace_ptr, t_entry, t_rel, t_rel, TRACE)

    @triton.jit
    def _write_compress(tok_ptrs, wtok_ptrs, ctok_ptrs, cache_ptr, win_ptr, tail_ptr, cmp_ptr, r, ok, pos, T, Tc,
                        pe_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, count_ptr, parts_ptr, chunk, L: tl.constexpr,
                        STRIDE: tl.constexpr, D: tl.constexpr, H1: tl.constexpr, SEPARATE: tl.constexpr,
                        HAS_B1: tl.constexpr, HAS_B2: tl.constexpr, RB: tl.constexpr, TPC: tl.constexpr,
                        CHUNKS: tl.constexpr, F32_DOT: tl.constexpr):
        """One side of the step for a block of rows (contiguous [B, Hkv, *, D] caches; the
        token pointers [RB] at each row's token)."""
        d = tl.arange(0, D)
        r = r.to(tl.int64)
        if chunk == 0:
            m = ok[:, None]
            dst = (r * T + pos)[:, None] * D + d[None, :]
            tl.store(cache_ptr + dst, tl.load(tok_ptrs[:, None] + d[None, :], mask=m).to(cache_ptr.dtype.element_ty),
                     mask=m)
            if SEPARATE:
                tl.store(win_ptr + dst,
                         tl.load(wtok_ptrs[:, None] + d[None, :], mask=m).to(win_ptr.dtype.element_ty), mask=m)
            tl.store(tail_ptr + (r * L + pos % L)[:, None] * D + d[None, :],
                     tl.load(ctok_ptrs[:, None] + d[None, :], mask=m).to(tail_ptr.dtype.element_ty), mask=m)
        fresh = _phi_fresh(pos, Tc, L, STRIDE) & ok
        if tl.max(fresh.to(tl.int32), axis=0) > 0:
            _phi_rows(tail_ptr + r * L * D, ctok_ptrs, cmp_ptr + r * Tc * D, fresh, pos, pe_ptr, w1_ptr, b1_ptr,
                      w2_ptr, b2_ptr, count_ptr, parts_ptr, chunk, L, STRIDE, D, H1, HAS_B1, HAS_B2, RB, TPC, CHUNKS,
                      F32_DOT)

    @triton.jit
    def _phi_rows(tails, toks, cmps, fresh, pos, pe_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, count_ptr, parts_ptr,
                  chunk, L: tl.constexpr, STRIDE: tl.constexpr, D: tl.constexpr, H1: tl.constexpr,
                  HAS_B1: tl.constexpr, HAS_B2: tl.constexpr, RB: tl.constexpr, TPC: tl.constexpr,
                  CHUNKS: tl.constexpr, F32_DOT: tl.constexpr):
        """phi for the fresh rows of a block (pointers [RB] at each row's ring, token and
        compressed cache) over CHUNKS programs, as two matmuls: each program multiplies the
        rows' inputs over its TPC tokens, [RB, TPC * D], by w1's slice and stores the sums; the
        last to count itself in (it then sees every chunk's) adds them in chunk order, applies
        bias and GELU, multiplies by w2 and stores the fresh rows' entries, and sets the count
        back to 0 for the next block. Rounding as the module's (see phi_step): inputs and the
        hidden layer in w1's dtype, products summed in fp32.
        The layouts measured against this one: docs/decisions.md, "Decode: the cache update"."""
        dtype = w1_ptr.dtype.element_ty
        KC: tl.constexpr = TPC * D
        kk = tl.arange(0, KC)
        j = chunk * TPC + kk // D
        dd = kk % D
        jok = j < L
        m = fresh[:, None] & jok[None, :]
        # Token pos - L + 1 + j sits at ring slot (pos - L + 1 + j) % L; the block's last one
        # (slot pos % L, which chunk 0 writes) comes from the input.
        last = (j == L - 1)[None, :]
        x = tl.load(tails[:, None] + (((pos[:, None] - L + 1 + j[None, :]) % L) * D + dd[None, :]), mask=m & ~last,
                    other=0.0)
        tok = tl.load(toks[:, None] + dd[None, :], mask=m & last, other=0.0).to(tails.dtype.element_ty)
        pe = tl.load(pe_ptr + j * D + dd, mask=jok, other=0.0)
        x = tl.where(last, tok, x).to(dtype) + pe.to(dtype)[None, :]
        hh = tl.arange(0, H1)
        # Block pointers: a [KC, H1] tensor of 64-bit addresses took 255 registers and spilled.
        w1 = tl.load(tl.make_block_ptr(w1_ptr, (H1, L * D), (L * D, 1), (0, chunk * KC), (H1, KC), (1, 0)),
                     boundary_check=(1,), padding_option="zero")
        rr = tl.arange(0, RB)
        tl.store(parts_ptr + chunk * RB * H1 + rr[:, None] * H1 + hh[None, :], _phi_dot(x, tl.trans(w1), F32_DOT))
        # The barrier orders every thread's stores before the count; acq_rel publishes them and
        # acquires the other programs' (whose sums are then read at L2, .cg).
        tl.debug_barrier()
        if tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == CHUNKS - 1:
            tl.store(count_ptr, 0)
            # Four chunks' sums in flight at a time: all of them unrolled took 255 registers and spilled.
            acc = tl.zeros([RB, H1], dtype=tl.float32)
            for i0 in range(0, CHUNKS, 4):
                for i in tl.static_range(4):
                    acc += tl.load(parts_ptr + (i0 + i) * RB * H1 + rr[:, None] * H1 + hh[None, :],
                                   mask=i0 + i < CHUNKS, other=0.0, cache_modifier=".cg")
            if HAS_B1:
                acc += tl.load(b1_ptr + hh).to(tl.float32)[None, :]
            hid = acc.to(dtype).to(tl.float32)
            hid = (0.5 * hid * (1.0 + tl.math.erf(hid * 0.7071067811865476))).to(dtype)
            outs = tl.arange(0, D)
            w2 = tl.load(tl.make_block_ptr(w2_ptr, (D, H1), (H1, 1), (0, 0), (D, H1), (1, 0)))
            out = _phi_dot(hid, tl.trans(w2), F32_DOT)
            if HAS_B2:
                out += tl.load(b2_ptr + outs).to(tl.float32)[None, :]
            entry = (pos + 1 - L) // STRIDE
            tl.store(cmps[:, None] + entry[:, None] * D + outs[None, :], out.to(dtype).to(cmps.dtype.element_ty),
                     mask=fresh[:, None])

    @triton.jit
    def _phi_dot(a, b, F32_DOT: tl.constexpr):
        """a @ b summed in fp32: on tensor cores in 16 bits, in fp32 (ieee) otherwise and under the
        interpreter, whose dot misreads bf16."""
        if F32_DOT or (a.dtype == tl.float32):
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(a, b)
