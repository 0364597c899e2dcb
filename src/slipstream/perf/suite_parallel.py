"""The multi-rank workloads of `slipstream bench suite`: data parallelism and one model-parallel run
per landed parallelism (tensor, pipeline, context, expert), each at world 2.

Each is one training run of the LM job under torchrun (`perf.sharding.run_strategy`, as `bench
sharding` / `bench model-parallel` / `bench moe` launch theirs; OMP_NUM_THREADS=1 per rank), every
step logged: the first steps are warm-up, every later step's tokens/s (the job's, from rank 0's
metrics.jsonl) is one sample. The quality gate: every logged loss finite and the last below the
first (the run learns).
"""

from __future__ import annotations

import math
from typing import Any, Callable

from slipstream.errors import UserError
from slipstream.perf.suite_workloads import SuiteContext, Workload, median_of, read_metrics, timed_steps

WORLD = 2
# mode -> (model and batch per rank, warm-up steps). The default job's model (gpt-mini: 6 heads and
# 6 blocks, which tp 2 and pp 2 divide) at a per-rank batch of 8; ci is the tests' tiny model.
DENSE = {
    "full": (["--train.micro_batch_size=8", "--train.seq_len=256"], 3),
    "quick": (["--train.micro_batch_size=8", "--train.seq_len=128"], 2),
    "ci": (["--model.preset=tiny", "--train.micro_batch_size=4", "--train.seq_len=32"], 2),
}
# The MoE runs: moe-tiny (Llama-style, 4 SwiGLU experts, top-2, in both blocks), as `bench moe`.
MOE = {
    "full": (["--model.preset=moe-tiny", "--train.micro_batch_size=8", "--train.seq_len=128"], 3),
    "quick": (["--model.preset=moe-tiny", "--train.micro_batch_size=4", "--train.seq_len=64"], 2),
    "ci": (["--model.preset=moe-tiny", "--train.micro_batch_size=2", "--train.seq_len=32"], 2),
}
# name -> (dp_strategy, layout overrides, the model table, what it is)
LAYOUTS: dict[str, tuple[str, list[str], dict, str]] = {
    "data_parallel_2": ("ddp", [], DENSE, "DDP over 2 ranks"),
    "tensor_parallel_2": ("none", ["--parallel.tp=2"], DENSE, "tensor parallel 2 (sequence parallel, loss parallel)"),
    "pipeline_parallel_2": ("none", ["--parallel.pp=2", "--parallel.pp_schedule=1f1b"], DENSE,
                            "pipeline parallel 2, 1F1B, one sequence per micro-batch"),
    # the cp ranks average gradients through FSDP, as `bench model-parallel` runs cp
    "context_parallel_2": ("fsdp", ["--parallel.cp=2"], DENSE,
                           "context parallel 2 (load-balanced), FSDP over the cp ranks"),
    "expert_parallel_2": ("ddp", ["--parallel.ep=2"], MOE, "expert parallel 2 over DDP 2 (MoE, all-to-all dispatch)"),
}
METHODOLOGY = (
    "One training run under torchrun at world 2 (one thread per rank); the first {warmup} steps are warm-up (process "
    "group start, first collectives, allocator) and excluded; every later step is one sample: the job's tokens/s of "
    "that step from rank 0's metrics.jsonl (logging every step). Samples: 5 steps (full), 3 (quick), 2 (ci). "
    "The median with a distribution-free order-statistic confidence interval. Secondary: step time, the last loss. "
    "On a GPU machine with fewer than 2 GPUs the workload is skipped.")


def _recipe(name: str) -> Callable[[SuiteContext], list[str]]:
    def recipe(ctx: SuiteContext) -> list[str]:
        strategy, layout, models, _ = LAYOUTS[name]
        model, warmup = models[ctx.mode]
        return [*model, *layout, f"--parallel.dp_strategy={strategy}", f"--nproc-per-node={WORLD}",
                f"(warm-up steps: {warmup})"]
    return recipe


def _measure(name: str) -> Callable[[SuiteContext, int], dict[str, Any]]:
    def measure(ctx: SuiteContext, n: int) -> dict[str, Any]:
        import torch

        from slipstream.perf.sharding import run_strategy

        if ctx.device == "cuda" and torch.cuda.device_count() < WORLD:
            return {"skipped": f"needs {WORLD} GPUs, this machine has {torch.cuda.device_count()}"}
        strategy, layout, models, _ = LAYOUTS[name]
        model, warmup = models[ctx.mode]
        run_dir = ctx.workdir / name
        overrides = [*model, *layout, f"--data.dir={ctx.data_dir}", "--train.eval_tokens=0",
                     "--logging.progress=false"]
        try:
            summary = run_strategy(strategy, WORLD, overrides, str(run_dir), steps=warmup + n,
                                   memory_breakdown=False)
        except UserError as e:
            raise UserError(f"{name}: {e}") from None
        records = read_metrics(run_dir)
        timed = timed_steps(records, warmup)
        losses = [r["loss"] for r in records if "loss" in r]
        learns = all(math.isfinite(v) for v in losses) and len(losses) > 1 and losses[-1] < losses[0]
        return {"samples": [r["tokens_per_s"] for r in timed],
                "secondary": {"step_time_s": median_of([r.get("step_time_s") for r in timed]),
                              "loss_first": losses[0] if losses else None, "loss_last": summary.get("final_loss")},
                "quality": {"passed": learns, "value": losses[-1] if losses else None,
                            "criterion": "every logged loss finite and the last below the first"}}
    return measure


WORKLOADS = [
    Workload(name=name, title=f"{what}: training tokens/s at world {WORLD}", metric="tokens_per_s", unit="tokens/s",
             higher_is_better=True, normalize_by="compute", samples={"full": 5, "quick": 3, "ci": 2},
             methodology=METHODOLOGY.format(warmup="3 (full) or 2 (quick, ci)"), recipe=_recipe(name),
             measure=_measure(name))
    for name, (_, _, _, what) in LAYOUTS.items()
]
