"""Triton kernel of nsa_flex::fold: q [B, T, Hq, D] -> folded [B, Hkv, R, D], zeros past T*G."""

from __future__ import annotations

from nsa_flex.ops.triton_utils import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _fold_kernel(x_ptr, out_ptr, T, Hkv, G, R, sx_b, sx_t, sx_h, so_b, so_h, so_r,
                     ROWS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
        """ROWS folded rows r of one (batch, kv head h): query head h * G + r % G at token r // G."""
        bh = tl.program_id(1)
        b = (bh // Hkv).to(tl.int64)
        h = bh % Hkv
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        d = tl.arange(0, DP)
        d_ok = d[None, :] < D
        live = r < T * G
        x = tl.load(x_ptr + b * sx_b + (r // G)[:, None] * sx_t + (h * G + r % G)[:, None] * sx_h + d[None, :],
                    mask=live[:, None] & d_ok, other=0.0)
        tl.store(out_ptr + b * so_b + h * so_h + r[:, None] * so_r + d[None, :], x, mask=(r < R)[:, None] & d_ok)
