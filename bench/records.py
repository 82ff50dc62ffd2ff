"""The GPU scripts' JSON records: rewritten after every measurement, so a call cut short keeps what it measured."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable


def shape_script_parser(doc: str, default_shapes: list[str]) -> argparse.ArgumentParser:
    """The arguments every shape-sweeping GPU script takes: --out JSON, --shapes B:T:Hq:Hkv:D ..., --commit."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shapes", nargs="+", default=default_shapes, help="B:T:Hq:Hkv:D each")
    p.add_argument("--commit", default="")
    return p


def json_saver(path: Path, record: dict) -> Callable[[], None]:
    """A save() that writes `record` (as it is at the time of the call) to `path`, folders made as needed."""

    def save() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1, default=str))

    return save


def row_recorder(path: Path, header: dict) -> tuple[list[dict], Callable[[dict], None]]:
    """(rows, add): add(row) appends a row, prints it and rewrites {"header", "rows"} at `path`."""
    rows: list[dict] = []
    save = json_saver(path, {"header": header, "rows": rows})

    def add(row: dict) -> None:
        rows.append(row)
        print(row, flush=True)
        save()

    save()
    return rows, add
