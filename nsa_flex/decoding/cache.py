"""NSACache: the decode state of one NSA layer, preallocated so every decode step has static shapes.

For a batch of B sequences of (possibly) different lengths, up to Tmax tokens each:

- raw keys/values of the selected and window branches, [B, Hkv, Tmax, D] (keys after RoPE);
  the window branch has its own pair only with separate K/V projections;
- the compressed keys/values, [B, Hkv, Tcmax, D] with Tcmax = (Tmax - l) // d + 1: entry i
  is written when token i*d + l - 1 arrives (a new entry every d tokens once l are there);
- the tail not yet compressed: the cmp branch's own (un-rotated) keys/values of the last l
  tokens, [B, Hkv, l, D], a ring indexed by position % l, from which phi builds each entry;
- lengths [B]: tokens held per sequence, i.e. the position of each sequence's next token;
- phi_count [B, Hkv, 2]: scratch counts of the decode step's kernel, zero between steps.

Head-major ([B, Hkv, T, D], as SDPA's dense decode reads it): each kv head's keys are one
contiguous matrix, so the branch matmuls batch over (B, Hkv) without a copy.

Slots past a sequence's length hold stale data (padding from a batched prefill, an earlier
request); every read masks by position and every slot is written before it is read, so the
cache never needs clearing.
"""

from __future__ import annotations

import torch
from torch import nn

from nsa_flex.blocks import num_cmp_blocks, num_sel_blocks
from nsa_flex.config import NSAConfig


class NSACache(nn.Module):
    """Decode state of one NSA layer: B sequences, at most max_len tokens each (see module doc)."""

    def __init__(self, config: NSAConfig, batch_size: int, max_len: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"NSACache batch_size={batch_size}: must be >= 1")
        if max_len < 1:
            raise ValueError(f"NSACache max_len={max_len}: must be >= 1")
        self.config, self.batch_size, self.max_len = config, batch_size, max_len
        B, Hkv, Dk, Dv, l = batch_size, config.n_kv_heads, config.head_dim, config.dv, config.cmp_block
        # At least one compressed slot, so shapes never hold a 0 (the slot stays masked).
        self.max_cmp = max(1, num_cmp_blocks(max_len, config))
        self.num_sel = num_sel_blocks(max_len, config)

        def buffer(name: str, *shape: int, dtype=dtype) -> None:
            t = torch.zeros(*shape, dtype=dtype, device=device)
            # A fixed address lets a CUDA graph update the cache in place (no copy per step).
            torch._dynamo.mark_static_address(t)
            self.register_buffer(name, t, persistent=False)

        buffer("k", B, Hkv, max_len, Dk)
        buffer("v", B, Hkv, max_len, Dv)
        if config.separate_kv:
            buffer("k_win", B, Hkv, max_len, Dk)
            buffer("v_win", B, Hkv, max_len, Dv)
        else:
            self.k_win, self.v_win = self.k, self.v
        buffer("k_cmp", B, Hkv, self.max_cmp, Dk)
        buffer("v_cmp", B, Hkv, self.max_cmp, Dv)
        buffer("k_tail", B, Hkv, l, Dk)
        buffer("v_tail", B, Hkv, l, Dv)
        buffer("lengths", B, dtype=torch.int64)
        # cache_step's programs that share a completed block's phi count themselves in here; the
        # last sets it back to 0 (nsa_flex.ops.decode.cache_step.check_phi_count).
        buffer("phi_count", B, Hkv, 2, dtype=torch.int32)

    def extra_repr(self) -> str:
        return (f"batch_size={self.batch_size}, max_len={self.max_len}, max_cmp={self.max_cmp}, "
                f"dtype={self.k.dtype}, device={self.k.device}")
