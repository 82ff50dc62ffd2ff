"""Sliding-window causal mask: query t sees keys t - w < s <= t (w tokens, the query included).

With packed documents, the window stops at the query's document start.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from nsa_flex.masks.documents import Documents
from nsa_flex.ops.blockmask import interval_block_mask


def window_mask_mod(window: int, docs: Documents | None = None):
    """mask_mod over (query token, key token); the same for every batch and head."""

    def win_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    if docs is None:
        return win_mask

    def win_doc_mask(b, h, q_idx, kv_idx):
        return win_mask(b, h, q_idx, kv_idx) & (docs.q_doc[q_idx] == docs.q_doc[kv_idx])

    return win_doc_mask


def window_block_mask(T: int, window: int, device, block_size=(128, 128), docs: Documents | None = None) -> BlockMask:
    """BlockMask [1, 1, T, T] of the window branch."""

    def lo(t):
        start = torch.clamp(t - window + 1, min=0)
        return start if docs is None else torch.maximum(start, docs.q_start)

    return interval_block_mask(T, T, lo, lambda t: t, block_size, window_mask_mod(window, docs), device)
