"""nsa_flex::select_blocks: the torch twin against the reference, the op's registration, and
(marked gpu) the Triton kernel against the twin.

Random inputs can hold near-ties that rounding orders either way; those comparisons accept a
differing block only when its importance is within a derived tolerance of the row's n-th best
(nsa_flex.ops.select.checks.importance_tolerance). Hand-built cases (weights, ties, no compressed tokens)
compare exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from nsa_flex.ops.select.checks import assert_same_selection, importance_scores, importance_tolerance, scores_fp64, visible
from nsa_flex.ops.select.kernels import list_tile_bits

from nsa_flex import reference
from nsa_flex.blocks import num_cmp_blocks, num_sel_blocks
from nsa_flex.compression import compressed_seqlens
from nsa_flex.config import NSAConfig
from nsa_flex.ops import select_blocks, select_blocks_torch

gpu = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

# Geometries: the paper's (weights 1,2,2,2,1), l' = l (weights 1,1 across two blocks), l = d
# (no overlap), and l > l' (a compression block spans a selection-block boundary with weight 4).
GEOMETRIES = {
    "paper": dict(cmp_block=32, cmp_stride=16, sel_block=64),
    "sel32": dict(cmp_block=32, cmp_stride=16, sel_block=32),
    "no_overlap": dict(cmp_block=16, cmp_stride=16, sel_block=64, n_initial=2, n_local=1),
    "long_cmp": dict(cmp_block=80, cmp_stride=16, sel_block=64, n_local=3),
}


def make_config(G: int, Dk: int, n: int, geometry: str = "paper", Hkv: int = 2) -> NSAConfig:
    return NSAConfig(n_heads=G * Hkv, n_kv_heads=Hkv, head_dim=Dk, n_selected=n, **GEOMETRIES[geometry])


def make_inputs(B, T, config, dtype=torch.float32, seed=0, device="cpu", cu_seqlens=None):
    """Random q, k_cmp and the exact lse (fp64, stored as fp32) of the compressed scores."""
    g = torch.Generator().manual_seed(seed)
    Hq, Hkv, Dk = config.n_heads, config.n_kv_heads, config.head_dim
    Tc = num_cmp_blocks(T, config) if cu_seqlens is None else int(compressed_seqlens(cu_seqlens, config)[-1])
    q = torch.randn(B, T, Hq, Dk, generator=g).to(dtype)
    k_cmp = torch.randn(B, Tc, Hkv, Dk, generator=g).to(dtype)
    scale = Dk ** -0.5
    lse = torch.empty(B, Hq, T, dtype=torch.float64)
    for s, e, cs, ce in _documents(T, Tc, config, cu_seqlens):
        scores = scores_fp64(q[:, s:e], k_cmp[:, cs:ce], scale)
        vis = visible(e - s, ce - cs, config)
        lse[:, :, s:e] = torch.logsumexp(scores.masked_fill(~vis, -math.inf), dim=-1)
    return q.to(device), k_cmp.to(device), lse.float().to(device)


def reference_selection(q, k_cmp, lse, config, scale=None, cu_seqlens=None):
    """(indices [B,Hkv,T,n], scores [B,Hkv,T,Ns]) from nsa_flex.reference on fp64 p_cmp.

    p_cmp = exp(scale * q.k_cmp - lse) on visible blocks, the op's definition; scores are
    the importance with forced blocks +inf and blocks after the query's own -inf.
    """
    q, k_cmp, lse = q.cpu(), k_cmp.cpu(), lse.cpu()
    B, T, Hq, Dk = q.shape
    G = Hq // k_cmp.shape[2]
    scale = Dk ** -0.5 if scale is None else scale
    Ns = num_sel_blocks(T, config)
    indices = torch.full((B, config.n_kv_heads, T, config.n_selected), -1, dtype=torch.int64)
    scores = torch.full((B, config.n_kv_heads, T, Ns), -math.inf, dtype=torch.float64)
    for s, e, cs, ce in _documents(T, k_cmp.shape[1], config, cu_seqlens):
        vis = visible(e - s, ce - cs, config)
        s_bhtc = scores_fp64(q[:, s:e], k_cmp[:, cs:ce], scale)
        p = torch.where(vis, torch.exp(s_bhtc - lse[:, :, s:e, None].double()), 0.0)
        indices[:, :, s:e] = reference.select_blocks(p, e - s, G, config)
        scores[:, :, s:e, : num_sel_blocks(e - s, config)] = importance_scores(p, e - s, G, config)
    return indices, scores


def selection_tolerance(q, k_cmp, lse, config, scale=None) -> float:
    """importance_tolerance for these inputs (0 without compressed tokens), with the score bits the
    selection kernel's lists may clear at this length (tiles of 4 selection blocks or more)."""
    if k_cmp.shape[1] == 0:
        return 0.0
    Dk = q.shape[-1]
    scale = Dk ** -0.5 if scale is None else scale
    q64, k64 = q.cpu().double(), k_cmp.cpu().double()
    abs_dot = scale * q64.norm(dim=-1).max().item() * k64.norm(dim=-1).max().item()
    s_minus_lse = scores_fp64(q64, k64, scale) - lse.cpu().double()[..., None]
    finite = torch.where(torch.isfinite(s_minus_lse), s_minus_lse.abs(), 0.0)
    return importance_tolerance(Dk, q.shape[2] // k_cmp.shape[2], config, abs_dot, finite.max().item(),
                                cleared_bits=list_tile_bits(num_sel_blocks(q.shape[1], config), 4))


def _documents(T, Tc, config, cu_seqlens):
    """(start, end, cmp start, cmp end) of each document; one document without cu_seqlens."""
    if cu_seqlens is None:
        return [(0, T, 0, Tc)]
    cu, cu_cmp = cu_seqlens.tolist(), compressed_seqlens(cu_seqlens, config).tolist()
    return list(zip(cu[:-1], cu[1:], cu_cmp[:-1], cu_cmp[1:]))


# ----- the twin against the reference (CPU) -----

SHAPES = [
    pytest.param(T, G, Dk, n, geometry, id=f"T{T}-G{G}-D{Dk}-n{n}-{geometry}")
    for T in (1, 31, 32, 63, 64, 65, 200, 1000)
    for G, Dk, n, geometry in ((1, 64, 4, "paper"), (2, 32, 3, "sel32"), (3, 192, 5, "no_overlap"),
                               (4, 128, 16, "paper"), (16, 64, 6, "long_cmp"))
]


@pytest.mark.parametrize("T, G, Dk, n, geometry", SHAPES)
def test_twin_matches_reference(T, G, Dk, n, geometry):
    config = make_config(G, Dk, n, geometry)
    q, k_cmp, lse = make_inputs(2, T, config, seed=T * 31 + G)
    got = select_blocks(q, k_cmp, lse, config)
    assert got.dtype == torch.int32 and got.shape == (2, 2, T, n)
    want, scores = reference_selection(q, k_cmp, lse, config)
    assert_same_selection(got, want, scores, selection_tolerance(q, k_cmp, lse, config))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_twin_dtypes(dtype):
    config = make_config(4, 64, 5)
    q, k_cmp, lse = make_inputs(1, 700, config, dtype=dtype, seed=3)
    # An explicit scale too: the op must use it for p, not Dk ** -0.5.
    scale = 0.1 if dtype == torch.float64 else None
    got = select_blocks(q, k_cmp, lse, config, scale=scale)
    want, scores = reference_selection(q, k_cmp, lse, config, scale=scale)
    assert_same_selection(got, want, scores, selection_tolerance(q, k_cmp, lse, config, scale=scale))


def test_twin_chunks_rows(monkeypatch):
    """Row chunking (bounded memory) changes nothing: one-row chunks give the same result."""
    from nsa_flex.ops.select import op as select_module

    config = make_config(2, 32, 4)
    q, k_cmp, lse = make_inputs(1, 400, config, seed=5)
    whole = select_blocks_torch(q, k_cmp, lse, config)
    # Chunks of 7 rows: the last one partial.
    monkeypatch.setattr(select_module, "_TWIN_CHUNK_ELEMENTS", 7 * config.n_heads * k_cmp.shape[1])
    assert torch.equal(select_blocks_torch(q, k_cmp, lse, config), whole)


def test_varlen_matches_reference_varlen():
    """Packed documents select independently with document-local ids, as nsa_reference_varlen does."""
    config = make_config(2, 32, 4)
    # Lengths 100, 1 (no compressed token), 20, 575, 64: short, empty and exact-block documents.
    cu = torch.tensor([0, 100, 101, 121, 696, 760], dtype=torch.int32)
    cu_cmp = compressed_seqlens(cu, config)
    T = int(cu[-1])
    q, k_cmp, lse = make_inputs(1, T, config, seed=11, cu_seqlens=cu)
    got = select_blocks(q, k_cmp, lse, config, cu_seqlens=cu, cu_seqlens_cmp=cu_cmp)
    # nsa_reference_varlen recomputes p_cmp itself from q and k_cmp (fp64 inputs: fp64 math).
    Hkv, Dk = config.n_kv_heads, config.head_dim
    k = torch.randn(1, T, Hkv, Dk, dtype=torch.float64)
    v_cmp = torch.randn(1, k_cmp.shape[1], Hkv, Dk, dtype=torch.float64)
    gates = torch.rand(1, T, config.n_heads, 3, dtype=torch.float64)
    _, want = reference.nsa_reference_varlen(q.double(), k, k, k_cmp.double(), v_cmp, gates, config, cu, cu_cmp)
    _, scores = reference_selection(q, k_cmp, lse, config, cu_seqlens=cu)
    assert_same_selection(got, want, scores, selection_tolerance(q, k_cmp, lse, config))
    # The 1-token document selects only its block 0.
    assert got[0, :, 100].tolist() == [[0, -1, -1, -1]] * Hkv


def _hand_inputs(p_by_head, T, config):
    """q, k_cmp, lse for which p_cmp[h, t, i] = p_by_head[h][i] for the last token (one kv head).

    k_cmp[i] = e_i and q = ln(p) / scale, lse = 0: scale * q . k_i = ln p_i.
    """
    Tc = num_cmp_blocks(T, config)
    Dk = config.head_dim
    scale = Dk ** -0.5
    q = torch.zeros(1, T, config.n_heads, Dk)
    for h, p in enumerate(p_by_head):
        q[0, :, h, :Tc] = torch.log(torch.tensor(p, dtype=torch.float64)).float() / scale
    k_cmp = torch.eye(Tc, Dk).view(1, Tc, 1, Dk)
    return q, k_cmp, torch.zeros(1, config.n_heads, T)


def test_hand_computed_weights_and_group_sum():
    """Weights 1,2,2,2,1 and the sum over the group's heads, worked out by hand.

    T = 512 tokens: Tc = 31 compression blocks, Ns = 8 selection blocks, the last token sees
    them all. n = 4: blocks 0, 6, 7 are forced, one slot is free. Selection block j gets
    compression blocks 4j-1 .. 4j+3 with weights 1, 2, 2, 2, 1. p is 1e-6 elsewhere and
      head 0: p[11] = 0.30 (tokens 176-207: weight 1 to sel 2 and 1 to sel 3)
              p[17] = 0.20 (tokens 272-303, inside sel 4: weight 2)
      head 1: p[13] = 0.12 (tokens 208-239, inside sel 3: weight 2)
              p[9]  = 0.05 (tokens 144-175, inside sel 2: weight 2)
    Head 0 alone: sel 2 = sel 3 = 0.30, sel 4 = 0.40 -> block 4 (a weight of 2 for the
    boundary block 11 would give 0.60 and block 2). Group sum: sel 2 = 0.30 + 0.10 = 0.40,
    sel 3 = 0.30 + 0.24 = 0.54, sel 4 = 0.40 -> block 3 (a max over heads would give 4).
    """
    config = NSAConfig(n_heads=2, n_kv_heads=1, head_dim=32, n_selected=4)
    T = 512
    p0, p1 = [1e-6] * 31, [1e-6] * 31
    p0[11], p0[17], p1[13], p1[9] = 0.30, 0.20, 0.12, 0.05
    q, k_cmp, lse = _hand_inputs([p0, p1], T, config)
    assert select_blocks(q, k_cmp, lse, config)[0, 0, T - 1].tolist() == [0, 3, 6, 7]
    one_head = config.replace(n_heads=1)
    q0, k0, lse0 = _hand_inputs([p0], T, one_head)
    assert select_blocks(q0, k0, lse0, one_head)[0, 0, T - 1].tolist() == [0, 4, 6, 7]


def test_tie_break_lower_index_first():
    """q = 0 and lse = 0: every visible compression block has p = 1 exactly, so interior
    blocks tie exactly; the lowest ids win. T = 1024, n = 5, last token: forced 0, 14, 15;
    blocks 1..13 all have importance 2 heads x 8; the free slots go to blocks 1 and 2."""
    config = NSAConfig(n_heads=4, n_kv_heads=2, head_dim=16, n_selected=5)
    T = 1024
    q = torch.zeros(1, T, 4, 16)
    k_cmp = torch.randn(1, num_cmp_blocks(T, config), 2, 16)
    lse = torch.zeros(1, 4, T)
    got = select_blocks(q, k_cmp, lse, config)
    assert got[0, :, T - 1].tolist() == [[0, 1, 2, 14, 15]] * 2
    want, _ = reference_selection(q, k_cmp, lse, config)
    assert torch.equal(got.long(), want)


@pytest.mark.parametrize("T", [1, 20, 31])
def test_no_compressed_tokens(T):
    """T < l: Tc = 0, lse -inf everywhere; only block 0 can be (and is) selected."""
    config = make_config(2, 32, 4)
    q = torch.randn(1, T, 4, 32)
    k_cmp = torch.empty(1, 0, 2, 32)
    lse = torch.full((1, 4, T), -math.inf)
    got = select_blocks(q, k_cmp, lse, config)
    assert got.tolist() == [[[[0, -1, -1, -1]] * T] * 2]


@pytest.mark.parametrize("change, error, message", [
    (dict(q=torch.randn(2, 8, 4)), ValueError, "q must be"),
    (dict(k_cmp=torch.randn(1, 3, 2, 16)), ValueError, "does not fit"),
    (dict(k_cmp=torch.randn(1, 3, 3, 32)), ValueError, "multiple of"),
    (dict(k_cmp=torch.randn(1, 3, 2, 32).double()), TypeError, "must match"),
    (dict(lse_cmp=torch.zeros(1, 4, 64).double()), TypeError, "float32"),
    (dict(lse_cmp=torch.zeros(1, 2, 64)), ValueError, r"\[B, Hq, T\]"),
    (dict(q=torch.randn(1, 64, 4, 32).int()), TypeError, "allowed"),
    (dict(cu_seqlens=torch.tensor([0, 64], dtype=torch.int32)), ValueError, "together"),
    (dict(cu_seqlens=torch.tensor([[0, 64]]), cu_seqlens_cmp=torch.tensor([[0, 3]])), ValueError, "1-D"),
], ids=["q-dims", "k-dim", "heads", "k-dtype", "lse-dtype", "lse-shape", "q-dtype", "cu-alone", "cu-2d"])
def test_bad_inputs(change, error, message):
    config = make_config(2, 32, 4)
    args = dict(q=torch.randn(1, 64, 4, 32), k_cmp=torch.randn(1, 3, 2, 32), lse_cmp=torch.zeros(1, 4, 64))
    kwargs = {key: change.pop(key) for key in ("cu_seqlens", "cu_seqlens_cmp") if key in change}
    args.update(change)
    with pytest.raises(error, match=message):
        select_blocks(args["q"], args["k_cmp"], args["lse_cmp"], config, **kwargs)


def test_varlen_needs_batch_one():
    config = make_config(2, 32, 4)
    cu = torch.tensor([0, 64], dtype=torch.int32)
    with pytest.raises(ValueError, match="batch size 1"):
        select_blocks(torch.randn(2, 64, 4, 32), torch.randn(2, 3, 2, 32), torch.zeros(2, 4, 64), config,
                      cu_seqlens=cu, cu_seqlens_cmp=compressed_seqlens(cu, config))


# ----- the op: registration and compilation -----

def _op_samples(device, dtype=torch.float32):
    config = make_config(2, 32, 4)
    q, k_cmp, lse = make_inputs(1, 100, config, dtype=dtype, seed=1, device=device)
    out = [(q, k_cmp, lse, None, None, 0.17, 32, 16, 64, 4, 1, 2)]
    cu = torch.tensor([0, 70, 71, 300], dtype=torch.int32)
    q, k_cmp, lse = make_inputs(1, 300, config, dtype=dtype, seed=9, device=device, cu_seqlens=cu)
    out.append((q, k_cmp, lse, cu.to(device), compressed_seqlens(cu, config).to(device), 0.17, 32, 16, 64, 4, 1, 2))
    return out


def test_opcheck_cpu():
    for args in _op_samples("cpu"):
        torch.library.opcheck(torch.ops.nsa_flex.select_blocks.default, args)


def _compiled_matches_eager(device, dtype=torch.float32):
    from torch._dynamo.testing import CompileCounterWithBackend

    config = make_config(4, 64, 6)
    counter = CompileCounterWithBackend("inductor")

    @torch.compile(backend=counter, fullgraph=True, dynamic=False)
    def step(q, k_cmp, lse):
        # Something around the op too, so the graph is more than the op alone.
        return select_blocks(q * 1.0, k_cmp, lse, config) + 0

    for seed in (0, 1):
        q, k_cmp, lse = make_inputs(1, 333, config, dtype=dtype, seed=seed, device=device)
        assert torch.equal(step(q, k_cmp, lse), select_blocks(q, k_cmp, lse, config))
    assert counter.frame_count == 1, "one compiled frame, no recompile on new data"


def test_compile_fullgraph_cpu():
    torch._dynamo.reset()
    _compiled_matches_eager("cpu")


# ----- the Triton kernel (GPU) -----

GPU_SHAPES = [
    pytest.param(B, T, G, Dk, n, geometry, dtype, id=f"B{B}-T{T}-G{G}-D{Dk}-n{n}-{geometry}-{str(dtype)[6:]}")
    for B, T, G, Dk, n, geometry, dtype in [
        (2, 31, 2, 64, 16, "paper", torch.bfloat16),
        (1, 1000, 3, 192, 4, "paper", torch.float32),
        (2, 1000, 16, 128, 16, "paper", torch.float16),
        (1, 4099, 16, 192, 16, "paper", torch.bfloat16),
        (1, 4099, 4, 128, 32, "paper", torch.bfloat16),
        (1, 3000, 1, 64, 5, "sel32", torch.bfloat16),
        (1, 2000, 8, 64, 6, "long_cmp", torch.float32),
    ]
]


@gpu
@pytest.mark.parametrize("B, T, G, Dk, n, geometry, dtype", GPU_SHAPES)
def test_kernel_matches_twin(B, T, G, Dk, n, geometry, dtype):
    config = make_config(G, Dk, n, geometry)
    q, k_cmp, lse = make_inputs(B, T, config, dtype=dtype, seed=T + G, device="cuda")
    got = select_blocks(q, k_cmp, lse, config)
    twin = select_blocks_torch(q, k_cmp, lse, config)
    _, scores = reference_selection(q, k_cmp, lse, config)
    assert_same_selection(got, twin.long(), scores, selection_tolerance(q, k_cmp, lse, config))


@gpu
def test_kernel_varlen():
    config = make_config(4, 128, 6)
    cu = torch.tensor([0, 100, 101, 121, 2696, 2760, 5000], dtype=torch.int32)
    q, k_cmp, lse = make_inputs(1, 5000, config, dtype=torch.bfloat16, seed=2, device="cuda", cu_seqlens=cu)
    cu_cmp = compressed_seqlens(cu, config)
    got = select_blocks(q, k_cmp, lse, config, cu_seqlens=cu.cuda(), cu_seqlens_cmp=cu_cmp.cuda())
    want, scores = reference_selection(q, k_cmp, lse, config, cu_seqlens=cu)
    assert_same_selection(got, want, scores, selection_tolerance(q, k_cmp, lse, config))


@gpu
def test_kernel_exact_cases():
    """Ties and the hand-computed weights give exactly the CPU answer on the GPU."""
    config = NSAConfig(n_heads=4, n_kv_heads=2, head_dim=16, n_selected=5)
    T = 1024
    args = (torch.zeros(1, T, 4, 16), torch.randn(1, num_cmp_blocks(T, config), 2, 16), torch.zeros(1, 4, T))
    assert torch.equal(select_blocks(*(x.cuda() for x in args), config).cpu(), select_blocks(*args, config))
    args = (torch.randn(1, 20, 4, 16), torch.empty(1, 0, 2, 16), torch.full((1, 4, 20), -math.inf))
    assert torch.equal(select_blocks(*(x.cuda() for x in args), config).cpu(), select_blocks(*args, config))


@gpu
def test_opcheck_cuda():
    for args in _op_samples("cuda", torch.bfloat16):
        torch.library.opcheck(torch.ops.nsa_flex.select_blocks.default, args)


@gpu
def test_compile_fullgraph_cuda():
    torch._dynamo.reset()
    _compiled_matches_eager("cuda", torch.bfloat16)
