"""The window branch alone on the GPU: Flex BlockMask block sizes, the window op's kernels, and two
chunked cuDNN causal calls.

    python -m bench.window_gpu --out $OUT/window.json --shapes 1:65536:16:4:128 1:32768:16:4:128 \
        [--blocks 128x128 128x64 "128x64:bwd_BLOCK_N1=64,bwd_num_warps=8" "128x128:USE_TMA=1"] [--no-cudnn] \
        [--max-autotune] [--kernels default "fwd_BN=128,kv_BM=128"]

Per shape B:T:Hq:Hkv:D (bf16, NSAConfig's window): dense causal cuDNN (the same run's baseline),
then the Flex window call (flex.window_branch, compiled with fullgraph=True) with each
FlexTiles.win_block ("QxK", optionally ":key=value,..." Flex kernel options over the op's own
for that call), forward and forward+backward medians, and the largest differences of its output and its
gradients (q, k, v; one fixed output gradient) from the first variant's (the tiles only reorder
bf16 sums; a wrong kernel option shows as a large difference or NaN). --kernels: the op
nsa_flex::window_attention's launches (ops.window.forward / backward, called directly) with
launch_config's settings, each variant "default" or "key=int,..." over them: forward, backward
(its two kernels) and forward+backward medians, and the same differences from the first Flex
variant. --max-autotune lets Inductor time its own candidate tiles for every variant (the winners go to stderr as
"Autotune Choices Stats"). Then the cost of the window as
two causal attention calls over w-token chunks (queries of chunk i over the keys of chunk i,
and w-1 reversed queries over the w-1 reversed keys before the chunk; design in
docs/decisions.md): both cuDNN calls on inputs of those shapes, forward and forward+backward
with plain autograd, no merge: what that design would pay before its copies and merge.
--fa2: torch's own FlashAttention-2 kernels with a window (aten._flash_attention_forward with
window_size_left = W - 1, GQA k/v, q unfolded [B, T, Hq, D]; autograd through its backward, which
adds dQ with atomics), forward and forward+backward, plain and with torch's deterministic
algorithms on, and their differences from the window op's kernels (the first --kernels variant).
"""

from __future__ import annotations

import time

import torch

from bench.common import bench_ms, dense_cudnn, header, make_inputs, parse_shape, row_recorder, shape_script_parser
from nsa_flex.flex import fold, tuning, window_branch
from nsa_flex.flex.tuning import FlexTiles, install_flex_tuning
from nsa_flex.ops import window as window_op

_OWN_OPTIONS = tuning.branch_kernel_options


def _with_window_options(extra: dict):
    """Make the window's Flex call take `extra` kernel options over the op's own (this process only)."""

    def options(branch, *args, **kwargs):
        opts = _OWN_OPTIONS(branch, *args, **kwargs)
        return {**opts, **extra} if branch == "win" else opts

    tuning.branch_kernel_options = options


def _parse_variant(text: str) -> tuple[tuple[int, int], dict]:
    """"QxK[:key=int,...]" -> ((Q, K), kernel options); a clear error for anything else."""
    blocks, _, opts = text.partition(":")
    try:
        qb, kb = (int(s) for s in blocks.split("x"))
        extra = {key: int(value) for key, value in (item.split("=") for item in filter(None, opts.split(",")))}
    except ValueError:
        raise SystemExit(f"--blocks {text!r}: expected QxK or QxK:option=int,... (e.g. 128x64:bwd_BLOCK_N1=64)")
    return (qb, kb), extra


def _timed(fn, leaves, grad):
    def fwd():
        with torch.no_grad():
            return fn()

    def fwd_bwd():
        for x in leaves:
            x.grad = None
        torch.autograd.backward(fn(), grad, inputs=leaves)

    t0 = time.monotonic()
    fwd_bwd()
    torch.cuda.synchronize()
    first = time.monotonic() - t0
    return {"fwd_ms": bench_ms(fwd), "fwd_bwd_ms": bench_ms(fwd_bwd), "first_s": round(first, 1)}


def _outputs(fn, leaves, grad) -> dict[str, torch.Tensor]:
    """The output and the leaves' gradients (fp32) of one forward+backward with output gradient `grad`."""
    for x in leaves:
        x.grad = None
    out = fn()
    torch.autograd.backward(out, grad, inputs=leaves)
    got = {"o": out.detach().float()}
    got.update({name: x.grad.float() for name, x in zip(("dq", "dk", "dv"), leaves)})
    return got


def _kernel_row(shape, spec, q_fold, k, v, G, w, scale, grad, ref) -> dict:
    """Times the window op's launches with launch_config's settings changed by spec; diffs against ref."""
    cfg = window_op.launch_config(q_fold.shape[-1], v.shape[-1])
    if spec != "default":
        for item in spec.split(","):
            key, value = item.split("=")
            if key not in cfg:
                raise SystemExit(f"--kernels {spec!r}: unknown key {key!r}; known: {', '.join(cfg)}")
            cfg[key] = int(value)
    qd, kd, vd = (x.detach() for x in (q_fold, k, v))
    row = {"shape": shape, "what": f"window op kernels {spec}", **cfg}
    try:
        o, lse = window_op.forward(qd, kd, vd, G, w, scale, cfg)[:2]
        dq, dk, dv = window_op.backward(grad, qd, kd, vd, o, lse, G, w, scale, cfg)
        row["fwd_ms"] = bench_ms(lambda: window_op.forward(qd, kd, vd, G, w, scale, cfg))
        row["bwd_ms"] = bench_ms(lambda: window_op.backward(grad, qd, kd, vd, o, lse, G, w, scale, cfg))
        row["fwd_bwd_ms"] = bench_ms(lambda: window_op.backward(grad, qd, kd, vd, *window_op.forward(
            qd, kd, vd, G, w, scale, cfg)[:2], G, w, scale, cfg))
        got = {"o": o.float(), "dq": dq.float(), "dk": dk.float(), "dv": dv.float()}
        if ref is not None:
            for name, value in got.items():
                row[f"max_diff_{name}_vs_first"] = float((value - ref[name]).abs().max())
    except Exception as exc:  # settings with no valid launch (shared memory): say so, go on
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        got = None
    return row, got


def _fa2_row(shape, x, Hkv, w, scale, grad_fold, ref, deterministic: bool) -> dict:
    """torch's FlashAttention-2 with the window on unfolded q [B, T, Hq, D], GQA k / v: times and
    differences (folded like the op's) from ref; whether two backward calls gave the same bits."""
    from nsa_flex.folded import fold, unfold

    q, k, v = (x[n].detach().requires_grad_(True) for n in ("q", "k", "v"))
    T = q.shape[1]
    grad = unfold(grad_fold, T)

    def call():
        return torch.ops.aten._flash_attention_forward(q, k, v, None, None, T, T, 0.0, True, False, scale=scale,
                                                       window_size_left=w - 1, window_size_right=0)[0]

    row = {"shape": shape, "what": f"fa2 window, deterministic={deterministic}"}
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    try:
        row.update(_timed(call, [q, k, v], grad))
        got = _outputs(call, [q, k, v], grad)
        again = _outputs(call, [q, k, v], grad)
        row["bwd_repeatable"] = all(torch.equal(got[n], again[n]) for n in got)
        got = {"o": fold(got["o"], Hkv), "dq": fold(got["dq"], Hkv), "dk": got["dk"], "dv": got["dv"]}
        if ref is not None:
            for name, value in got.items():
                row[f"max_diff_{name}_vs_first"] = float((value - ref[name]).abs().max())
                row[f"max_abs_{name}_first"] = float(ref[name].abs().max())
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        torch.use_deterministic_algorithms(was)
    return row


def main() -> None:
    p = shape_script_parser(__doc__, ["1:65536:16:4:128"])
    p.add_argument("--blocks", nargs="*", default=["128x128", "128x64", "128x64:bwd_BLOCK_N1=64"],
                   help="Flex window variants; none: no Flex call")
    p.add_argument("--no-cudnn", action="store_true", help="skip the chunked cuDNN calls")
    p.add_argument("--max-autotune", action="store_true", help="Inductor times its candidate Flex tiles")
    p.add_argument("--kernels", nargs="*", default=[], help='window op settings: "default" or "key=int,..."')
    p.add_argument("--fa2", action="store_true", help="also torch's FlashAttention-2 kernels with the window")
    args = p.parse_args()
    install_flex_tuning()
    if args.max_autotune:
        import torch._inductor.config as inductor_config

        inductor_config.max_autotune = True
    torch._dynamo.config.recompile_limit = 64
    rows, add = row_recorder(args.out, header(args.commit))
    for shape in args.shapes:
        B, T, Hq, Hkv, D = parse_shape(shape)
        cfg, x = make_inputs(B, T, Hq, Hkv, D)
        G, w = Hq // Hkv, cfg.window
        dense, dx = dense_cudnn(x, G)
        grad = torch.randn_like(dx["q"])
        add({"shape": shape, "what": "dense cuDNN", **_timed(dense, list(dx.values()), grad)})
        q_fold = fold(x["q"].detach(), Hkv).requires_grad_(True)
        k, v = (x[n].detach().requires_grad_(True) for n in ("k", "v"))
        ref = None
        g = None
        for blocks in args.blocks:
            win_block, extra = _parse_variant(blocks)
            _with_window_options(extra)
            tiles = FlexTiles(win_block=win_block)
            fn = torch.compile(lambda: window_branch(q_fold, k, v, cfg, D ** -0.5, tiles), fullgraph=True,
                               dynamic=False)
            try:
                out = fn()
                g = torch.randn_like(out) if g is None else g
                row = {"shape": shape, "what": f"flex window {blocks}", "max_autotune": args.max_autotune,
                       **_timed(fn, [q_fold, k, v], g)}
                got = _outputs(fn, [q_fold, k, v], g)
                ref = got if ref is None else ref
                for name, value in got.items():
                    row[f"max_diff_{name}_vs_first"] = float((value - ref[name]).abs().max())
            except Exception as exc:  # a block size Inductor has no tiles for: say so, go on
                row = {"shape": shape, "what": f"flex window {blocks}", "error": f"{type(exc).__name__}: {exc}"[:300]}
            add(row)
            torch.cuda.empty_cache()
        g = torch.randn(B, Hkv, T * G, cfg.head_dim, device="cuda", dtype=torch.bfloat16) if g is None else g
        for spec in args.kernels:
            row, got = _kernel_row(shape, spec, q_fold, k, v, G, w, D ** -0.5, g, ref)
            ref = got if ref is None else ref
            add(row)
            torch.cuda.empty_cache()
        if args.fa2:
            for deterministic in (False, True):
                add(_fa2_row(shape, x, Hkv, w, D ** -0.5, g, ref, deterministic))
                torch.cuda.empty_cache()
        # Two causal calls over chunks: A [B*nC, Hq, w, D] over [B*nC, Hkv, w, D];
        # B [B*(nC-1), Hq, w-1, D] over [B*(nC-1), Hkv, w-1, D].
        if args.no_cudnn:
            continue
        nC = -(-T // w)
        gen = torch.Generator(device="cuda").manual_seed(1)

        def rnd(*s):
            return torch.randn(*s, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_(True)

        for name, n, L in (("cudnn chunk call A (w)", B * nC, w), ("cudnn chunk call B (w-1)", B * (nC - 1), w - 1)):
            qa, ka, va = rnd(n, Hq, L, D), rnd(n, Hkv, L, D), rnd(n, Hkv, L, D)

            def call(qa=qa, ka=ka, va=va):
                return torch.ops.aten._scaled_dot_product_cudnn_attention(
                    qa, ka, va, None, True, 0.0, True, False, scale=D ** -0.5)[0]

            try:
                add({"shape": shape, "what": name, **_timed(call, [qa, ka, va], torch.randn_like(qa))})
            except Exception as exc:
                add({"shape": shape, "what": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
        del x, dx, q_fold, k, v
        torch.cuda.empty_cache()
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
