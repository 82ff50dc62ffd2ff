"""Written FLOP formulas: the work each benchmark row is credited with.

Conventions (those of the FlashAttention and attention-gym benchmarks):

- Only the two attention matmuls count: Q K^T (2*Dk flops per query-key pair, a multiply
  and an add per channel) and P V (2*Dv). Softmax, masking, gating, the projections and
  NSA's importance scores (p_cmp times the fixed overlap weights, O(T*Tc) with no head-dim
  factor) are not counted.
- Dense causal forward = 2 * B * Hq * (T^2 / 2) * (Dk + Dv): half of the T x T score matrix,
  the usual rounding of the exact T*(T+1)/2.
- Backward = 2.5 x forward (two matmuls of the forward recomputed or reused plus three for
  dQ, dK, dV, as in FlashAttention-2's accounting), so fwd+bwd = 3.5 x forward.
- NSA effective forward = 2 * B * Hq * (Dk + Dv) * sum over queries t of the keys t attends
  to in each branch, counted exactly (0-based t, T tokens):
    cmp: complete compression blocks, i*d + l - 1 <= t: 0 if t < l - 1, else (t - l + 1)//d + 1;
    sel: all t + 1 causal keys while the query has at most n valid selection blocks
         (t//l' + 1 <= n); past that n - 1 full earlier blocks plus the causal part of the
         query's own block, (n - 1)*l' + t%l' + 1, since the own block is always selected
         when n_local >= 1 (with n_local = 0 the count n*l' is an upper bound);
    win: min(w, t + 1).
  That is the work of an implementation that skips every masked key; a kernel that computes
  whole masked tiles does more.
"""

from __future__ import annotations

import functools

import torch

from nsa_flex.blocks import num_cmp_blocks
from nsa_flex.config import NSAConfig

BWD_FACTOR = 2.5
"""Backward flops / forward flops (convention, see the module docstring)."""

MODES = ("fwd", "fwd+bwd")
BRANCHES = ("cmp", "sel", "win")


def dense_causal_flops(B: int, Hq: int, T: int, Dk: int, Dv: int) -> float:
    """Forward flops of dense causal attention: 2 * B * Hq * (T^2 / 2) * (Dk + Dv)."""
    return 2.0 * B * Hq * (T * T / 2) * (Dk + Dv)


@functools.cache
def nsa_keys(T: int, config: NSAConfig) -> dict[str, int]:
    """Keys attended per branch, summed over the T query positions (one head, one sequence)."""
    l, d, sel_l, n, w = (config.cmp_block, config.cmp_stride, config.sel_block,
                         config.n_selected, config.window)
    t = torch.arange(T, dtype=torch.int64)
    cmp = torch.where(t >= l - 1, torch.div(t - l + 1, d, rounding_mode="floor") + 1, 0)
    cmp = cmp.clamp(max=num_cmp_blocks(T, config))
    beyond_n = t // sel_l + 1 > n
    sel_capped = (n - 1) * sel_l + t % sel_l + 1 if config.n_local >= 1 else torch.full_like(t, n * sel_l)
    sel = torch.where(beyond_n, sel_capped, t + 1)
    win = torch.clamp(t + 1, max=w)
    return {"cmp": int(cmp.sum()), "sel": int(sel.sum()), "win": int(win.sum())}


def nsa_flops(B: int, T: int, config: NSAConfig, branches: tuple[str, ...] = BRANCHES) -> float:
    """Forward flops of NSA's effective work: 2 * B * Hq * (Dk + Dv) * keys of the branches."""
    unknown = set(branches) - set(BRANCHES)
    if unknown:
        raise ValueError(f"unknown branches {sorted(unknown)}; allowed: {', '.join(BRANCHES)}")
    keys = nsa_keys(T, config)
    return 2.0 * B * config.n_heads * (config.head_dim + config.dv) * sum(keys[b] for b in branches)


def mode_flops(fwd_flops: float, mode: str) -> float:
    """Flops of one timed step of `mode` given the forward's."""
    match mode:
        case "fwd":
            return fwd_flops
        case "fwd+bwd":
            return fwd_flops * (1 + BWD_FACTOR)
        case _:
            raise ValueError(f"unknown mode {mode!r}; allowed: {', '.join(MODES)}")
