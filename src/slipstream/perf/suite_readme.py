"""The suite's results in the README: a markdown table of one suite JSON, the newest committed
result per device, and the README's marker block that holds the table.

The block sits between `<!-- suite-results:start -->` and `<!-- suite-results:end -->` at the top
of README's "Measured results"; `update_readme` replaces what is between the markers and nothing
else, and a test checks that the block is the table of the newest committed result.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from slipstream.errors import UserError

START, END = "<!-- suite-results:start -->", "<!-- suite-results:end -->"


def _number(value: Any, key: str = "") -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if key.endswith("_bytes"):
        return f"{value / 2**20:.1f} MiB"
    if abs(value) >= 1e6:
        return f"{value / 1e6:.3g}M"
    if abs(value) >= 1e4:
        return f"{value / 1e3:.3g}k"
    return f"{value:.4g}"


def _cell(text: str) -> str:
    """Free text in a table cell: one line, no column breaks."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _quality(row: dict[str, Any]) -> str:
    if row["status"] == "ok":
        return f"ok: {row['quality']['criterion']}"
    reason = (row.get("error") or "").splitlines()[0] if row.get("error") else ""
    return f"**{row['status']}**: {reason}"


def suite_table(result: dict[str, Any]) -> str:
    """One suite result as markdown: per workload its metric, median [CI, level], secondary numbers and
    quality gate, then the machine, versions, git sha and mode it was measured with."""
    lines = ["| workload | metric | median [CI] (level) | secondary (medians) | quality |", "|---|---|---|---|---|"]
    for row in result["workloads"]:
        better = "higher" if row["higher_is_better"] else "lower"
        metric = f"{row['metric']}, {row['unit']} ({better} is better)"
        if row["median"] is None:
            median = "-"
        else:
            low, high = row["ci"]
            median = (f"{_number(row['median'])} [{_number(low)}, {_number(high)}] "
                      f"({row['ci_level']:.0%}, n={len(row['samples'])})")
        secondary = ", ".join(f"{k} {_number(v, k)}" for k, v in row["secondary"].items() if v is not None)
        lines.append(f"| {row['name']} | {_cell(metric)} | {median} | {_cell(secondary) or '-'} "
                     f"| {_cell(_quality(row))} |")
    env, machine = result.get("env") or {}, result.get("machine") or {}
    devices = ", ".join(d.get("name", "") for d in env.get("devices") or []) or env.get("cpu_model") or "?"
    peaks = ", ".join(f"{k} {v:.3g}" for k, v in (machine.get("matmul_tflops_by_dtype") or {}).items())
    copy = f"{machine['copy_gb_s']:.1f} GB/s" if machine.get("copy_gb_s") else "not measured"
    lines += ["", f"{result['mode']} mode, suite v{result['suite_version']}, {result['started'][:10]}, "
                  f"{result['wall_s'] / 60:.1f} min; {devices} ({env.get('torch_num_threads', '?')} threads), "
                  f"matmul {peaks or 'not measured'} TFLOP/s, copy {copy}; torch {env.get('torch_version', '?')}, "
                  f"git {str(env.get('git_sha') or '?')[:10]}"]
    return "\n".join(lines)


def latest_suite(folder: str | Path = "benchmarks/suite", device: str = "cpu") -> Path | None:
    """The newest (by its "started" time) full or quick suite result of `device` in `folder`; None if none."""
    from slipstream.perf.suite_compare import SUITE_JSON
    from slipstream.safe_read import load_json_capped

    newest: tuple[str, Path] | None = None
    for path in sorted(Path(folder).glob("suite-*.json")):
        try:
            result = load_json_capped(path, SUITE_JSON)
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"{path} is not a readable suite result ({e}); delete it or run the suite again") from None
        if not isinstance(result, dict) or result.get("bench") != "suite" or result.get("mode") == "ci":
            continue
        if (result.get("machine") or {}).get("device") != device or not isinstance(result.get("started"), str):
            continue
        if newest is None or result["started"] > newest[0]:
            newest = (result["started"], path)
    return newest[1] if newest else None


def readme_block(readme_text: str, where: str | Path = "README.md") -> tuple[int, int]:
    """(start, end) character offsets of what lies between the markers."""
    start, end = readme_text.find(START), readme_text.find(END)
    if start < 0 or end < 0 or end < start or readme_text.count(START) != 1 or readme_text.count(END) != 1:
        raise UserError(f"{where} needs exactly one {START} ... {END} block (in that order) for the suite table")
    return start + len(START), end


def update_readme(readme: Path, suite_json: Path) -> bool:
    """Put the table of `suite_json` between the README's markers; False when it was already there."""
    from slipstream.observe.env import write_text_atomic
    from slipstream.perf.suite_compare import SUITE_JSON
    from slipstream.safe_read import load_json_capped

    text = Path(readme).read_text(encoding="utf-8")
    start, end = readme_block(text, readme)
    new = text[:start] + "\n" + suite_table(load_json_capped(suite_json, SUITE_JSON)) + "\n" + text[end:]
    if new == text:
        return False
    write_text_atomic(readme, new)
    return True
