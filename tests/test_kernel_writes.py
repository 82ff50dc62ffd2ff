"""What torch.compile believes each traced Triton kernel of the op writes.

Under torch.compile a wrap_triton launch's written tensors come from Inductor's analysis of the
kernel's Triton IR (torch._higher_order_ops.triton_kernel_wrap.identify_accessed_tensors). Where
that analysis loses track of a pointer it counts a tensor the kernel only reads as written, and
an input that requires grad counted so (q, k, v, the gates) fails the whole op's compile on the
GPU ("a leaf Variable that requires grad is being used in an in-place operation"): a kernel
that stored its results under a constexpr branch once did that to the gated sum's backward.

The analysis needs the kernels as JIT functions, not Triton's interpreter's, and a GPU target:
so a subprocess without TRITON_INTERPRET runs the op's own launch functions (window, selected,
gated sum, fold, selection, and the gated node's backward) on small CPU tensors, with Triton's
driver answering for an sm_90 GPU, analyses each launch instead of running it and reports the op
inputs it would count as written. No GPU and no kernel run is needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r'''
import importlib, json, logging, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
import torch._higher_order_ops.triton_kernel_wrap as tkw


class Sm90:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0


triton.runtime.driver.set_active(Sm90())
fell_back = []


class Catch(logging.Handler):
    def emit(self, record):
        if "assuming every input is mutated" in record.getMessage():
            fell_back.append(record.getMessage())


logging.getLogger(tkw.__name__).addHandler(Catch())

from nsa_flex import NSAConfig
from nsa_flex.bench.selected import random_selection
from nsa_flex.folded import fold

win = importlib.import_module("nsa_flex.ops.window")
sl = importlib.import_module("nsa_flex.ops.selected_attention.launch")
gs = importlib.import_module("nsa_flex.ops.gated_sum")
fo = importlib.import_module("nsa_flex.ops.fold")
sk = importlib.import_module("nsa_flex.ops.select.kernels")

inputs = {}
rows = []


def analyse(kernel, args, kwargs):
    names = kernel.arg_names
    kw = dict(zip(names, args))
    kw.update({k: v for k, v in kwargs.items() if k in names})
    if "F32_DOT" in kw:
        kw["F32_DOT"] = False
    writes = {d.name for d in tkw.identify_accessed_tensors(kernel, kw, {}).read_writes.writes}
    bad = sorted(n for n in writes if any(kw[n] is x for x in inputs.values()))
    rows.append({"kernel": kernel.fn.__name__, "writes": sorted(writes), "inputs_written": bad})


class Record:
    def __call__(self, kernel):
        class Grid:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: analyse(kernel, args, kwargs)
        return Grid()


record = Record()
for mod in (win, sl, gs, fo):
    mod.wrap_triton = record
capped = lambda kernel, grid, *args, writes=(), **kwargs: analyse(kernel, args, kwargs)
sl.launch = capped
sk.launch_kernel = capped

B, T, Hkv, G, D, L = 1, 512, 2, 4, 64, 64
cfg = NSAConfig(n_heads=G * Hkv, n_kv_heads=Hkv, head_dim=D, head_dim_v=D)
bf = torch.bfloat16
q = torch.randn(B, T, G * Hkv, D, dtype=bf)
k, v = torch.randn(B, T, Hkv, D, dtype=bf), torch.randn(B, T, Hkv, D, dtype=bf)
do = torch.randn(B, T, G * Hkv, D, dtype=bf)
gates = torch.rand(B, T, G * Hkv, 3, dtype=bf)
qf = fold(q, Hkv)
cmp_rows = torch.randn(B, Hkv, T * G, D, dtype=bf)
k_cmp = torch.randn(B, T // 16 - 1, Hkv, D, dtype=bf)
lse_cmp = torch.randn(B, G * Hkv, T)
inputs.update(q=q, k=k, v=v, do=do, gates=gates, qf=qf, cmp_rows=cmp_rows, k_cmp=k_cmp, lse_cmp=lse_cmp)
scale = D ** -0.5
wcfg = win.launch_config(D, D)

fo._fold_impl(q, Hkv, T * G, "triton")
o_win, lse_win, o_loc, lse_loc = win.forward(qf, k, v, G, cfg.window, scale, wcfg, L)
inputs.update(o_win=o_win, lse_win=lse_win)
win.backward(fold(do, Hkv), qf, k, v, o_win, lse_win, G, cfg.window, scale, wcfg)
sel = random_selection(B, Hkv, T, cfg, "cpu")
inputs["sel"] = sel
o_sel, lse_sel = sl.forward(qf, k, v, sel, None, scale, L, q_heads=G * Hkv, local=(o_loc, lse_loc))
inputs.update(o_sel=o_sel, lse_sel=lse_sel)
sl.backward(do, qf, k, v, o_sel, lse_sel, sel, None, scale, L, q_heads=G * Hkv)
sl.forward_gated(qf, k, v, sel, None, scale, L, cmp_rows, 0, o_win, gates, q_heads=G * Hkv)
gs._forward_impl(cmp_rows, 0, o_sel, o_win, gates, "triton")
gs._backward_impl(do, cmp_rows, 0, o_sel, o_win, gates, "triton")
sk.select_blocks_triton(q, k_cmp, lse_cmp, None, None, scale, cfg)
# nsa_flex::gated_branches' backward: the gated sum's deltas, the window's and the selected op's kernels from dO.
gs.backward_deltas(do, cmp_rows, 0, o_sel, o_win, gates, cmp_apart=True)
d_cmp, d_gates, delta_sel, delta_win, gate_sel, gate_win = gs.backward_deltas(do, cmp_rows, 0, o_sel, o_win, gates)
grads = win.backward(do, qf, k, v, o_win, lse_win, G, cfg.window, scale, wcfg, gate=gate_win, delta=delta_win,
                     sel=(lse_sel, delta_sel, gate_sel, L))
# With the grouped compressed call's dQ added (its rows read, never written).
dq4 = torch.randn(B * Hkv, 16 * G, T // 16 - 1, D, dtype=bf)
inputs["dq4"] = dq4
win.backward(do, qf, k, v, o_win, lse_win, G, cfg.window, scale, wcfg, gate=gate_win, delta=delta_win,
             sel=(lse_sel, delta_sel, gate_sel, L), add=([(0, dq4)], 15 * G))
grads = tuple(torch.zeros_like(x) for x in (qf, k, v))
sl.backward(do, qf, k, v, o_sel, lse_sel, sel, None, scale, L, q_heads=G * Hkv, gate=gate_sel, delta=delta_sel,
            skip_local=True, acc=grads)
print(json.dumps({"rows": rows, "fell_back": fell_back}))
'''


def _analysis() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=1200)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def analysis() -> dict:
    pytest.importorskip("triton")
    tkw = pytest.importorskip("torch._higher_order_ops.triton_kernel_wrap")
    if not hasattr(tkw, "identify_accessed_tensors"):
        pytest.skip("this torch has no identify_accessed_tensors")
    return _analysis()


def test_no_traced_kernel_counts_an_input_as_written(analysis):
    assert not analysis["fell_back"], analysis["fell_back"]
    bad = [r for r in analysis["rows"] if r["inputs_written"]]
    assert not bad, bad


def test_every_launch_of_the_op_was_analysed(analysis):
    """The launches above reach every kernel the compiled op traces (a renamed or bypassed launch
    would leave its kernel unchecked)."""
    seen = {r["kernel"] for r in analysis["rows"]}
    assert {"_fold_kernel", "_fwd_kernel", "_dq_kernel", "_dkdv_kernel", "_bwd_kernel", "_delta_kernel",
            "_slot_kernel", "_block_sum_kernel", "_slot_gated_kernel", "_sum_kernel", "_sum_bwd_kernel",
            "_select_kernel", "_sum_deltas_kernel"} <= seen, seen
    # The analysis itself: the window's dQ kernel writes dQ and delta, nothing else; in the gated
    # node's mode (delta given) dQ alone, with rows added too (their X is read).
    dq = [r["writes"] for r in analysis["rows"] if r["kernel"] == "_dq_kernel"]
    assert dq == [["DELTA", "DQ"], ["DQ"], ["DQ"]], dq


def test_selected_kernels_count_only_their_outputs_as_written(analysis):
    """The selected op's Triton forward and backward write their partials, dK / dV and the sums,
    and not the index arrays they read (entries, items, block bounds), which the gated node saves
    for its backward."""
    fwd = [r for r in analysis["rows"] if r["kernel"] == "_fwd_kernel" and "po_ptr" in r["writes"]]
    bwd = [r for r in analysis["rows"] if r["kernel"] == "_bwd_kernel"]
    assert len(fwd) >= 2 and len(bwd) >= 2, analysis["rows"]
    assert all(set(r["writes"]) == {"po_ptr", "plse_ptr"} for r in fwd), fwd
    outputs = {"dqp_ptr", "dkp_ptr", "dvp_ptr", "dk_ptr", "dv_ptr", "dk_sum_ptr", "dv_sum_ptr"}
    assert all(set(r["writes"]) <= outputs for r in bwd), bwd


def test_slot_kernels_count_only_their_outputs_as_written(analysis):
    """The merges and dQ sums write their outputs (and the merge its lse), and not the block-id rows
    they read: a pointer handed to a helper whose results address a store would count as written,
    and Inductor would treat the saved index as mutated."""
    slots = [r for r in analysis["rows"] if r["kernel"] in ("_slot_kernel", "_slot_gated_kernel")]
    assert len(slots) >= 4, slots
    assert all(set(r["writes"]) <= {"out_ptr", "lse_ptr"} and "out_ptr" in r["writes"] for r in slots), slots
