"""The default compiled flex path (nsa_flex.flex.compiled): when it compiles, its eager fallback, its switch.

Its results on the GPU are checked against the fp64 oracle in test_flex_gpu.py
(test_default_compiled_path_against_fp64_oracle).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.exc import InternalTorchDynamoError

from nsa_flex import NSAAttention, NSAConfig, nsa_attention
from nsa_flex.flex import compiled as compiled_path
from nsa_flex.model import NSALM, NSAModelConfig
from naive import random_inputs

CFG = NSAConfig(n_heads=4, n_kv_heads=2, head_dim=16, n_selected=3, sel_block=16, cmp_block=8, cmp_stride=4,
                window=16)


def _inputs(T: int = 70) -> dict:
    return {name: t.float() for name, t in random_inputs(CFG, T, seed=3).items()}


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_compiled_must_be_bool(bad):
    x = _inputs()
    with pytest.raises(TypeError, match="compiled="):
        nsa_attention(**x, config=CFG, impl="reference", compiled=bad)
    with pytest.raises(TypeError, match="compiled="):
        NSAAttention(CFG, 32, compiled=bad)
    with pytest.raises(TypeError, match="compiled="):
        NSALM(NSAModelConfig(vocab_size=16, dim=32, n_layers=1, nsa=CFG), device="cpu").set_compiled_attention(bad)


def test_cpu_flex_runs_eagerly_whatever_compiled_says(monkeypatch):
    """Off CUDA the flex path never goes through torch.compile (CPU flex is eager by design)."""
    monkeypatch.setattr(compiled_path, "_compiled", lambda fn: pytest.fail("compiled on CPU"))
    x = _inputs()
    with torch.no_grad():
        a = nsa_attention(**x, config=CFG, impl="flex", compiled=True)
        b = nsa_attention(**x, config=CFG, impl="flex", compiled=False)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_compile_failure_runs_eagerly_with_one_warning(monkeypatch):
    """A compiler failure: the same function runs eagerly, says so once, and is not compiled again."""
    calls = {"compiled": 0, "eager": 0}

    def fn(x, scale=1.0):
        calls["eager"] += 1
        return x * (1.0 if scale is None else scale)

    def broken(fn):
        def call(*args, **kwargs):
            calls["compiled"] += 1
            raise InternalTorchDynamoError("inductor bug")
        return call

    monkeypatch.setattr(compiled_path, "wanted", lambda compiled, x: compiled)
    monkeypatch.setattr(compiled_path, "_compiled", broken)
    monkeypatch.setattr(compiled_path, "_FAILED", set())
    x = torch.arange(3.0)
    with pytest.warns(UserWarning, match="runs eagerly from now on"):
        out = compiled_path.run(fn, True, x, scale=2.0)
    torch.testing.assert_close(out, 2 * x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(compiled_path.run(fn, True, x, scale=3.0), 3 * x)
    assert calls == {"compiled": 1, "eager": 2}
    # compiled=False never tries.
    compiled_path.run(fn, False, x)
    assert calls == {"compiled": 1, "eager": 3}
    # Other optional inputs given: a separate graph, tried once more.
    with pytest.warns(UserWarning, match="runs eagerly from now on"):
        compiled_path.run(fn, True, x, scale=None)
    assert calls == {"compiled": 2, "eager": 4}


def test_compiled_call_used_when_wanted(monkeypatch):
    """Where wanted (CUDA, no outer compile) the call goes through the compiled function, args intact."""
    seen = []

    def fake_compiled(fn):
        def call(*args, **kwargs):
            seen.append((args, kwargs))
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(compiled_path, "wanted", lambda compiled, x: compiled)
    monkeypatch.setattr(compiled_path, "_compiled", fake_compiled)
    x = torch.ones(2)
    assert torch.equal(compiled_path.run(torch.add, True, x, x, alpha=2), torch.full((2,), 3.0))
    assert len(seen) == 1 and seen[0][1] == {"alpha": 2}


def test_wanted_only_on_cuda_outside_compile():
    assert not compiled_path.wanted(True, torch.ones(1))  # CPU
    assert not compiled_path.wanted(False, torch.ones(1))


def test_uncompiled_model_turns_its_attention_eager():
    model = NSALM(NSAModelConfig(vocab_size=16, dim=32, n_layers=2, nsa=CFG), device="cpu")
    layers = [m for m in model.modules() if isinstance(m, NSAAttention)]
    assert len(layers) == 2 and all(m.compiled for m in layers)
    model.set_compiled_attention(False)
    assert not any(m.compiled for m in layers)
