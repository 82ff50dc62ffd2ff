"""The attention suite: op-level time, TFLOP/s and peak memory of NSA and its baselines over T.

For every implementation: one correctness check at a small length, then for each T one
set of fresh inputs and, for each mode, a timed run. Any failure (OOM, unsupported shape,
missing kernel) becomes an error row and the sweep goes on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from nsa_flex.bench.core import (
    BACK_TO_BACK,
    Progress,
    Row,
    Suite,
    add_speedups,
    describe_error,
    free_memory,
    register_suite,
    time_back_to_back,
    time_calls,
)
from nsa_flex.bench.flops import BWD_FACTOR, MODES, mode_flops
from nsa_flex.bench.impls import DTYPES, OWN_IMPLS, Built, Impl, Problem
from nsa_flex.bench.peers import PEER_IMPLS
from nsa_flex.config import PRESETS, NSAConfig

IMPLS: dict[str, Impl] = {impl.name: impl for impl in (*OWN_IMPLS, *PEER_IMPLS)}
BASELINE_ORDER = ("dense-cudnn", "dense-flash", "dense", "flex-dense")
DEVICES = ("cuda", "cpu")
MAX_T = 1 << 20
# The reference and dense math hold [B, H, T, T] fp32 scores: beyond this a CPU run swaps.
MAX_T_CPU = 16384

INPUTS = (
    "op level: q, k, v ~ N(0, 1); k_cmp, v_cmp ~ N(0, 1) with Tc = (T - l)//d + 1 tokens, i.e. "
    "attention given compressed tokens (phi is timed only in nsa-flex-module); gates = sigmoid(N(0, 1)). "
    "fwd runs under torch.no_grad; fwd+bwd backpropagates a fixed random output gradient to every input."
)


@dataclass(frozen=True)
class Defaults:
    preset: str
    seq_lens: tuple[int, ...]
    impls: tuple[str, ...]
    dtype: str
    warmup: int
    iters: int
    check_seq_len: int
    compile: bool


DEFAULTS = {
    # Check at 2048 > n * l' = 1024, so the selection really selects. nsa-flex runs as
    # nsa_attention does by default: on CUDA one compiled graph per shape (nsa_flex.flex.compiled);
    # nsa-flex-eager is the same op with its glue eager, --compile puts it inside the caller's
    # torch.compile(fullgraph=True).
    "cuda": Defaults("bench", (8192, 16384, 32768, 65536),
                     ("nsa-flex", "dense-cudnn", "dense-flash", "flex-dense", "fla", "lucidrains"),
                     "bf16", 3, 10, 2048, False),
    # CPU flex runs eagerly by design (nsa_flex.flex): nothing to compile there.
    "cpu": Defaults("tiny", (256, 512), ("reference", "nsa-flex", "dense"), "fp32", 1, 3, 256, False),
}


@dataclass(frozen=True, kw_only=True)
class AttentionBenchConfig:
    """Everything one attention sweep depends on; written whole into the JSON header."""

    device: str
    preset: str
    """The NSAConfig preset the shapes and sparsity started from (flags may override fields)."""
    nsa: NSAConfig
    seq_lens: tuple[int, ...]
    impls: tuple[str, ...]
    modes: tuple[str, ...] = MODES
    batch: int = 1
    dtype: str = "bf16"
    warmup: int = 3
    """Untimed calls after the first (which is timed alone: compile time)."""
    iters: int = 10
    """Timed calls; rows report their median."""
    check_seq_len: int = 2048
    """T of the correctness check before timing; 0 skips it."""
    module_dim: int = 1024
    """Model width of the module rows (nsa-flex-module, lucidrains)."""
    compile: bool = False
    """nsa-flex runs inside the caller's torch.compile(fullgraph=True); off: as nsa_attention runs by
    default (on CUDA its own compiled graph per shape)."""
    seed: int = 0
    left_out: tuple[str, ...] = ()
    """Optional peers of the default list that were left out, with why."""
    inputs: str = INPUTS

    def __post_init__(self) -> None:
        _one_of("device", self.device, DEVICES)
        _one_of("dtype", self.dtype, DTYPES)
        _all_of("impl", self.impls, IMPLS)
        _all_of("mode", self.modes, MODES)
        for name in ("batch", "iters", "module_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        for name in ("warmup", "check_seq_len"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")
        if not self.seq_lens:
            raise ValueError("seq_lens is empty; give at least one sequence length")
        cpu = self.device == "cpu"
        limit = MAX_T_CPU if cpu else MAX_T
        where = " on CPU (the reference and dense math are O(T^2) in memory; larger T needs CUDA)" if cpu else ""
        for T in (*self.seq_lens, self.check_seq_len or 1):
            if not 1 <= T <= limit:
                raise ValueError(f"T={T} not supported{where}; allowed: 1 <= T <= {limit}")


def _one_of(what: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; allowed: {', '.join(allowed)}")


def _all_of(what: str, values: tuple[str, ...], allowed) -> None:
    if not values:
        raise ValueError(f"no {what} given; allowed: {', '.join(allowed)}")
    for value in values:
        _one_of(what, value, allowed)
    if len(set(values)) != len(values):
        raise ValueError(f"{what}s repeat: {', '.join(values)}")


def attention_config(*, device: str | None = None, preset: str | None = None,
                     nsa_overrides: dict | None = None, **settings) -> AttentionBenchConfig:
    """A config from the device's defaults (CUDA if present, else a tiny CPU sweep) and overrides.

    nsa_overrides replaces NSAConfig fields of the preset (n_heads, head_dim, window, ...);
    settings are AttentionBenchConfig fields (seq_lens, impls, modes, dtype, iters, ...); a
    value of None keeps the default. Raises ValueError saying what is allowed on any bad value.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    _one_of("device", device, DEVICES)
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch sees no CUDA device; allowed here: cpu")
    defaults = dataclasses.asdict(DEFAULTS[device])
    preset = preset or DEFAULTS[device].preset
    _one_of("preset", preset, PRESETS)
    fields = {f.name for f in dataclasses.fields(AttentionBenchConfig)} - {"device", "preset", "nsa", "left_out"}
    for name in settings:
        _one_of("setting", name, sorted(fields))
    nsa_fields = {f.name for f in dataclasses.fields(NSAConfig)}
    overrides = {k: v for k, v in (nsa_overrides or {}).items() if v is not None}
    for name in overrides:
        _one_of("NSAConfig field", name, sorted(nsa_fields))
    chosen = {k: v for k, v in settings.items() if v is not None}
    cfg = AttentionBenchConfig(device=device, preset=preset, nsa=PRESETS[preset].replace(**overrides),
                               **{k: v for k, v in defaults.items() if k in fields} | chosen)
    if "impls" in chosen:
        return cfg
    # Peers are optional extras: a default sweep leaves out the ones that cannot run here.
    left_out = {n: IMPLS[n].unavailable(cfg) for n in cfg.impls if IMPLS[n].optional}
    left_out = {n: why for n, why in left_out.items() if why}
    return dataclasses.replace(cfg, impls=tuple(n for n in cfg.impls if n not in left_out),
                               left_out=tuple(f"{n}: {why}" for n, why in left_out.items()))


def attention_notes(cfg: AttentionBenchConfig) -> list[str]:
    notes = [
        cfg.inputs,
        f"flops: attention matmuls only, 2 flops per MAC; dense causal fwd = 2*B*Hq*(T^2/2)*(Dk+Dv); "
        f"NSA effective fwd counts each branch's keys exactly; bwd = {BWD_FACTOR} x fwd (convention).",
        "first call ms: the first call alone (compile, autotune, plan creation); median ms: of the timed calls, "
        "each alone and synced, so it holds the host time before the call's first kernel; back-to-back ms: "
        "the mean of as many calls issued back to back, one sync at the end (the host runs ahead, as in a "
        "training loop); speedups of each against the baseline's.",
    ]
    notes += [f"left out (optional peer): {why}" for why in cfg.left_out]
    if cfg.device == "cpu":
        notes.append("CPU run: a functional smoke test with a tiny config, not a performance figure; "
                     "GPU figures need CUDA. FlexAttention has no backward on CPU, so flex rows are fwd only.")
    return notes


def attention_summary(cfg: AttentionBenchConfig) -> str:
    n = cfg.nsa
    return (f"B={cfg.batch} Hq={n.n_heads} Hkv={n.n_kv_heads} Dk={n.head_dim} Dv={n.dv} {cfg.dtype}; "
            f"NSA l={n.cmp_block} d={n.cmp_stride} l'={n.sel_block} n={n.n_selected} w={n.window} "
            f"(preset {cfg.preset})")


def run_attention(cfg: AttentionBenchConfig, progress: Progress | None = None,
                  on_rows: Callable[[list[Row]], None] | None = None) -> list[Row]:
    """The sweep: rows for every impl x T x mode, speedups against the first dense baseline.

    on_rows(rows so far) runs after each T of each impl (a cut-off run keeps what it measured).
    """
    _allow_recompiles()
    tick = _ticker(progress, len(cfg.impls) * (1 + len(cfg.seq_lens) * len(cfg.modes)))
    rows: list[Row] = []
    for name in cfg.impls:
        for group in _run_impl(IMPLS[name], cfg, tick):
            rows.extend(group)
            if on_rows is not None:
                add_speedups(rows, BASELINE_ORDER)
                on_rows(list(rows))
    tick("done", 0)
    add_speedups(rows, BASELINE_ORDER)
    return rows


def _allow_recompiles() -> None:
    # Each T and each mode compiles flex_attention anew; past dynamo's default limit (8) the
    # next one would silently run eager flex: dense math, O(T^2) memory, meaningless times.
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), 64))


def _ticker(progress: Progress | None, total: int) -> Callable[[str, int], None]:
    done = 0

    def tick(description: str, steps: int = 1) -> None:
        nonlocal done
        if progress is not None:
            progress(done, total, description)
        done += steps

    return tick


def _run_impl(impl: Impl, cfg: AttentionBenchConfig, tick) -> Iterator[list[Row]]:
    """The impl's rows, one list per T (after its check at the check length)."""
    reason = impl.unavailable(cfg)
    if reason:
        tick(f"{impl.name}: skipped", 1 + len(cfg.seq_lens) * len(cfg.modes))
        yield [Row(suite="attention", impl=impl.name, mode=m, T=T, status="skipped", note=reason)
               for T in cfg.seq_lens for m in cfg.modes]
        return
    tick(f"{impl.name}: check at T={cfg.check_seq_len}")
    check = _run_check(impl, cfg)
    for T in cfg.seq_lens:
        yield _run_length(impl, cfg, T, check, tick)


def _run_check(impl: Impl, cfg: AttentionBenchConfig) -> tuple[str, float | None]:
    if cfg.check_seq_len == 0:
        return "not checked (check_seq_len=0)", None
    torch.manual_seed(cfg.seed)
    try:
        check = impl.check(Problem(cfg, cfg.check_seq_len))
        return f"{check.text()} at T={cfg.check_seq_len}", check.err
    except Exception as exc:
        return f"check failed at T={cfg.check_seq_len}: {describe_error(exc)}", None
    finally:
        free_memory(cfg.device)


def _run_length(impl: Impl, cfg: AttentionBenchConfig, T: int, check, tick) -> list[Row]:
    base = dict(suite="attention", impl=impl.name, T=T, check=check[0], check_err=check[1])
    torch.manual_seed(cfg.seed + T)
    cpu_fwd_only = cfg.device == "cpu" and impl.cpu_forward_only
    try:
        built = impl.build(Problem(cfg, T, grad="fwd+bwd" in cfg.modes and not cpu_fwd_only))
    except Exception as exc:
        error = describe_error(exc)
        free_memory(cfg.device)
        tick(f"{impl.name} T={T}: build failed", len(cfg.modes))
        return [Row(**base, mode=m, status="error", error=error) for m in cfg.modes]
    rows = []
    for mode in cfg.modes:
        tick(f"{impl.name} T={T} {mode}")
        rows.append(_time_mode(impl, cfg, mode, built, base))
    del built
    free_memory(cfg.device)
    return rows


def _time_mode(impl: Impl, cfg: AttentionBenchConfig, mode: str, built: Built, base: dict) -> Row:
    if mode == "fwd+bwd" and cfg.device == "cpu" and impl.cpu_forward_only:
        return Row(**base, mode=mode, status="skipped",
                   note="FlexAttention has no backward on CPU: fwd+bwd needs CUDA")
    step = _step(built, mode)
    try:
        timing = time_calls(step, device=cfg.device, warmup=cfg.warmup, iters=cfg.iters)
        back_to_back = time_back_to_back(step, device=cfg.device, iters=cfg.iters)
    except Exception as exc:
        error = describe_error(exc)
        free_memory(cfg.device)
        return Row(**base, mode=mode, status="error", error=error, note=built.note)
    flops = mode_flops(impl.fwd_flops(cfg, base["T"]), mode)
    median = timing.median_ms
    return Row(**base, mode=mode, median_ms=median, min_ms=min(timing.times_ms), first_call_ms=timing.first_ms,
               iters=cfg.iters, flops=flops, tflops=flops / median / 1e9, peak_mem_mib=timing.peak_mem_mib,
               note=built.note, extra={BACK_TO_BACK: back_to_back})


def _step(built: Built, mode: str) -> Callable[[], None]:
    if mode == "fwd":
        def forward() -> None:
            with torch.no_grad():
                built.fn()
        return forward
    grad_out: list[torch.Tensor] = []

    def forward_backward() -> None:
        out = built.fn()
        if not grad_out:
            grad_out.append(torch.randn_like(out))
        torch.autograd.grad(out, built.leaves, grad_out[0], allow_unused=True)
    return forward_backward


SUITE = register_suite(Suite("attention", "op-level NSA attention against dense and peers", run_attention,
                             BASELINE_ORDER))
