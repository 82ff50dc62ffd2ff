"""GPU check + timing of nsa_flex (impl="flex") against dense cuDNN SDPA, in one run.

    python -m bench.flex_gpu --out runs/bench/flex.json [--sizes 8192 16384 65536] [--groups 64:4 16:4]

For each (Hq:Hkv, T): a correctness check (at T=2048, against the reference), then
median times (triton.testing.do_bench) of the whole op (compressed Flex call + selection op
+ selected Flex call + window Flex call + gates, compiled with fullgraph=True) forward and
forward+backward, peak memory of one forward+backward, the same for dense causal cuDNN
SDPA, and per-branch times at the largest T. Compile time is reported apart. Prints one
Markdown table and writes JSON with device, versions and commit. Rows that would run past
--deadline-s seconds are skipped and say so.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
from pathlib import Path

import torch

from bench.common import bench_ms, header, inputs, peak_gib
from nsa_flex import NSAConfig
from nsa_flex.flex import compressed_branch, fold, nsa_flex, selected_branch, window_branch
from nsa_flex.flex.masks import selection_block_mask
from nsa_flex.ops import select_blocks
from nsa_flex.reference import nsa_reference
from nsa_flex.flex.tuning import FlexTiles, install_flex_tuning

START = time.monotonic()


@dataclasses.dataclass
class Row:
    what: str
    Hq: int
    Hkv: int
    T: int
    fwd_ms: float | None = None
    fwd_bwd_ms: float | None = None
    peak_gib: float | None = None
    compile_s: float | None = None
    fwd_tflops: float | None = None
    note: str = ""


def nsa_flops(cfg: NSAConfig, T: int) -> float:
    """Forward FLOPs of the keys each query really sees: 2*(Dk+Dv) per (query head, key)."""
    t = torch.arange(T, dtype=torch.float64)
    cmp_keys = torch.clamp(torch.div(t - cfg.cmp_block + 1, cfg.cmp_stride, rounding_mode="floor") + 1, min=0)
    sel_keys = torch.clamp(t + 1, max=cfg.n_selected * cfg.sel_block)
    win_keys = torch.clamp(t + 1, max=cfg.window)
    keys = float((cmp_keys + sel_keys + win_keys).sum())
    return 2 * (cfg.head_dim + cfg.dv) * cfg.n_heads * keys


def dense_flops(cfg: NSAConfig, T: int) -> float:
    return 2 * (cfg.head_dim + cfg.dv) * cfg.n_heads * T * (T + 1) / 2


def timed_pair(fn, x: dict, out_grad) -> tuple[float, float, float]:
    """(fwd ms, fwd+bwd ms, peak GiB of one fwd+bwd) of fn(**x) -> tensor."""
    grads = [t for t in x.values() if t.requires_grad]

    def fwd_bwd():
        o = fn(**x)
        torch.autograd.backward(o, out_grad, inputs=grads)

    return bench_ms(lambda: fn(**x)), bench_ms(fwd_bwd), peak_gib(fwd_bwd)


def check(cfg: NSAConfig, compiled) -> str:
    """Forward + backward of the compiled op against the reference at T=2048 (bf16 vs fp32 math)."""
    x = inputs(cfg, 2048, seed=1)
    do = torch.randn(1, 2048, cfg.n_heads, cfg.dv, device="cuda", dtype=torch.bfloat16)
    o, sel = compiled(**x, config=cfg)
    o.backward(do)
    got = {n: t.grad.float() for n, t in x.items()}
    x32 = {n: t.detach().float().requires_grad_(True) for n, t in x.items()}
    o_ref, _ = nsa_reference(**x32, config=cfg, block_indices=sel)
    o_ref.backward(do.float())
    rel = {"o": ((o.float() - o_ref).norm() / o_ref.norm()).item()}
    rel.update({n: ((got[n] - x32[n].grad).norm() / x32[n].grad.norm()).item() for n in x})
    worst = max(rel.values())
    status = "ok" if worst < 2e-2 else "MISMATCH"
    return f"check T=2048 {status}: max rel err {worst:.2e} " + " ".join(f"{k}={v:.1e}" for k, v in rel.items())


def run_group(Hq: int, Hkv: int, sizes, tiles: FlexTiles, args, rows: list, log: list, first: bool) -> None:
    cfg = NSAConfig(n_heads=Hq, n_kv_heads=Hkv, head_dim=128)

    def op(**x):
        return nsa_flex(**x, config=cfg, tiles=tiles)[0]

    compiled = torch.compile(op, fullgraph=True, dynamic=False) if args.compile_op else op
    mode = "whole op compiled" if args.compile_op else "eager op, each flex call compiled"
    if args.check and first:
        checked = functools.partial(nsa_flex, tiles=tiles)
        if args.compile_op:
            checked = torch.compile(checked, fullgraph=True, dynamic=False)
        log.append(f"Hq={Hq} Hkv={Hkv} {tiles} {mode}: " + check(cfg, checked))
        print(log[-1], flush=True)
    for T in sizes:
        if time.monotonic() - START > args.deadline_s:
            rows.append(Row("nsa-flex", Hq, Hkv, T, note="skipped: deadline"))
            continue
        try:
            x = inputs(cfg, T)
            do = torch.randn(1, T, Hq, cfg.dv, device="cuda", dtype=torch.bfloat16)
            t0 = time.monotonic()
            compiled(**x).backward(do)
            torch.cuda.synchronize()
            compile_s = time.monotonic() - t0
            fwd, fwd_bwd, peak = timed_pair(compiled, x, do)
            rows.append(Row("nsa-flex", Hq, Hkv, T, fwd, fwd_bwd, peak, compile_s,
                            nsa_flops(cfg, T) / fwd / 1e9, note=f"q_tile={tiles.sel_rows(T, cfg)}; {mode}"))
        except Exception as e:  # one failed size must not lose the others
            rows.append(Row("nsa-flex", Hq, Hkv, T, note=f"error: {type(e).__name__}: {str(e)[:200]}"))
        print(rows[-1], flush=True)
        x = do = None
        torch.cuda.empty_cache()
        if args.dense and first:
            rows.append(dense_row(cfg, T))
            print(rows[-1], flush=True)
    if args.branches and first and time.monotonic() - START < args.deadline_s:
        try:
            branch_rows(cfg, max(sizes), tiles, rows)
        except Exception as e:
            rows.append(Row("branches", Hq, Hkv, max(sizes), note=f"error: {type(e).__name__}: {str(e)[:200]}"))


def dense_row(cfg: NSAConfig, T: int) -> Row:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    x = inputs(cfg, T)
    q, k, v = (x[n].detach().transpose(1, 2).requires_grad_(True) for n in ("q", "k", "v"))
    do = torch.randn_like(q)

    def sdpa(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    fwd, fwd_bwd, peak = timed_pair(sdpa, {"q": q, "k": k, "v": v}, do)
    return Row("dense cuDNN", cfg.n_heads, cfg.n_kv_heads, T, fwd, fwd_bwd, peak, None,
               dense_flops(cfg, T) / fwd / 1e9)


def branch_rows(cfg: NSAConfig, T: int, tiles: FlexTiles, rows: list) -> None:
    """Each step alone, compiled alone: where the time goes."""
    x = inputs(cfg, T)
    scale = cfg.head_dim ** -0.5
    q, k, v, kc, vc = (x[n] for n in ("q", "k", "v", "k_cmp", "v_cmp"))
    q_fold = fold(q.detach(), cfg.n_kv_heads).requires_grad_(True)
    with torch.no_grad():
        _, lse = torch.compile(compressed_branch, fullgraph=True)(q_fold, kc, vc, cfg, scale, tiles)
        sel = select_blocks(q, kc, lse, cfg, scale=scale)
    steps = {
        "cmp branch": lambda: compressed_branch(q_fold, kc, vc, cfg, scale, tiles)[0],
        "sel branch": lambda: selected_branch(q_fold, k, v, sel, cfg, scale, tiles),
        "win branch": lambda: window_branch(q_fold, k, v, cfg, scale, tiles),
    }
    do = torch.randn_like(q_fold[..., :cfg.dv])
    for name, fn in steps.items():
        compiled = torch.compile(fn, fullgraph=True)

        def fwd_bwd():
            compiled().backward(do)

        fwd_bwd()
        rows.append(Row(name, cfg.n_heads, cfg.n_kv_heads, T, bench_ms(compiled), bench_ms(fwd_bwd), peak_gib(fwd_bwd)))
        print(rows[-1], flush=True)
    no_grad_steps = {
        # Eager: the op's Triton kernel does not compile inside Inductor on torch 2.11 yet (fp64 scale).
        "selection op": lambda: select_blocks(q, kc, lse, cfg, scale=scale),
        "sel BlockMask": torch.compile(
            lambda: selection_block_mask(sel, T, cfg.group_size, cfg, tiles.sel_rows(T, cfg)).full_q_indices,
            fullgraph=True),
    }
    with torch.no_grad():
        for name, fn in no_grad_steps.items():
            fn()
            rows.append(Row(name, cfg.n_heads, cfg.n_kv_heads, T, bench_ms(fn)))
            print(rows[-1], flush=True)


def allow_many_shapes() -> None:
    """Dynamo limits for a script that compiles the Flex calls at many shapes and grad modes, then the tuning."""
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 512
    install_flex_tuning()


def table(rows: list) -> str:
    lines = ["| what | Hq/Hkv | T | fwd ms | fwd+bwd ms | peak GiB | fwd TFLOP/s | compile s | note |",
             "|---|---|---|---|---|---|---|---|---|"]

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    for r in rows:
        lines.append(f"| {r.what} | {r.Hq}/{r.Hkv} | {r.T} | {f(r.fwd_ms, '.2f')} | {f(r.fwd_bwd_ms, '.2f')} | "
                     f"{f(r.peak_gib, '.2f')} | {f(r.fwd_tflops, '.0f')} | {f(r.compile_s, '.0f')} | {r.note} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384, 65536])
    parser.add_argument("--groups", nargs="+", default=["64:4"], help="Hq:Hkv pairs")
    parser.add_argument("--sel-q-block", type=lambda v: None if v == "auto" else int(v), nargs="+", default=[None],
                        help="selected-branch query rows per tile; auto: chosen by length (FlexTiles.sel_rows)")
    parser.add_argument("--no-dense", dest="dense", action="store_false")
    parser.add_argument("--no-check", dest="check", action="store_false")
    parser.add_argument("--branches", action="store_true", help="per-branch times at the largest T")
    parser.add_argument("--eager-op", dest="compile_op", action="store_false",
                        help="run the op eagerly (each flex call still compiled) instead of compiling it whole")
    parser.add_argument("--deadline-s", type=float, default=1e9)
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    commit = args.commit
    install_flex_tuning()
    rows: list[Row] = []
    log: list[str] = []
    result = {"header": header(commit), "log": log, "rows": rows}
    try:
        for group in args.groups:
            Hq, Hkv = map(int, group.split(":"))
            for i, q_block in enumerate(args.sel_q_block):
                run_group(Hq, Hkv, args.sizes, FlexTiles(sel_q_block=q_block), args, rows, log, first=i == 0)
    finally:
        result["rows"] = [dataclasses.asdict(r) for r in rows]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(table(rows))
        print(f"total {time.monotonic() - START:.0f} s")


if __name__ == "__main__":
    main()
