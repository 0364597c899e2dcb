"""The comm section of `slipstream probe` (perf/probe.py): collectives over message sizes, timed
as nccl-tests times them, and all_reduce within and between the nodes of a multi-node launch.

Separate from perf/probe.py because it is the one section that runs across processes: every
rank calls the same collectives in the same order over torch.distributed, and its numbers are
nccl-tests' algorithm and bus bandwidth (the links `slipstream plan --probe` reads). probe.py
joins the process group and calls comm_section; this file only measures.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

# Collective message sizes (bytes). gloo on a CPU is slow, so fewer and smaller sizes.
CPU_COMM_SIZES = (2**10, 2**16, 2**20, 2**24)
GPU_COMM_SIZES = tuple(2**10 * 4**k for k in range(9))  # 1 KiB .. 64 MiB
COMM_WARMUP = 2
COMM_MIN_ITERS, COMM_MAX_ITERS = 5, 50
# Iterations per size ~ this much traffic, so small messages get many iterations.
CPU_COMM_TRAFFIC_BYTES = 128 * 2**20
GPU_COMM_TRAFFIC_BYTES = 2**30
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def bus_bandwidth_factor(collective: str, world_size: int) -> float:
    """busbw / algbw for a collective, as defined by nccl-tests (doc/PERFORMANCE.md).

    Bus bandwidth rescales the algorithm bandwidth so it is comparable to the link
    speed whatever the world size: all_reduce moves each byte 2(n-1)/n times;
    all_gather, reduce_scatter and all_to_all move (n-1)/n of the (full) buffer;
    broadcast moves it once.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    n = world_size
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if collective == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {collective!r}; expected one of {', '.join(COLLECTIVES)}")


def bus_bandwidth(collective: str, algbw: float, world_size: int) -> float:
    """nccl-tests bus bandwidth from algorithm bandwidth (same unit in and out)."""
    return algbw * bus_bandwidth_factor(collective, world_size)


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (CPU work is done when the call returns); probe.py times with it too."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _collective(name: str, numel: int, world: int, device: torch.device) -> Callable[[], None]:
    """One call of collective `name` whose nccl-tests "size" is numel fp32 elements."""
    # torch 2.13 prefers the *_single names (the *_tensor ones warn); torch 2.11 lacks them.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    full = torch.ones(numel, dtype=torch.float32, device=device)
    if name == "all_reduce":
        return lambda: dist.all_reduce(full)
    if name == "all_gather":
        # nccl-tests' size for all_gather is the gathered (output) buffer.
        part = torch.ones(numel // world, dtype=torch.float32, device=device)
        return lambda: gather(full, part)
    if name == "reduce_scatter":
        # ... and for reduce_scatter the full input buffer.
        part = torch.empty(numel // world, dtype=torch.float32, device=device)
        return lambda: scatter(part, full)
    if name == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full)
    if name == "broadcast":
        return lambda: dist.broadcast(full, src=0)
    raise ValueError(f"unknown collective {name!r}")


def _time_rows(name: str, sizes: list[int], world: int, device: torch.device, traffic: int,
               make: Callable[[int], Callable[[], None]]) -> list[dict[str, Any]]:
    """One row per size of collective `name` over a group of `world` ranks; make(numel) builds
    one call. Every rank of the launch runs this, even outside the group (the timing max is
    taken over the whole launch, which also keeps the sizes in step)."""
    rows = []
    for size in sizes:
        # Whole fp32 elements, divisible by the group size so every rank gets equal parts.
        numel = max(world, size // 4 // world * world)
        nbytes = numel * 4
        run = make(numel)
        iters = max(COMM_MIN_ITERS, min(COMM_MAX_ITERS, traffic // nbytes))
        for _ in range(COMM_WARMUP):
            run()
        sync_device(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            run()
        sync_device(device)
        # Ranks finish at slightly different times; the collective is as slow as the slowest.
        elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        seconds = float(elapsed.item())
        algbw = nbytes / seconds / 1e9
        rows.append({
            "bytes": nbytes,
            "iters": iters,
            "seconds": seconds,
            "algbw_gbs": algbw,
            "busbw_gbs": bus_bandwidth(name, algbw, world),
        })
    return rows


def comm_groups(node_of_rank: list[int]) -> tuple[list[list[int]], list[list[int]]] | None:
    """The two levels of a launch, from each rank's node: (nodes, rails).

    nodes: the ranks of each node (the intra-node groups); rails: for each local index i, the
    i-th rank of every node (the inter-node groups, one rank per node). NCCL runs one ring per
    NIC side by side, so timing all rails at once gives each GPU's share of its node's NICs,
    which is what the planner's inter link is. None when the nodes hold different numbers of
    ranks (there is then no rail per local rank to time).
    """
    by_node: dict[int, list[int]] = {}
    for rank, node in enumerate(node_of_rank):
        by_node.setdefault(node, []).append(rank)
    nodes = [by_node[node] for node in sorted(by_node)]
    if len({len(ranks) for ranks in nodes}) != 1:
        return None
    rails = [[ranks[i] for ranks in nodes] for i in range(len(nodes[0]))]
    return nodes, rails


def _node_of_each_rank(device: torch.device) -> list[int] | None:
    """Every rank's node, as torchrun numbers them (GROUP_RANK, else RANK // LOCAL_WORLD_SIZE);
    None when the launcher says neither. The same on every rank (gathered)."""
    node, local_world = os.environ.get("GROUP_RANK"), os.environ.get("LOCAL_WORLD_SIZE")
    if node is None and local_world is None:
        return None
    mine = int(node) if node is not None else dist.get_rank() // max(1, int(local_world))
    gathered = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.tensor([mine], dtype=torch.int64, device=device))
    return [int(t.item()) for t in gathered]


def _level(groups: list[list[int]], handles: list, sizes: list[int], device: torch.device,
           traffic: int) -> dict[str, Any]:
    """all_reduce within every group at once; the rows of this rank's group (all groups are alike)."""
    rank = dist.get_rank()
    mine = next(handle for ranks, handle in zip(groups, handles) if rank in ranks)
    world = len(groups[0])

    def make(numel: int) -> Callable[[], None]:
        full = torch.ones(numel, dtype=torch.float32, device=device)
        return lambda: dist.all_reduce(full, group=mine)

    return {"world_size": world, "groups": len(groups),
            "collectives": {"all_reduce": _time_rows("all_reduce", sizes, world, device, traffic, make)}}


def comm_section(device: torch.device, sizes: list[int] | None = None) -> dict[str, Any]:
    """Time every collective at every size over the whole launch, then, when it spans several
    nodes, all_reduce within the nodes and between them; identical calls on every rank, in the
    same order."""
    world = dist.get_world_size()
    sizes = list(sizes) if sizes else list(CPU_COMM_SIZES if device.type == "cpu" else GPU_COMM_SIZES)
    traffic = CPU_COMM_TRAFFIC_BYTES if device.type == "cpu" else GPU_COMM_TRAFFIC_BYTES
    result: dict[str, Any] = {
        "backend": dist.get_backend(),
        "world_size": world,
        "device": str(device),
        "dtype": "fp32",
        "time": "mean per call over iterations, slowest rank",
        "collectives": {},
    }
    for name in COLLECTIVES:
        make = lambda numel, name=name: _collective(name, numel, world, device)  # noqa: E731
        result["collectives"][name] = _time_rows(name, sizes, world, device, traffic, make)

    layout = _node_of_each_rank(device) if world > 1 else None
    levels = comm_groups(layout) if layout else None
    if layout and levels is None:
        result["levels"] = "not measured: the nodes run different numbers of ranks"
    if levels is None:
        return result
    nodes, rails = levels
    result["nodes"], result["ranks_per_node"] = len(nodes), len(nodes[0])
    if len(nodes) == 1:
        # One node: the whole launch is the intra-node group, already timed.
        result["intra"] = {"world_size": world, "groups": 1,
                           "collectives": {"all_reduce": result["collectives"]["all_reduce"]}}
        return result
    # new_group is collective over the whole launch: every rank creates every group, in one order.
    node_handles = [dist.new_group(ranks) for ranks in nodes] if len(nodes[0]) > 1 else []
    rail_handles = [dist.new_group(ranks) for ranks in rails]
    try:
        if node_handles:
            result["intra"] = _level(nodes, node_handles, sizes, device, traffic)
        result["inter"] = _level(rails, rail_handles, sizes, device, traffic)
        result["inter"]["note"] = (f"one rank per node; the {len(rails)} groups (one per local rank) run at once, "
                                   "so each sees its share of the node's NICs")
    finally:
        for handle in node_handles + rail_handles:
            if handle is not None and handle != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(handle)
    return result
