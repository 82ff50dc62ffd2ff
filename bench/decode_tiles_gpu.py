"""Launch parameters of the fused decode kernels: the op alone under several tile settings, per kernel.

    python -m bench.decode_tiles_gpu --out $OUT/decode_tiles.json [--cases 1:65536 8:65536]

For each case B:T (the bench shape of decode_kernel_gpu.Problem) and each variant (overrides
of nsa_flex.ops.decode.kernels.launch_config): GPU us per op call from a CUDA graph of 20 calls,
each of the four kernels' own us (torch.profiler, no graph), and the output's largest
difference from the default variant's (the tiles change only the order of fp32 sums).
JSON is rewritten after every variant.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.common import json_saver
from bench.decode_kernel_gpu import Problem, time_graph
from nsa_flex.bench.decode import kernel_profile
from nsa_flex.ops.decode.kernels import decode_attend_triton, launch_config


def variants(B: int, Hkv: int, Tc: int, cfg) -> dict[str, dict]:
    base = launch_config(B, Hkv, Tc, cfg)
    splits = base["SPLITS"]
    return {
        "default": {},
        **{f"splits{n}": {"SPLITS": n} for n in (16, 32, 64) if n != splits},
        "ti4": {"TI": 4},
        "ti16": {"TI": 16},
        **{f"d_warps{n}": {"DW": n} for n in (1, 4) if n != base["DW"]},
        "s_warps8": {"SW": 8},
        # Launch layout: programmatic dependent launch off; the window programs in A's grid (WS=0) or S's.
        "no_pdl": {"PDL": 0},
        "window_in_a": {"WS": 0},
        "window_in_s": {"WS": 1},
        "no_pdl_window_in_a": {"PDL": 0, "WS": 0},
    }


def parse_tiles(name: str) -> dict[str, int]:
    """A variant given as its overrides: "SPLITS=8,num_stages=3"."""
    try:
        tiles = {key: int(value) for key, value in (item.split("=") for item in name.split(","))}
    except ValueError:
        raise SystemExit(f"unknown variant {name!r}: a name of variants() or KEY=INT[,KEY=INT...]") from None
    return tiles


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cases", nargs="+", default=["1:65536", "8:65536", "8:131072"])
    p.add_argument("--commit", default="")
    p.add_argument("--variants", nargs="*",
                   help="only these variants (default: all), by name or as overrides KEY=INT[,KEY=INT...]")
    args = p.parse_args()
    rows: list[dict] = []
    header = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": args.commit}
    save = json_saver(args.out, {"header": header, "rows": rows})
    started = time.perf_counter()
    for case in args.cases:
        B, T = (int(s) for s in case.split(":"))
        prob = Problem(B, T)
        cfg = prob.cfg
        q, k, v, k_win, v_win, k_cmp, v_cmp, pos, gates = prob.op_args()
        q = q.contiguous()
        scale = cfg.head_dim ** -0.5
        ref = None
        named = variants(B, cfg.n_kv_heads, k_cmp.shape[2], cfg)
        # A list: a variant named twice (the default first and last) shows the drift over a run.
        chosen = [(name, named[name] if name in named else parse_tiles(name)) for name in args.variants or named]
        for name, tiles in chosen:
            def op(tiles=tiles):
                return decode_attend_triton(q, k, v, k_win, v_win, k_cmp, v_cmp, pos, gates, scale, cfg, tiles)

            row = {"B": B, "T": T, "variant": name, "tiles": {**launch_config(B, cfg.n_kv_heads, k_cmp.shape[2], cfg),
                                                              **tiles}}
            try:
                prob.reset()
                o = op()[0].float()
                ref = o if ref is None else ref
                row["max_diff_vs_default"] = float((o - ref).abs().max())
                row["op_us"] = time_graph(op, prob.reset)
                row["kernels_us"] = kernel_profile(op, prob.reset, top=None)["top_kernels_us"]
            except Exception as exc:  # a variant that fails to launch is a result too
                row["error"] = f"{type(exc).__name__}: {exc}"[:400]
            rows.append(row)
            save()
            print(f"[{time.perf_counter() - started:4.0f} s] {B=} {T=} {name}: {row.get('op_us')} us "
                  f"{row.get('kernels_us', row.get('error'))}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
