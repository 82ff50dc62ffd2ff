"""nsa-flex bench model: the CLI's flags and errors, the CPU defaults, a tiny CPU sweep end to end
(JSON, Markdown and PNG in a temporary folder) and error rows when a configuration fails."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from nsa_flex.bench import SCHEMA, run_suite
from nsa_flex.bench.model import ModelBenchConfig, model_config, train_settings
from nsa_flex.model import MODEL_PRESETS
from nsa_flex_cli.main import app

runner = CliRunner()


def _flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


@pytest.mark.parametrize("args, message", [
    pytest.param(["--attentions", "nsa,foo"], "unknown attention 'foo'; allowed: nsa, dense", id="attention"),
    pytest.param(["-T", "8x"], "expected comma-separated positive integers", id="T-syntax"),
    pytest.param(["-T", "4"], "needs at least 8 tokens", id="T-too-short"),
    pytest.param(["-T", "64,128", "--batches", "1,2,3"], "give one B per sequence length", id="batches-count"),
    pytest.param(["--batch", "0"], "expected comma-separated positive integers", id="batch-zero"),
    pytest.param(["--dtype", "fp8"], "allowed: bf16, fp16, fp32", id="dtype"),
    pytest.param(["--preset", "huge"], "allowed: seeds-125m, tiny", id="preset"),
    pytest.param(["--device", "tpu"], "allowed: cuda, cpu", id="device"),
    pytest.param(["--steps", "0"], "steps=0: must be >= 1", id="steps"),
    pytest.param(["--warmup", "0"], "warmup=0: must be >= 1", id="warmup"),
])
def test_cli_rejects_bad_flags(args, message):
    result = runner.invoke(app, ["bench", "model", "--device", "cpu", *args] if "--device" not in args
                           else ["bench", "model", *args])
    assert result.exit_code == 2, result.output
    assert message in _flat(result.output)


def test_cli_flags_reach_the_config(monkeypatch, tmp_path):
    seen = {}

    def fake_run_suite(name, cfg, progress=None):
        seen["name"], seen["cfg"] = name, cfg
        return []

    monkeypatch.setattr("nsa_flex.bench.run_suite", fake_run_suite)
    args = ["bench", "model", "--device", "cpu", "-T", "64,1k", "--batches", "3,1", "--preset", "seeds-125m",
            "--attentions", "dense", "--steps", "4", "--warmup", "2", "--dtype", "bf16", "--compile",
            "--seed", "7", "-o", str(tmp_path), "--name", "x", "--git-commit", "abc", "--no-progress"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    cfg = seen["cfg"]
    assert seen["name"] == "model"
    assert cfg.shapes == ((64, 3), (1024, 1)) and cfg.attentions == ("dense",) and cfg.preset == "seeds-125m"
    assert (cfg.steps, cfg.warmup, cfg.dtype, cfg.compile, cfg.seed) == (4, 2, "bf16", True, 7)
    # One B for all lengths.
    result = runner.invoke(app, ["bench", "model", "--device", "cpu", "-T", "64,128", "-B", "2", "-o", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert seen["cfg"].shapes == ((64, 2), (128, 2))


def test_defaults():
    cpu = model_config(device="cpu")
    assert cpu.preset == "tiny" and cpu.shapes == ((128, 8), (256, 4)) and cpu.attentions == ("nsa", "dense")
    assert (cpu.warmup, cpu.steps, cpu.dtype, cpu.compile) == (2, 3, "fp32", False)
    # A length without a default B gets max(1, tokens per step // T).
    assert model_config(device="cpu", seq_lens=(64, 4096)).shapes == ((64, 16), (4096, 1))
    if torch.cuda.is_available():
        cuda = model_config(device="cuda")
        assert cuda.preset == "seeds-125m" and cuda.shapes == ((2048, 16), (8192, 4), (32768, 1))
    else:
        with pytest.raises(ValueError, match="no CUDA device"):
            model_config(device="cuda")


def test_train_settings_raise_max_seq_len(tmp_path):
    flags = train_settings("tiny", "nsa", 1024, 2, 5, tmp_path, device="cpu")
    assert flags["model"] == {"attention": "nsa", "max_seq_len": 1024}
    assert flags["device"] == "cpu" and not flags["save_checkpoints"] and flags["resume"] == "none"
    tiny_max = MODEL_PRESETS["tiny"].max_seq_len
    assert train_settings("tiny", "dense", 64, 2, 5, tmp_path)["model"]["max_seq_len"] == tiny_max


def test_cpu_sweep_end_to_end(tmp_path):
    args = ["bench", "model", "--device", "cpu", "-T", "64", "-B", "2", "--steps", "2", "--warmup", "1",
            "-o", str(tmp_path), "--name", "cpu", "--git-commit", "abc123"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "GPU figures need CUDA" in result.output
    md = (tmp_path / "cpu.md").read_text()
    assert "| impl | mode | T | median ms |" in md and md.strip() in result.output
    assert "tok/s" in md
    report = json.loads((tmp_path / "cpu.json").read_text())
    assert report["schema"] == SCHEMA
    header = report["header"]
    assert header["suite"] == "model" and header["git_commit"] == "abc123" and header["speedup_baseline"] == "dense"
    assert header["config"]["shapes"] == [[64, 2]] and header["config"]["preset"] == "tiny"
    rows = {r["impl"]: r for r in report["rows"]}
    assert set(rows) == {"nsa", "dense"}
    for r in rows.values():
        assert r["status"] == "ok", r
        assert (r["suite"], r["mode"], r["T"], r["iters"]) == ("model", "B=2", 64, 2)
        assert r["median_ms"] > 0 and r["first_call_ms"] > 0 and r["peak_mem_mib"] is None
        assert r["extra"]["tokens_per_s"] == pytest.approx(128 / (r["median_ms"] / 1e3))
        assert r["extra"]["estimate_mib"] > 0 and r["check"].startswith("ok")
    assert rows["dense"]["speedup"] == 1.0
    assert rows["nsa"]["speedup"] == pytest.approx(rows["dense"]["median_ms"] / rows["nsa"]["median_ms"])
    assert rows["nsa"]["extra"]["nsa_impl"] == "reference"
    pytest.importorskip("matplotlib")
    assert (tmp_path / "cpu.png").stat().st_size > 1000


def test_failing_rows_are_recorded_and_the_sweep_goes_on(monkeypatch):
    import nsa_flex.bench.model as bench_model

    real_train = bench_model.train

    def train(config, **kwargs):
        if config.model.attention == "nsa" and config.T > 64:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 TiB")
        return real_train(config, **kwargs)

    monkeypatch.setattr(bench_model, "train", train)
    cfg = ModelBenchConfig(device="cpu", preset="tiny", shapes=((64, 1), (128, 1)), dtype="fp32", warmup=1,
                           steps=1, compile=False)
    seen = []
    rows = run_suite("model", cfg, progress=lambda done, total, what: seen.append((done, total, what)))
    assert seen[0] == (0, 4, "nsa T=64 B=1") and seen[-1] == (4, 4, "done")
    by = {(r.impl, r.T): r for r in rows}
    assert len(rows) == 4
    failed = by["nsa", 128]
    assert failed.status == "error" and failed.error.startswith("OutOfMemoryError: CUDA out of memory")
    assert failed.median_ms is None and failed.speedup is None and failed.extra["batch"] == 1
    for key in (("nsa", 64), ("dense", 64), ("dense", 128)):
        assert by[key].status == "ok", by[key]
    assert by["nsa", 64].speedup is not None
