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
    """The Documents of cu_seqlens (T tokens) and cu_seqlens_cmp (Tc compressed tokens).

    Made by the op nsa_flex::documents, which torch.compile keeps opaque: its outputs are buffers
    of a fixed layout. Made by Inductor inside a graph without gradients, the tensors a Flex
    call's mask_mod reads stopped the lowering (torch 2.11: "convert FlexibleLayout to FixedLayout
    first"; a training graph keeps them for the backward, which fixes their layout), and the
    compiled path fell back to eager for packed documents (docs/decisions.md).
    """
    return Documents(*torch.ops.nsa_flex.documents(cu_seqlens, cu_seqlens_cmp, T, Tc))


@torch.library.custom_op("nsa_flex::documents", mutates_args=())
def _documents(cu_seqlens: torch.Tensor, cu_seqlens_cmp: torch.Tensor, T: int,
               Tc: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_doc, q_start, c_doc, c_start, cmp_start_of_q), as the Documents fields."""
    cu, cu_c = cu_seqlens.to(torch.int64), cu_seqlens_cmp.to(torch.int64)
    device = cu.device
    q_doc = document_of(cu, torch.arange(T, device=device))
    c_doc = document_of(cu_c, torch.arange(Tc, device=device))
    return q_doc, cu[q_doc], c_doc, cu_c[c_doc], cu_c[q_doc]


@_documents.register_fake
def _documents_fake(cu_seqlens, cu_seqlens_cmp, T, Tc):
    make = lambda n: cu_seqlens.new_empty(n, dtype=torch.int64)  # noqa: E731
    return make(T), make(T), make(Tc), make(Tc), make(T)
