"""`nsa-flex`: turns flags into configs and calls the library. Nothing else lives here."""

from __future__ import annotations

import os
import warnings
from typing import Optional

import typer

from nsa_flex_cli import bench
from nsa_flex_cli.demo import demo
from nsa_flex_cli.generate import generate
from nsa_flex_cli.info import info
from nsa_flex_cli.memory import memory
from nsa_flex_cli.train import train

app = typer.Typer(
    name="nsa-flex",
    help="Native Sparse Attention for PyTorch: benchmarks, training and decoding.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


def default_threads() -> int:
    """Half the CPU cores this process may use, at most 4, at least 1.

    On a 2-core machine one thread trained the tiny model 1.6x slower than two when the machine
    was idle, but 1.3-2.7x faster when another job shared the cores (and small ops there ran
    10-60x slower on both cores): torch's spinning thread pool waits on a busy core.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cores // 2))


@app.callback()
def main(threads: Optional[int] = typer.Option(None, "--threads", min=1, help=(
        "CPU threads of torch's intra-op pool (per process). Default: half the cores, at most 4 "
        "(here: {}).".format(default_threads())))) -> None:
    """Native Sparse Attention for PyTorch: benchmarks, training and decoding."""
    import torch

    torch.set_num_threads(threads or default_threads())
    quiet_known_warnings()


def quiet_known_warnings() -> None:
    """Hide warnings that a CLI user can do nothing about; the commands report what ran instead."""
    # CPU FlexAttention runs eagerly on purpose (dense, exact); the library documents it.
    warnings.filterwarnings("ignore", message=r"flex_attention called without torch\.compile")
    # Triton 3.6's interpreter and numpy < 2.4 (array-to-scalar conversions); numpy's own notices.
    warnings.filterwarnings("ignore", message=r"Conversion of an array with ndim > 0 to a scalar")
    warnings.filterwarnings("ignore", module=r"numpy(\.|$)")
    warnings.filterwarnings("ignore", message=r"The given NumPy array is not writable")
    # The demo and train print the implementation that ran (impl=flex with CPU gradients).
    warnings.filterwarnings("ignore", message=r"impl='flex' on CPU with gradients runs the reference")


app.command()(info)
app.command()(demo)
app.command()(train)
app.command()(generate)
app.command()(memory)
app.add_typer(bench.app, name="bench")


if __name__ == "__main__":
    app()
