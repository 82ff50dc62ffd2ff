"""Compressed-causal mask: query t sees compressed token i iff its block is complete, i*d + l - 1 <= t.

With packed documents, positions are document-local and nothing crosses a document.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from nsa_flex.config import NSAConfig
from nsa_flex.masks.documents import Documents
from nsa_flex.ops.blockmask import interval_block_mask


def compressed_mask_mod(config: NSAConfig, docs: Documents | None = None):
    """mask_mod over (query token, compressed token); the same for every batch and head."""
    last_offset, stride = config.cmp_block - 1, config.cmp_stride
    if docs is None:

        def cmp_mask(b, h, q_idx, kv_idx):
            return kv_idx * stride + last_offset <= q_idx

        return cmp_mask

    def cmp_doc_mask(b, h, q_idx, kv_idx):
        same_doc = docs.q_doc[q_idx] == docs.c_doc[kv_idx]
        local_q, local_c = q_idx - docs.q_start[q_idx], kv_idx - docs.c_start[kv_idx]
        return same_doc & (local_c * stride + last_offset <= local_q)

    return cmp_doc_mask


def compressed_block_mask(T: int, Tc: int, config: NSAConfig, device, block_size=(128, 128),
                          docs: Documents | None = None) -> BlockMask:
    """BlockMask [1, 1, T, Tc] of the compressed branch (queries x compressed tokens)."""
    last_offset, stride = config.cmp_block - 1, config.cmp_stride

    def lo(t):
        return torch.zeros_like(t) if docs is None else docs.cmp_start_of_q

    def hi(t):
        local = t if docs is None else t - docs.q_start
        # Floor division of a possibly negative numerator: below lo means no complete block yet.
        return lo(t) + torch.div(local - last_offset, stride, rounding_mode="floor")

    return interval_block_mask(T, Tc, lo, hi, block_size, compressed_mask_mod(config, docs), device)
