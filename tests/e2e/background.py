"""Commands started now and awaited later: for jobs of one test module that do not depend on each other.

A `slipstream launch local` job keeps 2 cores only about half busy: its processes start one after
the other (the launcher, torchrun, then the ranks: a torch import each) and its ranks wait for each
other in collectives. Two independent 2-rank jobs side by side took 11.0-11.6 s on the 2-core
development machine, one after the other 14.1-15.1 s; a single-process reference trained in the
test's own process fits into a job's idle time as well.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


class Background:
    """`subprocess.run(cmd, capture_output=True, text=True, timeout=..., env=...)`, started now;
    result() waits for it and returns what subprocess.run would (and raises TimeoutExpired as it
    would, after killing the command's whole process group)."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None, timeout: float = 240.0):
        self.cmd, self.timeout, self.started = cmd, timeout, time.monotonic()
        # Output into files: a pipe that nobody reads while another job is awaited would fill up.
        self._dir = Path(tempfile.mkdtemp(prefix="slipstream-background-"))
        self._files = [open(self._dir / name, "w+") for name in ("stdout", "stderr")]
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._files[0], stderr=self._files[1], text=True,
                                     start_new_session=True)
        self._result: subprocess.CompletedProcess | None = None

    def result(self) -> subprocess.CompletedProcess:
        if self._result is None:
            try:
                self.proc.wait(timeout=max(0.0, self.timeout - (time.monotonic() - self.started)))
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                raise
            finally:
                out, err = (self._read(f) for f in self._files)
            self._result = subprocess.CompletedProcess(self.cmd, self.proc.returncode, out, err)
        return self._result

    def _read(self, f) -> str:
        f.seek(0)
        text = f.read()
        f.close()
        os.unlink(f.name)
        if not any(self._dir.iterdir()):
            self._dir.rmdir()
        return text


class Jobs:
    """Independent commands run in background threads, `at_once` at a time, in the order given (what
    subprocess.run(cmd, capture_output=True, text=True, timeout=..., env=...) returns, by name).

    A module that starts every job its selected tests read when the first of them asks keeps 2 cores
    busy while each test waits for its own job (and trains its in-process reference meanwhile)."""

    def __init__(self, commands: dict[str, tuple[list[str], dict[str, str], float]], at_once: int = 2):
        self._pool = ThreadPoolExecutor(at_once, thread_name_prefix="job")
        self._futures = {name: self._pool.submit(subprocess.run, cmd, capture_output=True, text=True,
                                                 timeout=timeout, env=env)
                         for name, (cmd, env, timeout) in commands.items()}

    def result(self, name: str) -> subprocess.CompletedProcess:
        return self._futures[name].result()  # re-raises subprocess.TimeoutExpired

    def close(self) -> None:
        """Cancel the jobs not started (their tests did not run) and wait for the running ones."""
        self._pool.shutdown(wait=True, cancel_futures=True)
