"""Where a training step's memory and time go: the NSA LM against the same LM with dense attention.

For each (attention, T, B), a fresh seeds-125m model with compiled blocks, bf16 autocast, the
compiled loss (as nsa_flex.training.train runs it, without the optimizer):
  saved      every tensor the blocks save for the backward, from saved_tensors_hooks during one
             forward (after a warm-up step compiled everything), deduplicated by storage, per
             block: shape, dtype, MiB; and the allocated bytes each block's forward adds.
  peak       one fwd+bwd under torch.cuda.memory._record_memory_history: the allocations alive
             at the step's peak, grouped by size and the line that made them (Inductor's
             generated code is resolved to its source line and the nearest "Source Nodes"
             comment above it).
  kernels    with --profile: one fwd+bwd under torch.profiler, CUDA time per kernel name.

    python -m bench.memory_probe_gpu --out "$OUT/memory_probe.json" --shapes nsa:8192:4 dense:8192:4
"""

from __future__ import annotations

import argparse
import collections
import gc
import linecache
import sys
import time
import traceback
from pathlib import Path

import torch

from bench.common import header, json_saver
from nsa_flex.model import MODEL_PRESETS, NSALM
from nsa_flex.training.train import compiled_lm_loss
from nsa_flex.training.parallel import compile_blocks

MIB = 2**20


def build(attention: str, T: int) -> NSALM:
    preset = MODEL_PRESETS["seeds-125m"]
    cfg = preset.replace(attention=attention, max_seq_len=max(preset.max_seq_len, T), impl="flex")
    torch.manual_seed(0)
    model = NSALM(cfg, device="cuda")
    compile_blocks(model)
    return model


def fwd_bwd(model: NSALM, tokens: torch.Tensor, loss_fn) -> None:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    for p in model.parameters():
        p.grad = None


def saved_tensors(model: NSALM, tokens: torch.Tensor, loss_fn) -> dict:
    """Saved tensors per block (by storage) and the bytes each block's forward leaves allocated."""
    current = {"block": "pre"}
    seen: dict[int, tuple] = {}
    per_block: dict[str, list] = collections.defaultdict(list)
    added: dict[str, float] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen[key] = (current["block"],)
                per_block[current["block"]].append(
                    {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                     "mib": t.untyped_storage().nbytes() / MIB})
        return t

    class Probe(torch.nn.Module):
        """Runs a compiled block, outside its compiled code: notes which block saves, and what it adds."""

        def __init__(self, inner, name):
            super().__init__()
            self.inner, self.name = inner, name

        def forward(self, *args):
            current["block"] = self.name
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            out = self.inner(*args)
            torch.cuda.synchronize()
            added[self.name] = torch.cuda.memory_allocated() - before
            current["block"] = "post"
            return out

    blocks_before = model.layers
    model.layers = torch.nn.ModuleList(Probe(b, f"block{i}") for i, b in enumerate(blocks_before))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        after_forward = torch.cuda.memory_allocated()
        loss.backward()
    finally:
        model.layers = blocks_before
    for p in model.parameters():
        p.grad = None
    blocks = {name: {"saved_mib": sum(x["mib"] for x in items), "tensors": sorted(items, key=lambda x: -x["mib"])}
              for name, items in per_block.items()}
    return {"after_forward_mib": after_forward / MIB, "block_forward_adds_mib": {k: v / MIB for k, v in added.items()},
            "saved": blocks}


def source_of(frames: list[dict]) -> str:
    """The innermost frame outside torch's own Python: for Inductor code, its line and 'Source Nodes'."""
    for fr in frames:
        name = fr.get("filename", "")
        if "torchinductor" in name or "/nsa_flex/" in name or "/bench/" in name:
            line = linecache.getline(name, fr.get("line", 0)).strip()
            note = ""
            if "torchinductor" in name:
                for back in range(1, 40):
                    text = linecache.getline(name, fr["line"] - back)
                    if "Source Nodes" in text or "Original ATen" in text:
                        note = text.strip()[:200]
                        break
            return f"{Path(name).name}:{fr.get('line')} {fr.get('name')}: {line[:160]} | {note}"
    return "; ".join(f"{Path(f.get('filename', '?')).name}:{f.get('line')}" for f in frames[:4])


def peak_live(model: NSALM, tokens: torch.Tensor, loss_fn) -> dict:
    """Alive allocations at the peak of one fwd+bwd of the model."""
    return peak_of(lambda: fwd_bwd(model, tokens, loss_fn))


def trace_of(run) -> tuple[int, list[dict]]:
    """(bytes allocated before, the allocator's events during run()): its trace with Python stacks."""
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
    return base, snap["device_traces"][torch.cuda.current_device()]


def peak_of(run, groups_kept: int = 60) -> dict:
    """Alive allocations at the peak of run(), replayed from the allocator's trace, grouped by
    the line that made them (source_of): base (MiB allocated before), peak over it, the groups."""
    base, events = trace_of(run)
    live: dict[int, dict] = {}
    total = peak = 0
    at_peak: list[dict] = []
    for ev in events:
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
    top = sorted(groups.items(), key=lambda kv: -kv[1][1])[:groups_kept]
    return {"base_mib": base / MIB, "peak_over_base_mib": peak / MIB,
            "groups": [{"where": k, "count": c, "mib": b / MIB} for k, (c, b) in top]}


def kernels(model: NSALM, tokens: torch.Tensor, loss_fn) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fwd_bwd(model, tokens, loss_fn)
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", 0) or getattr(ev, "cuda_time_total", 0)
        if t > 0:
            rows.append({"name": ev.key[:140], "count": ev.count, "ms": t / 1e3})
    rows.sort(key=lambda r: -r["ms"])
    return {"total_ms": sum(r["ms"] for r in rows), "top": rows[:50]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shapes", nargs="+", default=["nsa:8192:4", "dense:8192:4"], help="attention:T:B each")
    p.add_argument("--profile", action="store_true", help="Also a CUDA kernel-time profile of one fwd+bwd.")
    p.add_argument("--no-peak", action="store_true", help="Skip the allocator trace (the slowest part).")
    p.add_argument("--commit", default="")
    args = p.parse_args()
    record = {"header": header(args.commit), "rows": []}
    save = json_saver(args.out, record)
    loss_fn = compiled_lm_loss()
    for spec in args.shapes:
        attention, T, B = spec.split(":")
        T, B = int(T), int(B)
        row = {"attention": attention, "T": T, "B": B}
        record["rows"].append(row)
        t0 = time.time()
        try:
            torch._dynamo.reset()
            gc.collect()
            torch.cuda.empty_cache()
            model = build(attention, T)
            tokens = torch.randint(0, model.config.vocab_size, (B, T + 1), device="cuda")
            fwd_bwd(model, tokens, loss_fn)  # compile
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fwd_bwd(model, tokens, loss_fn)
            row["params_grads_free_base_mib"] = base / MIB
            row["fwd_bwd_peak_mib"] = torch.cuda.max_memory_allocated() / MIB
            phases = [("saved", saved_tensors)] + ([] if args.no_peak else [("peak", peak_live)]) \
                + ([("kernels", kernels)] if args.profile else [])
            for name, phase in phases:
                try:
                    row[name] = phase(model, tokens, loss_fn)
                except Exception:
                    row[f"{name}_error"] = traceback.format_exc()[-2000:]
                    print(row[f"{name}_error"], file=sys.stderr, flush=True)
        except Exception:
            row["error"] = traceback.format_exc()[-3000:]
            print(row["error"], file=sys.stderr, flush=True)
        row["seconds"] = time.time() - t0
        print(f"{spec}: {row.get('fwd_bwd_peak_mib', float('nan')):.0f} MiB peak, "
              f"{row.get('saved', {}).get('after_forward_mib', float('nan')):.0f} MiB after forward, {row['seconds']:.0f} s", flush=True)
        save()
        del model
    save()


if __name__ == "__main__":
    main()
