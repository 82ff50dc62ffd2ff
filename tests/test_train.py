"""train(): the loss falls, resume is exact, kills resume, the watchdog fires, the NaN guard (CPU).

Everything runs the tiny preset with the reference NSA on short sequences; the runs that must
die (a SIGKILL, a stall) run in a subprocess.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import subprocess
import sys
import textwrap
import threading
import time
import zipfile

import pytest
import torch

from fused_optimizer import fused_builder
from nsa_flex.training.train import NonFiniteLossError, TrainHooks, train
from nsa_flex.training import checkpoint as ckpt
from nsa_flex.training.config import ConfigError, build_config, plan
from nsa_flex.training.metrics import LoggingCallback, read_metrics
from nsa_flex.training.watchdog import STALL_EXIT_CODE, Watchdog


def tiny(tmp_path, name="run", **settings):
    """A small, fast TrainConfig: tiny preset, T=64, B=4, in tmp_path/name."""
    base = {"steps": 4, "seq_len": 64, "batch_size": 4, "warmup_steps": 2, "out_dir": str(tmp_path / name),
            "tensorboard": False, "log_every": 1000}
    return build_config({}, {**base, **settings})


def run_script(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)


def test_loss_falls_on_synthetic_data(tmp_path):
    result = train(tiny(tmp_path, steps=25, seq_len=128, batch_size=8, lr=3e-3, warmup_steps=5))
    first, last = sum(result.losses[:3]) / 3, sum(result.losses[-3:]) / 3
    assert first > math.log(208) - 0.6, result.losses
    assert last < first - 1.0, result.losses
    assert result.nonfinite_steps == 0
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, 26))
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "memory_gib", "skipped"} <= set(rows[0])


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_resume_continues_exactly(tmp_path, attention):
    model = {"attention": attention}
    full = train(tiny(tmp_path, "full", steps=6, checkpoint_every=3, model=model))
    saved = ckpt.checkpoint_path(tmp_path / "full", 3)
    assert saved.is_file() and ckpt.checkpoint_path(tmp_path / "full", 6).is_file()
    resumed = train(tiny(tmp_path, "resumed", steps=6, resume=str(saved), model=model))
    assert resumed.start_step == 3
    # Bit-exact: same data position, optimizer moments, schedule and RNG.
    assert resumed.losses == full.losses[3:]


def test_killed_run_resumes_from_last_checkpoint(tmp_path):
    reference = train(tiny(tmp_path, "reference", steps=6))
    out = tmp_path / "killed"
    proc = run_script(f"""
        import os, signal
        from nsa_flex.training.train import TrainHooks, train
        from nsa_flex.training.config import build_config
        cfg = build_config({{}}, dict(steps=6, seq_len=64, batch_size=4, warmup_steps=2, out_dir={str(out)!r},
                                      tensorboard=False, checkpoint_every=2, keep_checkpoints=5))
        def kill(step):
            if step == 5:
                os.kill(os.getpid(), signal.SIGKILL)
        train(cfg, hooks=TrainHooks(before_step=kill))
    """)
    assert proc.returncode == -9, proc.stderr
    assert [s for s, _ in ckpt.list_checkpoints(out)] == [2, 4]
    resumed = train(tiny(tmp_path, "killed", steps=6, resume="latest"))
    assert resumed.start_step == 4
    assert resumed.losses == reference.losses[4:]
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 7))


def test_resume_auto_and_nothing_left(tmp_path):
    train(tiny(tmp_path, steps=2))
    again = train(tiny(tmp_path, steps=2))
    assert again.start_step == 2 and again.losses == []
    longer = train(tiny(tmp_path, steps=3))
    assert longer.start_step == 2 and len(longer.losses) == 1
    fresh = train(tiny(tmp_path, steps=1, resume="none"))
    assert fresh.start_step == 0


def test_watchdog_fires_on_injected_stall(tmp_path):
    # The watchdog's clock stands still until step 3 stalls: however slow a busy machine runs
    # steps 1 and 2, only the injected stall can exceed the 2 s limit.
    proc = run_script(f"""
        import time
        from nsa_flex.training.train import TrainHooks, train
        from nsa_flex.training.config import build_config
        stalled_at = []

        def before(step):
            if step == 3:
                stalled_at.append(time.monotonic())
                time.sleep(600)

        def clock():
            return time.monotonic() - stalled_at[0] if stalled_at else 0.0

        cfg = build_config({{}}, dict(steps=5, seq_len=32, batch_size=2, out_dir={str(tmp_path / 'stall')!r},
                                      tensorboard=False, stall_timeout=2.0, first_step_timeout=60.0))
        train(cfg, hooks=TrainHooks(before_step=before, clock=clock))
    """)
    assert proc.returncode == STALL_EXIT_CODE, proc.stderr
    assert "no training step finished in" in proc.stderr
    assert "last finished step: 2" in proc.stderr
    # faulthandler's dump: the main thread is caught in the injected sleep.
    assert "Current thread" in proc.stderr or "Thread 0x" in proc.stderr
    assert "in before" in proc.stderr


def test_watchdog_unit():
    # A clock the test moves: the stall happens when the test says, not when the machine is slow.
    now, stalls, fired = [0.0], [], threading.Event()

    def on_stall(message):
        stalls.append(message)
        fired.set()

    with Watchdog(0.3, rank=1, on_stall=on_stall, poll=0.01, clock=lambda: now[0]) as dog:
        for step in range(1, 4):
            now[0] += 0.25
            dog.beat(step)
        time.sleep(0.1)
        assert stalls == []
        now[0] += 0.31
        assert fired.wait(30)
    assert len(stalls) == 1 and "rank 1" in stalls[0] and "last finished step: 3" in stalls[0]
    assert "no training step finished in 0 s (limit 0.3 s" in stalls[0]
    with Watchdog(0, on_stall=stalls.append):
        pass
    assert len(stalls) == 1


def test_nonfinite_loss_skips_the_step(tmp_path):
    def poison(step, loss):
        return loss * float("nan") if step == 3 else loss

    cfg = tiny(tmp_path, steps=5)
    result = train(cfg, hooks=TrainHooks(loss_transform=poison))
    assert result.nonfinite_steps == 1
    assert math.isnan(result.losses[2]) and all(math.isfinite(x) for i, x in enumerate(result.losses) if i != 2)
    rows = read_metrics(tmp_path / "run")
    assert [r["skipped"] for r in rows] == [False, False, True, False, False]
    state = ckpt.load(ckpt.checkpoint_path(tmp_path / "run", 5))
    assert all(torch.isfinite(t).all() for t in state["model"].values())


class _NanGrad(torch.autograd.Function):
    """The loss unchanged, its gradient NaN: a finite loss with a non-finite gradient norm."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


def test_fused_optimizer_skips_on_the_device_as_on_the_host(tmp_path, monkeypatch):
    """With a fused optimizer the update is queued before the step's host sync and skipped on the
    device where the loss or the gradient norm is not finite: the same losses, skips, parameters
    and optimizer state, bit for bit, as the host deciding after the sync."""
    from nsa_flex.training import train as train_module

    def poison(step, loss):
        return _NanGrad.apply(loss) if step == 2 else loss * float("nan") if step == 4 else loss

    queued = []
    monkeypatch.setattr(train_module, "build_optimizer", fused_builder(train_module.build_optimizer))
    step_unless = train_module._step_unless
    monkeypatch.setattr(train_module, "_step_unless", lambda *a: (queued.append(1), step_unless(*a)))
    runs = {}
    for name, device_skip in (("device", True), ("host", False)):
        monkeypatch.setattr(train_module, "_fused", lambda optimizer, on=device_skip: on)
        queued.clear()
        result = train(tiny(tmp_path, name, steps=5, model={"attention": "dense"}),
                       hooks=TrainHooks(loss_transform=poison))
        runs[name] = (result, [r["skipped"] for r in read_metrics(tmp_path / name)],
                      ckpt.load(ckpt.checkpoint_path(tmp_path / name, 5)), len(queued))
    (dev, dev_skips, dev_state, dev_queued), (host, host_skips, host_state, host_queued) = runs["device"], runs["host"]
    assert dev_queued == 5 and host_queued == 0
    assert dev_skips == host_skips == [False, True, False, True, False]
    assert math.isfinite(dev.losses[1]) and math.isnan(dev.losses[3])
    assert [x for x in dev.losses if math.isfinite(x)] == [x for x in host.losses if math.isfinite(x)]
    for name, t in dev_state["model"].items():
        assert torch.equal(t, host_state["model"][name]), name
    for pid, st in dev_state["optimizer"]["state"].items():
        for key, t in st.items():
            assert torch.equal(t, host_state["optimizer"]["state"][pid][key]), (pid, key)


def _fused_optimizer(monkeypatch):
    """Every run in the test builds a fused optimizer (the update queued on the device) and takes
    it as fused on the CPU too."""
    from nsa_flex.training import train as train_module

    monkeypatch.setattr(train_module, "build_optimizer", fused_builder(train_module.build_optimizer))
    monkeypatch.setattr(train_module, "_fused", lambda optimizer: True)
    return train_module


def test_steps_read_back_after_the_next_is_queued(tmp_path, monkeypatch):
    """With the update queued on the device, a step is read back after the next one is queued,
    except the first, a step that saves a checkpoint and the last: the checkpoint holds exactly its step
    (a resume from it continues bit for bit), and every step's metrics come, in order."""
    train_module = _fused_optimizer(monkeypatch)
    order = []
    launch, finish = train_module._launch_step, train_module._finish_step
    monkeypatch.setattr(train_module, "_launch_step",
                        lambda *a: (order.append(f"L{a[-1]}"), launch(*a))[1])
    monkeypatch.setattr(train_module, "_finish_step",
                        lambda state, run, config, world, launched, last: (order.append(f"F{launched.step}"),
                                                                         finish(state, run, config, world, launched,
                                                                                last))[1])
    model = {"attention": "dense"}
    full = train(tiny(tmp_path, "full", steps=6, checkpoint_every=3, model=model))
    assert order == ["L1", "F1", "L2", "L3", "F2", "F3", "L4", "L5", "F4", "L6", "F5", "F6"]
    assert [r["step"] for r in read_metrics(tmp_path / "full")] == list(range(1, 7))
    resumed = train(tiny(tmp_path, "resumed", steps=6, resume=str(ckpt.checkpoint_path(tmp_path / "full", 3)),
                         model=model))
    assert resumed.start_step == 3 and resumed.losses == full.losses[3:]


def test_queued_nonfinite_losses_in_a_row_abort(tmp_path, monkeypatch):
    """Read back a step late, non-finite steps still abort at the step that reaches the limit."""
    _fused_optimizer(monkeypatch)

    def poison(step, loss):
        return loss * float("inf") if step >= 2 else loss

    with pytest.raises(NonFiniteLossError, match=r"3 steps in a row \(steps 2..4\); aborting at step 4"):
        train(tiny(tmp_path, steps=10, nonfinite_limit=3, model={"attention": "dense"}),
              hooks=TrainHooks(loss_transform=poison))


def test_nonfinite_losses_in_a_row_abort(tmp_path):
    def poison(step, loss):
        return loss * float("inf") if step >= 2 else loss

    with pytest.raises(NonFiniteLossError, match=r"3 steps in a row \(steps 2..4\); aborting at step 4"):
        train(tiny(tmp_path, steps=10, nonfinite_limit=3), hooks=TrainHooks(loss_transform=poison))


def test_grad_accumulation_matches_a_bigger_batch(tmp_path):
    big = train(tiny(tmp_path, "big", steps=3, batch_size=4))
    accum = train(tiny(tmp_path, "accum", steps=3, batch_size=2, grad_accum=2))
    assert accum.losses == pytest.approx(big.losses, rel=1e-5)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_on_cpu(tmp_path, precision):
    def poison(step, loss):
        return loss * float("nan") if step == 2 else loss

    result = train(tiny(tmp_path, steps=3, precision=precision, model={"attention": "dense"}),
                   hooks=TrainHooks(loss_transform=poison))
    assert result.nonfinite_steps == 1 and math.isfinite(result.losses[-1])
    scales = [r["scale"] for r in read_metrics(tmp_path / "run")]
    # fp16 runs a GradScaler, which halves its scale after the poisoned step.
    assert scales == ([None] * 3 if precision == "bf16" else [65536.0, 32768.0, 32768.0])


def test_activation_checkpointing_trains_identically(tmp_path):
    plain = train(tiny(tmp_path, "plain", steps=3))
    recomputed = train(tiny(tmp_path, "recomputed", steps=3, activation_checkpointing=True))
    assert recomputed.losses == plain.losses


def test_text_data_end_to_end(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i}: " + "abc " * 40}) + "\n" for i in range(20)))
    result = train(tiny(tmp_path, steps=2, data=str(corpus)))
    # Untrained, the loss is about ln(vocab_size=512), and finite.
    assert len(result.losses) == 2 and all(math.isfinite(x) for x in result.losses)
    assert abs(result.losses[0] - math.log(512)) < 1.0, result.losses
    (token_file,) = (tmp_path / "run" / "data").glob("tokens-*.bin")
    meta = json.loads(token_file.with_name(token_file.name + ".json").read_text())
    want = [t for i in range(20) for t in [*f"document {i}: {'abc ' * 40}".encode(), 256]]
    assert meta["n_tokens"] == len(want) and meta["n_documents"] == 20
    assert torch.frombuffer(bytearray(token_file.read_bytes()), dtype=torch.uint16).tolist() == want


@pytest.mark.parametrize("settings, match", [
    pytest.param({"preset": "huge"}, "unknown preset 'huge'", id="preset"),
    pytest.param({"stepz": 3}, "unknown setting 'stepz'; allowed: model, data", id="unknown-key"),
    pytest.param({"model": {"widht": 3}}, "unknown setting 'model.widht'", id="unknown-model-key"),
    pytest.param({"model": {"nsa": {"window": 0}}}, "window=0", id="nsa-window"),
    pytest.param({"seq_len": 512}, r"seq_len=512: must lie in \[1, model.max_seq_len=256\]", id="seq-len"),
    pytest.param({"precision": "fp8"}, "precision='fp8'", id="precision"),
    pytest.param({"steps": "10"}, "steps='10': must be of type int", id="steps-type"),
    pytest.param({"lr": -1.0}, "lr=-1.0", id="lr"),
    pytest.param({"cuda_graphs": "always"}, r"cuda_graphs='always'.*allowed: auto, on, off", id="cuda-graphs"),
])
def test_bad_settings(settings, match):
    with pytest.raises(ConfigError, match=match):
        build_config({}, settings)


@pytest.mark.parametrize("settings, match", [
    pytest.param({"model": {"vocab_size": 64}}, "needs 208 token ids .* vocab_size=64", id="vocab"),
    pytest.param({"float8": True}, "float8 training needs a CUDA device", id="float8-cpu"),
    pytest.param({"parallel": "ddp"}, "parallel=ddp needs torchrun", id="ddp-without-torchrun"),
    pytest.param({"cuda_graphs": "on"}, r"cuda_graphs=on needs a CUDA device, compiled blocks \(compile on or "
                 r"auto\); use cuda_graphs auto or off", id="cuda-graphs-cpu"),
    pytest.param({"resume": "latest"}, "--resume latest: no checkpoint", id="resume-latest"),
    pytest.param({"resume": "nowhere.pt"}, "--resume nowhere.pt: no such checkpoint file", id="resume-path"),
])
def test_bad_runs_fail_clearly(tmp_path, settings, match):
    with pytest.raises((ConfigError, ckpt.CheckpointError), match=match):
        train(tiny(tmp_path, **settings))


@pytest.mark.parametrize("settings, want", [
    ({}, True), ({"cuda_graphs": "off"}, False), ({"cuda_graphs": "on"}, True), ({"compile": "off"}, False),
    ({"grad_accum": 2}, False), ({"activation_checkpointing": True}, False), ({"float8": True}, False),
    ({"parallel": "ddp"}, False),
])
def test_cuda_graphs_only_where_checked(monkeypatch, settings, want):
    """auto turns CUDA graphs on for compiled blocks on CUDA in one process with one micro-batch,
    no activation checkpointing and no float8, and off elsewhere; on outside them is refused."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    world = 2 if settings.get("parallel") == "ddp" else 1
    cfg = build_config({}, {"preset": "tiny", **settings})
    assert plan(cfg, world).cuda_graphs is want
    if not want and "cuda_graphs" not in settings:
        with pytest.raises(ConfigError, match=r"cuda_graphs=on needs .*; use cuda_graphs auto or off"):
            plan(cfg.replace(cuda_graphs="on"), world)


def test_corrupt_and_incompatible_checkpoints(tmp_path):
    train(tiny(tmp_path, steps=2, checkpoint_every=1))
    newest = ckpt.checkpoint_path(tmp_path / "run", 2)
    newest.write_bytes(newest.read_bytes()[:1000])
    with pytest.raises(ckpt.CheckpointError, match=r"step_00000002.pt is corrupt: its SHA-256 is .* the newest "
                                                   r"checkpoint that verifies is .*step_00000001.pt"):
        train(tiny(tmp_path, steps=3))
    newest.unlink()
    with pytest.raises(ckpt.CheckpointError, match="another model config .*attention: checkpoint 'nsa', now 'dense'"):
        train(tiny(tmp_path, steps=3, model={"attention": "dense"}))
    # How the model runs may change: a runtime field differs and the run resumes.
    other_budget = tiny(tmp_path, model={"sel_partial_bytes": 1 << 20}).to_dict()["model"]
    ckpt.check_compatible(ckpt.load(ckpt.checkpoint_path(tmp_path / "run", 1)), other_budget, newest)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ckpt.CheckpointError, match="junk.pt is corrupt") as err:
        train(tiny(tmp_path, steps=3, resume=str(tmp_path / "junk.pt")))
    # torch's advice to load with weights_only=False is never passed on.
    assert "weights_only=False" not in str(err.value) and "weights_only` set to `False" not in str(err.value)
    # A half-written temporary file from a killed save is never taken for a checkpoint.
    shutil.copy(ckpt.checkpoint_path(tmp_path / "run", 1), newest.with_name("step_00000009.pt.tmp-123"))
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "run")] == [1]


def _flip_tensor_bytes(path, count: int = 16) -> None:
    """Flip `count` bytes in the middle of the largest tensor record of a torch.save zip file."""
    with zipfile.ZipFile(path) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
    data[start:start + count] = bytes(b ^ 0xFF for b in data[start:start + count])
    path.write_bytes(bytes(data))


def test_flipped_tensor_bytes_are_caught(tmp_path):
    train(tiny(tmp_path, steps=2, checkpoint_every=1))
    newest = ckpt.checkpoint_path(tmp_path / "run", 2)
    assert ckpt.checksum_path(newest).read_text().split() == [ckpt.sha256_of(newest), newest.name]
    _flip_tensor_bytes(newest)
    # torch itself reads the damaged file without complaint: only the checksum sees it.
    assert torch.load(newest, weights_only=True)["step"] == 2
    with pytest.raises(ckpt.CheckpointError, match=r"step_00000002.pt is corrupt: its SHA-256 is [0-9a-f]{16}\.\.\., "
                                                   r"but step_00000002.pt.sha256 says .*the newest checkpoint that "
                                                   r"verifies is .*step_00000001.pt \(resume from it with --resume"):
        train(tiny(tmp_path, steps=3))
    resumed = train(tiny(tmp_path, steps=3, resume=str(ckpt.checkpoint_path(tmp_path / "run", 1))))
    assert resumed.start_step == 1


def test_pruned_checkpoints_take_their_checksums(tmp_path):
    train(tiny(tmp_path, steps=3, checkpoint_every=1, keep_checkpoints=1))
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == ["step_00000003.pt", "step_00000003.pt.sha256"]


@pytest.mark.parametrize("change, shown", [
    pytest.param({"data": "copy"}, "data: checkpoint 'kv', now 'copy'", id="data"),
    pytest.param({"seed": 7}, "seed: checkpoint 0, now 7", id="seed"),
    pytest.param({"seq_len": 32}, "seq_len: checkpoint 64, now 32", id="seq-len"),
])
def test_resume_refuses_changed_data(tmp_path, change, shown):
    train(tiny(tmp_path, steps=2))
    with pytest.raises(ckpt.CheckpointError, match=rf"was trained on other data settings \({shown}\): resuming "
                                                   r"would continue on another data stream.*--allow-data-change"):
        train(tiny(tmp_path, steps=3, **change))
    messages = []

    class Notes(LoggingCallback):
        def on_message(self, text):
            messages.append(text)

    resumed = train(tiny(tmp_path, steps=3, allow_data_change=True, **change), callback=Notes())
    assert resumed.start_step == 2 and len(resumed.losses) == 1
    assert any(f"data settings changed on purpose (--allow-data-change): {shown}" in m for m in messages)


def test_run_folder_holds_config_and_log(tmp_path):
    train(tiny(tmp_path, steps=3, log_every=2))
    run = tmp_path / "run"
    saved = json.loads((run / "config.json").read_text())
    assert saved["config"]["steps"] == 3 and saved["config"]["seq_len"] == 64 and "torch" in saved["versions"]
    log = (run / "train.log").read_text().splitlines()
    assert log[0].split(" ", 2)[2].startswith("start: {") and any("step      2/3  loss" in line for line in log)
    assert any("step      3/3" in line for line in log) and log[-1].split(" ", 2)[2].startswith("done: {")


def test_out_dir_under_a_file(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"out_dir=.*file/run'?: .*file is a file, not a folder; choose another "
                                          r"--out-dir"):
        train(tiny(tmp_path, name="file/run", steps=1))
