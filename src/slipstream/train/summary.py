"""The run summary: what `fit()` reports when its loop ends (summary.json, the console table,
the memory and communication reports), from the objects the Trainer owns."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from slipstream.observe.loggers import RunLoggers
from slipstream.observe.memory import peak_memory_bytes


def run_summary(trainer, loggers: RunLoggers, start_step: int, wall_start: float, last_eval,
                resume_from: Path | None) -> dict[str, Any]:
    """Commit the last checkpoint, close the loggers and loaders, and write summary.json (rank 0).
    Distributed: a collective (every rank's memory and stages are gathered)."""
    loop_time = trainer.meter.loop_time_s
    last_ckpt = trainer.writer.wait() or trainer.writer.last_committed or resume_from
    trainer.parallel.barrier()  # every rank's part of the last checkpoint is committed
    loggers.close()
    main = trainer.parallel.is_main
    if trainer.profiler is not None and main:
        _print_profiler_outputs(trainer)
    for loader in (trainer.train_loader, trainer.val_loader):
        if hasattr(loader, "close"):
            loader.close()  # stop prefetch threads / worker processes now
    summary = {
        "final_loss": loggers.last_loss, "val_loss": last_eval.loss if last_eval else None,
        "val_loss_stderr": last_eval.stderr if last_eval else None,
        "val_tokens": last_eval.tokens if last_eval else None, "steps": trainer.step,
        "steps_this_run": trainer.step - start_step, "tokens": trainer.tokens_seen,
    }
    if (stopped := trainer.early_stop.summary()) is not None:
        summary["stopped_early"] = stopped
    if trainer.scaler is not None:
        summary["skipped_steps"] = int(trainer.skipped_steps.item())  # host sync, once
    summary.update({
        "tokens_per_s": trainer.meter.tokens_per_s, "mfu": loggers.mean_mfu,
        "mem_peak_bytes": peak_memory_bytes(trainer.device),
        "wall_time_s": time.perf_counter() - wall_start, "loop_time_s": loop_time,
        "run_dir": str(trainer.run_dir), "checkpoint": str(last_ckpt) if last_ckpt else None,
        "device": str(trainer.device),
    })
    if trainer.profiler is not None:
        summary["trace_files"] = [str(p) for p in trainer.profiler.trace_files]
    if (memory := trainer.memory.summary()) is not None:
        summary["memory"] = memory
    if (comm := trainer.comm.summary()) is not None:
        summary["comm"] = comm
    if trainer.parallel.world_size > 1:
        summary.update(_job_summary(trainer, summary))  # a collective: every rank's memory
    if not main:
        return summary
    from slipstream.observe.console import print_summary
    from slipstream.observe.env import write_json_atomic

    write_json_atomic(trainer.run_dir / "summary.json", summary)
    print_summary({k: v for k, v in summary.items() if k not in ("memory", "ranks", "comm")})
    trainer.memory.print_report()
    trainer.comm.print_report()
    return summary


def _print_profiler_outputs(trainer) -> None:
    for path in trainer.profiler.trace_files:
        print(f"profiler trace: {path} (open it at https://ui.perfetto.dev)")
    if trainer.profiler.trace_files and trainer.profiler.memory_timeline_file is not None:
        print(f"memory timeline: {trainer.profiler.memory_timeline_file}")
    if not trainer.profiler.trace_files:
        print(f"note: the run ended before profile.start_step = {trainer.cfg.profile.start_step}; no trace was written")


def _job_summary(trainer, summary: dict[str, Any]) -> dict[str, Any]:
    """Distributed runs: the job's shape, and every rank's memory (a collective)."""
    report = trainer.memory.report
    mine = {"rank": trainer.parallel.rank, "device": str(trainer.device), "mem_peak_bytes": summary["mem_peak_bytes"],
            "step_peak_bytes": report.peak_bytes if report is not None else None,
            "step_peak_categories": report.categories if report is not None else None,
            # All gradients exist at the end of backward: the clearest view of what a strategy shards.
            "backward_end_categories": report.phase_categories["backward"]["end"] if report is not None else None}
    if trainer.pipeline is not None:  # which blocks each of this rank's stages holds
        mine["pp_stages"] = {s.stage_index: list(m.layers) for s, m in zip(trainer.pipeline.stages,
                                                                             trainer.pipeline.modules)}
    per_device = summary["tokens_per_s"] / trainer.parallel.world_size if summary["tokens_per_s"] else None
    return {"world_size": trainer.parallel.world_size, "dp_strategy": trainer.parallel.dims.strategy,
            "mesh": [list(dim) for dim in trainer.parallel.dims.mesh_dims],
            "tokens_per_s_per_device": per_device, "ranks": trainer.parallel.gather(mine)}  # gather: a collective
