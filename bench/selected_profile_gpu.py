"""One forward and one backward of the block-centric selected op, for a kernel profiler.

    ncu --profile-from-start off --section SpeedOfLight ... python -m bench.selected_profile_gpu --shape 1:16384:16:4:128

Inputs as bench.selected_tiles_gpu (bf16, NSA-shaped random selections). Two untraced rounds
first (Triton compiles, index compiles), then one traced round between cudaProfilerStart / Stop,
so the profiler sees each of the op's kernels once, warm.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import parse_shape
from nsa_flex.bench.selected import random_selection
from nsa_flex.config import NSAConfig
from nsa_flex.ops.selected_attention import launch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1:16384:16:4:128", help="B:T:Hq:Hkv:D")
    args = p.parse_args()
    B, T, Hq, Hkv, D = parse_shape(args.shape)
    cfg = NSAConfig(n_heads=Hq, n_kv_heads=Hkv, head_dim=D)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, T, h, D, generator=g, device="cuda", dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv, Hq))
    bi = random_selection(B, Hkv, T, cfg, "cuda")
    scale, L = D ** -0.5, cfg.sel_block
    for traced in (False, False, True):
        torch.cuda.synchronize()
        if traced:
            torch.cuda.cudart().cudaProfilerStart()
        o, lse = launch.forward(q, k, v, bi, None, scale, L)
        launch.backward(do, q, k, v, o, lse, bi, None, scale, L)
        torch.cuda.synchronize()
        if traced:
            torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled one forward and one backward at {args.shape}")


if __name__ == "__main__":
    main()
