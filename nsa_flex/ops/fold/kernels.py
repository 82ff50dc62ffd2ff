"""Triton kernels of the folded layout: nsa_flex::fold's, q [B, T, Hq, D] -> folded [B, Hkv, R, D] with
zeros past T*G; and the grouped compressed call's dQ added into folded rows (ops.gated_branches)."""

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

    @triton.jit
    def _add_grouped_kernel(dst_ptr, src_ptr, HEAD, TC, DG, Hkv, sd_b, sd_h, sd_r, ss_n, ss_j, ss_i,
                            ROWS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
        """dst [B, Hkv, R, D] folded rows HEAD + r += src [B*Hkv, dG, Tc, D] at (b*Hkv + h, r % dG, r // dG)
        (compressed_groups.to_grouped's layout), for ROWS rows r < Tc*dG of one (batch, kv head); the
        sum in fp32, rounded once."""
        bh = tl.program_id(1)
        b = (bh // Hkv).to(tl.int64)
        h = (bh % Hkv).to(tl.int64)
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        d = tl.arange(0, DP)
        m = (r < TC * DG)[:, None] & (d[None, :] < D)
        src = tl.load(src_ptr + bh.to(tl.int64) * ss_n + ((r % DG) * ss_j + (r // DG) * ss_i)[:, None] + d[None, :],
                      mask=m, other=0.0)
        at = dst_ptr + b * sd_b + h * sd_h + (HEAD + r)[:, None] * sd_r + d[None, :]
        x = tl.load(at, mask=m, other=0.0)
        tl.store(at, (x.to(tl.float32) + src.to(tl.float32)).to(dst_ptr.dtype.element_ty), mask=m)
