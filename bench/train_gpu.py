"""Training on the GPU: seeds-125m with NSA (impl flex) vs dense, one GPU, one process.

Modes (--mode; "all" runs them in this order):
  throughput  S=2048 (B=16), 8192 (B=4), 32768 (B=1) for each attention: warm-up steps, then
              timed steps; tokens/s (median step), compile time (first step) apart, peak memory
              (torch.cuda.max_memory_allocated) against nsa_flex.training.memory.estimate, and dense
              against the reference dense figures (docs/results.md, "Reference figures").
  precision   N steps in bf16 and N in fp16 + GradScaler (NSA flex, S=2048, B=16): non-finite
              (skipped) steps, GradScaler skips, final loss and scale.
  curve       NSA vs dense on the same synthetic kv data: the loss of every step, and a PNG.

Every configuration runs through nsa_flex.training.train.train (compiled blocks, bf16 autocast, fused
AdamW) inside try/except: a failure is recorded with its traceback and the rest go on.
Results are rewritten after every configuration to OUT/train_gpu_<mode>.json and .md, so a
run cut short still leaves what it measured. Configurations that would start after
--budget-s seconds are recorded as skipped.

    python -m bench.train_gpu --mode throughput --out "$OUT"
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

# Run as a script from the repository root: make the in-tree package importable.
import torch

from nsa_flex.bench.model import ANCHOR_DENSE_TOKENS_PER_S, CUDA_SHAPES, train_settings
from nsa_flex.training.memory import GIB, estimate
from nsa_flex.training.train import train
from nsa_flex.training.config import build_config
from nsa_flex.training.metrics import read_metrics, versions

# The (T, B) of the training targets; they and the reference dense tokens/s are shared with `nsa-flex bench model`.
SHAPES = CUDA_SHAPES


@dataclass
class ThroughputRow:
    attention: str
    seq_len: int
    batch: int
    tokens_per_s: float = math.nan
    step_ms: float = math.nan
    compile_s: float = math.nan
    peak_gib: float = math.nan
    estimate_gib: float = math.nan
    measured_over_estimate: float = math.nan
    vs_anchor_dense: float = math.nan
    final_loss: float = math.nan
    all_finite: bool | None = None
    error: str | None = None


@dataclass
class PrecisionRow:
    precision: str
    steps: int
    nonfinite_steps: int | None = None
    scaler_skips: int | None = None
    final_loss: float = math.nan
    final_scale: float | None = None
    aborted: str | None = None
    losses: list | None = None
    """Every step's loss: the bf16 run is the NSA curve of --mode curve's settings (same data, lr, seed)."""
    error: str | None = None


@dataclass
class CurveRow:
    attention: str
    steps: int
    final_loss_mean10: float = math.nan
    final_loss_mean50: float = math.nan
    tokens_per_s: float = math.nan
    losses: list | None = None
    error: str | None = None


def settings(attention: str, seq_len: int, batch: int, steps: int, out_dir: Path, data: str = "kv",
             **extra) -> dict:
    """Flags for build_config: seeds-125m on a synthetic task, compiled, bf16, no checkpoints
    (the benchmark-run flags of nsa_flex.bench.model, with impl flex)."""
    flags = train_settings("seeds-125m", attention, seq_len, batch, steps, out_dir)
    flags["model"]["impl"] = "flex"
    return {**flags, "data": data, "device": "cuda", "compile": "on", "precision": "bf16", "log_every": 10, **extra}


class Printer:
    """A train() callback that prints a line every `every` steps (the bench's own progress)."""

    def __init__(self, label: str, every: int = 10):
        self.label, self.every = label, every

    def on_start(self, info):
        print(f"[{self.label}] start: impl={info['impl']} precision={info['precision']} compile={info['compile']}",
              flush=True)

    def on_step(self, m):
        if m["step"] % self.every == 0 or m["step"] <= 2 or m["skipped"]:
            print(f"[{self.label}] step {m['step']}/{m['total_steps']} loss {m['loss']:.4f} "
                  f"{m['step_time_s'] * 1e3:.1f} ms {m['tokens_per_s']:,.0f} tok/s mem {m['memory_gib']:.2f} GiB"
                  + (" SKIPPED" if m["skipped"] else ""), flush=True)

    def on_message(self, text):
        print(f"[{self.label}] {text}", flush=True)

    def on_end(self, summary):
        print(f"[{self.label}] done: {summary}", flush=True)


def fresh_gpu() -> None:
    """Forget compiled graphs and cached blocks between configurations."""
    gc.collect()
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def error_text() -> str:
    return traceback.format_exc()[-4000:]


def run_throughput(args, work: Path, rows: list, save) -> None:
    for attention in args.attention:
        for seq_len, batch in SHAPES:
            if seq_len not in args.seq_lens:
                continue
            row = ThroughputRow(attention, seq_len, batch)
            rows.append(row)
            if over_budget(args, row):
                save()
                continue
            try:
                fresh_gpu()
                cfg = build_config({}, settings(attention, seq_len, batch, args.warmup + args.timed,
                                                work / f"tp-{attention}-{seq_len}"))
                result = train(cfg, callback=Printer(f"{attention} S={seq_len}"))
                timed = sorted(result.step_times_s[args.warmup:])
                step_s = timed[len(timed) // 2]
                row.step_ms, row.tokens_per_s = step_s * 1e3, result.tokens_per_step / step_s
                row.compile_s = result.step_times_s[0]
                row.peak_gib = torch.cuda.max_memory_allocated() / GIB
                est = estimate(cfg.model, batch_size=batch, seq_len=seq_len, precision="bf16", compiled=True,
                               impl="flex")
                row.estimate_gib = est.total / GIB
                row.measured_over_estimate = row.peak_gib / row.estimate_gib
                if attention == "dense":
                    row.vs_anchor_dense = row.tokens_per_s / ANCHOR_DENSE_TOKENS_PER_S[seq_len]
                row.final_loss = result.losses[-1]
                row.all_finite = all(math.isfinite(x) for x in result.losses)
            except Exception:
                row.error = error_text()
                print(row.error, file=sys.stderr, flush=True)
            save()


def run_precision(args, work: Path, rows: list, save) -> None:
    for precision, steps in (("bf16", args.precision_steps), ("fp16", args.fp16_steps or args.precision_steps)):
        row = PrecisionRow(precision, steps)
        rows.append(row)
        if over_budget(args, row):
            save()
            continue
        out_dir = work / f"prec-{precision}"
        try:
            fresh_gpu()
            # Count every non-finite step instead of aborting at the default 5 in a row.
            cfg = build_config({}, settings("nsa", 2048, 16, steps, out_dir, precision=precision,
                                            nonfinite_limit=steps + 1, lr=args.lr, warmup_steps=steps // 10))
            result = train(cfg, callback=Printer(f"nsa {precision}"))
            row.nonfinite_steps, row.final_loss, row.losses = result.nonfinite_steps, result.losses[-1], result.losses
        except Exception:
            row.error = error_text()
            print(row.error, file=sys.stderr, flush=True)
        # metrics.jsonl survives a failure part-way: count what the steps that ran recorded.
        metrics = read_metrics(out_dir) if (out_dir / "metrics.jsonl").exists() else []
        scales = [m["scale"] for m in metrics if m.get("scale") is not None]
        if scales:
            row.final_scale = scales[-1]
            row.scaler_skips = sum(b < a for a, b in zip(scales, scales[1:]))
        if metrics and row.nonfinite_steps is None:
            row.nonfinite_steps = sum(m["skipped"] for m in metrics)
        save()


def run_curve(args, work: Path, rows: list, save) -> None:
    for attention in args.attention:
        row = CurveRow(attention, args.curve_steps)
        rows.append(row)
        if over_budget(args, row):
            save()
            continue
        try:
            fresh_gpu()
            cfg = build_config({}, settings(attention, args.curve_seq_len, args.curve_batch, args.curve_steps,
                                            work / f"curve-{attention}", lr=args.lr, data=args.curve_data,
                                            warmup_steps=max(1, args.curve_steps // 10)))
            result = train(cfg, callback=Printer(f"curve {attention}", every=50))
            row.losses = result.losses
            row.final_loss_mean10 = sum(result.losses[-10:]) / len(result.losses[-10:])
            row.final_loss_mean50 = sum(result.losses[-50:]) / len(result.losses[-50:])
            row.tokens_per_s = result.tokens_per_s
        except Exception:
            row.error = error_text()
            print(row.error, file=sys.stderr, flush=True)
        save()
    plot_curves(rows, args)


def plot_curves(rows: list, args) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss-curve PNG", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for row in rows:
        if row.losses:
            ax.plot(range(1, len(row.losses) + 1), row.losses, alpha=0.3)
            ax.plot(range(1, len(row.losses) + 1), ema(row.losses, 0.9), label=f"{row.attention} (EMA 0.9)",
                    color=ax.lines[-1].get_color())
    ax.set_xlabel("step")
    synthetic = args.curve_data in ("kv", "copy")
    what = f"synthetic {args.curve_data}" if synthetic else f"text {Path(args.curve_data).name}, byte-level"
    ax.set_ylabel(f"loss (predictable tokens of the {args.curve_data} task)" if synthetic else "loss (nats per byte)")
    ax.set_title(f"seeds-125m, {what}, S={args.curve_seq_len}, B={args.curve_batch}: NSA vs dense")
    ax.legend()
    fig.savefig(Path(args.out) / "loss_curve.png", dpi=120, bbox_inches="tight")


def replot(args) -> None:
    """Curves from saved JSON: curve rows as they are, the bf16 precision row as NSA's curve."""
    rows = []
    for path in args.replot.split(","):
        record = json.loads(Path(path).read_text())
        for r in record["rows"]:
            if r.get("losses") and record["mode"] == "curve":
                rows.append(CurveRow(r["attention"], r["steps"], losses=r["losses"]))
            elif r.get("losses") and record["mode"] == "precision" and r["precision"] == "bf16":
                rows.append(CurveRow("nsa", r["steps"], losses=r["losses"]))
    if not rows:
        sys.exit(f"no loss curves in {args.replot}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    plot_curves(rows, args)
    for row in rows:
        tail = row.losses[-50:]
        print(f"{row.attention}: {row.steps} steps, mean loss of the last {len(tail)} steps {sum(tail) / len(tail):.4f}")


def ema(xs: list[float], beta: float) -> list[float]:
    out, acc = [], None
    for x in xs:
        acc = x if acc is None or not math.isfinite(acc) else beta * acc + (1 - beta) * x
        out.append(acc)
    return out


def over_budget(args, row) -> bool:
    if time.monotonic() - args.started > args.budget_s:
        row.error = f"skipped: time budget of {args.budget_s:g} s spent"
        return True
    return False


def header() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    props = torch.cuda.get_device_properties(0)
    return {"device": props.name, "memory_gib": props.total_memory / GIB, "versions": versions(),
            "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def markdown(rows: list) -> str:
    if not rows:
        return ""
    names = [f.name for f in dataclasses.fields(rows[0]) if f.name not in ("losses", "error")]
    lines = ["| " + " | ".join(names) + " | error |", "|" + "---|" * (len(names) + 1)]
    for row in rows:
        cells = [fmt(getattr(row, n)) for n in names]
        err = (row.error or "").strip().splitlines()
        lines.append("| " + " | ".join(cells) + f" | {err[-1][:80] if err else ''} |")
    return "\n".join(lines)


def fmt(x) -> str:
    if isinstance(x, float):
        return "" if math.isnan(x) else f"{x:,.3f}" if abs(x) < 100 else f"{x:,.0f}"
    return "" if x is None else str(x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("throughput", "precision", "curve", "all"), default="all")
    p.add_argument("--out", required=True, help="Folder for the JSON, Markdown and PNG (e.g. \"$OUT\").")
    p.add_argument("--attention", default="nsa,dense", type=lambda s: s.split(","))
    p.add_argument("--seq-lens", default="2048,8192,32768", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--warmup", type=int, default=3, help="Untimed steps (the first compiles).")
    p.add_argument("--timed", type=int, default=20)
    p.add_argument("--precision-steps", type=int, default=100, help="Steps of the bf16 run (and fp16's by default).")
    p.add_argument("--fp16-steps", type=int, default=None, help="Steps of the fp16 + GradScaler run.")
    p.add_argument("--curve-steps", type=int, default=300)
    p.add_argument("--curve-seq-len", type=int, default=2048)
    p.add_argument("--curve-batch", type=int, default=16)
    p.add_argument("--curve-data", default="kv", help=(
        "Data of the curves: a synthetic task (kv, copy) or any --data of nsa-flex train (a text file or "
        "folder, tokenised byte-level)."))
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--budget-s", type=float, default=540.0, help="Start no configuration after this many seconds.")
    p.add_argument("--replot", default=None, help=(
        "No training: plot the loss curves found in these comma-separated JSON files of earlier runs "
        "(curve rows, and the bf16 precision row as the NSA curve) into --out/loss_curve.png."))
    args = p.parse_args()
    args.started = time.monotonic()
    if args.replot:
        replot(args)
        return
    if not torch.cuda.is_available():
        sys.exit("bench/train_gpu.py needs a CUDA device")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = ("throughput", "precision", "curve") if args.mode == "all" else (args.mode,)
    work = Path(tempfile.mkdtemp(prefix="nsa-train-gpu-"))
    head = header()
    print(json.dumps(head), flush=True)
    for mode in modes:
        rows: list = []

        def save(mode=mode, rows=rows) -> None:
            record = {"header": head, "mode": mode, "args": {k: v for k, v in vars(args).items() if k != "started"},
                      "rows": [dataclasses.asdict(r) for r in rows]}
            (out / f"train_gpu_{mode}.json").write_text(json.dumps(record, indent=1))
            (out / f"train_gpu_{mode}.md").write_text(markdown(rows) + "\n")

        {"throughput": run_throughput, "precision": run_precision, "curve": run_curve}[mode](args, work, rows, save)
        save()
        print(f"\n## {mode}\n\n{markdown(rows)}\n", flush=True)


if __name__ == "__main__":
    main()
