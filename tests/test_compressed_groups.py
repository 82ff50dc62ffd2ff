"""The compressed branch as one causal call over token groups (flex.compressed_groups), on CPU.

The grouped layout is checked in plain torch (cmp_impl="torch") against the reference's
compressed branch in fp64: output, lse and the gradients of q, k_cmp, v_cmp, at lengths that
leave the last group partial. cuDNN runs the same layout on CUDA (tests/test_flex_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

from nsa_flex import NSAConfig
from nsa_flex.flex import compressed_branch, fold
from nsa_flex.flex.branches import compressed_impl
from nsa_flex.flex.compressed_groups import causal_attention_lse, compressed_grouped
from nsa_flex.flex.tuning import FlexTiles
from naive import compressed_dense, random_inputs

EPS = torch.finfo(torch.float64).eps


@pytest.mark.parametrize("T,G,Hkv,B,l,d", [(32, 4, 1, 1, 32, 16), (300, 4, 2, 2, 32, 16), (77, 16, 1, 1, 32, 16),
                                           (100, 2, 2, 1, 16, 8), (95, 3, 1, 2, 32, 32)],
                         ids=["T=l", "T300-G4", "T77-G16", "l16-d8", "G3-l=d"])
def test_grouped_call_equals_the_compressed_branch(T, G, Hkv, B, l, d):
    cfg = NSAConfig(n_heads=G * Hkv, n_kv_heads=Hkv, head_dim=32, head_dim_v=24, cmp_block=l, cmp_stride=d,
                    window=64, n_selected=4, sel_block=32)
    x = random_inputs(cfg, T, B=B, seed=5)
    q, kc, vc = (x[n].clone().requires_grad_(True) for n in ("q", "k_cmp", "v_cmp"))
    scale = 32 ** -0.5
    rows, lse = compressed_branch(fold(q, Hkv), kc, vc, cfg, scale, FlexTiles(cmp_impl="torch"))
    o_fold = rows.dense(T * G)
    o_ref, lse_ref = compressed_dense(q, kc, vc, cfg, scale)
    # Folded [B, Hkv, T*G, Dv] -> [B, Hq, T, Dv]
    o = o_fold.view(B, Hkv, T, G, -1).transpose(2, 3).reshape(B, Hkv * G, T, -1)
    assert (o - o_ref).abs().max() <= 100 * EPS
    assert torch.equal(lse.isinf(), lse_ref.isinf())
    finite = lse_ref.isfinite()
    # lse is float32 whatever the inputs (as the Flex call's): its rounding is the bound.
    assert lse.dtype == torch.float32
    assert (lse[finite] - lse_ref[finite]).abs().max() <= 4 * torch.finfo(torch.float32).eps * lse_ref[finite].abs().max()
    assert torch.equal(o[:, :, :l - 1], torch.zeros_like(o[:, :, :l - 1]))
    do = torch.randn_like(o_ref)
    grads = torch.autograd.grad(o, (q, kc, vc), do)
    grads_ref = torch.autograd.grad(o_ref, (q, kc, vc), do)
    for name, a, b in zip(("dq", "dk_cmp", "dv_cmp"), grads, grads_ref):
        assert (a - b).abs().max() <= 1e3 * EPS, name


def test_grouped_layout_mutation_is_caught():
    """Groups shifted by one stride (a wrong first visible token) change o: the test above can fail."""
    cfg = NSAConfig(n_heads=4, n_kv_heads=1, head_dim=32, head_dim_v=24, window=64, n_selected=4, sel_block=32)
    x = random_inputs(cfg, 200, seed=2)
    scale = 32 ** -0.5
    wrong = cfg.replace(cmp_block=cfg.cmp_block + cfg.cmp_stride)
    with torch.no_grad():
        o = compressed_grouped(fold(x["q"], 1), x["k_cmp"], x["v_cmp"], cfg, scale, causal_attention_lse)[0].dense(800)
        o_bad = compressed_grouped(fold(x["q"], 1), x["k_cmp"], x["v_cmp"], wrong, scale,
                                   causal_attention_lse)[0].dense(800)
    assert (o - o_bad).abs().max() > 1e-3


def test_cmp_impl_choice_and_its_errors():
    cfg = NSAConfig(n_heads=4, n_kv_heads=1, head_dim=32, head_dim_v=24, window=64, n_selected=4, sel_block=32)
    x = random_inputs(cfg, 100, dtype=torch.bfloat16, seed=1)
    q_fold = fold(x["q"], 1)
    # On CPU, or with Dk != Dv, None takes Flex; documents always take Flex.
    assert compressed_impl(q_fold, x["k_cmp"], x["v_cmp"], FlexTiles()) == "flex"
    assert compressed_impl(q_fold, x["k_cmp"], x["v_cmp"], FlexTiles(cmp_impl="torch")) == "torch"
    with pytest.raises(ValueError, match="cmp_impl='cudnn' needs CUDA tensors"):
        compressed_impl(q_fold, x["k_cmp"], x["v_cmp"], FlexTiles(cmp_impl="cudnn"))
    with pytest.raises(ValueError, match="packed documents"):
        compressed_impl(q_fold, x["k_cmp"], x["v_cmp"], FlexTiles(cmp_impl="torch"), docs=object())
    with pytest.raises(ValueError, match="cmp_impl='grouped'.*allowed None"):
        FlexTiles(cmp_impl="grouped")


@pytest.mark.parametrize("T,G,Hkv,B", [(300, 4, 2, 2), (77, 16, 1, 1), (40, 2, 1, 1)], ids=["T300-G4", "T77-G16", "T40"])
def test_whole_op_with_grouped_call_equals_the_reference(T, G, Hkv, B):
    """nsa_flex with cmp_impl="torch": the folded queries and the grouped call's rows share one
    tensor (q_room); output and selection equal the reference's in fp64."""
    from nsa_flex.flex import nsa_flex
    from nsa_flex.reference import nsa_reference

    cfg = NSAConfig(n_heads=G * Hkv, n_kv_heads=Hkv, head_dim=32, head_dim_v=24, window=64, n_selected=4,
                    sel_block=32)
    x = random_inputs(cfg, T, B=B, seed=11)
    o_ref, sel_ref = nsa_reference(**x, config=cfg)
    with torch.no_grad():
        o, sel = nsa_flex(**x, config=cfg, tiles=FlexTiles(cmp_impl="torch"))
    assert torch.equal(sel.long(), sel_ref.long())
    assert (o - o_ref).abs().max() <= 100 * EPS


def test_q_room_too_short_is_refused():
    cfg = NSAConfig(n_heads=4, n_kv_heads=1, head_dim=32, head_dim_v=24, window=64, n_selected=4, sel_block=32)
    x = random_inputs(cfg, 100, seed=1)
    q_fold = fold(x["q"], 1)
    with pytest.raises(ValueError, match="q_room .* must be"):
        compressed_grouped(q_fold, x["k_cmp"], x["v_cmp"], cfg, 32 ** -0.5, causal_attention_lse, q_room=q_fold)


def test_cudnn_backward_slices():
    """(rows, heads) a cuDNN backward call: as many batch rows as keep cuDNN's fp32 dK / dV of
    every query head within CUDNN_BACKWARD_BYTES, at least one, and where one row does not fit and
    its heads share one kv head, part of its heads; everything without GQA."""
    from nsa_flex.flex.compressed_groups import CUDNN_BACKWARD_BYTES, backward_slices

    Tc = 4095
    # g4 at 64k (d*G = 64 heads, D=128): one row a call; seeds-125m's heads (D=64): two rows a call.
    assert backward_slices(4, 64, 1, Tc, 128, 128) == (1, 64)
    assert backward_slices(3, 64, 1, Tc, 64, 64) == (2, 64)
    # G=16 (256 heads, D=128): a quarter of a row a call.
    assert backward_slices(4, 256, 1, Tc, 128, 128) == (1, 64)
    assert backward_slices(4, 1024, 1, Tc, 128, 128) == (1, 64)
    assert backward_slices(12, 8, 8, 10**6, 128, 128) == (12, 8)
    # Several kv heads: whole rows only.
    assert backward_slices(2, 512, 4, Tc, 128, 128) == (1, 512)
    rows, heads = backward_slices(7, 64, 1, 3000, 128, 64)
    assert heads == 64 and rows * 4 * 64 * 3000 * 192 <= CUDNN_BACKWARD_BYTES < (rows + 1) * 4 * 64 * 3000 * 192
    # At least one head even where one does not fit.
    assert backward_slices(1, 64, 1, 10**7, 128, 128) == (1, 1)
    assert backward_slices(3, 64, 2, 10**7, 128, 128) == (1, 64)


@pytest.mark.parametrize("H", [6, 1])
def test_causal_attention_backward_equals_autograd(H):
    """causal_attention_backward (the grouped call's backward in torch) against autograd through
    causal_attention_lse, fp64: equal but for the lse it is given, which is fp32 (as cuDNN's), so P
    carries up to a rounding of lse."""
    from nsa_flex.flex.compressed_groups import causal_attention_backward

    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, H, 37, 16, dtype=torch.float64, generator=g).requires_grad_()
    k, v = (torch.randn(2, 1, 37, 16, dtype=torch.float64, generator=g).requires_grad_() for _ in range(2))
    do = torch.randn(2, H, 37, 16, dtype=torch.float64, generator=g)
    o, lse = causal_attention_lse(q, k, v, 0.3)
    want = torch.autograd.grad(o, (q, k, v), do)
    got = causal_attention_backward(do, q.detach(), k.detach(), v.detach(), o.detach(), lse, 0.3)
    lse_rounding = torch.finfo(torch.float32).eps * lse.abs().max().item()
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert (a - b).abs().max() <= (1e3 * EPS + 4 * lse_rounding) * b.abs().max(), name
    # Given the fp64 lse, the same to fp64 roundings.
    lse64 = torch.logsumexp((q @ k.transpose(-1, -2) * 0.3).masked_fill(
        ~torch.ones(37, 37, dtype=torch.bool).tril(), float("-inf")), -1).detach()
    got = causal_attention_backward(do, q.detach(), k.detach(), v.detach(), o.detach(), lse64, 0.3)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert (a - b).abs().max() <= 1e3 * EPS * b.abs().max(), name
