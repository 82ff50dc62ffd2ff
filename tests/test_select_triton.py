"""The selection kernel of nsa_flex/ops/select_triton.py against the torch twin and
nsa_flex.reference.select_blocks, with launch_config's tiles and with others.

Run on CUDA (marked gpu) or, on a CPU machine, under Triton's interpreter (TRITON_INTERPRET=1
set before Python starts, Triton installed; skipped otherwise). A kernel's selection must equal
the twin's up to near-ties that fp32 rounding may order either way
(nsa_flex.ops.select.checks.assert_same_selection against fp64 importance); hand-built cases compare exactly.
Small tiles (tiles=...) force many programs, tiles and queue merges on small inputs; the cases
with DEFAULT run launch_config's tiles (G=16: BT=8 and 4 warps, also at Dk=192).
"""

from __future__ import annotations

import math

import pytest
import torch

from nsa_flex.ops.select.checks import assert_same_selection
from test_ops_select import make_config, make_inputs, reference_selection, selection_tolerance

from nsa_flex.blocks import num_cmp_blocks
from nsa_flex.compression import compressed_seqlens
from interpreter import QUIET_NUMPY, interpreter_skip
from nsa_flex.config import NSAConfig
from nsa_flex.ops import select_blocks_torch
from nsa_flex.ops.select import kernels as select_triton


def _device() -> str | None:
    if select_triton.HAS_TRITON and torch.cuda.is_available():
        return "cuda"
    if interpreter_skip(getattr(select_triton, "_select_kernel", None)) is None:
        return "cpu"
    return None


DEVICE = _device()
pytestmark = [
    pytest.mark.skipif(DEVICE is None, reason="needs CUDA and Triton, or Triton's interpreter "
                       "(TRITON_INTERPRET=1 before Python starts) with numpy < 2.4"),
    QUIET_NUMPY,
]
FP32 = torch.float32
# Triton 3.6's interpreter gets bf16 tl.dot wrong (errors ~1e10 on random inputs; fp16 and fp32
# are exact): there the half-precision cases run in fp16.
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16


def run_kernel(q, k_cmp, lse, config, tiles, cu=None):
    cu_cmp = None if cu is None else compressed_seqlens(cu, config).to(DEVICE)
    cu = None if cu is None else cu.to(DEVICE)
    return select_triton.select_blocks_triton(q, k_cmp, lse, cu, cu_cmp, q.shape[-1] ** -0.5, config, tiles)


# Beyond tests/test_ops_select.py's geometries: no forced block (with n_local >= 2 the
# blocks of compression blocks a token cannot see yet are all forced, so only here does the
# causal mask inside a tile decide anything), and R = l' / d = 3 (padded score rows).
MORE_GEOMETRIES = {
    "unforced": dict(cmp_block=32, cmp_stride=16, sel_block=64, n_initial=0, n_local=0),
    "sel48": dict(cmp_block=32, cmp_stride=16, sel_block=48, n_initial=1, n_local=1),
}


def check(B, T, G, Dk, n, geometry, dtype, tiles, seed=0):
    if geometry in MORE_GEOMETRIES:
        config = NSAConfig(n_heads=2 * G, n_kv_heads=2, head_dim=Dk, n_selected=n, **MORE_GEOMETRIES[geometry])
    else:
        config = make_config(G, Dk, n, geometry)
    q, k_cmp, lse = make_inputs(B, T, config, dtype=dtype, seed=seed, device=DEVICE)
    got = run_kernel(q, k_cmp, lse, config, tiles)
    assert got.dtype == torch.int32 and got.shape == (B, config.n_kv_heads, T, n)
    twin = select_blocks_torch(q, k_cmp, lse, config)
    want, scores = reference_selection(q, k_cmp, lse, config)
    tol = selection_tolerance(q, k_cmp, lse, config)
    assert_same_selection(got, twin.long(), scores, tol)
    assert_same_selection(got, want, scores, tol)


DEFAULT = {}


# (B, T, G, Dk, n, geometry, dtype, tiles): G' = 1..16 (3 padded to 4), head dims 32 to 192
# (192 pads to 256), T not a multiple of 64, the four geometries. DEFAULT: launch_config's tiles
# (BT = 16 for G <= 8, 8 for G = 16; BS = 16, or 32 for n = 32); a larger BT keeps the longer
# cases quick under the interpreter. A tile of BS selection blocks spans BS * l' tokens: BS = 4
# or 8 gives several tiles (the C1 carry, tiles every token sees whole) on short inputs;
# DEPTH = 1 merges at every join (as in the exact walk of a program whose lists lost a block,
# and in the queues alone with LISTS = 0).
CASES = [
    pytest.param(2, 200, 1, 64, 4, "paper", FP32, DEFAULT, id="G1-D64-fp32"),
    pytest.param(1, 2100, 1, 32, 4, "paper", HALF, dict(BT=32), id="G1-T2100-BT32"),
    pytest.param(2, 333, 4, 128, 6, "paper", HALF, DEFAULT, id="G4-D128-half"),
    pytest.param(1, 700, 16, 64, 4, "paper", HALF, dict(BT=16, BS=4), id="G16-D64-BT16-BS4-half"),
    pytest.param(1, 300, 16, 192, 5, "paper", FP32, DEFAULT, id="G16-D192-fp32"),
    pytest.param(1, 200, 16, 128, 4, "paper", HALF, DEFAULT, id="G16-D128-half"),
    pytest.param(1, 460, 3, 64, 4, "no_overlap", FP32, dict(BS=4), id="G3-no_overlap-BS4"),
    pytest.param(1, 600, 2, 32, 3, "sel32", HALF, dict(BS=8), id="G2-sel32-BS8"),
    pytest.param(1, 500, 8, 64, 4, "long_cmp", FP32, dict(BS=4), id="G8-long_cmp-BS4"),
    pytest.param(1, 700, 4, 64, 32, "paper", HALF, dict(BT=32), id="G4-n32-BT32"),
    pytest.param(1, 700, 4, 64, 4, "unforced", HALF, dict(BS=4), id="G4-unforced-BS4"),
    pytest.param(1, 500, 2, 64, 4, "sel48", FP32, dict(BS=4), id="G2-sel48-BS4"),
    pytest.param(1, 420, 16, 64, 4, "paper", FP32, dict(BT=4, BS=4, DEPTH=1, LISTS=0), id="G16-BT4-depth1"),
    pytest.param(2, 420, 4, 128, 5, "paper", HALF, dict(BT=8, BS=8, DEPTH=2, LISTS=0), id="G4-BT8-depth2"),
    # The queues alone (no lists), and one or two keys per list: most programs' lists lose a
    # block and the program walks again with the exact queues (without it these selections are wrong).
    pytest.param(1, 333, 4, 64, 6, "paper", HALF, dict(LISTS=0), id="G4-exact-queues"),
    pytest.param(1, 1500, 4, 64, 16, "paper", HALF, dict(BT=8, LISTS=1), id="G4-n16-lists1"),
    # A register cap: the launch through nsa_flex::capped_launch (the interpreter ignores the cap).
    pytest.param(1, 1500, 4, 64, 16, "paper", HALF, dict(BT=8, LISTS=1, maxnreg=128), id="G4-n16-lists1-maxnreg128"),
    pytest.param(1, 1500, 4, 128, 16, "paper", HALF, dict(LISTS=6), id="G4-n16-lists6"),
    pytest.param(1, 1100, 2, 32, 16, "paper", FP32, dict(LISTS=2, ROTATE=0), id="G2-n16-lists2-no-rotation"),
]


@pytest.mark.parametrize("B, T, G, Dk, n, geometry, dtype, tiles", CASES)
def test_kernel_matches_twin(B, T, G, Dk, n, geometry, dtype, tiles):
    check(B, T, G, Dk, n, geometry, dtype, tiles, seed=T + G)


@pytest.mark.parametrize("tiles", [DEFAULT, dict(BT=8, BS=8, DEPTH=1, LISTS=0), dict(BT=8, BS=8, LISTS=1)],
                         ids=["default", "small-queues", "small-lists1"])
def test_varlen(tiles):
    """Packed documents: short, empty (1 token, no compressed token) and long ones."""
    config = make_config(4, 64, 6)
    cu = torch.tensor([0, 100, 101, 121, 700, 764, 900], dtype=torch.int32)
    q, k_cmp, lse = make_inputs(1, 900, config, dtype=HALF, seed=2, device=DEVICE, cu_seqlens=cu)
    got = run_kernel(q, k_cmp, lse, config, tiles, cu=cu)
    want, scores = reference_selection(q, k_cmp, lse, config, cu_seqlens=cu)
    assert_same_selection(got, want, scores, selection_tolerance(q, k_cmp, lse, config))
    assert got[0, :, 100].tolist() == [[0, -1, -1, -1, -1, -1]] * config.n_kv_heads


@pytest.mark.parametrize("tiles", [DEFAULT, dict(BS=8, DEPTH=1, LISTS=0), dict(BS=8, LISTS=1)],
                         ids=["default", "BS8-queues-depth1", "BS8-lists1"])
def test_exact_ties_and_empty(tiles):
    """q = 0, lse = 0: p = 1 on every visible block, interior blocks tie exactly and the lowest
    ids win; T < l: no compressed token, only block 0. Each equals the twin exactly."""
    config = NSAConfig(n_heads=4, n_kv_heads=2, head_dim=16, n_selected=5)
    T = 1024
    q = torch.zeros(1, T, 4, 16, device=DEVICE)
    k_cmp = torch.randn(1, num_cmp_blocks(T, config), 2, 16, device=DEVICE)
    lse = torch.zeros(1, 4, T, device=DEVICE)
    got = run_kernel(q, k_cmp, lse, config, tiles)
    assert got[0, :, T - 1].tolist() == [[0, 1, 2, 14, 15]] * 2
    assert torch.equal(got, select_blocks_torch(q, k_cmp, lse, config))
    q, k_cmp, lse = torch.randn(1, 20, 4, 16), torch.empty(1, 0, 2, 16), torch.full((1, 4, 20), -math.inf)
    got = run_kernel(q.to(DEVICE), k_cmp.to(DEVICE), lse.to(DEVICE), config, tiles)
    assert got.tolist() == [[[[0, -1, -1, -1, -1]] * 20] * 2]


def test_hand_computed_weights_and_group_sum():
    """tests/test_ops_select.py's hand-worked case (weights 1,2,2,2,1, sum over the group's
    heads, not a max): the last token selects [0, 3, 6, 7]."""
    from test_ops_select import _hand_inputs

    config = NSAConfig(n_heads=2, n_kv_heads=1, head_dim=32, n_selected=4)
    p0, p1 = [1e-6] * 31, [1e-6] * 31
    p0[11], p0[17], p1[13], p1[9] = 0.30, 0.20, 0.12, 0.05
    q, k_cmp, lse = (x.to(DEVICE) for x in _hand_inputs([p0, p1], 512, config))
    got = run_kernel(q, k_cmp, lse, config, DEFAULT)
    assert got[0, 0, 511].tolist() == [0, 3, 6, 7]


def test_launch_config_defaults():
    """The measured tiles (see launch_config): 128 score columns, at most 16 tokens, 4 warps, 2 stages,
    the lists on long sequences only."""
    for G, BT in [(1, 16), (2, 16), (3, 16), (4, 16), (8, 16), (16, 8)]:
        for Dk in (64, 128, 192):
            assert select_triton.launch_config(G, Dk, 16) == {
                "BT": BT, "BS": 16, "DEPTH": 4, "LISTS": 0, "ROTATE": 1, "num_warps": 4, "num_stages": 2,
                "maxnreg": 0}
    assert select_triton.launch_config(4, 128, 32)["BS"] == 32
    # The lists from 32 tiles of selection blocks on (T = 32k at the paper's geometry), with a
    # register cap of 128 at G' <= 4 and 168 at G' >= 8, Dk <= 128 only.
    assert [select_triton.launch_config(4, 128, 16, blocks)["LISTS"] for blocks in (511, 512)] == [0, 6]
    assert select_triton.launch_config(4, 128, 32, 1023)["LISTS"] == 0
    # Past 4096 tiles a list key has no room for the tile: the exact queues (T > 4M tokens).
    assert [select_triton.launch_config(4, 128, 16, blocks)["LISTS"] for blocks in (4096 * 16, 4096 * 16 + 1)] == [6, 0]
    # 3 stages with the lists at G' <= 4, Dk <= 64 (seeds-125m's heads).
    stages = {(G, Dk) for G in (1, 2, 3, 4, 8, 16) for Dk in (64, 128, 192)
              if select_triton.launch_config(G, Dk, 16, 1024)["num_stages"] == 3}
    assert stages == {(G, 64) for G in (1, 2, 3, 4)}
    caps = {(G, Dk): select_triton.launch_config(G, Dk, 16, 1024)["maxnreg"]
            for G in (1, 2, 3, 4, 8, 16) for Dk in (64, 128, 192)}
    assert {key: cap for key, cap in caps.items() if cap} == {
        **{(G, Dk): 128 for G in (1, 2, 3, 4) for Dk in (64, 128)},
        **{(G, Dk): 168 for G in (8, 16) for Dk in (64, 128)}}


def test_lists_out_of_range():
    config = make_config(2, 32, 4)
    q, k_cmp, lse = make_inputs(1, 64, config, device=DEVICE)
    with pytest.raises(ValueError, match=r"LISTS \(keys kept per token and tile column\) must be 0 .* to 8, got 9"):
        run_kernel(q, k_cmp, lse, config, {"LISTS": 9})


def test_lists_refused_past_their_key_bits():
    """Tiles of 4 selection blocks: 4097 tiles need 13 bits of a 32-bit key, one more than allowed."""
    config = make_config(1, 16, 4)
    T = 4097 * 4 * config.sel_block
    q, k_cmp, lse = make_inputs(1, 64, config, device="cpu")
    q = q.new_zeros(1, T, q.shape[2], q.shape[3])
    lse = lse.new_zeros(1, lse.shape[1], T)
    k_cmp = k_cmp.new_zeros(1, num_cmp_blocks(T, config), k_cmp.shape[2], k_cmp.shape[3])
    assert select_triton.list_tile_bits(4096 * 4, 4) == 12
    with pytest.raises(ValueError, match=r"LISTS=6 needs at most 4096 tiles of 4 selection blocks, got 1048832 "
                                         r"tokens; use LISTS=0"):
        run_kernel(q.to(DEVICE), k_cmp.to(DEVICE), lse.to(DEVICE), config, {"BS": 4, "LISTS": 6})


if select_triton.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _list_key_kernel(key_ptr, col_ptr, out_ptr, BS: tl.constexpr, ROTATE: tl.constexpr, JT_BITS: tl.constexpr,
                         NUM: tl.constexpr):
        i = tl.arange(0, NUM)
        out = select_triton._list_key64(tl.load(key_ptr + i), tl.load(col_ptr + i), BS, ROTATE, JT_BITS)
        tl.store(out_ptr + i, out)


@pytest.mark.parametrize("rotate", [1, 0])
def test_list_keys_rank_as_64_bit_keys(rotate):
    """The lists' 32-bit keys (a score's bits with the low JT_BITS cleared, the tile counted down in
    them): within a column they order as the 64-bit keys of the cleared score and the block id (ties
    to the lower id), and _list_key64 gives back exactly that 64-bit key; the empty key maps to EMPTY."""
    BS, bits, num = 16, 6, 256
    g = torch.Generator().manual_seed(rotate)
    # Scores: positive floats over many binades, some equal after clearing, +inf (forced), -inf (none).
    score = torch.exp(torch.randn(num, generator=g) * 20).float()
    score[:32] = score[32:64] * (1 + 2.0 ** -20)  # equal once the low bits are cleared
    score[64:68], score[68:72] = math.inf, -math.inf
    jt = torch.randint(0, 2 ** bits, (num,), generator=g, dtype=torch.int32)
    col = torch.randint(0, BS, (num,), generator=g, dtype=torch.int32)
    cleared = score.view(torch.int32) & -(1 << bits)
    key32 = cleared | ((1 << bits) - 1 - jt)
    key32[-1] = -2147483648  # an empty list slot
    src = (col + (BS - jt % BS)) % BS if rotate else col
    block = jt.long() * BS + src.long()
    want = (cleared.long() << 32) | (2147483647 - block)
    want[-1] = -36028797018963968
    out = torch.empty(num, dtype=torch.int64, device=DEVICE)
    _list_key_kernel[(1,)](key32.to(DEVICE), col.to(DEVICE), out, BS, rotate, bits, num)
    assert torch.equal(out.cpu(), want)
    same = col[:-1, None] == col[None, :-1]
    assert torch.equal((key32[:-1, None] > key32[None, :-1]) & same, (want[:-1, None] > want[None, :-1]) & same)


def test_unknown_tile_key():
    config = make_config(2, 32, 4)
    q, k_cmp, lse = make_inputs(1, 64, config, device=DEVICE)
    allowed = r"unknown selection tile keys \['NSUB', 'variant'\]; allowed: BT, BS, DEPTH, LISTS, ROTATE, num_warps"
    with pytest.raises(ValueError, match=allowed):
        run_kernel(q, k_cmp, lse, config, {"variant": "cols", "NSUB": 4, "BT": 8})


G16 = (1, 4099, 16, 128, 16, "paper", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("B, T, G, Dk, n, geometry, dtype, tiles", [
    pytest.param(*G16, DEFAULT, id="G16-D128"),
    pytest.param(*G16, dict(BT=16, num_warps=8, num_stages=3), id="G16-D128-BT16-w8-stages3"),
    pytest.param(*G16, dict(BT=16, num_warps=8, DEPTH=8, maxnreg=128), id="G16-D128-BT16-w8-depth8-maxnreg128"),
    pytest.param(1, 4099, 16, 192, 16, "paper", torch.bfloat16, DEFAULT, id="G16-D192"),
    pytest.param(2, 3000, 4, 128, 32, "paper", torch.float16, DEFAULT, id="G4-n32-fp16"),
    pytest.param(1, 5000, 4, 128, 16, "paper", torch.bfloat16, dict(BT=32, num_warps=8, maxnreg=128),
                 id="G4-BT32-w8-maxnreg128"),
    pytest.param(1, 5000, 1, 64, 5, "sel32", torch.bfloat16, DEFAULT, id="G1-sel32"),
    # The lists (the default from 32k tokens on), programs that lost a block walking again exactly.
    pytest.param(*G16, dict(LISTS=6), id="G16-D128-lists6"),
    pytest.param(1, 5000, 4, 128, 16, "paper", torch.bfloat16, dict(LISTS=6), id="G4-lists6"),
    pytest.param(1, 5000, 4, 128, 16, "paper", torch.bfloat16, dict(LISTS=6, maxnreg=128), id="G4-lists6-maxnreg128"),
    pytest.param(1, 5000, 4, 128, 16, "paper", torch.bfloat16, dict(LISTS=4, ROTATE=0), id="G4-lists4-no-rotation"),
    pytest.param(1, 5000, 8, 64, 16, "paper", torch.bfloat16, dict(LISTS=6, maxnreg=168), id="G8-D64-lists6-maxnreg168"),
    # The long-sequence settings at seeds-125m's heads (Dk = 64): lists, 3 stages, a cap of 128.
    pytest.param(1, 5000, 4, 64, 16, "paper", torch.bfloat16, dict(LISTS=6, num_stages=3, maxnreg=128),
                 id="G4-D64-lists6-stages3-maxnreg128"),
    pytest.param(1, 5000, 8, 128, 16, "paper", torch.bfloat16, dict(LISTS=1, maxnreg=168), id="G8-lists1-maxnreg168"),
])
def test_kernel_matches_twin_gpu(B, T, G, Dk, n, geometry, dtype, tiles):
    """Settings bench/select_gpu.py times, on longer inputs (many tiles and merges)."""
    check(B, T, G, Dk, n, geometry, dtype, tiles, seed=T + G)


def _select_lists(q: torch.Tensor, k_cmp: torch.Tensor, lse: torch.Tensor, maxnreg: int) -> torch.Tensor:
    """The kernel with one key per list, in a triton_op as nsa_flex::select_blocks runs it."""
    return select_triton.select_blocks_triton(q, k_cmp, lse, None, None, q.shape[-1] ** -0.5, make_config(4, 64, 16),
                                              dict(BT=8, LISTS=1, maxnreg=maxnreg))


if select_triton.HAS_TRITON:
    torch.library.triton_op("nsa_flex_test::select_lists", mutates_args=())(_select_lists)
    torch.library.register_fake("nsa_flex_test::select_lists")(
        lambda q, k_cmp, lse, maxnreg: q.new_empty((q.shape[0], k_cmp.shape[2], q.shape[1], 16), dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("maxnreg", [0, 128])
def test_lists_and_exact_walk_under_fullgraph_compile(maxnreg):
    """The lists path traced by torch.compile(fullgraph=True): with one key per list most
    programs walk again with the exact queues, and the compiled selection must still equal the
    reference up to near-ties. With a register cap the launch runs through nsa_flex::capped_launch."""
    config = make_config(4, 64, 16)
    q, k_cmp, lse = make_inputs(1, 1500, config, dtype=HALF, seed=5, device=DEVICE)
    compiled = torch.compile(lambda q, k, l: torch.ops.nsa_flex_test.select_lists(q, k, l, maxnreg), fullgraph=True)
    got = compiled(q, k_cmp, lse)
    want, scores = reference_selection(q, k_cmp, lse, config)
    assert_same_selection(got, want, scores, selection_tolerance(q, k_cmp, lse, config))
