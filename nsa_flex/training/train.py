"""`train()`: one readable function, in a fixed order.

torchrun init -> log config and versions -> build (model, data) -> optional torchao float8 ->
activation checkpointing -> compile each block -> DDP / FSDP2 -> optimizer, schedule, scaler
-> resume -> loop (watchdog, non-finite guard, metrics, checkpoints).

One step: zero grads; for each micro-batch forward under autocast, cross-entropy in fp32,
backward (gradient sync on the last micro-batch only); unscale (fp16); clip; one all-reduce of
[loss, finite flag] (read back in the step's single host sync); then step, or skip the step when
the loss (or, without a GradScaler, the gradient norm) is not finite. Every rank takes the same
decision from the same reduced numbers, so no collective is ever left unmatched. With a fused
optimizer the update is queued on the GPU and skipped there, and the step is read back after
the next one is queued.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from nsa_flex.training.data import ShardedBatches
from nsa_flex.model import NSALM, lm_loss
from nsa_flex.training import checkpoint as ckpt
from nsa_flex.training import parallel as par
from nsa_flex.training.config import ConfigError, RunPlan, TrainConfig, plan
from nsa_flex.training.metrics import LoggingCallback, MetricsWriter, RunLog, TrainCallback, memory_gib, versions
from nsa_flex.training.optim import build_optimizer, build_scheduler
from nsa_flex.training.tokens import open_source
from nsa_flex.training.watchdog import Watchdog


@functools.cache
def compiled_lm_loss():
    """lm_loss compiled once per process (for runs that compile their blocks). Fusing the fp32
    cast, log-softmax and NLL keeps only the bf16 logits for the backward, not fp32 copies."""
    return torch.compile(lm_loss, fullgraph=True, dynamic=False)


class NonFiniteLossError(RuntimeError):
    """Too many non-finite losses in a row."""


@dataclass(frozen=True)
class TrainHooks:
    """Fault injection for tests and drills (never set in normal runs)."""

    before_step: Callable[[int], None] | None = None
    """Called with the step number before each step (e.g. sleep to test the watchdog); where steps
    are read back ahead, the step before may not be read back yet."""
    loss_transform: Callable[[int, torch.Tensor], torch.Tensor] | None = None
    """Maps (step, loss) to the loss that is backpropagated (e.g. NaN to test the guard)."""
    clock: Callable[[], float] | None = None
    """The watchdog's clock in seconds (None: time.monotonic); a test's clock makes a stall exact."""


@dataclass
class TrainResult:
    """What a run did (rank 0's view; losses averaged over ranks)."""

    start_step: int
    last_step: int
    total_steps: int = 0
    """The run's configured steps (a call that starts there trains nothing)."""
    losses: list[float] = field(default_factory=list)
    """Loss of each step this call ran (skipped steps included, as computed)."""
    step_times_s: list[float] = field(default_factory=list)
    tokens_per_step: int = 0
    nonfinite_steps: int = 0
    peak_memory_gib: float = 0.0
    checkpoint: str | None = None
    out_dir: str = ""

    def record(self, metrics: dict) -> None:
        self.losses.append(metrics["loss"])
        self.step_times_s.append(metrics["step_time_s"])
        self.last_step, self.nonfinite_steps = metrics["step"], metrics["nonfinite_total"]

    def summary(self) -> dict:
        return {"start_step": self.start_step, "last_step": self.last_step, "total_steps": self.total_steps,
                "final_loss": self.losses[-1] if self.losses else None,
                "tokens_per_s": self.tokens_per_s, "nonfinite_steps": self.nonfinite_steps,
                "peak_memory_gib": self.peak_memory_gib, "checkpoint": self.checkpoint}

    @property
    def tokens_per_s(self) -> float:
        """Median over the steps after the first (which includes compilation)."""
        times = sorted(self.step_times_s[1:] or self.step_times_s)
        return self.tokens_per_step / times[len(times) // 2] if times else 0.0


def train(config: TrainConfig, *, callback: TrainCallback | None = None, hooks: TrainHooks | None = None,
          ) -> TrainResult:
    """Train `config.model` on `config.data` (see TrainConfig); returns what happened.

    Under torchrun, train() starts the process group and destroys it at the end, unless the
    caller started one already: then it is used and left as it was.
    """
    # 1. torchrun init; every "auto" setting is resolved here, once.
    world = par.torchrun_world()
    run = plan(config, world.world_size, world.local_rank)
    out_dir = prepare_out_dir(config.out_dir)
    started_group = par.init_process_group(world, run.device)
    report = RunLog(out_dir, callback or LoggingCallback(config.log_every), config.log_every) \
        if world.rank == 0 else _Quiet()
    hooks, writer = hooks or TrainHooks(), None
    # The watchdog covers everything after init: a collective that never returns, in set-up
    # or in a step, ends the run with stack traces. The first step also compiles.
    dog = Watchdog(config.stall_timeout, first_timeout=config.first_step_timeout, rank=world.rank,
                   clock=hooks.clock or time.monotonic)
    try:
        dog.start()
        # 2. The config and the versions, before anything heavy.
        report.on_start({"config": config.to_dict(), "versions": versions(), "world_size": world.world_size,
                         "device": str(run.device), "precision": run.precision, "parallel": run.parallel,
                         "compile": run.compile, "cuda_graphs": run.cuda_graphs, "impl": run.model.impl})
        # 3. Build the model where it runs, and the data (checked against its vocabulary).
        torch.manual_seed(config.seed)
        model = NSALM(run.model, device=run.device)
        batches = _open_batches(config, world, model.config.vocab_size, pin_memory=run.device.type == "cuda")
        # 4. float8, activation checkpointing, compile each block, then DDP / FSDP2.
        if config.float8:
            par.apply_float8(model)
        if config.activation_checkpointing:
            par.apply_activation_checkpointing(model)
        if run.compile:
            par.compile_blocks(model, run.cuda_graphs)
        else:
            model.set_compiled_attention(False)
        wrapped = par.parallelize(model, run.parallel, run.device, world)
        # 5. Optimizer, schedule, GradScaler (fp16); then resume everything a checkpoint holds.
        optimizer = build_optimizer(wrapped, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay,
                                    device=run.device)
        state = _State(wrapped, optimizer, build_scheduler(optimizer, warmup=config.warmup_steps, total=config.steps,
                                                           min_ratio=config.min_lr_ratio),
                       torch.amp.GradScaler(run.device.type) if run.precision == "fp16" else None, batches)
        _resume(config, state, report)
        result = TrainResult(start_step=state.step, last_step=state.step, total_steps=config.steps,
                             out_dir=config.out_dir,
                             tokens_per_step=config.batch_size * config.T * config.grad_accum * world.world_size)
        if world.rank == 0:
            writer = MetricsWriter(Path(config.out_dir), tensorboard=config.tensorboard, notify=report.on_message)
        report.on_message(f"model: {model.num_params():,} parameters, {run.model.attention} attention"
                          + (f" (impl {run.model.impl})" if run.model.attention == "nsa" else "")
                          + f"; data: {batches.source.describe()}")
        # 6. The loop. A step whose update is queued on the GPU (_LaunchedStep.ahead) is read
        # back after the next step is queued, so the GPU never waits for the host between
        # steps; the first step (which compiles: its time stays its own), a step that saves a
        # checkpoint, and the last are read back at once.
        pending, last_done, first = None, None, state.step + 1

        def finish(launched: _LaunchedStep) -> None:
            nonlocal last_done
            metrics = _finish_step(state, run, config, world, launched, last_done)
            last_done = time.perf_counter()
            result.record(metrics)
            if writer is not None:
                writer.write(metrics)
            report.on_step(metrics)
            _check_nonfinite(state, config.nonfinite_limit)
            if _saves(config, launched.step):
                result.checkpoint = _save(config, state, world)
                report.on_message(f"checkpoint saved: {result.checkpoint}")
            dog.beat(launched.step)

        for step in range(state.step + 1, config.steps + 1):
            if hooks.before_step is not None:
                hooks.before_step(step)
            launched = _launch_step(state, run, config, world, hooks, step)
            if pending is not None:
                finish(pending)
            ahead = launched.ahead and first < step < config.steps and not _saves(config, step)
            pending = launched if ahead else None
            if pending is None:
                finish(launched)
        result.peak_memory_gib = memory_gib(run.device)
        report.on_end(result.summary())
        return result
    finally:
        dog.stop()
        if writer is not None:
            writer.close()
        if isinstance(report, RunLog):
            report.close()
        if started_group:
            torch.distributed.destroy_process_group()


@dataclass
class _State:
    """What the loop drives, and its counters (saved in checkpoints)."""

    model: torch.nn.Module
    """The model as wrapped for data parallelism."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler | None
    batches: ShardedBatches
    step: int = 0
    nonfinite_in_a_row: int = 0
    nonfinite_total: int = 0

    def counters(self) -> dict:
        return {"step": self.step, "nonfinite_in_a_row": self.nonfinite_in_a_row,
                "nonfinite_total": self.nonfinite_total}


def _saves(config: TrainConfig, step: int) -> bool:
    """Whether `step` ends with a checkpoint."""
    return config.save_checkpoints and (step == config.steps or bool(
        config.checkpoint_every and step % config.checkpoint_every == 0))


@dataclass
class _LaunchedStep:
    """A step whose work is queued; _finish_step reads its numbers back."""

    step: int
    start: float
    """perf_counter() when the step began on the host."""
    values: torch.Tensor
    """[mean-summed loss, ranks with a finite loss, grad norm]: on the host (pinned) where `ahead`."""
    done: torch.cuda.Event | None
    """Recorded after the copy of `values` to the host (CUDA, `ahead` only)."""
    ahead: bool
    """The update is queued on the device (skipped there where not finite) and the values copied
    without a sync: the next step can be queued before this one is read back."""
    lr: float | None
    """The learning rate of the queued update (None: the host steps at _finish_step)."""


def _launch_step(state: _State, run: RunPlan, config: TrainConfig, world: par.World, hooks: TrainHooks,
                 step: int) -> _LaunchedStep:
    """Queue one optimizer step over grad_accum micro-batches, up to its readback.

    The host waits for the GPU at most once a step, for the loss and finiteness (_finish_step).
    Before that it has sampled the next micro-batch and, with a fused optimizer, no GradScaler and
    no FSDP (whose DTensor parameters were not checked with it), queued the optimizer's update,
    skipped on the GPU where the loss or norm is not finite, and advanced the schedule: then the
    numbers go to pinned host memory without a sync, and the loop queues the next step before
    reading them, so the GPU does not sit idle between steps while the host does its bookkeeping
    (docs/decisions.md, "Training steps as CUDA graphs")."""
    start = time.perf_counter()
    model, optimizer, scaler = state.model, state.optimizer, state.scaler
    optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=run.device)
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(run.precision)
    loss_fn = compiled_lm_loss() if run.compile else lm_loss
    for micro in range(config.grad_accum):
        inputs, targets = (t.to(run.device, non_blocking=True) for t in state.batches.next())
        with par.gradient_sync(model, run.parallel, enabled=micro == config.grad_accum - 1):
            with torch.autocast(run.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                loss = loss_fn(model(inputs), targets) / config.grad_accum
            if hooks.loss_transform is not None:
                loss = hooks.loss_transform(step, loss)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_sum += loss.detach().float()
        if micro < config.grad_accum - 1:
            state.batches.prefetch()
    if scaler is not None:
        scaler.unscale_(optimizer)
    norm = par.grad_norm(model, config.grad_clip)
    stats = par.all_reduce_sum(torch.stack([loss_sum, torch.isfinite(loss_sum).float()]), world)
    # With a GradScaler, non-finite gradients are its business (it skips and lowers the scale).
    ahead = scaler is None and run.parallel != "fsdp" and _fused(optimizer)
    lr = None
    if ahead:
        lr = optimizer.param_groups[0]["lr"]
        _step_unless(optimizer, (stats[1] < world.world_size) | ~torch.isfinite(norm))
        state.scheduler.step()
    state.batches.prefetch()
    values = torch.cat([stats, norm.detach().float().reshape(1).to(stats.device)])
    done = None
    if ahead and values.is_cuda:
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        values = host
    return _LaunchedStep(step, start, values, done, ahead, lr)


def _finish_step(state: _State, run: RunPlan, config: TrainConfig, world: par.World, launched: _LaunchedStep,
                 last_done: float | None) -> dict:
    """Read a launched step's numbers back (the step's one host sync), step the optimizer and the
    schedule where the host decides, update the counters; returns the step's metrics. Its time
    runs from its start, or from the previous step's readback where that came later (a step
    queued ahead): in a steady run, the time between steps."""
    if launched.done is not None:
        launched.done.synchronize()
    loss, finite_ranks, norm = launched.values.tolist()
    loss /= world.world_size
    skipped = finite_ranks < world.world_size or (state.scaler is None and not math.isfinite(norm))
    lr = launched.lr
    if lr is None:
        if state.scaler is not None:
            if not skipped:
                state.scaler.step(state.optimizer)
            state.scaler.update()
        elif not skipped:
            state.optimizer.step()
        lr = state.optimizer.param_groups[0]["lr"]
        state.scheduler.step()
    state.step = launched.step
    state.nonfinite_in_a_row = state.nonfinite_in_a_row + 1 if skipped else 0
    state.nonfinite_total += int(skipped)
    elapsed = time.perf_counter() - max(launched.start, last_done if last_done is not None else launched.start)
    tokens = config.batch_size * config.T * config.grad_accum * world.world_size
    return {"step": launched.step, "total_steps": config.steps, "loss": loss, "lr": lr, "grad_norm": norm,
            "skipped": skipped, "nonfinite_total": state.nonfinite_total, "step_time_s": elapsed,
            "tokens_per_s": tokens / elapsed, "memory_gib": memory_gib(run.device),
            "scale": state.scaler.get_scale() if state.scaler is not None else None}


def _fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every group runs the fused kernel, which takes a found_inf tensor (skip the update)."""
    return all(group.get("fused") for group in optimizer.param_groups)


def _step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """optimizer.step() with its update skipped on the device where `skip` (a 0-d bool tensor) is
    true: the fused kernel reads it as GradScaler's found_inf (parameters, moments and step count
    left as they were), so no host sync comes first."""
    optimizer.found_inf = skip.to(torch.float32).reshape(())
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


def _check_nonfinite(state: _State, limit: int) -> None:
    if state.nonfinite_in_a_row >= limit:
        raise NonFiniteLossError(
            f"the loss was not finite for {limit} steps in a row (steps {state.step - limit + 1}..{state.step}); "
            f"aborting at step {state.step}. Lower --lr, use bf16 rather than fp16, or check the data")


def prepare_out_dir(out_dir: str) -> Path:
    """The run folder, created; a ConfigError (not an OSError) when it cannot be."""
    path = Path(out_dir)
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ConfigError(f"out_dir={out_dir!r}: {blocker} is a file, not a folder; choose another --out-dir")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"out_dir={out_dir!r}: cannot create the folder ({e.strerror}); "
                          "choose another --out-dir") from e
    return path


def _open_batches(config: TrainConfig, world: par.World, vocab_size: int,
                  pin_memory: bool = False) -> ShardedBatches:
    """The data source (text is tokenised by rank 0 while the others wait), checked against the model;
    pin_memory: batches in pinned memory (their copies to a GPU overlap its work)."""
    kwargs = dict(seq_len=config.T, seed=config.seed, tokenizer=config.tokenizer,
                  cache_dir=Path(config.out_dir) / "data",
                  text_key=config.text_key)
    if world.rank == 0:
        source = open_source(config.data, build=True, **kwargs)
    par.barrier(world)
    if world.rank != 0:
        source = open_source(config.data, build=False, **kwargs)
    if source.vocab_size > vocab_size:
        raise ConfigError(f"the data needs {source.vocab_size} token ids ({source.describe()}) but the model has "
                          f"vocab_size={vocab_size}; raise model.vocab_size (--vocab-size)")
    return ShardedBatches(source, batch_size=config.batch_size, rank=world.rank, world_size=world.world_size,
                          pin_memory=pin_memory)


def _resume(config: TrainConfig, state: _State, report) -> None:
    """Load the checkpoint `config.resume` names, if any, into everything the loop drives."""
    path = ckpt.find_resume(config.resume, config.out_dir)
    if path is None:
        return
    saved = ckpt.load(path)
    ckpt.check_compatible(saved, config.to_dict()["model"], path)
    changes = ckpt.check_same_data(saved, config.to_dict(), path, config.allow_data_change)
    if changes:
        report.on_message(f"data settings changed on purpose (--allow-data-change): {'; '.join(changes)}")
    ckpt.load_model_and_optimizer(state.model, state.optimizer, saved)
    state.scheduler.load_state_dict(saved["scheduler"])
    if state.scaler is not None and saved.get("scaler"):
        state.scaler.load_state_dict(saved["scaler"])
    state.batches.load_state_dict(saved["data"])
    ckpt.set_rng_state(saved["rng"])
    for key, value in saved["counters"].items():
        setattr(state, key, value)
    report.on_message(f"resumed from {path} at step {state.step} (data position {state.batches.position})")
    if state.step >= config.steps:
        report.on_message(f"{path} is already at step {state.step} >= steps={config.steps}: nothing to train "
                          "(raise --steps, or --resume none / another --out-dir to start afresh)")


def _save(config: TrainConfig, state: _State, world: par.World) -> str:
    """Write a checkpoint (rank 0 writes; gathering the state is collective) and prune old ones."""
    model_sd, optim_sd = ckpt.model_and_optimizer_state(state.model, state.optimizer)
    path = ckpt.checkpoint_path(config.out_dir, state.step)
    if world.rank == 0:
        ckpt.save(path, {
            "format": ckpt.FORMAT, "step": state.step, "model": model_sd, "optimizer": optim_sd,
            "scheduler": state.scheduler.state_dict(),
            "scaler": state.scaler.state_dict() if state.scaler is not None else None,
            "data": state.batches.state_dict(), "rng": ckpt.rng_state(), "config": config.to_dict(),
            "counters": state.counters(),
        })
        ckpt.prune(config.out_dir, config.keep_checkpoints)
    par.barrier(world)
    return str(path)


class _Quiet:
    """The callback of ranks other than 0."""

    def on_start(self, info): ...
    def on_step(self, metrics): ...
    def on_message(self, text): ...
    def on_end(self, summary): ...
