"""Generation with an NSALM: batched prefill, then one compiled decode step per token.

`Generator` holds one NSACache per layer. `prefill` runs every block's training path over
the right-padded prompts and fills the caches; `step` feeds one token per sequence through
all layers, samples the next one on the device and advances the caches: no host
synchronisation per token, static shapes, so with compile=True (mode="reduce-overhead") the
whole step is one CUDA graph.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from nsa_flex.decoding.cache import NSACache
from nsa_flex.decoding.step import decode_step, prefill
from nsa_flex.model import NSALM, apply_rotary


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How the next token is drawn from the logits."""

    temperature: float = 0.0
    """0 means greedy (argmax); otherwise logits are divided by it before the softmax."""
    top_k: int | None = None
    """Sample among the k most likely tokens only; None means all."""

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"SamplingConfig.temperature={self.temperature!r}: must be >= 0 (0 = greedy)")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"SamplingConfig.top_k={self.top_k!r}: must be a positive integer or None")


def sample(logits_bv: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Next token per row, [B] int64, on the device (no host synchronisation)."""
    if sampling.temperature == 0:
        return logits_bv.argmax(-1)
    logits = logits_bv.float() / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    # argmax(p / E) with E ~ Exp(1) draws from p (the exponential race): one kernel, graph-safe.
    return (probs / torch.empty_like(probs).exponential_(1)).argmax(-1)


class Generator:
    """Decode state of an NSALM for a batch of `batch_size` sequences of up to `max_len` tokens."""

    def __init__(self, model: NSALM, batch_size: int, max_len: int, *, sampling: SamplingConfig = SamplingConfig(),
                 compile: bool = False):
        cfg = model.config
        if cfg.attention != "nsa":
            raise ValueError(f"generate needs an NSA model (attention='nsa'); this one has attention={cfg.attention!r}")
        if max_len > cfg.max_seq_len:
            raise ValueError(f"max_len={max_len} exceeds the model's max_seq_len={cfg.max_seq_len} (its RoPE tables)")
        self.model, self.sampling, self.batch_size, self.max_len = model, sampling, batch_size, max_len
        weight = model.head.weight
        self.caches = [NSACache(cfg.nsa, batch_size, max_len, dtype=weight.dtype, device=weight.device)
                       for _ in model.layers]
        # Compiled once here; the step's only varying inputs are tensors, so it never recompiles.
        self._step = (torch.compile(self._step_eager, mode="reduce-overhead", fullgraph=True)
                      if compile else self._step_eager)

    def _rotary(self, q, k, positions_bt):
        cos, sin = self.model.rope.tables(positions_bt)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    @torch.no_grad()
    def prefill(self, tokens_bp: torch.Tensor, lengths_b: torch.Tensor) -> torch.Tensor:
        """Right-padded prompts [B, P] with lengths [B] -> first sampled token per sequence [B]."""
        if tokens_bp.dim() != 2:
            raise ValueError(f"prompt tokens must be [B, P], got shape {tuple(tokens_bp.shape)}")
        vocab = self.model.config.vocab_size
        if tokens_bp.numel() and (int(tokens_bp.min()) < 0 or int(tokens_bp.max()) >= vocab):
            raise ValueError(f"token ids must lie in [0, {vocab - 1}] (the model's vocabulary), "
                             f"got min {int(tokens_bp.min())}, max {int(tokens_bp.max())}")
        x = self.model.tok_emb(tokens_bp)
        for block, cache in zip(self.model.layers, self.caches):
            x = x + prefill(block.attn, cache, block.attn_norm(x), lengths_b, rotary=self._rotary)
            x = x + block.mlp(block.mlp_norm(x))
        last = (lengths_b.to(x.device) - 1)[:, None, None].expand(-1, 1, x.shape[-1])
        logits = self.model.head(self.model.norm(x.gather(1, last)))[:, 0]
        return sample(logits, self.sampling)

    def step(self, tokens_b: torch.Tensor) -> torch.Tensor:
        """One token per sequence [B] at the caches' positions -> the next token [B]."""
        # The output lives in the CUDA graph's memory and is overwritten by the next replay.
        return self._step(tokens_b).clone()

    def _step_eager(self, tokens_b: torch.Tensor) -> torch.Tensor:
        return sample(self.step_logits(tokens_b), self.sampling)

    @torch.no_grad()
    def step_logits(self, tokens_b: torch.Tensor) -> torch.Tensor:
        """One token per sequence [B] -> next-token logits [B, V] (eager; advances the caches)."""
        x = self.model.tok_emb(tokens_b[:, None])
        for block, cache in zip(self.model.layers, self.caches):
            x = x + decode_step(block.attn, cache, block.attn_norm(x), rotary=self._rotary)
            x = x + block.mlp(block.mlp_norm(x))
        return self.model.head(self.model.norm(x))[:, 0]


@dataclass(frozen=True)
class GenerateResult:
    tokens: list[list[int]]
    """The new tokens of each sequence."""
    prefill_s: float
    decode_s: float
    """Wall time of the decode steps after the first two (which compile and record the graph)."""
    decode_tokens: int
    """Tokens produced in those timed steps, all sequences together."""

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")


def pad_prompts(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pads prompts with token 0: ([B, P] tokens, [B] lengths)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    P = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), P, dtype=torch.int64)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = torch.tensor(p, dtype=torch.int64)
    return tokens.to(device), torch.tensor([len(p) for p in prompts], device=device)


def generate(model: NSALM, prompts: list[list[int]], max_new_tokens: int, *,
             sampling: SamplingConfig = SamplingConfig(), compile: bool = False) -> GenerateResult:
    """Generates max_new_tokens after each prompt (all sequences in one batch)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")
    device = model.head.weight.device
    tokens_bp, lengths_b = pad_prompts(prompts, device)
    max_len = tokens_bp.shape[1] + max_new_tokens - 1
    limit = model.config.max_seq_len
    if max_len > limit:
        raise ValueError(f"prompt ({tokens_bp.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"model's max_seq_len={limit}: shorten the prompt or ask for fewer tokens")
    gen = Generator(model, len(prompts), max_len, sampling=sampling, compile=compile)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    out = [gen.prefill(tokens_bp, lengths_b)]
    sync()
    prefill_s = time.perf_counter() - start
    # The first steps compile and record the CUDA graph (with compile=True): not timed.
    warm = min(2, max_new_tokens - 1)
    for _ in range(warm):
        out.append(gen.step(out[-1]))
    sync()
    start = time.perf_counter()
    for _ in range(max_new_tokens - 1 - warm):
        out.append(gen.step(out[-1]))
    sync()
    decode_s = time.perf_counter() - start
    new = torch.stack(out, dim=1).tolist()
    return GenerateResult(new, prefill_s, decode_s, (max_new_tokens - 1 - warm) * len(prompts))
