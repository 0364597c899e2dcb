"""The run report's memory, plan, per-rank and expert sections (see run_sections.py)."""

from __future__ import annotations

from slipstream.report.page import Section, figure, paragraph, table
from slipstream.report.run_plots import color, human_bytes, label, mib, panels, style
from slipstream.report.runs import RunData, median_steady, memory_summary, number, rank_entries, run_numbers
from slipstream.report.run_sections import lacking

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "other")
CATEGORY_COLORS = {"parameters": "#4C72B0", "gradients": "#DD8452", "optimizer_state": "#55A868",
                   "activations": "#C44E52", "other": "#8C8C8C"}
PHASES = ("forward", "backward", "optimizer")
MAX_LAYER_LINES = 12  # imbalance curves drawn per MoE run (the worst layers)


def _categories(run: RunData) -> dict[str, float]:
    raw = memory_summary(run).get("categories")
    raw = raw if isinstance(raw, dict) else {}
    values = {str(k): n for k, v in raw.items() if (n := number(v)) is not None}
    return {k: values[k] for k in [*CATEGORIES, *sorted(set(values) - set(CATEGORIES))] if k in values}


def _phases(run: RunData) -> dict[str, tuple[float, float]]:
    """phase -> (peak bytes, live bytes at its end)."""
    raw = memory_summary(run).get("phases")
    raw = raw if isinstance(raw, dict) else {}
    out = {}
    for phase in PHASES:
        entry = raw.get(phase)
        if isinstance(entry, dict) and (peak := number(entry.get("peak_bytes"))) is not None:
            out[phase] = (peak, min(number(entry.get("end_bytes")) or 0.0, peak))
    return out


def memory_section(runs: list[RunData]) -> Section:
    section = Section("memory", "Peak memory by phase and category")
    have = [r for r in runs if _categories(r) or _phases(r)]
    if lacking(section, runs, have, "memory breakdown (summary.json has no \"memory\"; the memory probe runs at "
                                    "metrics.memory_step)"):
        return section
    fig, (by_category, by_phase) = panels(2)
    names = [label(r.name, 24) for r in have]
    bottoms = [0.0] * len(have)
    for category in dict.fromkeys(c for r in have for c in _categories(r)):
        values = [mib(_categories(r).get(category)) for r in have]
        by_category.bar(range(len(have)), values, bottom=bottoms, label=category.replace("_", " "),
                        color=CATEGORY_COLORS.get(category))
        bottoms = [b + v for b, v in zip(bottoms, values)]
    by_category.set_xticks(range(len(have)), names, rotation=15 if len(have) > 2 else 0, ha="right" if len(have) > 2
                           else "center", fontsize=8)
    style(by_category, "", "MiB", "at the step's peak, by category", legend=False)
    by_category.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3)
    width = 0.8 / len(have)
    for i, run in enumerate(have):
        phases = _phases(run)
        xs = [p + (i - (len(have) - 1) / 2) * width for p in range(len(PHASES))]
        live = [mib(phases.get(p, (0, 0))[1]) for p in PHASES]
        transient = [mib(phases.get(p, (0, 0))[0] - phases.get(p, (0, 0))[1]) for p in PHASES]
        index = runs.index(run)
        by_phase.bar(xs, live, width, color=color(index), label=label(run.name))
        by_phase.bar(xs, transient, width, bottom=live, color=color(index), alpha=0.45, hatch="//")
    by_phase.bar([0], [0], 0, color="white", edgecolor="grey", hatch="//", label="hatched: transient")
    by_phase.set_xticks(range(len(PHASES)), PHASES)
    style(by_phase, "phase of the step", "MiB", "peak of each phase", legend=False)
    by_phase.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3)
    step = {number(memory_summary(r).get("step")) for r in have} - {None}
    at = f" (training step {', '.join(f'{s:g}' for s in sorted(step))})" if step else ""
    section.add(figure(fig, "memory", f"One training step measured by slipstream's memory probe{at}. Left: what "
                                      "the bytes at the peak are; right: each phase's peak, stacked as the memory "
                                      "still live when the phase ends and the transient part above it."))
    rows = []
    for run in have:
        cats, phases = _categories(run), _phases(run)
        rows.append([run.name, human_bytes(number(memory_summary(run).get("peak_bytes"))),
                     *[human_bytes(cats.get(c)) for c in CATEGORIES],
                     *[human_bytes(phases[p][0]) if p in phases else "-" for p in PHASES]])
    section.add(table(["run", "step peak", *[c.replace("_", " ") for c in CATEGORIES],
                       *[f"{p} peak" for p in PHASES]], rows, "memory"))
    return section


def planned_section(runs: list[RunData]) -> Section:
    from slipstream.report.run_plan import planned_step

    section = Section("planned", "Planned vs measured")
    rows, memory, timing, why_not = [], [], [], []
    for i, run in enumerate(runs):
        m = memory_summary(run)
        planned_mem, measured_mem = number(m.get("planned_peak_bytes")), number(m.get("peak_bytes"))
        measured_step = run_numbers(run)["step_time_s"]
        plan, reason = planned_step(run)
        if reason:
            why_not.append(f"{run.name}: no planned step time: {reason}.")
        if planned_mem is not None and measured_mem is not None:
            memory.append((i, run, planned_mem, measured_mem))
        if plan is not None and measured_step is not None:
            timing.append((i, run, plan.step_s, measured_step))
        rows.append([run.name, human_bytes(planned_mem), human_bytes(measured_mem),
                     _ratio_text(planned_mem, measured_mem), plan.step_s * 1e3 if plan else None,
                     measured_step * 1e3 if measured_step is not None else None,
                     _ratio_text(plan.step_s if plan else None, measured_step),
                     plan.layout if plan else "-", plan.cluster if plan else "-"])
    if lacking(section, runs, [r for _, r, *_ in memory + timing], "planned and measured numbers to compare"):
        for line in why_not:
            section.add(paragraph(line, "note"))
        return section
    fig, (mem_ax, time_ax) = panels(2)
    _paired_bars(mem_ax, memory, 2**20)
    style(mem_ax, "", "MiB", "step peak memory")
    _paired_bars(time_ax, timing, 1e-3)
    style(time_ax, "", "ms", "step time")
    section.add(figure(fig, "planned", "Hatched: planned; solid: measured. Planned memory is the planner's "
                                       "prediction the run recorded (summary.json); planned step time is computed "
                                       "now, by the planner from the run's config.toml (the run records none)."))
    section.add(table(["run", "planned memory", "measured memory", "planned / measured", "planned step (ms)",
                       "measured step (ms)", "planned / measured", "layout", "step time predicted on"], rows,
                      "planned"))
    section.add(paragraph("Measured step time: the median interval step time after the first interval. The planned "
                          "step time uses the planner's default efficiency (as `slipstream plan` without "
                          "--calibrate); on small models and CPUs per-op overheads the planner does not model "
                          "dominate, so expect it to be optimistic there.", "note"))
    for line in why_not:
        section.add(paragraph(line, "note"))
    return section


def _ratio_text(a: float | None, b: float | None) -> str:
    # Three significant digits: a planner 200x off on a tiny CPU run must not read "0.00x".
    return f"{a / b:.3g}x" if a is not None and b else "-"


def _paired_bars(ax, items: list[tuple[int, RunData, float, float]], scale: float) -> None:
    """Planned (hatched) and measured (solid) side by side for each run."""
    for slot, (index, run, planned, measured) in enumerate(items):
        ax.bar(slot - 0.2, planned / scale, 0.4, color=color(index), alpha=0.45, hatch="//")
        ax.bar(slot + 0.2, measured / scale, 0.4, color=color(index), label=label(run.name))
    ax.set_xticks(range(len(items)), [label(r.name, 24) for _, r, *_ in items], fontsize=8)


def _rank_speed(run: RunData) -> dict[int, tuple[float | None, float | None]]:
    """rank -> (median tokens/s of that process, median step time), after the first interval."""
    out = {}
    for rank, records in sorted(run.rank_logs.items()):
        speed = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
        step = [r["step_time_s"] for r in records if "step_time_s" in r]
        out[rank] = (median_steady(speed), median_steady(step))
    return out


def _rank_memory(run: RunData) -> tuple[dict[int, float], str]:
    """(rank -> bytes, which peak): the peak of one training step on each rank (summary.json
    "ranks") where every rank has one, else each rank's device peak (its resident set on CPU).
    One kind for all ranks: a step peak beside a device peak would look like an imbalance."""
    entries = rank_entries(run)
    for key, kind in (("step_peak_bytes", "step peak"), ("mem_peak_bytes", "device peak")):
        out = {int(e["rank"]): v for e in entries if (v := number(e.get(key))) is not None}
        if out and len(out) == len(entries):
            return out, kind
    out = {}
    for rank, records in run.rank_logs.items():
        peaks = [r["mem_peak_bytes"] for r in records if "mem_peak_bytes" in r]
        if peaks:
            out[rank] = max(peaks)
    return out, "device peak"


def _spread(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    return f"{max(values) / min(values):.2f}" if values and min(values) > 0 else "-"


def ranks_section(runs: list[RunData]) -> Section:
    section = Section("ranks", "Per-rank speed and memory")
    distributed = [r for r in runs if r.world_size > 1 or r.rank_logs or rank_entries(r)]
    if not distributed:
        section.add(paragraph(("This is a single-process run" if len(runs) == 1 else "These are single-process runs")
                              + ": there are no ranks to compare.", "note"))
        return section
    have = [r for r in distributed if _rank_speed(r) or _rank_memory(r)[0]]
    if lacking(section, distributed, have, "per-rank numbers (summary.json \"ranks\" or logs/rank<R>.jsonl)"):
        return section
    fig, (speed_ax, mem_ax) = panels(2)
    width = 0.8 / len(have)
    rows, kinds = [], set()
    for slot, run in enumerate(have):
        speed, (memory, kind) = _rank_speed(run), _rank_memory(run)
        kinds |= {kind} if memory else set()
        offset = (slot - (len(have) - 1) / 2) * width
        index = runs.index(run)
        if speed:
            speed_ax.bar([r + offset for r in speed], [v[0] or 0 for v in speed.values()], width, color=color(index),
                         label=label(run.name))
        if memory:
            mem_ax.bar([r + offset for r in memory], [mib(v) for v in memory.values()], width, color=color(index),
                       label=label(run.name))
        rows.append([run.name, run.world_size, _spread([v[0] for v in speed.values()]),
                     _spread([v[1] for v in speed.values()]), _spread(list(memory.values())),
                     min(speed, key=lambda r: speed[r][0] or float("inf")) if speed else "-"])
    for ax in (speed_ax, mem_ax):
        ax.xaxis.get_major_locator().set_params(integer=True)
    style(speed_ax, "rank", "tokens/s of the process", "speed per rank (logs/rank<R>.jsonl)")
    style(mem_ax, "rank", "MiB", f"{' / '.join(sorted(kinds)) or 'peak'} memory per rank")
    section.add(figure(fig, "ranks", "Medians over the logging intervals after the first. A slow rank holds "
                                     "every rank back at the next collective."))
    section.add(table(["run", "processes", "tokens/s max/min", "step time max/min", "memory max/min",
                       "slowest rank"], rows, "ranks"))
    for run in have:
        if not run.rank_logs:
            section.add(paragraph(f"{run.name}: no per-rank speed: train with --logging.rank_logs=true to write "
                                  "logs/rank<R>.jsonl.", "note"))
    return section


def experts_section(runs: list[RunData]) -> Section:
    section = Section("experts", "Expert load (mixture of experts)")
    have = [r for r in runs if r.moe_loads or r.moe_imbalance]
    if lacking(section, runs, have, "mixture-of-experts layers (no moe/* keys in metrics.jsonl)"):
        return section
    for run in have:
        fig, (heat, lines) = panels(2)
        layers = list(run.moe_loads)
        if layers:
            width = max(len(v) for v in run.moe_loads.values())
            grid = [v + [float("nan")] * (width - len(v)) for v in run.moe_loads.values()]
            image = heat.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
            fig.colorbar(image, ax=heat, label="share of routed tokens")
            heat.set_yticks(range(len(layers)), [label(n, 20) for n in layers], fontsize=7)
            heat.set_xticks(range(width), [str(e) for e in range(width)] if width <= 32 else None)
            style(heat, "expert", "layer", f"load per expert at step {run.moe_load_step or 0:g}", legend=False)
            heat.grid(False)
        worst = sorted(run.moe_imbalance, key=lambda n: -max(v for _, v in run.moe_imbalance[n]))
        for n, layer in enumerate(worst[:MAX_LAYER_LINES]):
            points = run.moe_imbalance[layer]
            lines.plot([s for s, _ in points], [v for _, v in points], color=f"C{n % 10}", label=label(layer, 20))
        lines.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
        style(lines, "step", "max / mean expert load", "imbalance per layer")
        shown = f" (the {MAX_LAYER_LINES} worst of {len(worst)} layers)" if len(worst) > MAX_LAYER_LINES else ""
        section.add(figure(fig, "experts", f"{run.name}: left, the share of tokens each expert received in the "
                                           f"last logging interval; right, the most loaded expert over the mean, per "
                                           f"layer{shown}. 1.0 is perfectly balanced."))
    return section
