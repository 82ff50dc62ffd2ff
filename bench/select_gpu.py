"""Time launch settings of the selection kernel (nsa_flex/ops/select/kernels.py) on a GPU.

    python -m bench.select_gpu --out runs/bench/select_tiles.json

Shapes: TxHq with Hkv = 4 and Dk = 128 (T = 16384 and 65536 with G = 16, T = 32768 and 65536
with G = 4), or TxHqxHkvxDk (65536x12x3x64: seeds-125m's heads); bf16, the paper's geometry
otherwise. With --wide every shape also times the wider tiles (WIDE). For each shape and launch
setting (the tiles of select_blocks_triton over launch_config's; "default" is what the op runs,
timed first as the reference): the fraction of (kv head, token) rows equal to the default's and
to the torch twin's, the rows that differ from the twin checked to be near-ties against fp64
importance (nsa_flex/ops/select/checks.py), the time of the first call (compile included), then the
median time of one call (triton.testing.do_bench). The JSON is rewritten after every setting,
so a run cut short keeps what it measured; a Markdown table is printed at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from bench.common import json_saver
from bench.ops_select_gpu import header, make_inputs, row_scores, score_flops
from nsa_flex.ops.select.checks import assert_same_selection

from nsa_flex.config import NSAConfig
from nsa_flex.ops import select_blocks_torch
from nsa_flex.ops.select import kernels as select_triton

DEFAULT = {}
# Per shape (T, Hq): named launch settings, "default" first (the reference for equality and
# speed). Defaults: G=16 -> BT=8 (128 columns), G=4 -> BT=16 (64 columns); 4 warps, 2 stages;
# from 32 tiles of selection blocks on, LISTS=6 sorted keys per (token, tile column), then the
# exact queues for the programs whose lists lost a block, with a cap of 128 registers at G=4.
# "exact queues" is the kernel before the lists (every program merges its queues;
# docs/records/select_kernel_variants_h200.json has its tile sweep). From sm_90 builds made
# without a GPU (Triton 3.6): 155 registers with the lists at G=4 (128 capped, no spills), 168
# with the queues; three programs per SM, four with the cap.
EXACT = {"LISTS": 0, "maxnreg": 0}
SETTINGS = {
    (16384, 64): {"default": DEFAULT, "exact queues": EXACT},
    (65536, 64): {"default": DEFAULT, "exact queues": EXACT, "maxnreg128": {"maxnreg": 128}},
    (32768, 16): {"default": DEFAULT, "no register cap": {"maxnreg": 0}, "exact queues": EXACT},
    (65536, 16): {
        "default": DEFAULT,
        "no register cap": {"maxnreg": 0},
        "exact queues": EXACT,
        "exact queues, stages3": {**EXACT, "num_stages": 3},
        "LISTS4": {"LISTS": 4},
        "LISTS8": {"LISTS": 8, "maxnreg": 0},
        "no rotation": {"ROTATE": 0},
    },
    (65536, 12, 3, 64): {"default": DEFAULT, "exact queues": EXACT},
    (32768, 12, 3, 64): {"default": DEFAULT},
}
# With the lists' 32-bit keys (fewer registers): launch settings around the default again.
AROUND = {
    "stages3": {"num_stages": 3},
    "BT32 w8": {"BT": 32, "num_warps": 8},
    "BT32 w8 cap128": {"BT": 32, "num_warps": 8, "maxnreg": 128},
    "LISTS5": {"LISTS": 5},
    "LISTS7": {"LISTS": 7},
    "DEPTH2": {"DEPTH": 2},
    "cap112": {"maxnreg": 112},
    "BT8": {"BT": 8},
}
# Wider tiles: BS = 32 selection blocks per tile hold a token's n best in twice the columns, so
# fewer sorted keys per column lose as few blocks (each key a column keeps costs a max and a min
# per score). Built for sm_90 without a GPU: at G=4, Dk=128, BS=32 with LISTS=4 and 8 warps takes
# 125 registers and 84 KB of shared memory (two programs per SM, 16 warps: as many as the default's
# four 4-warp programs), at seeds-125m's heads 115 and 43 KB; at G=16, 157 (one program per SM).
WIDE = {
    "BS32 LISTS4 w8": {"BS": 32, "LISTS": 4, "num_warps": 8, "maxnreg": 0},
    "BS32 LISTS3 w8": {"BS": 32, "LISTS": 3, "num_warps": 8, "maxnreg": 0},
    "BS32 LISTS5 w8": {"BS": 32, "LISTS": 5, "num_warps": 8, "maxnreg": 0},
    "BS32 LISTS4 w8 stages3": {"BS": 32, "LISTS": 4, "num_warps": 8, "num_stages": 3, "maxnreg": 0},
    "BS32 LISTS4 w4": {"BS": 32, "LISTS": 4, "maxnreg": 0},
    "BS32 BT8 LISTS4 w4": {"BS": 32, "BT": 8, "LISTS": 4, "maxnreg": 0},
    "BS64 LISTS3 w8": {"BS": 64, "LISTS": 3, "num_warps": 8, "maxnreg": 0},
}


@dataclasses.dataclass
class Row:
    T: int
    Hq: int
    Hkv: int
    setting: str
    tiles: dict
    ms: float | None = None
    score_tflops: float | None = None
    speedup_vs_default: float | None = None
    first_call_s: float | None = None
    rows_equal_default: float | None = None
    rows_equal_twin: float | None = None
    rows_differ_twin: int | None = None
    near_ties_ok: bool | None = None
    error: str | None = None


def check_near_ties(q, k_cmp, lse, config, got, twin) -> None:
    """Raises unless the (first 512) rows that differ from the twin's differ in near-ties only."""
    hs, ts = (got != twin).any(-1)[0].nonzero(as_tuple=True)
    if hs.numel():
        hs, ts = hs[:512], ts[:512]
        scores, tol = row_scores(q, k_cmp, lse, config, hs, ts)
        assert_same_selection(got[0, hs, ts][None, None], twin[0, hs, ts].long()[None, None], scores[None, None], tol)


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def bench_setting(q, k_cmp, lse, config, name, tiles, twin, default_out) -> tuple[Row, torch.Tensor | None]:
    """The setting's Row and its indices (None if it failed to run)."""
    import triton

    T, Hq, Dk = q.shape[1], q.shape[2], q.shape[3]
    G = Hq // k_cmp.shape[2]
    # The settings in full: launch_config's defaults, overridden by tiles.
    full = {**select_triton.launch_config(G, Dk, config.n_selected, -(-T // config.sel_block)), **tiles}
    row = Row(T, Hq, k_cmp.shape[2], name, full)

    def run():
        return select_triton.select_blocks_triton(q, k_cmp, lse, None, None, Dk ** -0.5, config, tiles)

    try:
        start = time.perf_counter()
        got = run()
        torch.cuda.synchronize()
        row.first_call_s = time.perf_counter() - start
    except Exception as e:  # a setting that fails to compile or run is reported, not fatal
        row.error = f"{type(e).__name__}: {str(e)[:300]}"
        return row, None
    if default_out is not None:
        row.rows_equal_default = 1.0 - (got != default_out).any(-1).float().mean().item()
    row.rows_differ_twin = int((got != twin).any(-1).sum())
    row.rows_equal_twin = 1.0 - row.rows_differ_twin / (got.shape[1] * got.shape[2])
    try:
        check_near_ties(q, k_cmp, lse, config, got, twin)
        row.near_ties_ok = True
    except AssertionError as e:
        row.near_ties_ok, row.error = False, f"beyond near-ties: {str(e)[:300]}"
    row.ms = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
    row.score_tflops = score_flops(T, Hq, Dk, config) / row.ms / 1e9
    return row, got


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default="65536x16,32768x16,65536x64,16384x64",
                        help="comma-separated TxHq or TxHqxHkvxDk among "
                             + ", ".join("x".join(map(str, k)) for k in SETTINGS))
    parser.add_argument("--wide", action="store_true", help="also time the wider tiles (WIDE) at every shape")
    parser.add_argument("--around", action="store_true", help="also time the settings around the default (AROUND)")
    args = parser.parse_args()
    config = NSAConfig()
    result = {**header(), "config": dataclasses.asdict(config), "rows": []}
    save = json_saver(args.out, result)

    rows = []
    for shape in args.shapes.split(","):
        key = tuple(int(x) for x in shape.split("x"))
        T, Hq, Hkv, Dk = key if len(key) == 4 else (*key, 4, 128)
        if key not in SETTINGS:
            raise SystemExit(f"unknown shape {shape}; allowed: " + ", ".join("x".join(map(str, k)) for k in SETTINGS))
        config = NSAConfig(n_heads=Hq, n_kv_heads=Hkv, head_dim=Dk, head_dim_v=Dk)
        q, k_cmp, lse = make_inputs(T, Hq, Hkv, Dk, torch.bfloat16, config)
        start = time.perf_counter()
        twin = select_blocks_torch(q, k_cmp, lse, config)
        print(f"T={T} Hq={Hq}: twin {time.perf_counter() - start:.1f} s", flush=True)
        default_out = base_ms = None
        for name, tiles in {**SETTINGS[key], **(WIDE if args.wide else {}), **(AROUND if args.around else {})}.items():
            row, got = bench_setting(q, k_cmp, lse, config, name, tiles, twin, default_out)
            if name == "default":
                default_out = got
                base_ms = row.ms
            if row.ms is not None and base_ms:
                row.speedup_vs_default = base_ms / row.ms
            rows.append(row)
            result["rows"].append(dataclasses.asdict(row))
            print(row, flush=True)
            save()
        del q, k_cmp, lse, twin, default_out
        torch.cuda.empty_cache()
    print("| T | Hq/Hkv | setting | ms | x default | score TFLOP/s | = default | = twin | near-ties ok | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.T} | {r.Hq}/{r.Hkv} | {r.setting} | {fmt(r.ms, '.3f')} | {fmt(r.speedup_vs_default, '.2f')} | "
              f"{fmt(r.score_tflops, '.0f')} | {fmt(r.rows_equal_default, '.6f')} | "
              f"{fmt(r.rows_equal_twin, '.6f')} | {r.near_ties_ok} | {r.error or ''} |")


if __name__ == "__main__":
    main()
