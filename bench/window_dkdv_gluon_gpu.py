"""The window op's backward kernels, Gluon against Triton, on the same inputs (a GPU with Gluon).

    python -m bench.window_dkdv_gluon_gpu --out $OUT/window_gluon_dkdv_kernel.json [--dim 64]
        [--shapes 65536:3:4 ...]

window_op.backward in the gated node's mode (dO unfolded, the window's gate and delta per row,
with and without the selected branch's local-slot term) with launch_config's kv_gluon and
dq_gluon: both Triton (triton), the Gluon dK/dV kernel (gluon: kv_gluon 1, 128-row tiles;
gluon_rows64: 64-row tiles and 4 warps) and both Gluon (gluon_dq: kv_gluon and dq_gluon 1), each
against the first; at --dim (Dk = Dv, 128 by default) and T:Hkv:G shapes (SHAPES by default), the
Triton kernels with launch_config(dim, dim)'s tiles.
Inputs: q, k, v random bf16; o, lse from window_op.forward with the local partial; the gate
uniform; delta = rowsum(dO o); the selected rows from lse plus 0.3 U(0, 1), 0.7 delta and U(0, 1).
Per shape: the largest and relative L2 differences of dq, dk and dv; at T >= 32k do_bench
medians of the whole backward (dQ + dK/dV), each variant twice.
docs/decisions.md, "The window branch".
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from bench.common import header, row_recorder

SHAPES = [(65536, 4, 4), (32768, 4, 4), (65536, 4, 16), (8192, 4, 1), (3001, 2, 2), (1000, 2, 8), (777, 3, 4),
          (130, 1, 4)]
"""(T, Hkv, G) at W = 512, l' = 64."""
VARIANTS = [("triton", 0, 0, 128), ("gluon", 1, 0, 128), ("gluon_rows64", 1, 0, 64), ("gluon_dq", 1, 1, 128)]
"""(name, kv_gluon, dq_gluon, kv_gluon_BM): launch_config's keys of each variant."""


def _inputs(T: int, Hkv: int, G: int, D: int):
    import nsa_flex.ops.window as W

    L = 64
    R, Hq = T * G, Hkv * G
    q = torch.randn(1, Hkv, R, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, T, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    o, lse, _, _ = W.forward(q, k, v, G, 512, D ** -0.5, W.launch_config(D, D), L)
    do = torch.randn(1, T, Hq, D, device="cuda", dtype=torch.bfloat16)
    do_fold = do.view(1, T, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(1, Hkv, R, D)
    delta = (do_fold.float() * o.float()).sum(-1)
    by_head = lambda x: x.view(1, Hkv, T, G).permute(0, 1, 3, 2).reshape(1, Hq, T)  # noqa: E731
    sel = (by_head(lse) / math.log2(math.e) + 0.3 * torch.rand(1, Hq, T, device="cuda"), 0.7 * by_head(delta),
           torch.rand(1, Hq, T, device="cuda"), L)
    return (do, q, k, v, o, lse, G, 512, D ** -0.5), dict(gate=torch.rand(1, Hkv, R, device="cuda"), delta=delta), sel


def main() -> None:
    from triton.testing import do_bench

    import nsa_flex.ops.window as W

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dim", type=int, default=128, choices=(64, 128), help="Dk = Dv")
    p.add_argument("--shapes", nargs="+", default=None, help="T:Hkv:G each (default: SHAPES)")
    args = p.parse_args()
    shapes = [tuple(int(x) for x in s.split(":")) for s in args.shapes] if args.shapes else SHAPES
    _, add = row_recorder(args.out, {**header(), "what": "window backward (dQ kernel + dK/dV kernel) in the gated "
                                     "node's mode with (sel) and without (nosel) the local-slot term: Triton kernels "
                                     "(triton), the Gluon dK/dV kernel (gluon), and the Gluon dQ kernel too "
                                     "(gluon_dq) on the same inputs; differences of dq, dk, dv against triton; "
                                     "do_bench ms",
                                     "method": "python -m bench.window_dkdv_gluon_gpu"})
    for T, Hkv, G in shapes:
        torch.manual_seed(0)
        base, kw, sel_rows = _inputs(T, Hkv, G, args.dim)
        cfgs = {name: {**W.launch_config(args.dim, args.dim), "kv_gluon": kv, "dq_gluon": dq, "kv_gluon_BM": bm}
                for name, kv, dq, bm in VARIANTS}
        row = {"T": T, "Hkv": Hkv, "G": G, "D": args.dim}
        for tag, sel in (("sel", sel_rows), ("nosel", None)):
            run = {name: (lambda c=c: W.backward(*base, c, **kw, sel=sel)) for name, c in cfgs.items()}
            want = run["triton"]()
            for variant in list(cfgs)[1:]:
                for name, a, b in zip(("dq", "dk", "dv"), want, run[variant]()):
                    a, b = a.float(), b.float()
                    row[f"{tag}_{variant}_{name}_max_diff"] = (a - b).abs().max().item()
                    row[f"{tag}_{name}_max_abs"] = a.abs().max().item()
                    row[f"{tag}_{variant}_{name}_rel_l2"] = ((a - b).norm() / a.norm().clamp_min(1e-30)).item()
            if T >= 32768:
                for rep in (1, 2):
                    for variant, fn in run.items():
                        row[f"{tag}_{variant}_ms_{rep}"] = do_bench(fn, rep=200)
        add(row)


if __name__ == "__main__":
    main()
