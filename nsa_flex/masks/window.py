"""Sliding-window causal mask: query t sees keys t - w < s <= t (w tokens, the query included).

Query rows are folded (row rho = t*G + g, see masks/selection.py; G=1 is the plain layout).
With packed documents, the window stops at the query's document start.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from nsa_flex.masks.documents import Documents
from nsa_flex.ops.blockmask import interval_block_mask


def window_mask_mod(window: int, G: int = 1, docs: Documents | None = None):
    """mask_mod over (folded query row, key token); the same for every batch and kv head."""

    def win_mask(b, h, q_idx, kv_idx):
        t = q_idx // G
        return (kv_idx <= t) & (t - kv_idx < window)

    if docs is None:
        return win_mask

    def win_doc_mask(b, h, q_idx, kv_idx):
        return win_mask(b, h, q_idx, kv_idx) & (docs.q_doc[q_idx // G] == docs.q_doc[kv_idx])

    return win_doc_mask


def window_block_mask(T: int, window: int, device, block_size=(128, 128), G: int = 1,
                      docs: Documents | None = None) -> BlockMask:
    """BlockMask [1, 1, T*G, T] of the window branch (folded query rows x key tokens)."""

    def lo(rows):
        t = rows // G
        start = torch.clamp(t - window + 1, min=0)
        return start if docs is None else torch.maximum(start, docs.q_start[t])

    return interval_block_mask(T * G, T, lo, lambda rows: rows // G, block_size,
                               window_mask_mod(window, G, docs), device)
