"""Multi-GPU training: `nsa-flex train` under torchrun, DDP and FSDP2.

    python -m bench.train_multi_gpu --out "$OUT" --gpus 2

For each of: one process on one GPU, torchrun DDP on --gpus GPUs, torchrun FSDP2 on --gpus
GPUs, the same seeds-125m NSA run (impl flex, bf16, synthetic kv data, S=2048, B=16 per
rank, --steps steps) is started through the real command line (`python -m nsa_flex_cli.main
train`), each in its own output folder with metrics.jsonl, under a time limit. Recorded per
run: exit status, median tokens/s after the first --skip steps (all ranks together), tokens/s
per GPU, the first step's time (compile), rank 0's peak memory, the first losses, and whether
every loss was finite. The JSON is rewritten after every run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from nsa_flex.training.metrics import read_metrics
from bench.common import run_limited

ROOT = Path(__file__).resolve().parents[1]


def train_args(out_dir: Path, parallel: str, args) -> list[str]:
    return ["-m", "nsa_flex_cli.main", "train", "--preset", args.preset, "--attention", "nsa", "--impl", args.impl,
            "--data", "kv", "--seq-len", str(args.seq_len), "--batch-size", str(args.batch), "--steps", str(args.steps),
            "--warmup-steps", "10", "--precision", args.precision, "--compile", args.compile, "--parallel", parallel,
            "--out-dir", str(out_dir), "--no-save-checkpoints", "--log-every", "10", "--no-tensorboard"]


def run(name: str, gpus: int, parallel: str, args) -> dict:
    out_dir = Path(args.work) / name
    if gpus == 1:
        cmd = [sys.executable, *train_args(out_dir, parallel, args)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
               *train_args(out_dir, parallel, args)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(gpus))}
    t0 = time.monotonic()
    status, log = run_limited(cmd, args.limit_s, cwd=str(ROOT), env=env)
    row = {"name": name, "gpus": gpus, "parallel": parallel, "status": status,
           "wall_s": round(time.monotonic() - t0, 1), "command": " ".join(cmd[1:])}
    metrics = read_metrics(out_dir) if (out_dir / "metrics.jsonl").exists() else []
    if metrics:
        later = sorted(m["tokens_per_s"] for m in metrics[args.skip:]) or [math.nan]
        tok_s = later[len(later) // 2]
        row.update(steps_done=len(metrics), tokens_per_s=tok_s, tokens_per_s_per_gpu=tok_s / gpus,
                   first_step_s=metrics[0]["step_time_s"], peak_gib_rank0=max(m["memory_gib"] for m in metrics),
                   all_finite=all(math.isfinite(m["loss"]) for m in metrics),
                   skipped_steps=sum(bool(m.get("skipped")) for m in metrics),
                   losses_first10=[round(m["loss"], 4) for m in metrics[:10]], final_loss=metrics[-1]["loss"])
    row["log_tail"] = log
    print(json.dumps({k: v for k, v in row.items() if k != "log_tail"}), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip", type=int, default=5, help="Steps left out of the tokens/s median (compile, warm-up).")
    p.add_argument("--runs", default="single,ddp,fsdp")
    p.add_argument("--limit-s", type=float, default=180)
    p.add_argument("--work", default="/tmp/nsa-multi-gpu")
    # The defaults are the GPU evidence run; a CPU smoke run: --preset tiny --impl reference
    # --precision fp32 --compile off --seq-len 128 --batch 2 (DDP/FSDP over gloo).
    p.add_argument("--preset", default="seeds-125m")
    p.add_argument("--impl", default="flex")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--compile", default="on")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16, help="Sequences per rank.")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    plans = {"single": ("single-gpu", 1, "none"), "ddp": (f"ddp-{args.gpus}gpu", args.gpus, "ddp"),
             "fsdp": (f"fsdp2-{args.gpus}gpu", args.gpus, "fsdp")}
    rows = []
    for key in args.runs.split(","):
        rows.append(run(*plans[key], args))
        (args.out / "train_multi_gpu.json").write_text(json.dumps(rows, indent=1))
    single = next((r for r in rows if r["gpus"] == 1 and "tokens_per_s" in r), None)
    print("\n| run | GPUs | status | tokens/s | per GPU | scaling | first step s | peak GiB r0 | finite |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        tok = r.get("tokens_per_s", math.nan)
        scaling = tok / (single["tokens_per_s"] * r["gpus"]) if single else math.nan
        print(f"| {r['name']} | {r['gpus']} | {r['status']} | {tok:,.0f} | {tok / r['gpus']:,.0f} | {scaling:.2f} | "
              f"{r.get('first_step_s', math.nan):.1f} | {r.get('peak_gib_rank0', math.nan):.1f} | "
              f"{r.get('all_finite')} |")


if __name__ == "__main__":
    main()
