"""`slipstream launch local|slurm|slurm-node|k8s -- COMMAND`: run a slipstream command on every rank.

    slipstream launch local --nproc N [--max-restarts R] -- train ...
    slipstream launch slurm --nodes N --gpus-per-node G [--partition P --time T ... --out F --force] -- train ...
    slipstream launch slurm-node --gpus-per-node G [--port P ...] -- train ...   (run by the sbatch script)
    slipstream launch k8s --name NAME --image IMAGE [--nodes N --gpus-per-node G ... --out F --force] -- train ...

What each launcher does: slipstream/distributed/launch.py.
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

from slipstream.distributed.launch import (DEFAULT_PORT, DEFAULT_RDZV_TIMEOUT_S, K8sJob, SlurmJob, check_command,
                                           parse_env, path_flag, run_local, run_slurm_node, write_pytorchjob,
                                           write_sbatch)
from slipstream.errors import UserError


def _rank_command(command: list[str], extra: list[str], subcommands: list[str]) -> list[str]:
    """The command after `--`, checked to be a slipstream subcommand."""
    if extra:
        raise UserError(f"unknown launch option(s) {' '.join(map(repr, extra))}; the command to run goes after `--`")
    command = list(command)
    # argparse keeps the `--` in a REMAINDER on some Python versions and drops it on others.
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UserError(f"no command to launch; add one after `--`, e.g. `-- train` (one of: {', '.join(subcommands)})")
    if command[0] not in subcommands:
        raise UserError(f"{command[0]!r} is not a slipstream command; after `--` put one of: {', '.join(subcommands)}")
    return check_command(command)


def cmd_local(args: argparse.Namespace, command: list[str]) -> int:
    return run_local(args.nproc, args.max_restarts, args.monitor_interval, command)


def cmd_slurm_node(args: argparse.Namespace, command: list[str]) -> int:
    return run_slurm_node(args.gpus_per_node, args.port, args.max_restarts, args.rdzv_timeout, command)


def cmd_slurm(args: argparse.Namespace, command: list[str]) -> int:
    workdir = Path(path_flag("--workdir", args.workdir) or os.getcwd()).expanduser().resolve()
    job = SlurmJob(command=tuple(command), nodes=args.nodes, gpus_per_node=args.gpus_per_node, workdir=workdir,
                   job_name=args.job_name, partition=args.partition, time=args.time, account=args.account,
                   mem=args.mem, cpus_per_task=args.cpus_per_task, port=args.port, max_restarts=args.max_restarts,
                   rdzv_timeout=args.rdzv_timeout)
    out = Path(path_flag("--out", args.out) or f"{job.job_name}.sbatch")
    write_sbatch(job, out, args.force)
    print(f"wrote {out}: {job.nodes} node(s) x {job.gpus_per_node} GPU(s), workdir {workdir}")
    print(f"submit it with: sbatch {shlex.quote(str(out))}   (logs go to {workdir}/logs/)")
    return 0


def cmd_k8s(args: argparse.Namespace, command: list[str]) -> int:
    job = K8sJob(name=args.name, image=args.image, command=tuple(command), nodes=args.nodes,
                 gpus_per_node=args.gpus_per_node, cpus=args.cpus, memory=args.memory, pvc=args.pvc,
                 mount=args.mount, env=parse_env(args.env), namespace=args.namespace, max_restarts=args.max_restarts)
    out = Path(path_flag("--out", args.out) or f"{job.name}.yaml")
    write_pytorchjob(job, out, args.force)
    print(f"wrote {out}: PyTorchJob {job.name}, {job.nodes} node(s) x {max(1, job.gpus_per_node)} process(es)")
    print(f"submit it with: kubectl apply -f {shlex.quote(str(out))}   (needs the Kubeflow training operator)")
    return 0


def add_commands(sub) -> None:
    """Register `slipstream launch ...` on the top-level subparsers."""
    launch = sub.add_parser("launch", help="run a slipstream command on many processes: local, Slurm, Kubernetes")
    where = launch.add_subparsers(dest="launcher", required=True)

    def handler(run):
        def handle(args: argparse.Namespace, extra: list[str]) -> int:
            # Read at call time: by then every top-level subcommand has been registered.
            subcommands = [name for name in sub.choices if name != "launch"]
            return run(args, _rank_command(args.command, extra, subcommands))
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
