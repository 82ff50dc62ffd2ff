"""nsa-flex bench: FLOP formulas against hand counts, the CLI's flags and errors, the JSON
schema, and a tiny CPU sweep end to end (JSON, Markdown and PNG in a temporary folder)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

from nsa_flex.bench import IMPLS, SCHEMA, Row, attention_config, run_suite
from nsa_flex.bench.core import add_speedups
from nsa_flex.bench.flops import dense_causal_flops, mode_flops, nsa_flops, nsa_keys
from nsa_flex.bench.impls import Built, Impl, dense_fwd_flops
from nsa_flex.blocks import cmp_block_last_token, num_cmp_blocks
from nsa_flex.config import NSAConfig
from nsa_flex.reference import _selection_mask, select_blocks
from nsa_flex_cli.bench import app, parse_ints

# l=4, d=2, l'=4, n=2, one initial and one local block, w=3: small enough to count by hand.
HAND = NSAConfig(n_heads=2, n_kv_heads=1, head_dim=4, head_dim_v=4, cmp_block=4, cmp_stride=2, sel_block=4,
                 n_selected=2, n_initial=1, n_local=1, window=3)


def test_nsa_keys_by_hand():
    # T=10, per query t = 0..9:
    # cmp: blocks with i*2 + 3 <= t: 0 0 0 1 1 2 2 3 3 4 -> 16
    # sel: t+1 while t//4 + 1 <= 2 (1..8 -> 36), then 4 + t%4 + 1 for t=8, 9 (5, 6) -> 47
    # win: min(3, t+1): 1 2 3 3 3 3 3 3 3 3 -> 27
    assert nsa_keys(10, HAND) == {"cmp": 16, "sel": 47, "win": 27}
    # 2 flops per MAC, (Dk + Dv) = 8 MACs per key, Hq = 2 heads, B = 3.
    assert nsa_flops(3, 10, HAND) == 2 * 8 * 2 * 3 * (16 + 47 + 27)
    assert nsa_flops(1, 10, HAND, branches=("cmp", "sel")) == 2 * 8 * 2 * (16 + 47)


def test_dense_and_mode_flops_by_hand():
    # 2 flops/MAC * B=2 * Hq=3 * T^2/2 = 50 query-key pairs * (Dk + Dv) = 12.
    assert dense_causal_flops(2, 3, 10, 8, 4) == 2 * 2 * 3 * 50 * 12
    assert mode_flops(100.0, "fwd") == 100.0
    assert mode_flops(100.0, "fwd+bwd") == 350.0
    with pytest.raises(ValueError, match="allowed: fwd, fwd\\+bwd"):
        mode_flops(1.0, "bwd")
    with pytest.raises(ValueError, match="allowed: cmp, sel, win"):
        nsa_flops(1, 10, HAND, branches=("dense",))


@pytest.mark.parametrize("config", [
    pytest.param(HAND, id="hand"),
    pytest.param(NSAConfig(n_heads=4, n_kv_heads=2, head_dim=8, cmp_block=32, cmp_stride=16, sel_block=64,
                           n_selected=3, n_local=2, window=100), id="paper-geometry-n3"),
    pytest.param(NSAConfig(n_heads=2, n_kv_heads=2, head_dim=8, cmp_block=8, cmp_stride=8, sel_block=16,
                           n_selected=5, n_initial=0, n_local=1, window=7), id="no-overlap-no-initial"),
])
@pytest.mark.parametrize("T", [1, 37, 300])
def test_nsa_keys_match_reference_masks(config, T):
    """The formula counts the same keys as the reference's masks, whatever the selection."""
    Tc = num_cmp_blocks(T, config)
    t = torch.arange(T)
    cmp = int((cmp_block_last_token(Tc, config)[None, :] <= t[:, None]).sum())
    p_cmp = torch.rand(1, config.n_heads, T, Tc).softmax(-1)
    sel = int(_selection_mask(select_blocks(p_cmp, T, config.group_size, config), T, config)[0, 0].sum())
    win = int(((t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - config.window)).sum())
    assert nsa_keys(T, config) == {"cmp": cmp, "sel": sel, "win": win}


def test_paper_config_keys_per_query_at_64k():
    # docs/results.md (floors): at 64k each query touches ~2048 compressed, ~1024 selected, 512 window keys.
    # Exactly: sel averages (n-1)*l' + (l'+1)/2 = 992.5 past the first n*l' tokens (own block partial).
    keys = nsa_keys(65536, NSAConfig())
    assert keys["cmp"] / 65536 == pytest.approx(2048, rel=0.01)
    assert keys["sel"] / 65536 == pytest.approx(992.5, rel=0.01)
    assert keys["win"] / 65536 == pytest.approx(512, rel=0.01)


def test_parse_ints():
    assert parse_ints("8k,16384, 1k", "-T") == (8192, 16384, 1024)


runner = CliRunner()


@pytest.mark.parametrize("args, message", [
    pytest.param(["--impls", "nsa-flex,foo"], "allowed: nsa-flex, nsa-flex-eager, nsa-flex-module, reference", id="impl"),
    pytest.param(["-T", "8x"], "expected comma-separated positive integers", id="T-syntax"),
    pytest.param(["-T", "0"], "expected comma-separated positive integers", id="T-zero"),
    pytest.param(["--device", "cpu", "-T", "100000"], "allowed: 1 <= T <= 16384", id="T-too-long-on-cpu"),
    pytest.param(["--modes", "bwd"], "allowed: fwd, fwd+bwd", id="mode"),
    pytest.param(["--dtype", "fp8"], "allowed: bf16, fp16, fp32", id="dtype"),
    pytest.param(["--heads", "5", "--kv-heads", "2"], "must be divisible by n_kv_heads=2", id="heads"),
    pytest.param(["--preset", "huge"], "allowed: paper, bench, g4, tiny", id="preset"),
    pytest.param(["--device", "tpu"], "allowed: cuda, cpu", id="device"),
    pytest.param(["--iters", "0"], "iters=0: must be >= 1", id="iters"),
    pytest.param(["--batch", "0"], "batch=0: must be >= 1", id="batch"),
])
def test_cli_rejects_bad_flags(args, message):
    result = runner.invoke(app, ["attention", *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.replace("│", " ").split())


def test_cli_flags_reach_the_config(monkeypatch, tmp_path):
    seen = {}

    def fake_run_suite(name, cfg, progress=None, on_rows=None):
        seen["cfg"] = cfg
        return []

    monkeypatch.setattr("nsa_flex.bench.run_suite", fake_run_suite)
    args = ["attention", "--device", "cpu", "-T", "64,1k", "--impls", "reference,dense", "--modes", "fwd",
            "--heads", "8", "--kv-heads", "2", "--head-dim", "16", "--head-dim-v", "8", "--window", "32",
            "--n-selected", "3", "--dtype", "bf16", "--iters", "2", "--warmup", "0", "--check-seq-len", "0",
            "--batch", "2", "-o", str(tmp_path), "--name", "x", "--no-progress"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    cfg = seen["cfg"]
    assert cfg.seq_lens == (64, 1024) and cfg.impls == ("reference", "dense") and cfg.modes == ("fwd",)
    assert (cfg.nsa.n_heads, cfg.nsa.n_kv_heads, cfg.nsa.head_dim, cfg.nsa.dv) == (8, 2, 16, 8)
    assert (cfg.nsa.window, cfg.nsa.n_selected, cfg.nsa.cmp_block) == (32, 3, 32)
    assert (cfg.dtype, cfg.iters, cfg.warmup, cfg.check_seq_len, cfg.batch) == ("bf16", 2, 0, 0, 2)


def test_bench_is_registered_in_the_main_cli():
    from nsa_flex_cli.main import app as main_app

    result = runner.invoke(main_app, ["bench", "attention", "--list-impls"])
    assert result.exit_code == 0, result.output


def test_cli_list_impls():
    result = runner.invoke(app, ["attention", "--list-impls"])
    assert result.exit_code == 0
    for name in IMPLS:
        assert name in result.output


def test_cpu_defaults_are_tiny_and_leave_out_missing_peers():
    cfg = attention_config(device="cpu")
    assert cfg.seq_lens == (256, 512) and cfg.impls == ("reference", "nsa-flex", "dense")
    assert cfg.preset == "tiny" and cfg.dtype == "fp32"


def test_cpu_sweep_end_to_end(tmp_path):
    """The README's main-job command, shrunk: every file written, the table printed last."""
    args = ["attention", "--device", "cpu", "-T", "64,128", "--iters", "1", "--warmup", "0",
            "--check-seq-len", "64", "-o", str(tmp_path), "--name", "cpu", "--git-commit", "abc123"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "GPU figures need CUDA" in result.output
    assert result.output.rstrip().splitlines()[-1].startswith("- CPU run:")
    md = (tmp_path / "cpu.md").read_text()
    assert "| impl | mode | T | median ms |" in md and md.strip() in result.output
    assert "| back-to-back ms | back-to-back speedup |" in md
    if pytest.importorskip("matplotlib"):
        assert (tmp_path / "cpu.png").stat().st_size > 1000
    report = json.loads((tmp_path / "cpu.json").read_text())
    _check_schema(report)
    rows = {(r["impl"], r["mode"], r["T"]): r for r in report["rows"]}
    assert len(rows) == 3 * 2 * 2
    for T in (64, 128):
        for impl in ("reference", "dense"):
            for mode in ("fwd", "fwd+bwd"):
                assert rows[impl, mode, T]["status"] == "ok", rows[impl, mode, T]
                assert rows[impl, mode, T]["check"].startswith("ok")
        assert rows["dense", "fwd", T]["speedup"] == 1.0
        assert rows["reference", "fwd+bwd", T]["flops"] == pytest.approx(3.5 * rows["reference", "fwd", T]["flops"])
        # nsa-flex: forward on CPU (its correctness is test_flex.py's business: here it either ran or
        # its failure is a row with the error); its fwd+bwd row says why it is skipped.
        for impl in ("reference", "dense"):
            for mode in ("fwd", "fwd+bwd"):
                assert rows[impl, mode, T]["extra"]["back_to_back_ms"] > 0
        assert rows["dense", "fwd", T]["extra"]["speedup_back_to_back"] == 1.0
        b2b = {impl: rows[impl, "fwd", T]["extra"]["back_to_back_ms"] for impl in ("reference", "dense")}
        assert rows["reference", "fwd", T]["extra"]["speedup_back_to_back"] == pytest.approx(
            b2b["dense"] / b2b["reference"])
        flex = rows["nsa-flex", "fwd", T]
        assert flex["status"] == "ok" or (flex["status"] == "error" and flex["error"]), flex
        assert rows["nsa-flex", "fwd+bwd", T]["status"] == "skipped"
        assert "no backward on CPU" in rows["nsa-flex", "fwd+bwd", T]["note"]


def _check_schema(report: dict) -> None:
    assert report["schema"] == SCHEMA
    header = report["header"]
    for key in ("suite", "date", "git_commit", "command", "device", "torch", "triton", "cuda", "python",
                "config", "notes", "summary", "speedup_baseline"):
        assert key in header, key
    assert header["suite"] == "attention" and header["git_commit"] == "abc123"
    assert header["speedup_baseline"] == "dense"
    config = header["config"]
    assert set(config["nsa"]) == {f.name for f in dataclasses.fields(NSAConfig)}
    assert "attention given compressed tokens" in config["inputs"]
    fields = {f.name for f in dataclasses.fields(Row)}
    for row in report["rows"]:
        assert set(row) == fields
        assert row["status"] in ("ok", "error", "skipped")
        if row["status"] == "ok":
            assert row["median_ms"] > 0 and row["tflops"] > 0 and row["first_call_ms"] > 0
        else:
            assert row["median_ms"] is None


def test_failing_rows_are_recorded_and_the_sweep_goes_on(monkeypatch):
    def build(problem):
        if problem.T > 64:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 TiB")
        return Built(lambda: torch.ones(1), [])

    def check(problem):
        raise RuntimeError("unsupported shape")

    monkeypatch.setitem(IMPLS, "boom", Impl("boom", "fails", build, check, dense_fwd_flops, "dense causal"))
    cfg = attention_config(device="cpu", seq_lens=(64, 128), impls=("boom", "dense", "fla"), modes=("fwd",),
                           iters=1, warmup=0, check_seq_len=64)
    rows = {(r.impl, r.T): r for r in run_suite("attention", cfg)}
    assert rows["boom", 64].status == "ok" and rows["boom", 64].check.startswith("check failed")
    assert rows["boom", 128].status == "error"
    assert rows["boom", 128].error.startswith("OutOfMemoryError: CUDA out of memory")
    assert rows["dense", 128].status == "ok"
    assert rows["fla", 64].status == "skipped" and "needs CUDA" in rows["fla", 64].note


def test_speedups_use_the_first_measured_baseline():
    rows = [Row(suite="s", impl="dense-cudnn", mode="fwd", T=8, status="error"),
            Row(suite="s", impl="dense-flash", mode="fwd", T=8, median_ms=4.0),
            Row(suite="s", impl="nsa-flex", mode="fwd", T=8, median_ms=1.0),
            Row(suite="s", impl="nsa-flex", mode="fwd", T=16, median_ms=1.0)]
    assert add_speedups(rows, ("dense-cudnn", "dense-flash")) == "dense-flash"
    assert [r.speedup for r in rows] == [None, 1.0, 4.0, None]


def test_back_to_back_speedups_need_both_rows_timed_so():
    """extra["speedup_back_to_back"] only where the row and its baseline were both timed back to back."""
    rows = [Row(suite="s", impl="dense", mode="fwd", T=8, median_ms=4.0, extra={"back_to_back_ms": 3.0}),
            Row(suite="s", impl="nsa-flex", mode="fwd", T=8, median_ms=2.0, extra={"back_to_back_ms": 1.5}),
            Row(suite="s", impl="peer", mode="fwd", T=8, median_ms=8.0)]
    add_speedups(rows, ("dense",))
    assert [r.speedup for r in rows] == [1.0, 2.0, 0.5]
    assert [r.extra.get("speedup_back_to_back") for r in rows] == [1.0, 2.0, None]


def test_time_back_to_back_is_the_mean_of_the_calls(monkeypatch):
    """CPU: the host clock around `iters` calls, divided by iters."""
    from nsa_flex.bench import core

    calls = []
    clock = iter([10.0, 10.6])
    monkeypatch.setattr(core.time, "perf_counter", lambda: next(clock))
    assert core.time_back_to_back(lambda: calls.append(1), device="cpu", iters=3) == pytest.approx(200.0)
    assert len(calls) == 3


def test_attention_sweep_reports_rows_as_it_goes(tmp_path):
    """on_rows sees the rows after every (impl, T), growing, so a cut-off run keeps a partial report."""
    from nsa_flex.bench import run_suite
    from nsa_flex.bench.attention import attention_config

    cfg = attention_config(device="cpu", seq_lens=(64, 128), impls=("reference", "dense"), modes=("fwd",),
                           warmup=0, iters=1, check_seq_len=64)
    seen = []
    rows = run_suite("attention", cfg, on_rows=lambda rows: seen.append([(r.impl, r.T) for r in rows]))
    assert [len(s) for s in seen] == [1, 2, 3, 4]
    assert seen[-1] == [(r.impl, r.T) for r in rows]


def test_merge_reports_recomputes_speedups_against_one_baseline(tmp_path):
    """Two parts of one sweep with different baselines: merged, every speedup is against dense-cudnn."""
    import json

    from nsa_flex.bench.attention import BASELINE_ORDER
    from nsa_flex.bench.core import SCHEMA, Row
    from nsa_flex.bench.report import merge_reports

    def part(name, rows):
        header = {"suite": "attention", "device": "test", "summary": "s", "torch": "t", "triton": None, "cuda": None,
                  "git_commit": "abc", "date": "d", "notes": [], "speedup_baseline": rows[0].impl}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"schema": SCHEMA, "header": header,
                                    "rows": [dataclasses.asdict(r) for r in rows]}))
        return path

    def row(impl, ms, speedup):
        return Row(suite="attention", impl=impl, mode="fwd", T=8192, median_ms=ms, speedup=speedup)

    a = part("a", [row("dense-cudnn", 2.0, 1.0), row("nsa-flex", 4.0, 0.5)])
    b = part("b", [row("dense-flash", 3.0, 1.0), row("flex-dense", 6.0, 0.5)])
    merge_reports([a, b], tmp_path / "out", "m", baseline_order=BASELINE_ORDER)
    merged = json.loads((tmp_path / "out" / "m.json").read_text())
    got = {r["impl"]: r["speedup"] for r in merged["rows"]}
    assert got == {"dense-cudnn": 1.0, "nsa-flex": 0.5, "dense-flash": 2.0 / 3.0, "flex-dense": 2.0 / 6.0}
    assert merged["header"]["speedup_baseline"] == "dense-cudnn"

    # A later run with its own baseline beside a peer: the baseline shows once (the first
    # run's), the peer keeps its speedup against the baseline of its own run.
    c = part("c", [row("dense-cudnn", 2.2, 1.0), Row(suite="attention", impl="fla", mode="fwd", T=8192,
                                                     median_ms=1.1, speedup=2.0)])
    merge_reports([a, c], tmp_path / "out", "m2", first_only=True)
    merged = json.loads((tmp_path / "out" / "m2.json").read_text())
    got = [(r["impl"], r["median_ms"], r["speedup"]) for r in merged["rows"]]
    assert got == [("dense-cudnn", 2.0, 1.0), ("nsa-flex", 4.0, 0.5), ("fla", 1.1, 2.0)]


def test_flex_check_covers_the_long_sequence_tiles(monkeypatch):
    """The check length takes the short-T tiles; a fault only in the long-T ones must still fail the check."""
    from nsa_flex import flex
    from nsa_flex.bench.impls import Problem, _nsa_op_check

    real = flex.nsa_flex

    def broken_long_tiles(*args, tiles=flex.FlexTiles(), **kwargs):
        o, sel = real(*args, tiles=tiles, **kwargs)
        return (o + 1 if tiles.sel_q_block == 16 else o), sel

    cfg = attention_config(device="cpu", seq_lens=(64,), check_seq_len=64)
    check = _nsa_op_check("flex")
    assert check(Problem(cfg, 64)).err < 1e-5
    monkeypatch.setattr(flex, "nsa_flex", broken_long_tiles)
    assert check(Problem(cfg, 64)).err > 1e-2


def test_cli_never_overwrites_an_earlier_result_silently(monkeypatch, tmp_path):
    from nsa_flex.bench import default_stem

    monkeypatch.setattr("nsa_flex.bench.run_suite", lambda name, cfg, progress=None, on_rows=None: [])
    args = ["attention", "--device", "cpu", "-T", "64", "--impls", "dense", "--no-progress", "-o", str(tmp_path)]
    (tmp_path / "x.json").write_text("{}")
    refused = runner.invoke(app, [*args, "--name", "x"])
    assert refused.exit_code == 2
    assert "holds an earlier result named 'x'; pass --overwrite" in " ".join(refused.output.replace("│", " ").split())
    assert (tmp_path / "x.json").read_text() == "{}"
    replaced = runner.invoke(app, [*args, "--name", "x", "--overwrite"])
    assert replaced.exit_code == 0, replaced.output
    assert json.loads((tmp_path / "x.json").read_text())["schema"]
    stem = default_stem("attention", "cpu")
    (tmp_path / f"{stem}.md").write_text("earlier")
    renamed = runner.invoke(app, args)
    assert renamed.exit_code == 0, renamed.output
    assert f"this run writes {stem}_2.*" in renamed.output
    assert (tmp_path / f"{stem}.md").read_text() == "earlier" and (tmp_path / f"{stem}_2.json").is_file()


def test_op_ab_variants_parse_and_refuse_unknown_keys():
    """bench.op_ab_gpu's variants: MODULE.KEY:INT items over each module's launch_config keys, and
    tiles.FIELD:VALUE over FlexTiles' fields."""
    from bench.op_ab_gpu import parse_variant

    assert parse_variant("code=-") == ("code", {"selected": {}, "select": {}, "window": {}, "tiles": {}})
    assert parse_variant("x=selected.fwd_maxnreg:0,select.maxnreg:0,selected.bwd_chunks:32") == (
        "x", {"selected": {"fwd_maxnreg": 0, "bwd_chunks": 32}, "select": {"maxnreg": 0}, "window": {}, "tiles": {}})
    assert parse_variant("w=tiles.win_impl:flex,tiles.local_partial:0") == (
        "w", {"selected": {}, "select": {}, "window": {}, "tiles": {"win_impl": "flex", "local_partial": 0}})
    assert parse_variant("d=window.fwd_BN:64,window.kv_stages:2") == (
        "d", {"selected": {}, "select": {}, "window": {"fwd_BN": 64, "kv_stages": 2}, "tiles": {}})
    with pytest.raises(ValueError, match=r"or tiles.FIELD:VALUE with a FlexTiles field"):
        parse_variant("x=tiles.no_such_field:1")
    with pytest.raises(ValueError, match=r"selected has no key 'fwd_maxreg'; allowed: fwd_BT, bwd_BT"):
        parse_variant("x=selected.fwd_maxreg:1")
    with pytest.raises(ValueError, match=r"window has no key 'BLOCK'; allowed: fwd_BM, fwd_BN"):
        parse_variant("x=window.BLOCK:64")
    with pytest.raises(ValueError, match=r"expected MODULE.KEY:INT with MODULE one of selected, select, window"):
        parse_variant("x=flex.BLOCK:64")


def test_step_gaps_kernel_sources(tmp_path):
    """bench.train_step_gaps_gpu.kernel_sources: an Inductor kernel's decorator and body from the
    cache's files, found by a name the profiler cut short, with the source-node comment of each
    launch; names of other kernels and names not found left out."""
    from bench.train_step_gaps_gpu import kernel_sources

    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "graph.py").write_text(
        "x = 1\n\n\n@triton_heuristics.pointwise(size_hints={'x': 8})\n@triton.jit\n"
        "def triton_poi_fused_add_cat_7(in_ptr0, out_ptr0):\n    tmp0 = tl.load(in_ptr0)\n\n\n"
        "def call(args):\n        # Topologically Sorted Source Nodes: [cat_3], Original ATen: [aten.cat]\n"
        "        triton_poi_fused_add_cat_7.run(buf1, buf2, 8, stream=stream0)\n"
        "        # Topologically Sorted Source Nodes: [add_9], Original ATen: [aten.add]\n"
        "        triton_poi_fused_add_cat_7.run(buf3, buf4, 8, stream=stream0)\n")
    got = kernel_sources(["triton_poi_fused_add_cat_", "_fwd_kernel", "triton_poi_missing_1"], tmp_path)
    assert list(got) == ["triton_poi_fused_add_cat_"]
    text = got["triton_poi_fused_add_cat_"]
    assert text.startswith("@triton_heuristics.pointwise") and "tmp0 = tl.load(in_ptr0)" in text
    assert "def call" not in text and "x = 1" not in text
    assert text.splitlines()[-2:] == ["# Topologically Sorted Source Nodes: [cat_3], Original ATen: [aten.cat]",
                                      "# Topologically Sorted Source Nodes: [add_9], Original ATen: [aten.add]"]


def test_step_gaps_merge_kernel_intervals():
    """bench.train_step_gaps_gpu.gaps_of: overlapping kernels count once as busy, the idle gaps lie
    between the merged intervals, and a gap lists the host ops that ran in it; the kernel names
    kept by time, and the events in order (kernel_sequence)."""
    from bench.train_step_gaps_gpu import gaps_of, kernel_sequence

    def kernel(name, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    events = [kernel("a", 0, 10), kernel("b", 5, 10), kernel("c", 18, 2, "gpu_memcpy"), kernel("d", 1019, 30),
              kernel("a", 1050, 40),
              {"ph": "X", "cat": "cpu_op", "name": "aten::randperm", "ts": 100, "dur": 400},
              {"ph": "X", "cat": "cpu_op", "name": "aten::tiny", "ts": 200, "dur": 10}]
    row = gaps_of(events)
    assert row["kernels"] == 5 and row["busy_ms"] * 1e3 == pytest.approx(15 + 2 + 30 + 40)
    assert row["span_ms"] * 1e3 == pytest.approx(1090) and row["idle_ms"] * 1e3 == pytest.approx(1090 - 87)
    assert row["gaps"]["0-5us"]["count"] == 2 and row["gaps"]["1000-infus"]["count"] == 0
    assert row["gaps"]["100-1000us"] == {"count": 1, "ms": pytest.approx(0.999)}
    assert row["largest"][0] == {"gap_us": 999, "before": "c", "after": "d", "host_ops": ["aten::randperm"]}
    # Kernel time by name: both launches of "a" summed, the largest first.
    assert row["by_kernel"][0] == {"name": "a", "ms": pytest.approx(0.05), "launches": 2}
    assert [k["name"] for k in row["by_kernel"]] == ["a", "d", "b", "c"]
    assert [k["name"] for k in gaps_of(events, top=2)["by_kernel"]] == ["a", "d"]
    # Every device event in start order, times from the first; host ops left out.
    assert kernel_sequence(events) == [["a", 0, 10], ["b", 5, 10], ["c", 18, 2], ["d", 1019, 30], ["a", 1050, 40]]
