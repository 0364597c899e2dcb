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
from slipstream.plan.memory import estimate_memory, rank_memory
from slipstream.plan.memory_activations import Compression
from slipstream.plan.memory_states import StackStates
from slipstream.plan.space import PlanModel, Strategy

TARGET_ERROR = 0.10
FAKE_WORLD = 8


@dataclasses.dataclass(frozen=True)
class Case:
    preset: str
    strategy: Strategy
    seq_len: int = 128
    overrides: tuple[tuple[str, Any], ...] = ()
    pp_rank: int | None = None   # pipelines: the pp rank measured (None: the one the planner finds busiest)
    state_dtype: str = "fp32"    # optim.state_dtype: int8 / int4 run torchao's low-bit AdamW
    qat: str = "none"            # quant.qat: the blocks' linears fake-quantized (torchao QAT, optimize/qat.py)
    sparsity: str = "none"       # sparsity.method: masks on the blocks' linears (optimize/sparsity.py)
    # The stack keeping the model states (plan.memory_states.StackStates): torch (slipstream's trainer;
    # reduce_dtype: FSDP2's MixedPrecisionPolicy.reduce_dtype under bf16), or megatron / deepspeed,
    # measured on an emulation of their mixed-precision states (_measure_stack_emulation), with
    # DeepSpeed's reduce bucket of bucket_mb MiB.
    stack: str = "torch"
    reduce_dtype: str = "fp32"
    bucket_mb: float | None = None

    def compression(self) -> Compression:
        return Compression(qat=self.qat, sparsity=self.sparsity)

    def states(self) -> StackStates:
        return StackStates(self.stack, reduce_dtype=self.reduce_dtype, bucket_mb=self.bucket_mb)

    def model_config(self) -> ModelConfig:
        values = {**PRESETS[self.preset], "preset": self.preset, "vocab_size": 512, **dict(self.overrides)}
        values["max_seq_len"] = max(values["max_seq_len"], self.seq_len)
        return ModelConfig(**values)

    def rank(self) -> int:
        """The pp rank measured and planned (0 without a pipeline)."""
        if self.strategy.pp == 1:
            return 0
        if self.pp_rank is not None:
            return self.pp_rank
        model = PlanModel(self.preset, self.model_config())
        return estimate_memory(model, self.strategy, self.seq_len, device="cpu").peak_rank

    def label(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in self.overrides)
        attention = f" {self.strategy.attention}" if self.strategy.attention != "flash" else ""
        rank = f" rank {self.rank()}" if self.strategy.pp > 1 else ""
        compress = "".join(f" {name} {value}" for name, value, plain in (
            ("state", self.state_dtype, "fp32"), ("qat", self.qat, "none"), ("sparsity", self.sparsity, "none"))
            if value != plain)
        gathers = " fp32-gathers" if self.strategy.dp_strategy in _FSDP and not self.strategy.fsdp_mixed else ""
        stack = "".join(f" {name} {value}" for name, value, plain in (
            ("stack", self.stack, "torch"), ("reduce", self.reduce_dtype, "fp32"), ("bucket-mb", self.bucket_mb, None))
            if value != plain)
        return (f"{self.preset}{'[' + extra + ']' if extra else ''} seq{self.seq_len} {self.strategy.precision} "
                f"{self.strategy.label()}{attention}{rank}{compress}{gathers}{stack}")


_FSDP = ("zero2", "fsdp", "hsdp")   # slipstream runs these as FSDP2


# The grid's model families: a preset and its overrides (the GPT-2 style one widened).
FAMILIES = {"tiny": (("n_layer", 4), ("d_model", 128), ("n_head", 4)), "llama-tiny": (("n_layer", 4),),
            "gpt-mini": ()}


def _family(preset: str, **options: Any) -> tuple[tuple[str, Any], ...]:
    """A family's overrides with `options` on top (replacing a family value of the same name)."""
    base = [(k, v) for k, v in FAMILIES[preset] if k not in options]
    return tuple(base) + tuple(options.items())


def _options(case: Case) -> dict[str, Any]:
    """A case's model options beyond its family's."""
    return {k: v for k, v in case.overrides if (k, v) not in FAMILIES[case.preset]}


def default_cases() -> list[Case]:
    """The grid: three model families x AC modes x precisions x strategies, then the architecture
    options, materialized attention and pipeline ranks (architecture_cases, pipeline_cases)."""
    cases = []
    for preset, overrides in FAMILIES.items():
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
    return cases + architecture_cases() + pipeline_cases() + compression_cases() + stack_cases()


def architecture_cases() -> list[Case]:
    """One process, each model option on a family that lacks it (fp32, and bf16 where autocast
    changes what is kept), two published architectures' combinations, and materialized attention."""
    cases = []
    for preset, options in (("tiny", dict(mlp="relu")), ("tiny", dict(parallel_block=True)),
                            ("tiny", dict(position="alibi")), ("llama-tiny", dict(rotary_fraction=0.25)),
                            ("tiny", dict(embedding_norm=True)), ("llama-tiny", dict(embedding_norm=True))):
        for precision in ("fp32", "bf16"):
            cases.append(Case(preset, Strategy(micro_batch=8, precision=precision), overrides=_family(preset, **options)))
    # BLOOM (ALiBi, embedding norm, GELU) and GPT-NeoX / Pythia (parallel block, partial rotary)
    cases.append(Case("tiny", Strategy(micro_batch=8, precision="bf16", ac="selective"),
                      overrides=_family("tiny", position="alibi", embedding_norm=True)))
    cases.append(Case("llama-tiny", Strategy(micro_batch=8, precision="bf16"),
                      overrides=_family("llama-tiny", parallel_block=True, rotary_fraction=0.25, mlp="gelu",
                                        norm="layernorm")))
    # Materialized scores (the MATH kernel; on a CPU it computes a bf16 run's attention in fp32,
    # which no GPU stack does, so fp32 only): MHA, and GQA (k, v repeated to every head), full AC
    for preset, ac in (("tiny", "none"), ("tiny", "full"), ("llama-tiny", "none")):
        cases.append(Case(preset, Strategy(micro_batch=8, precision="fp32", ac=ac, attention="materialized"),
                          overrides=FAMILIES[preset]))
    return cases


def pipeline_cases() -> list[Case]:
    """Pipeline ranks on one process: 1F1B's busiest rank (the first: the embedding and the most
    micro-batches in flight) and its last (head and loss, one in flight), bf16, an uneven split
    of 6 blocks over 4 ranks, a pinned split (parallel.pp_layers) and GPipe (every micro-batch in
    flight)."""
    def piped(**fields) -> Strategy:
        return Strategy(**{"pp": 2, "pp_schedule": "1f1b", "micro_batch": 2, "grad_accum": 4, "precision": "fp32",
                           **fields})

    return [Case("tiny", piped(), overrides=FAMILIES["tiny"]),
            Case("tiny", piped(), overrides=FAMILIES["tiny"], pp_rank=1),
            Case("llama-tiny", piped(precision="bf16"), overrides=FAMILIES["llama-tiny"]),
            Case("llama-tiny", piped(pp=4, ac="full"), overrides=_family("llama-tiny", n_layer=6)),
            Case("tiny", piped(pp_layers=(1, 3)), overrides=FAMILIES["tiny"]),
            Case("tiny", piped(pp_schedule="gpipe"), overrides=FAMILIES["tiny"], pp_rank=1)]


def compression_cases() -> list[Case]:
    """One process on the tiny family: torchao's low-bit AdamW states (int8, int4), QAT's two
    schemes (fp32 and bf16 autocast) and magnitude pruning's masks."""
    def tiny(precision: str = "fp32", **compression) -> Case:
        return Case("tiny", Strategy(micro_batch=8, precision=precision), overrides=FAMILIES["tiny"], **compression)

    return [tiny(state_dtype="int8"), tiny(state_dtype="int4"),
            *(tiny(precision, qat=scheme) for scheme in ("int8-dynact-int4-weight", "int8-weight")
              for precision in ("fp32", "bf16")),
            tiny(sparsity="magnitude")]


def stack_cases() -> list[Case]:
    """Mixed-precision model states as each stack keeps them, on the fake 8-rank world: FSDP2's
    MixedPrecisionPolicy with reduce_dtype bf16 and fp32 gathers under autocast (fsdp_mixed off),
    and emulations of Megatron's distributed optimizer (bf16 weights, an fp32 gradient buffer, the
    fp32 master copy and moments sharded) and of DeepSpeed ZeRO-2 (bf16 weights, a sharded bf16
    gradient partition, its reduce bucket, the fp32 master copy and moments sharded)."""
    def sharded(preset: str, dp_strategy: str, **fields) -> Case:
        case_fields = {k: fields.pop(k) for k in ("stack", "reduce_dtype", "bucket_mb") if k in fields}
        return Case(preset, Strategy(dp_strategy=dp_strategy, dp=FAKE_WORLD, micro_batch=8, precision="bf16", **fields),
                    overrides=FAMILIES[preset], **case_fields)

    return [sharded("tiny", "fsdp", reduce_dtype="bf16"),
            sharded("llama-tiny", "zero2", reduce_dtype="bf16"),
            sharded("tiny", "fsdp", fsdp_mixed=False),
            sharded("tiny", "zero1", stack="megatron"),
            sharded("llama-tiny", "zero1", stack="megatron", ac="full"),
            sharded("tiny", "zero2", stack="deepspeed", bucket_mb=2.0),
            sharded("llama-tiny", "zero2", stack="deepspeed", bucket_mb=2.0, grad_accum=2)]


# (preset, Strategy fields[, model options beyond the family's]) of each case of stratified_cases();
# each names one case of the grid (a field left out: a single process, flash attention, no options).
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
    ("llama-tiny", dict(precision="bf16"), dict(parallel_block=True, rotary_fraction=0.25, mlp="gelu", norm="layernorm")),
    ("tiny", dict(attention="materialized", ac="none")),
    ("tiny", dict(pp=2, pp_schedule="1f1b", pp_layers=())),
    ("tiny", dict(precision="bf16", qat="int8-dynact-int4-weight")),
    ("tiny", dict(state_dtype="int4")),
    ("tiny", dict(dp_strategy="zero1", precision="bf16", stack="megatron")),
    ("tiny", dict(dp_strategy="zero2", precision="bf16", stack="deepspeed")),
    ("tiny", dict(dp_strategy="fsdp", precision="bf16", reduce_dtype="bf16")),
    ("tiny", dict(dp_strategy="fsdp", precision="bf16", fsdp_mixed=False)),   # the grid's worst (+7.7 %)
)
# Fields of a Case (not of its Strategy) an entry of _STRATIFIED may name, with their plain values.
_COMPRESSION_FIELDS = {"state_dtype": "fp32", "qat": "none", "sparsity": "none"}
_CASE_FIELDS = {**_COMPRESSION_FIELDS, "stack": "torch", "reduce_dtype": "fp32"}


def stratified_cases() -> list[Case]:
    """21 of the grid's cases, measured in seconds instead of minutes: every model family,
    data-parallel strategy, AC mode and precision, accumulation with and without sharding, the
    fused loss and the 16-rank world, among them the grid's largest errors (sharded bf16, the
    16-rank world); an architecture combination, materialized attention, a pipeline's busiest
    rank, QAT, low-bit optimizer states, and the stacks' mixed-precision states (Megatron's
    distributed optimizer, DeepSpeed ZeRO-2, FSDP2 reducing in bf16 or gathering fp32). `bench planner --cases
    stratified` and the tests run these."""
    grid = default_cases()
    picked = []
    for preset, fields, *options in _STRATIFIED:
        compression = {k: fields.get(k, plain) for k, plain in _CASE_FIELDS.items()}
        wanted = {"pp": 1, "attention": "flash", "fsdp_mixed": True,
                  **{k: v for k, v in fields.items() if k not in compression}}
        found = [c for c in grid if c.preset == preset and c.pp_rank is None
                 and all(getattr(c.strategy, k) == v for k, v in wanted.items())
                 and all(getattr(c, k) == v for k, v in compression.items())
                 and _options(c) == (options[0] if options else {})]
        if len(found) != 1:
            raise ValueError(f"stratified case {preset} {fields} matches {len(found)} grid cases, not 1")
        picked.append(found[0])
    return picked


def _train_step(model, optimizer, batch, targets, s: Strategy, fused_loss) -> None:
    from slipstream.models.transformer import lm_loss

    # Low precision is autocast, except on the FSDP family, where it is FSDP mixed precision (unless
    # fsdp_mixed is off: fp32 gathers under autocast); a 16-bit model (the stack emulation) needs none.
    sixteen_bit = next(model.parameters()).dtype == torch.bfloat16
    autocast = torch.autocast(batch.device.type, dtype=torch.bfloat16,
                              enabled=s.precision == "bf16" and not sixteen_bit
                              and (s.dp_strategy in ("none", "ddp", "zero1") or not s.fsdp_mixed))
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


def measure_case(case: Case, threads: int | None = None) -> int:
    """Measured peak bytes of the second training step (MemTracker / FSDPMemTracker). threads:
    torch's intra-op threads for the measurement, then restored (bytes are counted, not timed:
    one thread is as exact, and other work on a small machine does not stall it as it does two)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with _attention_kernel(case.strategy):
            if case.strategy.pp > 1:
                return _measure_pipeline_rank(case)
            return _measure_one(case)
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _attention_kernel(s: Strategy) -> Iterator[None]:
    """Materialized attention runs as SDPA's MATH kernel (QK^T written out, the softmax kept);
    flash and efficient as the fused kernel SDPA picks."""
    if s.attention != "materialized":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield


def _measure_one(case: Case) -> int:
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
    if (case.state_dtype, case.qat, case.sparsity) != tuple(_COMPRESSION_FIELDS.values()):
        raise ValueError("the accuracy grid runs low-bit states, QAT and sparsity on one process only")
    if case.states().keeps_16bit_model(s):
        return _measure_stack_emulation(case, cfg, batch, targets, fused)
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
        # Low precision on sharded strategies is FSDP mixed precision, as the trainer runs it
        # (fsdp_mixed off: fp32 gathers, autocast in _train_step), reducing in the case's reduce dtype.
        reduce_dtype = torch.bfloat16 if case.reduce_dtype == "bf16" else torch.float32
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype) \
            if s.precision == "bf16" and s.fsdp_mixed else MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
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


def _measure_stack_emulation(case: Case, cfg: ModelConfig, batch, targets, fused) -> int:
    """Measured peak bytes of the second step of one data-parallel rank of Megatron's distributed
    optimizer (stack megatron, zero1 / zero2) or DeepSpeed ZeRO-2 (stack deepspeed, zero2) in bf16,
    emulated on one process: the ranks' collectives move no memory of their own (the gradient
    reduce-scatter is a copy into this rank's slice, the parameter all-gather a copy out of its
    master shard). What each keeps, as plan.memory_states.state_buffers describes it:
      the model itself in bf16 (Float16Module / the engine's bfloat16()), no autocast;
      megatron   an fp32 gradient buffer of every parameter (main_grad; each bf16 .grad is added
                 into it and freed, as Megatron's grad-accumulation hooks do); the optimizer's fp32
                 master shard (1 / dp of the flattened parameters) takes its gradient as a view of
                 the buffer's slice (bf16 params: "the distributed optimizer's fp32 main grads are
                 the same as the model's fp32 grads");
      deepspeed  a bf16 reduce bucket of bucket_mb MiB allocated for each backward (backward():
                 ipg_buffer), each .grad copied into it and its shard's slice into a kept bf16
                 gradient partition (1 / dp), then freed; step converts the partition to fp32.
    The fp32 master shard steps with fused AdamW, clipped by the norm of its gradient."""
    import torch.nn as nn

    from slipstream.models.transformer import build_model
    from slipstream.observe.memprofile import measure_step_memory
    from slipstream.optimize.activations import apply_activation_checkpointing

    s, stack = case.strategy, case.stack
    model = apply_activation_checkpointing(build_model(cfg).to(torch.bfloat16), s.ac)
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    shard = total // s.state_shard_group           # this rank's slice: the first 1 / dp of the flattened parameters
    holder = nn.Module()   # the model and the stack's buffers: MemTracker counts them from the start
    holder.model = model
    flat = torch.cat([p.detach().reshape(-1)[: max(0, shard - o)] for p, o in zip(params, _offsets(params))])
    holder.master = nn.Parameter(flat.float())
    del flat
    if stack == "megatron":
        holder.register_buffer("grad_buffer", torch.zeros(total, dtype=torch.float32))
    else:
        holder.register_buffer("partition", torch.zeros(shard, dtype=torch.bfloat16))
    bucket_elements = int((case.bucket_mb or 0) * 2**20 // 2)
    state = {"bucket": None, "filled": 0}

    def reduce_hook(p: torch.Tensor, offset: int) -> None:
        grad = p.grad.reshape(-1)
        if stack == "megatron":
            holder.grad_buffer[offset: offset + grad.numel()].add_(grad)
        else:
            bucket = state["bucket"]
            n = min(grad.numel(), bucket.numel())
            bucket[:n].copy_(grad[:n])                      # the reduce-scatter's input
            mine = max(0, min(grad.numel(), shard - offset))
            if mine:
                holder.partition[offset: offset + mine].add_(bucket[:mine])
        p.grad = None

    for p, offset in zip(params, _offsets(params)):
        p.register_post_accumulate_grad_hook(lambda p, offset=offset: reduce_hook(p, offset))
    optimizer = torch.optim.AdamW([holder.master], lr=1e-4, fused=True)

    def forward_backward() -> None:
        if stack == "deepspeed":
            state["bucket"] = torch.empty(bucket_elements, dtype=torch.bfloat16)
        _train_step(model, optimizer, batch, targets, s, fused)
        state["bucket"] = None

    def optimizer_step() -> None:
        if stack == "megatron":
            holder.master.grad = holder.grad_buffer[:shard]
        else:
            holder.master.grad = holder.partition.float()
        torch.nn.utils.clip_grad_norm_([holder.master], 1.0)
        optimizer.step()
        holder.master.grad = None
        with torch.no_grad():   # the all-gather: this rank's slice of the bf16 weights from its master shard
            for p, offset in zip(params, _offsets(params)):
                mine = max(0, min(p.numel(), shard - offset))
                if mine:
                    p.view(-1)[:mine].copy_(holder.master[offset: offset + mine])
        (holder.grad_buffer if stack == "megatron" else holder.partition).zero_()

    forward_backward()
    optimizer_step()
    return int(measure_step_memory(holder, optimizer, forward_backward, optimizer_step, "cpu").peak_bytes)


def _offsets(params: list[torch.Tensor]) -> list[int]:
    """Each parameter's offset in the flattened parameters."""
    offsets, at = [], 0
    for p in params:
        offsets.append(at)
        at += p.numel()
    return offsets


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
    options = dict(state_dtype=case.state_dtype, compression=case.compression(), stack=case.states())
    if case.strategy.pp > 1:
        return rank_memory(model, case.strategy, case.seq_len, case.rank(), device="cpu", **options).peak_bytes
    return estimate_memory(model, case.strategy, case.seq_len, device="cpu", **options).peak_bytes


# ---------------------------------------------------------------- one pipeline rank

def _rank_order(s: Strategy, rank: int) -> list[tuple[str, int]]:
    """The forwards ("F", micro-batch) and backwards ("B", micro-batch) of pipeline rank `rank`
    in the order torch runs them: Schedule1F1B warms up with min(m, pp - rank) forwards, then
    alternates a backward and a forward, then the remaining backwards; ScheduleGPipe runs every
    forward, then every backward."""
    m = s.grad_accum
    if s.pp_schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if s.pp_schedule != "1f1b":
        raise ValueError(f"the accuracy grid runs 1f1b and gpipe pipeline ranks, not {s.pp_schedule}")
    warmup = min(m, s.pp - rank)
    order = [("F", i) for i in range(warmup)]
    for i in range(m):
        order.append(("B", i))
        if warmup + i < m:
            order.append(("F", warmup + i))
    return order


def _measure_pipeline_rank(case: Case) -> int:
    """Measured peak bytes of pipeline rank case.rank()'s second step, on one process: its stage
    modules as the trainer builds them (plan.stages' split, distributed.pipeline_stages), torch's
    per-micro-batch receive buffers (a later stage's inputs, leaves that take their gradient) and
    gradient buffers (a stage that sends its output on), each micro-batch's output held until its
    backward (torch's fwd_cache), the loss of each micro-batch / m on the last stage, under one
    autocast context for the whole step (as the trainer's pipeline_step), then clip and AdamW."""
    import torch.nn as nn

    from slipstream.distributed.pipeline_stages import build_stage_modules
    from slipstream.models.transformer import lm_loss
    from slipstream.observe.memprofile import measure_step_memory
    from slipstream.optimize.activations import apply_activation_checkpointing
    from slipstream.plan.stages import split_layers, stage_costs, stage_indices

    s, cfg, rank = case.strategy, case.model_config(), case.rank()
    if s.dp_strategy != "none" or s.pp_virtual != 1:
        raise ValueError("the accuracy grid runs one-stage pipeline ranks without data parallelism")
    n_stages = s.pp
    splits = split_layers(cfg.n_layer, n_stages, list(s.pp_layers) or None, stage_costs(cfg, case.seq_len))
    (module,) = build_stage_modules(cfg, stage_indices(s.pp_schedule, rank, s.pp, 1), splits)
    apply_activation_checkpointing(module, s.ac)
    first, last = module.is_first, module.is_last
    torch.manual_seed(0)
    m, shape = s.grad_accum, (s.micro_batch, case.seq_len)
    tokens = torch.randint(0, cfg.vocab_size, (m, *shape))
    targets = torch.randint(0, cfg.vocab_size, (m, *shape))

    holder = nn.Module()   # the stage and torch's buffers: MemTracker counts them from the start
    holder.stage = module
    # The residual stream crosses the stage boundary: fp32 under autocast.
    for i in range(m):
        if not first:
            holder.register_buffer(f"recv{i}", (torch.randn(*shape, cfg.d_model) * 0.02).requires_grad_())
        if not last:
            holder.register_buffer(f"grad{i}", torch.randn(*shape, cfg.d_model) * 0.02)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.precision == "bf16")

    def forward_backward() -> None:
        held: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        losses: dict[int, torch.Tensor] = {}
        with autocast:
            for kind, i in _rank_order(s, rank):
                if kind == "F":
                    inputs = tokens[i] if first else getattr(holder, f"recv{i}")
                    output = module(inputs)
                    held[i] = (output, None if first else inputs)
                    if last:
                        losses[i] = lm_loss(output, targets[i]) / m
                    continue
                output, inputs = held.pop(i)
                if last:
                    losses.pop(i).backward()
                else:
                    output.backward(getattr(holder, f"grad{i}"))
                del output
                if inputs is not None:
                    inputs.grad = None   # torch sends it and lets it go (stage_backward)

    def optimizer_step() -> None:
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    forward_backward()
    optimizer_step()
    return int(measure_step_memory(holder, optimizer, forward_backward, optimizer_step, "cpu").peak_bytes)


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
    model = apply_activation_checkpointing(_compressed(build_model(cfg, device=device), case), s.ac)
    if case.state_dtype in ("int8", "int4"):
        from slipstream.optimize.optimizers import low_bit_adamw

        # eager (for-loop): the compiled update would compile per parameter shape for minutes on a CPU
        optimizer = low_bit_adamw(model.parameters(), case.state_dtype, lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=0.0, implementation="for-loop")
    else:
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


def _compressed(model, case: Case):
    """`model` with the case's QAT (torchao's fake-quantized linears) and sparsity masks, in the
    trainer's order (distributed/parallelize.py: QAT, then the masks, then AC); the masks at 50 %
    (their bytes do not depend on the fraction)."""
    if case.qat != "none":
        from slipstream.config.schema import QuantConfig
        from slipstream.optimize.qat import apply_qat

        apply_qat(model, QuantConfig(qat=case.qat))
    if case.sparsity != "none":
        from slipstream.config.schema import SparsityConfig
        from slipstream.optimize.sparsity import apply_sparsity, compute_masks

        config = SparsityConfig(method=case.sparsity, target=0.5)
        apply_sparsity(model, config)
        compute_masks(model, config, config.target)
    return model


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
