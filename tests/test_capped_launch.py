"""nsa_flex.ops.capped_launch: a launch with a register cap runs through the opaque op
nsa_flex::capped_launch (so torch.compile keeps the cap), with its arguments intact; an uncapped
launch stays a traced wrap_triton launch. Runs on CUDA or under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from interpreter import QUIET_NUMPY, interpreter_skip
from nsa_flex.ops.capped_launch import TmaView, launch, tma_descriptor

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _affine_kernel(x_ptr, y_ptr, flag_ptr, n, a, b, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
        """y = a * x + b (+ 1 with SHIFT) on the first n elements; program 0 sets flag[0] = n."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        y = tl.load(x_ptr + i, mask=i < n) * a + b
        if SHIFT:
            y += 1.0
        tl.store(y_ptr + i, y, mask=i < n)
        if tl.program_id(0) == 0:
            tl.store(flag_ptr, n)


def _device() -> str | None:
    if triton is not None and torch.cuda.is_available():
        return "cuda"
    if interpreter_skip(globals().get("_affine_kernel")) is None:
        return "cpu"
    return None


DEVICE = _device()
pytestmark = [pytest.mark.skipif(DEVICE is None, reason="needs CUDA and Triton, or Triton's interpreter"), QUIET_NUMPY]


def affine(x: torch.Tensor, a: float, b: float, maxnreg: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.numel() - 3  # the last three elements stay as written here: the kernel honours n
    y = torch.full_like(x, -7.0)
    flag = torch.zeros(1, dtype=torch.int32, device=x.device)
    launch(_affine_kernel, (triton.cdiv(n, 32),), x, y, flag, n, a, b, writes=(y, flag), SHIFT=True, BLOCK=32,
           maxnreg=maxnreg)
    return y, flag


# As the package's ops do: the launch inside a triton_op, which torch.compile traces below Dynamo.
if triton is not None:
    torch.library.triton_op("nsa_flex_test::affine", mutates_args=())(affine)

    @torch.library.register_fake("nsa_flex_test::affine")
    def _affine_fake(x, a, b, maxnreg):
        return torch.empty_like(x), x.new_empty(1, dtype=torch.int32)


@pytest.mark.parametrize("maxnreg", [0, 96])
def test_launch_passes_every_argument(maxnreg):
    x = torch.randn(200, device=DEVICE)
    y, flag = affine(x, 0.3125, -2.5, maxnreg)
    torch.testing.assert_close(y[:-3], x[:-3] * 0.3125 - 1.5, rtol=0, atol=1e-6)
    assert (y[-3:] == -7.0).all() and flag.item() == 197


def test_capped_launch_is_one_opaque_op_under_compile():
    """Traced fullgraph, the capped launch is the op nsa_flex::capped_launch, with the cap in its
    spec; the compiled result equals the eager one."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    backend = AotEagerAndRecordGraphs()
    compiled = torch.compile(lambda x: torch.ops.nsa_flex_test.affine(x.sin(), 2.0, 0.5, 96), backend=backend,
                             fullgraph=True)
    x = torch.randn(100, device=DEVICE)
    got, want = compiled(x), affine(x.sin(), 2.0, 0.5, 96)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    graph = "\n".join(g.print_readable(print_output=False) for g in backend.fw_graphs)
    assert "nsa_flex.capped_launch" in graph and "('maxnreg', 96)" in graph


@pytest.mark.gpu
def test_launch_traced_by_dynamo_stays_wrap_triton():
    """Compiled directly (Dynamo traces launch() itself), the launch is a plain traced one. GPU only:
    Dynamo cannot trace a wrap_triton launch of an interpreted kernel."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    backend = AotEagerAndRecordGraphs()
    compiled = torch.compile(lambda x: affine(x.cos(), -1.0, 0.25, 96), backend=backend, fullgraph=True)
    x = torch.randn(100, device=DEVICE)
    torch.testing.assert_close(compiled(x), affine(x.cos(), -1.0, 0.25, 96), rtol=0, atol=0)
    graph = "\n".join(g.print_readable(print_output=False) for g in backend.fw_graphs)
    assert "nsa_flex.capped_launch" not in graph and "triton_kernel_wrapper" in graph


@pytest.mark.gpu
def test_capped_launch_under_inductor_keeps_cap_and_writes_in_place():
    """Inductor calls the op with the cap and writes the kernel's outputs in place (no copies)."""
    from torch._inductor.utils import run_and_get_code

    x = torch.randn(4096, device=DEVICE)
    compiled = torch.compile(lambda x: torch.ops.nsa_flex_test.affine(x, 2.0, 0.5, 96), fullgraph=True)
    got, codes = run_and_get_code(compiled, x)
    torch.testing.assert_close(got, affine(x, 2.0, 0.5, 96), rtol=0, atol=0)
    code = "\n".join(codes)
    assert "nsa_flex.capped_launch" in code and "('maxnreg', 96)" in code
    assert "copy_" not in code and "clone" not in code


def test_errors():
    x = torch.randn(8, device=DEVICE)
    y = torch.empty_like(x)
    flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"writes\[1\] is not among the kernel's arguments"):
        launch(_affine_kernel, (1,), x, y, flag, 8, 1.0, 0.0, writes=(y, torch.empty(1)), SHIFT=False, BLOCK=32,
               maxnreg=96)
    with pytest.raises(TypeError, match="launch argument of type str; allowed: tensors, TmaView, None, bool, int"):
        launch(_affine_kernel, (1,), x, y, flag, "8", 1.0, 0.0, writes=(y, flag), SHIFT=False, BLOCK=32, maxnreg=96)

    with pytest.raises(TypeError, match="constexpr or launch option of type object; allowed: bool, int, float, str"):
        launch(_affine_kernel, (1,), x, y, flag, 8, 1.0, 0.0, writes=(y, flag), SHIFT=object(), BLOCK=32, maxnreg=96)
    # A constexpr that does not survive repr / literal_eval fails when the call is traced, not later.
    with pytest.raises(ValueError, match="capped launch spec .* is not a Python literal"):
        launch(_affine_kernel, (1,), x, y, flag, 8, 1.0, 0.0, writes=(y, flag), SHIFT=False, BLOCK=32, maxnreg=96,
               EPS=float("inf"))

    @triton.jit
    def local_kernel(x_ptr):
        pass

    with pytest.raises(ValueError, match="an opaque launch needs a module-level kernel"):
        launch(local_kernel, (1,), x, maxnreg=96)


def test_tma_views_need_an_opaque_launch():
    x = torch.randn(64, device=DEVICE)
    with pytest.raises(ValueError, match="a TmaView argument needs an opaque launch"):
        launch(_affine_kernel, (1,), TmaView(x, (8, 8), (8, 1), (8, 8)), x, x, 8, 1.0, 0.0, writes=(x,), SHIFT=False,
               BLOCK=32)


def test_tma_descriptor_of_an_unaligned_view_is_a_copy():
    """TMA reads from a 16-byte aligned base: a view that starts 2 bytes in is copied (same values),
    an aligned one is used in place."""
    pytest.importorskip("triton.experimental.gluon")
    buf = torch.arange(8 * 65, dtype=torch.bfloat16)
    aligned = tma_descriptor(TmaView(buf, (8, 64), (64, 1), (8, 64)))
    assert aligned.base.data_ptr() == buf.data_ptr()
    view = buf[1:513]
    desc = tma_descriptor(TmaView(view, (8, 64), (64, 1), (8, 64)))
    assert desc.base.data_ptr() % 16 == 0 and torch.equal(desc.base, view)
    with pytest.raises(TypeError, match=r"TMA view of a torch.int32 tensor; allowed: torch.bfloat16"):
        tma_descriptor(TmaView(buf.int(), (8, 64), (64, 1), (8, 64)))
