"""How right is the memory model? Planned peak vs measured peak, on this CPU.

    slipstream bench planner [--out benchmarks/planner-accuracy-cpu.json]

Every case runs two real training steps of slipstream's transformer (AdamW, gradient
clipping, zero_grad(set_to_none), the trainer's order of operations) and measures the
second one with PyTorch's MemTracker (single process) or FSDPMemTracker over a fake
process group of 8 ranks (sharded strategies: one real rank whose collectives are
no-ops, so the tensors each rank holds are real and counted). The planner predicts the
same step from shapes alone. Tests guard the error (tests/unit/test_plan_memory.py).

    slipstream bench planner --device cuda

runs GPT-2 small and medium steps on the GPU instead (one process, bf16): the CUDA
allocator's peak (allocated and reserved) and the step time, against the planner's memory
and time for that GPU (benchmarks/planner-accuracy-<gpu>.json).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import torch

from slipstream.config.presets import PRESETS
from slipstream.config.schema import ModelConfig
from slipstream.plan.memory import estimate_memory
from slipstream.plan.space import PlanModel, Strategy

TARGET_ERROR = 0.10
FAKE_WORLD = 8


@dataclasses.dataclass(frozen=True)
class Case:
    preset: str
    strategy: Strategy
    seq_len: int = 128
    overrides: tuple[tuple[str, Any], ...] = ()

    def model_config(self) -> ModelConfig:
        values = {**PRESETS[self.preset], "preset": self.preset, "vocab_size": 512, **dict(self.overrides)}
        values["max_seq_len"] = max(values["max_seq_len"], self.seq_len)
        return ModelConfig(**values)

    def label(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in self.overrides)
        return f"{self.preset}{'[' + extra + ']' if extra else ''} seq{self.seq_len} {self.strategy.precision} {self.strategy.label()}"


def default_cases() -> list[Case]:
    """The grid: two model families x AC modes x precisions x strategies."""
    cases = []
    wide = (("n_layer", 4), ("d_model", 128), ("n_head", 4))
    for preset, overrides in (("tiny", wide), ("llama-tiny", (("n_layer", 4),)), ("gpt-mini", ())):
        for precision in ("fp32", "bf16"):
            for ac in ("none", "selective", "full"):
                cases.append(Case(preset, Strategy(micro_batch=8, ac=ac, precision=precision), overrides=overrides))
        cases.append(Case(preset, Strategy(micro_batch=4, grad_accum=2, precision="fp32"), overrides=overrides))
        cases.append(Case(preset, Strategy(micro_batch=8, precision="fp32", fused_loss=True, loss_chunk=256),
                          overrides=overrides))
        for dp in ("fsdp", "zero2"):
            for precision in ("fp32", "bf16"):
                cases.append(Case(preset, Strategy(dp_strategy=dp, dp=FAKE_WORLD, micro_batch=8, precision=precision),
                                  overrides=overrides))
        for dp in ("ddp", "zero1"):
            for precision in ("fp32", "bf16"):
                cases.append(Case(preset, Strategy(dp_strategy=dp, dp=FAKE_WORLD, micro_batch=8, precision=precision),
                                  overrides=overrides))
        cases.append(Case(preset, Strategy(dp_strategy="fsdp", dp=FAKE_WORLD, micro_batch=4, grad_accum=2,
                                           ac="full", precision="bf16"), overrides=overrides))
    # A larger world: the shards get smaller, the gathered blocks and activations do not.
    cases.append(Case("gpt-mini", Strategy(dp_strategy="fsdp", dp=16, micro_batch=8, precision="bf16")))
    return cases


# (preset, Strategy fields) of each case of stratified_cases(); each names one case of the grid.
_STRATIFIED = (
    ("tiny", dict(dp_strategy="none", ac="selective", precision="fp32")),
    ("llama-tiny", dict(dp_strategy="none", ac="full", precision="bf16")),
    ("gpt-mini", dict(dp_strategy="none", ac="selective", precision="bf16")),
    ("llama-tiny", dict(dp_strategy="none", grad_accum=2)),
    ("tiny", dict(fused_loss=True)),
    ("tiny", dict(dp_strategy="ddp", precision="fp32")),
    ("llama-tiny", dict(dp_strategy="zero1", precision="bf16")),
    ("llama-tiny", dict(dp_strategy="zero2", precision="bf16")),
    ("llama-tiny", dict(dp_strategy="fsdp", precision="fp32")),
    ("tiny", dict(dp_strategy="fsdp", precision="bf16", grad_accum=1)),
    ("tiny", dict(dp_strategy="fsdp", grad_accum=2)),
    ("gpt-mini", dict(dp=16)),
)


def stratified_cases() -> list[Case]:
    """12 of the grid's cases, measured in seconds instead of a minute: every model family,
    data-parallel strategy, AC mode and precision, accumulation with and without sharding, the
    fused loss and the 16-rank world, among them the grid's largest errors (sharded bf16, the
    16-rank world). `bench planner --cases stratified` and the tests run these."""
    grid = default_cases()
    picked = []
    for preset, fields in _STRATIFIED:
        found = [c for c in grid if c.preset == preset
                 and all(getattr(c.strategy, k) == v for k, v in fields.items())]
        if len(found) != 1:
            raise ValueError(f"stratified case {preset} {fields} matches {len(found)} grid cases, not 1")
        picked.append(found[0])
    return picked


def _train_step(model, optimizer, batch, targets, s: Strategy, fused_loss) -> None:
    from slipstream.models.transformer import lm_loss

    # Low precision is autocast, except on the FSDP family, where it is FSDP mixed precision.
    autocast = torch.autocast(batch.device.type, dtype=torch.bfloat16,
                              enabled=s.precision == "bf16" and s.dp_strategy in ("none", "ddp", "zero1"))
    for micro in range(s.grad_accum):
        x, y = batch[micro], targets[micro]
        with autocast:
            if fused_loss is not None:
                loss = fused_loss(model, x, y)
            else:
                loss = lm_loss(model(x), y)
        (loss / s.grad_accum).backward()


def _optimizer_step(model, optimizer) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    # DDP's gradients are views into its buckets: the trainer zeroes them instead of freeing them.
    optimizer.zero_grad(set_to_none=not hasattr(model, "no_sync"))


@contextlib.contextmanager
def _fake_process_group(world: int) -> Iterator[Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


def measure_case(case: Case) -> int:
    """Measured peak bytes of the second training step (MemTracker / FSDPMemTracker)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from slipstream.models.transformer import build_model
    from slipstream.observe.memprofile import measure_step_memory
    from slipstream.optimize.activations import apply_activation_checkpointing

    s, cfg = case.strategy, case.model_config()
    torch.manual_seed(0)
    batch = torch.randint(0, cfg.vocab_size, (s.grad_accum, s.micro_batch, case.seq_len))
    targets = torch.randint(0, cfg.vocab_size, (s.grad_accum, s.micro_batch, case.seq_len))
    fused = _fused_loss(s.loss_chunk) if s.fused_loss else None

    if s.dp_strategy == "none":
        return int(measure_on_device(case, "cpu", steps=0)["peak_bytes"])
    if s.dp_strategy not in ("ddp", "zero1"):
        return _measure_sharded(case, cfg, batch, targets, fused)
    with _fake_process_group(s.dp):
        model = _ddp_without_traffic(apply_activation_checkpointing(build_model(cfg), s.ac))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True) if s.dp_strategy == "ddp" else \
            ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4, fused=True)
        _train_step(model, optimizer, batch, targets, s, fused)
        _optimizer_step(model, optimizer)
        tracked = optimizer.optim if s.dp_strategy == "zero1" else optimizer  # ZeRO keeps its shard's state inside
        report = measure_step_memory(model, tracked, lambda: _train_step(model, optimizer, batch, targets, s, fused),
                                     lambda: _optimizer_step(model, optimizer), "cpu")
        return report.peak_bytes


def _ddp_without_traffic(model):
    """DDP whose all-reduce is a no-op hook: the fake process group cannot run DDP's own, and
    the memory (gradients as views into the buckets) is DDP's, not the collective's."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)

    def skip_all_reduce(state, bucket):
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    ddp.register_comm_hook(None, skip_all_reduce)
    return ddp


def _measure_sharded(case: Case, cfg: ModelConfig, batch, targets, fused) -> int:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from slipstream.models.transformer import Transformer
    from slipstream.observe.memprofile import _reset_tracker_per_top_level_forward
    from slipstream.optimize.activations import apply_activation_checkpointing

    s = case.strategy
    with _fake_process_group(s.dp) as mesh:
        with torch.device("meta"):
            model = Transformer(cfg)
        apply_activation_checkpointing(model, s.ac)
        reshard = s.dp_strategy != "zero2"
        # Low precision on sharded strategies is FSDP mixed precision, as the trainer runs it.
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if s.precision == "bf16" else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        _train_step(model, optimizer, batch, targets, s, fused)
        _optimizer_step(model, optimizer)
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((batch, targets))
        # Accumulation runs several forwards in one tracked step, which the tracker refuses
        # unless its per-module stats are cleared before each (the peaks are kept).
        with _reset_tracker_per_top_level_forward(tracker), tracker:
            _train_step(model, optimizer, batch, targets, s, fused)
            _optimizer_step(model, optimizer)
        return _peak_total(tracker)


def _fused_loss(chunk: int):
    """The trainer's fused linear + cross-entropy loss (train.fused_loss)."""
    from slipstream.ops.fused_ce import fused_linear_cross_entropy

    def loss(model, x, y):
        hidden = model(x, return_hidden=True)
        return fused_linear_cross_entropy(hidden.view(-1, hidden.shape[-1]), model.lm_head.weight, y.view(-1),
                                          chunk_size=chunk)
    return loss


def _peak_total(tracker) -> int:
    snapshot = tracker.get_tracker_snapshot("peak")
    for device, by_kind in snapshot.items():
        if torch.device(device).type == "cpu":
            return int(by_kind["Total"])
    raise RuntimeError("FSDPMemTracker recorded no CPU memory")


def plan_case(case: Case) -> int:
    model = PlanModel(case.preset, case.model_config())
    return estimate_memory(model, case.strategy, case.seq_len, device="cpu").peak_bytes


def run_accuracy(cases: list[Case] | None = None) -> list[dict[str, Any]]:
    rows = []
    for case in cases or default_cases():
        t0 = time.perf_counter()
        measured = measure_case(case)
        planned = plan_case(case)
        rows.append({"case": case.label(), "measured_bytes": measured, "planned_bytes": planned,
                     "error": (planned - measured) / measured, "seconds": round(time.perf_counter() - t0, 2)})
    return rows


# ---------------------------------------------------------------- on a device (GPU)

def device_cases() -> list[Case]:
    """GPT-2 small and medium at sequence 1024 in bf16: AC modes, micro-batches, fused loss."""
    cases = []
    for preset, micro_batches in (("gpt2", (4, 8, 16)), ("gpt2-medium", (4, 8))):
        for mb in micro_batches:
            for ac in ("none", "selective", "full"):
                cases.append(Case(preset, Strategy(micro_batch=mb, ac=ac, precision="bf16"), seq_len=1024,
                                  overrides=(("vocab_size", 50257),)))
        cases.append(Case(preset, Strategy(micro_batch=8, precision="bf16", fused_loss=True), seq_len=1024,
                          overrides=(("vocab_size", 50257),)))
    return cases


def measure_on_device(case: Case, device: str, steps: int = 8) -> dict[str, float]:
    """One process on `device`: the step peak (MemTracker on CPU, the CUDA allocator on GPUs:
    allocated and reserved) of step 2, and the median time of `steps` steps after it (None for 0)."""
    from slipstream.models.transformer import build_model
    from slipstream.observe.memprofile import measure_step_memory
    from slipstream.optimize.activations import apply_activation_checkpointing

    s, cfg = case.strategy, case.model_config()
    torch.manual_seed(0)
    batch = torch.randint(0, cfg.vocab_size, (s.grad_accum, s.micro_batch, case.seq_len), device=device)
    targets = torch.randint(0, cfg.vocab_size, (s.grad_accum, s.micro_batch, case.seq_len), device=device)
    fused = _fused_loss(s.loss_chunk) if s.fused_loss else None
    model = apply_activation_checkpointing(build_model(cfg, device=device), s.ac)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step() -> None:
        _train_step(model, optimizer, batch, targets, s, fused)
        _optimizer_step(model, optimizer)

    step()
    report = measure_step_memory(model, optimizer, lambda: _train_step(model, optimizer, batch, targets, s, fused),
                                 lambda: _optimizer_step(model, optimizer), device)
    times = []
    target = torch.device(device)
    for _ in range(steps):
        if target.type != "cpu":
            torch.accelerator.synchronize(target)
        t0 = time.perf_counter()
        step()
        if target.type != "cpu":
            torch.accelerator.synchronize(target)  # the GPU runs ahead: time the work, not the launches
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"peak_bytes": report.peak_bytes, "reserved_bytes": report.reserved_peak_bytes,
            "step_s": times[len(times) // 2] if times else None}


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
