"""Where does the decode bench's illegal memory access come from? Each variant in its own process.

    PYTHONPATH=. python3 bench/pdl_debug_gpu.py [variant]
"""
import subprocess
import sys
import traceback

import torch

VARIANTS = ["all", "no_cs", "no_dec", "none", "ws0", "all_eager"]


def run(variant: str, B: int, T: int) -> None:
    from nsa_flex.bench import decode as bd
    from nsa_flex.ops import decode_triton
    from nsa_flex.config import NSAConfig

    real = decode_triton.pdl_launch

    def patched(device, wanted):
        caller = sys._getframe(1).f_code.co_name
        off = (variant == "none" or (variant == "no_cs" and caller == "_cache_step_triton")
               or (variant == "no_dec" and caller == "decode_attend_triton"))
        return real(device, wanted and not off)

    decode_triton.pdl_launch = patched
    if variant == "ws0":
        real_lc = decode_triton.launch_config
        decode_triton.launch_config = lambda *a: {**real_lc(*a), "WS": 0}
    cfg = bd.decode_config(device="cuda", contexts=(T,), batches=(B,))
    prob = bd._Problem(cfg, B, T)
    if variant == "ro":
        import time
        from torch._dynamo.utils import counters
        torch._logging.set_logs(perf_hints=True)
        fn = torch.compile(prob.nsa_step, mode="reduce-overhead", fullgraph=True)
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        print(f"RESULT ro B={B} T={T}: {(time.perf_counter() - start) / 50 * 1e6:.1f} us/call host;"
              f" inductor counters {dict(counters['inductor'])}", flush=True)
        return
    fn = prob.nsa_step if variant == "all_eager" else torch.compile(prob.nsa_step, fullgraph=True)
    stage = "first call"
    try:
        fn(); torch.cuda.synchronize()
        stage = "graph"
        t = bd.graph_step_times(fn, prob.reset, steps=10, reps=3, replays=10); torch.cuda.synchronize()
        stage = "profile"
        bd.kernel_profile(fn, prob.reset); torch.cuda.synchronize()
        print(f"RESULT {variant} B={B} T={T}: ok, {1e3 * sorted(t)[1]:.1f} us/step", flush=True)
    except Exception as exc:
        print(f"RESULT {variant} B={B} T={T}: FAILED at {stage}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] != "--variants":
        run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    else:
        for v in (sys.argv[2:] if len(sys.argv) > 1 else VARIANTS):
            for B, T in ((1, 8192),):
                out = subprocess.run([sys.executable, __file__, v, str(B), str(T)], capture_output=True, text=True,
                                     timeout=200)
                lines = [l for l in (out.stdout + out.stderr).splitlines()
                         if "RESULT" in l or "Error" in l or "skipping" in l.lower()]
                print("\n".join(lines[-3:]) or out.stderr[-500:], flush=True)
