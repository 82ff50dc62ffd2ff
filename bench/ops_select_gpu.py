"""Check and time nsa_flex::select_blocks (the Triton kernel) on a CUDA GPU.

    python -m bench.ops_select_gpu --out runs/bench/ops_select.json

For each shape: the kernel's indices against the torch twin's (rows identical, and rows that
differ checked to be near-ties against fp64 importance), then the time of one call, against
materialising the [T, Tc] scores as one dense matmul (what the kernel avoids). A sweep of
tile settings runs first at the largest shape; the table uses the op's own defaults
(select_triton.launch_config) so it measures what users get. Also checks that
flex_attention's lse is in natural log on this torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import subprocess
import time
from pathlib import Path

import torch

from bench.common import json_saver
from nsa_flex.ops.select.checks import assert_same_selection, importance_scores, importance_tolerance

from nsa_flex.blocks import cmp_block_last_token, num_cmp_blocks, num_sel_blocks
from nsa_flex.config import NSAConfig
from nsa_flex.ops import select_blocks, select_blocks_torch
from nsa_flex.ops.select import kernels as select_triton


@dataclasses.dataclass
class Row:
    T: int
    Hq: int
    Hkv: int
    Dk: int
    dtype: str
    ms: float
    score_tflops: float
    dense_scores_ms: float
    first_call_s: float
    rows_identical: float
    rows_near_tie: int


def make_inputs(T, Hq, Hkv, Dk, dtype, config, seed=0):
    """Random q, k_cmp (unit-variance rows) and the fp32 lse of the visible compressed scores."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    Tc = num_cmp_blocks(T, config)
    q = torch.randn(1, T, Hq, Dk, device="cuda", generator=g).to(dtype)
    k_cmp = torch.randn(1, Tc, Hkv, Dk, device="cuda", generator=g).to(dtype)
    scale = Dk ** -0.5
    lse = torch.empty(1, Hq, T, device="cuda")
    k_hdc = k_cmp[0].float().permute(1, 2, 0).repeat_interleave(Hq // Hkv, dim=0)
    last = cmp_block_last_token(Tc, config, "cuda")
    for t0 in range(0, T, 1024):
        t1 = min(T, t0 + 1024)
        s = scale * (q[0, t0:t1].float().transpose(0, 1) @ k_hdc)
        vis = last[None, :] <= torch.arange(t0, t1, device="cuda")[:, None]
        lse[0, :, t0:t1] = torch.logsumexp(s.masked_fill(~vis, -math.inf), dim=-1)
    return q, k_cmp, lse


def check_against_twin(q, k_cmp, lse, config, got) -> tuple[float, int]:
    """(fraction of rows identical to the twin, rows that differ); raises unless they are near-ties."""
    twin = select_blocks_torch(q, k_cmp, lse, config)
    differ = (got != twin).any(-1)[0]  # [Hkv, T]
    hs, ts = differ.nonzero(as_tuple=True)
    if hs.numel():
        hs, ts = hs[:512], ts[:512]
        scores, tol = row_scores(q, k_cmp, lse, config, hs, ts)
        assert_same_selection(got[0, hs, ts][None, None], twin[0, hs, ts].long()[None, None], scores[None, None], tol)
    return 1.0 - differ.float().mean().item(), int(differ.sum())


def row_scores(q, k_cmp, lse, config, hs, ts):
    """fp64 importance [R, Ns] of the (kv head, token) rows given, and their tolerance."""
    T, Hq, Dk = q.shape[1], q.shape[2], q.shape[3]
    Hkv, Tc = k_cmp.shape[2], k_cmp.shape[1]
    G, scale = Hq // Hkv, Dk ** -0.5
    heads = hs[:, None] * G + torch.arange(G, device=q.device)  # [R, G]
    q_rgd = q[0, ts[:, None], heads].double()
    k_rdc = k_cmp[0, :, hs].double().permute(1, 2, 0)
    s = scale * (q_rgd @ k_rdc)  # [R, G, Tc]
    vis = cmp_block_last_token(Tc, config, q.device)[None, None, :] <= ts[:, None, None]
    s_minus_lse = s - lse[0, heads, ts[:, None]].double()[..., None]
    p = torch.where(vis, torch.exp(s_minus_lse), 0.0)
    # Rows as the query positions of one batch entry: [1, G, R, Tc] -> [1, 1, R, Ns].
    scores = importance_scores(p.permute(1, 0, 2)[None], T, G, config, t=ts)[0, 0]
    abs_dot = scale * q_rgd.norm(dim=-1).max().item() * k_rdc.norm(dim=1).max().item()
    finite = torch.where(vis, s_minus_lse.abs(), 0.0).max().item()
    BS = select_triton.launch_config(G, Dk, config.n_selected)["BS"]
    bits = select_triton.list_tile_bits(num_sel_blocks(T, config), BS)
    return scores, importance_tolerance(Dk, G, config, abs_dot, finite, cleared_bits=bits)


def time_ms(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100)


def score_flops(T, Hq, Dk, config) -> float:
    """2 Dk flops per visible (query head, compressed key) pair."""
    Tc = num_cmp_blocks(T, config)
    last = cmp_block_last_token(Tc, config).double()
    visible_pairs = (T - last).clamp(min=0).sum().item()
    return 2.0 * Dk * Hq * visible_pairs


def bench_shape(T, Hq, Hkv, Dk, dtype, config) -> Row:
    q, k_cmp, lse = make_inputs(T, Hq, Hkv, Dk, dtype, config)

    def run():
        return select_blocks(q, k_cmp, lse, config)

    start = time.perf_counter()
    got = run()
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    identical, near = check_against_twin(q, k_cmp, lse, config, got)
    ms = time_ms(run)
    dense = time_ms(lambda: q[0].transpose(0, 1) @ k_cmp[0].permute(1, 2, 0).repeat_interleave(Hq // Hkv, dim=0))
    return Row(T, Hq, Hkv, Dk, str(dtype).replace("torch.", ""), ms, score_flops(T, Hq, Dk, config) / ms / 1e9,
               dense, first, identical, near)


def sweep(T, Hq, Hkv, Dk, dtype, config, settings) -> list[dict]:
    """Times of tile settings (tokens per program BT, BS, DEPTH, warps, stages) at one shape.

    bench/select_gpu.py compares settings in more detail (equality to the twin, near-ties).
    """
    q, k_cmp, lse = make_inputs(T, Hq, Hkv, Dk, dtype, config)
    default = select_blocks(q, k_cmp, lse, config)
    out = []
    for BT, BS, DEPTH, warps, stages in settings:
        tiles = {"BT": BT, "BS": BS, "DEPTH": DEPTH, "num_warps": warps, "num_stages": stages}

        def run():
            return select_triton.select_blocks_triton(q, k_cmp, lse, None, None, Dk ** -0.5, config, tiles)

        try:
            out.append({**tiles, "ms": time_ms(run), "same_as_default": torch.equal(run(), default)})
        except Exception as e:  # a setting that does not compile is reported, not fatal
            out.append({**tiles, "error": f"{type(e).__name__}: {str(e)[:200]}"})
        print(out[-1], flush=True)
    return out


def flex_lse_base() -> dict:
    """flex_attention(return_lse=True) against torch.logsumexp of the same scores."""
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = (torch.randn(1, 2, 256, 64, device="cuda") for _ in range(3))
    _, lse = torch.compile(flex_attention)(q, k, v, return_lse=True)
    natural = torch.logsumexp((q @ k.transpose(-1, -2)) * 64 ** -0.5, dim=-1)
    return {"max_abs_diff_to_natural_log": (lse - natural).abs().max().item(),
            "max_abs_diff_to_log2": (lse - natural / math.log(2)).abs().max().item()}


def header() -> dict:
    import triton

    git = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "nsa_flex"], capture_output=True, text=True).stdout
    commit = git.stdout.strip() if git.returncode == 0 else "unknown (no git checkout here)"
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": commit + (" + uncommitted changes in nsa_flex/" if dirty.strip() else "")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sweep", action="store_true", help="time several tile settings at 64k first")
    args = parser.parse_args()
    config = NSAConfig()
    result = {**header(), "config": dataclasses.asdict(config), "rows": []}
    save = json_saver(args.out, result)

    rows = []
    for Hq in (64, 16):
        for T in (8192, 16384, 32768, 65536):
            rows.append(bench_shape(T, Hq, 4, 128, torch.bfloat16, config))
            result["rows"].append(dataclasses.asdict(rows[-1]))
            print(rows[-1], flush=True)
            save()
    print("| T | Hq/Hkv | ms | score TFLOP/s | dense q.k_cmp ms | rows = twin | near-tie rows |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.T} | {r.Hq}/{r.Hkv} | {r.ms:.3f} | {r.score_tflops:.0f} | {r.dense_scores_ms:.2f} | "
              f"{r.rows_identical:.6f} | {r.rows_near_tie} |")
    try:
        result["flex_lse"] = flex_lse_base()
    except Exception as e:
        result["flex_lse"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    print("flex lse:", result["flex_lse"])
    save()
    if args.sweep:
        # The first of each: launch_config's tiles.
        result["sweep_g16_64k"] = sweep(65536, 64, 4, 128, torch.bfloat16, config, [
            (8, 16, 4, 4, 2), (8, 16, 4, 4, 3), (16, 16, 4, 8, 3), (8, 32, 4, 4, 2), (4, 16, 4, 4, 2)])
        save()
        result["sweep_g4_64k"] = sweep(65536, 16, 4, 128, torch.bfloat16, config, [
            (16, 16, 4, 4, 2), (16, 16, 4, 4, 3), (32, 16, 4, 8, 3), (8, 16, 4, 4, 2)])
        save()


if __name__ == "__main__":
    main()
