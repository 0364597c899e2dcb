"""`slipstream compare RUN_A RUN_B`: two runs side by side in the terminal.

What changed (the config keys whose values differ, as dotted names) and what it did (final loss,
final val loss, tokens/s, MFU, step time, peak memory: A, B, B - A and B / A). The numbers are
the report's (runs.run_numbers), so the terminal and the page never disagree. A run that stopped
early says where and why; a run that diverged has the final loss nan, and no delta or ratio.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from slipstream.report.runs import RunData, config_differences, read_runs, run_numbers, short_text, stopped_early

# (key of run_numbers, what the row is called, how its values are written)
METRICS = (("final_loss", "final loss", "number"), ("final_val_loss", "final val loss", "number"),
           ("tokens_per_s", "tokens/s (all processes)", "number"),
           ("tokens_per_s_per_device", "tokens/s per device", "number"), ("mfu", "MFU", "percent"),
           ("step_time_s", "step time (s, median)", "number"), ("step_peak_bytes", "step peak memory", "bytes"),
           ("mem_peak_bytes", "device peak memory", "bytes"))
MAX_SHOWN = 100  # config differences printed (runs of two code versions differ in many keys)


def compare_runs(run_a: str | Path, run_b: str | Path) -> dict[str, Any]:
    """The comparison as plain data (what --json prints): both runs, the config differences
    and one row per metric with A, B, B - A and B / A (None where a number is missing)."""
    a, b = read_runs([run_a, run_b])
    numbers_a, numbers_b = run_numbers(a), run_numbers(b)
    rows = []
    for key, name, kind in METRICS:
        va, vb = numbers_a[key], numbers_b[key]
        both = va is not None and vb is not None and math.isfinite(va) and math.isfinite(vb)
        rows.append({"metric": key, "name": name, "kind": kind, "a": va, "b": vb,
                     "delta": vb - va if both else None, "ratio": vb / va if both and va != 0 else None})
    if a.config and b.config:
        differences = [{"key": key, "a": va, "b": vb} for key, (va, vb) in config_differences([a.config, b.config])]
    else:
        differences = None  # unknown: a run has no readable config.toml
    return {"a": _side(a), "b": _side(b), "config_differences": differences, "metrics": rows}


def _side(run: RunData) -> dict[str, Any]:
    stop = stopped_early(run)
    stopped = {"step": stop[0], "reason": stop[1]} if stop else None
    return {"name": run.name, "path": str(run.path), "stopped_early": stopped, "notes": run.notes}


def comparison_json(result: dict[str, Any]) -> str:
    """The comparison as strict JSON (what --json prints): a non-finite number (a diverged run's
    final loss) is written as the string "nan" or "inf", which every JSON reader accepts."""
    def plain(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value

    return json.dumps(plain(result), indent=2, default=str, allow_nan=False)


def _format(value: float | None, kind: str, signed: bool = False) -> str:
    if value is None:
        return "-"
    if not math.isfinite(value):
        return str(value)
    sign = "+" if signed and value > 0 else ""
    if kind == "percent":
        return f"{sign}{100 * value:.2f}%"
    if kind == "bytes":
        return f"{sign}{value / 2**20:,.1f} MiB"
    if abs(value) >= 1000:
        return f"{sign}{value:,.0f}"
    return f"{sign}{value:.4g}"


def _columns(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


def format_comparison(result: dict[str, Any]) -> str:
    """The comparison as plain text: who A and B are, the config differences, the metrics."""
    a, b = result["a"], result["b"]
    lines = [_printable(f"A: {a['name']}  ({a['path']})"), _printable(f"B: {b['name']}  ({b['path']})"), ""]
    differences = result["config_differences"]
    if differences is None:
        lines.append("config differences: unknown (a run has no readable config.toml)")
    elif not differences:
        lines.append("config differences: none (run.dir aside)")
    else:
        lines.append(f"config differences ({len(differences)}):")
        table = [["key", "A", "B"]] + [[d["key"], _value(d["a"]), _value(d["b"])] for d in differences[:MAX_SHOWN]]
        lines += ["  " + line for line in _columns(table)]
        if len(differences) > MAX_SHOWN:
            lines.append(f"  ... and {len(differences) - MAX_SHOWN} more (--json lists them all)")
    lines.append("")
    table = [["metric", "A", "B", "B-A", "B/A"]]
    for row in result["metrics"]:
        ratio = f"{row['ratio']:.3f}x" if row["ratio"] is not None else "-"
        table.append([row["name"], _format(row["a"], row["kind"]), _format(row["b"], row["kind"]),
                      _format(row["delta"], row["kind"], signed=True), ratio])
    lines += _columns(table)
    for side in ("a", "b"):
        stopped = result[side].get("stopped_early")
        if stopped:
            at = f" at step {stopped['step']:g}" if stopped["step"] is not None else ""
            lines.append(_printable(f"{side.upper()} stopped early{at}: {stopped['reason']}"))
    for side in ("a", "b"):
        for note in result[side]["notes"]:
            lines.append(_printable(f"note ({result[side]['name']}): {note}"))
    return "\n".join(lines)


def _value(value: Any) -> str:
    return "(absent)" if value is None else _printable(short_text(value if isinstance(value, str) else
                                                                  json.dumps(value, default=str), 60))


def _printable(text: str) -> str:
    """No control characters reach the terminal (a config string could hold escape sequences)."""
    return "".join(c if c.isprintable() else "?" for c in text)
