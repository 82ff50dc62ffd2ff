"""`nsa-flex bench`: time NSA against dense attention and peers; write JSON, Markdown and PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(name="bench", no_args_is_help=True)

_K = 1024
_REPORT_SUFFIXES = (".json", ".md", ".png")


@app.callback()
def bench() -> None:
    """Benchmarks: each prints one Markdown table last and saves it as JSON, Markdown and PNG."""


def parse_ints(text: str, what: str) -> tuple[int, ...]:
    """'8k,16k' or '8192,16384' -> (8192, 16384); k means 1024."""
    values = []
    for item in (s.strip().lower() for s in text.split(",")):
        scale = _K if item.endswith("k") else 1
        digits = item[:-1] if scale == _K else item
        if not digits.isdigit() or int(digits) == 0:
            raise typer.BadParameter(
                f"{item!r} in {text!r}: expected comma-separated positive integers, k = 1024 "
                f"(e.g. 8k,16k or 8192,16384)", param_hint=what)
        values.append(int(digits) * scale)
    return tuple(values)


def free_stem(out_dir: Path, name: str | None, default: str, overwrite: bool) -> str:
    """The file stem to write: --name (an error if its result exists, unless --overwrite), or the
    default stem, with _2, _3, ... appended past earlier results of the same day (said so)."""
    def taken(stem: str) -> Path | None:
        return next((p for p in (out_dir / f"{stem}{ext}" for ext in _REPORT_SUFFIXES) if p.exists()), None)

    stem = name or default
    if overwrite or taken(stem) is None:
        return stem
    if name is not None:
        raise typer.BadParameter(f"{taken(stem)} holds an earlier result named {name!r}; pass --overwrite to "
                                 "replace it, or choose another --name", param_hint="--name")
    n = 2
    while taken(f"{stem}_{n}") is not None:
        n += 1
    typer.echo(f"{taken(stem)} exists: this run writes {stem}_{n}.* (pass --overwrite to replace {stem}.* instead)")
    return f"{stem}_{n}"


def parse_names(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


@app.command()
def attention(
    seq_lens: Optional[str] = typer.Option(None, "--seq-lens", "-T", help=(
        "Sequence lengths, comma-separated, k = 1024. Default: 8k,16k,32k,64k on CUDA; 256,512 on CPU.")),
    modes: Optional[str] = typer.Option(None, help="Modes, comma-separated: fwd, fwd+bwd (default both)."),
    impls: Optional[str] = typer.Option(None, help=(
        "Implementations, comma-separated (see --list-impls). Default on CUDA: nsa-flex, dense-cudnn, "
        "dense-flash, flex-dense and the peers fla, lucidrains when importable; on CPU: reference, nsa-flex, dense.")),
    list_impls: bool = typer.Option(False, "--list-impls", help="Print the implementations and exit."),
    device: Optional[str] = typer.Option(None, help="cuda or cpu (default: cuda when torch sees one)."),
    preset: Optional[str] = typer.Option(None, help=(
        "NSAConfig preset the shapes and sparsity start from: paper, bench, g4, tiny. Default: bench on CUDA "
        "(paper sparsity l=32 d=16 l'=64 n=16 w=512; Hq=64 Hkv=4 D=128), tiny on CPU.")),
    batch: int = typer.Option(1, "--batch", "-B", help="Sequences per batch."),
    heads: Optional[int] = typer.Option(None, help="Hq, query heads."),
    kv_heads: Optional[int] = typer.Option(None, help="Hkv, key/value heads."),
    head_dim: Optional[int] = typer.Option(None, help="Dk."),
    head_dim_v: Optional[int] = typer.Option(None, help="Dv (default Dk)."),
    cmp_block: Optional[int] = typer.Option(None, help="l, compression block."),
    cmp_stride: Optional[int] = typer.Option(None, help="d, compression stride."),
    sel_block: Optional[int] = typer.Option(None, help="l', selection block."),
    n_selected: Optional[int] = typer.Option(None, help="n, selected blocks."),
    window: Optional[int] = typer.Option(None, help="w, sliding window."),
    dtype: Optional[str] = typer.Option(None, help="bf16, fp16 or fp32 (default bf16 on CUDA, fp32 on CPU)."),
    warmup: Optional[int] = typer.Option(None, help="Untimed calls after the first (default 3 CUDA, 1 CPU)."),
    iters: Optional[int] = typer.Option(None, help="Timed calls, median reported (default 10 CUDA, 3 CPU)."),
    check_seq_len: Optional[int] = typer.Option(None, help=(
        "T of the correctness check before timing, 0 = none (default 2048 CUDA, 256 CPU).")),
    module_dim: int = typer.Option(1024, help="Model width of the module rows (nsa-flex-module, lucidrains)."),
    compile: Optional[bool] = typer.Option(None, "--compile/--no-compile", help=(
        "Run nsa-flex inside the caller's torch.compile(fullgraph=True). Default off: nsa-flex runs as "
        "nsa_attention does by default (on CUDA, one compiled graph per shape); nsa-flex-eager runs its glue "
        "eagerly.")),
    seed: int = typer.Option(0, help="Random seed of the inputs."),
    out_dir: Path = typer.Option(Path("runs/bench"), "--out-dir", "-o", help="Folder for the JSON, MD and PNG."),
    name: Optional[str] = typer.Option(None, help="File stem (default <date>_<device>_attention)."),
    overwrite: bool = typer.Option(False, "--overwrite", help=(
        "Replace an earlier result of the same --name (refused otherwise; without --name a new stem is picked)")),
    git_commit: Optional[str] = typer.Option(None, help="Commit to record when the checkout has no git metadata."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar on stderr."),
) -> None:
    """Op-level timing of NSA (nsa-flex) against dense attention and peers over sequence lengths."""
    from nsa_flex.bench import (IMPLS, attention_config, attention_notes, attention_summary, default_stem,
                                run_suite, write_report)

    if list_impls:
        for impl in IMPLS.values():
            typer.echo(f"{impl.name:16} {impl.description}")
        raise typer.Exit()
    nsa = dict(n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim, head_dim_v=head_dim_v, cmp_block=cmp_block,
               cmp_stride=cmp_stride, sel_block=sel_block, n_selected=n_selected, window=window)
    try:
        cfg = attention_config(
            device=device, preset=preset, nsa_overrides=nsa,
            seq_lens=parse_ints(seq_lens, "--seq-lens") if seq_lens else None,
            modes=parse_names(modes) if modes is not None else None,
            impls=parse_names(impls) if impls is not None else None,
            batch=batch, dtype=dtype, warmup=warmup, iters=iters, check_seq_len=check_seq_len,
            module_dim=module_dim, compile=compile, seed=seed,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if cfg.device == "cpu":
        typer.echo("No CUDA device (or --device cpu): running a tiny CPU sweep. It checks that everything runs; "
                   "its times are no performance figure. GPU figures need CUDA.")
    typer.echo(f"bench attention: {attention_summary(cfg)}; T={list(cfg.seq_lens)}; impls={', '.join(cfg.impls)}")
    for why in cfg.left_out:
        typer.echo(f"left out (optional peer): {why}")
    stem = free_stem(out_dir, name, default_stem("attention", cfg.device), overwrite)

    def save(rows):
        return write_report(out_dir, stem, suite="attention", config=cfg, rows=rows, summary=attention_summary(cfg),
                            notes=attention_notes(cfg), commit=git_commit)

    # Rewritten after every (impl, T): a run cut short still leaves what it measured.
    rows = _run_with_progress("attention", run_suite, cfg, progress, on_rows=save)
    paths, md = save(rows)
    _echo_paths(paths)
    typer.echo("")
    typer.echo(md)


def _echo_paths(paths: dict) -> None:
    for kind, path in paths.items():
        typer.echo(f"wrote {kind}: {path}" if path else f"no {kind}: matplotlib is not importable (pip install matplotlib)")


def _run_with_progress(suite: str, run_suite, cfg, show: bool, on_rows=None):
    """run_suite(suite, cfg) with a progress bar on stderr, or with plain lines when show is False."""
    saving = {} if on_rows is None else {"on_rows": on_rows}
    if not show:
        # Plain lines (logs, CI, remote runs): one per step, so a long sweep is never silent.
        return run_suite(suite, cfg, **saving,
                         progress=lambda done, total, what: typer.echo(f"  [{done}/{total}] {what}", err=True))
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task("starting", total=None)
        return run_suite(suite, cfg, **saving,
                         progress=lambda done, total, what: bar.update(task, completed=done, total=total,
                                                                       description=what))


@app.command()
def decode(
    contexts: Optional[str] = typer.Option(None, "--contexts", "-T", help=(
        "Tokens already cached, comma-separated, k = 1024. Default: 8k,16k,32k,64k,128k on CUDA; 256,512 on CPU.")),
    batches: Optional[str] = typer.Option(None, help="Batch sizes, comma-separated (default 1,8 on CUDA; 1,2 on CPU)."),
    device: Optional[str] = typer.Option(None, help="cuda or cpu (default: cuda when torch sees one)."),
    check: bool = typer.Option(True, "--check/--no-check", help="Check compiled decode against the reference first."),
    out_dir: Path = typer.Option(Path("runs/bench"), "--out-dir", "-o", help="Folder for the JSON, MD and PNG."),
    name: Optional[str] = typer.Option(None, help="File stem (default <date>_<device>_decode)."),
    overwrite: bool = typer.Option(False, "--overwrite", help=(
        "Replace an earlier result of the same --name (refused otherwise; without --name a new stem is picked)")),
    git_commit: Optional[str] = typer.Option(None, help="Commit to record when the checkout has no git metadata."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar on stderr."),
) -> None:
    """One layer's NSA decode step (one CUDA graph) against dense SDPA decode over context lengths."""
    from nsa_flex.bench import default_stem, run_suite, write_report
    from nsa_flex.bench.decode import decode_config, decode_notes, decode_summary

    try:
        cfg = decode_config(device=device, check=check,
                            contexts=parse_ints(contexts, "--contexts") if contexts else None,
                            batches=parse_ints(batches, "--batches") if batches else None)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if cfg.device == "cpu":
        typer.echo("No CUDA device (or --device cpu): a tiny functional decode sweep; GPU figures need CUDA.")
    typer.echo(f"bench decode: {decode_summary(cfg)}; T={list(cfg.contexts)} B={list(cfg.batches)}")
    stem = free_stem(out_dir, name, default_stem("decode", cfg.device), overwrite)
    rows = _run_with_progress("decode", run_suite, cfg, progress)
    paths, md = write_report(out_dir, stem, suite="decode", config=cfg,
                             rows=rows, summary=decode_summary(cfg), notes=decode_notes(cfg), commit=git_commit)
    _echo_paths(paths)
    typer.echo("")
    typer.echo(md)


@app.command()
def model(
    seq_lens: Optional[str] = typer.Option(None, "--seq-lens", "-T", help=(
        "Sequence lengths, comma-separated, k = 1024. Default: 2k,8k,32k on CUDA; 128,256 on CPU.")),
    batches: Optional[str] = typer.Option(None, "--batches", "--batch", "-B", help=(
        "Sequences per step: one per sequence length, or one for all. Default: 16,4,1 at 2k,8k,32k on CUDA; "
        "otherwise 32768 (CUDA) or 1024 (CPU) tokens per step, at least 1 sequence.")),
    preset: Optional[str] = typer.Option(None, help="Model preset: seeds-125m (default on CUDA) or tiny (CPU)."),
    attentions: Optional[str] = typer.Option(None, help="Attentions, comma-separated: nsa, dense (default both)."),
    steps: Optional[int] = typer.Option(None, help="Timed training steps, median reported (default 10 CUDA, 3 CPU)."),
    warmup: Optional[int] = typer.Option(None, help="Untimed steps first, the compiling one included (3 CUDA, 2 CPU)."),
    device: Optional[str] = typer.Option(None, help="cuda or cpu (default: cuda when torch sees one)."),
    dtype: Optional[str] = typer.Option(None, help=(
        "Autocast precision: bf16, fp16 or fp32 (default bf16 on CUDA, fp32 on CPU).")),
    compile: Optional[bool] = typer.Option(None, "--compile/--no-compile", help=(
        "Compile each block, as `nsa-flex train` does (default on CUDA).")),
    seed: int = typer.Option(0, help="Seed of the model initialisation and the data."),
    out_dir: Path = typer.Option(Path("runs/bench"), "--out-dir", "-o", help="Folder for the JSON, MD and PNG."),
    name: Optional[str] = typer.Option(None, help="File stem (default <date>_<device>_model)."),
    overwrite: bool = typer.Option(False, "--overwrite", help=(
        "Replace an earlier result of the same --name (refused otherwise; without --name a new stem is picked)")),
    git_commit: Optional[str] = typer.Option(None, help="Commit to record when the checkout has no git metadata."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar on stderr."),
) -> None:
    """Whole-model training steps: tokens/s and peak memory of the NSA LM against the same LM with dense attention."""
    from nsa_flex.bench import default_stem, run_suite, write_report
    from nsa_flex.bench.model import model_config, model_notes, model_summary

    try:
        cfg = model_config(device=device, preset=preset, dtype=dtype, steps=steps, warmup=warmup, compile=compile,
                           seed=seed, seq_lens=parse_ints(seq_lens, "--seq-lens") if seq_lens else None,
                           batches=parse_ints(batches, "--batches") if batches else None,
                           attentions=parse_names(attentions) if attentions is not None else None)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if cfg.device == "cpu":
        typer.echo("No CUDA device (or --device cpu): a tiny CPU sweep that checks everything runs; "
                   "its times are no performance figure. GPU figures need CUDA.")
    typer.echo(f"bench model: {model_summary(cfg)}; (T, B)={list(cfg.shapes)}; attentions={', '.join(cfg.attentions)}")
    stem = free_stem(out_dir, name, default_stem("model", cfg.device), overwrite)
    rows = _run_with_progress("model", run_suite, cfg, progress)
    paths, md = write_report(out_dir, stem, suite="model", config=cfg,
                             rows=rows, summary=model_summary(cfg), notes=model_notes(cfg), commit=git_commit)
    _echo_paths(paths)
    typer.echo("")
    typer.echo(md)


@app.command()
def selected(
    seq_lens: str = typer.Option("8k,32k,64k", "--seq-lens", "-T", help="Sequence lengths, comma-separated, k = 1024."),
    shapes: str = typer.Option("seeds-125m,g4", help=(
        "Attention shapes, comma-separated: seeds-125m (Hq=12, Hkv=3, D=64), g1, g2, g4, g8, g16 (Hkv=4, D=128).")),
    out_dir: Path = typer.Option(Path("runs/bench"), "--out-dir", "-o", help="Folder for the JSON."),
    name: Optional[str] = typer.Option(None, help="File stem (default <date>_cuda_selected)."),
    overwrite: bool = typer.Option(False, "--overwrite", help=(
        "Replace an earlier result of the same --name (refused otherwise; without --name a new stem is picked)")),
    git_commit: Optional[str] = typer.Option(None, help="Commit to record when the checkout has no git metadata."),
) -> None:
    """The selected branch alone (CUDA): the block-centric op against the token-centric Flex call and dense cuDNN."""
    import torch

    from nsa_flex.bench import default_stem
    from nsa_flex.bench.selected import SHAPES, run

    names = parse_names(shapes)
    unknown = [s for s in names if s not in SHAPES]
    if unknown or not names:
        raise typer.BadParameter(f"unknown shapes {unknown}; allowed: {', '.join(SHAPES)}", param_hint="--shapes")
    if not torch.cuda.is_available():
        raise typer.BadParameter("needs a CUDA device: it times Triton kernels against cuDNN "
                                 "(the op's CPU checks are in the test suite)", param_hint="device")
    stem = free_stem(out_dir, name, default_stem("selected", "cuda"), overwrite)
    out_dir.mkdir(parents=True, exist_ok=True)
    run(list(parse_ints(seq_lens, "--seq-lens")), names, out_dir / f"{stem}.json", git_commit)
    typer.echo(f"wrote json: {out_dir / f'{stem}.json'}")


@app.command()
def breakdown(
    seq_lens: str = typer.Option("16k,64k", "--seq-lens", "-T", help="Sequence lengths, comma-separated, k = 1024."),
    preset: str = typer.Option("g4", help="NSAConfig preset of the op's shapes: g4, bench, paper, tiny."),
    out_dir: Path = typer.Option(Path("runs/bench"), "--out-dir", "-o", help="Folder for the JSON."),
    name: Optional[str] = typer.Option(None, help="File stem (default <date>_cuda_breakdown)."),
    overwrite: bool = typer.Option(False, "--overwrite", help=(
        "Replace an earlier result of the same --name (refused otherwise; without --name a new stem is picked)")),
    git_commit: Optional[str] = typer.Option(None, help="Commit to record when the checkout has no git metadata."),
    profile_only: bool = typer.Option(False, "--profile-only", help=(
        "Only the whole op: its times, and its kernels by family (skips each step alone, which compiles on its own)")),
) -> None:
    """Where the op's time goes (CUDA): each step alone against its floor, and the whole op's kernels by family."""
    import torch

    from nsa_flex.bench import default_stem
    from nsa_flex.bench.breakdown import run
    from nsa_flex.config import PRESETS

    if preset not in PRESETS:
        raise typer.BadParameter(f"unknown preset {preset!r}; allowed: {', '.join(PRESETS)}", param_hint="--preset")
    if not torch.cuda.is_available():
        raise typer.BadParameter("needs a CUDA device: it times the op's GPU kernels and profiles them",
                                 param_hint="device")
    stem = free_stem(out_dir, name, default_stem("breakdown", "cuda"), overwrite)
    out_dir.mkdir(parents=True, exist_ok=True)
    run(preset, list(parse_ints(seq_lens, "--seq-lens")), out_dir / f"{stem}.json", git_commit, profile_only)
    typer.echo(f"wrote json: {out_dir / f'{stem}.json'}")
