"""The cache update of one decode step in one launch: the op nsa_flex::cache_step.

A decode step writes the new token's keys/values into the cache (the selected branch's, the
window's where they are separate, and the cmp branch's un-rotated ones into the tail ring)
and, one step in d, compresses the block that token completes (phi, as nsa_flex::phi_step).
As separate ops that was an Inductor scatter kernel and one phi_step launch each for k and
v; on an H200 at B=1 each launch costs ~1.7 us of a ~33 us step, mostly latency
(bench/results/2026-11-22_h200_decode_v4.json). Here one Triton program per (sequence, kv
head, keys or values) writes the token and, where a block completes, runs phi on the ring
it has just written (a CTA barrier makes the new slot visible to the program's threads).

Off CUDA, without Triton, or with head/hidden widths that are not powers of two >= 16 (the
phi kernel's tiles), the op runs its torch twin: the scatter writes (write_token_torch) and
phi_step's twin.
"""

# No `from __future__ import annotations` here: torch.library reads the op's annotations.
from typing import Optional

import torch
from torch import Tensor, nn
from torch.library import custom_op

from nsa_flex.ops import decode_triton
from nsa_flex.ops.phi_step import _DTYPES, PHI_WARPS, _phi_step_torch, phi_chunk_tokens, phi_params

if decode_triton.HAS_TRITON:
    import triton
    import triton.language as tl
    from torch.library import wrap_triton

    from nsa_flex.ops.decode_triton import _pdl_wait
    from nsa_flex.ops.phi_step import _phi_finish, _phi_fresh, _phi_partial, _phi_w1, _phi_x


def cache_step(tokens: tuple[Tensor, ...], caches: tuple[Optional[Tensor], ...], pos: Tensor, phi_k: nn.Module,
               phi_v: nn.Module, cmp_block: int, cmp_stride: int, *, phi_count: Optional[Tensor] = None) -> None:
    """Writes one token per sequence at positions pos [B] and compresses where a block completes.

    tokens: (k, v, k_win, v_win, k_cmp, v_cmp), each [B, Hkv, D] (k_win/v_win None without
    separate window projections; k_cmp/v_cmp are phi's un-rotated inputs); caches: (k, v, k_win,
    v_win, k_tail, v_tail, k_cmp, v_cmp) of an NSACache (k_win/v_win None likewise), updated in
    place; phi_k, phi_v: the layer's Compressors. phi_count: the NSACache's (see check_phi_count):
    with it the kernel splits a completed block's phi over several programs per head.
    """
    check_tokens(tokens, caches)
    check_phi_count(phi_count, pos, caches[0])
    k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok = tokens
    k, v, k_win, v_win, k_tail, v_tail, k_cmp, v_cmp = caches
    torch.ops.nsa_flex.cache_step(k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok, k, v, k_win, v_win, k_tail, v_tail,
                                  k_cmp, v_cmp, pos, phi_count, *phi_params(phi_k), *phi_params(phi_v), cmp_block,
                                  cmp_stride)


def check_tokens(tokens: tuple[Optional[Tensor], ...], caches: tuple[Optional[Tensor], ...]) -> None:
    """The window pair: tokens and caches both given (separate K/V) or both None."""
    if (tokens[2] is None) != (caches[2] is None) or (tokens[3] is None) != (caches[3] is None):
        raise ValueError("window tokens and window caches must both be given (separate K/V) or both be None")


def check_phi_count(phi_count: Optional[Tensor], pos: Tensor, k: Tensor) -> None:
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
    usable = (decode_triton.HAS_TRITON and k.device.type == "cuda" and w1_k.dtype in _DTYPES
              and w1_v.dtype in _DTYPES and all(x is None or x.is_contiguous() for x in caches)
              and all(n >= 16 and n & (n - 1) == 0 for n in widths)
              and w2_k.shape[0] == k.shape[-1] and w2_v.shape[0] == v.shape[-1])
    if usable:
        return _cache_step_triton(k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok, *caches, pos, phi_count,
                                  (pe_k, w1_k, b1_k, w2_k, b2_k), (pe_v, w1_v, b1_v, w2_v, b2_v), cmp_block,
                                  cmp_stride)
    write_token_torch((k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok), caches, pos, cmp_block)
    _phi_step_torch(k_tail, k_cmp, pos, pe_k, w1_k, b1_k, w2_k, b2_k, cmp_block, cmp_stride)
    _phi_step_torch(v_tail, v_cmp, pos, pe_v, w1_v, b1_v, w2_v, b2_v, cmp_block, cmp_stride)
    return ()


# A custom_op, opaque to Inductor, not a triton_op: Inductor launches a triton_op's kernels
# itself and drops launch_pdl on the way (ops/decode_triton.py, _pdl_wait).
_cache_step_op = custom_op(
    "nsa_flex::cache_step",
    mutates_args=("k", "v", "k_win", "v_win", "k_tail", "v_tail", "k_cmp", "v_cmp", "phi_count"),
)(_cache_step_impl)


@_cache_step_op.register_fake
def _cache_step_fake(*args) -> None:
    return None


LAUNCH = {"maxnreg": 128}
"""The kernel's register cap. Uncapped, ptxas gives it 255 registers (one program per SM, while
most programs return at once); at 128 it spills 100 bytes, on the path where a block completes.
bench/decode_step_gap_gpu.py --cache-step-maxnreg times another."""


def _cache_step_triton(k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok, k, v, k_win, v_win, k_tail, v_tail, k_cmp,
                       v_cmp, pos, phi_count, phi_k, phi_v, cmp_block: int, cmp_stride: int, *,
                       phi_tokens: Optional[int] = None) -> tuple[Tensor, ...]:
    """phi_tokens: tokens per phi program (tests; default phi_chunk_tokens). Without phi_count
    the kernel counts in a zeroed tensor of its own (one more launch)."""
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
    tpc = phi_tokens or phi_chunk_tokens(cmp_block, H1, max(Dk, Dv))
    chunks = -(-cmp_block // tpc)
    if phi_count is None:
        phi_count = torch.zeros((B, Hkv, 2), dtype=torch.int32, device=k.device)
    # The chunks' first-layer sums.
    parts = torch.empty((B * Hkv, 2, chunks, H1), dtype=torch.float32, device=k.device)
    wrap_triton(_cache_step_kernel)[(B * Hkv, 2 * chunks)](
        k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok, k, v, k_win, v_win, k_tail, v_tail, k_cmp, v_cmp, pos,
        phi_count, parts,
        pe_k, w1_k, w1_k if b1_k is None else b1_k, w2_k, w2_k if b2_k is None else b2_k,
        pe_v, w1_v, w1_v if b1_v is None else b1_v, w2_v, w2_v if b2_v is None else b2_v,
        T, k_cmp.shape[2],
        *(s for x in (k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok) for s in x.stride()[:2]),
        HKV=Hkv, L=cmp_block, STRIDE=cmp_stride, DK=Dk, DV=Dv, H1K=w1_k.shape[0], H1V=w1_v.shape[0], H1=H1,
        SEPARATE=separate, HAS_B1K=b1_k is not None, HAS_B2K=b2_k is not None, HAS_B1V=b1_v is not None,
        HAS_B2V=b2_v is not None, TPC=tpc, CHUNKS=chunks, num_warps=PHI_WARPS, **LAUNCH,
        **decode_triton.pdl_launch(k.device, True),
    )
    return (k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok, pe_k, w1_k, w2_k, pe_v, w1_v, w2_v, parts)


if decode_triton.HAS_TRITON:

    @triton.jit
    def _cache_step_kernel(
        kt_ptr, vt_ptr, kwt_ptr, vwt_ptr, kct_ptr, vct_ptr, k_ptr, v_ptr, kw_ptr, vw_ptr, ktail_ptr, vtail_ptr,
        kc_ptr, vc_ptr, pos_ptr, count_ptr, parts_ptr, pe_k, w1_k, b1_k, w2_k, b2_k, pe_v, w1_v, b1_v, w2_v, b2_v,
        T, Tc,
        skt_b, skt_h, svt_b, svt_h, skwt_b, skwt_h, svwt_b, svwt_h, skct_b, skct_h, svct_b, svct_h,
        HKV: tl.constexpr, L: tl.constexpr, STRIDE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        H1K: tl.constexpr, H1V: tl.constexpr, H1: tl.constexpr, SEPARATE: tl.constexpr, HAS_B1K: tl.constexpr,
        HAS_B2K: tl.constexpr, HAS_B1V: tl.constexpr, HAS_B2V: tl.constexpr, TPC: tl.constexpr, CHUNKS: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Program (sequence * kv head, chunk * 2 + side), side 0 the keys, side 1 the values:
        chunk 0 writes the token; where pos completes a block, each chunk's program takes phi's
        first layer over its TPC tokens, and the last to finish the rest (_phi_split). With PDL
        it is launched before the kernel ahead of it ends and waits for it first (the tokens come
        from there), then lets decode_attend's first kernel launch."""
        bh = tl.program_id(0) + _pdl_wait(tl.program_id(0), PDL)
        side = tl.program_id(1) % 2
        chunk = tl.program_id(1) // 2
        b = bh // HKV
        h = bh % HKV
        # A position past the cache is a caller's bug (decode checks it eagerly); clamped, it
        # cannot write out of bounds.
        pos = tl.minimum(tl.load(pos_ptr + b), T - 1)
        sync = (bh * 2 + side).to(tl.int64)
        count, parts = count_ptr + sync, parts_ptr + sync * CHUNKS * H1
        if side == 0:
            _write_compress(kt_ptr + b * skt_b + h * skt_h, kwt_ptr + b * skwt_b + h * skwt_h,
                            kct_ptr + b * skct_b + h * skct_h, k_ptr, kw_ptr, ktail_ptr, kc_ptr, bh, pos, T, Tc,
                            pe_k, w1_k, b1_k, w2_k, b2_k, count, parts, chunk, L, STRIDE, DK, H1K, SEPARATE,
                            HAS_B1K, HAS_B2K, TPC, CHUNKS)
        else:
            _write_compress(vt_ptr + b * svt_b + h * svt_h, vwt_ptr + b * svwt_b + h * svwt_h,
                            vct_ptr + b * svct_b + h * svct_h, v_ptr, vw_ptr, vtail_ptr, vc_ptr, bh, pos, T, Tc,
                            pe_v, w1_v, b1_v, w2_v, b2_v, count, parts, chunk, L, STRIDE, DV, H1V, SEPARATE,
                            HAS_B1V, HAS_B2V, TPC, CHUNKS)

    @triton.jit
    def _write_compress(tok_ptr, wtok_ptr, ctok_ptr, cache_ptr, win_ptr, tail_ptr, cmp_ptr, bh, pos, T, Tc,
                        pe_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, count_ptr, parts_ptr, chunk, L: tl.constexpr,
                        STRIDE: tl.constexpr, D: tl.constexpr, H1: tl.constexpr, SEPARATE: tl.constexpr,
                        HAS_B1: tl.constexpr, HAS_B2: tl.constexpr, TPC: tl.constexpr, CHUNKS: tl.constexpr):
        """One head's side of the step (contiguous [B, Hkv, *, D] caches). phi reads the block's
        last token from the input rather than from the ring slot that chunk 0 writes."""
        d = tl.arange(0, D)
        bh = bh.to(tl.int64)
        tail = tail_ptr + bh * L * D
        if chunk == 0:
            dst = (bh * T + pos) * D + d
            tl.store(cache_ptr + dst, tl.load(tok_ptr + d).to(cache_ptr.dtype.element_ty))
            if SEPARATE:
                tl.store(win_ptr + dst, tl.load(wtok_ptr + d).to(win_ptr.dtype.element_ty))
            tl.store(tail + (pos % L) * D + d, tl.load(ctok_ptr + d).to(tail_ptr.dtype.element_ty))
        if _phi_fresh(pos, Tc, L, STRIDE):
            _phi_split(tail, ctok_ptr, cmp_ptr + bh * Tc * D, pos, Tc, pe_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr,
                       count_ptr, parts_ptr, chunk, L, STRIDE, D, H1, HAS_B1, HAS_B2, TPC, CHUNKS)

    @triton.jit
    def _phi_split(tail, tok_ptr, cmp_ptr, pos, Tc, pe_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, count_ptr, parts_ptr,
                   chunk, L: tl.constexpr, STRIDE: tl.constexpr, D: tl.constexpr, H1: tl.constexpr,
                   HAS_B1: tl.constexpr, HAS_B2: tl.constexpr, TPC: tl.constexpr, CHUNKS: tl.constexpr):
        """phi of one head's completed block over CHUNKS programs: each stores its chunk's
        first-layer sums, and the last to count itself in (it then sees every chunk's) adds them
        in chunk order, as _phi_into does (the same bits as nsa_flex::phi_step), finishes phi and
        sets the count back to 0 for the next block. The sum is unrolled, so that its loads are in
        flight together.

        Measured on the H200 at 64k, a call that completes a block / the step, at B=8 and B=1
        (bench/results/2026-11-25_h200_phi_split_s12.json; the call's figures include a fill
        kernel): one program per head going over the chunks in turn, 28 us (the kernel before
        this one went over the 32 tokens in turn) / 48.2 and 18.6 us; 8 programs per head, the
        chunks summed in a loop, 16 / 8 us, the step 46.7 / 17.7 us; 16 programs per sequence
        over its 4 heads (one w1 load for them; 197 registers), 23 / 17 us, the step 47.2 /
        17.3 us: the last program then finishes four heads in turn."""
        rows = tl.arange(0, H1)
        tl.store(parts_ptr + chunk * H1 + rows,
                 _phi_partial(_phi_w1(w1_ptr, chunk * TPC, L, D, H1, TPC),
                              _phi_x(tail, D, tok_ptr, pos, pe_ptr, w1_ptr, chunk * TPC, L, D, TPC, True)))
        # The barrier orders every thread's stores before the count; acq_rel publishes them and
        # acquires the other programs' (whose sums are then read at L2, .cg).
        tl.debug_barrier()
        if tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == CHUNKS - 1:
            tl.store(count_ptr, 0)
            acc = tl.zeros([H1], dtype=tl.float32)
            for i in tl.static_range(CHUNKS):
                acc += tl.load(parts_ptr + i * H1 + rows, cache_modifier=".cg")
            _phi_finish(acc, cmp_ptr, D, pos, b1_ptr, w2_ptr, b2_ptr, L, STRIDE, H1, D, HAS_B1, HAS_B2)
