"""Decode for one NSAAttention layer: batched prefill into an NSACache, then one token a step.

`prefill` runs the layer's training path (its `impl`) over the right-padded prompts and fills
the cache in one go. `decode_step` takes one new token per sequence: it writes the token's
keys/values and compresses a new block where one just completed (nsa_flex::cache_step's work,
one Triton launch on CUDA), then runs the three branches for the one query and advances the
lengths (nsa_flex::decode_attend's, four Triton launches on CUDA), both in the one op
nsa_flex::step_attend; static shapes,
positions as tensors, no host synchronisation, so `torch.compile(mode="reduce-overhead")`
makes it one CUDA graph.

`rotary`, if given, is a callable (q [B,T,H,D], k [B,T,Hkv,D], positions [B,T]) -> (q, k):
RoPE at explicit positions, since the sequences of a decode batch sit at different ones.
With positions = arange(T) it must equal the `rotary(q, k)` the layer was trained with.
"""

from __future__ import annotations

from typing import Callable

import torch

from nsa_flex.attention import NSAAttention, Projected
from nsa_flex.decoding.cache import NSACache
from nsa_flex.ops import decode_attend_torch, phi_step, step_attend
from nsa_flex.ops.decode.cache_step import write_token_torch
# Re-exported: the selection rule of one decode query, now the op's torch twin.
from nsa_flex.ops.decode.attend import fold_to_sel_blocks, select_blocks_one  # noqa: F401

Rotary = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def project(layer: NSAAttention, x_btc: torch.Tensor, positions_bt: torch.Tensor, rotary: Rotary | None) -> Projected:
    """NSAAttention's projections, with RoPE at explicit positions [B, T]."""
    at_positions = None if rotary is None else (lambda q, k: rotary(q, k, positions_bt))
    return layer.project(x_btc, at_positions)


@torch.no_grad()
def prefill(layer: NSAAttention, cache: NSACache, x_btc: torch.Tensor, lengths: torch.Tensor, *,
            rotary: Rotary | None = None) -> torch.Tensor:
    """Runs the layer over right-padded prompts x [B,P,dim] and fills `cache`; returns y [B,P,dim].

    lengths [B]: real tokens of each prompt (1 <= lengths <= P). Causality makes y at
    t < lengths[b] independent of the padding; the cache then holds lengths[b] tokens.
    """
    check_prefill(layer, cache, x_btc, lengths)
    y, _, pr, k_cmp, v_cmp = _forward(layer, x_btc, rotary, None)
    _fill(cache, pr, k_cmp, v_cmp, lengths.to(device=cache.lengths.device, dtype=torch.int64))
    return y


@torch.no_grad()
def full_forward(layer: NSAAttention, x_btc: torch.Tensor, *, rotary: Rotary | None = None,
                 block_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's training path over x [B,T,dim] with this module's `rotary` convention:
    (y [B,T,dim], selection [B,Hkv,T,n]). block_indices overrides the selection (see nsa_attention)."""
    y, sel, *_ = _forward(layer, x_btc, rotary, block_indices)
    return y, sel


def _forward(layer: NSAAttention, x_btc: torch.Tensor, rotary: Rotary | None, block_indices):
    B, T, _ = x_btc.shape
    pr = project(layer, x_btc, torch.arange(T, device=x_btc.device).expand(B, T), rotary)
    y, sel, k_cmp, v_cmp = layer.attend(x_btc, pr, block_indices=block_indices)
    return y, sel, pr, k_cmp, v_cmp


def _fill(cache: NSACache, pr: Projected, k_cmp: torch.Tensor, v_cmp: torch.Tensor, lengths_b: torch.Tensor) -> None:
    P, Tc, l = pr.k_sel.shape[1], k_cmp.shape[1], cache.config.cmp_block
    cache.k[:, :, :P] = pr.k_sel.transpose(1, 2)
    cache.v[:, :, :P] = pr.v_sel.transpose(1, 2)
    if cache.config.separate_kv:
        cache.k_win[:, :, :P] = pr.k_win.transpose(1, 2)
        cache.v_win[:, :, :P] = pr.v_win.transpose(1, 2)
    cache.k_cmp[:, :, :Tc] = k_cmp.transpose(1, 2)
    cache.v_cmp[:, :, :Tc] = v_cmp.transpose(1, 2)
    # Ring slot r holds the latest token p < length with p % l == r (clamped at 0 while p < 0:
    # such slots are rewritten before any compression reads them).
    last = lengths_b[:, None] - 1
    src_bl = (last - torch.remainder(last - torch.arange(l, device=last.device), l)).clamp(min=0)
    b = torch.arange(src_bl.shape[0], device=last.device)[:, None]
    cache.k_tail.copy_(pr.k_cmp[b, src_bl].transpose(1, 2))
    cache.v_tail.copy_(pr.v_cmp[b, src_bl].transpose(1, 2))
    cache.lengths.copy_(lengths_b)


@torch.no_grad()
def decode_step(layer: NSAAttention, cache: NSACache, x_b1c: torch.Tensor, *, rotary: Rotary | None = None,
                return_indices: bool = False):
    """One new token per sequence, x [B,1,dim] at positions cache.lengths; returns y [B,1,dim].

    Advances cache.lengths by one. With return_indices=True also returns the selection used,
    [B,Hkv,n] (block ids in no particular order, -1 = unused slot).
    """
    check_step(layer, cache, x_b1c)
    pr = project(layer, x_b1c, cache.lengths[:, None], rotary)
    o_b1hd, blocks_bhn = decode_attention(cache, pr, layer.gate(x_b1c), layer.compress_k, layer.compress_v)
    y = layer.wo(o_b1hd.flatten(2))
    return (y, blocks_bhn) if return_indices else y


@torch.no_grad()
def decode_attention(cache: NSACache, pr: Projected, gates_b1h3: torch.Tensor, phi_k, phi_v, *, impl: str = "op"):
    """The NSA op for one query per sequence at positions cache.lengths, cache update included.

    Writes the token's keys/values, compresses a block where one completes, runs the three
    branches and the gates, advances cache.lengths. pr holds [B,1,...] projections, gates
    [B,1,Hq,3] (after the sigmoid). Returns (o [B,1,Hq,Dv] in q's dtype, selection [B,Hkv,n]).

    impl: "op", the registered op nsa_flex::step_attend (cache_step then decode_attend; Triton
    kernels on CUDA, their torch twins elsewhere); "torch", the scatter writes, nsa_flex::phi_step
    and the attention twin inline, for Inductor to compile (the pre-op path).
    """
    cfg = cache.config
    B, Hkv, G = pr.q.shape[0], cfg.n_kv_heads, cfg.group_size
    pos_b = cache.lengths
    # Query head h belongs to kv head h // G: [B,1,Hq,Dk] -> [B,Hkv,G,Dk].
    q_bhgd, gates_bhg3 = pr.q.reshape(B, Hkv, G, cfg.head_dim), gates_b1h3.reshape(B, Hkv, G, 3)
    match impl:
        case "op":
            # One op: the cache update, the attention, and cache.lengths advanced (on CUDA by the
            # attention's last kernel, with no launch of its own).
            o_bhgd, blocks_bhn = step_attend(*step_tensors(cache, pr), pos_b, phi_k, phi_v, q_bhgd, gates_bhg3, cfg,
                                             phi_count=cache.phi_count)
        case "torch":
            _write_token(cache, pr, pos_b)
            _update_compressed(cache, pos_b, phi_k, phi_v)
            o_bhgd, blocks_bhn = decode_attend_torch(q_bhgd, cache.k, cache.v, cache.k_win, cache.v_win, cache.k_cmp,
                                                     cache.v_cmp, pos_b, gates_bhg3, cfg)
            cache.lengths.add_(1)
        case _:
            raise ValueError(f"unknown decode impl {impl!r}; allowed: 'op', 'torch'")
    return o_bhgd.reshape(B, 1, cfg.n_heads, cfg.dv), blocks_bhn


def step_tensors(cache: NSACache, pr: Projected):
    """(tokens, caches) of one step as the cache ops take them; the window pair only when separate."""
    separate = cache.config.separate_kv
    tokens = (pr.k_sel[:, 0], pr.v_sel[:, 0], pr.k_win[:, 0] if separate else None,
              pr.v_win[:, 0] if separate else None, pr.k_cmp[:, 0], pr.v_cmp[:, 0])
    caches = (cache.k, cache.v, cache.k_win if separate else None, cache.v_win if separate else None, cache.k_tail,
              cache.v_tail, cache.k_cmp, cache.v_cmp)
    return tokens, caches


def _write_token(cache: NSACache, pr: Projected, pos_b: torch.Tensor) -> None:
    write_token_torch(*step_tensors(cache, pr), pos_b, cache.config.cmp_block)


def _update_compressed(cache: NSACache, pos_b: torch.Tensor, phi_k, phi_v) -> None:
    """Compresses tokens pos-l+1 .. pos into entry (pos+1-l)/d where that block just completed.

    Through the op nsa_flex::phi_step (ops/phi_step.py): on CUDA a kernel that does phi's work
    only for the sequences whose block completes; elsewhere phi for every sequence and a
    masked write (static shapes either way).
    """
    l, d = cache.config.cmp_block, cache.config.cmp_stride
    phi_step(phi_k, cache.k_tail, cache.k_cmp, pos_b, l, d)
    phi_step(phi_v, cache.v_tail, cache.v_cmp, pos_b, l, d)


def check_prefill(layer: NSAAttention, cache: NSACache, x_btc: torch.Tensor, lengths: torch.Tensor) -> None:
    """Clear errors for bad prefill input: shapes, batch size, prompt longer than the cache."""
    _check_layer_cache(layer, cache)
    if x_btc.dim() != 3 or x_btc.shape[-1] != layer.dim:
        raise ValueError(f"prefill input has shape {tuple(x_btc.shape)}; expected [B, P, dim={layer.dim}]")
    B, P, _ = x_btc.shape
    if B != cache.batch_size:
        raise ValueError(f"prefill batch size {B} does not match the cache's batch size {cache.batch_size}")
    if P > cache.max_len:
        raise ValueError(f"prompt of {P} tokens is longer than the cache ({cache.max_len} tokens); "
                         f"build the cache with max_len >= prompt + new tokens")
    if not isinstance(lengths, torch.Tensor) or tuple(lengths.shape) != (B,) or lengths.is_floating_point():
        raise ValueError(f"lengths must be an int tensor of shape [B={B}], got "
                         f"{tuple(lengths.shape) if isinstance(lengths, torch.Tensor) else type(lengths).__name__}")
    if B and (int(lengths.min()) < 1 or int(lengths.max()) > P):
        raise ValueError(f"lengths must lie in [1, P={P}] (P = padded prompt length), got {lengths.tolist()}")


def check_step(layer: NSAAttention, cache: NSACache, x_b1c: torch.Tensor) -> None:
    """Clear errors for a bad decode step; the cache-full check reads a value, so eager only."""
    _check_layer_cache(layer, cache)
    if x_b1c.dim() != 3 or x_b1c.shape[1] != 1 or x_b1c.shape[2] != layer.dim:
        raise ValueError(f"decode input has shape {tuple(x_b1c.shape)}; expected [B, 1, dim={layer.dim}]")
    if x_b1c.shape[0] != cache.batch_size:
        raise ValueError(f"decode batch size {x_b1c.shape[0]} does not match the cache's batch size {cache.batch_size}")
    if not torch.compiler.is_compiling() and int(cache.lengths.max()) >= cache.max_len:
        raise ValueError(f"the cache is full: a sequence already holds max_len={cache.max_len} tokens")


def _check_layer_cache(layer: NSAAttention, cache: NSACache) -> None:
    if cache.config != layer.config:
        raise ValueError(f"the cache was built for {cache.config}, the layer has {layer.config}")
