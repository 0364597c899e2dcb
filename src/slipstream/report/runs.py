"""Reading run directories for `slipstream report` and `slipstream compare`.

A run directory is slipstream's own folder (train/rundir.py), but a report is often made of a
run that crashed, was copied half-way, or was edited by hand, so every file is read
defensively: sizes are capped, a missing file or a line that does not parse is skipped with a
note that the page shows, and only the fields the report draws are kept, as plain numbers and
short strings. Reading a run never runs code (TOML and JSON only) and its memory is bounded
whatever the length of the run: interval records beyond MAX_POINTS are thinned evenly (the last
one always kept: it holds the final loss, step and tokens). Only files that really lie in the run
folder are read: a file there that links elsewhere (a config.toml linked to a credentials file)
would put that file's text on a page meant to be shared.

What a run directory holds (see README "Run directory"):

    config.toml          the resolved config
    env.json             versions, hardware, git sha
    metrics.jsonl        interval records (step, loss, lr, grad_norm, step_time_s, ...), eval
                         records (val_loss), checkpoint_stall_s records, guard events
    summary.json         the final numbers; "memory", "ranks" (distributed), "comm"
    logs/rank<R>.jsonl   each rank's own interval records (logging.rank_logs)
    traces/rank<R>.json  profiler traces (profile.enabled)
"""

from __future__ import annotations

import math
import re
import statistics
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from slipstream.errors import UserError
from slipstream.safe_read import MiB, Cap, load_json_capped, loads_bounded, read_bytes_capped, read_line_capped

# Our own files are small (a summary is a few KiB, a metrics line ~1-20 KiB with MoE loads); the
# caps only stop a damaged or foreign file from taking the machine's memory.
RUN_JSON = Cap("run JSON file (summary.json, env.json)", 64 * MiB, "SLIPSTREAM_MAX_RUN_JSON_BYTES")
RUN_CONFIG = Cap("run config.toml", 16 * MiB, "SLIPSTREAM_MAX_RUN_CONFIG_BYTES")
METRICS_LINE = Cap("metrics.jsonl line", 16 * MiB, "SLIPSTREAM_MAX_METRICS_LINE_BYTES")

MAX_POINTS = 20_000  # interval records kept per run; a longer run is thinned evenly
MAX_EVENTS = 2_000  # eval records and checkpoint stalls kept per run (thinned), guard events (the first)
MAX_RANK_LOGS = 256
MAX_RANK_POINTS = 2_000  # records kept per rank log: only their medians and peak are shown
MAX_TRACES = 64
MAX_MOE_LAYERS = 256
MAX_EXPERTS = 4_096
MAX_NOTES = 20
MAX_TEXT = 200  # characters of a string from a run file shown on the page

# The fields of an interval record the report draws (the rest: MoE, mixture, memory detail).
INTERVAL_KEYS = ("step", "loss", "lr", "grad_norm", "grad_norm_clipped", "step_time_s", "data_wait_s",
                 "tokens_per_s", "tokens_per_s_per_device", "mfu", "mem_peak_bytes", "tokens")
RANK_KEYS = ("step", "step_time_s", "tokens_per_s", "mem_peak_bytes")  # what the per-rank section draws
GUARD_KEYS = ("loss", "grad_norm", "median")
_MOE_KEY = re.compile(r"moe/(.{1,100})/(load|imbalance)")
_RANK_LOG = re.compile(r"rank(\d{1,6})\.jsonl")


def number(value: Any) -> float | None:
    """A finite int or float as float, else None (bools, strings, NaN, lists are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def short_text(value: Any, limit: int = MAX_TEXT) -> str:
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass(eq=False)  # runs are told apart by identity (two copies of one folder are two runs)
class RunData:
    """What the report knows of one run directory; every field may be empty."""

    path: Path
    name: str
    config_text: str | None = None
    config: dict[str, Any] = field(default_factory=dict)  # the parsed TOML, nested
    env: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    intervals: list[dict[str, float]] = field(default_factory=list)  # INTERVAL_KEYS present as numbers
    evals: list[dict[str, float]] = field(default_factory=list)  # step, val_loss, val_loss_stderr
    stalls: list[tuple[float, float]] = field(default_factory=list)  # (step, checkpoint stall seconds)
    stall_totals: tuple[int, float, float] = (0, 0.0, 0.0)  # every stall, also the thinned: count, sum, max
    last_loss: float | None = None  # of the last interval that logged one; NaN where the run diverged
    guard_events: list[dict[str, Any]] = field(default_factory=list)  # step, kind, action, loss, grad_norm
    moe_loads: dict[str, list[float]] = field(default_factory=dict)  # layer -> last per-expert load
    moe_load_step: float | None = None
    moe_imbalance: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # layer -> (step, max/mean)
    rank_logs: dict[int, list[dict[str, float]]] = field(default_factory=dict)  # rank -> interval records
    trace_files: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        if len(self.notes) < MAX_NOTES:
            self.notes.append(text)
        elif len(self.notes) == MAX_NOTES:
            self.notes.append("more problems were found; only the first ones are listed")

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """(steps, values) of an interval field, only where it was logged."""
        points = [(r["step"], r[key]) for r in self.intervals if key in r]
        return [p[0] for p in points], [p[1] for p in points]

    @property
    def world_size(self) -> int:
        world = number(self.summary.get("world_size"))
        return int(world) if world and world >= 1 else 1


def is_run_dir(path: str | Path) -> bool:
    """Whether `path` is a folder with a run's results (metrics.jsonl or summary.json)."""
    path = Path(path)
    return path.is_dir() and any((path / name).is_file() for name in ("metrics.jsonl", "summary.json"))


def read_run(path: str | Path, name: str | None = None) -> RunData:
    """Read one run directory (runs/latest, a link, is followed). A folder with neither
    metrics.jsonl nor summary.json is a UserError; anything else missing or damaged is a note."""
    given = Path(path)
    if not given.exists():
        raise UserError(f"'{given}' does not exist; give the --run.dir of a `slipstream train` run, e.g. runs/latest")
    if not is_run_dir(given):
        raise UserError(f"'{given}' is not a run directory (no metrics.jsonl or summary.json in it); give the "
                        "--run.dir of a `slipstream train` run, e.g. runs/latest")
    folder = given.resolve()
    run = RunData(folder, name or folder.name)
    try:  # each reader turns a damaged file into a note; this is for a folder that cannot be listed
        run.config_text, run.config = _read_config(folder / "config.toml", run)
        run.env = _read_json_object(folder / "env.json", run)
        run.summary = _read_json_object(folder / "summary.json", run)
        _read_metrics(folder / "metrics.jsonl", run)
        _read_rank_logs(folder / "logs", run)
        run.trace_files = _trace_files(folder, run)
    except OSError as e:
        raise UserError(f"'{given}' could not be read ({e.strerror or e}); check its permissions") from None
    _drop_stale_summary(run)
    if (folder / "history").is_dir():
        run.note("history/ holds the results of earlier runs in this folder; only the latest run is shown "
                 "(give history/<n> to report an earlier one)")
    return run


# What summary.json says of the run's end; its memory, ranks and device stay true of the run.
SUMMARY_END_KEYS = ("final_loss", "val_loss", "val_loss_stderr", "val_tokens", "steps", "steps_this_run", "tokens",
                    "tokens_per_s", "tokens_per_s_per_device", "mfu", "wall_time_s", "loop_time_s", "stopped_early")


def _drop_stale_summary(run: RunData) -> None:
    """A resumed run keeps the summary.json of its earlier part until it ends: while it runs, or
    after it crashed, metrics.jsonl goes past the summary's step, whose final numbers are then
    those of an earlier step. They are dropped; metrics.jsonl gives the final numbers instead."""
    steps = number(run.summary.get("steps"))
    last = run.intervals[-1]["step"] if run.intervals else None
    if steps is not None and last is not None and last > steps:
        for key in SUMMARY_END_KEYS:
            run.summary.pop(key, None)
        run.note(f"summary.json is of step {steps:g} but metrics.jsonl goes on to step {last:g} (a resumed run "
                 "still running, or stopped before its end): the final numbers are taken from metrics.jsonl")


def read_runs(paths: list[str | Path]) -> list[RunData]:
    """Several runs, each with a name that tells it apart from the others on the page."""
    resolved = [Path(p).resolve() for p in paths]
    return [read_run(p, name) for p, name in zip(paths, unique_names(resolved))]


def unique_names(paths: list[Path]) -> list[str]:
    """The folders' names; where two are the same, as many parent folders as tell them apart. One
    folder given twice is told apart by a number: "a (1)", "a (2)"."""
    distinct = list(dict.fromkeys(paths))
    depth = 1
    while len({p.parts[-depth:] for p in distinct}) < len(distinct):
        depth += 1
    names, seen = [], {}
    for path in paths:
        name = Path(*path.parts[-depth:]).as_posix()
        if paths.count(path) > 1:
            seen[path] = seen.get(path, 0) + 1
            name += f" ({seen[path]})"
        names.append(name)
    return names


# ---------------------------------------------------------------------------- files


def _own_file(path: Path, run: RunData) -> bool:
    """Whether `path` is a file that really lies in the run folder (run.path, resolved); a link
    to a file elsewhere is noted and not read."""
    if not path.is_file():
        return False
    try:
        inside = path.resolve().is_relative_to(run.path)
    except (OSError, RuntimeError):  # a link loop
        inside = False
    if not inside:
        run.note(f"{path.relative_to(run.path)} links to a file outside the run directory; it is not read "
                 "(a report shows only the run's own files)")
    return inside


def _read_config(path: Path, run: RunData) -> tuple[str | None, dict[str, Any]]:
    if not _own_file(path, run):
        if not path.is_file():
            run.note("config.toml is missing: no resolved config, config differences or planned step time")
        return None, {}
    try:
        text = read_bytes_capped(path, RUN_CONFIG).decode("utf-8")
        return text, tomllib.loads(text)
    except (OSError, UserError, UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError) as e:
        run.note(f"config.toml could not be read ({short_text(e)}); it is left out")
        return None, {}


def _read_json_object(path: Path, run: RunData) -> dict[str, Any]:
    if not _own_file(path, run):
        if not path.is_file():
            run.note(f"{path.name} is missing" + (" (the run did not finish?)" if path.name == "summary.json" else ""))
        return {}
    try:
        value = load_json_capped(path, RUN_JSON)
    except (OSError, ValueError, UserError) as e:  # ValueError: JSONDecodeError
        run.note(f"{path.name} could not be read ({short_text(e)}); it is left out")
        return {}
    if not isinstance(value, dict):
        run.note(f"{path.name} is not a JSON object; it is left out")
        return {}
    return value


def jsonl_records(path: Path, run: RunData) -> Iterator[dict[str, Any]]:
    """The JSON objects of a .jsonl file; a line that does not parse is skipped and counted in a
    note (a run killed while writing leaves half a line), a line over the cap ends the reading."""
    bad = []
    with open(path, "rb") as f:
        line_no = 0
        while True:
            line_no += 1
            try:
                line = read_line_capped(f, METRICS_LINE, path.name, line_no)
            except UserError as e:
                run.note(f"{e}; the rest of {path.name} is skipped")
                break
            if not line:
                break
            if not line.strip():
                continue
            try:
                record = loads_bounded(line, path.name)
            except (ValueError, UserError):
                record = None
            if isinstance(record, dict) and number(record.get("step")) is not None:
                yield record
            else:
                bad.append(line_no)
    if bad:
        shown = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        run.note(f"{path.name}: {len(bad)} line(s) that are not metric records were skipped (line {shown})")


class _Thinned:
    """A list that keeps every k-th item appended, doubling k when it would pass `limit`, so a
    long run's curve keeps its shape in bounded memory. `items` ends with the last item appended
    even where the stride skips it: the final loss, step and tokens are read from it."""

    def __init__(self, limit: int | None = None):
        self.kept: list[Any] = []
        self.limit, self.stride, self.seen = limit or MAX_POINTS, 1, 0
        self.last: Any = None

    def append(self, item: Any) -> bool:
        keep = self.seen % self.stride == 0
        self.seen += 1
        self.last = item
        if keep:
            self.kept.append(item)
            if len(self.kept) > self.limit:
                self.kept = self.kept[::2]
                self.stride *= 2
        return keep

    @property
    def items(self) -> list[Any]:
        if self.seen and (not self.kept or self.kept[-1] is not self.last):
            return [*self.kept, self.last]
        return list(self.kept)


def _interval(record: dict[str, Any]) -> dict[str, float]:
    return {k: v for k in INTERVAL_KEYS if (v := number(record.get(k))) is not None}


def _diverged(record: dict[str, Any], run: RunData) -> bool:
    """Whether an interval record's loss says the run diverged. The trainer logs a NaN or inf as
    null and stops; null is also what a stability guard logs when it dropped every step of the
    interval, so it means divergence only where no guard ran (stability.policy "none")."""
    loss = record.get("loss")
    if isinstance(loss, float) and not math.isfinite(loss):  # a foreign writer's bare NaN
        return True
    stability = run.config.get("stability")  # no config: no telling, so not a divergence
    return "loss" in record and loss is None and isinstance(stability, dict) and stability.get("policy") == "none"


def _read_metrics(path: Path, run: RunData) -> None:
    if not _own_file(path, run):
        if not path.is_file():
            run.note("metrics.jsonl is missing: no curves")
        return
    intervals, evals, stalls = _Thinned(), _Thinned(MAX_EVENTS), _Thinned(MAX_EVENTS)
    count, total, longest = 0, 0.0, 0.0
    dropped_events, diverged_at = 0, None
    try:
        for record in jsonl_records(path, run):
            step = number(record["step"])
            if "val_loss" in record:
                evals.append({k: v for k in ("step", "val_loss", "val_loss_stderr", "val_tokens")
                              if (v := number(record.get(k))) is not None})
            elif "checkpoint_stall_s" in record:
                stall = number(record["checkpoint_stall_s"])
                if stall is not None:
                    stalls.append((step, stall))
                    count, total, longest = count + 1, total + stall, max(longest, stall)
            elif "guard_event" in record:
                if len(run.guard_events) >= MAX_EVENTS:
                    dropped_events += 1
                else:
                    event = {"step": step, "kind": short_text(record["guard_event"], 60),
                             "action": short_text(record.get("action", ""), 60)}
                    # A non-finite loss is logged as the string "nan" / "inf": keep it as text.
                    event.update({k: v if (v := number(record[k])) is not None else short_text(record[k], 20)
                                  for k in GUARD_KEYS if k in record})
                    run.guard_events.append(event)
            elif "step_time_s" in record or "loss" in record:
                _moe_fields(record, step, run, over_time=intervals.append(_interval(record)))
                if _diverged(record, run):
                    run.last_loss = math.nan
                    if diverged_at is None:
                        diverged_at = step
                elif (loss := number(record.get("loss"))) is not None:
                    run.last_loss, diverged_at = loss, None
    except OSError as e:
        run.note(f"metrics.jsonl could not be read to the end ({e.strerror or e}); what was read is shown")
    run.intervals, run.evals, run.stalls = intervals.items, evals.items, stalls.items
    run.stall_totals = (count, total, longest)
    if dropped_events:
        run.note(f"{dropped_events} more stability events are not listed (the first {MAX_EVENTS} are)")
    if diverged_at is not None:
        run.note(f"the loss was NaN or infinite from step {diverged_at:g} on: the run diverged (its final loss "
                 "is shown as nan)")


def _moe_fields(record: dict[str, Any], step: float, run: RunData, over_time: bool) -> None:
    """An MoE run's per-layer expert loads (the last ones kept) and, for the records the curves
    keep (over_time), imbalance."""
    loads = {}
    for key, value in record.items():
        match = _MOE_KEY.fullmatch(key)
        if match is None:
            continue
        layer, what = match.groups()
        known = layer in run.moe_imbalance or layer in loads
        if not known and max(len(run.moe_imbalance), len(loads)) >= MAX_MOE_LAYERS:  # loads too: a heatmap row each
            continue
        if what == "imbalance" and over_time and (v := number(value)) is not None:
            run.moe_imbalance.setdefault(layer, []).append((step, v))
        elif what == "load" and isinstance(value, list) and 0 < len(value) <= MAX_EXPERTS:
            numbers = [number(v) for v in value]
            if all(n is not None for n in numbers):
                loads[layer] = numbers
    if loads:
        run.moe_loads, run.moe_load_step = loads, step


def _read_rank_logs(folder: Path, run: RunData) -> None:
    if not folder.is_dir():
        return
    files = sorted((int(m.group(1)), p) for p in folder.iterdir()
                   if (m := _RANK_LOG.fullmatch(p.name)) and _own_file(p, run))
    if len(files) > MAX_RANK_LOGS:
        run.note(f"logs/ holds {len(files)} rank logs; the first {MAX_RANK_LOGS} are read")
    for rank, path in files[:MAX_RANK_LOGS]:
        records = _Thinned(MAX_RANK_POINTS)
        try:
            for record in jsonl_records(path, run):
                if "step_time_s" in record or "tokens_per_s" in record:
                    records.append({k: v for k in RANK_KEYS if (v := number(record.get(k))) is not None})
        except OSError as e:
            run.note(f"logs/{path.name} could not be read ({e.strerror or e})")
        run.rank_logs[rank] = records.items


def _trace_files(folder: Path, run: RunData) -> list[Path]:
    """The profiler traces inside the run's traces/ folder (summary.json's trace_files may name
    paths of another machine, or anywhere: only the run's own folder is looked at)."""
    traces = folder / "traces"
    if not traces.is_dir():
        return []
    found = sorted(p for p in traces.iterdir()
                   if (p.name.endswith(".json") or p.name.endswith(".json.gz"))
                   and not p.name.startswith("memory_timeline") and _own_file(p, run))
    if len(found) > MAX_TRACES:
        run.note(f"traces/ holds {len(found)} traces; the first {MAX_TRACES} are analysed")
    return found[:MAX_TRACES]


# ---------------------------------------------------------------------------- numbers


def median_steady(values: list[float]) -> float | None:
    """The median without the first interval (start-up and warm-up make it slow), when more remain."""
    values = values[1:] if len(values) > 1 else values
    return statistics.median(values) if values else None


def run_numbers(run: RunData) -> dict[str, float | None]:
    """The headline numbers of a run: summary.json's, else what metrics.jsonl says.

    tokens_per_s is the whole job's, tokens_per_s_per_device that over the processes (what MFU is
    computed from); step_time_s is the median interval step time after the first interval (which
    holds the warm-up); step_peak_bytes is the measured peak of one training step (summary
    "memory"), mem_peak_bytes the device's (CPU: the process's RSS); both the largest rank's in a
    distributed run."""
    s = run.summary
    memory = memory_summary(run)
    step_peaks = [p for r in rank_entries(run) if (p := number(r.get("step_peak_bytes"))) is not None]
    device_peaks = [p for r in rank_entries(run) if (p := number(r.get("mem_peak_bytes"))) is not None]
    speed = _first(number(s.get("tokens_per_s")), median_steady(run.series("tokens_per_s")[1]))
    per_device = _first(number(s.get("tokens_per_s_per_device")),
                        median_steady(run.series("tokens_per_s_per_device")[1]),
                        speed / run.world_size if speed is not None else None)
    return {
        "final_loss": _first(number(s.get("final_loss")), run.last_loss),
        "final_val_loss": _first(number(s.get("val_loss")), run.evals[-1].get("val_loss") if run.evals else None),
        "tokens_per_s": speed,  # the whole job's (every process)
        "tokens_per_s_per_device": per_device,
        "mfu": _mfu(run, per_device),
        "step_time_s": median_steady(run.series("step_time_s")[1]),
        "step_peak_bytes": _first(max(step_peaks, default=None), number(memory.get("peak_bytes"))),
        "mem_peak_bytes": _first(max(device_peaks, default=None), number(s.get("mem_peak_bytes")),
                                 max(run.series("mem_peak_bytes")[1], default=None)),
        "steps": _first(number(s.get("steps")), run.intervals[-1]["step"] if run.intervals else None),
        "tokens": _first(number(s.get("tokens")), run.intervals[-1].get("tokens") if run.intervals else None),
        "wall_time_s": number(s.get("wall_time_s")),
    }


def _mfu(run: RunData, per_device: float | None) -> float | None:
    """MFU at the run's tokens/s per device. summary.json's "mfu" is the mean of the intervals'
    MFUs, which a few fast intervals pull far above what the run's tokens/s says (a mean of rates
    overweights the short intervals); every interval's MFU / tokens/s per device is the same
    constant (FLOPs per token / peak FLOP/s), so that times the run's tokens/s per device is the
    MFU that agrees with it."""
    constants = []
    for r in run.intervals:
        device_speed = r.get("tokens_per_s_per_device", r.get("tokens_per_s", 0.0) / run.world_size)
        if "mfu" in r and device_speed > 0:
            constants.append(r["mfu"] / device_speed)
    if per_device is not None and constants:
        return per_device * statistics.median(constants)
    return number(run.summary.get("mfu"))


def _first(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)


def rank_entries(run: RunData) -> list[dict[str, Any]]:
    """summary.json's per-rank entries (distributed runs), each a dict with an int rank."""
    ranks = run.summary.get("ranks")
    if not isinstance(ranks, list):
        return []
    return [r for r in ranks[:MAX_RANK_LOGS] if isinstance(r, dict) and number(r.get("rank")) is not None]


def stopped_early(run: RunData) -> tuple[float | None, str] | None:
    """(step, reason) where summary.json says the run stopped early (train.early_stop_patience)."""
    stopped = run.summary.get("stopped_early")
    if not isinstance(stopped, dict):
        return None
    reason = stopped.get("reason")
    return number(stopped.get("step")), short_text(reason) if isinstance(reason, str) else "no reason given"


def memory_summary(run: RunData) -> dict[str, Any]:
    """summary.json's "memory" (one training step measured), or {}."""
    memory = run.summary.get("memory")
    return memory if isinstance(memory, dict) else {}


# ---------------------------------------------------------------------------- config


def flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested TOML table as dotted keys: {"optim": {"lr": 1e-3}} -> {"optim.lr": 1e-3}."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


# Each run's own folder: always different, and already named in the runs table.
NOT_COMPARED = ("run.dir",)


def config_differences(configs: list[dict[str, Any]]) -> list[tuple[str, list[Any]]]:
    """(dotted key, the value in each config; None where absent) for every key whose values
    differ, sorted by key. Runs without a config are left out by the caller."""
    flat = [flatten(c) for c in configs]
    keys = sorted({k for f in flat for k in f} - set(NOT_COMPARED))
    rows = []
    for key in keys:
        values = [f.get(key) for f in flat]
        if any(v != values[0] for v in values[1:]):
            rows.append((key, values))
    return rows
