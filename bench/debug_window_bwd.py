"""GPU debug: which BlockMask construction gives right dK/dV for the folded window branch."""
import json, os, sys, time
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from nsa_flex.flex import tuning
from nsa_flex.flex.masks import window_block_mask
from nsa_flex.flex.masks.window import window_mask_mod

tuning.install_flex_tuning()
out = {}


def oracle(q, k, v, W, G, scale):
    qd, kd, vd = (x.double() for x in (q, k, v))
    rows, T = q.shape[2], k.shape[2]
    t = torch.arange(rows, device=q.device) // G
    s = torch.arange(T, device=q.device)
    m = (s[None] <= t[:, None]) & (t[:, None] - s[None] < W)
    sc = (qd @ kd.transpose(-1, -2)) * scale
    p = sc.masked_fill(~m, float("-inf")).softmax(-1)
    return p @ vd


def variant(name, mask, q, k, v, G, W, scale, compiled):
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    fn = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    o = fn(qq, kk, vv, block_mask=mask, scale=scale)
    go = torch.randn_like(o)
    o.backward(go)
    qr, kr, vr = (x.detach().clone().double().requires_grad_() for x in (q, k, v))
    orf = oracle(qr, kr, vr, W, G, scale)
    orf.backward(go.double())
    rel = lambda a, b: float((a.double() - b).norm() / b.norm().clamp_min(1e-30))
    return dict(o=rel(o, orf), dq=rel(qq.grad, qr.grad), dk=rel(kk.grad, kr.grad), dv=rel(vv.grad, vr.grad))


for (G, Hkv, T, D, dt, W) in [(8, 1, 200, 64, torch.float32, 128), (16, 4, 1000, 128, torch.bfloat16, 512),
                              (4, 4, 2048, 128, torch.bfloat16, 512)]:
    torch.manual_seed(0)
    dev = "cuda"
    rows = T * G
    q = torch.randn(1, Hkv, rows, D, device=dev, dtype=dt)
    k = torch.randn(1, T, Hkv, D, device=dev, dtype=dt).transpose(1, 2)
    v = torch.randn(1, T, Hkv, D, device=dev, dtype=dt).transpose(1, 2)
    scale = D ** -0.5
    mm = window_mask_mod(W, G)
    ours = window_block_mask(T, W, dev, (128, 128), G)
    cbm = create_block_mask(mm, 1, 1, rows, T, device=dev, BLOCK_SIZE=128, _compile=True)
    fkv = BlockMask.from_kv_blocks(ours.kv_num_blocks, ours.kv_indices, ours.full_kv_num_blocks, ours.full_kv_indices,
                                   BLOCK_SIZE=(128, 128), mask_mod=mm, seq_lengths=(rows, T))
    nofull = BlockMask.from_kv_blocks(cbm.kv_num_blocks, cbm.kv_indices, None, None, BLOCK_SIZE=(128, 128),
                                      mask_mod=mm, seq_lengths=(rows, T))
    # the same kv-side lists with everything partial: merge full into partial via create_block_mask of the mask
    key = f"G{G}_Hkv{Hkv}_T{T}_D{D}_{str(dt)[6:]}"
    out[key] = {}
    for name, m in [("ours", ours), ("create_block_mask", cbm), ("from_kv_blocks(ours)", fkv), ("cbm_no_full", nofull)]:
        for compiled in (True, False):
            try:
                r = variant(name, m, q, k, v, G, W, scale, compiled)
            except Exception as e:
                r = {"error": repr(e)[:300]}
            out[key][f"{name}{'' if compiled else ' eager'}"] = r
            print(key, name, "compiled" if compiled else "eager", r, flush=True)
    # compare ours vs cbm lists
    same = {}
    for attr in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        a, b = getattr(ours, attr), getattr(cbm, attr)
        same[attr] = bool(torch.equal(a.cpu(), b.cpu())) if a is not None and b is not None else f"{a is None} {b is None}"
    out[key]["lists_equal"] = same
    print(key, same, flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "debug_window_bwd.json"), "w"), indent=1)
