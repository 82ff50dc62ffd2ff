"""The window forward as a warp-specialised Gluon kernel, against the window op's Triton forward.

    python -m bench.window_gluon_gpu --out $OUT/window_gluon.json     (a GPU: correctness and times)
    python -m bench.window_gluon_gpu --compile                        (no GPU: build for sm_90a, registers)

A probe of the next design for the kernels that sit at ~2.3x of dense cuDNN's rate (docs/decisions.md,
"The window branch"), not a path of the op. Gluon, Triton's lower-level dialect, states what
Triton's compiler chooses for the op's kernels: here one producer warp issues the TMA loads of a
row tile's queries and of each key block's K and V into a ring of NB shared-memory buffers, and a
consumer warpgroup runs the wgmma's and the online softmax, so loads never wait on the softmax.
Folded rows as the op's forward takes them (q [B, Hkv, T*G, D], k / v [B, T, Hkv, D], bf16, no local
partial); EDGE masks only the key blocks the window's start or the diagonal cut, as the Triton
kernel does. Per shape: the Triton forward (ops.window.forward, launch_config's tiles) and each
variant, do_bench medians, and the largest differences of o and lse from the Triton forward's.
Gluon kernels do not run under Triton's CPU interpreter.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, ready, empty, q_row, k_row0, k_col, n_blocks,
            BN: gl.constexpr):
    # K / V of kv head h are the columns h*D.. of k viewed as [B*T, Hkv*D]; rows past a batch row's
    # last token are the next row's (or TMA's zero fill past the end), cut by the diagonal's mask.
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem)
    NB: gl.constexpr = k_bufs.type.shape[0]
    for i in range(n_blocks):
        idx = i % NB
        ph = (i // NB) & 1
        mbarrier.wait(empty.index(idx), ph ^ 1)
        bar = ready.index(idx)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_row0 + i * BN, k_col], bar, k_bufs.index(idx))
        tma.async_copy_global_to_shared(v_desc, [k_row0 + i * BN, k_col], bar, v_bufs.index(idx))


@gluon.jit
def _consumer(q_smem, k_bufs, v_bufs, q_bar, ready, empty, o_ptr, lse_ptr, row0, R, bh, first, n_blocks, W, scale2,
              t0, t1, G: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, EDGE: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    NB: gl.constexpr = k_bufs.type.shape[0]
    rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
    tok = rows // G
    m_i = gl.full([BM], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BM], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BM, D], gl.float32, layout=o_layout)
    s0 = gl.zeros([BM, BN], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)
    for i in range(n_blocks):
        idx = i % NB
        ph = (i // NB) & 1
        mbarrier.wait(ready.index(idx), ph)
        s = warpgroup_mma(q_smem, k_bufs.index(idx).permute((1, 0)), s0, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        kb = first + i * BN
        s = s * scale2
        # EDGE: only the blocks the window's start or the diagonal cut are masked.
        if (not EDGE) or (kb + BN - 1 > t0) or (kb <= t1 - W):
            keys = kb + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
            seen = (keys[None, :] <= tok[:, None]) & (keys[None, :] > tok[:, None] - W)
            s = gl.where(seen, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_sub[:, None])
        alpha = gl.exp2(m_i - m_sub)
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        acc = warpgroup_mma(p_op, v_bufs.index(idx), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        # Both dots of this block are done: its K / V buffers go back to the loader.
        mbarrier.arrive(empty.index(idx), count=1)
        m_i = m_new
    l_safe = gl.where(l_i > 0, l_i, 1.0)
    o = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
    orow = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, o_layout))
    ocol = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    optr = o_ptr + (bh.to(gl.int64) * R + orow.to(gl.int64))[:, None] * D + ocol[None, :]
    gl.store(optr, o.to(gl.bfloat16), mask=(orow < R)[:, None])
    gl.store(lse_ptr + bh.to(gl.int64) * R + rows, m_i + gl.log2(l_safe), mask=rows < R)


@gluon.jit
def _window_fwd_ws(q_desc, k_desc, v_desc, o_ptr, lse_ptr, T, R, Hkv, W, scale2,
                   G: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, NB: gl.constexpr,
                   EDGE: gl.constexpr):
    pid = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // Hkv
    h = bh % Hkv
    row0 = pid * BM
    t0 = row0 // G
    t1 = gl.minimum((row0 + BM - 1) // G, T - 1)
    first = (gl.maximum(t0 - W + 1, 0) // BN) * BN
    n_blocks = gl.cdiv(t1 + 1 - first, BN)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [NB] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [NB] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NB):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_consumer, (q_smem, k_bufs, v_bufs, q_bar, ready, empty, o_ptr, lse_ptr, row0, R, bh, first, n_blocks, W,
                     scale2, t0, t1, G, BM, BN, D, EDGE)),
        (_loader, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, ready, empty, bh * R + row0, b * T + first,
                   h * D, n_blocks, BN)),
    ], [1], [24])


def window_fwd_ws(q_fold, k, v, G, W, scale, BM=64, BN=64, NB=2, maxnreg=128, launch=None, edge=True):
    """o [B, Hkv, R, D] bf16 and lse (base 2) of the window over folded rows (R = T*G), as
    ops.window.forward gives them without a local partial. launch: a stand-in for the kernel's
    launch (compile_sm90's compiler); maxnreg: the kernel's register budget per thread, which
    warp_specialize splits between the loader (24) and the consumer warpgroup."""
    B, T, Hkv, D = k.shape
    R = T * G
    q2 = q_fold.reshape(B * Hkv * R, D)
    k2 = k.reshape(B * T, Hkv * D)
    v2 = v.reshape(B * T, Hkv * D)
    ql = gl.NVMMASharedLayout.get_default_for([BM, D], gl.bfloat16)
    kl = gl.NVMMASharedLayout.get_default_for([BN, D], gl.bfloat16)
    q_desc = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [BM, D], ql)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [BN, D], kl)
    v_desc = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [BN, D], kl)
    o = torch.empty(B, Hkv, R, D, dtype=q_fold.dtype, device=q_fold.device)
    lse = torch.empty(B, Hkv, R, dtype=torch.float32, device=q_fold.device)
    grid = (triton.cdiv(R, BM), B * Hkv)
    run = launch(_window_fwd_ws) if launch else _window_fwd_ws
    run[grid](q_desc, k_desc, v_desc, o, lse, T, R, Hkv, W, scale * math.log2(math.e), G=G, BM=BM, BN=BN, D=D,
              NB=NB, EDGE=edge, num_warps=4, maxnreg=maxnreg)
    return o, lse


def compile_sm90(T: int = 1024, G: int = 4, Hkv: int = 2, D: int = 128) -> None:
    """Build the kernel for sm_90a without a GPU and print its registers and shared memory."""
    from bench.kernel_regs import Compiler

    q = torch.randn(1, Hkv, T * G, D, dtype=torch.bfloat16)
    k = torch.randn(1, T, Hkv, D, dtype=torch.bfloat16)
    comp = Compiler()
    window_fwd_ws(q, k, k.clone(), G, 512, D ** -0.5, launch=comp)
    print(comp.rows[-1])


VARIANTS = ((64, 64, 2, 128, False), (64, 64, 2, 128, True), (64, 64, 3, 128, True), (64, 64, 2, 112, True),
            (64, 32, 3, 128, True))
"""(BM, BN, NB, maxnreg, EDGE) of each timed variant."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--compile", action="store_true", help="build for sm_90a without a GPU and print resources")
    args = p.parse_args()
    if args.compile:
        compile_sm90()
        return
    from bench.common import bench_ms, header
    from nsa_flex.ops import window as w

    out = {"header": header(), "rows": []}
    for B, T, Hq, Hkv, D in ((1, 65536, 16, 4, 128), (1, 32768, 16, 4, 128)):
        G = Hq // Hkv
        torch.manual_seed(0)
        q = torch.randn(B, Hkv, T * G, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, T, Hkv, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, T, Hkv, D, device="cuda", dtype=torch.bfloat16)
        scale = D ** -0.5
        ref_o, ref_lse, _, _ = w.forward(q, k, v, G, 512, scale, w.launch_config(D, D))
        row = {"shape": [B, T, Hq, Hkv, D],
               "triton_ms": bench_ms(lambda: w.forward(q, k, v, G, 512, scale, w.launch_config(D, D)))}
        for BM, BN, NB, reg, edge in VARIANTS:
            name = f"gluon BM{BM} BN{BN} NB{NB} maxnreg{reg} edge-only-mask {edge}"
            try:
                o, lse = window_fwd_ws(q, k, v, G, 512, scale, BM, BN, NB, reg, edge=edge)
                torch.cuda.synchronize()
                row[name] = {"ms": bench_ms(lambda: window_fwd_ws(q, k, v, G, 512, scale, BM, BN, NB, reg, edge=edge)),
                             "max_diff_o": float((o.float() - ref_o.float()).abs().max()),
                             "max_diff_lse": float((lse - ref_lse).abs().max())}
            except Exception as exc:  # one failing variant must not lose the others
                row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(row["shape"], "triton", round(row["triton_ms"], 4), name, row[name], flush=True)
        out["rows"].append(row)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
