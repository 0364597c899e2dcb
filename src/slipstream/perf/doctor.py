"""`slipstream doctor`: turn profiler traces into ranked, plain-words findings.

Each rule reads the measurements of `slipstream.perf.trace.analyze` and, when its
problem is present, returns a Finding: a title, the measured evidence, a severity (the
share of step time the problem costs, so findings sort by what they are worth) and the
slipstream setting that addresses it. `suggested_overrides` turns the findings into
`--section.key=value` overrides for `slipstream doctor --apply`.

With several traces (one per rank) every rule runs on every rank and the worst rank is
reported; two more rules look at all ranks together: imbalance compares them, and
pipeline_bubble (pipelined runs) reports each rank's wait on the pipeline's transfers next
to the bubble the run planned (its metrics.jsonl, when the traces sit in <run dir>/traces/), and
moe_dispatch (expert-parallel runs, perf/doctor_moe.py) a rank's wait on the MoE all-to-all next
to the tokens each rank's experts received (the same metrics.jsonl).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slipstream.errors import UserError
from slipstream.perf.trace import (DATA_LABEL, LAUNCH_BOUND_MIN_OPS, PIPELINE_LABEL, TINY_OP_US, TraceAnalysis,
                                   load_and_analyze)

# Below these shares of step time a problem is not worth a finding.
DATA_WAIT_MIN = 0.10
COMM_EXPOSED_MIN = 0.10
MEMCPY_MIN = 0.10
IDLE_MIN = 0.20  # idle not explained by the data wait
IMBALANCE_MIN = 0.10
LAUNCH_BOUND_MIN = 0.10  # share of step in runs of tiny ops; many tiny ops spread out cost little
COMPUTE_MIN = 0.50
SYNC_MIN_PER_STEP = 1.0  # the trainer syncs once per log_interval; every step is too often
PIPELINE_BUBBLE_MIN = 0.15  # a pipeline rank waiting on its stages' transfers


@dataclass
class Finding:
    # stable id: data_wait, sync, launch_bound, imbalance, pipeline_bubble, moe_dispatch, comm_exposed, memcpy,
    # idle, compute
    rule: str
    title: str
    evidence: str
    severity: float  # share of step time, 0..1
    fix: str
    overrides: list[str] = field(default_factory=list)
    numbers: dict[str, Any] = field(default_factory=dict)  # the measured values, for JSON and tests
    rank: int = 0  # the rank the numbers come from (the worst one)
    ranks: list[int] = field(default_factory=list)  # every rank where the rule fired


@dataclass
class Report:
    findings: list[Finding]
    analyses: list[TraceAnalysis]

    def finding(self, rule: str) -> Finding | None:
        return next((f for f in self.findings if f.rule == rule), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "findings": [dataclasses.asdict(f) for f in self.findings],
            "suggested_overrides": suggested_overrides(self),
            "traces": [_summary(a) for a in self.analyses],
        }

    def to_text(self) -> str:
        lines = []
        for a in self.analyses:
            lines.append(f"rank {a.rank} ({a.device} trace, {len(a.steps)} steps): {a.path}")
            lines.append(f"  step {format_ms(a.step_us)} (median {format_ms(a.step_us_median)}): "
                         f"compute {format_pct(a.share(a.compute_us))}, exposed communication "
                         f"{format_pct(a.share(a.comm_exposed_us))}, memory copies {format_pct(a.share(a.memcpy_us))}, "
                         f"idle {format_pct(a.share(a.idle_us))}; data wait "
                         + (format_pct(a.share(a.data_wait_us)) if a.data_wait_us is not None else "unknown"))
            if a.top_ops:
                tops = ", ".join(f"{_short(o['name'])} {format_ms(o['per_step_us'])}" for o in a.top_ops[:5])
                lines.append(f"  top host ops per step: {tops}")
            if a.top_kernels:
                tops = ", ".join(f"{_short(o['name'])} {format_ms(o['per_step_us'])}" for o in a.top_kernels[:5])
                lines.append(f"  top kernels per step: {tops}")
            if a.pipeline_us is not None:
                lines.append(f"  pipeline: {format_ms(a.pipeline_us)} per step in {PIPELINE_LABEL}, waiting on its "
                             f"transfers {format_ms(a.pp_wait_us)} ({format_pct(a.share(a.pp_wait_us))} of step, "
                             f"{format_pct(a.pp_bubble)} of the pipeline; {a.pp_transfers_per_step:g} sends/receives)")
            if a.a2a_wait_us is not None:
                lines.append(f"  all-to-all (MoE dispatch): waiting {format_ms(a.a2a_wait_us)} per step "
                             f"({format_pct(a.share(a.a2a_wait_us))} of step) with no compute running")
            for note in a.notes:
                lines.append(f"  note: {note}")
        lines.append("")
        if not self.findings:
            lines.append("no problems found")
        for i, f in enumerate(self.findings, 1):
            where = ""
            # say which rank the numbers are from (these two name every rank themselves)
            if len(self.analyses) > 1 and f.rule not in ("imbalance", "pipeline_bubble", "moe_dispatch"):
                where = f" (rank {f.rank})" if len(f.ranks) <= 1 else \
                    f" (worst: rank {f.rank}; on ranks {', '.join(map(str, f.ranks))})"
            lines.append(f"{i}. [{format_pct(f.severity)} of step] {f.title}{where}")
            lines.append(f"   evidence: {f.evidence}")
            lines.append(f"   fix: {f.fix}")
            if f.overrides:
                lines.append(f"   try: {' '.join(f.overrides)}")
        overrides = suggested_overrides(self)
        if overrides:
            lines.append("")
            lines.append(f"suggested overrides: {' '.join(overrides)}  (slipstream doctor --apply tries them)")
        return "\n".join(lines)


def format_ms(us: float) -> str:
    # Sub-0.1 ms amounts (a sync call, a short gap) would read as "0.00 ms".
    return f"{us:.1f} µs" if abs(us) < 100 else f"{us / 1000:.2f} ms"


def _short(name: str, width: int = 48) -> str:
    """An op or kernel name short enough for one line of the report."""
    name = name.removeprefix("autograd::engine::evaluate_function: ")
    return name if len(name) <= width else name[: width - 3] + "..."


def format_pct(share: float | None) -> str:
    return "unknown" if share is None else f"{100 * share:.0f}%"


def _summary(a: TraceAnalysis) -> dict[str, Any]:
    """The per-trace numbers for JSON output, without the per-step detail."""
    out = a.to_dict()
    out.pop("steps")
    out["shares"] = {k: a.share(getattr(a, k + "_us")) for k in
                     ("compute", "comm_exposed", "memcpy", "idle", "data_wait", "pp_wait", "a2a_wait")}
    out["pp_bubble"] = a.pp_bubble
    return out


@dataclass
class RunContext:
    """What the run directory beside the traces (<run dir>/traces/rank*.json) tells the rules."""

    run_dir: str | None = None
    cfg: Any = None  # the run's config: the one given, else the run dir's config.toml
    pp_bubble_planned: float | None = None  # metrics.jsonl's last pp_bubble_planned
    world_size: int | None = None  # summary.json's


def _run_dir(trace_files: list[str]) -> Path | None:
    """The run directory of traces written by the trainer (all in one <run dir>/traces/)."""
    dirs = {Path(f).resolve().parent for f in trace_files}
    if len(dirs) != 1:
        return None
    (folder,) = dirs
    return folder.parent if folder.name == "traces" else None


def _last_planned_bubble(metrics: Path) -> float | None:
    """The last pp_bubble_planned in a metrics.jsonl (lines that don't parse are skipped)."""
    from slipstream.perf.doctor_moe import is_number, metrics_records

    values = [r["pp_bubble_planned"] for r in metrics_records(metrics) if is_number(r.get("pp_bubble_planned"))]
    return float(values[-1]) if values else None


def read_run_context(trace_files: list[str], cfg=None) -> RunContext:
    """The run's planned bubble and config from the run dir holding the traces (if any)."""
    run_dir = _run_dir(trace_files)
    if run_dir is None:
        return RunContext(cfg=cfg)
    if cfg is None and (run_dir / "config.toml").is_file():
        from slipstream.config.load import config_from_toml_text
        from slipstream.safe_read import DOCUMENT, read_bytes_capped

        with contextlib.suppress(OSError, UnicodeDecodeError, UserError):
            cfg = config_from_toml_text(read_bytes_capped(run_dir / "config.toml", DOCUMENT).decode("utf-8"))
    world = None
    with contextlib.suppress(OSError, ValueError, UserError):
        from slipstream.safe_read import CHECKPOINT_JSON, load_json_capped

        world = load_json_capped(run_dir / "summary.json", CHECKPOINT_JSON).get("world_size")
    world = world if isinstance(world, int) and not isinstance(world, bool) and world > 0 else None
    return RunContext(str(run_dir), cfg, _last_planned_bubble(run_dir / "metrics.jsonl"), world)


# ---------------------------------------------------------------------------- rules
# Each rule: (analysis, cfg or None) -> Finding or None. cfg, when known, avoids
# suggesting a setting that is already in place.


def _rule_data_wait(a: TraceAnalysis, cfg) -> Finding | None:
    share = a.share(a.data_wait_us)
    if share is None or share < DATA_WAIT_MIN:
        return None
    # Double the workers (at least 2); more workers than cores only adds contention.
    workers = cfg.data.num_workers if cfg is not None else 0
    target = min(max(2, 2 * workers), max(2, os.cpu_count() or 1))
    overrides = []
    if target > workers:
        overrides.append(f"--data.num_workers={target}")
    if cfg is None or cfg.data.prefetch < 2:
        overrides.append("--data.prefetch=2")
    if a.device == "cuda" and (cfg is None or not cfg.data.pin_memory):
        overrides.append("--data.pin_memory=true")
    return Finding(
        "data_wait", f"the step waits for data: data wait is {format_pct(share)} of step time",
        f"{format_ms(a.data_wait_us)} of {format_ms(a.step_us)} per step inside slipstream/data "
        f"(mean of {len(a.steps)} steps)",
        share, "raise data.num_workers and enable pinned prefetch (data.prefetch, data.pin_memory); "
               "if batches are built by a slow data.augment, workers run it in parallel",
        overrides, {"data_wait_us": a.data_wait_us, "step_us": a.step_us, "share": share})


def _rule_sync(a: TraceAnalysis, cfg) -> Finding | None:
    if a.sync_points_per_step < SYNC_MIN_PER_STEP:
        return None
    per_step = round(a.sync_points_per_step, 1)
    ops = ", ".join(f"{name} x{count:g}" for name, count in
                    sorted(a.sync_ops_per_step.items(), key=lambda kv: -kv[1]))
    overrides, note = [], ""
    if cfg is not None and cfg.logging.log_interval < 10:
        overrides.append("--logging.log_interval=10")
        note = f"; logging.log_interval={cfg.logging.log_interval} makes the trainer itself sync that often"
    share = a.share(a.sync_us)
    return Finding(
        "sync", f"{per_step:g} host-device sync points per step",
        f"per step: {ops} ({format_ms(a.sync_us)} in the sync calls; on a GPU each one also "
        f"drains the launch queue){note}",
        share, "remove .item() / .cpu() / tensor printing from the step (e.g. in the loss) and keep "
               "metrics as tensors; slipstream syncs only every logging.log_interval steps",
        overrides, {"sync_points_per_step": a.sync_points_per_step, "sync_ops_per_step": a.sync_ops_per_step,
                    "sync_us": a.sync_us})


def _rule_launch_bound(a: TraceAnalysis, cfg) -> Finding | None:
    share = a.share(a.tiny_stretch_us)
    if a.ops_per_step <= LAUNCH_BOUND_MIN_OPS or a.median_op_us >= TINY_OP_US or share < LAUNCH_BOUND_MIN:
        return None
    overrides = [] if cfg is not None and cfg.compile.scope != "off" else ["--compile.scope=blocks"]
    return Finding(
        "launch_bound", f"launch-bound: {a.ops_per_step:.0f} small ops per step",
        f"{a.ops_per_step:.0f} top-level ops per step, median {a.median_op_us:.1f} µs each; runs of tiny "
        f"ops take {format_ms(a.tiny_stretch_us)} of {format_ms(a.step_us)} per step",
        share, "fuse the small ops with compile.scope=blocks (or model), and use a larger "
               "train.micro_batch_size so each op does more work",
        overrides, {"ops_per_step": a.ops_per_step, "median_op_us": a.median_op_us,
                    "tiny_stretch_us": a.tiny_stretch_us})


def _rule_comm_exposed(a: TraceAnalysis, cfg) -> Finding | None:
    # A pipeline's blocking send/recv is its bubble (pipeline_bubble), and an expert-parallel wait in
    # the all-to-all is moe_dispatch's (an overloaded peer), not a collective to overlap.
    share = a.share(max(0.0, a.comm_exposed_us - (a.pp_wait_comm_us or 0.0) - (a.a2a_wait_us or 0.0)))
    if share < COMM_EXPOSED_MIN:
        return None
    return Finding(
        "comm_exposed", f"communication is not hidden: {format_pct(share)} of step time waits on collectives",
        f"{format_ms(a.comm_us)} of communication per step, {format_ms(a.comm_overlapped_us)} overlapped with compute, "
        f"{format_ms(a.comm_exposed_us)} exposed",
        share, "DDP bucket size and overlap options are not in slipstream yet (they come later); "
               "until then a larger train.micro_batch_size raises compute per all-reduce",
        [], {"comm_us": a.comm_us, "comm_exposed_us": a.comm_exposed_us,
             "comm_overlapped_us": a.comm_overlapped_us})


def _rule_memcpy(a: TraceAnalysis, cfg) -> Finding | None:
    share = a.share(a.memcpy_us)
    if share < MEMCPY_MIN:
        return None
    overrides = [] if cfg is not None and cfg.data.pin_memory else ["--data.pin_memory=true"]
    return Finding(
        "memcpy", f"memory copies take {format_pct(share)} of step time",
        f"{format_ms(a.memcpy_us)} per step in Memcpy/Memset not overlapped with compute",
        share, "copy batches from pinned memory with non_blocking=True (data.pin_memory=true) and avoid "
               ".to(device) / .cpu() round trips inside the step",
        overrides, {"memcpy_us": a.memcpy_us})


def _rule_idle(a: TraceAnalysis, cfg) -> Finding | None:
    # Idle gaps the data wait does not explain: the host is too slow to keep the device fed.
    # Only gaps >= MIN_GAP_US count; the many short ones between tiny ops are launch_bound's.
    unexplained = a.long_idle_us
    share = a.share(unexplained)
    if share < IDLE_MIN:
        return None
    host = [(name, us) for name, us in a.idle_by_host.items() if name != DATA_LABEL]
    what = ", ".join(f"{name} {format_ms(us)}" for name, us in host[:3]) or "nothing recorded"
    who = "the device sits idle" if a.device == "cuda" else "no op runs"
    return Finding(
        "idle", f"{who} for {format_pct(share)} of the step, outside the data wait",
        f"{format_ms(unexplained)} per step in idle gaps outside slipstream/data; the host meanwhile: {what}",
        share, "look at what the host does in the gaps (listed above); compile.scope=blocks cuts Python "
               "overhead, and sleeps or blocking calls in the step show up here",
        [], {"idle_us": a.idle_us, "unexplained_idle_us": unexplained, "idle_by_host": a.idle_by_host})


def _rule_compute(a: TraceAnalysis, cfg) -> Finding | None:
    # Work in ops long enough to be real compute (tiny-op stretches belong to launch_bound).
    share = a.share(max(0.0, a.compute_us - a.tiny_stretch_us))
    if share < COMPUTE_MIN:
        return None
    overrides = []
    # bf16 matmuls are fast on GPUs; on most CPUs (no AMX) they are slower than fp32.
    if a.device == "cuda" and (cfg is None or cfg.precision.autocast == "none"):
        overrides.append("--precision.autocast=bf16")
    if cfg is None or cfg.compile.scope == "off":
        overrides.append("--compile.scope=blocks")
    top = ", ".join(_short(o["name"]) for o in (a.top_kernels or a.top_ops)[:3])
    return Finding(
        "compute", f"compute-bound: compute is {format_pct(share)} of step time",
        f"{format_ms(a.compute_us)} of {format_ms(a.step_us)} per step in compute; largest: {top}",
        share, "make the compute cheaper: precision.autocast=bf16 (GPUs), compile.scope=blocks "
               "(train.fused_loss saves logits memory, it does not speed the step up on CPU)",
        overrides, {"compute_us": a.compute_us})


RULES = (_rule_data_wait, _rule_sync, _rule_launch_bound, _rule_comm_exposed, _rule_memcpy, _rule_idle,
         _rule_compute)


def _rule_imbalance(analyses: list[TraceAnalysis]) -> Finding | None:
    if len(analyses) < 2:
        return None
    # A rank's own work: the step minus its time waiting in collectives. In synchronized
    # training every rank's step is as long as the slowest one's, so the slow rank is the
    # one that waits least; without communication it is simply the longest step.
    work = {a.rank: a.step_us - a.comm_exposed_us for a in analyses}
    steps = {a.rank: a.step_us for a in analyses}
    slow = max(work, key=work.get)
    fast = min(work, key=work.get)
    longest_step = max(steps.values())
    spread = (work[slow] - work[fast]) / longest_step if longest_step > 0 else 0.0
    if spread < IMBALANCE_MIN:
        return None
    by_rank = {a.rank: a for a in analyses}
    waiter = max(by_rank, key=lambda r: by_rank[r].comm_exposed_us + by_rank[r].idle_us)
    per_rank = ", ".join(f"rank {r} {format_ms(steps[r])}" for r in sorted(steps))
    s, f = by_rank[slow], by_rank[fast]
    detail = (f"rank {slow} idles {format_ms(s.idle_us)} per step vs {format_ms(f.idle_us)} on rank {fast}")
    if s.data_wait_us is not None and f.data_wait_us is not None:
        detail += f"; data wait {format_ms(s.data_wait_us)} vs {format_ms(f.data_wait_us)}"
    if any(a.comm_us > 0 for a in analyses):
        detail += f"; rank {waiter} waits longest (collectives and idle)"
    return Finding(
        "imbalance", f"rank {slow} is slower than the others (step-time spread {format_pct(spread)})",
        f"step time {per_rank}; {detail}",
        spread, f"check rank {slow}: data sharding (uneven shards or sequence lengths), a slower or busier "
                "device/host, or work only that rank does (logging, checkpointing)",
        [], {"step_us": steps, "work_us": work, "spread": spread, "slow_rank": slow, "waiting_rank": waiter},
        rank=slow, ranks=[slow])


def _runnable(cfg, overrides: list[str], world: int) -> bool:
    """cfg with overrides passes the config checks (load_config's) and adds no reason the planner
    knows why the trainer or torch would refuse the layout (e.g. torch's schedule rounds)."""
    from slipstream.plan.space import strategy_from_config

    try:
        new = _with_overrides(cfg, overrides)
    except UserError:
        return False
    try:
        before, after = (set(strategy_from_config(c, world).not_runnable()) for c in (cfg, new))
    except UserError:  # the world size does not fit the config: the config checks have to do
        return True
    return after <= before


def _pipeline_overrides(cfg, world: int) -> list[str]:
    """More micro-batches per step and, when the model has the blocks for it, a schedule with a
    smaller planned bubble (zbv, else interleaved-1f1b); only a runnable set (_runnable)."""
    from slipstream.config.dims import PP_ONE_STAGE, pp_microbatches
    from slipstream.plan.space import ZERO_BUBBLE_SCHEDULES

    p, t = cfg.parallel, cfg.train
    sequences, micro = t.micro_batch_size * t.grad_accum_steps, pp_microbatches(cfg)
    # The next micro-batch count from 2x that divides the sequences a rank runs per step; at one
    # sequence per micro-batch already, more sequences per step (a larger global batch).
    more = next((k for k in range(2 * micro, sequences + 1) if sequences % k == 0), None)
    if more is not None:
        micro_overrides = [f"--parallel.pp_microbatches={more}"]
    else:
        micro_overrides = [f"--train.grad_accum_steps={2 * t.grad_accum_steps}"]
        if p.pp_microbatches:
            micro_overrides.append(f"--parallel.pp_microbatches={2 * micro}")
    schedules = []
    if p.pp_schedule not in ZERO_BUBBLE_SCHEDULES:
        schedules = ["zbv", "interleaved-1f1b"] if p.pp_schedule in PP_ONE_STAGE else ["zbv"]
    candidates = [micro_overrides + [f"--parallel.pp_schedule={name}"] for name in schedules] + [micro_overrides]
    return next((o for o in candidates if _runnable(cfg, o, world)), [])


def _rule_pipeline_bubble(analyses: list[TraceAnalysis], run: RunContext) -> Finding | None:
    """The pipeline's bubble: each rank's wait on its stages' transfers (perf.trace measures it
    inside slipstream/pipeline); fires on pipelined runs whose worst rank waits too long."""
    piped = [a for a in analyses if a.pp_wait_us is not None]
    if not piped:
        return None
    shares = {a.rank: a.share(a.pp_wait_us) for a in piped}
    worst = max(piped, key=lambda a: shares[a.rank])
    if shares[worst.rank] < PIPELINE_BUBBLE_MIN:
        return None
    per_rank = ", ".join(f"rank {a.rank} {format_pct(shares[a.rank])} of step ({format_ms(a.pp_wait_us)}; "
                         f"{format_pct(a.pp_bubble)} of the pipeline)" for a in sorted(piped, key=lambda a: a.rank))
    cfg = run.cfg
    planned, where = run.pp_bubble_planned, "pp_bubble_planned in the run's metrics.jsonl"
    setup, overrides = "", []
    if cfg is not None and cfg.parallel.pp > 1:
        from slipstream.config.dims import pp_microbatches, virtual_stages
        from slipstream.plan.timing import pipeline_bubble

        p = cfg.parallel
        setup = f" ({p.pp_schedule}, pp {p.pp}, {pp_microbatches(cfg)} micro-batches per step)"
        if planned is None:
            planned = pipeline_bubble(p.pp_schedule, p.pp, virtual_stages(p), pp_microbatches(cfg))
            where = "the planner's formula for the run's config"
        overrides = _pipeline_overrides(cfg, run.world_size or len(analyses))
    evidence = f"waiting on the pipeline's send/recv with no compute running: {per_rank}"
    if planned is None:
        evidence += "; planned bubble unknown (no metrics.jsonl or config.toml beside the traces)"
    else:
        evidence += f"; planned bubble {format_pct(planned)} of the pipeline{setup}, from {where}"
    share = shares[worst.rank]
    return Finding(
        "pipeline_bubble",
        f"the pipeline bubble: rank {worst.rank} waits on other stages for {format_pct(share)} of the step",
        evidence, share,
        "give the pipeline more micro-batches per step (parallel.pp_microbatches, which must divide "
        "train.micro_batch_size x grad_accum_steps; or a larger train.grad_accum_steps, which also grows "
        "the global batch), switch to a schedule that fills the bubble (interleaved-1f1b with virtual "
        "stages, or the zero-bubble zbv), or run fewer pipeline stages (a lower parallel.pp, more data "
        "parallelism)",
        overrides,
        {"share": shares, "pp_bubble": {a.rank: a.pp_bubble for a in piped},
         "pp_wait_us": {a.rank: a.pp_wait_us for a in piped}, "pipeline_us": {a.rank: a.pipeline_us for a in piped},
         "step_us": {a.rank: a.step_us for a in piped}, "planned": planned},
        rank=worst.rank, ranks=sorted(r for r, v in shares.items() if v >= PIPELINE_BUBBLE_MIN))


def diagnose(analyses: list[TraceAnalysis], cfg=None, run: RunContext | None = None) -> Report:
    """Run every rule on every rank; keep the worst rank per rule; sort by severity.
    run: what the run dir says (its config, metrics for pipeline_bubble and moe_dispatch); default: cfg only."""
    if not analyses:
        raise UserError("no traces to diagnose")
    findings = []
    for rule in RULES:
        fired = []
        for a in analyses:
            f = rule(a, cfg)
            if f is not None:
                f.rank = a.rank
                fired.append(f)
        if fired:
            worst = max(fired, key=lambda f: f.severity)
            worst.ranks = sorted(f.rank for f in fired)
            findings.append(worst)
    from slipstream.perf.doctor_moe import moe_dispatch

    run = run or RunContext(cfg=cfg)
    for finding in (_rule_imbalance(analyses), _rule_pipeline_bubble(analyses, run), moe_dispatch(analyses, run)):
        if finding is not None:
            findings.append(finding)
    findings.sort(key=lambda f: -f.severity)
    return Report(findings, analyses)


def suggested_overrides(report: Report) -> list[str]:
    """The findings' overrides, most severe first; the first value for a key wins."""
    out, keys = [], set()
    for f in report.findings:
        for o in f.overrides:
            key = o.split("=", 1)[0]
            if key not in keys:
                keys.add(key)
                out.append(o)
    return out


# ---------------------------------------------------------------------------- entry point


def _profile(cfg, quiet: bool) -> dict[str, Any]:
    """A short profiled run of cfg; quiet: its prints go to stderr (stdout carries the JSON)."""
    try:
        from slipstream.perf.profiling import profile_run
    except ImportError as e:
        if e.name not in (None, "slipstream.perf.profiling"):
            raise  # the module is there but something it imports is broken: show that
        raise UserError(f"profiling a run is not available in this build ({e}); "
                        "pass trace files instead: slipstream doctor TRACE.json ...") from None
    with contextlib.redirect_stdout(sys.stderr) if quiet else contextlib.nullcontext():
        result = profile_run(cfg)
    if not result.get("trace_files"):
        raise UserError("the profiled run wrote no trace files")
    return result


def _with_overrides(cfg, overrides: list[str]):
    """cfg with more `--section.key=value` overrides applied (validated like the CLI's)."""
    from slipstream.config.load import build_config, deep_merge, parse_overrides

    return build_config(deep_merge(dataclasses.asdict(cfg), parse_overrides(overrides)))


def _run_numbers(analyses: list[TraceAnalysis], cfg, result: dict[str, Any]) -> dict[str, Any]:
    """Step time and tokens/s of one profiled run, for the --apply comparison.

    tokens/s comes from the profiled steps (tokens per step on all ranks / step time), not
    from the run summary: the summary's figure includes the warm-up steps, where a
    compile.scope change pays its compile time, and would hide the steady-state gain.
    """
    step_us = max(a.step_us for a in analyses)  # the slowest rank sets the pace
    t = cfg.train
    tokens_per_step = t.micro_batch_size * t.seq_len * t.grad_accum_steps * len(analyses)
    summary = result.get("summary") if isinstance(result.get("summary"), dict) else {}
    return {"step_us": step_us, "tokens_per_s": tokens_per_step / (step_us / 1e6) if step_us > 0 else None,
            "run_tokens_per_s": summary.get("tokens_per_s"), "trace_files": list(result.get("trace_files", []))}


def _compare_text(before: dict[str, Any], after: dict[str, Any], overrides: list[str]) -> str:
    def fmt_tps(v):
        return "-" if v is None else f"{v:,.0f}"

    lines = [f"--apply: {' '.join(overrides)}  (profiled steps)",
             f"{'':8} {'step time':>12} {'tokens/s':>12}",
             f"{'before':8} {format_ms(before['step_us']):>12} {fmt_tps(before['tokens_per_s']):>12}",
             f"{'after':8} {format_ms(after['step_us']):>12} {fmt_tps(after['tokens_per_s']):>12}"]
    if after["step_us"] > 0:
        lines.append(f"speedup: {before['step_us'] / after['step_us']:.2f}x")
    return "\n".join(lines)


def run_doctor(trace_files: list[str] | None, cfg=None, overrides: list[str] | None = None,
               apply: bool = False, as_json: bool = False, max_trace_bytes: int | None = None) -> dict[str, Any]:
    """Diagnose traces (or profile a run of `cfg` first), print the report, return it as a dict.

    trace_files: chrome traces, one per rank; None or empty: profile `cfg` with
      slipstream.perf.profiling.profile_run and diagnose its traces.
    cfg: the run's Config; used to profile, to avoid suggesting settings already in place and
      for --apply. None with no trace files: the default config plus `overrides`.
    overrides: the CLI's `--section.key=value` overrides (only used to build cfg when cfg is None).
    apply: profile again with the suggested overrides appended and print before/after.
    as_json: print JSON instead of text.
    max_trace_bytes: the cap on each trace's (decompressed) size; None: safe_read.TRACE's default.
    """
    if trace_files and apply:
        # The "before" must be the same run as the "after": a trace from elsewhere isn't.
        raise UserError("--apply profiles a config before and after the suggested switches; use it without --trace")
    if cfg is None and (not trace_files or apply):
        from slipstream.config import load_config

        cfg = load_config(None, overrides or [])
    result: dict[str, Any] = {}
    if trace_files:
        files = list(trace_files)
    else:
        result = _profile(cfg, quiet=as_json)
        files = list(result["trace_files"])
    analyses = load_and_analyze(files, max_trace_bytes)
    run_dir_rules = any(a.pipeline_us is not None or a.a2a_wait_us is not None for a in analyses)
    run = read_run_context(files, cfg) if run_dir_rules else None
    report = diagnose(analyses, cfg, run)
    out = report.to_dict()
    out["trace_files"] = files

    texts = [report.to_text()]
    if apply:
        suggested = suggested_overrides(report)
        if not suggested:
            texts.append("--apply: nothing to apply (no finding suggests an override)")
        else:
            after_cfg = _with_overrides(cfg, suggested)
            if cfg.run.dir:  # a fixed run dir: keep the first run's traces, write the second beside them
                after_cfg = dataclasses.replace(after_cfg, run=dataclasses.replace(after_cfg.run,
                                                                                   dir=cfg.run.dir + "-doctor-apply"))
            after_result = _profile(after_cfg, quiet=as_json)
            after_analyses = load_and_analyze(list(after_result["trace_files"]), max_trace_bytes)
            out["apply"] = {
                "overrides": suggested,
                "before": _run_numbers(report.analyses, cfg, result or {"trace_files": files}),
                "after": _run_numbers(after_analyses, after_cfg, after_result),
            }
            texts.append(_compare_text(out["apply"]["before"], out["apply"]["after"], suggested))

    if as_json:
        print(json.dumps(out, indent=2, default=str))
    else:
        print("\n\n".join(texts))
    return out
