"""impl="flex" on the GPU: output and every gradient against an fp64 oracle, and the compiler.

Tolerance (STYLE #11): the error of flex (low-precision inputs) against the reference run in
fp64 on the same inputs stays within 2x the error of the reference run on the
low-precision inputs with its own math (fp32 accumulation), plus a rounding floor of a few
ulps of the dtype at the oracle's scale. Both runs use the block indices flex selected,
so a tie broken differently in low precision cannot change the comparison.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from nsa_flex import NSAConfig
from nsa_flex.compression import compressed_seqlens
from nsa_flex.flex import nsa_flex
from nsa_flex.reference import nsa_reference, nsa_reference_varlen
from nsa_flex.flex.tuning import FlexTiles, install_flex_tuning
from naive import random_inputs

pytestmark = pytest.mark.gpu

GRAD_INPUTS = ("q", "k", "v", "k_cmp", "v_cmp", "gates")
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# Rounding floor in ulps of the dtype at the oracle's scale. In bf16/fp16 the input rounding
# dominates both runs (measured flex errors: 0.1-0.2 ulp at the oracle's scale); in fp32 flex's kernels differ from the reference's
# cuBLAS math by more than the reference's own error (exp2 with log2(e) folded into the scale,
# online softmax over tiles, dK/dV summed over the group in another order): 6-8 ulps at the
# gradient's scale were measured for dK and dK_cmp on an H200
# (docs/decisions.md, the window branch through enable_gqa). A real indexing bug gave 60-110x errors.
FLOOR_ULPS = {BF16: 2, FP16: 2, FP32: 16}


def cuda_inputs(cfg: NSAConfig, T: int, B: int, dtype, seed: int = 0, scale_qk: float = 1.0) -> dict:
    x = random_inputs(cfg, T, B=B, seed=seed)
    x["q"] = x["q"] * scale_qk
    return {name: t.to("cuda", dtype).requires_grad_(True) for name, t in x.items()}


def run(fn, x: dict, do: torch.Tensor, **kwargs):
    """(o, {name: grad}, block_indices) of one forward + backward with output gradient do."""
    for t in x.values():
        t.grad = None
    o, sel = fn(**x, **kwargs)
    o.backward(do.to(o.dtype))
    # An empty k_cmp (a document shorter than l) gets no gradient at all: count it as zeros.
    grads = {name: torch.zeros_like(x[name]) if x[name].grad is None else x[name].grad.detach().clone()
             for name in GRAD_INPUTS}
    return o.detach(), grads, sel


def errors(x: dict, cfg: NSAConfig, do: torch.Tensor, o, grads, sel, reference=nsa_reference, **ref_kwargs) -> dict:
    """{name: (flex error, tolerance)} for the output and every gradient (ref_kwargs: e.g. the
    documents of nsa_reference_varlen)."""
    x64 = {n: t.detach().double().requires_grad_(True) for n, t in x.items()}
    o64, g64, _ = run(reference, x64, do.double(), config=cfg, block_indices=sel, **ref_kwargs)
    xlo = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    olo, glo, _ = run(reference, xlo, do, config=cfg, block_indices=sel, **ref_kwargs)
    eps = torch.finfo(o.dtype).eps
    out = {}
    for name, ours, ref, oracle in [("o", o, olo, o64)] + [(n, grads[n], glo[n], g64[n]) for n in GRAD_INPUTS]:
        ours_err = (ours.double() - oracle).abs().max().item()
        ref_err = (ref.double() - oracle).abs().max().item()
        floor = FLOOR_ULPS[o.dtype] * eps * oracle.abs().max().item()
        out[name] = (ours_err, 2 * ref_err + floor)
    return out


def assert_within_tolerance(report: dict) -> None:
    """Prints the error table (kept in the recorded GPU output) and fails on any entry over its tolerance."""
    print(f"\n{'':8} {'flex err':>10} {'tolerance':>10}")
    for name, (err, tol) in report.items():
        print(f"{name:8} {err:10.3e} {tol:10.3e}")
    bad = {name: v for name, v in report.items() if not v[0] <= v[1]}
    assert not bad, bad


CASES = [
    # (G, Hkv, Dk, Dv, T, B, dtype, n_selected, window)
    pytest.param(16, 1, 128, 128, 1000, 1, BF16, 16, 512, id="G16-D128-T1000-bf16"),
    pytest.param(4, 2, 192, 128, 333, 2, BF16, 4, 128, id="G4-Dk192-Dv128-T333-B2-bf16"),
    pytest.param(2, 2, 64, 32, 130, 1, FP16, 3, 64, id="G2-Dk64-Dv32-T130-fp16"),
    pytest.param(8, 1, 64, 64, 200, 1, FP32, 4, 128, id="G8-D64-T200-fp32"),
    pytest.param(1, 2, 128, 64, 77, 1, BF16, 3, 32, id="G1-Dk128-Dv64-T77-bf16"),
    # Dk = Dv = 128, 16-bit: the compressed branch runs the grouped cuDNN call, the selected one the block op.
    pytest.param(4, 2, 128, 128, 1111, 2, BF16, 16, 512, id="G4-D128-T1111-B2-bf16"),
    # G not a power of two: the window op's row tiles cross selection blocks, its local partial walks a loop more.
    pytest.param(3, 2, 128, 128, 1111, 1, BF16, 16, 512, id="G3-D128-T1111-bf16"),
    pytest.param(6, 1, 64, 64, 1500, 1, FP16, 16, 256, id="G6-D64-T1500-fp16"),
    # seeds-125m's heads (Dk = Dv = 64, G=4, 16-bit): the selected op's Gluon kernels on Hopper.
    pytest.param(4, 3, 64, 64, 1337, 1, BF16, 16, 512, id="G4-D64-T1337-bf16"),
]


# The selected branch: the default (the block-centric op at every group), or the Flex call forced
# with its long-T 16-row tiles.
SELECTED = {"block": FlexTiles(), "flex16": FlexTiles(sel_impl="flex", sel_q_block=16)}


@pytest.mark.parametrize("selected", list(SELECTED))
@pytest.mark.parametrize("G,Hkv,Dk,Dv,T,B,dtype,n,w", CASES)
def test_forward_backward_against_fp64_oracle(G, Hkv, Dk, Dv, T, B, dtype, n, w, selected):
    install_flex_tuning()
    cfg = NSAConfig(n_heads=G * Hkv, n_kv_heads=Hkv, head_dim=Dk, head_dim_v=Dv, n_selected=n, window=w)
    x = cuda_inputs(cfg, T, B, dtype, seed=T)
    do = torch.randn(B, T, G * Hkv, Dv, device="cuda", dtype=dtype)
    o, grads, sel = run(nsa_flex, x, do, config=cfg, tiles=SELECTED[selected])
    assert sel.shape == (B, Hkv, T, n)
    assert_within_tolerance(errors(x, cfg, do, o, grads, sel))


@pytest.mark.parametrize("G,Hkv,T,dtype,n_initial,min_rows", [
    pytest.param(16, 1, 1024, BF16, 1, 512, id="G16-T1024-bf16-16chunks"),
    pytest.param(4, 2, 768, FP16, 2, 256, id="G4-Hkv2-T768-fp16-init2-8chunks"),
    pytest.param(4, 2, 1000, BF16, 1, 256, id="G4-Hkv2-T1000-bf16"),
])
def test_chunked_rows_and_initial_split_against_fp64_oracle(G, Hkv, T, dtype, n_initial, min_rows):
    """The compressed branch's rows in chunks (extra heads) and, in the Flex selected call, the initial keys in
    copies (one per 256 tokens)."""
    install_flex_tuning()
    cfg = NSAConfig(n_heads=G * Hkv, n_kv_heads=Hkv, head_dim=128, n_selected=8, window=256, n_initial=n_initial)
    x = cuda_inputs(cfg, T, 1, dtype, seed=T)
    do = torch.randn(1, T, G * Hkv, 128, device="cuda", dtype=dtype)
    tiles = FlexTiles(sel_impl="flex", sel_q_block=16, min_chunk_rows=min_rows, split_initial=True,
                      initial_copy_tokens=256)
    o, grads, sel = run(nsa_flex, x, do, config=cfg, tiles=tiles)
    assert_within_tolerance(errors(x, cfg, do, o, grads, sel))


@pytest.mark.parametrize("Hkv,sel_impl", [(1, "flex"), (4, None)], ids=["G16-flex-selected", "G4-block-selected"])
def test_compiled_whole_op_one_frame_no_recompile(Hkv, sel_impl):
    """torch.compile(nsa_flex, fullgraph=True): one graph, matches eager, no recompile over 3 steps,
    with either selected branch (the Flex call forced at G=16, the default block-centric op at G=4)."""
    install_flex_tuning()
    cfg = NSAConfig(n_heads=16, n_kv_heads=Hkv, head_dim=128, n_selected=16, window=512)
    tiles = FlexTiles(sel_impl=sel_impl)
    x = cuda_inputs(cfg, 1000, 1, BF16, seed=1)
    do = torch.randn(1, 1000, 16, 128, device="cuda", dtype=BF16)
    o_eager, g_eager, sel_eager = run(nsa_flex, x, do, config=cfg, tiles=tiles)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(nsa_flex, fullgraph=True, dynamic=False)
    o, grads, sel = run(compiled, x, do, config=cfg, tiles=tiles)
    assert torch.equal(sel, sel_eager)
    torch.testing.assert_close(o, o_eager, atol=2e-2, rtol=2e-2)
    for name in GRAD_INPUTS:
        torch.testing.assert_close(grads[name], g_eager[name], atol=5e-2, rtol=5e-2)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(3):
            x = cuda_inputs(cfg, 1000, 1, BF16, seed=2 + step)
            run(compiled, x, do, config=cfg, tiles=tiles)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_compiled_whole_op_without_gradients_one_frame():
    """torch.compile(nsa_flex, fullgraph=True) under torch.no_grad (the gated sum in the selected op's
    merge, G=4): one graph, the eager call's selection and output."""
    install_flex_tuning()
    cfg = NSAConfig(n_heads=16, n_kv_heads=4, head_dim=128, n_selected=16, window=512)
    x = {name: t.detach() for name, t in cuda_inputs(cfg, 1000, 1, BF16, seed=3).items()}
    with torch.no_grad():
        o_eager, sel_eager = nsa_flex(**x, config=cfg)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        o, sel = torch.compile(nsa_flex, fullgraph=True, dynamic=False)(**x, config=cfg)
    assert torch.equal(sel, sel_eager)
    torch.testing.assert_close(o, o_eager, atol=2e-2, rtol=2e-2)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def default_path_inputs(T: int, B: int, dtype, documents: bool, seed: int):
    """(config, inputs, cu_seqlens or None, output gradient) of the default-path tests: Hq=8, Hkv=2,
    D=128; with documents two packed documents (700 and T - 700 tokens), k_cmp / v_cmp cut to theirs."""
    cfg = NSAConfig(n_heads=8, n_kv_heads=2, head_dim=128, n_selected=16, window=512)
    x = cuda_inputs(cfg, T, B, dtype, seed=seed)
    cu = torch.tensor([0, 700, T], device="cuda", dtype=torch.int32) if documents else None
    if documents:
        Tc = int(compressed_seqlens(cu, cfg)[-1])
        x["k_cmp"] = x["k_cmp"][:, :Tc].detach().clone().requires_grad_(True)
        x["v_cmp"] = x["v_cmp"][:, :Tc].detach().clone().requires_grad_(True)
    return cfg, x, cu, torch.randn(B, T, 8, 128, device="cuda", dtype=dtype)


@pytest.mark.parametrize("T,B,documents", [(1111, 2, False), (333, 1, False), (1500, 1, True)],
                         ids=["T1111-B2", "T333-second-shape", "T1500-documents"])
def test_default_compiled_path_against_fp64_oracle(T, B, documents):
    """nsa_attention's default on CUDA (one compiled graph per shape, nsa_flex.flex.compiled): output
    and every gradient against the fp64 oracle, at a new shape each (each compiles its own graph)."""
    from nsa_flex import nsa_attention

    cfg, x, cu, do = default_path_inputs(T, B, BF16, documents, seed=T)
    torch._dynamo.utils.counters.clear()
    with warnings.catch_warnings():
        # The eager fallback after a compiler failure (nsa_flex.flex.compiled) fails the test.
        warnings.filterwarnings("error", message="(?s).*runs eagerly from now on")
        o, grads, sel = run(nsa_attention, x, do, config=cfg, impl="flex", return_indices=True, cu_seqlens=cu)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1, "the default path did not compile"
    docs = {"reference": nsa_reference_varlen, "cu_seqlens": cu,
            "cu_seqlens_cmp": compressed_seqlens(cu, cfg)} if documents else {}
    assert_within_tolerance(errors(x, cfg, do, o, grads, sel, **docs))


@pytest.mark.parametrize("T,B,documents,dtype", [(1111, 2, False, BF16), (1500, 1, True, BF16), (333, 1, False, FP32)],
                         ids=["T1111-B2-bf16", "T1500-documents-bf16", "T333-fp32-flex-compressed"])
def test_default_path_without_gradients(T, B, documents, dtype):
    """nsa_attention under torch.no_grad (the gated sum in the selected op's merge, compiled): the
    training call's selection, its output within one rounding, and the output against the fp64
    oracle (the gradients there are the training call's)."""
    from nsa_flex import nsa_attention

    cfg, x, cu, do = default_path_inputs(T, B, dtype, documents, seed=T + 5)
    kwargs = dict(config=cfg, impl="flex", return_indices=True, cu_seqlens=cu)
    o_train, grads, sel = run(nsa_attention, x, do, **kwargs)
    with torch.no_grad(), warnings.catch_warnings():
        # The eager fallback after a compiler failure (nsa_flex.flex.compiled) fails the test.
        warnings.filterwarnings("error", message="(?s).*runs eagerly from now on")
        o, sel_no_grad = nsa_attention(**x, **kwargs)
    assert torch.equal(sel_no_grad, sel)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(o, o_train, rtol=eps, atol=eps * o_train.abs().max().item())
    docs = {"reference": nsa_reference_varlen, "cu_seqlens": cu,
            "cu_seqlens_cmp": compressed_seqlens(cu, cfg)} if documents else {}
    assert_within_tolerance(errors(x, cfg, do, o, grads, sel, **docs))


def test_document_masking_equals_separate_documents():
    """Packed documents (cu_seqlens) give what running every document on its own gives."""
    install_flex_tuning()
    cfg = NSAConfig(n_heads=8, n_kv_heads=2, head_dim=64, n_selected=4, window=128)
    lengths = [300, 17, 700, 40]
    from nsa_flex.compression import compressed_seqlens

    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device="cuda", dtype=torch.int32)
    cu_cmp = compressed_seqlens(cu, cfg)
    T, Tc = sum(lengths), int(cu_cmp[-1])
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to("cuda", BF16).requires_grad_(True)

    x = {"q": randn(1, T, 8, 64), "k": randn(1, T, 2, 64), "v": randn(1, T, 2, 64),
         "k_cmp": randn(1, Tc, 2, 64), "v_cmp": randn(1, Tc, 2, 64),
         "gates": torch.rand(1, T, 8, 3, generator=gen).to("cuda", BF16).requires_grad_(True)}
    do = torch.randn(1, T, 8, 64, device="cuda", dtype=BF16)
    o, grads, sel = run(nsa_flex, x, do, config=cfg, cu_seqlens=cu)
    # Each document on its own through the same flex path.
    starts, cstarts = cu.tolist(), cu_cmp.tolist()
    for i, _ in enumerate(lengths):
        s, e, cs, ce = starts[i], starts[i + 1], cstarts[i], cstarts[i + 1]
        xi = {n: (t.detach()[:, cs:ce] if n in ("k_cmp", "v_cmp") else t.detach()[:, s:e]).clone().requires_grad_(True)
              for n, t in x.items()}
        oi, gi, seli = run(nsa_flex, xi, do[:, s:e], config=cfg, block_indices=sel[:, :, s:e])
        torch.testing.assert_close(o[:, s:e], oi, atol=2e-2, rtol=2e-2)
        for name in GRAD_INPUTS:
            rows = slice(cs, ce) if name in ("k_cmp", "v_cmp") else slice(s, e)
            torch.testing.assert_close(grads[name][:, rows], gi[name], atol=5e-2, rtol=5e-2)
    # And the semantics: the varlen reference.
    o_ref, _ = nsa_reference_varlen(*(x[n].detach().float() for n in GRAD_INPUTS), cfg, cu, cu_cmp,
                                    block_indices=sel)
    torch.testing.assert_close(o.float(), o_ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("split", [1, 2], ids=["rows", "heads"])
@pytest.mark.parametrize("N,H,L,D", [(4, 64, 1000, 64), (3, 8, 513, 128), (9, 16, 300, 64)])
def test_cudnn_backward_slices_match_one_call(N, H, L, D, split, monkeypatch):
    """_CudnnCausal's backward over slices against one cuDNN call through torch's own autograd: a
    batch row a call, or half a row's heads a call. The same output and lse bit for bit, and
    gradients within what two runs of that one call differ by (cuDNN's dQ sums blocks in no fixed
    order) plus one rounding of the largest, and with heads split one rounding more per call for
    dK / dV (their sum over the calls, cudnn_backward)."""
    from nsa_flex.flex import compressed_groups
    from nsa_flex.flex.compressed_groups import _CudnnCausal, backward_slices

    per_row = 4 * H * L * 2 * D
    monkeypatch.setattr(compressed_groups, "CUDNN_BACKWARD_BYTES", per_row // split)
    assert backward_slices(N, H, 1, L, D, D) == (1, H // split)
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(N, H, L, D, device="cuda", dtype=BF16, generator=g).requires_grad_()
    k, v = (torch.randn(N, 1, L, D, device="cuda", dtype=BF16, generator=g).requires_grad_() for _ in range(2))
    do = torch.randn(N, H, L, D, device="cuda", dtype=BF16, generator=g)
    scale = D ** -0.5
    o, lse = _CudnnCausal.apply(q, k, v, scale)
    ours = torch.autograd.grad(o, (q, k, v), do)

    def one_call():
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)
        return out, torch.autograd.grad(out[0], (q, k, v), do)

    out, theirs = one_call()
    _, again = one_call()
    assert torch.equal(o, out[0]) and torch.equal(lse, out[1])
    eps = torch.finfo(BF16).eps
    for name, a, b, b2 in zip(("dq", "dk", "dv"), ours, theirs, again):
        spread = (b.float() - b2.float()).abs().max().item()
        diff = (a.float() - b.float()).abs().max().item()
        roundings = 1 if name == "dq" else split
        bound = 2 * spread + roundings * eps * b.float().abs().max().item()
        assert diff <= bound, f"{name}: {diff} (runs differ by {spread})"


@pytest.mark.parametrize("G,Hkv,D,T,B,dtype", [
    pytest.param(4, 4, 128, 4099, 2, BF16, id="G4-D128-T4099-B2-bf16"),
    pytest.param(16, 1, 128, 1000, 1, BF16, id="G16-D128-T1000-bf16"),
    pytest.param(1, 2, 64, 777, 1, FP16, id="G1-D64-T777-fp16"),
    pytest.param(4, 1, 64, 40, 1, BF16, id="G4-D64-T40-one-block"),
])
def test_compressed_cudnn_against_fp64_oracle(G, Hkv, D, T, B, dtype):
    """The grouped cuDNN call: o, lse and dq / dk_cmp / dv_cmp within 2x the Flex call's error
    against the fp64 dense branch (same inputs), plus the floor."""
    from nsa_flex.flex import compressed_branch, fold
    from naive import compressed_dense

    install_flex_tuning()
    cfg = NSAConfig(n_heads=G * Hkv, n_kv_heads=Hkv, head_dim=D)
    x = cuda_inputs(cfg, T, B, dtype, seed=3)
    q, kc, vc = x["q"], x["k_cmp"], x["v_cmp"]
    scale = D ** -0.5
    do = torch.randn(B, Hkv, T * G, D, device="cuda", dtype=dtype)
    results = {}
    for impl in ("cudnn", "flex"):
        o, lse = compressed_branch(fold(q, Hkv), kc, vc, cfg, scale, FlexTiles(cmp_impl=impl))
        o = o.dense(T * G)
        grads = torch.autograd.grad(o, (q, kc, vc), do)
        # folded [B, Hkv, T*G, D] -> [B, Hq, T, D], the oracle's layout
        results[impl] = (o.detach().view(B, Hkv, T, G, D).transpose(2, 3).reshape(B, Hkv * G, T, D), lse, *grads)
    x64 = [t.detach().double().requires_grad_(True) for t in (q, kc, vc)]
    o64, lse64 = compressed_dense(*x64, cfg, scale)
    do64 = do.double().view(B, Hkv, T, G, D).transpose(2, 3).reshape(B, Hkv * G, T, D)
    g64 = torch.autograd.grad(o64, x64, do64)
    eps = torch.finfo(dtype).eps
    report = {}
    finite = lse64.isfinite()
    assert torch.equal(results["cudnn"][1].isfinite(), finite)
    for i, (name, oracle) in enumerate([("o", o64), ("lse", lse64), ("dq", g64[0]), ("dk_cmp", g64[1]),
                                        ("dv_cmp", g64[2])]):
        ours, flex = results["cudnn"][i].double(), results["flex"][i].double()
        if name == "lse":
            ours, flex, oracle = ours[finite], flex[finite], oracle[finite]
        err = (ours - oracle).abs().max().item()
        flex_err = (flex - oracle).abs().max().item()
        report[name] = (err, 2 * flex_err + FLOOR_ULPS[dtype] * eps * oracle.abs().max().item())
    assert_within_tolerance(report)
