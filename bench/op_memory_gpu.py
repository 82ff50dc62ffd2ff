"""What is alive at the peak of one fwd+bwd of the op, against dense cuDNN, on a GPU.

    python -m bench.op_memory_gpu --out runs/bench/op_memory.json --shapes g4:65536 bench:65536

For each preset:T, the op as nsa_attention runs by default (impl="flex", compiled on CUDA) on
random bf16 inputs with gradients (q, k, v, k_cmp, v_cmp, gates; the bench's), and dense cuDNN
SDPA with GQA: two warm-up calls, then one fwd+bwd under the allocator's trace, replayed to the
allocations alive at the peak, grouped by the line that made them (for Inductor's code, its line
and the nearest "Source Nodes" comment; bench.memory_probe_gpu.source_of).
"""

from __future__ import annotations

import argparse
import collections
import gc
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import header, json_saver
from bench.memory_probe_gpu import source_of
from nsa_flex.attention import nsa_attention
from nsa_flex.blocks import num_cmp_blocks
from nsa_flex.config import PRESETS

MIB = 2**20


def inputs(cfg, T: int) -> dict[str, torch.Tensor]:
    Tc = num_cmp_blocks(T, cfg)
    Hq, Hkv, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dv
    shapes = {"q": (1, T, Hq, Dk), "k": (1, T, Hkv, Dk), "v": (1, T, Hkv, Dv), "k_cmp": (1, Tc, Hkv, Dk),
              "v_cmp": (1, Tc, Hkv, Dv)}
    x = {n: torch.randn(s, device="cuda", dtype=torch.bfloat16) for n, s in shapes.items()}
    x["gates"] = torch.sigmoid(torch.randn(1, T, Hq, 3, device="cuda", dtype=torch.bfloat16))
    return {n: t.requires_grad_(True) for n, t in x.items()}


def peak_live(run) -> dict:
    """Alive allocations at the peak of run(), replayed from the allocator's trace."""
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        run()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    live, total, peak, at_peak = {}, 0, 0, []
    for ev in snap["device_traces"][torch.cuda.current_device()]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            total += ev["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif ev["action"] in ("free_requested", "free_completed") and ev["addr"] in live:
            total -= live.pop(ev["addr"])["size"]
    groups: dict[str, list] = collections.defaultdict(lambda: [0, 0])
    for ev in at_peak:
        g = groups[source_of(ev.get("frames", []))]
        g[0] += 1
        g[1] += ev["size"]
    top = sorted(groups.items(), key=lambda kv: -kv[1][1])[:40]
    return {"base_mib": base / MIB, "peak_over_base_mib": peak / MIB,
            "groups": [{"where": k, "count": c, "mib": b / MIB} for k, (c, b) in top]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shapes", nargs="+", default=["g4:65536"], help="preset:T each")
    args = p.parse_args()
    torch._dynamo.config.cache_size_limit = 64
    record = {"header": header(), "rows": []}
    save = json_saver(args.out, record)
    for spec in args.shapes:
        preset, T = spec.split(":")
        cfg, T = PRESETS[preset], int(T)
        for impl in ("nsa", "dense"):
            torch.cuda.empty_cache()
            x = inputs(cfg, T)
            do = torch.randn(1, T, cfg.n_heads, cfg.dv, device="cuda", dtype=torch.bfloat16)

            def forward():
                if impl == "nsa":
                    return nsa_attention(**x, config=cfg, impl="flex")
                q, k, v = (t.transpose(1, 2) for t in (x["q"], x["k"], x["v"]))
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)

            def run():
                forward().backward(do)
                for t in x.values():
                    t.grad = None

            run()
            run()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            run()
            torch.cuda.synchronize()
            row = {"preset": preset, "T": T, "impl": impl, "alloc_before_mib": before / MIB,
                   "max_allocated_mib": torch.cuda.max_memory_allocated() / MIB, **peak_live(run)}
            record["rows"].append(row)
            print(f"{spec} {impl}: peak {row['max_allocated_mib']:.0f} MiB", flush=True)
            for g in row["groups"][:20]:
                print(f"  {g['mib']:9.1f} MiB x{g['count']:3d}  {g['where'][:200]}", flush=True)
            save()
            del x, do


if __name__ == "__main__":
    main()
