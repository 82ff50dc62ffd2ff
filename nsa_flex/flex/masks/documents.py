"""Packed documents (cu_seqlens): which document every token and compressed token belongs to."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nsa_flex.blocks import document_of


@dataclass(frozen=True)
class Documents:
    """Per-position document ids and document starts of one packed sequence (B == 1).

    Built from cu_seqlens with searchsorted: no host sync, so it traces into a compiled graph.
    """

    q_doc: torch.Tensor
    """[T] int64: document of each token."""
    q_start: torch.Tensor
    """[T] int64: first token of each token's document."""
    c_doc: torch.Tensor
    """[Tc] int64: document of each compressed token."""
    c_start: torch.Tensor
    """[Tc] int64: first compressed token of each compressed token's document."""
    cmp_start_of_q: torch.Tensor
    """[T] int64: first compressed token of each token's document."""


def documents(cu_seqlens: torch.Tensor, cu_seqlens_cmp: torch.Tensor, T: int, Tc: int) -> Documents:
    cu, cu_c = cu_seqlens.to(torch.int64), cu_seqlens_cmp.to(torch.int64)
    device = cu.device
    q_doc = document_of(cu, torch.arange(T, device=device))
    c_doc = document_of(cu_c, torch.arange(Tc, device=device))
    return Documents(q_doc=q_doc, q_start=cu[q_doc], c_doc=c_doc, c_start=cu_c[c_doc], cmp_start_of_q=cu_c[q_doc])
