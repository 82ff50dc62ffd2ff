"""Peak training memory of a configuration, estimated from its shapes (`nsa-flex memory`).

Parts and how exact they are:
- params, grads, optimizer: exact. fp32 weights (4 B/param), fp32 grads (4 B/param), AdamW's
  exp_avg and exp_avg_sq (8 B/param) plus one 4-byte step counter per tensor. FSDP2 divides
  them by the world size and adds the unsharded weights of about two blocks and the root;
  DDP adds its gradient buckets (4 B/param).
- weight casts: the bf16/fp16 copies of the matmul weights that autocast makes and the
  backward keeps (2 B per Linear weight); none in fp32.
- activations: tensors saved for the backward, per token per layer, from the formulas in
  `_layer_bytes` (eager vs compiled blocks; activation checkpointing keeps only each block's
  input plus one block's activations); an estimate, checked on the GPU by bench/train_gpu.py.
- masks: the NSA flex path's selection indices and selected-branch BlockMask tensors (int32,
  full-width kv indices and their transpose, per layer); for the reference path the dense
  [T, T] scores, probabilities and masks of its three branches (O(T^2): the oracle's cost).
- logits: the output layer and the loss (fp32 log-softmax and its gradient when eager; a
  fused compiled loss keeps the low-precision logits and their gradient).
The total adds every part, as if all gradients were alive at the activation peak; that
makes it a slight over-estimate (by at most the grads row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from nsa_flex.model import NSALM, NSAModelConfig
from nsa_flex.tuning import FlexTiles

GIB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per part of the peak (see module docstring)."""

    params: int
    grads: int
    optimizer: int
    weight_casts: int
    activations: int
    masks: int
    logits: int
    parallel_overhead: int

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer + self.weight_casts + self.activations + self.masks
                + self.logits + self.parallel_overhead)

    def rows(self) -> list[tuple[str, int]]:
        names = ("params", "grads", "optimizer", "weight_casts", "activations", "masks", "logits",
                 "parallel_overhead")
        return [(n, getattr(self, n)) for n in names] + [("total", self.total)]


@dataclass(frozen=True)
class ParamCounts:
    total: int
    """Parameters (tied ones once)."""
    tensors: int
    """Parameter tensors (AdamW keeps one step counter each)."""
    linear: int
    """Parameters in Linear weights (autocast casts these)."""
    per_block: int
    root: int
    """Parameters outside the blocks (embedding, head, final norm)."""


def count_params(config: NSAModelConfig) -> ParamCounts:
    """Exact counts, from the model built on the meta device (no memory used)."""
    model = NSALM(config, device="meta")
    params = list(model.parameters())
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    if config.tie_embeddings:
        linear -= model.head.weight.numel()
    per_block = sum(p.numel() for p in model.layers[0].parameters())
    total = sum(p.numel() for p in params)
    return ParamCounts(total, len(params), linear, per_block, total - per_block * config.n_layers)


def estimate(config: NSAModelConfig, *, batch_size: int, seq_len: int, precision: str = "bf16",
             compiled: bool = True, activation_checkpointing: bool = False, parallel: str = "none",
             world_size: int = 1, impl: str = "flex", sel_q_block: int | None = None) -> MemoryEstimate:
    """Peak memory of one rank training `config` on micro-batches of [batch_size, seq_len].

    precision: fp32 | bf16 | fp16. impl: the NSA path ("flex" or "reference"; ignored for dense).
    sel_q_block: query rows per block of the selected branch's folded BlockMask (None: the
    length-based default of nsa_flex.tuning.FlexTiles.sel_rows).
    """
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"precision={precision!r}: allowed fp32, bf16, fp16")
    counts = count_params(config)
    shard = world_size if parallel == "fsdp" else 1
    a = 4 if precision == "fp32" else 2
    tokens = batch_size * seq_len
    tiles = FlexTiles(sel_q_block=sel_q_block)
    layer = _layer_bytes(config, a, compiled, impl == "flex" and tiles.split_at(seq_len, config.nsa))
    if activation_checkpointing:
        activations = config.n_layers * 4 * config.dim * tokens + layer * tokens
    else:
        activations = config.n_layers * layer * tokens
    # The final norm and the head run eagerly: fp32 input, fp32 normalised copy, low-precision cast.
    activations += (8 + a) * config.dim * tokens
    V = config.vocab_size
    logits = tokens * V * ((2 * a + 4) if compiled else (12 + a))
    masks = _mask_bytes(config, batch_size, seq_len, impl, tiles.sel_rows(seq_len, config.nsa))
    if activation_checkpointing:
        masks //= config.n_layers
    overhead = 0
    if parallel == "ddp":
        overhead = 4 * counts.total
    elif parallel == "fsdp":
        overhead = 4 * (2 * counts.per_block + counts.root)
    return MemoryEstimate(
        params=4 * counts.total // shard,
        grads=4 * counts.total // shard,
        optimizer=(8 * counts.total + 4 * counts.tensors) // shard,
        weight_casts=0 if precision == "fp32" else 2 * counts.linear // shard,
        activations=activations,
        masks=masks,
        logits=logits,
        parallel_overhead=overhead,
    )


def _layer_bytes(cfg: NSAModelConfig, a: int, compiled: bool, split: bool = True) -> int:
    """Bytes saved for the backward per token per layer (a = activation bytes, fp32 residual).

    split: the selected branch's keys and values carry the initial-block copies
    (FlexTiles.split_at): one contiguous copy of each is kept for the backward. The other
    terms were fitted on an H200 when the split was a separate Flex call, whose output and
    the fp32 operands of its lse merge, ~(8 + 2a) bytes per output element, are gone now.
    """
    n = cfg.nsa
    C, F, Hq = cfg.dim, cfg.mlp_hidden, n.n_heads
    Aq, Ak, Av, Ao = Hq * n.head_dim, n.n_kv_heads * n.head_dim, n.n_kv_heads * n.dv, Hq * n.dv
    if compiled:
        # Matmul inputs and attention inputs/outputs; pointwise ops are recomputed.
        norms = 2 * (4 + a) * C
        mlp = 3 * a * F
        wo_input = 0
    else:
        # RMSNorm keeps its fp32 input and normalised output plus the autocast copy; SwiGLU keeps
        # w1/w3 outputs, silu's output and the product; the head-merge reshape copies o.
        norms = 2 * (8 + a) * C
        mlp = 4 * a * F
        wo_input = a * Ao
    attn = a * (Aq + Ak + Av) + wo_input
    if cfg.attention == "dense":
        return norms + mlp + attn + a * Ao + 4 * Hq
    l_over_d = n.cmp_block / n.cmp_stride
    compress = a * n.n_kv_heads * (n.head_dim + n.dv) * (l_over_d + 3 / n.cmp_stride)
    gate = 2 * a * max(16, C // 4) + (a + 4) * 3 * Hq
    branch_out = 3 * (a if compiled else a + 4) * Ao + 3 * 4 * Hq
    folded = a * (Aq + Ao)
    copies = a * (Ak + Av) if split else 0
    return int(norms + mlp + attn + compress + gate + branch_out + folded - (8 + 2 * a) * Ao + copies)


def _mask_bytes(cfg: NSAModelConfig, B: int, T: int, impl: str, sel_q_block: int) -> int:
    """Mask/selection tensors of all layers for one micro-batch (0 for dense attention)."""
    if cfg.attention == "dense":
        return 0
    n = cfg.nsa
    Ns = math.ceil(T / n.sel_block)
    Tc = max(0, (T - n.cmp_block) // n.cmp_stride + 1)
    if impl == "reference":
        # Per sel/win branch: fp32 scores, exp, probabilities and a bool mask; cmp the same over Tc;
        # the selection mask; fp32 copies of k/v repeated per query head.
        per_seq = (2 * 13 * n.n_heads * T * T + 13 * n.n_heads * T * Tc + n.n_kv_heads * T * T
                   + 3 * 4 * n.n_heads * (n.head_dim + n.dv) * T)
    else:
        indices = 8 * n.n_kv_heads * T * n.n_selected
        q_blocks = math.ceil(T * n.group_size / sel_q_block)
        block_mask = 2 * 4 * n.n_kv_heads * q_blocks * Ns
        per_seq = indices + block_mask
    return cfg.n_layers * B * per_seq


def persistent_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Measured bytes of parameters, gradients and optimizer state (for checking the estimate)."""
    params = list(model.parameters())
    out = {"params": sum(p.numel() * p.element_size() for p in params),
           "grads": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)}
    if optimizer is not None:
        out["optimizer"] = sum(t.numel() * t.element_size() for s in optimizer.state.values()
                               for t in s.values() if isinstance(t, torch.Tensor))
    return out


def format_table(est: MemoryEstimate) -> str:
    """A Markdown table of the parts, in GiB and MiB."""
    lines = ["| part | GiB | MiB |", "|---|---:|---:|"]
    lines += [f"| {name} | {b / GIB:.3f} | {b / 2**20:.1f} |" for name, b in est.rows()]
    return "\n".join(lines)
