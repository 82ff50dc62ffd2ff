"""GPU smoke test of the optional peers, straight through their own APIs (no nsa-flex code).

fla's `parallel_nsa` and lucidrains' `SparseAttention` (Triton kernel), each timed at one
length (default T=8k; B=1, Hq=64, Hkv=4, D=128, bf16), forward and forward+backward, beside
cuDNN SDPA causal. Each case that fails prints its error; the others go on.

On the GPU machine, with the wheels of .whl/ (README: "Benchmarks"):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 bench/peers_smoke.py
"""

from __future__ import annotations

import argparse
import importlib.metadata
import statistics
import warnings

import torch
import torch.nn.functional as F


def time_ms(step, iters: int) -> tuple[float, float]:
    """(first call, median of `iters` later calls) in ms, CUDA events."""
    times = []
    for _ in range(iters + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times[0], statistics.median(times[1:])


def cases(T: int, B: int = 1, Hq: int = 64, Hkv: int = 4, D: int = 128, dim: int = 1024):
    """name -> (forward closure, leaves for the backward)."""
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, T, Hq, D, device=dev, dtype=dt, requires_grad=True)
    k, v = (torch.randn(B, T, Hkv, D, device=dev, dtype=dt, requires_grad=True) for _ in range(2))

    def cudnn():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True, enable_gqa=True)

    yield "cuDNN SDPA causal", cudnn, [q, k, v]
    g_cmp, g_slc = (torch.rand(B, T, Hq, device=dev, dtype=dt, requires_grad=True) for _ in range(2))

    def fla():
        from fla.ops.nsa import parallel_nsa

        return parallel_nsa(q, k, v, g_cmp=g_cmp, g_slc=g_slc, block_counts=16, block_size=64, window_size=0)

    yield "fla parallel_nsa (cmp+sel, no window)", fla, [q, k, v, g_cmp, g_slc]
    try:
        from native_sparse_attention_pytorch import SparseAttention
    except ImportError as exc:
        yield "lucidrains SparseAttention", _raiser(exc), []
        return
    module = SparseAttention(dim=dim, dim_head=D, heads=Hq, kv_heads=Hkv, sliding_window_size=512,
                             compress_block_size=32, compress_block_sliding_stride=16, selection_block_size=64,
                             num_selected_blocks=16, causal=True, use_triton_kernel=True).to(dev, dt)
    x = torch.randn(B, T, dim, device=dev, dtype=dt, requires_grad=True)
    leaves = [x, *(w for w in module.parameters() if w.requires_grad)]
    yield f"lucidrains SparseAttention module (dim={dim})", lambda: module(x), leaves


def _raiser(exc: Exception):
    def fail():
        raise exc
    return fail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=ImportWarning)
    versions = {p: _version(p) for p in ("torch", "triton", "fla-core", "native-sparse-attention-pytorch")}
    print(f"{torch.cuda.get_device_name()} | " + ", ".join(f"{p} {v}" for p, v in versions.items()))
    print(f"T={args.seq_len} B=1 Hq=64 Hkv=4 D=128 bf16; ms as first call / median of {args.iters}")
    for name, fn, leaves in cases(args.seq_len):
        cells = []
        for mode in ("fwd", "fwd+bwd"):
            try:
                first, median = time_ms(_step(fn, leaves, mode), args.iters)
                cells.append(f"{mode} {first:9.2f} / {median:8.3f}")
            except Exception as exc:
                first_line = (str(exc).splitlines() or [""])[0][:200]
                cells.append(f"{mode} FAILED {type(exc).__name__}: {first_line}")
        print(f"{name:48} " + " | ".join(cells), flush=True)


def _step(fn, leaves, mode: str):
    if mode == "fwd":
        return lambda: _no_grad(fn)
    grad: list[torch.Tensor] = []

    def step():
        out = fn()
        if not grad:
            grad.append(torch.randn_like(out))
        torch.autograd.grad(out, leaves, grad[0], allow_unused=True)
    return step


def _no_grad(fn):
    with torch.no_grad():
        return fn()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    main()
