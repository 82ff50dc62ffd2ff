"""Where the NSA op's time goes on CUDA: each step alone against its floor, and the whole op's kernels.

    nsa-flex bench breakdown --preset g4 -T 16k,64k        (or python -m nsa_flex.bench.breakdown)

Per length T, bf16, B=1, random inputs (selections from the op's own selection step):
- the whole op compiled with fullgraph=True (as `nsa-flex bench attention` runs it), fwd and
  fwd+bwd, and dense causal cuDNN in the same run;
- each step of the op alone (the Flex / cuDNN branches, the copies and the gated sum compiled
  alone with fullgraph=True, the two Triton ops as they are), fwd and fwd+bwd, with a
  floor: its attention flops at the rate dense cuDNN reached in this run, or, for the copies and
  the gated sum, its bytes at HBM_GBPS;
- one torch.profiler pass over three forward calls and one over three fwd+bwd calls of the whole
  op: GPU time per kernel family, the longest kernels, and the wall time per call (the gap between
  them is host time the GPU waited for).
profile_only skips the steps alone (each compiles on its own: minutes per length).
Times are triton.testing.do_bench medians. The JSON is rewritten after every row.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from nsa_flex.bench.core import describe_error, environment, free_memory, git_commit
from nsa_flex.bench.flops import BWD_FACTOR, dense_causal_flops, nsa_flops
from nsa_flex.config import PRESETS, NSAConfig

HBM_GBPS = 3000.0
"""Bytes floor of the copy-like steps: about what an H100 SXM's HBM3 sustains (3.35 TB/s peak)."""

# Kernel families of the profile, first match wins (Inductor names Flex templates triton_tem_*,
# its pointwise / reduction kernels triton_poi_* / triton_red_* / triton_per_*).
FAMILIES = (
    # Without gradients the selected op's merge also does the gated sum (_slot_gated_kernel).
    ("selected op", r"^_(fwd|bwd|slot|slot_gated|block_sum|delta)_kernel"),
    ("selection op", r"select|_score|_topn"),
    ("flex attention", r"flex_attention|triton_tem"),
    ("sort / scan (index)", r"(?i)sort|radix|scan|cub::"),
    ("cuDNN / GEMM", r"(?i)cudnn|gemm|sm90_|cutlass|nvjet"),
    # The gated sum and the fold (nsa_flex::gated_sum, nsa_flex::fold) replace Inductor's own glue kernels.
    ("elementwise / reductions", r"^triton_(poi|red|per)|^_(sum|sum_bwd|fold)_kernel|elementwise|reduce|vectorized"),
    ("copies / fills", r"(?i)memcpy|memset|copy|fill"),
)


def family(kernel: str) -> str:
    """The family of a kernel name (FAMILIES), "other" when none matches."""
    return next((name for name, pattern in FAMILIES if re.search(pattern, kernel)), "other")


@dataclass
class Row:
    T: int
    step: str
    mode: str
    ms: float | None
    floor_ms: float | None = None
    floor_basis: str = ""
    error: str | None = None


@dataclass
class Profile:
    T: int
    per_call_ms: dict[str, float] = field(default_factory=dict)
    """GPU time per kernel family, per call."""
    top: list[tuple[str, float, int]] = field(default_factory=list)
    """(kernel, ms per call, launches per call), longest first."""
    mode: str = "fwd+bwd"
    wall_ms: float | None = None
    """Wall time per call inside the profile (profiler overhead included)."""


def _inputs(cfg: NSAConfig, T: int, seed: int = 0) -> dict[str, torch.Tensor]:
    from nsa_flex.blocks import num_cmp_blocks

    g = torch.Generator(device="cuda").manual_seed(seed)
    Tc, Hq, Hkv, Dk, Dv = num_cmp_blocks(T, cfg), cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dv
    shapes = {"q": (1, T, Hq, Dk), "k": (1, T, Hkv, Dk), "v": (1, T, Hkv, Dv), "k_cmp": (1, Tc, Hkv, Dk),
              "v_cmp": (1, Tc, Hkv, Dv)}
    x = {n: torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16) for n, s in shapes.items()}
    x["gates"] = torch.sigmoid(torch.randn(1, T, Hq, 3, generator=g, device="cuda", dtype=torch.bfloat16))
    return x


def _ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return do_bench(fn, return_mode="median")


def _fwd_bwd(fn: Callable[[], torch.Tensor], leaves: list[torch.Tensor]) -> Callable[[], None]:
    out = fn()
    grad = torch.randn_like(out)

    def step():
        for x in leaves:
            x.grad = None
        torch.autograd.backward(fn(), grad, inputs=leaves)
    return step


def steps(cfg: NSAConfig, x: dict[str, torch.Tensor]) -> dict[str, tuple[Callable, list, str]]:
    """name -> (forward, leaves with gradients, what its floor counts) of each step the op runs."""
    from nsa_flex.flex import branches
    from nsa_flex.folded import FoldedRows
    from nsa_flex.ops.fold import fold
    from nsa_flex.flex.tuning import FlexTiles
    from nsa_flex.ops import select_blocks
    from nsa_flex.ops.selected_attention import selected_attention

    tiles, scale, Hkv, T = FlexTiles(), cfg.head_dim ** -0.5, cfg.n_kv_heads, x["q"].shape[1]
    leaf = {n: t.detach().requires_grad_(True) for n, t in x.items()}
    q_fold = fold(x["q"], Hkv).detach().requires_grad_(True)
    with torch.no_grad():
        _, lse = branches.compressed_branch(q_fold, x["k_cmp"], x["v_cmp"], cfg, scale, tiles)
        sel = select_blocks(x["q"], x["k_cmp"], lse, cfg, scale=scale)
        # The branch outputs as the gated sum takes them: o_cmp and o_win folded, o_sel not.
        o_branches = [torch.randn_like(q_fold[..., :cfg.dv]), torch.randn_like(x["q"][..., :cfg.dv]),
                      torch.randn_like(q_fold[..., :cfg.dv])]
    o_branches = [t.requires_grad_(True) for t in o_branches]
    block = tiles.selected_impl(T, cfg.group_size) == "block"
    compile_ = lambda f: torch.compile(f, fullgraph=True, dynamic=False)  # noqa: E731
    out = {
        "fold q": (compile_(lambda: fold(leaf["q"], Hkv)), [leaf["q"]], "bytes"),
        "compressed branch": (compile_(lambda: branches.compressed_branch(q_fold, leaf["k_cmp"], leaf["v_cmp"], cfg,
                                                                          scale, tiles)[0].x),
                              [q_fold, leaf["k_cmp"], leaf["v_cmp"]], "cmp"),
        "selection op": (lambda: select_blocks(x["q"], x["k_cmp"], lse, cfg, scale=scale), [], "scores"),
    }
    if branches.compressed_impl(q_fold, x["k_cmp"], x["v_cmp"], tiles) != "flex":
        flex_tiles = FlexTiles(cmp_impl="flex")
        out["compressed branch (flex, not run by the op)"] = (
            compile_(lambda: branches.compressed_branch(q_fold, leaf["k_cmp"], leaf["v_cmp"], cfg, scale,
                                                        flex_tiles)[0].x),
            [q_fold, leaf["k_cmp"], leaf["v_cmp"]], "cmp")
    if block:
        out["selected branch (block op)"] = (
            lambda: selected_attention(leaf["q"], leaf["k"], leaf["v"], sel, cfg, scale=scale),
            [leaf["q"], leaf["k"], leaf["v"]], "sel")
    else:
        out["selected branch (flex)"] = (
            lambda: branches.selected_branch(q_fold, leaf["k"], leaf["v"], sel, cfg, scale, tiles, None, True),
            [q_fold, leaf["k"], leaf["v"]], "sel")
    out["window branch"] = (compile_(lambda: branches.window_branch(q_fold, leaf["k"], leaf["v"], cfg, scale, tiles)),
                            [q_fold, leaf["k"], leaf["v"]], "win")
    o_cmp = FoldedRows(o_branches[0], 0)
    out["gated sum"] = (lambda: branches.gated_sum(o_cmp, *o_branches[1:], leaf["gates"]), [*o_branches, leaf["gates"]],
                        "sum")
    return out


def floor_ms(basis: str, cfg: NSAConfig, T: int, mode: str, dense_tflops: dict[str, float],
             x: dict[str, torch.Tensor]) -> float | None:
    """The step's floor: its flops at dense's rate of this mode, or its bytes at HBM_GBPS."""
    rate = dense_tflops.get(mode)
    factor = 1.0 if mode == "fwd" else 1.0 + BWD_FACTOR
    if basis in ("cmp", "sel", "win"):
        return None if rate is None else nsa_flops(1, T, cfg, (basis,)) * factor / rate / 1e9
    if basis == "scores":  # Q K^T of the importance scores: 2 * Dk per (query head, compressed key), no grad
        if rate is None or mode != "fwd":
            return None
        keys = nsa_flops(1, T, cfg, ("cmp",)) / (cfg.head_dim + cfg.dv)
        return keys * cfg.head_dim / rate / 1e9
    # Copies and the gated sum: read + write of [T, Hq, D] tensors (gated sum: three in, one out).
    q = x["q"]
    one = q.numel() * q.element_size()
    n = 2 if basis == "bytes" else 4
    return n * one * (1 if mode == "fwd" else 2) / HBM_GBPS / 1e6


def profile_op(op: Callable[[], torch.Tensor], leaves: list[torch.Tensor], T: int, calls: int = 3,
               top: int = 20, mode: str = "fwd+bwd") -> Profile:
    """GPU time of the op's kernels per call (mode "fwd" or "fwd+bwd"), by family, and the `top` longest."""
    import time

    from torch.profiler import ProfilerActivity, profile

    step = _fwd_bwd(op, leaves) if mode == "fwd+bwd" else _no_grad(op)
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / calls
    kernels: dict[str, tuple[float, int]] = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        if us > 0:
            kernels[e.key] = (us / 1e3 / calls, e.count // calls)
    result = Profile(T, mode=mode, wall_ms=wall)
    for name, (ms, _) in kernels.items():
        fam = family(name)
        result.per_call_ms[fam] = result.per_call_ms.get(fam, 0.0) + ms
    result.per_call_ms["total"] = sum(ms for ms, _ in kernels.values())
    longest = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    result.top = [(name[:120], ms, n) for name, (ms, n) in longest]
    return result


def dense_ms(cfg: NSAConfig, x: dict[str, torch.Tensor]) -> dict[str, float]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    q, k, v = (x[n].detach().transpose(1, 2).requires_grad_(True) for n in ("q", "k", "v"))
    G = cfg.group_size
    k, v = (t.detach().repeat_interleave(G, 1).requires_grad_(True) for t in (k, v))

    def fwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(q, k, v, is_causal=True)

    with torch.no_grad():
        f = _ms(fwd)
    return {"fwd": f, "fwd+bwd": _ms(_fwd_bwd(fwd, [q, k, v]))}


def run(preset: str, Ts, out_path, commit: str | None = None,
        profile_only: bool = False) -> tuple[list[Row], list[Profile]]:
    """Breaks the op down at every T; prints Markdown and writes JSON to out_path."""
    from nsa_flex.attention import nsa_attention
    from nsa_flex.flex.tuning import install_flex_tuning

    install_flex_tuning()
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 512
    cfg = PRESETS[preset]
    whole = torch.compile(nsa_attention, fullgraph=True, dynamic=False)
    rows: list[Row] = []
    profiles: list[Profile] = []
    for T in Ts:
        x = _inputs(cfg, T)
        leaves = [t.requires_grad_(True) for t in x.values()]
        dense = dense_ms(cfg, x)
        rows += [Row(T, "dense cuDNN", m, ms) for m, ms in dense.items()]
        dense_flops = dense_causal_flops(1, cfg.n_heads, T, cfg.head_dim, cfg.dv)
        rate = {"fwd": dense_flops / dense["fwd"] / 1e9,
                "fwd+bwd": dense_flops * (1 + BWD_FACTOR) / dense["fwd+bwd"] / 1e9}
        op = lambda: whole(**x, config=cfg)  # noqa: E731
        _save_rows(rows, profiles, out_path, commit, preset)
        for mode in ("fwd", "fwd+bwd"):
            try:
                fn = _fwd_bwd(op, leaves) if mode == "fwd+bwd" else _no_grad(op)
                rows.append(Row(T, "whole op (compiled)", mode, _ms(fn)))
            except Exception as exc:
                rows.append(Row(T, "whole op (compiled)", mode, None, error=describe_error(exc)))
                free_memory("cuda")
            print(_line(rows[-1]), flush=True)
        alone = {} if profile_only else steps(cfg, {n: t.detach() for n, t in x.items()})
        for name, (fn, step_leaves, basis) in alone.items():
            for mode in ("fwd", "fwd+bwd") if step_leaves else ("fwd",):
                try:
                    timed = _fwd_bwd(fn, step_leaves) if mode == "fwd+bwd" else _no_grad(fn)
                    timed()
                    rows.append(Row(T, name, mode, _ms(timed), floor_ms(basis, cfg, T, mode, rate, x),
                                    "bytes" if basis in ("bytes", "sum") else f"{basis} flops at dense's rate"))
                except Exception as exc:
                    rows.append(Row(T, name, mode, None, error=describe_error(exc)))
                    free_memory("cuda")
                print(_line(rows[-1]), flush=True)
                _save_rows(rows, profiles, out_path, commit, preset)
        for mode in ("fwd", "fwd+bwd"):
            try:
                profiles.append(profile_op(op, leaves, T, mode=mode))
                print(profile_markdown(profiles[-1]), flush=True)
            except Exception as exc:
                print(f"T={T}: {mode} profile failed: {describe_error(exc)}", flush=True)
        _save_rows(rows, profiles, out_path, commit, preset)
        del x, leaves
        free_memory("cuda")
    print(markdown(rows))
    return rows, profiles


def _no_grad(fn):
    def step():
        with torch.no_grad():
            return fn()
    return step


def _save_rows(rows, profiles, out_path, commit, preset) -> None:
    header = {"suite": "breakdown", "preset": preset, "commit": commit or git_commit(), **environment("cuda")}
    with open(out_path, "w") as fh:
        json.dump({"header": header, "rows": [asdict(r) for r in rows], "profiles": [asdict(p) for p in profiles]},
                  fh, indent=1)


def _line(r: Row) -> str:
    if r.ms is None:
        return f"T={r.T} {r.step} {r.mode}: ERROR {r.error}"
    floor = f" (floor {r.floor_ms:.3f}, {r.ms / r.floor_ms:.1f}x)" if r.floor_ms else ""
    return f"T={r.T} {r.step} {r.mode}: {r.ms:.3f} ms{floor}"


def markdown(rows: list[Row]) -> str:
    """One line per (T, step): fwd and fwd+bwd ms, each over its floor."""
    lines = ["| T | step | fwd ms | fwd+bwd ms | fwd / floor | fwd+bwd / floor |", "|---|---|---|---|---|---|"]
    keys = dict.fromkeys((r.T, r.step) for r in rows)
    for T, step in keys:
        by = {r.mode: r for r in rows if (r.T, r.step) == (T, step)}
        cells = []
        for mode in ("fwd", "fwd+bwd"):
            r = by.get(mode)
            cells.append("-" if r is None else "err" if r.ms is None else f"{r.ms:.3f}")
        for mode in ("fwd", "fwd+bwd"):
            r = by.get(mode)
            cells.append(f"{r.ms / r.floor_ms:.1f}x" if r and r.ms and r.floor_ms else "-")
        lines.append(f"| {T} | {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def profile_markdown(p: Profile) -> str:
    wall = "" if p.wall_ms is None else f" (wall {p.wall_ms:.3f} ms per call under the profiler)"
    lines = [f"T={p.T}, whole op {p.mode}, GPU ms per call by kernel family{wall}:", "| family | ms |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in sorted(p.per_call_ms.items(), key=lambda kv: -kv[1])]
    lines += ["", "| kernel | ms | launches |", "|---|---|---|"]
    lines += [f"| `{name}` | {ms:.3f} | {n} |" for name, ms, n in p.top]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="g4", choices=sorted(PRESETS))
    p.add_argument("--T", default="16384,65536", help="comma-separated sequence lengths")
    p.add_argument("--out", default="breakdown.json")
    p.add_argument("--commit", default=None, help="commit to record when the checkout has no git metadata")
    p.add_argument("--profile-only", action="store_true", help="skip the steps alone; time and profile the whole op")
    args = p.parse_args()
    run(args.preset, [int(t) for t in args.T.split(",")], args.out, args.commit, args.profile_only)


if __name__ == "__main__":
    main()
