"""What `slipstream plan` and `slipstream cost` show: a plan result as a table, as JSON, as a TOML config.

    format_plan(result, top, rejected)      the ranked layouts, the best one's step time, the rejected ones
    format_layout(result)                   one pinned layout (`plan --layout`): its memory and time, whole
    plan_record(result, top, rejected, ...) the same as one JSON-ready dict
    cluster_record(cluster)                 the cluster a plan or cost estimate was made for
    write_best_config(result, path)         the fastest runnable layout as a TOML for `slipstream train`
"""

from __future__ import annotations

from slipstream.errors import UserError
from slipstream.plan.memory import GIB
from slipstream.plan.search import PlanResult
from slipstream.plan.space import strategy_overrides


def plan_record(result: PlanResult, top: int, rejected: int, written: str | None) -> dict:
    return {"model": result.model.name, "cluster": cluster_record(result.cluster),
            "workload": {"seq_len": result.workload.seq_len, "global_batch": result.workload.global_batch},
            "evaluated": result.evaluated, "feasible": len(result.ranked),
            "ranked": [c.to_record() for c in result.ranked[:top]],
            "rejected": [c.to_record() for c in result.rejected[:rejected]], "wrote": written}


def cluster_record(cluster) -> dict:
    return {"gpu": cluster.gpu.name, "gpus_per_node": cluster.gpus_per_node, "nodes": cluster.nodes,
            "intra": cluster.intra.name, "inter": cluster.inter.name, "memory_gib": cluster.memory_bytes / GIB,
            "sources": list(cluster.sources)}


def _gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def _hfu(time) -> float | None:
    """Hardware FLOPs utilization (the recomputed forward counted too), where the time model gives it."""
    return getattr(time, "hfu", None)


def _header(result: PlanResult) -> list[str]:
    c, w = result.cluster, result.workload
    return [f"{result.model.name} on {c.world} x {c.gpu.name} ({c.nodes} node(s) x {c.gpus_per_node}, "
            f"{c.intra.name} / {c.inter.name}, {_gib(c.memory_bytes)} GiB usable per GPU)",
            f"seq {w.seq_len}, global batch {w.global_batch} sequences = {w.seq_len * w.global_batch:,} tokens per step"]


def format_plan(result: PlanResult, top: int, rejected: int) -> str:
    c = result.cluster
    first = result.ranked[0].strategy
    head = _header(result)
    lines = [head[0], f"{head[1]}; {result.evaluated} layouts evaluated, {len(result.ranked)} fit "
             f"(precision {first.precision}, attention {first.attention})", ""]
    shown = result.ranked[:top]
    width = max([20] + [len(cand.strategy.label()) for cand in shown])
    hfu = any(_hfu(cand.time) is not None for cand in shown)
    # MFU counts the model's FLOPs (6N + attention per token); HFU also the recomputed forward of
    # activation checkpointing: published runs quote one or the other.
    header = (f"{'#':>3}  {'layout':<{width}} {'tokens/s':>11} {'MFU':>6}" + (f" {'HFU':>6}" if hfu else "")
              + f" {'step s':>8} {'GiB/GPU':>8}  {'params':>6} {'grads':>6} {'optim':>6} {'acts':>6} {'temp':>6}  runnable")
    lines.append(header)
    for i, cand in enumerate(shown, 1):
        b = cand.memory.breakdown
        runnable = "yes" if not cand.not_runnable else "no: " + ", ".join(cand.not_runnable)
        used = _hfu(cand.time)
        lines.append(f"{i:>3}  {cand.strategy.label():<{width}} {cand.time.tokens_per_s:>11,.0f} {cand.time.mfu:>6.1%}"
                     + (f" {used:>6.1%}" if hfu and used is not None else (f" {'-':>6}" if hfu else ""))
                     + f" {cand.time.step_s:>8.3f} {_gib(cand.memory.total_bytes):>8}  {_gib(b['parameters']):>6} "
                     f"{_gib(b['gradients']):>6} {_gib(b['optimizer_state']):>6} {_gib(b['activations']):>6} "
                     f"{_gib(b['temporaries'] + cand.memory.fragmentation_bytes):>6}  {runnable}")
    lines.append("  MFU (model FLOPs): the model's FLOPs per token x tokens/s over the GPUs' peak"
                 + ("; HFU (with recompute): the FLOPs the GPUs run, activation checkpointing's recomputed "
                    "forward included" if hfu else ""))
    best = result.ranked[0]
    parts = ", ".join(f"{k} {v:.3f}s" for k, v in best.time.breakdown.items())
    lines += ["", f"best: {best.strategy.label()}: step {best.time.step_s:.3f}s = {parts}"]
    if best.not_runnable:
        runnable = result.best(runnable_only=True)
        if runnable:
            lines.append(f"  (slipstream cannot run {', '.join(best.not_runnable)} yet; best runnable: "
                         f"{runnable.strategy.label()} at {runnable.time.tokens_per_s:,.0f} tokens/s)")
        else:
            lines.append(f"  (slipstream cannot run {', '.join(best.not_runnable)} yet, and no runnable layout fits: "
                         f"data parallelism alone needs a global batch divisible by the {c.world} GPUs "
                         f"and model states small enough to shard)")
    if rejected and result.rejected:
        lines += ["", "rejected (fastest first):"]
        for cand in result.rejected[:rejected]:
            lines.append(f"  {cand.strategy.label():<44} {cand.why_not}"
                         + (f"; not runnable: {', '.join(cand.not_runnable)}" if cand.not_runnable else ""))
    if c.sources:
        lines += ["", "inputs:"] + [f"  {s}" for s in c.sources]
    return "\n".join(lines)


def format_layout(result: PlanResult) -> str:
    """One layout's whole estimate (`slipstream plan --layout`): whether it fits and runs, its speed,
    and every part of its memory per GPU and of its step time."""
    cand = (result.ranked or result.rejected)[0]
    s, t, m = cand.strategy, cand.time, cand.memory
    usable = result.cluster.memory_bytes
    lines = _header(result) + ["", f"layout {s.label()} (precision {s.precision}, attention {s.attention})"]
    lines.append("  fits:     " + (f"yes, {_gib(m.total_bytes)} of {_gib(usable)} GiB per GPU" if cand.fits
                                     else f"no: {cand.why_not}"))
    lines.append("  runnable: " + ("yes" if not cand.not_runnable else "no: slipstream cannot run "
                                   + ", ".join(cand.not_runnable) + " yet"))
    used = _hfu(t)
    lines.append(f"  speed:    {t.tokens_per_s:,.0f} tokens/s, step {t.step_s:.3f} s, MFU (model FLOPs) {t.mfu:.1%}"
                 + (f", HFU (with recompute) {used:.1%}" if used is not None else ""))
    lines += ["", f"memory per GPU at the peak ({m.peak_phase}), GiB:"]
    parts = {**m.breakdown, "fragmentation": m.fragmentation_bytes}
    lines += [f"  {name.replace('_', ' '):<24} {_gib(value):>8}" for name, value in parts.items()]
    lines.append(f"  {'total':<24} {_gib(m.total_bytes):>8}" + (f"   (+ {_gib(m.host_bytes)} GiB in host memory)"
                                                                   if m.host_bytes else ""))
    if m.buffers:   # the model states as the stack keeps them, by name (MemoryEstimate.buffers)
        lines += ["  model states and buffers:"]
        lines += [f"    {name:<23}{_gib(value):>8}" for name, value in m.buffers.items()]
    lines += [f"  note: {note}" for note in m.notes]
    lines += ["", "step time, s:"]
    lines += [f"  {name.replace('_', ' '):<24} {value:>8.3f}" for name, value in t.breakdown.items()]
    lines.append(f"  {'step':<24} {t.step_s:>8.3f}")
    if result.cluster.sources:
        lines += ["", "inputs:"] + [f"  {src}" for src in result.cluster.sources]
    return "\n".join(lines)


def write_best_config(result: PlanResult, path: str) -> str:
    """Write the fastest runnable layout as a TOML for `slipstream train` / `launch` (atomically)."""
    import tomli_w

    from slipstream.observe.env import write_text_atomic

    best = result.best(runnable_only=True)
    if best is None:
        raise UserError("no runnable layout fits, so there is no config to write; drop --write-config or "
                        "add GPUs (the fitting layouts need parallelisms slipstream cannot run yet)")
    if result.model.traced is not None:
        raise UserError("--write-config needs a slipstream model (a preset or a TOML config), not a traced module")
    # Every model field, so the run trains exactly the planned shape whatever the preset says.
    values: dict[str, dict] = {"model": dict(vars(result.model.cfg))}
    for dotted, value in strategy_overrides(best.strategy, result.workload.seq_len).items():
        section, key = dotted.split(".")
        values.setdefault(section, {})[key] = value
    c = result.cluster
    if c.nodes > 1:
        launch = f"slipstream launch slurm --nodes {c.nodes} --gpus-per-node {c.gpus_per_node} -- train --config {path}"
    elif c.world > 1:
        launch = f"slipstream launch local --nproc {c.gpus_per_node} -- train --config {path}"
    else:
        launch = f"slipstream train --config {path}"
    header = (f"# Written by `slipstream plan`: {best.strategy.label()} for {result.model.name} on "
              f"{result.cluster.world} x {result.cluster.gpu.name}.\n"
              f"# Predicted: {best.time.tokens_per_s:,.0f} tokens/s, MFU {best.time.mfu:.1%}, "
              f"{best.memory.total_bytes / GIB:.1f} GiB per GPU.\n# Run: {launch}\n"
              f"# Add a [data] section for your corpus and tokenizer (vocabulary {result.model.cfg.vocab_size}).\n")
    write_text_atomic(path, header + tomli_w.dumps(values))
    return f"wrote {path} ({best.strategy.label()}); run it with: {launch}"

