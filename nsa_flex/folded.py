"""The folded GQA layout: q [B, T, Hq, D] <-> [B, Hkv, T*G, D], row t*G + g of kv head h being query
head h*G + g at token t. The Flex calls and the grouped cuDNN call take queries this way; the
gated sum and the selected op read and write it in place (design.md, "Folded GQA")."""

from __future__ import annotations

from typing import NamedTuple

import torch


def fold(x_bthd: torch.Tensor, Hkv: int, rows: int | None = None) -> torch.Tensor:
    """[B, T, Hq, D] -> [B, Hkv, T*G, D]: row t*G + g of kv head h is query head h*G + g at token t.

    rows > T*G: that many rows per kv head, zeros past T*G.
    """
    B, T, Hq, D = x_bthd.shape
    out = x_bthd.view(B, T, Hkv, Hq // Hkv, D).transpose(1, 2).reshape(B, Hkv, T * (Hq // Hkv), D)
    return out if rows is None or rows <= out.shape[2] else torch.nn.functional.pad(out, (0, 0, 0, rows - out.shape[2]))


def unfold(x_bhrd: torch.Tensor, T: int) -> torch.Tensor:
    """[B, Hkv, T*G, D] -> [B, T, Hq, D] (a view when possible; compiled, it fuses into the consumer)."""
    B, Hkv, rows, D = x_bhrd.shape
    G = rows // T
    return x_bhrd.reshape(B, Hkv, T, G, D).transpose(1, 2).reshape(B, T, Hkv * G, D)


def group_strides(x: torch.Tensor, G: int, folded: bool) -> tuple[int, int, int, int]:
    """(batch, token, kv head, group member) strides of x [B, T, Hq, D], or with folded x [B, Hkv, R, D]:
    the element of query head h*G + g at token t lies at b*s0 + t*s1 + h*s2 + g*s3 either way."""
    if folded:
        return x.stride(0), G * x.stride(2), x.stride(1), x.stride(2)
    return x.stride(0), x.stride(1), G * x.stride(2), x.stride(2)


class FoldedRows(NamedTuple):
    """Folded rows [B, Hkv, R, D] held from row `head` on: x[:, :, i] is folded row head + i.

    Rows before head are zero and not stored (the compressed branch's tokens before the first
    complete block); rows of x past the sequence's T*G are padding. The grouped cuDNN call's
    output is this way a view, with no copy into the full [B, Hkv, T*G, D].
    """

    x: torch.Tensor
    head: int

    def dense(self, rows: int) -> torch.Tensor:
        """[B, Hkv, rows, D] with the zero rows in front (a new tensor unless head is 0 and x has rows rows)."""
        x = self.x[:, :, :rows - self.head]
        return x if self.head == 0 and x.shape[2] == rows else torch.nn.functional.pad(x, (0, 0, self.head, 0))
