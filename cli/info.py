"""`nsa-flex info`: versions and the device, for bug reports."""

from __future__ import annotations

import platform

import typer


def info() -> None:
    """Print the versions of nsa-flex, torch, triton (if present) and the CUDA device (if any)."""
    import torch

    import nsa_flex

    typer.echo(f"nsa-flex  {nsa_flex.__version__}")
    typer.echo(f"python    {platform.python_version()}")
    typer.echo(f"torch     {torch.__version__}")
    try:
        import triton

        typer.echo(f"triton    {triton.__version__}")
    except ImportError:
        typer.echo("triton    not installed (CPU build of torch: the flex path runs its torch twin)")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        typer.echo(f"cuda      {torch.version.cuda}, {torch.cuda.device_count()} device(s)")
        typer.echo(f"device    {props.name}, {props.total_memory / 2**30:.1f} GiB, sm_{props.major}{props.minor}")
    else:
        typer.echo("cuda      no CUDA device (CPU only)")
