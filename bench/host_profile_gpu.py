"""Host time against GPU time of nsa_flex, eager glue and whole-op compiled, with a kernel table.

    python bench/host_profile_gpu.py --out $OUT/host.json --shapes 16:2048:12:3:64 1:8192:64:4:128

A shape is B:T:Hq:Hkv:D. For each variant (eager glue with each Flex call compiled; the whole op
under torch.compile(fullgraph=True)) and each of forward / forward+backward:
  wall_ms     host wall time of one call, synchronised (median of 10)
  gpu_ms      summed GPU time of its kernels (torch.profiler, one call)
  kernels     kernels launched by one call
  syncs       host-device synchronisations (cudaStreamSynchronize / cudaDeviceSynchronize /
              cudaMemcpy to host) in one call
  top_gpu     the 15 kernels with the most GPU time
  top_cpu     the 15 operators with the most self CPU time (eager only)
When wall_ms is far above gpu_ms the call is bound by the host (Python and launches), and
kernel-level tuning cannot help until that is fixed. JSON is rewritten after every row.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from flex_gpu import header as flex_header, inputs  # noqa: E402
from records import json_saver  # noqa: E402

from nsa_flex import NSAConfig  # noqa: E402
from nsa_flex.flex import nsa_flex  # noqa: E402
from nsa_flex.flex.tuning import install_flex_tuning  # noqa: E402

_SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaEventSynchronize")


def parse_shape(shape: str) -> tuple[int, int, int, int, int]:
    """"B:T:Hq:Hkv:D" -> (B, T, Hq, Hkv, D), the shape argument of the GPU scripts."""
    B, T, Hq, Hkv, D = (int(s) for s in shape.split(":"))
    return B, T, Hq, Hkv, D


def make_inputs(B, T, Hq, Hkv, D, seed=0):
    """(config, bf16 op inputs) of one shape B:T:Hq:Hkv:D."""
    cfg = NSAConfig(n_heads=Hq, n_kv_heads=Hkv, head_dim=D)
    return cfg, inputs(cfg, T, seed=seed, B=B)


def wall_ms(fn, reps: int = 10) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def kernel_table(fn) -> dict:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    gpu, n, syncs, cpu = {}, 0, 0, {}
    for e in prof.events():
        dev_type = str(getattr(e, "device_type", ""))
        if dev_type.endswith("CUDA") and e.device_time > 0:
            gpu[e.name] = gpu.get(e.name, 0.0) + e.device_time
            n += 1
        elif any(e.name.startswith(s) for s in _SYNC_EVENTS):
            # cudaMemcpyAsync device->device does not block the host; count the others.
            syncs += 0 if e.name.startswith("cudaMemcpyAsync") else 1
    for a in prof.key_averages():
        if a.self_cpu_time_total > 0 and not a.key.startswith("cuda"):
            cpu[a.key] = a.self_cpu_time_total
    return {"gpu_ms": round(sum(gpu.values()) / 1e3, 3), "kernels": n, "syncs": syncs, "top_gpu": _top(gpu),
            "top_cpu": _top(cpu)}


def _top(us_by_name: dict[str, float], n: int = 15, width: int = 90) -> dict[str, float]:
    """The n largest entries in ms, names cut to `width`; names that the cut makes equal are summed."""
    ms: dict[str, float] = {}
    for name, us in us_by_name.items():
        ms[name[:width]] = ms.get(name[:width], 0.0) + us / 1e3
    return {k: round(v, 3) for k, v in sorted(ms.items(), key=lambda kv: -kv[1])[:n]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shapes", nargs="+", default=["16:2048:12:3:64"])
    p.add_argument("--variants", default="eager,compiled")
    p.add_argument("--commit", default="")
    args = p.parse_args()
    install_flex_tuning()
    rows = []
    header = flex_header(args.commit)

    save = json_saver(args.out, {"header": header, "rows": rows})

    # Every shape eagerly first: the whole-op compiles are the slow part of a run.
    for variant in args.variants.split(","):
        for shape in args.shapes:
            B, T, Hq, Hkv, D = parse_shape(shape)
            cfg, x = make_inputs(B, T, Hq, Hkv, D)
            do = torch.randn(B, T, Hq, D, device="cuda", dtype=torch.bfloat16)
            leaves = list(x.values())

            def op(cfg=cfg, **kw):
                return nsa_flex(**kw, config=cfg)[0]

            fn = op if variant == "eager" else torch.compile(op, fullgraph=True, dynamic=False)

            def fwd(fn=fn, x=x):
                return fn(**x)

            def fwd_bwd(fn=fn, x=x, do=do, leaves=leaves):
                torch.autograd.backward(fn(**x), do, inputs=leaves)

            t0 = time.monotonic()
            fwd_bwd()
            torch.cuda.synchronize()
            first_s = time.monotonic() - t0
            for what, f in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
                f()
                r = {"shape": shape, "variant": variant, "what": what, "first_s": round(first_s, 1),
                     "wall_ms": round(wall_ms(f), 3), **kernel_table(f)}
                if variant != "eager":
                    r.pop("top_cpu")
                rows.append(r)
                print({k: v for k, v in r.items() if not k.startswith("top")}, flush=True)
                save()


if __name__ == "__main__":
    main()
