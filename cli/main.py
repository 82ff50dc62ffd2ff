"""`nsa-flex`: turns flags into configs and calls the library. Nothing else lives here."""

from __future__ import annotations

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
app.command()(info)
app.command()(demo)
app.command()(train)
app.command()(generate)
app.command()(memory)
app.add_typer(bench.app, name="bench")


if __name__ == "__main__":
    app()
