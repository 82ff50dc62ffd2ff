"""The selected op's backward kernel in Gluon with its gathers issued one chunk ahead, against the
Triton kernel.

    python -m bench.selected_gluon_gpu --out $OUT/selected_gluon.json   (a GPU: correctness and times)
    python -m bench.selected_gluon_gpu --compile                        (no GPU: build for sm_90a, registers)

A probe of the next design for nsa_flex/ops/selected_attention/kernels.py's _bwd_kernel, not a
path of the op. Built for sm_90 (Triton 3.6), that kernel's loop waits for all of a chunk's
gathered copies (its query and output-gradient rows, cp.async) at the top of the iteration and
issues the next chunk's only after the chunk's dots and dQ store: with one 8-warp program per SM
nothing overlaps the gathers. Here the same loop issues chunk i+1's copies into the other buffer
before it waits for chunk i's (cp.async groups, wait_group(1)), and the next chunk's rows, lse,
delta and entries are read into registers a chunk early. The five dots are the Triton kernel's
(wgmma with the same operand layouts; P and dS go through shared memory as the A operands of dV,
dK and dQ). 16-bit, Dk = Dv = 128 only. The epilogue writes every item's fp32 dK/dV partial (the
Triton kernel is given n_items = 2 for every block so that it does the same). Each range's
launch arguments come from the op's own backward (launch.backward, captured).
Gluon kernels do not run under Triton's CPU interpreter.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, warpgroup_mma, \
    warpgroup_mma_wait


@gluon.jit
def _rows(entries_ptr, c0, end, h, N: gl.constexpr, G: gl.constexpr, GP: gl.constexpr, M: gl.constexpr,
          layout: gl.constexpr):
    """(token t, slot, group member g, row ok) of the M rows of the chunk at entry c0, in layout."""
    r = gl.arange(0, M, layout=layout)
    e_ok = c0 + r // GP < end
    e = gl.load(entries_ptr + c0 + r // GP, mask=e_ok, other=0)
    g = r % GP
    return (e // N).to(gl.int64), e % N, g, e_ok & (g < G)


@gluon.jit
def _bwd_gluon(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, gate_ptr, dqp_ptr, dkp_ptr, dvp_ptr, entries_ptr,
    item_blk_ptr, item_start_ptr, item_end_ptr, blk_start_ptr, blk_end_ptr, n_items_ptr,
    dk_ptr, dv_ptr, dk_sum_ptr, dv_sum_ptr, Hkv, Nv, T0, T1, scale,
    sq_b, sq_t, sq_kv, sq_g, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sdo_b, sdo_t, sdo_h,
    sl_b, sl_h, sl_t, sdq_b, sdq_t, sdq_h, sdq_n, sdk_b, sdk_t, sdk_h, sdv_b, sdv_t, sdv_h,
    N: gl.constexpr, G: gl.constexpr, GP: gl.constexpr, BT: gl.constexpr, BL: gl.constexpr,
    DK: gl.constexpr, DKP: gl.constexpr, DV: gl.constexpr, DVP: gl.constexpr,
    F32_DOT: gl.constexpr, IEEE: gl.constexpr, SUMS: gl.constexpr, ADD: gl.constexpr,
    ACC: gl.constexpr = False, GATED: gl.constexpr = False, STORE_LD: gl.constexpr = True,
    OVERLAP: gl.constexpr = False, LD_ROWS: gl.constexpr = 2,
):
    LOG2E: gl.constexpr = 1.4426950408889634
    M: gl.constexpr = BT * GP
    D: gl.constexpr = DKP
    # Register layouts: gathers (16-byte vectors), the [M, BL] scores, the [M, D] dQ, the [BL, D] sums.
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [LD_ROWS, 32 // LD_ROWS], [8, 1], [1, 0])
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BL, 16])
    mma_q: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, D, 16])
    mma_kv: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D // 2, 16])
    row_ld: gl.constexpr = gl.SliceLayout(1, ld)
    row_s: gl.constexpr = gl.SliceLayout(1, mma_s)
    row_q: gl.constexpr = gl.SliceLayout(1, mma_q)
    sh_md: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, D], gl.bfloat16)
    sh_kd: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BL, D], gl.bfloat16)
    sh_ml: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, BL], gl.bfloat16)
    dtype: gl.constexpr = q_ptr.dtype.element_ty

    w = gl.program_id(0)
    blk = gl.load(item_blk_ptr + w)
    valid = blk >= 0
    blk = gl.maximum(blk, 0)
    vb = blk % Nv
    bh = blk // Nv
    b = (bh // Hkv).to(gl.int64)
    h = bh % Hkv
    start = gl.load(item_start_ptr + w)
    end = gl.where(valid, gl.load(item_end_ptr + w), start)
    ks = gl.load(blk_start_ptr + vb)
    ke = gl.load(blk_end_ptr + vb)

    q_buf = gl.allocate_shared_memory(dtype, [2, M, D], sh_md)
    do_buf = gl.allocate_shared_memory(dtype, [2, M, D], sh_md)
    k_smem = gl.allocate_shared_memory(dtype, [BL, D], sh_kd)
    v_smem = gl.allocate_shared_memory(dtype, [BL, D], sh_kd)
    p_smem = gl.allocate_shared_memory(dtype, [M, BL], sh_ml)
    ds_smem = gl.allocate_shared_memory(dtype, [M, BL], sh_ml)

    # The key block, once.
    kr = ks + gl.arange(0, BL, layout=row_ld)
    dcol = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
    kv_ok = (kr < ke)[:, None]
    k_smem.store(gl.load(k_ptr + b * sk_b + kr.to(gl.int64)[:, None] * sk_t + h * sk_h + dcol[None, :],
                         mask=kv_ok, other=0.0))
    v_smem.store(gl.load(v_ptr + b * sv_b + kr.to(gl.int64)[:, None] * sv_t + h * sv_h + dcol[None, :],
                         mask=kv_ok, other=0.0))

    sc = gl.cast(scale, gl.float32)
    scale2 = sc * LOG2E
    key_s = ks + gl.arange(0, BL, layout=gl.SliceLayout(0, mma_s))
    key_ok_s = key_s < ke
    dq_col = gl.arange(0, D, layout=gl.SliceLayout(0, mma_q))
    dk_acc = gl.zeros([BL, D], gl.float32, layout=mma_kv)
    dv_acc = gl.zeros([BL, D], gl.float32, layout=mma_kv)
    s_zero = gl.zeros([M, BL], gl.float32, layout=mma_s)
    q_zero = gl.zeros([M, D], gl.float32, layout=mma_q)

    # Chunk 0's copies and row data; chunk 1's rows.
    t, slot, g, ok = _rows(entries_ptr, start, end, h, N, G, GP, M, row_ld)
    qa = b * sq_b + (T0 + t) * sq_t + h * sq_kv + g * sq_g
    da = b * sdo_b + (T0 + t) * sdo_t + (h * G + g) * sdo_h
    async_copy.async_copy_global_to_shared(q_buf.index(0), q_ptr + qa[:, None] + dcol[None, :], mask=ok[:, None])
    async_copy.async_copy_global_to_shared(do_buf.index(0), do_ptr + da[:, None] + dcol[None, :], mask=ok[:, None])
    async_copy.commit_group()
    t_s, slot_s, g_s, ok_s = _rows(entries_ptr, start, end, h, N, G, GP, M, row_s)
    st = b * sl_b + (h * G + g_s) * sl_h + (T0 + t_s) * sl_t
    lse2 = gl.load(lse_ptr + st, mask=ok_s, other=0.0) * LOG2E
    delta = gl.load(delta_ptr + st, mask=ok_s, other=0.0)
    if GATED:
        gate = gl.load(gate_ptr + st, mask=ok_s, other=0.0)
    t_q, slot_q, g_q, ok_q = _rows(entries_ptr, start, end, h, N, G, GP, M, row_q)
    t_ld, slot_ld, g_ld, ok_ld = t, slot, g, ok
    tc, sc_, gc, okc = _rows(entries_ptr, start + BT, end, h, N, G, GP, M, row_ld)
    tn, sn, gn, okn = tc, sc_, gc, okc
    n_chunks = gl.cdiv(end - start, BT)
    for i in range(n_chunks):
        c0 = start + i * BT
        cur = i % 2
        # Every warp is past chunk i-1's dots, which read the other buffers: refill them with chunk i+1.
        gl.thread_barrier()
        qa = b * sq_b + (T0 + tn) * sq_t + h * sq_kv + gn * sq_g
        da = b * sdo_b + (T0 + tn) * sdo_t + (h * G + gn) * sdo_h
        async_copy.async_copy_global_to_shared(q_buf.index(1 - cur), q_ptr + qa[:, None] + dcol[None, :],
                                               mask=okn[:, None])
        async_copy.async_copy_global_to_shared(do_buf.index(1 - cur), do_ptr + da[:, None] + dcol[None, :],
                                               mask=okn[:, None])
        async_copy.commit_group()
        # The rows of chunk i+2, for next iteration's copies (loaded now, used then).
        tn, sn, gn, okn = _rows(entries_ptr, c0 + 2 * BT, end, h, N, G, GP, M, row_ld)
        tn_s, sn_s, gn_s, okn_s = _rows(entries_ptr, c0 + BT, end, h, N, G, GP, M, row_s)
        stn = b * sl_b + (h * G + gn_s) * sl_h + (T0 + tn_s) * sl_t
        lse2_n = gl.load(lse_ptr + stn, mask=okn_s, other=0.0) * LOG2E
        delta_n = gl.load(delta_ptr + stn, mask=okn_s, other=0.0)
        if GATED:
            gate_n = gl.load(gate_ptr + stn, mask=okn_s, other=0.0)
        tn_q, sn_q, gn_q, okn_q = _rows(entries_ptr, c0 + BT, end, h, N, G, GP, M, row_q)
        # Chunk i's copies (all but the group just committed).
        async_copy.wait_group(1)
        gl.thread_barrier()
        fence_async_shared()
        qs = q_buf.index(cur)
        dos = do_buf.index(cur)
        vis = ok_s[:, None] & key_ok_s[None, :] & (key_s[None, :] <= (T0 + t_s)[:, None])
        s = warpgroup_mma(qs, k_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(dos, v_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if OVERLAP:
            # P while dP's dot runs; dQ's dot first, and its store while dV's and dK's run.
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
            p = gl.where(vis, gl.exp2(s * scale2 - lse2[:, None]), 0.0)
            if GATED:
                p = p * gate[:, None]
            p_smem.store(p.to(dtype))
            dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp, ))
        else:
            s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
            p = gl.where(vis, gl.exp2(s * scale2 - lse2[:, None]), 0.0)
            if GATED:
                p = p * gate[:, None]
            p_smem.store(p.to(dtype))
        ds = p * (dp - delta[:, None])
        ds_smem.store(ds.to(dtype))
        gl.thread_barrier()
        fence_async_shared()
        if OVERLAP:
            dq = warpgroup_mma(ds_smem, k_smem, q_zero, use_acc=False, is_async=True)
            dv_acc = warpgroup_mma(p_smem.permute((1, 0)), dos, dv_acc, is_async=True)
            dk_acc = warpgroup_mma(ds_smem.permute((1, 0)), qs, dk_acc, is_async=True)
            dq = warpgroup_mma_wait(num_outstanding=2, deps=(dq, ))
        else:
            dv_acc = warpgroup_mma(p_smem.permute((1, 0)), dos, dv_acc, is_async=True)
            dk_acc = warpgroup_mma(ds_smem.permute((1, 0)), qs, dk_acc, is_async=True)
            dq = warpgroup_mma(ds_smem, k_smem, q_zero, use_acc=False, is_async=True)
            dv_acc, dk_acc, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dv_acc, dk_acc, dq))
        if STORE_LD:
            # 16-byte stores: the tile through shared memory into the gathers' layout.
            row = b * sdq_b + t_ld * sdq_t + (h * G + g_ld) * sdq_h + slot_ld * sdq_n
            gl.store(dqp_ptr + row[:, None] + dcol[None, :],
                     gl.convert_layout((dq * sc).to(dqp_ptr.dtype.element_ty), ld), mask=ok_ld[:, None])
        else:
            row = b * sdq_b + t_q * sdq_t + (h * G + g_q) * sdq_h + slot_q * sdq_n
            gl.store(dqp_ptr + row[:, None] + dq_col[None, :], (dq * sc).to(dqp_ptr.dtype.element_ty),
                     mask=ok_q[:, None])
        if OVERLAP:
            dv_acc, dk_acc = warpgroup_mma_wait(num_outstanding=0, deps=(dv_acc, dk_acc))
        t_ld, slot_ld, g_ld, ok_ld = tc, sc_, gc, okc
        tc, sc_, gc, okc = tn, sn, gn, okn
        t_s, ok_s, lse2, delta = tn_s, okn_s, lse2_n, delta_n
        if GATED:
            gate = gate_n
        t_q, slot_q, g_q, ok_q = tn_q, sn_q, gn_q, okn_q
    async_copy.wait_group(0)
    dk_acc = dk_acc * sc
    r = gl.arange(0, BL, layout=gl.SliceLayout(1, mma_kv))
    c = gl.arange(0, D, layout=gl.SliceLayout(0, mma_kv))
    at = (w.to(gl.int64) * BL + r[:, None]) * D + c[None, :]
    gl.store(dkp_ptr + at, dk_acc)
    gl.store(dvp_ptr + at, dv_acc)


def capture_backward(B: int, T: int, Hq: int, Hkv: int, D: int, gated: bool):
    """The selected op's backward on random inputs: every range's _bwd_kernel launch (args, kwargs)."""
    from nsa_flex.bench.selected import random_selection
    from nsa_flex.config import NSAConfig
    from nsa_flex.ops.selected_attention import launch

    cfg = NSAConfig(n_heads=Hq, n_kv_heads=Hkv, head_dim=D)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=dev, dtype=torch.bfloat16)  # noqa: E731
    q, do, o = rnd(B, T, Hq, D), rnd(B, T, Hq, D), rnd(B, T, Hq, D)
    k, v = rnd(B, T, Hkv, D), rnd(B, T, Hkv, D)
    lse = torch.rand(B, Hq, T, device=dev, generator=gen) * 4 + 2
    selection = random_selection(B, Hkv, T, cfg, dev)
    gate = torch.rand(B, Hq, T, device=dev, generator=gen) if gated else None
    delta = torch.randn(B, Hq, T, device=dev, generator=gen) if gated else None
    calls = []
    saved = launch.launch

    def grab(kernel, grid, *args, writes=(), **kwargs):
        if kernel.fn.__name__ == "_bwd_kernel":
            calls.append((grid, args, kwargs))
        return saved(kernel, grid, *args, writes=writes, **kwargs)

    launch.launch = grab
    try:
        launch.backward(do, q, k, v, o, lse, selection, None, D ** -0.5, cfg.sel_block, gate=gate, delta=delta)
    finally:
        launch.launch = saved
    return calls


def _args_partials(args):
    """The launch's args with n_items 2 for every block (every item writes its partial) and fresh
    dQ / dK / dV partial buffers."""
    args = list(args)
    args[16] = torch.full_like(args[16], 2)  # n_items
    for i in (7, 8, 9):  # dqp, dkp, dvp
        args[i] = torch.zeros_like(args[i])
    return args


def run_triton(grid, args, kwargs):
    from nsa_flex.ops.selected_attention import kernels

    kw = {k: v for k, v in kwargs.items() if k != "maxnreg" or v}
    kernels._bwd_kernel[grid](*args, **kw)


def run_gluon(grid, args, kwargs, **extra):
    kw = {k: v for k, v in kwargs.items() if k not in ("num_stages", "maxnreg")}
    _bwd_gluon[grid](*args, **kw, **extra)


def compile_sm90() -> None:
    """Build the Gluon kernel for sm_90a without a GPU (arguments of a CPU capture) and print its
    registers and shared memory."""
    from triton.compiler import compile as triton_compile
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    from bench.kernel_regs import _Compiler, _ptxas_report
    from nsa_flex.ops.selected_attention import launch

    calls = []
    saved = launch.launch
    launch.launch = lambda kernel, grid, *a, writes=(), **kw: calls.append((grid, a, kw))
    try:
        from nsa_flex.bench.selected import random_selection
        from nsa_flex.config import NSAConfig

        for gated in (False, True):
            cfg = NSAConfig(n_heads=16, n_kv_heads=4, head_dim=128)
            T = 1024
            q, do, o = (torch.randn(1, T, 16, 128, dtype=torch.bfloat16) for _ in range(3))
            k, v = torch.randn(1, T, 4, 128, dtype=torch.bfloat16), torch.randn(1, T, 4, 128, dtype=torch.bfloat16)
            lse = torch.rand(1, 16, T)
            sel = random_selection(1, 4, T, cfg, "cpu")
            # The CPU launch config has F32_DOT; the sm_90 build takes the GPU's.
            try:
                launch.backward(do, q, k, v, o, lse, sel, None, 128 ** -0.5, cfg.sel_block,
                                gate=lse.clone() if gated else None, delta=lse.clone())
            except Exception:
                pass
    finally:
        launch.launch = saved

    class _GluonCompiler(_Compiler):
        def compile(self, fn, grid, args, kwargs):
            binder = create_function_from_signature(fn.signature, fn.params, self.backend)
            bound, spec, options = binder(*args, **kwargs)
            options, signature, constexprs, attrs = fn._pack_args(self.backend, kwargs, bound, spec, options)
            kernel = triton_compile(GluonASTSource(fn, signature, constexprs, attrs), target=self.target,
                                    options=options.__dict__)
            print({"gated": kwargs.get("GATED"), **_ptxas_report(kernel.asm["ptx"], "sm_90a", None),
                   "shared_bytes": kernel.metadata.shared}, flush=True)

    comp = _GluonCompiler()
    seen = set()
    for grid, args, kw in calls:
        if kw.get("GATED") in seen:
            continue
        seen.add(kw.get("GATED"))
        kw = {k: v for k, v in kw.items() if k not in ("num_stages", "maxnreg")}
        kw["F32_DOT"] = False
        for overlap in (False, True):
            for rows in (2, 8):
                comp(_bwd_gluon)[grid](*args, **kw, OVERLAP=overlap, LD_ROWS=rows)


SHAPES = ((1, 65536, 16, 4, 128), (1, 16384, 16, 4, 128), (1, 65536, 64, 4, 128))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--compile", action="store_true", help="build for sm_90a without a GPU and print resources")
    args = p.parse_args()
    if args.compile:
        compile_sm90()
        return
    from bench.common import header

    out = {"header": header(), "rows": []}
    for shape in SHAPES:
        for gated in (False, True):
            row = {"shape": list(shape), "gated": gated}
            try:
                calls = capture_backward(*shape, gated)
                row["ranges"] = len(calls)
                for name, extra in (("triton", None), ("gluon_store_ld", {"STORE_LD": True}),
                                    ("gluon_overlap", {"OVERLAP": True}), ("gluon_ld8", {"LD_ROWS": 8}),
                                    ("gluon_overlap_ld8", {"OVERLAP": True, "LD_ROWS": 8})):
                    total, worst = 0.0, {}
                    for grid, a, kw in calls:
                        ta = _args_partials(a)
                        run_triton(grid, ta, kw)
                        if extra is None:
                            fn = lambda: run_triton(grid, ta, kw)  # noqa: E731
                        else:
                            ga = _args_partials(a)
                            fn = lambda: run_gluon(grid, ga, kw, **extra)  # noqa: E731
                            fn()
                            torch.cuda.synchronize()
                            for part, i in (("dq_partials", 7), ("dk_partials", 8), ("dv_partials", 9)):
                                diff = float((ta[i].float() - ga[i].float()).abs().max())
                                worst[part] = max(worst.get(part, 0.0), diff)
                        total += triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
                    row[f"{name}_ms"] = total
                    row.update({f"{name}_max_diff_{k}": v for k, v in worst.items()})
            except Exception as exc:  # one failing shape must not lose the others
                row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
            print(row, flush=True)
            out["rows"].append(row)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(out, f, indent=1)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
