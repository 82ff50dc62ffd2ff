"""Triton kernels of nsa_flex::selected_attention: block-centric forward and backward.

A program takes one work item (index.WorkList): a span of the tokens that selected one key
block. It loads the block's K [l', Dk] and V [l', Dv] once and walks the span in chunks of BT
tokens, each chunk M = BT * G' query rows (the G heads of a kv head are adjacent in q, G'
the next power of two, pad rows masked). So K/V are read once per BT * chunks tokens, not once
per token as in the token-centric loop.

Forward: each (token, slot) gets a block-local softmax, partial o (normalised, in the partial
buffer's dtype) and partial lse (fp32, base 2, -inf when no key is visible), which
merge_kernels.py merges per token. Backward: P = exp(S - lse) from the global lse, dV and dK
accumulate in registers over the item's chunks; a block's only item writes them itself, others
go to an fp32 partial per item, summed per block in item order by _block_sum_kernel
(deterministic, no atomics); dQ goes to a partial per (token, slot), which merge_kernels.py sums
over the slots. A token's partials lie at the places of its row of the index, its used slots
first (index.SelectionIndex: entries hold t * N + place, N a power of two >= the places).

The launches may cover a token range [T0, T0 + T') of the sequence (launch.py splits long
sequences so the partial buffers stay bounded): entries and the partial buffers are local to
the range (t), every whole-sequence tensor (q, dO, o, lse, keys) is read and written at the
absolute token T0 + t. Every argument is a whole dense tensor, never a strided slice: strides
arrive as numbers fixed when torch.compile traces the op, and Inductor may lay out a strided
argument densely, which the fixed strides would then read past.

Under Triton's interpreter (CPU tests) the dots run in fp32 (F32_DOT): its dot misreads
16-bit inputs. fp32 inputs use IEEE dots (not TF32) on the GPU.
"""

from __future__ import annotations

from nsa_flex.ops.triton_utils import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    from nsa_flex.ops.triton_utils import dot


    # The index arrays are loaded in the kernels themselves and handed to these helpers as values:
    # a pointer passed into a helper whose results address a store counts as written in Inductor's
    # analysis of a traced kernel (tests/test_kernel_writes.py).

    @triton.jit
    def _item(blk, Hkv, Nv):
        """(valid, b, h, block of the sequence) of a work item on block row blk (-1: no work)."""
        valid = blk >= 0
        blk = tl.maximum(blk, 0)
        bh = blk // Nv
        return valid, (bh // Hkv).to(tl.int64), bh % Hkv, blk % Nv

    @triton.jit
    def _block_tile(ptr, b, h, key, key_ok, s_b, s_t, s_h, D: tl.constexpr, DP: tl.constexpr):
        """[BL, DP] rows key of head h (zero outside the block and past D)."""
        d = tl.arange(0, DP)
        ptrs = ptr + b * s_b + key.to(tl.int64)[:, None] * s_t + h * s_h + d[None, :]
        return tl.load(ptrs, mask=key_ok[:, None] & (d[None, :] < D), other=0.0)

    @triton.jit
    def _block_kv(k_ptr, v_ptr, b, h, ks, ke, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, BL: tl.constexpr,
                  DK: tl.constexpr, DKP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr):
        """(key [BL], key ok, K [BL, DKP], V [BL, DVP]) of the key block [ks, ke) of kv head h."""
        key = ks + tl.arange(0, BL)
        key_ok = key < ke
        k_ld = _block_tile(k_ptr, b, h, key, key_ok, sk_b, sk_t, sk_h, DK, DKP)
        v_ld = _block_tile(v_ptr, b, h, key, key_ok, sv_b, sv_t, sv_h, DV, DVP)
        return key, key_ok, k_ld, v_ld

    @triton.jit
    def _chunk_rows(e, e_ok, r, h, N: tl.constexpr, G: tl.constexpr, GP: tl.constexpr):
        """Rows (token, head) of a chunk: token t, slot, query head, row ok. Row r holds entry e (ok
        where e_ok), head h * G + r % G'."""
        g = r % GP
        return (e // N).to(tl.int64), e % N, h * G + g, e_ok & (g < G)

    @triton.jit
    def _q_rows(b, t, h, g, s_b, s_t, s_kv, s_g):
        """Offsets of query rows (token t, query head h * G + g): q unfolded [B, T, Hq, D] has s_kv =
        G s_g, q folded [B, Hkv, R, D] (row t * G + g) s_t = G s_g."""
        return b * s_b + t.to(tl.int64) * s_t + h * s_kv + g * s_g

    @triton.jit
    def _fwd_kernel(
        q_ptr, k_ptr, v_ptr, po_ptr, plse_ptr, entries_ptr,
        item_blk_ptr, item_start_ptr, item_end_ptr, blk_start_ptr, blk_end_ptr, Hkv, Nv, T0, scale,
        sq_b, sq_t, sq_kv, sq_g, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
        so_b, so_t, so_h, so_n, sl_b, sl_t, sl_h,
        N: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr, BL: tl.constexpr,
        DK: tl.constexpr, DKP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr,
        F32_DOT: tl.constexpr, IEEE: tl.constexpr,
    ):
        """Partial o [B,T',Hq,n,Dv] and partial lse (base 2) [B,T',Hq,n] of one work item's tokens."""
        LOG2E: tl.constexpr = 1.4426950408889634
        pid = tl.program_id(0)
        valid, b, h, vb = _item(tl.load(item_blk_ptr + pid), Hkv, Nv)
        start = tl.load(item_start_ptr + pid)
        end = tl.where(valid, tl.load(item_end_ptr + pid), start)
        ks, ke = tl.load(blk_start_ptr + vb), tl.load(blk_end_ptr + vb)
        if valid:
            key, key_ok, k_ld, v_ld = _block_kv(k_ptr, v_ptr, b, h, ks, ke, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
                                                BL, DK, DKP, DV, DVP)
            k_dl = tl.trans(k_ld)
            dk = tl.arange(0, DKP)
            dv = tl.arange(0, DVP)
            # Inductor may pass the float as fp64; keep the tiles fp32.
            scale2 = tl.cast(scale * LOG2E, tl.float32)
            cr = tl.arange(0, BT * GP)
            for c0 in range(start, end, BT):
                e_ok = c0 + cr // GP < end
                e = tl.load(entries_ptr + c0 + cr // GP, mask=e_ok, other=0)
                t, slot, hq, row_ok = _chunk_rows(e, e_ok, cr, h, N, G, GP)
                q_md = tl.load(q_ptr + _q_rows(b, T0 + t, h, hq - h * G, sq_b, sq_t, sq_kv, sq_g)[:, None] + dk[None, :],
                               mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
                s = dot(q_md, k_dl, F32_DOT, IEEE) * scale2
                vis = row_ok[:, None] & key_ok[None, :] & (key[None, :] <= T0 + t[:, None])
                s = tl.where(vis, s, float("-inf"))
                m = tl.max(s, axis=1)
                m = tl.where(m == float("-inf"), 0.0, m)
                p = tl.math.exp2(s - m[:, None])
                l = tl.sum(p, axis=1)
                acc = dot(p.to(v_ld.dtype), v_ld, F32_DOT, IEEE)
                o = acc / tl.where(l > 0, l, 1.0)[:, None]
                lse = tl.where(l > 0, m + tl.math.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
                row = b * so_b + t * so_t + hq * so_h + slot * so_n
                tl.store(po_ptr + row[:, None] + dv[None, :], o.to(po_ptr.dtype.element_ty),
                         mask=row_ok[:, None] & (dv[None, :] < DV))
                tl.store(plse_ptr + b * sl_b + t * sl_t + hq * sl_h + slot, lse, mask=row_ok)

    @triton.jit
    def _bwd_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, gate_ptr, dqp_ptr, dkp_ptr, dvp_ptr, entries_ptr,
        item_blk_ptr, item_start_ptr, item_end_ptr, blk_start_ptr, blk_end_ptr, n_items_ptr,
        dk_ptr, dv_ptr, dk_sum_ptr, dv_sum_ptr, Hkv, Nv, T0, T1, scale,
        sq_b, sq_t, sq_kv, sq_g, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sdo_b, sdo_t, sdo_h,
        sl_b, sl_h, sl_t, sdq_b, sdq_t, sdq_h, sdq_n, sdk_b, sdk_t, sdk_h, sdv_b, sdv_t, sdv_h,
        ssk_b, ssk_t, ssk_h, ssv_b, ssv_t, ssv_h,
        N: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr, BL: tl.constexpr,
        DK: tl.constexpr, DKP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr,
        F32_DOT: tl.constexpr, IEEE: tl.constexpr, SUMS: tl.constexpr, ADD: tl.constexpr,
        ACC: tl.constexpr = False, GATED: tl.constexpr = False,
    ):
        """dQ partials [B,T',Hq,n,Dk] of the item's tokens; the item's dK/dV.

        An item that is its block's only one in this range finishes the block itself
        (_finish_block, with SUMS / ADD / ACC as _block_sum_kernel takes them): its sums go
        straight to dk / dv or to the fp32 sums, with no partial written and read back. Other
        items write fp32 partials [W, BL, D] for _block_sum_kernel. ssk_* / ssv_*: the strides
        (batch, token, kv head) of the sums [B, Ts, Hkv, D] (Ts <= T keys, launch.sum_tokens).

        lse [B, Hq, T] natural log (-inf: no visible key), delta [B, Hq, T] = rowsum(dO * O).
        GATED: dO is the gated sum's output gradient and the branch's is g_sel dO, with g_sel per row
        in gate [B, Hq, T] fp32 (lse's layout): P' = g P stands for it, nothing written.
        """
        LOG2E: tl.constexpr = 1.4426950408889634
        pid = tl.program_id(0)
        valid, b, h, vb = _item(tl.load(item_blk_ptr + pid), Hkv, Nv)
        start = tl.load(item_start_ptr + pid)
        end = tl.where(valid, tl.load(item_end_ptr + pid), start)
        ks, ke = tl.load(blk_start_ptr + vb), tl.load(blk_end_ptr + vb)
        w = pid.to(tl.int64)
        if valid:
            key, key_ok, k_ld, v_ld = _block_kv(k_ptr, v_ptr, b, h, ks, ke, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
                                                BL, DK, DKP, DV, DVP)
            k_dl = tl.trans(k_ld)
            v_dl = tl.trans(v_ld)
            dk = tl.arange(0, DKP)
            dv = tl.arange(0, DVP)
            # A new name: under Inductor `scale` arrives as a constexpr, which may not be reassigned.
            sc = tl.cast(scale, tl.float32)
            scale2 = sc * LOG2E
            dk_acc = tl.zeros([BL, DKP], tl.float32)
            dv_acc = tl.zeros([BL, DVP], tl.float32)
            cr = tl.arange(0, BT * GP)
            for c0 in range(start, end, BT):
                e_ok = c0 + cr // GP < end
                e = tl.load(entries_ptr + c0 + cr // GP, mask=e_ok, other=0)
                t, slot, hq, row_ok = _chunk_rows(e, e_ok, cr, h, N, G, GP)
                q_md = tl.load(q_ptr + _q_rows(b, T0 + t, h, hq - h * G, sq_b, sq_t, sq_kv, sq_g)[:, None] + dk[None, :],
                               mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
                do_md = tl.load(do_ptr + b * sdo_b + (T0 + t[:, None]) * sdo_t + hq[:, None] * sdo_h + dv[None, :],
                                mask=row_ok[:, None] & (dv[None, :] < DV), other=0.0)
                stat = b * sl_b + hq * sl_h + (T0 + t) * sl_t
                lse2 = tl.load(lse_ptr + stat, mask=row_ok, other=0.0) * LOG2E
                delta = tl.load(delta_ptr + stat, mask=row_ok, other=0.0)
                s = dot(q_md, k_dl, F32_DOT, IEEE) * scale2
                vis = row_ok[:, None] & key_ok[None, :] & (key[None, :] <= T0 + t[:, None])
                # A row with no visible key anywhere has lse -inf and no visible key here either.
                p = tl.where(vis, tl.math.exp2(s - lse2[:, None]), 0.0)
                if GATED:
                    p = p * tl.load(gate_ptr + stat, mask=row_ok, other=0.0)[:, None]
                dv_acc += dot(tl.trans(p.to(do_md.dtype)), do_md, F32_DOT, IEEE)
                dp = dot(do_md, v_dl, F32_DOT, IEEE)
                ds = (p * (dp - delta[:, None])).to(q_md.dtype)
                dk_acc += dot(tl.trans(ds), q_md, F32_DOT, IEEE)
                dq = dot(ds, k_ld, F32_DOT, IEEE) * sc
                row = b * sdq_b + t * sdq_t + hq * sdq_h + slot * sdq_n
                tl.store(dqp_ptr + row[:, None] + dk[None, :], dq.to(dqp_ptr.dtype.element_ty),
                         mask=row_ok[:, None] & (dk[None, :] < DK))
            dk_acc = dk_acc * sc
            if tl.load(n_items_ptr + tl.maximum(tl.load(item_blk_ptr + w), 0)) == 1:
                _finish_block(dk_acc, dv_acc, dk_ptr, dv_ptr, dk_sum_ptr, dv_sum_ptr, b, h, ks, ke, T0, T1,
                              sdk_b, sdk_t, sdk_h, sdv_b, sdv_t, sdv_h, ssk_b, ssk_t, ssk_h, ssv_b, ssv_t, ssv_h,
                              BL, DK, DKP, DV, DVP, SUMS, ADD, ACC)
            else:
                r = tl.arange(0, BL)
                tl.store(dkp_ptr + (w * BL + r[:, None]) * DKP + dk[None, :], dk_acc)
                tl.store(dvp_ptr + (w * BL + r[:, None]) * DVP + dv[None, :], dv_acc)

    @triton.jit
    def _finish_block(dk_acc, dv_acc, dk_ptr, dv_ptr, dk_sum_ptr, dv_sum_ptr, b, h, ks, ke, T0, T1,
                      sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, ssk_b, ssk_t, ssk_h, ssv_b, ssv_t, ssv_h,
                      BL: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr,
                      SUMS: tl.constexpr, ADD: tl.constexpr, ACC: tl.constexpr):
        """Write the key block [ks, ke) of (b, kv head h): dk_acc / dv_acc [BL, D'] fp32 are its dK/dV
        sums over the token range [T0, T1).

        Without SUMS (one range) every block is final here: this writes its dK and dV (zeros for
        keys no token selected; every key lies in exactly one virtual block). With SUMS the
        ranges run last first. A token selects only blocks that start at or before it (later
        listed blocks are masked whole and add exact zeros), so a block that starts at or after
        T1 is final already and is left alone; one that starts in [T0, T1) is final in this
        range and goes to dk / dv; one that starts before T0 still waits for earlier ranges and
        goes to the fp32 sums dk_sum / dv_sum (strides ssk_* / ssv_*; they hold only the keys of
        blocks that start before the last range, launch.sum_tokens). ADD: the sums hold the later
        ranges' contributions, read and added. ACC: dk / dv hold another gradient already, which
        a block adds where it is final."""
        live = ks < T1
        final = ks >= T0
        r = tl.arange(0, BL)
        dk = tl.arange(0, DKP)
        dv = tl.arange(0, DVP)
        key = ks + r
        key_ok = (key < ke) & live
        kt = key.to(tl.int64)[:, None]
        k_at = b * sk_b + kt * sk_t + h * sk_h + dk[None, :]
        v_at = b * sv_b + kt * sv_t + h * sv_h + dv[None, :]
        k_sum_at = b * ssk_b + kt * ssk_t + h * ssk_h + dk[None, :]
        v_sum_at = b * ssv_b + kt * ssv_t + h * ssv_h + dv[None, :]
        k_ok = key_ok[:, None] & (dk[None, :] < DK)
        v_ok = key_ok[:, None] & (dv[None, :] < DV)
        if ADD:
            dk_acc += tl.load(dk_sum_ptr + k_sum_at, mask=k_ok, other=0.0)
            dv_acc += tl.load(dv_sum_ptr + v_sum_at, mask=v_ok, other=0.0)
        if ACC:
            dk_out = dk_acc + tl.load(dk_ptr + k_at, mask=k_ok & final, other=0.0).to(tl.float32)
            dv_out = dv_acc + tl.load(dv_ptr + v_at, mask=v_ok & final, other=0.0).to(tl.float32)
        else:
            dk_out = dk_acc
            dv_out = dv_acc
        tl.store(dk_ptr + k_at, dk_out.to(dk_ptr.dtype.element_ty), mask=k_ok & final)
        tl.store(dv_ptr + v_at, dv_out.to(dv_ptr.dtype.element_ty), mask=v_ok & final)
        if SUMS:
            tl.store(dk_sum_ptr + k_sum_at, dk_acc, mask=k_ok & ~final)
            tl.store(dv_sum_ptr + v_sum_at, dv_acc, mask=v_ok & ~final)

    @triton.jit
    def _block_sum_kernel(
        dkp_ptr, dvp_ptr, dk_ptr, dv_ptr, dk_sum_ptr, dv_sum_ptr, first_item_ptr, n_items_ptr, blk_start_ptr,
        blk_end_ptr, Hkv, Nv, T0, T1, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, ssk_b, ssk_t, ssk_h, ssv_b, ssv_t, ssv_h,
        BL: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr,
        SUMS: tl.constexpr, ADD: tl.constexpr, ACC: tl.constexpr = False,
    ):
        """dK, dV of one (batch, kv head, virtual block) for the token range [T0, T1): its items'
        partials summed in item order, then written by _finish_block. A block with one item was
        finished by that item's program (_bwd_kernel, or gluon_kernels' twin) and is skipped; one with
        none still gets its zeros or its sums carried."""
        row = tl.program_id(0)
        count = tl.load(n_items_ptr + row)
        if count != 1:
            vb = row % Nv
            b = (row // Nv // Hkv).to(tl.int64)
            h = (row // Nv) % Hkv
            first = tl.load(first_item_ptr + row).to(tl.int64)
            ks = tl.load(blk_start_ptr + vb)
            # A block that starts at or after T1 has only exact zeros here (_finish_block skips it).
            count = tl.where(ks < T1, count, 0)
            r = tl.arange(0, BL)
            dk = tl.arange(0, DKP)
            dv = tl.arange(0, DVP)
            dk_acc = tl.zeros([BL, DKP], tl.float32)
            dv_acc = tl.zeros([BL, DVP], tl.float32)
            for i in range(count):
                w = first + i
                dk_acc += tl.load(dkp_ptr + (w * BL + r[:, None]) * DKP + dk[None, :])
                dv_acc += tl.load(dvp_ptr + (w * BL + r[:, None]) * DVP + dv[None, :])
            _finish_block(dk_acc, dv_acc, dk_ptr, dv_ptr, dk_sum_ptr, dv_sum_ptr, b, h, ks,
                          tl.load(blk_end_ptr + vb), T0, T1, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, ssk_b, ssk_t, ssk_h,
                          ssv_b, ssv_t, ssv_h, BL, DK, DKP, DV, DVP, SUMS, ADD, ACC)
