"""The run part of `slipstream report`: the sections for one or more training runs.

Several runs share every plot (one colour per run, the legend names them), so a page of two
runs is a comparison. Every section is always on the page, in the order of SECTION_KEYS; where
no run has its data (a single-process run has no ranks, a dense model no experts) the section
says so in one line instead of drawing an empty plot, and where only some runs lack it a line
names them. Plots of the run's curves are here; memory, plan, ranks and experts are in
run_memory.py, the doctor, environment and config in run_info.py.
"""

from __future__ import annotations

from typing import Callable

from slipstream.report.page import Section, figure, paragraph, table
from slipstream.report.run_plots import color, human_bytes, label, panels, style
from slipstream.report.runs import RunData, run_numbers, stopped_early

SECTION_KEYS = ("runs", "loss", "lr", "grad-norm", "throughput", "data-wait", "memory", "planned", "ranks", "events",
                "experts", "doctor", "environment", "config-diff", "config")
MAX_EVENT_ROWS = 500


def run_sections(runs: list[RunData]) -> list[Section]:
    """Every section of the run report, in SECTION_KEYS order."""
    from slipstream.report.run_info import config_diff_section, config_section, doctor_section, environment_section
    from slipstream.report.run_memory import experts_section, memory_section, planned_section, ranks_section

    return [overview_section(runs), loss_section(runs), lr_section(runs), grad_norm_section(runs),
            throughput_section(runs), data_wait_section(runs), memory_section(runs), planned_section(runs),
            ranks_section(runs), events_section(runs), experts_section(runs), doctor_section(runs),
            environment_section(runs), config_diff_section(runs), config_section(runs)]


def lacking(section: Section, runs: list[RunData], have: list[RunData], what: str) -> bool:
    """Say in one line which runs lack `what`; True when none has it (the section is done)."""
    if not have:
        # "None of these runs has no X" said the opposite; a one-run page keeps "This run has no X".
        text = f"This run has no {what}." if len(runs) == 1 else f"No {what} in any of these runs."
        section.add(paragraph(text, "note"))
        return True
    missing = [r.name for r in runs if r not in have]
    if missing:
        section.add(paragraph(f"No {what} in: {', '.join(missing)}.", "note"))
    return False


def overview_section(runs: list[RunData]) -> Section:
    section = Section("runs", "Runs")
    header = ["run", "folder", "steps", "tokens", "final loss", "final val loss", "tokens/s (all processes)", "MFU",
              "step time (ms)", "step peak memory", "device peak memory", "wall time (s)", "device", "processes"]
    rows = []
    for run in runs:
        n = run_numbers(run)
        rows.append([run.name, str(run.path), _int(n["steps"]), _int(n["tokens"]), n["final_loss"], n["final_val_loss"],
                     _int(n["tokens_per_s"]), f"{n['mfu']:.2%}" if n["mfu"] is not None else None,
                     n["step_time_s"] * 1e3 if n["step_time_s"] is not None else None,
                     human_bytes(n["step_peak_bytes"]), human_bytes(n["mem_peak_bytes"]), n["wall_time_s"],
                     str(run.summary.get("device", "-"))[:40], run.world_size])
    section.add(table(header, rows, "runs"))
    section.add(paragraph("tokens/s: the whole run's tokens over its training time (eval and checkpoints "
                          "excluded); MFU: at that speed per device. Step time: the median over the logging "
                          "intervals after the first (warm-up). Step peak memory: one training step measured by "
                          "slipstream's memory probe; device peak memory: on CPU the process's resident set, on "
                          "CUDA the peak allocated (both the largest rank's).", "note"))
    for run in runs:
        if stop := stopped_early(run):
            at = f" at step {stop[0]:g}" if stop[0] is not None else ""
            section.add(paragraph(f"{run.name}: stopped early{at} ({stop[1]})", "note"))
        for note in run.notes:
            section.add(paragraph(f"{run.name}: {note}", "note"))
    return section


def _int(value: float | None) -> int | None:
    return int(value) if value is not None else None


def _with(runs: list[RunData], key: str) -> list[RunData]:
    return [r for r in runs if r.series(key)[0]]


def _plot_series(ax, runs: list[RunData], key: str, scale: float = 1.0, linestyle: str = "-", suffix: str = "",
                 transform: Callable[[RunData], tuple[list[float], list[float]]] | None = None) -> None:
    for i, run in enumerate(runs):
        steps, values = transform(run) if transform else run.series(key)
        if steps:
            ax.plot(steps, [v * scale for v in values], color=color(i), linestyle=linestyle,
                    marker=_marker(steps), label=label(run.name + suffix))


def _marker(points: list) -> str | None:
    """Dots on a short curve: a run that logged one interval is otherwise an invisible line."""
    return "." if len(points) < 50 else None


def loss_section(runs: list[RunData]) -> Section:
    section = Section("loss", "Loss")
    have = [r for r in runs if r.series("loss")[0] or r.evals]
    if lacking(section, runs, have, "training or validation loss (metrics.jsonl has no records)"):
        return section
    fig, (by_step, by_tokens) = panels(2)
    events = stalls = stops = False
    for i, run in enumerate(runs):
        steps, losses = run.series("loss")
        name = label(run.name)
        if steps:
            by_step.plot(steps, losses, color=color(i), marker=_marker(steps), label=f"{name} train")
        evals = [(e["step"], e["val_loss"]) for e in run.evals if "val_loss" in e]
        if evals:
            by_step.plot(*zip(*evals), color=color(i), linestyle="--", marker="o", markersize=3, label=f"{name} val")
        tokens_at = _tokens_at_step(run)
        if tokens_at is not None:
            points = [(r["tokens"], r["loss"]) for r in run.intervals if "tokens" in r and "loss" in r]
            if points:
                by_tokens.plot(*zip(*points), color=color(i), marker=_marker(points), label=f"{name} train")
            if evals:
                by_tokens.plot([tokens_at(s) for s, _ in evals], [v for _, v in evals], color=color(i),
                               linestyle="--", marker="o", markersize=3, label=f"{name} val")
        events |= _mark_events(by_step, run, i, first=not events)
        stalls |= _mark_stalls(by_step, run, i, first=not stalls)
        stops |= _mark_early_stop(by_step, run, i, first=not stops)
    style(by_step, "step", "loss", "loss vs step")
    style(by_tokens, "tokens", "loss", "loss vs tokens")
    caption = "Solid: training loss (mean over each logging interval); dashed: validation loss."
    if events or stalls:
        caption += " Markers on the left plot: X a stability event (guard), ▼ a checkpoint save (stalls in Events)."
    if stops:
        caption += " Dotted vertical line: where early stopping ended the run (the reason is under Runs)."
    section.add(figure(fig, "loss", caption))
    if not any(_tokens_at_step(r) for r in runs):
        section.add(paragraph("No run logged its token count, so the loss vs tokens plot is empty.", "note"))
    return section


def _tokens_at_step(run: RunData) -> Callable[[float], float] | None:
    """Tokens seen at a step, interpolated between the interval records (None without tokens)."""
    points = [(r["step"], r["tokens"]) for r in run.intervals if "tokens" in r]
    if not points:
        return None
    import numpy as np

    steps, tokens = zip(*points)
    if len(points) == 1:  # one record: tokens grow in proportion to steps
        return lambda step: tokens[0] * step / steps[0] if steps[0] else tokens[0]
    return lambda step: float(np.interp(step, steps, tokens))


def _mark_events(ax, run: RunData, index: int, first: bool) -> bool:
    """Stability events as X markers at their loss (at the top when the loss was not finite)."""
    if not run.guard_events:
        return False
    import matplotlib.transforms as transforms

    top = transforms.blended_transform_factory(ax.transData, ax.transAxes)
    for n, event in enumerate(run.guard_events):
        loss = event.get("loss")
        kwargs = {"color": color(index), "marker": "X", "markersize": 9, "linestyle": "none", "clip_on": False,
                  "markeredgecolor": "black", "label": "stability event" if first and n == 0 else None}
        if isinstance(loss, float):
            ax.plot([event["step"]], [loss], **kwargs)
        else:
            ax.plot([event["step"]], [0.97], transform=top, **kwargs)
    return True


def _mark_stalls(ax, run: RunData, index: int, first: bool) -> bool:
    """Checkpoint saves as ▼ markers along the top of the plot."""
    if not run.stalls:
        return False
    import matplotlib.transforms as transforms

    top = transforms.blended_transform_factory(ax.transData, ax.transAxes)
    ax.plot([s for s, _ in run.stalls], [0.99] * len(run.stalls), transform=top, color=color(index), marker="v",
            linestyle="none", markersize=7, label="checkpoint save" if first else None, clip_on=False)
    return True


def _mark_early_stop(ax, run: RunData, index: int, first: bool) -> bool:
    """The step where early stopping ended the run, as a dotted vertical line."""
    stop = stopped_early(run)
    if stop is None or stop[0] is None:
        return False
    ax.axvline(stop[0], color=color(index), linestyle=":", linewidth=1.5, label="stopped early" if first else None)
    return True


def lr_section(runs: list[RunData]) -> Section:
    section = Section("lr", "Learning rate")
    have = _with(runs, "lr")
    if lacking(section, runs, have, "learning rate values"):
        return section
    fig, (ax,) = panels(1, width=7)
    _plot_series(ax, runs, "lr")
    style(ax, "step", "learning rate", "learning rate at the end of each logging interval")
    peaks = [max(r.series("lr")[1]) for r in have]
    if min(peaks) > 0 and max(peaks) > 30 * min(peaks):  # runs orders of magnitude apart: the lower ones flat
        ax.set_yscale("log")
    else:
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    section.add(figure(fig, "lr", "The schedule's learning rate (first parameter group)."))
    return section


def grad_norm_section(runs: list[RunData]) -> Section:
    section = Section("grad-norm", "Gradient norm")
    have = _with(runs, "grad_norm")
    if lacking(section, runs, have, "gradient norms"):
        return section
    fig, (ax,) = panels(1, width=7)
    _plot_series(ax, runs, "grad_norm", suffix=" before clipping")
    _plot_series(ax, runs, "grad_norm_clipped", linestyle="--", suffix=" after clipping")
    clips = {r.config.get("optim", {}).get("grad_clip") for r in have if isinstance(r.config.get("optim"), dict)}
    clips = [c for c in clips if isinstance(c, (int, float)) and not isinstance(c, bool) and c > 0]
    for clip in clips:
        ax.axhline(clip, color="grey", linewidth=0.8, linestyle=":")
    style(ax, "step", "gradient norm", "total gradient norm at each logged step")
    caption = "Solid: the norm before clipping; dashed: after clipping (what the optimizer used)."
    if clips:
        caption += f" Dotted: optim.grad_clip = {', '.join(f'{c:g}' for c in clips)}."
    section.add(figure(fig, "grad-norm", caption))
    return section


def throughput_section(runs: list[RunData]) -> Section:
    section = Section("throughput", "Throughput and MFU")
    have = [r for r in runs if r.series("tokens_per_s")[0] or r.series("mfu")[0]]
    if lacking(section, runs, have, "tokens/s or MFU values"):
        return section
    fig, (speed, mfu) = panels(2)
    _plot_series(speed, runs, "tokens_per_s")
    _plot_series(mfu, runs, "mfu", scale=100.0)
    style(speed, "step", "tokens/s (all processes)", "tokens per second")
    style(mfu, "step", "MFU (%)", "model FLOPs utilization")
    section.add(figure(fig, "throughput", "Measured over each logging interval's wall time (eval and checkpoint "
                                          "time excluded). The first interval includes the warm-up."))
    if not any(r.series("mfu")[0] for r in runs):
        section.add(paragraph("No run logged MFU (no peak FLOP/s known for its device).", "note"))
    return section


def _wait_share(run: RunData) -> tuple[list[float], list[float]]:
    points = [(r["step"], r["data_wait_s"] / r["step_time_s"]) for r in run.intervals
              if "data_wait_s" in r and r.get("step_time_s", 0) > 0]
    return [p[0] for p in points], [p[1] for p in points]


def data_wait_section(runs: list[RunData]) -> Section:
    section = Section("data-wait", "Data wait")
    have = [r for r in runs if _wait_share(r)[0]]
    if lacking(section, runs, have, "data wait and step time values"):
        return section
    fig, (ax,) = panels(1, width=7)
    _plot_series(ax, runs, "", scale=100.0, transform=_wait_share)
    style(ax, "step", "data wait (% of step time)", "time the step waited for its batch")
    ax.set_ylim(bottom=0)
    section.add(figure(fig, "data-wait", "data_wait_s / step_time_s per logging interval. Above ~10 % the input "
                                         "pipeline is a bottleneck: raise data.num_workers or prefetching."))
    return section


def events_section(runs: list[RunData]) -> Section:
    section = Section("events", "Stability events and checkpoint stalls")
    have = [r for r in runs if r.guard_events or r.stalls]
    if lacking(section, runs, have, "stability events or checkpoint saves"):
        return section
    rows = []
    for run in runs:
        for event in run.guard_events:
            details = ", ".join(f"{k} {_short_number(event[k])}" for k in ("loss", "grad_norm", "median") if k in event)
            rows.append([run.name, int(event["step"]), f"stability: {event['kind']}", event["action"] or "-", details])
        for step, stall in run.stalls:
            rows.append([run.name, int(step), "checkpoint save", "-", f"training stalled {stall:.3g} s"])
    if len(rows) > MAX_EVENT_ROWS:
        section.add(paragraph(f"{len(rows)} events; the first {MAX_EVENT_ROWS} are listed.", "note"))
    section.add(table(["run", "step", "event", "action", "details"], rows[:MAX_EVENT_ROWS], "events"))
    for run in have:
        count, total, longest = run.stall_totals  # every save, also those a long run's list thins out
        if count:
            shown = f"; {len(run.stalls)} of them are listed" if count > len(run.stalls) else ""
            section.add(paragraph(f"{run.name}: {count} checkpoint save(s), the training stalled {total:.3g} s in "
                                  f"all (longest {longest:.3g} s){shown}.", "note"))
    return section


def _short_number(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
