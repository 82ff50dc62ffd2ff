"""The flex path compiled, the default on CUDA: one graph per shape instead of eager glue.

Eagerly, the flex path runs its compiled Flex calls and Triton ops with ~60 small kernels of glue
between them (folds, masks, the selection index, the gated sum), each its own launch, and is
host-bound where the GPU work is short: at G=4 (H200) the forward took 2.49 / 2.38 / 3.50 ms at
2k / 8k / 16k tokens eagerly and 0.75 / 1.73 / 2.54 compiled (docs/decisions.md, "The default
path compiled"). Compiled, Inductor fuses that glue.

`run(fn, compiled, *args)` calls fn through torch.compile on CUDA when `compiled` is true and no
outer torch.compile is tracing (that one fuses the glue itself). Each new shape compiles once
(dynamic=False: the index and the masks are sized by the shapes). Past Dynamo's recompile limit
(8 shapes a process by default) new shapes run eagerly with Dynamo's warning, and a compiler
failure makes fn run eagerly from then on (for calls giving the same optional inputs), with a
warning (same result, more host time).
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import torch

from nsa_flex.validate import check_compiled

# (function, optional inputs given) whose compile failed in this process: they run eagerly.
_FAILED: set[tuple[str, tuple[str, ...]]] = set()


def wanted(compiled: bool, x: torch.Tensor) -> bool:
    """Whether `compiled` asks for the compiled call here: CUDA tensors, no outer compile tracing."""
    check_compiled(compiled)
    return compiled and x.is_cuda and not torch.compiler.is_compiling()


@functools.cache
def _compiled(fn: Callable) -> Callable:
    from nsa_flex.flex.tuning import install_flex_tuning

    # The selected branch's backward needs Inductor's extra tile choice before anything compiles.
    install_flex_tuning()
    # Not fullgraph: past Dynamo's recompile limit a fullgraph function raises, this one runs eagerly.
    return torch.compile(fn, dynamic=False)


def run(fn: Callable, compiled: bool, *args, **kwargs):
    """fn(*args, **kwargs), compiled where `wanted` says so (see the module docstring)."""
    # A failure is remembered per function and set of optional inputs given (packed documents
    # compile other code than one sequence per row).
    name = (f"{fn.__module__}.{fn.__qualname__}", tuple(sorted(k for k, v in kwargs.items() if v is not None)))
    if not wanted(compiled, args[0]) or name in _FAILED:
        return fn(*args, **kwargs)
    from torch._dynamo.exc import BackendCompilerFailed, InternalTorchDynamoError

    try:
        return _compiled(fn)(*args, **kwargs)
    except (BackendCompilerFailed, InternalTorchDynamoError) as exc:
        _FAILED.add(name)
        warnings.warn(f"nsa_flex: compiling {fn.__qualname__} failed on torch {torch.__version__} "
                      f"({type(exc).__name__}: {str(exc)[:300]}); it runs eagerly from now on (same result, more "
                      "host time). Pass compiled=False to choose that yourself.", stacklevel=3)
        return fn(*args, **kwargs)
