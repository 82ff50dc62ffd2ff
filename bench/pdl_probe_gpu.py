"""Does programmatic dependent launch (PDL) shorten a chain of small dependent kernels in a CUDA graph?

    PYTHONPATH=. python3 bench/pdl_probe_gpu.py --out $OUT/pdl_probe.json

The decode step is a chain of five small kernels whose cost is mostly launch and ramp latency
(bench/results/2026-11-24_h200_decode_latency_analysis.md). This probe times a chain of K
dependent copy-add kernels (each reads what the previous one wrote), launched directly by
Triton, captured in a CUDA graph, with and without `launch_pdl=True` and
`gdc_wait` / `gdc_launch_dependents` in the kernels. It checks the result of each variant
(PDL must not break the dependency) and reports us per kernel. It also tries the same
launch through torch.compile (wrap_triton in a triton_op), to see whether that path accepts the option.

"flags" (session 13): each kernel lets the next launch at once and spins on a counter until every
program of the kernel ahead has counted itself in, instead of PDL's grid-wide wait. It was slower
than PDL at every size (bench/results/2026-11-25_h100_pdl_probe_flags_s13.json).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton
import triton.language as tl


@triton.jit
def _step(x_ptr, y_ptr, n, PDL: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if PDL:
        # Everything above runs while the previous kernel finishes; its writes are visible after this.
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + offs, mask=offs < n)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(y_ptr + offs, x + 1, mask=offs < n)


@triton.jit
def _step_flag(x_ptr, y_ptr, cnt_ptr, n, expect, FIRST: tl.constexpr, BLOCK: tl.constexpr):
    """A chain link that hands over by a counter instead of the grid's end: it lets the next kernel
    launch at once, then spins (acquiring atomic) until all `expect` programs of the kernel ahead
    have counted themselves in. A dependent grid starts only once every program of the grid ahead
    has started (or ended), so the programs it waits for are resident: the spin cannot hang."""
    tl.extra.cuda.gdc_launch_dependents()
    if FIRST:
        tl.extra.cuda.gdc_wait()
    else:
        c = tl.atomic_add(cnt_ptr - 1, 0, sem="acquire", scope="gpu")
        while c < expect:
            c = tl.atomic_add(cnt_ptr - 1, 0, sem="acquire", scope="gpu")
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, cache_modifier=".cg")
    tl.store(y_ptr + offs, x + 1, mask=offs < n)
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")


def chain(bufs: list[torch.Tensor], programs: int, block: int, pdl: bool, counts: torch.Tensor | None = None) -> None:
    n = bufs[0].numel()
    if counts is not None:
        # Each replay starts from zero counts (a memset node ahead of the chain; the slope over K cancels it).
        counts.zero_()
        for i, (src, dst) in enumerate(zip(bufs[:-1], bufs[1:])):
            _step_flag[(programs,)](src, dst, counts[i + 1:], n, programs, FIRST=i == 0, BLOCK=block,
                                    launch_pdl=True, num_warps=4)
        return
    for src, dst in zip(bufs[:-1], bufs[1:]):
        _step[(programs,)](src, dst, n, PDL=pdl, BLOCK=block, launch_pdl=pdl, num_warps=4)


def time_graph(fn, reps: int = 200) -> float:
    """us per replay of a CUDA graph of fn (median of 5 runs of `reps` replays)."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    rows = []
    started = time.perf_counter()
    for kernels in (5, 10):
        for programs in (64, 256, 512):
            block = 1024
            bufs = [torch.zeros(programs * block, device="cuda") for _ in range(kernels + 1)]
            row = {"kernels": kernels, "programs": programs}
            counts = torch.zeros(kernels + 1, dtype=torch.int32, device="cuda")
            for key, pdl, cnt in (("plain", False, None), ("pdl", True, None), ("flags", True, counts)):
                try:
                    bufs[0].fill_(1.0)
                    chain(bufs, programs, block, pdl, cnt)
                    torch.cuda.synchronize()
                    ok = bool((bufs[-1] == 1.0 + kernels).all())
                    us = time_graph(lambda: chain(bufs, programs, block, pdl, cnt))
                    bufs[0].fill_(1.0)
                    g_ok = None
                    # After the graph replays, the chain must still hold.
                    chain(bufs, programs, block, pdl, cnt)
                    torch.cuda.synchronize()
                    g_ok = bool((bufs[-1] == 1.0 + kernels).all())
                    row[key] = {"us": us, "us_per_kernel": us / kernels, "correct": ok and g_ok}
                except Exception as exc:  # a variant that fails is a result too
                    row[key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            rows.append(row)
            print(f"[{time.perf_counter() - started:4.0f} s] {row}", flush=True)
    rows.append({"compile_path": compile_path()})
    print(rows[-1], flush=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "triton": triton.__version__, "rows": rows}, indent=1))


def compile_path() -> str:
    """Whether torch.compile accepts launch_pdl on a wrap_triton launch inside a triton_op."""
    from torch.library import triton_op, wrap_triton

    @triton_op("pdl_probe::chain2", mutates_args=())
    def chain2(x: torch.Tensor) -> torch.Tensor:
        y, z = torch.empty_like(x), torch.empty_like(x)
        wrap_triton(_step)[(x.numel() // 1024,)](x, y, x.numel(), PDL=True, BLOCK=1024, launch_pdl=True)
        wrap_triton(_step)[(x.numel() // 1024,)](y, z, x.numel(), PDL=True, BLOCK=1024, launch_pdl=True)
        return z

    try:
        x = torch.ones(64 * 1024, device="cuda")
        out = torch.compile(lambda t: torch.ops.pdl_probe.chain2(t), fullgraph=True)(x)
        return f"ok: {bool((out == 3).all())}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:400]


if __name__ == "__main__":
    main()
