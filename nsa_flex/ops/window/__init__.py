"""NSA's sliding-window branch over folded queries: the op nsa_flex::window_attention.

Query t (query head h*G + g, folded row t*G + g of kv head h) attends to the keys s with
t - W < s <= t, softmax with scale Dk ** -0.5 by default. The same attention as the Flex window
call (flex.branches.window_branch) with one kernel written for its band: a row tile's keys in
blocks, only the two blocks at the band's edges masked, no block lists to read
(kernels.py; docs/decisions.md, "The window branch").

On CUDA with 16-bit inputs and Dk, Dv in HEAD_DIMS the op runs the Triton kernels; elsewhere the
torch twin (twin.py). impl="triton" forces the kernels, e.g. on CPU under Triton's interpreter.
With folded=False the op reads q [B, T, Hq, Dk] itself, in place (the forward without gradients:
no folded copy beside the selected op's partials).
"""

# No `from __future__ import annotations` here: torch.library reads the ops' annotations.
import math

import torch
from torch import Tensor
from torch.library import triton_op

from nsa_flex.folded import fold, group_strides, unfold
from nsa_flex.ops.capped_launch import TmaView, launch
from nsa_flex.ops.triton_utils import HAS_TRITON, dense, quiet_without_triton
from nsa_flex.ops.window import gluon_kernels, kernels, twin
from nsa_flex.validate import check_4d

if HAS_TRITON:
    from torch.library import wrap_triton

_IMPLS = ("auto", "triton", "torch")
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 128)


def kernels_apply(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether impl="auto" runs the kernels for these inputs: CUDA, 16-bit, Dk and Dv in HEAD_DIMS."""
    return (q.is_cuda and HAS_TRITON and q.dtype in KERNEL_DTYPES and q.shape[-1] in HEAD_DIMS
            and v.shape[-1] in HEAD_DIMS)


def window_attention(q: Tensor, k: Tensor, v: Tensor, group: int, window: int, *, scale: float | None = None,
                     impl: str = "auto", folded: bool = True) -> Tensor:
    """o [B, Hkv, T*G, Dv] folded, in q's dtype; differentiable in q, k, v.

    q [B, Hkv, R, Dk]: folded queries (nsa_flex.folded; R >= T*G rows, those past T*G ignored and
    their gradient zero), read in place; with folded=False q [B, T, Hq, Dk] itself, read in place
    (no folded copy; its gradient in that layout). k [B, T, Hkv, Dk], v [B, T, Hkv, Dv], one
    dtype. group: G, query heads per kv head. window: W >= 1 keys, the query's own included. impl:
    "auto" (the kernels where kernels_apply, else the twin), "triton" (the kernels on any device:
    CPU only under TRITON_INTERPRET=1) or "torch" (the twin).
    """
    _check_inputs(q, k, v, group, window, impl, folded)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    o, _, _, _ = torch.ops.nsa_flex.window_attention(q, k, v, group, window, scale, impl, 0, folded)
    return o


def window_and_local(q: Tensor, k: Tensor, v: Tensor, group: int, window: int, sel_block: int, *,
                     scale: float | None = None, impl: str = "auto",
                     folded: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """(o, o_loc, lse_loc): window_attention's o, and the selected branch's partial over each
    token's two local selection blocks (its own, causally, and the one before), which the window
    holds whole: o_loc [B, Hkv, T*G, Dv] normalised, lse_loc [B, Hkv, T*G] fp32 base 2, no
    gradient. The kernels take those blocks first in a tile's walk, so the partial costs its
    store only; nsa_flex::selected_attention merges it in place of those two slots.
    Needs local_fits(window, sel_block, Dk, Dv); arguments otherwise as window_attention.
    """
    _check_inputs(q, k, v, group, window, impl, folded)
    if isinstance(sel_block, bool) or not isinstance(sel_block, int) or sel_block < 1:
        raise ValueError(f"sel_block={sel_block!r}: tokens per selection block, an int >= 1")
    if not local_fits(window, sel_block, q.shape[-1], v.shape[-1]):
        bn = launch_config(q.shape[-1], v.shape[-1])["fwd_BN"]
        raise ValueError(f"window_and_local: window {window} and sel_block {sel_block} do not fit: the local "
                         f"partial needs sel_block a multiple of the kernels' {bn}-key blocks and window >= "
                         "2 * sel_block (see local_fits)")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    o, _, o_loc, lse_loc = torch.ops.nsa_flex.window_attention(q, k, v, group, window, scale, impl, sel_block, folded)
    return o, o_loc, lse_loc


def local_fits(window: int, sel_block: int, Dk: int = 64, Dv: int = 64) -> bool:
    """Whether the local blocks' partial fits the kernels' tiles (launch_config(Dk, Dv)'s, the ones
    the forward launches with): the key blocks tile l' (the local walk starts on a selection
    block's first key) and the window holds both local blocks of every token (W >= 2 l'). Any
    group: a tile whose tokens cross a block's end walks the keys its later rows skipped in a loop
    more (tiles_cross)."""
    return sel_block >= 1 and sel_block % launch_config(Dk, Dv)["fwd_BN"] == 0 and window >= 2 * sel_block


def tiles_cross(group: int, sel_block: int, rows: int) -> bool:
    """Whether a tile of `rows` folded rows may hold tokens of two selection blocks: unless G is a
    power of two whose tiles tile a block (l' a multiple of rows / G)."""
    return not (group & (group - 1) == 0 and group <= rows and sel_block % (rows // group) == 0)


def launch_config(Dk: int, Dv: int) -> dict[str, int]:
    """Row tiles (BM), key blocks (BN), warps and stages of the three kernels, for 16-bit head dims.

    64-row tiles with 4 warps everywhere (H100, bf16, W=512; docs/decisions.md, "The window
    branch"): at T=64k, Hq=16, Hkv=4, D=128 the forward took 0.94 ms against 1.09 with 128-row
    tiles and 8 warps, the backward 2.79 against 4.32 (the dK/dV kernel at 4 warps holds two
    programs per SM, 255 registers with 124 bytes of spills, against one at 8 warps).

    With both head dims 64 (seeds-125m's heads) the forward and dQ kernels take 32-key blocks
    three stages deep and the dK/dV kernel one stage: at T=64k, Hq=12, Hkv=3 the three kernels
    took 0.46 / 0.45 / 0.69 ms against 0.47 / 0.56 / 0.80 with the D=128 settings, at 8k x 4
    0.22 / 0.23 / 0.35 against 0.24 / 0.28 / 0.41. At D=128 those settings were slower.

    kv_gluon: where gluon_kernels.applies (Hopper, D of 64 or 128), the dK/dV kernel in Gluon
    (gluon_kernels.py; 64-key blocks, kv_gluon_BM rows a tile with one warp per 16): at T=64k, G=4
    in the compiled op 1.76 ms against 2.19, at G=16 7.14 against 9.58, with 128-row tiles (8
    warps, one program per SM; 64-row tiles spill there and took the backward from 2.9 to 3.6 ms).
    At D = 64 with 64-row tiles (4 warps, two programs per SM) the node's backward (dQ + dK/dV) at
    T=64k, Hq=12, Hkv=3 took 1.23-1.25 ms against 1.37-1.38 with the Triton kernel and 1.36-1.39
    with 128-row tiles (H100). 0 keeps the Triton kernel. dq_gluon stays 0 at D = 64: 1.45 ms.

    fwd_gluon: where gluon_kernels.forward_applies, the forward in Gluon, warp-specialised with
    TMA loads (its own 64-row tiles and 64-key blocks; docs/decisions.md, "The window branch").
    dq_gluon: in the gated node's backward where gluon_kernels.applies, the dQ kernel in the
    forward's form (gluon_kernels._window_dq_gluon_kernel): in the compiled op 0.97 against 1.09 ms at
    T=64k, G=4 and 3.53 against 4.42 at G=16 (H100).
    """
    if max(Dk, Dv) <= 64:
        return {"fwd_BM": 64, "fwd_BN": 32, "fwd_warps": 4, "fwd_stages": 3, "fwd_gluon": 0,
                "dq_BM": 64, "dq_BN": 32, "dq_warps": 4, "dq_stages": 3, "dq_gluon": 0,
                "kv_BM": 64, "kv_BN": 64, "kv_warps": 4, "kv_stages": 1, "kv_gluon": 1, "kv_gluon_BM": 64}
    return {"fwd_BM": 64, "fwd_BN": 64, "fwd_warps": 4, "fwd_stages": 2, "fwd_gluon": 1,
            "dq_BM": 64, "dq_BN": 64, "dq_warps": 4, "dq_stages": 2, "dq_gluon": 1,
            "kv_BM": 64, "kv_BN": 64, "kv_warps": 4, "kv_stages": 2, "kv_gluon": 1, "kv_gluon_BM": 128}


def _runs_kernels(q: Tensor, k: Tensor, v: Tensor, impl: str) -> bool:
    return impl == "triton" or (impl == "auto" and kernels_apply(q, k, v))


def _forward_impl(q: Tensor, k: Tensor, v: Tensor, group: int, window: int, scale: float, impl: str,
                  local_block: int, folded: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if not _runs_kernels(q, k, v, impl):
        return twin.forward(q if folded else fold(q, k.shape[2]), k, v, group, window, scale, local_block)
    return forward(q, k, v, group, window, scale, launch_config(q.shape[-1], v.shape[-1]), local_block,
                   folded=folded)


def forward(q: Tensor, k: Tensor, v: Tensor, group: int, window: int, scale: float, cfg: dict[str, int],
            local_block: int = 0, *, folded: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The forward kernel's launch: (o, lse base 2, o_loc, lse_loc; the last two empty unless
    local_block > 0, see window_and_local). cfg: as launch_config gives it. folded: q folded
    [B, Hkv, R >= T*G, Dk]; else q [B, T, Hq, Dk] read in place (the outputs are folded either way)."""
    q, k, v = dense(q, k, v)
    B, T, Hkv, Dk = k.shape
    R = T * group
    q_rows = _row_strides(q, group, folded)
    o = q.new_empty(B, Hkv, R, v.shape[-1])
    lse = torch.empty(B, Hkv, R, dtype=torch.float32, device=q.device)
    o_loc, lse_loc = twin.local_buffers(q, k, v, group, local_block)
    if B * R * Hkv == 0:
        return o, lse, o_loc, lse_loc
    if cfg.get("fwd_gluon") and gluon_kernels.forward_applies(q, v, group, local_block):
        # Inductor cannot launch a Gluon kernel: the opaque op does, making the TMA descriptors.
        BM, D = gluon_kernels.FWD_ROWS, Dk
        launch(gluon_kernels._window_fwd_gluon_kernel, (-(-R // BM), B * Hkv),
               q, _kv_tiles(k), _kv_tiles(v), o, lse, o_loc, lse_loc, T, R, Hkv, window, scale * math.log2(math.e),
               *q_rows, writes=(o, lse, o_loc, lse_loc), opaque=True,
               G=group, BM=BM, BN=gluon_kernels.FWD_KEYS, D=D, NB=gluon_kernels.FWD_BUFFERS, LOCAL=local_block,
               num_warps=4, maxnreg=gluon_kernels.FWD_MAXNREG)
        return o, lse, o_loc, lse_loc
    BM = cfg["fwd_BM"]
    wrap_triton(kernels._fwd_kernel)[(-(-R // BM), B * Hkv)](
        q, k, v, o, lse, o_loc, lse_loc, T, R, Hkv, window, scale * math.log2(math.e), *q_rows,
        *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], G=group, BM=BM, BN=cfg["fwd_BN"], DK=Dk, DV=v.shape[-1],
        LOCAL=local_block, CROSS=bool(local_block) and tiles_cross(group, local_block, BM), F32_DOT=not q.is_cuda,
        num_warps=cfg["fwd_warps"], num_stages=cfg["fwd_stages"])
    return o, lse, o_loc, lse_loc


def _row_strides(x: Tensor, group: int, folded: bool) -> tuple[int, int, int, int]:
    """(batch, kv head, token, group member) strides of the kernels' folded row index into x:
    folded [B, Hkv, R, D] or x [B, T, Hq, D] (nsa_flex.folded.group_strides)."""
    s_b, s_t, s_h, s_g = group_strides(x, group, folded)
    return s_b, s_h, s_t, s_g


def _kv_tiles(x: Tensor) -> TmaView:
    """k or v [B, T, Hkv, D] (contiguous) as the Gluon kernels' TMA loads read it: [B*T, Hkv*D] in
    tiles of FWD_KEYS keys of one kv head."""
    B, T, Hkv, D = x.shape
    return TmaView(x, (B * T, Hkv * D), (Hkv * D, 1), (gluon_kernels.FWD_KEYS, D))


def _backward_impl(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, group: int, window: int,
                   scale: float, impl: str, folded: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    if not _runs_kernels(q, k, v, impl):
        dq, dk, dv = twin.backward(do, q if folded else fold(q, k.shape[2]), k, v, group, window, scale)
        return (dq if folded else unfold(dq, k.shape[1]).contiguous()), dk, dv
    return backward(do, q, k, v, o, lse, group, window, scale, launch_config(q.shape[-1], v.shape[-1]),
                    folded=folded)


def backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, group: int, window: int,
             scale: float, cfg: dict[str, int], *, gate: Tensor | None = None, delta: Tensor | None = None,
             sel: tuple | None = None, add: tuple | None = None, folded: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """The backward kernels' launches: dQ (and delta), then dK / dV. cfg: as launch_config gives it.
    folded: as forward's; dQ comes in q's layout.

    do: the window output's gradient, folded like o. With gate (the window's gate per row, fp32
    [B, Hkv, R] like lse) instead: do is the gated sum's output gradient [B, T, Hq, Dv] (the
    window's is gate * dO, never written; P' = g P in the kernels) and delta [B, Hkv, R] fp32 =
    rowsum(dO * o) comes given. sel (with gate): (lse_sel, delta_sel, gate_sel [B, Hq, T] fp32,
    lse in natural log, delta_sel = rowsum(dO * o_sel), l'): the kernels also add the selected
    branch's gradient over each row's two local blocks, whose keys they score anyway (W >= 2 l',
    l' a multiple of the dQ kernel's key blocks). add: None, or (parts, head) with another gradient
    of q's rows, which dQ takes before its one rounding: the grouped compressed call's dQ
    (compressed_groups.grouped_backward's dq_parts: (first (b, kv head), X [n, dG, Tc, Dk]), folded
    row head + s * dG + j of that (b, kv head) + i being X[i, j, s]); so that dQ is never alive
    beside the later branches' buffers."""
    if cfg.get("kv_gluon") and cfg["kv_gluon_BM"] not in gluon_kernels.DKDV_ROWS:
        raise ValueError(f"window backward: kv_gluon_BM={cfg['kv_gluon_BM']!r}; the Gluon dK/dV kernel's tiles "
                         f"take {' or '.join(map(str, gluon_kernels.DKDV_ROWS))} rows")
    q, k, v = dense(q, k, v)
    B, T, Hkv, Dk = k.shape
    Dv = v.shape[-1]
    R = T * group
    # dQ in q's layout (the kernels write it by q's strides); a folded q's rows past T*G too (zeros
    # there: no key, no output gradient).
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    q_rows = _row_strides(q, group, folded)
    RQ = q.shape[2] if folded else R
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    if B * Hkv * RQ == 0:
        return dq, dk, dv
    gated = gate is not None
    if gated:
        if delta is None:
            raise ValueError("backward: a gate needs delta [B, Hkv, R] = rowsum(dO * o)")
        do, gate, delta = dense(do, gate, delta)
        # do [B, T, Hq, Dv]: row t * G + g of kv head h is query head h * G + g at token t.
        do_rows = (do.stride(0), group * do.stride(2), do.stride(1), do.stride(2))
    else:
        do, = dense(do)
        delta = torch.empty(B, Hkv, R, dtype=torch.float32, device=q.device)
        do_rows = (do.stride(0), do.stride(1), group * do.stride(2), do.stride(2))
    sel_block = 0
    if sel is None:
        # Never read (SEL = 0): tensors the kernels read anyway stand in.
        sel_args, sel_strides = (lse, lse, lse), (0, 0, 0)
    else:
        lse_sel, delta_sel, gate_sel, sel_block = sel
        if not gated or sel_block < 1 or sel_block % cfg["dq_BN"] or window < 2 * sel_block:
            raise ValueError(f"backward: sel needs a gate, and l' = {sel_block} a multiple of the dQ kernel's "
                             f"{cfg['dq_BN']}-key blocks with window {window} >= 2 l'")
        lse_sel, delta_sel, gate_sel = dense(lse_sel, delta_sel, gate_sel)
        sel_args, sel_strides = (lse_sel, delta_sel, gate_sel), lse_sel.stride()
    gate_arg = gate if gated else lse
    scale2 = scale * math.log2(math.e)
    common = (T, R, Hkv, window, scale, scale2, *q_rows, *k.stride()[:3], *v.stride()[:3],
              *o.stride()[:3], *do_rows, *sel_strides)
    gluon_dq = gated and T > 0 and cfg.get("dq_gluon") and gluon_kernels.applies(q, v, group)
    for bh0, n_bh, x, x_args in _dq_launches(add, B * Hkv, lse):
        if gluon_dq:
            # The gated node's dQ in the Gluon forward's form (the opaque op makes the descriptors).
            BM = gluon_kernels.FWD_ROWS
            launch(gluon_kernels._window_dq_gluon_kernel, (-(-RQ // BM), n_bh), _kv_tiles(k), _kv_tiles(v), q, do,
                   dq, lse, delta, gate, *sel_args, x, RQ, T, R, Hkv, window, scale, scale2, bh0, *x_args[:3],
                   *q_rows, *do_rows, *sel_strides, *x_args[3:], writes=(dq,), opaque=True, G=group, BM=BM,
                   BN=gluon_kernels.FWD_KEYS, D=Dk, NB=gluon_kernels.FWD_BUFFERS, SEL=sel_block, ADD=add is not None,
                   num_warps=4, maxnreg=gluon_kernels.FWD_MAXNREG)
        else:
            BM = cfg["dq_BM"]
            wrap_triton(kernels._dq_kernel)[(-(-RQ // BM), n_bh)](
                q, k, v, o, do, lse, dq, delta, gate_arg, *sel_args, x, RQ, *common[:6], bh0, *x_args[:3],
                *common[6:], *x_args[3:], G=group, BM=BM, BN=cfg["dq_BN"], DK=Dk, DV=Dv, GATED=gated, SEL=sel_block,
                F32_DOT=not q.is_cuda, ADD=add is not None, num_warps=cfg["dq_warps"], num_stages=cfg["dq_stages"])
    if T == 0:
        return dq, dk, dv
    kv_args = (q, k, v, do, lse, delta, dk, dv, gate_arg, *sel_args, *common)
    if cfg.get("kv_gluon") and gluon_kernels.applies(q, v, group):
        # Inductor cannot launch a Gluon kernel: the opaque op does.
        BN, BM = gluon_kernels.DKDV_KEYS, cfg["kv_gluon_BM"]
        launch(gluon_kernels._window_dkdv_gluon_kernel, (-(-T // BN), B * Hkv), *kv_args, writes=(dk, dv), opaque=True,
               G=group, BM=BM, BN=BN, DK=Dk, DV=Dv, GATED=gated, SEL=sel_block, F32_DOT=False, num_warps=BM // 16)
    else:
        BN = cfg["kv_BN"]
        wrap_triton(kernels._dkdv_kernel)[(-(-T // BN), B * Hkv)](
            *kv_args, G=group, BM=cfg["kv_BM"], BN=BN, DK=Dk, DV=Dv, GATED=gated, SEL=sel_block,
            F32_DOT=not q.is_cuda, num_warps=cfg["kv_warps"], num_stages=cfg["kv_stages"])
    return dq, dk, dv


def _dq_launches(add: tuple | None, BH: int, stand_in: Tensor):
    """(first (b, kv head), count, X, (head, dG, rows, 3 strides of X)) of each dQ launch: one over
    all BH without add (X unread: stand_in takes its place), else one per part of add (backward)."""
    if add is None:
        return [(0, BH, stand_in, (0, 1, 0, 0, 0, 0))]
    parts, head = add
    launches = []
    for bh0, x in parts:
        n, dG, Tc = x.shape[:3]
        launches.append((bh0, n, x, (head, dG, dG * Tc, x.stride(0), x.stride(1), x.stride(2))))
    if sum(n for _, n, _, _ in launches) != BH:
        raise ValueError(f"backward: add's parts cover {sum(n for _, n, _, _ in launches)} (b, kv head) rows of {BH}")
    return launches


with quiet_without_triton():
    _forward_op = triton_op("nsa_flex::window_attention", mutates_args=())(_forward_impl)
    _backward_op = triton_op("nsa_flex::window_attention_backward", mutates_args=())(_backward_impl)


@_forward_op.register_fake
def _forward_fake(q, k, v, group, window, scale, impl, local_block, folded=True):
    B, T, Hkv, _ = k.shape
    return (q.new_empty(B, Hkv, T * group, v.shape[-1]), q.new_empty(B, Hkv, T * group, dtype=torch.float32),
            *twin.local_buffers(q, k, v, group, local_block))


@_backward_op.register_fake
def _backward_fake(do, q, k, v, o, lse, group, window, scale, impl, folded=True):
    return (torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(k), torch.empty_like(v))


def _setup_context(ctx, inputs, output):
    q, k, v, group, window, scale, impl, _, folded = inputs
    o, lse, o_loc, lse_loc = output
    ctx.mark_non_differentiable(lse, o_loc, lse_loc)
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.args = (group, window, scale, impl, folded)


def _backward(ctx, do, _dlse, _do_loc, _dlse_loc):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.nsa_flex.window_attention_backward(do, q, k, v, o, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _check_inputs(q, k, v, group, window, impl, folded: bool = True) -> None:
    """Shape, dtype and device checks; every error says what was wrong and what is allowed.
    folded: q [B, Hkv, R >= T*G, Dk] folded, else [B, T, Hq, Dk] (the launches' folded=False)."""
    if impl not in _IMPLS:
        raise ValueError(f"impl={impl!r}; allowed: {', '.join(_IMPLS)}")
    check_4d({"q": (q, "[B, Hkv, R >= T*G, Dk] (folded)" if folded else "[B, T, Hq, Dk]"),
              "k": (k, "[B, T, Hkv, Dk]"), "v": (v, "[B, T, Hkv, Dv]")}, "q")
    B, T, Hkv, Dk = k.shape
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"group={group!r}: query heads per kv head, an int >= 1")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window={window!r}: keys per query, an int >= 1")
    if folded and (q.shape[:2] != (B, Hkv) or q.shape[2] < T * group or q.shape[3] != Dk):
        raise ValueError(f"folded q {tuple(q.shape)} does not fit k {tuple(k.shape)} and group {group}: "
                         f"expected [{B}, {Hkv}, >= {T * group}, {Dk}]")
    if not folded and q.shape != (B, T, Hkv * group, Dk):
        raise ValueError(f"q {tuple(q.shape)} does not fit k {tuple(k.shape)} and group {group}: "
                         f"expected [{B}, {T}, {Hkv * group}, {Dk}]")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v {tuple(v.shape)} does not fit k {tuple(k.shape)}: expected [{B}, {T}, {Hkv}, Dv]")
    if impl == "triton":
        allowed = KERNEL_DTYPES + ((torch.float32,) if not q.is_cuda else ())
        if q.dtype not in allowed or q.shape[-1] not in HEAD_DIMS or v.shape[-1] not in HEAD_DIMS:
            raise ValueError(f"impl='triton' runs {', '.join(map(str, allowed))} with Dk, Dv in {HEAD_DIMS}; got "
                             f"{q.dtype}, Dk={q.shape[-1]}, Dv={v.shape[-1]}")
    allowed = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
    if q.dtype not in allowed or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}; they must match, one of "
                        f"{', '.join(map(str, allowed))}")
