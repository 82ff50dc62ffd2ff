"""fused_linear against the layers it stands for: values and every gradient, in fp64."""

import pytest
import torch
from torch import nn

from nsa_flex import NSAConfig
from nsa_flex.attention import NSAAttention
from nsa_flex.model import DenseAttention
from nsa_flex.projections import fused_linear


def _layers(biases, dim=24, outs=(16, 8, 12)):
    torch.manual_seed(0)
    return [nn.Linear(dim, o, bias=b).double() for o, b in zip(outs, biases)]


@pytest.mark.parametrize("biases", [(False, False, False), (True, False, True), (True, True, True)],
                         ids=["no-bias", "mixed-bias", "all-bias"])
def test_fused_linear_equals_each_layer(biases):
    layers = _layers(biases)
    x = torch.randn(2, 5, 24, dtype=torch.float64, requires_grad=True)
    got = fused_linear(x, layers)
    want = [layer(x) for layer in layers]
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    dys = [torch.randn_like(w) for w in want]
    params = [x] + [p for layer in layers for p in layer.parameters()]
    g_got = torch.autograd.grad(sum((g * d).sum() for g, d in zip(got, dys)), params)
    g_want = torch.autograd.grad(sum((w * d).sum() for w, d in zip(want, dys)), params)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_fused_linear_without_grad_mode_runs_each_layer():
    layers = _layers((True, False, True))
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    with torch.no_grad():
        got = fused_linear(x, layers)
    assert all(torch.equal(g, layer(x)) and g.is_contiguous() for g, layer in zip(got, layers))


def test_fused_linear_of_one_layer_is_the_layer():
    layer, = _layers((True,), outs=(8,))
    x = torch.randn(3, 24, dtype=torch.float64)
    assert torch.equal(fused_linear(x, [layer])[0], layer(x))


@pytest.mark.parametrize("separate_kv", [False, True], ids=["shared-kv", "separate-kv"])
def test_nsa_projections_equal_their_linears(separate_kv):
    cfg = NSAConfig(n_heads=4, n_kv_heads=2, head_dim=16, cmp_block=16, cmp_stride=8, sel_block=16,
                    n_selected=4, window=32, separate_kv=separate_kv)
    torch.manual_seed(1)
    layer = NSAAttention(cfg, 32, bias=True).double()
    x = torch.randn(2, 40, 32, dtype=torch.float64)
    pr = layer.project(x)
    torch.testing.assert_close(pr.q, layer.wq(x).view(2, 40, 4, 16), rtol=1e-12, atol=1e-12)
    branches = ((pr.k_cmp, pr.v_cmp), (pr.k_sel, pr.v_sel), (pr.k_win, pr.v_win))
    for i, (k, v) in enumerate(branches):
        j = i if separate_kv else 0
        torch.testing.assert_close(k, layer.wk[j](x).view(2, 40, 2, 16), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(v, layer.wv[j](x).view(2, 40, 2, 16), rtol=1e-12, atol=1e-12)


def test_dense_attention_equals_its_linears():
    cfg = NSAConfig(n_heads=4, n_kv_heads=2, head_dim=16, cmp_block=16, cmp_stride=8, sel_block=16,
                    n_selected=4, window=32)
    torch.manual_seed(2)
    layer = DenseAttention(cfg, 32).double()
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    q = layer.wq(x).view(2, 20, 4, 16).transpose(1, 2)
    k = layer.wk(x).view(2, 20, 2, 16).transpose(1, 2)
    v = layer.wv(x).view(2, 20, 2, 16).transpose(1, 2)
    o = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want = layer.wo(o.transpose(1, 2).reshape(2, 20, 64))
    torch.testing.assert_close(layer(x), want, rtol=1e-10, atol=1e-12)
