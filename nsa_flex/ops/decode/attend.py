"""The NSA attention of one new query token per sequence: the op nsa_flex::decode_attend.

Given a decode cache (already holding the new token's keys/values and any compressed block it
completed) and the query of one token per sequence at positions pos [B], it runs

- the compressed branch over the whole compressed cache (entry i visible iff i*d + l - 1 <= pos),
- top-n selection of one query per kv head group from that branch's probabilities (group sum,
  folded onto selection blocks, forced blocks first, blocks after the query's own excluded,
  ties to the lower block id),
- the selected branch (the n blocks' tokens <= pos) and the window branch (the last w tokens),
  each with its own softmax,
- the gates: o = g_cmp * o_cmp + g_sel * o_sel + g_win * o_win (fp32).

On CUDA with Triton the op runs four Triton launches (ops/decode/kernels.py); elsewhere its torch
twin below, the batched-ops decode of nsa_flex.decoding.step. As for select_blocks, the choice is made
inside the op body (a register_kernel("cpu") fallback would be skipped under torch.compile).
"""

# No `from __future__ import annotations` here: torch.library reads the op's annotations.
import torch
from torch import Tensor
from torch.library import custom_op
from torch.nn import functional as F

from nsa_flex.blocks import num_sel_blocks, top_n_blocks
from nsa_flex.config import NSAConfig
from nsa_flex.ops.decode import kernels

_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def decode_attend(q, k, v, k_win, v_win, k_cmp, v_cmp, pos, gates, config: NSAConfig, *,
                  scale: float | None = None, advance: bool = False) -> tuple[Tensor, Tensor]:
    """(o [B,Hkv,G,Dv] in q's dtype, selected blocks [B,Hkv,n] int64 in no particular order, -1 unused).

    q [B,Hkv,G,Dk] (or [B,1,Hq,Dk]); the cache tensors, head-major: k, k_win [B,Hkv,T,Dk],
    v, v_win [B,Hkv,T,Dv], k_cmp [B,Hkv,Tc,Dk], v_cmp [B,Hkv,Tc,Dv] (k_win/v_win may be k/v);
    pos [B] int64, the query's position, its token already in the cache (pos < T);
    gates [B,Hkv,G,3] (after the sigmoid). scale defaults to Dk ** -0.5. advance: add 1 to
    pos in place afterwards (a decode step's lengths; on CUDA the last kernel does it).

    The compressed entries past a sequence's visible ones must hold finite values (an NSACache
    starts zero-filled): at larger batches the kernel loads whole tiles of k_cmp/v_cmp by TMA,
    unmasked, and gives those entries probability 0, which a NaN or inf in v_cmp would turn
    into NaN.
    """
    q, gates, scale = prepare_inputs(q, k, v, k_win, v_win, k_cmp, v_cmp, pos, gates, config, scale)
    if advance and not pos.is_contiguous():
        raise ValueError("advance=True updates pos in place: pos must be contiguous")
    return torch.ops.nsa_flex.decode_attend(q, k, v, k_win, v_win, k_cmp, v_cmp, pos, gates, scale,
                                            *_geometry(config), advance)


def decode_attend_torch(q, k, v, k_win, v_win, k_cmp, v_cmp, pos, gates, config: NSAConfig, *,
                        scale: float | None = None) -> tuple[Tensor, Tensor]:
    """The torch twin of decode_attend, inline (Inductor compiles it): same arguments, same result."""
    q, gates, scale = prepare_inputs(q, k, v, k_win, v_win, k_cmp, v_cmp, pos, gates, config, scale)
    return _attend_torch(q, k, v, k_win, v_win, k_cmp, v_cmp, pos, gates, scale, config)


def _decode_attend_impl(
    q: Tensor, k: Tensor, v: Tensor, k_win: Tensor, v_win: Tensor, k_cmp: Tensor, v_cmp: Tensor,
    pos: Tensor, gates: Tensor, scale: float, cmp_block: int, cmp_stride: int, sel_block: int,
    n_selected: int, n_initial: int, n_local: int, window: int, advance: bool,
) -> tuple[Tensor, Tensor]:
    return run_decode_attend(q, k, v, k_win, v_win, k_cmp, v_cmp, pos, gates, scale, cmp_block, cmp_stride,
                             sel_block, n_selected, n_initial, n_local, window, advance)


def run_decode_attend(q, k, v, k_win, v_win, k_cmp, v_cmp, pos, gates, scale: float, cmp_block: int, cmp_stride: int,
                      sel_block: int, n_selected: int, n_initial: int, n_local: int, window: int, advance: bool,
                      after_cache_step: bool = False) -> tuple[Tensor, Tensor]:
    """The op's body; after_cache_step as kernels.decode_attend_triton's (nsa_flex::step_attend)."""
    # Only the geometry fields are read; head counts come from the tensors.
    config = NSAConfig(cmp_block=cmp_block, cmp_stride=cmp_stride, sel_block=sel_block, n_selected=n_selected,
                       n_initial=n_initial, n_local=n_local, window=window)
    if q.device.type == "cuda" and kernels.HAS_TRITON:
        return kernels.decode_attend_triton(q, k, v, k_win, v_win, k_cmp, v_cmp, pos, gates, scale, config,
                                                  advance=advance, after_cache_step=after_cache_step)
    o, blocks = _attend_torch(q, k, v, k_win, v_win, k_cmp, v_cmp, pos, gates, scale, config)
    if advance:
        pos.add_(1)
    return o, blocks


# pos is mutated only with advance=True; the schema has to say so either way. A custom_op,
# opaque to Inductor, not a triton_op: Inductor launches a triton_op's kernels itself and drops
# launch_pdl on the way, which cost the compiled step the ~3 us that PDL saves at B=1
# (ops/decode/kernels.py, pdl_wait). Under a CUDA graph the op's Python runs only at capture.
_decode_attend_op = custom_op("nsa_flex::decode_attend", mutates_args=("pos",))(_decode_attend_impl)


@_decode_attend_op.register_fake
def _decode_attend_fake(q, k, v, k_win, v_win, k_cmp, v_cmp, pos, gates, scale, cmp_block, cmp_stride,
                        sel_block, n_selected, n_initial, n_local, window, advance):
    B, Hkv, G, _ = q.shape
    return q.new_empty((B, Hkv, G, v.shape[-1])), q.new_empty((B, Hkv, n_selected), dtype=torch.int64)


# --- the torch twin ------------------------------------------------------------------------

def _attend_torch(q_bhgd, k, v, k_win, v_win, k_cmp, v_cmp, pos_b, gates_bhg3, scale: float, cfg: NSAConfig):
    g = gates_bhg3.to(torch.promote_types(gates_bhg3.dtype, torch.float32))
    o_cmp, p_cmp = cmp_attention(q_bhgd, k_cmp, v_cmp, pos_b, scale, cfg)
    blocks_bhn = select_blocks_one(p_cmp, pos_b, cfg, num_sel_blocks(k.shape[2], cfg))
    o = g[..., 0:1] * o_cmp + sel_win_attention(q_bhgd, k, v, k_win, v_win, blocks_bhn, pos_b,
                                                g[..., 1:2], g[..., 2:3], scale, cfg)
    return o.to(q_bhgd.dtype), blocks_bhn


def _matmul_f32(a: Tensor, b: Tensor) -> Tensor:
    """a [..., M, K] @ b [..., K, N] with fp32 (or wider) results.

    bf16/fp16 on CUDA: one cuBLAS bmm with fp32 output (no upcast copy of the cache);
    elsewhere the inputs are upcast.
    """
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and b.dtype == a.dtype:
        out = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), out_dtype=torch.float32)
        return out.view(*a.shape[:-2], *out.shape[-2:])
    dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    return a.to(dtype) @ b.to(dtype)


def _softmax(s_bhgs: Tensor, valid_bhs: Tensor) -> Tensor:
    """Softmax over the valid keys (valid broadcasts to [B,Hkv,S]); a row with none gives 0, never NaN."""
    s = s_bhgs.masked_fill(~valid_bhs[:, :, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
    den = e.sum(-1, keepdim=True)
    return e / torch.where(den > 0, den, torch.ones_like(den))


def cmp_attention(q_bhgd, k_cmp, v_cmp, pos_b, scale: float, cfg: NSAConfig) -> tuple[Tensor, Tensor]:
    """Compressed branch over the whole compressed cache, entry i visible iff i*d + l - 1 <= pos:
    (o [B,Hkv,G,Dv], p [B,Hkv,G,Tc]). Scores and softmax in fp32; p is rounded to the cache's
    dtype for the second matmul, as flash does."""
    last_c = torch.arange(k_cmp.shape[2], device=pos_b.device) * cfg.cmp_stride + cfg.cmp_block - 1
    valid_b1c = (last_c[None, :] <= pos_b[:, None])[:, None, :]
    p = _softmax(_matmul_f32(q_bhgd, k_cmp.transpose(-1, -2)) * scale, valid_b1c)
    return _matmul_f32(p.to(v_cmp.dtype), v_cmp), p


def fold_to_sel_blocks(imp_bhc: Tensor, cfg: NSAConfig, num_sel: int) -> Tensor:
    """[..., Tc] compression-block scores -> [..., num_sel] selection-block scores.

    Equals `imp @ blocks.cmp_to_sel_weights(Tc, num_sel)` without the [Tc, Ns] matrix: with
    the sequence cut into chunks of d tokens, compression block i covers chunks i .. i+l/d-1,
    so chunk c collects blocks c-l/d+1 .. c, and selection block j sums its l'/d chunks.
    """
    r, per_sel = cfg.cmp_block // cfg.cmp_stride, cfg.sel_block // cfg.cmp_stride
    n_chunks, Tc = num_sel * per_sel, imp_bhc.shape[-1]
    if Tc > n_chunks:
        raise ValueError(f"{Tc} compression blocks do not fit in {num_sel} selection blocks")
    padded = F.pad(imp_bhc, (r - 1, n_chunks - Tc))
    chunks = sum(padded[..., r - 1 - k: r - 1 - k + n_chunks] for k in range(r))
    return chunks.unflatten(-1, (num_sel, per_sel)).sum(-1)


def select_blocks_one(p_bhgc: Tensor, pos_b: Tensor, cfg: NSAConfig, num_sel: int) -> Tensor:
    """Top-n selection blocks of one query per kv head: [B,Hkv,G,Tc] cmp probabilities -> [B,Hkv,n].

    The group-summed importance in fp32 (as the kernels compute it), then blocks.top_n_blocks,
    the rule every implementation shares. The Triton kernels return the same ids unordered.
    """
    return top_n_blocks(fold_to_sel_blocks(p_bhgc.sum(2), cfg, num_sel).float(), pos_b[:, None], cfg)


def sel_win_attention(q_bhgd, k, v, k_win, v_win, blocks_bhn, pos_b, g_sel, g_win, scale: float,
                      cfg: NSAConfig) -> Tensor:
    """g_sel * selected branch + g_win * window branch, [B,Hkv,G,Dv], from one gather each.

    Keys: the n*l' tokens of the chosen blocks (causal up to pos), then the last w tokens up
    to pos (masked where < 0). One score matmul, a softmax per branch, and, with each
    branch's probabilities scaled by its gate, one matmul with the gathered values.
    """
    dev, (B, Hkv, n), T = pos_b.device, blocks_bhn.shape, k.shape[2]
    tok_sel = (blocks_bhn[..., None] * cfg.sel_block + torch.arange(cfg.sel_block, device=dev)).flatten(-2)
    valid_sel = (blocks_bhn >= 0).repeat_interleave(cfg.sel_block, dim=-1) & (tok_sel <= pos_b[:, None, None])
    w = min(cfg.window, T)
    tok_win = (pos_b[:, None] - w + 1 + torch.arange(w, device=dev))[:, None, :].expand(B, Hkv, w)
    tok = torch.cat([tok_sel, tok_win], dim=-1).clamp(0, T - 1)
    b = torch.arange(B, device=dev)[:, None, None]
    h = torch.arange(Hkv, device=dev)[None, :, None]
    S = n * cfg.sel_block
    k_bhsd = torch.cat([k[b, h, tok[..., :S]], k_win[b, h, tok[..., S:]]], dim=2)
    v_bhsd = torch.cat([v[b, h, tok[..., :S]], v_win[b, h, tok[..., S:]]], dim=2)
    s = _matmul_f32(q_bhgd, k_bhsd.transpose(-1, -2)) * scale
    p = torch.cat([g_sel * _softmax(s[..., :S], valid_sel), g_win * _softmax(s[..., S:], tok_win >= 0)], dim=-1)
    return _matmul_f32(p.to(v_bhsd.dtype), v_bhsd)


# --- arguments ------------------------------------------------------------------------------

def _geometry(config: NSAConfig) -> tuple[int, ...]:
    """The config fields the op needs, as the op's int arguments."""
    return (config.cmp_block, config.cmp_stride, config.sel_block, config.n_selected,
            config.n_initial, config.n_local, config.window)


def prepare_inputs(q, k, v, k_win, v_win, k_cmp, v_cmp, pos, gates, config: NSAConfig, scale):
    """Checks the inputs (clear errors); returns (q [B,Hkv,G,Dk], gates [B,Hkv,G,3], scale)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("k_win", k_win), ("v_win", v_win), ("k_cmp", k_cmp),
                    ("v_cmp", v_cmp), ("pos", pos), ("gates", gates)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.device != k.device:
            raise ValueError(f"{name} is on {x.device} but k is on {k.device}; inputs must share one device")
    if k.dim() != 4:
        raise ValueError(f"k must be [B, Hkv, T, Dk], got shape {tuple(k.shape)}")
    B, Hkv, T, Dk = k.shape
    Dv, Tc = v.shape[-1], k_cmp.shape[2]
    for name, x, want in (("v", v, (B, Hkv, T, Dv)), ("k_win", k_win, (B, Hkv, T, Dk)),
                          ("v_win", v_win, (B, Hkv, T, Dv)), ("k_cmp", k_cmp, (B, Hkv, Tc, Dk)),
                          ("v_cmp", v_cmp, (B, Hkv, Tc, Dv))):
        if tuple(x.shape) != want:
            raise ValueError(f"{name} must be {list(want)} to fit k {list(k.shape)}, got {list(x.shape)}")
        if x.dtype != k.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but k has {k.dtype}; the cache tensors must share one")
    heads_ok = q.dim() == 4 and (q.shape[1] == Hkv or (q.shape[1] == 1 and q.shape[2] % Hkv == 0))
    if not heads_ok or q.shape[0] != B or q.shape[-1] != Dk:
        raise ValueError(f"q must be [B={B}, Hkv={Hkv}, G, Dk={Dk}] or [B, 1, Hq, Dk], got {list(q.shape)}")
    q = q.reshape(B, Hkv, -1, Dk)
    G = q.shape[2]
    if tuple(gates.shape) != (B, Hkv, G, 3) and tuple(gates.shape) != (B, 1, Hkv * G, 3):
        raise ValueError(f"gates must be [B, Hkv, G, 3] = {[B, Hkv, G, 3]} (or [B, 1, Hq, 3]), got {list(gates.shape)}")
    if tuple(pos.shape) != (B,) or pos.dtype != torch.int64:
        raise ValueError(f"pos must be an int64 tensor [B={B}], got {pos.dtype} {list(pos.shape)}")
    if k.is_cuda and k.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"the cache has dtype {k.dtype}; allowed on cuda: {', '.join(map(str, _KERNEL_DTYPES))}")
    if Tc > num_sel_blocks(T, config) * (config.sel_block // config.cmp_stride):
        raise ValueError(f"k_cmp holds {Tc} entries, more than a cache of T={T} tokens can complete")
    return q, gates.reshape(B, Hkv, G, 3), Dk ** -0.5 if scale is None else float(scale)
