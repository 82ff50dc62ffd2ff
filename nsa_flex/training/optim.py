"""AdamW (fused on CUDA) with decay on matrices only, and a warm-up + cosine LR schedule."""

from __future__ import annotations

import functools
import math

import torch
from torch import nn


def build_optimizer(model: nn.Module, *, lr: float, betas: tuple[float, float], weight_decay: float,
                    device: torch.device) -> torch.optim.AdamW:
    """Matrices (dim >= 2) get weight decay; vectors (norms, biases) do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    # The fused kernel exists for CUDA; on the CPU the default (foreach) path is used.
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=device.type == "cuda" or None)


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak LR for optimizer step `step` (0-based): linear warm-up, cosine decay."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, *, warmup: int, total: int,
                    min_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    factor = functools.partial(lr_factor, warmup=warmup, total=total, min_ratio=min_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
