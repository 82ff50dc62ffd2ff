"""NSA settings: one frozen, keyword-only dataclass, validated on construction.

Letters follow the paper (DeepSeek, "Native Sparse Attention", arXiv 2502.11089):
l = cmp_block, d = cmp_stride, l' = sel_block, n = n_selected, w = window.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

MAX_SELECTED = 4096
"""Upper bound of n_selected: 4096 blocks are 262144 tokens at l'=64, past any sequence NSA is run on."""


@dataclass(frozen=True, kw_only=True)
class NSAConfig:
    """Shape and sparsity settings of one NSA attention layer."""

    n_heads: int = 64
    """Hq: query heads."""
    n_kv_heads: int = 4
    """Hkv: key/value heads; the G = Hq / Hkv query heads of a group share one selection."""
    head_dim: int = 128
    """d_k: query/key head dimension."""
    head_dim_v: int | None = None
    """d_v: value head dimension; None means equal to d_k."""
    cmp_block: int = 32
    """l: tokens per compression block."""
    cmp_stride: int = 16
    """d: stride between consecutive compression blocks (blocks overlap when d < l)."""
    sel_block: int = 64
    """l': tokens per selection block."""
    n_selected: int = 16
    """n: selection blocks each query attends to (forced blocks included), at most MAX_SELECTED.
    A sequence with fewer blocks selects all of them; the unused slots are -1."""
    n_initial: int = 1
    """Leading blocks (block 0, ...) that are always selected."""
    n_local: int = 2
    """Local blocks (the query's own and the previous ones) that are always selected."""
    window: int = 512
    """w: sliding-window size in tokens, the query itself included."""
    separate_kv: bool = False
    """Independent K/V projections for each branch (paper section 3.3.3)."""

    def __post_init__(self) -> None:
        # Types first, so the value rules below never compare a str or None with an int.
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "bool":
                _require(field.name, value, isinstance(value, bool), "must be a bool")
            elif field.type == "int" or (field.type == "int | None" and value is not None):
                _require(field.name, value, isinstance(value, int) and not isinstance(value, bool),
                         "must be an int" if field.type == "int" else "must be an int or None")
        for field in ("n_heads", "n_kv_heads", "head_dim", "cmp_block", "cmp_stride",
                      "sel_block", "n_selected", "window"):
            _require(field, getattr(self, field), getattr(self, field) > 0, "must be a positive integer")
        for field in ("n_initial", "n_local"):
            _require(field, getattr(self, field), getattr(self, field) >= 0, "must be >= 0")
        if self.head_dim_v is not None:
            _require("head_dim_v", self.head_dim_v, self.head_dim_v > 0, "must be a positive integer or None")
        _require("n_heads", self.n_heads, self.n_heads % self.n_kv_heads == 0,
                 f"must be divisible by n_kv_heads={self.n_kv_heads}")
        _require("cmp_block", self.cmp_block, self.cmp_block % self.cmp_stride == 0,
                 f"must be divisible by cmp_stride={self.cmp_stride}")
        _require("sel_block", self.sel_block, self.sel_block % self.cmp_stride == 0,
                 f"must be divisible by cmp_stride={self.cmp_stride}")
        _require("n_selected", self.n_selected, self.n_selected <= MAX_SELECTED,
                 f"must be <= {MAX_SELECTED}: a query attends to at most the selection blocks its sequence has "
                 f"({MAX_SELECTED} blocks of l'={self.sel_block} are {MAX_SELECTED * self.sel_block} tokens), and "
                 "the selection's output holds n slots per token")
        _require("n_selected", self.n_selected, self.n_selected >= self.n_initial + self.n_local,
                 f"must be >= n_initial + n_local = {self.n_initial + self.n_local} (the forced blocks)")

    @property
    def group_size(self) -> int:
        """G: query heads per kv head."""
        return self.n_heads // self.n_kv_heads

    @property
    def dv(self) -> int:
        """d_v, resolved."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    def replace(self, **changes) -> "NSAConfig":
        return dataclasses.replace(self, **changes)


def _require(field: str, value, ok: bool, rule: str) -> None:
    if not ok:
        raise ValueError(f"NSAConfig.{field}={value!r}: {rule}")


PRESETS: dict[str, NSAConfig] = {
    # The paper's layer: 64 query heads over 4 kv heads, d_k=192, d_v=128.
    "paper": NSAConfig(n_heads=64, n_kv_heads=4, head_dim=192, head_dim_v=128),
    # The benchmark shape of the reference figures (docs/results.md): group 16, head dim 128.
    "bench": NSAConfig(n_heads=64, n_kv_heads=4, head_dim=128),
    # Group 4: where no public implementation is fast.
    "g4": NSAConfig(n_heads=16, n_kv_heads=4, head_dim=128),
    # Small enough for CPU tests and demos (same sparsity geometry, smaller window).
    "tiny": NSAConfig(n_heads=4, n_kv_heads=2, head_dim=32, head_dim_v=24, window=128, n_selected=4),
}
