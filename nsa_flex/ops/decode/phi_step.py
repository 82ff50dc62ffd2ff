"""phi for one decode step: the op nsa_flex::phi_step, which compresses only where a block completes.

A decode step of token pos completes compression block (pos + 1 - l) / d when pos + 1 >= l and
(pos + 1 - l) % d == 0: one step in d. The batched tensor path (nsa_flex.decoding.step) runs phi's two
Linear layers for every sequence on every step and keeps the result by a masked write, because
a CUDA graph cannot branch on the host; on an H200 those cuBLAS GEMMs (split-K and its reduce)
were ~16 of the 56 us of a B=1 step at 64k (docs/records/decode_batched_ops_h200.json).
Here one Triton program per (sequence, kv head) reads pos, returns at once unless its block
completed, and otherwise gathers the block from the tail ring, adds the position encoding and
runs Linear -> GELU -> Linear itself, writing the entry into the compressed cache. The
decision is made on the device, so the step stays one graph.

Rounding follows the module (nsa_flex.compression.Compressor in phi's parameter dtype):
the block plus position encoding, each Linear's output and GELU's are rounded to that
dtype; products accumulate in fp32. Off CUDA (or without Triton) the op runs its torch twin,
the module itself with the masked write.
"""

# No `from __future__ import annotations` here: torch.library reads the op's annotations.
from typing import Optional

import torch
from torch import Tensor, nn
from torch.library import triton_op

from nsa_flex.ops.decode import kernels
from nsa_flex.ops.triton_utils import next_pow2, quiet_without_triton

if kernels.HAS_TRITON:
    import triton
    import triton.language as tl
    from torch.library import wrap_triton

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def phi_step(phi: nn.Module, tail: Tensor, cmp: Tensor, pos: Tensor, cmp_block: int, cmp_stride: int) -> None:
    """Writes phi(block) into cmp[b, :, (pos_b + 1 - l) / d] for every sequence b whose block completes at pos_b.

    phi: a Compressor (pos_lxd, mlp = Linear, GELU, Linear). tail [B, Hkv, l, Din]: ring of the
    last l un-rotated keys (or values), token p at slot p % l, the token at pos included;
    cmp [B, Hkv, Tmax, Dout] (updated in place); pos [B] int64.
    """
    torch.ops.nsa_flex.phi_step(tail, cmp, pos, *phi_params(phi), cmp_block, cmp_stride)


def phi_params(phi: nn.Module) -> tuple[Tensor, Tensor, Optional[Tensor], Tensor, Optional[Tensor]]:
    """A Compressor's (pos_lxd, w1, b1, w2, b2), the ops' arguments; a clear error for any other module."""
    lin1, act, lin2 = getattr(phi, "mlp", (None, None, None))
    if not (isinstance(lin1, nn.Linear) and isinstance(act, nn.GELU) and act.approximate == "none"
            and isinstance(lin2, nn.Linear)):
        raise ValueError("phi_step needs phi.mlp = Linear, GELU (exact), Linear (nsa_flex.compression.Compressor)")
    return phi.pos_lxd, lin1.weight, lin1.bias, lin2.weight, lin2.bias


def _phi_step_impl(tail: Tensor, cmp: Tensor, pos: Tensor, pos_enc: Tensor, w1: Tensor, b1: Optional[Tensor],
                   w2: Tensor, b2: Optional[Tensor], cmp_block: int, cmp_stride: int) -> None:
    usable = (kernels.HAS_TRITON and tail.device.type == "cuda" and w1.dtype in _DTYPES
              and tail.stride(-1) == 1 and cmp.stride(-1) == 1)
    if usable:
        _phi_step_triton(tail, cmp, pos, pos_enc, w1, b1, w2, b2, cmp_block, cmp_stride)
    else:
        _phi_step_torch(tail, cmp, pos, pos_enc, w1, b1, w2, b2, cmp_block, cmp_stride)


with quiet_without_triton():
    _phi_step_op = triton_op("nsa_flex::phi_step", mutates_args=("cmp",))(_phi_step_impl)


@_phi_step_op.register_fake
def _phi_step_fake(tail, cmp, pos, pos_enc, w1, b1, w2, b2, cmp_block, cmp_stride) -> None:
    return None


def _phi_step_torch(tail, cmp, pos, pos_enc, w1, b1, w2, b2, cmp_block: int, cmp_stride: int) -> None:
    """The twin: phi for every sequence, kept where a block completed (nsa_flex.decoding.step's batched path)."""
    l, d = cmp_block, cmp_stride
    B = pos.shape[0]
    b = torch.arange(B, device=pos.device)
    slots_bl = torch.remainder(pos[:, None] - l + 1 + torch.arange(l, device=pos.device), l)
    done_b = pos + 1 - l
    entry_b = torch.div(done_b, d, rounding_mode="floor")
    # An entry past the cache is never written (the kernel skips it too; decode refuses a full cache).
    write_b = (done_b >= 0) & (torch.remainder(done_b, d) == 0) & (entry_b < cmp.shape[2])
    entry_b = entry_b.clamp(0, cmp.shape[2] - 1)
    dtype = w1.dtype
    # [B, Hkv, l, D] gathered at the block's slots -> [B, Hkv, l * D], the block in token order.
    block = tail[b[:, None], :, slots_bl].transpose(1, 2).to(dtype)
    x = (block + pos_enc.to(dtype)).flatten(-2)
    hidden = nn.functional.gelu(nn.functional.linear(x, w1, b1))
    new_bhd = nn.functional.linear(hidden, w2, b2).to(cmp.dtype)
    cmp[b, :, entry_b] = torch.where(write_b[:, None, None], new_bhd, cmp[b, :, entry_b])


def phi_chunk_tokens(cmp_block: int, h1: int, d_in: int, elements: int = 1 << 16) -> int:
    """Tokens of the block whose first-layer products a program takes at once (a power of two,
    at least 1): a [TPC, H1, D_in] slice of w1 of at most `elements`, loaded in one go so that
    the chunk's weights are in flight together (4 tokens at H1 = D_in = 128 by default)."""
    return min(next_pow2(cmp_block), max(1, elements // (h1 * d_in)))


def _phi_step_triton(tail, cmp, pos, pos_enc, w1, b1, w2, b2, cmp_block: int, cmp_stride: int, *,
                     phi_tokens: int | None = None) -> None:
    """phi_tokens: tokens per chunk (tests; default phi_chunk_tokens)."""
    B, Hkv, l, D_in = tail.shape
    H1, D_out = w1.shape[0], w2.shape[0]
    for name, n in (("head dim", D_in), ("hidden width", H1), ("output dim", D_out)):
        if n & (n - 1) or n < 16:
            raise ValueError(f"phi_step on CUDA: phi's {name} {n} must be a power of two >= 16")
    w1, w2, pos_enc = w1.contiguous(), w2.contiguous(), pos_enc.contiguous()
    tpc = phi_tokens or phi_chunk_tokens(l, H1, D_in)
    wrap_triton(_phi_step_kernel)[(B * Hkv,)](
        tail, cmp, pos, pos_enc, w1, w1 if b1 is None else b1, w2, w2 if b2 is None else b2,
        Hkv, cmp.shape[2],
        tail.stride(0), tail.stride(1), tail.stride(2), cmp.stride(0), cmp.stride(1), cmp.stride(2),
        L=l, STRIDE=cmp_stride, D_IN=D_in, H1=H1, D_OUT=D_out, HAS_B1=b1 is not None, HAS_B2=b2 is not None,
        TPC=tpc, num_warps=8,
    )


if kernels.HAS_TRITON:

    @triton.jit
    def _phi_step_kernel(tail_ptr, cmp_ptr, pos_ptr, pe_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, Hkv, T_max,
                         s_tb, s_th, s_tl, s_cb, s_ch, s_ct,
                         L: tl.constexpr, STRIDE: tl.constexpr, D_IN: tl.constexpr, H1: tl.constexpr,
                         D_OUT: tl.constexpr, HAS_B1: tl.constexpr, HAS_B2: tl.constexpr, TPC: tl.constexpr):
        pid = tl.program_id(0)
        b = pid // Hkv
        h = pid % Hkv
        pos = tl.load(pos_ptr + b)
        _phi_into(tail_ptr + b * s_tb + h * s_th, s_tl, cmp_ptr + b * s_cb + h * s_ch, s_ct, pos, T_max,
                  pe_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, L, STRIDE, D_IN, H1, D_OUT, HAS_B1, HAS_B2, TPC)

    @triton.jit
    def _phi_fresh(pos, T_max, L: tl.constexpr, STRIDE: tl.constexpr):
        """Whether pos completes a block whose entry lies in the cache."""
        done = pos + 1 - L
        return (done >= 0) & (done % STRIDE == 0) & (done // STRIDE < T_max)

    @triton.jit
    def _phi_into(tail_ptr, s_tl, cmp_ptr, s_ct, pos, T_max, pe_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr,
                  L: tl.constexpr, STRIDE: tl.constexpr, D_IN: tl.constexpr, H1: tl.constexpr,
                  D_OUT: tl.constexpr, HAS_B1: tl.constexpr, HAS_B2: tl.constexpr, TPC: tl.constexpr):
        """phi of the block ending at pos into its entry of one (sequence, kv head)'s compressed
        cache, if pos completes a block: tail_ptr/cmp_ptr point at that head's ring and cache.
        w1 is read in chunks of TPC tokens, each a [TPC, H1, D_in] tile loaded in one go: one
        token at a time, the kernel waited on one w1 tile after another."""
        if _phi_fresh(pos, T_max, L, STRIDE):
            dtype = w1_ptr.dtype.element_ty
            rows = tl.arange(0, H1)
            d_in = tl.arange(0, D_IN)
            acc = tl.zeros([H1], dtype=tl.float32)
            for j0 in range(0, L, TPC):
                jj = j0 + tl.arange(0, TPC)
                ok = jj < L
                # Token pos - L + 1 + j sits at ring slot (pos - L + 1 + j) % L.
                slot = (pos - L + 1 + jj) % L
                x = tl.load(tail_ptr + slot[:, None] * s_tl + d_in[None, :], mask=ok[:, None], other=0.0)
                pe = tl.load(pe_ptr + jj[:, None] * D_IN + d_in[None, :], mask=ok[:, None], other=0.0)
                x = (x.to(dtype) + pe.to(dtype)).to(tl.float32)
                w = tl.load(w1_ptr + rows[None, :, None] * (L * D_IN) + jj[:, None, None] * D_IN + d_in[None, None, :],
                            mask=ok[:, None, None], other=0.0).to(tl.float32)
                acc += tl.sum(tl.sum(w * x[:, None, :], axis=2), axis=0)
            if HAS_B1:
                acc += tl.load(b1_ptr + rows).to(tl.float32)
            hid = acc.to(dtype).to(tl.float32)
            hid = (0.5 * hid * (1.0 + tl.math.erf(hid * 0.7071067811865476))).to(dtype).to(tl.float32)
            outs = tl.arange(0, D_OUT)
            w2 = tl.load(w2_ptr + outs[:, None] * H1 + rows[None, :]).to(tl.float32)
            out = tl.sum(w2 * hid[None, :], axis=1)
            if HAS_B2:
                out += tl.load(b2_ptr + outs).to(tl.float32)
            dst = cmp_ptr + ((pos + 1 - L) // STRIDE) * s_ct + outs
            tl.store(dst, out.to(dtype).to(cmp_ptr.dtype.element_ty))
