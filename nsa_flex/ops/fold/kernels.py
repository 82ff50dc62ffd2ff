"""Triton kernel of nsa_flex::fold and nsa_flex::fold_pairs: q [B, T, Hq, D] -> folded rows [R, D] of
(batch, kv head) pairs, zeros past T*G."""

from __future__ import annotations

from nsa_flex.ops.triton_utils import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _fold_kernel(x_ptr, out_ptr, T, Hkv, G, R, first, sx_b, sx_t, sx_h, so_p, so_r,
                     ROWS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
        """ROWS folded rows r of pair first + p (batch b, kv head h; pair b * Hkv + h), written to
        out[p]: query head h * G + r % G at token r // G."""
        p = tl.program_id(1)
        bh = first + p
        b = (bh // Hkv).to(tl.int64)
        h = bh % Hkv
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        d = tl.arange(0, DP)
        d_ok = d[None, :] < D
        live = r < T * G
        x = tl.load(x_ptr + b * sx_b + (r // G)[:, None] * sx_t + (h * G + r % G)[:, None] * sx_h + d[None, :],
                    mask=live[:, None] & d_ok, other=0.0)
        tl.store(out_ptr + p.to(tl.int64) * so_p + r[:, None] * so_r + d[None, :], x, mask=(r < R)[:, None] & d_ok)
