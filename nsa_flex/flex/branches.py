"""NSA through FlexAttention: nsa_attention(..., impl="flex").

compressed call (with lse: one causal cuDNN call over token groups where it applies, see
compressed_groups, else a Flex call) -> selection op -> window -> selected branch -> gated sum.
The window is the op nsa_flex::window_attention where it applies (see window_impl), else a Flex
call; the op also gives the selected branch its partial over each token's two local blocks. The
selected branch is the block-centric op nsa_flex::selected_attention or a Flex call over folded
tiles, whichever FlexTiles.selected_impl picks for the group size and length (with the Flex
call the window comes after it and reads its keys). Without gradients the block-centric path
runs the gated sum inside the selected op's merge (nsa_flex_no_grad). The
Flex calls use the folded GQA layout, q [B, T, Hq, D] -> [B, Hkv, T*G, D] (row t*G + g = query
head h*G + g at token t), so none goes through FlexAttention's enable_gqa path: on torch 2.11
that path gave wrong dK/dV for the window branch in several configurations, while the folded
selected branch was right in all (docs/records/flex_enable_gqa_tests_h200.txt). Every step is
traceable, so the whole op compiles with `torch.compile(nsa_flex, fullgraph=True)`. The gated sum
(nsa_flex::gated_sum) reads each branch's output in the layout its call leaves.

On CUDA each branch's flex call is a small function compiled once at module level
(inside an outer compile Dynamo inlines it). On CPU flex runs eagerly (dense, for
correctness, no backward: FlexAttention has none there) and the compressed branch's lse,
which compiled CPU flex cannot return, comes from a small dense torch computation.

Process-global: the first eager CUDA call installs `nsa_flex.flex.tuning.install_flex_tuning()`;
call it yourself before compiling code that uses nsa_flex.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn.attention.flex_attention import AuxRequest, create_mask, flex_attention

from nsa_flex.flex import compressed_groups, tuning
from nsa_flex.compression import compressed_seqlens
from nsa_flex.config import NSAConfig
from nsa_flex.flex.masks import compressed_block_mask, selection_block_mask, window_block_mask
from nsa_flex.flex.masks.documents import Documents, documents
from nsa_flex.flex.masks.selection import InitialCopies, initial_copies
from nsa_flex.ops import select_blocks
from nsa_flex.ops.selected_attention import selected_attention, selected_gated_sum
from nsa_flex.ops.selected_attention import _gated_with_window_local, _with_window_local
from nsa_flex.flex.blockmask import query_chunks
from nsa_flex.flex.tuning import FlexTiles
from nsa_flex.folded import FoldedRows, unfold
from nsa_flex.validate import needs_grad
from nsa_flex.ops.fold import fold as fold_op
from nsa_flex.ops.gated_sum import gated_sum as gated_sum_op
from nsa_flex.ops import window as window_op
from nsa_flex.ops.gated_branches import gated_branches


# One function per Flex call, each compiled once here: separate code objects give each its
# own Dynamo recompile budget (8 shapes) instead of one shared by all.
def _flex_cmp(q, k, v, block_mask, scale, kernel_options):
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, return_aux=AuxRequest(lse=True),
                          kernel_options=kernel_options)


def _flex_sel(q, k, v, block_mask, scale, kernel_options):
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, kernel_options=kernel_options)


def _flex_win(q, k, v, block_mask, scale, kernel_options):
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, kernel_options=kernel_options)


_COMPILED = {fn: torch.compile(fn, dynamic=False) for fn in (_flex_cmp, _flex_sel, _flex_win)}
_WITH_LSE = (_flex_cmp,)


def _call(fn, q, k, v, block_mask, scale, branch: str):
    """A Flex call: compiled with its tiles on CUDA, eager (dense, exact) on CPU.

    Returns o, or (o, lse [B, H, rows] float32) for the calls that need the lse. On CPU the lse
    comes from a small dense computation: compiled CPU flex cannot return it.
    """
    if q.is_cuda:
        opts = tuning.branch_kernel_options(branch, q.shape[-1], q.dtype, q_block=block_mask.BLOCK_SIZE[0],
                                            kv_block=block_mask.BLOCK_SIZE[1])
        out = _COMPILED[fn](q, k, v, block_mask, scale, opts)
        return (out[0], out[1].lse) if fn in _WITH_LSE else out
    o = _flex_sel(q, k, v, block_mask, scale, None)
    return (o, _dense_lse(q, k, block_mask, scale)) if fn in _WITH_LSE else o


_SHAPE_MASKS: dict = {}
_SHAPE_MASKS_MAX = 32


def shape_mask(build, *args, docs: Documents | None = None, **kwargs):
    """build(*args, **kwargs) once per argument set in eager mode, for masks that depend on shapes only.

    The compressed, window and initial-block masks are the same on every call of one shape: at
    T=8k they are ~half of the eager op's ~450 small kernels, and at 64k ~2 ms of GPU time per
    call. Under torch.compile they are built in the graph (fused; a cached tensor there would
    become a constant guarded by identity). Masks of packed documents depend on data: with
    docs, build(*args, docs=docs, **kwargs) runs every time. Oldest entries go first past _SHAPE_MASKS_MAX. Masks made
    under inference_mode are kept apart (autograd may not save inference tensors), and none is
    cached while a CUDA graph is being captured.
    """
    if docs is not None:
        return build(*args, docs=docs, **kwargs)
    if torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return build(*args, **kwargs)
    key = (build, args, tuple(sorted(kwargs.items())), torch.is_inference_mode_enabled())
    mask = _SHAPE_MASKS.get(key)
    if mask is None:
        if len(_SHAPE_MASKS) >= _SHAPE_MASKS_MAX:
            _SHAPE_MASKS.pop(next(iter(_SHAPE_MASKS)))
        mask = _SHAPE_MASKS[key] = build(*args, **kwargs)
    return mask


def nsa_flex(q, k, v, k_cmp, v_cmp, gates, config: NSAConfig, *, block_indices=None, cu_seqlens=None,
             k_win=None, v_win=None, tiles: FlexTiles = FlexTiles()):
    """NSA with FlexAttention. Shapes as nsa_attention: q [B,T,Hq,Dk], k [B,T,Hkv,Dk], v [B,T,Hkv,Dv],
    k_cmp/v_cmp [B,Tc,Hkv,*], gates [B,T,Hq,3] (cmp, sel, win).

    Returns (o [B,T,Hq,Dv], block_indices [B,Hkv,T,n]): the selection used, from the
    selection op unless given. cu_seqlens [n_docs+1] (B == 1): packed documents, every
    branch and the selection stay inside a document, block ids are document-local.
    tiles: BlockMask block sizes and layout choices (speed knobs, see FlexTiles).

    Where no input needs a gradient and the selected branch is the block-centric op, the gated sum
    runs inside that op (nsa_flex_no_grad): the same values, fewer bytes. With gradients, where the
    window op runs and the selection lists both local blocks (tiles.gated_node), the window and
    selected branches and the gated sum are one node (ops.gated_branches).
    """
    _check_device(q, k, v, k_cmp, v_cmp, gates, k_win, v_win)
    T, G = q.shape[1], q.shape[2] // k.shape[2]
    if not needs_grad(q, k, v, k_cmp, v_cmp, gates, k_win, v_win) and tiles.selected_impl(T, G) == "block":
        return nsa_flex_no_grad(q, k, v, k_cmp, v_cmp, gates, config, block_indices=block_indices,
                                cu_seqlens=cu_seqlens, k_win=k_win, v_win=v_win, tiles=tiles)
    o_cmp, o_sel, o_win, block_indices, gated = _branches(
        q, k, v, k_cmp, v_cmp, config, gates=gates, block_indices=block_indices, cu_seqlens=cu_seqlens,
        k_win=k_win, v_win=v_win, tiles=tiles)
    return (gated_sum(o_cmp, o_sel, o_win, gates) if gated is None else gated.o), block_indices


def nsa_flex_no_grad(q, k, v, k_cmp, v_cmp, gates, config: NSAConfig, *, block_indices=None, cu_seqlens=None,
                     k_win=None, v_win=None, tiles: FlexTiles = FlexTiles()):
    """nsa_flex for inputs that need no gradient, with the block-centric selected op: (o, block_indices).

    The gated sum is the selected op's epilogue (nsa_flex::selected_gated_sum): o_sel is merged
    in registers and summed with the other two branches there, never written and read back. So
    the window call comes before the selected op, and its output lives while the selected op's
    partials do (no backward keeps it): ~270 MiB more forward peak at 64k, G=4, for ~0.2 ms
    (docs/decisions.md, "The forward without gradients").

    The window op (where it runs) and the selected op read q [B, T, Hq, Dk] in place: the folded
    copy lives only for the compressed call (and a Flex window call), not beside the selected op's
    partials (256 MiB at G=4, 64k).
    """
    _check_device(q, k, v, k_cmp, v_cmp, gates, k_win, v_win)
    qs = _queries(q, k, k_cmp, v_cmp, config, cu_seqlens, tiles)
    scale = qs.scale
    forced_local = forces_local(block_indices, config, tiles)
    o_cmp, block_indices, _ = _compressed_and_selection(q, qs, k_cmp, v_cmp, config, cu_seqlens, tiles,
                                                        block_indices)
    k_win, v_win = (k, v) if k_win is None else (k_win, v_win)
    o_win, local = window_and_local_branch(qs.fold, k_win, v_win, config, scale, tiles, qs.docs, qs.room,
                                           with_local=k_win is k and forced_local, q=q)
    del qs  # the folded copy, eagerly too
    if local is None:
        o = selected_gated_sum(q, k, v, block_indices, config, o_cmp.x, o_cmp.head, o_win, gates,
                               scale=scale, cu_seqlens=cu_seqlens)
    else:
        o = _gated_with_window_local(q, k, v, block_indices, config, o_cmp.x, o_cmp.head, o_win, gates,
                                     local, scale=scale)
    return o, block_indices


class _Queries(NamedTuple):
    """The folded queries every call reads, and what the branches share."""

    fold: torch.Tensor  # [B, Hkv, T*G, Dk]
    room: torch.Tensor | None  # fold plus the rows the grouped compressed call reads past it, or None
    scale: float
    docs: Documents | None
    cu_cmp: torch.Tensor | None

    @property
    def buffer(self) -> torch.Tensor:
        """The folded buffer itself (room when the grouped call made one): the selected op reads q there."""
        return self.fold if self.room is None else self.room


def _queries(q, k, k_cmp, v_cmp, config: NSAConfig, cu_seqlens, tiles: FlexTiles) -> _Queries:
    T, Hkv = q.shape[1], k.shape[2]
    docs = cu_cmp = None
    if cu_seqlens is not None:
        cu_cmp = compressed_seqlens(cu_seqlens, config)
        docs = documents(cu_seqlens, cu_cmp, T, k_cmp.shape[1])
    q_room = None
    if k_cmp.shape[1] > 0 and compressed_impl(q, k_cmp, v_cmp, tiles, docs) != "flex":
        # The grouped compressed call reads a few rows past the folded queries: one tensor holds both.
        G = q.shape[2] // Hkv
        q_room = fold_op(q, Hkv, rows=compressed_groups.grouped_rows(T * G, config, k_cmp.shape[1]))
        q_fold = q_room[:, :, :T * G]
    else:
        q_fold = fold_op(q, Hkv)
    return _Queries(q_fold, q_room, q.shape[-1] ** -0.5, docs, cu_cmp)


def _compressed_and_selection(q, qs: _Queries, k_cmp, v_cmp, config: NSAConfig, cu_seqlens, tiles: FlexTiles,
                              block_indices, node: bool = False):
    """(o_cmp: FoldedRows, block_indices, grouped): the compressed call, then the selection op unless
    given. node: the gated node will take the call; where it is the grouped one, it is made without
    a gradient of its own and grouped (compressed_groups.Grouped) is what the node's backward takes
    (ops.gated_branches); else grouped is None."""
    grouped = None
    impl = compressed_impl(qs.fold, k_cmp, v_cmp, tiles, qs.docs) if node and k_cmp.shape[1] > 0 else "flex"
    if impl != "flex":
        o_cmp, lse_cmp, grouped = compressed_groups.compressed_grouped_detached(
            qs.fold, k_cmp, v_cmp, config, qs.scale, impl == "cudnn", q_room=qs.room)
    else:
        o_cmp, lse_cmp = compressed_branch(qs.fold, k_cmp, v_cmp, config, qs.scale, tiles, qs.docs, q_room=qs.room)
    if block_indices is None:
        block_indices = select_blocks(q, k_cmp, lse_cmp, config, scale=qs.scale, cu_seqlens=cu_seqlens,
                                      cu_seqlens_cmp=qs.cu_cmp)
    return o_cmp, block_indices, grouped


class GatedSum(NamedTuple):
    """The gated sum as one node made it (ops.gated_branches), and the nsa_flex::gated_sum impl
    ("triton" or "torch") that made it, for a caller that makes it again in its backward."""

    o: torch.Tensor
    impl: str


def nsa_flex_branches(q, k, v, k_cmp, v_cmp, config: NSAConfig, *, gates=None, block_indices=None, cu_seqlens=None,
                      k_win=None, v_win=None, tiles: FlexTiles = FlexTiles()):
    """(o_cmp, o_sel, o_win, block_indices, gated): the three branch outputs before the gates,
    o_cmp as FoldedRows (folded rows held from its first complete block on), o_win folded
    [B, Hkv, T*G, Dv], o_sel [B, T, Hq, Dv]; with gates, where the window and selected branches
    and the gated sum run as one node, gated (a GatedSum) is its sum, differentiable, and o_sel
    (folded there, as o_win: gated_sum(..., sel_folded=True) reads it) and o_win are the node's
    own (no gradient flows through them), o_cmp too where the compressed
    branch is the grouped call (the node runs its backward); else gated is None.

    For NSAAttention, which makes the gated sum again in the backward instead of keeping it (see
    NSAAttention._attend_flex). Arguments as nsa_flex. Each o_sel is the one its op keeps for its own
    backward: a copy in another layout, kept for the gated sum's backward, would be a second
    [T, Hq, Dv] per layer.
    """
    _check_device(q, k, v, k_cmp, v_cmp, gates, k_win, v_win)
    return _branches(q, k, v, k_cmp, v_cmp, config, gates=gates, block_indices=block_indices, cu_seqlens=cu_seqlens,
                     k_win=k_win, v_win=v_win, tiles=tiles)


def _branches(q, k, v, k_cmp, v_cmp, config: NSAConfig, *, gates=None, block_indices=None, cu_seqlens=None,
              k_win=None, v_win=None, tiles: FlexTiles = FlexTiles()):
    """nsa_flex_branches' (o_cmp, o_sel, o_win, block_indices, gated): with gates, where the window
    and selected branches share their local blocks (_gated_node), gated is the GatedSum of one
    node; else None."""
    T, Hkv = q.shape[1], k.shape[2]
    qs = _queries(q, k, k_cmp, v_cmp, config, cu_seqlens, tiles)
    q_fold, scale, docs = qs.fold, qs.scale, qs.docs
    # The op's selection always holds the forced initial blocks; a given one may not.
    forced_initial = block_indices is None
    forced_local = forces_local(block_indices, config, tiles)
    G = q.shape[2] // Hkv
    block = tiles.selected_impl(T, G) == "block"
    if block:
        k_win, v_win = (k, v) if k_win is None else (k_win, v_win)
    node = block and gates is not None and _gated_node(qs, k_win, v_win, config, tiles,
                                                       with_local=k_win is k and forced_local)
    o_cmp, block_indices, grouped = _compressed_and_selection(q, qs, k_cmp, v_cmp, config, cu_seqlens, tiles,
                                                              block_indices, node)
    if block:
        if node:
            # The window op's impl ("triton" or "torch") is the node's, its gated sum's too. The node
            # reads q itself: the folded copy lives only for the grouped call's forward.
            impl = window_impl(q_fold, k, v, tiles, docs)
            o, o_sel, o_win = gated_branches(q, k, v, block_indices, config, o_cmp.x, o_cmp.head, gates,
                                             scale=scale, impl=impl, return_branches=True, grouped=grouped,
                                             partial_bytes=tiles.sel_partial_bytes or 0)
            return o_cmp, o_sel, o_win, block_indices, GatedSum(o, impl)
        # The window first: its op hands the selected op the partial over the local blocks.
        o_win, local = window_and_local_branch(q_fold, k_win, v_win, config, scale, tiles, docs, qs.room,
                                               with_local=k_win is k and forced_local)
        # The op reads q in place from the folded copy the other calls keep: one saved copy of q.
        if local is None:
            o_sel = selected_attention(qs.buffer, k, v, block_indices, config, scale=scale, cu_seqlens=cu_seqlens,
                                       folded=True)
        else:
            o_sel = _with_window_local(qs.buffer, k, v, block_indices, config, local, scale=scale, folded=True)
        return o_cmp, o_sel, o_win, block_indices, None
    keys = selected_keys(k, v, G, config, tiles, docs, forced_initial)
    o_sel = unfold(selected_branch(q_fold, k, v, block_indices, config, scale, tiles, docs, forced_initial,
                                   keys=keys), T)
    if k_win is None:
        # The window reads the same keys through a view of the selected branch's tensors: with
        # initial-block copies those are new tensors, and one saved copy of K/V beats two.
        k_win, v_win = keys.k[:, :, :T].transpose(1, 2), keys.v[:, :, :T].transpose(1, 2)
    o_win = window_branch(q_fold, k_win, v_win, config, scale, tiles, docs, q_room=qs.room)
    return o_cmp, o_sel, o_win, block_indices, None


def _gated_node(qs: _Queries, k_win, v_win, config: NSAConfig, tiles: FlexTiles, with_local: bool) -> bool:
    """Whether the window and selected branches and the gated sum run as one node
    (ops.gated_branches): tiles.gated_node, the local partial's conditions (with_local: the
    selection lists both local blocks and the window reads the selected branch's keys) and the
    window op's kernels or twin running, with tiles that fit."""
    return (tiles.gated_node and with_local and window_impl(qs.fold, k_win, v_win, tiles, qs.docs) != "flex"
            and window_op.local_fits(config.window, config.sel_block, qs.fold.shape[-1], v_win.shape[-1]))


def forces_local(block_indices, config: NSAConfig, tiles: FlexTiles) -> bool:
    """Whether the window op's partial over each token's own block and the one before may stand for
    those slots (tiles.local_partial): every token's selection lists both, as the selection op's
    own (not given) does with n_local = 2."""
    return tiles.local_partial and block_indices is None and config.n_local == 2


def gated_sum(o_cmp: FoldedRows, o_sel, o_win, gates, impl: str = "auto", sel_folded: bool = False) -> torch.Tensor:
    """g_cmp*o_cmp + g_sel*o_sel + g_win*o_win in fp32 as [B,T,Hq,Dv] in o_sel's dtype, from the
    branches' layouts as nsa_flex_branches gives them (the op nsa_flex::gated_sum: with impl
    "auto" Triton on CUDA, its torch twin elsewhere; a GatedSum's impl makes its sum again).
    sel_folded: o_sel folded [B, Hkv, T*G, Dv], as the gated node gives it."""
    return gated_sum_op(o_cmp.x, o_cmp.head, o_sel, o_win, gates, impl=impl, sel_folded=sel_folded)


def chunk_heads(x_bhrd: torch.Tensor, chunks: int) -> torch.Tensor:
    """[B, H, R, D] -> [B, H*chunks, R/chunks, D]: consecutive row chunks as heads (a view)."""
    B, H, R, D = x_bhrd.shape
    return x_bhrd.reshape(B, H * chunks, R // chunks, D)


def repeat_heads(kv_bhtd: torch.Tensor, chunks: int) -> torch.Tensor:
    """[B, H, T, D] -> [B, H*chunks, T, D]: each head's keys once per query chunk (autograd sums back)."""
    if chunks == 1:
        return kv_bhtd
    B, H, T, D = kv_bhtd.shape
    return kv_bhtd[:, :, None].expand(B, H, chunks, T, D).reshape(B, H * chunks, T, D)


def compressed_impl(q_fold, k_cmp, v_cmp, tiles: FlexTiles, docs: Documents | None = None) -> str:
    """The compressed branch's implementation: tiles.cmp_impl, or cudnn where it applies, else flex.

    q_fold: the queries, folded or not (only their device, dtype and head dim are read)."""
    needs = (f"CUDA tensors in {compressed_groups.CUDNN_DTYPES} with Dk = Dv in {compressed_groups.CUDNN_HEAD_DIMS}; "
             f"got {q_fold.device.type}, {q_fold.dtype}, Dk={q_fold.shape[-1]}, Dv={v_cmp.shape[-1]}")
    return _impl_choice("cmp_impl", tiles.cmp_impl, "cudnn", compressed_groups.cudnn_applies(q_fold, k_cmp, v_cmp),
                        docs, needs)


def _impl_choice(field: str, chosen: str | None, fast: str, applies: bool, docs: Documents | None, needs: str) -> str:
    """The implementation FlexTiles.<field> picks for a branch: `chosen`, or with None the `fast`
    one where it applies (and no packed documents), else flex. Every choice but flex runs one
    sequence per batch row; `fast` needs what `needs` says (where it does not apply)."""
    match chosen:
        case None:
            return fast if applies and docs is None else "flex"
        case _ if chosen != "flex" and docs is not None:
            raise ValueError(f"FlexTiles.{field}={chosen!r} runs one sequence per batch row; packed documents "
                             f"(cu_seqlens) take {field}='flex' or None")
        case _ if chosen == fast and not applies:
            raise ValueError(f"FlexTiles.{field}={fast!r} needs {needs}. Use {field}=None")
        case _:
            return chosen


def compressed_branch(q_fold, k_cmp, v_cmp, config: NSAConfig, scale: float, tiles: FlexTiles,
                      docs: Documents | None = None, q_room=None) -> tuple[FoldedRows, torch.Tensor]:
    """(o: FoldedRows of [B,Hkv,T*G,Dv], lse [B,Hq,T] float32, natural log, -inf where no block is complete).

    o.dense(T*G) is the branch's folded output; the grouped call leaves its zero rows unstored.

    compressed_impl picks the call. The grouped one (cudnn / torch) is plain causal attention over
    token groups (flex.compressed_groups). The Flex one takes the folded rows as up to
    tiles.max_chunks row chunks (extra heads, see ops.blockmask.query_chunks): the branch has
    few kv blocks, and its backward runs one dK/dV program per (head, kv block). q_room: see
    compressed_groups.compressed_grouped (the grouped call only).
    """
    B, Hkv, rows, _ = q_fold.shape
    Tc, Dv = k_cmp.shape[1], v_cmp.shape[-1]
    G = config.group_size
    T = rows // G
    if Tc == 0:
        # No complete compression block anywhere (T < l): the branch is exactly 0.
        return (FoldedRows(q_fold.new_zeros(B, Hkv, rows, Dv), 0),
                q_fold.new_full((B, Hkv * G, T), float("-inf"), dtype=torch.float32))
    impl = compressed_impl(q_fold, k_cmp, v_cmp, tiles, docs)
    if impl != "flex":
        attend = compressed_groups.cudnn_attention_lse if impl == "cudnn" else compressed_groups.causal_attention_lse
        return compressed_groups.compressed_grouped(q_fold, k_cmp, v_cmp, config, scale, attend, q_room)
    S = query_chunks(rows, tiles.cmp_block[0], tiles.max_chunks, tiles.min_chunk_rows)
    mask = shape_mask(compressed_block_mask, T, Tc, config, q_fold.device, tiles.cmp_block, G, docs=docs, chunks=S,
                      heads=Hkv)
    o, lse = _call(_flex_cmp, chunk_heads(q_fold, S), repeat_heads(k_cmp.transpose(1, 2), S),
                   repeat_heads(v_cmp.transpose(1, 2), S), mask, scale, "cmp")
    # [B, Hkv*S, rows/S] -> [B, Hkv, T, G] -> [B, Hq, T]
    lse = lse.float().view(B, Hkv, T, G).transpose(2, 3).reshape(B, Hkv * G, T)
    return FoldedRows(o.view(B, Hkv, rows, Dv), 0), lse


class SelectedKeys(NamedTuple):
    """The selected branch's keys and values [B, Hkv, S, D] and the initial-block copies among them.

    k[:, :, :T] are the keys themselves; with copies (S = copies.kv_len) padding and the copies follow.
    """

    k: torch.Tensor
    v: torch.Tensor
    copies: InitialCopies | None


def selected_keys(k, v, G: int, config: NSAConfig, tiles: FlexTiles, docs: Documents | None = None,
                  forced_initial: bool = False) -> SelectedKeys:
    """k, v [B, T, Hkv, D] -> SelectedKeys: with initial-block copies where tiles.split_at says so
    (single sequences whose selection holds the forced initial blocks)."""
    T = k.shape[1]
    kT, vT = k.transpose(1, 2), v.transpose(1, 2)
    copies = None
    if forced_initial and tiles.split_at(T, config) and docs is None:
        copies = initial_copies(T, G, config, tiles.sel_rows(T, config), tiles.initial_copy_tokens)
    if copies is not None:
        kT, vT = with_initial_copies(kT, copies), with_initial_copies(vT, copies)
    return SelectedKeys(kT, vT, copies)


def selected_branch(q_fold, k, v, block_indices, config: NSAConfig, scale: float, tiles: FlexTiles,
                    docs: Documents | None = None, forced_initial: bool = False, *,
                    keys: SelectedKeys | None = None):
    """o [B,Hkv,T*G,Dv] of the selected blocks, one Flex call.

    forced_initial: every token's selection holds the first n_initial blocks (true for the
    selection op's, not for any given one). Then, where tiles.split_at says so, the keys of
    those blocks, which every query visits, are appended as copies, one per span of query
    tokens (masks.selection.InitialCopies): in the backward no single program walks every
    query tile. That took 174.1 against 194.6 ms forward+backward without it at T=64k, G=16,
    and beat a separate call for those blocks merged through the lse (178.3 ms, 3.9 GiB
    more; H200, docs/records/flex_initial_copies_h200.json). keys: selected_keys of
    these arguments, when the caller already made them.
    """
    T = k.shape[1]
    G = q_fold.shape[2] // T
    if keys is None:
        keys = selected_keys(k, v, G, config, tiles, docs, forced_initial)
    mask = selection_block_mask(block_indices, T, G, config, tiles.sel_rows(T, config), docs, copies=keys.copies,
                                full_blocks=tiles.sel_full_blocks)
    return _call(_flex_sel, q_fold, keys.k, keys.v, mask, scale, "sel")


def with_initial_copies(x_bhtd: torch.Tensor, copies: InitialCopies) -> torch.Tensor:
    """[B, H, T, D] keys or values -> [B, H, copies.kv_len, D]: padded to copies.start, then the copies.

    One contiguous tensor (Flex then reads each l'-key block as one span); autograd sums the
    copies' gradients back into the initial keys.
    """
    B, H, T, D = x_bhtd.shape
    pad = x_bhtd.new_zeros(B, H, copies.start - T, D)
    return torch.cat([x_bhtd, pad, x_bhtd[:, :, :copies.keys].repeat(1, 1, copies.count, 1)], dim=2)


def window_impl(q_fold, k, v, tiles: FlexTiles, docs: Documents | None = None) -> str:
    """The window branch's implementation: tiles.win_impl, or triton where it applies, else flex."""
    needs = (f"CUDA tensors in {window_op.KERNEL_DTYPES} with Dk and Dv in {window_op.HEAD_DIMS}; got "
             f"{q_fold.device.type}, {q_fold.dtype}, Dk={q_fold.shape[-1]}, Dv={v.shape[-1]}")
    return _impl_choice("win_impl", tiles.win_impl, "triton", window_op.kernels_apply(q_fold, k, v), docs, needs)


def window_branch(q_fold, k, v, config: NSAConfig, scale: float, tiles: FlexTiles, docs: Documents | None = None,
                  q_room=None):
    """o [B,Hkv,T*G,Dv] of the sliding window (w tokens, the query included).

    window_impl picks the call: the op nsa_flex::window_attention (triton / torch) reads the
    folded rows in place from q_room when given (the buffer q_fold is the first T*G rows of), or
    a Flex call with the window BlockMask.
    """
    o, _ = window_and_local_branch(q_fold, k, v, config, scale, tiles, docs, q_room, with_local=False)
    return o


def window_and_local_branch(q_fold, k, v, config: NSAConfig, scale: float, tiles: FlexTiles,
                            docs: Documents | None = None, q_room=None, with_local: bool = True, q=None):
    """(o as window_branch gives it, local): local is the selected branch's partial over each
    token's two local blocks (ops.window.window_and_local) where with_local, the window op runs
    and its tiles fit (window_op.local_fits), else None. k, v: the selected branch's keys too.
    q: q [B, T, Hq, Dk] itself, which the window op then reads in place (folded=False) instead of
    the folded rows (the Flex call reads those)."""
    T = k.shape[1]
    G = q_fold.shape[2] // T
    impl = window_impl(q_fold, k, v, tiles, docs)
    if impl == "flex":
        mask = shape_mask(window_block_mask, T, config.window, q_fold.device, tiles.win_block, G, docs=docs)
        return _call(_flex_win, q_fold, k.transpose(1, 2), v.transpose(1, 2), mask, scale, "win"), None
    q_win = q if q is not None else q_fold if q_room is None else q_room
    folded = q is None
    if with_local and window_op.local_fits(config.window, config.sel_block, q_fold.shape[-1], v.shape[-1]):
        o, o_loc, lse_loc = window_op.window_and_local(q_win, k, v, G, config.window, config.sel_block, scale=scale,
                                                       impl=impl, folded=folded)
        return o, (o_loc, lse_loc)
    return window_op.window_attention(q_win, k, v, G, config.window, scale=scale, impl=impl, folded=folded), None


def _dense_lse(q_bhrd, k_bhtd, mask, scale: float) -> torch.Tensor:
    """CPU only: lse [B, H, rows] from the dense scores under the mask's mask_mod (small T only)."""
    dtype = torch.promote_types(q_bhrd.dtype, torch.float32)
    scores = (q_bhrd.to(dtype) @ k_bhtd.to(dtype).transpose(-1, -2)) * scale
    B, H, rows, _ = q_bhrd.shape
    visible = create_mask(mask.mask_mod, B, H, rows, k_bhtd.shape[2], q_bhrd.device)
    return scores.masked_fill(~visible, float("-inf")).logsumexp(-1)


def _check_device(*tensors) -> None:
    x = tensors[0]
    if x.is_cuda:
        if not torch.compiler.is_compiling():
            tuning.install_flex_tuning()
        elif not tuning.is_installed():
            raise RuntimeError("nsa_flex on CUDA under torch.compile: call nsa_flex.flex.tuning.install_flex_tuning() "
                               "once before compiling (the selected branch's backward needs it)")
        return
    if needs_grad(*tensors):
        raise RuntimeError(
            "impl='flex' has no backward on CPU (FlexAttention has none there); call it under "
            "torch.no_grad(), or use impl='reference' for CPU gradients"
        )
