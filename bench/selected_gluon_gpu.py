"""The selected op's Gluon kernels against its Triton kernels, launch by launch, on a GPU.

    python -m bench.selected_gluon_gpu --out $OUT/selected_gluon.json [--shapes 1:65536:16:4:128 ...]
        [--tiles '{}' '{"bwd_BT": 32, "bwd_warps": 8}']
    python -m bench.selected_gluon_gpu --compile [--shapes ...]   (no GPU: build both Gluon kernels for sm_90a)

Per shape B:T:Hq:Hkv:D (bf16, random inputs and selections, the paper's geometry) and launch
settings (--tiles, each a JSON dict of launch_config keys; the default ones by default): the op's own
forward and backward (launch.forward / launch.backward, the gated backward too) run once with
the Triton kernels, and each launch of _fwd_kernel / _bwd_kernel is captured. Each captured
launch then runs with the Triton kernel and with its Gluon twin (gluon_kernels; the forward also
without its register cap), on fresh output buffers: the largest differences of every output
(expected 0: the same dots and roundings) and do_bench medians summed over the launches.
The backward's variants of the first probe (commit e65cc7a) are in
docs/records/selected_backward_gluon_probe_h100.json.
"""

from __future__ import annotations

import argparse
import json

import torch

from nsa_flex.ops.selected_attention import gluon_kernels, kernels, launch

# Positions of the buffers each kernel writes, in its argument list.
OUTPUTS = {"_fwd_kernel": {"po": 3, "plse": 4},
           "_bwd_kernel": {"dqp": 7, "dkp": 8, "dvp": 9, "dk": 17, "dv": 18, "dk_sum": 19, "dv_sum": 20}}
TWINS = {"_fwd_kernel": "_fwd_gluon_kernel", "_bwd_kernel": "_bwd_gluon_kernel"}


def capture(B: int, T: int, Hq: int, Hkv: int, D: int, device: str, gated: bool, tiles: dict | None = None):
    """[(kernel name, grid, args, kwargs)] of the op's forward and backward on random inputs, with
    the Triton kernels (the Gluon ones turned off; tiles: other launch settings)."""
    from nsa_flex.bench.selected import random_selection
    from nsa_flex.config import NSAConfig

    cfg = NSAConfig(n_heads=Hq, n_kv_heads=Hkv, head_dim=D)
    gen = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device, dtype=torch.bfloat16)  # noqa: E731
    q, do = rnd(B, T, Hq, D), rnd(B, T, Hq, D)
    k, v = rnd(B, T, Hkv, D), rnd(B, T, Hkv, D)
    selection = random_selection(B, Hkv, T, cfg, device)
    gate = torch.rand(B, Hq, T, device=device, generator=gen) if gated else None
    tiles = {**(tiles or {}), "bwd_gluon": 0, "fwd_gluon": 0}
    calls = []
    saved = launch.launch

    def grab(kernel, grid, *args, writes=(), **kwargs):
        name = kernel.fn.__name__
        if name in OUTPUTS:
            calls.append((name, grid, args, kwargs))
        if device == "cuda":
            return saved(kernel, grid, *args, writes=writes, **kwargs)

    launch.launch = grab
    try:
        # On CPU (the build) only the launches' arguments are needed: each pass stops after its
        # kernel's launch (the next launch, traced, needs a GPU or the interpreter).
        for run_pass in ("forward", "backward"):
            try:
                if run_pass == "forward":
                    o, lse = launch.forward(q, k, v, selection, None, D ** -0.5, cfg.sel_block, tiles)
                else:
                    if device == "cpu":
                        o, lse = rnd(B, T, Hq, D), torch.rand(B, Hq, T, device=device, generator=gen)
                    delta = torch.randn(B, Hq, T, device=device, generator=gen) if gated or device == "cpu" else None
                    launch.backward(do, q, k, v, o, lse, selection, None, D ** -0.5, cfg.sel_block, tiles, gate=gate,
                                    delta=delta)
            except Exception:
                if device == "cuda":
                    raise
    finally:
        launch.launch = saved
    return calls


def _fresh(name: str, args) -> list:
    """args with zeroed copies of the kernel's outputs (the sums keep their content: they are read)."""
    args = list(args)
    for i in OUTPUTS[name].values():
        args[i] = args[i].clone() if name == "_bwd_kernel" and i >= 17 else torch.zeros_like(args[i])
    return args


def run(name: str, grid, args, kwargs, gluon: bool, cap: bool = True):
    kw = {k: v for k, v in kwargs.items() if v or k != "maxnreg"}
    if gluon:
        kw.pop("num_stages", None)
        if not cap:
            kw.pop("maxnreg", None)
        getattr(gluon_kernels, TWINS[name])[grid](*args, **kw)
    else:
        getattr(kernels, name)[grid](*args, **kw)


def compare(shape: str, gated: bool, tiles: dict | None = None) -> list[dict]:
    import triton

    from bench.common import parse_shape

    rows = []
    calls = capture(*parse_shape(shape), "cuda", gated, tiles)
    for name in OUTPUTS:
        mine = [c for c in calls if c[0] == name]
        variants = [("triton", False, True), ("gluon", True, True)]
        if name == "_fwd_kernel":
            variants.append(("gluon_uncapped", True, False))
        row = {"shape": shape, "gated": gated, "tiles": tiles or {}, "kernel": name, "launches": len(mine)}
        for label, gluon, cap in variants:
            total, worst = 0.0, {}
            for _, grid, a, kw in mine:
                ref = _fresh(name, a)
                run(name, grid, ref, kw, False)
                got = _fresh(name, a)
                run(name, grid, got, kw, gluon, cap)
                torch.cuda.synchronize()
                for out, i in OUTPUTS[name].items():
                    d = (ref[i].float() - got[i].float()).abs().nan_to_num(0.0).max()
                    worst[out] = max(worst.get(out, 0.0), float(d))
                total += triton.testing.do_bench(lambda: run(name, grid, got, kw, gluon, cap), warmup=10, rep=50,
                                                 return_mode="median")
            row[f"{label}_ms"] = total
            if gluon:
                row[f"{label}_max_diff"] = worst
        rows.append(row)
        print(row, flush=True)
    return rows


def compile_sm90(shapes: list[str], tiles: dict | None = None) -> None:
    """Build both Gluon kernels for sm_90a without a GPU from a CPU capture's arguments; print
    registers, spills and shared memory."""
    from bench.common import parse_shape
    from bench.kernel_regs import Compiler

    comp = Compiler()
    for shape in shapes:
        B, T, Hq, Hkv, D = parse_shape(shape)
        seen = set()
        for name, grid, args, kw in capture(B, min(T, 2048), Hq, Hkv, D, "cpu", gated=False, tiles=tiles):
            if name in seen:
                continue
            seen.add(name)
            kw = {k: v for k, v in kw.items() if k != "num_stages"}
            comp(getattr(gluon_kernels, TWINS[name]))[grid](*args, **kw)
            print({"shape": shape, "tiles": tiles or {}, **comp.rows[-1]}, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--shapes", nargs="+", default=["1:65536:16:4:128", "1:16384:16:4:128", "1:65536:64:4:128"])
    p.add_argument("--compile", action="store_true", help="build for sm_90a without a GPU and print resources")
    p.add_argument("--tiles", nargs="*", default=["{}"],
                   help='launch settings to compare under, each a JSON dict (e.g. \'{"bwd_BT": 32, "bwd_warps": 8}\')')
    args = p.parse_args()
    variants = [json.loads(t) for t in args.tiles]
    if args.compile:
        for tiles in variants:
            compile_sm90(args.shapes, tiles)
        return
    from bench.common import header

    out = {"header": header(), "rows": []}
    for shape in args.shapes:
        for tiles, gated in ((t, g) for t in variants for g in (False, True)):
            try:
                out["rows"] += compare(shape, gated, tiles)
            except Exception as exc:  # one failing shape must not lose the others
                out["rows"].append({"shape": shape, "gated": gated, "tiles": tiles,
                                    "error": f"{type(exc).__name__}: {str(exc)[:400]}"})
                print(out["rows"][-1], flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(out, f, indent=1)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
