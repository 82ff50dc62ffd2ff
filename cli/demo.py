"""`nsa-flex demo`: a small forward/backward of one NSA layer, timed. Runs anywhere."""

from __future__ import annotations

import time

import typer

from nsa_flex.config import PRESETS


def demo(
    preset: str = typer.Option("tiny", help=f"NSA config preset: {', '.join(PRESETS)}."),
    seq_len: int = typer.Option(1024, "--seq-len", "-T", min=1, help="Tokens per sequence."),
    batch: int = typer.Option(1, "--batch", "-B", min=1, help="Sequences per batch."),
    dim: int = typer.Option(128, min=1, help="Model width of the layer's input and output."),
    impl: str = typer.Option("auto", help=(
        "Implementation: auto (flex on CUDA, reference on CPU), reference or flex (forward only on CPU: "
        "with gradients the reference runs there).")),
    steps: int = typer.Option(3, min=1, help="Timed forward+backward steps."),
    seed: int = typer.Option(0, help="Random seed."),
) -> None:
    """Run NSAAttention forward and backward on random data and print the timings."""
    import torch

    from nsa_flex.attention import IMPLS, NSAAttention

    if preset not in PRESETS:
        raise typer.BadParameter(f"unknown preset {preset!r}; allowed: {', '.join(PRESETS)}", param_hint="--preset")
    if impl not in IMPLS:
        raise typer.BadParameter(f"unknown impl {impl!r}; allowed: {', '.join(IMPLS)}", param_hint="--impl")
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = PRESETS[preset]
    layer = NSAAttention(config, dim, impl=impl).to(device)
    x = torch.randn(batch, seq_len, dim, device=device, requires_grad=True)
    typer.echo(f"NSAAttention preset={preset} {config}")
    typer.echo(f"input [B={batch}, T={seq_len}, dim={dim}] on {device}, impl={impl}")
    for step in range(steps + 1):
        start = time.perf_counter()
        y, sel = layer(x, return_indices=True)
        y.float().square().mean().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - start) * 1e3
        label = "warm-up" if step == 0 else f"step {step}"
        typer.echo(f"{label:>8}: forward+backward {ms:8.1f} ms, output finite: {bool(torch.isfinite(y).all())}")
    typer.echo(f"ran: impl={layer.last_impl}" + ("" if layer.last_impl == impl else f" (asked for impl={impl})"))
    typer.echo(f"selection of the last token, kv head 0: {sel[0, 0, -1].tolist()}")
