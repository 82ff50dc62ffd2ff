"""Two-process torchrun (gloo, CPU): DDP and FSDP2 train like one process with the whole batch.

Each launch trains 2 steps, checkpoints, then resumes to step 3 in the same processes (and the
same process group); rank 0 writes its losses. Deterministic sharding gives the 2 ranks exactly the samples one process
takes with twice the batch, so the losses must match a single-process run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from pathlib import Path

import pytest

from fused_optimizer import fused_builder
from nsa_flex.training.train import train
from nsa_flex.training import checkpoint as ckpt
from nsa_flex.training.config import build_config

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch.distributed as dist
    from nsa_flex.training.train import train
    from nsa_flex.training.config import build_config
    parallel, out = sys.argv[1], sys.argv[2]
    # One process group for both runs: train() uses a group it finds (re-creating one in the
    # same processes can hang in gloo's rendezvous).
    dist.init_process_group("gloo")
    # A hang ends in the watchdog's stack traces long before the test's timeout.
    base = dict(seq_len=64, batch_size=2, warmup_steps=2, out_dir=out, tensorboard=False, parallel=parallel,
                stall_timeout=60.0, first_step_timeout=120.0)
    first = train(build_config({}, dict(base, steps=2)))
    resumed = train(build_config({}, dict(base, steps=3, resume="latest")))
    if os.environ["RANK"] == "0":
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump({"losses": first.losses + resumed.losses, "start": resumed.start_step}, f)
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def single_process_losses(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    cfg = build_config({}, dict(seq_len=64, batch_size=4, warmup_steps=2, steps=3, out_dir=str(out),
                                tensorboard=False))
    return train(cfg).losses


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_process_torchrun_matches_one_process(tmp_path, parallel, single_process_losses):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script), parallel, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((out / "losses.json").read_text())
    assert record["start"] == 2
    assert record["losses"] == pytest.approx(single_process_losses, rel=1e-5)
    assert [s for s, _ in ckpt.list_checkpoints(out)] == [2, 3]


# Prepended to SCRIPT: train() with a fused optimizer, its update queued on the device and steps
# read back ahead (tests/fused_optimizer.py).
AHEAD = f"""
    import sys
    sys.path.insert(0, {str(Path(__file__).parent)!r})
    from fused_optimizer import fused_builder
    from nsa_flex.training import train as train_module
    train_module.build_optimizer = fused_builder(train_module.build_optimizer)
    train_module._fused = lambda optimizer: True
"""


def test_two_process_ddp_reads_steps_ahead(tmp_path, monkeypatch):
    """DDP with a fused optimizer: steps 2 and 3 of 4 are read back after the next one is queued
    (the update queued on each rank, the collectives in step order); the losses match one process
    with the whole batch and the same optimizer stepped by the host after each readback, and a
    resume from the last checkpoint goes on as that run does."""
    script = tmp_path / "run.py"
    code = SCRIPT.replace('parallel, out = sys.argv[1], sys.argv[2]\n',
                          'parallel, out = sys.argv[1], sys.argv[2]\n' + textwrap.dedent(AHEAD))
    # Every step inside the warmup: the learning rate does not depend on the run's length, so a
    # run of 4 steps resumed to 5 takes the steps a run of 5 takes.
    code = code.replace("dict(base, steps=2)", "dict(base, steps=4)").replace("dict(base, steps=3,",
                                                                               "dict(base, steps=5,")
    code = code.replace("warmup_steps=2", "warmup_steps=8")
    script.write_text(code)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script), "ddp", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((out / "losses.json").read_text())
    from nsa_flex.training import train as train_module

    monkeypatch.setattr(train_module, "build_optimizer", fused_builder(train_module.build_optimizer))
    monkeypatch.setattr(train_module, "_fused", lambda optimizer: False)
    single = train(build_config({}, dict(seq_len=64, batch_size=4, warmup_steps=8, steps=5,
                                         out_dir=str(tmp_path / "single"), tensorboard=False)))
    assert record["start"] == 4
    assert record["losses"] == pytest.approx(single.losses, rel=1e-5)
    assert [s for s, _ in ckpt.list_checkpoints(out)] == [4, 5]
