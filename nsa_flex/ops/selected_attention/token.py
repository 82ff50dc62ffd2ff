"""nsa_flex::selected_attention's forward token by token, for large groups.

The block-centric forward (kernels._fwd_kernel) writes, per (token, slot), the G rows of a
block-local output, and the merge reads them back: 2 * G * Dv * 2 bytes per pair besides the
query rows, 8 KiB at G=16, D=128. Token by token, a program takes one (token, kv head), keeps
its G heads' online softmax in registers and reads each selected block's K/V itself (from L2
while a kv head's keys fit there): no partials, no merge, no index, no token ranges. At small
groups those K/V reads (2 * l' * D * 2 bytes per pair, shared by G rows only) cost more than the
partials; launch_config picks this forward from TOKEN_FORWARD_FROM_GROUP on (docs/decisions.md).
The backward stays block-centric: it needs only o and the lse, which this forward writes alike.
"""

from __future__ import annotations

import torch

from nsa_flex.ops.selected_attention import kernels
from nsa_flex.ops.triton_utils import HAS_TRITON, dense, next_pow2

if HAS_TRITON:
    import triton
    import triton.language as tl
    from torch.library import wrap_triton

    from nsa_flex.ops.selected_attention.kernels import _gated_store, _q_rows
    from nsa_flex.ops.triton_utils import dot


    @triton.jit
    def _token_fwd_kernel(
        q_ptr, k_ptr, v_ptr, sel_ptr, out_ptr, lse_ptr, loc_ptr, loc_lse_ptr, cmp_ptr, win_ptr, gate_ptr,
        T, Hkv, SEL, scale, HEAD, RC,
        sq_b, sq_t, sq_kv, sq_g, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, ss_b, ss_h, ss_t,
        so_b, so_t, so_h, sl_b, sl_h, sl_t, sx_b, sx_h, sx_r, sxl_b, sxl_h,
        sc_b, sc_h, sc_r, sw_b, sw_h, sw_r, sgt_b, sgt_t, sgt_h,
        N: tl.constexpr, NP: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BL: tl.constexpr,
        DK: tl.constexpr, DKP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr,
        LOCAL: tl.constexpr, GATED: tl.constexpr, STAGES: tl.constexpr, F32_DOT: tl.constexpr, IEEE: tl.constexpr,
    ):
        """The forward token by token: one program per (token t, kv head h, batch entry b) = (program_id(0)
        // Hkv, program_id(0) % Hkv, program_id(1)) walks the token's n selected blocks with an online
        softmax over its G query heads (rows, G' >= 16 of them for the dots, pad rows masked).

        Each block's K/V are read for this token alone (from L2 where the kv head's keys fit), so
        no partials are written or merged; where G >= 16 the block-centric forward's partials (G
        rows of o in and out per token and slot) cost more than these reads (docs/decisions.md).
        Slots: -1, a block that starts past t or a repeat of an earlier slot read nothing; LOCAL:
        the slots of t's own block and the one before neither, the window op's partial over them
        (loc folded [B, Hkv, T*G, DV], loc_lse [B, Hkv, T*G] base 2) merges at the end. Writes o
        [B, T, Hq, DV] and lse [B, Hq, T] (natural log, -inf when no key is visible); GATED: the
        gated sum of the three branches into out instead (_gated_store), no lse.
        """
        LOG2E: tl.constexpr = 1.4426950408889634
        LN2: tl.constexpr = 0.6931471805599453
        pid = tl.program_id(0)
        h = pid % Hkv
        t = (pid // Hkv).to(tl.int64)
        b = tl.program_id(1).to(tl.int64)
        g = tl.arange(0, GP)
        g_ok = g < G
        hq = h * G + g
        dk = tl.arange(0, DKP)
        dv = tl.arange(0, DVP)
        q = tl.load(q_ptr + _q_rows(b, t, h, g, sq_b, sq_t, sq_kv, sq_g)[:, None] + dk[None, :],
                    mask=g_ok[:, None] & (dk[None, :] < DK), other=0.0)
        # A new name: under Inductor `scale` arrives as a constexpr, which may not be reassigned.
        sc2 = tl.cast(scale, tl.float32) * LOG2E
        sel_row = sel_ptr + b * ss_b + h * ss_h + t * ss_t
        n = tl.arange(0, NP)
        row = tl.load(sel_row + n, mask=n < N, other=-1)
        own = t // SEL
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DVP], tl.float32)
        for slot in tl.range(0, N, num_stages=STAGES):
            j = tl.load(sel_row + slot).to(tl.int64)
            use = (j >= 0) & (j * SEL <= t) & (tl.sum(((row == j) & (n < slot)).to(tl.int32), 0) == 0)
            if LOCAL:
                use = use & (j != own) & (j != own - 1)
            key = j * SEL + tl.arange(0, BL)
            key_ok = use & (key <= t) & (key < (j + 1) * SEL)
            k_ld = tl.load(k_ptr + b * sk_b + key[:, None] * sk_t + h * sk_h + dk[None, :],
                           mask=key_ok[:, None] & (dk[None, :] < DK), other=0.0)
            s = dot(q, tl.trans(k_ld), F32_DOT, IEEE) * sc2
            s = tl.where(key_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row that has seen no key yet: subtract 0, not -inf (no NaN).
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_sub[:, None])
            alpha = tl.math.exp2(m_i - m_sub)
            l_i = l_i * alpha + tl.sum(p, 1)
            v_ld = tl.load(v_ptr + b * sv_b + key[:, None] * sv_t + h * sv_h + dv[None, :],
                           mask=key_ok[:, None] & (dv[None, :] < DV), other=0.0)
            acc = acc * alpha[:, None] + dot(p.to(v_ld.dtype), v_ld, F32_DOT, IEEE)
            m_i = m_new
        if LOCAL:
            r = t * G + g
            lse_l = tl.load(loc_lse_ptr + b * sxl_b + h * sxl_h + r, mask=g_ok, other=float("-inf"))
            o_l = tl.load(loc_ptr + b * sx_b + h * sx_h + r[:, None] * sx_r + dv[None, :],
                          mask=g_ok[:, None] & (dv[None, :] < DV), other=0.0).to(tl.float32)
            m = tl.maximum(m_i, lse_l)
            m = tl.where(m == float("-inf"), 0.0, m)
            w_s = tl.math.exp2(m_i - m)
            w_l = tl.math.exp2(lse_l - m)
            den = l_i * w_s + w_l
            acc = acc * w_s[:, None] + o_l * w_l[:, None]
        else:
            m = tl.where(m_i == float("-inf"), 0.0, m_i)
            den = l_i
        seen = den > 0
        den = tl.where(seen, den, 1.0)
        o = acc / den[:, None]
        row_ok = g_ok[:, None] & (dv[None, :] < DV)
        if GATED:
            _gated_store(out_ptr, o.to(out_ptr.dtype.element_ty).to(tl.float32), cmp_ptr, win_ptr, gate_ptr, b, h,
                         t, g, dv, hq, g_ok, row_ok, HEAD, RC, sc_b, sc_h, sc_r, sw_b, sw_h, sw_r, sgt_b, sgt_t,
                         sgt_h, so_b, so_t, so_h, G, DV)
        else:
            tl.store(out_ptr + b * so_b + t * so_t + hq[:, None] * so_h + dv[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=row_ok)
            tl.store(lse_ptr + b * sl_b + hq * sl_h + t * sl_t,
                     tl.where(seen, (m + tl.math.log2(den)) * LN2, float("-inf")), mask=g_ok)


def forward(q, k, v, block_indices, scale: float, sel_block: int, cfg: dict, Hq: int, q_strides, local=None,
            gated=None):
    """(o [B,T,Hq,Dv] in q's dtype, lse [B,Hq,T] fp32 natural log) as launch.forward returns them, or
    with gated = (cmp_rows, head, o_win, gates) the gated sum o and None (launch.forward_gated's).

    q (dense, unfolded or folded) and its q_strides as launch.forward passes them; cfg:
    launch_config's, for tok_warps and tok_stages; local: the window op's partial; one sequence per
    batch row."""
    k, v, block_indices = dense(k, v, block_indices)
    B, T, Hkv = k.shape[:3]
    G, n, Dk, Dv = Hq // Hkv, block_indices.shape[-1], q.shape[-1], v.shape[-1]
    o = torch.empty(B, T, Hq, Dv, dtype=q.dtype, device=q.device)
    lse = None if gated else torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    if B * T * Hkv == 0:
        return o, lse
    # The inputs a launch does not read get the selection in their place (read only, aliasing
    # nothing the kernel writes), with zero strides.
    spare = block_indices
    loc, loc_lse = (spare, spare) if local is None else dense(*local)
    loc_strides = (0,) * 5 if local is None else (*loc.stride()[:3], *loc_lse.stride()[:2])
    cmp_rows, head, o_win, gates = (spare, 0, spare, spare) if gated is None else gated
    if gated is not None:
        cmp_rows, o_win, gates = dense(cmp_rows, o_win, gates)
    gated_strides = (0,) * 9 if gated is None else (*cmp_rows.stride()[:3], *o_win.stride()[:3], *gates.stride()[:3])
    pad = lambda d: max(16, next_pow2(d))  # noqa: E731
    wrap_triton(_token_fwd_kernel)[(T * Hkv, B)](
        q, k, v, block_indices, o, spare if lse is None else lse, loc, loc_lse, cmp_rows, o_win, gates,
        T, Hkv, sel_block, scale, head, 0 if gated is None else cmp_rows.shape[2], *q_strides, *k.stride()[:3],
        *v.stride()[:3], *block_indices.stride()[:3], *o.stride()[:3], *((0, 0, 0) if lse is None else lse.stride()),
        *loc_strides, *gated_strides, N=n, NP=next_pow2(n), G=G, GP=pad(G), BL=pad(sel_block), DK=Dk, DKP=pad(Dk),
        DV=Dv, DVP=pad(Dv), LOCAL=local is not None, GATED=gated is not None, STAGES=cfg["tok_stages"],
        F32_DOT=q.device.type == "cpu", IEEE=q.dtype == torch.float32, num_warps=cfg["tok_warps"])
    return o, lse
