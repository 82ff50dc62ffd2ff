"""The decode suite: one NSA layer's decode step against dense SDPA decode, over context length.

For each batch B and context T, a cache holds T tokens of random keys/values per sequence;
one step is the NSA op for one new token per sequence (`decode.decode_attention`: cache write,
phi where a block completes, the three branches, the gates; no projections), compiled with
torch.compile(fullgraph=True). The baseline is dense decode through SDPA's flash kernel over
the whole cache (the G query heads of a kv head as G query rows), read from the same cache.

Rows (GPU time per step, medians):
- nsa-graph: the compiled step captured in a CUDA graph and replayed (what one step costs
  inside the whole-model decode graph);
- dense-sdpa: the baseline, also replayed from a CUDA graph;
- nsa-reduce-overhead: torch.compile(mode="reduce-overhead") called from Python, as a
  caller of the one-layer step sees it (cudagraph-tree bookkeeping on the host included).
Before timing: `check_decode`, the compiled bf16 decode against the fp32 reference forward.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, NamedTuple

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from nsa_flex.attention import NSAAttention
from nsa_flex.bench.core import Progress, Row, Suite, add_speedups, describe_error, free_memory, register_suite
from nsa_flex.blocks import sort_block_indices
from nsa_flex.decoding.cache import NSACache
from nsa_flex.compression import Compressor
from nsa_flex.config import PRESETS, NSAConfig
from nsa_flex.decoding.step import Projected, decode_attention, decode_step, full_forward, prefill
from nsa_flex.model import Rotary, apply_rotary

DEVICES = ("cuda", "cpu")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BASELINE_ORDER = ("dense-sdpa",)
SLACK = 256
"""Cache room past T for the steps of one timed run (each step advances every sequence)."""


@dataclass(frozen=True, kw_only=True)
class DecodeBenchConfig:
    """Everything one decode sweep depends on; written whole into the JSON header."""

    device: str
    nsa: NSAConfig
    contexts: tuple[int, ...]
    """T: tokens already in the cache when the timed steps start."""
    batches: tuple[int, ...] = (1, 8)
    dtype: str = "bf16"
    steps_per_graph: int = 10
    """Decode steps captured in one CUDA graph."""
    replays: int = 10
    """Graph replays per timed run (CPU: steps per timed run)."""
    reps: int = 7
    """Timed runs; rows report the median (and min) time per step."""
    reduce_overhead_at: tuple[int, ...] = (65536,)
    """Contexts at which the nsa-reduce-overhead row is timed too (each one compiles again)."""
    check: bool = True
    """Run check_decode (compiled decode vs the fp32 reference forward) before timing."""
    check_dim: int = 1024
    seed: int = 0

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"unknown device {self.device!r}; allowed: {', '.join(DEVICES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; allowed: {', '.join(DTYPES)}")
        if not self.contexts or not self.batches or min(self.contexts) < 1 or min(self.batches) < 1:
            raise ValueError(f"contexts {self.contexts} and batches {self.batches} must be non-empty and positive")
        for name in ("steps_per_graph", "replays", "reps", "check_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.steps_per_graph * self.replays > SLACK:
            raise ValueError(f"steps_per_graph * replays must be <= {SLACK} (the cache room past T)")


def decode_config(*, device: str | None = None, **settings) -> DecodeBenchConfig:
    """Defaults for the device (CUDA: the paper shape, Hq=64 Hkv=4 D=128, bf16, 8k..128k,
    B=1 and 8; CPU: a tiny functional smoke sweep) with the given settings (None keeps a default)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch sees no CUDA device; allowed here: cpu")
    cuda = device == "cuda"
    defaults = dict(
        nsa=PRESETS["bench"] if cuda else PRESETS["tiny"],
        contexts=tuple(k * 1024 for k in (8, 16, 32, 64, 128)) if cuda else (256, 512),
        batches=(1, 8) if cuda else (1, 2), dtype="bf16" if cuda else "fp32",
        replays=10 if cuda else 5, reps=7 if cuda else 2,
        reduce_overhead_at=(65536,) if cuda else (), check_dim=1024 if cuda else 64,
    )
    return DecodeBenchConfig(device=device, **(defaults | {k: v for k, v in settings.items() if v is not None}))


def decode_summary(cfg: DecodeBenchConfig) -> str:
    n = cfg.nsa
    return (f"one layer's decode step, Hq={n.n_heads} Hkv={n.n_kv_heads} Dk={n.head_dim} Dv={n.dv} {cfg.dtype}; "
            f"NSA l={n.cmp_block} d={n.cmp_stride} l'={n.sel_block} n={n.n_selected} w={n.window}")


def decode_notes(cfg: DecodeBenchConfig) -> list[str]:
    notes = [
        "mode B=b: b sequences, each with T tokens in the cache; median ms = GPU time of one step.",
        "nsa-graph: decode_attention compiled (fullgraph) and replayed from a CUDA graph, "
        f"{cfg.steps_per_graph} steps per graph; cache write + phi in one launch "
        "(nsa_flex::cache_step: phi only where a block completes), "
        "cmp branch over the whole compressed cache, top-n, selected + window branches, gates. No projections.",
        "dense-sdpa: SDPA flash over the whole cache, [B, Hkv, G, D] queries, also from a CUDA graph.",
        "nsa-reduce-overhead: mode='reduce-overhead' called from Python (host replay overhead included).",
        "extra.kernels / extra.busy_us: GPU kernels per step and their summed time (torch.profiler, no graph).",
        "first call ms: compilation of the step (and the first run).",
    ]
    if cfg.device == "cpu":
        notes.append("CPU run: a functional smoke test (eager, no graphs); its times are no performance figure.")
    return notes


def run_decode(cfg: DecodeBenchConfig, progress: Progress | None = None,
               on_rows: Callable[[list[Row]], None] | None = None) -> list[Row]:
    """The sweep; every configuration that fails becomes an error row and the sweep goes on.

    on_rows(rows so far, speedups filled) is called after each configuration (e.g. to save).
    """
    total = len(cfg.batches) * len(cfg.contexts) + 1
    tick = (lambda i, what: progress(i, total, what)) if progress else (lambda i, what: None)
    tick(0, "check")
    check = _safe_check(cfg)
    rows: list[Row] = []
    done = 1
    for B in cfg.batches:
        for T in cfg.contexts:
            tick(done, f"B={B} T={T}")
            rows += _run_config(cfg, B, T, check)
            add_speedups(rows, BASELINE_ORDER)
            if on_rows is not None:
                on_rows(rows)
            done += 1
    tick(done, "done")
    return rows


def _safe_check(cfg: DecodeBenchConfig) -> tuple[str, float | None]:
    if not cfg.check:
        return "not checked (check=False)", None
    try:
        result = check_decode(cfg.nsa, device=cfg.device, dtype=DTYPES[cfg.dtype], dim=cfg.check_dim, seed=cfg.seed)
        return result.text(), result.err
    except Exception as exc:
        return f"check failed: {describe_error(exc)}", None
    finally:
        free_memory(cfg.device)


def _run_config(cfg: DecodeBenchConfig, B: int, T: int, check) -> list[Row]:
    base = dict(suite="decode", mode=f"B={B}", T=T, extra={"batch": B, "context": T})
    impls = ["nsa-graph", "dense-sdpa"] + (["nsa-reduce-overhead"] if T in cfg.reduce_overhead_at else [])
    rows = []
    try:
        torch.manual_seed(cfg.seed + T + B)
        problem = DecodeProblem(cfg, B, T)
    except Exception as exc:
        free_memory(cfg.device)
        return [Row(**base, impl=name, status="error", error=describe_error(exc)) for name in impls]
    for name in impls:
        # The check is of the NSA decode; the dense baseline has none.
        own = dict(base, extra=dict(base["extra"]), **(dict(check=check[0], check_err=check[1])
                                                       if name.startswith("nsa") else {}))
        try:
            rows.append(_time_impl(cfg, problem, name, own))
        except Exception as exc:
            rows.append(Row(**own, impl=name, status="error", error=describe_error(exc)))
        torch._dynamo.reset()
    del problem
    free_memory(cfg.device)
    return rows


class StepInputs(NamedTuple):
    """What one decode step reads: the cache, the new token's projections and gates, phi."""

    cache: NSACache
    pr: Projected
    gates: torch.Tensor
    phi_k: Compressor
    phi_v: Compressor


def random_step_inputs(n: NSAConfig, B: int, max_len: int, dtype: torch.dtype, device, *,
                       q_scale: float = 1.0) -> StepInputs:
    """A cache of max_len slots of random data (lengths left at 0 for the caller to set), one new
    token's random projections (q times q_scale), gates in [0, 1) and freshly initialised phi modules."""
    cache = NSACache(n, B, max_len, dtype=dtype, device=device)
    bufs = [cache.k, cache.v, cache.k_cmp, cache.v_cmp, cache.k_tail, cache.v_tail]
    # k_win / v_win are k / v themselves unless the config gives the window its own projections.
    for buf in bufs + ([cache.k_win, cache.v_win] if n.separate_kv else []):
        buf.normal_()
    kv = lambda D: torch.randn(B, 1, n.n_kv_heads, D, device=device, dtype=dtype)  # noqa: E731
    k, v = kv(n.head_dim), kv(n.dv)
    q = q_scale * torch.randn(B, 1, n.n_heads, n.head_dim, device=device, dtype=dtype)
    gates = torch.rand(B, 1, n.n_heads, 3, device=device, dtype=dtype)
    return StepInputs(cache, Projected(q, k, v, k, v, k, v), gates, Compressor(n, n.head_dim).to(device, dtype),
                      Compressor(n, n.dv).to(device, dtype))


class DecodeProblem:
    """A cache holding T random tokens per sequence, one new token's projections and gates, phi."""

    def __init__(self, cfg: DecodeBenchConfig, B: int, T: int):
        self.T, self.cfg = T, cfg
        self.cache, self.pr, self.gates, self.phi_k, self.phi_v = random_step_inputs(
            cfg.nsa, B, T + SLACK, DTYPES[cfg.dtype], cfg.device)
        self.reset()

    def reset(self) -> None:
        self.cache.lengths.fill_(self.T)

    def nsa_step(self):
        return decode_attention(self.cache, self.pr, self.gates, self.phi_k, self.phi_v)

    def dense_step(self):
        c, n = self.cache, self.cfg.nsa
        q = self.pr.q.view(c.batch_size, n.n_kv_heads, n.group_size, n.head_dim)
        return F.scaled_dot_product_attention(q, c.k[:, :, :self.T], c.v[:, :, :self.T])


def _time_impl(cfg: DecodeBenchConfig, problem: DecodeProblem, name: str, base: dict) -> Row:
    cuda = cfg.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    match name:
        case "nsa-graph":
            fn = torch.compile(problem.nsa_step, fullgraph=True) if cuda else problem.nsa_step
            first_ms, times = _time_graph(fn, problem.reset, cfg)
            if cuda:
                base["extra"].update(kernel_profile(fn, problem.reset))
        case "dense-sdpa":
            first_ms, times = _time_graph(_flash(problem.dense_step) if cuda else problem.dense_step,
                                          problem.reset, cfg)
        case "nsa-reduce-overhead":
            fn = torch.compile(problem.nsa_step, mode="reduce-overhead", fullgraph=True)
            first_ms, times = _time_calls(fn, problem.reset, cfg)
        case _:
            raise ValueError(f"unknown decode impl {name!r}")
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    return Row(**base, impl=name, median_ms=_median(times), min_ms=min(times), first_call_ms=first_ms,
               iters=len(times), peak_mem_mib=peak)


def _flash(fn):
    def step():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return fn()
    return step


def _time_graph(fn, reset, cfg: DecodeBenchConfig) -> tuple[float, list[float]]:
    """(first call ms, ms per step of each timed run); CUDA: replays of a captured graph."""
    start = time.perf_counter()
    fn()
    _sync(cfg.device)
    first_ms = (time.perf_counter() - start) * 1e3
    if cfg.device != "cuda":
        return first_ms, _host_times(fn, reset, cfg)
    return first_ms, graph_step_times(fn, reset, steps=cfg.steps_per_graph, reps=cfg.reps, replays=cfg.replays)


def graph_step_times(fn, reset, *, steps: int, reps: int, replays: int = 1) -> list[float]:
    """ms per step of each of `reps` timed runs; a run replays a CUDA graph of `steps` calls `replays` times.

    Warm-up on a side stream first (as graph capture needs); reset() restores the state
    (cache lengths) before the capture and before every run.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps):
            fn()
    times = []
    for _ in range(reps):
        reset()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / (replays * steps))
    return times


def _time_calls(fn, reset, cfg: DecodeBenchConfig) -> tuple[float, list[float]]:
    """(first call ms, ms per call of each timed run): calls from Python, events around each run."""
    start = time.perf_counter()
    fn()
    _sync(cfg.device)
    first_ms = (time.perf_counter() - start) * 1e3
    for _ in range(3):
        fn()
    return first_ms, _host_times(fn, reset, cfg)


def _host_times(fn, reset, cfg: DecodeBenchConfig) -> list[float]:
    steps = cfg.replays * cfg.steps_per_graph if cfg.device == "cuda" else cfg.replays
    times = []
    for _ in range(cfg.reps):
        reset()
        _sync(cfg.device)
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        _sync(cfg.device)
        times.append((time.perf_counter() - start) * 1e3 / steps)
    return times


def kernel_profile(fn, reset, steps: int = 5, top: int | None = 8) -> dict:
    """Kernels per step, their summed GPU us per step and the `top` kernels' us per step (None: all),
    names cut to 80 characters (names the cut makes equal are summed). No graph: each kernel seen on its own."""
    from torch.profiler import ProfilerActivity, profile

    reset()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name[:80]] = by_name.get(e.name[:80], 0.0) + e.time_range.elapsed_us()
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {"kernels": len(kernels) / steps, "busy_us": sum(by_name.values()) / steps,
            "top_kernels_us": {name: round(t / steps, 2) for name, t in ranked}}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


@dataclass(frozen=True)
class CheckResult:
    err: float
    """Max abs error of the decode against the fp32 reference forward (same selection)."""
    ref_err: float
    """The same error of the reference forward run in `dtype`: the precision's own level."""
    bound: float
    selection_agreement: float
    """Fraction of (position, kv head) where the decode's own selection equals the fp32 one."""
    positions: int

    @property
    def passed(self) -> bool:
        return self.err <= self.bound

    def text(self) -> str:
        verdict = "ok" if self.passed else "FAILED"
        return (f"{verdict}: decode vs fp32 reference max err {self.err:.2e} (bound {self.bound:.2e} = 2 x the "
                f"{self.ref_err:.2e} of the low-precision reference + rounding floor) over {self.positions} "
                f"positions; selection = fp32 selection at {self.selection_agreement:.1%} of (position, kv head)")


def check_decode(nsa: NSAConfig, *, device: str, dtype: torch.dtype, dim: int = 1024, prompt: int = 1000,
                 steps: int = 100, seed: int = 0) -> CheckResult:
    """Prefill two prompts (prompt and prompt - 63 tokens), decode `steps` tokens through the
    compiled step (CUDA: mode="reduce-overhead") in `dtype`, compare with the fp32 reference forward.

    The fp32 forward runs with the decode's own selection at the decoded positions, so a
    near-tie that low precision breaks the other way cannot swap a block; how often the
    selections agree is reported apart. Bound: 2x the error of the reference forward in
    `dtype` against fp32, plus one bf16 rounding of the output's scale.
    """
    torch.manual_seed(seed)
    layer = NSAAttention(nsa, dim, impl="reference").to(device)
    low = copy.deepcopy(layer).to(dtype)
    B, T = 2, prompt + steps
    rope = Rotary(nsa.head_dim, T + 1, 10000.0).to(device)

    def rotary(q, k, positions):
        cos, sin = rope.tables(positions)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    x = torch.randn(B, T, dim, device=device)
    lengths = torch.tensor([prompt, prompt - 63], device=device)
    cache = NSACache(nsa, B, T + 1, dtype=dtype, device=device)
    prefill(low, cache, x[:, :prompt].to(dtype), lengths, rotary=rotary)
    step = partial(decode_step, low, cache, rotary=rotary, return_indices=True)
    if device == "cuda":
        step = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    b_idx = torch.arange(B, device=device)
    decoded = []
    for _ in range(steps):
        pos = cache.lengths.clone()
        y, sel = step(x[b_idx, pos.clamp(max=T - 1)][:, None].to(dtype))
        decoded.append((pos, y.float().clone(), sort_block_indices(sel)))
    oracle_sel = full_forward(layer, x, rotary=rotary)[1]
    used = oracle_sel.clone()
    agree, count = 0, 0
    for pos, _, sel in decoded:
        for b in range(B):
            if pos[b] < T:
                agree += int((oracle_sel[b, :, pos[b]] == sel[b]).all(-1).sum())
                count += sel.shape[1]
                used[b, :, pos[b]] = sel[b]
    oracle = full_forward(layer, x, rotary=rotary, block_indices=used)[0]
    low_ref = full_forward(low, x.to(dtype), rotary=rotary, block_indices=used)[0].float()
    err, ref_err, scale, n = 0.0, 0.0, 0.0, 0
    for pos, y, _ in decoded:
        for b in range(B):
            if pos[b] < T:
                want = oracle[b, pos[b]]
                err = max(err, (y[b, 0] - want).abs().max().item())
                ref_err = max(ref_err, (low_ref[b, pos[b]] - want).abs().max().item())
                scale, n = max(scale, want.abs().max().item()), n + 1
    return CheckResult(err, ref_err, 2 * ref_err + 2 ** -8 * scale, agree / max(count, 1), n)


SUITE = register_suite(Suite("decode", "one layer's NSA decode step against dense SDPA decode", run_decode,
                             BASELINE_ORDER))
