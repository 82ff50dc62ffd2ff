"""Checks of a block selection against fp64 importance scores: the selection op's tests and its GPU
tools compare its output with these (a near-tie may flip; a clear winner may not).

Random inputs can hold near-ties that rounding orders either way. A selection passes when it
differs from the expected one only in blocks whose importance lies within a derived relative
tolerance (`importance_tolerance`) of the row's n-th best score.
"""

from __future__ import annotations

import math

import torch

from nsa_flex.blocks import cmp_block_last_token, cmp_to_sel_weights, forced_and_valid, num_sel_blocks
from nsa_flex.config import NSAConfig


def scores_fp64(q_bthd, k_bchd, scale):
    """[B, Hq, T, Tc] fp64 scale * q . k_cmp (each kv head serving its G query heads)."""
    G = q_bthd.shape[2] // k_bchd.shape[2]
    k_bhdc = k_bchd.double().permute(0, 2, 3, 1).repeat_interleave(G, dim=1)
    return scale * (q_bthd.double().transpose(1, 2) @ k_bhdc)


def visible(T: int, Tc: int, config: NSAConfig, device=None) -> torch.Tensor:
    """[T, Tc] compression block i visible to query t: complete, i*d + l - 1 <= t."""
    return cmp_block_last_token(Tc, config, device)[None, :] <= torch.arange(T, device=device)[:, None]


def importance_scores(p_bhtc, T: int, G: int, config: NSAConfig, t=None) -> torch.Tensor:
    """[B, Hkv, T', Ns] group importance from p_cmp, forced blocks +inf, later blocks -inf.

    t (optional [T'] positions) when p_bhtc holds only some query rows of a T-token sequence.
    """
    B, Hq, rows, Tc = p_bhtc.shape
    Ns = num_sel_blocks(T, config)
    weights = cmp_to_sel_weights(Tc, Ns, config, dtype=p_bhtc.dtype, device=p_bhtc.device)
    imp = (p_bhtc @ weights).view(B, Hq // G, G, rows, Ns).sum(2)
    forced, valid = forced_and_valid(T, Ns, config, p_bhtc.device)
    if t is not None:
        forced, valid = forced[t], valid[t]
    return imp.masked_fill(forced, math.inf).masked_fill(~valid, -math.inf)


def importance_tolerance(Dk: int, G: int, config: NSAConfig, abs_dot: float, max_s_minus_lse: float,
                         cleared_bits: int = 0) -> float:
    """Relative error bound of an fp32 importance against the fp64 one, times 2 (both sides).

    With u = 2^-24: the fp32 dot q.k errs by at most (Dk + 2) u scale sum|q_d k_d| (abs_dot
    bounds scale sum|q_d k_d|, e.g. scale |q| |k| by Cauchy-Schwarz); s - lse adds
    u |s - lse|; exp adds a few u (GPU ex2.approx included: 4u). Each importance is a sum of
    at most G (R + m - 1) non-negative terms, adding that many u relative. A ranking with the
    low cleared_bits of each fp32 score cleared (the selection kernel's lists,
    kernels.list_tile_bits) rounds toward zero by less than 2^(cleared_bits + 1) u relative.
    """
    u = 2.0 ** -24
    e = (Dk + 2) * u * abs_dot + u * max_s_minus_lse + 4 * u
    R, m = config.sel_block // config.cmp_stride, config.cmp_block // config.cmp_stride
    rounding = 2.0 ** (cleared_bits + 1) * u if cleared_bits else 0.0
    return 2 * (e + G * (R + m - 1) * u + rounding)


def assert_same_selection(got, want, scores, tol: float) -> int:
    """got equals want up to near-ties; returns the number of rows that differ.

    A block may be in one set and not the other only if its score is within tol (relative)
    of the row's n-th best score: rounding may order such blocks either way.
    """
    assert got.shape == want.shape, (got.shape, want.shape)
    got, want, scores = got.cpu().long(), want.cpu().long(), scores.cpu()
    assert_canonical(got)
    assert torch.equal((got < 0).sum(-1), (want < 0).sum(-1)), "different numbers of selected blocks"
    Ns = scores.shape[-1]
    diff = _members(got, Ns) ^ _members(want, Ns)
    rows = diff.any(-1)
    if rows.any():
        n = min(want.shape[-1], Ns)
        nth = scores.sort(dim=-1, descending=True).values[..., n - 1 : n]
        near = (scores - nth).abs() <= tol * torch.maximum(scores.abs(), nth.abs())
        bad = diff & ~near
        if bad.any():
            b, h, t = bad.nonzero()[0, :3].tolist()
            raise AssertionError(
                f"selection differs beyond near-ties at (b={b}, h={h}, t={t}): got {got[b, h, t].tolist()}, "
                f"want {want[b, h, t].tolist()}, n-th score {nth[b, h, t].item()}, tol {tol}"
            )
    return int(rows.sum())


def assert_canonical(idx: torch.Tensor) -> None:
    """Ascending block ids, each at most once, the -1 slots last."""
    used = idx >= 0
    assert not (used[..., 1:] & ~used[..., :-1]).any(), "-1 before a block id"
    assert ((idx[..., 1:] > idx[..., :-1]) | ~used[..., 1:]).all(), "ids not strictly ascending"


def _members(idx, Ns):
    m = torch.zeros(*idx.shape[:-1], Ns + 1, dtype=torch.bool)
    m.scatter_(-1, torch.where(idx < 0, Ns, idx), True)
    return m[..., :Ns]
