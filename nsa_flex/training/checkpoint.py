"""Checkpoints: atomic files with everything a run needs to continue exactly.

A checkpoint is one file `out_dir/checkpoints/step_<8-digit step>.pt` holding the model, the
optimizer, the LR scheduler, the GradScaler (fp16), the data position, the RNG states, the
non-finite counters and the config. It is written to a temporary file in the same folder,
fsync'ed, and renamed over the final name, so a run killed at any moment leaves either the
complete new checkpoint or none (stray `.tmp-*` files are never read). Beside it,
`step_<step>.pt.sha256` holds the file's SHA-256 (in `sha256sum` format), written before the
checkpoint's rename; `load` checks it first, so flipped or missing bytes are an error that
names the newest checkpoint that still verifies. A file without that sidecar (copied by
hand, or written by an older version) loads unverified. Loading uses
`torch.load(weights_only=True)`: no pickled code runs.

Model and optimizer states are full (unsharded) state dicts keyed by parameter name, gathered
with torch.distributed.checkpoint's helpers, so one file serves one process, DDP and FSDP2.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
from pathlib import Path

import torch

from nsa_flex.model import RUNTIME_FIELDS

FORMAT = "nsa-flex-train/1"
_NAME = re.compile(r"^step_(\d{8})\.pt$")


class CheckpointError(RuntimeError):
    """A missing, corrupt or incompatible checkpoint; the message names the file."""


def checkpoint_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def checkpoint_path(out_dir: str | Path, step: int) -> Path:
    return checkpoint_dir(out_dir) / f"step_{step:08d}.pt"


def list_checkpoints(out_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints in out_dir, oldest first."""
    folder = checkpoint_dir(out_dir)
    if not folder.is_dir():
        return []
    found = ((_NAME.match(p.name), p) for p in folder.iterdir())
    return sorted((int(m.group(1)), p) for m, p in found if m)


def find_resume(resume: str, out_dir: str | Path) -> Path | None:
    """The checkpoint to resume from: auto (latest or none), none, latest (must exist), or a path."""
    match resume:
        case "none":
            return None
        case "auto" | "latest":
            found = list_checkpoints(out_dir)
            if not found and resume == "latest":
                raise CheckpointError(f"--resume latest: no checkpoint in {checkpoint_dir(out_dir)}")
            return found[-1][1] if found else None
        case _:
            path = Path(resume)
            if not path.is_file():
                raise CheckpointError(f"--resume {resume}: no such checkpoint file")
            return path


def checksum_path(path: Path) -> Path:
    """The SHA-256 sidecar of a checkpoint file."""
    return path.with_name(f"{path.name}.sha256")


def save(path: Path, state: dict) -> None:
    """Write `state` to `path` atomically (temp file, fsync, rename), its checksum sidecar first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    _write_atomic(checksum_path(path), f"{sha256_of(tmp)}  {path.name}\n".encode())
    os.replace(tmp, path)
    # The rename itself must reach the disk before older checkpoints are pruned.
    _fsync_dir(path.parent)


def load(path: Path) -> dict:
    """Verify a checkpoint's checksum, then read it with weights_only=True; any failure is a
    CheckpointError naming the file (and the newest checkpoint beside it that verifies)."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    problem = verify(path)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} is corrupt: {problem}{_newest_good_hint(path)}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated and cannot be read "
                              f"({_load_error(e)}){_newest_good_hint(path)}") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an nsa-flex training checkpoint (expected format {FORMAT!r})")
    return state


def verify(path: Path) -> str | None:
    """None if `path` matches its checksum sidecar (or has none); else what is wrong."""
    sidecar = checksum_path(path)
    if not sidecar.is_file():
        return None
    fields = sidecar.read_text(errors="replace").split()
    if not fields or len(fields[0]) != 64:
        return f"its checksum file {sidecar.name} is unreadable"
    actual = sha256_of(path)
    if actual != fields[0].lower():
        return f"its SHA-256 is {actual[:16]}..., but {sidecar.name} says {fields[0][:16]}... (bytes changed on disk)"
    return None


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _newest_good_hint(path: Path) -> str:
    """'; the newest checkpoint that verifies is ...' among the run's other checkpoints, newest first."""
    others = [p for _, p in reversed(list_checkpoints(path.parent.parent)) if p != path]
    good = next((p for p in others if verify(p) is None), None)
    if good is not None:
        return f"; the newest checkpoint that verifies is {good} (resume from it with --resume {good})"
    return "; no other checkpoint of this run verifies" if others else ""


def _load_error(e: Exception) -> str:
    """torch.load's error, without its advice to load with weights_only=False (never safe here)."""
    first = str(e).splitlines()[0] if str(e) else ""
    if "weights_only" in first or "Weights only" in first:
        return f"{type(e).__name__}: not a file torch.load(weights_only=True) can read"
    return f"{type(e).__name__}: {first}"


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(folder: Path) -> None:
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def prune(out_dir: str | Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints (and their checksums)."""
    for _, path in list_checkpoints(out_dir)[:-keep]:
        path.unlink(missing_ok=True)
        checksum_path(path).unlink(missing_ok=True)


def model_and_optimizer_state(model, optimizer) -> tuple[dict, dict]:
    """Full state dicts on the CPU (collective under FSDP2: every rank must call it)."""
    # Imported here: torch.distributed.checkpoint takes seconds to import.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_model_and_optimizer(model, optimizer, state: dict) -> None:
    """Load full state dicts into a (possibly DDP/FSDP2-wrapped) model and its optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(full_state_dict=True))


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


DATA_SETTINGS = ("data", "seed", "seq_len", "tokenizer", "text_key")
"""The TrainConfig fields that choose the data stream a checkpoint's data position points into."""


def data_changes(state: dict, config: dict) -> list[str]:
    """'name: checkpoint X, now Y' for each data setting that differs (seq_len resolved to T)."""
    saved = state["config"]

    def value(cfg: dict, name: str):
        if name == "seq_len" and cfg.get("seq_len") is None:
            return cfg.get("model", {}).get("max_seq_len")
        return cfg.get(name)

    return [f"{k}: checkpoint {value(saved, k)!r}, now {value(config, k)!r}"
            for k in DATA_SETTINGS if value(saved, k) != value(config, k)]


def check_same_data(state: dict, config: dict, path: Path, allow: bool) -> list[str]:
    """The data changes against a checkpoint; an error unless `allow` (then they are returned)."""
    changes = data_changes(state, config)
    if changes and not allow:
        raise CheckpointError(
            f"{path} was trained on other data settings ({'; '.join(changes)}): resuming would continue on "
            "another data stream. Use the checkpoint's settings, another --out-dir (or --resume none), or "
            "--allow-data-change to continue on the new data on purpose")
    return changes


def check_compatible(state: dict, model_config: dict, path: Path) -> None:
    """The checkpoint's model must be the configured one (RUNTIME_FIELDS aside: they choose how it
    runs, not what it computes)."""
    saved = dict(state["config"]["model"])
    now = dict(model_config)
    for name in RUNTIME_FIELDS:
        saved.pop(name, None), now.pop(name, None)
    diff = [f"{k}: checkpoint {saved.get(k)!r}, now {now.get(k)!r}" for k in sorted(now) if saved.get(k) != now.get(k)]
    if diff:
        raise CheckpointError(f"{path} was trained with another model config ({'; '.join(diff)}); "
                              "use the same model settings or another --out-dir")
