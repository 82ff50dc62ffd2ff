"""Run a child process under a time limit and keep what it printed, also when the limit cut it off."""

from __future__ import annotations

import subprocess


def run_limited(cmd: list[str], limit_s: float, tail: int = 5000, **kwargs) -> tuple[str, str]:
    """(status, output): 'exit N' or 'cut off after S s', and the last `tail` characters of stdout + stderr.

    kwargs go to subprocess.run (cwd, env). A cut-off child's stdout is what it flushed before the limit.
    """
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s, **kwargs)
        return f"exit {p.returncode}", (p.stdout + p.stderr)[-tail:]
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return f"cut off after {limit_s:g} s", out[-tail:]
