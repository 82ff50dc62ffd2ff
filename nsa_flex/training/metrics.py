"""What a run reports: versions, per-step metrics (JSONL, TensorBoard), and a callback for a UI.

The library prints nothing itself: it hands events to a `TrainCallback` (the CLI draws a
progress bar with rich; `LoggingCallback` sends them to the `logging` module). Only rank 0
reports.
"""

from __future__ import annotations

import json
import logging
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Protocol

import torch

log = logging.getLogger("nsa_flex.training.train")


class TrainCallback(Protocol):
    def on_start(self, info: dict) -> None:
        """Once, before building anything heavy: config, versions, world, device."""

    def on_step(self, metrics: dict) -> None:
        """After every step: step, loss, lr, grad_norm, tokens_per_s, memory_gib, skipped, ..."""

    def on_message(self, text: str) -> None:
        """A one-off notice (resuming, checkpoint saved, tensorboard missing, ...)."""

    def on_end(self, summary: dict) -> None:
        """Once, after the last step."""


class LoggingCallback:
    """Reports through `logging` (a line every `log_every` steps)."""

    def __init__(self, log_every: int = 10):
        self.log_every = log_every

    def on_start(self, info: dict) -> None:
        log.info("nsa-flex train: %s", json.dumps(info, default=str))

    def on_step(self, m: dict) -> None:
        if m["step"] % self.log_every == 0 or m["step"] == m["total_steps"]:
            log.info(format_step(m))

    def on_message(self, text: str) -> None:
        log.info(text)

    def on_end(self, summary: dict) -> None:
        log.info("done: %s", json.dumps(summary, default=str))


class RunLog:
    """Passes every event on to `inner` and keeps the run folder readable (rank 0 only):
    config.json (this call's config, versions and plan) and train.log (appended, timestamped:
    the start, notices, a line every `log_every` steps and the last, the end)."""

    def __init__(self, out_dir: Path, inner: TrainCallback, log_every: int):
        self.out_dir, self.inner, self.log_every = out_dir, inner, log_every
        self._log = open(out_dir / "train.log", "a")

    def _write(self, text: str) -> None:
        self._log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")
        self._log.flush()

    def on_start(self, info: dict) -> None:
        (self.out_dir / "config.json").write_text(json.dumps(info, indent=1, default=str) + "\n")
        self._write("start: " + json.dumps(info, default=str))
        self.inner.on_start(info)

    def on_step(self, m: dict) -> None:
        if m["step"] % self.log_every == 0 or m["step"] == m["total_steps"] or m["skipped"]:
            self._write(format_step(m))
        self.inner.on_step(m)

    def on_message(self, text: str) -> None:
        self._write(text)
        self.inner.on_message(text)

    def on_end(self, summary: dict) -> None:
        self._write("done: " + json.dumps(summary, default=str))
        self.inner.on_end(summary)

    def close(self) -> None:
        self._log.close()


def format_step(m: dict) -> str:
    """One human line for a step's metrics."""
    flag = "  SKIPPED (non-finite)" if m["skipped"] else ""
    return (f"step {m['step']:>6}/{m['total_steps']}  loss {m['loss']:.4f}  lr {m['lr']:.2e}  "
            f"{m['tokens_per_s']:,.0f} tok/s  mem {m['memory_gib']:.2f} GiB{flag}")


def versions() -> dict:
    """Versions and the device, as printed at the start of every run."""
    import nsa_flex

    out = {"nsa_flex": nsa_flex.__version__, "python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    if torch.cuda.is_available():
        out["cuda"] = torch.version.cuda
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def memory_gib(device: torch.device) -> float:
    """Peak memory so far: CUDA max allocated, or the process's peak RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in KiB on Linux and bytes on macOS.
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


class MetricsWriter:
    """metrics.jsonl (one JSON object per step, appended) and TensorBoard if installed."""

    def __init__(self, out_dir: Path, *, tensorboard: bool, notify):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "metrics.jsonl"
        self._file = open(self.path, "a")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(out_dir / "tensorboard"))
            except ImportError:
                notify("tensorboard is not installed: metrics go to metrics.jsonl only "
                       "(pip install tensorboard to get TensorBoard events)")

    def write(self, metrics: dict) -> None:
        self._file.write(json.dumps(metrics) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s", "memory_gib"):
                if metrics.get(key) is not None:
                    self._tb.add_scalar(f"train/{key}", metrics[key], metrics["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(out_dir: str | Path) -> list[dict]:
    """The steps recorded in out_dir/metrics.jsonl (the last record of a step wins)."""
    by_step = {}
    for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            m = json.loads(line)
            by_step[m["step"]] = m
    return [by_step[s] for s in sorted(by_step)]
