"""The selected branch alone: block-centric nsa_flex::selected_attention against the token-centric
Flex path and dense causal cuDNN attention, forward and forward+backward, on CUDA.

    python -m nsa_flex.bench.selected --T 8192,32768 --out results.json [--shapes g4,g1]

Selections are random but shaped like NSA's: block 0, the own and the previous block forced,
the other n - 3 distinct past blocks uniform (n = 16, l' = 64). Before timing, each shape
checks the op against the Flex path at bf16 tolerance. Times are triton.testing.do_bench
medians; the op's and Flex's times include building their index / BlockMask, as in the model.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch

from nsa_flex.bench.core import describe_error, environment, free_memory, git_commit
from nsa_flex.blocks import num_sel_blocks, sort_block_indices
from nsa_flex.config import NSAConfig

# name: (Hq, Hkv, D)
SHAPES = {
    "seeds-125m": (12, 3, 64), "g4": (16, 4, 128), "g1": (4, 4, 128), "g2": (8, 4, 128),
    "g8": (32, 4, 128), "g16": (64, 4, 128),
}
IMPLS = ("selected-op", "flex-sel", "dense-cudnn")
MODES = ("fwd", "fwd+bwd")
CHECK_T = 2048


@dataclass
class Row:
    shape: str
    T: int
    impl: str
    mode: str
    ms: float | None
    error: str | None = None


def random_selection(B: int, Hkv: int, T: int, config: NSAConfig, device, seed: int = 0) -> torch.Tensor:
    """[B, Hkv, T, n] int32: block 0, own and previous forced, random distinct past blocks, -1 last."""
    g = torch.Generator(device=device).manual_seed(seed)
    Ns, n, L = num_sel_blocks(T, config), config.n_selected, config.sel_block
    j = torch.arange(Ns, device=device)
    out = []
    for t0 in range(0, T, 4096):
        own = torch.arange(t0, min(T, t0 + 4096), device=device)[:, None] // L
        score = torch.rand(B, Hkv, own.shape[0], Ns, generator=g, device=device)
        score = score.masked_fill((j == 0) | (j == own) | (j == own - 1), 2.0).masked_fill(j > own, -1.0)
        top = torch.topk(score, min(n, Ns), dim=-1)
        idx = top.indices.masked_fill(top.values < 0, -1)
        if idx.shape[-1] < n:
            idx = torch.cat([idx, idx.new_full((*idx.shape[:-1], n - idx.shape[-1]), -1)], dim=-1)
        out.append(sort_block_indices(idx))
    return torch.cat(out, dim=2).to(torch.int32)


def _impl(name: str, config: NSAConfig):
    """f(q, k, v, block_indices) -> o [B, T, Hq, Dv] for one implementation."""
    from nsa_flex.flex import fold, selected_branch, unfold
    from nsa_flex.ops.selected_attention import selected_attention
    from nsa_flex.flex.tuning import FlexTiles

    def flex_sel(q, k, v, bi):
        scale = q.shape[-1] ** -0.5
        o = selected_branch(fold(q, k.shape[2]), k, v, bi, config, scale, FlexTiles(sel_impl="flex"), None, True)
        return unfold(o, q.shape[1])

    def dense(q, k, v, bi):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        # K/V come repeated to Hq heads (time_one does it outside the timed call): cuDNN's GQA
        # support varies by version, repeated heads are always accepted.
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(qt, kt, vt, is_causal=True).transpose(1, 2)

    return {"selected-op": lambda q, k, v, bi: selected_attention(q, k, v, bi, config),
            "flex-sel": flex_sel, "dense-cudnn": dense}[name]


def _inputs(T: int, Hq: int, Hkv: int, D: int, config: NSAConfig, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(1, T, h, D, generator=g, device="cuda", dtype=torch.bfloat16)
                   for h in (Hq, Hkv, Hkv, Hq))
    return q, k, v, do, random_selection(1, Hkv, T, config, "cuda", seed)


def check_against_flex(shape: str, config: NSAConfig) -> None:
    """The op's output and gradients equal the Flex path's at bf16 tolerance (T = CHECK_T)."""
    Hq, Hkv, D = SHAPES[shape]
    q, k, v, do, bi = _inputs(CHECK_T, Hq, Hkv, D, config, seed=1)
    results = []
    for name in ("selected-op", "flex-sel"):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        o = _impl(name, config)(*x, bi)
        results.append((o, *torch.autograd.grad(o, x, do)))
    for what, a, b in zip(("o", "dq", "dk", "dv"), *results):
        err = (a.float() - b.float()).abs().max().item()
        tol = 2e-2 * max(1.0, b.float().abs().max().item())
        if not err <= tol:
            raise AssertionError(f"{shape}: {what} differs from the Flex path by {err:.3e} > {tol:.3e}")


def time_one(name: str, mode: str, q, k, v, do, bi, config: NSAConfig) -> float:
    from triton.testing import do_bench

    f = _impl(name, config)
    if name == "dense-cudnn":
        G = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)
    if mode == "fwd":
        def fwd():
            with torch.no_grad():
                f(q, k, v, bi)
        return do_bench(fwd, return_mode="median")
    x = [t.detach().requires_grad_() for t in (q, k, v)]
    return do_bench(lambda: f(*x, bi).backward(do), grad_to_none=x, return_mode="median")


def run(Ts, shapes, out_path, commit: str | None = None) -> list[Row]:
    """Times every (shape, T, impl, mode); prints a Markdown table and writes JSON to out_path."""
    from nsa_flex.flex.tuning import install_flex_tuning

    install_flex_tuning()
    rows: list[Row] = []
    for shape in shapes:
        Hq, Hkv, D = SHAPES[shape]
        config = NSAConfig(n_heads=Hq, n_kv_heads=Hkv, head_dim=D)
        # Each shape compiles the Flex call and the mask lists afresh: without the reset, the shapes of
        # earlier rows use up Dynamo's recompile budget and the Flex path falls back to eager, dense.
        torch._dynamo.reset()
        try:
            check_against_flex(shape, config)
        except Exception as exc:  # recorded; the timings still say what the op costs
            rows.append(Row(shape, CHECK_T, "check", "fwd+bwd", None, describe_error(exc)))
            print(_line(rows[-1]), flush=True)
        for T in Ts:
            q, k, v, do, bi = _inputs(T, Hq, Hkv, D, config)
            for name in IMPLS:
                for mode in MODES:
                    try:
                        rows.append(Row(shape, T, name, mode, time_one(name, mode, q, k, v, do, bi, config)))
                    except Exception as exc:  # an OOM or an unsupported shape: an error row, the sweep goes on
                        rows.append(Row(shape, T, name, mode, None, describe_error(exc)))
                        free_memory("cuda")
                    print(_line(rows[-1]), flush=True)
                    _write(rows, out_path, commit)
            del q, k, v, do, bi
            free_memory("cuda")
    print(markdown(rows))
    _write(rows, out_path, commit)
    return rows


def _write(rows: list[Row], out_path, commit: str | None) -> None:
    """The JSON record, rewritten after every row: a run cut short keeps what it measured."""
    header = {"suite": "selected", "commit": commit or git_commit(), **environment("cuda")}
    with open(out_path, "w") as fh:
        json.dump({"header": header, "rows": [asdict(r) for r in rows]}, fh, indent=1)


def _line(r: Row) -> str:
    return f"{r.shape} T={r.T} {r.impl} {r.mode}: " + (f"{r.ms:.3f} ms" if r.ms is not None else f"ERROR {r.error}")


def markdown(rows: list[Row]) -> str:
    """One line per (shape, T, mode): ms of each impl and the op's speedup over Flex."""
    lines = ["| shape | T | mode | " + " | ".join(f"{i} ms" for i in IMPLS) + " | op vs flex |",
             "|" + "---|" * (len(IMPLS) + 4)]
    keys = dict.fromkeys((r.shape, r.T, r.mode) for r in rows if r.impl != "check")
    for shape, T, mode in keys:
        ms = {r.impl: r.ms for r in rows if (r.shape, r.T, r.mode) == (shape, T, mode)}
        cells = [f"{ms[i]:.3f}" if ms.get(i) is not None else "err" for i in IMPLS]
        op, flex = ms.get("selected-op"), ms.get("flex-sel")
        speed = f"{flex / op:.2f}x" if op and flex else "-"
        lines.append(f"| {shape} | {T} | {mode} | " + " | ".join(cells) + f" | {speed} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", default="8192,32768", help="comma-separated sequence lengths")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {', '.join(SHAPES)}")
    p.add_argument("--out", default="selected_results.json")
    p.add_argument("--commit", default=None, help="commit to record when the checkout has no git metadata")
    args = p.parse_args()
    run([int(t) for t in args.T.split(",")], args.shapes.split(","), args.out, args.commit)


if __name__ == "__main__":
    main()
