"""The window op's forward, Gluon against Triton, on the same inputs (a GPU with Gluon).

    python -m bench.window_gluon_gpu --out $OUT/window_gluon_fwd_kernel.json

window_op.forward with launch_config's fwd_gluon 1 and 0, with the local partial (l' = 64, as the
gated node runs it) and without (the window op's own forward). Inputs: q (folded), k, v random
bf16, W = 512. Per shape: the largest differences of o and lse (and of the local
partial's), and do_bench medians of each variant, each twice in turn. docs/decisions.md, "The
window branch".
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.common import bench_ms, header, row_recorder

SHAPES = [(1, 65536, 4, 4, 128), (1, 32768, 4, 4, 128), (1, 65536, 4, 16, 128), (1, 16384, 4, 4, 128),
          (1, 8192, 4, 1, 128), (1, 65536, 3, 4, 64), (4, 8192, 3, 4, 64)]
"""(B, T, Hkv, G, D) at W = 512: the g4 and G=16 op's heads, and seeds-125m's (D = 64)."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--commit", default="")
    args = p.parse_args()
    import nsa_flex.ops.window as W

    _, add = row_recorder(args.out, {**header(args.commit), "what": "window_op.forward, Gluon (fwd_gluon 1) against "
                                     "Triton (0), bf16, W=512; do_bench medians, each variant twice"})
    for B, T, Hkv, G, D in SHAPES:
        torch.manual_seed(T + G)
        q = torch.randn(B, Hkv, T * G, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, T, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for local in (64, 0):
            cfgs = {name: {**W.launch_config(D, D), "fwd_gluon": use} for name, use in (("gluon", 1), ("triton", 0))}
            outs = {name: W.forward(q, k, v, G, 512, D ** -0.5, cfg, local) for name, cfg in cfgs.items()}
            names = ("o", "lse", "o_loc", "lse_loc")[:4 if local else 2]
            diffs = {n: float((a.float() - b.float()).abs().max()) for n, a, b in
                     zip(names, outs["gluon"], outs["triton"])}
            ms = {name: [] for name in cfgs}
            for _ in range(2):
                for name, cfg in cfgs.items():
                    ms[name].append(bench_ms(lambda cfg=cfg: W.forward(q, k, v, G, 512, D ** -0.5, cfg, local)))
            row = {"B": B, "T": T, "Hkv": Hkv, "G": G, "D": D, "local": local, "ms": ms, "max_abs_diff": diffs}
            add(row)


if __name__ == "__main__":
    main()
