"""`nsa-flex generate`: sample from a trained checkpoint (or a tiny random model) and time it."""

from __future__ import annotations

from typing import Optional

import typer


def generate(
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", "-c", help=(
        "A checkpoint written by `nsa-flex train`, or its run folder (the newest checkpoint is used). "
        "Default: a randomly initialised model of --preset.")),
    preset: str = typer.Option("tiny", help="Model preset of the random model (without --checkpoint)."),
    prompt: Optional[list[str]] = typer.Option(None, "--prompt", "-p", help=(
        "Prompt text (repeat for a batch; prompts may differ in length).")),
    tokens: Optional[list[str]] = typer.Option(None, "--tokens", "-t", help=(
        "Prompt as comma-separated token ids, e.g. 1,2,3 (repeatable; instead of --prompt).")),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", min=1, help="Tokens to generate per prompt."),
    temperature: float = typer.Option(0.8, min=0.0, help=(
        "Softmax temperature; 0 = greedy (a small byte-level model then often repeats one byte, e.g. spaces).")),
    top_k: Optional[int] = typer.Option(20, "--top-k", min=1, help=(
        "Sample among the k most likely tokens (with --temperature > 0).")),
    seed: int = typer.Option(0, help="Seeds the random model and the sampling."),
    device: str = typer.Option("auto", help="cpu, cuda, or auto (cuda when available)."),
    dtype: str = typer.Option("auto", help="fp32, bf16, or auto (bf16 on CUDA, fp32 on CPU)."),
    compile: str = typer.Option("auto", help=(
        "Compile the decode step into one CUDA graph (mode=reduce-overhead): on, off, auto (on for CUDA).")),
) -> None:
    """Prefill the prompts in one batch, decode token by token, print the text and tokens/s."""
    import torch

    from nsa_flex.decoding.generate import SamplingConfig
    from nsa_flex.decoding.generate import generate as run_generate

    dev = _choose(device, "--device", {"auto": "cuda" if torch.cuda.is_available() else "cpu", "cpu": "cpu",
                                       "cuda": "cuda"})
    if dev == "cuda" and not torch.cuda.is_available():
        raise typer.BadParameter("cuda requested but torch sees no CUDA device", param_hint="--device")
    dt = _choose(dtype, "--dtype", {"auto": torch.bfloat16 if dev == "cuda" else torch.float32,
                                    "fp32": torch.float32, "bf16": torch.bfloat16})
    compiled = _choose(compile, "--compile", {"auto": dev == "cuda", "on": True, "off": False})
    sampling = SamplingConfig(temperature=temperature, top_k=top_k)
    torch.manual_seed(seed)
    model, tokenizer, source = _model(checkpoint, preset, dev, dt, seed, need_tokenizer=not tokens)
    prompts = _prompts(prompt, tokens, tokenizer)
    typer.echo(f"model: {source}; {model.num_params() / 1e6:.2f}M parameters, impl={model.config.impl}, "
               f"{dev}, {str(dt).removeprefix('torch.')}, compile={'on' if compiled else 'off'}; "
               + ("greedy" if temperature == 0 else f"sampling at temperature {temperature:g}"
                  + (f", top-k {top_k}" if top_k else "") + f", seed {seed}"))
    try:
        result = run_generate(model, prompts, max_new_tokens, sampling=sampling, compile=compiled)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    for i, (p, new) in enumerate(zip(prompts, result.tokens)):
        typer.echo(f"--- sequence {i}: {len(p)} prompt tokens, {len(new)} new")
        typer.echo(f"prompt ids: {p}\nnew ids:    {new}")
        text = _detokenize(tokenizer, new)
        if text is not None:
            typer.echo(f"text: {_detokenize(tokenizer, p)}|{text}")
    typer.echo(f"prefill: {result.prefill_s * 1e3:.1f} ms; decode: {result.decode_tokens} tokens in "
               f"{result.decode_s * 1e3:.1f} ms = {result.tokens_per_s:.1f} tokens/s "
               f"(batch {len(prompts)}; the first 2 steps, which compile, are not timed)")


def _model(checkpoint: str | None, preset: str, dev: str, dt, seed: int, need_tokenizer: bool):
    """(model, tokenizer or None, description): a checkpoint's model, else a random one of `preset`."""
    from nsa_flex.training.data import DataError
    from nsa_flex.model import MODEL_PRESETS, NSALM
    from nsa_flex.training.checkpoint import CheckpointError
    from nsa_flex.training.tokens import load_tokenizer

    if checkpoint is None:
        if preset not in MODEL_PRESETS:
            raise typer.BadParameter(f"unknown preset {preset!r}; allowed: {', '.join(MODEL_PRESETS)}",
                                     param_hint="--preset")
        model, spec = NSALM(MODEL_PRESETS[preset], device=dev).to(dt).eval(), "byte"
        source = f"random {preset} model (seed {seed})"
    else:
        from nsa_flex.training.load import find_checkpoint, load_model

        try:
            path = find_checkpoint(checkpoint)
            model, train_config = load_model(path, device=dev, dtype=dt)
        except CheckpointError as e:
            raise typer.BadParameter(str(e), param_hint="--checkpoint") from e
        spec, source = train_config.tokenizer, str(path)
    try:
        tokenizer = load_tokenizer(spec)
    except DataError as e:
        if need_tokenizer:
            raise typer.BadParameter(f"{e} (the checkpoint's tokenizer; give --tokens instead)",
                                     param_hint="--prompt") from e
        tokenizer = None
    return model, tokenizer, source


def _choose(value: str, flag: str, table: dict):
    if value not in table:
        raise typer.BadParameter(f"{value!r}; allowed: {', '.join(table)}", param_hint=flag)
    return table[value]


def _prompts(texts: list[str] | None, id_lists: list[str] | None, tokenizer) -> list[list[int]]:
    if texts and id_lists:
        raise typer.BadParameter("give --prompt or --tokens, not both")
    if id_lists:
        prompts = []
        for item in id_lists:
            try:
                prompts.append([int(s) for s in item.split(",") if s.strip()])
            except ValueError as e:
                raise typer.BadParameter(f"{item!r}: expected comma-separated token ids", param_hint="--tokens") from e
        return prompts
    return [tokenizer.encode(t) for t in (texts or ["Native sparse attention"])]


def _detokenize(tokenizer, ids: list[int]) -> str | None:
    """Text of ids: the tokenizer's own decode if it has one; bytes for the byte tokenizer
    (ids >= 256 shown as <id>); else None (ids only)."""
    if tokenizer is None:
        return None
    if hasattr(tokenizer, "decode"):
        return tokenizer.decode(ids)
    if getattr(tokenizer, "name", None) != "byte":
        return None
    parts, run = [], bytearray()
    for t in ids:
        if t < 256:
            run.append(t)
            continue
        parts += [run.decode("utf-8", errors="replace"), f"<{t}>"]
        run = bytearray()
    return "".join(parts) + run.decode("utf-8", errors="replace")
