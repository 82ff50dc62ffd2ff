"""Selected-branch query tiles on the GPU: the whole op at several sel_q_block sizes, per shape.

    python -m bench.tiles_gpu --out $OUT/tiles.json --shapes 16:2048:12:3:64 1:8192:64:4:128 \
        --variants 16 128 128n [--deadline-s 540]

A shape is B:T:Hq:Hkv:D. For each one: dense causal cuDNN SDPA (k/v expanded to Hq heads), then
nsa_flex (eager glue, each Flex call compiled) with FlexTiles(sel_q_block=X) for every variant X
(Xn: also split_initial=False; Xf: sel_full_blocks=False; X@N: N query tokens per initial copy):
forward and forward+backward medians, peak memory of one forward+backward, first-call seconds
(compilation), and the output's largest difference from the first X's (the tiles only change
the order of bf16 sums, so this stays at rounding level; a larger one is a bug).

Why: with 16 folded rows per tile (one token at G=16, four at G=4) every 64-key block is
loaded for 16 rows. At short T a token selects a large share of its blocks, so larger tiles
over the union of their tokens' blocks may cost less than many 16-row ones.
JSON is rewritten after every measurement, so a call cut short keeps what it measured.
"""

from __future__ import annotations

import time

import torch

from bench.common import (bench_ms, dense_cudnn, header, kernel_table, make_inputs, parse_shape, peak_gib,
                          row_recorder, shape_script_parser)
from bench.flex_gpu import allow_many_shapes

from nsa_flex.flex import nsa_flex
from nsa_flex.flex.tuning import FlexTiles

START = time.monotonic()
def measure(fn, x: dict, grad_out) -> dict:
    leaves = [t for t in x.values() if t.requires_grad]

    def fwd_bwd():
        torch.autograd.backward(fn(), grad_out, inputs=leaves)

    t0 = time.monotonic()
    fwd_bwd()
    torch.cuda.synchronize()
    first = time.monotonic() - t0
    # The eager glue can leave the GPU waiting on the host: gpu_* sum the kernels' own time.
    return {"first_s": round(first, 1), "fwd_ms": bench_ms(fn), "fwd_bwd_ms": bench_ms(fwd_bwd),
            "gpu_fwd_ms": kernel_table(fn)["gpu_ms"], "gpu_fwd_bwd_ms": kernel_table(fwd_bwd)["gpu_ms"],
            "peak_gib": peak_gib(fwd_bwd)}


def parse_variant(variant: str) -> FlexTiles:
    """"16", "16n" (no initial split), "16f" (no full-block lists), "16@1024" (tokens per initial copy)."""
    head, _, tokens = variant.partition("@")
    extra = {"initial_copy_tokens": int(tokens)} if tokens else {}
    flags = head.lstrip("0123456789")
    return FlexTiles(sel_q_block=int(head[:len(head) - len(flags)]), split_initial="n" not in flags,
                     sel_full_blocks="f" not in flags, **extra)


def main() -> None:
    p = shape_script_parser(__doc__, ["16:2048:12:3:64"])
    p.add_argument("--variants", nargs="+", default=["16", "128"],
                   help="sel_q_block values; suffix n: no initial split, f: no full-block lists, @N: query tokens per copy")
    p.add_argument("--deadline-s", type=float, default=540)
    args = p.parse_args()
    allow_many_shapes()
    rows, add = row_recorder(args.out, header(args.commit) | {
        "what": "nsa_flex eager glue, each Flex call compiled; dense = cuDNN SDPA causal, same run"})

    for shape in args.shapes:
        B, T, Hq, Hkv, D = parse_shape(shape)
        cfg, x = make_inputs(B, T, Hq, Hkv, D)
        do = torch.randn(B, T, Hq, D, device="cuda", dtype=torch.bfloat16)
        dense, dense_x = dense_cudnn(x, Hq // Hkv)
        r = {"shape": shape, "impl": "dense-cudnn", **measure(dense, dense_x, do.transpose(1, 2).contiguous())}
        add(r)

        ref = None
        for variant in args.variants:
            tiles = parse_variant(variant)
            qb, split = tiles.sel_q_block, tiles.split_initial
            if time.monotonic() - START > args.deadline_s:
                add({"shape": shape, "impl": "nsa-flex", "variant": variant, "note": "skipped: deadline"})
                continue

            def op():
                return nsa_flex(**x, config=cfg, tiles=tiles)[0]

            r = {"shape": shape, "impl": "nsa-flex", "variant": variant, "sel_q_block": qb, "split_initial": split}
            try:
                r.update(measure(op, x, do))
                with torch.no_grad():
                    o = op().float()
                if ref is None:
                    ref = o
                r["max_diff_vs_first"] = float((o - ref).abs().max())
                dense_row = next(d for d in rows if d["shape"] == shape and d["impl"] == "dense-cudnn")
                r["fwd_vs_dense"] = round(dense_row["fwd_ms"] / r["fwd_ms"], 3)
                r["fwd_bwd_vs_dense"] = round(dense_row["fwd_bwd_ms"] / r["fwd_bwd_ms"], 3)
            except Exception as e:  # a variant that does not compile is a result too
                r["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            add(r)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
