"""The ladder part of `slipstream report`: a `slipstream bench ladder` result JSON as its rung
chart and rung table.

A ladder result may come from another machine (a colleague's GPU run, a CI artifact), so it is
read as untrusted: the file is size-capped, and every field the page shows is checked for its
type, so a damaged or crafted file gives a clear error (or, to `is_ladder_json`, a plain "no"),
never a traceback deep in matplotlib. Strings reach the page only through page.py, which escapes.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from slipstream.errors import UserError
from slipstream.report.page import Section, figure, paragraph, table
from slipstream.safe_read import MiB, Cap, load_json_capped

# A real result is ~20 KiB (the memory breakdown of each rung is the bulk).
LADDER_JSON = Cap("ladder result JSON", 16 * MiB, "SLIPSTREAM_MAX_LADDER_JSON_BYTES")
LADDERS = {"ladder-memory": "Memory ladder", "ladder-speed": "Speed ladder",
           "ladder-compression": "Compression ladder"}
MAX_RUNGS = 64  # the books' ladders have 6 and 7 rungs
MAX_TEXT = 200  # characters of a rung name or note shown


def is_ladder_json(path: str | Path) -> bool:
    """Whether `path` is a `bench ladder` result (for the report's dispatcher). Reads at most
    LADDER_JSON's cap and never raises: anything unreadable is simply not a ladder."""
    path = Path(path)
    if not path.is_file():
        return False
    try:
        result = load_json_capped(path, LADDER_JSON)
    except (OSError, ValueError, UserError):  # ValueError: json.JSONDecodeError
        return False
    return _ladder_problem(result) is None


def load_ladder(path: str | Path) -> dict[str, Any]:
    """The ladder result at `path`, checked; a UserError names what is wrong with it."""
    path = Path(path)
    try:
        result = load_json_capped(path, LADDER_JSON)
    except FileNotFoundError:
        raise UserError(f"{path} does not exist; give a `slipstream bench ladder` result, e.g. "
                        "benchmarks/ladder-speed-cpu-tiny.json") from None
    except ValueError as e:  # json.JSONDecodeError, or an integer of more digits than Python converts
        raise UserError(f"{path} is not valid JSON ({e}); give a `slipstream bench ladder` result") from None
    problem = _ladder_problem(result)
    if problem:
        raise UserError(f"{path} is not a `slipstream bench ladder` result: {problem}")
    return result


def _ladder_problem(result: Any) -> str | None:
    """What makes `result` unusable as a ladder, or None."""
    if not isinstance(result, dict):
        return "not a JSON object"
    if result.get("bench") not in LADDERS:
        return f"its 'bench' is not one of {', '.join(LADDERS)}"
    rungs = result.get("rungs")
    if not isinstance(rungs, list) or not rungs or len(rungs) > MAX_RUNGS:
        return f"'rungs' is not a list of 1 to {MAX_RUNGS} rungs"
    for i, row in enumerate(rungs):
        if not isinstance(row, dict) or not isinstance(row.get("rung"), str):
            return f"rung {i} has no name ('rung')"
    if result["bench"] == "ladder-compression":  # one run per row: plain numbers, the dense row first
        if _number(rungs[0].get("peak_bytes")) is None or _number(rungs[0].get("val_loss")) is None:
            return "its first row (dense fp32) has no finite peak_bytes and val_loss"
        return None
    for i, row in enumerate(rungs):
        if _median(row, _main_key(result)) is None:
            return (f"rung {row['rung'][:MAX_TEXT]!r} has no median {_main_key(result)} "
                    "(finite numbers median, min and max with min <= median <= max)")
    return None


def _main_key(result: dict[str, Any]) -> str:
    """The quantity a ladder climbs: peak memory down, or tokens/s up."""
    return "peak_bytes" if result["bench"] == "ladder-memory" else "tokens_per_s"


def _stat(row: dict[str, Any], key: str) -> tuple[float, float, float] | None:
    """(median, min, max) of one measurement, or None when absent, not finite numbers or out of
    order (min <= median <= max holds for any real measurement; the chart's error bars need it)."""
    value = row.get(key)
    if not isinstance(value, dict):
        return None
    numbers = [value.get(k) for k in ("median", "min", "max")]
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in numbers):
        return None
    median, low, high = map(float, numbers)
    return (median, low, high) if low <= median <= high else None


def _number(value: Any) -> float | None:
    """A finite number from the file, or None."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _median(row: dict[str, Any], key: str) -> float | None:
    stat = _stat(row, key)
    return stat[0] if stat else None


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else ""
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + "..."


def _safe_key(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60]


# ---------------------------------------------------------------------------- the page


def ladder_sections(path: str | Path, key: str | None = None) -> list[Section]:
    """One section for the ladder result at `path`: what was measured, the rung chart and the
    rung table. Its key is `ladder-<memory|speed>-<device>-<size>` unless `key` is given."""
    result = load_ladder(path)
    device, size = _text(result.get("device")) or "?", _text(result.get("size")) or "?"
    key = key or _safe_key(f"{result['bench']}-{device}-{size}")
    section = Section(key, f"{LADDERS[result['bench']]} ({device}, size {size})")
    if result["bench"] == "ladder-compression":
        section.add(paragraph(_compression_setting(result, Path(path))))
        section.add(compression_table(result))
        return [section]
    section.add(paragraph(_setting(result, Path(path))))
    section.add(figure(rung_figure(result), key, _caption(result), math_text=False))
    section.add(rung_table(result))
    return [section]


def _setting(result: dict[str, Any], path: Path) -> str:
    """One sentence: what the numbers are and where they were measured."""
    env = result.get("env") if isinstance(result.get("env"), dict) else {}
    devices = env.get("devices") if isinstance(env.get("devices"), list) else []
    names = [_text(d.get("name")) for d in devices if isinstance(d, dict) and d.get("name")]
    machine = names[0] if names else _text(env.get("cpu_model")) or "an unrecorded machine"
    counts = [f"{result[k]} {k}" for k in ("repeats", "steps") if isinstance(result.get(k), int)]
    batch = f", batch {result['batch']}" if isinstance(result.get("batch"), int) else ""
    torch = f", torch {_text(env.get('torch_version'))}" if env.get("torch_version") else ""
    when = f", {_text(env.get('timestamp'))}" if env.get("timestamp") else ""
    return (f"{path.name}: each rung adds one switch to the rung before; median (min-max) over "
            f"{' x '.join(counts) or 'the recorded runs'}{batch}, measured on {machine}{torch}{when}.")


def _caption(result: dict[str, Any]) -> str:
    if result["bench"] == "ladder-memory":
        return "peak memory of a training step per rung (lower is better) and its cost in step time"
    return "training throughput per rung (higher is better) and the step's peak memory"


def rung_figure(result: dict[str, Any]):
    """The rung chart: the ladder's own quantity (peak memory or tokens/s) per rung, with its
    ratio to the baseline written on each bar, next to the other quantity (what the rung costs
    or saves besides). Bars span repeats as min-max error bars. Rung names come from the file, so
    a `$` in them is drawn as written, never parsed as mathtext (save with math_text=False)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    with matplotlib.rc_context({"text.parse_math": False}):
        return _draw_rungs(result)


def _draw_rungs(result: dict[str, Any]):
    import matplotlib.pyplot as plt

    memory = result["bench"] == "ladder-memory"
    rungs = result["rungs"]
    names = [r["rung"] if len(r["rung"]) <= 30 else r["rung"][:28] + "..." for r in rungs]  # tick labels
    panels = [("peak_bytes", "peak memory (MiB)", 2**20), ("step_time_s", "step time (ms)", 1e-3)] if memory else \
             [("tokens_per_s", "tokens/s", 1.0), ("peak_bytes", "peak memory (MiB)", 2**20)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    for panel, (ax, (key, label, scale)) in enumerate(zip(axes, panels)):
        stats = [_stat(r, key) for r in rungs]
        medians = [s[0] / scale if s else 0.0 for s in stats]
        low = [(s[0] - s[1]) / scale if s else 0.0 for s in stats]
        high = [(s[2] - s[0]) / scale if s else 0.0 for s in stats]
        color = "#4C72B0" if panel == 0 else "#8C8C8C"
        bars = ax.bar(range(len(names)), medians, yerr=[low, high], capsize=3, color=color)
        for i, s in enumerate(stats):
            if s is None:  # an empty slot would read as zero: say it was not measured
                ax.text(i, 0, "not measured", rotation=90, ha="center", va="bottom", fontsize=7, color="#555")
        if panel == 0 and medians[0] > 0:
            labels = [f"{m / medians[0]:.2f}x" if s else "n/a" for m, s in zip(medians, stats)]
            ax.bar_label(bars, labels, padding=2, fontsize=8)
            ax.margins(y=0.12)  # room for the ratio labels above the tallest bar
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    axes[0].set_title("vs baseline" + (" (lower is better)" if memory else " (higher is better)"), fontsize=10)
    axes[1].set_title("what it costs" if memory else "memory", fontsize=10)
    fig.tight_layout()
    return fig


def rung_table(result: dict[str, Any]) -> str:
    """One row per rung: what it adds, its numbers and its ratio to the baseline."""
    main = _main_key(result)
    base = _median(result["rungs"][0], main)
    header = ["rung", "adds", "ms/step", "tokens/s", "peak memory (MiB)", "optimizer-phase peak (MiB)",
              "vs baseline", "final loss", "what it is"]
    rows, before = [], []
    for row in result["rungs"]:
        overrides = [o for o in row.get("overrides", []) if isinstance(o, str)] \
            if isinstance(row.get("overrides"), list) else []
        added = " ".join(_text(o) for o in overrides if o not in before) or "-"
        before = overrides
        step, tps = _median(row, "step_time_s"), _median(row, "tokens_per_s")
        peak, opt_peak = _median(row, "peak_bytes"), _median(row, "optimizer_phase_peak_bytes")
        value = _median(row, main)
        losses = row.get("final_loss") if isinstance(row.get("final_loss"), list) else []
        loss = losses[-1] if losses and isinstance(losses[-1], (int, float)) else None
        rows.append([_text(row["rung"]), added, step * 1e3 if step is not None else None,
                     round(tps) if tps is not None else None,
                     peak / 2**20 if peak is not None else None, opt_peak / 2**20 if opt_peak is not None else None,
                     f"{value / base:.2f}x" if value is not None and base else "n/a",
                     float(loss) if loss is not None else None, _text(row.get("note"))])
    return table(header, rows, name=f"{result['bench']}-rungs")


# ---------------------------------------------------------------------------- compression ladder


def _compression_setting(result: dict[str, Any], path: Path) -> str:
    env = result.get("env") if isinstance(result.get("env"), dict) else {}
    machine = _text(env.get("cpu_model")) or "an unrecorded machine"
    budget = [f"{int(result[k]):,} {k.replace('_', ' ')}" for k in ("steps", "tokens_per_row")
              if _number(result.get(k)) is not None]
    return (f"{path.name}: one row per technique, each trained from the same init on the same data "
            f"({', '.join(budget) or 'budget not recorded'}) and scored on the same val windows, against dense "
            f"fp32; export and one-shot rows transform the dense checkpoint without training. Ratios to dense "
            f"in parentheses. Measured on {machine}.")


def compression_table(result: dict[str, Any]) -> str:
    """One row per technique: absolute numbers with their ratio to the dense row."""
    header = ["technique", "peak train memory (MiB)", "ms/step", "val loss", "sparsity", "optimizer state (MiB)",
              "model.pt (MB)", "quantized model.pt (MB)", "quantized val loss", "generate tokens/s", "what it is"]
    dense = result["rungs"][0]

    def cell(row: dict[str, Any], key: str, scale: float = 1.0, digits: int = 1) -> str | None:
        value, base = _number(row.get(key)), _number(dense.get(key))
        if value is None:
            return None
        ratio = f" ({value / base:.2f}x)" if base else ""
        return f"{value / scale:.{digits}f}{ratio}"

    rows = []
    for row in result["rungs"]:
        quantized, base = _number(row.get("quantized_bytes")), _number(dense.get("checkpoint_bytes"))
        rows.append([_text(row["rung"]), cell(row, "peak_bytes", 2**20), cell(row, "step_time_s", 1e-3, 0),
                     _number(row.get("val_loss")), _number(row.get("sparsity")),
                     cell(row, "optimizer_state_bytes", 2**20, 2), cell(row, "checkpoint_bytes", 1e6, 2),
                     None if quantized is None else f"{quantized / 1e6:.2f}" + (f" ({quantized / base:.2f}x)"
                                                                                 if base else ""),
                     _number(row.get("quantized_val_loss")), cell(row, "generate_tokens_per_s", 1.0, 0),
                     _text(row.get("note"))])
    return table(header, rows, name="ladder-compression-rows")
