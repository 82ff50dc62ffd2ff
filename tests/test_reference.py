"""nsa_flex.reference against a naive per-token NSA, hand-computed cases, causality, gradients."""

from __future__ import annotations

import pytest
import torch

from nsa_flex import NSAConfig, nsa_attention
from nsa_flex.blocks import cmp_to_sel_weights, forced_and_valid
from nsa_flex.compression import compressed_seqlens
from nsa_flex.reference import nsa_reference, select_blocks
from naive import naive_nsa, overlap_weights, padded_indices, random_inputs

# Small sparsity geometries; head counts are filled in per test (G = n_heads / n_kv_heads).
GEOMETRIES = {
    # The paper's l, d, l' with a small n and window: selection matters from T > 2 * 64.
    "l32d16s64": dict(cmp_block=32, cmp_stride=16, sel_block=64, n_selected=4, window=128,
                      head_dim=16, head_dim_v=8),
    # Other l, d, l' (same ratios, smaller): tests the general overlap formula.
    "l16d8s32": dict(cmp_block=16, cmp_stride=8, sel_block=32, n_selected=3, n_local=1, window=40,
                     head_dim=12, head_dim_v=20),
    # Selection blocks as small as compression blocks, two initial blocks, one local.
    "l8d4s8": dict(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=5, n_initial=2, n_local=1,
                   window=16, head_dim=8, head_dim_v=4),
    # Compression blocks that do not overlap (d = l), no initial block forced.
    "l8d8s16": dict(cmp_block=8, cmp_stride=8, sel_block=16, n_selected=4, n_initial=0, n_local=2,
                    window=24, head_dim=8, head_dim_v=12),
}
TS = (1, 15, 16, 31, 32, 33, 63, 64, 65, 130)
GROUPS = (1, 2, 3, 4, 16)


def make_config(geometry: str, G: int, n_kv_heads: int = 1, **changes) -> NSAConfig:
    return NSAConfig(n_heads=G * n_kv_heads, n_kv_heads=n_kv_heads, **{**GEOMETRIES[geometry], **changes})


def _naive_cases():
    cases = []
    # Paper geometry: every T with every group size; two kv heads where the group is small.
    for T in TS:
        for G in GROUPS:
            cases.append(pytest.param("l32d16s64", T, G, 2 if G <= 4 else 1, id=f"l32d16s64-T{T}-G{G}"))
    # Other geometries: every T, the group size cycling so each one meets each G.
    for k, geometry in enumerate(("l16d8s32", "l8d4s8", "l8d8s16")):
        for i, T in enumerate(TS):
            G = GROUPS[(i + k) % len(GROUPS)]
            cases.append(pytest.param(geometry, T, G, 1, id=f"{geometry}-T{T}-G{G}"))
    # T = 600 with few heads only: the naive loops are slow.
    cases += [
        pytest.param("l32d16s64", 600, 2, 1, id="l32d16s64-T600-G2"),
        pytest.param("l16d8s32", 600, 1, 2, id="l16d8s32-T600-G1-Hkv2"),
    ]
    return cases


@pytest.mark.parametrize("geometry, T, G, n_kv_heads", _naive_cases())
def test_reference_matches_naive(geometry, T, G, n_kv_heads):
    cfg = make_config(geometry, G, n_kv_heads)
    x = random_inputs(cfg, T, seed=T * 31 + G)
    o, idx = nsa_reference(**x, config=cfg)
    o_naive, selected = naive_nsa(**x, cfg=cfg)
    assert o.dtype == torch.float64 and o.shape == (1, T, cfg.n_heads, cfg.dv)
    assert torch.equal(idx, padded_indices(selected, cfg.n_selected))
    torch.testing.assert_close(o, o_naive, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("B", [pytest.param(1, id="B1"), pytest.param(3, id="B3")])
def test_reference_matches_naive_batched_window_kv(B):
    # Batch entries independent; the window branch reads its own k_win / v_win.
    cfg = make_config("l16d8s32", G=2, n_kv_heads=2)
    x = random_inputs(cfg, 70, B=B, seed=5, window_kv=True)
    o, idx = nsa_reference(**x, config=cfg)
    o_naive, selected = naive_nsa(**x, cfg=cfg)
    assert torch.equal(idx, padded_indices(selected, cfg.n_selected))
    torch.testing.assert_close(o, o_naive, rtol=1e-10, atol=1e-10)


def test_reference_given_indices_matches_naive():
    # A user selection (unsorted, with -1 slots, a repeat, a block after the query's own)
    # replaces the top-n; keys stay causal.
    cfg = make_config("l8d4s8", G=3, n_kv_heads=1)
    T = 40
    x = random_inputs(cfg, T, seed=11)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(-1, T // cfg.sel_block, (1, 1, T, cfg.n_selected), generator=gen)
    o, used = nsa_reference(**x, config=cfg, block_indices=idx)
    o_naive, _ = naive_nsa(**x, cfg=cfg, block_indices=idx)
    assert used is idx
    torch.testing.assert_close(o, o_naive, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype, tol", [
    pytest.param(torch.float32, 1e-5, id="fp32"),
    pytest.param(torch.bfloat16, 3e-2, id="bf16"),
])
def test_reference_low_precision_inputs(dtype, tol):
    # Lower-precision inputs: the math runs in fp32 and the output has the input dtype.
    # The selection is pinned to the fp64 one so a near-tie cannot flip a block.
    cfg = make_config("l16d8s32", G=4, n_kv_heads=1)
    x64 = random_inputs(cfg, 100, seed=3)
    _, idx = nsa_reference(**x64, config=cfg)
    o_naive, _ = naive_nsa(**x64, cfg=cfg)
    o, _ = nsa_reference(**{n: t.to(dtype) for n, t in x64.items()}, config=cfg, block_indices=idx)
    assert o.dtype == dtype
    torch.testing.assert_close(o.double(), o_naive, rtol=tol, atol=tol)


# --- hand-computed cases -------------------------------------------------------------

def test_cmp_to_sel_weights_paper_geometry():
    # l=32, d=16, l'=64, T=192: Tc=11 blocks [16i, 16i+32), Ns=3 blocks [64j, 64j+64).
    # Selection block j takes compression blocks 4j-1 .. 4j+3 with weights 1, 2, 2, 2, 1.
    cfg = NSAConfig(n_heads=1, n_kv_heads=1, cmp_block=32, cmp_stride=16, sel_block=64)
    expected = torch.tensor([
        [2, 0, 0],
        [2, 0, 0],
        [2, 0, 0],
        [1, 1, 0],
        [0, 2, 0],
        [0, 2, 0],
        [0, 2, 0],
        [0, 1, 1],
        [0, 0, 2],
        [0, 0, 2],
        [0, 0, 2],
    ], dtype=torch.float64)
    assert torch.equal(cmp_to_sel_weights(11, 3, cfg, dtype=torch.float64), expected)
    assert torch.equal(torch.tensor(overlap_weights(11, 3, 32, 16, 64), dtype=torch.float64), expected)
    assert expected[3:8, 1].tolist() == [1, 2, 2, 2, 1]


def test_cmp_to_sel_weights_blocks_larger_than_selection():
    # l=32, d=8, l'=16, T=48: compression block i = [8i, 8i+32) spans up to three selection
    # blocks [16j, 16j+16); weight = shared tokens / 8.
    cfg = NSAConfig(n_heads=1, n_kv_heads=1, cmp_block=32, cmp_stride=8, sel_block=16)
    expected = torch.tensor([
        [2, 2, 0],
        [1, 2, 1],
        [0, 2, 2],
    ], dtype=torch.float64)
    assert torch.equal(cmp_to_sel_weights(3, 3, cfg, dtype=torch.float64), expected)
    assert torch.equal(torch.tensor(overlap_weights(3, 3, 32, 8, 16), dtype=torch.float64), expected)


def test_forced_and_valid_rows():
    cfg = NSAConfig(n_heads=1, n_kv_heads=1, cmp_block=32, cmp_stride=16, sel_block=16,
                    n_selected=4, n_initial=1, n_local=2)
    forced, valid = forced_and_valid(80, 5, cfg)
    # (t, forced row, valid row) with own block t // 16.
    rows = {
        0: ([1, 0, 0, 0, 0], [1, 0, 0, 0, 0]),
        16: ([1, 1, 0, 0, 0], [1, 1, 0, 0, 0]),
        47: ([1, 1, 1, 0, 0], [1, 1, 1, 0, 0]),
        79: ([1, 0, 0, 1, 1], [1, 1, 1, 1, 1]),
    }
    for t, (f, v) in rows.items():
        assert forced[t].int().tolist() == f, t
        assert valid[t].int().tolist() == v, t


# Query t=511 with l=32, d=16, l'=64, n=4, one initial and two local blocks: Tc=31, Ns=8,
# forced {0, 6, 7}, one free slot among selection blocks 1..5.
HAND_CFG = NSAConfig(n_heads=1, n_kv_heads=1, cmp_block=32, cmp_stride=16, sel_block=64,
                     n_selected=4, n_initial=1, n_local=2)
HAND_T, HAND_TC = 512, 31


def _select_one(probs_by_head: list[dict[int, float]], t: int = HAND_T - 1, cfg: NSAConfig = HAND_CFG):
    """Selection of query t from hand-set cmp probabilities {compression block: p} per head."""
    p = torch.zeros(1, len(probs_by_head), HAND_T, HAND_TC, dtype=torch.float64)
    for h, probs in enumerate(probs_by_head):
        for i, value in probs.items():
            p[0, h, t, i] = value
    return select_blocks(p, HAND_T, len(probs_by_head), cfg)[0, 0, t].tolist()


@pytest.mark.parametrize("probs, expected", [
    # Importance 0.3*2 in block 2, 0.5*2 in block 3, 0.2*2 in block 4: block 3 takes the slot;
    # the forced blocks 0, 6, 7 win though their importance is 0.
    pytest.param({8: 0.3, 12: 0.5, 16: 0.2}, [0, 3, 6, 7], id="free-slot-to-most-important"),
    # All mass on the forced blocks' compression blocks: the free slot goes to block 1 (tie at 0).
    pytest.param({0: 0.4, 26: 0.6}, [0, 1, 6, 7], id="mass-on-forced-blocks"),
])
def test_forced_blocks_and_top_n(probs, expected):
    assert _select_one([probs]) == expected


@pytest.mark.parametrize("probs, expected", [
    # No importance anywhere: equal scores, the lowest free index.
    pytest.param({}, [0, 1, 6, 7], id="all-zero"),
    # Compression block 7 = tokens [112, 144) straddles selection blocks 1 and 2 equally.
    pytest.param({7: 1.0}, [0, 1, 6, 7], id="straddle-1-2"),
    # Compression block 11 = tokens [176, 208) straddles selection blocks 2 and 3 equally.
    pytest.param({11: 1.0}, [0, 2, 6, 7], id="straddle-2-3"),
])
def test_tie_break_lower_index(probs, expected):
    assert _select_one([probs]) == expected


def test_group_sum_decides_selection():
    # Head 0 alone ties blocks 2 and 3 (would take 2); head 1 ties 3 and 4. Summed over the
    # group, block 3 has twice the importance and is the one the whole group selects.
    heads = [{8: 0.5, 12: 0.5}, {12: 0.5, 16: 0.5}]
    assert _select_one(heads, cfg=HAND_CFG.replace(n_heads=2)) == [0, 3, 6, 7]


@pytest.mark.parametrize("t, expected", [
    pytest.param(63, [0, -1, -1, -1], id="own-block-0"),
    pytest.param(64, [0, 1, -1, -1], id="own-block-1"),
    pytest.param(200, [0, 1, 2, 3], id="own-block-3"),
])
def test_fewer_valid_blocks_than_n(t, expected):
    # Blocks after the query's own never count; unused slots are -1, after the ids.
    assert _select_one([{}], t=t) == expected


@pytest.mark.parametrize("T", [pytest.param(20, id="no-block-T20"), pytest.param(40, id="first-block-T40")])
def test_query_before_first_compression_block(T):
    # l=32: queries t < 31 see no complete compression block; with only the cmp gate open their
    # output is exactly 0, never NaN, forward and backward.
    cfg = make_config("l32d16s64", G=2, n_kv_heads=1)
    x = random_inputs(cfg, T, seed=2)
    x["gates"] = torch.zeros_like(x["gates"])
    x["gates"][..., 0] = 1.0
    for t in x.values():
        t.requires_grad_(True)
    o = nsa_attention(**x, config=cfg)
    assert torch.isfinite(o).all()
    assert torch.equal(o[:, :31], torch.zeros_like(o[:, :31]))
    if T > 31:
        assert (o[:, 31:].abs() > 0).all()
    o.square().sum().backward()
    for name, t in x.items():
        # k_cmp / v_cmp are empty at T=20 (Tc=0): nothing reads them, no gradient to give.
        assert (t.grad is None and t.numel() == 0) or torch.isfinite(t.grad).all(), name
    assert torch.equal(x["q"].grad[:, :31], torch.zeros_like(x["q"].grad[:, :31]))


def test_single_token_is_finite():
    cfg = make_config("l32d16s64", G=4, n_kv_heads=2)
    x = random_inputs(cfg, 1, seed=0, dtype=torch.float32)
    for t in x.values():
        t.requires_grad_(True)
    o, idx = nsa_attention(**x, config=cfg, return_indices=True)
    assert torch.isfinite(o).all() and idx[..., 0].eq(0).all() and idx[..., 1:].eq(-1).all()
    o.sum().backward()
    for name, t in x.items():
        # k_cmp / v_cmp are empty (Tc=0): nothing reads them, no gradient to give.
        assert (t.grad is None and t.numel() == 0) or torch.isfinite(t.grad).all(), name


# --- causality and gradients at op level -----------------------------------------------

@pytest.mark.parametrize("t0", [0, 17, 40, 63, 64, 98])
def test_op_causality(t0):
    # Changing every input that belongs after t0 (tokens > t0, compression blocks that end
    # after t0) changes no output and no selection at or before t0.
    cfg = make_config("l16d8s32", G=2, n_kv_heads=2)
    T = 100
    x = random_inputs(cfg, T, seed=7)
    y = random_inputs(cfg, T, seed=8)
    first_late_block = max(0, (t0 - cfg.cmp_block + 1) // cfg.cmp_stride + 1)
    for name in ("q", "k", "v", "gates"):
        y[name][:, : t0 + 1] = x[name][:, : t0 + 1]
    for name in ("k_cmp", "v_cmp"):
        y[name][:, :first_late_block] = x[name][:, :first_late_block]
    o_x, idx_x = nsa_attention(**x, config=cfg, return_indices=True)
    o_y, idx_y = nsa_attention(**y, config=cfg, return_indices=True)
    torch.testing.assert_close(o_y[:, : t0 + 1], o_x[:, : t0 + 1], rtol=0, atol=1e-12)
    assert torch.equal(idx_y[:, :, : t0 + 1], idx_x[:, :, : t0 + 1])
    assert not torch.allclose(o_y[:, t0 + 1:], o_x[:, t0 + 1:])


def test_op_gradcheck_fixed_selection():
    # Selection is piecewise constant (not differentiable): with block_indices fixed, the op
    # is smooth in all eight inputs and gradcheck's finite differences are exact enough.
    cfg = NSAConfig(n_heads=2, n_kv_heads=1, head_dim=4, head_dim_v=3, cmp_block=4, cmp_stride=2,
                    sel_block=4, n_selected=2, n_initial=1, n_local=1, window=3)
    T = 11
    x = random_inputs(cfg, T, seed=4, window_kv=True)
    _, idx = nsa_reference(**x, config=cfg)
    names = list(x)

    def op(*tensors):
        return nsa_attention(**dict(zip(names, tensors)), config=cfg, block_indices=idx)

    inputs = tuple(t.requires_grad_(True) for t in x.values())
    assert torch.autograd.gradcheck(op, inputs, eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("docs", [
    pytest.param([5, 40, 70, 1], id="short-long-long-one"),
    pytest.param([33], id="one-doc"),
    pytest.param([16, 16, 17], id="at-block-edges"),
])
def test_varlen_op_equals_separate_documents(docs):
    cfg = make_config("l16d8s32", G=2, n_kv_heads=2)
    T = sum(docs)
    cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32)
    cu_cmp = compressed_seqlens(cu, cfg)
    x = random_inputs(cfg, T, seed=9)
    Tc = int(cu_cmp[-1])
    gen = torch.Generator().manual_seed(10)
    x["k_cmp"] = torch.randn(1, Tc, cfg.n_kv_heads, cfg.head_dim, generator=gen, dtype=torch.float64)
    x["v_cmp"] = torch.randn(1, Tc, cfg.n_kv_heads, cfg.dv, generator=gen, dtype=torch.float64)
    o, idx = nsa_attention(**x, config=cfg, cu_seqlens=cu, return_indices=True)
    for i in range(len(docs)):
        s, e, cs, ce = int(cu[i]), int(cu[i + 1]), int(cu_cmp[i]), int(cu_cmp[i + 1])
        part = {n: t[:, s:e] for n, t in x.items() if n not in ("k_cmp", "v_cmp")}
        o_doc, idx_doc = nsa_attention(**part, k_cmp=x["k_cmp"][:, cs:ce], v_cmp=x["v_cmp"][:, cs:ce],
                                       config=cfg, return_indices=True)
        torch.testing.assert_close(o[:, s:e], o_doc, rtol=0, atol=1e-12)
        assert torch.equal(idx[:, :, s:e], idx_doc)
        o_naive, selected = naive_nsa(**part, k_cmp=x["k_cmp"][:, cs:ce], v_cmp=x["v_cmp"][:, cs:ce], cfg=cfg)
        torch.testing.assert_close(o[:, s:e], o_naive, rtol=1e-10, atol=1e-10)


def test_varlen_op_with_given_indices():
    # Given block ids are document-local: each document reads its own blocks, not the
    # packed sequence's blocks of the same number.
    cfg = make_config("l8d4s8", G=2, n_kv_heads=1)
    docs = [20, 30, 9]
    cu = torch.tensor([0, 20, 50, 59])
    cu_cmp = compressed_seqlens(cu, cfg)
    x = random_inputs(cfg, sum(docs), seed=12)
    gen = torch.Generator().manual_seed(13)
    Tc = int(cu_cmp[-1])
    x["k_cmp"] = torch.randn(1, Tc, 1, cfg.head_dim, generator=gen, dtype=torch.float64)
    x["v_cmp"] = torch.randn(1, Tc, 1, cfg.dv, generator=gen, dtype=torch.float64)
    # Distinct ids per token (a random subset of the document's blocks), -1 in the other slots.
    idx = torch.cat([_distinct_ids(n, -(-n // cfg.sel_block), cfg.n_selected, gen) for n in docs], dim=2)
    o = nsa_attention(**x, config=cfg, cu_seqlens=cu, block_indices=idx)
    for i in range(len(docs)):
        s, e, cs, ce = int(cu[i]), int(cu[i + 1]), int(cu_cmp[i]), int(cu_cmp[i + 1])
        part = {n: t[:, s:e] for n, t in x.items() if n not in ("k_cmp", "v_cmp")}
        o_naive, _ = naive_nsa(**part, k_cmp=x["k_cmp"][:, cs:ce], v_cmp=x["v_cmp"][:, cs:ce], cfg=cfg,
                               block_indices=idx[:, :, s:e])
        torch.testing.assert_close(o[:, s:e], o_naive, rtol=1e-10, atol=1e-10)


def _distinct_ids(T: int, n_blocks: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """[1, 1, T, n]: per token up to n distinct random block ids below n_blocks, -1 in the rest."""
    keys = torch.rand(T, max(n, n_blocks), generator=gen)
    keys[:, n_blocks:] = 2.0
    ids = keys.argsort(-1)[:, :n]
    drop = torch.rand(T, n, generator=gen) < 0.3
    return torch.where((ids >= n_blocks) | drop, -1, ids)[None, None]
