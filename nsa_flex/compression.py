"""phi: learned compression of overlapping key/value blocks into one token each.

Shared by every implementation: it is plain PyTorch (an unfold and an MLP) that
torch.compile fuses well, so there is no separate kernel for it.
"""

from __future__ import annotations

import torch
from torch import nn

from nsa_flex.blocks import num_cmp_blocks
from nsa_flex.config import NSAConfig


class Compressor(nn.Module):
    """Maps each block of l tokens (stride d) of every head to one token.

    An MLP over the flattened block plus a learned intra-block position encoding, shared
    across heads. [B, T, H, D] -> [B, Tc, H, D_out], Tc = max(0, (T - l) // d + 1).
    """

    def __init__(self, config: NSAConfig, dim_in: int, dim_out: int | None = None, hidden: int | None = None):
        super().__init__()
        self.config = config
        dim_out = dim_in if dim_out is None else dim_out
        hidden = dim_in if hidden is None else hidden
        self.pos_lxd = nn.Parameter(torch.randn(config.cmp_block, dim_in) * 0.02)
        self.mlp = nn.Sequential(
            nn.Linear(config.cmp_block * dim_in, hidden), nn.GELU(), nn.Linear(hidden, dim_out)
        )
        self.dim_out = dim_out

    def forward(self, x_bthd: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        if cu_seqlens is not None:
            # Blocks never straddle two documents: compress each one on its own.
            bounds = cu_seqlens.tolist()
            parts = [self._compress(x_bthd[:, s:e]) for s, e in zip(bounds[:-1], bounds[1:])]
            return torch.cat(parts, dim=1)
        return self._compress(x_bthd)

    def _compress(self, x_bthd: torch.Tensor) -> torch.Tensor:
        B, T, H, _ = x_bthd.shape
        Tc = num_cmp_blocks(T, self.config)
        if Tc == 0:
            return x_bthd.new_zeros(B, 0, H, self.dim_out)
        # unfold puts the window last: [B, Tc, H, D, l] -> [B, Tc, H, l, D]
        blocks = x_bthd.unfold(1, self.config.cmp_block, self.config.cmp_stride).transpose(-1, -2)
        blocks = blocks + self.pos_lxd.to(blocks.dtype)
        return self.mlp(blocks.flatten(-2))


def compressed_seqlens(cu_seqlens: torch.Tensor, config: NSAConfig) -> torch.Tensor:
    """cu_seqlens of the compressed tokens of packed documents."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    cmp_lengths = torch.clamp((lengths - config.cmp_block) // config.cmp_stride + 1, min=0)
    return torch.cat([cu_seqlens.new_zeros(1), torch.cumsum(cmp_lengths, 0)]).to(cu_seqlens.dtype)
