"""NSAAttention and Compressor: phi per block, causality, gradients to every parameter, varlen."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.func import functional_call

from nsa_flex import Compressor, Gate, NSAAttention, NSAConfig, attention, nsa_attention
from nsa_flex.attention import resolve_impl
from naive import random_inputs
from nsa_flex.compression import compressed_seqlens

CFG = NSAConfig(n_heads=4, n_kv_heads=2, head_dim=12, head_dim_v=20, cmp_block=16, cmp_stride=8, sel_block=32,
                n_selected=3, n_local=1, window=40)
DIM = 24


def make_module(cfg: NSAConfig = CFG, dim: int = DIM, seed: int = 0, **kwargs) -> NSAAttention:
    torch.manual_seed(seed)
    module = NSAAttention(cfg, dim, **kwargs).double()
    # Larger random weights than the init, so every branch and gate visibly matters.
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.3)
    return module


def naive_compress(compressor: Compressor, x_bthd: torch.Tensor) -> torch.Tensor:
    """phi block by block: tokens [i*d, i*d + l) plus the position encoding, flattened, through the MLP."""
    l, d = compressor.config.cmp_block, compressor.config.cmp_stride
    B, T, H, D = x_bthd.shape
    blocks = []
    i = 0
    while i * d + l <= T:
        block_bhld = x_bthd[:, i * d: i * d + l].permute(0, 2, 1, 3) + compressor.pos_lxd
        blocks.append(compressor.mlp(block_bhld.reshape(B, H, l * D)))
        i += 1
    if not blocks:
        return x_bthd.new_zeros(B, 0, H, compressor.dim_out)
    return torch.stack(blocks, dim=1)


@pytest.mark.parametrize("T", [1, 15, 16, 17, 24, 31, 32, 100])
def test_compressor_matches_blockwise(seed, T):
    comp = Compressor(CFG, 12, dim_out=7, hidden=9).double()
    x = torch.randn(2, T, 3, 12, dtype=torch.float64)
    out = comp(x)
    assert out.shape == (2, max(0, (T - 16) // 8 + 1), 3, 7)
    torch.testing.assert_close(out, naive_compress(comp, x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("l,d", [(16, 8), (24, 8), (16, 16)])
def test_compressor_gradients_match_blockwise(seed, l, d):
    # phi's first layer runs as a sum of R = l/d chunk products: values and every gradient
    # must be the blockwise ones.
    cfg = CFG.replace(cmp_block=l, cmp_stride=d, sel_block=48, window=48)
    comp = Compressor(cfg, 12, dim_out=7, hidden=9).double()
    with torch.no_grad():
        comp.pos_lxd.normal_()
    x = torch.randn(2, 61, 3, 12, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, (61 - l) // d + 1, 3, 7, dtype=torch.float64)
    params = [x, *comp.parameters()]
    got = torch.autograd.grad(comp(x), params, grad)
    want = torch.autograd.grad(naive_compress(comp, x), params, grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_compressor_varlen_per_document(seed):
    # Blocks never straddle documents: the packed result is each document's blocks in order.
    comp = Compressor(CFG, 12).double()
    docs = [40, 10, 16, 33]
    cu = torch.tensor([0, 40, 50, 66, 99])
    x = torch.randn(1, 99, 2, 12, dtype=torch.float64)
    out = comp(x, cu)
    parts = [naive_compress(comp, x[:, s:e]) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())]
    torch.testing.assert_close(out, torch.cat(parts, dim=1), rtol=1e-12, atol=1e-12)
    assert compressed_seqlens(cu, CFG).tolist() == [0, 4, 4, 5, 8]
    assert out.shape[1] == sum(max(0, (n - 16) // 8 + 1) for n in docs)


def test_gates_start_near_half_and_vary(seed):
    gate = Gate(64, 8)
    g = gate(torch.randn(2, 50, 64))
    assert g.shape == (2, 50, 8, 3)
    assert ((g > 0.4) & (g < 0.6)).all()
    assert g.std() > 1e-3


@pytest.mark.parametrize("separate_kv", [pytest.param(False, id="shared-kv"), pytest.param(True, id="separate-kv")])
@pytest.mark.parametrize("t0", [0, 20, 63, 64, 90])
def test_module_causality(separate_kv, t0):
    # Changing tokens after t0 changes no output and no selection at or before t0.
    module = make_module(CFG.replace(separate_kv=separate_kv))
    gen = torch.Generator().manual_seed(t0)
    x = torch.randn(2, 100, DIM, generator=gen, dtype=torch.float64)
    y = x.clone()
    y[:, t0 + 1:] = torch.randn(2, 100 - t0 - 1, DIM, generator=gen, dtype=torch.float64)
    out_x, idx_x = module(x, return_indices=True)
    out_y, idx_y = module(y, return_indices=True)
    torch.testing.assert_close(out_y[:, : t0 + 1], out_x[:, : t0 + 1], rtol=0, atol=1e-12)
    assert torch.equal(idx_y[:, :, : t0 + 1], idx_x[:, :, : t0 + 1])
    assert not torch.allclose(out_y[:, t0 + 1:], out_x[:, t0 + 1:])


# Tiny enough for gradcheck over every parameter: T=14 gives Ns=4 selection blocks of 4, so
# each query past block 1 has one free slot beside block 0 and its own block.
TINY = NSAConfig(n_heads=2, n_kv_heads=1, head_dim=4, head_dim_v=3, cmp_block=4, cmp_stride=2, sel_block=4,
                 n_selected=3, n_initial=1, n_local=1, window=3, separate_kv=True)


def test_module_gradcheck_all_parameters():
    module = make_module(TINY, dim=8, seed=1)
    x = torch.randn(1, 14, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    names = [n for n, _ in module.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_(True) for p in module.parameters())

    def forward(x_btc, *ps):
        return functional_call(module, dict(zip(names, ps)), (x_btc,))

    # The top-n selection is piecewise constant, so gradcheck's finite differences are only
    # valid if no perturbation flips a block. With this seed the selection stays the same
    # under random perturbations 10x larger than gradcheck's eps in every input at once.
    _, idx = module(x, return_indices=True)
    gen = torch.Generator().manual_seed(3)
    for _ in range(10):
        with torch.no_grad():
            moved = tuple(p + 1e-5 * torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params)
            x_moved = x + 1e-5 * torch.randn(x.shape, generator=gen, dtype=x.dtype)
        _, idx_moved = functional_call(module, dict(zip(names, moved)), (x_moved,), dict(return_indices=True))
        assert torch.equal(idx_moved, idx)
    # The selection is not trivial: some queries pick a block that is not forced (0 < j < own).
    own = (torch.arange(14) // TINY.sel_block)[:, None]
    assert ((idx > 0) & (idx < own)).any()
    # fast_mode checks a random projection of the Jacobian, not all ~800 columns: the full
    # check takes minutes on 2 cores. The attention math itself gets the full gradcheck at op
    # level (test_reference.py); here it is the wiring through phi, gates and projections.
    assert torch.autograd.gradcheck(forward, (x.requires_grad_(True), *params), eps=1e-6, atol=1e-8,
                                    fast_mode=True)


@pytest.mark.parametrize("separate_kv", [pytest.param(False, id="shared-kv"), pytest.param(True, id="separate-kv")])
def test_every_parameter_gets_gradient(separate_kv):
    # phi (both compressors), the gate MLP, every projection: gradient non-zero and finite.
    module = make_module(CFG.replace(separate_kv=separate_kv), bias=True)
    x = torch.randn(2, 70, DIM, dtype=torch.float64, requires_grad=True)
    (module(x) * torch.randn(2, 70, DIM, dtype=torch.float64)).sum().backward()
    for name, p in module.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    assert len(module.wk) == (3 if separate_kv else 1)
    assert torch.isfinite(x.grad).all()


def test_separate_kv_with_equal_weights_equals_shared():
    # Three copies of the same K/V projection must reproduce the shared-projection layer:
    # checks each branch reads its own projection (cmp, sel, win) and nothing else changed.
    shared = make_module(CFG)
    separate = make_module(CFG.replace(separate_kv=True), seed=5)
    state = shared.state_dict()
    for name in ("wk", "wv"):
        for i in range(3):
            state[f"{name}.{i}.weight"] = state[f"{name}.0.weight"]
    separate.load_state_dict(state)
    x = torch.randn(1, 80, DIM, dtype=torch.float64)
    torch.testing.assert_close(separate(x), shared(x), rtol=1e-12, atol=1e-12)
    # And each branch's projection matters on its own.
    for name in ("wk", "wv"):
        for i in range(3):
            with torch.no_grad():
                getattr(separate, name)[i].weight.mul_(1.5)
            assert not torch.allclose(separate(x), shared(x)), f"{name}[{i}]"
            separate.load_state_dict(state)


@pytest.mark.parametrize("separate_kv", [pytest.param(False, id="shared-kv"), pytest.param(True, id="separate-kv")])
@pytest.mark.parametrize("docs", [
    pytest.param([5, 40, 70, 1], id="short-long-long-one"),
    pytest.param([15, 16, 17], id="around-first-block"),
    pytest.param([100], id="one-doc"),
])
def test_module_varlen_equals_separate_documents(separate_kv, docs):
    module = make_module(CFG.replace(separate_kv=separate_kv))
    T = sum(docs)
    cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()])
    x = torch.randn(1, T, DIM, dtype=torch.float64, requires_grad=True)
    out, idx = module(x, cu_seqlens=cu, return_indices=True)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        out_doc, idx_doc = module(x[:, s:e], return_indices=True)
        torch.testing.assert_close(out[:, s:e], out_doc, rtol=0, atol=1e-12)
        assert torch.equal(idx[:, :, s:e], idx_doc)
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_single_token_module(seed, dtype):
    module = NSAAttention(CFG, DIM).to(dtype)
    x = torch.randn(3, 1, DIM, dtype=dtype, requires_grad=True)
    y = module(x)
    assert y.shape == (3, 1, DIM) and y.dtype == dtype and torch.isfinite(y).all()
    y.float().sum().backward()
    assert torch.isfinite(x.grad).all()


def test_identity_rotary_changes_nothing():
    module = make_module(CFG.replace(separate_kv=True))
    x = torch.randn(1, 50, DIM, dtype=torch.float64)
    torch.testing.assert_close(module(x, rotary=lambda q, k: (q, k)), module(x), rtol=0, atol=0)
    # A rotary that changes keys changes the output (it is applied at all).
    assert not torch.allclose(module(x, rotary=lambda q, k: (q, -k)), module(x))


@pytest.mark.parametrize("shape", [pytest.param((2, 5, 7), id="wrong-dim"), pytest.param((5, 16), id="rank-2")])
def test_module_rejects_wrong_input_shape(shape):
    layer = NSAAttention(NSAConfig(n_heads=2, n_kv_heads=1, head_dim=8, n_selected=3, window=16), 16)
    with pytest.raises(ValueError, match=r"expected \[B, T, dim=16\]"):
        layer(torch.randn(*shape))


@pytest.mark.parametrize("separate_kv", [pytest.param(False, id="shared-kv"), pytest.param(True, id="separate-kv")])
@pytest.mark.parametrize("T", [1, 17, 100])
def test_module_flex_forward_equals_reference(separate_kv, T):
    # impl="flex" runs the op's branches, then the gates, gated sum and wo as its own region
    # (NSAAttention._attend_flex): on CPU (flex is dense and exact there, forward only) the
    # output and the selection must be the reference module's.
    module = make_module(CFG.replace(separate_kv=separate_kv))
    x = torch.randn(2, T, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        want, sel_want = module(x, return_indices=True)
        module.impl = "flex"
        got, sel_got = module(x, return_indices=True)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert torch.equal(sel_got, sel_want)


def test_module_flex_frozen_layer_takes_the_path_without_gradients(monkeypatch):
    """A frozen layer with grad mode on (an evaluation loop without torch.no_grad) needs no
    gradient: it runs the flex op in its order without gradients, not the checkpointed branches
    kept for a backward, and gives the reference's output."""
    from nsa_flex import flex

    x = torch.randn(1, 70, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    module = make_module().requires_grad_(False)
    with torch.no_grad():
        want = module(x)
    module.impl = "flex"

    def branches(*args, **kwargs):
        raise AssertionError("the checkpointed branches ran for a call that needs no gradient")

    monkeypatch.setattr(flex, "nsa_flex_branches", branches)
    got = module(x)
    assert not got.requires_grad
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_module_flex_with_cpu_gradients_runs_the_reference():
    """The README's `NSAAttention(config, dim, impl="flex")` trains on CPU: the reference runs, said once."""
    x = torch.randn(1, 40, DIM, dtype=torch.float64, requires_grad=True)
    want = make_module(impl="reference")(x)
    module = make_module(impl="flex")
    attention._ROUTED.clear()
    with pytest.warns(UserWarning, match=r"impl='flex' on CPU with gradients runs the reference implementation"):
        got = module(x)
    assert module.last_impl == "reference"
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got.sum().backward()
    assert torch.isfinite(x.grad).all() and all(p.grad is not None for p in module.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module(x)
    with torch.no_grad():
        module(x)
    assert module.last_impl == "flex"


def test_impl_auto_is_the_default():
    module = NSAAttention(CFG, DIM)
    assert module.impl == "auto"
    module(torch.randn(1, 20, DIM))
    assert module.last_impl == "reference"
    assert resolve_impl("auto", "cpu") == resolve_impl("reference", "cuda") == "reference"
    assert resolve_impl("auto", "cuda") == resolve_impl("flex", "cuda", needs_grad=True) == "flex"
    assert resolve_impl("flex", "cpu") == "flex"
    # FlexAttention has no float64 CUDA kernels: auto takes the reference there, flex says so.
    assert resolve_impl("auto", "cuda", dtype=torch.float64) == "reference"
    assert resolve_impl("flex", "cpu", dtype=torch.float64) == "flex"
    assert resolve_impl("auto", "cuda", dtype=torch.float32) == "flex"
    with pytest.raises(ValueError, match="float64.*impl='reference'"):
        resolve_impl("flex", "cuda", dtype=torch.float64)
    with pytest.raises(ValueError, match=r"unknown impl 'fast'; allowed: 'auto', 'reference', 'flex'"):
        resolve_impl("fast", "cpu")


def test_op_flex_with_cpu_gradients_equals_reference():
    cfg = NSAConfig(n_heads=4, n_kv_heads=2, head_dim=8, cmp_block=8, cmp_stride=4, sel_block=8, n_selected=3,
                    window=16)
    x = {k: t.requires_grad_() for k, t in random_inputs(cfg, 40).items()}
    attention._ROUTED.add("flex")
    o = nsa_attention(**x, config=cfg, impl="flex")
    want = nsa_attention(**x, config=cfg, impl="reference")
    torch.testing.assert_close(o, want, rtol=0, atol=0)
    o.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in x.values())


@pytest.mark.parametrize("config, dim, error, message", [
    pytest.param(CFG, 64.5, TypeError, r"dim=64\.5: must be a positive integer, got float", id="float-dim"),
    pytest.param(CFG, "64", TypeError, r"dim='64': must be a positive integer, got str", id="str-dim"),
    pytest.param(CFG, True, TypeError, r"dim=True: must be a positive integer, got bool", id="bool-dim"),
    pytest.param({"n_heads": 4}, 64, TypeError, r"config must be an NSAConfig, got dict; build one with "
                 r"NSAConfig\(\*\*settings\)", id="dict-config"),
    pytest.param(CFG, 64, ValueError, r"unknown impl 'fast'; allowed: 'auto', 'reference', 'flex'", id="impl"),
])
def test_module_constructor_errors(config, dim, error, message):
    impl = "fast" if "impl" in message else "auto"
    with pytest.raises(error, match=message):
        NSAAttention(config, dim, impl=impl)


def test_module_input_dtype_and_type_errors():
    layer = NSAAttention(CFG, DIM)
    with pytest.raises(TypeError, match=r"NSAAttention input has dtype torch.float64 but the layer's weights are "
                                        r"torch.float32; cast one to the other"):
        layer(torch.randn(1, 20, DIM, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"NSAAttention input must be a torch.Tensor \[B, T, dim=24\], got list"):
        layer([[0.0] * DIM])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(torch.randn(1, 20, DIM)).shape == (1, 20, DIM)


@pytest.mark.parametrize("autocast", [pytest.param(False, id="fp32"), pytest.param(True, id="autocast-bf16")])
def test_module_compiles_whole(autocast):
    """The input checks and the impl choice trace: one fullgraph frame equals eager, with gradients."""
    torch._dynamo.reset()
    module = NSAAttention(CFG, DIM)
    x = torch.randn(2, 40, DIM, generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(module, backend="eager", fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        want, got = module(x), compiled(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got.float().sum().backward()
    assert all(p.grad is not None for p in module.parameters())


def test_into_gated_sum_routes_wo_gradient_to_the_node_sum():
    """The gated node's path (NSAAttention._attend_flex): wo over the sum made again from detached
    branch outputs, joined to the node's sum by _IntoGatedSum, gives a Linear over that sum's
    value and every gradient (fp64, exact), and keeps no tensor of the sum itself."""
    from torch.utils.checkpoint import checkpoint

    from nsa_flex.attention import _IntoGatedSum

    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 9, 4, 5, dtype=torch.float64, generator=g, requires_grad=True)
    wo = torch.nn.Linear(20, 6, dtype=torch.float64)
    dy = torch.randn(2, 9, 6, dtype=torch.float64, generator=g)

    def parts():
        return torch.tanh(q), torch.sin(q) * 2  # two "branch outputs" of q

    a, b = parts()
    o = 0.3 * a + 0.7 * b  # the node's sum, differentiable in q
    want = torch.autograd.grad(wo(o.flatten(2)), [q, wo.weight, wo.bias], dy)

    a, b = parts()
    o = 0.3 * a + 0.7 * b
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        y = checkpoint(lambda a, b: wo((0.3 * a + 0.7 * b).flatten(2)), a.detach(), b.detach(), use_reentrant=False)
        y = _IntoGatedSum.apply(y, o, wo.weight)
    assert not any(t.data_ptr() == o.data_ptr() for t in kept)
    got = torch.autograd.grad(y, [q, wo.weight, wo.bias], dy)
    for name, x, w in zip(("q", "weight", "bias"), got, want):
        torch.testing.assert_close(x, w, rtol=1e-12, atol=1e-12, msg=name)
