"""Peak FLOP/s of the training device, the denominator of MFU.

GPUs: the table of vendor datasheet numbers in plan/gpus.py, matched against
torch.cuda.get_device_name().
CPUs: there is no reliable table (core counts, clocks, AVX-512/AMX and thread settings
all matter), so we measure a short matmul probe once per machine and cache the result.
`slipstream probe` (perf/probe.py) uses the same measurement and writes the same cache.

An unknown GPU never falls back to a guess: MFU against a wrong peak is worse than no
MFU. We warn and return None, and the user can pass --metrics.peak_tflops=... instead.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path

import torch

from slipstream.errors import UserError
from slipstream.observe.env import cpu_model, write_json_atomic
from slipstream.plan.gpus import DTYPE_KEYS, lookup_gpu
from slipstream.plan.hardware import CpuFacts

CACHE_FILE_NAME = "cpu_peak_flops.json"
CACHE_VERSION = 1


def _check_dtype_key(dtype_key: str) -> None:
    if dtype_key not in DTYPE_KEYS:
        raise UserError(
            f"Unknown dtype key {dtype_key!r} for peak FLOP/s; use one of {', '.join(DTYPE_KEYS)}."
        )


def gpu_peak_flops(device_name: str, dtype_key: str) -> tuple[float | None, str]:
    """Peak FLOP/s for a GPU given its name, as (flops or None, source description).

    Separate from device_peak_flops so the table rules can be tested without a GPU.
    """
    _check_dtype_key(dtype_key)
    spec = lookup_gpu(device_name)
    if spec is None:
        warnings.warn(
            f"Unknown GPU {device_name!r}: no peak FLOP/s in slipstream's table, so MFU "
            f"will not be reported. Set --metrics.peak_tflops=<dense {dtype_key} TFLOP/s "
            "from your GPU's datasheet> to enable it.",
            stacklevel=2,
        )
        return None, f"unknown gpu {device_name!r}"
    tflops = spec.peaks.get(dtype_key)
    if tflops is None:
        warnings.warn(
            f"GPU {device_name!r} ({spec.name}) has no {dtype_key} peak in slipstream's table "
            f"(the hardware has no fast {dtype_key} path), so MFU will not be reported. Set "
            "--metrics.peak_tflops=<TFLOP/s> to enable it.",
            stacklevel=2,
        )
        return None, f"no {dtype_key} peak for {spec.name}"
    return tflops * 1e12, f"datasheet {spec.name} {dtype_key} dense"


# ---------------------------------------------------------------------------- CPU probe

# CPUs have no TF32 and (in practice) no fp8 matmul: those dtypes run as fp32.
_CPU_DTYPES = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float32,
}
PROBE_SIZES = (1024, 2048)
PROBE_REPEATS = 3
PROBE_BUDGET_S = 1.5
_FP8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name))


def default_cache_dir() -> Path:
    return Path(os.environ.get("SLIPSTREAM_CACHE_DIR") or Path.home() / ".cache" / "slipstream")


def _cpu_cache_key(dtype_key: str) -> str:
    return f"{cpu_model()}|threads={torch.get_num_threads()}|torch={torch.__version__}|{dtype_key}"


def _supports_matmul(dtype: torch.dtype) -> bool:
    try:
        a = torch.ones(8, 8, dtype=dtype)
        torch.mm(a, a)
        return True
    except RuntimeError:
        return False


# Each timing runs enough back-to-back matmuls to last at least this long, so that
# timer resolution and (on GPUs) kernel-launch latency do not dominate small sizes.
MIN_TIMING_S = 0.01
MAX_INNER = 1000
WARMUP_S = 0.05


def _sync(device: torch.device) -> None:
    # GPU kernels run asynchronously: without a sync we would time the launch, not the work.
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _matmul_runner(dtype: torch.dtype, n: int, device: torch.device):
    """A zero-argument function that runs one n x n x n matmul in `dtype` on `device`."""
    if dtype in _FP8_DTYPES:
        a = torch.randn(n, n, device=device).to(dtype)
        # torch._scaled_mm wants the second operand column-major, hence the transpose.
        b = torch.randn(n, n, device=device).to(dtype).t()
        one = torch.ones((), device=device)
        return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    # torch.mm is looked up at call time (not bound here) so tests can stand in for it.
    return lambda: torch.mm(a, b, out=out)


def measure_matmul_flops(
    dtype: torch.dtype,
    sizes: tuple[int, ...] | list[int] = PROBE_SIZES,
    repeats: int = PROBE_REPEATS,
    budget_s: float | None = None,
    device: str | torch.device = "cpu",
) -> dict[int, float]:
    """Best observed FLOP/s of square n x n matmuls in `dtype`, per size n: {n: flops}.

    The one measurement behind both the MFU peak of a CPU (cpu_peak_flops) and
    `slipstream probe`. Per size: an untimed warm-up of at least one call and WARMUP_S
    (thread-pool start-up, weight packing, cuBLAS handles), then `repeats` timings, of
    which the best is kept: the fastest run is the one least disturbed by other work,
    the closest to the hardware.
    fp8 dtypes go through torch._scaled_mm (CUDA with compute capability >= 8.9 only).

    budget_s: skip a size, or stop repeating, when it would run past the budget, so a
    slow machine still answers in about that time. Sizes never measured are absent from
    the result; at least one timing is always made.
    """
    device = torch.device(device)
    start = time.perf_counter()
    results: dict[int, float] = {}
    per_mm, prev_n = 0.0, 0  # seconds of one matmul at size prev_n, from the latest timing

    def over_budget(extra_s: float) -> bool:
        return bool(results) and budget_s is not None and time.perf_counter() - start + extra_s > budget_s

    for n in sizes:
        # Warm-up plus one timing at the new size, scaled from the last size by n^3.
        if prev_n and over_budget(2 * per_mm * (n / prev_n) ** 3):
            break
        run = _matmul_runner(dtype, n, device)
        # Warm up for at least WARMUP_S, not just one call: the first matmuls of a process
        # also wait for lazily started thread pools and kernel selection.
        warm_start = time.perf_counter()
        calls = 0
        while calls == 0 or time.perf_counter() - warm_start < WARMUP_S:
            _sync(device)
            t0 = time.perf_counter()
            run()
            _sync(device)
            per_mm = time.perf_counter() - t0
            calls += 1
        for _ in range(repeats):
            # The warm-up (or previous timing) says how many matmuls fill MIN_TIMING_S.
            inner = max(1, min(MAX_INNER, int(MIN_TIMING_S / max(per_mm, 1e-9))))
            if over_budget(inner * per_mm):
                return results
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(inner):
                run()
            _sync(device)
            per_mm = (time.perf_counter() - t0) / inner
            results[n] = max(results.get(n, 0.0), 2 * n**3 / per_mm)
        prev_n = n
    return results


def _measure_matmul_flops(dtype: torch.dtype) -> float:
    """Best FLOP/s over the peak-probe sizes on this CPU, within ~PROBE_BUDGET_S."""
    return max(measure_matmul_flops(dtype, PROBE_SIZES, PROBE_REPEATS, PROBE_BUDGET_S).values())


def _read_cache(path: Path) -> dict:
    """Cache entries, or {} when the file is missing, corrupt or from another version."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def _valid_entry(entry: object) -> bool:
    if not isinstance(entry, dict):
        return False
    flops = entry.get("flops")
    return isinstance(flops, (int, float)) and 0 < flops < float("inf")


def record_cpu_peak(
    dtype_key: str,
    flops: float,
    measured_dtype: str,
    probe_seconds: float,
    cache_dir: str | None = None,
    source: str = "peaks",
) -> dict:
    """Store a measured CPU peak under this machine's cache key; returns the entry.

    The one cache writer, used by cpu_peak_flops and by `slipstream probe`, so both
    fill the cache that cpu_peak_flops reads. A lower measurement than the cached one is
    not stored (returns the cached entry). An unwritable cache only warns: caching
    is an optimisation and must not stop training.
    """
    _check_dtype_key(dtype_key)
    path = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / CACHE_FILE_NAME
    entries = _read_cache(path)
    entry = {
        "flops": float(flops),
        "measured_dtype": measured_dtype,
        "probe_seconds": round(probe_seconds, 3),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "source": source,
    }
    key = _cpu_cache_key(dtype_key)
    previous = entries.get(key)
    if isinstance(previous, dict) and isinstance(previous.get("flops"), (int, float)) and previous["flops"] > flops:
        # A peak is the best the machine did: a probe disturbed by other work measures less,
        # and must not lower the MFU denominator for every later run.
        return previous
    entries[key] = entry
    try:
        write_json_atomic(path, {"version": CACHE_VERSION, "entries": entries})
    except OSError as e:
        warnings.warn(f"Could not write the CPU peak cache {path}: {e}", stacklevel=3)
    return entry


def _cpu_peak(dtype_key: str, cache_dir: str | None, force: bool) -> tuple[float, dict, bool]:
    """(flops, cache entry, came_from_cache)."""
    _check_dtype_key(dtype_key)
    path = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = path / CACHE_FILE_NAME
    key = _cpu_cache_key(dtype_key)
    entries = _read_cache(path)
    if not force and _valid_entry(entries.get(key)):
        return float(entries[key]["flops"]), entries[key], True

    dtype = _CPU_DTYPES[dtype_key]
    if not _supports_matmul(dtype):
        dtype = torch.float32
    measured_key = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    if measured_key != dtype_key and dtype_key != "tf32":
        warnings.warn(
            f"{dtype_key} matmul is not available on this CPU; its peak FLOP/s is measured "
            "with fp32 instead.",
            stacklevel=3,
        )

    t0 = time.perf_counter()
    flops = _measure_matmul_flops(dtype)
    entry = record_cpu_peak(dtype_key, flops, measured_key, time.perf_counter() - t0, cache_dir)
    return flops, entry, False


def cpu_peak_flops(dtype_key: str = "fp32", cache_dir: str | None = None, force: bool = False) -> float:
    """Measured matmul FLOP/s of this CPU for `dtype_key`, cached per machine.

    The cache key is CPU model + torch thread count + torch version + dtype key, so a
    change to any of them re-measures. tf32 and fp8 are measured as fp32 (CPUs have
    neither); fp16 falls back to fp32, with a warning, where fp16 matmul is unsupported.
    `force=True` re-measures and overwrites the cached value.
    """
    flops, _, _ = _cpu_peak(dtype_key, cache_dir, force)
    return flops


def device_peak_flops(
    device: str | torch.device,
    dtype_key: str,
    user_peak_tflops: float | None = None,
    cache_dir: str | None = None,
) -> tuple[float | None, str]:
    """Peak FLOP/s used as the MFU denominator, as (flops or None, source description).

    A user-given peak always wins. CUDA devices use the datasheet table (unknown GPU:
    warning and None). CPUs use the measured, cached probe. Other device types have no
    known peak: warning and None.
    """
    if user_peak_tflops is not None:
        if not user_peak_tflops > 0:
            raise UserError(
                f"--metrics.peak_tflops must be a positive number of TFLOP/s, got {user_peak_tflops}."
            )
        return float(user_peak_tflops) * 1e12, "user"
    _check_dtype_key(dtype_key)
    device = torch.device(device)
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), dtype_key)
    if device.type == "cpu":
        flops, entry, cached = _cpu_peak(dtype_key, cache_dir, force=False)
        how = "cached" if cached else "measured"
        source = (
            f"cpu matmul probe ({entry.get('measured_dtype', dtype_key)}, "
            f"{torch.get_num_threads()} threads, {how})"
        )
        return flops, source
    warnings.warn(
        f"No peak FLOP/s is known for device type {device.type!r}, so MFU will not be "
        "reported. Set --metrics.peak_tflops=<TFLOP/s> to enable it.",
        stacklevel=2,
    )
    return None, f"unknown device type {device.type!r}"


def this_cpu(cache_dir: str | None = None) -> CpuFacts:
    """This machine, as make_cluster("Nxcpu") needs it: its model name and its measured (cached)
    matmul FLOP/s per dtype key, measured only when the planner asks for a dtype."""
    # cpu_peak_flops is looked up at call time, so a test's stand-in for it is the one used.
    return CpuFacts(cpu_model(), lambda dtype_key: cpu_peak_flops(dtype_key, cache_dir))
