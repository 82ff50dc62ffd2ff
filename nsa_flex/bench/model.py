"""The model suite: whole-model training steps of the NSA LM against the same LM with dense attention.

For each attention (nsa, dense) and each (T, B): a fresh model from the preset, trained for
`warmup + steps` steps by `nsa_flex.training.train.train` itself (the step `nsa-flex train` runs: forward
under autocast, fp32 loss, backward, clip, fused AdamW, schedule; CUDA: each block compiled),
on the synthetic kv task. The first step (compilation) is reported apart; rows give the median
of the timed steps, tokens/s from it, the peak allocated CUDA memory next to
`nsa_flex.training.memory.estimate`, and the speedup of NSA over dense at the same (T, B). A
configuration that fails (OOM above all) becomes an error row and the sweep goes on.
"""

from __future__ import annotations

import math
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from nsa_flex.bench.core import Progress, Row, Suite, add_speedups, describe_error, free_memory, register_suite
from nsa_flex.training.memory import estimate
from nsa_flex.model import ATTENTIONS, MODEL_PRESETS
from nsa_flex.training.train import train
from nsa_flex.training.config import build_config, plan

DEVICES = ("cuda", "cpu")
DTYPES = ("bf16", "fp16", "fp32")
BASELINE_ORDER = ("dense",)
MIB = 2**20

CUDA_SHAPES = ((2048, 16), (8192, 4), (32768, 1))
"""(T, B) of issue 4 on CUDA: 32k tokens per step at every length (bench/train_gpu.py uses them too)."""
ANCHOR_DENSE_TOKENS_PER_S = {2048: 567_624, 8192: 368_427, 32768: 158_170}
"""docs/results.md, "Reference figures": tokens/s of a compiled dense 123M GPT on one H200."""
TOKENS_PER_STEP = {"cuda": 32768, "cpu": 1024}
"""Default B for a T without one: max(1, these tokens // T)."""


@dataclass(frozen=True, kw_only=True)
class ModelBenchConfig:
    """Everything one model sweep depends on; written whole into the JSON header."""

    device: str
    preset: str
    shapes: tuple[tuple[int, int], ...]
    """(T, B) pairs: sequence length and sequences per step."""
    attentions: tuple[str, ...] = ATTENTIONS
    dtype: str = "bf16"
    """Autocast precision of the steps (fp32: none; fp16 adds a GradScaler)."""
    warmup: int = 3
    """Untimed steps, the first (compilation) included; its time is reported apart."""
    steps: int = 10
    """Timed steps; rows report their median."""
    compile: bool = True
    """Compile each block (fullgraph) and the loss, as `nsa-flex train` does on CUDA."""
    seed: int = 0

    def __post_init__(self) -> None:
        _one_of("device", self.device, DEVICES)
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("preset", self.preset, MODEL_PRESETS)
        if not self.attentions:
            raise ValueError("attentions is empty; allowed: " + ", ".join(ATTENTIONS))
        for name in self.attentions:
            _one_of("attention", name, ATTENTIONS)
        if not self.shapes or min(v for shape in self.shapes for v in shape) < 1:
            raise ValueError(f"shapes {self.shapes}: need at least one (T, B), all positive")
        if min(T for T, _ in self.shapes) < 8:
            raise ValueError("T < 8: the synthetic kv task needs at least 8 tokens per sequence")
        if self.warmup < 1:
            raise ValueError(f"warmup={self.warmup}: must be >= 1 (the first step compiles and is not timed)")
        if self.steps < 1:
            raise ValueError(f"steps={self.steps}: must be >= 1")


def _one_of(what: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; allowed: {', '.join(allowed)}")


def model_config(*, device: str | None = None, seq_lens: tuple[int, ...] | None = None,
                 batches: tuple[int, ...] | None = None, **settings) -> ModelBenchConfig:
    """Defaults for the device with the given settings (None keeps a default).

    CUDA: seeds-125m, bf16, compiled, (T, B) = CUDA_SHAPES, 3 warm-up + 10 timed steps.
    CPU: tiny, fp32, eager, T = 128, 256 (B = 8, 4), 2 warm-up + 3 timed steps.
    `batches`: one B per T, or one B for all; without it a T of CUDA_SHAPES keeps its B and
    any other gets max(1, TOKENS_PER_STEP // T).
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    _one_of("device", device, DEVICES)
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch sees no CUDA device; allowed here: cpu")
    cuda = device == "cuda"
    seq_lens = seq_lens or (tuple(T for T, _ in CUDA_SHAPES) if cuda else (128, 256))
    defaults = dict(preset="seeds-125m" if cuda else "tiny", dtype="bf16" if cuda else "fp32",
                    warmup=3 if cuda else 2, steps=10 if cuda else 3, compile=cuda)
    chosen = defaults | {k: v for k, v in settings.items() if v is not None}
    return ModelBenchConfig(device=device, shapes=_shapes(device, seq_lens, batches), **chosen)


def _shapes(device: str, seq_lens: tuple[int, ...], batches: tuple[int, ...] | None) -> tuple[tuple[int, int], ...]:
    if batches is None:
        known = dict(CUDA_SHAPES) if device == "cuda" else {}
        return tuple((T, known.get(T, max(1, TOKENS_PER_STEP[device] // T))) for T in seq_lens)
    if len(batches) == 1:
        batches = batches * len(seq_lens)
    if len(batches) != len(seq_lens):
        raise ValueError(f"batches {list(batches)}: give one B per sequence length {list(seq_lens)}, or one for all")
    return tuple(zip(seq_lens, batches))


def model_summary(cfg: ModelBenchConfig) -> str:
    m = MODEL_PRESETS[cfg.preset]
    n = m.nsa
    T, B = cfg.shapes[0]
    run = plan(build_config({}, train_settings(cfg.preset, "nsa", T, B, 1, Path("."), device=cfg.device,
                                               compile=cfg.compile)), world_size=1)
    blocks = "eager" if not run.compile else "compiled blocks as CUDA graphs" if run.cuda_graphs else "compiled blocks"
    return (f"training steps of the {cfg.preset} LM ({m.n_layers} layers, dim {m.dim}, Hq={n.n_heads} "
            f"Hkv={n.n_kv_heads} D={n.head_dim}, V={m.vocab_size}), {cfg.dtype}, {blocks}; NSA l={n.cmp_block} "
            f"d={n.cmp_stride} l'={n.sel_block} n={n.n_selected} w={n.window} vs dense SDPA")


def model_notes(cfg: ModelBenchConfig) -> list[str]:
    notes = [
        "mode B=b: b sequences of T tokens per step. One step = nsa_flex.training.train's step: batch from the synthetic "
        "kv task, forward under autocast, fp32 cross-entropy, backward, grad clip, AdamW (fused on CUDA), LR "
        "schedule; one host sync per step.",
        f"median ms: host time of one step (with the update queued on the GPU, from the previous step's readback to "
        f"its own), median of {cfg.steps} timed steps after {cfg.warmup} warm-up steps; "
        "first call ms: the first step alone (compilation included).",
        "note: tokens/s = B*T / median step; est = nsa_flex.training.memory.estimate of the peak (params, grads, AdamW, "
        "activations, masks, logits); extra.peak_over_estimate = measured / estimate.",
        "speedup: dense median / nsa median at the same T and B, i.e. the ratio of tokens/s.",
        "check: every loss of the run was finite.",
    ]
    if cfg.device == "cuda":
        notes.append("peak MiB: torch.cuda.max_memory_allocated over the whole run (model, optimizer, steps). "
                     "extra.vs_anchor_dense: dense tokens/s / the reference dense 123M GPT on one H200 (docs/results.md).")
    else:
        notes.append("CPU run: NSA runs the reference implementation; a functional smoke test whose times are no "
                     "performance figure and no peak memory is measured. GPU figures need CUDA.")
    return notes


def run_model(cfg: ModelBenchConfig, progress: Progress | None = None) -> list[Row]:
    """The sweep: for each (T, B), each attention; failures become error rows."""
    total = len(cfg.shapes) * len(cfg.attentions)
    rows: list[Row] = []
    done = 0
    for T, B in cfg.shapes:
        for attention in cfg.attentions:
            if progress is not None:
                progress(done, total, f"{attention} T={T} B={B}")
            rows.append(measure(cfg, attention, T, B))
            done += 1
    if progress is not None:
        progress(done, total, "done")
    add_speedups(rows, BASELINE_ORDER)
    return rows


def measure(cfg: ModelBenchConfig, attention: str, T: int, B: int) -> Row:
    """One configuration's row (an error row when anything fails)."""
    base = dict(suite="model", impl=attention, mode=f"B={B}", T=T)
    extra: dict = {"batch": B, "seq_len": T, "tokens_per_step": B * T}
    cuda = cfg.device == "cuda"
    try:
        with tempfile.TemporaryDirectory(prefix="nsa-bench-model-") as work:
            train_cfg = build_config({}, train_settings(cfg.preset, attention, T, B, cfg.warmup + cfg.steps,
                                                        Path(work), device=cfg.device, precision=cfg.dtype,
                                                        compile=cfg.compile, seed=cfg.seed))
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            result = train(train_cfg, callback=_Quiet())
        peak = torch.cuda.max_memory_allocated() / MIB if cuda else None
    except Exception as exc:
        return Row(**base, status="error", error=describe_error(exc), extra=extra)
    finally:
        torch._dynamo.reset()
        free_memory(cfg.device)
    timed_ms = [s * 1e3 for s in result.step_times_s[cfg.warmup:]]
    median_ms = statistics.median(timed_ms)
    tokens_per_s = B * T / (median_ms / 1e3)
    impl = train_cfg.model.resolve(cfg.device).impl
    est_mib = estimate(train_cfg.model, batch_size=B, seq_len=T, precision=cfg.dtype, compiled=cfg.compile,
                       impl=impl).total / MIB
    extra.update(tokens_per_s=tokens_per_s, estimate_mib=est_mib, final_loss=result.losses[-1],
                 nsa_impl=impl if attention == "nsa" else None, step_ms=timed_ms)
    if peak is not None:
        extra["peak_over_estimate"] = peak / est_mib
    if cuda and attention == "dense" and T in ANCHOR_DENSE_TOKENS_PER_S:
        extra["vs_anchor_dense"] = tokens_per_s / ANCHOR_DENSE_TOKENS_PER_S[T]
    finite = all(math.isfinite(x) for x in result.losses)
    check = (f"ok: all {len(result.losses)} losses finite (last {result.losses[-1]:.3f})" if finite
             else f"FAILED: {sum(not math.isfinite(x) for x in result.losses)} non-finite losses")
    note = f"{tokens_per_s:,.0f} tok/s; est {est_mib:,.0f} MiB" + (f"; nsa impl {impl}" if attention == "nsa" else "")
    return Row(**base, median_ms=median_ms, min_ms=min(timed_ms), first_call_ms=result.step_times_s[0] * 1e3,
               iters=len(timed_ms), peak_mem_mib=peak, check=check, note=note, extra=extra)


def train_settings(preset: str, attention: str, T: int, B: int, steps: int, out_dir: Path, **extra) -> dict:
    """Flags for build_config of a benchmark run: synthetic kv data, no checkpoints, logs or resume;
    model.max_seq_len raised to T where the preset's is shorter. `extra` overrides (device, precision, ...)."""
    model = {"attention": attention, "max_seq_len": max(MODEL_PRESETS[preset].max_seq_len, T)}
    return {"preset": preset, "model": model, "seq_len": T, "batch_size": B, "steps": steps, "data": "kv",
            "out_dir": str(out_dir), "resume": "none", "save_checkpoints": False, "tensorboard": False,
            "first_step_timeout": 1800.0, **extra}


class _Quiet:
    """A train() callback that says nothing (the suite reports per row)."""

    def on_start(self, info): ...
    def on_step(self, metrics): ...
    def on_message(self, text): ...
    def on_end(self, summary): ...


SUITE = register_suite(Suite("model", "whole-model training steps of the NSA LM against the same LM with dense "
                                      "attention", run_model, BASELINE_ORDER))
