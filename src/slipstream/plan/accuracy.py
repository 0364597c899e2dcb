"""How right is the memory model? Planned peak vs measured peak, on this CPU.

    slipstream bench planner [--out benchmarks/planner-accuracy-cpu.json]

Every case runs two real training steps of slipstream's transformer (AdamW, gradient
clipping, zero_grad(set_to_none), the trainer's order of operations) and measures the
second one with PyTorch's MemTracker (single process) or FSDPMemTracker over a fake
process group of 8 ranks (sharded strategies: one real rank whose collectives are
no-ops, so the tensors each rank holds are real and counted). The planner predicts the
same step from shapes alone. Tests guard the error (tests/unit/test_plan_memory.py).

The grid also covers the architecture options (ReLU MLP, parallel block, ALiBi, partial rotary,
embedding norm), materialized attention (SDPA's MATH kernel, which writes out the scores and
keeps the softmax) and pipeline ranks: one pp rank's stage modules (the trainer's split and
initialization) run the forwards and backwards of its micro-batches in the order torch's 1F1B /
GPipe runs them on that rank, with torch's per-micro-batch receive and gradient buffers, on one
process, against the planner's estimate for that rank (the busiest, unless the case names one).
Mixed-precision model states as other stacks keep them (stack_cases): FSDP2 reducing in bf16 and
gathering fp32 under autocast, and one rank of Megatron's distributed optimizer and of DeepSpeed
ZeRO-2, emulated on one process with the buffers each keeps (_measure_stack_emulation).

    slipstream bench planner --device cuda

runs GPT-2 small and medium steps on the GPU instead (one process, bf16): the CUDA
allocator's peak (allocated and reserved) and the step time, against the planner's memory
and time for that GPU (benchmarks/planner-accuracy-<gpu>.json).

The bench's pieces: the cases (plan/accuracy_cases.py: the CPU grid, its stratified subset, the
GPU cases) and the measurement of a case's real step (plan/accuracy_measure.py); this module
runs both next to the planner and reports the errors.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from slipstream.plan.accuracy_cases import Case, default_cases, device_cases
from slipstream.plan.accuracy_measure import measure_case, measure_on_device
from slipstream.plan.memory import estimate_memory, rank_memory
from slipstream.plan.space import PlanModel

TARGET_ERROR = 0.10


def plan_case(case: Case) -> int:
    model = PlanModel(case.preset, case.model_config())
    options = dict(state_dtype=case.state_dtype, compression=case.compression(), stack=case.states())
    if case.strategy.pp > 1:
        return rank_memory(model, case.strategy, case.seq_len, case.rank(), device="cpu", **options).peak_bytes
    return estimate_memory(model, case.strategy, case.seq_len, device="cpu", **options).peak_bytes


def run_accuracy(cases: list[Case] | None = None) -> list[dict[str, Any]]:
    rows = []
    for case in cases or default_cases():
        t0 = time.perf_counter()
        measured = measure_case(case)
        planned = plan_case(case)
        rows.append({"case": case.label(), "measured_bytes": measured, "planned_bytes": planned,
                     "error": (planned - measured) / measured, "seconds": round(time.perf_counter() - t0, 2)})
    return rows


def run_device_accuracy(device: str, gpus: str, cases: list[Case] | None = None) -> list[dict[str, Any]]:
    """Planned vs measured memory and step time per case; `gpus` names the cluster to plan
    for (e.g. "1xH200", or "1xcpu" on a CPU)."""
    from slipstream.observe.peaks import this_cpu
    from slipstream.plan.hardware import make_cluster
    from slipstream.plan.space import Workload
    from slipstream.plan.timing import estimate_time

    cluster = make_cluster(gpus, cpu=this_cpu())
    rows = []
    for case in cases or device_cases():
        model = PlanModel(case.preset, case.model_config())
        work = Workload(case.seq_len, case.strategy.micro_batch * case.strategy.grad_accum)
        memory = estimate_memory(model, case.strategy, case.seq_len, device=torch.device(device).type)
        time_estimate = estimate_time(model, case.strategy, work, cluster)
        try:
            measured = measure_on_device(case, device)
        except torch.OutOfMemoryError:
            measured = None  # the exception's frames hold the tensors: free them outside this block
        if measured is None:
            torch.cuda.empty_cache()
            rows.append({"case": case.label(), "planned_bytes": memory.peak_bytes, "planned_total_bytes":
                         memory.total_bytes, "fits_planned": memory.total_bytes <= cluster.memory_bytes,
                         "measured": "out of memory"})
            continue
        rows.append({"case": case.label(), "measured_bytes": measured["peak_bytes"],
                     "measured_reserved_bytes": measured["reserved_bytes"], "planned_bytes": memory.peak_bytes,
                     "planned_total_bytes": memory.total_bytes,
                     "error": memory.peak_bytes / measured["peak_bytes"] - 1,
                     "measured_step_s": measured["step_s"], "planned_step_s": time_estimate.step_s,
                     "step_error": time_estimate.step_s / measured["step_s"] - 1})
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def device_step_errors(path: str, gpus: str) -> list[dict[str, Any]]:
    """The committed step times of a `bench planner --device cuda` file (e.g.
    benchmarks/gpu-planner.json) against the planner's current step time for them on `gpus`
    (e.g. "1xH200"): per measured case, measured_step_s, planned_step_s and step_error
    (planned / measured - 1). Needs no GPU: the plan is pure math, the measurement is the file's."""
    import json

    from slipstream.plan.hardware import make_cluster
    from slipstream.plan.space import Workload
    from slipstream.plan.timing import estimate_time

    with open(path) as f:
        measured = {row["case"]: row["measured_step_s"] for row in json.load(f)["cases"] if row.get("measured_step_s")}
    cluster = make_cluster(gpus)
    rows = []
    for case in device_cases():
        if case.label() not in measured:
            continue
        s = case.strategy
        planned = estimate_time(PlanModel(case.preset, case.model_config()), s,
                                Workload(case.seq_len, s.micro_batch * s.grad_accum), cluster).step_s
        rows.append({"case": case.label(), "measured_step_s": measured[case.label()], "planned_step_s": planned,
                     "step_error": planned / measured[case.label()] - 1})
    return rows
