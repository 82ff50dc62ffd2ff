"""The NSA op every implementation shares, its dispatch, and the NSAAttention module."""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from nsa_flex.compression import Compressor, compressed_seqlens
from nsa_flex.config import NSAConfig
from nsa_flex.flex.tuning import FlexTiles
from nsa_flex.folded import FoldedRows
from nsa_flex.projections import fused_linear
from nsa_flex.validate import check_compiled, check_inputs, needs_grad

IMPLS = ("auto", "reference", "flex")
"""auto: flex on CUDA, reference elsewhere. flex off CUDA runs forward-only (see resolve_impl)."""

# Reroutings already warned about: each is said once per process.
_ROUTED: set[str] = set()


def resolve_impl(impl: str, device: torch.device | str, needs_grad: bool = False,
                 dtype: torch.dtype | None = None) -> str:
    """The implementation that runs for `impl` on `device`: "reference" or "flex". Unknown values raise.

    "auto" is flex on CUDA and reference elsewhere, and reference for float64 inputs (`dtype`)
    on CUDA, where FlexAttention has no float64 kernels; "flex" with them raises. "flex" off CUDA
    with gradients needed runs the reference (FlexAttention has no CPU backward) and warns once
    per process.
    """
    on_cuda = torch.device(device).type == "cuda"
    fp64 = on_cuda and dtype == torch.float64
    match impl:
        case "auto":
            return "flex" if on_cuda and not fp64 else "reference"
        case "reference":
            return "reference"
        case "flex" if fp64:
            raise ValueError("impl='flex' got float64 inputs on CUDA; FlexAttention's CUDA kernels run float16, "
                             "bfloat16 and float32. Use impl='reference' (or 'auto') for float64")
        case "flex" if on_cuda or not needs_grad:
            return "flex"
        case "flex":
            if "flex" not in _ROUTED:
                _ROUTED.add("flex")
                warnings.warn("impl='flex' on CPU with gradients runs the reference implementation (FlexAttention "
                              "has no CPU backward); pass impl='auto' or 'reference' to choose it yourself",
                              stacklevel=3)
            return "reference"
        case _:
            raise ValueError(f"unknown impl {impl!r}; allowed: {', '.join(map(repr, IMPLS))}")


def nsa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    gates: torch.Tensor,
    *,
    config: NSAConfig,
    impl: str = "auto",
    block_indices: torch.Tensor | None = None,
    return_indices: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    k_win: torch.Tensor | None = None,
    v_win: torch.Tensor | None = None,
    compiled: bool = True,
):
    """Native Sparse Attention: gated sum of the compressed, selected and window branches.

    q [B,T,Hq,Dk], k [B,T,Hkv,Dk], v [B,T,Hkv,Dv], k_cmp [B,Tc,Hkv,Dk], v_cmp [B,Tc,Hkv,Dv]
    with Tc = max(0, (T - l) // d + 1), gates [B,T,Hq,3] (after the sigmoid; cmp, sel, win).
    Returns o [B,T,Hq,Dv], and with return_indices=True also the selection used,
    [B,Hkv,T,n] int (ascending block ids, -1 = unused slot).

    block_indices overrides the selection. cu_seqlens [n_docs+1] packs documents into one
    sequence (B == 1): no attention crosses a document boundary, k_cmp / v_cmp hold each
    document's compressed tokens in order, and block ids are document-local. k_win / v_win
    are the window branch's own keys and values when the branches have separate projections.
    impl chooses the implementation: "reference" (plain PyTorch, any device, gradients
    everywhere), "flex" (FlexAttention + the Triton selection op; on CPU forward only, so with
    gradients there the reference runs) or "auto" (flex on CUDA, reference elsewhere); see
    resolve_impl. compiled (flex on CUDA): run the op as one compiled graph per shape (the
    default; the first call of each shape compiles) or, False, as eager glue around its compiled
    Flex calls and Triton ops (see nsa_flex.flex.compiled). Inside torch.compile it has no effect.
    """
    check_compiled(compiled)
    if not torch.compiler.is_compiling():
        # Value checks read tensors on the host; under torch.compile only shapes are checked.
        check_inputs(q, k, v, k_cmp, v_cmp, gates, config, block_indices, cu_seqlens, k_win, v_win)
    grad = needs_grad(q, k, v, k_cmp, v_cmp, gates, k_win, v_win)
    match resolve_impl(impl, q.device, grad, q.dtype):
        case "reference":
            from nsa_flex import reference

            if cu_seqlens is None:
                o, sel = reference.nsa_reference(q, k, v, k_cmp, v_cmp, gates, config, block_indices, k_win, v_win)
            else:
                o, sel = reference.nsa_reference_varlen(
                    q, k, v, k_cmp, v_cmp, gates, config, cu_seqlens,
                    compressed_seqlens(cu_seqlens, config), block_indices, k_win, v_win,
                )
        case "flex":
            from nsa_flex import flex
            from nsa_flex.flex import compiled as compiled_path

            o, sel = compiled_path.run(flex.nsa_flex, compiled, q, k, v, k_cmp, v_cmp, gates, config,
                                       block_indices=block_indices, cu_seqlens=cu_seqlens, k_win=k_win, v_win=v_win)
    return (o, sel) if return_indices else o


class Projected(NamedTuple):
    """A layer's projections of x: q [B,T,Hq,Dk] and each branch's keys/values [B,T,Hkv,D]."""

    q: torch.Tensor
    k_cmp: torch.Tensor  # the cmp branch's keys before RoPE: phi's input
    v_cmp: torch.Tensor
    k_sel: torch.Tensor
    v_sel: torch.Tensor
    k_win: torch.Tensor
    v_win: torch.Tensor


class Gate(nn.Module):
    """Sigmoid gates, one per branch per query head, from the layer input.

    The last layer starts Xavier-uniform with gain 0.1 and zero bias, so gates start near
    0.5 and still vary across tokens.
    """

    def __init__(self, dim: int, n_heads: int, hidden: int | None = None):
        super().__init__()
        hidden = hidden or max(16, dim // 4)
        self.n_heads = n_heads
        self.hidden = nn.Linear(dim, hidden)
        self.out = nn.Linear(hidden, n_heads * 3)
        nn.init.xavier_uniform_(self.out.weight, gain=0.1)
        nn.init.zeros_(self.out.bias)

    def forward(self, x_btc: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_btc.shape
        return torch.sigmoid(self.out(nn.functional.silu(self.hidden(x_btc)))).view(B, T, self.n_heads, 3)


class NSAAttention(nn.Module):
    """An NSA attention layer: projections, compression phi, gates, output projection.

    x [B, T, dim] -> [B, T, dim]. `impl` picks the implementation of the op (see nsa_attention);
    after each eager forward `last_impl` names the one that ran ("reference" or "flex").
    `compiled`: on CUDA the flex branches run as one compiled graph per shape (see nsa_attention).
    `tiles`: the flex path's speed knobs (flex.FlexTiles; None: its defaults).
    `rotary`, if given, is a callable (q, k) -> (q, k) applied to the selected/window keys and
    all queries; the compressed keys come from the un-rotated keys, since phi's intra-block
    position encoding already tells it where inside a block each token sits.
    """

    def __init__(self, config: NSAConfig, dim: int, *, impl: str = "auto", bias: bool = False, compiled: bool = True,
                 tiles: "FlexTiles | None" = None):
        super().__init__()
        if not isinstance(config, NSAConfig):
            raise TypeError(f"config must be an NSAConfig, got {type(config).__name__}; build one with "
                            "NSAConfig(**settings) or take a preset from nsa_flex.PRESETS")
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise TypeError(f"dim={dim!r}: must be a positive integer, got {type(dim).__name__}")
        if dim <= 0:
            raise ValueError(f"dim={dim}: must be a positive integer")
        # Unknown values fail here, not at the first forward.
        resolve_impl(impl, "cpu")
        check_compiled(compiled)
        if tiles is not None and not isinstance(tiles, FlexTiles):
            raise TypeError(f"tiles must be a FlexTiles or None, got {type(tiles).__name__}")
        self.config, self.dim, self.impl, self.compiled = config, dim, impl, compiled
        self.tiles = FlexTiles() if tiles is None else tiles
        self.last_impl: str | None = None
        Hq, Hkv, Dk, Dv = config.n_heads, config.n_kv_heads, config.head_dim, config.dv
        self.wq = nn.Linear(dim, Hq * Dk, bias=bias)
        # One K/V projection for all branches, or one per branch (paper section 3.3.3).
        n_kv = 3 if config.separate_kv else 1
        self.wk = nn.ModuleList(nn.Linear(dim, Hkv * Dk, bias=bias) for _ in range(n_kv))
        self.wv = nn.ModuleList(nn.Linear(dim, Hkv * Dv, bias=bias) for _ in range(n_kv))
        self.compress_k = Compressor(config, Dk)
        self.compress_v = Compressor(config, Dv)
        self.gate = Gate(dim, Hq)
        self.wo = nn.Linear(Hq * Dv, dim, bias=bias)
        nn.init.normal_(self.wo.weight, std=0.02 / math.sqrt(2))

    def project(self, x_btc: torch.Tensor, rotary=None) -> Projected:
        """x [B,T,dim] -> Projected (heads split).

        k_cmp / v_cmp are phi's inputs (never rotated); `rotary(q, k) -> (q, k)` is applied to the
        queries and the selected/window keys. Decoding calls this with RoPE at explicit positions.
        """
        cfg = self.config
        B, T, _ = x_btc.shape
        q, *kv = fused_linear(x_btc, [self.wq, *self.wk, *self.wv])
        q = q.view(B, T, cfg.n_heads, cfg.head_dim)
        ks = [k.view(B, T, cfg.n_kv_heads, cfg.head_dim) for k in kv[:len(self.wk)]]
        vs = [v.view(B, T, cfg.n_kv_heads, cfg.dv) for v in kv[len(self.wk):]]
        # Branch order of the projections: cmp, sel, win (all the same one when shared).
        k_c, k_s, k_w = (ks * 3)[:3] if len(ks) == 1 else ks
        v_c, v_s, v_w = (vs * 3)[:3] if len(vs) == 1 else vs
        if rotary is not None:
            q_rot, k_s = rotary(q, k_s)
            k_w = rotary(q, k_w)[1] if len(ks) > 1 else k_s
            q = q_rot
        return Projected(q, k_c, v_c, k_s, v_s, k_w, v_w)

    def forward(self, x_btc: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None, rotary=None,
                return_indices: bool = False):
        self._check_input(x_btc)
        y, sel, _, _ = self.attend(x_btc, self.project(x_btc, rotary), cu_seqlens=cu_seqlens)
        return (y, sel) if return_indices else y

    def attend(self, x_btc: torch.Tensor, pr: Projected, *, cu_seqlens: torch.Tensor | None = None,
               block_indices: torch.Tensor | None = None):
        """The layer after its projections: phi, the op, gates, output projection.

        Returns (y [B,T,dim], selection [B,Hkv,T,n], k_cmp, v_cmp [B,Tc,Hkv,*]); the training
        forward and decoding's prefill (which keeps k_cmp / v_cmp in its cache) both run this.
        block_indices overrides the selection (see nsa_attention).
        """
        cfg = self.config
        impl = resolve_impl(self.impl, x_btc.device, needs_grad(x_btc, self.wq.weight), self.wq.weight.dtype)
        if not torch.compiler.is_compiling():
            self.last_impl = impl
        B, T, _ = x_btc.shape
        k_cmp = self.compress_k(pr.k_cmp, cu_seqlens)
        v_cmp = self.compress_v(pr.v_cmp, cu_seqlens)
        k_win, v_win = (pr.k_win, pr.v_win) if cfg.separate_kv else (None, None)
        if impl == "flex":
            y, sel = self._attend_flex(x_btc, pr.q, pr.k_sel, pr.v_sel, k_cmp, v_cmp, k_win, v_win, cu_seqlens,
                                       block_indices)
        else:
            o, sel = nsa_attention(pr.q, pr.k_sel, pr.v_sel, k_cmp, v_cmp, self.gate(x_btc), config=cfg, impl=impl,
                                   block_indices=block_indices, return_indices=True, cu_seqlens=cu_seqlens,
                                   k_win=k_win, v_win=v_win)
            y = self.wo(o.reshape(B, T, cfg.n_heads * cfg.dv))
        return y, sel, k_cmp, v_cmp

    def _check_input(self, x_btc) -> None:
        if not isinstance(x_btc, torch.Tensor):
            raise TypeError(f"NSAAttention input must be a torch.Tensor [B, T, dim={self.dim}], "
                            f"got {type(x_btc).__name__}")
        if x_btc.dim() != 3 or x_btc.shape[-1] != self.dim:
            raise ValueError(f"NSAAttention input has shape {tuple(x_btc.shape)}; expected [B, T, dim={self.dim}]")
        weight = self.wq.weight
        # Under autocast the matmuls cast for themselves.
        if x_btc.dtype != weight.dtype and not torch.is_autocast_enabled(x_btc.device.type):
            raise TypeError(f"NSAAttention input has dtype {x_btc.dtype} but the layer's weights are {weight.dtype}; "
                            f"cast one to the other (x.to({weight.dtype}) or layer.to({x_btc.dtype})), "
                            "or run under torch.autocast")
        if x_btc.device != weight.device:
            raise ValueError(f"NSAAttention input is on {x_btc.device} but the layer's weights are on "
                             f"{weight.device}; move one to the other (x.to(...) or layer.to(...))")

    def _attend_flex(self, x_btc, q, k, v, k_cmp, v_cmp, k_win, v_win, cu_seqlens, block_indices):
        """The flex op's branches, then gates, gated sum and output projection, keeping neither the
        sum nor the gate MLP's activations for the backward (~74 MiB per layer of seeds-125m at 32k
        tokens; docs/decisions.md, "Training memory"): the backward recomputes the gates from x,
        and the sum and wo from the branch outputs the branches keep anyway (one checkpointed
        region). Where the window and selected branches and the gated sum run as one node
        (flex.nsa_flex_branches with gates), the region only stands in for wo: its input is the
        node's sum made again, and the output's gradient reaches the node through _IntoGatedSum."""
        from nsa_flex import flex
        from nsa_flex.flex import compiled as compiled_path

        cfg = self.config
        B, T, _ = x_btc.shape
        if not torch.compiler.is_compiling():
            # The gates are made below: their shape stands in for the checks.
            gates_shape = q.new_zeros(()).expand(B, T, cfg.n_heads, 3)
            check_inputs(q, k, v, k_cmp, v_cmp, gates_shape, cfg, block_indices, cu_seqlens, k_win, v_win)
        if not needs_grad(x_btc, q, k, v, k_cmp, v_cmp, k_win, v_win, *self.gate.parameters(), *self.wo.parameters()):
            # Nothing to recompute: the flex op with its gates, in its order without gradients
            # (under torch.no_grad, or a frozen layer with grad mode on).
            o, sel = compiled_path.run(flex.nsa_flex, self.compiled, q, k, v, k_cmp, v_cmp, self.gate(x_btc), cfg,
                                       block_indices=block_indices, cu_seqlens=cu_seqlens, k_win=k_win, v_win=v_win,
                                       tiles=self.tiles)
            return self.wo(o.reshape(B, T, cfg.n_heads * cfg.dv)), sel
        gates = checkpoint(self.gate, x_btc, use_reentrant=False)
        o_cmp, o_sel, o_win, sel, gated = compiled_path.run(
            flex.nsa_flex_branches, self.compiled, q, k, v, k_cmp, v_cmp, cfg, gates=gates,
            block_indices=block_indices, cu_seqlens=cu_seqlens, k_win=k_win, v_win=v_win, tiles=self.tiles)

        def output(cmp_rows, o_sel, o_win, gates):
            o = flex.gated_sum(FoldedRows(cmp_rows, o_cmp.head), o_sel, o_win, gates,
                               impl=gated.impl if gated is not None else "auto", sel_folded=gated is not None)
            return self.wo(o.reshape(B, T, cfg.n_heads * cfg.dv))

        if gated is None:
            return checkpoint(output, o_cmp.x, o_sel, o_win, gates, use_reentrant=False), sel
        # The node's gradients flow from its own sum: the region's inputs are cut from the graph.
        y = checkpoint(output, o_cmp.x.detach(), o_sel, o_win, gates.detach(), use_reentrant=False)
        return _IntoGatedSum.apply(y, gated.o, self.wo.weight), sel


class _IntoGatedSum(torch.autograd.Function):
    """y = wo(o) with o = the gated node's sum, given y made from a copy of o that carries no
    gradient to the node: the value is y's; the output's gradient dy goes on to y (wo's own
    gradients) and, as dy W, to o. Neither saves o: its value is never read, so a compiled
    block's partitioner keeps nothing of it either."""

    @staticmethod
    def forward(ctx, y, o, weight):
        ctx.save_for_backward(weight)
        ctx.o_meta = (o.shape, o.dtype)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        weight, = ctx.saved_tensors
        shape, dtype = ctx.o_meta
        return dy, (dy @ weight.to(dy.dtype)).to(dtype).view(shape), None
