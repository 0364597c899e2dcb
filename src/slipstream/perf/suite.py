"""`slipstream bench suite`: a fixed, versioned list of workloads, MLPerf style.

    time_to_target        wall time of a cold-start run of the default job to a fixed val loss
    gpt2_124m_fp32/best   GPT-2 124M training step tokens/s and MFU, fp32 and the device's best switches
    trainer_overhead      the Trainer's step time over a hand-written loop's
    data_path             the training loader's tokens/s over the step's
    checkpoint_stall      the stall of an asynchronous checkpoint save
    *_parallel_2          data, tensor, pipeline, context and expert parallelism at world 2

Every workload writes down its methodology (what is warm-up, what one sample is) and its exact
recipe, repeats its measurement, and reports the median with a distribution-free confidence
interval (suite_stats.summarize) and a quality gate: a number only counts when the run's loss is
where it should be. The JSON (schema: docs/benchmark-suite.md) also holds the environment, the
git sha and the machine's measured matmul peak and copy bandwidth (`slipstream probe`), which
`bench compare` uses to compare across machines. A workload that fails is reported and the rest
still run.
"""

from __future__ import annotations

import datetime
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from slipstream.errors import UserError
from slipstream.perf import suite_parallel, suite_workloads
from slipstream.perf.suite_workloads import MODES, SuiteContext, Workload, prepare_data

SUITE_VERSION = 1  # bump when a workload's definition changes
WORKLOADS: dict[str, Workload] = {w.name: w for w in (*suite_workloads.WORKLOADS, *suite_parallel.WORKLOADS)}
# The machine block's probe per device and mode: matmul sizes (None: the probe's defaults, 512-2048 on a
# CPU) and copy bytes (None: the probe's default). A few seconds per dtype at most.
PROBE = {"cpu": {"full": (None, None), "quick": ([256, 512, 1024], 64 * 2**20), "ci": ([64, 128], 8 * 2**20)},
         "cuda": {"full": ([4096], None), "quick": ([4096], None), "ci": ([1024], 64 * 2**20)}}


def run_suite(mode: str = "full", only: list[str] | None = None, repeats: int = 0, out: str = "",
              data_dir: str = "") -> dict[str, Any]:
    """Run the suite (or the workloads in `only`) and write its JSON; returns the result."""
    from slipstream.observe.env import collect_env, write_json_atomic
    from slipstream.perf.suite_compare import load_noise_bands

    if mode not in MODES:
        raise UserError(f"unknown suite mode '{mode}'; use {', '.join(MODES)}")
    names = chosen(only, WORKLOADS, "workload", "--only")
    if repeats < 0:
        raise UserError(f"--repeats must be >= 1 (or 0 for the mode's default), got {repeats}")
    if mode == "ci" and not out:
        raise UserError("--size ci needs --out: benchmarks/suite/ holds the quick and full results")
    device = _device()
    bands = load_noise_bands(device, mode=mode)  # a damaged noise file stops the suite before any work
    started = datetime.datetime.now(datetime.timezone.utc)
    path = Path(out) if out else _default_out(device, mode, started)
    t0 = time.perf_counter()
    data_note = "the --data-dir corpus" if data_dir else "the default corpus (stdlib sources, byte tokens)"
    data_dir = prepare_data(data_dir)  # checked or prepared once, outside every timed region
    print(f"[suite] {mode} mode, {len(names)} workloads on {device}; data {data_dir}", flush=True)
    with tempfile.TemporaryDirectory(prefix="slipstream-suite-") as tmp:
        ctx = SuiteContext(mode=mode, device=device, data_dir=str(data_dir), data_note=data_note, workdir=Path(tmp))
        machine = measure_machine(device, mode)
        rows = []
        for i, name in enumerate(names):
            workload = WORKLOADS[name]
            n = repeats or workload.samples[mode]
            print(f"[suite] {i + 1}/{len(names)} {name}: {n} sample(s)", flush=True)
            rows.append(run_workload(workload, ctx, n, bands))
            print(f"[suite] {name}: {_one_line(rows[-1])}", flush=True)
    result = {"bench": "suite", "suite_version": SUITE_VERSION, "mode": mode, "env": collect_env(),
              "machine": machine, "started": started.isoformat(timespec="seconds"),
              "wall_s": time.perf_counter() - t0, "workloads": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, result)
    print_table(result)
    print(f"wrote {path}")
    return result


def run_workload(workload: Workload, ctx: SuiteContext, n: int, bands: dict[str, float]) -> dict[str, Any]:
    """One workload's entry of the suite JSON; an error in any repeat makes it "failed" (its first lines kept)."""
    from slipstream.perf.suite_stats import DEFAULT_NOISE_BAND, summarize

    entry: dict[str, Any] = {
        "name": workload.name, "title": workload.title,
        "definition": f"{ctx.mode}: " + " ".join(workload.recipe(ctx)) + f"; data: {ctx.data_note}",
        "methodology": workload.methodology, "metric": workload.metric, "unit": workload.unit,
        "higher_is_better": workload.higher_is_better, "normalize_by": workload.normalize_by,
        "samples": [], "median": None, "ci": None, "ci_level": None,
        "noise_band": bands.get(workload.name, DEFAULT_NOISE_BAND),
        "noise_band_source": "measured" if workload.name in bands else "default", "quality": None, "status": "failed",
        "error": None, "secondary": {},
        # the matmul dtype a compute-bound workload runs in: compare normalizes by that dtype's peak
        "dtype": "fp32" if workload.normalize_by == "compute" else None}
    try:
        measured = workload.measure(ctx, n)
    except Exception as e:  # one workload's failure is a row, not the end of the suite
        lines = [line for line in str(e).splitlines() if line.strip()] or [""]
        entry["error"] = f"{type(e).__name__}: " + "\n".join(lines[:3])[:1000]
        return entry
    if "skipped" in measured:
        return {**entry, "status": "skipped", "error": measured["skipped"]}
    samples = [float(x) for x in measured["samples"]]
    entry.update(samples=samples, quality=measured["quality"], secondary=measured["secondary"])
    entry["dtype"] = measured.get("dtype", entry["dtype"])
    entry["normalize_by"] = measured.get("normalize_by", entry["normalize_by"])  # may depend on the device
    if not samples or not all(math.isfinite(x) for x in samples):
        entry["error"] = f"the measurement gave no usable samples: {samples}"
        return entry
    stats = summarize(samples)
    entry.update(median=stats["median"], ci=stats["ci"], ci_level=stats["ci_level"])
    passed = measured["quality"]["passed"]
    entry["status"] = "ok" if passed else "quality_failed"
    if not passed:
        entry["error"] = f"quality gate: {measured['quality']['criterion']}"
    return entry


def measure_machine(device: str, mode: str) -> dict[str, Any]:
    """The JSON's machine block: matmul TFLOP/s per dtype and copy bandwidth, from `slipstream probe`'s
    compute and memory sections at small sizes (seconds); the CPU peak cache is left alone."""
    import torch

    from slipstream.perf.probe import compute_section, memory_section

    sizes, copy_bytes = PROBE[device][mode]
    machine: dict[str, Any] = {"device": device}
    try:
        compute = compute_section(torch.device(device), sizes, write_cache=False)
        memory = memory_section(torch.device(device), copy_bytes=copy_bytes)
    except Exception as e:  # the workloads still run; compare then cannot normalize this file
        machine["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return machine
    by_dtype = {k: v["best_tflops"] for k, v in compute["dtypes"].items() if v.get("status") == "ok"}
    machine.update(matmul_tflops=by_dtype.get("fp32"), matmul_tflops_by_dtype=by_dtype,
                   copy_gb_s=memory["copy"]["gbs"], matmul_sizes=compute["sizes"], copy_bytes=memory["copy"]["bytes"])
    print(f"[suite] machine: matmul {', '.join(f'{k} {v:.3g}' for k, v in by_dtype.items())} TFLOP/s, "
          f"copy {machine['copy_gb_s']:.1f} GB/s", flush=True)
    return machine


def chosen(names: list[str] | None, table, what: str, flag: str) -> list[str]:
    """The entries of `table` named on the command line (all when none), each known and named once,
    in the table's order (gpt2_124m_best after its fp32 run; the speed-run baseline first)."""
    names = list(names) if names else list(table)
    unknown = [name for name in names if name not in table]
    if unknown:
        raise UserError(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(table)}")
    if len(set(names)) != len(names):
        raise UserError(f"a {what} is named twice in {flag}")
    return [name for name in table if name in names]


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _default_out(device: str, mode: str, started: datetime.datetime) -> Path:
    """benchmarks/suite/suite-<device>-<mode>-<YYYYMMDD-HHMM>.json; a second run in the same minute
    gets -2, -3, ...: never over an earlier result."""
    stem = f"suite-{device}-{mode}-{started:%Y%m%d-%H%M}"
    path, k = Path("benchmarks") / "suite" / f"{stem}.json", 1
    while path.exists():
        k += 1
        path = path.with_name(f"{stem}-{k}.json")
    return path


def _one_line(row: dict[str, Any]) -> str:
    if row["median"] is None:
        return f"{row['status']}: {row['error']}"
    text = f"{row['median']:.4g} {row['unit']} [{row['ci'][0]:.4g}, {row['ci'][1]:.4g}]"
    return text if row["status"] == "ok" else f"{text}, {row['status']}: {row['error']}"


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"bench suite v{result['suite_version']}, {result['mode']} mode, "
                        f"{result['wall_s']:.0f} s (median [CI, its level])")
    for col in ("workload", "metric", "median [CI]", "n", "quality"):
        table.add_column(col, justify="right" if col in ("median [CI]", "n") else "left")
    for row in result["workloads"]:
        if row["median"] is None:
            table.add_row(row["name"], row["metric"], "-", "0", f"{row['status']}: {row['error']}")
            continue
        better = "higher" if row["higher_is_better"] else "lower"
        quality = "ok" if row["status"] == "ok" else f"{row['status']}: {row['quality']['criterion']}"
        table.add_row(row["name"], f"{row['metric']} ({row['unit']}, {better} is better)",
                      f"{row['median']:.4g} [{row['ci'][0]:.4g}, {row['ci'][1]:.4g}, {row['ci_level']:.0%}]",
                      str(len(row["samples"])), quality)
    Console(width=max(Console().width, 140)).print(table)
