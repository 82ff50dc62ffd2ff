"""NSALM: shapes, causality, RoPE, presets, impl resolution, un-rotated compressed keys (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from nsa_flex.attention import NSAAttention
from nsa_flex.model import (
    MODEL_PRESETS,
    DenseAttention,
    NSALM,
    NSAModelConfig,
    Rotary,
    apply_rotary,
    lm_loss,
    resolve_impl,
)

TINY = MODEL_PRESETS["tiny"]


@pytest.fixture(autouse=True)
def fixed_seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_forward_shapes_and_initial_loss(attention):
    model = NSALM(TINY.replace(attention=attention), device="cpu")
    tokens = torch.randint(0, TINY.vocab_size, (2, 77))
    logits = model(tokens)
    assert logits.shape == (2, 77, TINY.vocab_size)
    assert torch.isfinite(logits).all()
    # A fresh model predicts close to uniformly.
    assert abs(model.loss(tokens, tokens).item() - math.log(TINY.vocab_size)) < 0.3


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_causal(attention):
    model = NSALM(TINY.replace(attention=attention), device="cpu").eval()
    a = torch.randint(0, TINY.vocab_size, (1, 111))
    b = a.clone()
    b[:, 70:] = torch.randint(0, TINY.vocab_size, (1, 41))
    with torch.no_grad():
        torch.testing.assert_close(model(a)[:, :70], model(b)[:, :70], rtol=1e-5, atol=1e-5)


def test_attention_modules_and_presets():
    nsa, dense = NSALM(TINY, device="cpu"), NSALM(TINY.replace(attention="dense"), device="cpu")
    assert all(isinstance(layer.attn, NSAAttention) for layer in nsa.layers)
    assert all(isinstance(layer.attn, DenseAttention) for layer in dense.layers)
    big = MODEL_PRESETS["seeds-125m"]
    assert (big.n_layers, big.dim, big.nsa.n_heads, big.nsa.n_kv_heads, big.nsa.head_dim, big.max_seq_len) == (
        12, 768, 12, 3, 64, 2048)
    # The reference dense model (docs/results.md) has ~123M parameters; built on meta, no memory used.
    assert NSALM(big.replace(attention="dense"), device="meta").num_params() == 123_489_024


def test_impl_resolution():
    assert resolve_impl("auto", torch.device("cpu")) == "reference"
    assert resolve_impl("auto", torch.device("cuda")) == "flex"
    assert resolve_impl("flex", torch.device("cpu")) == "flex"
    with pytest.raises(ValueError, match="unknown impl 'fast'"):
        resolve_impl("fast", torch.device("cpu"))
    assert NSALM(TINY, device="cpu").layers[0].attn.impl == "reference"
    assert NSALM(TINY.replace(impl="flex"), device="cpu").layers[0].attn.impl == "flex"


@pytest.mark.parametrize("bad, match", [
    pytest.param({"attention": "sparse"}, "attention='sparse'", id="attention"),
    pytest.param({"impl": "triton"}, "impl='triton'", id="impl"),
    pytest.param({"dim": 0}, "dim=0", id="dim"),
    pytest.param({"vocab_size": 1.5}, "vocab_size=1.5", id="vocab-float"),
    pytest.param({"sel_partial_bytes": 0}, "sel_partial_bytes=0: must be a positive number of bytes", id="partials"),
])
def test_config_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        NSAModelConfig(**bad)


def test_layers_take_the_partial_budget():
    """NSAModelConfig.sel_partial_bytes reaches every NSA layer's tiles (which the flex path passes on
    to the gated node); a layer refuses tiles of another type."""
    model = NSALM(TINY.replace(sel_partial_bytes=12345), device="cpu")
    assert all(layer.attn.tiles.sel_partial_bytes == 12345 for layer in model.layers)
    with pytest.raises(TypeError, match="tiles must be a FlexTiles or None, got dict"):
        NSAAttention(TINY.nsa, TINY.dim, tiles={"sel_partial_bytes": 1})


def test_rotary_is_relative():
    rope = Rotary(32, 64, 10000.0)
    q, k = torch.randn(1, 1, 1, 32), torch.randn(1, 1, 1, 32)

    def score(m, n):
        cm, sm = rope.tables(torch.tensor([[m]]))
        cn, sn = rope.tables(torch.tensor([[n]]))
        return (apply_rotary(q, cm, sm) * apply_rotary(k, cn, sn)).sum()

    torch.testing.assert_close(score(10, 3), score(40, 33))
    cos, sin = rope.tables(64)
    x = torch.randn(2, 64, 3, 32)
    torch.testing.assert_close(apply_rotary(x, cos, sin).norm(dim=-1), x.norm(dim=-1))
    with pytest.raises(ValueError, match="exceeds max_seq_len=64"):
        rope.tables(65)


def test_compressed_keys_come_from_unrotated_keys():
    model = NSALM(TINY, device="cpu")
    attn = model.layers[0].attn
    seen = {}

    def keep_input(module, args, output):
        seen["k"] = args[0]

    attn.compress_k.register_forward_hook(keep_input)
    tokens = torch.randint(0, TINY.vocab_size, (1, 64))
    with torch.no_grad():
        model(tokens)
        x = model.layers[0].attn_norm(model.tok_emb(tokens))
        k = attn.wk[0](x).view(1, 64, TINY.nsa.n_kv_heads, TINY.nsa.head_dim)
    torch.testing.assert_close(seen["k"], k)


def test_tied_embeddings():
    model = NSALM(TINY.replace(tie_embeddings=True), device="cpu")
    assert model.head.weight is model.tok_emb.weight
    untied = NSALM(TINY, device="cpu")
    assert model.num_params() == untied.num_params() - TINY.vocab_size * TINY.dim


def test_activation_checkpointing_same_gradients():
    model = NSALM(TINY, device="cpu")
    tokens = torch.randint(0, TINY.vocab_size, (2, 48))
    model.loss(tokens, tokens).backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for block in model.layers:
        block.checkpoint_activations = True
    model.loss(tokens, tokens).backward()
    for g, p in zip(plain, model.parameters()):
        torch.testing.assert_close(p.grad, g)


def test_loss_ignores_masked_targets():
    logits = torch.randn(1, 4, 10)
    targets = torch.tensor([[1, -100, 3, -100]])
    expected = torch.nn.functional.cross_entropy(logits[0, [0, 2]], torch.tensor([1, 3]))
    torch.testing.assert_close(lm_loss(logits, targets), expected)
