"""Where the first call of nsa_flex spends its time on a GPU, as T grows.

    PYTHONPATH=. python3 bench/compile_probe_gpu.py --out "$OUT" --cases eager:65536,whole:16384

The attention bench's first calls grow with T (H200, eager glue: fwd+bwd 28 s at 8k, 157 s
at 64k; the whole op under torch.compile(fullgraph=True) did not finish its 16k forward in
150 s) while the forward alone stays near 6 s. Each case runs in a subprocess with a time
limit; every --every-s seconds faulthandler writes every thread's stack to
OUT/stacks_<case>.txt, so a case that is cut off still shows where it was. A case that ends
prints its phase times (first fwd, first fwd+bwd, later fwd+bwd) and Dynamo's compile_times().

Cases: eager:T (nsa_flex called directly; its Flex calls are compiled) or whole:T (the op
under torch.compile(fullgraph=True, dynamic=False)).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from limited import run_limited

CHILD = r"""
import faulthandler, json, sys, time
import torch
sys.path.insert(0, '.'); sys.path.insert(0, 'bench')
stacks = open(sys.argv[3], 'w')
faulthandler.dump_traceback_later(float(sys.argv[4]), repeat=True, file=stacks)
from nsa_flex import NSAConfig
from nsa_flex.flex import nsa_flex
from nsa_flex.flex.tuning import install_flex_tuning
from flex_gpu import inputs
install_flex_tuning()
mode, T = sys.argv[1], int(sys.argv[2])
cfg = NSAConfig(n_heads=64, n_kv_heads=4, head_dim=128)
x = inputs(cfg, T)
fn = lambda **x: nsa_flex(**x, config=cfg)[0]
if mode == 'whole':
    fn = torch.compile(fn, fullgraph=True, dynamic=False)
times = {}
def phase(name, f):
    t0 = time.monotonic(); f(); torch.cuda.synchronize(); times[name] = round(time.monotonic() - t0, 2)
    print(name, times[name], 's', flush=True)
def fwd():
    with torch.no_grad():
        fn(**x)
def fwd_bwd():
    o = fn(**x); o.backward(torch.ones_like(o))
phase('first_fwd', fwd)
phase('second_fwd', fwd)
phase('first_fwd_bwd', fwd_bwd)
phase('second_fwd_bwd', fwd_bwd)
print('RESULT', json.dumps({'times_s': times, 'compile_times': torch._dynamo.utils.compile_times()}), flush=True)
"""


def run_case(case: str, out: Path, limit_s: float, every_s: float) -> dict:
    mode, T = case.split(":")
    stacks = out / f"stacks_{mode}_{T}.txt"
    t0 = time.monotonic()
    status, text = run_limited([sys.executable, "-c", CHILD, mode, T, str(stacks), str(every_s)], limit_s,
                               cwd=str(Path(__file__).resolve().parents[1]))
    result = next((json.loads(line[7:]) for line in text.splitlines() if line.startswith("RESULT ")), None)
    lines = [line for line in text.splitlines() if not line.startswith("RESULT ")]
    return {"case": case, "status": status, "wall_s": round(time.monotonic() - t0, 1), "result": result,
            "log": "\n".join(lines)[-3000:]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cases", default="eager:65536,whole:16384")
    p.add_argument("--limit-s", type=float, default=200)
    p.add_argument("--every-s", type=float, default=15)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for case in args.cases.split(","):
        results.append(run_case(case, args.out, args.limit_s, args.every_s))
        print(json.dumps(results[-1], indent=1), flush=True)
        (args.out / "compile_probe.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
