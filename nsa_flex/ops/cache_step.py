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
from nsa_flex.ops.phi_step import _DTYPES, _phi_step_torch, phi_params

if decode_triton.HAS_TRITON:
    import triton
    import triton.language as tl
    from torch.library import wrap_triton

    from nsa_flex.ops.decode_triton import _pdl_wait
    from nsa_flex.ops.phi_step import _phi_into


def cache_step(tokens: tuple[Tensor, ...], caches: tuple[Optional[Tensor], ...], pos: Tensor, phi_k: nn.Module,
               phi_v: nn.Module, cmp_block: int, cmp_stride: int) -> None:
    """Writes one token per sequence at positions pos [B] and compresses where a block completes.

    tokens: (k, v, k_win, v_win, k_cmp, v_cmp), each [B, Hkv, D] (k_win/v_win None without
    separate window projections; k_cmp/v_cmp are phi's un-rotated inputs); caches: (k, v, k_win,
    v_win, k_tail, v_tail, k_cmp, v_cmp) of an NSACache (k_win/v_win None likewise), updated in
    place; phi_k, phi_v: the layer's Compressors.
    """
    check_tokens(tokens, caches)
    k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok = tokens
    k, v, k_win, v_win, k_tail, v_tail, k_cmp, v_cmp = caches
    torch.ops.nsa_flex.cache_step(k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok, k, v, k_win, v_win, k_tail, v_tail,
                                  k_cmp, v_cmp, pos, *phi_params(phi_k), *phi_params(phi_v), cmp_block, cmp_stride)


def check_tokens(tokens: tuple[Optional[Tensor], ...], caches: tuple[Optional[Tensor], ...]) -> None:
    """The window pair: tokens and caches both given (separate K/V) or both None."""
    if (tokens[2] is None) != (caches[2] is None) or (tokens[3] is None) != (caches[3] is None):
        raise ValueError("window tokens and window caches must both be given (separate K/V) or both be None")


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
    k_cmp: Tensor, v_cmp: Tensor, pos: Tensor,
    pe_k: Tensor, w1_k: Tensor, b1_k: Optional[Tensor], w2_k: Tensor, b2_k: Optional[Tensor],
    pe_v: Tensor, w1_v: Tensor, b1_v: Optional[Tensor], w2_v: Tensor, b2_v: Optional[Tensor],
    cmp_block: int, cmp_stride: int,
) -> None:
    run_cache_step(k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok, k, v, k_win, v_win, k_tail, v_tail, k_cmp, v_cmp,
                   pos, pe_k, w1_k, b1_k, w2_k, b2_k, pe_v, w1_v, b1_v, w2_v, b2_v, cmp_block, cmp_stride)


def run_cache_step(k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok, k, v, k_win, v_win, k_tail, v_tail, k_cmp, v_cmp,
                   pos, pe_k, w1_k, b1_k, w2_k, b2_k, pe_v, w1_v, b1_v, w2_v, b2_v, cmp_block: int,
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
        return _cache_step_triton(k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok, *caches, pos,
                                  (pe_k, w1_k, b1_k, w2_k, b2_k), (pe_v, w1_v, b1_v, w2_v, b2_v), cmp_block,
                                  cmp_stride)
    write_token_torch((k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok), caches, pos, cmp_block)
    _phi_step_torch(k_tail, k_cmp, pos, pe_k, w1_k, b1_k, w2_k, b2_k, cmp_block, cmp_stride)
    _phi_step_torch(v_tail, v_cmp, pos, pe_v, w1_v, b1_v, w2_v, b2_v, cmp_block, cmp_stride)
    return ()


# A custom_op, opaque to Inductor, not a triton_op: Inductor launches a triton_op's kernels
# itself and drops launch_pdl on the way (ops/decode_triton.py, _pdl_wait).
_cache_step_op = custom_op(
    "nsa_flex::cache_step", mutates_args=("k", "v", "k_win", "v_win", "k_tail", "v_tail", "k_cmp", "v_cmp"),
)(_cache_step_impl)


@_cache_step_op.register_fake
def _cache_step_fake(*args) -> None:
    return None


def _cache_step_triton(k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok, k, v, k_win, v_win, k_tail, v_tail, k_cmp,
                       v_cmp, pos, phi_k, phi_v, cmp_block: int, cmp_stride: int) -> tuple[Tensor, ...]:
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
    wrap_triton(_cache_step_kernel)[(B * Hkv, 2)](
        k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok, k, v, k_win, v_win, k_tail, v_tail, k_cmp, v_cmp, pos,
        pe_k, w1_k, w1_k if b1_k is None else b1_k, w2_k, w2_k if b2_k is None else b2_k,
        pe_v, w1_v, w1_v if b1_v is None else b1_v, w2_v, w2_v if b2_v is None else b2_v,
        Hkv, T, k_cmp.shape[2],
        *(s for x in (k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok) for s in x.stride()[:2]),
        L=cmp_block, STRIDE=cmp_stride, DK=Dk, DV=Dv, H1K=w1_k.shape[0], H1V=w1_v.shape[0], SEPARATE=separate,
        HAS_B1K=b1_k is not None, HAS_B2K=b2_k is not None, HAS_B1V=b1_v is not None, HAS_B2V=b2_v is not None,
        num_warps=8, **decode_triton.pdl_launch(k.device, True),
    )
    return (k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok, pe_k, w1_k, w2_k, pe_v, w1_v, w2_v)


if decode_triton.HAS_TRITON:

    @triton.jit
    def _cache_step_kernel(
        kt_ptr, vt_ptr, kwt_ptr, vwt_ptr, kct_ptr, vct_ptr, k_ptr, v_ptr, kw_ptr, vw_ptr, ktail_ptr, vtail_ptr,
        kc_ptr, vc_ptr, pos_ptr, pe_k, w1_k, b1_k, w2_k, b2_k, pe_v, w1_v, b1_v, w2_v, b2_v, Hkv, T, Tc,
        skt_b, skt_h, svt_b, svt_h, skwt_b, skwt_h, svwt_b, svwt_h, skct_b, skct_h, svct_b, svct_h,
        L: tl.constexpr, STRIDE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, H1K: tl.constexpr,
        H1V: tl.constexpr, SEPARATE: tl.constexpr, HAS_B1K: tl.constexpr, HAS_B2K: tl.constexpr,
        HAS_B1V: tl.constexpr, HAS_B2V: tl.constexpr, PDL: tl.constexpr,
    ):
        """Program (sequence * kv head, side): side 0 writes and compresses the keys, side 1 the values.
        With PDL it is launched before the kernel ahead of it ends and waits for it first (the
        token's k/v come from there), then lets decode_attend's first kernel launch."""
        bh = tl.program_id(0) + _pdl_wait(tl.program_id(0), PDL)
        b = bh // Hkv
        h = bh % Hkv
        # A position past the cache is a caller's bug (decode checks it eagerly); clamped, it
        # cannot write out of bounds.
        pos = tl.minimum(tl.load(pos_ptr + b), T - 1)
        if tl.program_id(1) == 0:
            _write_compress(kt_ptr + b * skt_b + h * skt_h, kwt_ptr + b * skwt_b + h * skwt_h,
                            kct_ptr + b * skct_b + h * skct_h, k_ptr, kw_ptr, ktail_ptr, kc_ptr, bh, pos, T, Tc,
                            pe_k, w1_k, b1_k, w2_k, b2_k, L, STRIDE, DK, H1K, SEPARATE, HAS_B1K, HAS_B2K)
        else:
            _write_compress(vt_ptr + b * svt_b + h * svt_h, vwt_ptr + b * svwt_b + h * svwt_h,
                            vct_ptr + b * svct_b + h * svct_h, v_ptr, vw_ptr, vtail_ptr, vc_ptr, bh, pos, T, Tc,
                            pe_v, w1_v, b1_v, w2_v, b2_v, L, STRIDE, DV, H1V, SEPARATE, HAS_B1V, HAS_B2V)

    @triton.jit
    def _write_compress(tok_ptr, wtok_ptr, ctok_ptr, cache_ptr, win_ptr, tail_ptr, cmp_ptr, bh, pos, T, Tc,
                        pe_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, L: tl.constexpr, STRIDE: tl.constexpr,
                        D: tl.constexpr, H1: tl.constexpr, SEPARATE: tl.constexpr, HAS_B1: tl.constexpr,
                        HAS_B2: tl.constexpr):
        """One head's side of the step (contiguous [B, Hkv, *, D] caches)."""
        d = tl.arange(0, D)
        bh = bh.to(tl.int64)
        dst = (bh * T + pos) * D + d
        tl.store(cache_ptr + dst, tl.load(tok_ptr + d).to(cache_ptr.dtype.element_ty))
        if SEPARATE:
            tl.store(win_ptr + dst, tl.load(wtok_ptr + d).to(win_ptr.dtype.element_ty))
        tail = tail_ptr + bh * L * D
        tl.store(tail + (pos % L) * D + d, tl.load(ctok_ptr + d).to(tail_ptr.dtype.element_ty))
        # The ring slot just written is read back by other threads of this program.
        tl.debug_barrier()
        _phi_into(tail, D, cmp_ptr + bh * Tc * D, D, pos, Tc, pe_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr,
                  L, STRIDE, D, H1, D, HAS_B1, HAS_B2)
