"""Where the selection kernel's time goes, and how often its lists lose a block, on a GPU.

    python -m bench.select_parts_gpu --out runs/bench/select_parts.json [--lost-out runs/bench/lost.json]

Parts: the kernel of nsa_flex/ops/select/kernels.py compiled with parts cut off (the source
patched here, nothing in the package changes), each timed at T = 64k and 32k with G = 4 and at
64k with G = 16 (bf16, Dk = 128, the paper's geometry, the exact queues: LISTS = 0):
  whole    the kernel
  notopk   scores summed into an accumulator instead of the top n (the fold kept)
  nofold   the exp'd scores summed before the group sum and the fold
  noexp    the raw scores summed (no exp either)
Lost (--lost-out): with the exact walk of programs whose lists lost a block turned off (REDO),
the share of tokens and of programs whose lists (LISTS = 4, 6, 8; rotation on and off) lost one
of their n best blocks, against the exact queues' selection, at 64k with G = 4 and 16.
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import torch

from bench.common import header, json_saver
from bench.ops_select_gpu import make_inputs
from nsa_flex.config import NSAConfig
from nsa_flex.ops.select import kernels as select_triton

_WALK = "    def _walk("
_TOPN = "            j = jt * BS + jb\n"
_LOOP = "        for jt in range(0, n_tiles):\n"
_TAIL = "        if LISTS:\n            # The n best of the lists"
# The cut walk returns its sums as the keys (the kernel then sorts and stores them: the times count).
_STORE = "        return acc.to(tl.int32, bitcast=True).to(tl.int64), 0\n"
_STORE_P = ("        acc = tl.sum(tl.reshape(accp, [BS, RP * NC]), axis=1)\n"
            "        return tl.broadcast_to(acc[None, :], [BT, BS]).to(tl.int32, bitcast=True).to(tl.int64), 0\n")


def variant_source(kind: str) -> str:
    """The kernels module's source with the tile loop's body in _walk (the module's last function)
    cut from a marker (the first after _walk's def) to its end."""
    src = Path(select_triton.__file__).read_text()
    if kind == "whole":
        return src
    walk = src.index(_WALK)  # the markers are searched from here: helpers before _walk share some
    loop_end = src.index(_TAIL, walk)  # the tile loop ends here (the post-loop lists block follows)
    start = src.index(_TOPN if kind == "notopk" else "            # Group sum", walk)
    body = src[:start] + ("            acc += imp\n\n" if kind == "notopk" else "            accp += p\n\n")
    assert start < loop_end
    if kind == "notopk":
        body = body.replace(_LOOP, "        acc = tl.zeros([BT, BS], tl.float32)\n" + _LOOP)
        return body + _STORE
    body = body.replace(_LOOP, "        accp = tl.zeros([BC, NC], tl.float32)\n" + _LOOP)
    if kind == "noexp":
        body = body.replace("p = tl.math.exp2(s * scale2 - lse2_n[None, :])", "p = s * scale2")
    return body + _STORE_P


def load_variant(kind: str, workdir: Path):
    """The patched kernels module (a file, so that Triton can read the kernel's source)."""
    path = workdir / f"select_part_{kind}.py"
    path.write_text(variant_source(kind))
    mod = types.ModuleType(path.stem)
    mod.__file__ = str(path)
    sys.modules[path.stem] = mod
    exec(compile(path.read_text(), str(path), "exec"), mod.__dict__)
    return mod


def parts(out: Path, workdir: Path) -> None:
    import triton

    record = {"header": header(), "rows": []}
    save = json_saver(out, record)
    config = NSAConfig()
    mods = {kind: load_variant(kind, workdir) for kind in ("whole", "notopk", "nofold", "noexp")}
    for T, Hq in ((65536, 16), (32768, 16), (65536, 64)):
        q, k_cmp, lse = make_inputs(T, Hq, 4, 128, torch.bfloat16, config)
        for kind, mod in mods.items():
            fn = lambda: mod.select_blocks_triton(q, k_cmp, lse, None, None, 128 ** -0.5, config,  # noqa: E731
                                                  {"LISTS": 0})
            ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
            record["rows"].append({"T": T, "Hq": Hq, "Hkv": 4, "kind": kind, "ms": ms})
            print(record["rows"][-1], flush=True)
            save()


def lost(out: Path) -> None:
    record = {"header": header(), "rows": []}
    save = json_saver(out, record)
    config = NSAConfig()
    launch = select_triton.launch_kernel

    def no_redo(kernel, grid, *args, **kwargs):
        """The launch with the exact walk of programs that lost a block turned off (REDO=False)."""
        return launch(kernel, grid, *args, **{**kwargs, "REDO": False})

    for T, Hq in ((65536, 16), (65536, 64)):
        q, k_cmp, lse = make_inputs(T, Hq, 4, 128, torch.bfloat16, config)
        exact = select_triton.select_blocks_triton(q, k_cmp, lse, None, None, 128 ** -0.5, config, {"LISTS": 0})
        BT = select_triton.launch_config(Hq // 4, 128, config.n_selected)["BT"]
        select_triton.launch_kernel = no_redo
        try:
            for tiles in ({"LISTS": 4}, {"LISTS": 6}, {"LISTS": 8}, {"LISTS": 6, "ROTATE": 0}):
                got = select_triton.select_blocks_triton(q, k_cmp, lse, None, None, 128 ** -0.5, config, tiles)
                rows = (got != exact).any(-1)[0]  # [Hkv, T]
                programs = rows[:, : T // BT * BT].reshape(rows.shape[0], -1, BT).any(-1)
                record["rows"].append({"T": T, "Hq": Hq, **tiles, "tokens_lost": int(rows.sum()),
                                       "token_frac": rows.float().mean().item(),
                                       "program_frac": programs.float().mean().item()})
                print(record["rows"][-1], flush=True)
                save()
        finally:
            select_triton.launch_kernel = launch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="the parts' times")
    p.add_argument("--lost-out", type=Path, help="also the lists' lost blocks, here")
    p.add_argument("--workdir", type=Path, default=Path("/tmp"), help="where the patched kernels are written")
    args = p.parse_args()
    parts(args.out, args.workdir)
    if args.lost_out:
        lost(args.lost_out)


if __name__ == "__main__":
    main()
