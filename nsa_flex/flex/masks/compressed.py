"""Compressed-causal mask: query t sees compressed token i iff its block is complete, i*d + l - 1 <= t.

Query rows are folded (row rho = t*G + g, see masks/selection.py; G=1 is the plain layout).
With packed documents, positions are document-local and nothing crosses a document.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from nsa_flex.config import NSAConfig
from nsa_flex.flex.masks.documents import Documents
from nsa_flex.flex.blockmask import interval_block_mask


def compressed_mask_mod(config: NSAConfig, G: int = 1, docs: Documents | None = None):
    """mask_mod over (folded query row, compressed token); the same for every batch and kv head."""
    last_offset, stride = config.cmp_block - 1, config.cmp_stride
    if docs is None:

        def cmp_mask(b, h, q_idx, kv_idx):
            return kv_idx * stride + last_offset <= q_idx // G

        return cmp_mask

    def cmp_doc_mask(b, h, q_idx, kv_idx):
        t = q_idx // G
        same_doc = docs.q_doc[t] == docs.c_doc[kv_idx]
        local_q, local_c = t - docs.q_start[t], kv_idx - docs.c_start[kv_idx]
        return same_doc & (local_c * stride + last_offset <= local_q)

    return cmp_doc_mask


def compressed_block_mask(T: int, Tc: int, config: NSAConfig, device, block_size=(128, 128), G: int = 1,
                          docs: Documents | None = None, *, chunks: int = 1, heads: int = 1) -> BlockMask:
    """BlockMask [1, 1, T*G, Tc] of the compressed branch (folded query rows x compressed tokens).

    chunks > 1: [1, heads*chunks, T*G/chunks, Tc], the rows split into chunks passed as extra
    heads (see ops.blockmask.query_chunks)."""
    last_offset, stride = config.cmp_block - 1, config.cmp_stride

    def lo(rows):
        return torch.zeros_like(rows) if docs is None else docs.cmp_start_of_q[rows // G]

    def hi(rows):
        t = rows // G
        local = t if docs is None else t - docs.q_start[t]
        # Floor division of a possibly negative numerator: below lo means no complete block yet.
        return lo(rows) + torch.div(local - last_offset, stride, rounding_mode="floor")

    return interval_block_mask(T * G, Tc, lo, hi, block_size, compressed_mask_mod(config, G, docs), device,
                               chunks=chunks, heads=heads)
