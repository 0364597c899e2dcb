"""Step watchdog: a hung step (stuck collective, dead data worker, deadlock) ends the process.

A hung job otherwise burns its whole allocation doing nothing. The trainer calls `beat()` once
per step; a daemon thread checks the time since the last beat and, after `timeout_s`, writes
every thread's Python stack to `dump_dir/hang_rank{rank}.txt`, prints one line to stderr and
calls `os._exit(exit_code)`, so the launcher (torchrun, Slurm, Kubernetes) restarts the job
from its last checkpoint. `os._exit` and not `sys.exit`: a hung main thread would never see a
SystemExit, and atexit handlers may themselves block on the stuck collective.

Legitimately long pauses (evaluation, checkpoint saves, the first step's compile) go inside
`with watchdog.paused():` (or `pause()`/`resume()`); the clock restarts at resume.

Limitation: the check runs in a Python thread, so it needs the GIL. Blocking PyTorch calls
(CUDA syncs, NCCL waits, I/O) release it; a C extension spinning while holding it would not be
caught here.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from slipstream.errors import UserError

# Exit code of a process killed by the watchdog: 124 is what GNU `timeout` returns when the
# command timed out, so scripts and people already read it as "hung, killed". Distinct from
# 1 (crash), 2 (user error), 130 (Ctrl-C) and EXIT_PREEMPTED (75).
EXIT_HANG = 124


class StepWatchdog:
    """Kills the process when no `beat()` arrives for `timeout_s` seconds while armed."""

    def __init__(self, timeout_s: float, dump_dir: str | Path, rank: int = 0, exit_code: int = EXIT_HANG) -> None:
        if not timeout_s > 0:
            raise UserError(f"watchdog timeout must be > 0 seconds (got {timeout_s}); set it above your slowest step")
        self.timeout_s, self.dump_dir, self.rank, self.exit_code = float(timeout_s), Path(dump_dir), rank, exit_code
        self.dump_path = self.dump_dir / f"hang_rank{rank}.txt"
        self._last = time.monotonic()
        self._step: int | None = None
        self._pause_depth = 0
        self._lock = threading.Lock()  # guards pause depth only; beat() stays a plain store
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # The watchdog wakes several times per timeout so the kill lands close to timeout_s,
    # but at most once a second: checking is cheap, and it never touches the training thread.
    def _poll_s(self) -> float:
        return min(1.0, self.timeout_s / 4)

    def start(self) -> StepWatchdog:
        """Arm the watchdog; the start itself counts as a beat."""
        if self._thread is None:
            self._last = time.monotonic()
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=f"slipstream-watchdog-rank{self.rank}", daemon=True)
            self._thread.start()
        return self

    def beat(self, step: int | None = None) -> None:
        """Mark progress. Called every step, so only two attribute stores (atomic under the GIL)."""
        self._last = time.monotonic()
        self._step = step

    def pause(self) -> None:
        """Suspend the deadline (nestable) until the matching `resume()`."""
        with self._lock:
            self._pause_depth += 1

    def resume(self) -> None:
        with self._lock:
            self._pause_depth = max(0, self._pause_depth - 1)
            self._last = time.monotonic()  # time spent paused does not count

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def stop(self) -> None:
        """Disarm and join the thread (safe to call twice)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> StepWatchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s()):
            idle = time.monotonic() - self._last
            if self._pause_depth == 0 and idle > self.timeout_s and not self._stop.is_set():
                self._fire(idle)

    def _fire(self, idle_s: float) -> None:
        """Dump all stacks, say so once, and exit without unwinding (see module docstring)."""
        try:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            with open(self.dump_path, "w") as f:
                f.write(f"slipstream watchdog: no step finished for {idle_s:.1f} s (timeout {self.timeout_s:g} s)\n"
                        f"time: {time.strftime('%Y-%m-%d %H:%M:%S %z')}\nrank: {self.rank}  pid: {os.getpid()}\n"
                        f"last beat at step: {self._step}\n\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            where = str(self.dump_path)
        except OSError as e:  # an unwritable dump dir must not keep a hung job alive
            where = f"(could not write {self.dump_path}: {e})"
        print(f"slipstream watchdog: rank {self.rank} hung for {idle_s:.0f} s after step {self._step}; "
              f"stacks in {where}; exiting with code {self.exit_code}", file=sys.stderr, flush=True)
        os._exit(self.exit_code)
