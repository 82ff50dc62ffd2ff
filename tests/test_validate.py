"""Every bad input to nsa_attention raises an error that says what was wrong and what is allowed."""

from __future__ import annotations

import re

import pytest
import torch

from nsa_flex import NSAAttention, NSAConfig, nsa_attention
from naive import naive_nsa, random_inputs

# T=40: Tc = (40 - 8) // 4 + 1 = 9 compression blocks, Ns = 5 selection blocks.
CFG = NSAConfig(n_heads=4, n_kv_heads=2, head_dim=8, head_dim_v=6, cmp_block=8, cmp_stride=4, sel_block=8,
                n_selected=3, window=16)
T, TC = 40, 9


def inputs(**changes) -> dict:
    x = random_inputs(CFG, T, dtype=torch.float32, seed=0)
    x.update(changes)
    return x


def call(x: dict, **kwargs):
    return nsa_attention(**x, config=kwargs.pop("config", CFG), **kwargs)


@pytest.mark.parametrize("impl", ["reference", "flex"])
def test_valid_inputs_pass(impl):
    """Checked inputs go through unchanged: the output and selection are the naive oracle's."""
    x = inputs()
    with torch.no_grad():
        o, sel = call(x, impl=impl, return_indices=True)
    want, chosen = naive_nsa(**x, cfg=CFG)
    assert o.shape == (1, T, 4, 6) and o.dtype == torch.float32
    torch.testing.assert_close(o.double(), want, rtol=0, atol=1e-5)
    assert [[sorted(int(j) for j in sel[0, h, t] if j >= 0) for t in range(T)] for h in range(2)] == chosen[0]


@pytest.mark.parametrize("name", ["q", "k", "v", "k_cmp", "v_cmp", "gates"])
def test_not_a_tensor(name):
    with pytest.raises(TypeError, match=rf"{name} must be a torch\.Tensor, got list"):
        call(inputs(**{name: [1.0]}))


@pytest.mark.parametrize("name, layout", [
    ("q", r"\[B, T, Hq, Dk\]"), ("k", r"\[B, T, Hkv, Dk\]"), ("v", r"\[B, T, Hkv, Dv\]"),
    ("k_cmp", r"\[B, Tc, Hkv, Dk\]"), ("v_cmp", r"\[B, Tc, Hkv, Dv\]"), ("gates", r"\[B, T, Hq, 3\]"),
])
@pytest.mark.parametrize("rank", [pytest.param(3, id="rank3"), pytest.param(5, id="rank5")])
def test_wrong_rank(name, layout, rank):
    x = inputs()
    bad = x[name][0] if rank == 3 else x[name][None]
    with pytest.raises(ValueError, match=rf"{name} must have 4 dims, got shape .*; expected {layout}"):
        call(inputs(**{name: bad}))


@pytest.mark.parametrize("name", ["q", "gates", "k_cmp"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64], ids=str)
def test_non_float_dtype(name, dtype):
    x = inputs()
    with pytest.raises(TypeError, match=rf"{name} has dtype {dtype}; allowed: float16, bfloat16, float32, float64"):
        call(inputs(**{name: x[name].to(dtype)}))


@pytest.mark.parametrize("name", ["k", "v", "k_cmp", "v_cmp", "gates"])
def test_mismatched_dtype(name):
    x = inputs()
    with pytest.raises(TypeError, match=rf"{name} has dtype torch.float64 but q has torch.float32; "
                                        r"all inputs must share one dtype"):
        call(inputs(**{name: x[name].double()}))


@pytest.mark.parametrize("name", ["k", "v", "k_cmp", "v_cmp", "gates"])
def test_mismatched_device(name):
    # The meta device stands in for a second device on a CPU-only machine.
    x = inputs()
    with pytest.raises(ValueError, match=rf"{name} is on meta but q is on cpu; all inputs must share one device"):
        call(inputs(**{name: x[name].to("meta")}))


# (input, a wrong shape for it); q itself keeps B and T, which set every other expectation.
SHAPES = [
    pytest.param("q", (1, T, 6, 8), id="q-heads"),
    pytest.param("q", (1, T, 4, 16), id="q-head-dim"),
    pytest.param("k", (1, T, 1, 8), id="k-heads"),
    pytest.param("k", (1, T, 2, 6), id="k-dim-is-dv"),
    pytest.param("k", (1, T - 1, 2, 8), id="k-tokens"),
    pytest.param("k", (2, T, 2, 8), id="k-batch"),
    pytest.param("v", (1, T, 2, 8), id="v-dim-is-dk"),
    pytest.param("v", (1, T + 1, 2, 6), id="v-tokens"),
    pytest.param("k_cmp", (1, TC + 1, 2, 8), id="k_cmp-Tc"),
    pytest.param("k_cmp", (1, T, 2, 8), id="k_cmp-uncompressed"),
    pytest.param("v_cmp", (1, TC, 2, 8), id="v_cmp-dim"),
    pytest.param("v_cmp", (1, TC, 4, 6), id="v_cmp-heads"),
    pytest.param("gates", (1, T, 4, 2), id="gates-two-branches"),
    pytest.param("gates", (1, T, 2, 3), id="gates-kv-heads"),
]


EXPECTED = {"q": (1, T, 4, 8), "k": (1, T, 2, 8), "v": (1, T, 2, 6), "k_cmp": (1, TC, 2, 8),
            "v_cmp": (1, TC, 2, 6), "gates": (1, T, 4, 3)}


@pytest.mark.parametrize("name, shape", SHAPES)
def test_mismatched_shape(name, shape):
    expected = re.escape(str(EXPECTED[name]))
    with pytest.raises(ValueError, match=rf"{name} has shape {re.escape(str(shape))}, expected {expected} = \[B, "
                                         r".*for config \(n_heads=4, n_kv_heads=2, head_dim=8, head_dim_v=6\)"):
        call(inputs(**{name: torch.zeros(shape)}))


def test_heads_not_divisible():
    # Non-divisible head counts are a config error; q with more heads than the config a shape error.
    with pytest.raises(ValueError, match=r"NSAConfig\.n_heads=6: must be divisible by n_kv_heads=4"):
        NSAConfig(n_heads=6, n_kv_heads=4)
    with pytest.raises(ValueError, match=r"q has shape \(1, 40, 6, 8\), expected \(1, 40, 4, 8\)"):
        call(inputs(q=torch.zeros(1, T, 6, 8)))


def test_empty_sequence():
    x = {n: t[:, :0] for n, t in inputs().items()}
    with pytest.raises(ValueError, match=r"q has T=0 tokens; T must be >= 1"):
        call(x)


# --- block_indices --------------------------------------------------------------------

def good_indices(dtype=torch.int64) -> torch.Tensor:
    """Blocks 0 and 1 for every token, the third slot unused."""
    return torch.tensor([0, 1, -1], dtype=dtype).expand(1, 2, T, 3).clone()


@pytest.mark.parametrize("impl", ["reference", "flex"])
def test_valid_indices_pass(impl):
    # Unsorted ids, unused slots in the middle, a block after some tokens, the last block.
    idx = good_indices(torch.int32)
    idx[..., 1], idx[..., 2] = -1, 4
    idx[0, 1, ::3] = torch.tensor([3, -1, 1], dtype=torch.int32)
    x = inputs()
    with torch.no_grad():
        o, used = call(x, block_indices=idx, impl=impl, return_indices=True)
    want, _ = naive_nsa(**x, cfg=CFG, block_indices=idx)
    assert torch.equal(used, idx)
    torch.testing.assert_close(o.double(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("impl", ["reference", "flex"])
@pytest.mark.parametrize("row, block, slots", [
    pytest.param([0, 0, -1], 0, (0, 1), id="adjacent"),
    pytest.param([2, -1, 2], 2, (0, 2), id="apart"),
])
def test_repeated_indices_rejected(impl, row, block, slots):
    idx = good_indices()
    idx[0, 1, 17] = torch.tensor(row)
    with pytest.raises(ValueError, match=rf"block_indices lists block {block} twice for \[b=0, kv_head=1, t=17\] "
                                         rf"\(slots {slots[0]} and {slots[1]}: .*\); each token's block ids must be "
                                         r"distinct, with -1 for unused slots"):
        call(inputs(), block_indices=idx, impl=impl)


def test_unused_slots_may_repeat():
    idx = torch.tensor([2, -1, -1]).expand(1, 2, T, 3).clone()
    call(inputs(), block_indices=idx)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.uint8, torch.bool], ids=str)
def test_indices_dtype(dtype):
    with pytest.raises(TypeError, match=rf"block_indices has dtype {dtype}; allowed: int32, int64"):
        call(inputs(), block_indices=good_indices().to(dtype))


def test_indices_not_a_tensor():
    with pytest.raises(TypeError, match=r"block_indices must be a torch\.Tensor, got list"):
        call(inputs(), block_indices=[[0]])


@pytest.mark.parametrize("shape", [
    pytest.param((1, 2, T, 4), id="n"), pytest.param((1, 4, T, 3), id="query-heads"),
    pytest.param((1, 2, T - 1, 3), id="tokens"), pytest.param((2, T, 3), id="rank"),
])
def test_indices_shape(shape):
    with pytest.raises(ValueError, match=rf"block_indices has shape {re.escape(str(shape))}, "
                                         r"expected \(1, 2, 40, 3\) = \[B, Hkv, T, n_selected\]"):
        call(inputs(), block_indices=torch.zeros(shape, dtype=torch.int64))


@pytest.mark.parametrize("value", [pytest.param(5, id="past-last-block"), pytest.param(-2, id="below-minus-one")])
def test_indices_out_of_range(value):
    idx = good_indices()
    idx[0, 1, 25, 2] = value
    with pytest.raises(ValueError, match=rf"block_indices values must lie in \[-1, 4\] \(-1 = unused slot, "
                                         rf"5 selection blocks of 8 tokens for T=40\); got {value} at "
                                         r"\[b=0, kv_head=1, t=25, slot=2\]"):
        call(inputs(), block_indices=idx)


def test_indices_out_of_range_in_document():
    # Packed documents use document-local ids: block 3 exists in T=40 but not in a 20-token document.
    cu = torch.tensor([0, 20, 40], dtype=torch.int32)
    x = inputs(k_cmp=torch.zeros(1, 8, 2, 8), v_cmp=torch.zeros(1, 8, 2, 6))
    idx = good_indices()
    idx[0, 0, 30, 0] = 2
    call(x, block_indices=idx, cu_seqlens=cu)
    idx[0, 0, 30, 0] = 3
    with pytest.raises(ValueError, match=r"block_indices values must lie in \[-1, 2\] .*3 selection blocks of 8 "
                                         r"tokens for the document of tokens \[20, 40\)\); got 3 at"):
        call(x, block_indices=idx, cu_seqlens=cu)


def test_indices_device():
    with pytest.raises(ValueError, match=r"block_indices is on meta but q is on cpu; all inputs must share one device"):
        call(inputs(), block_indices=good_indices().to("meta"))


# --- cu_seqlens -----------------------------------------------------------------------

@pytest.mark.parametrize("cu, error, message", [
    pytest.param([0, 40], TypeError, r"cu_seqlens must be a torch\.Tensor \[n_docs \+ 1\] of int32/int64, got list",
                 id="list"),
    pytest.param(torch.tensor([0.0, 40.0]), ValueError,
                 r"cu_seqlens must be a 1-D int32/int64 tensor \[n_docs \+ 1\], got torch\.float32 \(2,\)", id="float"),
    pytest.param(torch.tensor([[0, 40]]), ValueError,
                 r"cu_seqlens must be a 1-D int32/int64 tensor \[n_docs \+ 1\], got torch\.int64 \(1, 2\)", id="2d"),
    pytest.param(torch.tensor([40]), ValueError,
                 r"cu_seqlens must be a 1-D int32/int64 tensor \[n_docs \+ 1\], got torch\.int64 \(1,\)",
                 id="one-entry"),
    pytest.param(torch.tensor([0, 30]), ValueError, r"cu_seqlens must rise strictly from 0 to T=40, got \[0, 30\]",
                 id="short-of-T"),
    pytest.param(torch.tensor([0, 50]), ValueError, r"cu_seqlens must rise strictly from 0 to T=40, got \[0, 50\]",
                 id="past-T"),
    pytest.param(torch.tensor([5, 40]), ValueError, r"cu_seqlens must rise strictly from 0 to T=40, got \[5, 40\]",
                 id="not-from-0"),
    pytest.param(torch.tensor([0, 20, 20, 40]), ValueError,
                 r"cu_seqlens must rise strictly from 0 to T=40, got \[0, 20, 20, 40\]", id="empty-document"),
    pytest.param(torch.tensor([0, 30, 20, 40]), ValueError,
                 r"cu_seqlens must rise strictly from 0 to T=40, got \[0, 30, 20, 40\]", id="decreasing"),
])
def test_bad_cu_seqlens(cu, error, message):
    # k_cmp is sized for no packing: the cu_seqlens error must come first, not a k_cmp shape error.
    with pytest.raises(error, match=message):
        call(inputs(), cu_seqlens=cu)


def test_cu_seqlens_needs_batch_one():
    x = random_inputs(CFG, T, B=2, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"packed documents \(cu_seqlens\) need batch size 1, got B=2"):
        call(x, cu_seqlens=torch.tensor([0, 40]))


def test_cu_seqlens_compressed_length():
    # Two 20-token documents have 2 * 4 compressed tokens, not the 9 of one 40-token sequence.
    with pytest.raises(ValueError, match=r"k_cmp has shape \(1, 9, 2, 8\), expected \(1, 8, 2, 8\) = "
                                         r"\[B, Tc, Hkv, Dk\] with Tc summed over the documents of cu_seqlens"):
        call(inputs(), cu_seqlens=torch.tensor([0, 20, 40]))


# --- window keys/values, impl ----------------------------------------------------------

@pytest.mark.parametrize("name, bad", [
    pytest.param("k_win", torch.zeros(1, T, 2, 6), id="k_win-shape"),
    pytest.param("v_win", torch.zeros(1, T, 2, 6, dtype=torch.float64), id="v_win-dtype"),
    pytest.param("k_win", torch.zeros(1, T, 2, 8, device="meta"), id="k_win-device"),
])
def test_bad_window_kv(name, bad):
    with pytest.raises(ValueError, match=rf"{name} must match {name[0]} in shape, dtype and device"):
        call(inputs(), **{name: bad})


def test_window_kv_not_a_tensor():
    with pytest.raises(TypeError, match=r"v_win must be a torch\.Tensor or None, got list"):
        call(inputs(), v_win=[0.0])


@pytest.mark.parametrize("impl", ["triton", "Reference", "", None])
def test_unknown_impl(impl):
    with pytest.raises(ValueError, match=rf"unknown impl {re.escape(repr(impl))}; allowed: 'auto', 'reference', 'flex'"):
        call(inputs(), impl=impl)


def test_module_rejects_unknown_impl_and_bad_dim():
    with pytest.raises(ValueError, match=r"unknown impl 'fast'; allowed: 'auto', 'reference', 'flex'"):
        NSAAttention(CFG, 32, impl="fast")
    with pytest.raises(ValueError, match=r"dim=0: must be a positive integer"):
        NSAAttention(CFG, 0)
