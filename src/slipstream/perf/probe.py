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
           links the planner reads (`slipstream plan --probe`). Measured by perf/probe_comm.py.
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
from typing import Any

import torch
import torch.distributed as dist

from slipstream.errors import UserError
from slipstream.observe import peaks
from slipstream.observe.env import collect_env, write_json_atomic
from slipstream.perf.probe_comm import comm_section, sync_device

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

STORAGE_READ_CHUNK = 8 * 2**20

_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COMPUTE_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
# Only these are real CPU matmul rates; they go into the CPU peak cache.
_CPU_CACHED_DTYPES = ("fp32", "bf16", "fp16")

COMM_LAUNCH_HINT = "torchrun --standalone --nproc-per-node N -m slipstream probe --sections comm"
COMM_TIMEOUT_S = 120
PAGE_CACHE_NOTE = (
    "the page cache was not dropped: files read recently are served from memory, so this "
    "can be far above the disk's speed; for a cold-disk number run "
    "`sync; echo 3 | sudo tee /proc/sys/vm/drop_caches` first"
)


# ------------------------------------------------------------------------ helpers


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
    sync_device(device)
    best = math.inf
    for _ in range(repeats):
        sync_device(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync_device(device)
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
