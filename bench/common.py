"""What the GPU scripts share: timing, the record header, JSON records, time-limited children, op inputs.

Records are rewritten after every measurement, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
from pathlib import Path
from typing import Callable

import torch

from nsa_flex import NSAConfig
from nsa_flex.bench.core import environment, git_commit
from nsa_flex.blocks import num_cmp_blocks

_SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaEventSynchronize")


def header(commit: str = "") -> dict:
    """Device, versions, commit and UTC date of a record (the checkout's HEAD when commit is empty)."""
    return {**environment("cuda" if torch.cuda.is_available() else "cpu"), "commit": commit or git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def bench_ms(fn) -> float:
    """Median ms of fn() (triton.testing.do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median"))


def peak_gib(fn) -> float:
    """Peak allocated GiB of one call of fn, counted from the allocations alive before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def shape_script_parser(doc: str, default_shapes: list[str]) -> argparse.ArgumentParser:
    """The arguments every shape-sweeping GPU script takes: --out JSON, --shapes B:T:Hq:Hkv:D ..., --commit."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shapes", nargs="+", default=default_shapes, help="B:T:Hq:Hkv:D each")
    p.add_argument("--commit", default="")
    return p


def parse_shape(shape: str) -> tuple[int, int, int, int, int]:
    """"B:T:Hq:Hkv:D" -> (B, T, Hq, Hkv, D), the shape argument of the GPU scripts."""
    B, T, Hq, Hkv, D = (int(s) for s in shape.split(":"))
    return B, T, Hq, Hkv, D


def selected_op_inputs(shape: str):
    """(config, q, k, v, dO, selection) of the block-centric selected op at B:T:Hq:Hkv:D: bf16
    N(0, 1) tensors from a fixed seed and NSA-shaped random selections (nsa_flex.bench.selected)."""
    from nsa_flex.bench.selected import random_selection

    B, T, Hq, Hkv, D = parse_shape(shape)
    cfg = NSAConfig(n_heads=Hq, n_kv_heads=Hkv, head_dim=D)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, T, h, D, generator=g, device="cuda", dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv, Hq))
    return cfg, q, k, v, do, random_selection(B, Hkv, T, cfg, "cuda")


def json_saver(path: Path, record: dict) -> Callable[[], None]:
    """A save() that writes `record` (as it is at the time of the call) to `path`, folders made as needed."""

    def save() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1, default=str))

    return save


def row_recorder(path: Path, header: dict) -> tuple[list[dict], Callable[[dict], None]]:
    """(rows, add): add(row) appends a row, prints it and rewrites {"header", "rows"} at `path`."""
    rows: list[dict] = []
    save = json_saver(path, {"header": header, "rows": rows})

    def add(row: dict) -> None:
        rows.append(row)
        print(row, flush=True)
        save()

    save()
    return rows, add


def run_limited(cmd: list[str], limit_s: float, tail: int = 5000, **kwargs) -> tuple[str, str]:
    """(status, output): 'exit N' or 'cut off after S s', and the last `tail` characters of stdout + stderr.

    kwargs go to subprocess.run (cwd, env). A cut-off child's stdout is what it flushed before the limit.
    """
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s, **kwargs)
        return f"exit {p.returncode}", (p.stdout + p.stderr)[-tail:]
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return f"cut off after {limit_s:g} s", out[-tail:]


def inputs(cfg: NSAConfig, T: int, dtype=torch.bfloat16, seed: int = 0, B: int = 1) -> dict:
    """Random op inputs of B sequences, all taking gradients (q, k, v, k_cmp, v_cmp, gates in [0, 1))."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    Tc = num_cmp_blocks(T, cfg)
    Hq, Hkv, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dv

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=dtype).requires_grad_(True)

    return {"q": randn(B, T, Hq, Dk), "k": randn(B, T, Hkv, Dk), "v": randn(B, T, Hkv, Dv),
            "k_cmp": randn(B, Tc, Hkv, Dk), "v_cmp": randn(B, Tc, Hkv, Dv),
            "gates": torch.rand(B, T, Hq, 3, generator=gen, device="cuda", dtype=dtype).requires_grad_(True)}


def make_inputs(B, T, Hq, Hkv, D, seed=0):
    """(config, bf16 op inputs) of one shape B:T:Hq:Hkv:D."""
    cfg = NSAConfig(n_heads=Hq, n_kv_heads=Hkv, head_dim=D)
    return cfg, inputs(cfg, T, seed=seed, B=B)


def dense_cudnn(x: dict, G: int, requires_grad: bool = True):
    """(fn, {"q", "k", "v"}): dense causal cuDNN SDPA on the op inputs x, k/v repeated to the Hq heads.

    The baseline every GPU script times in the same run as nsa_flex (absolute times drift between
    machines; ratios within one run do not).
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qd = x["q"].detach().transpose(1, 2).contiguous()
    kd, vd = (x[n].detach().repeat_interleave(G, dim=2).transpose(1, 2).contiguous() for n in ("k", "v"))
    tensors = {n: t.requires_grad_(requires_grad) for n, t in zip("qkv", (qd, kd, vd))}

    def dense():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True)

    return dense, tensors


def kernel_table(fn) -> dict:
    """One call of fn under torch.profiler: GPU ms, kernels launched, host syncs, top GPU kernels and CPU ops."""
    from torch.profiler import ProfilerActivity, profile

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
