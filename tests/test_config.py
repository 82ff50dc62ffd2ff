"""Every NSAConfig rule raises a ValueError that names the field, the value and the rule."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from nsa_flex import PRESETS, NSAConfig, nsa_attention
from nsa_flex.config import MAX_SELECTED
from nsa_flex.flex.masks import selection_block_mask
from nsa_flex.ops import select_blocks_torch
from naive import random_inputs

POSITIVE = ("n_heads", "n_kv_heads", "head_dim", "cmp_block", "cmp_stride", "sel_block", "n_selected", "window")


@pytest.mark.parametrize("field", POSITIVE)
@pytest.mark.parametrize("value", [pytest.param(0, id="zero"), pytest.param(-3, id="negative")])
def test_positive_fields(field, value):
    with pytest.raises(ValueError, match=rf"NSAConfig\.{field}={value}: must be a positive integer"):
        NSAConfig(**{field: value})


@pytest.mark.parametrize("field", ["n_initial", "n_local"])
def test_non_negative_fields(field):
    with pytest.raises(ValueError, match=rf"NSAConfig\.{field}=-1: must be >= 0"):
        NSAConfig(**{field: -1})


@pytest.mark.parametrize("value", [pytest.param(0, id="zero"), pytest.param(-8, id="negative")])
def test_head_dim_v_positive_or_none(value):
    with pytest.raises(ValueError, match=rf"NSAConfig\.head_dim_v={value}: must be a positive integer or None"):
        NSAConfig(head_dim_v=value)


@pytest.mark.parametrize("field, value, rule", [
    pytest.param("n_heads", 4.0, "must be an int", id="float"),
    pytest.param("window", 2.5, "must be an int", id="fraction"),
    pytest.param("head_dim", "128", "must be an int", id="str"),
    pytest.param("sel_block", None, "must be an int", id="none"),
    pytest.param("n_kv_heads", True, "must be an int", id="bool-as-int"),
    pytest.param("n_initial", 1.0, "must be an int", id="float-non-negative"),
    pytest.param("head_dim_v", "x", "must be an int or None", id="str-optional"),
    pytest.param("head_dim_v", 64.0, "must be an int or None", id="float-optional"),
    pytest.param("separate_kv", "yes", "must be a bool", id="str-bool"),
    pytest.param("separate_kv", 1, "must be a bool", id="int-bool"),
])
def test_field_types(field, value, rule):
    with pytest.raises(ValueError, match=rf"NSAConfig\.{field}={value!r}: {rule}"):
        NSAConfig(**{field: value})


@pytest.mark.parametrize("changes, message", [
    pytest.param(dict(n_heads=6, n_kv_heads=4), r"NSAConfig\.n_heads=6: must be divisible by n_kv_heads=4",
                 id="heads-not-divisible"),
    pytest.param(dict(cmp_block=24, cmp_stride=16), r"NSAConfig\.cmp_block=24: must be divisible by cmp_stride=16",
                 id="cmp-block-vs-stride"),
    pytest.param(dict(cmp_block=16, cmp_stride=32, sel_block=64),
                 r"NSAConfig\.cmp_block=16: must be divisible by cmp_stride=32", id="stride-above-block"),
    pytest.param(dict(sel_block=40, cmp_stride=16), r"NSAConfig\.sel_block=40: must be divisible by cmp_stride=16",
                 id="sel-block-vs-stride"),
    pytest.param(dict(n_selected=2, n_initial=1, n_local=2),
                 r"NSAConfig\.n_selected=2: must be >= n_initial \+ n_local = 3 \(the forced blocks\)",
                 id="n-below-forced"),
])
def test_cross_field_rules(changes, message):
    with pytest.raises(ValueError, match=message):
        NSAConfig(**changes)


def test_rules_apply_to_replace():
    with pytest.raises(ValueError, match=r"NSAConfig\.n_heads=5: must be divisible by n_kv_heads=4"):
        PRESETS["g4"].replace(n_heads=5)


def test_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        NSAConfig(64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        NSAConfig().window = 3


@pytest.mark.parametrize("changes", [
    pytest.param(dict(), id="defaults"),
    pytest.param(dict(n_selected=3, n_initial=1, n_local=2), id="n-equals-forced"),
    pytest.param(dict(n_initial=0, n_local=0, n_selected=1), id="nothing-forced"),
    pytest.param(dict(cmp_block=16, cmp_stride=16, sel_block=16), id="l-equals-d-equals-l'"),
    pytest.param(dict(n_heads=3, n_kv_heads=3, head_dim=1, head_dim_v=5, window=1), id="tiny"),
    pytest.param(dict(separate_kv=True, head_dim_v=None), id="separate-kv"),
])
def test_valid_configs(changes):
    NSAConfig(**changes)


def test_derived_properties():
    cfg = NSAConfig(n_heads=12, n_kv_heads=3, head_dim=64)
    assert cfg.group_size == 4 and cfg.dv == 64
    assert cfg.replace(head_dim_v=32).dv == 32


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_valid(name):
    cfg = PRESETS[name]
    assert cfg.replace() == cfg
    assert cfg.n_heads % cfg.n_kv_heads == 0


def test_paper_preset():
    # docs/design.md section 1: 64 query heads over 4 kv heads, d_k=192, d_v=128, l=32, d=16, l'=64,
    # n=16, w=512, one initial and two local blocks forced.
    cfg = PRESETS["paper"]
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dv) == (64, 4, 192, 128)
    assert (cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.n_selected, cfg.window) == (32, 16, 64, 16, 512)
    assert (cfg.n_initial, cfg.n_local, cfg.group_size) == (1, 2, 16)


@pytest.mark.parametrize("value", [4097, 10**6, 10**9])
def test_n_selected_upper_bound(value):
    with pytest.raises(ValueError, match=rf"NSAConfig\.n_selected={value}: must be <= {MAX_SELECTED}: a query "
                                         r"attends to at most the selection blocks its sequence has"):
        NSAConfig(n_selected=value)
    assert NSAConfig(n_selected=MAX_SELECTED).n_selected == MAX_SELECTED


class _Elements(TorchDispatchMode):
    """Counts the elements of every tensor the aten ops in scope create (views excluded)."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.total += sum(t.numel() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def _selection_work(n: int) -> dict[str, int]:
    """Elements created by the reference op, the selection twin and the flex selection mask at T=64."""
    cfg = NSAConfig(n_heads=4, n_kv_heads=2, head_dim=16, cmp_block=16, cmp_stride=8, sel_block=16,
                    n_selected=n, window=32)
    x = random_inputs(cfg, T=64, dtype=torch.float32)
    lse = torch.zeros(1, 4, 64)
    work = {}
    with torch.no_grad():
        with _Elements() as m:
            _, sel = nsa_attention(**x, config=cfg, impl="reference", return_indices=True)
        work["reference"] = m.total
        with _Elements() as m:
            select_blocks_torch(x["q"], x["k_cmp"], lse, cfg)
        work["select twin"] = m.total
        with _Elements() as m:
            selection_block_mask(sel, 64, 2, cfg)
        work["flex mask"] = m.total
    return work


def test_work_scales_with_the_blocks_that_exist():
    """At T=64 (4 blocks of 16), n=4096 costs what n=4 costs plus a few passes over its [B, Hkv, T, n] output."""
    small, big = _selection_work(4), _selection_work(MAX_SELECTED)
    out = 2 * 64 * MAX_SELECTED
    passes = {"reference": 4, "select twin": 4, "flex mask": 20}
    for name, extra in passes.items():
        assert big[name] - small[name] <= extra * out, (name, big[name] - small[name], out)
