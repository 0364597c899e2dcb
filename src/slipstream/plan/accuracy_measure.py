"""The real training steps of the planner accuracy bench (plan/accuracy.py): a case's second step
measured on this CPU with PyTorch's MemTracker (one process), FSDPMemTracker over a fake process
group (sharded strategies), an emulation of Megatron's or DeepSpeed's mixed-precision states, or
one pipeline rank's stage modules in torch's schedule order; measure_on_device runs one process
on a GPU (the CUDA allocator's peak and the step time). Apart from the cases
(plan/accuracy_cases.py) because this is the part that runs the trainer's pieces (models,
optimize, distributed, observe): a tool, above the estimators.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from slipstream.config.schema import ModelConfig
from slipstream.plan.accuracy_cases import COMPRESSION_FIELDS, Case
from slipstream.plan.space import Strategy

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
    if (case.state_dtype, case.qat, case.sparsity) != tuple(COMPRESSION_FIELDS.values()):
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
    from slipstream.observe.memprofile import reset_tracker_per_top_level_forward
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
        with reset_tracker_per_top_level_forward(tracker), tracker:
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
