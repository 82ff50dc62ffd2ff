"""Compressed-causal mask: query t sees compressed token i iff its block is complete, i*d + l - 1 <= t."""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from nsa_flex.config import NSAConfig
from nsa_flex.ops.blockmask import interval_block_mask


def compressed_mask_mod(config: NSAConfig):
    """mask_mod over (query token, compressed token); the same for every batch and head."""
    last_offset, stride = config.cmp_block - 1, config.cmp_stride

    def cmp_mask(b, h, q_idx, kv_idx):
        return kv_idx * stride + last_offset <= q_idx

    return cmp_mask


def compressed_block_mask(T: int, Tc: int, config: NSAConfig, device, block_size=(128, 128)) -> BlockMask:
    """BlockMask [1, 1, T, Tc] of the compressed branch (queries x compressed tokens)."""
    last_offset, stride = config.cmp_block - 1, config.cmp_stride

    def hi(t):
        # Floor division of a possibly negative numerator: -1 or less means no complete block yet.
        return torch.div(t - last_offset, stride, rounding_mode="floor")

    return interval_block_mask(T, Tc, torch.zeros_like, hi, block_size, compressed_mask_mod(config), device)
