"""The run report's doctor, environment and config sections (see run_sections.py)."""

from __future__ import annotations

import json
from typing import Any

from slipstream.errors import UserError
from slipstream.report.page import Section, figure, paragraph, preformatted, table
from slipstream.report.run_plots import label, panels, style
from slipstream.report.runs import RunData, config_differences, flatten, short_text
from slipstream.report.run_sections import lacking

MAX_CONFIG_CHARS = 200_000  # of one config.toml shown (a resolved config is ~4 KB)
MAX_ENV_ROWS = 200
MAX_DIFF_ROWS = 500  # config differences listed (two real configs differ in a few dozen keys at most)
SPLIT = (("compute", "compute_us", "#4C72B0"), ("exposed communication", "comm_exposed_us", "#DD8452"),
         ("memory copies", "memcpy_us", "#55A868"), ("idle", "idle_us", "#8C8C8C"))


def _diagnose(run: RunData):
    """The doctor's report on the run's traces (perf.doctor, as `slipstream doctor --trace`)."""
    from slipstream.perf.doctor import diagnose, read_run_context
    from slipstream.perf.trace import load_and_analyze

    files = [str(p) for p in run.trace_files]
    analyses = load_and_analyze(files)
    context = read_run_context(files)  # the run's config.toml (no setting already in place is suggested)
    return diagnose(analyses, context.cfg, context)


def doctor_section(runs: list[RunData]) -> Section:
    section = Section("doctor", "Doctor's findings")
    have = [r for r in runs if r.trace_files]
    if lacking(section, runs, have, "profiler trace (train with --profile.enabled=true to get one)"):
        return section
    findings, traces, bars = [], [], []
    for run in have:
        try:
            report = _diagnose(run)
        except (UserError, OSError) as e:
            section.add(paragraph(f"{run.name}: the trace could not be analysed ({short_text(e)}).", "note"))
            continue
        for a in report.analyses:
            traces.append([run.name, a.rank, len(a.steps), a.step_us / 1e3, *[_share(a, attr) for _, attr, _ in SPLIT],
                           _share(a, "data_wait_us")])
            bars.append((f"{label(run.name, 20)} r{a.rank}", [a.share(getattr(a, attr)) or 0.0 for _, attr, _ in SPLIT]))
        for f in report.findings:
            findings.append([run.name, f"{f.severity:.0%}", f.title, f.evidence, f.fix, " ".join(f.overrides) or "-"])
        if not report.findings:
            findings.append([run.name, "-", "no problems found", "-", "-", "-"])
    if bars:
        fig, (ax,) = panels(1, width=7, height=max(2.0, 0.5 * len(bars) + 1.2))
        left = [0.0] * len(bars)
        for n, (name, _, colour) in enumerate(SPLIT):
            values = [100 * shares[n] for _, shares in bars]
            ax.barh(range(len(bars)), values, left=left, color=colour, label=name)
            left = [a + b for a, b in zip(left, values)]
        ax.set_yticks(range(len(bars)), [name for name, _ in bars], fontsize=8)
        ax.invert_yaxis()
        style(ax, "% of step time", "", "where the profiled steps' time goes", legend=False)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4)
        section.add(figure(fig, "doctor", "From the run's profiler traces (traces/), one bar per rank, as "
                                          "`slipstream doctor --trace` measures them."))
        section.add(table(["run", "rank", "steps", "step (ms)", *[n for n, _, _ in SPLIT], "data wait"], traces,
                          "doctor-traces"))
        section.add(table(["run", "share of step", "finding", "evidence", "fix", "try"], findings, "doctor"))
    return section


def _share(a, attr: str) -> str:
    share = a.share(getattr(a, attr))
    return "unknown" if share is None else f"{share:.0%}"


def _env_rows(env: dict[str, Any]) -> dict[str, str]:
    """env.json as dotted keys with short text values (devices as their names)."""
    out = {}
    for key, value in flatten(env).items():
        if key == "devices" and isinstance(value, list):
            value = ", ".join(short_text(d.get("name", "?"), 60) for d in value[:16] if isinstance(d, dict)) or "none"
        elif isinstance(value, list):
            value = " ".join(short_text(v, 100) for v in value[:64])
        out[key] = short_text("-" if value is None else value)
    return out


def environment_section(runs: list[RunData]) -> Section:
    section = Section("environment", "Environment")
    have = [r for r in runs if r.env]
    if lacking(section, runs, have, "env.json"):
        return section
    envs = [_env_rows(r.env) for r in have]
    rows = []
    for key in sorted({k for e in envs for k in e}):
        values = [e.get(key, "-") for e in envs]
        # One value when the runs agree; else each run's, named (a wide table of N columns would not fit).
        rows.append([key, values[0] if len(set(values)) == 1 else
                     "; ".join(f"{r.name}: {v}" for r, v in zip(have, values))])
    if len(rows) > MAX_ENV_ROWS:
        section.add(paragraph(f"env.json has {len(rows)} entries; the first {MAX_ENV_ROWS} are shown.", "note"))
    header = ["", "value" if len(have) == 1 else "value (each run's where they differ)"]
    section.add(table(header, rows[:MAX_ENV_ROWS], "environment"))
    return section


def config_diff_section(runs: list[RunData]) -> Section:
    section = Section("config-diff", "Config differences")
    have = [r for r in runs if r.config]
    if len(runs) < 2:
        section.add(paragraph("One run: there is no other config to compare it with.", "note"))
        return section
    if lacking(section, runs, have, "config.toml") or len(have) < 2:
        if len(have) == 1:
            section.add(paragraph("Only one run has a config.toml: nothing to compare.", "note"))
        return section
    rows = config_differences([r.config for r in have])
    if not rows:
        section.add(paragraph("The resolved configs are the same (run.dir aside).", "note"))
        return section
    if len(rows) > MAX_DIFF_ROWS:
        section.add(paragraph(f"{len(rows)} settings differ; the first {MAX_DIFF_ROWS} are listed.", "note"))
    section.add(table(["key", *[r.name for r in have]],
                      [[key, *[_value(v) for v in values]] for key, values in rows[:MAX_DIFF_ROWS]], "config-diff"))
    section.add(paragraph(f"{len(rows)} setting(s) differ; run.dir (each run's own folder) is left out. "
                          "- : the setting is not in that run's config.toml.", "note"))
    return section


def _value(value: Any) -> str:
    return "-" if value is None else short_text(value if isinstance(value, str) else json.dumps(value, default=str))


def config_section(runs: list[RunData]) -> Section:
    section = Section("config", "Resolved config")
    have = [r for r in runs if r.config_text]
    if lacking(section, runs, have, "config.toml"):
        return section
    for run in have:
        text = run.config_text
        if len(text) > MAX_CONFIG_CHARS:
            text = text[:MAX_CONFIG_CHARS] + f"\n... ({len(run.config_text) - MAX_CONFIG_CHARS:,} more characters)"
        if len(runs) > 1:
            section.add(paragraph(f"{run.name} (config.toml):"))
        section.add(preformatted(text))
    return section
