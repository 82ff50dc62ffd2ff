"""The fused decode op on the GPU: nsa_flex::decode_attend (Triton) against its torch twin and dense SDPA.

    python -m bench.decode_kernel_gpu                    # 8k..128k, B=1 and 8
    python -m bench.decode_kernel_gpu --contexts 64k --batches 1 --out runs/x

Per (B, T), a cache of the bench shape (Hq=64, Hkv=4, D=128, bf16, the paper's l=32 d=16
l'=64 n=16 w=512) filled with random data, the B sequences at positions T-1, T-98, ...:

1. check: the op against its torch twin run on the fp32 upcast of the same tensors: max error
   of o against the twin's output with the op's own selection (and the bf16 twin's error for
   scale), and the fraction of (b, kv head) whose block set equals the fp32 twin's.
2. times, GPU time per step, each from a torch.cuda.CUDAGraph of STEPS steps (median of the
   replays):
   op          the op alone (four Triton kernels), eager launches captured;
   step-op     decode_attention (cache write + compression + the op), Inductor-compiled
               (fullgraph; the code mode="reduce-overhead" wraps in its own graph), advancing;
   step-torch  the same step with impl="torch": the old batched-torch path, compiled the same way;
   dense       SDPA flash over the whole cache ([B, Hkv, G, D] queries), the baseline.
   At --reduce-overhead-at contexts also step-op-ro / step-torch-ro: mode="reduce-overhead"
   called from Python once per step (host time included: what a caller of one layer sees).
   kernels / busy_us: GPU kernels per compiled step and their summed time (profiler, no graph).

JSON to --out (default $OUT, else runs/bench), rewritten after every configuration; a table
is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from nsa_flex.bench.decode import graph_step_times, kernel_profile, random_step_inputs
from nsa_flex.blocks import sort_block_indices
from nsa_flex.config import PRESETS
from nsa_flex.decoding.step import decode_attention
from nsa_flex.ops import decode_attend, decode_attend_torch
from nsa_flex.ops.decode.attend import cmp_attention, sel_win_attention

STEPS = 20
"""Steps captured in one CUDA graph (the cache has room for them past T)."""
REPLAYS = 15


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    out = Path(args.out or os.environ.get("OUT") or "runs/bench")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "decode_kernel_gpu.json"
    header = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": _triton_version(), "config": repr(PRESETS["bench"]), "dtype": "bf16",
              "steps_per_graph": STEPS, "replays": REPLAYS}
    rows: list[dict] = []
    started = time.perf_counter()
    for B in args.batches:
        for T in args.contexts:
            row = {"B": B, "T": T}
            try:
                run_config(row, B, T, T in args.reduce_overhead_at)
            except Exception as exc:  # keep the sweep going; the row says what failed
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            rows.append(row)
            path.write_text(json.dumps({"header": header, "rows": rows}, indent=1))
            print(f"[{time.perf_counter() - started:5.0f} s] {_line(row)}", flush=True)
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    print(table(rows))
    print(f"wrote {path}")


class Problem:
    """A filled cache of T tokens per sequence, one new token's projections and gates, phi."""

    def __init__(self, B: int, T: int):
        torch.manual_seed(B * 1000 + T)
        cfg = PRESETS["bench"]
        self.cfg, self.B, self.T = cfg, B, T
        # Queries larger than unit scale: a peaked compressed softmax, so the selection is not a coin toss.
        self.cache, self.pr, self.gates, self.phi_k, self.phi_v = random_step_inputs(
            cfg, B, T + STEPS + 1, torch.bfloat16, "cuda", q_scale=2.0)
        self.start = torch.tensor([T - 1 - 97 * b for b in range(B)], device="cuda")
        self.reset()

    def reset(self) -> None:
        self.cache.lengths.copy_(self.start)

    def op_args(self):
        c, cfg = self.cache, self.cfg
        return (self.pr.q.view(self.B, cfg.n_kv_heads, cfg.group_size, cfg.head_dim), c.k, c.v, c.k_win, c.v_win,
                c.k_cmp, c.v_cmp, c.lengths, self.gates.view(self.B, cfg.n_kv_heads, cfg.group_size, 3))

    def op(self):
        return decode_attend(*self.op_args(), self.cfg)

    def step(self, impl: str):
        return decode_attention(self.cache, self.pr, self.gates, self.phi_k, self.phi_v, impl=impl)

    def dense(self):
        c, cfg = self.cache, self.cfg
        q = self.pr.q.view(self.B, cfg.n_kv_heads, cfg.group_size, cfg.head_dim)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, c.k[:, :, :self.T], c.v[:, :, :self.T])


def run_config(row: dict, B: int, T: int, reduce_overhead: bool) -> None:
    p = Problem(B, T)
    row.update(check(p))
    row["op_us"] = time_graph(p.op, p.reset)
    row["dense_us"] = time_graph(p.dense, p.reset)
    for impl in ("op", "torch"):
        torch._dynamo.reset()
        start = time.perf_counter()
        fn = torch.compile(lambda: p.step(impl), fullgraph=True)
        row[f"step_{impl}_us"] = time_graph(fn, p.reset)
        row[f"step_{impl}_compile_s"] = round(time.perf_counter() - start, 1)
        prof = kernel_profile(fn, p.reset)
        row[f"step_{impl}_kernels"], row[f"step_{impl}_busy_us"] = prof["kernels"], round(prof["busy_us"], 2)
        if reduce_overhead:
            torch._dynamo.reset()
            fn = torch.compile(lambda: p.step(impl), mode="reduce-overhead", fullgraph=True)
            row[f"step_{impl}_ro_us"] = time_calls(fn, p.reset)
    row["speedup_vs_dense"] = round(row["dense_us"] / row["step_op_us"], 2)
    row["speedup_vs_torch"] = round(row["step_torch_us"] / row["step_op_us"], 2)


@torch.no_grad()
def check(p: Problem) -> dict:
    """The op against the fp32 twin on the same (upcast) tensors."""
    p.reset()
    args = p.op_args()
    o, blocks = decode_attend(*args, p.cfg)
    args32 = tuple(x.float() if x.is_floating_point() else x for x in args)
    o32, blocks32 = decode_attend_torch(*args32, p.cfg)
    o_bf16, _ = decode_attend_torch(*args, p.cfg)
    same = (sort_block_indices(blocks) == sort_block_indices(blocks32)).all(-1)
    # The fp32 twin with the op's own selection: output errors without near-tie swaps.
    q, k, v, k_win, v_win, k_cmp, v_cmp, pos, gates = args32
    scale = q.shape[-1] ** -0.5
    o32_own = gates[..., 0:1] * cmp_attention(q, k_cmp, v_cmp, pos, scale, p.cfg)[0] + sel_win_attention(
        q, k, v, k_win, v_win, blocks, pos, gates[..., 1:2], gates[..., 2:3], scale, p.cfg)
    return {"blocks_equal": round(same.float().mean().item(), 4),
            "err_op": (o.float() - o32_own).abs().max().item(),
            "err_op_vs_twin_sel": (o.float() - o32).abs().max().item(),
            "err_twin_bf16": (o_bf16.float() - o32).abs().max().item(),
            "out_scale": o32.abs().max().item()}


def time_graph(fn, reset) -> float:
    """Median GPU us per step over REPLAYS runs of a graph of STEPS calls."""
    return round(statistics.median(graph_step_times(fn, reset, steps=STEPS, reps=REPLAYS)) * 1e3, 2)


def time_calls(fn, reset) -> float:
    """Median us per call from Python (host included), STEPS calls per run."""
    reset()
    for _ in range(3):
        fn()
    times = []
    for _ in range(REPLAYS):
        reset()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(STEPS):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6 / STEPS)
    return round(statistics.median(times), 2)


COLUMNS = ("B", "T", "op_us", "step_op_us", "step_torch_us", "dense_us", "speedup_vs_dense", "speedup_vs_torch",
           "step_op_kernels", "step_op_ro_us", "step_torch_ro_us", "blocks_equal", "err_op", "err_twin_bf16")


def table(rows: list[dict]) -> str:
    def cell(v):
        return "" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(COLUMNS) + " | error |", "|" + "---|" * (len(COLUMNS) + 1)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in COLUMNS) + f" | {r.get('error', '')} |" for r in rows]
    return "\n".join(lines)


def _line(row: dict) -> str:
    return ", ".join(f"{k}={row[k]}" for k in row)


def _triton_version() -> str:
    try:
        import triton
        return triton.__version__
    except ImportError:
        return "none"


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(int(x[:-1]) * 1024 if x.endswith("k") else int(x) for x in text.split(","))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=_sizes, default=_sizes("8k,16k,32k,64k,128k"))
    parser.add_argument("--batches", type=_sizes, default=(1, 8))
    parser.add_argument("--reduce-overhead-at", type=_sizes, default=_sizes("64k"),
                        help="contexts where the mode='reduce-overhead' rows are timed too (each compiles again)")
    parser.add_argument("--out", default=None, help="output folder (default $OUT, else runs/bench)")
    return parser.parse_args()


if __name__ == "__main__":
    main()
