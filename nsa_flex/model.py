"""A decoder-only language model whose attention is NSA or dense causal SDPA.

Pre-norm blocks: x + attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)); a final RMSNorm and a
linear head (tied to the embedding or not). `attention="nsa"` uses `NSAAttention`;
`attention="dense"` uses `DenseAttention` (causal `scaled_dot_product_attention`, GQA) with
the same projections, initialisation and RoPE, so every NSA-vs-dense comparison is between
two models that differ only in the attention op.

RoPE (rotate-half layout, fp32 tables cast to the activations' dtype) is applied to all
queries and to the keys of the selected and window branches. The compressed keys are built
by phi from the *un-rotated* keys: phi has its own intra-block position encoding, and a
compressed token stands for 32 positions at once, so a single rotation angle would be
arbitrary. Positional information therefore reaches the compressed branch only through the
queries' rotation and phi's intra-block encoding; selection is content-based. The decode
cache (nsa_flex.decoding.cache) keeps rotated keys for sel/win and un-rotated ones for phi, to match.

Shapes: B batch, T tokens, C model dim, V vocabulary, Hq/Hkv heads, Dk/Dv head dims.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nsa_flex.attention import IMPLS, NSAAttention, resolve_impl
from nsa_flex.config import NSAConfig
from nsa_flex.flex.tuning import FlexTiles
from nsa_flex.projections import fused_linear
from nsa_flex.validate import check_compiled, is_byte_count

ATTENTIONS = ("nsa", "dense")
MODEL_IMPLS = IMPLS
RUNTIME_FIELDS = ("impl", "sel_partial_bytes")
"""NSAModelConfig fields that choose how the model runs, not what it computes: a checkpoint
resumes under other values of them."""
IGNORE_INDEX = -100
"""Targets equal to this take no part in the loss (unpredictable positions of a task)."""


@dataclass(frozen=True, kw_only=True)
class NSAModelConfig:
    """Shape of the language model. The attention heads and sparsity live in `nsa`."""

    vocab_size: int = 32000
    """V: embedding rows and output logits."""
    dim: int = 768
    """C: width of the residual stream."""
    n_layers: int = 12
    """Transformer blocks."""
    mlp_hidden: int = 2048
    """Hidden width of the SwiGLU MLP."""
    max_seq_len: int = 2048
    """Longest sequence the RoPE tables cover."""
    attention: str = "nsa"
    """"nsa" (NSAAttention) or "dense" (causal SDPA): the only difference between compared models."""
    impl: str = "auto"
    """NSA implementation: "reference", "flex", or "auto" (flex on CUDA, reference elsewhere)."""
    nsa: NSAConfig = field(default_factory=lambda: NSAConfig(n_heads=12, n_kv_heads=3, head_dim=64))
    """Heads, head dims and sparsity geometry; the heads apply to dense attention too."""
    tie_embeddings: bool = False
    """Share the embedding matrix with the output head."""
    rope_theta: float = 10000.0
    """RoPE base."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    sel_partial_bytes: int = 2 << 30
    """NSA layers: the selected op's partial buffers per token range (FlexTiles.sel_partial_bytes), a
    speed and memory setting that leaves results unchanged. In training the activations are the
    peak, not these buffers: at 64k tokens seeds-125m's layers take one range of 1.5 GiB instead of
    two of 768 MiB, 1-2 ms a step faster at the same peak (H100, docs/decisions.md); the op alone
    keeps 1 GiB, where they are its peak."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "mlp_hidden", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"NSAModelConfig.{name}={value!r}: must be a positive integer")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"NSAModelConfig.attention={self.attention!r}: allowed: {', '.join(ATTENTIONS)}")
        if self.impl not in MODEL_IMPLS:
            raise ValueError(f"NSAModelConfig.impl={self.impl!r}: allowed: {', '.join(MODEL_IMPLS)}")
        if not isinstance(self.nsa, NSAConfig):
            raise TypeError(f"NSAModelConfig.nsa must be an NSAConfig, got {type(self.nsa).__name__}")
        if self.nsa.head_dim % 2:
            raise ValueError(f"NSAModelConfig.nsa.head_dim={self.nsa.head_dim}: RoPE needs an even head dim")
        if not is_byte_count(self.sel_partial_bytes):
            raise ValueError(f"NSAModelConfig.sel_partial_bytes={self.sel_partial_bytes!r}: must be a positive "
                             "number of bytes")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError("NSAModelConfig.rope_theta and norm_eps must be > 0")

    def replace(self, **changes) -> "NSAModelConfig":
        return dataclasses.replace(self, **changes)

    def resolve(self, device: torch.device | str) -> "NSAModelConfig":
        """This config with impl="auto" made concrete for `device` (the one place it is decided)."""
        return self.replace(impl=resolve_impl(self.impl, torch.device(device)))


MODEL_PRESETS: dict[str, NSAModelConfig] = {
    # The ~125M model of the earlier implementation's production runs (docs/results.md, reference figures): 12 layers,
    # dim 768, 12 query heads over 3 kv heads of 64, SwiGLU 2048, vocab 32000, S=2048.
    "seeds-125m": NSAModelConfig(),
    # For CPU tests and demos. The NSA geometry is scaled down with it (l=16, d=8, l'=16,
    # n=4, w=32) so that at T=256 selection still picks 4 of 16 blocks and matters.
    "tiny": NSAModelConfig(
        vocab_size=512, dim=128, n_layers=2, mlp_hidden=384, max_seq_len=256,
        nsa=NSAConfig(n_heads=4, n_kv_heads=2, head_dim=32, cmp_block=16, cmp_stride=8,
                      sel_block=16, n_selected=4, window=32),
    ),
}


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and returned in x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x_btc: torch.Tensor) -> torch.Tensor:
        x = x_btc.float()
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)
        return (x * self.weight.float()).to(x_btc.dtype)


class Rotary(nn.Module):
    """RoPE tables: cos/sin [max_seq_len, D/2] in fp32 (non-persistent buffers)."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles_td = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", angles_td.cos().float(), persistent=False)
        self.register_buffer("sin", angles_td.sin().float(), persistent=False)

    def tables(self, positions: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for `positions` (a tensor of positions, or T meaning 0..T-1)."""
        if isinstance(positions, int):
            if positions > self.cos.shape[0]:
                raise ValueError(f"sequence of {positions} tokens exceeds max_seq_len={self.cos.shape[0]}")
            return self.cos[:positions], self.sin[:positions]
        return self.cos[positions], self.sin[positions]


def apply_rotary(x_bthd: torch.Tensor, cos_td: torch.Tensor, sin_td: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [B, T, H, D] with tables [T, D/2] (or [B, T, D/2])."""
    cos = cos_td.to(x_bthd.dtype).unsqueeze(-2)
    sin = sin_td.to(x_bthd.dtype).unsqueeze(-2)
    x1, x2 = x_bthd.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class DenseAttention(nn.Module):
    """Causal GQA attention through SDPA, with NSAAttention's projections and initialisation.

    x [B, T, C] -> [B, T, C]; `rotary` is the same (q, k) -> (q, k) callable NSAAttention takes.
    """

    def __init__(self, config: NSAConfig, dim: int):
        super().__init__()
        self.config, self.dim = config, dim
        Hq, Hkv, Dk, Dv = config.n_heads, config.n_kv_heads, config.head_dim, config.dv
        self.wq = nn.Linear(dim, Hq * Dk, bias=False)
        self.wk = nn.Linear(dim, Hkv * Dk, bias=False)
        self.wv = nn.Linear(dim, Hkv * Dv, bias=False)
        self.wo = nn.Linear(Hq * Dv, dim, bias=False)
        nn.init.normal_(self.wo.weight, std=0.02 / math.sqrt(2))

    def forward(self, x_btc: torch.Tensor, *, rotary=None) -> torch.Tensor:
        cfg = self.config
        B, T, _ = x_btc.shape
        q, k, v = fused_linear(x_btc, [self.wq, self.wk, self.wv])
        q = q.view(B, T, cfg.n_heads, cfg.head_dim)
        k = k.view(B, T, cfg.n_kv_heads, cfg.head_dim)
        # SDPA keeps v for its backward: a view would keep the whole fused output.
        v = v.contiguous().view(B, T, cfg.n_kv_heads, cfg.dv)
        if rotary is not None:
            q, k = rotary(q, k)
        o_bhtd = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=cfg.n_heads != cfg.n_kv_heads,
        )
        return self.wo(o_bhtd.transpose(1, 2).reshape(B, T, cfg.n_heads * cfg.dv))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int, n_layers: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        # Residual branches start small so the stream's variance does not grow with depth.
        nn.init.normal_(self.w2.weight, std=0.02 / math.sqrt(2 * n_layers))

    def forward(self, x_btc: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_btc)) * self.w3(x_btc))


class Block(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)). `checkpoint_activations` recomputes it in backward."""

    def __init__(self, config: NSAModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        if config.attention == "nsa":
            self.attn = NSAAttention(config.nsa, config.dim, impl=config.impl,
                                     tiles=FlexTiles(sel_partial_bytes=config.sel_partial_bytes))
        else:
            self.attn = DenseAttention(config.nsa, config.dim)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = SwiGLU(config.dim, config.mlp_hidden, config.n_layers)
        self.checkpoint_activations = False

    def forward(self, x_btc: torch.Tensor, cos_td: torch.Tensor, sin_td: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_activations and torch.is_grad_enabled():
            return checkpoint(self._forward, x_btc, cos_td, sin_td, use_reentrant=False)
        return self._forward(x_btc, cos_td, sin_td)

    def _forward(self, x_btc, cos_td, sin_td):
        def rotary(q, k):
            return apply_rotary(q, cos_td, sin_td), apply_rotary(k, cos_td, sin_td)

        x_btc = x_btc + self.attn(self.attn_norm(x_btc), rotary=rotary)
        return x_btc + self.mlp(self.mlp_norm(x_btc))


class NSALM(nn.Module):
    """Decoder-only LM: tokens [B, T] -> logits [B, T, V].

    `config.impl="auto"` is resolved against `device` (default: the current default device),
    where the parameters are created: "flex" when they live on CUDA, "reference" otherwise.
    Moving the model afterwards does not change the implementation; build it where it runs.
    """

    def __init__(self, config: NSAModelConfig, *, device: torch.device | str | None = None):
        super().__init__()
        device = torch.device(device) if device is not None else torch.get_default_device()
        self.config = config = config.resolve(device)
        with torch.device(device):
            self.tok_emb = nn.Embedding(config.vocab_size, config.dim)
            self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
            self.norm = RMSNorm(config.dim, config.norm_eps)
            self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
            self.rope = Rotary(config.nsa.head_dim, config.max_seq_len, config.rope_theta)
        nn.init.normal_(self.tok_emb.weight, std=0.02)
        if config.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        else:
            nn.init.normal_(self.head.weight, std=0.02)

    def forward(self, tokens_bt: torch.Tensor) -> torch.Tensor:
        if tokens_bt.dim() != 2:
            raise ValueError(f"tokens must be [B, T], got shape {tuple(tokens_bt.shape)}")
        cos_td, sin_td = self.rope.tables(tokens_bt.shape[1])
        x_btc = self.tok_emb(tokens_bt)
        for layer in self.layers:
            x_btc = layer(x_btc, cos_td, sin_td)
        return self.head(self.norm(x_btc))

    def loss(self, tokens_bt: torch.Tensor, targets_bt: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (see lm_loss). Under DDP call the wrapper, then lm_loss."""
        return lm_loss(self(tokens_bt), targets_bt)

    def set_compiled_attention(self, compiled: bool) -> None:
        """Every NSA layer's `compiled` (see NSAAttention): False makes an uncompiled model run its
        attention's glue eagerly too (`nsa-flex train --no-compile`)."""
        check_compiled(compiled)
        for module in self.modules():
            if isinstance(module, NSAAttention):
                module.compiled = compiled

    def num_params(self, *, embeddings: bool = True) -> int:
        """Parameters (shared ones once); without the input embedding if embeddings=False."""
        n = sum(p.numel() for p in self.parameters())
        if not embeddings and not self.config.tie_embeddings:
            n -= self.tok_emb.weight.numel()
        return n


def lm_loss(logits_btv: torch.Tensor, targets_bt: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in fp32, averaged over the targets that are not IGNORE_INDEX."""
    return F.cross_entropy(
        logits_btv.float().flatten(0, 1), targets_bt.flatten(), ignore_index=IGNORE_INDEX
    )
