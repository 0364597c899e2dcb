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

import argparse
import contextlib
import copy
import datetime
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from slipstream.errors import UserError

DEFAULT_PORT = 29500
DEFAULT_RDZV_TIMEOUT_S = 300
# The operator's default master port and the name it looks the port up by.
K8S_MASTER_PORT = 23456
K8S_PORT_NAME = "pytorchjob-port"
_K8S_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_SLURM_NOT_IN_JOB = ("`slipstream launch slurm-node` runs inside an sbatch job, once per node via srun; "
                     "generate that job with `slipstream launch slurm ... -- <command>`")


# ------------------------------------------------------------------ shared helpers

def _slipstream_command(args: argparse.Namespace, extra: list[str], subcommands: list[str]) -> list[str]:
    """The command after `--`, checked to be a slipstream subcommand."""
    if extra:
        raise UserError(f"unknown launch option(s) {' '.join(extra)}; the command to run goes after `--`")
    command = list(args.command)
    # argparse keeps the `--` in a REMAINDER on some Python versions and drops it on others.
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UserError(f"no command to launch; add one after `--`, e.g. `-- train` (one of: {', '.join(subcommands)})")
    if command[0] not in subcommands:
        raise UserError(f"'{command[0]}' is not a slipstream command; after `--` put one of: {', '.join(subcommands)}")
    return command


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)


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

def cmd_local(args: argparse.Namespace, command: list[str]) -> int:
    _check(args.nproc >= 1, f"--nproc must be >= 1 (got {args.nproc})")
    _check(args.max_restarts >= 0, f"--max-restarts must be >= 0 (got {args.max_restarts})")
    _check(args.monitor_interval > 0, f"--monitor-interval must be > 0 seconds (got {args.monitor_interval})")
    cmd = _torchrun() + ["--standalone", "--nproc-per-node", str(args.nproc), "--max-restarts", "0",
                         "--monitor-interval", str(args.monitor_interval), "-m", "slipstream", *command]
    return run_with_restarts(cmd, args.max_restarts)


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


def _check_node_options(args: argparse.Namespace) -> None:
    _check(args.gpus_per_node >= 1, f"--gpus-per-node must be >= 1 (got {args.gpus_per_node})")
    _check(1 <= args.port <= 65535, f"--port must be in 1..65535 (got {args.port})")
    _check(args.max_restarts >= 0, f"--max-restarts must be >= 0 (got {args.max_restarts})")
    _check(args.rdzv_timeout >= 1, f"--rdzv-timeout must be >= 1 second (got {args.rdzv_timeout})")


def cmd_slurm_node(args: argparse.Namespace, command: list[str]) -> int:
    _check_node_options(args)
    job_id = _slurm_env("SLURM_JOB_ID")
    nnodes = _slurm_int("SLURM_NNODES", 1)
    node_id = _slurm_int("SLURM_NODEID", 0)
    _check(node_id < nnodes, f"SLURM_NODEID={node_id} must be < SLURM_NNODES={nnodes}: {_SLURM_NOT_IN_JOB}")
    hosts = parse_hostlist(_slurm_env("SLURM_JOB_NODELIST"))
    # No --node-rank: with c10d the rendezvous assigns node ranks (torchrun ignores it and warns).
    cmd = _torchrun() + [
        "--nnodes", str(nnodes), "--nproc-per-node", str(args.gpus_per_node),
        # c10d: the first node hosts the rendezvous store; every node joins it under the job id.
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0]}:{args.port}", "--rdzv-id", job_id,
        "--rdzv-conf", f"join_timeout={args.rdzv_timeout}",
        "--max-restarts", str(args.max_restarts), "-m", "slipstream", *command]
    return _run(cmd)


def slurm_node_argv(gpus_per_node: int, port: int, max_restarts: int, rdzv_timeout: int, command: list[str]) -> list[str]:
    """The per-node command line that the sbatch script hands to srun."""
    return [sys.executable, "-m", "slipstream", "launch", "slurm-node", "--gpus-per-node", str(gpus_per_node),
            "--port", str(port), "--max-restarts", str(max_restarts), "--rdzv-timeout", str(rdzv_timeout),
            "--", *command]


# ------------------------------------------------------------------ slurm (sbatch script)

def render_sbatch(args: argparse.Namespace, command: list[str], workdir: Path, out: Path) -> str:
    q = shlex.quote
    sbatch = [f"--job-name={args.job_name}", f"--nodes={args.nodes}",
              "--ntasks-per-node=1",  # one torchrun agent per node; it starts the per-GPU ranks
              f"--gpus-per-node={args.gpus_per_node}"]
    for flag, value in (("cpus-per-task", args.cpus_per_task), ("time", args.time), ("partition", args.partition),
                        ("account", args.account), ("mem", args.mem)):
        if value:
            sbatch.append(f"--{flag}={value}")
    # Preemption warning: SIGUSR1 to the ranks 120 s before the time limit (they save and exit 75).
    sbatch += [f"--chdir={workdir}", "--output=logs/%x-%j.out", "--signal=USR1@120"]
    threads = max(1, args.cpus_per_task // args.gpus_per_node) if args.cpus_per_task else 1
    srun = ["srun", "--kill-on-bad-exit=1",
            *slurm_node_argv(args.gpus_per_node, args.port, args.max_restarts, args.rdzv_timeout, command)]
    lines = [
        "#!/bin/bash",
        f"# Written by `slipstream launch slurm` on {datetime.datetime.now().isoformat(timespec='seconds')}.",
        f"# Submit with: sbatch {q(str(out))}",
        *(f"#SBATCH {q(line)}" for line in sbatch),
        "",
        "set -euo pipefail",
        f"cd {q(str(workdir))}",
        "mkdir -p logs",
        "",
        "# Reproducibility: what this job ran with (first node only). Secret-looking values are masked.",
        'ENV_FILE="logs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}-env.txt"',
        "{",
        '  echo "job ${SLURM_JOB_ID} nodes ${SLURM_JOB_NODELIST} started $(date -u +%Y-%m-%dT%H:%M:%SZ)"',
        f"  echo {q('command: ' + shlex.join(command))}",
        "  git rev-parse HEAD 2>/dev/null || true",
        "  # python, torch, CUDA, cuDNN, GPU models, driver and package versions",
        f"  {q(sys.executable)} -m torch.utils.collect_env || true",
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
        shlex.join(srun),
        "",
    ]
    return "\n".join(lines)


def cmd_slurm(args: argparse.Namespace, command: list[str]) -> int:
    _check(args.nodes >= 1, f"--nodes must be >= 1 (got {args.nodes})")
    _check_node_options(args)
    _check(args.cpus_per_task is None or args.cpus_per_task >= 1, f"--cpus-per-task must be >= 1 (got {args.cpus_per_task})")
    _check(re.fullmatch(r"[A-Za-z0-9_.+-]+", args.job_name) is not None,
           f"--job-name {args.job_name!r}: use letters, digits and _ . + - only")
    _check(not args.time or re.fullmatch(r"[0-9]+(-[0-9]+)?(:[0-9]+){0,2}", args.time) is not None,
           f"--time {args.time!r} is not a Slurm time; write HH:MM:SS or D-HH:MM:SS")
    workdir = Path(args.workdir or os.getcwd()).expanduser().resolve()
    out = Path(args.out or f"{args.job_name}.sbatch")
    if workdir.is_dir():
        # Slurm opens --output=logs/... before the script runs: a missing folder loses the log.
        (workdir / "logs").mkdir(exist_ok=True)
    else:
        print(f"note: {workdir} does not exist here; create {workdir}/logs on the cluster before submitting")
    _write_new(out, render_sbatch(args, command, workdir, out), args.force)
    print(f"wrote {out}: {args.nodes} node(s) x {args.gpus_per_node} GPU(s), workdir {workdir}")
    print(f"submit it with: sbatch {shlex.quote(str(out))}   (logs go to {workdir}/logs/)")
    return 0


# ------------------------------------------------------------------ k8s (PyTorchJob)

def build_pytorchjob(args: argparse.Namespace, command: list[str]) -> dict[str, Any]:
    env = []
    for item in args.env:
        key, sep, value = item.partition("=")
        _check(bool(sep) and _ENV_NAME.match(key) is not None, f"--env {item!r}: write KEY=VALUE")
        env.append({"name": key, "value": value})
    resources: dict[str, dict[str, Any]] = {"limits": {}, "requests": {}}
    if args.gpus_per_node > 0:
        resources["limits"]["nvidia.com/gpu"] = args.gpus_per_node
    for key, value in (("cpu", args.cpus), ("memory", args.memory)):
        if value:
            resources["limits"][key] = resources["requests"][key] = str(value)
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    # Data-loader workers pass batches through shared memory; the container default is 64 MB.
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if args.pvc:
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": args.pvc}})
        mounts.append({"name": "checkpoints", "mountPath": args.mount or "/checkpoints"})
    container: dict[str, Any] = {
        "name": "pytorch",  # the operator finds the training container by this name
        "image": args.image,
        "imagePullPolicy": "IfNotPresent",
        # torchrun takes --nnodes, --nproc-per-node, --node-rank, --master-addr/port from the PET_* variables.
        "command": ["torchrun", "-m", "slipstream", *command],
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
    if args.nodes > 1:
        specs["Worker"] = replica(args.nodes - 1)
    metadata = {"name": args.name}
    if args.namespace:
        metadata["namespace"] = args.namespace
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": metadata,
        "spec": {
            "nprocPerNode": str(max(1, args.gpus_per_node)),  # a string in the v1 API ("auto", "gpu" or a number)
            # Restarts happen as pod restarts (OnFailure), at most backoffLimit times; a finished job
            # stops any still-running pods so a failed rank does not leave the others waiting.
            "runPolicy": {"backoffLimit": args.max_restarts, "cleanPodPolicy": "Running"},
            "pytorchReplicaSpecs": specs,
        },
    }


def cmd_k8s(args: argparse.Namespace, command: list[str]) -> int:
    import yaml

    # The operator names pods and services <name>-worker-<i>; those must stay valid DNS labels.
    _check(_K8S_NAME.match(args.name) is not None and len(args.name) <= 50,
           f"--name {args.name!r}: use lowercase letters, digits and '-', start with a letter, at most 50 characters")
    _check(bool(args.image.strip()), "--image must name a container image, e.g. registry/slipstream:gpu")
    _check(args.nodes >= 1, f"--nodes must be >= 1 (got {args.nodes})")
    _check(args.gpus_per_node >= 0, f"--gpus-per-node must be >= 0 (got {args.gpus_per_node})")
    _check(args.max_restarts >= 0, f"--max-restarts must be >= 0 (got {args.max_restarts})")
    _check(args.mount is None or args.mount.startswith("/"), f"--mount {args.mount!r} must be an absolute container path")
    _check(bool(args.pvc) or args.mount is None, "--mount needs --pvc CLAIM (the volume to mount there)")
    out = Path(args.out or f"{args.name}.yaml")
    manifest = build_pytorchjob(args, command)
    _write_new(out, yaml.safe_dump(manifest, sort_keys=False), args.force)
    print(f"wrote {out}: PyTorchJob {args.name}, {args.nodes} node(s) x {max(1, args.gpus_per_node)} process(es)")
    print(f"submit it with: kubectl apply -f {shlex.quote(str(out))}   (needs the Kubeflow training operator)")
    return 0


# ------------------------------------------------------------------ argparse

def add_launch_parser(sub) -> None:
    """Register `slipstream launch ...` on the top-level subparsers."""
    launch = sub.add_parser("launch", help="run a slipstream command on many processes: local, Slurm, Kubernetes")
    where = launch.add_subparsers(dest="launcher", required=True)

    def handler(run):
        def handle(args: argparse.Namespace, extra: list[str]) -> int:
            # Read at call time: by then every top-level subcommand has been registered.
            subcommands = [name for name in sub.choices if name != "launch"]
            return run(args, _slipstream_command(args, extra, subcommands))
        return handle

    def with_command(p: argparse.ArgumentParser, run) -> None:
        p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the slipstream command for every rank")
        p.set_defaults(func=handler(run))

    p = where.add_parser("local", help="torchrun on this machine")
    p.add_argument("--nproc", type=int, default=1, help="processes (ranks) on this machine")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="after a failure, start all ranks again this often (they resume with --checkpoint.resume=auto)")
    p.add_argument("--monitor-interval", type=float, default=0.1, help="seconds between torchrun's health checks")
    with_command(p, cmd_local)

    def node_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--gpus-per-node", type=int, required=True, help="ranks per node (one per GPU)")
        p.add_argument("--port", type=int, default=DEFAULT_PORT, help="rendezvous port on the first node")
        p.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts of all ranks after a failure")
        p.add_argument("--rdzv-timeout", type=int, default=DEFAULT_RDZV_TIMEOUT_S,
                       help="seconds a node waits for its peers before failing")

    p = where.add_parser("slurm", help="write an sbatch script (one torchrun per node via srun)")
    p.add_argument("--nodes", type=int, required=True)
    node_options(p)
    p.add_argument("--partition", default=None)
    p.add_argument("--time", default=None, help="time limit, HH:MM:SS")
    p.add_argument("--account", default=None)
    p.add_argument("--job-name", default="slipstream")
    p.add_argument("--cpus-per-task", type=int, default=None, help="CPUs per node (the one task per node)")
    p.add_argument("--mem", default=None, help="memory per node, e.g. 256G")
    p.add_argument("--workdir", default=None, help="folder the job runs in (default: the current one)")
    p.add_argument("--out", default=None, help="script file (default <job-name>.sbatch)")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    with_command(p, cmd_slurm)

    p = where.add_parser("slurm-node", help="(run by the sbatch script via srun) torchrun for this node")
    node_options(p)
    with_command(p, cmd_slurm_node)

    p = where.add_parser("k8s", help="write a Kubeflow PyTorchJob manifest")
    p.add_argument("--name", required=True, help="job name (lowercase, digits, '-')")
    p.add_argument("--image", required=True, help="container image with slipstream installed")
    p.add_argument("--nodes", type=int, default=1, help="pods: 1 master + nodes-1 workers")
    p.add_argument("--gpus-per-node", type=int, default=1, help="GPUs (and ranks) per pod; 0 = CPU pods, 1 rank")
    p.add_argument("--cpus", default=None, help="CPU limit per pod, e.g. 16")
    p.add_argument("--memory", default=None, help="memory limit per pod, e.g. 64Gi")
    p.add_argument("--pvc", default=None, help="PersistentVolumeClaim for checkpoints")
    p.add_argument("--mount", default=None, help="where the claim is mounted (default /checkpoints)")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the container (repeatable)")
    p.add_argument("--namespace", default=None)
    p.add_argument("--max-restarts", type=int, default=3, help="pod restarts before the job fails (backoffLimit)")
    p.add_argument("--out", default=None, help="manifest file (default <name>.yaml)")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    with_command(p, cmd_k8s)
