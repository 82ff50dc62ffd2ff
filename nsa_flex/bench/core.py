"""What every benchmark suite shares: the row, the report header, timing and the suite registry.

A suite (attention now; decode and model later) is a function config -> list[Row] plus a
frozen config dataclass. Adding one is: write the function, register it with
`register_suite`, add one CLI command that builds its config and calls `run_suite`. The
writers (JSON, Markdown, PNG) work on any suite's rows.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

SCHEMA = "nsa-flex-bench/1"
STATUSES = ("ok", "error", "skipped")

Progress = Callable[[int, int, str], None]
"""progress(done, total, description): called before each step of a sweep."""


@dataclass(kw_only=True)
class Row:
    """One measured (or failed) configuration: an implementation, a mode and a length."""

    suite: str
    impl: str
    mode: str
    T: int
    status: str = "ok"
    """ok, error (the error field says why) or skipped (the note says why)."""
    median_ms: float | None = None
    min_ms: float | None = None
    first_call_ms: float | None = None
    """The first call alone: compilation, autotuning and plan creation included."""
    iters: int = 0
    flops: float | None = None
    """Credited flops of one step (see flops.py), None where no formula applies."""
    tflops: float | None = None
    peak_mem_mib: float | None = None
    """Peak allocated device memory during this row's calls, inputs included (CUDA only)."""
    speedup: float | None = None
    """Baseline median / this median, same T and mode; filled by `add_speedups`."""
    check: str = ""
    """What the correctness check compared and its outcome."""
    check_err: float | None = None
    note: str = ""
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    """Suite-specific values (decode: batch and context; model: tokens/s, ...)."""


@dataclass(frozen=True)
class Timing:
    first_ms: float
    times_ms: tuple[float, ...]
    peak_mem_mib: float | None

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    run: Callable[..., list[Row]]
    """run(config, progress=None) -> rows."""
    baseline_order: tuple[str, ...] = ()
    """Impls the speedup column divides by: the first one with measured rows."""


SUITES: dict[str, Suite] = {}


def register_suite(suite: Suite) -> Suite:
    if suite.name in SUITES:
        raise ValueError(f"suite {suite.name!r} is already registered")
    SUITES[suite.name] = suite
    return suite


def run_suite(name: str, config, progress: Progress | None = None,
              on_rows: Callable[[list[Row]], None] | None = None) -> list[Row]:
    """Runs a suite; on_rows(rows so far) after each finished group, so a caller can save a partial report."""
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; allowed: {', '.join(SUITES)}")
    if on_rows is None:
        return SUITES[name].run(config, progress=progress)
    return SUITES[name].run(config, progress=progress, on_rows=on_rows)


def pick_baseline(rows: list[Row], order: tuple[str, ...]) -> str | None:
    measured = {r.impl for r in rows if r.status == "ok"}
    return next((name for name in order if name in measured), None)


BACK_TO_BACK = "back_to_back_ms"
"""Row.extra key: mean ms per call of calls issued back to back (time_back_to_back)."""


def add_speedups(rows: list[Row], order: tuple[str, ...]) -> str | None:
    """Fill each row's speedup against the baseline's row of the same T and mode, and, where both
    rows were also timed back to back, extra["speedup_back_to_back"] likewise."""
    base = pick_baseline(rows, order)
    ref = {(r.T, r.mode): r for r in rows if r.impl == base and r.status == "ok"}
    for r in rows:
        b = ref.get((r.T, r.mode))
        if r.status != "ok" or b is None:
            continue
        r.speedup = b.median_ms / r.median_ms
        if BACK_TO_BACK in r.extra and BACK_TO_BACK in b.extra:
            r.extra["speedup_back_to_back"] = b.extra[BACK_TO_BACK] / r.extra[BACK_TO_BACK]
    return base


def time_calls(step: Callable[[], object], *, device: str, warmup: int, iters: int) -> Timing:
    """First call timed alone, then `warmup` untimed calls, then `iters` calls timed each.

    CUDA: events around each call (device time, launch gaps included), peak memory from
    the allocator. CPU: the host clock.
    """
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    first = _timed(step, cuda)
    for _ in range(warmup):
        step()
    times = tuple(_timed(step, cuda) for _ in range(iters))
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    return Timing(first, times, peak)


def time_back_to_back(step: Callable[[], object], *, device: str, iters: int) -> float:
    """Mean ms per call of `iters` calls issued back to back, one sync at the end.

    The host runs ahead as it does in a training loop, so a call's host time before its first
    kernel overlaps the previous call's GPU work; time_calls' synced calls count it in full.
    CUDA: events around the loop; CPU: the host clock.
    """
    if device != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            step()
        return (time.perf_counter() - start) * 1e3 / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _timed(step: Callable[[], object], cuda: bool) -> float:
    if not cuda:
        start = time.perf_counter()
        step()
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def describe_error(exc: BaseException, limit: int = 500) -> str:
    """The exception's type, the first and the last lines of its message, for a row's error field.

    Compiler errors wrap the cause in a long traceback: its last line usually names it.
    """
    lines = [s.strip() for s in str(exc).strip().splitlines() if s.strip()]
    kept = lines if len(lines) <= 4 else [*lines[:2], "...", *lines[-2:]]
    text = f"{type(exc).__name__}: {' | '.join(kept)}"
    return text if len(text) <= limit else text[: limit // 2 - 2] + " ... " + text[-(limit // 2 - 3):]


def free_memory(device: str) -> None:
    """After a failed row (OOM above all): drop the garbage so the next row starts clean."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def environment(device: str) -> dict[str, Any]:
    """Device name and versions for a report header."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "platform": platform.platform(),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env["device"] = props.name
        env["device_memory_gib"] = round(props.total_memory / 2**30, 1)
        env["sm"] = f"{props.major}{props.minor}"
    else:
        env["device"] = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    return env


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def git_commit(repo: Path | None = None) -> str:
    """HEAD of the checkout holding this package, '+dirty' when it has changes; 'unknown' without git."""
    repo = repo or Path(__file__).resolve().parents[2]
    try:
        head = _git(repo, "rev-parse", "HEAD")
        dirty = _git(repo, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def _git(repo: Path, *args: str) -> str:
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True, timeout=10)
    return out.stdout.strip()


def make_header(suite: str, config, *, device: str, commit: str | None = None,
                notes: list[str] | None = None) -> dict[str, Any]:
    """The report header: suite, date, commit, command line, environment and the full config."""
    return {
        "suite": suite,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit or git_commit(),
        "command": " ".join(sys.argv),
        **environment(device),
        "config": to_jsonable(config),
        "notes": list(notes or []),
    }


def to_jsonable(value):
    """Dataclasses to dicts, tuples to lists, everything else as is (recursively)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    return value
