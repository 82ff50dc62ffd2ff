"""Sliding-window causal mask: query t sees keys t - w < s <= t (w tokens, the query included).

Query rows are folded (row rho = t*G + g, see masks/selection.py; G=1 is the plain layout).
With packed documents, the window stops at the query's document start.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from nsa_flex.flex.masks.documents import Documents
from nsa_flex.flex.blockmask import interval_block_mask


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
                               window_mask_mod(window, G, docs), device, widths=window_widths(window, block_size, G))


def window_widths(window: int, block_size: tuple[int, int], G: int = 1) -> tuple[int, int]:
    """Most kv blocks one query tile sees, and most query tiles that see one kv block.

    A tile of qbs folded rows spans at most ceil(qbs / G) tokens (plus one when G does not
    divide qbs) and sees the w - 1 keys before its first token: that many keys touch at most
    ceil(keys / kbs) + 1 kv blocks. A kv block of kbs keys is seen by kbs + w - 1 tokens, i.e.
    (kbs + w - 1) * G rows, which touch at most ceil(rows / qbs) + 1 tiles. Documents only
    shorten windows, so the bounds hold for them too.
    """
    qbs, kbs = block_size
    tokens = -(-qbs // G) + 1
    kv_side = -(-(tokens + window - 1) // kbs) + 1
    q_side = -(-((kbs + window - 1) * G) // qbs) + 1
    return kv_side, q_side
