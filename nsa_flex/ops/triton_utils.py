"""Triton helpers shared by several ops: Triton's presence, programmatic dependent launch (PDL)
and per-program timeline stamps.

PDL (sm_90+): a kernel launched with launch_pdl may start before the kernel ahead of it ends;
it does what it can, then waits in pdl_wait. Timeline stamps (TRACE) record, per program, its
entry, the end of its wait, a mid point and its end, read by the decode timeline tool.
"""

from __future__ import annotations

import contextlib
import logging

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the CPU wheel of torch ships no Triton: ops run their torch twins
    HAS_TRITON = False


def runs_triton(x, impl: str) -> bool:
    """Whether an op with impl "auto" | "triton" | "torch" runs its Triton kernels on x's device:
    "triton" always (on CPU only under Triton's interpreter), "auto" on CUDA where Triton is
    installed, else the op's torch twin."""
    return impl == "triton" or (impl == "auto" and x.device.type == "cuda" and HAS_TRITON)


def dense(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors, contiguous: a kernel gets strides as numbers fixed when torch.compile traces
    its launch, and Inductor keeps a contiguous input's layout exactly (a strided one only its
    stride order). A no-op for tensors that are contiguous already."""
    return tuple(x.contiguous() for x in xs)


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1): Triton's block shapes are powers of two."""
    return 1 << max(0, x - 1).bit_length()


@contextlib.contextmanager
def quiet_without_triton():
    """Registering a triton_op logs "Triton not available" on machines without Triton (CPU
    wheels), where the op runs its twin by design: silence that one logger meanwhile."""
    log = logging.getLogger("torch._library.triton")
    level = log.level
    if not HAS_TRITON:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def pdl_launch(device: torch.device, wanted: bool) -> dict:
    """Launch arguments for a kernel with a PDL constexpr (see pdl_wait): programmatic dependent
    launch where wanted and the GPU has it (sm_90 and newer); launch_pdl only then, since the
    interpreter knows neither."""
    pdl = wanted and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    return {"PDL": pdl, **({"launch_pdl": True} if pdl else {})}


if HAS_TRITON:

    @triton.jit
    def pdl_wait(after, PDL: tl.constexpr):
        """Programmatic dependent launch: waits until the previous kernel has finished and its
        writes are visible, then lets the next kernel launch. Returns 0 (int32), which the caller
        adds into the address of every load of an earlier kernel's result. The asm is marked
        pure, so only that data dependency orders those loads after it (and ptxas keeps memory
        operations on their side of griddepcontrol.wait): an impure asm makes torch's mutation
        analysis of the kernel give up and assume every argument written, the caches included.
        after: an int32 scalar for the asm's input, a program id: an input derived from loaded
        data would make that mutation analysis count the loaded argument as written too (it
        follows stored addresses back through every operand).

        Every kernel waits before it lets the next launch, so a kernel that starts early finds
        the kernel two launches back finished: what it reads before its own wait must come from
        there or earlier.

        Only Triton's own launcher honours launch_pdl: Inductor, launching a triton_op's kernels
        itself, drops it. So decode_attend and cache_step are custom_ops, opaque to Inductor."""
        z = 0
        if PDL:
            z = tl.inline_asm_elementwise(
                # One line: Inductor copies this source into a module of its own, where an escaped
                # newline in a string breaks it.
                "griddepcontrol.wait; griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r,r",
                [after], dtype=tl.int32, is_pure=True, pack=1)
        return z

    @triton.jit
    def global_time(after):
        """The GPU's global timer (ns), read once `after` (an int32 scalar) is known: a timeline
        stamp (TRACE)."""
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [after], dtype=tl.int64,
                                         is_pure=False, pack=1)

    @triton.jit
    def store_trace(trace_ptr, t_entry, t_released, t_mid, TRACE: tl.constexpr):
        """Stores a program's timeline (TRACE): entry, the end of its wait for the kernel ahead,
        a point of the kernel's choosing after that (t_mid), its end (after a barrier, so after
        its last store issued) and its SM, at trace_ptr[program, :5] (programs numbered
        row-major over the grid)."""
        if TRACE:
            tl.debug_barrier()
            slot = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)).to(tl.int64) * 5
            t_end = global_time(tl.program_id(1))
            sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [tl.program_id(0)], dtype=tl.int32,
                                           is_pure=False, pack=1)
            tl.store(trace_ptr + slot, t_entry)
            tl.store(trace_ptr + slot + 1, t_released)
            tl.store(trace_ptr + slot + 2, t_mid)
            tl.store(trace_ptr + slot + 3, t_end)
            tl.store(trace_ptr + slot + 4, sm.to(tl.int64))

    @triton.jit
    def dot(a, b, F32_DOT: tl.constexpr, IEEE: tl.constexpr):
        """tl.dot with the precision the caller needs: F32_DOT upcasts both operands to fp32 (the
        interpreter's bf16 dot is wrong), IEEE keeps fp32 operands exact (no tf32)."""
        if F32_DOT:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        elif IEEE:
            return tl.dot(a, b, input_precision="ieee")
        else:
            return tl.dot(a, b)
