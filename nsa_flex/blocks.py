"""Block geometry shared by every implementation: pure functions of the config, no kernels.

Compression block i covers tokens [i*d, i*d + l); selection block j covers [j*l', (j+1)*l').
"""

from __future__ import annotations

import math

import torch

from nsa_flex.config import NSAConfig


def document_of(cu_seqlens: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The document (index into cu_seqlens [n_docs + 1]) holding each position x (one document: zeros).

    Searches the whole bounds tensor, never a slice of it: Inductor (torch 2.11) cannot lower
    searchsorted over a sliced sequence (it raises on a SliceView), which stopped the
    compiled op with packed documents.
    """
    if cu_seqlens.shape[0] == 2:
        return torch.zeros_like(x, dtype=torch.int64)
    return (torch.searchsorted(cu_seqlens, x, right=True) - 1).clamp(0, cu_seqlens.shape[0] - 2)


def num_cmp_blocks(T: int, config: NSAConfig) -> int:
    """Tc: complete compression blocks in a sequence of T tokens."""
    return max(0, (T - config.cmp_block) // config.cmp_stride + 1)


def num_sel_blocks(T: int, config: NSAConfig) -> int:
    """Ns: selection blocks covering T tokens (the last one may be partial)."""
    return math.ceil(T / config.sel_block)


def cmp_block_last_token(Tc: int, config: NSAConfig, device=None) -> torch.Tensor:
    """[Tc] index of each compression block's last token: a query at t sees block i iff this <= t."""
    return torch.arange(Tc, device=device) * config.cmp_stride + config.cmp_block - 1


def cmp_to_sel_weights(Tc: int, Ns: int, config: NSAConfig, *, dtype=torch.float32, device=None) -> torch.Tensor:
    """[Tc, Ns] weight of compression block i in selection block j: overlapping tokens / d.

    The paper's Eq. 9 reads ambiguously; this is the geometric reading. For l=32, d=16,
    l'=64 selection block j gets compression blocks 4j-1 .. 4j+3 with weights 1, 2, 2, 2, 1.
    """
    cmp_start = torch.arange(Tc, device=device) * config.cmp_stride
    sel_start = torch.arange(Ns, device=device) * config.sel_block
    lo = torch.maximum(cmp_start[:, None], sel_start[None, :])
    hi = torch.minimum(cmp_start[:, None] + config.cmp_block, sel_start[None, :] + config.sel_block)
    return (hi - lo).clamp(min=0).to(dtype) / config.cmp_stride


def forced_and_valid_at(t: torch.Tensor, Ns: int, config: NSAConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """([..., Ns] forced, [..., Ns] valid) selection blocks of queries at (document-local) positions t [...].

    valid: the block starts at or before the query (j <= t // l').
    forced: the first n_initial blocks and the n_local blocks ending with the query's own.
    """
    own = (t // config.sel_block)[..., None]
    j = torch.arange(Ns, device=t.device)
    valid = j <= own
    forced = valid & ((j < config.n_initial) | (j > own - config.n_local))
    return forced, valid


def forced_and_valid(T: int, Ns: int, config: NSAConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """([T, Ns] forced, [T, Ns] valid) selection blocks of each query position 0 .. T-1."""
    return forced_and_valid_at(torch.arange(T, device=device), Ns, config)


def top_n_blocks(importance: torch.Tensor, t: torch.Tensor, config: NSAConfig) -> torch.Tensor:
    """The selection rule: importance [..., Ns] of queries at positions t (broadcast against
    importance[..., 0]) -> [..., n] block ids, ascending, -1 in unused slots.

    Forced blocks always win, blocks after the query's own never count, and equal scores take
    the lower block id first (a stable descending sort keeps equal scores in index order). The
    reference, the selection op's twin and the decode twin all select through this function.
    """
    Ns = importance.shape[-1]
    forced, valid = forced_and_valid_at(t, Ns, config)
    score = importance.masked_fill(forced, math.inf).masked_fill(~valid, -math.inf)
    order = torch.sort(score, dim=-1, descending=True, stable=True)
    n = config.n_selected
    k = min(n, Ns)
    # Work scales with the Ns blocks that exist: an n above Ns only adds unused (-1) slots.
    top = sort_block_indices(order.indices[..., :k].masked_fill(order.values[..., :k] == -math.inf, -1))
    return torch.nn.functional.pad(top, (0, n - k), value=-1)


def sort_block_indices(idx: torch.Tensor) -> torch.Tensor:
    """Ascending block ids along the last dim, the -1 (unused) slots last."""
    big = torch.iinfo(idx.dtype).max
    s = torch.sort(idx.masked_fill(idx < 0, big), dim=-1).values
    return s.masked_fill(s == big, -1)


def distinct_block_indices(idx: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """[..., n] block ids in [-1, n_blocks) -> [..., min(n, n_blocks)]: each id once, ascending, -1 last.

    A selection is a set of blocks: a repeated id counts once. At most n_blocks ids can be
    distinct, so the width never exceeds the number of blocks that exist.
    """
    s = sort_block_indices(idx)
    repeat = torch.cat([torch.zeros_like(s[..., :1], dtype=torch.bool), s[..., 1:] == s[..., :-1]], dim=-1)
    return sort_block_indices(s.masked_fill(repeat, -1))[..., :max(1, min(idx.shape[-1], n_blocks))]
