"""Triton kernels of nsa_flex::selected_attention: block-centric forward and backward.

A program takes one work item (index.WorkList): a span of the tokens that selected one key
block. It loads the block's K [l', Dk] and V [l', Dv] once and walks the span in chunks of BT
tokens, each chunk M = BT * G' query rows (the G heads of a kv head are adjacent in q, G'
the next power of two, pad rows masked). So K/V are read once per BT * chunks tokens, not once
per token as in the token-centric loop.

Forward: each (token, slot) gets a block-local softmax, partial o (normalised, in the partial
buffer's dtype) and partial lse (fp32, base 2, -inf when no key is visible); _slot_kernel
merges a token's n partials in fp32. Backward: P = exp(S - lse) from the global lse, dV and dK
accumulate in registers over the item's chunks; a block's only item writes them itself, others
go to an fp32 partial per item, summed per block in item order by _block_sum_kernel
(deterministic, no atomics); dQ goes to a partial per
(token, slot), summed over the slots in fp32 by _slot_kernel. _slot_gated_kernel merges like
_slot_kernel and adds the gated sum of the three branches (forward without gradients).

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


    @triton.jit
    def _item(item_blk_ptr, item_start_ptr, item_end_ptr, blk_start_ptr, blk_end_ptr, Hkv, Nv):
        """(valid, b, h, first entry, end entry, first key, end key) of this program's work item."""
        w = tl.program_id(0)
        blk = tl.load(item_blk_ptr + w)
        valid = blk >= 0
        blk = tl.maximum(blk, 0)
        vb = blk % Nv
        bh = blk // Nv
        start = tl.load(item_start_ptr + w)
        end = tl.where(valid, tl.load(item_end_ptr + w), start)
        return valid, (bh // Hkv).to(tl.int64), bh % Hkv, start, end, tl.load(blk_start_ptr + vb), \
            tl.load(blk_end_ptr + vb)

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
    def _chunk_rows(entries_ptr, c0, end, h, N: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                    BT: tl.constexpr):
        """Rows (token, head) of the chunk at entry c0: token t, slot, query head, row ok. Row r is
        entry c0 + r // G', head h * G + r % G'."""
        r = tl.arange(0, BT * GP)
        e_ok = c0 + r // GP < end
        e = tl.load(entries_ptr + c0 + r // GP, mask=e_ok, other=0)
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
        valid, b, h, start, end, ks, ke = _item(item_blk_ptr, item_start_ptr, item_end_ptr, blk_start_ptr,
                                                 blk_end_ptr, Hkv, Nv)
        if valid:
            key, key_ok, k_ld, v_ld = _block_kv(k_ptr, v_ptr, b, h, ks, ke, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
                                                BL, DK, DKP, DV, DVP)
            k_dl = tl.trans(k_ld)
            dk = tl.arange(0, DKP)
            dv = tl.arange(0, DVP)
            # Inductor may pass the float as fp64; keep the tiles fp32.
            scale2 = tl.cast(scale * LOG2E, tl.float32)
            for c0 in range(start, end, BT):
                t, slot, hq, row_ok = _chunk_rows(entries_ptr, c0, end, h, N, G, GP, BT)
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
        N: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr, BL: tl.constexpr,
        DK: tl.constexpr, DKP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr,
        F32_DOT: tl.constexpr, IEEE: tl.constexpr, SUMS: tl.constexpr, ADD: tl.constexpr,
        ACC: tl.constexpr = False, GATED: tl.constexpr = False,
    ):
        """dQ partials [B,T',Hq,n,Dk] of the item's tokens; the item's dK/dV.

        An item that is its block's only one in this range finishes the block itself
        (_finish_block, with SUMS / ADD / ACC as _block_sum_kernel takes them): its sums go
        straight to dk / dv or to the fp32 sums, with no partial written and read back. Other
        items write fp32 partials [W, BL, D] for _block_sum_kernel.

        lse [B, Hq, T] natural log (-inf: no visible key), delta [B, Hq, T] = rowsum(dO * O).
        GATED: dO is the gated sum's output gradient and the branch's is g_sel dO, with g_sel per row
        in gate [B, Hq, T] fp32 (lse's layout): P' = g P stands for it, nothing written.
        """
        LOG2E: tl.constexpr = 1.4426950408889634
        valid, b, h, start, end, ks, ke = _item(item_blk_ptr, item_start_ptr, item_end_ptr, blk_start_ptr,
                                                 blk_end_ptr, Hkv, Nv)
        w = tl.program_id(0).to(tl.int64)
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
            for c0 in range(start, end, BT):
                t, slot, hq, row_ok = _chunk_rows(entries_ptr, c0, end, h, N, G, GP, BT)
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
                              sdk_b, sdk_t, sdk_h, sdv_b, sdv_t, sdv_h, BL, DK, DKP, DV, DVP, SUMS, ADD, ACC)
            else:
                r = tl.arange(0, BL)
                tl.store(dkp_ptr + (w * BL + r[:, None]) * DKP + dk[None, :], dk_acc)
                tl.store(dvp_ptr + (w * BL + r[:, None]) * DVP + dv[None, :], dv_acc)

    @triton.jit
    def _finish_block(dk_acc, dv_acc, dk_ptr, dv_ptr, dk_sum_ptr, dv_sum_ptr, b, h, ks, ke, T0, T1,
                      sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, BL: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr,
                      DV: tl.constexpr, DVP: tl.constexpr, SUMS: tl.constexpr, ADD: tl.constexpr,
                      ACC: tl.constexpr):
        """Write the key block [ks, ke) of (b, kv head h): dk_acc / dv_acc [BL, D'] fp32 are its dK/dV
        sums over the token range [T0, T1).

        Without SUMS (one range) every block is final here: this writes its dK and dV (zeros for
        keys no token selected; every key lies in exactly one virtual block). With SUMS the
        ranges run last first. A token selects only blocks that start at or before it (later
        listed blocks are masked whole and add exact zeros), so a block that starts at or after
        T1 is final already and is left alone; one that starts in [T0, T1) is final in this
        range and goes to dk / dv; one that starts before T0 still waits for earlier ranges and
        goes to the fp32 sums dk_sum / dv_sum (dK/dV's strides). ADD: the sums hold the later
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
        k_ok = key_ok[:, None] & (dk[None, :] < DK)
        v_ok = key_ok[:, None] & (dv[None, :] < DV)
        if ADD:
            dk_acc += tl.load(dk_sum_ptr + k_at, mask=k_ok, other=0.0)
            dv_acc += tl.load(dv_sum_ptr + v_at, mask=v_ok, other=0.0)
        if ACC:
            dk_out = dk_acc + tl.load(dk_ptr + k_at, mask=k_ok & final, other=0.0).to(tl.float32)
            dv_out = dv_acc + tl.load(dv_ptr + v_at, mask=v_ok & final, other=0.0).to(tl.float32)
        else:
            dk_out = dk_acc
            dv_out = dv_acc
        tl.store(dk_ptr + k_at, dk_out.to(dk_ptr.dtype.element_ty), mask=k_ok & final)
        tl.store(dv_ptr + v_at, dv_out.to(dv_ptr.dtype.element_ty), mask=v_ok & final)
        if SUMS:
            tl.store(dk_sum_ptr + k_at, dk_acc, mask=k_ok & ~final)
            tl.store(dv_sum_ptr + v_at, dv_acc, mask=v_ok & ~final)

    @triton.jit
    def _block_sum_kernel(
        dkp_ptr, dvp_ptr, dk_ptr, dv_ptr, dk_sum_ptr, dv_sum_ptr, first_item_ptr, n_items_ptr, blk_start_ptr,
        blk_end_ptr, Hkv, Nv, T0, T1, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
        BL: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr,
        SUMS: tl.constexpr, ADD: tl.constexpr, ACC: tl.constexpr = False,
    ):
        """dK, dV of one (batch, kv head, virtual block) for the token range [T0, T1): its items'
        partials summed in item order, then written by _finish_block. A block with one item was
        finished by that item's program (_bwd_kernel) and is skipped; one with none still gets
        its zeros or its sums carried."""
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
                          tl.load(blk_end_ptr + vb), T0, T1, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, BL, DK, DKP, DV,
                          DVP, SUMS, ADD, ACC)

    @triton.jit
    def _slot_kernel(
        part_ptr, plse_ptr, gid_ptr, out_ptr, lse_ptr, loc_ptr, loc_lse_ptr, T, TG, T0, Hkv,
        sp_b, sp_t, sp_h, sp_n, spl_b, spl_t, spl_h, sg_b, sg_h, sg_t,
        so_b, so_t, so_kv, so_g, sl_b, sl_h, sl_t, sx_b, sx_h, sx_r, sxl_b, sxl_h,
        N: tl.constexpr, NP: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
        DP: tl.constexpr, MERGE: tl.constexpr, LOCAL: tl.constexpr, ACC: tl.constexpr = False,
    ):
        """One (b, t, kv head h) of the range: for each of its G query heads, the n slots' partials
        [n, D] -> out [D] in out's dtype at token T0 + t (part, plse, gid: [B, T', ...] of the
        range, T' = T; out, lse: whole). out's query head h * G + g lies at h * so_kv + g * so_g
        (unfolded [B, T, Hq, D] or folded [B, Hkv, R, D] rows).

        The slots are walked one by one with the G heads' [G, D] rows in registers, so the sum
        needs no exchange between threads, and the slots' block ids are read once for the G heads.
        MERGE: softmax-weighted by the partial lse (base 2); also writes the global lse (natural
        log, -inf when no slot saw a key). LOCAL: one more partial, the window op's over the
        token's two local blocks (loc [B, Hkv, R, D] folded, loc_lse [B, Hkv, R] base 2, rows at
        absolute tokens; the index left those slots out). Else a plain sum (dQ). Slots that read nothing
        (gid -1) were never written and are not loaded. The grid covers TG >= T tokens: tokens
        t >= T (rows of a folded buffer past the sequence) get zeros. ACC (sum only): out holds
        another gradient of these rows already, which the sum adds to.
        """
        b, h, t, g, d, hq, g_ok, rows, row_ok, gid_row = _slot_program(
            gid_ptr, TG, Hkv, sp_b, sp_t, sp_h, sg_b, sg_h, sg_t, G, GP, D, DP)
        live = t < T
        if MERGE:
            plse_row = plse_ptr + b * spl_b + t * spl_t + hq * spl_h
            loc_rows, loc_lse = _local_rows(loc_ptr, loc_lse_ptr, b, h, T0 + t, g, d, sx_b, sx_h, sx_r, sxl_b,
                                            sxl_h, G)
            out, lse = _merged(part_ptr, plse_row, gid_row, rows, row_ok, g_ok, live, sp_n, loc_rows, loc_lse,
                               N, NP, GP, DP, LOCAL)
            tl.store(lse_ptr + b * sl_b + hq * sl_h + (T0 + t) * sl_t, lse, mask=g_ok)
        else:
            out = tl.zeros([GP, DP], tl.float32)
            for slot in tl.static_range(N):
                ok = tl.load(gid_row + slot, mask=live, other=-1) >= 0
                out += tl.load(part_ptr + rows + slot * sp_n, mask=row_ok & ok, other=0.0).to(tl.float32)
        out_at = out_ptr + b * so_b + (T0 + t) * so_t + h * so_kv + g[:, None] * so_g + d[None, :]
        if ACC:
            out += tl.load(out_at, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _slot_program(gid_ptr, TG, Hkv, sp_b, sp_t, sp_h, sg_b, sg_h, sg_t, G: tl.constexpr, GP: tl.constexpr,
                      D: tl.constexpr, DP: tl.constexpr):
        """This slot program's (b, kv head h, token t of TG, head offsets g, d, query heads hq, g ok,
        partial row offsets [G', D'], their mask, its block-id row): one program per (b, t, h)."""
        pid = tl.program_id(0)
        h = pid % Hkv
        t = ((pid // Hkv) % TG).to(tl.int64)
        b = (pid // Hkv // TG).to(tl.int64)
        g = tl.arange(0, GP)
        d = tl.arange(0, DP)
        hq = h * G + g
        g_ok = g < G
        rows = b * sp_b + t * sp_t + hq[:, None] * sp_h + d[None, :]
        row_ok = g_ok[:, None] & (d[None, :] < D)
        gid_row = gid_ptr + b * sg_b + h * sg_h + t * sg_t
        return b, h, t, g, d, hq, g_ok, rows, row_ok, gid_row

    @triton.jit
    def _local_rows(loc_ptr, loc_lse_ptr, b, h, tok, g, d, sx_b, sx_h, sx_r, sxl_b, sxl_h, G: tl.constexpr):
        """(loc row pointers [G', D'], loc lse pointers [G']) of token tok's G heads in the window
        op's local partial (folded rows tok * G + g of kv head h; loc_lse rows dense)."""
        r = (tok * G + g).to(tl.int64)
        return (loc_ptr + b * sx_b + h * sx_h + r[:, None] * sx_r + d[None, :],
                loc_lse_ptr + b * sxl_b + h * sxl_h + r)

    @triton.jit
    def _merged(part_ptr, plse_row, gid_row, rows, row_ok, g_ok, live, sp_n, loc_rows, loc_lse, N: tl.constexpr,
                NP: tl.constexpr, GP: tl.constexpr, DP: tl.constexpr, LOCAL: tl.constexpr):
        """(o [G', D'] fp32, lse [G'] natural log) of one (b, t, kv head): the n slots' partials
        softmax-weighted by their partial lse (base 2), and with LOCAL the local blocks' partial at
        loc_rows / loc_lse (pointers). lse is -inf and o zero when no slot saw a key. Slots that
        read nothing (gid -1) were never written and are not loaded."""
        LN2: tl.constexpr = 0.6931471805599453
        n = tl.arange(0, NP)
        used = tl.load(gid_row + n, mask=(n < N) & live, other=-1) >= 0
        plse = tl.load(plse_row[:, None] + n[None, :], mask=g_ok[:, None] & used[None, :], other=float("-inf"))
        m = tl.max(plse, axis=1)
        if LOCAL:
            lse_l = tl.load(loc_lse, mask=g_ok & live, other=float("-inf"))
            m = tl.maximum(m, lse_l)
        m = tl.where(m == float("-inf"), 0.0, m)
        den = tl.sum(tl.math.exp2(plse - m[:, None]), axis=1)
        acc = tl.zeros([GP, DP], tl.float32)
        if LOCAL:
            w_l = tl.math.exp2(lse_l - m)
            den += w_l
            acc += tl.load(loc_rows, mask=row_ok & live, other=0.0).to(tl.float32) * w_l[:, None]
        for slot in tl.static_range(N):
            ok = tl.load(gid_row + slot, mask=live, other=-1) >= 0
            w = tl.math.exp2(tl.load(plse_row + slot, mask=g_ok & ok, other=float("-inf")) - m)
            part = tl.load(part_ptr + rows + slot * sp_n, mask=row_ok & ok, other=0.0).to(tl.float32)
            acc += part * w[:, None]
        out = acc / tl.where(den > 0, den, 1.0)[:, None]
        lse = tl.where(den > 0, (m + tl.math.log2(tl.where(den > 0, den, 1.0))) * LN2, float("-inf"))
        return out, lse

    @triton.jit
    def _slot_gated_kernel(
        part_ptr, plse_ptr, gid_ptr, cmp_ptr, win_ptr, gate_ptr, out_ptr, loc_ptr, loc_lse_ptr, T, T0, Hkv, HEAD, RC,
        sp_b, sp_t, sp_h, sp_n, spl_b, spl_t, spl_h, sg_b, sg_h, sg_t,
        sc_b, sc_h, sc_r, sw_b, sw_h, sw_r, sgt_b, sgt_t, sgt_h, so_b, so_t, so_h, sx_b, sx_h, sx_r, sxl_b, sxl_h,
        N: tl.constexpr, NP: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
        DP: tl.constexpr, LOCAL: tl.constexpr,
    ):
        """_slot_kernel's merge with the gated sum as its epilogue (no autograd: forward only).

        One (b, t, kv head h) of the range: o_sel of its G query heads merged as _slot_kernel does
        and rounded to out's dtype, then o = g_cmp o_cmp + g_sel o_sel + g_win o_win in fp32, the
        same expression as nsa_flex::gated_sum's kernel, into out [B, T, Hq, D] at token T0 + t.
        o_cmp: folded rows from row HEAD on (RC of them, earlier rows zero), o_win folded
        [B, Hkv, T*G, D], gates [B, T, Hq, 3]. So o_sel is never written to memory and read back.
        """
        b, h, t, g, d, hq, g_ok, rows, row_ok, gid_row = _slot_program(
            gid_ptr, T, Hkv, sp_b, sp_t, sp_h, sg_b, sg_h, sg_t, G, GP, D, DP)
        plse_row = plse_ptr + b * spl_b + t * spl_t + hq * spl_h
        loc_rows, loc_lse = _local_rows(loc_ptr, loc_lse_ptr, b, h, T0 + t, g, d, sx_b, sx_h, sx_r, sxl_b, sxl_h,
                                        G)
        o_sel, _ = _merged(part_ptr, plse_row, gid_row, rows, row_ok, g_ok, t >= 0, sp_n, loc_rows, loc_lse,
                           N, NP, GP, DP, LOCAL)
        x_sel = o_sel.to(out_ptr.dtype.element_ty).to(tl.float32)
        r = (T0 + t) * G + g
        c = r - HEAD
        c_ok = g_ok & (c >= 0) & (c < RC)
        gate = gate_ptr + b * sgt_b + (T0 + t) * sgt_t + hq * sgt_h
        g0 = tl.load(gate, mask=g_ok, other=0.0).to(tl.float32)
        g1 = tl.load(gate + 1, mask=g_ok, other=0.0).to(tl.float32)
        g2 = tl.load(gate + 2, mask=g_ok, other=0.0).to(tl.float32)
        x_cmp = tl.load(cmp_ptr + b * sc_b + h * sc_h + c[:, None] * sc_r + d[None, :],
                        mask=c_ok[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)
        x_win = tl.load(win_ptr + b * sw_b + h * sw_h + r[:, None] * sw_r + d[None, :], mask=row_ok,
                        other=0.0).to(tl.float32)
        o = g0[:, None] * x_cmp + g1[:, None] * x_sel + g2[:, None] * x_win
        tl.store(out_ptr + b * so_b + (T0 + t) * so_t + hq[:, None] * so_h + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _delta_kernel(
        do_ptr, o_ptr, delta_ptr, T, Hq,
        sdo_b, sdo_t, sdo_h, so_b, so_t, so_h, sd_b, sd_h, sd_t,
        TB: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    ):
        """delta [B, Hq, T] = rowsum(dO * O) in fp32 for TB tokens (all their heads) of batch entry b.

        One pass over dO and O ([B, T, Hq, D], any strides), the transposed fp32 rows written
        directly: a torch expression made fp32 copies of both and reduced them at ~1.6 TB/s."""
        pid = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        r = tl.arange(0, TB * HP)
        t = (pid * TB + r // HP).to(tl.int64)
        hq = r % HP
        d = tl.arange(0, DP)
        ok = (t < T) & (hq < Hq)
        m = ok[:, None] & (d[None, :] < D)
        do = tl.load(do_ptr + b * sdo_b + t[:, None] * sdo_t + hq[:, None] * sdo_h + d[None, :], mask=m, other=0.0)
        o = tl.load(o_ptr + b * so_b + t[:, None] * so_t + hq[:, None] * so_h + d[None, :], mask=m, other=0.0)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
        tl.store(delta_ptr + b * sd_b + hq * sd_h + t * sd_t, delta, mask=ok)
