"""`slipstream probe`: what this machine can actually do, measured.

Sections (any subset):
  compute  matmul TFLOP/s per dtype and square size; on CUDA also the fraction of the
           datasheet peak. On a CPU the best fp32/bf16/fp16 numbers are written into the
           per-machine cache that observe.peaks.cpu_peak_flops reads, so MFU on this CPU
           uses exactly what the probe measured.
  memory   device copy bandwidth; on CUDA also host<->device bandwidth, pinned vs pageable.
  comm     collectives (all_reduce, all_gather, reduce_scatter, all_to_all, broadcast)
           over message sizes, with nccl-tests' algorithm and bus bandwidth. Needs a
           distributed launch (torchrun); every rank runs the same collectives. When the
           launch spans several nodes it also times all_reduce within each node ("intra":
           the ranks of one node) and between nodes ("inter": the i-th rank of every node,
           all local ranks at once, so each sees its share of the node's NICs), the two
           links the planner reads (`slipstream plan --probe`).
  storage  read throughput of a prepared token-shard folder.

Every timing excludes a warm-up and keeps the best of a few repeats (the fastest run is
the one least disturbed by other work), except collectives, which report the mean over
iterations of the slowest rank, as nccl-tests does.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from slipstream.errors import UserError
from slipstream.observe import peaks
from slipstream.observe.env import collect_env, write_json_atomic

SECTIONS = ("compute", "memory", "comm", "storage")
DEFAULT_SECTIONS = ("compute", "memory")

# Matmul sizes: big enough to reach the hardware's rate, small enough to stay quick.
CPU_MATMUL_SIZES = (512, 1024, 2048)
GPU_MATMUL_SIZES = (2048, 4096, 8192)
MATMUL_REPEATS = 3
# Per dtype; keeps the default CPU probe to a few seconds even on a slow machine.
CPU_MATMUL_BUDGET_S = 2.5
GPU_MATMUL_BUDGET_S = 20.0

# Copies large enough that fixed per-call costs vanish next to the transfer itself.
CPU_COPY_BYTES = 256 * 2**20
GPU_COPY_BYTES = 1024 * 2**20
HOST_TRANSFER_BYTES = 256 * 2**20
COPY_REPEATS = 5

# Collective message sizes (bytes). gloo on a CPU is slow, so fewer and smaller sizes.
CPU_COMM_SIZES = (2**10, 2**16, 2**20, 2**24)
GPU_COMM_SIZES = tuple(2**10 * 4**k for k in range(9))  # 1 KiB .. 64 MiB
COMM_WARMUP = 2
COMM_MIN_ITERS, COMM_MAX_ITERS = 5, 50
# Iterations per size ~ this much traffic, so small messages get many iterations.
CPU_COMM_TRAFFIC_BYTES = 128 * 2**20
GPU_COMM_TRAFFIC_BYTES = 2**30
COMM_TIMEOUT_S = 120
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")

STORAGE_READ_CHUNK = 8 * 2**20

_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COMPUTE_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
# Only these are real CPU matmul rates; they go into the CPU peak cache.
_CPU_CACHED_DTYPES = ("fp32", "bf16", "fp16")

COMM_LAUNCH_HINT = "torchrun --standalone --nproc-per-node N -m slipstream probe --sections comm"
PAGE_CACHE_NOTE = (
    "the page cache was not dropped: files read recently are served from memory, so this "
    "can be far above the disk's speed; for a cold-disk number run "
    "`sync; echo 3 | sudo tee /proc/sys/vm/drop_caches` first"
)


# ------------------------------------------------------------------- bus bandwidth


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


# ------------------------------------------------------------------------ helpers


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def _resolve_device(device: str | torch.device) -> torch.device:
    """"auto" -> this process's accelerator (LOCAL_RANK under torchrun), else the CPU."""
    has_accelerator = torch.accelerator.is_available()
    if str(device) == "auto":
        if not has_accelerator:
            return torch.device("cpu")
        kind = torch.accelerator.current_accelerator().type
        return torch.device(kind, _local_rank() % torch.accelerator.device_count())
    try:
        resolved = torch.device(device)
    except RuntimeError as e:
        raise UserError(f"--device {device!r} is not a device: {e}. Use auto, cpu or cuda[:N].") from None
    if resolved.type == "cpu":
        return resolved
    if not has_accelerator or torch.accelerator.current_accelerator().type != resolved.type:
        raise UserError(f"--device {device}: no {resolved.type} device is available here; use --device cpu or auto.")
    if resolved.index is None:
        resolved = torch.device(resolved.type, _local_rank() % torch.accelerator.device_count())
    return resolved


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _init_distributed(device: torch.device) -> bool:
    """Join the process group torchrun set up in the environment; True if we created it."""
    if dist.is_initialized():
        return False
    if not _under_torchrun():
        raise UserError(
            "the comm section measures collectives between processes, so it needs a distributed "
            f"launch: run `{COMM_LAUNCH_HINT}` (N = processes, e.g. GPUs on this machine)."
        )
    if device.type == "cpu":
        # torchrun gives each worker OMP_NUM_THREADS=1; share the cores between the local ranks.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        from slipstream.distributed.mesh import usable_cores

        torch.set_num_threads(max(1, usable_cores() // local_world))
    dist.init_process_group(
        backend=dist.get_default_backend_for_device(device),
        # A short timeout: a hung peer should fail the probe in minutes, not the 30-minute default.
        timeout=datetime.timedelta(seconds=COMM_TIMEOUT_S),
        device_id=device if device.type == "cuda" else None,
    )
    return True


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@contextlib.contextmanager
def _tf32(enabled: bool):
    """Allow (tf32) or forbid (true fp32) TF32 tensor cores for fp32 matmuls, then restore."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


# ------------------------------------------------------------------------ compute


def _skip_reason(key: str, device: torch.device) -> str | None:
    """Why dtype `key` cannot be measured on `device`, or None when it can."""
    if key == "tf32" and device.type != "cuda":
        return "TF32 is an NVIDIA tensor-core mode (CUDA only)"
    if key == "fp8":
        if device.type != "cuda":
            return "fp8 matmul needs CUDA compute capability >= 8.9 (torch._scaled_mm)"
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            return f"fp8 matmul needs compute capability >= 8.9; this GPU is {capability[0]}.{capability[1]}"
        if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
            return f"torch {torch.__version__} has no torch._scaled_mm / float8_e4m3fn"
    return None


def compute_section(device: torch.device, sizes: list[int] | None = None, cache_dir: str | None = None,
                    write_cache: bool = True) -> dict[str, Any]:
    """Matmul TFLOP/s per dtype and size; CPU results also go into the CPU peak cache."""
    default_sizes = GPU_MATMUL_SIZES if device.type == "cuda" else CPU_MATMUL_SIZES
    sizes = list(sizes) if sizes else list(default_sizes)
    # Small matrices measure overheads, not the peak: only full-size probes may set the MFU peak.
    write_cache = write_cache and max(sizes) >= max(default_sizes)
    budget = GPU_MATMUL_BUDGET_S if device.type == "cuda" else CPU_MATMUL_BUDGET_S
    spec = peaks.lookup_gpu(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    result: dict[str, Any] = {"device": str(device), "sizes": sizes, "dtypes": {}}
    if device.type == "cuda":
        result["datasheet"] = spec.name if spec else None
    for key in COMPUTE_DTYPES:
        reason = _skip_reason(key, device)
        if reason:
            result["dtypes"][key] = {"status": "skipped", "reason": reason}
            continue
        dtype = getattr(torch, "float8_e4m3fn", None) if key == "fp8" else _DTYPES[key]
        t0 = time.perf_counter()
        try:
            # fp32 must measure true fp32 on GPUs that could silently use TF32.
            with _tf32(key == "tf32") if device.type == "cuda" else contextlib.nullcontext():
                by_size = peaks.measure_matmul_flops(dtype, sizes, MATMUL_REPEATS, budget, device)
        except (RuntimeError, TypeError, NotImplementedError) as e:
            # E.g. bf16 on a GPU without bf16 support: report, do not abort the probe.
            result["dtypes"][key] = {"status": "skipped", "reason": _first_line(e)}
            continue
        seconds = time.perf_counter() - t0
        best = max(by_size.values())
        entry: dict[str, Any] = {
            "status": "ok",
            "tflops_by_size": {str(n): flops / 1e12 for n, flops in by_size.items()},
            "best_tflops": best / 1e12,
            "seconds": round(seconds, 3),
        }
        if len(by_size) < len(sizes):
            entry["note"] = f"sizes {[n for n in sizes if n not in by_size]} skipped to stay within {budget:g} s"
        if key == "fp8":
            entry["note"] = "torch._scaled_mm e4m3, unit scales, bf16 output, fast accumulation"
        if device.type == "cuda":
            peak = spec.peaks.get(key) if spec else None
            entry["datasheet_tflops"] = peak
            entry["fraction_of_peak"] = best / (peak * 1e12) if peak else None
        if device.type == "cpu" and key in _CPU_CACHED_DTYPES and write_cache:
            peaks.record_cpu_peak(key, best, key, seconds, cache_dir, source="slipstream probe")
            entry["written_to_peak_cache"] = True
        result["dtypes"][key] = entry
    return result


# ------------------------------------------------------------------------- memory


def _best_copy_seconds(dst: torch.Tensor, src: torch.Tensor, device: torch.device, repeats: int) -> float:
    dst.copy_(src, non_blocking=True)  # warm-up: first-touch page faults, allocator, driver
    _sync(device)
    best = math.inf
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def memory_section(device: torch.device, copy_bytes: int | None = None,
                   transfer_bytes: int | None = None) -> dict[str, Any]:
    """Device copy bandwidth (read + write bytes) and host<->device bandwidth."""
    n = copy_bytes or (CPU_COPY_BYTES if device.type == "cpu" else GPU_COPY_BYTES)
    # ones, not empty: reading never-touched memory maps the kernel's zero page and
    # would look impossibly fast.
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _best_copy_seconds(dst, src, device, COPY_REPEATS)
    result: dict[str, Any] = {
        "device": str(device),
        "copy": {"bytes": n, "seconds": seconds, "gbs": 2 * n / seconds / 1e9, "counts": "read + write bytes"},
    }
    del src, dst

    not_applicable = "n/a (no accelerator)"
    if device.type == "cpu":
        for key in ("h2d_pinned", "h2d_pageable", "d2h_pinned", "d2h_pageable"):
            result[key] = not_applicable
        return result

    m = transfer_bytes or HOST_TRANSFER_BYTES
    on_device = torch.ones(m, dtype=torch.uint8, device=device)
    pageable = torch.ones(m, dtype=torch.uint8)
    # Pinned (page-locked) host memory is what the GPU's copy engines can DMA directly;
    # pageable memory is staged through a driver buffer first, hence usually slower.
    pinned = pageable.pin_memory() if device.type == "cuda" else None
    for name, host in (("pinned", pinned), ("pageable", pageable)):
        if host is None:
            result[f"h2d_{name}"] = result[f"d2h_{name}"] = "n/a (pinned memory is only measured on CUDA)"
            continue
        h2d = _best_copy_seconds(on_device, host, device, COPY_REPEATS)
        d2h = _best_copy_seconds(host, on_device, device, COPY_REPEATS)
        result[f"h2d_{name}"] = {"bytes": m, "seconds": h2d, "gbs": m / h2d / 1e9}
        result[f"d2h_{name}"] = {"bytes": m, "seconds": d2h, "gbs": m / d2h / 1e9}
    return result


# --------------------------------------------------------------------------- comm


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
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            run()
        _sync(device)
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


# ------------------------------------------------------------------------ storage


def storage_section(data_dir: str) -> dict[str, Any]:
    """Read every *.bin shard of a prepared data folder once; GB/s over all of them."""
    folder = Path(data_dir)
    if not folder.is_dir():
        raise UserError(
            f"--data-dir {data_dir}: no such folder. Point it at a prepared token-shard folder "
            "(made by `slipstream data prepare`)."
        )
    files = sorted(p for p in folder.rglob("*.bin") if p.is_file())
    if not files:
        raise UserError(f"--data-dir {data_dir}: no *.bin token shards in it; prepare it with `slipstream data prepare`.")
    buffer = bytearray(STORAGE_READ_CHUNK)
    total = 0
    t0 = time.perf_counter()
    for path in files:
        # Unbuffered reads into one reused buffer: measures the storage, not Python allocation.
        with open(path, "rb", buffering=0) as f:
            while count := f.readinto(buffer):
                total += count
    seconds = max(time.perf_counter() - t0, 1e-9)
    return {
        "data_dir": str(folder),
        "files": len(files),
        "bytes": total,
        "seconds": seconds,
        "gbs": total / seconds / 1e9,
        "note": PAGE_CACHE_NOTE,
    }


# ------------------------------------------------------------------------ reports


def _gbs(value: Any) -> str:
    return f"{value['gbs']:.2f}" if isinstance(value, dict) else str(value)


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def print_report(result: dict[str, Any]) -> None:
    """One rich table per measured section."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    sections = result["sections"]
    if "compute" in sections:
        compute = sections["compute"]
        sizes = [str(n) for n in compute["sizes"]]
        table = Table(title=f"matmul TFLOP/s on {compute['device']} (best of {MATMUL_REPEATS}, warm-up excluded)")
        table.add_column("dtype")
        for n in sizes:
            table.add_column(f"n={n}", justify="right")
        table.add_column("best", justify="right")
        if "datasheet" in compute:
            table.add_column(f"of peak ({compute['datasheet'] or 'unknown GPU'})", justify="right")
        table.add_column("note")
        for key, entry in compute["dtypes"].items():
            if entry["status"] != "ok":
                cells = ["-"] * (len(sizes) + 1) + (["-"] if "datasheet" in compute else [])
                table.add_row(key, *cells, f"skipped: {entry['reason']}")
                continue
            by_size = entry["tflops_by_size"]
            cells = [f"{by_size[n]:.3f}" if n in by_size else "-" for n in sizes]
            cells.append(f"{entry['best_tflops']:.3f}")
            if "datasheet" in compute:
                fraction = entry.get("fraction_of_peak")
                cells.append(f"{fraction:.0%}" if fraction is not None else "-")
            note = entry.get("note", "")
            if entry.get("written_to_peak_cache"):
                note = (note + "; " if note else "") + "CPU peak cache updated"
            table.add_row(key, *cells, note)
        console.print(table)
    if "memory" in sections:
        memory = sections["memory"]
        table = Table(title=f"memory bandwidth, GB/s (best of {COPY_REPEATS})")
        table.add_column("transfer")
        table.add_column("GB/s", justify="right")
        table.add_column("size", justify="right")
        copy = memory["copy"]
        table.add_row(f"copy on {memory['device']} (read + write)", _gbs(copy), _size(copy["bytes"]))
        for key, label in (("h2d_pinned", "host -> device, pinned"), ("h2d_pageable", "host -> device, pageable"),
                           ("d2h_pinned", "device -> host, pinned"), ("d2h_pageable", "device -> host, pageable")):
            value = memory[key]
            table.add_row(label, _gbs(value), _size(value["bytes"]) if isinstance(value, dict) else "")
        console.print(table)
    if "comm" in sections:
        comm = sections["comm"]
        table = Table(title=f"collectives: {comm['backend']}, world {comm['world_size']}, fp32 "
                            f"(nccl-tests algbw / busbw, slowest rank)")
        for column in ("collective", "size", "time (us)", "algbw GB/s", "busbw GB/s"):
            table.add_column(column, justify="left" if column == "collective" else "right")
        for name, rows in comm["collectives"].items():
            for i, row in enumerate(rows):
                table.add_row(name if i == 0 else "", _size(row["bytes"]), f"{row['seconds'] * 1e6:.1f}",
                              f"{row['algbw_gbs']:.3f}", f"{row['busbw_gbs']:.3f}")
        console.print(table)
        if "inter" in comm:
            table = Table(title=f"all_reduce by level: {comm['nodes']} nodes x {comm['ranks_per_node']} ranks "
                                "(every group at once; busbw per rank)")
            for column in ("level", "ranks", "size", "time (us)", "busbw GB/s"):
                table.add_column(column, justify="left" if column == "level" else "right")
            for level in ("intra", "inter"):
                for i, row in enumerate(comm.get(level, {}).get("collectives", {}).get("all_reduce", [])):
                    table.add_row(level if i == 0 else "", str(comm[level]["world_size"]) if i == 0 else "",
                                  _size(row["bytes"]), f"{row['seconds'] * 1e6:.1f}", f"{row['busbw_gbs']:.3f}")
            console.print(table)
    if "storage" in sections:
        storage = sections["storage"]
        table = Table(title=f"storage read: {storage['data_dir']}")
        for column in ("files", "size", "seconds", "GB/s"):
            table.add_column(column, justify="right")
        table.add_row(str(storage["files"]), _size(storage["bytes"]), f"{storage['seconds']:.3f}", f"{storage['gbs']:.2f}")
        console.print(table)
        console.print(f"note: {storage['note']}", markup=False, highlight=False)


# ---------------------------------------------------------------------- entry points


def run_probe(
    sections: list[str] | tuple[str, ...] = DEFAULT_SECTIONS,
    device: str = "auto",
    data_dir: str | None = None,
    out: str | None = None,
    sizes: list[int] | None = None,
    comm_sizes: list[int] | None = None,
    show: bool = True,
) -> dict[str, Any]:
    """Measure the requested sections and return the result (see module doc).

    sizes: matmul sizes for compute (default 512/1024/2048 on CPU, 2048/4096/8192 on CUDA).
    comm_sizes: collective message sizes in bytes (default 1 KiB..16 MiB on CPU, ..64 MiB on GPU).
    Under a distributed launch every rank measures, and only rank 0 prints, writes `out`
    and updates the CPU peak cache.
    """
    sections = list(dict.fromkeys(sections))  # de-duplicated, order kept
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or not sections:
        raise UserError(f"unknown probe section(s) {unknown}; choose from {', '.join(SECTIONS)}.")
    if "storage" in sections and not data_dir:
        raise UserError("the storage section reads a prepared token-shard folder: pass --data-dir DIR.")
    for name, values in (("sizes", sizes), ("comm_sizes", comm_sizes)):
        if values is not None and (not values or min(values) < 1):
            raise UserError(f"{name} must be positive integers, got {values}.")

    resolved = _resolve_device(device)
    if resolved.type == "cuda":
        torch.cuda.set_device(resolved)
    # Checked before any measuring, so a missing launcher fails at once.
    created_group = _init_distributed(resolved) if "comm" in sections else False
    try:
        rank = _rank()
        env = collect_env()
        result: dict[str, Any] = {
            "machine": {
                "device": str(resolved),
                "device_name": torch.cuda.get_device_name(resolved) if resolved.type == "cuda" else env.get("cpu_model"),
                "cpu_model": env.get("cpu_model"),
                "torch_threads": torch.get_num_threads(),
                "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            },
            "git_sha": env.get("git_sha"),
            "env": env,
            "sections": {},
        }
        for section in sections:
            if section == "compute":
                result["sections"]["compute"] = compute_section(resolved, sizes, write_cache=rank == 0)
            elif section == "memory":
                result["sections"]["memory"] = memory_section(resolved)
            elif section == "comm":
                result["sections"]["comm"] = comm_section(resolved, comm_sizes)
            elif section == "storage":
                result["sections"]["storage"] = storage_section(data_dir)
        if rank == 0:
            if show:
                print_report(result)
            if out:
                write_json_atomic(out, result)
                if show:
                    print(f"wrote {out}")
        return result
    finally:
        if created_group:
            dist.destroy_process_group()
