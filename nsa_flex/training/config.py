"""Training settings: one frozen dataclass, built from a preset, an optional TOML/YAML file and flags.

Precedence: flags > file > preset (MODEL_PRESETS and TRAIN_PRESETS) > defaults. A file holds
TrainConfig fields at the top level, `preset = "tiny"`, a `[model]` table of NSAModelConfig
fields and a `[model.nsa]` table of NSAConfig fields. Unknown keys are errors that list the
allowed ones. Example (TOML):

    preset = "seeds-125m"
    steps = 2000
    data = "corpus/"          # txt / jsonl / parquet files, tokenised byte-level
    [model]
    attention = "nsa"
    [model.nsa]
    window = 512
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nsa_flex.model import MODEL_PRESETS, NSAModelConfig

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
PARALLELS = ("auto", "none", "ddp", "fsdp")
SWITCHES = ("auto", "on", "off")
DEVICES = ("auto", "cpu", "cuda")


TRAIN_PRESETS: dict[str, dict] = {
    # Fast on a CPU: --preset tiny --steps 50 takes well under a minute with the reference NSA.
    "tiny": {"seq_len": 128, "batch_size": 8, "lr": 3e-3},
    # The reference dense-model shape (docs/results.md): S=2048, batch 16 (32k tokens per step).
    "seeds-125m": {"seq_len": 2048, "batch_size": 16, "lr": 6e-4, "warmup_steps": 100},
}
"""Training defaults that come with a model preset (a file or flags override them)."""


class ConfigError(ValueError):
    """A bad setting; the message names it and says what is allowed."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything one training run needs. "auto" values are resolved by `plan()`, once."""

    model: NSAModelConfig = field(default_factory=lambda: MODEL_PRESETS["tiny"])
    """The language model (see nsa_flex.model)."""
    data: str = "kv"
    """Synthetic task (kv, copy), stdlib (the standard library's .py sources), a .bin token file,
    a text file/folder, or hf:<saved dataset>."""
    tokenizer: str = "byte"
    """"byte" or the path of a tokenizer.json (text data only)."""
    text_key: str = "text"
    """Field/column holding the text in jsonl, parquet and datasets."""
    seq_len: int | None = None
    """T: tokens per sample; None means model.max_seq_len."""
    batch_size: int = 8
    """Sequences per micro-batch per rank."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    steps: int = 50
    """Optimizer steps in total (a resumed run continues up to this)."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (matrices only; norms, biases and gates' biases get none)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    precision: str = "auto"
    """fp32, bf16 (autocast), fp16 (autocast + GradScaler), or auto: bf16 on CUDA, fp32 on CPU."""
    parallel: str = "auto"
    """none, ddp, fsdp (FSDP2), or auto: ddp under torchrun with more than one rank, else none."""
    activation_checkpointing: bool = False
    """Recompute each block in the backward pass."""
    float8: bool = False
    """torchao float8 training of the Linear layers (CUDA, torchao installed)."""
    compile: str = "auto"
    """Compile each block (fullgraph): on, off, or auto (on for CUDA, off on CPU)."""
    cuda_graphs: str = "auto"
    """Replay each compiled block as CUDA graphs (torch.compile mode "reduce-overhead"), which takes
    the per-kernel launch cost off the step: on, off, or auto (on where it was checked: compiled
    blocks on CUDA in one process, grad_accum 1, no activation checkpointing, no float8)."""
    device: str = "auto"
    """cpu, cuda, or auto (cuda when available)."""
    seed: int = 0
    """Seeds the model initialisation and the data."""
    out_dir: str = "runs/train"
    """Checkpoints, metrics.jsonl, TensorBoard events and the tokenised-text cache."""
    resume: str = "auto"
    """auto (latest checkpoint in out_dir if any), none, latest (one must exist), or a checkpoint path."""
    allow_data_change: bool = False
    """Resume even though data, seed, seq_len, tokenizer or text_key differ from the checkpoint's."""
    save_checkpoints: bool = True
    """Write checkpoints at all (benchmarks turn this off)."""
    checkpoint_every: int = 0
    """Save every N steps; 0 saves only at the end. The last step is always saved."""
    keep_checkpoints: int = 2
    """Checkpoints kept in out_dir (older ones are deleted after a successful save)."""
    log_every: int = 10
    """Print a line every N steps (the progress bar and metrics.jsonl see every step)."""
    stall_timeout: float = 600.0
    """Watchdog: no step finished for this many seconds -> stack traces, exit code 3; 0 disables."""
    first_step_timeout: float = 3600.0
    """The watchdog's limit for the first step, which includes compilation."""
    nonfinite_limit: int = 5
    """Abort after this many non-finite losses in a row (each one skips its step)."""
    tensorboard: bool = True
    """Also write TensorBoard events (when tensorboard is installed)."""

    def __post_init__(self) -> None:
        _check_types(self)
        for name in ("batch_size", "grad_accum", "steps", "keep_checkpoints", "log_every", "nonfinite_limit"):
            _require(name, getattr(self, name), getattr(self, name) >= 1, "must be >= 1")
        for name in ("warmup_steps", "checkpoint_every", "grad_clip", "weight_decay", "stall_timeout",
                     "first_step_timeout"):
            _require(name, getattr(self, name), getattr(self, name) >= 0, "must be >= 0")
        _require("lr", self.lr, self.lr > 0, "must be > 0")
        _require("min_lr_ratio", self.min_lr_ratio, 0 <= self.min_lr_ratio <= 1, "must lie in [0, 1]")
        _require("betas", self.betas, len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
                 "must be two numbers in [0, 1)")
        if self.seq_len is not None:
            _require("seq_len", self.seq_len, 1 <= self.seq_len <= self.model.max_seq_len,
                     f"must lie in [1, model.max_seq_len={self.model.max_seq_len}] (raise model.max_seq_len)")
        for name, allowed in (("precision", PRECISIONS), ("parallel", PARALLELS), ("compile", SWITCHES),
                              ("cuda_graphs", SWITCHES), ("device", DEVICES)):
            _require(name, getattr(self, name), getattr(self, name) in allowed, f"allowed: {', '.join(allowed)}")
        _require("resume", self.resume, bool(self.resume), "auto, none, latest or a checkpoint path")

    @property
    def T(self) -> int:
        """Resolved sequence length."""
        return self.model.max_seq_len if self.seq_len is None else self.seq_len

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain nested dict (for printing, metrics and checkpoints)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RunPlan:
    """The "auto" settings of a TrainConfig made concrete for this process."""

    device: torch.device
    precision: str
    parallel: str
    compile: bool
    model: NSAModelConfig
    cuda_graphs: bool = False


def plan(config: TrainConfig, world_size: int, local_rank: int = 0) -> RunPlan:
    """Resolve every "auto" (the only place this happens) and reject impossible combinations."""
    cuda = torch.cuda.is_available()
    if config.device == "cuda" and not cuda:
        raise ConfigError("device=cuda but torch sees no CUDA device; use --device cpu")
    device = torch.device(f"cuda:{local_rank}") if (config.device == "cuda" or (config.device == "auto" and cuda)) \
        else torch.device("cpu")
    precision = {"auto": "bf16" if device.type == "cuda" else "fp32"}.get(config.precision, config.precision)
    parallel = {"auto": "ddp" if world_size > 1 else "none"}.get(config.parallel, config.parallel)
    if parallel != "none" and world_size == 1 and config.parallel != "auto":
        raise ConfigError(f"parallel={parallel} needs torchrun with more than one process "
                          "(torchrun --nproc_per_node N -m nsa_flex_cli.main train ...)")
    if parallel == "none" and world_size > 1:
        raise ConfigError(f"parallel=none under torchrun with {world_size} processes; use ddp or fsdp")
    if precision == "fp16" and parallel == "fsdp":
        raise ConfigError("fp16 with FSDP2 is not supported (its GradScaler would need sharded inf checks); "
                          "use precision bf16")
    compile_on = {"auto": device.type == "cuda", "on": True, "off": False}[config.compile]
    if config.float8 and device.type != "cuda":
        raise ConfigError("float8 training needs a CUDA device with float8 support (sm_89 or newer)")
    return RunPlan(device, precision, parallel, compile_on, config.model.resolve(device),
                   _cuda_graphs(config, device, parallel, compile_on))


def _cuda_graphs(config: TrainConfig, device: torch.device, parallel: str, compile_on: bool) -> bool:
    """Whether the compiled blocks replay as CUDA graphs. Only where checked: outside those
    settings "on" is refused and "auto" is off. (With several micro-batches a block's gradient
    outputs, kept in .grad between them, would live in the graphs' memory pool.)"""
    if config.cuda_graphs == "off":
        return False
    why = [reason for reason, bad in (
        ("a CUDA device", device.type != "cuda"), ("compiled blocks (compile on or auto)", not compile_on),
        ("one process (parallel none)", parallel != "none"), ("grad_accum 1", config.grad_accum != 1),
        ("no activation checkpointing", config.activation_checkpointing), ("no float8", config.float8)) if bad]
    if why and config.cuda_graphs == "on":
        raise ConfigError(f"cuda_graphs=on needs {', '.join(why)}; use cuda_graphs auto or off")
    return not why


def load_config_file(path: str | Path) -> dict:
    """A TOML (tomllib) or YAML (yaml.safe_load, if PyYAML is installed) file as a dict."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    if path.suffix == ".toml":
        try:
            import tomllib
        except ImportError as e:  # Python 3.10
            raise ConfigError(f"{path}: reading TOML needs Python >= 3.11 (tomllib)") from e
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from e
    elif path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as e:
            raise ConfigError(f"{path}: reading YAML needs PyYAML (pip install pyyaml), or use a .toml file") from e
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {e}") from e
    else:
        raise ConfigError(f"config file {path}: unknown type {path.suffix!r}; use .toml, .yaml or .yml")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a table/mapping, got {type(data).__name__}")
    return data


def build_config(file_values: dict | None = None, overrides: dict | None = None) -> TrainConfig:
    """TrainConfig from a file's dict and flag overrides (same layout; flags win)."""
    merged = _merge(file_values or {}, overrides or {})
    preset = merged.pop("preset", "tiny")
    if preset not in MODEL_PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; allowed: {', '.join(MODEL_PRESETS)}")
    model_values = dict(merged.pop("model", {}) or {})
    base = MODEL_PRESETS[preset]
    nsa = _replace(base.nsa, model_values.pop("nsa", {}) or {}, "model.nsa")
    model = _replace(base, {**model_values, "nsa": nsa}, "model")
    if isinstance(merged.get("betas"), list):
        merged["betas"] = tuple(merged["betas"])
    for key in ("compile", "cuda_graphs"):
        if isinstance(merged.get(key), bool):
            merged[key] = "on" if merged[key] else "off"
    return _replace(TrainConfig(), {**TRAIN_PRESETS.get(preset, {}), **merged, "model": model}, "")


def _replace(obj, values: dict, where: str):
    if not isinstance(values, dict):
        raise ConfigError(f"{where or 'config'} must be a table/mapping, got {type(values).__name__}")
    allowed = [f.name for f in dataclasses.fields(obj)]
    for key in values:
        if key not in allowed:
            name = f"{where}.{key}" if where else key
            extra = "" if where else ", preset"
            raise ConfigError(f"unknown setting {name!r}; allowed: {', '.join(allowed)}{extra}")
    try:
        return dataclasses.replace(obj, **values)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from e


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _check_types(cfg: TrainConfig) -> None:
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(cfg):
        value, hint = getattr(cfg, f.name), hints[f.name]
        if hint is float and isinstance(value, int) and not isinstance(value, bool):
            object.__setattr__(cfg, f.name, float(value))
            continue
        expected = {int: int, float: float, str: str, bool: bool}.get(hint)
        if hint == int | None:
            ok = value is None or (isinstance(value, int) and not isinstance(value, bool))
        elif expected is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif expected is not None:
            ok = isinstance(value, expected)
        else:
            continue
        _require(f.name, value, ok, f"must be of type {getattr(hint, '__name__', hint)}")
    if not isinstance(cfg.model, NSAModelConfig):
        raise ConfigError(f"TrainConfig.model must be an NSAModelConfig, got {type(cfg.model).__name__}")


def _require(name: str, value, ok: bool, rule: str) -> None:
    if not ok:
        raise ConfigError(f"TrainConfig.{name}={value!r}: {rule}")
