"""The selected branch at G < 16 with one token per 16-row tile (G real rows, the rest zero) vs the folded tiles.

    python bench/pad_rows_gpu.py --out $OUT/pad_rows.json --shapes 4:8192:12:3:64 1:32768:12:3:64

At G=4 a 16-row tile of the folded layout holds 4 tokens and walks the union of their selected
blocks (~55 for n=16), nearly all of them partial, so Flex evaluates the selection mask_mod (a
bit-set gather) on every element. Padding each token's G rows to 16 gives one token per tile:
its 16 blocks are full except its own, no mask_mod there, at 16/G times the query rows. This
script times both, forward and forward+backward (selection and masks given, built outside the
timed region), and reports their largest output difference (rounding level if both are right).

Measured (H200, bench/results/2026-11-22_h200_pad_rows.json, seeds-125m shape 4:8192:12:3:64):
padded 5.55 / 18.4 ms against folded 5.69 / 19.0 ms forward / forward+backward, within 3%. The
mask_mod is not what keeps the branch at ~2.7x its traffic floor there; the folded tiles stay.
(The run's further shapes hit Dynamo's recompile limit and fell back to the dense math path:
the script now raises the limit, as tiles_gpu.py does.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from flex_gpu import allow_many_shapes, bench_ms, header  # noqa: E402
from host_profile_gpu import make_inputs, parse_shape  # noqa: E402
from records import row_recorder, shape_script_parser  # noqa: E402

from nsa_flex.flex import _call, _flex_sel, fold, nsa_flex, with_initial_copies  # noqa: E402
from nsa_flex.flex.masks.selection import initial_copies, selection_block_mask  # noqa: E402
from nsa_flex.flex.tuning import FlexTiles  # noqa: E402

ROWS = 16


def main() -> None:
    args = shape_script_parser(__doc__, ["4:8192:12:3:64", "1:32768:12:3:64"]).parse_args()
    # Each variant and grad mode is another shape for the compiled Flex call.
    allow_many_shapes()
    _, add = row_recorder(args.out, header(args.commit) | {"what": __doc__.splitlines()[0]})
    for shape in args.shapes:
        B, T, Hq, Hkv, D = parse_shape(shape)
        cfg, x = make_inputs(B, T, Hq, Hkv, D)
        G = Hq // Hkv
        with torch.no_grad():
            _, sel = nsa_flex(**x, config=cfg)
        scale = D ** -0.5
        kT = x["k"].detach().transpose(1, 2)
        vT = x["v"].detach().transpose(1, 2)
        r = {"shape": shape, "G": G}
        variants = {}
        for name, g_eff in (("folded", G), ("padded", ROWS)):
            copies = initial_copies(T, g_eff, cfg, ROWS, FlexTiles().initial_copy_tokens)
            mask = selection_block_mask(sel, T, g_eff, cfg, ROWS, copies=copies)
            k_in = with_initial_copies(kT, copies) if copies is not None else kT
            v_in = with_initial_copies(vT, copies) if copies is not None else vT
            q = fold(x["q"].detach(), Hkv).view(B, Hkv, T, G, D)
            if g_eff != G:
                q = torch.cat([q, q.new_zeros(B, Hkv, T, g_eff - G, D)], dim=3)
            q = q.reshape(B, Hkv, T * g_eff, D).requires_grad_(True)
            k_in, v_in = k_in.detach().requires_grad_(True), v_in.detach().requires_grad_(True)

            def fwd(q=q, k_in=k_in, v_in=v_in, mask=mask, g_eff=g_eff):
                o = _call(_flex_sel, q, k_in, v_in, mask, scale, "sel")
                return o.view(B, Hkv, T, g_eff, -1)[:, :, :, :G]

            do = torch.randn(B, Hkv, T, G, D, device="cuda", dtype=q.dtype)

            def fwd_bwd(fwd=fwd, q=q, k_in=k_in, v_in=v_in, do=do):
                torch.autograd.backward(fwd(), do, inputs=[q, k_in, v_in])

            fwd_bwd()
            with torch.no_grad():
                variants[name] = fwd().float()
                r[f"{name}_fwd_ms"] = round(bench_ms(fwd), 3)
            r[f"{name}_fwd_bwd_ms"] = round(bench_ms(fwd_bwd), 3)
        r["max_diff"] = float((variants["folded"] - variants["padded"]).abs().max())
        r["padded_speedup_fwd"] = round(r["folded_fwd_ms"] / r["padded_fwd_ms"], 3)
        r["padded_speedup_fwd_bwd"] = round(r["folded_fwd_bwd_ms"] / r["padded_fwd_bwd_ms"], 3)
        add(r)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
