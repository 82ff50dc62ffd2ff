"""Registers, spills and shared memory of one decode step's Triton kernels, compiled for sm_90a
on a machine without a GPU (Triton ships ptxas): no device time spent to learn whether a
kernel change compiles, or what it does to the occupancy that decides kernel A at B=8.

    python -m bench.kernel_regs --cases 1:65536 8:65536 [--tiles ST=0] [--trace]
    python -m bench.kernel_regs --selected 4:128:128:bf16 16:192:128:fp32     (the selected op's kernels)

The step is nsa_flex::step_attend's: cache_step's kernel, then A, B, S and D of nsa_flex.ops.decode.kernels,
launched as on an H100/H200 (PDL on, bf16 tensor-core dots; the inputs live on the CPU only so
that their shapes, strides and alignments are real). Each launch is compiled instead of run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import subprocess
import tempfile
from pathlib import Path

import torch

KERNELS = {"_cache_step_kernel": "cache_step", "_cmp_win_kernel": "A", "_importance_kernel": "B",
           "_sel_win_kernel": "S", "_combine_kernel": "D"}


def _ptxas_report(ptx: str, arch: str, maxnreg: int | None) -> dict:
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(int(re.sub(r"\D", "", arch))).path
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        cmd = [ptxas, "-v", f"--gpu-name={arch}", str(src), "-o", str(Path(tmp) / "k.cubin")]
        if maxnreg:
            cmd.append(f"--maxrregcount={maxnreg}")
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    get = lambda pat: int(m.group(1)) if (m := re.search(pat, out)) else 0  # noqa: E731
    return {"registers": get(r"Used (\d+) registers"), "spill_stores": get(r"(\d+) bytes spill stores"),
            "spill_loads": get(r"(\d+) bytes spill loads"), "stack": get(r"(\d+) bytes stack frame")}


def build_sm90(fn, args, kwargs, arch: int = 90):
    """Compile a @triton.jit or @gluon.jit function for sm_{arch}a on this machine (no GPU): the
    compiled kernel and its resources (ptxas registers and spills, shared memory bytes)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
    source = (GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource)(fn, signature, constexprs, attrs)
    kernel = compile(source, target=target, options=options.__dict__)
    return kernel, {**_ptxas_report(kernel.asm["ptx"], f"sm_{arch}a", kwargs.get("maxnreg")),
                    "shared_bytes": kernel.metadata.shared}


class Compiler:
    """Stands in for torch.library.wrap_triton: kernel[grid](*args, **kwargs) compiles for the
    target and records the kernel's resources, as a GPU launch would have set them."""

    def __init__(self, arch: int = 90):
        self.arch = arch
        self.rows: list[dict] = []

    def __call__(self, fn):
        outer = self

        class _Launch:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: outer.compile(fn, grid, args, kwargs)

        return _Launch()

    def compile(self, fn, grid, args, kwargs):
        # As on the GPU: tensor-core dots (the CPU path asks the interpreter's fp32 dots) and PDL.
        if "F32_DOT" in kwargs:
            kwargs["F32_DOT"] = False
        if "PDL" in kwargs:
            kwargs["PDL"], kwargs["launch_pdl"] = True, True
        # As capped_launch.launch: maxnreg 0 means no cap.
        if not kwargs.get("maxnreg"):
            kwargs.pop("maxnreg", None)
        kernel, resources = build_sm90(fn, args, kwargs, self.arch)
        self.rows.append({"kernel": KERNELS.get(fn.__name__, fn.__name__), "grid": list(grid),
                          "num_warps": kernel.metadata.num_warps, **resources})


def step_resources(B: int, T: int, tiles: dict[str, int] | None = None, trace: bool = False) -> list[dict]:
    """The rows of one step's kernels at B sequences of T cached tokens (the bench's shape and slack)."""
    from nsa_flex.bench.decode import SLACK, random_step_inputs
    from nsa_flex.config import PRESETS
    from nsa_flex.decoding.step import step_tensors
    from nsa_flex.ops.decode.attend import prepare_inputs
    from nsa_flex.ops.decode.phi_step import phi_params

    # The modules, not nsa_flex.ops's functions of the same names: their wrap_triton is swapped below.
    cs = importlib.import_module("nsa_flex.ops.decode.cache_step")
    dt = importlib.import_module("nsa_flex.ops.decode.kernels")
    n = PRESETS["bench"]
    cache, pr, gates, phi_k, phi_v = random_step_inputs(n, B, T + SLACK, torch.bfloat16, "cpu")
    cache.lengths.fill_(T)
    tokens, caches = step_tensors(cache, pr)
    k, v, k_win, v_win, _, _, k_cmp, v_cmp = caches
    k_win, v_win = (k, v) if k_win is None else (k_win, v_win)
    G = n.group_size
    q, g, scale = prepare_inputs(pr.q.reshape(B, n.n_kv_heads, G, n.head_dim), k, v, k_win, v_win, k_cmp, v_cmp,
                           cache.lengths, gates.reshape(B, n.n_kv_heads, G, 3), n, None)
    comp = Compiler()
    saved = dt.wrap_triton, cs.wrap_triton
    dt.wrap_triton = cs.wrap_triton = comp
    try:
        stamps = (lambda *shape: {"trace": torch.zeros(*shape, 5, dtype=torch.int64)} if trace else {})  # noqa: E731
        cs.cache_step_triton(*tokens, *caches, cache.lengths, cache.phi_count, phi_params(phi_k),
                              phi_params(phi_v), n.cmp_block, n.cmp_stride, **stamps(4096))
        dt.decode_attend_triton(q, k, v, k_win, v_win, k_cmp, v_cmp, cache.lengths, g, scale, n, tiles,
                                advance=True, after_cache_step=True, **stamps(4, 4096))
    finally:
        dt.wrap_triton, cs.wrap_triton = saved
    return comp.rows


def selected_resources(G: int, Dk: int, Dv: int, dtype: torch.dtype) -> list[dict]:
    """The rows of the selected op's forward and backward launches (launch.forward / backward at
    their default tiles, register caps included) for group G, head dims Dk / Dv and dtype, on a
    small CPU problem (the kernels' tiles do not depend on T; the forward's cap does, and is set)."""
    from nsa_flex.bench.selected import random_selection
    from nsa_flex.config import NSAConfig

    launch = importlib.import_module("nsa_flex.ops.selected_attention.launch")
    Hkv, T = 2, 512
    cfg = NSAConfig(n_heads=G * Hkv, n_kv_heads=Hkv, head_dim=Dk, head_dim_v=Dv)
    q, do, o = (torch.randn(1, T, G * Hkv, d, dtype=dtype) for d in (Dk, Dv, Dv))
    k, v = torch.randn(1, T, Hkv, Dk, dtype=dtype), torch.randn(1, T, Hkv, Dv, dtype=dtype)
    comp = Compiler()
    # Traced launches (wrap_triton) and launches through capped_launch.launch alike compile here.
    saved = launch.wrap_triton, launch.launch
    launch.wrap_triton = comp
    launch.launch = lambda kernel, grid, *args, writes=(), **kwargs: comp(kernel)[grid](*args, **kwargs)
    try:
        selection = random_selection(1, Hkv, T, cfg, "cpu")
        # The forward as it runs on long sequences (its register cap starts at LONG_FROM_TOKENS).
        long = launch.launch_config(G, Dk, Dv, dtype, launch.LONG_FROM_TOKENS)
        launch.forward(q, k, v, selection, None, Dk ** -0.5, cfg.sel_block, tiles={"fwd_maxnreg": long["fwd_maxnreg"]})
        launch.backward(do, q, k, v, o, torch.zeros(1, G * Hkv, T), selection, None, Dk ** -0.5, cfg.sel_block)
    finally:
        launch.wrap_triton, launch.launch = saved
    return comp.rows


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=["1:65536", "8:65536"], help="B:T pairs")
    p.add_argument("--tiles", nargs="*", default=[], help="launch_config overrides, KEY=INT")
    p.add_argument("--trace", action="store_true", help="compile the timeline-stamping variants (TRACE)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--selected", nargs="*", default=[], help="G:Dk:Dv:dtype of the selected op's kernels instead")
    args = p.parse_args()
    tiles = {k: int(v) for k, v in (t.split("=") for t in args.tiles)}
    out = []
    for case in args.selected:
        G, Dk, Dv, dt = case.split(":")
        for row in selected_resources(int(G), int(Dk), int(Dv), DTYPES[dt]):
            out.append({"case": case, **row})
            print(f"{case} {row['kernel']:>18} warps={row['num_warps']} regs={row['registers']} "
                  f"spills={row['spill_stores']}/{row['spill_loads']} smem={row['shared_bytes']}", flush=True)
    if args.selected:
        args.cases = []
    for case in args.cases:
        B, T = (int(x) for x in case.split(":"))
        for row in step_resources(B, T, tiles, args.trace):
            row = {"B": B, "T": T, **row}
            out.append(row)
            print(f"B={B} T={T} {row['kernel']:>10} grid={row['grid']} warps={row['num_warps']} "
                  f"regs={row['registers']} spills={row['spill_stores']}/{row['spill_loads']} "
                  f"stack={row['stack']} smem={row['shared_bytes']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
