"""The selected op's Gluon backward kernel (nsa_flex/ops/selected_attention/gluon_kernels.py).

Gluon kernels do not run under Triton's CPU interpreter. On CPU: the kernel builds for sm_90a
(Triton ships ptxas) within Hopper's registers and shared memory, and the backward's path
around it (every item's partial, the block sum finishing every block) runs interpreted with
the Triton kernel standing in for it. On the GPU (marked gpu): the backward with the Gluon
kernel equals the one with the Triton kernel bit for bit, in every mode of the block sums, and
the selected op's fp64-oracle tests (test_selected_attention.py) run through it on an H100.
"""

from __future__ import annotations

import pytest
import torch

from interpreter import interpreter_mark
from nsa_flex.ops.selected_attention import gluon_kernels, kernels, launch

from test_selected_attention import make_config, make_inputs, random_selection

gpu = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)
interpreter = interpreter_mark(getattr(kernels, "_bwd_kernel", None))
needs_gluon = pytest.mark.skipif(not gluon_kernels.HAS_GLUON, reason="needs Triton with Gluon")

SM90_SHARED_BYTES = 232448  # the most shared memory a program may take on sm_90


def _bwd_args(G: int, gated: bool, dtype=torch.bfloat16, T: int = 256, Hkv: int = 2, n: int = 16):
    """Positional and constexpr arguments of one Gluon launch on CPU tensors of real dtypes and strides."""
    B, D, BL, GP = 1, 128, 64, G
    Hq, BT = G * Hkv, gluon_kernels.ROWS // G
    q, do = torch.zeros(B, T, Hq, D, dtype=dtype), torch.zeros(B, T, Hq, D, dtype=dtype)
    k, v = torch.zeros(B, T, Hkv, D, dtype=dtype), torch.zeros(B, T, Hkv, D, dtype=dtype)
    lse, delta, gate = (torch.zeros(B, Hq, T) for _ in range(3))
    dqp = torch.zeros(B, T, Hq, n, D, dtype=dtype)
    W = 8
    dkp, dvp = torch.zeros(W, BL, D), torch.zeros(W, BL, D)
    entries = torch.zeros(T * n, dtype=torch.int32)
    items = [torch.zeros(W, dtype=torch.int32) for _ in range(3)]
    bounds = [torch.zeros(T // BL, dtype=torch.int32) for _ in range(2)]
    args = (q, k, v, do, lse, delta, gate, dqp, dkp, dvp, entries, *items, *bounds, Hkv, T // BL, 0, D ** -0.5,
            q.stride(0), q.stride(1), G * q.stride(2), q.stride(2), *k.stride()[:3], *v.stride()[:3],
            *do.stride()[:3], *lse.stride(), *dqp.stride()[:4])
    return (W,), args, dict(N=n, G=G, GP=GP, BT=BT, BL=BL, D=D, GATED=gated, num_warps=8)


def _build_sm90(grid, args, kwargs) -> dict:
    """Compile the Gluon kernel for sm_90a (no GPU) and read its resources from ptxas."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import compile as triton_compile
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    fn = gluon_kernels._bwd_gluon_kernel
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    bound, spec, options = create_function_from_signature(fn.signature, fn.params, backend)(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
    kernel = triton_compile(GluonASTSource(fn, signature, constexprs, attrs), target=target,
                            options=options.__dict__)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(kernel.asm["ptx"])
        out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(src), "-o", str(Path(tmp) / "k.o")],
                             capture_output=True, text=True, check=True).stderr
    count = lambda pat: int(m.group(1)) if (m := re.search(pat, out)) else 0  # noqa: E731
    return {"registers": count(r"Used (\d+) registers"), "spill_stores": count(r"(\d+) bytes spill stores"),
            "shared": kernel.metadata.shared}


@needs_gluon
@pytest.mark.parametrize("G, gated, dtype", [(4, False, torch.bfloat16), (4, True, torch.bfloat16),
                                             (16, False, torch.float16)])
def test_gluon_backward_builds_for_sm90(G, gated, dtype):
    """It compiles for Hopper within one program's shared memory, spilling a few words at most (4
    bytes at G=4, 24 at G=16 as built when timed; 255 registers and ~200 KB: one 8-warp program per
    SM, as the Triton kernel; its earlier forms that spilled 80-96 bytes were slower)."""
    got = _build_sm90(*_bwd_args(G, gated, dtype))
    assert got["spill_stores"] <= 32, got
    assert 0 < got["shared"] <= SM90_SHARED_BYTES, got
    assert got["registers"] <= 255, got


def test_gluon_applies_only_where_written_for():
    """Not on CPU tensors, nor at other head dims or chunk shapes (the kernel's layouts are fixed)."""
    q = torch.zeros(1, 8, 4, 128, dtype=torch.bfloat16)
    assert not gluon_kernels.applies(q, q, 32, 4, 64)
    assert launch.launch_config(4, 128, 128, torch.bfloat16)["bwd_gluon"] == 1


@interpreter
@pytest.mark.parametrize("gated", [False, True])
def test_backward_with_partials_for_every_item_interpreted(monkeypatch, gated):
    """The backward's Gluon path on CPU: the launch plumbing and the block sum finishing every block
    (FINISH_ALL), with the Triton kernel in the Gluon kernel's place (every item writes its
    partial: n_items 2 for every block). Three token ranges (sums across ranges) and an acc."""
    cfg = make_config(4, 128, 128, 16, 64)
    T = 700
    q, k, v, do = make_inputs(1, T, cfg, torch.bfloat16, seed=3)
    bi = random_selection(1, cfg.n_kv_heads, T, 16, 64, seed=3, drop=0.0)
    o = torch.randn(1, T, cfg.n_heads, 128, dtype=torch.bfloat16)
    lse = torch.rand(1, cfg.n_heads, T) + 3
    gate = torch.rand(1, cfg.n_heads, T) if gated else None
    delta = torch.randn(1, cfg.n_heads, T) if gated else None
    acc = tuple(torch.randn(x.shape, dtype=x.dtype) for x in (q, k, v))
    tiles = {"range_tokens": 256, "bwd_BT": 32, "bwd_chunks": 4}
    scale = 128 ** -0.5

    def backward():
        return launch.backward(do, q, k, v, o, lse, bi, None, scale, 64, tiles, gate=gate, delta=delta,
                               acc=tuple(x.clone() for x in acc))

    want = backward()
    real = launch.launch

    def stand_in(kernel, grid, *args, writes=(), opaque=False, **kw):
        if kernel is not gluon_kernels._bwd_gluon_kernel:
            return real(kernel, grid, *args, writes=writes, **kw)
        head, Hkv, Nv, T0, scale_, strides = args[:16], args[16], args[17], args[18], args[19], args[20:]
        n_items = torch.full((q.shape[0] * Hkv * Nv,), 2, dtype=torch.int32)
        unused = torch.zeros(1)
        kernels._bwd_kernel[grid](*head, n_items, unused, unused, unused, unused, Hkv, Nv, T0, 0, scale_,
                                  *strides, 0, 0, 0, 0, 0, 0, N=kw["N"], G=kw["G"], GP=kw["GP"], BT=kw["BT"],
                                  BL=kw["BL"], DK=kw["D"], DKP=kw["D"], DV=kw["D"], DVP=kw["D"], F32_DOT=True,
                                  IEEE=False, SUMS=False, ADD=False, ACC=False, GATED=kw["GATED"])

    monkeypatch.setattr(gluon_kernels, "applies", lambda *a: True)
    monkeypatch.setattr(launch, "launch", stand_in)
    got = backward()
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), f"{name}: largest difference {(a.float() - b.float()).abs().max().item()}"


def _backward_both(G: int, T: int, dtype, gated: bool, with_acc: bool, range_tokens: int):
    cfg = make_config(G, 128, 128, 16, 64)
    q, k, v, do = make_inputs(1, T, cfg, dtype, seed=G + T, device="cuda")
    bi = random_selection(1, cfg.n_kv_heads, T, 16, 64, seed=G, drop=0.0).cuda()
    gen = torch.Generator(device="cuda").manual_seed(T)
    o = torch.randn(q.shape, dtype=dtype, device="cuda", generator=gen)
    lse = torch.rand(1, cfg.n_heads, T, device="cuda", generator=gen) + 3
    gate = torch.rand(1, cfg.n_heads, T, device="cuda", generator=gen) if gated else None
    delta = torch.randn(1, cfg.n_heads, T, device="cuda", generator=gen) if gated else None
    acc = tuple(torch.randn(x.shape, dtype=x.dtype, device="cuda", generator=gen) for x in (q, k, v))
    out = []
    for use in (1, 0):
        tiles = {"bwd_gluon": use, "range_tokens": range_tokens}
        out.append(launch.backward(do, q, k, v, o, lse, bi, None, 128 ** -0.5, 64, tiles, gate=gate, delta=delta,
                                   acc=tuple(x.clone() for x in acc) if with_acc else None))
    return out


@gpu
@pytest.mark.parametrize("G, T, dtype, gated, with_acc, range_tokens", [
    (4, 3000, torch.bfloat16, False, False, 0), (4, 3000, torch.bfloat16, True, True, 1024),
    (16, 2000, torch.bfloat16, True, False, 512), (2, 1500, torch.float16, False, True, 0),
    (8, 4100, torch.bfloat16, False, False, 1024),
])
def test_gluon_backward_equals_triton(G, T, dtype, gated, with_acc, range_tokens):
    """dq, dk, dv with the Gluon kernel equal the Triton kernel's bit for bit (the same dots and
    roundings; a single-item block's sums go through the block sum instead of the kernel's
    epilogue, in the same order)."""
    if not gluon_kernels.applies(torch.zeros(1, 1, 1, 128, dtype=dtype, device="cuda"),
                                 torch.zeros(1, 1, 1, 128, dtype=dtype, device="cuda"), 128 // G, G, 64):
        pytest.skip("the Gluon kernel runs on Hopper (sm_90) only")
    got, want = _backward_both(G, T, dtype, gated, with_acc, range_tokens)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), f"{name}: largest difference {(a.float() - b.float()).abs().max().item()}"
