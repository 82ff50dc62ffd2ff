"""Where the decode step's time goes beyond its kernels: the step and its parts, each from a CUDA graph.

    python -m bench.decode_step_gap_gpu --out $OUT/step_gap.json [--cases 8:65536 1:65536]

`nsa-flex bench decode` times the compiled step (nsa_flex::step_attend) from a CUDA graph of
10 steps. At B=8, 64k that step took ~53 us while its kernels' profiled times add up to ~48.
This times, in one run and the same way (bench.decode.graph_step_times), the step compiled and
uncompiled, decode_attend alone and cache_step alone (the two ops step_attend runs as one), to
see which boundary the rest sits at.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

import torch

from nsa_flex.bench.decode import DecodeProblem, decode_config, graph_step_times
from nsa_flex.decoding.step import step_tensors
from nsa_flex.ops import cache_step, decode_attend
from nsa_flex.ops.decode import kernels as decode_triton

from bench.decode_tiles_gpu import parse_tiles


def parts(prob: DecodeProblem) -> dict:
    cache, pr, gates = prob.cache, prob.pr, prob.gates
    cfg = cache.config
    B = pr.q.shape[0]

    def op_only():
        q = pr.q.reshape(B, cfg.n_kv_heads, cfg.group_size, cfg.head_dim)
        return decode_attend(q, cache.k, cache.v, cache.k_win, cache.v_win, cache.k_cmp, cache.v_cmp, cache.lengths,
                             gates.reshape(B, cfg.n_kv_heads, cfg.group_size, 3), cfg, advance=True)

    def cache_only():
        cache_step(*step_tensors(cache, pr), cache.lengths, prob.phi_k, prob.phi_v, cfg.cmp_block, cfg.cmp_stride,
                   phi_count=cache.phi_count)
        cache.lengths.add_(1)

    # Every call completes a block: the lengths set to one that does (a fill kernel first).
    fresh = prob.T + (cfg.cmp_block - 1 - prob.T) % cfg.cmp_stride

    def cache_fresh():
        cache.lengths.fill_(fresh)
        cache_step(*step_tensors(cache, pr), cache.lengths, prob.phi_k, prob.phi_v, cfg.cmp_block, cfg.cmp_stride,
                   phi_count=cache.phi_count)

    compiled = []

    def step_compiled():
        # Compiled on first use only (it takes a while): --parts may leave it out.
        if not compiled:
            compiled.append(torch.compile(prob.nsa_step, fullgraph=True))
        return compiled[0]()

    return {"step-eager": prob.nsa_step, "step-compiled": step_compiled,
            "op-eager": op_only, "cache_step-eager": cache_only,
            "cache_step-fresh": cache_fresh}


@contextlib.contextmanager
def _overridden(tiles: dict[str, int]):
    """decode_triton.launch_config with tiles over its result, for the step's op to pick up."""
    original = decode_triton.launch_config
    decode_triton.launch_config = lambda *args: {**original(*args), **tiles}
    try:
        yield
    finally:
        decode_triton.launch_config = original


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cases", nargs="+", default=["8:65536", "1:65536"])
    p.add_argument("--variants", nargs="*", default=[],
                   help="also time the step (eager, from a graph) with these launch_config overrides, "
                        "KEY=INT[,KEY=INT...]; a variant may repeat")
    p.add_argument("--parts", nargs="*", default=None,
                   help="time only these parts (step-eager, step-compiled, op-eager, cache_step-eager, "
                        "cache_step-fresh); all by default, none with an empty list")
    args = p.parse_args()
    rows = []
    for case in args.cases:
        B, T = (int(x) for x in case.split(":"))
        cfg = decode_config(device="cuda", contexts=(T,), batches=(B,))
        prob = DecodeProblem(cfg, B, T)
        for name, fn in parts(prob).items():
            if args.parts is not None and name not in args.parts:
                continue
            fn()
            torch.cuda.synchronize()
            times = graph_step_times(fn, prob.reset, steps=10, reps=7, replays=10)
            rows.append({"B": B, "T": T, "part": name, "us": 1e3 * statistics.median(times)})
            print(f"B={B} T={T} {name}: {rows[-1]['us']:.1f} us", flush=True)
        for variant in args.variants:
            tiles = parse_tiles(variant)
            with _overridden(tiles):
                times = graph_step_times(prob.nsa_step, prob.reset, steps=10, reps=7, replays=10)
            rows.append({"B": B, "T": T, "part": "step-eager", "tiles": tiles, "us": 1e3 * statistics.median(times)})
            print(f"B={B} T={T} step-eager {variant}: {rows[-1]['us']:.1f} us", flush=True)
        torch._dynamo.reset()
        del prob
        torch.cuda.empty_cache()
    header = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "argv": sys.argv[1:]}
    args.out.write_text(json.dumps({"header": header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
