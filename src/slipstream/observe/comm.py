"""Communication volume of a training step: the bytes every collective moves, by kind and group.

    with CommCounter(mesh_groups(mesh)) as comm:
        trainer.train_step(it)   # the trainer does this at step 2 with metrics.comm_volume (StepComm)
    comm.summary()   # {"total_bytes": ..., "collectives": [...], "by_dim": {"tp": {"all_gather": ...}}}

`CommCounter` is a TorchDispatchMode: every collective that reaches PyTorch's dispatcher
inside it is recorded with its kind, its process group and its size. Per call it counts

    bytes       the call's full buffer: all_reduce the tensor, all_gather the gathered output,
                reduce_scatter the input before scattering, all_to_all this rank's input,
                gather / scatter the root's whole buffer (this rank's piece x n), broadcast /
                send / recv the tensor (nccl-tests' "size"; what plan/timing_comm.py's
                step_collectives predicts)
    bus_bytes   what each rank moves on a ring algorithm: bytes x 2(n-1)/n for all_reduce,
                x (n-1)/n for all_gather / reduce_scatter / all_to_all / gather / scatter, x 1
                for broadcast and point-to-point (nccl-tests' bus-bandwidth factors; the
                planner's time model uses the same, plan.collectives.bus_factor)

What it sees (checked on torch 2.13, CPU, gloo):
- c10d ops, i.e. every `torch.distributed` call: FSDP2's all-gathers and reduce-scatters,
  DDP's bucket all-reduces (its C++ reducer calls the c10d ops through the dispatcher, from
  the backward pass on this thread) and its buffer broadcasts, ZeroRedundancyOptimizer's
  broadcasts, send/recv, and the object collectives (`all_gather_object` and friends, whose
  pickled payload is a uint8 tensor);
- functional collectives (`_c10d_functional`): DTensor's redistributions (the tensor- and
  sequence-parallel styles' hooks, loss parallel) and context parallelism's K/V all-gather
  with its backward reduce-scatter; and the reductions DTensor's own op dispatch makes (a
  Partial gradient read by the gradient norm or the optimizer): DTensor ops are let through
  first (NotImplemented), so the collectives they turn into come back here, once each (the
  test checks this with an op on a Partial DTensor).
What it does not see:
- work on other threads or processes that did not enter the mode (asynchronous checkpoint
  writers), and code compiled by torch.compile (the trainer does not count under compile);
- what a backend does inside a collective (NCCL's tree or ring choice, gloo's algorithms):
  bytes and bus_bytes are computed from the buffers, not captured from the wire;
- barrier (no payload).

Groups are named by the mesh dims they serve (`mesh_groups`). A dim that spans the whole job
shares the default process group with the others that do (a cp2 run on 2 ranks: cp and the
data-parallel dim that folds cp in, dp_shard_cp, are one group); such calls are labelled with
every dim ("cp+dp_shard_cp") and `by_dim` splits them by the API that made them (see there).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from slipstream.plan.collectives import bus_factor  # the ring factors the planner's time model uses

# c10d op -> (kind, index of the argument whose tensors are the full buffer)
_C10D = {
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0),
    "allgather_coalesced_": ("all_gather", 0), "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "alltoall_base_": ("all_to_all", 1), "alltoall_": ("all_to_all", 1),
    "broadcast_": ("broadcast", 0), "reduce_": ("reduce", 0),
    "gather_": ("gather", 1), "scatter_": ("scatter", 0),   # this rank's piece (x group size: the buffer)
    "send": ("send", 0), "recv_": ("recv", 0), "recv_any_source_": ("recv", 0),
}
# functional op -> kind; the buffer is the input, except for all-gathers (the output)
_FUNCTIONAL = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_out": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast", "broadcast_": "broadcast",
}
def _tensor_bytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(t) for t in x)
    return 0


def _group_of(args: tuple, kwargs: dict) -> tuple[str, int]:
    """(name, size) of the process group a collective runs over."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch._C._distributed_c10d import ProcessGroup

    for a in args:
        if isinstance(a, torch.ScriptObject) and a._type().qualified_name().endswith("c10d.ProcessGroup"):
            pg = ProcessGroup.unbox(a)  # a c10d op's group arrives boxed
            return pg.group_name, pg.size()
    name = kwargs.get("group_name", args[-1])  # a functional op names its group last
    return str(name), _resolve_process_group(name).size()


def mesh_groups(*meshes) -> dict[str, str]:
    """Process group name -> the mesh dims it serves ("cp+dp_shard_cp" when several share it), for
    every named dim of the given DeviceMeshes (None is skipped; the job's default group is "world"
    unless a dim spans the job)."""
    import torch.distributed as dist

    dims: dict[str, list[str]] = {}
    for mesh in meshes:
        if mesh is None or mesh.mesh_dim_names is None:
            continue
        for name in mesh.mesh_dim_names:
            if mesh.size(mesh.mesh_dim_names.index(name)) > 1:
                names = dims.setdefault(mesh.get_group(name).group_name, [])
                if name not in names:  # a submesh (hsdp's gradient mesh) repeats its parent's dims
                    names.append(name)
    if dist.is_initialized():
        dims.setdefault(dist.group.WORLD.group_name, ["world"])
    return {group: "+".join(names) for group, names in dims.items()}


class CommCounter(TorchDispatchMode):
    """Counts every collective run inside it (see the module doc). One instance per measured step."""

    def __init__(self, groups: dict[str, str] | None = None):
        from torch.distributed.tensor import DTensor

        super().__init__()
        self.groups = groups or {}
        self._dtensor = DTensor
        # (group label, api, kind) -> [group size, calls, bytes]
        self.counts: dict[tuple[str, str, str], list[int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, self._dtensor) for t in types):
            return NotImplemented  # DTensor runs first; the collectives it issues come back here
        kwargs = kwargs or {}
        out = func(*args, **kwargs)  # communicates when func is a collective: counted below, never added
        space, name = func.namespace, func._opname
        if space == "c10d" and name in _C10D:
            kind, where = _C10D[name]
            group = _group_of(args, kwargs)
            nbytes = _tensor_bytes(args[where]) * (group[1] if kind in ("gather", "scatter") else 1)
            self._add("c10d", kind, nbytes, group)
        elif space == "_c10d_functional" and name in _FUNCTIONAL:
            kind = _FUNCTIONAL[name]
            buffer = out if kind == "all_gather" else args[0]
            self._add("functional", kind, _tensor_bytes(buffer), _group_of(args, kwargs))
        return out

    def _add(self, api: str, kind: str, nbytes: int, group_and_size: tuple[str, int]) -> None:
        group, size = group_and_size
        label = self.groups.get(group, f"group {group}")
        entry = self.counts.setdefault((label, api, kind), [size, 0, 0])
        entry[1] += 1
        entry[2] += nbytes

    def collectives(self) -> list[dict[str, Any]]:
        """One row per (group, api, kind): calls, bytes and bus_bytes."""
        return [{"group": label, "size": size, "api": api, "kind": kind, "calls": calls, "bytes": nbytes,
                 "bus_bytes": round(nbytes * bus_factor(kind, size))}
                for (label, api, kind), (size, calls, nbytes) in sorted(self.counts.items())]

    def by_dim(self, key: str = "bytes") -> dict[str, dict[str, int]]:
        """dim -> kind -> bytes (or bus_bytes). A group serving several dims is split by who calls:
        functional collectives (DTensor, context parallelism) go to its model-parallel dim (tp,
        cp), c10d calls (FSDP, DDP, ZeRO, the trainer's own) to its data-parallel one (dp_*). So
        slipstream's own layers land where they belong; one known misfile: the gradient norm of
        FSDP's DTensor parameters is a functional all-reduce of a few scalars."""
        out: dict[str, dict[str, int]] = {}
        for row in self.collectives():
            dims = row["group"].split("+")
            data = [d for d in dims if d.startswith("dp")]
            model = [d for d in dims if not d.startswith("dp")]
            if row["api"] == "c10d":
                dim = (data or model)[0]
            else:
                dim = (model or data)[0]
            kinds = out.setdefault(dim, {})
            kinds[row["kind"]] = kinds.get(row["kind"], 0) + row[key]
        return out

    def summary(self) -> dict[str, Any]:
        rows = self.collectives()
        return {"total_bytes": sum(r["bytes"] for r in rows), "total_bus_bytes": sum(r["bus_bytes"] for r in rows),
                "collectives": rows, "by_dim": self.by_dim(), "by_dim_bus": self.by_dim("bus_bytes")}


def planned_step_comm(cfg, dims, model=None) -> dict[str, dict[str, int]] | None:
    """The planner's bytes per step by dim and kind (plan/timing_comm.step_collectives) for a run of
    `cfg` on the resolved `dims`; None for models the planner cannot describe (a user module),
    or when the planner fails: a prediction is a check, it never stops a run."""
    import warnings

    from slipstream.models.transformer import Transformer

    if model is not None and not isinstance(model, Transformer):
        return None
    try:
        from slipstream.plan.collectives import collectives_by_dim
        from slipstream.plan.space import PlanModel, Workload, strategy_from_config
        from slipstream.plan.timing_comm import step_collectives

        model_cfg = model.cfg if model is not None else cfg.model
        strategy = strategy_from_config(cfg, dims.dp, dims.strategy, dims.dp_shard)
        work = Workload(cfg.train.seq_len, cfg.train.micro_batch_size * cfg.train.grad_accum_steps * dims.dp)
        return collectives_by_dim(step_collectives(PlanModel(model_cfg.preset, model_cfg), strategy, work))
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"slipstream plan could not predict this run's communication ({type(e).__name__}: {e})",
                      stacklevel=2)
        return None


def plan_dim(dim: str, planned: dict[str, Any]) -> str:
    """The planner's name for a measured dim: the data-parallel dims (dp_shard, dp_replicate,
    with cp folded in: dp_shard_cp, ...) are its "dp", except hsdp's replicate dim, which it
    names apart ("dp_replicate") when it predicts one."""
    if dim.startswith("dp_replicate") and "dp_replicate" in planned:
        return "dp_replicate"
    return "dp" if dim.startswith("dp") else dim


def compare_with_plan(measured: dict[str, dict[str, int]], planned: dict[str, dict[str, int]]) -> dict[str, Any]:
    """dim -> measured and planned bytes per step (all kinds) and their ratio (measured / planned)."""
    totals: dict[str, list[float]] = {}
    for dim, kinds in measured.items():
        totals.setdefault(plan_dim(dim, planned), [0, 0])[0] += sum(kinds.values())
    for dim, kinds in planned.items():
        totals.setdefault(dim, [0, 0])[1] += sum(kinds.values())
    return {dim: {"measured_bytes": m, "planned_bytes": p, "ratio": (m / p) if p else None}
            for dim, (m, p) in sorted(totals.items())}


class StepComm:
    """metrics.comm_volume: count the collectives of one steady-state training step (the second
    this process runs, the step memory_breakdown measures: optimizer state exists, DDP's buckets
    are built), for summary.json's `comm`, next to the planner's prediction (rank 0's, like the
    memory breakdown; the ranks of a layout move the same volumes).

    Both counters are dispatch modes, so they share the step: the counter is entered around the
    whole train step, the memory tracker inside it (the tracker's ops reach the counter, which
    counts only collectives), and no second step is slowed down."""

    def __init__(self, cfg, start_step: int, parallel, model=None, is_main: bool = True):
        self.measure_at = start_step + 2 if start_step + 2 <= cfg.train.max_steps else None
        self.skipped: str | None = None
        if not cfg.metrics.comm_volume or parallel.world_size <= 1:
            self.measure_at = None  # one process: no collectives to count
        elif self.measure_at is not None and cfg.compile.scope != "off":
            # A dispatch mode does not see inside compiled graphs: the count would miss them.
            self.skipped = ("skipped with torch.compile (compiled graphs run their collectives unseen by the "
                            "counter); compare with --compile.scope=off")
            if is_main:
                print(f"note: metrics.comm_volume is {self.skipped}")
            self.measure_at = None
        self.groups = {}
        if self.measure_at is not None:
            # (expert parallelism's own view of the ranks, made at start-up: ep, dp_mod_ep)
            ep_mesh = parallel.ep_mesh if parallel.dims.ep > 1 else None
            self.groups = mesh_groups(parallel.mesh, parallel.grad_mesh, ep_mesh)
        self.predicted = planned_step_comm(cfg, parallel.dims, model) if self.measure_at is not None else None
        self.counter: CommCounter | None = None

    def counting(self, step: int):
        """A CommCounter around training step `step` (1-based) when it is the measured one."""
        import contextlib

        if step != self.measure_at:
            return contextlib.nullcontext()
        self.counter = CommCounter(self.groups)
        return self.counter

    def summary(self) -> dict[str, Any] | None:
        """The summary's `comm` entry: the counts, the planner's prediction and their ratio per dim."""
        if self.skipped is not None:
            return {"skipped": self.skipped}
        if self.counter is None:
            return None
        out = {"step": self.measure_at, **self.counter.summary()}
        if self.predicted is not None:
            out["planned"] = self.predicted
            out["vs_planned"] = compare_with_plan(out["by_dim"], self.predicted)
        return out

    def print_report(self) -> None:
        """One line per mesh dim: bytes per step measured, and planned where the planner predicts it."""
        summary = self.summary()
        if summary is None or "skipped" in summary:
            return
        mib = 2**20
        print(f"communication of training step {self.measure_at} (rank 0, bytes of the collectives' buffers):")
        for dim, kinds in summary["by_dim"].items():
            parts = ", ".join(f"{kind} {n / mib:.2f} MiB" for kind, n in sorted(kinds.items()))
            print(f"  {dim}: {parts}")
        for dim, row in summary.get("vs_planned", {}).items():
            ratio = f" ({row['ratio']:.2f}x)" if row["ratio"] is not None else ""
            print(f"  planned by `slipstream plan`, {dim}: {row['planned_bytes'] / mib:.2f} MiB, measured "
                  f"{row['measured_bytes'] / mib:.2f} MiB{ratio}")
