"""One decode step's cache update and attention as one op: nsa_flex::step_attend.

The same work as nsa_flex::cache_step followed by nsa_flex::decode_attend(advance=True), in
one op so that the order of its kernels is fixed: decode_attend's first kernel (A) then
follows cache_step's for certain, and that kernel wrote only the token at pos and the
compressed entry the token completes. So A's compressed programs read q, pos and the older
compressed entries before they wait for it (programmatic dependent launch; see
triton_utils.pdl_wait), where decode_attend on its own has to wait first: the kernel
before it may have written anything. As two ops the cache update cost the step ~4 us on an
H200, against its kernel's 1.4-1.8 us (docs/records/decode_step_gap_h200.json); in this op,
with phi split over programs, 0.5 us at B=8 and 1.5 us at B=1, 64k
(docs/records/decode_phi_split_h200.json).

Off CUDA both halves run their torch twins, as the two ops do.
"""

# No `from __future__ import annotations` here: torch.library reads the op's annotations.
from typing import Optional

import torch
from torch import Tensor, nn
from torch.library import custom_op

from nsa_flex.config import NSAConfig
from nsa_flex.ops.decode.cache_step import check_phi_count, check_tokens, run_cache_step
from nsa_flex.ops.decode.attend import _geometry, prepare_inputs, run_decode_attend
from nsa_flex.ops.decode.phi_step import phi_params


def step_attend(tokens: tuple[Tensor, ...], caches: tuple[Optional[Tensor], ...], pos: Tensor, phi_k: nn.Module,
                phi_v: nn.Module, q: Tensor, gates: Tensor, config: NSAConfig, *,
                scale: Optional[float] = None, phi_count: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """cache_step(tokens, caches, pos, phi_k, phi_v, ...) then decode_attend(q, ..., pos, gates,
    advance=True): (o [B,Hkv,G,Dv], selected blocks [B,Hkv,n]). tokens and caches as
    cache_step's (caches: an NSACache's k, v, k_win, v_win, k_tail, v_tail, k_cmp, v_cmp, the
    window pair None without separate window projections); q and gates as decode_attend's;
    phi_count as cache_step's."""
    check_tokens(tokens, caches)
    check_phi_count(phi_count, caches[0])
    k, v, k_win, v_win, _, _, k_cmp, v_cmp = caches
    q, gates, scale = prepare_inputs(q, k, v, k if k_win is None else k_win, v if v_win is None else v_win, k_cmp, v_cmp,
                               pos, gates, config, scale)
    if not pos.is_contiguous():
        raise ValueError("step_attend advances pos in place: pos must be contiguous")
    return torch.ops.nsa_flex.step_attend(*tokens, *caches, pos, phi_count, *phi_params(phi_k), *phi_params(phi_v), q,
                                          gates, scale, *_geometry(config))


def _step_attend_impl(
    k_tok: Tensor, v_tok: Tensor, kw_tok: Optional[Tensor], vw_tok: Optional[Tensor], kc_tok: Tensor, vc_tok: Tensor,
    k: Tensor, v: Tensor, k_win: Optional[Tensor], v_win: Optional[Tensor], k_tail: Tensor, v_tail: Tensor,
    k_cmp: Tensor, v_cmp: Tensor, pos: Tensor, phi_count: Optional[Tensor],
    pe_k: Tensor, w1_k: Tensor, b1_k: Optional[Tensor], w2_k: Tensor, b2_k: Optional[Tensor],
    pe_v: Tensor, w1_v: Tensor, b1_v: Optional[Tensor], w2_v: Tensor, b2_v: Optional[Tensor],
    q: Tensor, gates: Tensor, scale: float, cmp_block: int, cmp_stride: int, sel_block: int,
    n_selected: int, n_initial: int, n_local: int, window: int,
) -> tuple[Tensor, Tensor]:
    # Held until the attention's kernels have launched: see run_cache_step.
    read_by_cache_step = run_cache_step(k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok, k, v, k_win, v_win, k_tail,
                                        v_tail, k_cmp, v_cmp, pos, phi_count, pe_k, w1_k, b1_k, w2_k, b2_k, pe_v, w1_v,
                                        b1_v, w2_v, b2_v, cmp_block, cmp_stride)
    o, blocks = run_decode_attend(q, k, v, k if k_win is None else k_win, v if v_win is None else v_win, k_cmp, v_cmp,
                                  pos, gates, scale, cmp_block, cmp_stride, sel_block, n_selected, n_initial, n_local,
                                  window, advance=True, after_cache_step=True)
    del read_by_cache_step
    return o, blocks


# A custom_op for the reasons cache_step and decode_attend are (Inductor drops launch_pdl).
_step_attend_op = custom_op(
    "nsa_flex::step_attend",
    mutates_args=("k", "v", "k_win", "v_win", "k_tail", "v_tail", "k_cmp", "v_cmp", "pos", "phi_count"),
)(_step_attend_impl)


@_step_attend_op.register_fake
def _step_attend_fake(k_tok, v_tok, kw_tok, vw_tok, kc_tok, vc_tok, k, v, k_win, v_win, k_tail, v_tail, k_cmp, v_cmp,
                      pos, phi_count, pe_k, w1_k, b1_k, w2_k, b2_k, pe_v, w1_v, b1_v, w2_v, b2_v, q, gates, scale,
                      cmp_block, cmp_stride, sel_block, n_selected, n_initial, n_local, window):
    B, Hkv, G, _ = q.shape
    return q.new_empty((B, Hkv, G, v.shape[-1])), q.new_empty((B, Hkv, n_selected), dtype=torch.int64)
