"""Decode on the GPU: correctness of the compiled bf16 step, then one layer's step against dense SDPA.

    python -m bench.decode_gpu                      # all of it: 8k..128k, B=1 and B=8
    python -m bench.decode_gpu --contexts 64k --batches 1,8 --out runs/bench
    python -m bench.decode_gpu --merge a.json b.json --out runs/bench   # one report of split runs

First `check_decode`: prefill + 100 decode steps through torch.compile(mode="reduce-overhead")
in bf16 (positions 937..1099, across multiples of 16, 32, 64 and 512), against the fp32
reference forward, and `Generator` (the whole model, one CUDA graph per step) against the
model's forward. Then the decode suite (nsa_flex.bench.decode): per (B, T) the NSA step and
dense SDPA decode, both replayed from CUDA graphs. Results go to --out (default $OUT, else
runs/bench) as JSON + Markdown + PNG, rewritten after every configuration so a run cut
short still leaves what it measured; the table is printed at the end. Exit status 1 if a
check failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from nsa_flex.bench.core import describe_error
from nsa_flex.bench.decode import decode_config, decode_notes, decode_summary, run_decode
from nsa_flex.bench.report import default_stem, merge_reports, write_report


def main() -> int:
    args = parse_args()
    if args.merge:
        return merge(args.merge, Path(args.out or "runs/bench"), args.name)
    if not torch.cuda.is_available() and args.device != "cpu":
        print("no CUDA device: pass --device cpu for a functional smoke run (its times mean nothing)")
        return 2
    cfg = decode_config(device=args.device, contexts=args.contexts, batches=args.batches,
                        reduce_overhead_at=args.reduce_overhead_at, check=not args.no_check)
    out = Path(args.out or os.environ.get("OUT") or "runs/bench")
    stem = args.name or default_stem("decode", cfg.device)
    print(f"decode bench: {decode_summary(cfg)}; T={list(cfg.contexts)} B={list(cfg.batches)}; writing {out}/{stem}.*",
          flush=True)
    ok = True
    if not args.no_check:
        ok = check_model_generate(cfg.device)
    started = time.perf_counter()

    def save(rows) -> None:
        write_report(out, stem, suite="decode", config=cfg, rows=rows, summary=decode_summary(cfg),
                     notes=decode_notes(cfg))
        last = rows[-1]
        print(f"[{time.perf_counter() - started:6.0f} s] B={last.extra.get('batch')} T={last.T}: " + ", ".join(
            f"{r.impl} {r.median_ms * 1e3:.1f} us" + (f" ({r.speedup:.2f}x)" if r.speedup else "")
            if r.status == "ok" else f"{r.impl} {r.status}: {r.error}"
            for r in rows if r.T == last.T and r.mode == last.mode), flush=True)

    rows = run_decode(cfg, progress=lambda done, total, what: print(f"  {done}/{total} {what}", flush=True),
                      on_rows=save)
    paths, md = write_report(out, stem, suite="decode", config=cfg, rows=rows, summary=decode_summary(cfg),
                             notes=decode_notes(cfg))
    print()
    print(md)
    print("\n".join(f"wrote {kind}: {path}" for kind, path in paths.items() if path))
    ok = ok and all(r.check.startswith("ok") for r in rows if r.check)
    return 0 if ok else 1


def merge(paths: list[str], out: Path, name: str | None) -> int:
    """One report (JSON + Markdown + PNG) from the JSON files of several runs on one device."""
    found, md = merge_reports([Path(p) for p in paths], out, name or Path(paths[0]).stem + "_merged")
    print(md)
    print("\n".join(f"wrote {kind}: {path}" for kind, path in found.items() if path))
    return 0


def check_model_generate(device: str) -> bool:
    """The whole-model step (Generator, compiled on CUDA) against NSALM.forward, greedy, fp32."""
    from nsa_flex.decoding.generate import generate
    from nsa_flex.model import MODEL_PRESETS, NSALM

    try:
        torch.manual_seed(0)
        model = NSALM(MODEL_PRESETS["tiny"], device=device)
        prompts = [[1, 2, 3], list(range(10, 70))]
        result = generate(model, prompts, 60, compile=device == "cuda")
        same = 0
        for prompt, new in zip(prompts, result.tokens):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + new], device=device))[0, len(prompt) - 1:-1]
            same += int((logits.argmax(-1).cpu() == torch.tensor(new)).sum())
        total = sum(len(t) for t in result.tokens)
        print(f"model check: compiled greedy generation = full-forward argmax at {same}/{total} tokens; "
              f"{result.tokens_per_s:.0f} tokens/s (tiny model, batch 2)", flush=True)
        return same == total
    except Exception as exc:
        print(f"model check failed: {describe_error(exc)}", flush=True)
        return False


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=_ints, default=None, help="e.g. 8k,16k,32k,64k,128k (k = 1024)")
    p.add_argument("--batches", type=_ints, default=None, help="e.g. 1,8")
    p.add_argument("--reduce-overhead-at", type=_ints, default=None,
                   help="contexts that also get the reduce-overhead row (default 64k)")
    p.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    p.add_argument("--device", default=None, help="cuda (default) or cpu (smoke run)")
    p.add_argument("--out", default=None, help="output folder (default $OUT, else runs/bench)")
    p.add_argument("--name", default=None, help="file stem (default <date>_<device>_decode)")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="write one report from these runs' JSON files (no GPU needed), e.g. of a split sweep")
    return p.parse_args()


def _ints(text: str) -> tuple[int, ...]:
    """'8k,16k' or '8192,16384' -> (8192, 16384). (The script needs only nsa_flex on the path.)"""
    items = [item.strip().lower() for item in text.split(",")]
    if not all(item.removesuffix("k").isdigit() and int(item.removesuffix("k")) > 0 for item in items):
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated positive integers, k = 1024")
    return tuple(int(item.removesuffix("k")) * (1024 if item.endswith("k") else 1) for item in items)


if __name__ == "__main__":
    sys.exit(main())
