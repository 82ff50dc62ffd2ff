"""Triton launches that keep their register cap (maxnreg) under torch.compile.

Inside a triton_op, torch.compile traces a wrap_triton launch, and Inductor then launches the
kernel itself from configs it builds out of num_warps and num_stages: a maxnreg given at launch
is dropped without a word (torch 2.11; docs/decisions.md, "Register caps under torch.compile").
So launch() sends a capped launch through nsa_flex::capped_launch, a custom_op that Inductor
calls as an opaque function, whose body launches with Triton's own launcher; uncapped launches
stay traced (wrap_triton), which costs less host time.
"""

# No `from __future__ import annotations` here: torch.library reads the op's annotations.
import ast
import functools
import importlib
from typing import NamedTuple

import torch
from torch import Tensor
from torch.library import custom_op

from nsa_flex.ops.triton_utils import HAS_TRITON

if HAS_TRITON:
    from torch.library import wrap_triton


class TmaView(NamedTuple):
    """A Gluon kernel's TMA descriptor argument: `tensor` (read, 16-bit or fp32) seen as `shape` with
    `strides` (elements, the last 1), loaded in tiles of `block`. launch() sends it through the
    opaque op, whose body makes the descriptor (tma_descriptor) from the real tensor."""

    tensor: Tensor
    shape: tuple
    strides: tuple
    block: tuple


def tma_descriptor(view: TmaView):
    """The Hopper TensorDescriptor of view, with the shared-memory layout Gluon picks for its block.
    TMA needs a 16-byte aligned base: a tensor that starts elsewhere (a view at an odd offset) is
    copied first, same values."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    t = view.tensor
    if t.dtype not in _TMA_DTYPES:
        raise TypeError(f"TMA view of a {t.dtype} tensor; allowed: {', '.join(map(str, _TMA_DTYPES))}")
    if t.data_ptr() % 16:
        t = t.clone()
    return TensorDescriptor(t, list(view.shape), list(view.strides), list(view.block),
                            _tma_layout(tuple(view.block), t.dtype))


_TMA_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.lru_cache(maxsize=64)
def _tma_layout(block: tuple, dtype: torch.dtype):
    """The shared-memory layout Gluon picks for a TMA tile (made once per tile and dtype: launches
    make descriptors on every call)."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(list(block), getattr(gl, str(dtype).removeprefix("torch.")))


def launch(kernel, grid, *args, writes=(), opaque: bool = False, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), traceable by torch.compile, with kwargs["maxnreg"] honoured.

    The ops call this from their triton_op bodies, which torch.compile traces below Dynamo. Where
    Dynamo itself traces the launch (a caller compiling these launch functions directly) it
    cannot read the kernel's name, so the launch stays a wrap_triton one, uncapped.

    kernel: a module-level @triton.jit (or @gluon.jit) function. args: tensors, TmaView (opaque
    launches only), None, bools, ints and floats. opaque: through the opaque op even without a
    cap (a Gluon kernel, which Inductor cannot launch).
    writes: the tensors among args that the kernel stores to (a capped launch declares them to
    torch.library; the other tensors are only read). kwargs: constexprs and launch options, all
    plain values (bool, int, float, str, None); maxnreg 0 or None means no cap.
    """
    if not kwargs.get("maxnreg"):
        kwargs.pop("maxnreg", None)
    if not opaque and any(isinstance(a, TmaView) for a in args):
        raise ValueError(f"{kernel.fn.__name__}: a TmaView argument needs an opaque launch (opaque=True)")
    if opaque and torch.compiler.is_dynamo_compiling():
        raise RuntimeError(f"{kernel.fn.__name__}: an opaque launch cannot be traced by Dynamo itself; "
                           "call it from a torch.library op")
    if ("maxnreg" not in kwargs and not opaque) or torch.compiler.is_dynamo_compiling():
        wrap_triton(kernel)[tuple(grid)](*args, **kwargs)
        return
    name = f"{kernel.fn.__module__}:{kernel.fn.__name__}"
    if _kernel(name) is not kernel:
        raise ValueError(f"an opaque launch needs a module-level kernel, got {name}")
    # Constexprs and launch options must be concrete: a symbolic one (an int argument torch.compile
    # made dynamic) is specialised here, under a guard.
    kwargs = {k: _concrete(v) for k, v in kwargs.items()}
    written = list(writes)
    reads, ints, floats, spec = [], [], [], []
    for a in args:
        if isinstance(a, TmaView):
            spec.append(("d", len(reads), *(tuple(int(x) for x in part) for part in a[1:])))
            reads.append(a.tensor)
        elif isinstance(a, Tensor):
            w = next((i for i, x in enumerate(written) if x is a), None)
            spec.append(("r", len(reads)) if w is None else ("w", w))
            if w is None:
                reads.append(a)
        elif a is None or isinstance(a, bool):
            spec.append(("c", a))
        elif isinstance(a, (int, torch.SymInt)):
            spec.append(("i", len(ints)))
            ints.append(a)
        elif isinstance(a, (float, torch.SymFloat)):
            spec.append(("f", len(floats)))
            floats.append(a)
        else:
            raise TypeError(f"launch argument of type {type(a).__name__}; allowed: tensors, TmaView, None, bool, "
                            "int, float")
    missing = [i for i, x in enumerate(written) if not any(x is a for a in args)]
    if missing:
        raise ValueError(f"writes[{missing[0]}] is not among the kernel's arguments")
    encoded = repr((tuple(spec), tuple(kwargs.items())))
    _decode(encoded)  # at trace time: a value that does not survive the round trip fails here, not in the graph
    torch.ops.nsa_flex.capped_launch(name, list(grid), reads, written, ints, floats, encoded)


def _concrete(v):
    """A constexpr's value as a plain Python literal (symbolic ones specialised)."""
    if v is None or isinstance(v, str):
        return v
    for types, py in (((bool, torch.SymBool), bool), ((int, torch.SymInt), int), ((float, torch.SymFloat), float)):
        if isinstance(v, types):
            return py(v)
    raise TypeError(f"constexpr or launch option of type {type(v).__name__}; allowed: bool, int, float, str, None")


@functools.lru_cache(maxsize=None)
def _kernel(name: str):
    module, attr = name.split(":")
    return getattr(importlib.import_module(module), attr, None)


# needs_exact_strides: the launch's strides are numbers fixed when torch.compile traced the call,
# so the tensors must keep exactly those strides.
_TAGS = tuple(getattr(torch.Tag, t) for t in ("needs_exact_strides",) if hasattr(torch.Tag, t))


@custom_op("nsa_flex::capped_launch", mutates_args=("written",), tags=_TAGS)
def _capped_launch(kernel: str, grid: list[int], reads: list[Tensor], written: list[Tensor], ints: list[int],
                   floats: list[float], spec: str) -> None:
    """Launch `kernel` (module:name) with the arguments launch() encoded in `spec`."""
    arg_spec, kwargs = _decode(spec)
    pools = {"r": reads, "w": written, "i": ints, "f": floats}
    args = [tma_descriptor(TmaView(reads[a[1]], *a[2:])) if a[0] == "d" else a[1] if a[0] == "c" else pools[a[0]][a[1]]
            for a in arg_spec]
    _kernel(kernel)[tuple(grid)](*args, **kwargs)


@functools.lru_cache(maxsize=256)
def _decode(spec: str):
    """launch()'s spec string -> (argument spec, kwargs), parsed once per call site and shape."""
    try:
        arg_spec, kwargs = ast.literal_eval(spec)
    except (ValueError, SyntaxError) as exc:
        raise ValueError(f"capped launch spec {spec!r} is not a Python literal ({exc})") from None
    return arg_spec, dict(kwargs)


@_capped_launch.register_fake
def _capped_launch_fake(kernel, grid, reads, written, ints, floats, spec) -> None:
    return None
