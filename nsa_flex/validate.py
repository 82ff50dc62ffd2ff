"""Input checks for nsa_attention: every error says what was wrong and what is allowed."""

from __future__ import annotations

import torch

from nsa_flex.blocks import num_cmp_blocks
from nsa_flex.config import NSAConfig

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_4d(tensors: dict, anchor: str) -> None:
    """Each tensors[name] = (x, layout) is a 4-D torch.Tensor on the device of tensors[anchor]'s;
    an error names the tensor and its expected layout."""
    for name, (x, dims) in tensors.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be {dims}, got shape {tuple(x.shape)}")
    ref = tensors[anchor][0]
    for name, (x, _) in tensors.items():
        if x.device != ref.device:
            raise ValueError(f"{name} is on {x.device} but {anchor} is on {ref.device}; inputs must share one device")


def needs_grad(*tensors) -> bool:
    """Whether autograd would record a call on these inputs: grad mode on and some tensor among them
    requiring a gradient (None and other values ignored)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def is_byte_count(value, zero: bool = False) -> bool:
    """Whether value is a number of bytes: an int (not a bool) >= 1, or >= 0 with zero (where 0 stands
    for a default)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= (0 if zero else 1)


def check_compiled(compiled) -> None:
    """`compiled` of nsa_attention / NSAAttention: a bool (see nsa_flex.flex.compiled)."""
    if not isinstance(compiled, bool):
        raise TypeError(f"compiled={compiled!r}: must be True (the flex path as one compiled graph per shape on "
                        "CUDA) or False (eager glue around its compiled calls)")


def check_inputs(q, k, v, k_cmp, v_cmp, gates, config: NSAConfig, block_indices=None,
                 cu_seqlens=None, k_win=None, v_win=None) -> None:
    named = {"q": q, "k": k, "v": v, "k_cmp": k_cmp, "v_cmp": v_cmp, "gates": gates}
    for name, x in named.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must have 4 dims, got shape {tuple(x.shape)}; expected {_LAYOUT[name]}")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {x.dtype}; allowed: {_names(FLOAT_DTYPES)}")
    for name, x in named.items():
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but q has {q.dtype}; all inputs must share one dtype")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}; all inputs must share one device")

    B, T, Hq, Dk = q.shape
    Hkv, Dv = config.n_kv_heads, config.dv
    # Before Tc is derived from them: a bad cu_seqlens must not surface as a k_cmp shape error.
    if cu_seqlens is not None:
        _check_cu_seqlens(cu_seqlens, B, T)
    Tc = _expected_tc(T, config, cu_seqlens)
    expected = {
        "q": (B, T, config.n_heads, config.head_dim),
        "k": (B, T, Hkv, config.head_dim),
        "v": (B, T, Hkv, Dv),
        "k_cmp": (B, Tc, Hkv, config.head_dim),
        "v_cmp": (B, Tc, Hkv, Dv),
        "gates": (B, T, config.n_heads, 3),
    }
    if T < 1:
        raise ValueError(f"q has T={T} tokens; T must be >= 1")
    for name, x in named.items():
        if tuple(x.shape) != expected[name]:
            layout = _LAYOUT[name]
            if cu_seqlens is not None and name in ("k_cmp", "v_cmp"):
                layout = layout.split(" with ")[0] + " with Tc summed over the documents of cu_seqlens"
            raise ValueError(
                f"{name} has shape {tuple(x.shape)}, expected {expected[name]} = {layout} "
                f"for config (n_heads={config.n_heads}, n_kv_heads={Hkv}, head_dim={config.head_dim}, "
                f"head_dim_v={Dv}) and q of shape {tuple(q.shape)}"
            )
    for name, x, ref in (("k_win", k_win, k), ("v_win", v_win, v)):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(x).__name__}")
        if x.shape != ref.shape or x.dtype != ref.dtype or x.device != ref.device:
            raise ValueError(
                f"{name} must match {name[0]} in shape, dtype and device ({tuple(ref.shape)}, {ref.dtype}, "
                f"{ref.device}), got ({tuple(x.shape)}, {x.dtype}, {x.device})"
            )
    if block_indices is not None:
        _check_indices(block_indices, B, Hkv, T, config, q.device, cu_seqlens)


def _check_indices(idx, B, Hkv, T, config, device, cu_seqlens) -> None:
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"block_indices must be a torch.Tensor, got {type(idx).__name__}")
    if idx.dtype not in INDEX_DTYPES:
        raise TypeError(f"block_indices has dtype {idx.dtype}; allowed: {_names(INDEX_DTYPES)}")
    if idx.device != device:
        raise ValueError(f"block_indices is on {idx.device} but q is on {device}; all inputs must share one device")
    want = (B, Hkv, T, config.n_selected)
    if tuple(idx.shape) != want:
        raise ValueError(f"block_indices has shape {tuple(idx.shape)}, expected {want} = [B, Hkv, T, n_selected]")
    # Highest allowed id per token; packed documents use document-local block ids.
    if cu_seqlens is None:
        starts = torch.zeros(T, dtype=torch.long)
        ends = torch.full((T,), T, dtype=torch.long)
    else:
        cu = cu_seqlens.long().cpu()
        lengths = cu[1:] - cu[:-1]
        starts, ends = cu[:-1].repeat_interleave(lengths), cu[1:].repeat_interleave(lengths)
    limit_t = ((ends - starts + config.sel_block - 1) // config.sel_block - 1).to(idx.device)
    bad = (idx < -1) | (idx > limit_t[:, None])
    if bool(bad.any()):
        b, h, t, slot = (int(i) for i in bad.nonzero()[0])
        Ns, s, e = int(limit_t[t]) + 1, int(starts[t]), int(ends[t])
        where = f"T={T}" if cu_seqlens is None else f"the document of tokens [{s}, {e})"
        raise ValueError(
            f"block_indices values must lie in [-1, {Ns - 1}] (-1 = unused slot, {Ns} selection blocks "
            f"of {config.sel_block} tokens for {where}); got {int(idx[b, h, t, slot])} at "
            f"[b={b}, kv_head={h}, t={t}, slot={slot}]"
        )
    _check_distinct(idx)


def _check_distinct(idx) -> None:
    """Each token's selection is a set: a block id may appear once; -1 (unused) may repeat."""
    s, order = torch.sort(idx, dim=-1, stable=True)
    repeat = (s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)
    if bool(repeat.any()):
        b, h, t, i = (int(x) for x in repeat.nonzero()[0])
        slots = sorted(int(order[b, h, t, j]) for j in (i, i + 1))
        raise ValueError(
            f"block_indices lists block {int(s[b, h, t, i])} twice for [b={b}, kv_head={h}, t={t}] "
            f"(slots {slots[0]} and {slots[1]}: {idx[b, h, t].tolist()}); each token's block ids must be "
            f"distinct, with -1 for unused slots"
        )


def _check_cu_seqlens(cu, B, T) -> None:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor [n_docs + 1] of int32/int64, got {type(cu).__name__}")
    if cu.dtype not in INDEX_DTYPES or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor [n_docs + 1], got {cu.dtype} {tuple(cu.shape)}")
    if B != 1:
        raise ValueError(f"packed documents (cu_seqlens) need batch size 1, got B={B}")
    if int(cu[0]) != 0 or int(cu[-1]) != T or bool((cu[1:] <= cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must rise strictly from 0 to T={T}, got {cu.tolist()}")


def _expected_tc(T, config, cu_seqlens) -> int:
    if cu_seqlens is None:
        return num_cmp_blocks(T, config)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    return sum(num_cmp_blocks(int(n), config) for n in lengths)


def _names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


_LAYOUT = {
    "q": "[B, T, Hq, Dk]",
    "k": "[B, T, Hkv, Dk]",
    "v": "[B, T, Hkv, Dv]",
    "k_cmp": "[B, Tc, Hkv, Dk] with Tc = max(0, (T - l) // d + 1)",
    "v_cmp": "[B, Tc, Hkv, Dv] with Tc = max(0, (T - l) // d + 1)",
    "gates": "[B, T, Hq, 3] (cmp, sel, win after the sigmoid)",
}
