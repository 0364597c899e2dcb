"""`slipstream profile`: a short profiled training run of the configured job.

A tool above the trainer (perf layer). The step profiler it switches on, its files and the
label contract are in slipstream.observe.profiling.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from slipstream.config.schema import Config
from slipstream.errors import UserError


def profile_run(cfg: Config, steps: int | None = None) -> dict[str, Any]:
    """`slipstream profile`: a short profiled training run of the configured job.

    Trains profile.start_step + steps steps (eval, checkpoints, progress bar and the memory
    breakdown off), prints the top-ops table and the trace path. Returns trace_files,
    run_dir, summary (the trainer's) and top_ops (the table).
    """
    from slipstream.train.lm import build_lm_trainer

    steps = cfg.profile.steps if steps is None else steps
    if steps < 1:
        raise UserError(f"--steps must be >= 1 (got {steps})")
    replace = dataclasses.replace
    cfg = replace(
        cfg,
        profile=replace(cfg.profile, enabled=True, steps=steps),
        # One unprofiled step after the window keeps the last step's extra work (final
        # logging and summary) out of the trace.
        train=replace(cfg.train, max_steps=cfg.profile.start_step + steps, eval_steps=0, eval_interval=0),
        checkpoint=replace(cfg.checkpoint, save_final=False, interval=0, resume="none"),
        logging=replace(cfg.logging, progress=False),
        # The breakdown measures one step under a dispatch-mode tracker: not a normal step.
        metrics=replace(cfg.metrics, memory_breakdown=False),
    )
    trainer = build_lm_trainer(cfg)
    summary = trainer.fit()
    table = trainer.profiler.top_ops_table()
    print(table)
    trace_files = [str(p) for p in trainer.profiler.trace_files]
    for path in trace_files:
        print(f"trace: {path}")
    return {"trace_files": trace_files, "run_dir": str(trainer.run_dir), "summary": summary, "top_ops": table}
