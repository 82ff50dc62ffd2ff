"""Kernel times of the block-centric selected op per launch setting, from torch.profiler, on a GPU.

    python -m bench.selected_kernels_gpu --out $OUT/selected_kernels.json --shapes 1:65536:16:4:128 \\
        --variants default=- fwd_reg0=fwd_maxnreg:0 bwd_reg128=bwd_maxnreg:128

For each shape B:T:Hq:Hkv:D (bf16, NSA-shaped random selections from nsa_flex.bench.selected) and
each variant (NAME=KEY:INT,KEY:INT over launch_config's tiles; "-" for none), run twice in turn:
the CUDA time per call of each kernel of launch.forward and of launch.backward (three calls each
under the profiler), the forward's median from triton.testing.do_bench, the memory the backward
allocates beyond what is held before it (its results included), and the largest
difference of o, dq, dk and dv from the first variant's. Kernel sums are
steadier between calls than wall times (bench.selected_tiles_gpu times the whole calls).
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import header, parse_shape, row_recorder, selected_op_inputs, shape_script_parser
from nsa_flex.ops.selected_attention import launch


def parse_variant(spec: str) -> tuple[str, dict]:
    name, _, keys = spec.partition("=")
    if keys in ("", "-"):
        return name, {}
    return name, {k: int(v) for k, v in (kv.split(":") for kv in keys.split(","))}


def kernel_ms(fn, calls: int = 3, prefix: str = "_") -> dict[str, float]:
    """CUDA ms per call of each kernel whose name starts with `prefix` ("_": the op's Triton and Gluon
    kernels; "": every kernel, cuDNN's and Inductor's too) and their sum."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    ms = {e.key[:40]: e.self_device_time_total / calls / 1e3 for e in prof.key_averages()
          if e.key.startswith(prefix) and e.self_device_time_total > 0}
    return {**ms, "sum": sum(ms.values())}


def main() -> None:
    p = shape_script_parser(__doc__, ["1:65536:16:4:128"])
    p.add_argument("--variants", nargs="+", default=["default=-"], help="NAME=KEY:INT,... or NAME=-")
    args = p.parse_args()
    import triton

    _, add = row_recorder(args.out, header(args.commit))
    variants = [parse_variant(v) for v in args.variants]
    for shape in args.shapes:
        B, T, Hq, Hkv, D = parse_shape(shape)
        cfg, q, k, v, do, bi = selected_op_inputs(shape)
        scale = D ** -0.5
        first = None  # the first variant's outputs, which every variant's are compared with
        for rep in range(2):
            for name, tiles in variants:
                o, lse = launch.forward(q, k, v, bi, None, scale, cfg.sel_block, tiles)
                grads = launch.backward(do, q, k, v, o, lse, bi, None, scale, cfg.sel_block, tiles)
                outs = (o, *grads)
                first = first or outs
                diff = {key: (a.float() - b.float()).abs().max().item()
                        for key, a, b in zip(("o", "dq", "dk", "dv"), outs, first)}
                fwd = lambda: launch.forward(q, k, v, bi, None, scale, cfg.sel_block, tiles)  # noqa: E731
                bwd = lambda: launch.backward(do, q, k, v, o, lse, bi, None, scale, cfg.sel_block, tiles)  # noqa: E731
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                bwd()
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
                add({"shape": shape, "variant": name, "backward_peak_over_inputs_mib": peak,
                     "tiles": {**launch.launch_config(Hq // Hkv, D, D, q.dtype, B * T), **tiles}, "round": rep,
                     "max_diff_from_first": diff, "forward_kernels_ms": kernel_ms(fwd),
                     "backward_kernels_ms": kernel_ms(bwd),
                     "forward_do_bench_ms": triton.testing.do_bench(fwd, warmup=5, rep=100)})


if __name__ == "__main__":
    main()
