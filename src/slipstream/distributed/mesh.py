"""Joining the job and naming its dimensions.

    torchrun environment -> process group (gloo on CPU, NCCL on CUDA, timeouts)
        -> ParallelDims (validated degrees, slipstream.config.dims) -> one DeviceMesh with named dims

`init_parallel(cfg)` is the only entry point: it reads the environment torchrun sets
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), joins the process group once per
process and returns a `Parallel` context the rest of the code asks "which rank am I,
which device, which mesh". A single process without torchrun gets a world-1 context
(and, for a sharding strategy, a world-1 process group, so FSDP code paths run alike).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist

from slipstream.config.dims import ParallelDims, check_compatibility, resolve_parallel_dims
from slipstream.config.schema import Config, ParallelConfig
from slipstream.errors import UserError


@dataclass(frozen=True)
class LaunchEnv:
    """What torchrun told this process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    launched: bool = False  # True under torchrun (or any launcher that sets RANK/WORLD_SIZE)


def read_launch_env(environ: dict[str, str] | None = None) -> LaunchEnv:
    env = os.environ if environ is None else environ
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return LaunchEnv()
    values = {}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        raw = env.get(key, "0" if key == "LOCAL_RANK" else env.get("WORLD_SIZE", "1") if key == "LOCAL_WORLD_SIZE" else "")
        try:
            values[key] = int(raw)
        except ValueError:
            raise UserError(f"environment variable {key}={raw!r} is not an integer; start the job with "
                            "`slipstream launch` or torchrun, which set it") from None
    rank, world = values["RANK"], values["WORLD_SIZE"]
    if world < 1 or not 0 <= rank < world:
        raise UserError(f"RANK={rank} and WORLD_SIZE={world} are inconsistent; start the job with "
                        "`slipstream launch` or torchrun")
    return LaunchEnv(rank, world, values["LOCAL_RANK"], max(1, values["LOCAL_WORLD_SIZE"]), launched=True)


@dataclass
class Parallel:
    """This process's place in the job: rank, device, degrees and the mesh."""

    env: LaunchEnv
    dims: ParallelDims
    device: torch.device
    mesh: Any = None  # DeviceMesh, or None for a single process without a sharding strategy
    side_group: Any = None  # a gloo group for background collectives (async checkpoints); None for one process
    grad_mesh: Any = None  # with cp: the data-parallel dims with cp folded in (see data_parallel_mesh)

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def dp_rank(self) -> int:
        """Which slice of the global batch this rank reads (the ranks of one tp group read the same)."""
        return self.dims.dp_rank(self.env.rank)

    @property
    def dp_mesh(self):
        """The mesh over which gradients are averaged: the data-parallel dims (FSDP shards over
        it, DDP replicates over it), with the cp ranks folded into the innermost one."""
        if self.grad_mesh is not None:
            return self.grad_mesh
        names = tuple(name for name, _ in self.dims.dp_mesh_dims)
        return self.mesh if tuple(self.mesh.mesh_dim_names) == names else self.mesh[names]

    # One submesh object per process, not a new one per lookup: DTensor caches sharding decisions
    # by mesh *value*, so a second, equal mesh object (a second Trainer in the same process) gets
    # specs holding the first one, and a compiled backward then fails to trace the stranger
    # (torch 2.13, Inductor: "device_mesh._get_submesh is not an OpOverload").
    @cached_property
    def tp_mesh(self):
        return self.mesh["tp"]

    @cached_property
    def cp_mesh(self):
        return self.mesh["cp"]

    @cached_property
    def ep_mesh(self):
        """Expert parallelism's mesh over the same ranks: the data-parallel degree split into
        dp_mod_ep (ranks holding the same experts) x ep (consecutive ranks splitting them). A
        collective on first use (new groups): every rank asks for it at the same point."""
        from torch.distributed.device_mesh import init_device_mesh

        d = self.dims
        return init_device_mesh(self.device.type, (d.pp, d.dp // d.ep, d.ep, d.cp, d.tp),
                                mesh_dim_names=("pp", "dp_mod_ep", "ep", "cp", "tp"))

    def barrier(self) -> None:
        if self.distributed and self.world_size > 1:
            dist.barrier()

    def broadcast(self, value: Any) -> Any:
        """Rank 0's value on every rank (for decisions only one rank may make, like a run-dir name)."""
        if not self.distributed or self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """Average a device tensor over all ranks (a collective: every rank must call it)."""
        if not self.distributed or self.world_size == 1:
            return tensor
        out = tensor.detach().clone().float()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out / self.world_size

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a device tensor over all ranks, in its own dtype (a collective: every rank must call it)."""
        if not self.distributed or self.world_size == 1:
            return tensor
        out = tensor.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    def gather(self, value: Any) -> list[Any]:
        """Every rank's value, on every rank."""
        if not self.distributed or self.world_size == 1:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out


_CURRENT: Parallel | None = None


def check_device_rules(cfg: Config, device: torch.device) -> None:
    """Settings that only some devices honour (the config-only rules ran when it was loaded)."""
    if cfg.metrics.memory_snapshot and device.type != "cuda":
        raise UserError("metrics.memory_snapshot records the CUDA caching allocator; this run is on "
                        f"{device.type}. Use --metrics.memory_breakdown (works on CPU) instead")
    if cfg.profile.enabled and cfg.profile.nvtx and device.type != "cuda":
        raise UserError(f"profile.nvtx emits NVTX ranges for Nsight Systems, which needs CUDA; this run is on "
                        f"{device.type}. Use --profile.nvtx=false (the torch profiler trace has the same ranges)")
    if cfg.parallel.async_tp and device.type != "cuda":
        raise UserError(f"parallel.async_tp uses CUDA symmetric memory (Inductor's micro-pipelined tensor parallel); "
                        f"this run is on {device.type}. Set --parallel.async_tp=false")
    if cfg.precision.fp8:
        from slipstream.optimize.precision import fp8_support

        if reason := fp8_support(device):
            raise UserError(f"precision.fp8 = true: {reason}; set --precision.fp8=false")


def init_parallel(cfg: Config) -> Parallel:
    """Join the job (once per process) and return its Parallel context."""
    global _CURRENT
    env = read_launch_env()
    dims = resolve_parallel_dims(cfg.parallel, env.world_size, env.local_world_size)
    check_compatibility(cfg, dims)
    if dims.tp > 1:
        from slipstream.distributed.tensor_parallel import check_tensor_parallel

        check_tensor_parallel(cfg, dims.tp)
    if dims.cp > 1:
        from slipstream.distributed.context_parallel import check_context_parallel

        check_context_parallel(cfg, dims.cp, dims.tp)
    if dims.ep > 1:
        from slipstream.distributed.expert_parallel import check_expert_parallel

        check_expert_parallel(cfg, dims)
    if _CURRENT is not None and _CURRENT.env == env and _CURRENT.dims == dims:
        check_device_rules(cfg, _CURRENT.device)
        return _CURRENT
    from slipstream.runtime import resolve_device

    device = resolve_device(cfg.train.device)
    if env.launched and device.type != "cpu":
        # One accelerator per local rank.
        device = torch.device(device.type, env.local_rank % torch.accelerator.device_count())
        torch.accelerator.set_device_index(device.index)
    check_device_rules(cfg, device)  # before joining the process group: a bad combination costs no wait
    if env.launched and device.type == "cpu" and not cfg.train.threads:
        # torchrun gives each worker OMP_NUM_THREADS=1; share the cores among the local ranks instead.
        torch.set_num_threads(max(1, usable_cores() // env.local_world_size))
    needs_group = env.launched or dims.strategy != "none"
    if needs_group and not dist.is_initialized():
        _join_process_group(cfg.parallel, env, device, cfg.run.dir)
    mesh = _build_mesh(dims, device) if needs_group else None
    grad_mesh = data_parallel_mesh(dims, mesh) if needs_group and dims.cp > 1 else None
    side_group = None
    if needs_group and env.world_size > 1:
        _first_barrier(cfg.parallel, env, mesh)
        side_group = _new_gloo_group()
    _CURRENT = Parallel(env, dims, device, mesh, side_group, grad_mesh)
    if needs_group and dims.ep > 1:
        _CURRENT.ep_mesh  # new groups, a collective: every rank builds it here (a pipeline stage may hold no MoE layer)
    return _CURRENT


def _new_gloo_group():
    """A second gloo group over all ranks, for background work (asynchronous checkpoint writes)
    that must never interleave with the training step's collectives. Made right after the
    first barrier, when every rank is listening. (No retry: it is a collective, and a retry on
    one rank only would pair with another collective on the others.)"""
    return dist.new_group(backend="gloo")


def usable_cores() -> int:
    """Cores this process may run on (Slurm --cpus-per-task, container limits), not the node's."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _backend(p: ParallelConfig, device: torch.device) -> str:
    if p.backend == "gloo" or device.type == "cpu":
        if p.backend == "nccl":
            raise UserError("parallel.backend = nccl needs CUDA devices; use gloo (or auto) on CPU")
        return "gloo"
    if device.type == "cuda":
        # NCCL for CUDA tensors, plus gloo for CPU tensors: FSDP's CPU offload reduces CPU-resident
        # gradient norms, and object collectives (run directory, per-rank summaries) may use CPU.
        return "cpu:gloo,cuda:nccl"
    return dist.get_default_backend_for_device(device)


def _join_process_group(p: ParallelConfig, env: LaunchEnv, device: torch.device, run_dir: str = "") -> None:
    if device.type == "cuda":
        # Async error handling tears the job down on a failed/stuck collective instead of hanging,
        # and the flight recorder keeps the last collectives of every rank for the post-mortem
        # (dumped next to the run's other files when the run directory is known).
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        if run_dir:
            os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", os.path.join(run_dir, "nccl_trace_rank_"))
    backend = _backend(p, device)
    timeout = datetime.timedelta(seconds=p.init_timeout_s)
    try:
        if env.launched:
            dist.init_process_group(backend=backend, timeout=timeout,
                                    device_id=device if device.type == "cuda" else None)
        else:  # one process without a launcher: a private in-memory store
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    except (RuntimeError, ValueError, dist.DistError) as e:
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise UserError(f"rank {env.rank} could not join the process group at {where} within "
                        f"{p.init_timeout_s:g} s ({type(e).__name__}: {str(e).splitlines()[0][:200]}); check that "
                        "every node started, the address/port is reachable, and raise parallel.init_timeout_s "
                        "for slow starts") from None


def _first_barrier(p: ParallelConfig, env: LaunchEnv, mesh) -> None:
    """Everybody is here; from now on collectives get the (longer) training timeout."""
    try:
        dist.barrier()
    except (RuntimeError, dist.DistError) as e:
        raise UserError(f"rank {env.rank}: not every rank arrived within parallel.init_timeout_s = "
                        f"{p.init_timeout_s:g} s ({str(e).splitlines()[0][:200]})") from None
    from torch.distributed import distributed_c10d

    if hasattr(distributed_c10d, "_set_pg_timeout"):
        timeout = datetime.timedelta(seconds=p.timeout_s)
        groups = {id(g): g for g in [dist.group.WORLD, *(mesh.get_group(n) for n in mesh.mesh_dim_names)]}
        for group in groups.values():
            distributed_c10d._set_pg_timeout(timeout, group)


def _build_mesh(dims: ParallelDims, device: torch.device):
    from torch.distributed.device_mesh import init_device_mesh

    names, sizes = zip(*dims.mesh_dims)
    return init_device_mesh(device.type, tuple(sizes), mesh_dim_names=tuple(names))


def data_parallel_mesh(dims: ParallelDims, mesh):
    """The dp dims with cp folded into the innermost one (as torchtitan does): the cp ranks of a
    sequence hold different tokens of the same batch, so their gradients are averaged exactly
    like data-parallel ranks' (FSDP then shards over them too). A collective (new groups): every
    rank calls it once, at start-up."""
    names = [name for name, _ in dims.dp_mesh_dims]
    inner = names[-1]
    flat = mesh[(inner, "cp")]._flatten(f"{inner}_cp")
    if len(names) == 1:
        return flat
    return mesh[(names[0], f"{inner}_cp")]


def shutdown() -> None:
    """Leave the process group (end of a run launched by slipstream)."""
    global _CURRENT
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _CURRENT = None


def describe(par: Parallel) -> str:
    d = par.dims
    mesh = " x ".join(f"{n} {s}" for n, s in d.mesh_dims)
    if d.ep > 1:  # experts split over groups of ep consecutive data-parallel ranks
        mesh += f"; experts: ep {d.ep} x dp_mod_ep {d.dp // d.ep}"
    return (f"parallel: {d.strategy} on {par.world_size} process(es) [{mesh}], rank {par.rank}, "
            f"device {par.device}, backend {dist.get_backend() if par.distributed else 'none'}")
