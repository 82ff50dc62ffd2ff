"""What is alive at the peak of one fwd+bwd of the op, against dense cuDNN, on a GPU.

    python -m bench.op_memory_gpu --out runs/bench/op_memory.json --shapes g4:65536 bench:65536
    python -m bench.op_memory_gpu --timeline --out runs/bench/op_memory_timeline.json --shapes bench:65536
    python -m bench.op_memory_gpu --timeline --partial-mib 768 --out runs/bench/op_memory_768.json

With --timeline, for the op alone (gradients by autograd.grad, as nsa-flex bench takes them): every
allocation and free of 48 MiB or more in order, with the running total over the inputs and the line
that made it, where the peak falls among them, and what is alive then.

For each preset:T, the op as nsa_attention runs by default (impl="flex", compiled on CUDA) on
the attention bench's random bf16 inputs with gradients (nsa_flex.bench.impls.nsa_inputs), and dense cuDNN
SDPA with GQA; --partial-mib: the op with that budget for the selected op's partials
(FlexTiles.sel_partial_bytes) instead of its default. Two warm-up calls, then one fwd+bwd under the allocator's trace, replayed to the
allocations alive at the peak, grouped by the line that made them (bench.memory_probe_gpu.peak_of).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import header, json_saver
from bench.memory_probe_gpu import peak_of, source_of, trace_of
from nsa_flex import flex
from nsa_flex.attention import nsa_attention
from nsa_flex.flex import compiled
from nsa_flex.flex.tuning import FlexTiles
from nsa_flex.bench.attention import attention_config
from nsa_flex.bench.impls import Problem, nsa_inputs

MIB = 2**20


def _case(preset: str, T: int):
    """(the preset's NSAConfig, the attention bench's random bf16 inputs with gradients, an output gradient)."""
    bench_cfg = attention_config(device="cuda", preset=preset, impls=("nsa-flex",), dtype="bf16")
    cfg = bench_cfg.nsa
    x = nsa_inputs(Problem(bench_cfg, T), grad=True)
    return cfg, x, torch.randn(1, T, cfg.n_heads, cfg.dv, device="cuda", dtype=torch.bfloat16)


def _op(x: dict, cfg, partial_mib: int):
    """The op's output as nsa_attention gives it by default, or with partial_mib MiB of partials."""
    if not partial_mib:
        return nsa_attention(**x, config=cfg, impl="flex")
    args = [x[n] for n in ("q", "k", "v", "k_cmp", "v_cmp", "gates")]
    o, _ = compiled.run(flex.nsa_flex, True, *args, cfg, tiles=FlexTiles(sel_partial_bytes=partial_mib * MIB))
    return o


def measure(preset: str, T: int, impl: str, partial_mib: int = 0) -> dict:
    """The row of one (preset, T, impl): the peak of one fwd+bwd after two warm-up calls, and what is alive then."""
    cfg, x, do = _case(preset, T)

    def forward():
        if impl == "nsa":
            return _op(x, cfg, partial_mib)
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
    return {"T": T, "impl": impl, "alloc_before_mib": before / MIB,
            "max_allocated_mib": torch.cuda.max_memory_allocated() / MIB, **peak_of(run, 40)}


def timeline(preset: str, T: int, big: int = 48 * MIB, partial_mib: int = 0) -> dict:
    """The op's allocation timeline of one fwd+bwd after two warm-up calls (see the module docstring)."""
    cfg, x, do = _case(preset, T)
    leaves = [t for t in x.values() if isinstance(t, torch.Tensor) and t.requires_grad]

    def run():
        o = _op(x, cfg, partial_mib)
        torch.autograd.grad(o, leaves, do)

    run()
    run()
    base, events = trace_of(run)
    live, total, peak, peak_at, at_peak, seq = {}, 0, 0, 0, [], []
    for ev in events:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            total += ev["size"]
            if ev["size"] >= big:
                seq.append(["+", round(ev["size"] / MIB), round(total / MIB), source_of(ev.get("frames", []))[:230]])
            if total > peak:
                peak, at_peak, peak_at = total, list(live.values()), len(seq)
        elif ev["action"] in ("free_requested", "free_completed") and ev["addr"] in live:
            gone = live.pop(ev["addr"])
            total -= gone["size"]
            if gone["size"] >= big:
                seq.append(["-", round(gone["size"] / MIB), round(total / MIB),
                            source_of(gone.get("frames", []))[:120]])
    alive = sorted(([round(e["size"] / MIB), source_of(e.get("frames", []))[:230]] for e in at_peak
                    if e["size"] >= 16 * MIB), key=lambda a: -a[0])
    return {"preset": preset, "T": T, "partial_mib": partial_mib, "base_mib": base / MIB, "peak_over_base_mib": peak / MIB, "peak_at": peak_at,
            "seq": seq, "alive": alive}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shapes", nargs="+", default=["g4:65536"], help="preset:T each")
    p.add_argument("--timeline", action="store_true", help="The op's allocation timeline instead (see above).")
    p.add_argument("--partial-mib", type=int, default=0, help="The selected op's partial budget (0: its default).")
    args = p.parse_args()
    torch._dynamo.config.cache_size_limit = 64
    # The graph compiled here, not one Inductor cached from another version of the code.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    record = {"header": header(), "rows": []}
    save = json_saver(args.out, record)
    for spec in args.shapes:
        preset, T = spec.split(":")
        if args.timeline:
            torch._dynamo.reset()
            torch.cuda.empty_cache()
            row = timeline(preset, int(T), partial_mib=args.partial_mib)
            record["rows"].append(row)
            print(f"{spec}: peak over the inputs {row['peak_over_base_mib']:.0f} MiB, event {row['peak_at']} of "
                  f"{len(row['seq'])}", flush=True)
            save()
            continue
        for impl in ("nsa", "dense"):
            torch.cuda.empty_cache()
            row = {"preset": preset, "partial_mib": args.partial_mib, **measure(preset, int(T), impl, args.partial_mib)}
            record["rows"].append(row)
            print(f"{spec} {impl}: peak {row['max_allocated_mib']:.0f} MiB", flush=True)
            for g in row["groups"][:20]:
                print(f"  {g['mib']:9.1f} MiB x{g['count']:3d}  {g['where'][:200]}", flush=True)
            save()


if __name__ == "__main__":
    main()
