"""Implementations the attention suite can time: nsa-flex, the reference and the dense baselines.

Each `Impl` builds a closure over freshly drawn inputs (`build`), checks its output against
an fp32 oracle at a small length (`check`) and names its credited forward flops. Peers
(fla, lucidrains) live in peers.py and use the same record.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from nsa_flex import flex
from nsa_flex.attention import NSAAttention, nsa_attention
from nsa_flex.bench.flops import dense_causal_flops, nsa_flops
from nsa_flex.blocks import num_cmp_blocks
from nsa_flex.flex.tuning import FlexTiles

LONG_SEQ_TILES = FlexTiles(sel_impl="flex", sel_q_block=16, split_initial=True, initial_copy_tokens=512)
"""The Flex selected call (an option since the block-centric op is the default at every group) with
the tiles it takes past FlexTiles' short-sequence threshold, forced, and initial-key copies short
enough to be several at the check's length (see _nsa_op_check)."""

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Relative-error ceilings of the pre-timing check, ||out - oracle|| / ||oracle||: bf16
# operands land between 1e-3 and 1e-2, fp32 through the matrix units' TF32 mode near 3e-4;
# each ceiling leaves about 2x over the top of its band. A kernel bug is far larger.
CHECK_TOL = {"bf16": 2e-2, "fp16": 5e-3, "fp32": 1e-3}


@dataclass(frozen=True)
class Problem:
    """One input size of the sweep: the suite config and a sequence length."""

    cfg: object
    """AttentionBenchConfig (not imported: attention.py imports this module)."""
    T: int
    grad: bool = False
    """Inputs (and module parameters) that take gradients: fwd+bwd rows will run."""

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.cfg.dtype]

    @property
    def device(self) -> str:
        return self.cfg.device


@dataclass(frozen=True)
class Built:
    """A ready forward: fn() returns the output; `leaves` get gradients in fwd+bwd."""

    fn: Callable[[], torch.Tensor]
    leaves: list[torch.Tensor]
    note: str = ""


@dataclass(frozen=True)
class Check:
    what: str
    err: float
    tol: float
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.err <= self.tol

    def text(self) -> str:
        verdict = "ok" if self.ok else "MISMATCH"
        extra = f"; {self.detail}" if self.detail else ""
        return f"{verdict}: {self.what}, rel err {self.err:.1e} (tol {self.tol:.0e}){extra}"


@dataclass(frozen=True)
class Impl:
    name: str
    description: str
    build: Callable[[Problem], Built]
    check: Callable[[Problem], Check]
    fwd_flops: Callable[[object, int], float]
    """(cfg, T) -> forward flops credited to one call."""
    flops_basis: str
    unavailable: Callable[[object], str | None] = lambda cfg: None
    """(cfg) -> why it cannot run with this config, or None."""
    cpu_forward_only: bool = False
    """FlexAttention has no backward on CPU: fwd+bwd rows are skipped there."""
    optional: bool = False
    """A peer from an optional package: left out of the defaults when not importable."""


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64; inf when out has NaN/inf."""
    out, ref = out.double(), ref.double()
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def nsa_inputs(p: Problem, *, grad: bool) -> dict[str, torch.Tensor]:
    """q, k, v, k_cmp, v_cmp (random, Tc tokens: phi is not part of the op) and sigmoid gates."""
    nsa, B, T = p.cfg.nsa, p.cfg.batch, p.T
    Tc = num_cmp_blocks(T, nsa)
    Hq, Hkv, Dk, Dv = nsa.n_heads, nsa.n_kv_heads, nsa.head_dim, nsa.dv
    shapes = {"q": (B, T, Hq, Dk), "k": (B, T, Hkv, Dk), "v": (B, T, Hkv, Dv),
              "k_cmp": (B, Tc, Hkv, Dk), "v_cmp": (B, Tc, Hkv, Dv)}
    x = {name: torch.randn(s, device=p.device, dtype=p.dtype) for name, s in shapes.items()}
    x["gates"] = torch.sigmoid(torch.randn(B, T, Hq, 3, device=p.device, dtype=p.dtype))
    return {name: t.requires_grad_(grad) for name, t in x.items()}


def nsa_fwd_flops(cfg, T: int) -> float:
    return nsa_flops(cfg.batch, T, cfg.nsa)


def dense_fwd_flops(cfg, T: int) -> float:
    nsa = cfg.nsa
    return dense_causal_flops(cfg.batch, nsa.n_heads, T, nsa.head_dim, nsa.dv)


@functools.cache
def _compiled_nsa_attention():
    """nsa_attention as one graph, compiled once for the process (each new T specialises once)."""
    from nsa_flex.flex import tuning

    # The selected branch's backward needs the tile choices installed before compiling.
    tuning.install_flex_tuning()
    return torch.compile(nsa_attention, fullgraph=True, dynamic=False)


def _nsa_op(p: Problem, impl: str, compiled: bool) -> tuple[Callable[..., object], str]:
    """The op as a row calls it: inside the caller's fullgraph compile (--compile), or nsa_attention
    itself, whose flex path compiles one graph per shape on CUDA (compiled=False: eager glue)."""
    if impl == "flex" and p.cfg.compile and compiled:
        return _compiled_nsa_attention(), "whole op under torch.compile(fullgraph=True)"
    if impl == "flex" and torch.device(p.device).type == "cuda":
        return nsa_attention, "nsa_attention's compiled flex path" if compiled else "eager glue (compiled=False)"
    return nsa_attention, ""


def _nsa_op_build(impl: str, compiled: bool = True) -> Callable[[Problem], Built]:
    def build(p: Problem) -> Built:
        x = nsa_inputs(p, grad=p.grad)
        op, note = _nsa_op(p, impl, compiled)
        return Built(lambda: op(**x, config=p.cfg.nsa, impl=impl, compiled=compiled), list(x.values()), note)
    return build


def _nsa_op_check(impl: str, compiled: bool = True) -> Callable[[Problem], Check]:
    def check(p: Problem) -> Check:
        cfg = p.cfg.nsa
        x = nsa_inputs(p, grad=False)
        x32 = {name: t.float() for name, t in x.items()}
        op, _ = _nsa_op(p, impl, compiled)
        with torch.no_grad():
            o, sel = op(**x, config=cfg, impl=impl, return_indices=True, compiled=compiled)
            # Same selection as the tested run, so a near-tie flipped by rounding is no error.
            ref = nsa_attention(**x32, config=cfg, impl="reference", block_indices=sel.long())
            _, own = nsa_attention(**x32, config=cfg, impl="reference", return_indices=True)
        agree = float((sel.long() == own).all(-1).float().mean())
        err, note = rel_err(o, ref), f"selection = fp32 reference's on {agree:.1%} of queries"
        if impl == "flex":
            # The Flex selected call (an option) with its long-T tiles (16-row tiles, initial-key
            # copies), which the check length would not take, is checked too; the worse error counts.
            with torch.no_grad():
                o_long, sel_long = flex.nsa_flex(**x, config=cfg, tiles=LONG_SEQ_TILES)
                ref_long = ref if torch.equal(sel_long, sel) else nsa_attention(
                    **x32, config=cfg, impl="reference", block_indices=sel_long.long())
            err = max(err, rel_err(o_long, ref_long))
            note += "; also the Flex selected call's long-T tiles"
        return Check("vs reference fp32 given its selection", err, CHECK_TOL[p.cfg.dtype], note)
    return check


def _module_build(p: Problem) -> Built:
    layer = NSAAttention(p.cfg.nsa, p.cfg.module_dim, impl="flex").to(device=p.device, dtype=p.dtype)
    x = torch.randn(p.cfg.batch, p.T, p.cfg.module_dim, device=p.device, dtype=p.dtype, requires_grad=p.grad)
    note = f"dim={p.cfg.module_dim}, projections and phi included"
    return Built(lambda: layer(x), module_leaves(layer, x, p.grad), note)


def module_leaves(module: torch.nn.Module, x: torch.Tensor, grad: bool) -> list[torch.Tensor]:
    """x and the trainable parameters; without fwd+bwd rows nothing takes gradients."""
    if not grad:
        module.requires_grad_(False)
    return [x, *(w for w in module.parameters() if w.requires_grad)]


def _module_check(p: Problem) -> Check:
    layer = NSAAttention(p.cfg.nsa, p.cfg.module_dim, impl="flex").to(device=p.device, dtype=p.dtype)
    layer.requires_grad_(False)
    oracle = copy.deepcopy(layer).float()
    oracle.impl = "reference"
    x = torch.randn(p.cfg.batch, p.T, p.cfg.module_dim, device=p.device, dtype=p.dtype)
    with torch.no_grad():
        err = rel_err(layer(x), oracle(x.float()))
    return Check("vs reference module fp32 (own selection)", err, CHECK_TOL[p.cfg.dtype])


def dense_inputs(p: Problem, *, grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B,Hq,T,Dk], k [B,Hkv,T,Dk], v [B,Hkv,T,Dv]: SDPA's layout, so no transpose is timed."""
    nsa, B, T = p.cfg.nsa, p.cfg.batch, p.T
    q = torch.randn(B, nsa.n_heads, T, nsa.head_dim, device=p.device, dtype=p.dtype)
    k = torch.randn(B, nsa.n_kv_heads, T, nsa.head_dim, device=p.device, dtype=p.dtype)
    v = torch.randn(B, nsa.n_kv_heads, T, nsa.dv, device=p.device, dtype=p.dtype)
    return q.requires_grad_(grad), k.requires_grad_(grad), v.requires_grad_(grad)


def dense_oracle(q, k, v) -> torch.Tensor:
    """fp32 causal attention with kv heads repeated for their groups: [B,Hq,T,Dv]."""
    G = q.shape[1] // k.shape[1]
    q, k, v = q.float(), k.float().repeat_interleave(G, 1), v.float().repeat_interleave(G, 1)
    T = q.shape[2]
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return torch.softmax(s.masked_fill(~causal, float("-inf")), -1) @ v


def _sdpa_fn(backend, q, k, v) -> tuple[Callable[[], torch.Tensor], str]:
    """SDPA causal through `backend` (None: torch's choice), GQA native where it works."""
    from torch.nn.attention import sdpa_kernel

    def call(q, k, v, gqa):
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    # A 128-token probe tells whether the backend takes GQA as it is; if not, the kv heads
    # are repeated once here, outside the timed call.
    try:
        with torch.no_grad():
            call(q[:, :, :128], k[:, :, :128], v[:, :, :128], True)
    except RuntimeError:
        G = q.shape[1] // k.shape[1]
        k = k.detach().repeat_interleave(G, 1).requires_grad_(k.requires_grad)
        v = v.detach().repeat_interleave(G, 1).requires_grad_(v.requires_grad)
        return (lambda: call(q, k, v, False)), "kv heads repeated to Hq (backend lacks GQA)"
    return (lambda: call(q, k, v, True)), ""


def _sdpa_impl(backend_name: str | None) -> tuple[Callable[[Problem], Built], Callable[[Problem], Check]]:
    def backend():
        from torch.nn.attention import SDPBackend
        return None if backend_name is None else getattr(SDPBackend, backend_name)

    def build(p: Problem) -> Built:
        q, k, v = dense_inputs(p, grad=p.grad)
        fn, note = _sdpa_fn(backend(), q, k, v)
        return Built(fn, [q, k, v], note)

    def check(p: Problem) -> Check:
        q, k, v = dense_inputs(p, grad=False)
        fn, _ = _sdpa_fn(backend(), q, k, v)
        with torch.no_grad():
            return Check("vs fp32 dense causal", rel_err(fn(), dense_oracle(q, k, v)), CHECK_TOL[p.cfg.dtype])

    return build, check


@functools.cache
def _compiled_flex():
    """flex_attention compiled once for the process (each new T still specialises once)."""
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def _flex_dense_fn(p: Problem, q, k, v) -> Callable[[], torch.Tensor]:
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    mask = create_block_mask(causal, None, None, p.T, p.T, device=p.device, _compile=True)
    flex = _compiled_flex()
    return lambda: flex(q, k, v, block_mask=mask, enable_gqa=True)


def _flex_dense_build(p: Problem) -> Built:
    q, k, v = dense_inputs(p, grad=p.grad)
    return Built(_flex_dense_fn(p, q, k, v), [q, k, v])


def _flex_dense_check(p: Problem) -> Check:
    q, k, v = dense_inputs(p, grad=False)
    with torch.no_grad():
        out = _flex_dense_fn(p, q, k, v)()
    return Check("vs fp32 dense causal", rel_err(out, dense_oracle(q, k, v)), CHECK_TOL[p.cfg.dtype])


def _needs_cuda(cfg) -> str | None:
    return None if cfg.device == "cuda" else "needs CUDA"


_cudnn, _flash, _default = _sdpa_impl("CUDNN_ATTENTION"), _sdpa_impl("FLASH_ATTENTION"), _sdpa_impl(None)
_NSA = "NSA effective (flops.py)"
_DENSE = "dense causal (flops.py)"

OWN_IMPLS = (
    Impl("nsa-flex", "nsa_attention(impl='flex'): FlexAttention + the selection op",
         _nsa_op_build("flex"), _nsa_op_check("flex"), nsa_fwd_flops, _NSA, cpu_forward_only=True),
    Impl("nsa-flex-eager", "nsa_attention(impl='flex', compiled=False): eager glue around the compiled calls",
         _nsa_op_build("flex", compiled=False), _nsa_op_check("flex", compiled=False), nsa_fwd_flops, _NSA,
         cpu_forward_only=True),
    Impl("nsa-flex-module", "NSAAttention(impl='flex'): projections, phi, gates and the op",
         _module_build, _module_check, nsa_fwd_flops, _NSA + ", attention only", cpu_forward_only=True),
    Impl("reference", "nsa_attention(impl='reference'): dense masks, fp32 math, O(T^2) memory",
         _nsa_op_build("reference"), _nsa_op_check("reference"), nsa_fwd_flops, _NSA),
    Impl("dense-cudnn", "SDPA causal, cuDNN backend", *_cudnn, dense_fwd_flops, _DENSE, _needs_cuda),
    Impl("dense-flash", "SDPA causal, FlashAttention-2 backend", *_flash, dense_fwd_flops, _DENSE, _needs_cuda),
    Impl("dense", "SDPA causal, torch's choice of backend (runs on CPU)", *_default, dense_fwd_flops, _DENSE),
    Impl("flex-dense", "FlexAttention, causal BlockMask, compiled", _flex_dense_build, _flex_dense_check,
         dense_fwd_flops, _DENSE, cpu_forward_only=True),
)
