"""A/B of the compiled op under launch-setting variants, in one process, on a GPU.

    python -m bench.op_ab_gpu --out $OUT/op_ab.json --preset g4 -T 32768 65536 --modes fwd fwd+bwd \\
        --variants code=- no_caps=selected.fwd_maxnreg:0,select.maxnreg:0 chunks16=selected.bwd_chunks:16
    python -m bench.op_ab_gpu --out $OUT/window_ab.json -T 8192 65536 \\
        --variants window_op=tiles.win_impl:triton flex_window=tiles.win_impl:flex
    python -m bench.op_ab_gpu --out $OUT/g3_ab.json --heads 12 --kv-heads 4 -T 65536 \\
        --variants local=tiles.local_partial:1 no_local=tiles.local_partial:0
    python -m bench.op_ab_gpu --out $OUT/w64_ab.json --heads 12 --kv-heads 3 --head-dim 64 -T 8192 65536 \\
        --variants code=- d128_tiles=window.fwd_BN:64,window.fwd_stages:2,window.dq_BN:64,window.dq_stages:2,window.kv_stages:2

Each variant (NAME=MODULE.KEY:VALUE,...; "-" for none) overrides launch_config's keys of the
selected op (selected.KEY:INT), of the selection kernel (select.KEY:INT) and of the window op
(window.KEY:INT), and FlexTiles'
fields (tiles.FIELD:VALUE, an int or a word; such a variant compiles nsa_flex itself, without
nsa_attention's checks: compare it with variants of the same form), while its own
torch.compile(fullgraph=True, dynamic=False) of nsa_attention traces. Inductor's graph caches are
off: they key on the Dynamo graph, which does not see these settings, and would hand every
variant the first one's code. Then the variants run in turn, --reps rounds of: each call timed
alone, synced (nsa_flex.bench.core.time_calls, as nsa-flex bench times it), then --calls calls
back to back. Per variant: the medians, peak MiB, the op's Triton kernels from the profiler, and
the largest difference of the output (and of dq, dk, dv) from the first variant's. With
--all-kernels the profiler's sums hold every kernel (cuDNN's and Inductor's too), not only the
op's own; with --dense, dense causal cuDNN SDPA on the same q, k, v runs as one more variant in
the same rounds ("dense-cudnn"; no output difference: its output is another function's).

    python -m bench.op_ab_gpu --out $OUT/g16_fwd.json --preset bench -T 65536 --modes fwd \
        --variants code=- --all-kernels --dense
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import statistics
from pathlib import Path

import torch

from bench.common import dense_cudnn, header, row_recorder
from bench.selected_kernels_gpu import kernel_ms
from nsa_flex.attention import nsa_attention
from nsa_flex.bench.attention import attention_config
from nsa_flex.bench.core import time_back_to_back, time_calls
from nsa_flex.bench.impls import Problem, nsa_inputs
from nsa_flex.flex import nsa_flex
from nsa_flex.flex.tuning import FlexTiles, install_flex_tuning

MODULES = {"selected": "nsa_flex.ops.selected_attention.launch", "select": "nsa_flex.ops.select.kernels",
           "window": "nsa_flex.ops.window"}


def tile_keys(module: str) -> tuple[str, ...]:
    """The launch_config keys a variant may override in `module` (the window op's: its dict's keys)."""
    mod = importlib.import_module(MODULES[module])
    return getattr(mod, "TILE_KEYS", None) or tuple(mod.launch_config(64, 64))


def parse_variant(spec: str) -> tuple[str, dict[str, dict]]:
    """"NAME=selected.KEY:INT,select.KEY:INT,tiles.FIELD:VALUE" -> (NAME, {"selected": {KEY: INT},
    "select": {...}, "tiles": {FIELD: VALUE}})."""
    name, _, keys = spec.partition("=")
    over: dict[str, dict] = {m: {} for m in (*MODULES, "tiles")}
    for item in ([] if keys in ("", "-") else keys.split(",")):
        key, _, value = item.partition(":")
        module, _, field = key.partition(".")
        if module == "tiles" and field in {f.name for f in dataclasses.fields(FlexTiles)} and value:
            over["tiles"][field] = int(value) if value.lstrip("-").isdigit() else value
            continue
        if module not in MODULES or not field or not value:
            raise ValueError(f"variant item {item!r}: expected MODULE.KEY:INT with MODULE one of {', '.join(MODULES)}, "
                             "or tiles.FIELD:VALUE with a FlexTiles field")
        keys = tile_keys(module)
        if field not in keys:
            raise ValueError(f"variant item {item!r}: {module} has no key {field!r}; allowed: {', '.join(keys)}")
        over[module][field] = int(value)
    return name, over


def compiled_step(over: dict[str, dict[str, int]], x: dict, do, cfg, grad: bool):
    """A call of the op compiled with `over` in launch_config (its own code object: its own Dynamo cache)."""
    namespace = {"nsa_attention": nsa_attention, "nsa_flex": nsa_flex}
    if over["tiles"]:
        # nsa_attention takes no FlexTiles: such a variant calls the flex path itself.
        namespace["tiles"] = FlexTiles(**over["tiles"])
        exec("def op(x, cfg):\n    return nsa_flex(**x, config=cfg, tiles=tiles)[0]\n", namespace)
    else:
        exec("def op(x, cfg):\n    return nsa_attention(**x, config=cfg, impl='flex', compiled=False)\n", namespace)
    op = torch.compile(namespace["op"], fullgraph=True, dynamic=False)
    modules = {m: importlib.import_module(path) for m, path in MODULES.items()}
    originals = {m: mod.launch_config for m, mod in modules.items()}
    patched = {m: (lambda *a, _f=originals[m], _o=over[m], **k: {**_f(*a, **k), **_o}) for m in modules}

    def step():
        # Every call under the same overrides: Dynamo inlines the window op's local_fits, which
        # calls its launch_config, and guards on that function object; restored between calls,
        # it would recompile this variant with the defaults.
        for m, mod in modules.items():
            mod.launch_config = patched[m]
        try:
            out = op(x, cfg)
            # autograd.grad as nsa-flex bench takes it: backward() would add each call's gradients
            # into .grad, eager adds (~0.4 ms at g4, 64k) that are not the op's.
            grads = torch.autograd.grad(out, [x[n] for n in ("q", "k", "v")], do) if grad else ()
            return out, grads
        finally:
            for m, mod in modules.items():
                mod.launch_config = originals[m]

    out, grads = step()  # traces and compiles with the overrides
    return step, [out.detach().float()] + [g.float() for g in grads]


def dense_step(x: dict, do, G: int, grad: bool):
    """Dense causal cuDNN on the op's q, k, v (k, v repeated to the Hq heads), as compiled_step's steps."""
    dense, tensors = dense_cudnn(x, G, requires_grad=grad)
    do_bhtd = do.transpose(1, 2).contiguous()

    def step():
        out = dense()
        grads = torch.autograd.grad(out, list(tensors.values()), do_bhtd) if grad else ()
        return out, grads

    return step


def time_variants(steps: dict, reps: int, calls: int) -> dict[str, dict]:
    """Synced and back-to-back medians and peak MiB of each step, the variants in turn `reps` times."""
    synced = {n: [] for n in steps}
    b2b = {n: [] for n in steps}
    peak = {}
    for _ in range(reps):
        for name, step in steps.items():
            timing = time_calls(step, device="cuda", warmup=1, iters=calls)
            synced[name] += timing.times_ms
            peak[name] = timing.peak_mem_mib
            b2b[name].append(time_back_to_back(step, device="cuda", iters=calls))
    return {n: {"synced_median_ms": statistics.median(synced[n]), "synced_min_ms": min(synced[n]),
                "back_to_back_ms": statistics.median(b2b[n]), "peak_mib": peak[n]} for n in steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--preset", default="g4", help="an nsa-flex bench attention preset (g4, bench, ...)")
    p.add_argument("--heads", type=int, default=None, help="Hq instead of the preset's")
    p.add_argument("--kv-heads", type=int, default=None, help="Hkv instead of the preset's")
    p.add_argument("--head-dim", type=int, default=None, help="Dk = Dv instead of the preset's")
    p.add_argument("-T", "--seq-lens", type=int, nargs="+", default=[32768, 65536])
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--variants", nargs="+", default=["code=-", "no_caps=selected.fwd_maxnreg:0,select.maxnreg:0"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--commit", default="")
    p.add_argument("--all-kernels", action="store_true", help="profile every kernel, not only the op's own")
    p.add_argument("--dense", action="store_true", help="time dense cuDNN in the same rounds")
    args = p.parse_args()
    variants = dict(parse_variant(v) for v in args.variants)
    install_flex_tuning()  # the variants that compile nsa_flex itself need it before tracing
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    bench_cfg = attention_config(device="cuda", preset=args.preset, impls=("nsa-flex",), dtype="bf16",
                                 nsa_overrides={"n_heads": args.heads, "n_kv_heads": args.kv_heads,
                                                "head_dim": args.head_dim})
    cfg = bench_cfg.nsa
    _, add = row_recorder(args.out, {**header(args.commit), "preset": args.preset, "nsa": dataclasses.asdict(cfg),
                                     "variants": variants})
    for mode in args.modes:
        for T in args.seq_lens:
            grad = mode == "fwd+bwd"
            x = nsa_inputs(Problem(bench_cfg, T), grad=grad)
            do = torch.randn(1, T, cfg.n_heads, cfg.dv, device="cuda", dtype=torch.bfloat16)
            steps, results = {}, {}
            for name, over in variants.items():
                steps[name], results[name] = compiled_step(over, x, do, cfg, grad)
            first = next(iter(results.values()))
            if args.dense:
                steps["dense-cudnn"] = dense_step(x, do, cfg.n_heads // cfg.n_kv_heads, grad)
            timed = time_variants(steps, args.reps, args.calls)
            for name, step in steps.items():
                diff = (max((a - b).abs().max().item() for a, b in zip(results[name], first))
                        if name in results else None)
                add({"T": T, "mode": mode, "variant": name, **timed[name], "max_abs_diff_vs_first": diff,
                     "kernel_ms": kernel_ms(step, prefix="" if args.all_kernels else "_")})
            del x, do, steps, results


if __name__ == "__main__":
    main()
