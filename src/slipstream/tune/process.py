"""Trial processes: start a `slipstream train` in its own session, say why one failed, and stop
one with everything it started (torchrun's ranks included). Shared by every tuner."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

# A metrics line longer than this is not the trainer's (its records are well under 4 KiB).
MAX_LINE_BYTES = 1 << 20


def override(key: str, value: object) -> str:
    """A `--section.key=value` override for a trial's command line (booleans as true/false)."""
    text = ("true" if value else "false") if isinstance(value, bool) else str(value)
    return f"--{key}={text}"


def train_env() -> dict[str, str]:
    """The environment of a trial process: this one's, with this slipstream first on the path
    (so a trial imports the same code as the tuner, installed or not)."""
    src = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}


def train_command(train_args: list[str], nproc: int = 1) -> list[str]:
    """`python -m slipstream train ARGS`, under `launch local --nproc N` for N > 1."""
    launch = ["launch", "local", "--nproc", str(nproc), "--"] if nproc > 1 else []
    return [sys.executable, "-m", "slipstream", *launch, "train", *train_args]


def failure_reason(stderr: str, code: int) -> str:
    """The line of a failed trial's stderr that says why: slipstream's `error: ...`, else the last
    exception line of a rank (under torchrun the last lines are its own report and "=====" rules,
    not the cause), else the last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip(" =-\t")]
    for line in reversed(lines):
        if line.startswith("error: "):
            return line
    for line in reversed(lines):
        if re.match(r"[\w.]*(Error|Exception)\b", line) and "ChildFailedError" not in line:
            return line
    return lines[-1] if lines else f"exit code {code}"


# Seconds a stopped trial gets to shut its ranks down before they are killed.
TRIAL_GRACE_S = 10.0


def _descendants(pid: int) -> dict[int, str]:
    """Every process below `pid`, with its start time (Linux /proc; empty elsewhere). torchrun
    starts its ranks in their own sessions, so killing the trial's process group misses them."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = entry.read_text().rsplit(")", 1)[1].split()
            # fields[1] is the parent pid, fields[19] the start time (stat fields 4 and 22)
            children.setdefault(int(fields[1]), []).append((int(entry.parent.name), fields[19]))
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        for child, started in children.get(todo.pop(), []):
            found[child] = started
            todo.append(child)
    return found


def _same_process(pid: int, started: str) -> bool:
    """The pid still names the process we saw (not a new one that reused the number)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19] == started
    except (OSError, IndexError):
        return False


def stop_trial(proc: subprocess.Popen, grace_s: float = TRIAL_GRACE_S) -> None:
    """Stop a trial and everything it started: SIGTERM first (the launcher forwards it and
    torchrun tears its ranks down), SIGKILL to whatever is left after `grace_s`. Only
    processes still alive as the ones seen are killed, never a reused pid."""
    family = _descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        family.update(_descendants(proc.pid))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)   # proc is not reaped yet: its pid and group are still ours
        proc.wait()
    for pid, started in family.items():
        if _same_process(pid, started):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


class MetricsTail:
    """The new complete records of a growing metrics.jsonl (a line still being written waits
    for its newline)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, b""
        self.last_step: int | None = None

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(MAX_LINE_BYTES)
        except OSError:
            return []  # not written yet
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()[:MAX_LINE_BYTES]
        records = []
        for line in lines:
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    records.append(record)
                    if isinstance(record.get("step"), int):
                        self.last_step = record["step"]
        return records
