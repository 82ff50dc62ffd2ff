"""nsa_flex::selected_attention: the inverse index, the torch twin and the Triton kernels.

The oracle is nsa_flex.reference's selected branch (_selection_mask, _attend) in fp64, per
document for packed sequences. Kernel tests run under Triton's interpreter on CPU tensors
(TRITON_INTERPRET=1 set before Python starts; skipped otherwise) or on CUDA (marked gpu).
Tolerance: the error against fp64 stays within 2x the error of the same reference computed
in the input dtype, plus a floor of half an epsilon of the result's scale and a few fp32
ulps (the kernels' partial merges and sums run in fp32).
"""

from __future__ import annotations

import math

import pytest
import torch

from nsa_flex import reference
from interpreter import interpreter_mark
from nsa_flex.config import NSAConfig
from nsa_flex.folded import fold, unfold
from nsa_flex.ops.selected_attention import kernels, launch, selected_attention
from nsa_flex.ops.selected_attention.index import build_index, num_virtual_blocks, split_items_bound, work_list

gpu = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


interpreter = interpreter_mark(getattr(kernels, "_fwd_kernel", None))


# ----- inputs and the oracle -----

def make_config(G: int, Dk: int, Dv: int, n: int, sel_block: int = 64, Hkv: int = 2) -> NSAConfig:
    return NSAConfig(n_heads=G * Hkv, n_kv_heads=Hkv, head_dim=Dk, head_dim_v=Dv, sel_block=sel_block,
                     cmp_block=16, cmp_stride=16, n_selected=n)


def random_selection(B, Hkv, T, n, sel_block, seed=0, cu_seqlens=None, drop=0.1) -> torch.Tensor:
    """[B, Hkv, T, n] int64: block 0 and the own block forced, random distinct past blocks, -1 last.
    A `drop` share of the optional slots stays -1 (rows with fewer blocks)."""
    g = torch.Generator().manual_seed(seed)
    starts = [0] * T if cu_seqlens is None else _doc_starts(cu_seqlens, T)
    out = torch.full((B, Hkv, T, n), -1, dtype=torch.int64)
    for t in range(T):
        own = (t - starts[t]) // sel_block
        for bh in range(B * Hkv):
            picks = {0, own} | set(torch.randperm(own + 1, generator=g)[: n].tolist())
            keep = [0, own] + [j for j in sorted(picks - {0, own}) if torch.rand(1, generator=g).item() > drop]
            chosen = sorted(set(keep))[:n]
            out[bh // Hkv, bh % Hkv, t, : len(chosen)] = torch.tensor(chosen)
    return out


def _doc_starts(cu_seqlens, T):
    cu = cu_seqlens.tolist()
    return [max(s for s in cu[:-1] if s <= t) for t in range(T)]


def make_inputs(B, T, cfg: NSAConfig, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    Hq, Hkv = cfg.n_heads, cfg.n_kv_heads
    q = torch.randn(B, T, Hq, cfg.head_dim, generator=g)
    k = torch.randn(B, T, Hkv, cfg.head_dim, generator=g)
    v = torch.randn(B, T, Hkv, cfg.dv, generator=g)
    do = torch.randn(B, T, Hq, cfg.dv, generator=g)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v, do)]


def oracle(q, k, v, do, block_indices, cfg: NSAConfig, dtype, cu_seqlens=None):
    """(o, dq, dk, dv) of the reference's selected branch in `dtype` (fp64: the oracle), on q's device."""
    q, k, v, do = (x.detach().to(dtype).requires_grad_() for x in (q, k, v, do))
    block_indices = block_indices.to(q.device)
    bounds = [0, q.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
    G = q.shape[2] // k.shape[2]
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        mask = reference._selection_mask(block_indices[:, :, s:e], e - s, cfg).repeat_interleave(G, dim=1)
        o, _ = reference._attend(q[:, s:e].transpose(1, 2), reference._heads(k[:, s:e], G, dtype),
                                 reference._heads(v[:, s:e], G, dtype), mask, q.shape[-1] ** -0.5)
        outs.append(o.transpose(1, 2))
    o = torch.cat(outs, dim=1)
    grads = torch.autograd.grad(o, (q, k, v), do)
    return (o.detach(), *grads)


def assert_within(name, got, want64, low, dtype, magnitude):
    """|got - fp64| <= 2 |low - fp64| + half an epsilon of the result + 16 fp32 ulps of `magnitude`
    (the scale of the terms summed: a zero result, e.g. dq of a one-key row, has rounding too)."""
    err = (got.detach().double() - want64.double()).abs().max().item()
    ref_err = (low.double() - want64.double()).abs().max().item()
    bound = 2 * ref_err + torch.finfo(dtype).eps / 2 * want64.abs().max().item() + 16 * 2.0 ** -24 * magnitude
    assert math.isfinite(err) and err <= bound, f"{name}: error {err:.3e} > bound {bound:.3e} (ref {ref_err:.3e})"


def check(got, q, k, v, do, bi, cfg, cu_seqlens=None):
    """got = (o, dq, dk, dv) against the fp64 oracle with the derived tolerance."""
    dtype = q.dtype
    want = oracle(q, k, v, do, bi, cfg, torch.float64, cu_seqlens)
    low = oracle(q, k, v, do, bi, cfg, dtype, cu_seqlens)
    assert got[0].dtype == dtype and got[0].shape == want[0].shape
    big = {name: x.abs().max().item() for name, x in zip("qkvd", (q, k, v, do))}
    ds = big["d"] * big["v"] * q.shape[-1] ** -0.5
    magnitudes = (big["v"], ds * big["k"], ds * big["q"], big["d"])
    for name, x, w, lo, m in zip(("o", "dq", "dk", "dv"), got, want, low, magnitudes):
        assert_within(name, x, w, lo, dtype, m)


def run_op(q, k, v, do, bi, cfg, impl, cu_seqlens=None):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = selected_attention(q, k, v, bi, cfg, cu_seqlens=cu_seqlens, impl=impl)
    return (o.detach(), *torch.autograd.grad(o, (q, k, v), do))


def run_kernels(q, k, v, do, bi, cfg, cu_seqlens=None, tiles=None):
    """The Triton path through its internal entry points (tiles override launch_config)."""
    scale = q.shape[-1] ** -0.5
    o, lse = launch.forward(q, k, v, bi, cu_seqlens, scale, cfg.sel_block, tiles)
    return (o, *launch.backward(do, q, k, v, o, lse, bi, cu_seqlens, scale, cfg.sel_block, tiles))


@pytest.fixture
def poisoned(monkeypatch):
    """The kernels' buffers start as NaN: any element read before written shows up."""
    real = torch.empty

    def empty(*args, **kwargs):
        x = real(*args, **kwargs)
        return x.fill_(math.nan) if x.is_floating_point() else x.fill_(-(2 ** 30))

    monkeypatch.setattr(launch.torch, "empty", empty)


@pytest.fixture
def guarded(monkeypatch):
    """As poisoned, each buffer the front half of one twice its size: gives a check that the back
    halves kept their poison (no kernel wrote past a buffer; one that read past it read NaN)."""
    real = torch.empty
    tails = []

    def empty(*size, **kwargs):
        numel = torch.Size(size[0] if len(size) == 1 and not isinstance(size[0], int) else size).numel()
        whole = real(2 * numel, **kwargs)
        whole.fill_(math.nan) if whole.is_floating_point() else whole.fill_(-(2 ** 30))
        tails.append((whole[numel:], whole[numel:].clone()))
        return whole[:numel].view(*size)

    monkeypatch.setattr(launch.torch, "empty", empty)

    def untouched():
        for tail, poison in tails:
            assert tail.isnan().all() if tail.is_floating_point() else torch.equal(tail, poison), "written past a buffer"
    return untouched


# ----- the inverse index -----

def dense_rows(gid_bhtn, Nv):
    """{(b, h, block): [t * S + place, ...]} by a plain loop over the index's rows [B, Hkv, T, s]
    (S: s rounded up to a power of two)."""
    B, Hkv, T, n = gid_bhtn.shape
    S = 1 << (n - 1).bit_length()
    rows = {}
    for b in range(B):
        for h in range(Hkv):
            for t in range(T):
                for s in range(n):
                    j = int(gid_bhtn[b, h, t, s])
                    if j >= 0:
                        rows.setdefault((b, h, j), []).append(t * S + s)
    return rows


@pytest.mark.parametrize("B, Hkv, T, n, L, cu", [
    (2, 3, 111, 5, 16, None), (1, 2, 1, 3, 64, None), (2, 1, 200, 16, 32, None),
    (1, 2, 150, 4, 16, [0, 40, 41, 41, 150]),
], ids=["B2-H3-T111", "T1", "n16-more-than-blocks", "packed"])
def test_index_matches_dense(B, Hkv, T, n, L, cu):
    cu_t = None if cu is None else torch.tensor(cu)
    bi = random_selection(B, Hkv, T, n, L, seed=T, cu_seqlens=cu_t)
    # Also an id past the document's end, and slots of -1 before used ones: they read nothing, and
    # each token's row of the index holds its used slots first, in slot order.
    bi[0, 0, T - 1, -1] = (T + L) // L + 3
    bi[0, 0, T - 1, 0] = (T + L) // L + 3
    bi[:, :, ::3, 0] = -1
    index = build_index(bi.int(), L, cu_t)
    Nv = num_virtual_blocks(T, L, 1 if cu is None else len(cu) - 1)
    assert index.counts.shape == (B * Hkv * Nv,)
    bounds = [0, T] if cu is None else cu
    docs = [(s, e) for s, e in zip(bounds[:-1], bounds[1:])]
    first = [sum(-(-(e - s) // L) for s, e in docs[:d]) for d in range(len(docs))]
    assert index.gid_bhtn.shape == (B, Hkv, T, n)
    for t in range(T):
        d = max(i for i, (s, e) in enumerate(docs) if s <= t < e)
        used = []
        for slot in range(n):
            j = int(bi[0, 0, t, slot])
            if 0 <= j and docs[d][0] + j * L < docs[d][1]:
                used.append(first[d] + j)
                # The virtual block's keys: its document's tokens from the block's start on.
                assert int(index.blk_start[used[-1]]) == docs[d][0] + j * L
                assert int(index.blk_end[used[-1]]) == min(docs[d][0] + (j + 1) * L, docs[d][1])
        assert index.gid_bhtn[0, 0, t].tolist() == used + [-1] * (n - len(used))
    rows = dense_rows(index.gid_bhtn, Nv)
    for r in range(B * Hkv * Nv):
        b, h, j = r // (Hkv * Nv), (r // Nv) % Hkv, r % Nv
        got = index.entries[index.offsets[r]: index.offsets[r] + index.counts[r]].tolist()
        assert got == rows.get((b, h, j), []), (b, h, j)
    for span in (1, 7, 64):
        items = work_list(index, span, T, n)
        assert items.blk.shape == (B * Hkv * (-(-(T * n) // span) + Nv),)
        for r in range(B * Hkv * Nv):
            f, c = int(items.first_item[r]), int(items.n_items[r])
            assert (items.blk[f: f + c] == r).all()
            covered = [e for w in range(f, f + c) for e in range(items.start[w], items.end[w])]
            assert covered == list(range(index.offsets[r], index.offsets[r] + index.counts[r]))
            assert all(0 < items.end[w] - items.start[w] <= span for w in range(f, f + c))
        used = int(items.n_items.sum())
        assert (items.blk[used:] == -1).all()
        # The items of rows with several come first, within the bound the partial buffers take.
        split = sorted(w for w in range(used) if items.n_items[items.blk[w]] > 1)
        assert split == list(range(len(split)))
        assert len(split) <= split_items_bound(B * Hkv * T * n, span)


def test_index_with_fewer_places_than_slots():
    """slots < n (the gated node's n - 2): rows of `slots` places, entries t * slots + place, the
    sort over B*Hkv*T*slots keys; a token's used slots past `slots` read nothing instead of
    reaching another token's partials."""
    T, n, L = 150, 6, 16
    bi = random_selection(2, 2, T, n, L, seed=4, drop=0.0).int()
    bi[:, :, :, 2] = -1
    slots = 3
    index = build_index(bi, L, slots=slots)
    full = build_index(bi, L)
    assert int((full.gid_bhtn >= 0).sum(-1).max()) > slots  # some tokens use more slots than that
    assert torch.equal(index.gid_bhtn, full.gid_bhtn[..., :slots])
    assert index.entries.shape == (2 * 2 * T * slots,)
    Nv = num_virtual_blocks(T, L, 1)
    rows = dense_rows(index.gid_bhtn, Nv)
    for r in range(2 * 2 * Nv):
        b, h, j = r // (2 * Nv), (r // Nv) % 2, r % Nv
        got = index.entries[index.offsets[r]: index.offsets[r] + index.counts[r]].tolist()
        assert got == rows.get((b, h, j), []), (b, h, j)


def test_index_of_a_unique_selection_without_the_repeat_check():
    """unique=True (the selection op's own output) leaves out the repeat check: on a selection with
    no repeats every field equals the checked index's; on one with a repeat the checked index
    drops the later copy, which is what the check is for."""
    T, n, L = 150, 5, 16
    bi = random_selection(2, 2, T, n, L, seed=5).int()
    checked, trusted = build_index(bi, L), build_index(bi, L, unique=True)
    for name, a, b in zip(checked._fields, checked, trusted):
        assert torch.equal(a, b), name
    bi[1, 0, T - 1, -1] = bi[1, 0, T - 1, 0]
    assert int(build_index(bi, L).gid_bhtn[1, 0, T - 1, -1]) == -1
    assert int(build_index(bi, L, unique=True).gid_bhtn[1, 0, T - 1, -1]) >= 0


def test_index_with_more_rows_than_16_bit_keys_hold():
    """Past 32766 rows the sort keys are int32: the same CSR as the dense construction."""
    T, n, L = 33000, 2, 1  # Nv = 33001 rows of one kv head
    bi = random_selection(1, 1, T, n, L, seed=3)
    index = build_index(bi.int(), L)
    Nv = num_virtual_blocks(T, L, 1)
    assert Nv >= 2 ** 15 - 1
    rows = dense_rows(index.gid_bhtn, Nv)
    assert int(index.counts.sum()) == sum(len(v) for v in rows.values())
    for r in range(Nv):
        got = index.entries[index.offsets[r]: index.offsets[r] + index.counts[r]].tolist()
        assert got == rows.get((0, 0, r), []), r


def test_unknown_tile_keys_are_refused():
    cfg = make_config(4, 32, 32, 3, 16)
    q, k, v, do = make_inputs(1, 40, cfg, torch.float32, seed=1)
    bi = random_selection(1, cfg.n_kv_heads, 40, 3, 16, seed=2)
    with pytest.raises(ValueError, match=r"unknown selected_attention tile keys \['BT'\]; allowed: fwd_BT, bwd_BT"):
        launch.forward(q, k, v, bi.int(), None, 32 ** -0.5, 16, {"BT": 16})


def test_long_sequence_settings_from_32k_tokens():
    """The forward's cap (a launch through nsa_flex::capped_launch) at 16-bit only, 168 at Dk = Dv =
    128 and 128 at D = 64, from LONG_FROM_TOKENS tokens (B * T) on, never on the backward; 64-chunk
    backward items there, 16 below at 16-bit D=128, 32 otherwise; 5 backward stages at 16-bit D <= 64."""
    caps = {(G, D, dtype, tokens): launch.launch_config(G, D, D, dtype, tokens)
            for G in (1, 4, 16) for D in (64, 128) for dtype in (torch.bfloat16, torch.float16, torch.float32)
            for tokens in (0, 16384, 32767, 32768, 1 << 20)}
    capped = {key for key, cfg in caps.items() if cfg["fwd_maxnreg"]}
    assert capped == {(G, D, dtype, tokens) for G in (1, 4, 16) for D in (64, 128)
                      for dtype in (torch.bfloat16, torch.float16) for tokens in (32768, 1 << 20)}
    assert {cfg["fwd_maxnreg"] for key, cfg in caps.items() if key in capped and key[1] == 64} == {128}
    assert {cfg["fwd_maxnreg"] for cfg in caps.values()} == {0, 128, 168}
    assert {cfg["bwd_maxnreg"] for cfg in caps.values()} == {0}
    assert launch.LONG_FROM_TOKENS == 32768
    assert {key for key, cfg in caps.items() if cfg["bwd_chunks"] == 16} == {
        (G, 128, dtype, tokens) for G in (1, 4, 16) for dtype in (torch.bfloat16, torch.float16)
        for tokens in (0, 16384, 32767)}
    assert {key for key, cfg in caps.items() if cfg["bwd_chunks"] == 64} == {
        key for key in caps if key[3] >= 32768}
    assert {key for key, cfg in caps.items() if cfg["bwd_stages"] == 5} == {
        key for key in caps if key[1] == 64 and key[2] != torch.float32}


# ----- the torch twin (CPU) -----

TWIN_CASES = [
    pytest.param(B, T, G, Dk, Dv, n, L, dtype, id=f"B{B}-T{T}-G{G}-D{Dk}x{Dv}-n{n}-l{L}-{str(dtype)[6:]}")
    for B, T, G, Dk, Dv, n, L, dtype in [
        (2, 1, 1, 32, 24, 3, 16, torch.float32), (1, 63, 2, 64, 64, 4, 16, torch.float32),
        (2, 111, 4, 32, 24, 4, 32, torch.float32), (1, 200, 16, 64, 32, 5, 16, torch.bfloat16),
        (1, 300, 3, 192, 128, 16, 64, torch.float64),
    ]
]


@pytest.mark.parametrize("B, T, G, Dk, Dv, n, L, dtype", TWIN_CASES)
def test_twin_matches_reference(B, T, G, Dk, Dv, n, L, dtype):
    cfg = make_config(G, Dk, Dv, n, L)
    q, k, v, do = make_inputs(B, T, cfg, dtype, seed=T + G)
    bi = random_selection(B, cfg.n_kv_heads, T, n, L, seed=T)
    check(run_op(q, k, v, do, bi, cfg, "torch"), q, k, v, do, bi, cfg)


def test_twin_chunks_and_packed_documents(monkeypatch):
    """Packed documents (document-local ids), with one-token chunks: same as per-document reference."""
    from nsa_flex.ops.selected_attention import twin

    monkeypatch.setattr(twin, "_CHUNK_ELEMENTS", 1)
    cfg = make_config(2, 32, 24, 4, 16)
    cu = torch.tensor([0, 40, 41, 41, 150], dtype=torch.int32)
    q, k, v, do = make_inputs(1, 150, cfg, torch.float32, seed=5)
    bi = random_selection(1, cfg.n_kv_heads, 150, 4, 16, seed=5, cu_seqlens=cu)
    check(run_op(q, k, v, do, bi, cfg, "torch", cu), q, k, v, do, bi, cfg, cu)


def test_twin_empty_rows_give_zero():
    cfg = make_config(2, 32, 24, 3, 16)
    q, k, v, do = make_inputs(1, 40, cfg, torch.float32)
    bi = torch.full((1, 2, 40, 3), -1)
    bi[:, :, ::2, 0] = 0
    o, dq, dk, dv = run_op(q, k, v, do, bi, cfg, "torch")
    assert (o[:, 1::2] == 0).all() and (dq[:, 1::2] == 0).all()
    assert all(torch.isfinite(x).all() for x in (o, dq, dk, dv))


# ----- the op: registration -----

def _op_args(device="cpu", dtype=torch.float32, cu=None):
    cfg = make_config(2, 32, 24, 4, 16)
    T = 70 if cu is None else int(cu[-1])
    q, k, v, _ = make_inputs(1, T, cfg, dtype, seed=1, device=device)
    bi = random_selection(1, 2, T, 4, 16, seed=1, cu_seqlens=cu).to(device=device, dtype=torch.int32)
    cu = None if cu is None else cu.to(device)
    return (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), bi, cu, 0.2, 16, "auto", 0, None, None)


@pytest.mark.parametrize("cu", [None, torch.tensor([0, 30, 31, 90])], ids=["single", "packed"])
@pytest.mark.parametrize("folded", [False, True], ids=["bthd", "folded"])
def test_opcheck_cpu(cu, folded):
    args = _op_args(cu=cu)
    if folded:
        q = args[0].detach()
        args = (fold(q, 2, rows=q.shape[1] * 2 + 6).requires_grad_(), *args[1:-3], q.shape[2], None, None)
    torch.library.opcheck(torch.ops.nsa_flex.selected_attention.default, args)


def run_folded(q, k, v, do, bi, cfg, impl, pad_rows=0):
    """run_op with q passed folded (pad_rows zero rows past T*G): (o, dq unfolded, dk, dv, dq's pad rows)."""
    Hkv, T = cfg.n_kv_heads, q.shape[1]
    rows = T * cfg.group_size
    q_fold = fold(q, Hkv, rows=rows + pad_rows).detach().requires_grad_()
    k, v = (x.detach().clone().requires_grad_() for x in (k, v))
    o = selected_attention(q_fold, k, v, bi, cfg, impl=impl, folded=True)
    dq, dk, dv = torch.autograd.grad(o, (q_fold, k, v), do)
    return o.detach(), unfold(dq[:, :, :rows], T), dk, dv, dq[:, :, rows:]


FOLDED_CASES = pytest.mark.parametrize("G, pad_rows", [(2, 0), (3, 9), (4, 64), (4, 6)],
                                       ids=["G2", "G3-pad", "G4-pad", "G4-pad-part-token"])


@FOLDED_CASES
def test_folded_q_equals_bthd_twin(G, pad_rows):
    _check_folded("torch", G, pad_rows)


@interpreter
@FOLDED_CASES
def test_folded_q_equals_bthd_kernels_interpreted(G, pad_rows, poisoned):
    _check_folded("triton", G, pad_rows)


@gpu
def test_folded_q_equals_bthd_cuda():
    _check_folded("triton", 4, 64, torch.bfloat16, "cuda", D=128)


def _check_folded(impl, G, pad_rows, dtype=torch.float32, device="cpu", D=32):
    """q read in place from a folded buffer (rows past T*G ignored): the same o, dk, dv and, folded
    back, dq; dq's rows past T*G are zeros (written, not left over: with `poisoned` the kernels'
    buffers start as NaN)."""
    cfg = make_config(G, D, D if D > 32 else 24, 4, 16)
    q, k, v, do = make_inputs(1, 70, cfg, dtype, seed=G, device=device)
    bi = random_selection(1, cfg.n_kv_heads, 70, 4, 16, seed=G).to(device)
    want = run_op(q, k, v, do, bi, cfg, impl)
    *got, pad = run_folded(q, k, v, do, bi, cfg, impl, pad_rows)
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), name
    assert torch.equal(pad, torch.zeros_like(pad))
    check(got, q, k, v, do, bi, cfg)


def test_folded_q_bad_rows():
    cfg = make_config(2, 32, 24, 4, 16)
    q_fold = torch.randn(1, 2, 2 * 64 - 1, 32)
    with pytest.raises(ValueError, match="folded q .* expected \\[1, 2, >= 128, Dk\\]"):
        selected_attention(q_fold, torch.randn(1, 64, 2, 32), torch.randn(1, 64, 2, 24),
                           torch.zeros(1, 2, 64, 4, dtype=torch.int32), cfg, folded=True)


@pytest.mark.parametrize("change, error, message", [
    (dict(q=torch.randn(2, 8, 4)), ValueError, "q must be"),
    (dict(k=torch.randn(1, 64, 2, 16)), ValueError, "do not fit"),
    (dict(k=torch.randn(1, 64, 3, 32), v=torch.randn(1, 64, 3, 24)), ValueError, "multiple of"),
    (dict(v=torch.randn(1, 64, 2, 24).double()), TypeError, "must match"),
    (dict(block_indices=torch.zeros(1, 2, 64, 4)), ValueError, "int32/int64"),
    (dict(impl="flex"), ValueError, "allowed"),
    (dict(cu_seqlens=torch.tensor([[0, 64]])), ValueError, "1-D"),
], ids=["q-dims", "k-dim", "heads", "v-dtype", "indices-dtype", "impl", "cu-2d"])
def test_bad_inputs(change, error, message):
    cfg = make_config(2, 32, 24, 4, 16)
    args = dict(q=torch.randn(1, 64, 4, 32), k=torch.randn(1, 64, 2, 32), v=torch.randn(1, 64, 2, 24),
                block_indices=torch.zeros(1, 2, 64, 4, dtype=torch.int32))
    kwargs = {key: change.pop(key) for key in ("cu_seqlens", "impl") if key in change}
    args.update(change)
    with pytest.raises(error, match=message):
        selected_attention(args["q"], args["k"], args["v"], args["block_indices"], cfg, **kwargs)


# ----- the Triton kernels under the interpreter (CPU) -----

KERNEL_CASES = [
    pytest.param(B, T, G, Dk, Dv, n, L, dtype, tiles, id=f"B{B}-T{T}-G{G}-D{Dk}x{Dv}-n{n}-l{L}-{str(dtype)[6:]}"
                 + ("-" + "-".join(f"{a}{b}" for a, b in tiles.items()) if tiles else ""))
    for B, T, G, Dk, Dv, n, L, dtype, tiles in [
        (1, 1, 2, 64, 64, 4, 64, torch.float32, None),
        (2, 63, 1, 64, 64, 3, 16, torch.float32, None),
        (1, 111, 4, 32, 24, 5, 16, torch.float32, dict(fwd_chunks=1, bwd_chunks=1)),
        (1, 111, 16, 32, 24, 4, 32, torch.float32, dict(bwd_chunks=2)),
        (2, 90, 3, 32, 24, 5, 16, torch.float32, None),  # G=3: padded head rows in every kernel
        (1, 200, 2, 64, 64, 6, 16, torch.bfloat16, dict(bwd_chunks=3)),
        (1, 111, 4, 64, 64, 4, 64, torch.float16, None),
        # Register caps: the launches go through nsa_flex::capped_launch (the interpreter ignores the cap).
        (1, 111, 4, 64, 64, 4, 64, torch.float16, dict(fwd_maxnreg=168, bwd_maxnreg=255)),
        # The long-sequence settings at 16-bit D=128 (launch_config from LONG_FROM_TOKENS on).
        (1, 200, 4, 128, 128, 4, 64, torch.float16, dict(fwd_maxnreg=168, bwd_chunks=64)),
        (1, 40, 2, 192, 128, 3, 16, torch.float32, None),
        (1, 40, 2, 192, 128, 3, 16, torch.bfloat16, None),
    ]
]


@interpreter
@pytest.mark.parametrize("B, T, G, Dk, Dv, n, L, dtype, tiles", KERNEL_CASES)
def test_kernels_interpreted(B, T, G, Dk, Dv, n, L, dtype, tiles, poisoned):
    cfg = make_config(G, Dk, Dv, n, L)
    q, k, v, do = make_inputs(B, T, cfg, dtype, seed=T * 7 + G)
    bi = random_selection(B, cfg.n_kv_heads, T, n, L, seed=T + 1)
    check(run_kernels(q, k, v, do, bi.int(), cfg, tiles=tiles), q, k, v, do, bi, cfg)


@interpreter
def test_kernels_interpreted_one_block_for_all(poisoned):
    """Every token reads block 0 only (plus -1 slots): one long list, split over many items.
    Tokens 50..59 read nothing at all and give exactly 0."""
    cfg = make_config(4, 32, 24, 3, 16)
    T = 100
    q, k, v, do = make_inputs(1, T, cfg, torch.float32, seed=3)
    bi = torch.full((1, 2, T, 3), -1)
    bi[..., 0] = 0
    bi[:, :, 50:60] = -1
    got = run_kernels(q, k, v, do, bi, cfg, tiles=dict(fwd_BT=4, bwd_BT=2, fwd_chunks=2, bwd_chunks=3))
    check(got, q, k, v, do, bi, cfg)
    assert (got[0][:, 50:60] == 0).all() and (got[1][:, 50:60] == 0).all()


@interpreter
def test_kernels_interpreted_packed_documents(poisoned):
    cfg = make_config(2, 32, 24, 4, 16)
    cu = torch.tensor([0, 40, 41, 41, 130], dtype=torch.int32)
    q, k, v, do = make_inputs(1, 130, cfg, torch.float32, seed=9)
    bi = random_selection(1, 2, 130, 4, 16, seed=9, cu_seqlens=cu)
    check(run_kernels(q, k, v, do, bi, cfg, cu, tiles=dict(bwd_chunks=1)), q, k, v, do, bi, cfg, cu)


@interpreter
@pytest.mark.parametrize("B, T, Hq, D, dtype", [(2, 37, 3, 24, torch.float32), (1, 70, 16, 128, torch.bfloat16),
                                                (1, 5, 64, 64, torch.float16)], ids=["odd", "g4-d128", "hq64"])
def test_delta_kernel(B, T, Hq, D, dtype, poisoned):
    """delta = rowsum(dO * O) in fp32 as [B, Hq, T], O a strided view, against an fp64 sum."""
    g = torch.Generator().manual_seed(T)
    do = torch.randn(B, T, Hq, D, generator=g).to(dtype)
    o = torch.randn(B, Hq, T, D, generator=g).to(dtype).transpose(1, 2)
    got = launch._delta(do, o)
    want = (do.double() * o.double()).sum(-1).transpose(1, 2)
    assert got.dtype == torch.float32 and got.shape == (B, Hq, T)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * math.sqrt(D))


@interpreter
@pytest.mark.parametrize("B, T, R, dtype, cu", [
    (1, 130, 64, torch.float32, None), (1, 130, 50, torch.bfloat16, None), (1, 97, 1, torch.float32, None),
    (1, 130, 45, torch.float32, [0, 40, 41, 41, 130]), (2, 130, 40, torch.float32, None),
], ids=["3-ranges", "bf16-ranges-across-blocks", "one-token-ranges", "ranges-across-documents", "batch-4-ranges"])
def test_kernels_interpreted_token_ranges(B, T, R, dtype, cu, guarded):
    """A sequence run in token ranges (bounded partial buffers) equals the oracle: keys and
    causality absolute, dK/dV summed over the ranges, ranges cutting blocks and documents; no
    buffer is read or written past its end. The fp32 dK/dV sums [B, Ts, Hkv, D] hold only the
    keys of blocks that start before the last range (Ts < T): at B=2 their batch stride is not
    dK/dV's."""
    cfg = make_config(2, 32, 24, 4, 16)
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    q, k, v, do = make_inputs(B, T, cfg, dtype, seed=T + R)
    bi = random_selection(B, 2, T, 4, 16, seed=R, cu_seqlens=cu)
    got = run_kernels(q, k, v, do, bi, cfg, cu, tiles=dict(range_tokens=R, bwd_chunks=2))
    check(got, q, k, v, do, bi, cfg, cu)
    guarded()


@interpreter
def test_kernels_interpreted_slots_that_read_nothing_between_used_ones(poisoned):
    """Slots of -1 and repeated blocks before used ones: the index packs each token's used slots
    first, and the kernels, the merge and the dQ sum agree on their places."""
    cfg = make_config(2, 32, 24, 5, 16)
    T = 100
    q, k, v, do = make_inputs(1, T, cfg, torch.float32, seed=21)
    bi = random_selection(1, 2, T, 5, 16, seed=21, drop=0.0)
    bi[..., 1], bi[..., 2] = bi[..., 2].clone(), -1
    bi[:, 0, ::2, 0] = bi[:, 0, ::2, 3]
    assert ((bi[..., 1:] >= 0).sum(-1) > 2).any()
    got = run_kernels(q, k, v, do, bi, cfg, tiles=dict(range_tokens=40, bwd_chunks=2))
    check(got, q, k, v, do, bi, cfg)


@interpreter
def test_kernels_interpreted_token_ranges_with_later_blocks(poisoned):
    """A given selection may list blocks after a token's own (masked whole, exact zeros): with
    token ranges run last first, such a block is already final when an earlier range lists it,
    and must keep the dK/dV its own and later tokens gave it."""
    cfg = make_config(2, 32, 24, 4, 16)
    T = 130
    q, k, v, do = make_inputs(1, T, cfg, torch.float32, seed=11)
    bi = random_selection(1, 2, T, 4, 16, seed=11)
    g = torch.Generator().manual_seed(12)
    later = torch.randint(0, -(-T // 16), (1, 2, T), generator=g)
    bi[..., -1] = torch.where(later > torch.arange(T) // 16, later, bi[..., -1])
    assert (bi[..., -1] > torch.arange(T) // 16).sum() > 20
    got = run_kernels(q, k, v, do, bi, cfg, tiles=dict(range_tokens=40, bwd_chunks=2))
    check(got, q, k, v, do, bi, cfg)


@interpreter
@pytest.mark.parametrize("R, skip_local, folded", [(40, False, False), (130, True, False), (50, True, True)],
                         ids=["4-ranges", "one-range-without-local", "3-ranges-folded-without-local"])
def test_backward_from_the_saved_index_equals_rebuilding_it(R, skip_local, folded, poisoned):
    """backward(index=) with forward(keep_index=True)'s SavedIndex gives bit for bit what building
    the index again gives (the same index, range by range; only the work items are built), and the
    SavedIndex has the shapes saved_index_shapes states (the gated node's fake outputs). Without
    the local slots the selection lists each token's own block and the one before (the gated
    node's), and the index is the forward's that leaves them out too (n - 2 partial slots)."""
    from test_gated_branches import local_selection

    cfg = make_config(2, 32, 24, 4, 16)
    T, scale = 130, 32 ** -0.5
    q, k, v, do = make_inputs(1, T, cfg, torch.float32, seed=R)
    bi = local_selection(1, 2, T, 5, 16, seed=R) if skip_local else random_selection(1, 2, T, 4, 16, seed=R)
    n = bi.shape[-1]
    tiles = dict(range_tokens=R, bwd_chunks=2)
    q_heads = cfg.n_heads if folded else 0
    if folded:
        q = fold(q, cfg.n_kv_heads, rows=T * 2 + 3)
    o, lse, index = launch.forward(q, k, v, bi, None, scale, 16, tiles, q_heads, keep_index=True)
    if skip_local:
        index = launch._pack([i for _, _, i, _ in launch._forward_ranges(q, k, v, bi, None, scale, 16, tiles, q_heads,
                                                                          skip_local=True)])
    assert index.counts.shape[0] == len(launch._ranges(T, R))
    if R >= T:
        shapes = launch.saved_index_shapes(1, T, 2, n, 16, q, k, v, q_heads, skip_local=skip_local)
        assert [tuple(x.shape) for x in index] == list(shapes)
    got = launch.backward(do, q, k, v, o, lse, bi, None, scale, 16, tiles, q_heads, skip_local=skip_local,
                          index=index)
    want = launch.backward(do, q, k, v, o, lse, bi, None, scale, 16, tiles, q_heads, skip_local=skip_local)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), name


def test_sums_hold_the_keys_of_blocks_that_start_before_the_last_range():
    """sum_tokens (the rows of the backward's fp32 dK/dV sums) reaches the end of every block that
    starts before the last range's first token, single sequence or packed documents (blocks
    starting anywhere), and at T=64k in 4 ranges is the last range's start."""
    from nsa_flex.ops.selected_attention.index import _bounds, _virtual_blocks

    assert launch.sum_tokens(65536, 49152, 64, False) == 49152
    g = torch.Generator().manual_seed(0)
    for T, L in [(130, 16), (300, 64), (1000, 48)]:
        docs = [None] + [torch.cat([torch.tensor([0]), torch.randint(1, T, (d,), generator=g).sort().values,
                                    torch.tensor([T])]) for d in (1, 3, 9)]
        for cu in docs:
            b = _bounds(cu, T, "cpu")
            blocks = (b[1:] - b[:-1] + L - 1) // L
            last = torch.cumsum(blocks, 0)
            start, end = _virtual_blocks(b, last, last - blocks, num_virtual_blocks(T, L, b.shape[0] - 1), L)
            for t0 in range(1, T):
                need = int(end[(start < t0) & (end > start)].max())
                got = launch.sum_tokens(T, t0, L, cu is not None)
                assert need <= got <= T, (T, L, t0, cu)
                if cu is None:
                    assert got == need


def test_backward_refuses_a_saved_index_of_other_ranges():
    cfg = make_config(2, 32, 24, 4, 16)
    q, k, v, do = make_inputs(1, 130, cfg, torch.float32)
    index = launch.SavedIndex(*(torch.zeros(1, dtype=torch.int32) for _ in range(2)),
                              torch.zeros(1, 9, dtype=torch.int32), torch.zeros(1, 9, dtype=torch.int32),
                              *(torch.zeros(9, dtype=torch.int32) for _ in range(2)))
    with pytest.raises(ValueError, match="1 token ranges, these inputs 3"):
        launch.backward(do, q, k, v, q, torch.zeros(1, 4, 130), random_selection(1, 2, 130, 4, 16), None, 1.0, 16,
                        dict(range_tokens=50), index=index)


def test_range_tokens_bound_the_partial_buffers():
    """Ranges: the whole sequence when its partials fit, else multiples of 64 tokens whose
    partial buffer stays within PARTIAL_BYTES, as few as fit and of even length (the last no
    shorter than the others by more than 64 tokens a range); an explicit range_tokens wins."""
    assert launch.range_tokens(1, 8192, 12, 16, 64, torch.bfloat16) == 8192
    assert launch.range_tokens(1, 65536, 12, 16, 64, torch.bfloat16) == 21888  # seeds-125m's heads: 3 ranges
    for B, T, Hq, D, dtype in [(1, 65536, 16, 128, torch.bfloat16), (2, 65536, 12, 64, torch.float32),
                               (64, 4096, 64, 192, torch.bfloat16), (1, 65536, 12, 64, torch.bfloat16),
                               (1, 100000, 16, 128, torch.bfloat16), (1, 65536, 64, 192, torch.bfloat16)]:
        R = launch.range_tokens(B, T, Hq, 16, D, dtype)
        size = launch.partial_dtype(dtype).itemsize
        assert R % 64 == 0 and 64 <= R < T
        assert R == 64 or B * R * Hq * 16 * D * size <= launch.PARTIAL_BYTES
        ranges = launch._ranges(T, R)
        fewest = -(-T // max(64, launch.PARTIAL_BYTES // (B * Hq * 16 * D * size) // 64 * 64))
        assert len(ranges) == fewest
        last = ranges[-1][1] - ranges[-1][0]
        assert R - last <= 64 * len(ranges), (R, last)
    assert launch.range_tokens(1, 65536, 16, 16, 128, torch.bfloat16, dict(range_tokens=100)) == 100
    # Another budget: seeds-125m's heads at 64k in one range of 1.5 GiB within 2 GiB.
    assert launch.range_tokens(1, 65536, 12, 16, 64, torch.bfloat16, dict(partial_bytes=2 << 30)) == 65536
    assert launch.range_tokens(1, 65536, 12, 16, 64, torch.bfloat16, dict(partial_bytes=24 << 20)) == 1024


def test_compiled_index_skipped_while_tracing():
    """Fake tensors (the op's body traced by AOTAutograd) use the plain index functions: a nested
    compile there would fail and, before, switched the compiled index off for good."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert not launch._tracing(torch.zeros(3, dtype=torch.int32))
    with FakeTensorMode() as mode:
        assert launch._tracing(mode.from_tensor(torch.zeros(3, dtype=torch.int32)))


@interpreter
def test_kernels_interpreted_causal():
    """Changing keys and values after token t0 changes nothing at tokens <= t0."""
    cfg = make_config(2, 32, 24, 4, 16)
    T, t0 = 90, 37
    q, k, v, do = make_inputs(1, T, cfg, torch.float32, seed=4)
    bi = random_selection(1, 2, T, 4, 16, seed=4).int()
    o1, _ = launch.forward(q, k, v, bi, None, 0.2, 16)
    k2, v2 = k.clone(), v.clone()
    k2[:, t0 + 1:] += 3.0
    # Finite: a masked key's p is 0 and 0 * NaN would still be NaN, in any attention.
    v2[:, t0 + 1:] *= -100.0
    o2, _ = launch.forward(q, k2, v2, bi, None, 0.2, 16)
    assert torch.equal(o1[:, : t0 + 1], o2[:, : t0 + 1])


@interpreter
def test_op_forces_kernels_on_cpu():
    """impl="triton" runs the kernels through the op and its autograd, as the twin does."""
    cfg = make_config(2, 32, 24, 4, 16)
    q, k, v, do = make_inputs(1, 50, cfg, torch.float32, seed=2)
    bi = random_selection(1, 2, 50, 4, 16, seed=2)
    got = run_op(q, k, v, do, bi, cfg, "triton")
    twin = run_op(q, k, v, do, bi, cfg, "torch")
    for x, y in zip(got, twin):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


@interpreter
def test_op_kernels_on_an_empty_sequence():
    """T = 0 on the kernel path gives what the twin gives (empty outputs and gradients, no error), and
    forward(keep_index=True) an index of the shapes its fake declares (saved_index_shapes)."""
    cfg = make_config(2, 32, 32, 4, 16)
    q, k, v, do = make_inputs(1, 0, cfg, torch.float32)
    bi = torch.empty(1, 2, 0, 4, dtype=torch.int64)
    got = run_op(q, k, v, do, bi, cfg, "triton")
    for x, y in zip(got, run_op(q, k, v, do, bi, cfg, "torch")):
        assert x.shape == y.shape and x.numel() == 0
    o, lse, index = launch.forward(q, k, v, bi.int(), None, 32 ** -0.5, 16, keep_index=True)
    assert o.shape == (1, 0, 4, 32) and lse.shape == (1, 4, 0)
    want = launch.saved_index_shapes(1, 0, 2, 4, 16, q, k, v)
    assert [tuple(x.shape) for x in index] == [tuple(w) for w in want]
    dq, dk, dv = launch.backward(do, q, k, v, o, lse, bi.int(), None, 32 ** -0.5, 16, index=index)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


# ----- CUDA (the lead's GPU machine) -----

GPU_CASES = [
    pytest.param(T, G, Dk, Dv, dtype, id=f"T{T}-G{G}-D{Dk}x{Dv}-{str(dtype)[6:]}")
    for T, G, Dk, Dv, dtype in [
        (1000, 1, 64, 64, torch.bfloat16), (1000, 2, 128, 128, torch.float16), (1000, 4, 192, 128, torch.bfloat16),
        (1000, 8, 64, 64, torch.float32), (1000, 16, 128, 128, torch.bfloat16), (1000, 16, 192, 128, torch.float32),
        (4096, 1, 128, 128, torch.bfloat16), (4096, 2, 64, 64, torch.bfloat16), (4096, 4, 128, 128, torch.bfloat16),
        (4096, 8, 128, 128, torch.float16), (4096, 16, 192, 128, torch.bfloat16), (4096, 4, 64, 64, torch.float32),
    ]
]


@gpu
@pytest.mark.parametrize("T, G, Dk, Dv, dtype", GPU_CASES)
def test_kernels_gpu(T, G, Dk, Dv, dtype):
    cfg = make_config(G, Dk, Dv, 16, 64)
    q, k, v, do = make_inputs(1, T, cfg, dtype, seed=T + G, device="cuda")
    bi = random_selection(1, cfg.n_kv_heads, T, 16, 64, seed=T, drop=0.0).cuda()
    check(run_op(q, k, v, do, bi, cfg, "auto"), q, k, v, do, bi, cfg)


@gpu
@pytest.mark.parametrize("G, cu", [(4, None), (16, None), (4, [0, 100, 101, 121, 2696, 2760, 3000])])
def test_kernels_gpu_long_sequence_settings(G, cu):
    """The settings launch_config gives from LONG_FROM_TOKENS tokens on (the forward's register cap
    through nsa_flex::capped_launch, 64-chunk backward items), on a short input. (Not `poisoned`:
    its torch.empty would break the compiled index build, which then runs eagerly for the process.)"""
    cfg = make_config(G, 128, 128, 16, 64)
    long = launch.launch_config(G, 128, 128, torch.bfloat16, launch.LONG_FROM_TOKENS)
    tiles = {key: long[key] for key in ("fwd_maxnreg", "bwd_chunks")}
    assert tiles == {"fwd_maxnreg": 168, "bwd_chunks": 64}
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    q, k, v, do = make_inputs(1, 3000, cfg, torch.bfloat16, seed=G, device="cuda")
    bi = random_selection(1, cfg.n_kv_heads, 3000, 16, 64, seed=G, cu_seqlens=cu)
    got = run_kernels(q, k, v, do, bi.int().cuda(), cfg, None if cu is None else cu.cuda(), tiles)
    check(got, q, k, v, do, bi, cfg, cu)


@gpu
def test_kernels_gpu_packed_documents():
    cfg = make_config(4, 128, 128, 16, 64)
    cu = torch.tensor([0, 100, 101, 121, 2696, 2760, 3000], dtype=torch.int32)
    q, k, v, do = make_inputs(1, 3000, cfg, torch.bfloat16, seed=2, device="cuda")
    bi = random_selection(1, 2, 3000, 16, 64, seed=2, cu_seqlens=cu)
    check(run_op(q, k, v, do, bi.cuda(), cfg, "auto", cu.cuda()), q, k, v, do, bi, cfg, cu)


def check_compiled(backend: str, device: str, cfg: NSAConfig, T: int, dtype, impl: str, **tol) -> None:
    """fwd + bwd under torch.compile(fullgraph=True) equal eager `impl` on two inputs: one frame, no recompile."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)

    @torch.compile(backend=counter, fullgraph=True, dynamic=False)
    def step(q, k, v, bi):
        return selected_attention(q * 1.0, k, v, bi, cfg) + 0

    for seed in (0, 1):
        q, k, v, do = make_inputs(1, T, cfg, dtype, seed=seed, device=device)
        bi = random_selection(1, 2, T, cfg.n_selected, cfg.sel_block, seed=seed).to(device)
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        o = step(*x, bi)
        got = (o, *torch.autograd.grad(o, x, do))
        for a, b in zip(got, run_op(q, k, v, do, bi, cfg, impl)):
            torch.testing.assert_close(a, b, **tol)
    assert counter.frame_count == 1


@gpu
def test_compile_fullgraph_cuda():
    """The Triton path compiles whole with Inductor and equals the eager op."""
    check_compiled("inductor", "cuda", make_config(4, 128, 128, 16, 64), 1000, torch.bfloat16, "auto",
                   atol=2e-2, rtol=2e-2)


@gpu
def test_compile_fullgraph_cuda_token_ranges_batch(monkeypatch):
    """Compiled with Inductor at B=3, in several token ranges, with q a strided view (as a fused
    projection gives): equals the eager op. Strided index tensors once made the compiled kernels
    read past their buffers here (an illegal address at B=4, 8k tokens in the model)."""
    monkeypatch.setattr(launch, "PARTIAL_BYTES", 1 << 24)  # ranges of 320 tokens
    cfg = make_config(4, 64, 64, 16, 64)
    B, T = 3, 1500
    assert len(launch._ranges(T, launch.range_tokens(B, T, 8, 16, 64, torch.bfloat16))) >= 3
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, dynamic=False)
    def step(qkv, k, v, bi):
        return selected_attention(qkv[..., :64], k, v, bi, cfg)

    q, k, v, do = make_inputs(B, T, cfg, torch.bfloat16, seed=8, device="cuda")
    bi = random_selection(B, 2, T, 16, 64, seed=8, drop=0.0).cuda()
    qkv = torch.cat([q, torch.zeros_like(q)], -1)
    x = [t.clone().requires_grad_() for t in (qkv, k, v)]
    o = step(*x, bi)
    got = (o, *torch.autograd.grad(o, x, do))
    want = run_op(q, k, v, do, bi, cfg, "auto")
    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[1][..., :64], want[1], atol=2e-2, rtol=2e-2)
    for a, b in zip(got[2:], want[2:]):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    check(want, q, k, v, do, bi, cfg)


def test_compile_fullgraph_cpu():
    """The op and its autograd trace whole (the twin on CPU): compiled equals eager, one frame."""
    check_compiled("aot_eager", "cpu", make_config(2, 32, 24, 4, 16), 70, torch.float32, "torch")


@gpu
def test_kernels_gpu_deterministic():
    """No atomics: two runs on the same inputs give the same output and gradients bit for bit."""
    cfg = make_config(4, 128, 128, 16, 64)
    q, k, v, do = make_inputs(1, 4096, cfg, torch.bfloat16, seed=5, device="cuda")
    bi = random_selection(1, 2, 4096, 16, 64, seed=5).cuda()
    first, second = (run_op(q, k, v, do, bi, cfg, "auto") for _ in range(2))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@interpreter
def test_kernels_interpreted_repeated_ids_count_once():
    """A block listed twice in one row is that block once, as in the reference's mask (and the twin)."""
    cfg = make_config(2, 32, 24, 4, 16)
    T = 70
    q, k, v, do = make_inputs(1, T, cfg, torch.float32, seed=11)
    bi = random_selection(1, cfg.n_kv_heads, T, 4, 16, seed=11)
    # Slot 3 repeats slot 0 (block 0) wherever it is free: the same keys listed twice.
    bi[..., 3] = torch.where(bi[..., 3] < 0, bi[..., 0], bi[..., 3])
    assert bool((bi[..., 3] == bi[..., 0]).any())
    check(run_kernels(q, k, v, do, bi, cfg), q, k, v, do, bi, cfg)
    check(run_op(q, k, v, do, bi, cfg, "torch"), q, k, v, do, bi, cfg)
