"""`slipstream launch`: run a slipstream command on every rank, locally, on Slurm or on Kubernetes.

Everything after `--` is the slipstream command each rank runs (`train --parallel.dp_strategy=fsdp`).

  local       torchrun --standalone on this machine (N processes), as a child process;
              its output streams through and its exit code is ours.
  slurm       writes an sbatch script: one srun task per node, each running `launch slurm-node`.
              The script records the environment and sets NCCL's fail-fast / flight-recorder knobs.
  slurm-node  what srun runs on every node: reads SLURM_* variables, expands the compressed
              node list (gpu[01-03,07]) to find the rendezvous host, then runs torchrun with a
              c10d rendezvous keyed by the job id, so the nodes find each other without a
              fixed master, and a node whose peers never arrive fails after --rdzv-timeout.
  k8s         writes a Kubeflow PyTorchJob (kubeflow.org/v1). The operator injects PET_NNODES,
              PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT, which
              torchrun reads as defaults for its options, so the container runs plain `torchrun`.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slipstream.errors import UserError

DEFAULT_PORT = 29500
DEFAULT_RDZV_TIMEOUT_S = 300
# The operator's default master port and the name it looks the port up by.
K8S_MASTER_PORT = 23456
K8S_PORT_NAME = "pytorchjob-port"
_K8S_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_SLURM_NOT_IN_JOB = ("`slipstream launch slurm-node` runs inside an sbatch job, once per node via srun; "
                     "generate that job with `slipstream launch slurm ... -- <command>`")


# ------------------------------------------------------------------ checking user values

# Unicode categories no generated file may carry, and how the error names them.
_UNSAFE = {"Cc": "control character", "Zl": "line separator", "Zp": "paragraph separator",
           "Cs": "undecodable byte (not UTF-8)"}


def check_text(flag: str, value: str, forbid: str = "", why: str = "") -> str:
    """Refuse what could end a line or a field of a generated file: control characters (C0,
    DEL, C1: a newline would end an #SBATCH line and start a command of its own), Unicode
    line/paragraph separators, and unpaired surrogates (bytes that are not UTF-8). Quoting
    handles everything else; `forbid` names extra characters a non-shell parser reads its own way."""
    for ch in value:
        kind = _UNSAFE.get(unicodedata.category(ch))
        if kind:
            raise UserError(f"{flag} {value!r}: {kind} U+{ord(ch):04X} is not allowed; remove it")
        if ch in forbid:
            raise UserError(f"{flag} {value!r}: {ch!r} is not allowed{why}")
    return value


def check_command(command: list[str] | tuple[str, ...]) -> list[str]:
    """The rank command lands in generated files as argv (quoted, or a YAML list): checked like every value."""
    for i, arg in enumerate(command):
        check_text(f"argument {i + 1} of the command after `--`", arg)
    return list(command)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)


def path_flag(flag: str, value: str | None) -> str | None:
    """A path flag checked before it becomes a Path: a NUL byte would crash Path.resolve/exists."""
    return None if value is None else check_text(flag, value)


def _run(cmd: list[str]) -> int:
    """Run `cmd` with our stdout/stderr (so it streams) and return its exit code, shell style."""
    print(f"running: {shlex.join(cmd)}", flush=True)
    # SIGUSR1 means "preempted: save and exit" to the training ranks only. torchrun does not
    # handle it (its default action would kill the agent), so torchrun is started with it
    # ignored (an ignored signal stays ignored across exec; each rank installs its own handler).
    # This launcher forwards a SIGUSR1 it receives to the ranks, torchrun's children, which run
    # in sessions of their own; Slurm's --signal=USR1@T reaches every process of the step itself.
    usr1 = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    proc = subprocess.Popen(cmd)
    signal.signal(signal.SIGUSR1, lambda signum, frame: _signal_children(proc.pid, signum))
    # `kill <our pid>` must reach torchrun too, or its workers outlive us.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signum))
    try:
        while True:
            try:
                rc = proc.wait()
                break
            except KeyboardInterrupt:
                # Ctrl-C went to the whole process group: torchrun is shutting its workers down.
                continue
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGUSR1, usr1)
    return 128 - rc if rc < 0 else rc


def _signal_children(pid: int, signum: int) -> None:
    """Send `signum` to the direct children of `pid` (Linux /proc; elsewhere: nothing to do)."""
    for tasks in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in tasks.read_text().split():
            with contextlib.suppress(OSError):
                os.kill(int(child), signum)


def _torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run"]


def _write_new(path: Path, text: str, force: bool) -> None:
    """Write atomically (temp file, then rename), refusing to replace a file unless `force`."""
    _check(path.parent.is_dir(), f"{path.parent} is not a folder; create it or pick another --out")
    if path.exists() and not force:
        raise UserError(f"{path} already exists; pass --force to overwrite it or --out to pick another file")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# ------------------------------------------------------------------ local

def local_argv(nproc: int, monitor_interval: float, command: list[str]) -> list[str]:
    """The torchrun command line of `launch local`: an argv list, run without a shell."""
    _check(nproc >= 1, f"--nproc must be >= 1 (got {nproc})")
    # `not > 0` also refuses NaN; inf would never check on the ranks.
    _check(monitor_interval > 0 and math.isfinite(monitor_interval),
           f"--monitor-interval must be a number of seconds > 0 (got {monitor_interval})")
    return _torchrun() + ["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "0",
                          "--monitor-interval", str(monitor_interval), "-m", "slipstream", *check_command(command)]


def run_local(nproc: int, max_restarts: int, monitor_interval: float, command: list[str]) -> int:
    _check(max_restarts >= 0, f"--max-restarts must be >= 0 (got {max_restarts})")
    return run_with_restarts(local_argv(nproc, monitor_interval, command), max_restarts)


# Worker exit codes that must not be retried: a user error (2) would fail again, and a
# preempted job (75) was told to stop.
FINAL_EXIT_CODES = (2, 75)
EXIT_FILE_ENV = "SLIPSTREAM_EXIT_FILE"
RESTART_ENV = "SLIPSTREAM_RESTART_COUNT"


def run_with_restarts(cmd: list[str], max_restarts: int) -> int:
    """Run torchrun; after a failure, start it again (all ranks, a fresh rendezvous and store) up to
    max_restarts times. The ranks resume from their last checkpoint with --checkpoint.resume=auto.

    Restarting the whole torchrun (instead of its in-place elastic restart) gives every attempt a
    new store: on CPU/gloo, in-place restarts failed to re-form the group about every second time.
    A rank reports a final exit code (user error, preemption) through SLIPSTREAM_EXIT_FILE, since
    torchrun itself exits 1 whatever its workers returned."""
    import tempfile

    saved_env = {key: os.environ.get(key) for key in (EXIT_FILE_ENV, RESTART_ENV)}
    try:
        with tempfile.TemporaryDirectory(prefix="slipstream-launch-") as tmp:
            exit_file = Path(tmp) / "exit_code"
            for attempt in range(max_restarts + 1):
                os.environ[EXIT_FILE_ENV], os.environ[RESTART_ENV] = str(exit_file), str(attempt)
                rc = _run(cmd)
                final = _read_exit_code(exit_file)
                if rc == 0 or final in FINAL_EXIT_CODES:
                    return final if rc != 0 and final is not None else rc
                if attempt < max_restarts:
                    print(f"launch: attempt {attempt + 1} failed (exit {rc}); restarting all ranks "
                          f"({max_restarts - attempt} restart(s) left)", flush=True)
        return rc
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _read_exit_code(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------ slurm-node

def parse_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm compressed host list: `gpu[01-03,07],login-1,a[1-2]b` -> gpu01, gpu02, ..."""
    groups, depth, start = [], 0, 0
    for i, ch in enumerate(hostlist):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        _check(0 <= depth <= 1, f"SLURM_JOB_NODELIST={hostlist!r}: unbalanced or nested brackets")
        if ch == "," and depth == 0:
            groups.append(hostlist[start:i])
            start = i + 1
    _check(depth == 0, f"SLURM_JOB_NODELIST={hostlist!r}: unclosed '['")
    groups.append(hostlist[start:])
    hosts: list[str] = []
    for group in groups:
        _check(bool(group.strip()), f"SLURM_JOB_NODELIST={hostlist!r}: empty host name")
        hosts.extend(_expand_group(group.strip(), hostlist))
    return hosts


def _expand_group(group: str, hostlist: str) -> list[str]:
    """One host pattern, possibly with several bracket ranges (rack[1-2]-n[01-04])."""
    if "[" not in group:
        _check("]" not in group, f"SLURM_JOB_NODELIST={hostlist!r}: stray ']'")
        return [group]
    open_at = group.index("[")
    close_at = group.index("]", open_at)
    prefix, body, rest = group[:open_at], group[open_at + 1:close_at], group[close_at + 1:]
    values: list[str] = []
    for item in body.split(","):
        lo, _, hi = item.partition("-")
        hi = hi or lo
        _check(lo.isdigit() and hi.isdigit() and int(lo) <= int(hi),
               f"SLURM_JOB_NODELIST={hostlist!r}: bad range '{item}' (expected N or LO-HI)")
        # Zero padding is part of the name: gpu[08-10] -> gpu08, gpu09, gpu10.
        values.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return [prefix + value + tail for value in values for tail in _expand_group(rest, hostlist)]


def _slurm_env(name: str) -> str:
    value = os.environ.get(name, "").strip()
    _check(bool(value), f"{name} is not set: {_SLURM_NOT_IN_JOB}")
    return value


def _slurm_int(name: str, minimum: int) -> int:
    value = _slurm_env(name)
    _check(value.isdigit() and int(value) >= minimum,
           f"{name}={value!r} is not an integer >= {minimum}: {_SLURM_NOT_IN_JOB}")
    return int(value)


def _check_node_options(gpus_per_node: int, port: int, max_restarts: int, rdzv_timeout: int) -> None:
    _check(gpus_per_node >= 1, f"--gpus-per-node must be >= 1 (got {gpus_per_node})")
    _check(1 <= port <= 65535, f"--port must be in 1..65535 (got {port})")
    _check(max_restarts >= 0, f"--max-restarts must be >= 0 (got {max_restarts})")
    _check(rdzv_timeout >= 1, f"--rdzv-timeout must be >= 1 second (got {rdzv_timeout})")


def run_slurm_node(gpus_per_node: int, port: int, max_restarts: int, rdzv_timeout: int, command: list[str]) -> int:
    _check_node_options(gpus_per_node, port, max_restarts, rdzv_timeout)
    command = check_command(command)
    job_id = _slurm_env("SLURM_JOB_ID")
    nnodes = _slurm_int("SLURM_NNODES", 1)
    node_id = _slurm_int("SLURM_NODEID", 0)
    _check(node_id < nnodes, f"SLURM_NODEID={node_id} must be < SLURM_NNODES={nnodes}: {_SLURM_NOT_IN_JOB}")
    hosts = parse_hostlist(_slurm_env("SLURM_JOB_NODELIST"))
    # No --node-rank: with c10d the rendezvous assigns node ranks (torchrun ignores it and warns).
    cmd = _torchrun() + [
        "--nnodes", str(nnodes), "--nproc-per-node", str(gpus_per_node),
        # c10d: the first node hosts the rendezvous store; every node joins it under the job id.
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0]}:{port}", "--rdzv-id", job_id,
        "--rdzv-conf", f"join_timeout={rdzv_timeout}",
        "--max-restarts", str(max_restarts), "-m", "slipstream", *command]
    return _run(cmd)


def slurm_node_argv(python: str, gpus_per_node: int, port: int, max_restarts: int, rdzv_timeout: int,
                    command: list[str]) -> list[str]:
    """The per-node command line that the sbatch script hands to srun."""
    return [python, "-m", "slipstream", "launch", "slurm-node", "--gpus-per-node", str(gpus_per_node),
            "--port", str(port), "--max-restarts", str(max_restarts), "--rdzv-timeout", str(rdzv_timeout),
            "--", *command]


# ------------------------------------------------------------------ slurm (sbatch script)

# Slurm reads #SBATCH lines with its own parser, not a shell: a backslash escapes the next
# character even inside single quotes. Without quotes and backslashes in a value, its reading
# and a shell's reading of the shell-quoted value agree.
_SBATCH_FORBID = "'\"\\"
_SBATCH_WHY = " in an #SBATCH value (Slurm's directive parser reads quotes and backslashes its own way)"


@dataclass(frozen=True)
class SlurmJob:
    """Everything `launch slurm` writes into an sbatch script; checked when built, so a
    SlurmJob always renders to a script that runs exactly `command` (and its own setup)."""

    command: tuple[str, ...]
    nodes: int
    gpus_per_node: int
    workdir: Path  # absolute: the job's --chdir and the folder of its logs/
    job_name: str = "slipstream"
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    mem: str | None = None
    cpus_per_task: int | None = None
    port: int = DEFAULT_PORT
    max_restarts: int = 0
    rdzv_timeout: int = DEFAULT_RDZV_TIMEOUT_S
    # The interpreter every node runs; this one by default (a shared file system is assumed).
    python: str = field(default_factory=lambda: sys.executable)

    def __post_init__(self) -> None:
        object.__setattr__(self, "command", tuple(check_command(self.command)))
        # Control characters first, so a newline is named as such whatever the field's format.
        for flag, value in (("--job-name", self.job_name), ("--time", self.time), ("--mem", self.mem)):
            check_text(flag, value or "")
        for flag, value in (("--partition", self.partition), ("--account", self.account),
                            ("--workdir", str(self.workdir))):
            check_text(flag, value or "", forbid=_SBATCH_FORBID, why=_SBATCH_WHY)
        check_text("the Python interpreter path", self.python)
        _check(self.nodes >= 1, f"--nodes must be >= 1 (got {self.nodes})")
        _check_node_options(self.gpus_per_node, self.port, self.max_restarts, self.rdzv_timeout)
        _check(self.cpus_per_task is None or self.cpus_per_task >= 1,
               f"--cpus-per-task must be >= 1 (got {self.cpus_per_task})")
        _check(re.fullmatch(r"[A-Za-z0-9_.+-]+", self.job_name) is not None,
               f"--job-name {self.job_name!r}: use letters, digits and _ . + - only")
        _check(not self.time or re.fullmatch(r"[0-9]+(-[0-9]+)?(:[0-9]+){0,2}", self.time) is not None,
               f"--time {self.time!r} is not a Slurm time; write HH:MM:SS or D-HH:MM:SS")
        _check(not self.mem or re.fullmatch(r"[0-9]+[KMGTkmgt]?", self.mem) is not None,
               f"--mem {self.mem!r} is not a Slurm memory size; write a number with an optional unit K, M, G or T (256G)")
        _check(self.workdir.is_absolute(), f"--workdir {str(self.workdir)!r} must be an absolute path")

    def directives(self) -> list[str]:
        """The sbatch options of the job, one per #SBATCH line."""
        lines = [f"--job-name={self.job_name}", f"--nodes={self.nodes}",
                 "--ntasks-per-node=1",  # one torchrun agent per node; it starts the per-GPU ranks
                 f"--gpus-per-node={self.gpus_per_node}"]
        for flag, value in (("cpus-per-task", self.cpus_per_task), ("time", self.time), ("partition", self.partition),
                            ("account", self.account), ("mem", self.mem)):
            if value:
                lines.append(f"--{flag}={value}")
        # Preemption warning: SIGUSR1 to the ranks 120 s before the time limit (they save and exit 75).
        return lines + [f"--chdir={self.workdir}", "--output=logs/%x-%j.out", "--signal=USR1@120"]

    def srun_argv(self) -> list[str]:
        return ["srun", "--kill-on-bad-exit=1", *slurm_node_argv(self.python, self.gpus_per_node, self.port,
                                                                 self.max_restarts, self.rdzv_timeout,
                                                                 list(self.command))]


def render_sbatch(job: SlurmJob, out: Path) -> str:
    """The sbatch script of `job`. Every value in it is shell-quoted (and free of control
    characters, which SlurmJob refused), so the script runs only the commands written here."""
    q = shlex.quote
    check_text("--out", str(out))
    threads = max(1, job.cpus_per_task // job.gpus_per_node) if job.cpus_per_task else 1
    lines = [
        "#!/bin/bash",
        f"# Written by `slipstream launch slurm` on {datetime.datetime.now().isoformat(timespec='seconds')}.",
        f"# Submit with: sbatch {q(str(out))}",
        *(f"#SBATCH {q(line)}" for line in job.directives()),
        "",
        "set -euo pipefail",
        f"cd {q(str(job.workdir))}",
        "mkdir -p logs",
        "",
        "# Reproducibility: what this job ran with (first node only). Secret-looking values are masked.",
        'ENV_FILE="logs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}-env.txt"',
        "{",
        '  echo "job ${SLURM_JOB_ID} nodes ${SLURM_JOB_NODELIST} started $(date -u +%Y-%m-%dT%H:%M:%SZ)"',
        f"  echo {q('command: ' + shlex.join(job.command))}",
        "  git rev-parse HEAD 2>/dev/null || true",
        "  # python, torch, CUDA, cuDNN, GPU models, driver and package versions",
        f"  {q(job.python)} -m torch.utils.collect_env || true",
        "  if command -v nvidia-smi >/dev/null; then nvidia-smi || true; fi",
        "  env | sort | sed -E 's/^([^=]*(TOKEN|SECRET|PASSWORD|API_KEY|CREDENTIAL)[^=]*)=.*/\\1=<masked>/I'",
        '} > "$ENV_FILE" 2>&1',
        "",
        "# Fail fast instead of hanging: a collective error or timeout kills the process (3 = skip cleanup),",
        "# srun --kill-on-bad-exit then stops the other nodes.",
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=3",
        "# Flight recorder: keep the last collectives per rank and dump them on a timeout (read with torchfrtrace).",
        "export TORCH_NCCL_TRACE_BUFFER_SIZE=2000",
        "export TORCH_NCCL_DUMP_ON_TIMEOUT=1",
        'export TORCH_FR_DUMP_TEMP_FILE="$PWD/logs/${SLURM_JOB_ID}-nccl-trace-rank-"',
        'export TORCH_NCCL_DEBUG_INFO_TEMP_FILE="$TORCH_FR_DUMP_TEMP_FILE"  # older name of the same setting',
        "# Warnings only; INFO is the first thing to try when nodes cannot connect.",
        "export NCCL_DEBUG=WARN",
        "# If NCCL picks the wrong network interface, pin it (check `ip addr` on a compute node):",
        "# export NCCL_SOCKET_IFNAME=ib0",
        "# export NCCL_IB_HCA=mlx5",
        "# CPU threads per rank: the task's CPUs shared by its GPU ranks (torchrun would otherwise use 1).",
        f"export OMP_NUM_THREADS={threads}",
        "",
        shlex.join(job.srun_argv()),
        "",
    ]
    return "\n".join(lines)


def write_sbatch(job: SlurmJob, out: Path, force: bool = False) -> None:
    """Write the job's sbatch script to `out` (never replacing a file unless `force`)."""
    text = render_sbatch(job, out)
    if job.workdir.is_dir():
        # Slurm opens --output=logs/... before the script runs: a missing folder loses the log.
        (job.workdir / "logs").mkdir(exist_ok=True)
    else:
        print(f"note: {job.workdir} does not exist here; create {job.workdir}/logs on the cluster before submitting")
    _write_new(out, text, force)


# ------------------------------------------------------------------ k8s (PyTorchJob)

# A Kubernetes resource quantity: 16, 0.5, 500m, 64Gi, 1e9.
_K8S_QUANTITY = re.compile(r"[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?")
_K8S_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")


@dataclass(frozen=True)
class K8sJob:
    """Everything `launch k8s` writes into a PyTorchJob manifest; checked when built."""

    name: str
    image: str
    command: tuple[str, ...]
    nodes: int = 1
    gpus_per_node: int = 1
    cpus: str | None = None
    memory: str | None = None
    pvc: str | None = None
    mount: str | None = None
    env: tuple[tuple[str, str], ...] = ()  # (name, value) pairs, in order
    namespace: str | None = None
    max_restarts: int = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "command", tuple(check_command(self.command)))
        # Control characters first, so a newline is named as such whatever the field's format.
        for flag, value in (("--name", self.name), ("--image", self.image), ("--cpus", self.cpus),
                            ("--memory", self.memory), ("--pvc", self.pvc), ("--mount", self.mount),
                            ("--namespace", self.namespace)):
            check_text(flag, value or "")
        # The operator names pods and services <name>-worker-<i>; those must stay valid DNS labels.
        _check(_K8S_NAME.fullmatch(self.name) is not None and len(self.name) <= 50,
               f"--name {self.name!r}: use lowercase letters, digits and '-', start with a letter, at most 50 characters")
        _check(bool(self.image) and not any(ch.isspace() for ch in self.image),
               f"--image {self.image!r} must name a container image (no spaces), e.g. registry/slipstream:gpu")
        _check(self.nodes >= 1, f"--nodes must be >= 1 (got {self.nodes})")
        _check(self.gpus_per_node >= 0, f"--gpus-per-node must be >= 0 (got {self.gpus_per_node})")
        _check(self.max_restarts >= 0, f"--max-restarts must be >= 0 (got {self.max_restarts})")
        for flag, value in (("--cpus", self.cpus), ("--memory", self.memory)):
            _check(not value or _K8S_QUANTITY.fullmatch(value) is not None,
                   f"{flag} {value!r} is not a Kubernetes quantity; write e.g. 16, 500m, 64Gi")
        _check(self.pvc is None or (_K8S_SUBDOMAIN.fullmatch(self.pvc) is not None and len(self.pvc) <= 253),
               f"--pvc {self.pvc!r}: a claim name uses lowercase letters, digits, '-' and '.'")
        _check(self.mount is None or self.mount.startswith("/"),
               f"--mount {self.mount!r} must be an absolute container path")
        _check(bool(self.pvc) or self.mount is None, "--mount needs --pvc CLAIM (the volume to mount there)")
        _check(self.namespace is None or (_K8S_NAME.fullmatch(self.namespace) is not None and len(self.namespace) <= 63),
               f"--namespace {self.namespace!r}: use lowercase letters, digits and '-', start with a letter")
        names = [key for key, _ in self.env]
        for key, value in self.env:
            _check(_ENV_NAME.fullmatch(key) is not None, f"--env {key!r}: a variable name uses letters, digits and _ . -")
            _check(names.count(key) == 1, f"--env {key} is given more than once; keep one")
            check_text(f"--env {key}", value)


def parse_env(items: list[str]) -> tuple[tuple[str, str], ...]:
    """`--env KEY=VALUE` strings as (key, value) pairs."""
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        _check(bool(sep) and _ENV_NAME.fullmatch(key) is not None, f"--env {item!r}: write KEY=VALUE")
        pairs.append((key, value))
    return tuple(pairs)


def build_pytorchjob(job: K8sJob) -> dict[str, Any]:
    """The PyTorchJob manifest of `job` as plain data (written with yaml.safe_dump, never a template)."""
    env = [{"name": key, "value": value} for key, value in job.env]
    resources: dict[str, dict[str, Any]] = {"limits": {}, "requests": {}}
    if job.gpus_per_node > 0:
        resources["limits"]["nvidia.com/gpu"] = job.gpus_per_node
    for key, value in (("cpu", job.cpus), ("memory", job.memory)):
        if value:
            resources["limits"][key] = resources["requests"][key] = str(value)
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    # Data-loader workers pass batches through shared memory; the container default is 64 MB.
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if job.pvc:
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": job.pvc}})
        mounts.append({"name": "checkpoints", "mountPath": job.mount or "/checkpoints"})
    container: dict[str, Any] = {
        "name": "pytorch",  # the operator finds the training container by this name
        "image": job.image,
        "imagePullPolicy": "IfNotPresent",
        # torchrun takes --nnodes, --nproc-per-node, --node-rank, --master-addr/port from the PET_* variables.
        # An argv list: the container runtime execs it, no shell reads it.
        "command": ["torchrun", "-m", "slipstream", *job.command],
        "ports": [{"name": K8S_PORT_NAME, "containerPort": K8S_MASTER_PORT}],
        "env": env,
        "resources": {k: v for k, v in resources.items() if v},
        "volumeMounts": mounts,
    }

    def replica(count: int) -> dict[str, Any]:
        # Deep copies: shared objects would come out as YAML anchors, which some tools reject.
        return {"replicas": count, "restartPolicy": "OnFailure",
                "template": {"spec": {"containers": [copy.deepcopy(container)], "volumes": copy.deepcopy(volumes)}}}

    specs = {"Master": replica(1)}
    if job.nodes > 1:
        specs["Worker"] = replica(job.nodes - 1)
    metadata = {"name": job.name}
    if job.namespace:
        metadata["namespace"] = job.namespace
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": metadata,
        "spec": {
            "nprocPerNode": str(max(1, job.gpus_per_node)),  # a string in the v1 API ("auto", "gpu" or a number)
            # Restarts happen as pod restarts (OnFailure), at most backoffLimit times; a finished job
            # stops any still-running pods so a failed rank does not leave the others waiting.
            "runPolicy": {"backoffLimit": job.max_restarts, "cleanPodPolicy": "Running"},
            "pytorchReplicaSpecs": specs,
        },
    }


def render_pytorchjob(job: K8sJob) -> str:
    import yaml

    return yaml.safe_dump(build_pytorchjob(job), sort_keys=False)


def write_pytorchjob(job: K8sJob, out: Path, force: bool = False) -> None:
    """Write the job's PyTorchJob manifest to `out` (never replacing a file unless `force`)."""
    _write_new(out, render_pytorchjob(job), force)
