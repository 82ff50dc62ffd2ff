"""Where a decode step's time goes, program by program: a timeline of its five kernels.

    python -m bench.decode_timeline_gpu --out $OUT/timeline.json [--cases 1:65536 8:65536]

The step (nsa_flex::step_attend's kernels: cache_step, then A, B, S and D of nsa_flex.ops.decode.kernels)
runs STEPS times from one CUDA graph, as the bench times it. Every program of every kernel
stores the global timer (ns) at its entry, where its wait for the kernel ahead ended, at a
point of its own (B: before its top n; S: once its block is known; the others: the wait's
end again) and at its end, with its SM (nsa_flex.ops.triton_utils). Per step and kernel the JSON holds those three
times (min / median / max over the programs) relative to the step's first cache_step entry,
and the step's period (the end of D to the end of the previous step's D). The graph is also
timed with the stamps off, to see what they cost. A PNG draws every program of one step
that completes no compressed block.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from nsa_flex.bench.decode import DecodeProblem, decode_config, graph_step_times
from nsa_flex.decoding.step import step_tensors
from nsa_flex.ops.decode.cache_step import cache_step_triton, phi_chunk_tokens, phi_rows
from nsa_flex.ops.decode.attend import prepare_inputs
from nsa_flex.ops.decode.kernels import decode_attend_triton, launch_config, launch_grids
from nsa_flex.ops.decode.phi_step import phi_params

from bench.decode_tiles_gpu import parse_tiles

KERNELS = ("cache_step", "A", "B", "S", "D")
STEPS = 10
REPLAYS = 10


def stepper(prob: DecodeProblem, overrides: dict[str, int] | None = None):
    """(step(traces or None), programs per kernel): step_attend's work, the kernels launched
    directly so that they can take a trace buffer; overrides: launch_config keys."""
    cache, pr, cfg = prob.cache, prob.pr, prob.cache.config
    B, Hkv, G = pr.q.shape[0], cfg.n_kv_heads, cfg.group_size
    tokens, caches = step_tensors(cache, pr)
    k, v, k_win, v_win, _, _, k_cmp, v_cmp = caches
    k_win, v_win = (k, v) if k_win is None else (k_win, v_win)
    q, gates, scale = prepare_inputs(pr.q.reshape(B, Hkv, G, cfg.head_dim), k, v, k_win, v_win, k_cmp, v_cmp,
                               cache.lengths, prob.gates.reshape(B, Hkv, G, 3), cfg, None)
    T, Tc = k.shape[2], k_cmp.shape[2]
    tiles = {**launch_config(B, Hkv, Tc, cfg), **(overrides or {})}
    w1 = phi_params(prob.phi_k)[1]
    chunks = -(-cfg.cmp_block // phi_chunk_tokens(cfg.cmp_block, w1.shape[0], cfg.head_dim,
                                                  (1 << 16) // w1.element_size()))
    programs = [-(-B * Hkv // phi_rows(B * Hkv)) * 2 * chunks]
    programs += [a * b for a, b in launch_grids(B, Hkv, T, Tc, cfg, tiles, G)]

    def step(trace: torch.Tensor | None = None):
        cache_step_triton(*tokens, *caches, cache.lengths, cache.phi_count, phi_params(prob.phi_k),
                           phi_params(prob.phi_v), cfg.cmp_block, cfg.cmp_stride,
                           trace=None if trace is None else trace[0])
        return decode_attend_triton(q, k, v, k_win, v_win, k_cmp, v_cmp, cache.lengths, gates, scale, cfg, tiles,
                                    advance=True, after_cache_step=True, trace=None if trace is None else trace[1:])

    return step, programs


def summarize(trace: torch.Tensor, programs: list[int], t0: int) -> dict:
    """Per kernel: entry / released / end ns (min, median, max) relative to t0, and SMs used."""
    out = {}
    for i, name in enumerate(KERNELS):
        if not programs[i]:
            continue  # not launched (B with SB)
        rows = trace[i, :programs[i]]
        out[name] = {col: [int(rows[:, c].min()) - t0, int(rows[:, c].median()) - t0, int(rows[:, c].max()) - t0]
                     for c, col in enumerate(("entry", "released", "mid", "end"))}
        out[name]["programs"] = programs[i]
        out[name]["sms"] = int(rows[:, 4].unique().numel())
    return out


def plot(trace: torch.Tensor, programs: list[int], t0: int, title: str, ax) -> None:
    colors = ("tab:purple", "tab:blue", "tab:orange", "tab:green", "tab:red")
    first = 0
    for i, name in enumerate(KERNELS):
        if not programs[i]:
            continue
        rows = trace[i, :programs[i]].double()
        ax.scatter((rows[:, 2] - t0) / 1e3, torch.arange(first, first + programs[i]), s=2, color="k")
        y = torch.arange(first, first + programs[i])
        first += programs[i]
        ax.hlines(y, (rows[:, 0] - t0) / 1e3, (rows[:, 1] - t0) / 1e3, color=colors[i], alpha=0.25, lw=1)
        ax.hlines(y, (rows[:, 1] - t0) / 1e3, (rows[:, 3] - t0) / 1e3, color=colors[i], lw=1,
                  label=f"{name} ({programs[i]})")
    ax.set_xlabel("us since the step's first cache_step program started")
    ax.set_ylabel("program")
    ax.set_title(title + "\nfaint: entry to end of wait, solid: after the wait")
    ax.legend(loc="lower right")
    ax.invert_yaxis()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cases", nargs="+", default=["1:65536", "8:65536"],
                   help="B:T or B:T:KEY=INT[,KEY=INT...] (launch_config overrides)")
    args = p.parse_args()
    rows, figs = [], []
    for case in args.cases:
        B, T, *rest = case.split(":")
        B, T = int(B), int(T)
        overrides = parse_tiles(rest[0]) if rest else {}
        prob = DecodeProblem(decode_config(device="cuda", contexts=(T,), batches=(B,)), B, T)
        step, programs = stepper(prob, overrides)
        traces = torch.zeros(STEPS, len(KERNELS), max(programs), 5, dtype=torch.int64, device="cuda")
        calls = iter(range(10**9))

        def traced():
            return step(traces[next(calls) % STEPS])

        row = {"B": B, "T": T, "tiles": overrides, "programs": dict(zip(KERNELS, programs))}
        for name, fn in (("plain", step), ("traced", traced)):
            times = graph_step_times(fn, prob.reset, steps=STEPS, reps=7, replays=REPLAYS)
            row[f"{name}_us"] = 1e3 * statistics.median(times)
        # graph_step_times captured STEPS traced steps after 3 warm-up calls: rotate so that
        # index 0 is the graph's first step.
        tr = traces.roll(-3, dims=0).cpu()
        starts = [int(tr[s, 0, :programs[0], 0].min()) for s in range(STEPS)]
        ends = [int(tr[s, 4, :programs[4], 3].max()) for s in range(STEPS)]
        # The traces hold the last replay of the last timed run: reset, then (replays - 1) graphs of STEPS.
        lengths0 = prob.T + (REPLAYS - 1) * STEPS
        row["steps"] = []
        for s in range(STEPS):
            pos = lengths0 + s
            fresh = pos + 1 >= prob.cfg.nsa.cmp_block and (pos + 1 - prob.cfg.nsa.cmp_block) % prob.cfg.nsa.cmp_stride == 0
            row["steps"].append({"pos": pos, "completes_block": fresh,
                                 "period_ns": ends[s] - ends[s - 1] if s else None,
                                 "kernels": summarize(tr[s], programs, starts[s])})
        periods = [r["period_ns"] for r in row["steps"][1:] if not r["completes_block"]]
        row["median_period_us"] = statistics.median(periods) / 1e3 if periods else None
        print(json.dumps({k: v for k, v in row.items() if k != "steps"}), flush=True)
        for r in row["steps"]:
            print(f"  pos {r['pos']} fresh={r['completes_block']} period={r['period_ns']} "
                  + " ".join(f"{n}:{v['entry'][0]}/{v['released'][2]}/{v['mid'][2]}/{v['end'][2]}" for n, v in r['kernels'].items()),
                  flush=True)
        pick = next((s for s in range(STEPS - 1, 0, -1) if not row["steps"][s]["completes_block"]), STEPS - 1)
        figs.append((tr[pick], programs, starts[pick], f"B={B} T={T} {rest[0] if rest else ''}, step {pick} (pos {lengths0 + pick}): "
                     f"{row['plain_us']:.1f} us a step untraced"))
        rows.append(row)
        del prob
        torch.cuda.empty_cache()
    header = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "argv": sys.argv[1:],
              "stamps": "entry / released (end of the wait for the kernel ahead) / end, ns, "
                        "relative to the step's first cache_step entry; [min, median, max] over programs"}
    args.out.write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(figs), figsize=(8 * len(figs), 7), squeeze=False)
    for ax, (tr, programs, t0, title) in zip(axes[0], figs):
        plot(tr, programs, t0, title, ax)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
