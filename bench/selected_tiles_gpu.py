"""Launch settings of the block-centric selected op (nsa_flex/ops/selected_attention/launch.py) on a GPU.

    python -m bench.selected_tiles_gpu --out $OUT/selected_tiles.json --shapes 1:16384:16:4:128 1:65536:16:4:128

For each shape B:T:Hq:Hkv:D (bf16, NSA-shaped random selections from nsa_flex.bench.selected) and
each variant (tile keys over launch_config's, "default" first): the forward and the backward
alone (launch.forward / launch.backward, index builds included), medians, and the largest
difference of o / dq / dk / dv from the default's (the tiles change only the order of sums,
so it stays at rounding level; a larger one is a bug). The JSON is rewritten after every row.
"""

from __future__ import annotations

import torch

from bench.common import bench_ms, header, parse_shape, row_recorder, selected_op_inputs, shape_script_parser
from nsa_flex.ops.selected_attention import launch

VARIANTS = {
    "fwd_chunks4": {"fwd_chunks": 4},
    "fwd_chunks16": {"fwd_chunks": 16},
    "fwd_warps8": {"fwd_warps": 8},
    "fwd_stages3": {"fwd_stages": 3},
    "fwd_stages4": {"fwd_stages": 4},
    "fwd_stages3_reg168": {"fwd_stages": 3, "fwd_maxnreg": 168},
    "fwd_stages3_reg128": {"fwd_stages": 3, "fwd_maxnreg": 128},
    "fwd_reg168": {"fwd_maxnreg": 168},
    "fwd_BT32_stages3": {"fwd_BT": 32, "fwd_stages": 3},
    "fwd_BT32_stages3_warps8": {"fwd_BT": 32, "fwd_stages": 3, "fwd_warps": 8},
    "fwd_stages3_chunks16": {"fwd_stages": 3, "fwd_chunks": 16},
    "bwd_chunks16": {"bwd_chunks": 16},
    "bwd_chunks64": {"bwd_chunks": 64},
    "bwd_stages2": {"bwd_stages": 2},
    "bwd_warps4": {"bwd_warps": 4},
    "bwd_BT8": {"bwd_BT": 8},
    "bwd_BT32": {"bwd_BT": 32},
    "bwd_BT32_stages2": {"bwd_BT": 32, "bwd_stages": 2},
    "bwd_BT32_chunks16": {"bwd_BT": 32, "bwd_chunks": 16},
    "bwd_M64": {"bwd_BT": 16, "bwd_chunks": 32},
    "bwd_M128": {"bwd_BT": 32, "bwd_chunks": 16},
    "bwd_M128_warps4": {"bwd_BT": 32, "bwd_chunks": 16, "bwd_warps": 4},
    "bwd_M128_warps8": {"bwd_BT": 32, "bwd_chunks": 16, "bwd_warps": 8},
    "fwd_stages2": {"fwd_stages": 2},
    "range_half": {"range_tokens": -0.5},
    "range_x2": {"range_tokens": -2},
}
"""range_tokens < 0: -k times the default range (the op's memory rule), for the partials' size against speed."""


def main() -> None:
    parser = shape_script_parser(__doc__, ["1:16384:16:4:128", "1:65536:16:4:128"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        help="variants to time (default: all); 'default' always runs first")
    args = parser.parse_args()
    variants = {"default": {}, **{name: VARIANTS[name] for name in args.variants}}
    rows, add = row_recorder(args.out, {**header(args.commit), "variants": variants})
    for shape in args.shapes:
        B, T, Hq, Hkv, D = parse_shape(shape)
        cfg, q, k, v, do, bi = selected_op_inputs(shape)
        scale, L = D ** -0.5, cfg.sel_block
        base = None
        for name, tiles in variants.items():
            tiles = dict(tiles)
            if tiles.get("range_tokens", 0) < 0:
                tiles["range_tokens"] = int(-tiles["range_tokens"] * launch.range_tokens(B, T, Hq, cfg.n_selected, D,
                                                                                         q.dtype))
            try:
                o, lse = launch.forward(q, k, v, bi, None, scale, L, tiles)
                grads = launch.backward(do, q, k, v, o, lse, bi, None, scale, L, tiles)
                out = (o, *grads)
                if base is None:
                    base = out
                diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(out, base))
                fwd = bench_ms(lambda: launch.forward(q, k, v, bi, None, scale, L, tiles))
                bwd = bench_ms(lambda: launch.backward(do, q, k, v, o, lse, bi, None, scale, L, tiles))
                add({"shape": shape, "variant": name, "tiles": tiles, "fwd_ms": fwd, "bwd_ms": bwd,
                     "max_diff_vs_default": diff})
            except Exception as exc:  # one failing variant must not lose the others
                add({"shape": shape, "variant": name, "tiles": tiles, "error": f"{type(exc).__name__}: {exc}"[:300]})
            torch.cuda.empty_cache()
    print("| shape | variant | fwd ms | bwd ms | max diff |\n|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['variant']} | error | | {r['error'][:80]} |")
        else:
            print(f"| {r['shape']} | {r['variant']} | {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | "
                  f"{r['max_diff_vs_default']:.2e} |")


if __name__ == "__main__":
    main()
