"""When the Triton kernels' tests can run on the CPU: Triton installed, its interpreter on
(tests/conftest.py sets TRITON_INTERPRET=1 without CUDA) and numpy < 2.4.

Triton 3.6's interpreter turns 1-element arrays into loop bounds with int(): numpy >= 2.4
raises there (triton-lang/triton#9171), and numpy < 2.4 warns instead, thousands of times per
test, hence QUIET_NUMPY.
"""

from __future__ import annotations

import numpy
import pytest

QUIET_NUMPY = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def interpreting(kernel) -> bool:
    """Whether `kernel` (a @triton.jit function, or None without Triton) runs interpreted."""
    if kernel is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def interpreter_skip(kernel) -> str | None:
    """Why `kernel` cannot run interpreted here, or None when it can."""
    if kernel is None:
        return "needs Triton (not installed)"
    if not interpreting(kernel):
        return "needs Triton's interpreter (TRITON_INTERPRET=1 before Python starts)"
    if tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4):
        return "Triton 3.6's interpreter needs numpy < 2.4 (triton-lang/triton#9171)"
    return None


def interpreter_mark(kernel):
    """A decorator: skip the test unless `kernel` runs interpreted; quiet numpy's warnings."""
    reason = interpreter_skip(kernel)
    skip = pytest.mark.skipif(reason is not None, reason=str(reason))
    return lambda test: skip(QUIET_NUMPY(test))
