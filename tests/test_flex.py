"""impl="flex" on CPU: forward against the reference, the masks, and the BlockMask index emission.

CPU FlexAttention runs eagerly and applies only mask_mod (densely), so these tests pin the
mask_mods and the forward math; the block lists (what the GPU kernels walk) are checked
against create_block_mask / from_kv_blocks and the reference's dense masks. Gradients and
the compiled kernels are GPU tests (tests/test_flex_gpu.py).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask

from nsa_flex import NSAConfig, nsa_attention
from nsa_flex.blocks import num_cmp_blocks
from nsa_flex.compression import compressed_seqlens
from nsa_flex.flex import nsa_flex
from nsa_flex.flex.masks import (
    compressed_block_mask,
    compressed_mask_mod,
    selection_bits,
    selection_block_mask,
    selection_mask_mod,
    window_block_mask,
    window_widths,
    window_mask_mod,
)
from nsa_flex.flex.masks.documents import documents
from nsa_flex.flex.masks.selection import tokens_per_tile
from nsa_flex.flex.blockmask import transpose_blocks
from nsa_flex.reference import _selection_mask, nsa_reference, nsa_reference_varlen
from nsa_flex.flex.tuning import FlexTiles
from naive import random_inputs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def small_config(G: int, Dk: int, Dv: int, Hkv: int = 1, **changes) -> NSAConfig:
    settings = dict(n_heads=G * Hkv, n_kv_heads=Hkv, head_dim=Dk, head_dim_v=Dv, window=128, n_selected=4)
    return NSAConfig(**{**settings, **changes})


def oracle_tolerance(x: dict, cfg: NSAConfig, block_indices, o_oracle) -> float:
    """2x the reference's own error at this dtype against the fp64 oracle, plus a rounding floor."""
    o_ref, _ = nsa_reference(**x, config=cfg, block_indices=block_indices)
    ref_err = (o_ref.double() - o_oracle).abs().max().item()
    return 2 * ref_err + 100 * torch.finfo(x["q"].dtype).eps


# (T, G, Hkv, Dk, Dv, B, dtype): awkward lengths, every group size, d_v != d_k. CPU flex is
# dense and slow, so fp32 (where the tolerance is derived from the reference's own fp32
# error) runs on two shapes only.
FP64, FP32 = torch.float64, torch.float32
SHAPES = [
    pytest.param(1, 4, 1, 64, 32, 2, FP64, id="T1-G4-B2-fp64"),
    pytest.param(63, 16, 1, 64, 32, 1, FP64, id="T63-G16-fp64"),
    pytest.param(111, 2, 2, 32, 48, 2, FP64, id="T111-G2-Hkv2-B2-fp64"),
    pytest.param(200, 1, 3, 32, 16, 1, FP64, id="T200-G1-Hkv3-fp64"),
    pytest.param(1000, 4, 1, 16, 8, 1, FP64, id="T1000-G4-fp64"),
    pytest.param(63, 16, 1, 64, 32, 1, FP32, id="T63-G16-fp32"),
    pytest.param(200, 4, 2, 64, 32, 2, FP32, id="T200-G4-Hkv2-B2-fp32"),
]


@pytest.mark.parametrize("T,G,Hkv,Dk,Dv,B,dtype", SHAPES)
def test_forward_matches_reference(T, G, Hkv, Dk, Dv, B, dtype):
    cfg = small_config(G, Dk, Dv, Hkv)
    x64 = random_inputs(cfg, T, B=B, seed=T + G)
    o_oracle, sel = nsa_reference(**x64, config=cfg)
    x = {name: t.to(dtype) for name, t in x64.items()}
    with torch.no_grad():
        o, used = nsa_flex(**x, config=cfg, block_indices=sel)
    assert o.dtype == dtype and o.shape == o_oracle.shape
    assert torch.equal(used, sel)
    err = (o.double() - o_oracle).abs().max().item()
    assert err <= oracle_tolerance(x, cfg, sel, o_oracle), err


@pytest.mark.parametrize("sel_impl", ["block", "flex"])
@pytest.mark.parametrize("T,G,Hkv,Dk,Dv,B,dtype", [SHAPES[i] for i in (0, 3, 5, 6)])
def test_both_selected_branches_match_reference(T, G, Hkv, Dk, Dv, B, dtype, sel_impl):
    """Either implementation of the selected branch, forced at any group size, matches the oracle."""
    cfg = small_config(G, Dk, Dv, Hkv)
    x64 = random_inputs(cfg, T, B=B, seed=T + G + 1)
    o_oracle, sel = nsa_reference(**x64, config=cfg)
    x = {name: t.to(dtype) for name, t in x64.items()}
    with torch.no_grad():
        o, _ = nsa_flex(**x, config=cfg, block_indices=sel, tiles=FlexTiles(sel_impl=sel_impl))
    err = (o.double() - o_oracle).abs().max().item()
    assert err <= oracle_tolerance(x, cfg, sel, o_oracle), err


@pytest.mark.parametrize("G,expected", [(1, "block"), (4, "block"), (8, "block"), (16, "block")])
def test_selected_impl_by_group(G, expected):
    assert FlexTiles().selected_impl(4096, G) == expected
    assert FlexTiles(sel_impl="flex").selected_impl(4096, G) == "flex"
    with pytest.raises(ValueError, match="sel_impl"):
        FlexTiles(sel_impl="token")


@pytest.mark.parametrize("T,G", [(1, 2), (300, 4), (300, 16)], ids=["T1-G2", "T300-G4", "T300-G16"])
def test_forward_with_selection_op(T, G):
    """No block_indices: the selection op picks the same blocks as the reference (fp64, no ties)."""
    cfg = small_config(G, 32, 16, 2)
    x = random_inputs(cfg, T, B=2, seed=7, window_kv=True)
    o_ref, sel_ref = nsa_reference(**x, config=cfg)
    with torch.no_grad():
        o, sel = nsa_attention(**x, config=cfg, impl="flex", return_indices=True)
    assert torch.equal(sel.long(), sel_ref.long())
    assert (o - o_ref).abs().max().item() <= 100 * torch.finfo(torch.float64).eps


def test_compressed_branch_before_first_block_is_zero():
    """T < l: no compressed token at all; queries before the first complete block: 0, never NaN."""
    cfg = small_config(4, 16, 8)
    for T in (20, 40):
        x = random_inputs(cfg, T, seed=1)
        x["gates"] = torch.zeros_like(x["gates"])
        x["gates"][..., 0] = 1
        with torch.no_grad():
            o, _ = nsa_flex(**x, config=cfg)
        assert not o.isnan().any()
        first_visible = cfg.cmp_block - 1
        assert torch.equal(o[:, :first_visible], torch.zeros_like(o[:, :first_visible]))


def test_cpu_backward_is_refused_with_a_clear_error():
    cfg = small_config(2, 16, 8)
    x = random_inputs(cfg, 40)
    x["q"].requires_grad_(True)
    with pytest.raises(RuntimeError, match="no backward on CPU.*impl='reference'"):
        nsa_flex(**x, config=cfg)


def test_flex_tiles_validate():
    with pytest.raises(ValueError, match="sel_q_block=24: must be a power of two >= 16"):
        FlexTiles(sel_q_block=24)
    with pytest.raises(ValueError, match="cmp_block"):
        FlexTiles(cmp_block=(128, 8))
    with pytest.raises(ValueError, match="max_chunks=3: must be a power of two >= 1"):
        FlexTiles(max_chunks=3)
    with pytest.raises(ValueError, match="min_chunk_rows=0: must be >= 1"):
        FlexTiles(min_chunk_rows=0)
    with pytest.raises(ValueError, match="initial_copy_tokens=0: must be >= 1"):
        FlexTiles(initial_copy_tokens=0)
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="sel_partial_bytes=.*None .* or a positive number of bytes"):
            FlexTiles(sel_partial_bytes=bad)


# ---------------------------------------------------------------- masks


def block_grid(dense_bhqk: torch.Tensor, block_size) -> tuple[torch.Tensor, torch.Tensor]:
    """(any, all) allowed element per block of a dense [B, H, Q, K] mask, over in-range elements."""
    qbs, kbs = block_size
    B, H, Q, K = dense_bhqk.shape
    nq, nk = -(-Q // qbs), -(-K // kbs)
    pad = (0, nk * kbs - K, 0, nq * qbs - Q)
    allowed = torch.nn.functional.pad(dense_bhqk, pad, value=False).view(B, H, nq, qbs, nk, kbs)
    inside = torch.nn.functional.pad(torch.ones_like(dense_bhqk), pad, value=False).view(B, H, nq, qbs, nk, kbs)
    any_ = allowed.any(-1).any(-2)
    all_ = (allowed | ~inside).all(-1).all(-2)
    return any_, all_


def listed(num: torch.Tensor, idx: torch.Tensor, n_cols: int) -> torch.Tensor:
    """(num [..., R], idx [..., R, W]) -> [..., R, n_cols] bool of the listed entries."""
    grid = torch.zeros(*idx.shape[:-1], n_cols + 1, dtype=torch.bool)
    valid = torch.arange(idx.shape[-1]) < num[..., None]
    return grid.scatter_(-1, torch.where(valid, idx.long(), n_cols), True)[..., :n_cols]


def check_block_mask(bm: BlockMask, dense_bhqk: torch.Tensor, exact: bool = True) -> None:
    """The lists of bm match the dense mask: partial | full = blocks with any allowed element
    (a superset where not exact), full blocks are entirely allowed, and the q-side lists are
    the transposes of the kv-side ones."""
    any_, all_ = block_grid(dense_bhqk, bm.BLOCK_SIZE)
    nq, nk = any_.shape[-2:]
    partial = listed(bm.kv_num_blocks, bm.kv_indices, nk)
    full = listed(bm.full_kv_num_blocks, bm.full_kv_indices, nk)
    assert not (partial & full).any()
    union = (partial | full).expand_as(any_)
    assert torch.equal(union, any_) if exact else not (any_ & ~union).any()
    assert not (full.expand_as(all_) & ~all_).any()
    assert torch.equal(listed(bm.q_num_blocks, bm.q_indices, nq), partial.transpose(-1, -2))
    assert torch.equal(listed(bm.full_q_num_blocks, bm.full_q_indices, nq), full.transpose(-1, -2))


@pytest.mark.parametrize("T", [1, 40, 63, 200, 777])
def test_compressed_block_mask(T):
    cfg = small_config(1, 16, 16)
    Tc = num_cmp_blocks(T, cfg)
    if Tc == 0:
        pytest.skip("no compressed tokens")
    t, i = torch.arange(T)[:, None], torch.arange(Tc)[None, :]
    dense = (i * cfg.cmp_stride + cfg.cmp_block - 1 <= t)[None, None]
    for block_size in ((128, 128), (64, 16)):
        bm = compressed_block_mask(T, Tc, cfg, "cpu", block_size)
        check_block_mask(bm, dense)
        assert torch.equal(create_mask(bm.mask_mod, None, None, T, Tc, "cpu"), dense)
        reference_bm = create_block_mask(compressed_mask_mod(cfg), None, None, T, Tc, "cpu", BLOCK_SIZE=block_size)
        n_kv = -(-Tc // block_size[1])
        assert torch.equal(listed(bm.kv_num_blocks, bm.kv_indices, n_kv) | listed(bm.full_kv_num_blocks, bm.full_kv_indices, n_kv),
                           reference_bm.to_dense().bool())


@pytest.mark.parametrize("T,G", [(200, 4), (77, 16), (130, 3), (1500, 4), (700, 16)])
def test_folded_interval_masks(T, G):
    """Compressed and window masks over folded rows (t*G + g) equal the plain ones repeated G times."""
    cfg = small_config(G, 16, 16)
    Tc = num_cmp_blocks(T, cfg)
    t, i, s = torch.arange(T)[:, None], torch.arange(Tc)[None, :], torch.arange(T)[None, :]
    cmp_dense = (i * cfg.cmp_stride + cfg.cmp_block - 1 <= t).repeat_interleave(G, 0)[None, None]
    win_dense = ((s <= t) & (t - s < 100)).repeat_interleave(G, 0)[None, None]
    for bm, dense in ((compressed_block_mask(T, Tc, cfg, "cpu", (128, 16), G), cmp_dense),
                      (window_block_mask(T, 100, "cpu", (64, 64), G), win_dense)):
        assert bm.seq_lengths == (T * G, dense.shape[-1])
        check_block_mask(bm, dense)
        assert torch.equal(create_mask(bm.mask_mod, None, None, T * G, dense.shape[-1], "cpu"), dense)


@pytest.mark.parametrize("seed", range(16))
def test_interval_masks_at_random_shapes(seed):
    """Window and compressed masks at random lengths, groups, block sizes, windows and packed
    documents: each list against its own mask_mod's dense mask (exact without documents, a
    superset with them), full blocks entirely allowed, q lists the transposes of the kv lists."""
    import random

    rnd = random.Random(seed)
    T, G = rnd.randint(1, 700), rnd.choice([1, 2, 3, 4])
    block_size = (rnd.choice([16, 32, 64, 128]), rnd.choice([16, 64, 128]))
    cfg = small_config(G, 16, 16, window=rnd.choice([1, 7, 100, 512]))
    docs = None
    if seed % 2 and T > 2:
        cuts = sorted(rnd.sample(range(1, T), min(T - 1, rnd.randint(1, 4))))
        cu = torch.tensor([0, *cuts, T])
        cu_cmp = compressed_seqlens(cu, cfg)
        docs = documents(cu, cu_cmp, T, int(cu_cmp[-1]))
    Tc = num_cmp_blocks(T, cfg) if docs is None else int(docs.c_doc.shape[0])
    masks = [(window_block_mask(T, cfg.window, "cpu", block_size, G, docs=docs), T)]
    if Tc > 0:
        masks.append((compressed_block_mask(T, Tc, cfg, "cpu", block_size, G, docs=docs), Tc))
    for bm, kv_len in masks:
        dense = create_mask(bm.mask_mod, None, None, T * G, kv_len, "cpu")
        check_block_mask(bm, dense, exact=docs is None)


@pytest.mark.parametrize("T,window", [(1, 4), (300, 128), (1000, 512), (513, 100), (5000, 512), (3001, 100)])
def test_window_block_mask(T, window):
    t, s = torch.arange(T)[:, None], torch.arange(T)[None, :]
    dense = ((s <= t) & (t - s < window))[None, None]
    bm = window_block_mask(T, window, "cpu", (128, 128))
    check_block_mask(bm, dense)
    # Lists cut to the geometry's bounds (window_widths): a few blocks, not all of them.
    n_blocks = -(-T // 128)
    kv_width, q_width = window_widths(window, (128, 128))
    assert bm.kv_indices.shape[-1] == min(kv_width, n_blocks)
    assert bm.q_indices.shape[-1] == bm.full_q_indices.shape[-1] == min(q_width, n_blocks)
    assert torch.equal(create_mask(window_mask_mod(window), None, None, T, T, "cpu"), dense)
    reference_bm = create_block_mask(window_mask_mod(window), None, None, T, T, "cpu", BLOCK_SIZE=128)
    n_kv = -(-T // 128)
    union = listed(bm.kv_num_blocks, bm.kv_indices, n_kv) | listed(bm.full_kv_num_blocks, bm.full_kv_indices, n_kv)
    assert torch.equal(union, reference_bm.to_dense().bool())


def random_selection(B, Hkv, T, cfg, seed=0) -> torch.Tensor:
    """Reference-style indices: forced blocks plus random valid ones, ascending, -1 last."""
    from nsa_flex.reference import select_blocks

    gen = torch.Generator().manual_seed(seed)
    Tc = num_cmp_blocks(T, cfg)
    p = torch.rand(B, Hkv, T, Tc, generator=gen, dtype=torch.float64)
    return select_blocks(p, T, 1, cfg)


@pytest.mark.parametrize("T,G,q_block,sel_block", [
    pytest.param(1, 16, 16, 64, id="T1-G16"),
    pytest.param(100, 16, 16, 64, id="T100-G16"),
    pytest.param(300, 4, 16, 64, id="T300-G4"),
    pytest.param(300, 1, 16, 64, id="T300-G1"),
    pytest.param(257, 3, 16, 64, id="T257-G3"),
    pytest.param(200, 32, 16, 64, id="T200-G32"),
    pytest.param(300, 16, 64, 64, id="T300-G16-tile64"),
    pytest.param(130, 6, 32, 64, id="T130-G6-tile32"),
    pytest.param(777, 2, 16, 16, id="T777-G2-sel16-two-words"),
])
def test_selection_block_mask(T, G, q_block, sel_block):
    cfg = small_config(G, 16, 16, 2, n_selected=5, sel_block=sel_block)
    B, Hkv = 2, 2
    idx = random_selection(B, Hkv, T, cfg)
    dense_bhts = _selection_mask(idx, T, cfg)  # [B, Hkv, T, T]
    dense_folded = dense_bhts.repeat_interleave(G, dim=2)  # row t*G + g
    bm = selection_block_mask(idx.to(torch.int32), T, G, cfg, q_block)
    assert bm.kv_indices.shape[1] == Hkv and bm.seq_lengths == (T * G, T)
    check_block_mask(bm, dense_folded)
    assert torch.equal(create_mask(bm.mask_mod, B, Hkv, T * G, T, "cpu"), dense_folded)


@pytest.mark.parametrize("T,G,q_block,tokens,n_initial", [
    pytest.param(300, 4, 16, 64, 1, id="T300-G4-64tok"),
    pytest.param(257, 16, 16, 100, 1, id="T257-G16-tokens-rounded"),
    pytest.param(400, 2, 16, 96, 2, id="T400-G2-two-initial-blocks"),
    pytest.param(333, 1, 16, 48, 1, id="T333-G1"),
])
def test_selection_block_mask_with_initial_copies(T, G, q_block, tokens, n_initial):
    """Copies of the initial keys: token t sees them only through copy t // tokens, blocks listed exactly."""
    from nsa_flex.flex.masks.selection import initial_copies

    L = 32
    cfg = small_config(G, 16, 16, 2, n_selected=5, sel_block=L, n_initial=n_initial)
    B, Hkv = 2, 2
    idx = random_selection(B, Hkv, T, cfg)
    assert (idx[..., 0] == 0).all()  # the forced block 0 is there
    copies = initial_copies(T, G, cfg, q_block, tokens)
    assert copies is not None and copies.tokens % max(1, q_block // G) == 0 and copies.tokens >= tokens
    assert copies.start % L == 0 and copies.start >= T and copies.count == -(-T // copies.tokens)
    dense = _selection_mask(idx, T, cfg).repeat_interleave(G, dim=2)  # [B, Hkv, T*G, T]
    expected = torch.zeros(B, Hkv, T * G, copies.kv_len, dtype=torch.bool)
    keys = copies.keys
    expected[..., :T] = dense
    expected[..., :keys] = False
    span = (torch.arange(T * G) // G) // copies.tokens  # each row's copy
    for c in range(copies.count):
        rows = span == c
        expected[:, :, rows, copies.start + c * keys:copies.start + (c + 1) * keys] = dense[:, :, rows, :keys]
    bm = selection_block_mask(idx.to(torch.int32), T, G, cfg, q_block, copies=copies)
    assert bm.seq_lengths == (T * G, copies.kv_len)
    check_block_mask(bm, expected)
    assert torch.equal(create_mask(bm.mask_mod, B, Hkv, T * G, copies.kv_len, "cpu"), expected)
    # Each copy's backward list holds only its own span's tiles (the point of the copies).
    n_tiles = T * G // q_block
    first_copy = copies.start // L
    q_lists = listed(bm.full_q_num_blocks, bm.full_q_indices, n_tiles) | listed(bm.q_num_blocks, bm.q_indices,
                                                                                  n_tiles)
    for c in range(copies.count):
        tiles_of_c = q_lists[..., first_copy + c * n_initial, :].nonzero()[:, -1]
        assert tiles_of_c.numel() and ((tiles_of_c * q_block // G) // copies.tokens == c).all()


def test_selection_lists_trace_as_one_graph():
    """What CUDA compiles (selection_lists): one Dynamo graph, no break, the same tensors as eager."""
    from nsa_flex.flex.masks.selection import initial_copies, selection_lists

    cfg = small_config(4, 16, 16, 2, n_selected=5, sel_block=32)
    T = 300
    idx = random_selection(2, 2, T, cfg).to(torch.int32)
    copies = initial_copies(T, 4, cfg, 16, 64)
    torch._dynamo.reset()
    traced = torch.compile(selection_lists, backend="aot_eager", fullgraph=True, dynamic=False)
    got = traced(idx, T, 4, cfg, 16, None, copies)
    want = selection_lists(idx, T, 4, cfg, 16, None, copies)
    flat = lambda xs: [t for x in xs for t in (x if isinstance(x, tuple) else (x,))]  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(flat(got), flat(want), strict=True))


def test_initial_copies_only_where_they_split_the_work():
    from nsa_flex.flex.masks.selection import initial_copies

    cfg = NSAConfig(n_heads=64, n_kv_heads=4, head_dim=128)
    assert initial_copies(2048, 16, cfg, 16, 2048) is None
    c = initial_copies(65536, 16, cfg, 16, 2048)
    assert (c.count, c.keys, c.start, c.kv_len) == (32, 64, 65536, 65536 + 32 * 64)
    assert initial_copies(5000, 4, cfg, 16, 1000).tokens == 1000  # 4 tokens per tile divide it
    assert initial_copies(5000, 3, cfg, 16, 1000).tokens == 1008  # a 16-row tile of G=3 spans 16 rows' tokens


@pytest.mark.parametrize("T,G,Hkv,B,n_initial", [(600, 4, 2, 2, 1), (700, 16, 1, 1, 2), (333, 2, 2, 1, 1)])
def test_initial_copies_equal_one_plain_call(T, G, Hkv, B, n_initial):
    """The selected branch with initial copies equals the plain call; dropping the initial blocks does not."""
    from nsa_flex.flex import fold, selected_branch

    cfg = small_config(G, 32, 16, Hkv, n_initial=n_initial, n_local=1, sel_block=32)
    x = random_inputs(cfg, T, B=B, seed=4)
    _, sel = nsa_reference(**x, config=cfg)
    q_fold, scale = fold(x["q"], Hkv), 32 ** -0.5
    plain = FlexTiles(sel_impl="flex", split_initial=False)
    copied = FlexTiles(sel_impl="flex", sel_q_block=16, split_initial=True, initial_copy_tokens=128)
    with torch.no_grad():
        s_plain = selected_branch(q_fold, x["k"], x["v"], sel, cfg, scale, plain, forced_initial=True)
        s_copied = selected_branch(q_fold, x["k"], x["v"], sel, cfg, scale, copied, forced_initial=True)
        broken = selected_branch(q_fold, x["k"], x["v"], torch.where(sel < n_initial, -1, sel), cfg, scale, plain)
    tol = 1e3 * torch.finfo(torch.float64).eps
    assert (s_plain - s_copied).abs().max() <= tol
    assert (s_plain - broken).abs().max() > 1e-3  # the test can see a lost initial block


@pytest.mark.parametrize("full_blocks", [True, False])
@pytest.mark.parametrize("T,G,Hkv", [(600, 4, 2), (333, 2, 2)])
def test_whole_op_with_initial_copies_equals_reference(T, G, Hkv, full_blocks):
    """nsa_flex with copies (its window then reads the keys through a view of the copied tensors),
    with and without full-block lists, equals the reference; the window on the padded or copied
    keys instead would not."""
    cfg = small_config(G, 32, 16, Hkv, n_initial=1, n_local=1, sel_block=32)
    x = random_inputs(cfg, T, B=2, seed=5)
    o_ref, sel_ref = nsa_reference(**x, config=cfg)
    copied = FlexTiles(sel_impl="flex", sel_q_block=16, split_initial=True, initial_copy_tokens=128,
                       sel_full_blocks=full_blocks)
    with torch.no_grad():
        o, sel = nsa_flex(**x, config=cfg, tiles=copied)
    assert torch.equal(sel, sel_ref)
    assert (o - o_ref).abs().max() <= 1e3 * torch.finfo(torch.float64).eps


@pytest.mark.parametrize("copies", [False, True])
def test_selection_mask_without_full_lists_lists_the_same_blocks(copies):
    """full_blocks=False: no full lists, and the partial lists hold exactly the default's partial
    and full blocks, both ways."""
    from nsa_flex.flex.masks.selection import initial_copies

    T, G = 700, 4
    cfg = small_config(G, 32, 16, 2, n_initial=1, n_local=1, sel_block=32)
    _, idx = nsa_reference(**random_inputs(cfg, T, B=2, seed=6), config=cfg)
    c = initial_copies(T, G, cfg, 16, 128) if copies else None
    with_full = selection_block_mask(idx, T, G, cfg, 16, copies=c)
    without = selection_block_mask(idx, T, G, cfg, 16, copies=c, full_blocks=False)
    assert without.full_kv_num_blocks is None and without.full_q_num_blocks is None
    assert int(with_full.full_kv_num_blocks.sum()) > 0  # the default does list full blocks here

    def listed(num, idx_):
        keep = torch.arange(idx_.shape[-1]) < num[..., None]
        return {(*p[:-1], int(idx_[tuple(p)])) for p in torch.nonzero(keep).tolist()}

    for side in ("kv", "q"):
        both = listed(getattr(with_full, f"{side}_num_blocks"), getattr(with_full, f"{side}_indices")) | listed(
            getattr(with_full, f"full_{side}_num_blocks"), getattr(with_full, f"full_{side}_indices"))
        assert listed(getattr(without, f"{side}_num_blocks"), getattr(without, f"{side}_indices")) == both


def test_selection_bits_high_bit():
    """Bit 31 of a word (the int32 sign bit) and ids in the second word."""
    idx = torch.full((1, 1, 64, 4), -1)
    idx[0, 0, 63] = torch.tensor([0, 31, 32, 63])
    idx[0, 0, 1, 0] = 5
    bits = selection_bits(idx, 64)
    assert bits.dtype == torch.int32 and bits.shape == (1, 1, 64, 2)
    assert bits[0, 0, 63].tolist() == [1 - 2**31, 1 - 2**31] and bits[0, 0, 1].tolist() == [32, 0]
    mask_mod = selection_mask_mod(bits, 1, 1)
    allowed = [s for s in range(64) if mask_mod(0, 0, torch.tensor(63), torch.tensor(s))]
    assert allowed == [0, 31, 32, 63]


def test_selection_bits_repeated_ids():
    """A repeated id sets its own bit once: [0, 0] is block 0, never block 1 (0b01 + 0b01 = 0b10)."""
    idx = torch.tensor([[0, 0, -1, -1], [33, 5, 33, 33], [-1, -1, -1, -1]]).view(1, 1, 3, 4)
    assert selection_bits(idx, 40)[0, 0].tolist() == [[1, 0], [32, 2], [0, 0]]


@pytest.mark.parametrize("rows", [
    pytest.param(([0, 0, -1, -1], [1, 1, 1, 0]), id="repeat-first-block"),
    pytest.param(([2, -1, 2, 3], [3, 2, 3, 2]), id="repeat-apart"),
])
def test_repeated_ids_match_reference(rows):
    """The flex op itself (no input checks) reads a repeated id as that block once, as the reference does."""
    cfg = small_config(4, 16, 8, Hkv=2, sel_block=16, cmp_block=16, cmp_stride=8)
    T = 70
    x = random_inputs(cfg, T, seed=3)
    idx = torch.tensor(rows).view(1, 2, 1, 4).expand(1, 2, T, 4).contiguous()
    o_ref, _ = nsa_reference(**x, config=cfg, block_indices=idx)
    with torch.no_grad():
        o, _ = nsa_flex(**x, config=cfg, block_indices=idx)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("G,q_block,expected", [(16, 16, 1), (4, 16, 4), (1, 16, 16), (3, 16, 6), (32, 16, 1),
                                                 (6, 32, 6)])
def test_tokens_per_tile(G, q_block, expected):
    assert tokens_per_tile(G, q_block) == expected


# (600, 40, 16): more entries than transpose_blocks' spare slots, most of them unlisted.
@pytest.mark.parametrize("R,C,W", [(7, 5, 3), (33, 9, 9), (64, 16, 4), (600, 40, 16)])
def test_transpose_blocks_matches_from_kv_blocks(R, C, W):
    gen = torch.Generator().manual_seed(R)
    B, H = 2, 3
    scores = torch.rand(B, H, R, C, generator=gen)
    idx = scores.argsort(-1)[..., :W].sort(-1).values.to(torch.int32)
    num = torch.randint(0, W + 1, (B, H, R), generator=gen, dtype=torch.int32)
    full_idx = torch.cat([idx, torch.zeros(B, H, R, C - W, dtype=torch.int32)], -1)
    expected = BlockMask.from_kv_blocks(num, full_idx, BLOCK_SIZE=16, seq_lengths=(16 * R, 16 * C))
    q_num, q_idx = transpose_blocks(num, idx, C, R)
    assert torch.equal(q_num, expected.q_num_blocks)
    valid = torch.arange(R) < q_num[..., None]
    assert torch.equal(torch.where(valid, q_idx, 0), torch.where(valid, expected.q_indices, 0))


def test_transpose_blocks_cuts_columns_at_width():
    """Entries past `width` are dropped (the lowest rows kept), the counts clamped, the rest zero."""
    num = torch.tensor([[[1, 1, 1, 1, 1]]], dtype=torch.int32)
    idx = torch.tensor([[[[2], [2], [0], [2], [2]]]], dtype=torch.int32)
    q_num, q_idx = transpose_blocks(num, idx, 3, 2)
    assert q_num.tolist() == [[[1, 0, 2]]]
    assert q_idx.tolist() == [[[[2, 0], [0, 0], [0, 1]]]]


def test_flex_matches_reference_on_window_kv():
    """Separate window projections (k_win / v_win) reach the window branch only."""
    cfg = small_config(2, 16, 8, 2)
    x = random_inputs(cfg, 150, seed=3, window_kv=True)
    o_ref, sel = nsa_reference(**x, config=cfg)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        o, _ = nsa_flex(**x, config=cfg, block_indices=sel)
    assert (o - o_ref).abs().max().item() <= 100 * torch.finfo(torch.float64).eps


# ---------------------------------------------------------------- packed documents

DOC_LENGTHS = [150, 17, 230, 1, 40]


def packed(cfg: NSAConfig, lengths=DOC_LENGTHS, seed: int = 0):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    cu_cmp = compressed_seqlens(cu, cfg)
    T, Tc = int(cu[-1]), int(cu_cmp[-1])
    x = random_inputs(cfg, T, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, dim in (("k_cmp", cfg.head_dim), ("v_cmp", cfg.dv)):
        x[name] = torch.randn(1, Tc, cfg.n_kv_heads, dim, generator=gen, dtype=torch.float64)
    return x, cu, cu_cmp


@pytest.mark.parametrize("G", [1, 4, 16])
def test_documents_forward_matches_reference_varlen(G):
    cfg = small_config(G, 16, 8, 2 if G < 16 else 1, window=100, n_selected=3)
    x, cu, cu_cmp = packed(cfg, seed=G)
    o_ref, sel_ref = nsa_reference_varlen(*(x[n] for n in ("q", "k", "v", "k_cmp", "v_cmp", "gates")), cfg,
                                          cu, cu_cmp)
    with torch.no_grad():
        o, sel = nsa_flex(**x, config=cfg, cu_seqlens=cu)
    assert torch.equal(sel.long(), sel_ref.long())
    assert (o - o_ref).abs().max().item() <= 100 * torch.finfo(torch.float64).eps


def test_documents_block_masks():
    """Document masks: mask_mods exact against the per-document dense masks, lists cover them."""
    G, Hkv = 4, 2
    cfg = small_config(G, 16, 16, Hkv, window=100, n_selected=3)
    x, cu, cu_cmp = packed(cfg)
    T, Tc = x["q"].shape[1], x["k_cmp"].shape[1]
    docs = documents(cu, cu_cmp, T, Tc)
    same_doc = docs.q_doc[:, None] == docs.q_doc[None, :]
    local_t = torch.arange(T) - docs.q_start
    local_c = torch.arange(Tc) - docs.c_start
    cmp_dense = (docs.q_doc[:, None] == docs.c_doc[None, :]) & (
        local_c[None, :] * cfg.cmp_stride + cfg.cmp_block - 1 <= local_t[:, None])
    bm = compressed_block_mask(T, Tc, cfg, "cpu", (64, 16), docs=docs)
    assert torch.equal(create_mask(bm.mask_mod, None, None, T, Tc, "cpu")[0, 0], cmp_dense)
    check_block_mask(bm, cmp_dense[None, None], exact=False)
    t = torch.arange(T)
    win_dense = same_doc & (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < cfg.window)
    bm = window_block_mask(T, cfg.window, "cpu", (64, 64), docs=docs)
    assert torch.equal(create_mask(bm.mask_mod, None, None, T, T, "cpu")[0, 0], win_dense)
    check_block_mask(bm, win_dense[None, None], exact=False)
    # Selection: document-local block ids, as the reference picks them per document.
    _, sel = nsa_reference_varlen(*(x[n] for n in ("q", "k", "v", "k_cmp", "v_cmp", "gates")), cfg, cu, cu_cmp)
    dense = torch.zeros(1, Hkv, T, T, dtype=torch.bool)
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        dense[:, :, s:e, s:e] = _selection_mask(sel[:, :, s:e], e - s, cfg)
    bm = selection_block_mask(sel.to(torch.int32), T, G, cfg, 16, docs)
    folded = dense.repeat_interleave(G, dim=2)
    assert torch.equal(create_mask(bm.mask_mod, 1, Hkv, T * G, T, "cpu"), folded)
    check_block_mask(bm, folded, exact=False)


def test_documents_op_against_a_loop():
    """nsa_flex::documents (opaque to torch.compile, see masks/documents.py): each token's and each
    compressed token's document and document start, against a plain loop; empty documents in
    between; opcheck."""
    cu = torch.tensor([0, 40, 41, 41, 130], dtype=torch.int32)
    cu_cmp = torch.tensor([0, 2, 2, 2, 8], dtype=torch.int32)
    docs = documents(cu, cu_cmp, 130, 8)

    def owner(bounds, i):
        return max(d for d in range(len(bounds) - 1) if bounds[d] <= i < bounds[d + 1])

    b, bc = cu.tolist(), cu_cmp.tolist()
    q_doc = [owner(b, t) for t in range(130)]
    c_doc = [owner(bc, c) for c in range(8)]
    assert docs.q_doc.tolist() == q_doc and docs.c_doc.tolist() == c_doc
    assert docs.q_start.tolist() == [b[d] for d in q_doc] and docs.c_start.tolist() == [bc[d] for d in c_doc]
    assert docs.cmp_start_of_q.tolist() == [bc[d] for d in q_doc]
    torch.library.opcheck(torch.ops.nsa_flex.documents.default, (cu, cu_cmp, 130, 8))


def test_sel_block_must_suit_the_gpu_kernel():
    from nsa_flex.flex.tuning import branch_kernel_options

    with pytest.raises(ValueError, match="sel_block=48: impl='flex' on CUDA needs a power of two >= 16"):
        branch_kernel_options("sel", 128, torch.bfloat16, q_block=16, kv_block=48)
    opts = branch_kernel_options("sel", 128, torch.bfloat16, q_block=16, kv_block=64)
    assert 64 % opts["fwd_BLOCK_N"] == 0 and 16 % opts["fwd_BLOCK_M"] == 0 and opts["bwd_BLOCK_M1"] == 16


@pytest.mark.parametrize("head_dim", [32, 64, 128, 192])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("branch", ["cmp", "win"])
def test_branch_tiles_fit_the_block_masks(branch, dtype, head_dim):
    """Every tile the cmp / win calls set divides the 128 x 128 BlockMask blocks, and the backward's
    satisfy Triton's N1 % M1 == 0 and M2 % N2 == 0; the window's D <= 64 16-bit backward takes its own."""
    from nsa_flex.flex.tuning import branch_kernel_options

    opts = branch_kernel_options(branch, head_dim, dtype, q_block=128, kv_block=128)
    for key in ("fwd_BLOCK_M", "fwd_BLOCK_N", "bwd_BLOCK_M1", "bwd_BLOCK_N1", "bwd_BLOCK_M2", "bwd_BLOCK_N2"):
        assert 128 % opts.get(key, 128) == 0, key
    if "bwd_BLOCK_M1" in opts:
        assert opts["bwd_BLOCK_N1"] % opts["bwd_BLOCK_M1"] == 0 and opts["bwd_BLOCK_M2"] % opts["bwd_BLOCK_N2"] == 0
    narrow_window = branch == "win" and head_dim <= 64 and dtype != torch.float32
    if narrow_window:
        assert (opts["bwd_BLOCK_M1"], opts["bwd_BLOCK_N1"], opts["bwd_num_warps"]) == (32, 64, 4)
    assert ("bwd_BLOCK_M1" in opts) == (narrow_window or (head_dim > 128 and dtype == torch.float32))


def test_install_flex_tuning_sets_the_choices_class(monkeypatch):
    """Process-global and idempotent; restored after the test."""
    import torch._inductor.config as inductor_config

    from nsa_flex.flex import tuning
    from nsa_flex.flex.inductor_choices import NSAFlexChoices

    from torch._inductor.choices import InductorChoices

    monkeypatch.setattr(tuning, "_INSTALLED", False)
    monkeypatch.setattr(inductor_config, "inductor_choices_class", None)
    monkeypatch.setattr(InductorChoices, "get_flex_attention_bwd_configs", InductorChoices.get_flex_attention_bwd_configs)
    tuning.install_flex_tuning()
    tuning.install_flex_tuning()
    assert tuning.is_installed() and inductor_config.inductor_choices_class is NSAFlexChoices
    assert NSAFlexChoices().uuid()


def test_install_flex_tuning_reaches_handlers_made_before_it(monkeypatch):
    """A thread that compiled before the install keeps a handler of Inductor's own class (the
    autograd engine's thread, which compiles backward graphs): after the install that handler's
    backward configs hold the 16x16 fallback too, once."""
    import torch._inductor.config as inductor_config
    from torch._inductor.choices import InductorChoices

    from nsa_flex.flex import tuning
    from nsa_flex.flex.inductor_choices import _fallback_bwd_config

    class Heuristics:  # configs that fit no 16-row block, as sm90's defaults
        def get_flex_attn_bwd_configs(self, head_dim, dtype):
            return []

    monkeypatch.setattr(tuning, "_INSTALLED", False)
    monkeypatch.setattr(inductor_config, "inductor_choices_class", None)
    monkeypatch.setattr(InductorChoices, "get_flex_attention_bwd_configs", InductorChoices.get_flex_attention_bwd_configs)
    monkeypatch.setattr(InductorChoices, "get_config_heuristics", lambda self, device_type="cuda": Heuristics())
    stale = InductorChoices()
    assert stale.get_flex_attention_bwd_configs(64, torch.bfloat16) == []
    tuning.install_flex_tuning()
    monkeypatch.setattr(tuning, "_INSTALLED", False)
    tuning.install_flex_tuning()
    assert stale.get_flex_attention_bwd_configs(64, torch.bfloat16) == [_fallback_bwd_config()]


# ---------------------------------------------------------------- row chunks and the initial-blocks split


@pytest.mark.parametrize("rows,q_block,max_chunks,min_rows,expected", [
    (2**20, 128, 16, 4096, 16), (2**20, 128, 64, 4096, 64), (131072, 128, 16, 65536, 2),
    (1000, 128, 16, 1, 1), (1024, 128, 16, 256, 4), (3 * 1024, 128, 16, 128, 8), (1024, 128, 1, 1, 1),
])
def test_query_chunks(rows, q_block, max_chunks, min_rows, expected):
    from nsa_flex.flex.blockmask import query_chunks

    S = query_chunks(rows, q_block, max_chunks, min_rows)
    assert S == expected
    assert S == 1 or (rows % (S * q_block) == 0 and rows // S >= min_rows)


@pytest.mark.parametrize("T,G,S", [(256, 4, 4), (512, 2, 8), (128, 16, 16)])
def test_chunked_compressed_mask(T, G, S):
    """Rows in S chunks as heads: the same allowed set, chunk c of head h being rows c*R/S.. of kv head h."""
    cfg = small_config(G, 16, 16)
    Tc, Hkv, rows = num_cmp_blocks(T, cfg), 3, T * G
    t, i = torch.arange(T)[:, None], torch.arange(Tc)[None, :]
    dense = (i * cfg.cmp_stride + cfg.cmp_block - 1 <= t).repeat_interleave(G, 0)  # [rows, Tc]
    chunked = dense.view(S, rows // S, Tc)[None, None].expand(1, Hkv, S, rows // S, Tc).reshape(1, Hkv * S, rows // S, Tc)
    bm = compressed_block_mask(T, Tc, cfg, "cpu", (128, 16), G, chunks=S, heads=Hkv)
    assert bm.seq_lengths == (rows // S, Tc) and bm.kv_indices.shape[1] == Hkv * S
    check_block_mask(bm, chunked)
    assert torch.equal(create_mask(bm.mask_mod, 1, Hkv * S, rows // S, Tc, "cpu"), chunked)


def test_chunks_must_divide_the_rows():
    cfg = small_config(4, 16, 16)
    with pytest.raises(ValueError, match="3 query chunks of 128-row blocks do not divide 800 rows"):
        compressed_block_mask(200, num_cmp_blocks(200, cfg), cfg, "cpu", (128, 16), 4, chunks=3, heads=1)


@pytest.mark.parametrize("T,G,Hkv,B,n_initial", [(256, 4, 2, 2, 1), (384, 16, 1, 1, 2), (300, 4, 2, 2, 1),
                                                 (40, 16, 1, 1, 1)])
def test_chunks_and_initial_split_equal_one_call(T, G, Hkv, B, n_initial):
    """Chunked compressed rows and initial-key copies: the plain calls' o and lse."""
    from nsa_flex.flex import compressed_branch, fold, selected_branch

    cfg = small_config(G, 32, 16, Hkv, n_initial=n_initial, n_local=1)
    x = random_inputs(cfg, T, B=B, seed=3)
    _, sel = nsa_reference(**x, config=cfg)
    q_fold, scale = fold(x["q"], Hkv), 32 ** -0.5
    plain = FlexTiles(sel_impl="flex", max_chunks=1, split_initial=False)
    chunked = FlexTiles(sel_impl="flex", max_chunks=16, min_chunk_rows=128, split_initial=True, sel_q_block=16,
                        initial_copy_tokens=64)
    with torch.no_grad():
        o_a, lse_a = compressed_branch(q_fold, x["k_cmp"], x["v_cmp"], cfg, scale, plain)
        o_b, lse_b = compressed_branch(q_fold, x["k_cmp"], x["v_cmp"], cfg, scale, chunked)
        o_a, o_b = o_a.dense(T * G), o_b.dense(T * G)
        s_a = selected_branch(q_fold, x["k"], x["v"], sel, cfg, scale, plain, forced_initial=True)
        s_b = selected_branch(q_fold, x["k"], x["v"], sel, cfg, scale, chunked, forced_initial=True)
    tol = 1e3 * torch.finfo(torch.float64).eps
    assert (o_a - o_b).abs().max() <= tol
    assert torch.equal(lse_a.isinf(), lse_b.isinf())
    finite = lse_a.isfinite()
    assert (lse_a[finite] - lse_b[finite]).abs().max() <= tol
    assert (s_a - s_b).abs().max() <= tol
    # A mutation check of the test itself: dropping the initial blocks changes the result.
    broken = torch.where(sel < n_initial, -1, sel)
    with torch.no_grad():
        s_c = selected_branch(q_fold, x["k"], x["v"], broken, cfg, scale, plain)
    assert (s_a - s_c).abs().max() > 1e-3


def test_given_selection_is_not_split():
    """A caller's selection may lack block 0: the op must then not add the initial blocks."""
    cfg = small_config(4, 32, 16, 1)
    T = 256
    x = random_inputs(cfg, T, seed=5)
    _, sel = nsa_reference(**x, config=cfg)
    sel = torch.where(sel == 0, -1, sel)
    o_ref, _ = nsa_reference(**x, config=cfg, block_indices=sel)
    with torch.no_grad():
        tiles = FlexTiles(sel_impl="flex", min_chunk_rows=128, split_initial=True)
        o, _ = nsa_flex(**x, config=cfg, block_indices=sel, tiles=tiles)
    assert (o - o_ref).abs().max() <= 1e3 * torch.finfo(torch.float64).eps


def test_shape_masks_are_built_once_per_shape_in_eager_mode():
    from nsa_flex.flex import branches as flex_mod

    calls = []

    def build(T, *, G):
        calls.append((T, G))
        return torch.full((T,), G)

    flex_mod._SHAPE_MASKS.clear()
    a = flex_mod.shape_mask(build, 4, G=2)
    assert flex_mod.shape_mask(build, 4, G=2) is a
    flex_mod.shape_mask(build, 8, G=2)
    with torch.inference_mode():
        b = flex_mod.shape_mask(build, 4, G=2)
    assert b is not a and b.is_inference()
    assert calls == [(4, 2), (8, 2), (4, 2)]
    for T in range(flex_mod._SHAPE_MASKS_MAX + 5):
        flex_mod.shape_mask(build, 100 + T, G=1)
    assert len(flex_mod._SHAPE_MASKS) == flex_mod._SHAPE_MASKS_MAX
    flex_mod._SHAPE_MASKS.clear()


@pytest.mark.parametrize("T,rows,split", [(2048, 128, False), (2049, 16, True), (65536, 16, True)])
def test_tiles_follow_length_by_default(T, rows, split):
    """Default tiles: 128-row selected tiles and no initial-key copies up to 2*n*l' tokens (paper config: 2048)."""
    cfg = NSAConfig(n_heads=64, n_kv_heads=4, head_dim=128)
    assert FlexTiles().sel_rows(T, cfg) == rows and FlexTiles().split_at(T, cfg) == split
    assert FlexTiles(sel_q_block=32, split_initial=True).sel_rows(T, cfg) == 32
    assert FlexTiles(sel_q_block=32, split_initial=True).split_at(T, cfg)
