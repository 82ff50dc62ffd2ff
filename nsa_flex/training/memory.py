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
- masks: the NSA flex path's selection indices and, where the selected branch is a Flex call
  (sel_impl="flex"), its BlockMask tensors (int32, full-width kv indices and their transpose, per
  layer); for the reference path the dense [T, T] scores, probabilities and masks of its three
  branches (O(T^2): the oracle's cost).
- workspace: where the selected branch is block-centric (the default), the buffers one layer's
  forward or backward holds while it runs: partial outputs (forward) or dQ partials and dK/dV
  partials (backward), n per (token, query head) of one token range, and the inverse index
  (nsa_flex.ops.selected_attention.launch.workspace_bytes). With it the estimate comes out 7-10%
  above seeds-125m's measured training peaks at 8k-64k (docs/decisions.md, "Training memory").
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

from nsa_flex.flex.masks.selection import initial_copies, tokens_per_tile
from nsa_flex.model import NSALM, NSAModelConfig
from nsa_flex.flex.blockmask import query_chunks
from nsa_flex.flex.tuning import FlexTiles

GIB = 2**30

PRECISIONS = ("fp32", "bf16", "fp16")
MEMORY_IMPLS = ("flex", "reference")
"""The NSA paths whose masks an estimate can count (a model's "auto" is resolved before)."""
PARALLELS = ("none", "ddp", "fsdp")


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
    workspace: int = 0

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer + self.weight_casts + self.activations + self.masks
                + self.logits + self.parallel_overhead + self.workspace)

    def rows(self) -> list[tuple[str, int]]:
        names = ("params", "grads", "optimizer", "weight_casts", "activations", "masks", "logits",
                 "parallel_overhead", "workspace")
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
             world_size: int = 1, impl: str = "flex", sel_q_block: int | None = None,
             sel_impl: str | None = None) -> MemoryEstimate:
    """Peak memory of one rank training `config` on micro-batches of [batch_size, seq_len].

    precision: fp32 | bf16 | fp16. impl: the NSA path ("flex" or "reference"; ignored for dense).
    sel_q_block: query rows per block of the selected branch's folded BlockMask (None: the
    length-based default of nsa_flex.flex.tuning.FlexTiles.sel_rows). sel_impl: the selected
    branch's implementation (None: FlexTiles.selected_impl's choice by group size).
    """
    for name, value, allowed in (("precision", precision, PRECISIONS), ("impl", impl, MEMORY_IMPLS),
                                 ("parallel", parallel, PARALLELS)):
        if value not in allowed:
            raise ValueError(f"{name}={value!r}: allowed {', '.join(allowed)}")
    counts = count_params(config)
    shard = world_size if parallel == "fsdp" else 1
    a = 4 if precision == "fp32" else 2
    tokens = batch_size * seq_len
    tiles = FlexTiles(sel_q_block=sel_q_block, sel_impl=sel_impl, sel_partial_bytes=config.sel_partial_bytes)
    layer = _layer_bytes(config, a, compiled, impl, seq_len, tiles)
    if activation_checkpointing:
        activations = int(config.n_layers * 4 * config.dim * tokens + layer * tokens)
    else:
        activations = int(config.n_layers * layer * tokens)
    # The final norm and the head run eagerly: fp32 input, fp32 normalised copy, low-precision cast.
    activations += (8 + a) * config.dim * tokens
    V = config.vocab_size
    # Compiled, the fused loss keeps only the low-precision logits and their gradient.
    logits = tokens * V * ((2 * a) if compiled else (12 + a))
    masks = _mask_bytes(config, batch_size, seq_len, impl, tiles)
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
        workspace=_workspace_bytes(config, batch_size, seq_len, impl, precision, tiles),
    )


def _layer_bytes(cfg: NSAModelConfig, a: int, compiled: bool, impl: str, T: int, tiles: FlexTiles) -> float:
    """Bytes saved for the backward per token per layer (a = activation bytes, fp32 residual).

    Itemised from the tensors the compiled blocks of seeds-125m save (saved_tensors_hooks on an
    H200, docs/records/model_memory_probe_h200.json; the masks are `_mask_bytes`).
    Both: the fp32 residual and two normalised low-precision copies (the inputs of the q/k/v and
    MLP matmuls), SwiGLU's three F-wide tensors. Dense: q, k, v, o, lse and the copy of o that
    feeds wo. NSA with impl flex: q (the gated node's, read in place; elsewhere its folded copy), the
    selected branch's k/v (with the initial-block copies where split; the window reads a view of
    them), three branch outputs and their lse,
    phi's d-token chunks, hidden and outputs, and the compressed k/v repeated per query chunk;
    gates, gated sum and wo's input are recomputed in the backward (NSAAttention._attend_flex).
    Eager blocks also keep RMSNorm's fp32 intermediates, SwiGLU's product and the head-merge copy.
    """
    n = cfg.nsa
    C, F, Hq, Hkv = cfg.dim, cfg.mlp_hidden, n.n_heads, n.n_kv_heads
    Aq, Ak, Av, Ao = Hq * n.head_dim, Hkv * n.head_dim, Hkv * n.dv, Hq * n.dv
    if compiled:
        norms, mlp = (4 + 2 * a) * C, 3 * a * F
    else:
        norms, mlp = 2 * (8 + a) * C, 4 * a * F
    if cfg.attention == "dense":
        return norms + mlp + a * (Aq + Ak + Av) + 2 * a * Ao + 4 * Hq
    flex = impl == "flex"
    block = flex and _block_centric(cfg, T, tiles)
    kv_len = T
    if flex and not block and tiles.split_at(T, n):
        copies = initial_copies(T, n.group_size, n, tiles.sel_rows(T, n), tiles.initial_copy_tokens)
        kv_len = T if copies is None else copies.kv_len
    chunks = query_chunks(T * n.group_size, tiles.cmp_block[0], tiles.max_chunks, tiles.min_chunk_rows)
    kv = a * (Ak + Av) * kv_len / T
    compress = a * Hkv * (n.head_dim + n.dv) * (1 + (2 + chunks) / n.cmp_stride)
    outs = 3 * (a if compiled else a + 4) * Ao + 3 * 4 * Hq
    recomputed = 0 if flex else a * Ao + 2 * a * max(16, C // 4) + (a + 4) * 3 * Hq
    # The block-centric op keeps its lse for its backward; its output is o_sel (one of `outs`) and it
    # reads q itself or its folded copy (docs/decisions.md, "Training memory"). The token-centric Flex
    # call keeps its folded output beside the unfolded o_sel.
    op_saved = 4 * Hq if block else a * Ao if flex else 0
    return norms + mlp + a * Aq + kv + compress + outs + recomputed + op_saved


def _mask_bytes(cfg: NSAModelConfig, B: int, T: int, impl: str, tiles: FlexTiles) -> int:
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
    elif _block_centric(cfg, T, tiles):
        # The selection (int32 [Hkv, T, n]), saved for the op's backward; no BlockMask lists. The
        # gated node also keeps the selected op's inverse index for its backward: per (kv head,
        # token, slot) an int32 block id and an int32 entry.
        per_seq = (12 if tiles.gated_node else 4) * n.n_kv_heads * T * n.n_selected
    else:
        # The mask_mod's selection bits; per query tile a kv-side list (the union of its tokens'
        # blocks), per kv block a q-side list as wide as the query tiles (Flex's backward needs
        # that width); both once more for the full blocks where they are listed apart.
        bits = 4 * n.n_kv_heads * T * math.ceil(Ns / 32)
        q_block = tiles.sel_rows(T, n)
        q_blocks = math.ceil(T * n.group_size / q_block)
        kv_blocks = Ns
        if tiles.split_at(T, n):
            copies = initial_copies(T, n.group_size, n, q_block, tiles.initial_copy_tokens)
            kv_blocks += 0 if copies is None else copies.count * n.n_initial
        width = min(kv_blocks, tokens_per_tile(n.group_size, q_block) * n.n_selected)
        lists = 4 * n.n_kv_heads * q_blocks * (kv_blocks + width)
        per_seq = bits + lists * (2 if tiles.sel_full_blocks else 1)
    return int(cfg.n_layers * B * per_seq)


def _block_centric(cfg: NSAModelConfig, T: int, tiles: FlexTiles) -> bool:
    return cfg.attention != "dense" and tiles.selected_impl(T, cfg.nsa.group_size) == "block"


def _workspace_bytes(cfg: NSAModelConfig, B: int, T: int, impl: str, precision: str, tiles: FlexTiles) -> int:
    """The block-centric selected branch's buffers while one layer's forward or backward runs."""
    if impl != "flex" or not _block_centric(cfg, T, tiles):
        return 0
    from nsa_flex.flex.branches import forces_local
    from nsa_flex.ops.selected_attention.launch import workspace_bytes

    n = cfg.nsa
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    return workspace_bytes(B, T, n.n_heads, n.n_kv_heads, n.n_selected, n.head_dim, n.dv, n.sel_block, dtype,
                           tiles.sel_partial_bytes or 0, skip_local=forces_local(None, n, tiles))


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
