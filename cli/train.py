"""`nsa-flex train`: flags (and an optional TOML/YAML file) -> TrainConfig -> nsa_flex.training.train.train().

Only flags that are given override the file; the file overrides the preset. Under torchrun
(`torchrun --nproc_per_node N -m nsa_flex_cli.main train ...`) every rank runs this command
and rank 0 draws the progress bar.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

_MODEL_FLAGS = ("attention", "impl", "vocab_size", "max_seq_len")


def train(
    config: Path = typer.Option(None, "--config", "-c", help="TOML or YAML settings file; flags override it."),
    preset: str = typer.Option(None, help="Model preset: tiny (CPU) or seeds-125m. Default tiny."),
    attention: str = typer.Option(None, help="nsa or dense (causal SDPA): the only difference between compared runs."),
    impl: str = typer.Option(None, help="NSA implementation: auto (flex on CUDA, reference on CPU), reference, flex."),
    vocab_size: int = typer.Option(None, help="Model vocabulary size (must cover the data's tokens)."),
    max_seq_len: int = typer.Option(None, help="Longest sequence of the model (RoPE tables)."),
    data: str = typer.Option(None, help="kv | copy (synthetic), a .bin token file, a text file/folder, or hf:<dir>."),
    tokenizer: str = typer.Option(None, help="byte, or a local tokenizer.json (text data)."),
    text_key: str = typer.Option(None, help="Text field of jsonl/parquet/dataset rows."),
    seq_len: int = typer.Option(None, "--seq-len", "-T", help="Tokens per sample."),
    batch_size: int = typer.Option(None, "--batch-size", "-B", help="Sequences per micro-batch per rank."),
    grad_accum: int = typer.Option(None, help="Micro-batches per optimizer step."),
    steps: int = typer.Option(None, help="Optimizer steps in total."),
    lr: float = typer.Option(None, help="Peak learning rate."),
    warmup_steps: int = typer.Option(None, help="Linear warm-up steps."),
    min_lr_ratio: float = typer.Option(None, help="Cosine decay floor, as a fraction of lr."),
    weight_decay: float = typer.Option(None, help="AdamW weight decay."),
    grad_clip: float = typer.Option(None, help="Gradient-norm clip (0: off)."),
    precision: str = typer.Option(None, help="auto, fp32, bf16 (autocast), fp16 (autocast + GradScaler)."),
    parallel: str = typer.Option(None, help="auto, none, ddp, fsdp (FSDP2; under torchrun)."),
    activation_checkpointing: bool = typer.Option(None, "--activation-checkpointing/--no-activation-checkpointing",
                                                  help="Recompute blocks in the backward pass."),
    float8: bool = typer.Option(None, "--float8/--no-float8", help="torchao float8 Linear layers (CUDA)."),
    compile: str = typer.Option(None, help="Compile each block: auto (CUDA only), on, off."),
    device: str = typer.Option(None, help="auto, cpu, cuda."),
    seed: int = typer.Option(None, help="Seed of the initialisation and the data."),
    out_dir: str = typer.Option(None, "--out-dir", "-o", help="Checkpoints, metrics.jsonl, token cache."),
    resume: str = typer.Option(None, help="auto (latest in --out-dir, if any), none, latest, or a checkpoint path."),
    save_checkpoints: bool = typer.Option(None, "--save-checkpoints/--no-save-checkpoints",
                                          help="Write checkpoints at all."),
    checkpoint_every: int = typer.Option(None, help="Checkpoint every N steps (0: only the last)."),
    keep_checkpoints: int = typer.Option(None, help="Checkpoints to keep."),
    log_every: int = typer.Option(None, help="Print a line every N steps."),
    stall_timeout: float = typer.Option(None, help="Watchdog seconds without a finished step (0: off)."),
    first_step_timeout: float = typer.Option(None, help="Watchdog limit of the first (compiling) step."),
    nonfinite_limit: int = typer.Option(None, help="Abort after this many non-finite losses in a row."),
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
                           f"parallel={info['parallel']} compile={info['compile']} impl={info['impl']}",
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
        loss = summary["final_loss"]
        self.console.print(
            f"done: step {summary['last_step']}, final loss {loss if loss is None else f'{loss:.4f}'}, "
            f"{summary['tokens_per_s']:,.0f} tok/s (median), peak memory {summary['peak_memory_gib']:.2f} GiB, "
            f"{summary['nonfinite_steps']} non-finite steps", highlight=False)
        sys.stdout.flush()
