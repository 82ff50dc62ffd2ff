"""Where the fused decode kernel's time goes: a timeline of its programs, and what each kernel compiles to.

    PYTHONPATH=. python3 bench/decode_fused_probe_gpu.py --out $OUT/fused_probe.json [--cases 1:65536 8:65536]

For each case B:T (decode_kernel_gpu.Problem's bench shape):
- registers, spills and shared memory of the fused kernel and of the four kernels it replaces
  (their compiled Triton kernels);
- for each variant (VARIANTS: programs per SM, the way of waiting): us per op call from
  a CUDA graph, against the four launches timed in the same run, and one traced call: per
  program its ticket, SM and the global-timer ns at entry, ticket taken, wait over, work done.
  Per phase (A, B, S, D) the JSON holds when its programs entered, were released and finished,
  relative to the first entry; a PNG draws every program.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_kernel_gpu import Problem, time_graph  # noqa: E402
from records import json_saver  # noqa: E402

from nsa_flex.blocks import num_sel_blocks  # noqa: E402
from nsa_flex.ops import decode_triton  # noqa: E402
from nsa_flex.ops.decode_triton import _cdiv, _next_pow2, decode_attend_triton, launch_config, sync_size  # noqa: E402

PHASES = ("A", "B", "S", "D")
VARIANTS = {
    "default": {},
    "program_per_item": {"PERSIST": 0},
    "persist2": {"PERSIST": 2},
    "persist4": {"PERSIST": 4},
    "sleep100": {"SLEEP": 100},
    "stages1": {"num_stages": 1},
}
"""Overrides of launch_config (FUSED=1): PERSIST programs per SM (0: one per work item), the
way of waiting (SPIN) and its backoff (SLEEP ns)."""


def phase_sizes(B: int, T: int, Tc: int, cfg, tiles: dict) -> dict[str, int]:
    """Programs per phase of the fused grid (the launcher's arithmetic)."""
    full = {**launch_config(B, cfg.n_kv_heads, Tc, cfg), **tiles}
    R = cfg.sel_block // cfg.cmp_stride
    JT = full["BC"] // R
    TI = max(full["TI"], _cdiv(_next_pow2(cfg.n_selected), _next_pow2(JT)))
    nprog = _cdiv(_cdiv(num_sel_blocks(T, cfg), JT), TI)
    BH = B * cfg.n_kv_heads
    return {"A": BH * (full["SPLITS"] + _cdiv(min(cfg.window, T), full["WCH"])), "B": BH * nprog,
            "S": BH * cfg.n_selected, "D": BH * cfg.group_size}


def compiled_kernels(op) -> list[dict]:
    """Runs op once with Triton's launches seen directly: each kernel's registers, spills, shared bytes."""
    seen = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                compiled = self.kernel[grid](*args, **kwargs)
                seen.append({"kernel": self.kernel.__name__, "grid": list(grid), "n_regs": compiled.n_regs,
                             "n_spills": compiled.n_spills, "shared_bytes": compiled.metadata.shared,
                             "num_warps": compiled.metadata.num_warps,
                             "cubin_bytes": len(compiled.asm.get("cubin", b"")),
                             "ptx_lines": compiled.asm.get("ptx", "").count("\n")})
            return launch

    original = decode_triton.wrap_triton
    decode_triton.wrap_triton = Recorder
    try:
        op()
        torch.cuda.synchronize()
    finally:
        decode_triton.wrap_triton = original
    return seen


def summarize(trace: torch.Tensor, sizes: dict[str, int]) -> dict:
    """Per phase: entry / release / finish ns (min, median, max) relative to the first entry."""
    t = trace.cpu()
    t0 = int(t[:, 2].min())
    out, first = {}, 0
    for name in PHASES:
        rows = t[first:first + sizes[name]]
        first += sizes[name]
        out[name] = {col: [int(rows[:, i].min()) - t0, int(rows[:, i].median()) - t0, int(rows[:, i].max()) - t0]
                     for col, i in (("entry", 2), ("ticket", 3), ("released", 4), ("done", 5))}
        out[name]["programs"] = int(rows.shape[0])
    out["span_ns"] = int(t[:, 5].max()) - t0
    out["sms_used"] = int(t[:, 1].unique().numel())
    return out


def plot(traces: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(traces), figsize=(7 * len(traces), 6), squeeze=False)
    colors = dict(zip(PHASES, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    for ax, (title, (trace, sizes)) in zip(axes[0], traces.items()):
        t = trace.cpu().double()
        t0 = t[:, 2].min()
        first = 0
        for name in PHASES:
            rows = t[first:first + sizes[name]]
            y = torch.arange(first, first + rows.shape[0])
            first += sizes[name]
            ax.hlines(y, (rows[:, 2] - t0) / 1e3, (rows[:, 4] - t0) / 1e3, color=colors[name], alpha=0.25, lw=1)
            ax.hlines(y, (rows[:, 4] - t0) / 1e3, (rows[:, 5] - t0) / 1e3, color=colors[name], lw=1,
                      label=f"{name} ({rows.shape[0]})")
        ax.set_xlabel("us since the first program started")
        ax.set_ylabel("ticket")
        ax.set_title(title + "\nfaint: entry to release (waiting), solid: work")
        ax.legend()
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cases", nargs="+", default=["1:65536", "8:65536"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    args = p.parse_args()
    rows: list[dict] = []
    header = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    save = json_saver(args.out, {"header": header, "rows": rows})
    traces = {}
    started = time.perf_counter()
    for case in args.cases:
        B, T = (int(s) for s in case.split(":"))
        prob = Problem(B, T)
        cfg = prob.cfg
        q, k, v, k_win, v_win, k_cmp, v_cmp, pos, gates = prob.op_args()
        q = q.contiguous()
        scale = cfg.head_dim ** -0.5
        sync = torch.zeros(sync_size(B, cfg.n_kv_heads), dtype=torch.int32, device="cuda")

        def op(tiles, trace=None):
            return decode_attend_triton(q, k, v, k_win, v_win, k_cmp, v_cmp, pos, gates, scale, cfg, tiles,
                                        sync=sync, trace=trace)

        row = {"B": B, "T": T, "compiled": compiled_kernels(lambda: op({"FUSED": 1}))
               + compiled_kernels(lambda: op({"FUSED": 0}))}
        prob.reset()
        row["four_launches_us"] = time_graph(lambda: op({"FUSED": 0}), prob.reset)
        ref = op({"FUSED": 0})[0].float()
        for key in args.variants:
            tiles = {"FUSED": 1, **VARIANTS[key]}
            try:
                prob.reset()
                row[f"{key}_max_diff"] = float((op(tiles)[0].float() - ref).abs().max())
                row[f"{key}_us"] = time_graph(lambda tiles=tiles: op(tiles), prob.reset)
                sizes = phase_sizes(B, T, k_cmp.shape[2], cfg, tiles)
                trace = torch.zeros(sum(sizes.values()), 6, dtype=torch.int64, device="cuda")
                prob.reset()
                op(tiles)
                prob.reset()
                op(tiles, trace)
                torch.cuda.synchronize()
                row[f"{key}_phases"] = summarize(trace, sizes)
                traces[f"B={B} T={T} {key}: {row[f'{key}_us']} us"] = (trace, sizes)
            except Exception as exc:  # a variant that fails to compile is a result too
                row[f"{key}_error"] = f"{type(exc).__name__}: {exc}"[:400]
            print(f"[{time.perf_counter() - started:4.0f} s] {B=} {T=} {key}: {row.get(key + '_us')} us "
                  f"(four launches {row['four_launches_us']}) {row.get(key + '_phases', row.get(key + '_error'))}",
                  flush=True)
        print(row["compiled"], flush=True)
        rows.append(row)
        save()
    if traces:
        plot(traces, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
