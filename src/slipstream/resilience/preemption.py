"""Preemption: turn SIGTERM/SIGUSR1 into a flag the trainer polls, so it can save and exit cleanly.

Schedulers announce preemption with a signal and a grace period before SIGKILL (Slurm:
SIGTERM, or `--signal=USR1@120` ahead of the time limit; Kubernetes: SIGTERM, 30 s by
default). The handler only records the signal: saving a checkpoint inside a signal handler
would run at an arbitrary point of the step (mid optimizer update, mid collective). The trainer
checks `requested` at a step boundary, saves, and exits with EXIT_PREEMPTED. In multi-rank runs
only some ranks may get the signal, so the trainer should agree on the flag across ranks
(e.g. an all-reduce MAX) before acting on it.

Python runs signal handlers only in the main thread, and `signal.signal` fails elsewhere, so
installing (entering the context) off the main thread raises RuntimeError; constructing the
object anywhere is fine.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterable
from types import FrameType
from typing import Any

from slipstream.errors import UserError

# Exit code after a clean preemption save: 75 is EX_TEMPFAIL in sysexits.h ("temporary failure,
# try again later"), which is what happened. Distinct from 1 (crash), 2 (user error),
# 130 (Ctrl-C) and EXIT_HANG (124).
EXIT_PREEMPTED = 75

_UNCATCHABLE = {"SIGKILL", "SIGSTOP"}


def _resolve(sig: str | int | signal.Signals) -> signal.Signals:
    """Accept "SIGTERM", "term", 15 or signal.SIGTERM; reject what cannot be caught here."""
    if isinstance(sig, str):
        name = sig.strip().upper()
        name = name if name.startswith("SIG") else "SIG" + name
        if name in _UNCATCHABLE or not isinstance(getattr(signal, name, None), signal.Signals):
            raise UserError(f"cannot handle signal '{sig}' for preemption; use catchable signals such as "
                            "SIGTERM, SIGUSR1 or SIGUSR2")
        return signal.Signals(getattr(signal, name))
    try:
        return signal.Signals(sig)
    except ValueError:
        raise UserError(f"unknown signal number {sig}; use names such as SIGTERM or SIGUSR1") from None


class PreemptionHandler:
    """Context manager: while active, the listed signals set `requested` instead of killing the process."""

    def __init__(self, signals: Iterable[str | int | signal.Signals] = ("SIGTERM", "SIGUSR1"),
                 grace_s: float = 30.0) -> None:
        if not grace_s >= 0:
            raise UserError(f"preemption grace period must be >= 0 seconds (got {grace_s})")
        self.signals = tuple(dict.fromkeys(_resolve(s) for s in signals))
        self.grace_s = float(grace_s)
        self.signal_name: str | None = None  # first signal received
        self.received_at: float | None = None  # time.monotonic() of the first signal
        self.received_wall: float | None = None  # time.time() of it, for logs
        self.count = 0  # all signals received, repeats included
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def requested(self) -> bool:
        return self.received_at is not None

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def request(self, name: str = "manual") -> None:
        """Record a preemption request; what the handlers call, and usable from code and tests."""
        self.count += 1
        if self.received_at is None:  # the first signal starts the grace clock; repeats do not reset it
            self.signal_name, self.received_at, self.received_wall = name, time.monotonic(), time.time()

    def seconds_left(self) -> float:
        """Grace seconds left before the scheduler's kill is expected; grace_s while nothing was received."""
        if self.received_at is None:
            return self.grace_s
        return max(0.0, self.grace_s - (time.monotonic() - self.received_at))

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: anything more could run in the middle of a step (see module docstring).
        self.request(signal.Signals(signum).name)

    def install(self) -> PreemptionHandler:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionHandler must be installed from the main thread: Python delivers "
                               "signals only there. Create it in the main thread, or poll request() instead.")
        if not self._previous:
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        """Restore the handlers that were there before (SIG_DFL where they were set outside Python)."""
        for sig, prev in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if prev is None else prev)
        self._previous = {}

    def __enter__(self) -> PreemptionHandler:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()
