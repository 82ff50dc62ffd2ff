"""The Triton kernels behind nsa_flex::decode_attend: one query token per sequence, four launches.

The G query heads of a kv head share its keys and its selection, so every program takes them
as the rows of one tile ([G', D], G' = G rounded up to a power of two, at least 16 for tl.dot).

A  compressed split-K (and the window at larger batches), grid (B*Hkv, SPLITS + window chunks).
   A program takes tiles of the entries visible at pos (entry i iff i*d + l - 1 <= pos), each
   tile whole selection blocks. Besides its flash partial (m, l, acc) it folds each tile's
   probabilities onto selection blocks at once, P_t = exp(s - m_t) @ W [G, JS] (W[c, j]: the
   d-token chunks entry c shares with block j), so nothing of size G x Tc is written.
B  importance and top n, grid (B*Hkv, tile groups): the importance of block j is
   sum over rows g and tiles t of exp(m_t[g] - lse[g]) P_t[g, j], packed as a selection key
   (score bits above the reversed block id: ties go to the lower id; forced blocks +inf, blocks
   after the query's own out). Each program keeps the top n of its tiles' keys (bitonic tl.topk).
S  selected branch, grid (B*Hkv, n) or (B*Hkv, NW + n) with WS (the window chunks first, which
   need nothing of B). With ST each selected program takes the top n of B's candidates itself.
D  combine, grid (B*Hkv, G): softmax-merges the compressed, selected and window partials,
   applies the gates in fp32, writes o in q's dtype; with advance it then adds 1 to pos.

Programmatic dependent launch (PDL, sm_90+; triton_utils.pdl_wait): each kernel is launched
before the one ahead of it ends and does what needs nothing of it before it waits (B and S
load pos and q, WS's window programs run whole, D merges A's partials; after the op's own
cache update A's compressed programs read q, pos and the older entries). Inductor drops
launch_pdl when it launches a triton_op's kernels, so the decode ops are custom_ops.

Scores and softmax in fp32; probabilities are rounded to the cache dtype before the PV dot, as
flash does; the fold dot runs in fp32 so that near-ties select as the fp32 reference does.
Scratch (partials, folded probabilities, counters) is allocated per call, so under
torch.compile it lives in the CUDA graph's pool. Work depends on pos (a tensor), never the
grid: one graph serves every position.

Limits: the top n sorts cdiv(T / l' / JT, TI) * next_pow2(n) candidates in one program (256 at
64k tokens, 512 at 128k); far longer caches want a second level of candidates.
The tile settings and the variants measured and dropped: docs/decisions.md, "Decode kernels".
"""

from __future__ import annotations

import torch

from nsa_flex.blocks import num_sel_blocks
from nsa_flex.config import NSAConfig
from nsa_flex.ops import triton_utils
from nsa_flex.ops.triton_utils import next_pow2

try:
    import triton
    import triton.language as tl
    from torch.library import wrap_triton
    from triton.tools.tensor_descriptor import TensorDescriptor

    HAS_TRITON = True
except ImportError:  # the CPU wheel of torch ships no Triton: the op runs its torch twin
    HAS_TRITON = False

_TARGET_PROGRAMS = 512
"""Kernel A programs to aim for (about four per SM on an H100/H200): sets the split count
(docs/decisions.md, "Decode kernels")."""

TILE_KEYS = ("BC", "SPLITS", "BN", "WCH", "TI", "IW", "SW", "DW", "num_warps", "num_stages", "maxnreg", "PDL", "WS",
             "FS", "TMA", "ST", "SREG")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def launch_config(B: int, Hkv: int, Tc: int, config: NSAConfig) -> dict[str, int]:
    """Tile sizes: BC compressed-entry lanes per tile of A (a tile uses R * (BC // R) of them),
    SPLITS of A, BN tokens per tile of S and of A's window programs, WCH window tokens per
    window program (one selection block's worth, so selection and window programs do equal
    work); TI tiles per importance program (raised to hold at least n blocks); warps: IW of
    B, SW of S, DW of D (one warp up to ~100 partials per row), num_warps (and num_stages) of A.

    Switches (0/1), each on where it measured faster (docs/decisions.md, "Decode kernels"):
    PDL, programmatic dependent launch; WS, the window programs in S's grid, before S waits
    (B*Hkv <= 16); FS, A's fold dot over the tile's own blocks only, the columns past them by
    row sums (B*Hkv <= 4, where A's grid is one wave either way); TMA, A's compressed tiles
    through tensor descriptors (B*Hkv > 16); ST, S's programs take the top n themselves;
    SREG, a cap on S's registers (128 past 16 kv heads, so that 4 programs fit an SM);
    maxnreg caps A's registers (a measurement knob: every cap tried was slower)."""
    R = config.sel_block // config.cmp_stride
    BC = max(64, next_pow2(R))
    BN = max(16, min(64, next_pow2(config.sel_block)))
    SPLITS = max(1, min(_cdiv(Tc, R * (BC // R)), _cdiv(_TARGET_PROGRAMS, B * Hkv)))
    WCH = BN * _cdiv(config.sel_block, BN)
    # D's partials per row: one warp up to ~100 of them, measured at 40 and 88 (see below).
    partials = SPLITS + config.n_selected + _cdiv(config.window, WCH)
    return {"BC": BC, "SPLITS": SPLITS, "BN": BN, "WCH": WCH, "TI": max(1, 128 // next_pow2(BC // R)),
            "IW": 4, "SW": 4, "DW": 1 if partials <= 96 else 4, "num_warps": 4, "num_stages": 2, "PDL": 1,
            "WS": int(B * Hkv <= 16), "FS": int(B * Hkv <= 4),
            "TMA": int(B * Hkv > 16), "ST": 1, "SREG": 128 if B * Hkv > 16 else 0}


def decode_attend_triton(q, k, v, k_win, v_win, k_cmp, v_cmp, pos, gates, scale: float, config: NSAConfig,
                         tiles: dict[str, int] | None = None, *, advance: bool = False,
                         after_cache_step: bool = False,
                         trace: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches A, B, S and D; arguments and result as nsa_flex.ops.decode.attend (q [B,Hkv,G,Dk]).
    advance: D adds 1 to pos in place once nothing reads it any more (a decode step's
    lengths update without a launch of its own). after_cache_step: the launches just before
    wrote only the token at pos and the compressed entry it completes (nsa_flex::step_attend,
    whose cache update runs first): A's compressed programs read q, pos and the older entries
    before they wait (see pdl_wait).

    trace: an int64 tensor [4, programs, 5] (a diagnostic, bench/decode_timeline_gpu.py): each
    program of A, B, S and D stores its timeline there (see store_trace), the kernels in that order,
    at least as many rows as the largest grid (launch_grids).

    tiles overrides launch_config's keys (TILE_KEYS). CUDA tensors, or CPU tensors under the
    Triton interpreter (tests): there tl.dot runs in fp32, since the interpreter's dot misreads
    bf16 (its raw 16-bit patterns).
    """
    B, Hkv, G, Dk = q.shape
    T, Tc, Dv = k.shape[2], k_cmp.shape[2], v.shape[-1]
    for name, x in (("k", k), ("v", v), ("k_win", k_win), ("v_win", v_win), ("k_cmp", k_cmp), ("v_cmp", v_cmp)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (stride {x.stride(-1)})")
    unknown = sorted(set(tiles or {}) - set(TILE_KEYS))
    if unknown:
        raise ValueError(f"unknown decode tile keys {unknown}; allowed: {', '.join(TILE_KEYS)}")
    cfg = {**launch_config(B, Hkv, Tc, config), **(tiles or {})}
    BC, SPLITS, BN, WCH = (cfg[name] for name in ("BC", "SPLITS", "BN", "WCH"))
    NS, N = num_sel_blocks(T, config), config.n_selected
    R, M_CMP = config.sel_block // config.cmp_stride, config.cmp_block // config.cmp_stride
    if BC < R or BC & (BC - 1):
        raise ValueError(f"decode tile BC={BC} must be a power of two >= l'/d = {R}")
    if cfg["TI"] < 1 or cfg["TI"] & (cfg["TI"] - 1):
        # B sorts each program's TI * JT keys with a bitonic network.
        raise ValueError(f"decode tile TI={cfg['TI']} must be a power of two >= 1")
    for key in ("PDL", "WS", "FS", "TMA", "ST"):
        if cfg[key] not in (0, 1):
            raise ValueError(f"decode tile {key}={cfg[key]} must be 0 or 1")
    for key in ("maxnreg", "SREG"):
        if cfg.get(key) and not 24 <= cfg[key] <= 255:
            raise ValueError(f"decode tile {key}={cfg[key]} must be 0 (no cap) or 24..255 registers")
    # A tile: JT whole selection blocks; its entries' chunks reach JS - JT blocks further.
    JT = BC // R
    BCL, JS = R * JT, (R * JT + M_CMP - 2) // R + 1
    NT = _cdiv(Tc, BCL)
    w = min(config.window, T)
    NW = _cdiv(w, WCH)
    dev = q.device
    ROWS, DKP, DVP = max(16, next_pow2(G)), max(16, next_pow2(Dk)), max(16, next_pow2(Dv))
    out_dtype = q.dtype
    q = q.to(k.dtype)
    q = q if q.stride(-1) == 1 else q.contiguous()
    gates = gates.contiguous()
    if pos.stride(0) != 1:
        if advance:
            raise ValueError("advance=True updates pos in place: pos must be contiguous")
        pos = pos.contiguous()
    BH = B * Hkv
    # B's programs take TI tiles of JT blocks each (blocks past the NT tiles take the last
    # tile's reach, KB - 1 tiles, or nothing: tokens no entry covers yet) and store the top
    # n of their keys; enough tiles that a program holds at least n keys.
    KB = 1 + _cdiv(JS - JT, JT)
    NP = next_pow2(N)
    TI, NPROG = _importance_programs(T, config, JT, cfg)
    f32 = torch.float32
    m_a, l_a = (torch.empty((BH, SPLITS, ROWS), dtype=f32, device=dev) for _ in range(2))
    acc_a = torch.empty((BH, SPLITS, ROWS, DVP), dtype=f32, device=dev)
    fold = torch.empty((BH, NT, G, JS), dtype=f32, device=dev)
    m_tile = torch.empty((BH, NT, G), dtype=f32, device=dev)
    # S's window programs write these before S waits for B (WS with PDL): their memory must not
    # be one a buffer B reads could still hold. A takes them as arguments, WS or not, so
    # Inductor's memory planning keeps them alive (and apart from B's inputs) from A on. (One
    # allocation with views made Inductor copy the views around every kernel: 45 us a step.)
    m_c, l_c = (torch.empty((BH, N + NW, ROWS), dtype=f32, device=dev) for _ in range(2))
    acc_c = torch.empty((BH, N + NW, ROWS, DVP), dtype=f32, device=dev)
    cand = torch.empty((BH, NPROG, NP), dtype=torch.int64, device=dev)
    # B's programs of a kv head count themselves in here (A zeroes it); the last one ranks.
    arrived = torch.empty((BH,), dtype=torch.int32, device=dev)
    blocks = torch.empty((B, Hkv, N), dtype=torch.int64, device=dev)
    o = torch.empty((B, Hkv, G, Dv), dtype=out_dtype, device=dev)
    dims = dict(G=G, ROWS=ROWS, DK=Dk, DKP=DKP, DV=Dv, DVP=DVP)
    dots = dict(F32_DOT=dev.type == "cpu", IEEE=k.dtype == torch.float32)
    ws, fs = bool(cfg["WS"]), bool(cfg["FS"])
    pdl_args = triton_utils.pdl_launch(dev, bool(cfg["PDL"]))
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_args,
                  **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}))
    # TMA: tensor descriptors of the compressed caches, boxes [1, 1, BC, D] (sm_90 and newer, or
    # the interpreter); without, the kernel takes the tensors in their place and never reads them.
    tma = (bool(cfg["TMA"]) and (dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] >= 9)
           and max(BC, DKP, DVP) <= 256 and all(_tma_ok(x) for x in (k_cmp, v_cmp)))
    kc_desc, vc_desc = ((TensorDescriptor.from_tensor(x, [1, 1, BC, p]) for x, p in ((k_cmp, DKP), (v_cmp, DVP)))
                        if tma else (k_cmp, v_cmp))
    grids = launch_grids(B, Hkv, T, Tc, config, cfg, G)
    check_trace(trace, max(a * b for a, b in grids), kernels=4)
    traced = [dict(trace_ptr=pos if trace is None else trace[i], TRACE=trace is not None) for i in range(4)]
    wrap_triton(_cmp_win_kernel)[grids[0]](
        q, k_cmp, v_cmp, kc_desc, vc_desc, k_win, v_win, pos, fold, m_tile, m_a, l_a, acc_a, m_c, l_c, acc_c, arrived,
        Hkv, T, Tc, NT, w, scale,
        *q.stride()[:3], *k_cmp.stride()[:3], *v_cmp.stride()[:3], *k_win.stride()[:3], *v_win.stride()[:3],
        **dims, **dots, BC=BC, BCL=BCL, JS=JS, FW=max(16, next_pow2(JT if fs else JS)), FWU=JT if fs else JS,
        SPLITS=SPLITS,
        CMP_BLOCK=config.cmp_block, CMP_STRIDE=config.cmp_stride, R=R, M_CMP=M_CMP, N=N, NW=NW, WCH=WCH, BN=BN,
        WS=ws, PREFETCH=after_cache_step, TMA=tma, **traced[0], **launch,
    )
    st = bool(cfg["ST"])
    wrap_triton(_importance_kernel)[grids[1]](
        fold, m_tile, m_a, l_a, pos, cand, arrived, blocks, Hkv, T, Tc, NS, NT,
        G=G, GP=next_pow2(G), ROWS=ROWS, SPLITS=SPLITS, SPP=next_pow2(SPLITS), TI=TI, JT=JT,
        JTP=next_pow2(JT), JS=JS, KB=KB, BCL=BCL, CMP_BLOCK=config.cmp_block, CMP_STRIDE=config.cmp_stride,
        SEL_BLOCK=config.sel_block, N_INIT=config.n_initial, N_LOCAL=config.n_local, N=N, NP=NP,
        NPROGP=next_pow2(NPROG), ST=st, num_warps=cfg["IW"], **traced[1], **pdl_args,
    )
    wrap_triton(_sel_win_kernel)[grids[2]](
        q, k, v, k_win, v_win, pos, blocks, cand, m_c, l_c, acc_c, Hkv, T, w, scale, NS, NPROG,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *k_win.stride()[:3], *v_win.stride()[:3],
        **dims, **dots, N=N, NW=NW, WCH=WCH, SEL_BLOCK=config.sel_block, BN=BN, WS=ws, ST=st, NP=NP,
        NPROGP=next_pow2(NPROG), num_warps=cfg["SW"], num_stages=cfg["num_stages"], **traced[2], **pdl_args,
        **({"maxnreg": cfg["SREG"]} if cfg.get("SREG") else {}),
    )
    wrap_triton(_combine_kernel)[grids[3]](
        m_a, l_a, acc_a, m_c, l_c, acc_c, gates, o, pos, B,
        ADVANCE=advance, G=G, ROWS=ROWS, DV=Dv, DVP=DVP, SPLITS=SPLITS, SPP=next_pow2(SPLITS), N=N, NP=N + NW,
        NPP=next_pow2(N + NW), num_warps=cfg["DW"], **traced[3], **pdl_args,
    )
    return o, blocks


def launch_grids(B: int, Hkv: int, T: int, Tc: int, config: NSAConfig, cfg: dict[str, int],
                G: int | None = None) -> list[tuple[int, int]]:
    """The grids of A, B, S and D for tiles cfg (launch_config's result with any overrides)."""
    NW = _cdiv(min(config.window, T), cfg["WCH"])
    _, NPROG = _importance_programs(T, config, cfg["BC"] // (config.sel_block // config.cmp_stride), cfg)
    BH, ws = B * Hkv, bool(cfg["WS"])
    return [(BH, cfg["SPLITS"] + (0 if ws else NW)), (BH, NPROG), (BH, config.n_selected + (NW if ws else 0)),
            (BH, G if G is not None else config.group_size)]


def _importance_programs(T: int, config: NSAConfig, JT: int, cfg: dict[str, int]) -> tuple[int, int]:
    """(TI, programs per kv head) of B: TI tiles of JT blocks each, enough that a program holds at
    least n keys."""
    TI = max(cfg["TI"], _cdiv(next_pow2(config.n_selected), next_pow2(JT)))
    return TI, _cdiv(_cdiv(num_sel_blocks(T, config), JT), TI)


def check_trace(trace: torch.Tensor | None, programs: int, kernels: int | None = None) -> None:
    """A timeline buffer (TRACE; bench/decode_timeline_gpu.py): contiguous int64, [programs, 5]
    rows per kernel, with a leading dim of `kernels` where one buffer serves several."""
    if trace is None:
        return
    lead = [] if kernels is None else [kernels]
    if (trace.dtype != torch.int64 or not trace.is_contiguous() or list(trace.shape[:-2]) != lead
            or trace.dim() != len(lead) + 2 or trace.shape[-2] < programs or trace.shape[-1] != 5):
        want = ", ".join(str(x) for x in lead + [f">= {programs}", 5])
        raise ValueError(f"trace must be a contiguous int64 tensor [{want}]; got {trace.dtype} {list(trace.shape)}")


def _tma_ok(x: torch.Tensor) -> bool:
    """A tensor a TMA descriptor can address: 16-byte aligned base and strides, unit last stride."""
    size = x.element_size()
    return x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in x.stride()[:-1])


if HAS_TRITON:
    from nsa_flex.ops.triton_utils import dot, global_time, pdl_wait, store_trace

    @triton.jit
    def _load_q(q_ptr, b, h, sq_b, sq_h, sq_g, G: tl.constexpr, ROWS: tl.constexpr, DK: tl.constexpr,
                DKP: tl.constexpr):
        g = tl.arange(0, ROWS)
        d = tl.arange(0, DKP)
        ptrs = q_ptr + b * sq_b + h * sq_h + g[:, None] * sq_g + d[None, :]
        return tl.load(ptrs, mask=(g[:, None] < G) & (d[None, :] < DK), other=0.0)

    @triton.jit
    def _load_pos(pos_ptr, b, T):
        # A position past the cache is a caller's bug; clamped, it cannot read out of bounds.
        return tl.minimum(tl.load(pos_ptr + b), T - 1)

    @triton.jit
    def _n_visible(pos, Tc, CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr):
        """Compressed entries visible at pos: i*d + l - 1 <= pos."""
        n = tl.where(pos >= CMP_BLOCK - 1, (pos - (CMP_BLOCK - 1)) // CMP_STRIDE + 1, 0)
        return tl.minimum(n, Tc)

    @triton.jit
    def _flash_init(ROWS: tl.constexpr, DVP: tl.constexpr):
        """An online softmax that has seen no key: (m = -inf, l = 0, acc = 0) per row."""
        return (tl.full([ROWS], float("-inf"), tl.float32), tl.zeros([ROWS], tl.float32),
                tl.zeros([ROWS, DVP], tl.float32))

    @triton.jit
    def _flash_step(q_rd, k_ptrs, v_ptrs, ok, m, l, acc, scale, k_mask, v_mask,
                    F32_DOT: tl.constexpr, IEEE: tl.constexpr):
        """One key tile of an online softmax: keys where ok ([BN] columns), returns (m, l, acc, p),
        p = exp(s - m) with the new m (0 where not ok)."""
        k_dn = tl.load(k_ptrs, mask=k_mask, other=0.0)
        # Both loads first: V's latency overlaps the scores and the softmax.
        v_nd = tl.load(v_ptrs, mask=v_mask, other=0.0)
        return _flash_update(q_rd, k_dn, v_nd, ok, m, l, acc, scale, F32_DOT, IEEE)

    @triton.jit
    def _flash_update(q_rd, k_dn, v_nd, ok, m, l, acc, scale, F32_DOT: tl.constexpr, IEEE: tl.constexpr):
        """_flash_step on loaded tiles, k_dn [D, BN] and v_nd [BN, D]. Where not ok, p is 0 and
        k_dn's columns may hold anything, v_nd's rows anything finite."""
        s = (dot(q_rd, k_dn, F32_DOT, IEEE) * scale).to(tl.float32)
        s = tl.where(ok[None, :], s, float("-inf"))
        # Every tile holds a visible key, so m_new is finite and no row turns NaN.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        acc = acc * alpha[:, None] + dot(p.to(v_nd.dtype), v_nd, F32_DOT, IEEE)
        return m_new, l * alpha + tl.sum(p, axis=1), acc, p

    @triton.jit
    def _store_partial(m_ptr, l_ptr, acc_ptr, idx, m, l, acc, ROWS: tl.constexpr, DVP: tl.constexpr):
        g = tl.arange(0, ROWS)
        tl.store(m_ptr + idx * ROWS + g, m)
        tl.store(l_ptr + idx * ROWS + g, l)
        tl.store(acc_ptr + (idx * ROWS + g)[:, None] * DVP + tl.arange(0, DVP)[None, :], acc)

    @triton.jit
    def _attend_range(q_rd, k_base, v_base, skt, svt, lo, hi, scale, ROWS: tl.constexpr, DK: tl.constexpr,
                      DKP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr, BN: tl.constexpr,
                      F32_DOT: tl.constexpr, IEEE: tl.constexpr):
        """Online softmax over the tokens lo..hi-1 of one kv head: (m, l, acc)."""
        dk = tl.arange(0, DKP)
        dv = tl.arange(0, DVP)
        m, l, acc = _flash_init(ROWS, DVP)
        tt = tl.arange(0, BN)
        for t0 in range(lo, hi, BN):
            ok = t0 + tt < hi
            k_ptrs = k_base + t0 * skt + tt[None, :] * skt + dk[:, None]
            v_ptrs = v_base + t0 * svt + tt[:, None] * svt + dv[None, :]
            m, l, acc, _ = _flash_step(q_rd, k_ptrs, v_ptrs, ok, m, l, acc, scale,
                                       ok[None, :] & (dk[:, None] < DK), ok[:, None] & (dv[None, :] < DV),
                                       F32_DOT, IEEE)
        return m, l, acc

    @triton.jit
    def _cmp_win_kernel(
        q_ptr, kc_ptr, vc_ptr, kc_desc, vc_desc, kw_ptr, vw_ptr, pos_ptr, fold_ptr, mt_ptr, m_a, l_a, acc_a, m_c,
        l_c, acc_c, arrived_ptr, Hkv, T, Tc, NT, w, scale,
        sq_b, sq_h, sq_g, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, skw_b, skw_h, skw_t, svw_b, svw_h, svw_t,
        G: tl.constexpr, ROWS: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr, DV: tl.constexpr,
        DVP: tl.constexpr, F32_DOT: tl.constexpr, IEEE: tl.constexpr, BC: tl.constexpr, BCL: tl.constexpr,
        JS: tl.constexpr, FW: tl.constexpr, FWU: tl.constexpr, SPLITS: tl.constexpr, CMP_BLOCK: tl.constexpr,
        CMP_STRIDE: tl.constexpr, R: tl.constexpr, M_CMP: tl.constexpr, N: tl.constexpr, NW: tl.constexpr,
        WCH: tl.constexpr, BN: tl.constexpr, WS: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
        TMA: tl.constexpr, trace_ptr, TRACE: tl.constexpr,
    ):
        pid = tl.program_id(0)
        part = tl.program_id(1)
        t_entry = global_time(pid) if TRACE else 0
        t_rel = t_entry
        # Everything A reads may come from the kernel just before it, so it waits first; but after
        # the op's own cache update (PREFETCH) only the newest compressed entry and the token at
        # pos can, and the compressed programs wait only where they need them (below).
        z = tl.zeros([], tl.int32)
        if not PREFETCH:
            z = pdl_wait(pid, PDL)
            if TRACE:
                t_rel = global_time(z)
        elif part >= SPLITS:
            z = pdl_wait(pid, PDL)
            if TRACE:
                t_rel = global_time(z)
        bh = pid + z
        b = (bh // Hkv).to(tl.int64)
        h = bh % Hkv
        pos = _load_pos(pos_ptr, b, T)
        q_rd = _load_q(q_ptr, b, h, sq_b, sq_h, sq_g, G, ROWS, DK, DKP)
        if part < SPLITS:
            n_vis = _n_visible(pos, Tc, CMP_BLOCK, CMP_STRIDE)
            n_tiles = tl.cdiv(n_vis, BCL)
            per = tl.cdiv(n_tiles, SPLITS)
            g = tl.arange(0, ROWS)
            dk = tl.arange(0, DKP)
            dv = tl.arange(0, DVP)
            cc = tl.arange(0, BC)
            # Fold weights: entry c of a tile covers chunks c .. c+M-1, block j of it chunks jR .. jR+R-1.
            # The dot fills columns < FWU (JS, or with FS the tile's own JT blocks); the columns
            # past them, reached by the tile's last entries, come from row sums.
            jj = tl.arange(0, FW)
            wt = tl.minimum(cc[:, None] + M_CMP, jj[None, :] * R + R) - tl.maximum(cc[:, None], jj[None, :] * R)
            wt = tl.where((cc[:, None] < BCL) & (jj[None, :] < FWU), tl.maximum(wt, 0), 0).to(tl.float32)
            m, l, acc = _flash_init(ROWS, DVP)
            t_lo, t_hi = part * per, tl.minimum(part * per + per, n_tiles)
            # The newest visible entry is this step's own (cache_step's kernel writes it) only
            # where pos completes a block; otherwise an earlier step wrote it.
            done = pos + 1 - CMP_BLOCK
            fresh = ((done >= 0) & (done % CMP_STRIDE == 0) & (t_hi == n_tiles) & (t_lo < t_hi)).to(tl.int32)
            if PREFETCH:
                # The program holding a fresh newest entry waits before its loop, the others
                # after it (the wait's 0 goes into the loop's start, or the partial's index).
                if fresh == 1:
                    t_lo += pdl_wait(pid, PDL)
                    if TRACE:
                        t_rel = global_time(t_lo)
            # 64-bit scalar bases, 32-bit tile offsets: [D, BC] tensors of 64-bit offsets cost registers.
            k_base = kc_ptr + b * sk_b + h * sk_h
            v_base = vc_ptr + b * sv_b + h * sv_h
            for t in range(t_lo, t_hi):
                c0 = t * BCL
                ok = (cc < BCL) & (c0 + cc < n_vis)
                if TMA:
                    # Unmasked: entries past n_vis are cache entries (finite, see decode_attend)
                    # and past Tc TMA's zero fill; their p is 0.
                    at = [b.to(tl.int32), h.to(tl.int32), c0.to(tl.int32), 0]
                    k_nd = kc_desc.load(at).reshape(BC, DKP)
                    v_nd = vc_desc.load(at).reshape(BC, DVP)
                    m, l, acc, p = _flash_update(q_rd, tl.trans(k_nd), v_nd, ok, m, l, acc, scale, F32_DOT, IEEE)
                else:
                    k_ptrs = k_base + c0.to(tl.int64) * sk_t + cc[None, :] * sk_t + dk[:, None]
                    v_ptrs = v_base + c0.to(tl.int64) * sv_t + cc[:, None] * sv_t + dv[None, :]
                    m, l, acc, p = _flash_step(q_rd, k_ptrs, v_ptrs, ok, m, l, acc, scale,
                                               ok[None, :] & (dk[:, None] < DK), ok[:, None] & (dv[None, :] < DV),
                                               F32_DOT, IEEE)
                folded = tl.dot(p, wt, input_precision="ieee")
                row = (bh * NT + t).to(tl.int64) * G
                tl.store(fold_ptr + (row + g[:, None]) * JS + jj[None, :], folded,
                         mask=(g[:, None] < G) & (jj[None, :] < FWU))
                for s in tl.static_range(JS - FWU):
                    w_s = tl.minimum(cc + M_CMP, (FWU + s) * R + R) - tl.maximum(cc, (FWU + s) * R)
                    w_s = tl.where(cc < BCL, tl.maximum(w_s, 0), 0).to(tl.float32)
                    tl.store(fold_ptr + (row + g) * JS + FWU + s, tl.sum(p * w_s[None, :], axis=1), mask=g < G)
                tl.store(mt_ptr + row + g, m, mask=g < G)
            idx = bh * SPLITS + part
            if PREFETCH:
                if fresh == 0:
                    # (pid + 1: an input of its own, so that the two waits stay apart.)
                    idx += pdl_wait(pid + 1, PDL)
                    if TRACE:
                        t_rel = global_time(idx)
            _store_partial(m_a, l_a, acc_a, idx, m, l, acc, ROWS, DVP)
            if WS and part == 0:
                # Kernels run in order, so B starts with every counter at zero. (Not at the
                # kernel's start: there the store took A from 128 registers to 140, 3 programs
                # per SM instead of 4, and A from 27 to 36 us at B=8, 64k.)
                tl.store(arrived_ptr + bh, 0)
        else:
            if part == SPLITS:
                tl.store(arrived_ptr + bh, 0)
            _window_chunk(q_rd, kw_ptr, vw_ptr, m_c, l_c, acc_c, b, h, bh, pos, part - SPLITS, w, scale,
                          skw_b, skw_h, skw_t, svw_b, svw_h, svw_t, ROWS, DK, DKP, DV, DVP, F32_DOT, IEEE, N, NW,
                          WCH, BN)
        store_trace(trace_ptr, t_entry, t_rel, t_rel, TRACE)

    @triton.jit
    def _window_chunk(q_rd, kw_ptr, vw_ptr, m_c, l_c, acc_c, b, h, bh, pos, chunk, w, scale,
                      skw_b, skw_h, skw_t, svw_b, svw_h, svw_t, ROWS: tl.constexpr, DK: tl.constexpr,
                      DKP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr, F32_DOT: tl.constexpr,
                      IEEE: tl.constexpr, N: tl.constexpr, NW: tl.constexpr, WCH: tl.constexpr, BN: tl.constexpr):
        """The window branch's partial over one chunk of the last w tokens, stored after S's."""
        start = pos - w + 1 + chunk * WCH
        m, l, acc = _attend_range(q_rd, kw_ptr + b * skw_b + h * skw_h, vw_ptr + b * svw_b + h * svw_h,
                                  skw_t, svw_t, tl.maximum(start, 0), tl.minimum(start + WCH, pos + 1), scale,
                                  ROWS, DK, DKP, DV, DVP, BN, F32_DOT, IEEE)
        _store_partial(m_c, l_c, acc_c, bh * (N + NW) + N + chunk, m, l, acc, ROWS, DVP)

    @triton.jit
    def _importance_kernel(
        fold_ptr, mt_ptr, m_a, l_a, pos_ptr, cand_ptr, arrived_ptr, blocks_ptr, Hkv, T, Tc, NS, NT,
        G: tl.constexpr, GP: tl.constexpr, ROWS: tl.constexpr, SPLITS: tl.constexpr, SPP: tl.constexpr,
        TI: tl.constexpr, JT: tl.constexpr, JTP: tl.constexpr, JS: tl.constexpr, KB: tl.constexpr,
        BCL: tl.constexpr, CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, SEL_BLOCK: tl.constexpr,
        N_INIT: tl.constexpr, N_LOCAL: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, NPROGP: tl.constexpr,
        ST: tl.constexpr, PDL: tl.constexpr, trace_ptr, TRACE: tl.constexpr,
    ):
        """Selection keys of the blocks of TI tiles and their top n (stored); the last program of
        a kv head to finish then picks the top n of those candidates (_top_n), or with ST each of
        S's programs does."""
        bh = tl.program_id(0)
        t_entry = global_time(bh) if TRACE else 0
        t0 = tl.program_id(1) * TI
        pos = _load_pos(pos_ptr, bh // Hkv, T)
        # Below: A's results.
        bh = bh + pdl_wait(tl.program_id(1), PDL)
        t_rel = global_time(bh) if TRACE else 0
        n_tiles = tl.cdiv(_n_visible(pos, Tc, CMP_BLOCK, CMP_STRIDE), BCL)
        # Importance 0 where nothing is visible (a tile's entries also reach the first blocks of
        # the next tile); keys -1 past the query's own block.
        g = tl.arange(0, GP)
        i = tl.arange(0, TI * JTP)
        t = t0 + i // JTP
        col = i % JTP
        # The folds of the tiles reaching these blocks, own (kk = 0) and previous (1; KB >= 2
        # always), are loaded before the lse's partials are used, so that all of them are one
        # round trip after the wait rather than two.
        m_0, f_0, ok_0 = _fold_loads(fold_ptr, mt_ptr, bh, t, col, g, n_tiles, NT, 0, G, JT, JS)
        m_1, f_1, ok_1 = _fold_loads(fold_ptr, mt_ptr, bh, t, col, g, n_tiles, NT, 1, G, JT, JS)
        # lse of each row from A's partials.
        sp = tl.arange(0, SPP)
        part = (bh * SPLITS + sp[:, None]) * ROWS + g[None, :]
        m_sg = tl.load(m_a + part, mask=sp[:, None] < SPLITS, other=float("-inf"))
        l_sg = tl.load(l_a + part, mask=sp[:, None] < SPLITS, other=0.0)
        m_g = tl.max(m_sg, axis=0)
        m_g = tl.where(m_g == float("-inf"), 0.0, m_g)
        den = tl.sum(l_sg * tl.exp(m_sg - m_g[None, :]), axis=0)
        lse = m_g + tl.log(tl.where(den > 0, den, 1.0))
        imp = (tl.sum(tl.where(ok_0, tl.exp(m_0 - lse[:, None]) * f_0, 0.0), axis=0)
               + tl.sum(tl.where(ok_1, tl.exp(m_1 - lse[:, None]) * f_1, 0.0), axis=0))
        for kk in tl.static_range(2, KB):
            m_k, f_k, ok_k = _fold_loads(fold_ptr, mt_ptr, bh, t, col, g, n_tiles, NT, kk, G, JT, JS)
            imp += tl.sum(tl.where(ok_k, tl.exp(m_k - lse[:, None]) * f_k, 0.0), axis=0)
        j = t * JT + col
        key = _sel_key(imp, j, pos // SEL_BLOCK, NS, N_INIT, N_LOCAL)
        key = tl.where(col < JT, key, -1)
        # (TRACE: the top n below starts here.)
        t_mid = global_time(tl.max(key, axis=0).to(tl.int32)) if TRACE else 0
        # Every key of the kv head's top n is among its program's top n.
        slot = tl.arange(0, NP)
        tl.store(cand_ptr + (bh * tl.num_programs(1) + tl.program_id(1)) * NP + slot, tl.topk(key, NP))
        if ST:
            store_trace(trace_ptr, t_entry, t_rel, t_mid, TRACE)
            return
        # The last program of this kv head to get here sees every candidate (the barrier orders
        # the program's stores before its count; acq_rel publishes them and acquires the others').
        tl.debug_barrier()
        done = tl.atomic_add(arrived_ptr + bh, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(1) - 1:
            _top_n(cand_ptr, blocks_ptr, bh, NS, tl.num_programs(1), N, NP, NPROGP)
        store_trace(trace_ptr, t_entry, t_rel, t_mid, TRACE)

    @triton.jit
    def _fold_loads(fold_ptr, mt_ptr, bh, t, col, g, n_tiles, NT, kk: tl.constexpr, G: tl.constexpr,
                    JT: tl.constexpr, JS: tl.constexpr):
        """(m_t, P_t[:, col + kk*JT], ok) [G', TI*JT'] of the tiles t - kk: tile t - kk's column
        col + kk*JT falls on block t*JT + col. Importance 0 where nothing is visible (a tile's
        entries also reach the first blocks of the next tile)."""
        src = t - kk
        t_ok = (src >= 0) & (src < n_tiles) & (col < JT) & (col + kk * JT < JS)
        row = (bh * NT + src).to(tl.int64)[None, :] * G + g[:, None]
        ok = (g[:, None] < G) & t_ok[None, :]
        m_t = tl.load(mt_ptr + row, mask=ok, other=0.0)
        folded = tl.load(fold_ptr + row * JS + (col + kk * JT)[None, :], mask=ok, other=0.0)
        return m_t, folded, ok

    @triton.jit
    def _sel_key(imp, j, own, NS, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr):
        """Selection keys of blocks j: score bits above the reversed block id, -1 where not valid."""
        valid = (j <= own) & (j < NS)
        forced = valid & ((j < N_INIT) | (j > own - N_LOCAL))
        score = tl.where(forced, float("inf"), imp)
        # Importance is >= 0, so its int32 bits order like the value; the reversed id below
        # makes keys unique with ties to the lower block id.
        key = score.to(tl.int32, bitcast=True).to(tl.int64) * 4294967296 + (NS - 1 - j)
        return tl.where(valid, key, -1)

    @triton.jit
    def _top_n(cand_ptr, blocks_ptr, bh, NS, NPROG, N: tl.constexpr, NP: tl.constexpr, NPROGP: tl.constexpr):
        """Top n of one kv head: a bitonic top n (tl.topk) of its programs' candidates, read at
        L2 (.cg) since other programs wrote them in this launch. A key holds its block id;
        invalid keys are negative, so slots they reach get -1."""
        slot = tl.arange(0, NP)
        tl.store(blocks_ptr + bh * N + slot, _top_blocks(cand_ptr, bh, NS, NPROG, NP, NPROGP), mask=slot < N)

    @triton.jit
    def _top_blocks(cand_ptr, bh, NS, NPROG, NP: tl.constexpr, NPROGP: tl.constexpr):
        """The block ids of one kv head's top n candidates (-1 for invalid keys), [NP], in the
        same order wherever it runs."""
        r = tl.arange(0, NPROGP)
        slot = tl.arange(0, NP)
        cand = tl.load(cand_ptr + (bh * NPROG + r[:, None]) * NP + slot[None, :], mask=(r < NPROG)[:, None],
                       other=-1, cache_modifier=".cg")
        top = tl.topk(tl.reshape(cand, [NPROGP * NP]), NP)
        return tl.where(top >= 0, NS - 1 - top % 4294967296, -1)

    @triton.jit
    def _sel_win_kernel(
        q_ptr, k_ptr, v_ptr, kw_ptr, vw_ptr, pos_ptr, blocks_ptr, cand_ptr, m_c, l_c, acc_c, Hkv, T, w, scale, NS,
        NPROG,
        sq_b, sq_h, sq_g, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, skw_b, skw_h, skw_t, svw_b, svw_h, svw_t,
        G: tl.constexpr, ROWS: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr, DV: tl.constexpr,
        DVP: tl.constexpr, F32_DOT: tl.constexpr, IEEE: tl.constexpr, N: tl.constexpr, NW: tl.constexpr,
        WCH: tl.constexpr, SEL_BLOCK: tl.constexpr, BN: tl.constexpr, WS: tl.constexpr, ST: tl.constexpr,
        NP: tl.constexpr, NPROGP: tl.constexpr, PDL: tl.constexpr, trace_ptr, TRACE: tl.constexpr,
    ):
        """With WS, programs part < NW take the window chunks, which need nothing of B and never
        wait for it (first in the grid, so that they are dispatched before the programs waiting
        for B); the others the selected block B chose in slot part - NW. Without WS, only those."""
        bh = tl.program_id(0)
        t_entry = global_time(bh) if TRACE else 0
        t_rel = t_entry
        t_mid = t_entry
        part = tl.program_id(1) - (NW if WS else 0)
        b = (bh // Hkv).to(tl.int64)
        h = bh % Hkv
        pos = _load_pos(pos_ptr, b, T)
        q_rd = _load_q(q_ptr, b, h, sq_b, sq_h, sq_g, G, ROWS, DK, DKP)
        if part >= 0:
            zw = pdl_wait(part, PDL)
            if TRACE:
                t_rel = global_time(zw)
            if ST:
                # B stored each of its programs' top n: every program of the kv head takes the
                # same top n of them and attends over the block in its slot (and stores its id).
                top = _top_blocks(cand_ptr, bh + zw, NS, NPROG, NP, NPROGP)
                blk = tl.sum(tl.where(tl.arange(0, NP) == part, top, 0))
                tl.store(blocks_ptr + bh * N + part, blk)
            else:
                blk = tl.load(blocks_ptr + (bh + zw) * N + part)
            if TRACE:
                # The block is known here: its tokens' loads and attention follow.
                t_mid = global_time(blk.to(tl.int32))
            lo = tl.maximum(blk, 0) * SEL_BLOCK
            hi = tl.where(blk >= 0, tl.minimum(lo + SEL_BLOCK, pos + 1), lo)
            m, l, acc = _attend_range(q_rd, k_ptr + b * sk_b + h * sk_h, v_ptr + b * sv_b + h * sv_h, sk_t, sv_t,
                                      lo, hi, scale, ROWS, DK, DKP, DV, DVP, BN, F32_DOT, IEEE)
            _store_partial(m_c, l_c, acc_c, bh * (N + NW) + part, m, l, acc, ROWS, DVP)
        else:
            _window_chunk(q_rd, kw_ptr, vw_ptr, m_c, l_c, acc_c, b, h, bh, pos, part + NW, w, scale,
                          skw_b, skw_h, skw_t, svw_b, svw_h, svw_t, ROWS, DK, DKP, DV, DVP, F32_DOT, IEEE, N, NW,
                          WCH, BN)
        store_trace(trace_ptr, t_entry, t_rel, t_mid, TRACE)

    @triton.jit
    def _merge(m_ptr, l_ptr, acc_ptr, first, last, PP: tl.constexpr, ROWS: tl.constexpr, DVP: tl.constexpr):
        """Softmax-merges the flash partials first..last-1 of one row (pointers at that row): [DVP].
        Loads at L2 (.cg): with PDL, D merges A's partials while S still runs."""
        i = tl.arange(0, PP)
        ok = (i >= first) & (i < last)
        m = tl.load(m_ptr + i * ROWS, mask=ok, other=float("-inf"), cache_modifier=".cg")
        top = tl.max(m, axis=0)
        wt = tl.where(ok, tl.exp(m - tl.where(top == float("-inf"), 0.0, top)), 0.0)
        den = tl.sum(tl.load(l_ptr + i * ROWS, mask=ok, other=0.0, cache_modifier=".cg") * wt, axis=0)
        acc = tl.load(acc_ptr + i[:, None] * (ROWS * DVP) + tl.arange(0, DVP)[None, :], mask=ok[:, None], other=0.0,
                      cache_modifier=".cg")
        # No visible key (the cmp branch before the first block): the branch gives 0.
        return tl.sum(acc * wt[:, None], axis=0) / tl.where(den > 0, den, 1.0)

    @triton.jit
    def _combine_kernel(
        m_a, l_a, acc_a, m_c, l_c, acc_c, gates_ptr, o_ptr, pos_ptr, B,
        ADVANCE: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr, SPLITS: tl.constexpr,
        SPP: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, NPP: tl.constexpr, PDL: tl.constexpr, trace_ptr,
        TRACE: tl.constexpr,
    ):
        bh = tl.program_id(0)
        g = tl.program_id(1)
        t_entry = global_time(bh) if TRACE else 0
        ra = bh * SPLITS * ROWS + g
        # A finished before S started, so its partials merge while S runs; S's after the wait.
        o_cmp = _merge(m_a + ra, l_a + ra, acc_a + ra * DVP, 0, SPLITS, SPP, ROWS, DVP)
        # The gates, and pos where this program advances it, come from before the op: read
        # before the wait too, so that only S's partials are a round trip after it.
        gate = gates_ptr + (bh * G + g) * 3
        g_cmp = tl.load(gate).to(tl.float32)
        g_sel = tl.load(gate + 1).to(tl.float32)
        g_win = tl.load(gate + 2).to(tl.float32)
        advance = ADVANCE & (bh == 0) & (g == 0)
        bb = tl.arange(0, 128)
        pos0 = tl.load(pos_ptr + bb, mask=(bb < B) & advance, other=0)
        z = pdl_wait(g, PDL)
        t_rel = global_time(z) if TRACE else 0
        bh = bh + z
        rc = bh * NP * ROWS + g
        o_sel = _merge(m_c + rc, l_c + rc, acc_c + rc * DVP, 0, N, NPP, ROWS, DVP)
        o_win = _merge(m_c + rc, l_c + rc, acc_c + rc * DVP, N, NP, NPP, ROWS, DVP)
        o = g_cmp * o_cmp + g_sel * o_sel + g_win * o_win
        dv = tl.arange(0, DVP)
        tl.store(o_ptr + (bh * G + g) * DV + dv, o.to(o_ptr.dtype.element_ty), mask=dv < DV)
        # A, B and S, the readers of pos, are done: kernels of one stream run in order.
        tl.store(pos_ptr + bb + z, pos0 + 1, mask=(bb < B) & advance)
        if advance:
            for b0 in range(128, B, 128):
                tl.store(pos_ptr + b0 + bb + z, tl.load(pos_ptr + b0 + bb + z, mask=b0 + bb < B) + 1,
                         mask=b0 + bb < B)
        store_trace(trace_ptr, t_entry, t_rel, t_rel, TRACE)
