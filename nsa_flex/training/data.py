"""Training data: index-addressable samples, deterministic rank sharding, a resumable position.

Every source maps a global sample index i to one (inputs [T], targets [T]) pair, a pure
function of (seed, i). A batch is a run of consecutive indices; rank r of W takes its slice
of each global batch. The data position (samples consumed by all ranks together) is one
integer, saved in checkpoints: a resumed run, with any number of ranks, sees exactly the
samples an uninterrupted run would have.

Sources:
- `SyntheticTask`: "kv" (associative recall: key/value pairs, then queries of the keys) and
  "copy" (a random string, a separator, the string again). Both have long-range structure
  that a 32-token window cannot see, so the loss falls only as far as selection and the
  compressed branch retrieve it. Unpredictable targets are IGNORE_INDEX.
- `TokenFile`: a memory-mapped token file (see nsa_flex.training.tokens for building one from txt /
  jsonl / parquet / Hugging Face datasets), cut into windows of T+1 tokens, visited in a
  seeded random order per epoch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from nsa_flex.model import IGNORE_INDEX

SYNTHETIC_TASKS = ("kv", "copy")
TOKEN_FILE_FORMAT = "nsa-flex-tokens/1"


class DataError(ValueError):
    """Bad data settings or files; the message says what to change."""


class TokenSource(Protocol):
    vocab_size: int
    """Every token of every sample is below this."""
    seq_len: int
    """T: tokens per sample."""

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs [T] int64, targets [T] int64) of global sample `index`; pure in (seed, index)."""
        ...

    def describe(self) -> str:
        ...


def _generator(seed: int, index: int) -> torch.Generator:
    # A multiplicative hash keeps neighbouring (seed, index) pairs far apart.
    return torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) % 2**63)


@dataclass(frozen=True, kw_only=True)
class SyntheticTask:
    """Synthetic sequences with learnable long-range structure (see module docstring)."""

    task: str = "kv"
    """"kv" (associative recall) or "copy"."""
    seq_len: int = 256
    """T: tokens per sample."""
    seed: int = 0
    """Data seed; the samples are a pure function of (seed, index)."""
    n_keys: int | None = None
    """kv: key alphabet size (>= the number of pairs); None: max(128, pairs)."""
    n_values: int = 64
    """kv: value alphabet size; copy: alphabet of the copied string."""

    BOS = 1
    SEP = 2
    PAD = 0
    FIRST = 16
    """Lowest content token; 0..15 are reserved for specials."""

    def __post_init__(self) -> None:
        if self.task not in SYNTHETIC_TASKS:
            raise DataError(f"unknown synthetic task {self.task!r}; allowed: {', '.join(SYNTHETIC_TASKS)}")
        if self.seq_len < 8:
            raise DataError(f"synthetic task {self.task!r} needs seq_len >= 8, got {self.seq_len}")
        if self.task == "kv" and self.keys < self.n_pairs:
            raise DataError(f"kv task: n_keys={self.n_keys} < {self.n_pairs} pairs at seq_len={self.seq_len}")

    @property
    def n_pairs(self) -> int:
        """kv: key/value pairs before the separator (a quarter of the tokens)."""
        return (self.seq_len - 1) // 4

    @property
    def keys(self) -> int:
        """kv: the key alphabet size in use."""
        return max(128, self.n_pairs) if self.n_keys is None else self.n_keys

    @property
    def vocab_size(self) -> int:
        return self.FIRST + (self.keys + self.n_values if self.task == "kv" else self.n_values)

    def describe(self) -> str:
        return f"synthetic {self.task} (T={self.seq_len}, vocab {self.vocab_size}, seed {self.seed})"

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = _generator(self.seed, index)
        seq, predictable = self._kv(g) if self.task == "kv" else self._copy(g)
        # seq holds T+1 tokens: inputs are seq[:-1], targets seq[1:].
        targets = seq[1:].masked_fill(~predictable[1:], IGNORE_INDEX)
        return seq[:-1].clone(), targets

    def _kv(self, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """[BOS] k1 v1 .. kP vP [SEP] q1 a1 .. qQ aQ [PAD..]; a_j (the value of key q_j) is predictable."""
        T, P = self.seq_len, self.n_pairs
        Q = (T - 1 - 2 * P) // 2
        keys = torch.randperm(self.keys, generator=g)[:P] + self.FIRST
        values = torch.randint(0, self.n_values, (P,), generator=g) + self.FIRST + self.keys
        asked = torch.randint(0, P, (Q,), generator=g)
        seq = torch.full((T + 1,), self.PAD, dtype=torch.int64)
        predictable = torch.zeros(T + 1, dtype=torch.bool)
        seq[0] = self.BOS
        seq[1:1 + 2 * P:2], seq[2:2 + 2 * P:2] = keys, values
        start = 2 + 2 * P
        seq[start - 1] = self.SEP
        seq[start:start + 2 * Q:2], seq[start + 1:start + 2 * Q:2] = keys[asked], values[asked]
        predictable[start + 1:start + 2 * Q:2] = True
        return seq, predictable

    def _copy(self, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """[BOS] s [SEP] s [PAD..] with |s| = (T-1)//2; the second s and the SEP are predictable."""
        T = self.seq_len
        m = (T - 1) // 2
        s = torch.randint(0, self.n_values, (m,), generator=g) + self.FIRST
        seq = torch.full((T + 1,), self.PAD, dtype=torch.int64)
        predictable = torch.zeros(T + 1, dtype=torch.bool)
        seq[0], seq[1:1 + m], seq[1 + m], seq[2 + m:2 + 2 * m] = self.BOS, s, self.SEP, s
        predictable[1 + m:2 + 2 * m] = True
        return seq, predictable


class TokenFile:
    """Windows of T+1 tokens of a memory-mapped token file, in a seeded order per epoch."""

    def __init__(self, path: str | Path, *, seq_len: int, seed: int = 0):
        self.path = Path(path)
        self.meta = read_token_meta(self.path)
        np = _numpy()
        self.tokens = np.memmap(self.path, dtype=self.meta["dtype"], mode="r", shape=(self.meta["n_tokens"],))
        self.seq_len, self.seed = seq_len, seed
        self.vocab_size = int(self.meta["vocab_size"])
        self.n_windows = (len(self.tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise DataError(f"{self.path} holds {len(self.tokens)} tokens; seq_len={seq_len} needs at least "
                            f"{seq_len + 1}: add text or lower --seq-len")
        self._epoch, self._order = -1, None

    def describe(self) -> str:
        return (f"token file {self.path} ({len(self.tokens):,} tokens, {self.n_windows:,} windows of "
                f"{self.seq_len}, vocab {self.vocab_size}, tokenizer {self.meta['tokenizer']})")

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, offset = divmod(index, self.n_windows)
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = torch.randperm(self.n_windows, generator=_generator(self.seed, epoch))
        start = int(self._order[offset]) * self.seq_len
        window = torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype("int64"))
        return window[:-1], window[1:]


def read_token_meta(path: Path) -> dict:
    """The JSON sidecar `<path>.json` of a token file, checked."""
    meta_path = Path(f"{path}.json")
    if not path.is_file():
        raise DataError(f"token file {path} does not exist")
    if not meta_path.is_file():
        raise DataError(f"token file {path} has no sidecar {meta_path}; "
                        "build token files with nsa_flex.training.tokens")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{meta_path} is not valid JSON: {e}") from e
    if meta.get("format") != TOKEN_FILE_FORMAT:
        raise DataError(f"{meta_path}: format {meta.get('format')!r}, expected {TOKEN_FILE_FORMAT!r}")
    itemsize = {"uint16": 2, "uint32": 4}[meta["dtype"]]
    if path.stat().st_size != meta["n_tokens"] * itemsize:
        raise DataError(f"{path} is {path.stat().st_size} bytes but {meta_path} says {meta['n_tokens']} "
                        f"{meta['dtype']} tokens: the file is truncated or stale; delete both and rebuild")
    return meta


class ShardedBatches:
    """Rank `rank` of `world_size`'s micro-batches, from global sample `position` on.

    Global micro-batch m holds samples [p, p + W*B) with p the position before it; rank r
    gets [p + r*B, p + (r+1)*B). `position` advances by W*B per micro-batch on every rank.
    prefetch() samples the next micro-batch early (the training loop calls it while the GPU
    runs the step) without moving the position, so checkpoints and resumes are unchanged.
    """

    def __init__(self, source: TokenSource, *, batch_size: int, rank: int = 0, world_size: int = 1,
                 position: int = 0, pin_memory: bool = False):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        self.source, self.batch_size, self.rank, self.world_size = source, batch_size, rank, world_size
        self.position = position
        self.pin_memory = pin_memory
        """Batches in pinned memory: their copies to the GPU (non_blocking) run asynchronously."""
        self._ahead: tuple[int, tuple[torch.Tensor, torch.Tensor]] | None = None

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs [B, T], targets [B, T]) int64 on the CPU."""
        ahead, self._ahead = self._ahead, None
        batch = ahead[1] if ahead is not None and ahead[0] == self.position else self._sample(self.position)
        self.position += self.world_size * self.batch_size
        return batch

    def prefetch(self) -> None:
        """Sample the micro-batch next() returns now, leaving the position where it is."""
        if self._ahead is None or self._ahead[0] != self.position:
            self._ahead = (self.position, self._sample(self.position))

    def _sample(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        first = position + self.rank * self.batch_size
        pairs = [self.source.sample(first + b) for b in range(self.batch_size)]
        batch = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
        return tuple(t.pin_memory() for t in batch) if self.pin_memory else batch

    def state_dict(self) -> dict:
        return {"position": self.position, "source": self.source.describe()}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
        self._ahead = None


def _numpy():
    try:
        import numpy
    except ImportError as e:
        raise DataError("token files need numpy (pip install numpy)") from e
    return numpy
