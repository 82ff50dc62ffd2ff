"""Where a training step leaves the GPU idle, on a GPU.

    python -m bench.train_step_gaps_gpu --out runs/bench/step_gaps.json --attentions nsa dense -T 65536 -B 1

For each attention, seeds-125m trains as `nsa-flex bench model` runs it (compiled blocks as CUDA
graphs, synthetic kv data) for 7 steps; steps 4 and 5 run under torch.profiler. The kernels' (and
copies') intervals are merged: busy time, idle time between the first and last kernel, the idle
gaps by size, and the largest gaps with the kernels on either side and the host ops that ran
during each (what the GPU waited for), and the kernels' time summed by name.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path

import torch

from bench.common import header, json_saver
from nsa_flex.bench.model import train_settings
from nsa_flex.training.config import build_config
from nsa_flex.training.train import TrainHooks, train

FIRST = 4
"""The first profiled step (two are profiled: a step boundary lies between them)."""
GAP_BINS_US = ((0, 5), (5, 20), (20, 100), (100, 1000), (1000, float("inf")))


def device_events(events: list[dict]) -> list[dict]:
    """A chrome trace's kernels, copies and memsets, in start order."""
    device_cats = ("kernel", "gpu_memcpy", "gpu_memset")
    return sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in device_cats), key=lambda e: e["ts"])


def gaps_of(events: list[dict], top: int = 40) -> dict:
    """Busy and idle ms of the GPU over a chrome trace's events, the gaps by size, the largest 25,
    and the `top` kernel names that took the most time (ms summed, launches)."""
    kernels = device_events(events)
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    busy, end, last, gaps = 0.0, None, None, []
    for e in kernels:
        start, stop = e["ts"], e["ts"] + e["dur"]
        if end is not None and start > end:
            gaps.append((start - end, last["name"], e["name"], start))
        if end is None or stop > end:
            busy += stop - max(start, end if end is not None else start)
            end, last = stop, e
    span = end - kernels[0]["ts"] if kernels else 0.0
    bins = {f"{lo}-{hi}us": {"count": sum(lo <= g[0] < hi for g in gaps),
                             "ms": sum(g[0] for g in gaps if lo <= g[0] < hi) / 1e3} for lo, hi in GAP_BINS_US}
    largest = []
    for gap, before, after, at in sorted(gaps, key=lambda g: -g[0])[:25]:
        ops = [e["name"][:60] for e in host if at - gap <= e["ts"] <= at and e["dur"] > 50]
        largest.append({"gap_us": gap, "before": before[:90], "after": after[:90], "host_ops": ops[:12]})
    by_name: dict[str, list] = {}
    for e in kernels:
        entry = by_name.setdefault(e["name"][:90], [0.0, 0])
        entry[0] += e["dur"] / 1e3
        entry[1] += 1
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {"kernels": len(kernels), "span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3,
            "gaps": bins, "largest": largest,
            "by_kernel": [{"name": name, "ms": ms, "launches": count} for name, (ms, count) in ranked]}


def kernel_sequence(events: list[dict]) -> list[list]:
    """Every device event in order: [name, start us from the first, duration us]."""
    kernels = device_events(events)
    return [[e["name"][:80], round(e["ts"] - kernels[0]["ts"], 2), round(e["dur"], 2)] for e in kernels]


def kernel_sources(names: list[str], root: Path) -> dict[str, str]:
    """The generated source of each Inductor kernel in names (triton_* as the profiler names them,
    maybe cut short: gaps_of keeps 90 characters) found under root (Inductor's cache), from its
    decorator to the end of its body, then the source-node comment of each place that launches it:
    {name: text}. Other names, or names not found, are left out. (Inductor numbers its kernels per
    graph: the first file, in path order, that defines a name is taken.)"""
    texts = [path.read_text() for path in sorted(root.rglob("*.py"))]
    found = {}
    for name in (n for n in names if n.startswith("triton_")):
        for text in texts:
            m = re.search(rf"def ({re.escape(name)}\w*)\(", text)
            if m is None:
                continue
            start = text.rfind("@triton_heuristics", 0, m.start())
            end = text.find("\n\n\n", m.start())
            body = text[start if start >= 0 else m.start():end if end >= 0 else len(text)]
            calls = [text[at:text.find("\n", at)].strip()
                     for call in re.finditer(rf"\b{m.group(1)}\.run\(", text)
                     if (at := text.rfind("# Topologically Sorted Source Nodes", 0, call.start())) >= 0]
            found[name] = "\n".join([body, *calls])
            break
    return found


def profile_steps(attention: str, T: int, B: int, top: int = 40, sequence: Path | None = None) -> dict:
    """One row: steps FIRST and FIRST + 1 of a fresh run under the profiler, and every step's ms;
    with `sequence`, every device event of those steps in order, written there as JSON."""
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA])

    def before_step(step: int) -> None:
        if step in (FIRST, FIRST + 2):
            torch.cuda.synchronize()
            profiler.__enter__() if step == FIRST else profiler.__exit__(None, None, None)

    work = Path(tempfile.mkdtemp())
    config = build_config({}, train_settings("seeds-125m", attention, T, B, FIRST + 3, work))
    result = train(config, hooks=TrainHooks(before_step=before_step))
    trace = work / "trace.json"
    profiler.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    row = gaps_of(events, top)
    if sequence is not None:
        sequence.write_text(json.dumps({"attention": attention, "T": T, "B": B, "events": kernel_sequence(events)}))
    return {"attention": attention, "T": T, "B": B, "step_ms": [s * 1e3 for s in result.step_times_s],
            "profiled_steps": 2, **row}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--attentions", nargs="+", default=["nsa", "dense"], choices=["nsa", "dense"])
    p.add_argument("-T", type=int, default=65536)
    p.add_argument("-B", type=int, default=1)
    p.add_argument("--commit", default="")
    p.add_argument("--top", type=int, default=40, help="kernel names kept, by time")
    p.add_argument("--sequence", type=Path, help="also write every device event in order here (NAME.json per attention)")
    p.add_argument("--sources", action="store_true",
                   help="also keep each kept Inductor kernel's generated source (row key kernel_sources), read "
                        "from Inductor's cache: run with a fresh TORCHINDUCTOR_CACHE_DIR so that it holds this run's")
    args = p.parse_args()
    record = {"header": {**header(args.commit), "what": __doc__.splitlines()[0]}, "rows": []}
    save = json_saver(args.out, record)
    for attention in args.attentions:
        sequence = args.sequence.with_name(f"{args.sequence.stem}_{attention}.json") if args.sequence else None
        row = profile_steps(attention, args.T, args.B, args.top, sequence)
        if args.sources:
            from torch._inductor.runtime.cache_dir_utils import cache_dir

            row["kernel_sources"] = kernel_sources([k["name"] for k in row["by_kernel"]], Path(cache_dir()))
        record["rows"].append(row)
        save()
        print(f"{attention} T={args.T} B={args.B}: idle {row['idle_ms'] / 2:.2f} ms a step "
              f"(busy {row['busy_ms'] / 2:.1f})", flush=True)


if __name__ == "__main__":
    main()
