"""torchrun set-up and the model transforms of a run, each applied once, in train()'s order:
float8 -> activation checkpointing -> compile each block -> DDP / FSDP2.

torchrun's RANK / WORLD_SIZE / LOCAL_RANK are the only environment variables nsa-flex reads.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from nsa_flex.training.config import ConfigError


@dataclass(frozen=True)
class World:
    """This process's place among the ranks of a torchrun job (0 of 1 without torchrun)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def torchrun_world() -> World:
    """Read torchrun's variables (the only environment reads of nsa-flex)."""
    return World(int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)),
                 int(os.environ.get("WORLD_SIZE", 1)))


def init_process_group(world: World, device: torch.device) -> bool:
    """Start the process group (NCCL on CUDA, gloo on CPU); True if this call started it."""
    if not world.distributed or dist.is_initialized():
        return False
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                            device_id=device if device.type == "cuda" else None)
    return True


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def all_reduce_sum(t: torch.Tensor, world: World) -> torch.Tensor:
    if world.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def apply_float8(model: nn.Module) -> None:
    """torchao float8 training for every Linear whose dims are multiples of 16, except the head."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as e:
        raise ConfigError("float8 training needs torchao (pip install torchao)") from e

    def eligible(module: nn.Module, fqn: str) -> bool:
        return (isinstance(module, nn.Linear) and fqn != "head"
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    convert_to_float8_training(model, module_filter_fn=eligible)


def apply_activation_checkpointing(model: nn.Module) -> None:
    for block in model.layers:
        block.checkpoint_activations = True


def compile_blocks(model: nn.Module, cuda_graphs: bool = False) -> None:
    """Compile each block once, fullgraph, in place (parameter names are unchanged); cuda_graphs:
    mode "reduce-overhead", each block's kernels replayed as CUDA graphs."""
    if model.config.attention == "nsa" and model.config.impl == "flex":
        # The flex backward needs Inductor's tile workaround before anything compiles (see
        # nsa_flex.flex.tuning); importing nsa_flex.flex here keeps imports out of the traced code.
        import nsa_flex.flex  # noqa: F401
        from nsa_flex.flex.tuning import install_flex_tuning

        install_flex_tuning()
    mode = "reduce-overhead" if cuda_graphs else None
    for block in model.layers:
        block.compile(fullgraph=True, dynamic=False, mode=mode)


def parallelize(model: nn.Module, parallel: str, device: torch.device, world: World) -> nn.Module:
    """Wrap for data parallelism: none (as is), ddp (DistributedDataParallel), fsdp (FSDP2 per block)."""
    match parallel:
        case "none":
            return model
        case "ddp":
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        case "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.type, (world.world_size,))
            for block in model.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            return model
        case _:
            raise ConfigError(f"unknown parallel {parallel!r}; allowed: none, ddp, fsdp")


@contextlib.contextmanager
def gradient_sync(model: nn.Module, parallel: str, enabled: bool):
    """Skip the gradient all-reduce / reduce-scatter on all but the last micro-batch."""
    if enabled or parallel == "none":
        yield
    elif parallel == "ddp":
        with model.no_sync():
            yield
    else:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)


def grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip to max_norm (0: no clipping) and return the global norm as a plain tensor."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"))
    # Under FSDP2 the norm is a DTensor; its full value is the global norm.
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
