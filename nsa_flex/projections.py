"""Several Linear layers over one input, as one matmul."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def fused_linear(x: torch.Tensor, layers: Sequence[nn.Linear]) -> list[torch.Tensor]:
    """[layer(x) for layer in layers], computed as one x @ cat(W)^T (+ cat(b)) split back into
    each layer's columns (views of one output).

    One matmul reads x once, and its backward makes x's gradient in one matmul rather than as a
    sum of one per layer: in a compiled block with four such terms Inductor wrote that sum in a
    pass of its own (docs/decisions.md, "Fused projections"). The layers keep their own
    parameters, so state dicts do not change. Without grad mode (decoding) each layer runs alone:
    the gain is the backward's, and the weights' copy would cost every decode step.
    """
    if len(layers) == 1 or not torch.is_grad_enabled():
        return [layer(x) for layer in layers]
    weight = torch.cat([layer.weight for layer in layers])
    bias = None
    if any(layer.bias is not None for layer in layers):
        bias = torch.cat([layer.bias if layer.bias is not None else layer.weight.new_zeros(layer.out_features)
                          for layer in layers])
    return list(nn.functional.linear(x, weight, bias).split([layer.out_features for layer in layers], dim=-1))
