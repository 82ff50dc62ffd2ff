"""`nsa-flex train`: flags (and an optional TOML/YAML file) -> TrainConfig -> nsa_flex.training.train.train().

Only flags that are given override the file; the file overrides the preset. Under torchrun
(`torchrun --nproc_per_node N -m nsa_flex_cli.main train ...`) every rank runs this command
and rank 0 draws the progress bar.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from nsa_flex.training.config import TRAIN_PRESETS, TrainConfig

_MODEL_FLAGS = ("attention", "impl", "vocab_size", "max_seq_len")


def _default(field: str) -> str:
    """' Default: ...' of a TrainConfig field, with the presets' own values where they set it."""
    base = {f.name: f.default for f in dataclasses.fields(TrainConfig)}[field]
    per_preset = {name: values.get(field, base) for name, values in TRAIN_PRESETS.items()}
    if len(set(per_preset.values())) <= 1:
        return f" Default: {base}."
    return " Default: " + ", ".join(f"{v} ({name} preset)" for name, v in per_preset.items()) + "."


def train(
    config: Path = typer.Option(None, "--config", "-c", help="TOML or YAML settings file; flags override it."),
    preset: str = typer.Option(None, help="Model preset: tiny (CPU) or seeds-125m. Default tiny."),
    attention: str = typer.Option(None, help="nsa or dense (causal SDPA): the only difference between compared runs."),
    impl: str = typer.Option(None, help="NSA implementation: auto (flex on CUDA, reference on CPU), reference, flex."),
    vocab_size: int = typer.Option(None, help="Model vocabulary size (must cover the data's tokens)."),
    max_seq_len: int = typer.Option(None, help="Longest sequence of the model (RoPE tables)."),
    data: str = typer.Option(None, help=(
        "kv | copy (synthetic tasks), stdlib (Python's own standard library sources, offline text), a .bin token "
        "file, a text file or folder (.txt .md .jsonl .parquet), or hf:<dir> (a saved Hugging Face dataset)."
        + _default("data"))),
    tokenizer: str = typer.Option(None, help="byte, or a local tokenizer.json (text data)." + _default("tokenizer")),
    text_key: str = typer.Option(None, help="Text field of jsonl/parquet/dataset rows." + _default("text_key")),
    seq_len: int = typer.Option(None, "--seq-len", "-T", help="Tokens per sample." + _default("seq_len")),
    batch_size: int = typer.Option(None, "--batch-size", "-B", help="Sequences per micro-batch per rank."
                                   + _default("batch_size")),
    grad_accum: int = typer.Option(None, help="Micro-batches per optimizer step." + _default("grad_accum")),
    steps: int = typer.Option(None, help="Optimizer steps in total (a resumed run continues up to this)."
                              + _default("steps")),
    lr: float = typer.Option(None, help="Peak learning rate." + _default("lr")),
    warmup_steps: int = typer.Option(None, help="Linear warm-up steps." + _default("warmup_steps")),
    min_lr_ratio: float = typer.Option(None, help=(
        "Cosine decay floor, as a fraction of lr." + _default("min_lr_ratio"))),
    weight_decay: float = typer.Option(None, help="AdamW weight decay." + _default("weight_decay")),
    grad_clip: float = typer.Option(None, help="Gradient-norm clip (0: off)." + _default("grad_clip")),
    precision: str = typer.Option(None, help=(
        "auto, fp32, bf16 (autocast), fp16 (autocast + GradScaler)." + _default("precision"))),
    parallel: str = typer.Option(None, help="auto, none, ddp, fsdp (FSDP2; under torchrun)." + _default("parallel")),
    activation_checkpointing: bool = typer.Option(None, "--activation-checkpointing/--no-activation-checkpointing",
                                                  help="Recompute blocks in the backward pass."),
    float8: bool = typer.Option(None, "--float8/--no-float8", help="torchao float8 Linear layers (CUDA)."),
    compile: str = typer.Option(None, help="Compile each block: auto (CUDA only), on, off." + _default("compile")),
    cuda_graphs: str = typer.Option(None, "--cuda-graphs", help=(
        "Replay compiled blocks as CUDA graphs: auto (one process on CUDA, grad_accum 1, no activation "
        "checkpointing or float8), on, off." + _default("cuda_graphs"))),
    device: str = typer.Option(None, help="auto, cpu, cuda." + _default("device")),
    seed: int = typer.Option(None, help="Seed of the initialisation and the data." + _default("seed")),
    out_dir: str = typer.Option(None, "--out-dir", "-o", help=(
        "Run folder: config.json, train.log, metrics.jsonl, checkpoints/, the token cache." + _default("out_dir"))),
    resume: str = typer.Option(None, help="auto (latest in --out-dir, if any), none, latest, or a checkpoint path."
                               + _default("resume")),
    allow_data_change: bool = typer.Option(None, "--allow-data-change/--no-allow-data-change", help=(
        "Resume although --data, --seed, -T, --tokenizer or --text-key differ from the checkpoint's "
        "(refused by default: the run would continue on another data stream).")),
    save_checkpoints: bool = typer.Option(None, "--save-checkpoints/--no-save-checkpoints",
                                          help="Write checkpoints at all."),
    checkpoint_every: int = typer.Option(None, help=(
        "Checkpoint every N steps (0: only the last)." + _default("checkpoint_every"))),
    keep_checkpoints: int = typer.Option(None, help="Checkpoints to keep." + _default("keep_checkpoints")),
    log_every: int = typer.Option(None, help="Print a line every N steps." + _default("log_every")),
    stall_timeout: float = typer.Option(None, help=(
        "Watchdog seconds without a finished step (0: off)." + _default("stall_timeout"))),
    first_step_timeout: float = typer.Option(None, help=(
        "Watchdog limit of the first (compiling) step." + _default("first_step_timeout"))),
    nonfinite_limit: int = typer.Option(None, help=(
        "Abort after this many non-finite losses in a row." + _default("nonfinite_limit"))),
    tensorboard: bool = typer.Option(None, "--tensorboard/--no-tensorboard", help="Write TensorBoard events."),
) -> None:
    """Train the NSA (or dense) language model; prints the config and versions, then a progress bar."""
    # Exactly the flags that were given (None = not given), before any other local exists.
    flags = {name: value for name, value in locals().items() if value is not None and name != "config"}
    from nsa_flex.training.data import DataError
    from nsa_flex.training.train import NonFiniteLossError
    from nsa_flex.training.train import train as run_train
    from nsa_flex.training.checkpoint import CheckpointError
    from nsa_flex.training.config import ConfigError, build_config, load_config_file

    model_flags = {k: flags.pop(k) for k in _MODEL_FLAGS if k in flags}
    if model_flags:
        flags["model"] = model_flags
    # Long lines (the config) stay whole in logs instead of wrapping at 80 columns.
    console = Console(soft_wrap=True)
    try:
        file_values = load_config_file(config) if config is not None else {}
        cfg = build_config(file_values, flags)
        run_train(cfg, callback=RichCallback(console, cfg.log_every))
    except (ConfigError, DataError, CheckpointError) as e:
        console.print(f"[bold red]error:[/] {e}", highlight=False)
        raise typer.Exit(2)
    except NonFiniteLossError as e:
        console.print(f"[bold red]error:[/] {e}", highlight=False)
        raise typer.Exit(1)


class RichCallback:
    """Config and versions first, then a progress bar with loss, tokens/s, lr and memory.

    A line per `log_every` steps is printed too, so logs of non-interactive runs show the loss.
    """

    def __init__(self, console: Console, log_every: int):
        self.console, self.log_every = console, log_every
        self.progress: Progress | None = None
        self.task = None

    def on_start(self, info: dict) -> None:
        v = info["versions"]
        self.console.print(" ".join(f"{k}={val}" for k, val in v.items() if val is not None), highlight=False)
        self.console.print(f"world_size={info['world_size']} device={info['device']} precision={info['precision']} "
                           f"parallel={info['parallel']} compile={info['compile']} "
                           f"cuda_graphs={info['cuda_graphs']} impl={info['impl']}",
                           highlight=False)
        self.console.print("config: " + json.dumps(info["config"], default=str), highlight=False, soft_wrap=True)

    def on_step(self, m: dict) -> None:
        from nsa_flex.training.metrics import format_step

        if self.progress is None:
            self.progress = Progress(
                TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("{task.fields[status]}"), console=self.console, transient=False,
                disable=not self.console.is_terminal,
            )
            self.progress.start()
            self.task = self.progress.add_task("train", total=m["total_steps"], completed=m["step"] - 1, status="")
        status = (f"loss {m['loss']:.4f}  {m['tokens_per_s']:,.0f} tok/s  lr {m['lr']:.2e}  "
                  f"mem {m['memory_gib']:.2f} GiB")
        self.progress.update(self.task, completed=m["step"], status=status)
        if m["step"] % self.log_every == 0 or m["step"] == m["total_steps"] or m["skipped"]:
            self.progress.console.print(format_step(m), highlight=False)

    def on_message(self, text: str) -> None:
        self.console.print(text, highlight=False)

    def on_end(self, summary: dict) -> None:
        if self.progress is not None:
            self.progress.stop()
        if summary["last_step"] == summary["start_step"]:
            step = summary["last_step"]
            self.console.print(
                f"nothing to train: the run is already at step {step} of --steps {summary['total_steps']}. "
                f"To continue it, raise --steps (e.g. --steps {step + max(step, 1)}); to start afresh, "
                "use --resume none or another --out-dir", highlight=False)
            sys.stdout.flush()
            return
        loss = summary["final_loss"]
        self.console.print(
            f"done: step {summary['last_step']}, final loss {loss if loss is None else f'{loss:.4f}'}, "
            f"{summary['tokens_per_s']:,.0f} tok/s (median), peak memory {summary['peak_memory_gib']:.2f} GiB, "
            f"{summary['nonfinite_steps']} non-finite steps", highlight=False)
        sys.stdout.flush()
