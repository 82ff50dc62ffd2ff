"""phi: learned compression of overlapping key/value blocks into one token each.

Shared by every implementation: it is plain PyTorch (a chunked first layer and an MLP) that
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
        first, act, second = self.mlp
        return second(act(self._first_layer_by_chunks(x_bthd, first, Tc)))

    def _first_layer_by_chunks(self, x_bthd: torch.Tensor, first: nn.Linear, Tc: int) -> torch.Tensor:
        """The first Linear of every block: with l = R*d (NSAConfig requires it) block i is the d-token
        chunks i .. i+R-1.

        W (blocks + pos) + b = sum_r W_r chunk_{i+r} + (W pos + b), W_r the columns of chunk r.
        The matmul then keeps the chunks for its backward, 1x the input, where the overlapping
        blocks were l/d x (24 of 48 MiB per layer of seeds-125m at 32k tokens, H200 probe in
        docs/records/model_memory_probe_before_h200.json).
        """
        B, _, H, D = x_bthd.shape
        R, d = self.config.cmp_block // self.config.cmp_stride, self.config.cmp_stride
        n = Tc + R - 1
        chunks = x_bthd[:, :n * d].reshape(B, n, d, H, D).transpose(2, 3).reshape(B, n, H, d * D)
        hidden = first.out_features
        w_rows = first.weight.view(hidden, R, d * D).transpose(0, 1).reshape(R * hidden, d * D)
        y = nn.functional.linear(chunks, w_rows).view(B, n, H, R, hidden)
        acc = torch.promote_types(y.dtype, torch.float32)
        h = sum(y[:, r:r + Tc, :, r].to(acc) for r in range(R))
        const = nn.functional.linear(self.pos_lxd.flatten().to(first.weight.dtype), first.weight, first.bias)
        return (h + const.to(acc)).to(y.dtype)


def compressed_seqlens(cu_seqlens: torch.Tensor, config: NSAConfig) -> torch.Tensor:
    """cu_seqlens of the compressed tokens of packed documents."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    cmp_lengths = torch.clamp((lengths - config.cmp_block) // config.cmp_stride + 1, min=0)
    return torch.cat([cu_seqlens.new_zeros(1), torch.cumsum(cmp_lengths, 0)]).to(cu_seqlens.dtype)
