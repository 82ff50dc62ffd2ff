"""NSA attention as a specification: plain PyTorch, dense masks, at least fp32 math.

The oracle for every other implementation and the CPU path for gradients. It has no
kernel limits: any T >= 1, any GQA group, d_v != d_k. Memory is O(T^2); use it for
correctness, never for speed.

Shapes use the paper's letters: B batch, T tokens, Tc compressed tokens, Ns selection
blocks, Hq query heads, Hkv kv heads, G = Hq / Hkv, n selected blocks, Dk / Dv head dims.
"""

from __future__ import annotations

import torch

from nsa_flex.blocks import (
    cmp_block_last_token,
    cmp_to_sel_weights,
    forced_and_valid,
    num_sel_blocks,
    sort_block_indices,
)
from nsa_flex.config import NSAConfig


def nsa_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    gates: torch.Tensor,
    config: NSAConfig,
    block_indices: torch.Tensor | None = None,
    k_win: torch.Tensor | None = None,
    v_win: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence batch of NSA. Returns (o [B,T,Hq,Dv], block_indices [B,Hkv,T,n]).

    q [B,T,Hq,Dk], k [B,T,Hkv,Dk], v [B,T,Hkv,Dv], k_cmp [B,Tc,Hkv,Dk], v_cmp [B,Tc,Hkv,Dv],
    gates [B,T,Hq,3] (after the sigmoid; order cmp, sel, win). k_win / v_win replace k / v
    in the window branch when the branches have separate projections.
    """
    B, T, Hq, Dk = q.shape
    G = Hq // k.shape[2]
    dtype = torch.promote_types(q.dtype, torch.float32)
    scale = Dk ** -0.5
    q_bhtd = q.to(dtype).transpose(1, 2)
    t = torch.arange(T, device=q.device)

    # Compressed branch: block i is visible once complete, i*d + l - 1 <= t.
    cmp_mask_tc = cmp_block_last_token(k_cmp.shape[1], config, q.device)[None, :] <= t[:, None]
    o_cmp, p_cmp = _attend(q_bhtd, _heads(k_cmp, G, dtype), _heads(v_cmp, G, dtype), cmp_mask_tc, scale)

    if block_indices is None:
        block_indices = select_blocks(p_cmp.detach(), T, G, config)

    # Selected branch: the chosen blocks, causal inside the query's own block.
    sel_mask_bhts = _selection_mask(block_indices, T, config).repeat_interleave(G, dim=1)
    o_sel, _ = _attend(q_bhtd, _heads(k, G, dtype), _heads(v, G, dtype), sel_mask_bhts, scale)

    # Window branch: the last w tokens, the query included.
    win_mask_ts = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - config.window)
    k_win = k if k_win is None else k_win
    v_win = v if v_win is None else v_win
    o_win, _ = _attend(q_bhtd, _heads(k_win, G, dtype), _heads(v_win, G, dtype), win_mask_ts, scale)

    g = gates.to(dtype).transpose(1, 2)  # [B, Hq, T, 3]
    o = g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel + g[..., 2:3] * o_win
    return o.transpose(1, 2).to(q.dtype), block_indices


def select_blocks(p_cmp_bhtc: torch.Tensor, T: int, G: int, config: NSAConfig) -> torch.Tensor:
    """Top-n selection blocks per (kv head, query) from the compressed branch's probabilities.

    Importance of selection block j = sum over compression blocks i of p_cmp[i] * overlap(i, j) / d,
    summed over the G query heads of the group. Forced blocks (the first n_initial and the
    n_local ending with the query's own) always win; blocks after the query's own never count.
    Tie-break: equal scores take the lower block index first. Result [B, Hkv, T, n], int64,
    ascending block ids, -1 in unused slots (sequences with fewer than n valid blocks).
    """
    B, Hq, _, Tc = p_cmp_bhtc.shape
    Ns = num_sel_blocks(T, config)
    weights_cs = cmp_to_sel_weights(Tc, Ns, config, dtype=p_cmp_bhtc.dtype, device=p_cmp_bhtc.device)
    importance = (p_cmp_bhtc @ weights_cs).view(B, Hq // G, G, T, Ns).sum(2)
    forced_ts, valid_ts = forced_and_valid(T, Ns, config, p_cmp_bhtc.device)
    score = importance.masked_fill(forced_ts, float("inf")).masked_fill(~valid_ts, float("-inf"))
    # A stable descending sort keeps equal scores in index order: the documented tie-break.
    order = torch.sort(score, dim=-1, descending=True, stable=True)
    # Work scales with the Ns blocks that exist: an n above Ns only adds unused (-1) slots.
    n = min(config.n_selected, Ns)
    top = order.indices[..., :n]
    top = sort_block_indices(top.masked_fill(order.values[..., :n] == float("-inf"), -1))
    return torch.nn.functional.pad(top, (0, config.n_selected - n), value=-1)


def _selection_mask(block_indices: torch.Tensor, T: int, config: NSAConfig) -> torch.Tensor:
    """[B, Hkv, T, T] bool: key s allowed for query t iff block(s) is selected and s <= t."""
    B, Hkv, _, n = block_indices.shape
    Ns = num_sel_blocks(T, config)
    # Unused slots (-1) scatter into a spare column Ns that is dropped afterwards.
    idx = torch.where(block_indices < 0, Ns, block_indices).long()
    chosen = torch.zeros(B, Hkv, T, Ns + 1, dtype=torch.bool, device=block_indices.device)
    chosen.scatter_(-1, idx, True)
    s = torch.arange(T, device=block_indices.device)
    causal_ts = s[None, :] <= s[:, None]
    return chosen[..., s // config.sel_block] & causal_ts


def _heads(x_bthd: torch.Tensor, G: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, Hkv, D] -> [B, Hkv*G, T, D]: each kv head repeated for its G query heads."""
    return x_bthd.to(dtype).transpose(1, 2).repeat_interleave(G, dim=1)


def _attend(q, k, v, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention under a boolean mask; rows with no visible key give 0 (never NaN).

    Returns (output [B,H,T,Dv], probabilities [B,H,T,S]).
    """
    if k.shape[-2] == 0:
        # No keys at all (T < l for the compressed branch): the branch contributes exactly 0.
        return q.new_zeros(*q.shape[:-1], v.shape[-1]), q.new_zeros(*q.shape[:-1], 0)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    # The row max only stabilises exp; detaching it leaves the gradient unchanged.
    row_max = scores.amax(-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(scores - row_max)
    denom = e.sum(-1, keepdim=True)
    p = e / torch.where(denom > 0, denom, torch.ones_like(denom))
    return p @ v, p


def nsa_reference_varlen(q, k, v, k_cmp, v_cmp, gates, config, cu_seqlens, cu_seqlens_cmp,
                         block_indices=None, k_win=None, v_win=None):
    """Packed documents (B == 1): each document is an independent sequence.

    The definition of document masking: the result equals running every document on its
    own. Block indices are document-local block ids.
    """
    outs, sels = [], []
    bounds, cmp_bounds = cu_seqlens.tolist(), cu_seqlens_cmp.tolist()
    for i in range(len(bounds) - 1):
        s, e = bounds[i], bounds[i + 1]
        cs, ce = cmp_bounds[i], cmp_bounds[i + 1]
        o, sel = nsa_reference(
            q[:, s:e], k[:, s:e], v[:, s:e], k_cmp[:, cs:ce], v_cmp[:, cs:ce], gates[:, s:e], config,
            None if block_indices is None else block_indices[:, :, s:e],
            None if k_win is None else k_win[:, s:e], None if v_win is None else v_win[:, s:e],
        )
        outs.append(o)
        sels.append(sel)
    return torch.cat(outs, dim=1), torch.cat(sels, dim=2)
