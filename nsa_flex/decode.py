"""Decode for one NSAAttention layer: batched prefill into an NSACache, then one token a step.

`prefill` runs the layer's training path (its `impl`) over the right-padded prompts and fills
the cache in one go. `decode_step` takes one new token per sequence: it writes the token's
keys/values, compresses a new block where one just completed, and runs the three branches
for the one query with batched tensor ops only (static shapes, positions as tensors, no
host synchronisation), so `torch.compile(mode="reduce-overhead")` makes it one CUDA graph.

`rotary`, if given, is a callable (q [B,T,H,D], k [B,T,Hkv,D], positions [B,T]) -> (q, k):
RoPE at explicit positions, since the sequences of a decode batch sit at different ones.
With positions = arange(T) it must equal the `rotary(q, k)` the layer was trained with.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch.nn import functional as F

from nsa_flex.attention import NSAAttention, nsa_attention
from nsa_flex.cache import NSACache
from nsa_flex.config import NSAConfig

Rotary = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class Projected(NamedTuple):
    """The layer's projections of x: q [B,T,Hq,Dk] and each branch's keys/values [B,T,Hkv,D]."""

    q: torch.Tensor
    k_cmp: torch.Tensor  # the cmp branch's keys before RoPE: phi's input
    v_cmp: torch.Tensor
    k_sel: torch.Tensor
    v_sel: torch.Tensor
    k_win: torch.Tensor
    v_win: torch.Tensor


def project(layer: NSAAttention, x_btc: torch.Tensor, positions_bt: torch.Tensor, rotary: Rotary | None) -> Projected:
    """NSAAttention's projections, with RoPE at explicit positions [B, T]."""
    at_positions = None if rotary is None else (lambda q, k: rotary(q, k, positions_bt))
    return Projected(*layer.project(x_btc, at_positions))


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
    cfg = layer.config
    B, T, _ = x_btc.shape
    pr = project(layer, x_btc, torch.arange(T, device=x_btc.device).expand(B, T), rotary)
    k_cmp, v_cmp = layer.compress_k(pr.k_cmp), layer.compress_v(pr.v_cmp)
    separate = cfg.separate_kv
    o, sel = nsa_attention(pr.q, pr.k_sel, pr.v_sel, k_cmp, v_cmp, layer.gate(x_btc), config=cfg, impl=layer.impl,
                           block_indices=block_indices, return_indices=True,
                           k_win=pr.k_win if separate else None, v_win=pr.v_win if separate else None)
    return layer.wo(o.reshape(B, T, cfg.n_heads * cfg.dv)), sel, pr, k_cmp, v_cmp


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
def decode_attention(cache: NSACache, pr: Projected, gates_b1h3: torch.Tensor, phi_k, phi_v):
    """The NSA op for one query per sequence at positions cache.lengths, cache update included.

    Writes the token's keys/values, compresses a block where one completes, runs the three
    branches and the gates, advances cache.lengths. pr holds [B,1,...] projections, gates
    [B,1,Hq,3] (after the sigmoid). Returns (o [B,1,Hq,Dv] in q's dtype, selection [B,Hkv,n]).
    """
    cfg = cache.config
    B, Hkv, G = pr.q.shape[0], cfg.n_kv_heads, cfg.group_size
    pos_b = cache.lengths
    _write_token(cache, pr, pos_b)
    _update_compressed(cache, pos_b, phi_k, phi_v)
    # Query head h belongs to kv head h // G: [B,1,Hq,Dk] -> [B,Hkv,G,Dk].
    q_bhgd = pr.q.reshape(B, Hkv, G, cfg.head_dim)
    g = gates_b1h3.reshape(B, Hkv, G, 3).to(torch.promote_types(gates_b1h3.dtype, torch.float32))
    o_cmp, p_cmp = _cmp_attention(q_bhgd, cache, pos_b)
    blocks_bhn = select_blocks_one(p_cmp, pos_b, cfg, cache.num_sel)
    o = g[..., 0:1] * o_cmp + _sel_win_attention(q_bhgd, cache, blocks_bhn, pos_b, g[..., 1:2], g[..., 2:3])
    cache.lengths.add_(1)
    return o.to(pr.q.dtype).reshape(B, 1, cfg.n_heads, cfg.dv), blocks_bhn


def _write_token(cache: NSACache, pr: Projected, pos_b: torch.Tensor) -> None:
    b = torch.arange(pos_b.shape[0], device=pos_b.device)
    cache.k[b, :, pos_b] = pr.k_sel[:, 0].to(cache.k.dtype)
    cache.v[b, :, pos_b] = pr.v_sel[:, 0].to(cache.v.dtype)
    if cache.config.separate_kv:
        cache.k_win[b, :, pos_b] = pr.k_win[:, 0].to(cache.k.dtype)
        cache.v_win[b, :, pos_b] = pr.v_win[:, 0].to(cache.v.dtype)
    slot_b = torch.remainder(pos_b, cache.config.cmp_block)
    cache.k_tail[b, :, slot_b] = pr.k_cmp[:, 0].to(cache.k.dtype)
    cache.v_tail[b, :, slot_b] = pr.v_cmp[:, 0].to(cache.v.dtype)


def _update_compressed(cache: NSACache, pos_b: torch.Tensor, phi_k, phi_v) -> None:
    """Compresses tokens pos-l+1 .. pos into entry (pos+1-l)/d where that block just completed.

    phi runs for every sequence every step (static shapes); a masked write keeps the result
    only where (pos + 1 - l) % d == 0 and pos + 1 >= l.
    """
    l, d = cache.config.cmp_block, cache.config.cmp_stride
    b = torch.arange(pos_b.shape[0], device=pos_b.device)
    slots_bl = torch.remainder(pos_b[:, None] - l + 1 + torch.arange(l, device=pos_b.device), l)
    done_b = pos_b + 1 - l
    write_b = (done_b >= 0) & (torch.remainder(done_b, d) == 0)
    entry_b = torch.div(done_b, d, rounding_mode="floor").clamp(0, cache.max_cmp - 1)
    for tail, cmp, phi in ((cache.k_tail, cache.k_cmp, phi_k), (cache.v_tail, cache.v_cmp, phi_v)):
        # [B, Hkv, l, D] gathered at the block's slots -> [B, l, Hkv, D], phi's layout.
        block_blhd = tail[b[:, None], :, slots_bl].to(next(phi.parameters()).dtype)
        new_bhd = phi(block_blhd)[:, 0].to(cmp.dtype)
        cmp[b, :, entry_b] = torch.where(write_b[:, None, None], new_bhd, cmp[b, :, entry_b])


def _matmul_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] with fp32 (or wider) results.

    bf16/fp16 on CUDA: one cuBLAS bmm with fp32 output (no upcast copy of the cache);
    elsewhere the inputs are upcast.
    """
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        out = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), out_dtype=torch.float32)
        return out.view(*a.shape[:-2], *out.shape[-2:])
    dtype = torch.promote_types(a.dtype, torch.float32)
    return a.to(dtype) @ b.to(dtype)


def _softmax(s_bhgs: torch.Tensor, valid_bhs: torch.Tensor) -> torch.Tensor:
    """Softmax over the valid keys (valid broadcasts to [B,Hkv,S]); a row with none gives 0, never NaN."""
    s = s_bhgs.masked_fill(~valid_bhs[:, :, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
    den = e.sum(-1, keepdim=True)
    return e / torch.where(den > 0, den, torch.ones_like(den))


def _cmp_attention(q_bhgd, cache: NSACache, pos_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Compressed branch over the whole compressed cache, entry i visible iff i*d + l - 1 <= pos:
    (o [B,Hkv,G,Dv], p [B,Hkv,G,Tc]). Scores and softmax in fp32; p is rounded to the cache's
    dtype for the second matmul, as flash does."""
    cfg = cache.config
    last_c = torch.arange(cache.max_cmp, device=pos_b.device) * cfg.cmp_stride + cfg.cmp_block - 1
    valid_b1c = (last_c[None, :] <= pos_b[:, None])[:, None, :]
    p = _softmax(_matmul_f32(q_bhgd, cache.k_cmp.transpose(-1, -2)) * cfg.head_dim ** -0.5, valid_b1c)
    return _matmul_f32(p.to(cache.v_cmp.dtype), cache.v_cmp), p


def fold_to_sel_blocks(imp_bhc: torch.Tensor, cfg: NSAConfig, num_sel: int) -> torch.Tensor:
    """[..., Tc] compression-block scores -> [..., num_sel] selection-block scores.

    Equals `imp @ blocks.cmp_to_sel_weights(Tc, num_sel)` without the [Tc, Ns] matrix: with
    the sequence cut into chunks of d tokens, compression block i covers chunks i .. i+l/d-1,
    so chunk c collects blocks c-l/d+1 .. c, and selection block j sums its l'/d chunks.
    """
    r, per_sel = cfg.cmp_block // cfg.cmp_stride, cfg.sel_block // cfg.cmp_stride
    n_chunks, Tc = num_sel * per_sel, imp_bhc.shape[-1]
    if Tc > n_chunks:
        raise ValueError(f"{Tc} compression blocks do not fit in {num_sel} selection blocks")
    padded = F.pad(imp_bhc, (r - 1, n_chunks - Tc))
    chunks = sum(padded[..., r - 1 - k: r - 1 - k + n_chunks] for k in range(r))
    return chunks.unflatten(-1, (num_sel, per_sel)).sum(-1)


def select_blocks_one(p_bhgc: torch.Tensor, pos_b: torch.Tensor, cfg: NSAConfig, num_sel: int) -> torch.Tensor:
    """Top-n selection blocks of one query per kv head: [B,Hkv,G,Tc] cmp probabilities -> [B,Hkv,n].

    The rule of reference.select_blocks (group-summed importance, forced blocks first, blocks
    after the query's own excluded, ties to the lower block id, -1 in unused slots), but the
    ids come in no particular order. torch.topk is not stable, so ties are broken by a key
    that cannot tie: the score's bits (a non-negative float orders like its int32 bit
    pattern) above the reversed block id.
    """
    imp_bhs = fold_to_sel_blocks(p_bhgc.sum(2), cfg, num_sel).float()
    j = torch.arange(num_sel, device=pos_b.device)
    own_b1 = (pos_b // cfg.sel_block)[:, None]
    valid_bs = j[None, :] <= own_b1
    forced_bs = valid_bs & ((j[None, :] < cfg.n_initial) | (j[None, :] > own_b1 - cfg.n_local))
    score = imp_bhs.masked_fill(forced_bs[:, None], float("inf"))
    key = score.view(torch.int32).to(torch.int64) * 2**32 + (num_sel - 1 - j)
    key = key.masked_fill(~valid_bs[:, None], -1)
    n = min(cfg.n_selected, num_sel)
    top = torch.topk(key, n, dim=-1, sorted=False)
    blocks = torch.where(top.values >= 0, top.indices, -1)
    return F.pad(blocks, (0, cfg.n_selected - n), value=-1)


def _sel_win_attention(q_bhgd, cache: NSACache, blocks_bhn, pos_b, g_sel, g_win) -> torch.Tensor:
    """g_sel * selected branch + g_win * window branch, [B,Hkv,G,Dv], from one gather.

    Keys: the n*l' tokens of the chosen blocks (causal up to pos), then the last w tokens up
    to pos (masked where < 0). One score matmul, a softmax per branch, and, with each
    branch's probabilities scaled by its gate, one matmul with the gathered values.
    """
    cfg = cache.config
    dev, B, Hkv, n = pos_b.device, *blocks_bhn.shape
    tok_sel = (blocks_bhn[..., None] * cfg.sel_block + torch.arange(cfg.sel_block, device=dev)).flatten(-2)
    valid_sel = (blocks_bhn >= 0).repeat_interleave(cfg.sel_block, dim=-1) & (tok_sel <= pos_b[:, None, None])
    w = min(cfg.window, cache.max_len)
    tok_win = (pos_b[:, None] - w + 1 + torch.arange(w, device=dev))[:, None, :].expand(B, Hkv, w)
    tok = torch.cat([tok_sel, tok_win], dim=-1).clamp(0, cache.max_len - 1)
    b = torch.arange(B, device=dev)[:, None, None]
    h = torch.arange(Hkv, device=dev)[None, :, None]
    S = n * cfg.sel_block
    if cfg.separate_kv:
        k = torch.cat([cache.k[b, h, tok[..., :S]], cache.k_win[b, h, tok[..., S:]]], dim=2)
        v = torch.cat([cache.v[b, h, tok[..., :S]], cache.v_win[b, h, tok[..., S:]]], dim=2)
    else:
        k, v = cache.k[b, h, tok], cache.v[b, h, tok]
    s = _matmul_f32(q_bhgd, k.transpose(-1, -2)) * cfg.head_dim ** -0.5
    p = torch.cat([g_sel * _softmax(s[..., :S], valid_sel), g_win * _softmax(s[..., S:], tok_win >= 0)], dim=-1)
    return _matmul_f32(p.to(v.dtype), v)


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
