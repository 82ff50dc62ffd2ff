"""Build Gluon (and Triton) kernels for sm_90a on a machine without a GPU, for the CPU tests.

Gluon kernels do not run under Triton's interpreter, and under TRITON_INTERPRET=1 Triton's own
@jit helpers (the combine functions of Gluon's reductions) are interpreted functions, which the
compiler refuses. So the builds run in one subprocess without the interpreter, and each test
module gets every case's resources (ptxas registers and spills, shared memory) back as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SM90_SHARED_BYTES = 232448  # the most shared memory a program may take on sm_90


def build(script: str) -> dict:
    """Run `script` (Python that prints one JSON object as its last line; the tests' folder and the
    repository root come first on sys.path) without Triton's interpreter; its object."""
    tests = Path(__file__).resolve().parent
    code = f"import sys\nsys.path[:0] = [{str(tests)!r}, {str(tests.parent)!r}]\n" + script
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])
