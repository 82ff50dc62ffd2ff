"""A stall watchdog: a training run never hangs silently.

`start()` it right after start-up and `beat()` after every finished step; set-up and the first
step get `first_timeout` (compilation). If no beat comes in time, a watcher thread
prints a message naming the last finished step, the stack traces of all threads
(faulthandler.dump_traceback), and ends the process with exit code STALL_EXIT_CODE (os._exit:
a hung collective or kernel cannot be unwound). The Python watcher needs the GIL; as a
backstop for a hang that holds the GIL, faulthandler's own C-level timer dumps the stacks and
exits a little later.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from typing import Callable

STALL_EXIT_CODE = 3
_BACKSTOP_GRACE_S = 60.0


class Watchdog:
    """Watches a loop that must `beat()` at least every `timeout` seconds (0 disables)."""

    def __init__(self, timeout: float, *, first_timeout: float | None = None, rank: int = 0,
                 on_stall: Callable[[str], None] | None = None, poll: float = 0.2,
                 clock: Callable[[], float] = time.monotonic):
        self.timeout, self.rank, self.poll = timeout, rank, poll
        self._limit = timeout if first_timeout is None else max(timeout, first_timeout)
        self._on_stall = on_stall or _dump_and_exit
        # The clock the limits are measured on (tests pass one they control; the backstop keeps real time).
        self._clock = clock
        self._last = clock()
        self._step = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Watchdog":
        """Start watching (no-op when the timeout is 0)."""
        if self.timeout > 0 and self._thread is None:
            self._last = self._clock()
            self._stop.clear()
            self._arm_backstop()
            self._thread = threading.Thread(target=self._watch, name="nsa-flex-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching; safe to call more than once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            faulthandler.cancel_dump_traceback_later()

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def beat(self, step: int) -> None:
        """Step `step` finished: restart the clock with the regular timeout."""
        self._step, self._limit, self._last = step, self.timeout, self._clock()
        if self._thread is not None:
            self._arm_backstop()

    def _arm_backstop(self) -> None:
        faulthandler.dump_traceback_later(self._limit + _BACKSTOP_GRACE_S, repeat=False, file=_stderr(), exit=True)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            waited = self._clock() - self._last
            if waited > self._limit:
                self._on_stall(
                    f"nsa-flex watchdog (rank {self.rank}): no training step finished in {waited:.0f} s "
                    f"(limit {self._limit:g} s; last finished step: {self._step or 'none yet'}). Stack traces of all "
                    f"threads follow; exiting with code {STALL_EXIT_CODE}."
                )
                return


def _dump_and_exit(message: str) -> None:
    err = _stderr()
    print(message, file=err, flush=True)
    faulthandler.dump_traceback(file=err, all_threads=True)
    err.flush()
    os._exit(STALL_EXIT_CODE)


def _stderr():
    """The process's real stderr: faulthandler needs a file descriptor, which a captured
    sys.stderr (a test runner's, a notebook's) may not have."""
    return sys.__stderr__
