"""A deliberately naive NSA, written from docs/design.md section 1, to check nsa_flex.reference.

Loops over batch, token and head; fp64; no masks: each query gathers the list of keys it
may see (visible compression blocks, tokens of its selected blocks, its window); the
selection block importance comes from counting overlapping tokens of explicit ranges and
the top-n from Python's sorted(). It shares no code with nsa_flex (only NSAConfig's fields).
Slow on purpose: keep T * Hq small.
"""

from __future__ import annotations

import math

import torch


def overlap_weights(Tc: int, Ns: int, l: int, d: int, l_sel: int) -> list[list[float]]:
    """[Tc][Ns]: tokens shared by compression block i and selection block j, divided by d."""
    table = []
    for i in range(Tc):
        cmp_tokens = set(range(i * d, i * d + l))
        table.append([len(cmp_tokens & set(range(j * l_sel, (j + 1) * l_sel))) / d for j in range(Ns)])
    return table


def _attend(q_d: torch.Tensor, keys_sd: torch.Tensor, values_sd: torch.Tensor):
    """One query against the keys listed for it: (output [Dv], probabilities as a list).

    No keys at all: a zero output and no probabilities.
    """
    if keys_sd.shape[0] == 0:
        return values_sd.new_zeros(values_sd.shape[-1]), []
    scores = (keys_sd @ q_d) / math.sqrt(q_d.shape[0])
    e = torch.exp(scores - scores.max())
    p = e / e.sum()
    return p @ values_sd, p.tolist()


def naive_nsa(q, k, v, k_cmp, v_cmp, gates, cfg, *, k_win=None, v_win=None, block_indices=None):
    """Returns (o [B,T,Hq,Dv] fp64, selected [B][Hkv][T] -> sorted list of block ids).

    block_indices [B,Hkv,T,n] (optional) replaces the selection (-1 slots ignored).
    """
    q, k, v, k_cmp, v_cmp, gates = (x.detach().double() for x in (q, k, v, k_cmp, v_cmp, gates))
    k_win = k if k_win is None else k_win.detach().double()
    v_win = v if v_win is None else v_win.detach().double()
    B, T, Hq, _ = q.shape
    Hkv, Dv, Tc = k.shape[2], v.shape[3], k_cmp.shape[1]
    G = Hq // Hkv
    l, d, l_sel, n, w = cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.n_selected, cfg.window
    Ns = -(-T // l_sel)
    weights = overlap_weights(Tc, Ns, l, d, l_sel)
    o = torch.zeros(B, T, Hq, Dv, dtype=torch.float64)
    selected = [[[None] * T for _ in range(Hkv)] for _ in range(B)]
    for b in range(B):
        for t in range(T):
            visible = [i for i in range(Tc) if i * d + l - 1 <= t]
            own = t // l_sel
            for kv in range(Hkv):
                heads = range(kv * G, (kv + 1) * G)
                o_cmp, importance = {}, [0.0] * Ns
                for h in heads:
                    o_cmp[h], p = _attend(q[b, t, h], k_cmp[b, visible, kv], v_cmp[b, visible, kv])
                    # Group sum: every head of the group adds its own importance.
                    for p_i, i in zip(p, visible):
                        for j in range(Ns):
                            importance[j] += p_i * weights[i][j]
                if block_indices is None:
                    candidates = list(range(own + 1))
                    forced = {j for j in candidates if j < cfg.n_initial or j > own - cfg.n_local}
                    # Forced blocks first, then by importance, equal importance: lower index first.
                    ranked = sorted(candidates, key=lambda j: (j not in forced, -importance[j], j))
                    chosen = sorted(ranked[:n])
                else:
                    chosen = sorted({int(j) for j in block_indices[b, kv, t] if int(j) >= 0})
                selected[b][kv][t] = chosen
                sel_tokens = [s for j in chosen for s in range(j * l_sel, min((j + 1) * l_sel, T)) if s <= t]
                win_tokens = list(range(max(0, t - w + 1), t + 1))
                for h in heads:
                    o_sel, _ = _attend(q[b, t, h], k[b, sel_tokens, kv], v[b, sel_tokens, kv])
                    o_win, _ = _attend(q[b, t, h], k_win[b, win_tokens, kv], v_win[b, win_tokens, kv])
                    g = gates[b, t, h]
                    o[b, t, h] = g[0] * o_cmp[h] + g[1] * o_sel + g[2] * o_win
    return o, selected


def padded_indices(selected, n: int) -> torch.Tensor:
    """The naive selection as [B, Hkv, T, n] int64, ascending, -1 in unused slots."""
    rows = [[[ids + [-1] * (n - len(ids)) for ids in per_t] for per_t in per_kv] for per_kv in selected]
    return torch.tensor(rows, dtype=torch.int64)


def compressed_dense(q, k_cmp, v_cmp, cfg, scale: float):
    """(o [B,Hq,T,Dv], lse [B,Hq,T]) of the compressed branch alone, dense, in q's dtype (fp64 for an oracle).

    Block i (last token i*d + l - 1) is visible to token t once complete; rows with no visible
    block give o = 0 and lse = -inf.
    """
    T, G = q.shape[1], q.shape[2] // k_cmp.shape[2]
    t = torch.arange(T, device=q.device)
    last = torch.arange(k_cmp.shape[1], device=q.device) * cfg.cmp_stride + cfg.cmp_block - 1
    visible = last[None, :] <= t[:, None]
    k = k_cmp.transpose(1, 2).repeat_interleave(G, 1)
    v = v_cmp.transpose(1, 2).repeat_interleave(G, 1)
    s = (q.transpose(1, 2) @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.where(visible, torch.softmax(s, -1), 0).nan_to_num(0.0)
    return p @ v, lse


def random_inputs(cfg, T: int, *, B: int = 1, dtype=torch.float64, seed: int = 0, window_kv: bool = False) -> dict:
    """Random op inputs for nsa_attention / nsa_reference as a dict of tensors.

    Gates are sigmoids of normals (in (0, 1), as after the gate MLP). window_kv adds
    k_win / v_win, the window branch's own keys and values.
    """
    gen = torch.Generator().manual_seed(seed)
    Tc = max(0, (T - cfg.cmp_block) // cfg.cmp_stride + 1)
    Hq, Hkv, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dv

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    x = {
        "q": randn(B, T, Hq, Dk),
        "k": randn(B, T, Hkv, Dk),
        "v": randn(B, T, Hkv, Dv),
        "k_cmp": randn(B, Tc, Hkv, Dk),
        "v_cmp": randn(B, Tc, Hkv, Dv),
        "gates": torch.sigmoid(randn(B, T, Hq, 3)),
    }
    if window_kv:
        x["k_win"], x["v_win"] = randn(B, T, Hkv, Dk), randn(B, T, Hkv, Dv)
    return x
