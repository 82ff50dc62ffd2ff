"""`nsa-flex memory`: estimated peak training memory of a configuration (nsa_flex.training.memory)."""

from __future__ import annotations

from pathlib import Path

import typer


def memory(
    config: Path = typer.Option(None, "--config", "-c", help="TOML or YAML training settings; flags override it."),
    preset: str = typer.Option(None, help="Model preset: tiny or seeds-125m."),
    attention: str = typer.Option(None, help="nsa or dense."),
    impl: str = typer.Option("flex", help="NSA path whose masks to count: flex or reference."),
    seq_len: int = typer.Option(None, "--seq-len", "-T", help="Tokens per sample."),
    batch_size: int = typer.Option(None, "--batch-size", "-B", help="Sequences per micro-batch per rank."),
    precision: str = typer.Option("bf16", help="fp32, bf16 or fp16."),
    compiled: bool = typer.Option(True, "--compile/--no-compile", help="Blocks compiled (as on CUDA by default)."),
    activation_checkpointing: bool = typer.Option(False, "--activation-checkpointing/--no-activation-checkpointing"),
    parallel: str = typer.Option("none", help="none, ddp or fsdp."),
    world_size: int = typer.Option(1, min=1, help="Ranks (FSDP2 shards by this)."),
) -> None:
    """Estimate the peak memory of training a configuration, part by part."""
    from nsa_flex.training.memory import count_params, estimate, format_table
    from nsa_flex.training.config import ConfigError, build_config, load_config_file

    flags = {k: v for k, v in (("preset", preset), ("seq_len", seq_len), ("batch_size", batch_size)) if v is not None}
    # The RoPE tables follow --seq-len, so any length can be estimated with any preset.
    model = {k: v for k, v in (("attention", attention), ("max_seq_len", seq_len)) if v is not None}
    if model:
        flags["model"] = model
    try:
        cfg = build_config(load_config_file(config) if config else {}, flags)
        est = estimate(cfg.model, batch_size=cfg.batch_size, seq_len=cfg.T, precision=precision, compiled=compiled,
                       activation_checkpointing=activation_checkpointing, parallel=parallel, world_size=world_size,
                       impl=impl)
    except (ConfigError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    counts = count_params(cfg.model)
    typer.echo(f"model: {cfg.model.attention} attention, {counts.total:,} parameters, {cfg.model.n_layers} layers, "
               f"dim {cfg.model.dim}; batch {cfg.batch_size} x {cfg.T} tokens, {precision}, "
               f"{'compiled' if compiled else 'eager'} blocks"
               + (", activation checkpointing" if activation_checkpointing else "")
               + (f", {parallel} over {world_size} ranks" if parallel != "none" else ""))
    typer.echo(format_table(est))

