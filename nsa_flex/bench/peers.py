"""Peers timed beside nsa-flex when their optional packages are importable (never required).

- fla (`pip install fla-core`): `fla.ops.nsa.parallel_nsa`, Triton. It computes its own
  compressed branch (mean-pooled blocks of l' tokens, no overlap, no learned phi) and its
  own top-n, then the selected branch; its window branch needs flash-attn and is left off
  (window_size=0). So it does less work than NSA and a different function: its check runs
  the selected branch alone on the reference's selection.
- lucidrains (`pip install native-sparse-attention-pytorch`): the `SparseAttention` module
  with its Triton kernel; projections, compression MLPs and the branch-combining gates are
  part of what is timed. Checked against its own fp32 PyTorch path (self-consistency only).
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import replace

import torch

from nsa_flex.attention import nsa_attention
from nsa_flex.bench.flops import nsa_flops
from nsa_flex.bench.impls import (CHECK_TOL, Built, Check, Impl, Problem, module_leaves, nsa_fwd_flops, nsa_inputs,
                                  rel_err)


def importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _fla_unavailable(cfg) -> str | None:
    if cfg.device != "cuda":
        return "needs CUDA (Triton kernels)"
    if not importable("fla"):
        return "fla not installed (optional: pip install fla-core)"
    G = cfg.nsa.group_size
    if G < 16 or G & (G - 1):
        return f"fla's parallel_nsa needs G = Hq/Hkv a power of 2 >= 16, got G={G}"
    return None


def _fla_call(q, k, v, cfg, **kwargs) -> torch.Tensor:
    from fla.ops.nsa import parallel_nsa

    return parallel_nsa(q, k, v, block_counts=cfg.nsa.n_selected, block_size=cfg.nsa.sel_block,
                        window_size=0, **kwargs)


def _fla_build(p: Problem) -> Built:
    x = nsa_inputs(p, grad=p.grad)
    q, k, v = x["q"], x["k"], x["v"]
    g_cmp, g_slc = (torch.sigmoid(torch.randn(q.shape[:3], device=p.device, dtype=p.dtype)).requires_grad_(p.grad)
                    for _ in range(2))
    return Built(lambda: _fla_call(q, k, v, p.cfg, g_cmp=g_cmp, g_slc=g_slc), [q, k, v, g_cmp, g_slc],
                 "cmp = mean pool of l' tokens + own top-n + sel; no window branch")


def _fla_check(p: Problem) -> Check:
    cfg = p.cfg.nsa
    x = nsa_inputs(p, grad=False)
    x32 = {name: t.float() for name, t in x.items()}
    # Gates (0, 1, 0) leave the reference's selected branch alone.
    x32["gates"] = torch.zeros_like(x32["gates"])
    x32["gates"][..., 1] = 1
    with torch.no_grad():
        ref, sel = nsa_attention(**x32, config=cfg, impl="reference", return_indices=True)
        # fla takes block indices as [B, T, Hkv, n]; -1 slots are skipped by its kernel.
        out = _fla_call(x["q"], x["k"], x["v"], p.cfg, block_indices=sel.permute(0, 2, 1, 3).contiguous())
    return Check("selected branch vs reference fp32 on the same selection", rel_err(out, ref),
                 CHECK_TOL[p.cfg.dtype], "cmp branch differs by design, no window branch")


def _fla_flops(cfg, T: int) -> float:
    # fla's own work: cmp over mean-pooled blocks of l' (stride l'), sel, no window.
    nsa = replace(cfg.nsa, cmp_block=cfg.nsa.sel_block, cmp_stride=cfg.nsa.sel_block)
    return nsa_flops(cfg.batch, T, nsa, branches=("cmp", "sel"))


def _lucidrains_unavailable(cfg) -> str | None:
    nsa = cfg.nsa
    if cfg.device != "cuda":
        return "needs CUDA (Triton kernel)"
    if not importable("native_sparse_attention_pytorch"):
        return "native_sparse_attention_pytorch not installed (optional: pip install native-sparse-attention-pytorch)"
    if nsa.head_dim != nsa.dv or nsa.head_dim > 128:
        return f"needs head_dim == head_dim_v <= 128, got {nsa.head_dim} / {nsa.dv}"
    if 16 % nsa.group_size or nsa.sel_block % 16:
        return (f"its Triton kernel needs G dividing 16 and l' a multiple of 16, "
                f"got G={nsa.group_size}, l'={nsa.sel_block}")
    if cfg.dtype == "fp32":
        return "its Triton kernel runs bf16/fp16 only"
    return None


def _lucidrains_module(p: Problem) -> torch.nn.Module:
    from native_sparse_attention_pytorch import SparseAttention

    nsa = p.cfg.nsa
    module = SparseAttention(
        dim=p.cfg.module_dim, dim_head=nsa.head_dim, heads=nsa.n_heads, kv_heads=nsa.n_kv_heads,
        sliding_window_size=nsa.window, compress_block_size=nsa.cmp_block,
        compress_block_sliding_stride=nsa.cmp_stride, selection_block_size=nsa.sel_block,
        num_selected_blocks=nsa.n_selected, causal=True, use_triton_kernel=True,
    )
    return module.to(device=p.device, dtype=p.dtype)


def _lucidrains_build(p: Problem) -> Built:
    module = _lucidrains_module(p)
    x = torch.randn(p.cfg.batch, p.T, p.cfg.module_dim, device=p.device, dtype=p.dtype, requires_grad=p.grad)
    return Built(lambda: module(x), module_leaves(module, x, p.grad),
                 f"whole module, dim={p.cfg.module_dim}, projections included")


def _lucidrains_check(p: Problem) -> Check:
    module = _lucidrains_module(p)
    oracle = copy.deepcopy(module).float()
    x = torch.randn(p.cfg.batch, p.T, p.cfg.module_dim, device=p.device, dtype=p.dtype)
    with torch.no_grad():
        err = rel_err(module(x), oracle(x.float(), disable_triton_kernel=True))
    return Check("self-consistency: bf16 Triton vs its own fp32 PyTorch path", err, CHECK_TOL[p.cfg.dtype],
                 "not compared with the reference (different module); its top-n may pick other blocks in bf16")


PEER_IMPLS = (
    Impl("fla", "fla parallel_nsa (Triton): cmp (mean pool) + top-n + sel, no window",
         _fla_build, _fla_check, _fla_flops, "NSA effective of fla's work: cmp over l'-blocks + sel",
         _fla_unavailable, optional=True),
    Impl("lucidrains", "native_sparse_attention_pytorch SparseAttention module (Triton kernel)",
         _lucidrains_build, _lucidrains_check, nsa_fwd_flops, "NSA effective, attention only (approximate)",
         _lucidrains_unavailable, optional=True),
)
