"""The selected branch's memory-traffic floor on the GPU, against the Flex call and dense attention.

    python bench/traffic_floor_gpu.py --out $OUT/floor.json --shapes 1:8192:64:4:128 1:65536:64:4:128

A shape is B:T:Hq:Hkv:D. For each one, with the selection the selection op makes on random inputs:
- "load-only": a Triton kernel with one program per (token, kv head) that reads the K and V
  rows of that token's selected blocks (n blocks of l' keys) and nothing else, summing them so
  the loads stay. Any kernel that computes the branch one token per program (fla's
  parallel_nsa, Flex with one token per 16-row tile) moves at least these bytes, so its time
  is a floor for that design; bytes / time is the bandwidth it reaches.
- "load-only, same blocks": the same kernel where every token reads blocks 0..n-1: the bytes
  are the same, but all programs share them (the L2 at its best).
- the selected branch through Flex (its forward, mask given), and nsa_flex's whole forward;
- dense causal cuDNN SDPA forward, the reference of issue 3's targets.
Why: random selections of neighbouring tokens barely overlap, so the branch reads
~n * l' * (Dk + Dv) * 2 bytes per (token, kv head): 137 GB at T=64k, G=16. The script measures
whether that, not FLOPs, bounds the branch, and what it leaves for the other branches.
JSON is rewritten after every measurement.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from flex_gpu import bench_ms, dense_cudnn, header  # noqa: E402
from host_profile_gpu import make_inputs, parse_shape  # noqa: E402
from records import row_recorder, shape_script_parser  # noqa: E402

from nsa_flex.flex import fold, nsa_flex, selected_branch  # noqa: E402
from nsa_flex.flex.tuning import FlexTiles, install_flex_tuning  # noqa: E402


@triton.jit
def _load_selected_kernel(k_ptr, v_ptr, idx_ptr, out_ptr, T,
                          s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_ib, s_ih, s_it,
                          N: tl.constexpr, L: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    rows = tl.arange(0, L)
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    acc_k = tl.zeros([L, DK], tl.float32)
    acc_v = tl.zeros([L, DV], tl.float32)
    for i in range(N):
        blk = tl.load(idx_ptr + b * s_ib + h * s_ih + t * s_it + i)
        ok = blk >= 0
        pos = tl.maximum(blk, 0) * L + rows
        kk = tl.load(k_ptr + b * s_kb + h * s_kh + pos[:, None] * s_kt + dk[None, :], mask=ok & (pos[:, None] < T))
        vv = tl.load(v_ptr + b * s_vb + h * s_vh + pos[:, None] * s_vt + dv[None, :], mask=ok & (pos[:, None] < T))
        acc_k += kk.to(tl.float32)
        acc_v += vv.to(tl.float32)
    tl.store(out_ptr + (b * tl.num_programs(1) + h) * T + t, tl.sum(acc_k) + tl.sum(acc_v))


def load_selected(k_bthd, v_bthd, idx_bhtn, L: int) -> torch.Tensor:
    B, T, H, DK = k_bthd.shape
    DV = v_bthd.shape[-1]
    out = torch.empty(B, H, T, device=k_bthd.device, dtype=torch.float32)
    _load_selected_kernel[(T, H, B)](
        k_bthd, v_bthd, idx_bhtn, out, T,
        k_bthd.stride(0), k_bthd.stride(1), k_bthd.stride(2), v_bthd.stride(0), v_bthd.stride(1), v_bthd.stride(2),
        idx_bhtn.stride(0), idx_bhtn.stride(1), idx_bhtn.stride(2),
        N=idx_bhtn.shape[-1], L=L, DK=DK, DV=DV, num_warps=4)
    return out


def main() -> None:
    args = shape_script_parser(__doc__, ["1:8192:64:4:128", "1:65536:64:4:128"]).parse_args()
    install_flex_tuning()
    _, add = row_recorder(args.out, header(args.commit) | {
        "what": "selected-branch traffic floor: load-only Triton kernel vs the Flex call vs dense cuDNN"})
    for shape in args.shapes:
        B, T, Hq, Hkv, D = parse_shape(shape)
        cfg, x = make_inputs(B, T, Hq, Hkv, D)
        L, n = cfg.sel_block, cfg.n_selected
        with torch.no_grad():
            _, sel = nsa_flex(**x, config=cfg)
        sel = sel.to(torch.int32).contiguous()
        k, v = x["k"].detach(), x["v"].detach()
        # Bytes each design must move: the listed blocks' keys that exist (causal tail of the own block included).
        valid = (sel >= 0).sum().item()
        bytes_moved = valid * L * (D + D) * k.element_size()
        same = torch.where(sel >= 0, torch.arange(n, device=sel.device, dtype=torch.int32), -1).contiguous()
        k_c, v_c = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))  # [B, Hkv, T, D] storage

        r = {"shape": shape, "G": Hq // Hkv, "selected_blocks": valid, "gbytes": round(bytes_moved / 1e9, 2)}
        for name, fn in [("load_only_ms", lambda: load_selected(k, v, sel, L)),
                         ("load_only_kv_contiguous_ms", lambda: load_selected(k_c, v_c, sel, L)),
                         ("load_only_same_blocks_ms", lambda: load_selected(k, v, same, L))]:
            r[name] = round(bench_ms(fn), 3)
            r[name.replace("_ms", "_tb_s")] = round(bytes_moved / r[name] / 1e9, 2)
        q_fold = fold(x["q"].detach(), Hkv)
        scale = D ** -0.5
        with torch.no_grad():
            for label, tiles in [("flex_sel_fwd_ms", FlexTiles(sel_q_block=16, split_initial=True)),
                                 ("flex_sel_fwd_no_split_ms", FlexTiles(sel_q_block=16, split_initial=False))]:
                r[label] = round(bench_ms(lambda tiles=tiles: selected_branch(q_fold, k, v, sel, cfg, scale, tiles,
                                                                             forced_initial=True)), 3)
            r["nsa_flex_fwd_ms"] = round(bench_ms(lambda: nsa_flex(**x, config=cfg)), 3)
            dense, dense_x = dense_cudnn(x, Hq // Hkv, requires_grad=False)
            r["dense_cudnn_fwd_ms"] = round(bench_ms(dense), 3)
            del dense, dense_x
        r["floor_vs_dense_fwd"] = round(r["load_only_ms"] / r["dense_cudnn_fwd_ms"], 3)
        add(r)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
