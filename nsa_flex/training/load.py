"""A trained model for inference: the newest checkpoint of a run, loaded weights-only.

Decoding takes a model; this module is where a training run's files become one, so that
nsa_flex.decoding never imports training code.
"""

from __future__ import annotations

from pathlib import Path

import torch

from nsa_flex.model import NSALM
from nsa_flex.training import checkpoint as ckpt
from nsa_flex.training.config import ConfigError, TrainConfig, build_config


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint file, or the newest checkpoint of a training run's out_dir (or its checkpoints/)."""
    path = Path(path)
    if path.is_dir():
        found = ckpt.list_checkpoints(path) or ckpt.list_checkpoints(path.parent)
        if not found:
            raise ckpt.CheckpointError(f"{path} holds no checkpoint (expected {ckpt.checkpoint_dir(path)}/step_*.pt)")
        return found[-1][1]
    if not path.is_file():
        raise ckpt.CheckpointError(f"checkpoint {path} does not exist")
    return path


def load_model(path: str | Path, *, device: torch.device | str, dtype: torch.dtype) -> tuple[NSALM, TrainConfig]:
    """The model of a training checkpoint (weights-only loading), built on `device` in `dtype`.

    The implementation is chosen for `device` ("auto"), not taken from the training run.
    Missing, corrupt, foreign or mismatched files raise CheckpointError naming the file.
    """
    path = find_checkpoint(path)
    state = ckpt.load(path)
    try:
        config = build_config(state["config"])
    except (KeyError, TypeError, ConfigError) as e:
        raise ckpt.CheckpointError(f"{path}: its training config cannot be read ({e})") from e
    model = NSALM(config.model.replace(impl="auto"), device=device)
    weights = state.get("model")
    if not isinstance(weights, dict):
        raise ckpt.CheckpointError(f"{path} holds no model weights")
    # Wrappers (torch.compile, DDP) may prefix parameter names.
    weights = {k.replace("_orig_mod.", "").removeprefix("module."): v for k, v in weights.items()}
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        raise ckpt.CheckpointError(f"{path}: the weights do not fit the model of its config ({e})") from e
    return model.to(dtype).eval(), config
