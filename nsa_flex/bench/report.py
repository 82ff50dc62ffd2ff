"""Writers for any suite's rows: a JSON report (header + one record per row), a Markdown
table with a speedup column, and a PNG plot of time and speedup against T (log scales)."""

from __future__ import annotations

import datetime
import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

from nsa_flex.bench.core import (BACK_TO_BACK, SCHEMA, SUITES, Row, add_speedups, environment, make_header,
                                 pick_baseline)


def write_report(out_dir: Path, stem: str, *, suite: str, config, rows: list[Row], summary: str,
                 notes: list[str], commit: str | None = None) -> tuple[dict[str, Path | None], str]:
    """Write <stem>.json, <stem>.md and <stem>.png (None when matplotlib is missing).

    Returns ({"json": path, "md": path, "png": path or None}, the Markdown text).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    header = make_header(suite, config, device=config.device, commit=commit, notes=notes)
    header["summary"] = summary
    header["speedup_baseline"] = pick_baseline(rows, SUITES[suite].baseline_order)
    report = {"schema": SCHEMA, "header": header, "rows": [asdict(r) for r in rows]}
    paths: dict[str, Path | None] = {"json": out_dir / f"{stem}.json", "md": out_dir / f"{stem}.md"}
    paths["json"].write_text(json.dumps(report, indent=2) + "\n")
    md = markdown(header, rows)
    paths["md"].write_text(md + "\n")
    paths["png"] = plot(header, rows, out_dir / f"{stem}.png")
    return paths, md


def merge_reports(paths: list[Path], out_dir: Path, stem: str, baseline_order: tuple[str, ...] | None = None,
                  first_only: bool = False, note: str | None = None) -> tuple[dict[str, Path | None], str]:
    """One report from the JSON files of several runs of one suite on one device (e.g. a sweep
    split over several commands): the first file's header, every file's rows in order.

    baseline_order: recompute every speedup against the first of these impls found in the
    merged rows (each file's own speedups may use different baselines); None keeps them.
    first_only: of rows with the same (impl, mode, T) keep the first file's. With
    baseline_order None, a later run that timed its own baseline beside a peer keeps the
    peer's speedup against that same-run baseline while the table shows the baseline once.
    """
    reports = [json.loads(Path(p).read_text()) for p in paths]
    rows = [Row(**r) for report in reports for r in report["rows"]]
    if first_only:
        # dicts keep insertion order: setdefault keeps each key's first row in place.
        by_key: dict[tuple, Row] = {}
        for r in rows:
            by_key.setdefault((r.impl, r.mode, r.T), r)
        rows = list(by_key.values())
    first = reports[0]["header"]
    merged = f"merged from {', '.join(Path(p).name for p in paths)}" + (f": {note}" if note else "")
    header = dict(first, notes=first["notes"] + [merged])
    if baseline_order is not None:
        for r in rows:
            r.speedup = None
            r.extra.pop("speedup_back_to_back", None)
        header["speedup_baseline"] = add_speedups(rows, baseline_order)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths_out: dict[str, Path | None] = {"json": out_dir / f"{stem}.json", "md": out_dir / f"{stem}.md"}
    paths_out["json"].write_text(json.dumps({"schema": reports[0]["schema"], "header": header,
                                             "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    md = markdown(header, rows)
    paths_out["md"].write_text(md + "\n")
    paths_out["png"] = plot(header, rows, out_dir / f"{stem}.png")
    return paths_out, md


def default_stem(suite: str, device: str) -> str:
    """e.g. 2026-11-22_nvidia-h200_attention."""
    name = environment(device)["device"] if device == "cuda" else "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return f"{datetime.date.today().isoformat()}_{slug}_{suite}"


def markdown(header: dict[str, Any], rows: list[Row]) -> str:
    base = header.get("speedup_baseline")
    # Suites that also time calls back to back (attention) get two more columns.
    b2b = any(BACK_TO_BACK in r.extra for r in rows)
    extra_head, extra_rule = ("| back-to-back ms | back-to-back speedup ", "---:|---:|") if b2b else ("", "")
    lines = [
        f"### nsa-flex bench {header['suite']}: {header['device']}",
        "",
        f"{header['summary']}. torch {header['torch']}, triton {header['triton']}, CUDA {header['cuda']}, "
        f"commit {header['git_commit'][:12]}, {header['date']}.",
        "",
        "| impl | mode | T | median ms | first call ms | TFLOP/s | peak MiB "
        f"| speedup vs {base or 'dense'} {extra_head}| check | note |",
        f"|---|---|---|---:|---:|---:|---:|---:|{extra_rule}---|---|",
    ]
    lines += [_md_row(r, b2b) for r in rows]
    lines += ["", "Checks (before timing):"]
    checks: dict[str, str] = {}
    for r in rows:
        # A merged report holds one real check per impl and "not checked" rows from the other runs.
        if r.check and (r.impl not in checks or checks[r.impl].startswith("not checked")):
            checks[r.impl] = r.check
    lines += [f"- {impl}: {text}" for impl, text in checks.items()]
    lines += ["", "Notes:"] + [f"- {note}" for note in header["notes"]]
    return "\n".join(lines)


def _md_row(r: Row, b2b: bool = False) -> str:
    match r.status:
        case "error":
            note = f"ERROR {_short(r.error or '', 160)}"
        case "skipped":
            note = f"skipped: {r.note}"
        case _:
            note = r.note
    check = r.check.split(":", 1)[0] if r.check else ""
    if r.check_err is not None:
        check += f" {r.check_err:.1e}"
    cells = [r.impl, r.mode, _t(r.T), _num(r.median_ms, 3), _num(r.first_call_ms, 1), _num(r.tflops, 1),
             _num(r.peak_mem_mib, 0), _num(r.speedup, 2, "x")]
    if b2b:
        cells += [_num(r.extra.get(BACK_TO_BACK), 3), _num(r.extra.get("speedup_back_to_back"), 2, "x")]
    cells += [check, note.replace("|", "/")]
    return "| " + " | ".join(cells) + " |"


def _t(T: int) -> str:
    return f"{T // 1024}k" if T % 1024 == 0 else str(T)


def _num(x: float | None, digits: int, suffix: str = "") -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}f}{suffix}" if abs(x) >= 10 ** -digits or x == 0 else f"{x:.1e}{suffix}"


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def plot(header: dict[str, Any], rows: list[Row], path: Path) -> Path | None:
    """Time and speedup against T, log scales; one colour per impl, one line style and marker per
    mode (fwd solid circles, fwd+bwd dashed squares; decode's batch sizes likewise)."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import NullLocator
    except ImportError:
        return None
    fig = Figure(figsize=(13, 5))
    ax_time, ax_speed = fig.subplots(1, 2)
    impls = list(dict.fromkeys(r.impl for r in rows))
    modes = list(dict.fromkeys(r.mode for r in rows))
    lines, markers = ("-", "--", ":", "-."), ("o", "s", "^", "D")
    for (impl, mode), pts in _series(rows).items():
        m = modes.index(mode)
        style = dict(color=f"C{impls.index(impl) % 10}", linestyle=lines[m % 4], marker=markers[m % 4],
                     label=f"{impl} {mode}")
        ax_time.plot([p.T for p in pts], [p.median_ms for p in pts], **style)
        with_speedup = [p for p in pts if p.speedup is not None]
        if with_speedup:
            ax_speed.plot([p.T for p in with_speedup], [p.speedup for p in with_speedup], **style)
    lengths = sorted({r.T for r in rows})
    for ax, label in ((ax_time, "median time (ms)"), (ax_speed, f"speedup vs {header.get('speedup_baseline')}")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(lengths, [_t(T) for T in lengths])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("T (tokens)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    ax_speed.axhline(1.0, color="gray", linewidth=0.8)
    ax_time.legend(fontsize=7)
    fig.suptitle(f"nsa-flex bench {header['suite']}: {header['device']}\n{header['summary']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def _series(rows: list[Row]) -> dict[tuple[str, str], list[Row]]:
    series: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        if r.status == "ok":
            series.setdefault((r.impl, r.mode), []).append(r)
    return {key: sorted(pts, key=lambda p: p.T) for key, pts in series.items()}
