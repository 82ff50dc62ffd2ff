"""`nsa-flex train`: config and versions first, config files, flag precedence, clear errors (CPU)."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

from nsa_flex.training.config import ConfigError, build_config, load_config_file
from nsa_flex_cli.main import app

FAST = ["--preset", "tiny", "-T", "64", "-B", "2", "--no-tensorboard"]


def test_train_command_prints_config_versions_then_progress(tmp_path):
    result = CliRunner().invoke(app, ["train", *FAST, "--steps", "3", "--log-every", "1", "-o", str(tmp_path)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("nsa_flex=") and "torch=" in lines[0]
    # On the CPU the blocks stay eager, and so no CUDA graphs.
    assert "compile=False cuda_graphs=False" in lines[1]
    assert lines[2].startswith("config: {") and '"seq_len": 64' in lines[2]
    assert "step      3/3  loss" in result.output and "tok/s" in result.output
    assert "done: step 3" in result.output


def test_config_file_and_flag_precedence(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('preset = "tiny"\nsteps = 7\nlr = 1\ncompile = false\n[model]\nattention = "dense"\n'
                    '[model.nsa]\nwindow = 64\n')
    cfg = build_config(load_config_file(toml), {"steps": 2})
    assert (cfg.steps, cfg.lr, cfg.compile, cfg.model.attention, cfg.model.nsa.window) == (2, 1.0, "off", "dense", 64)
    assert cfg.seq_len == 128  # the tiny preset's training default
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("steps: 5\nmodel:\n  attention: nsa\n")
    pytest.importorskip("yaml")
    assert build_config(load_config_file(yaml_file)).steps == 5


def test_config_file_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="config file .*missing.toml does not exist"):
        load_config_file(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = = 3")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config_file(bad)
    (tmp_path / "x.ini").write_text("")
    with pytest.raises(ConfigError, match="unknown type '.ini'"):
        load_config_file(tmp_path / "x.ini")
    (tmp_path / "a.yaml").write_text("steps: 1\n")
    monkeypatch.setitem(sys.modules, "yaml", None)
    with pytest.raises(ConfigError, match=r"reading YAML needs PyYAML \(pip install pyyaml\)"):
        load_config_file(tmp_path / "a.yaml")


@pytest.mark.parametrize("args, message", [
    pytest.param(["--preset", "huge"], "unknown preset 'huge'", id="preset"),
    pytest.param(["--data", "no/such/folder"], "no such file or folder", id="data"),
    pytest.param(["--config", "nowhere.toml"], "nowhere.toml does not exist", id="config"),
    pytest.param(["--resume", "nowhere.pt"], "no such checkpoint file", id="resume"),
    pytest.param(["--attention", "sparse"], "attention='sparse'", id="attention"),
    pytest.param(["--cuda-graphs", "always"], "cuda_graphs='always'", id="cuda-graphs-choice"),
    pytest.param(["--cuda-graphs", "on"], "cuda_graphs=on needs a CUDA device", id="cuda-graphs-on-cpu"),
])
def test_train_command_errors(tmp_path, args, message):
    result = CliRunner().invoke(app, ["train", *FAST, "--steps", "1", "-o", str(tmp_path), *args])
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and message in result.output


def test_help_shows_the_defaults():
    result = CliRunner().invoke(app, ["train", "--help"], terminal_width=200)
    assert result.exit_code == 0
    text = " ".join(result.output.replace("│", " ").split())
    for flag, default in (("--steps", "Default: 50."), ("--lr", "Default: 0.003 (tiny preset), 0.0006"),
                          ("--out-dir", "Default: runs/train."), ("--seq-len", "Default: 128 (tiny preset), 2048"),
                          ("--batch-size", "Default: 8 (tiny preset), 16")):
        assert flag in text and default in text, (flag, default)


def test_rerun_of_a_finished_run_says_how_to_continue(tmp_path):
    args = ["train", *FAST, "--steps", "2", "-o", str(tmp_path)]
    assert CliRunner().invoke(app, args).exit_code == 0
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output
    assert "nothing to train: the run is already at step 2 of --steps 2. To continue it, raise --steps " \
           "(e.g. --steps 4)" in again.output
    assert "final loss None" not in again.output and "0 tok/s" not in again.output
    assert {"config.json", "train.log", "metrics.jsonl"} <= {p.name for p in tmp_path.iterdir()}


def test_resume_with_other_data_is_refused(tmp_path):
    assert CliRunner().invoke(app, ["train", *FAST, "--steps", "1", "-o", str(tmp_path)]).exit_code == 0
    result = CliRunner().invoke(app, ["train", *FAST, "--steps", "2", "-o", str(tmp_path), "--data", "copy"])
    assert result.exit_code == 2, result.output
    assert "data: checkpoint 'kv', now 'copy'" in result.output and "--allow-data-change" in result.output
    allowed = CliRunner().invoke(app, ["train", *FAST, "--steps", "2", "-o", str(tmp_path), "--data", "copy",
                                       "--allow-data-change"])
    assert allowed.exit_code == 0, allowed.output
    assert "done: step 2" in allowed.output


def test_out_dir_under_a_file_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("")
    result = CliRunner().invoke(app, ["train", *FAST, "--steps", "1", "-o", str(tmp_path / "file" / "run")])
    assert result.exit_code == 2, result.output
    assert "is a file, not a folder; choose another --out-dir" in result.output
    assert "NotADirectoryError" not in result.output
