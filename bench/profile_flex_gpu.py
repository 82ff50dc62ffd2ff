"""Where the time of impl="flex" goes on the GPU: each step alone, tile variants, a kernel profile.

    python -m bench.profile_flex_gpu --T 65536 --out $OUT [--parts steps,variants,profile,compile]

Parts (each writes its JSON as soon as it is done, so a call cut short keeps what it measured):
  steps     every step of the eager op alone (fold, each mask build, each Flex call forward and
            forward+backward, the selection op, the gated sum), the eager op whole and dense
            cuDNN SDPA in the same run.
  variants  the same branch with other tiles or layouts: compressed branch with query rows
            split into S chunks as extra heads (more programs for its dK/dV loop), selected
            branch without block 0 (how much the block every query selects costs).
  profile   torch.profiler table of the eager op's forward+backward: top kernels by CUDA time.
  compile   compile time of the whole op under torch.compile(fullgraph=True) at --compile-T,
            in a subprocess cut off after --compile-timeout-s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import AuxRequest, flex_attention

from bench.common import bench_ms, inputs, peak_gib, run_limited

from nsa_flex import NSAConfig
from nsa_flex.flex import compressed_branch, fold, nsa_flex, selected_branch, window_branch
from nsa_flex.flex.masks import compressed_block_mask, selection_block_mask, window_block_mask
from nsa_flex.flex.masks.compressed import compressed_mask_mod
from nsa_flex.ops import select_blocks
from nsa_flex.flex.blockmask import grid_to_ordered, make_block_mask
from nsa_flex.flex.tuning import FlexTiles, install_flex_tuning

_flex = torch.compile(flex_attention, dynamic=False)


def save(out: Path, name: str, data) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))
    print(f"wrote {out / name}.json", flush=True)


def timed(fn, grad_out=None, inputs_=None) -> dict:
    """fwd ms, and fwd+bwd ms + peak GiB when grad_out is given."""
    r = {"fwd_ms": bench_ms(fn)}
    if grad_out is not None:
        def fb():
            torch.autograd.backward(fn(), grad_out, inputs=inputs_)
        fb()
        r["fwd_bwd_ms"] = bench_ms(fb)
        r["peak_gib"] = peak_gib(fb)
    return r


def part_steps(cfg: NSAConfig, T: int) -> dict:
    x = inputs(cfg, T)
    tiles = FlexTiles()
    scale = cfg.head_dim ** -0.5
    G, Hkv = cfg.group_size, cfg.n_kv_heads
    q, k, v, kc, vc, gates = (x[n] for n in ("q", "k", "v", "k_cmp", "v_cmp", "gates"))
    res: dict = {}

    def rec(name, fn, grad_out=None, inputs_=None):
        try:
            res[name] = timed(fn, grad_out, inputs_)
        except Exception as e:  # one failing step must not lose the others
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(name, res[name], flush=True)

    with torch.no_grad():
        rec("fold q", lambda: fold(q, Hkv))
        rec("cmp mask build", lambda: compressed_block_mask(T, kc.shape[1], cfg, q.device, tiles.cmp_block, G))
        rec("win mask build", lambda: window_block_mask(T, cfg.window, q.device, tiles.win_block, G))
        q_fold0 = fold(q, Hkv)
        _, lse = compressed_branch(q_fold0, kc, vc, cfg, scale, tiles)
        rec("selection op", lambda: select_blocks(q, kc, lse, cfg, scale=scale))
        sel = select_blocks(q, kc, lse, cfg, scale=scale)
        rec("sel mask build", lambda: selection_block_mask(sel, T, G, cfg, tiles.sel_rows(T, cfg)))
    q_fold = q_fold0.detach().requires_grad_(True)
    do_fold = torch.randn_like(q_fold[..., :cfg.dv])
    leaves = [q_fold, k, v, kc, vc]
    rec("cmp branch (mask + flex)", lambda: compressed_branch(q_fold, kc, vc, cfg, scale, tiles)[0], do_fold,
        [q_fold, kc, vc])
    rec("sel branch (mask + flex), one call", lambda: selected_branch(q_fold, k, v, sel, cfg, scale, tiles), do_fold,
        [q_fold, k, v])
    rec("sel branch (masks + flex), initial blocks split", lambda: selected_branch(
        q_fold, k, v, sel, cfg, scale, tiles, forced_initial=True), do_fold, [q_fold, k, v])
    rec("cmp branch (mask + flex), rows not chunked", lambda: compressed_branch(
        q_fold, kc, vc, cfg, scale, FlexTiles(max_chunks=1))[0], do_fold, [q_fold, kc, vc])
    rec("win branch (mask + flex)", lambda: window_branch(q_fold, k, v, cfg, scale, tiles), do_fold,
        [q_fold, k, v])
    with torch.no_grad():
        sel_mask = selection_block_mask(sel, T, G, cfg, tiles.sel_rows(T, cfg))
        win_mask = window_block_mask(T, cfg.window, q.device, tiles.win_block, G)
    from nsa_flex.flex import branches as F

    def call(fn, kk, vv, mask, branch):
        return F._call(fn, q_fold, kk, vv, mask, scale, branch)

    kT, vT = k.transpose(1, 2), v.transpose(1, 2)
    rec("sel flex only", lambda: call(F._flex_sel, kT, vT, sel_mask, "sel"), do_fold, [q_fold, k, v])
    rec("win flex only", lambda: call(F._flex_win, kT, vT, win_mask, "win"), do_fold, [q_fold, k, v])
    o3 = [torch.randn_like(q_fold[..., :cfg.dv]).requires_grad_(True) for _ in range(3)]

    def combine():
        return F.gated_sum(o3[0], [(o3[1], None)], o3[2], gates, T)

    do = torch.randn(1, T, cfg.n_heads, cfg.dv, device="cuda", dtype=q.dtype)
    rec("gated sum (eager)", combine, do, o3 + [gates])
    rec("gated sum (compiled)", lambda: F._COMPILED_SUM(o3[0], [(o3[1], None)], o3[2], gates, T), do, o3 + [gates])
    rec("whole op (eager, flex calls compiled)", lambda: nsa_flex(**x, config=cfg)[0], do, list(x.values()))
    rec("whole op (eager), initial blocks not split",
        lambda: nsa_flex(**x, config=cfg, tiles=FlexTiles(split_initial=False))[0], do, list(x.values()))
    rec("whole op (eager), cmp rows not chunked",
        lambda: nsa_flex(**x, config=cfg, tiles=FlexTiles(max_chunks=1))[0], do, list(x.values()))
    whole = torch.compile(lambda **x: nsa_flex(**x, config=cfg)[0], fullgraph=True, dynamic=False)
    t0 = time.monotonic()
    try:
        whole(**x).backward(do)
        torch.cuda.synchronize()
        res["whole op compile (fullgraph) s"] = round(time.monotonic() - t0, 1)
    except Exception as e:
        res["whole op compile (fullgraph) s"] = f"error: {type(e).__name__}: {str(e)[:300]}"
    rec("whole op (torch.compile fullgraph)", lambda: whole(**x), do, list(x.values()))
    del leaves
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qd, kd, vd = (x[n].detach().transpose(1, 2).requires_grad_(True) for n in ("q", "k", "v"))

    def dense():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)

    rec("dense cuDNN", dense, torch.randn_like(qd), [qd, kd, vd])
    return res


def chunked_cmp(q_fold, k_cmp_bhtd, v_cmp_bhtd, cfg: NSAConfig, scale: float, S: int, block=(128, 128), opts=None):
    """Compressed branch with the folded query rows split into S chunks that become extra heads.

    Flex's backward computes dK/dV in one program per kv block that walks every query row;
    with only Tc/128 blocks x Hkv heads that is ~128 long programs at 64k. As S heads each
    chunk gets its own programs (K/V copied S times: tiny for the compressed keys) and
    autograd's sum over the expanded copies adds the chunks' dK/dV.
    """
    B, Hkv, R, D = q_fold.shape
    G = cfg.group_size
    Tc = k_cmp_bhtd.shape[2]
    rows_c = R // S
    qc = q_fold.reshape(B, Hkv * S, rows_c, D)
    kc = k_cmp_bhtd[:, :, None].expand(B, Hkv, S, Tc, D).reshape(B, Hkv * S, Tc, D)
    vc = v_cmp_bhtd[:, :, None].expand(B, Hkv, S, Tc, v_cmp_bhtd.shape[-1]).reshape(B, Hkv * S, Tc, -1)
    base = compressed_mask_mod(cfg, G)

    def mask_mod(b, h, q_idx, kv_idx):
        return base(b, h, (h % S) * rows_c + q_idx, kv_idx)

    mask = _chunked_mask(R, Tc, cfg, G, S, Hkv, block, mask_mod, q_fold.device)
    o, aux = _flex(qc, kc, vc, block_mask=mask, scale=scale, return_aux=AuxRequest(lse=True),
                   kernel_options=opts or {"FORCE_USE_FLEX_ATTENTION": True})
    return o.reshape(B, Hkv, R, -1), aux.lse.reshape(B, Hkv, R)


def _chunked_mask(R, Tc, cfg, G, S, Hkv, block, mask_mod, device):
    qbs, kbs = block
    n_q, n_kv = R // qbs, -(-Tc // kbs)
    rows = torch.arange(n_q, device=device) * qbs
    t_first, t_last = rows // G, (rows + qbs - 1) // G
    c = torch.arange(n_kv, device=device)
    c_first = c * kbs
    c_last = torch.clamp(c * kbs + kbs, max=Tc) - 1
    last_off, d = cfg.cmp_block - 1, cfg.cmp_stride
    touched = c_first[None] * d + last_off <= t_last[:, None]
    full = c_last[None] * d + last_off <= t_first[:, None]
    partial = touched & ~full

    def heads(grid):  # [n_q, n_kv] -> [1, Hkv*S, n_q/S, n_kv]
        g = grid.view(S, n_q // S, n_kv)
        return g[None, None].expand(1, Hkv, S, n_q // S, n_kv).reshape(1, Hkv * S, n_q // S, n_kv)

    kv, full_kv = grid_to_ordered(heads(partial)), grid_to_ordered(heads(full))
    qq = grid_to_ordered(heads(partial).transpose(-1, -2))
    full_q = grid_to_ordered(heads(full).transpose(-1, -2))
    return make_block_mask((R // S, Tc), kv, full_kv, qq, full_q, block, mask_mod)


def part_variants(cfg: NSAConfig, T: int) -> dict:
    x = inputs(cfg, T)
    scale = cfg.head_dim ** -0.5
    G, Hkv = cfg.group_size, cfg.n_kv_heads
    q, k, v, kc, vc = (x[n] for n in ("q", "k", "v", "k_cmp", "v_cmp"))
    q_fold = fold(q.detach(), Hkv).requires_grad_(True)
    do_fold = torch.randn_like(q_fold[..., :cfg.dv])
    kcT, vcT = kc.detach().transpose(1, 2).requires_grad_(True), vc.detach().transpose(1, 2).requires_grad_(True)
    res: dict = {}

    def rec(name, fn, grad_out=None, inputs_=None):
        try:
            res[name] = timed(fn, grad_out, inputs_)
        except Exception as e:
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(name, res[name], flush=True)

    # Correctness of the chunked layout against the plain branch (forward and dK).
    ref_o, ref_lse = compressed_branch(q_fold, kc, vc, cfg, scale, FlexTiles())
    for S in (4, 16):
        o, lse = chunked_cmp(q_fold, kcT, vcT, cfg, scale, S)
        err = ((o.float() - ref_o.float()).abs().max().item(),
               (lse.view(1, Hkv, T, G).transpose(2, 3).reshape(1, -1, T) - ref_lse).abs().max().item())
        res[f"cmp chunked S={S} max err vs plain (o, lse)"] = err
        print(S, err, flush=True)
    rec("cmp plain 128x128", lambda: compressed_branch(q_fold, kc, vc, cfg, scale, FlexTiles())[0], do_fold,
        [q_fold, kc, vc])
    for S in (4, 16, 32):
        rec(f"cmp chunked S={S} 128x128", lambda S=S: chunked_cmp(q_fold, kcT, vcT, cfg, scale, S)[0], do_fold,
            [q_fold, kcT, vcT])
    opts64 = {"FORCE_USE_FLEX_ATTENTION": True, "fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 8,
              "fwd_num_stages": 3, "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
              "bwd_num_warps": 4, "bwd_num_stages": 3}
    for S in (1, 8):
        rec(f"cmp chunked S={S} 128x64 tiles64", lambda S=S: chunked_cmp(q_fold, kcT, vcT, cfg, scale, S, (128, 64),
                                                                         opts64)[0], do_fold, [q_fold, kcT, vcT])
    # Selected branch: the selection op's indices, and the same without block 0.
    with torch.no_grad():
        _, lse = compressed_branch(fold(q, Hkv), kc, vc, cfg, scale, FlexTiles())
        sel = select_blocks(q, kc, lse, cfg, scale=scale)
        no0 = torch.where(sel == 0, -1, sel)  # block 0 dropped: n-1 blocks, -1 where it was
    for name, idx in (("sel (real selection)", sel), ("sel without block 0", no0)):
        for qb in (16, 32, 64):
            tiles = FlexTiles(sel_q_block=qb)
            rec(f"{name} q_tile={qb}", lambda idx=idx, tiles=tiles: selected_branch(q_fold, k, v, idx, cfg, scale, tiles),
                do_fold, [q_fold, k, v])
            if name != "sel (real selection)":
                break
    return res


def part_profile(cfg: NSAConfig, T: int) -> dict:
    x = inputs(cfg, T)
    do = torch.randn(1, T, cfg.n_heads, cfg.dv, device="cuda", dtype=torch.bfloat16)

    def step():
        o = nsa_flex(**x, config=cfg)[0]
        torch.autograd.backward(o, do, inputs=list(x.values()))

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    rows = []
    for e in events:
        dev_us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if dev_us > 0:
            rows.append({"name": e.key[:160], "calls": e.count, "self_device_ms": dev_us / 1e3})
    rows.sort(key=lambda r: -r["self_device_ms"])
    total = sum(r["self_device_ms"] for r in rows)
    print(f"device time total {total:.1f} ms", flush=True)
    for r in rows[:30]:
        print(f"{r['self_device_ms']:8.2f} ms  x{r['calls']:<4} {r['name'][:120]}", flush=True)
    return {"device_total_ms": total, "kernels": rows[:60]}


def part_compile(T: int, timeout_s: float) -> dict:
    code = (
        "import time, torch;"
        "from nsa_flex import NSAConfig; from nsa_flex.flex import nsa_flex; from nsa_flex.flex.tuning import install_flex_tuning;"
        "from bench.common import inputs; install_flex_tuning();"
        f"cfg = NSAConfig(n_heads=64, n_kv_heads=4, head_dim=128); x = inputs(cfg, {T});"
        "op = torch.compile(lambda **x: nsa_flex(**x, config=cfg)[0], fullgraph=True, dynamic=False);"
        "t0 = time.monotonic(); o = op(**x); torch.cuda.synchronize(); t1 = time.monotonic();"
        "print('fwd_compile_s', round(t1 - t0, 1), flush=True);"
        "o.backward(torch.randn_like(o)); torch.cuda.synchronize(); t2 = time.monotonic();"
        "print('bwd_compile_s', round(t2 - t1, 1), flush=True)"
    )
    t0 = time.monotonic()
    status, out = run_limited([sys.executable, "-c", code], timeout_s, cwd=str(Path(__file__).resolve().parents[1]))
    res = {"T": T, "status": status, "wall_s": round(time.monotonic() - t0, 1), "output": out[-4000:]}
    print(res, flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=65536)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--parts", default="steps,variants,profile,compile")
    p.add_argument("--compile-T", type=int, default=8192)
    p.add_argument("--compile-timeout-s", type=float, default=240)
    p.add_argument("--commit", default="")
    args = p.parse_args()
    install_flex_tuning()
    cfg = NSAConfig(n_heads=64, n_kv_heads=4, head_dim=128)
    head = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": args.commit, "T": args.T}
    for part in args.parts.split(","):
        t0 = time.monotonic()
        print(f"== part {part}", flush=True)
        try:
            if part == "steps":
                data = part_steps(cfg, args.T)
            elif part == "variants":
                data = part_variants(cfg, args.T)
            elif part == "profile":
                data = part_profile(cfg, args.T)
            elif part == "compile":
                data = part_compile(args.compile_T, args.compile_timeout_s)
            else:
                raise SystemExit(f"unknown part {part!r}; allowed: steps, variants, profile, compile")
        except Exception as e:
            data = {"error": f"{type(e).__name__}: {str(e)[:1000]}"}
            print(data, flush=True)
        data = {"header": head, "part": part, "seconds": round(time.monotonic() - t0, 1), "result": data}
        save(args.out, f"profile_{part}_T{args.T}", data)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
