"""Peak memory per GPU of one training step, predicted from shapes alone (docs/planner.md).

The step is walked phase by phase, as it runs:

    forward   parameters + optimizer state (+ gradients when they persist) + the activations
              saved so far + the loss's logits
    backward  layer by layer from the top: saved activations are freed as gradients appear,
              plus the backward temporaries of the layer being differentiated
    optimizer parameters + gradients + optimizer state

and the peak is the highest point of that walk. Every byte is counted from the same
shapes the model code uses (param counts come from models.flops, the one source of
truth), by category: parameters, gradients, optimizer_state, activations, temporaries.

What a step holds comes from two modules of its own: plan/memory_activations.py, the bytes a
block saves for backward (and what the compression switches change in them), and
plan/memory_states.py, the model states (parameters, gradients, optimizer state) as each
training stack keeps them, with torchao's low-bit optimizer states. This module walks the step
with them, rank by rank.

Pipeline ranks (plan/stages.rank_parts, the trainer's split in whole blocks): every rank is
planned with its own blocks, the first stage's rank with the embedding, the last's with the head
and the loss, the micro-batches it keeps in flight under its schedule (in_flight_microbatches,
per rank), and torch's pipelining buffers: each stage that receives keeps one input buffer per
micro-batch, each stage that sends back gradients one gradient buffer per micro-batch, for the
whole step (torch.distributed.pipelining.stage: _setup_forward_recv_info, _create_grad_recv_info);
a stage's output is held until its backward (fwd_cache). The plan is the busiest rank's
(MemoryEstimate.peak_rank).

Mixture of experts (plan/experts.py): an MoE block's parameters are the router and the shared
experts whole on every tp rank, E / ep routed experts, sharded over the dp / ep ranks holding the
same experts (Strategy.expert_shard_group); what it saves: plan/memory_activations.py.

Soft-capped logits (model.logit_softcap) keep their tanh for backward: tokens x vocabulary in the
compute dtype, alive until the loss's gradient has passed it; the fused loss instead holds one more
chunk of fp32 logits in its backward (the cap's derivative).

fp16 runs as bf16 does (autocast, or FSDP mixed precision with a sharded grad scaler): the same
bytes; a grad scaler keeps a scale and an inf flag per device, nothing per parameter.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from slipstream.models.flops import param_count
from slipstream.plan.experts import experts_of
from slipstream.plan.memory_activations import (NO_COMPRESSION, Compression, attention_scores_bytes,
                                                block_activation_bytes, block_backward_transient_bytes,
                                                forward_saved_bytes, qat_activation_bytes, qat_weight_bytes,
                                                sparsity_masked_values, strategy_dtypes)
from slipstream.plan.memory_states import (LOW_BIT_FORMATS, LOW_BIT_MIN_NUMEL, TORCH_STATES, StackStates,
                                           low_bit_optimizer_bytes, model_state_bytes, muon_matrix_params,
                                           stack_reduce_bucket_bytes, state_buffers)
from slipstream.plan.space import PlanModel, Strategy
from slipstream.plan.stages import RankPart, rank_parts, stage_costs

GIB = 2**30
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
# CUDA's caching allocator rounds blocks and keeps freed blocks for reuse: the reserved
# bytes run above the allocated ones. A margin on the device total, not on CPU (MemTracker
# and the CPU allocator count tensor bytes only).
CUDA_FRAGMENTATION = 0.08


@dataclass
class MemoryEstimate:
    """Predicted peak bytes per GPU, with the breakdown at the peak."""

    peak_bytes: int
    peak_phase: str
    breakdown: dict[str, int]
    fragmentation_bytes: int = 0
    host_bytes: int = 0          # offloaded state in host memory, per GPU
    notes: list[str] = field(default_factory=list)
    peak_rank: int | None = None   # a pipeline's busiest pp rank (the one planned here); None without one
    # The model-state buffers by name (state_buffers: "weights (bf16)", "master weights (fp32)", ...,
    # and DeepSpeed's "reduce buckets (16-bit)"), bytes per GPU; they make up parameters, gradients,
    # optimizer_state (and the buckets part of backward's temporaries).
    buffers: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return self.peak_bytes + self.fragmentation_bytes

    def to_record(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "total_bytes": self.total_bytes, "peak_phase": self.peak_phase,
                "fragmentation_bytes": self.fragmentation_bytes, "host_bytes": self.host_bytes,
                "breakdown": dict(self.breakdown), "notes": list(self.notes), "peak_rank": self.peak_rank,
                "buffers": dict(self.buffers)}


def _qat_note(scheme: str) -> str:
    return ("int8 per-token fake-quantized inputs and int4 grouped fake-quantized weights of every block linear"
            if scheme == "int8-dynact-int4-weight" else "int8 per-channel fake-quantized weights of every block linear")


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


# ---------------------------------------------------------------- pipeline ranks

_PARTS: dict[tuple, list[RankPart]] = {}


def pipeline_parts(model: PlanModel, s: Strategy, seq_len: int) -> list[RankPart]:
    """What each pp rank holds, in whole blocks, as the trainer splits them (plan/stages.rank_parts:
    balanced by training FLOPs, or s.pp_layers); one part holding everything without a pipeline.
    Cached: the split is a dynamic program over the layers, and a search asks for it per layout."""
    cfg = model.cfg
    if s.pp <= 1:
        return [RankPart(0, cfg.n_layer, (0,), (cfg.n_layer,), True, True)]
    key = (cfg.n_layer, stage_costs(cfg, seq_len), s.pp, s.pp_schedule, s.pp_virtual, s.pp_layers)
    if key not in _PARTS:
        _PARTS[key] = rank_parts(cfg, seq_len, s.pp, s.pp_schedule, s.pp_virtual, s.pp_layers or None)
    return _PARTS[key]


def _moe_blocks(model: PlanModel, parts: list[RankPart], part: RankPart) -> int:
    """Blocks with experts among the part's (models.moe.is_moe_layer, counted in closed form)."""
    cfg = model.cfg
    if not model.moe:
        return 0
    sizes = {stage: n for p in parts for stage, n in zip(p.stages, p.layers)}
    starts = [0]
    for stage in range(len(sizes)):
        starts.append(starts[-1] + sizes[stage])
    count = 0
    for stage in part.stages:
        lo, hi = max(starts[stage], cfg.moe_first_dense), starts[stage + 1]
        first = lo + (-(lo - cfg.moe_first_dense)) % cfg.moe_every   # the first MoE index >= lo
        count += (hi - 1 - first) // cfg.moe_every + 1 if first < hi else 0
    return count


def in_flight_microbatches(s: Strategy, rank: int = 0) -> float:
    """Micro-batches whose activations pipeline rank `rank` holds at once, counted in micro-batches
    of all its blocks (a rank of v stages holding c stage-micro-batches holds c / v), as torch's
    schedules order the work (torch.distributed.pipelining.schedules)."""
    if s.pp == 1:
        return 1.0
    m, p, v = s.grad_accum, s.pp, s.pp_virtual
    if s.pp_schedule in ("gpipe", "looped-bfs"):
        return float(m)   # every micro-batch's forward before the first backward
    if s.pp_schedule == "dualpipev":
        return float(min(p + 1, m))   # DeepSeek-V3 report, table 2: PP + 1 (1F1B: PP), every rank
    if s.pp_schedule == "zbv":
        return float(min(p, m))       # Qi et al. 2024: ZB-V's peak is 1F1B's, on every rank
    if s.pp_schedule == "1f1b":
        return float(min(m, p - rank))   # Schedule1F1B: rank r warms up with p - r forwards
    # Interleaved: _get_warmup_ops (rank r: (v - 1) micro-batches per round + 2 per hop to the last
    # rank; zero bubble 1 per hop), then one forward before each backward. Zero bubble defers the
    # weight gradients of its first r backwards (num_1f1b_microbatches = rank): their inputs stay.
    rounds = max(1, m // p)
    per_round = m // rounds
    hops = 2 if s.pp_schedule == "interleaved-1f1b" else 1
    warmup = min((v - 1) * per_round + hops * (p - 1 - rank), m * v)
    chunks = warmup + 1 if warmup < m * v else warmup
    if s.pp_schedule == "interleaved-zero-bubble":
        chunks = min(m * v, chunks + rank)
    return chunks / v


def _head_in_flight(s: Strategy) -> int:
    """Micro-batches whose logits and loss the last stage holds at once: one (its forward is
    followed by its backward), except where every forward runs first."""
    return s.grad_accum if s.pp > 1 and s.pp_schedule in ("gpipe", "looped-bfs") else 1


# ---------------------------------------------------------------- the step

def estimate_memory(model: PlanModel, s: Strategy, seq_len: int, device: str = "cuda",
                    optimizer_state_bytes: int = 4, optimizer: str = "adamw",
                    state_dtype: str = "", compression: Compression = NO_COMPRESSION,
                    stack: StackStates | str = TORCH_STATES) -> MemoryEstimate:
    """Predicted peak memory per GPU of one training step of `model` laid out as `s`.

    seq_len: tokens per sequence; s.micro_batch sequences go through each forward.
    optimizer_state_bytes: bytes per Adam moment (4 fp32, 2 bf16).
    state_dtype: int8 / int4 (optim.state_dtype): torchao's block-quantized moments, counted tensor
    by tensor (low_bit_optimizer_bytes; optimizer_state_bytes is then unused).
    optimizer: adamw, or muon (optim.optimizer): one fp32 momentum buffer per hidden-matrix
    parameter instead of two moments (a traced user module is planned with AdamW's state).
    device: "cuda" adds the allocator's fragmentation margin; "cpu" does not.
    compression: quant.qat and sparsity.method (Compression.of(config)): fake-quantized linears
    planned on, as after quant.qat_start_step (before it the linears run plain and keep less);
    sparsity's masks and masked gradients.
    stack: the training stack that keeps the model states (StackStates, or its name: torch,
    megatron, deepspeed; Cluster.stack): Megatron's and DeepSpeed's mixed precision keep 16-bit
    weights and gradients and a sharded fp32 master copy (state_buffers).
    A pipeline is planned rank by rank (pipeline_parts, rank_memory); the estimate is the
    busiest rank's, with its index in peak_rank.
    """
    states = StackStates(stack) if isinstance(stack, str) else stack
    if model.traced is not None:
        return _traced_memory(model, s, seq_len, device, optimizer_state_bytes, state_dtype, states)
    parts = pipeline_parts(model, s, seq_len)
    if s.pp == 1:
        return _rank_memory(model, s, seq_len, parts[0], _moe_blocks(model, parts, parts[0]), device,
                            optimizer_state_bytes, optimizer, state_dtype, compression, states)
    # A rank that holds the same kind of pieces as another, no more blocks and no more
    # micro-batches in flight cannot be the peak: only the others are planned (a model with
    # experts plans every rank: its blocks differ in kind).
    by_kind: dict[tuple, list[tuple[float, int, RankPart]]] = {}
    for part in parts:
        kind = (len(part.stages), part.embedding, part.head, part.rank if model.moe else 0)
        by_kind.setdefault(kind, []).append((in_flight_microbatches(s, part.rank), part.blocks, part))
    candidates = []
    for ranks in by_kind.values():
        most_blocks = -1
        for in_flight, blocks, part in sorted(ranks, key=lambda c: (-c[0], -c[1], c[2].rank)):
            if blocks > most_blocks:   # more blocks than every rank with as many in flight or more
                candidates.append((part, _moe_blocks(model, parts, part), in_flight))
                most_blocks = blocks
    planned = [(part, _rank_memory(model, s, seq_len, part, n_moe, device, optimizer_state_bytes, optimizer,
                                   state_dtype, compression, states))
               for part, n_moe, _ in sorted(candidates, key=lambda c: c[0].rank)]
    part, chosen = max(planned, key=lambda pe: (pe[1].total_bytes, -pe[0].rank))   # the first of equal peaks
    pieces = " + ".join(["embedding"] * part.embedding + [f"{part.blocks} blocks"] + ["head and loss"] * part.head)
    chosen.notes.append(f"pipeline: rank {part.rank} of {s.pp} is the busiest ({pieces}, "
                        f"{in_flight_microbatches(s, part.rank):g} micro-batches in flight)")
    chosen.peak_rank = part.rank
    return chosen


def rank_memory(model: PlanModel, s: Strategy, seq_len: int, rank: int, device: str = "cuda",
                optimizer_state_bytes: int = 4, optimizer: str = "adamw", state_dtype: str = "",
                compression: Compression = NO_COMPRESSION, stack: StackStates | str = TORCH_STATES) -> MemoryEstimate:
    """The step's peak on pipeline rank `rank` alone (estimate_memory plans the busiest)."""
    parts = pipeline_parts(model, s, seq_len)
    part = parts[rank]
    estimate = _rank_memory(model, s, seq_len, part, _moe_blocks(model, parts, part), device,
                            optimizer_state_bytes, optimizer, state_dtype, compression,
                            StackStates(stack) if isinstance(stack, str) else stack)
    estimate.peak_rank = rank if s.pp > 1 else None
    return estimate


def _rank_memory(model: PlanModel, s: Strategy, seq_len: int, part: RankPart, n_moe: int, device: str,
                 optimizer_state_bytes: int, optimizer: str, state_dtype: str = "",
                 compression: Compression = NO_COMPRESSION, states: StackStates = TORCH_STATES) -> MemoryEstimate:
    """The step's peak on one pipeline rank (without a pipeline: the one GPU's whole model)."""
    # Megatron and DeepSpeed cast the model itself to 16 bits (Float16Module; the engine's half() /
    # bfloat16()): no autocast copies, a 16-bit residual stream, the activations of FSDP mixed
    # precision's compute. `sa` plans the activations with those dtypes; `s` the states and buffers.
    sixteen = states.keeps_16bit_model(s)
    zero_stack = states.zero_optimizer(s)   # the stack's own ZeRO (any precision): not FSDP
    sa = dataclasses.replace(s, dp_strategy="fsdp", fsdp_mixed=True) if sixteen else s
    cfg, dt = model.cfg, strategy_dtypes(sa)
    pc = param_count(cfg)
    ex = experts_of(model)
    shard_grad = s.shards()[1]
    group = s.state_shard_group
    layers, first, last = part.blocks, part.embedding, part.head
    piped = s.pp > 1
    notes: list[str] = []

    # ---- parameters per GPU: this rank's blocks (split by tp, experts by ep) + embedding / head
    block_params = (pc.attn + pc.mlp) / s.tp + pc.norm
    vocab_params = pc.embedding - (cfg.max_seq_len * cfg.d_model if cfg.position == "learned" else 0)
    pos_params = pc.embedding - vocab_params
    head_matmul = vocab_params / s.tp   # the output head's weight (a tied one is the table)
    # A pipeline's head holds its own copy of a tied table (distributed/pipeline_parallel.py).
    head_params = (pc.head or (vocab_params if piped else 0)) / s.tp
    first_stage = vocab_params / s.tp + pos_params + pc.embedding_norm
    last_stage = head_params + pc.final_norm
    edge = first_stage * first + last_stage * last
    stage_blocks, experts = layers * block_params, 0.0
    if ex:
        # Dense blocks split by tp; an MoE block's attention by tp, its router and shared experts
        # whole, its routed experts E / ep. The largest block sizes the FSDP buffers.
        dense_block = (pc.attn + ex.dense_mlp) / s.tp + pc.norm
        expert_block = ex.routed_params / s.ep
        moe_block = pc.attn / s.tp + pc.norm + ex.other_params + expert_block
        stage_blocks = (layers - n_moe) * dense_block + n_moe * moe_block
        experts = n_moe * expert_block
        block_params = moe_block if n_moe == layers else (max(dense_block, moe_block) if n_moe else dense_block)
        notes.append(f"mixture of experts: {n_moe} of this rank's {layers} blocks hold {ex.n // s.ep} of "
                     f"{ex.n} experts each; tokens are planned as spread evenly over the experts")
    local_params = stage_blocks + edge

    def sharded(count: float, is_sharded: bool) -> float:
        return count / group if is_sharded else count

    buffers = state_buffers(local_params, s, states, optimizer_state_bytes)
    if experts and s.ep > 1:
        # The routed experts shard over the dp / ep ranks that hold the same ones (FSDP), or not
        # at all (DDP, ep = dp): per GPU, E / ep experts / (dp / ep) = E / dp under FSDP.
        buffers = state_buffers(local_params - experts, s, states, optimizer_state_bytes)
        expert = state_buffers(experts, s, states, optimizer_state_bytes, shard_group=s.expert_shard_group)
        buffers = {name: (category, nbytes + expert[name][1]) for name, (category, nbytes) in buffers.items()}
    moments = "Adam moments"
    if optimizer == "muon":  # one moment instead of two for the matrices Muon steps
        muon = state_buffers(muon_matrix_params(model, layers, n_moe, s), s, states, optimizer_state_bytes)
        buffers[moments] = ("optimizer_state", buffers[moments][1] - muon[moments][1] / 2)
    if state_dtype in LOW_BIT_FORMATS:
        # config.dims refuses low-bit state with sharding and tp: this rank's whole tensors, one by one.
        buffers[moments] = ("optimizer_state", low_bit_optimizer_bytes(model, part, state_dtype, piped))
        notes.append(f"optimizer state {state_dtype}: torchao's block-quantized moments; tensors under "
                     f"{LOW_BIT_MIN_NUMEL} values (norms, biases) keep fp32 moments")
    param_bytes, grad_bytes, optim_bytes = (sum(nbytes for category, nbytes in buffers.values() if category == wanted)
                                            for wanted in ("parameters", "gradients", "optimizer_state"))
    if zero_stack and not sixteen:
        notes.append(f"{states.stack} ZeRO in fp32: " + ", ".join(buffers) + " (moments sharded over dp)")
    if sixteen:
        notes.append(f"{states.stack} mixed precision: " + ", ".join(buffers)
                     + (" (master copy and moments sharded over dp)" if s.dp_strategy in ("zero1", "zero2") else ""))
    if states.stack == "megatron" and s.dp_strategy == "zero2":
        notes.append("Megatron's distributed optimizer shards no gradients: zero2 planned as its zero1")
    host = 0
    if s.offload:
        host = int(param_bytes + grad_bytes + optim_bytes)
        param_bytes = grad_bytes = optim_bytes = 0
        notes.append("offload: sharded parameters, gradients and optimizer state live in host memory")
    # Sparsity's masks: one bool per pruned value, a buffer of each block (config refuses sharding and tp).
    masked, largest_masked = sparsity_masked_values(model, compression.sparsity)
    if masked:
        param_bytes += layers * masked
        notes.append(f"sparsity {compression.sparsity}: a bool mask per pruned tensor ({_mib(layers * masked)} with "
                     "the parameters); the masked gradient (grad x mask) of the tensor being differentiated")
    if compression.qat != "none":
        notes.append(f"QAT {compression.qat}: {_qat_note(compression.qat)} kept for backward per micro-batch "
                     "(planned after quant.qat_start_step; before it the linears run plain and keep less)")

    # ---- activations of one micro-batch on this GPU
    tokens = s.micro_batch * seq_len // s.cp
    per_block = block_activation_bytes(model, tokens, sa, seq_len=seq_len, compression=compression)
    stage_acts = layers * per_block
    if n_moe:
        moe_acts = block_activation_bytes(model, tokens, sa, moe=True, seq_len=seq_len)
        stage_acts = (layers - n_moe) * per_block + n_moe * moe_acts
    seq_split = s.tp if (s.tp > 1 and s.sequence_parallel) else 1
    final_norm = tokens * cfg.d_model * (dt.residual + (dt.compute if dt.autocast else dt.residual)) // seq_split
    if cfg.norm == "rmsnorm":
        final_norm += tokens * cfg.d_model * 4 // seq_split
    final_norm *= last
    forward_saved = forward_saved_bytes(model, tokens, sa, seq_len, first)
    in_flight = in_flight_microbatches(s, part.rank)
    head_in_flight = _head_in_flight(s)
    one_micro = stage_acts + forward_saved + final_norm
    acts = (stage_acts + forward_saved) * in_flight + final_norm * head_in_flight
    pipe_buffers = 0.0
    if piped:
        # torch's stages: a receiving stage's input is its receive buffer (one per micro-batch,
        # kept all step; the first block's saved input is that buffer), a sending stage keeps its
        # output until the micro-batch's backward, and every stage that gets gradients back has
        # one buffer per micro-batch for them.
        boundary = tokens * cfg.d_model * dt.residual // seq_split
        acts += boundary * (in_flight * first - head_in_flight * last)
        receiving, sending = len(part.stages) - first, len(part.stages) - last
        pipe_buffers = boundary * s.grad_accum * (receiving + sending)

    # Autocast keeps a bf16 copy of each weight a saved matmul needs (blocks without AC).
    weight_copies = 0.0
    if dt.autocast and s.ac == "none":
        matmul_per_block = (pc.active_matmul - vocab_params) / cfg.n_layer / s.tp
        if ex:  # every weight of the rank's blocks: an MoE block casts all of its local experts
            matmul_per_block = stage_blocks / max(layers, 1)
        weight_copies = layers * matmul_per_block * dt.compute + head_matmul * dt.compute * last

    # ---- the loss: logits (tokens x vocab) and their fp32 log-softmax, on the last stage's rank
    v_local = vocab_params // cfg.d_model / s.tp
    loss_fwd = loss_bwd = held_loss = 0.0
    if last and s.fused_loss:
        chunk = min(s.loss_chunk, tokens)
        loss_fwd = chunk * v_local * 4 * 2
        loss_bwd = chunk * v_local * 4 * 2 + tokens * cfg.d_model * 4
        notes.append("fused loss: logits exist one chunk at a time")
        if cfg.logit_softcap > 0:  # the forward caps each chunk in place; the backward holds the cap's derivative
            loss_bwd += chunk * v_local * 4
    elif last:
        low_logits = tokens * v_local * dt.compute if dt.compute != 4 else 0   # before the fp32 upcast
        loss_fwd = low_logits + 2 * tokens * v_local * 4     # fp32 logits and their log-softmax
        # backward of the log-softmax: its saved output, the incoming gradient and the outgoing
        # one (the low-precision logits are gone by then; their gradient comes after these go)
        loss_bwd = 3 * tokens * v_local * 4
        if cfg.logit_softcap > 0:  # the tanh of the logits, saved until the loss's gradient has passed the cap
            loss_fwd += tokens * v_local * dt.compute
            loss_bwd += tokens * v_local * dt.compute
        if piped:
            # The last stage holds its output, the logits, until the micro-batch's backward, and
            # the other micro-batches in flight keep their log-softmax (and the cap's tanh).
            loss_bwd += tokens * v_local * dt.compute
            held_loss = tokens * v_local * (dt.compute + 4 + (dt.compute if cfg.logit_softcap > 0 else 0))
            acts += held_loss * (head_in_flight - 1)

    # Materialized attention: the top block's scores exist next to their softmax in the forward.
    scores_fwd = attention_scores_bytes(model, tokens, sa, seq_len) if s.attention == "materialized" and layers else 0

    # ---- gathered parameters and communication buffers
    gather_unit = block_params * dt.gathered
    mean_gather_unit = stage_blocks / max(layers, 1) * dt.gathered if n_moe else gather_unit   # per block of the rank
    # zero2 keeps the gathered parameters from forward to backward; so does FSDP under a
    # pipeline (as torchtitan runs it), or every micro-batch would gather them again.
    # (slipstream's zero2 runs as FSDP2; Megatron's and DeepSpeed's keep the 16-bit weights whole.)
    fsdp_run = s.dp_strategy in ("fsdp", "hsdp") or (s.dp_strategy == "zero2" and not zero_stack)
    keeps_gathered = (s.dp_strategy == "zero2" and not zero_stack) or (piped and s.dp_strategy in ("fsdp", "hsdp"))
    comm = pipe_buffers
    if s.dp_strategy in ("fsdp", "hsdp") and not keeps_gathered:
        comm += 2 * gather_unit                        # the block being computed and the prefetched next one
    elif keeps_gathered:
        comm += layers * mean_gather_unit + edge * dt.gathered   # parameters stay gathered between forward and backward
    # FSDP2 reduce-scatters a unit's gradients from a buffer in its reduce dtype (MixedPrecisionPolicy.
    # reduce_dtype; the sharded gradient it keeps is fp32 either way); DeepSpeed reduces through its buckets.
    reduce_bytes = 2 if states.reduce_dtype in ("bf16", "fp16") else dt.reduce
    bucket_bytes = stack_reduce_bucket_bytes(s, states)
    reduce_buffer = block_params * reduce_bytes if fsdp_run else bucket_bytes
    if bucket_bytes:
        buffers["reduce buckets (16-bit)" if sixteen else "reduce buckets (fp32)"] = ("temporaries", bucket_bytes)
    # DDP/zero1 gradients are views into the all-reduce buckets and never freed, as are Megatron's
    # in its gradient buffer and DeepSpeed ZeRO-2's in its gradient partition; DeepSpeed ZeRO-1's
    # 16-bit gradients appear in backward. With accumulation every gradient exists from the
    # second micro-batch on.
    if sixteen or zero_stack:
        grad_buffers = states.stack == "megatron" or s.dp_strategy == "zero2"
    else:
        grad_buffers = s.dp_strategy in ("ddp", "zero1")
    persistent_grads = grad_buffers or s.grad_accum > 1
    # Under a pipeline, FSDP reduces gradients only after the last micro-batch (torch's
    # pipelining stages turn gradient sync off before it): the unsharded gradients accumulate.
    if keeps_gathered and piped:
        grad_bytes += local_params * dt.reduce

    def phase(grads: float, activations: float, temporaries: float) -> dict[str, float]:
        return {"parameters": param_bytes, "gradients": grads, "optimizer_state": optim_bytes,
                "activations": activations, "temporaries": temporaries}

    all_grads = grad_bytes if persistent_grads else 0.0
    # GPipe-like schedules run every forward before the first backward: the gradients of the
    # step's first micro-batch appear during its backward, with every micro-batch in flight.
    forwards_first = piped and s.pp_schedule in ("gpipe", "looped-bfs") and not grad_buffers
    phases = {"forward": phase(0.0 if forwards_first else all_grads, acts + weight_copies,
                               max(loss_fwd, scores_fwd) + comm)}
    # Backward: the loss's gradient first, then down the blocks: block i's activations go as
    # its gradients arrive, while its backward temporaries (and recomputation) are alive.
    head_grad = sharded(head_matmul, shard_grad) * 4 * last
    block_grad = sharded(block_params, shard_grad) * 4
    if sixteen or zero_stack:   # the stack's gradient bytes per parameter (16-bit, fp32 accumulation, fp32)
        head_grad = head_matmul * last * grad_bytes / max(local_params, 1)
        block_grad = block_params * grad_bytes / max(local_params, 1)
    transient = block_backward_transient_bytes(model, tokens, sa, seq_len=seq_len)
    # A checkpointed block's backward first recomputes what it did not keep.
    recompute = block_activation_bytes(model, tokens, sa, mode="none", seq_len=seq_len,
                                       compression=compression) - per_block if s.ac != "none" else 0
    # The hook of a masked gradient makes grad x mask while the gradient autograd computed is alive.
    transient += largest_masked * 4
    mean_block = per_block
    if n_moe:
        # The walk goes down the rank's blocks at their mean; the largest MoE block's backward
        # (and recompute) is the one alive at each point.
        expert_grads = experts / s.expert_shard_group if shard_grad else experts
        block_grad = (sharded(stage_blocks - experts, shard_grad) + expert_grads) / layers * 4
        transient = max(transient, block_backward_transient_bytes(model, tokens, sa, moe=True, seq_len=seq_len))
        if s.ac != "none":
            recompute = max(recompute, block_activation_bytes(model, tokens, sa, mode="none", moe=True, seq_len=seq_len)
                            - moe_acts)
        mean_block = stage_acts / layers
    copies_per_block = weight_copies / max(layers, 1)

    def walk(held: float, grads_before: float) -> dict[str, float]:
        """The highest point of one micro-batch's backward that starts with `held` activations
        and `grads_before` gradient bytes (0: they appear as it goes down the blocks)."""
        others = held - one_micro                    # the other in-flight micro-batches stay
        worst = phase(grads_before or head_grad, held + weight_copies, loss_bwd + comm + reduce_buffer)
        # Blocks 1..i still hold their activations. The total is linear in i, so its highest point
        # is at one end: checking i = layers, then i = 1, finds the same peak as walking every
        # block, in constant time (a config with a million layers is refused in microseconds).
        for i in dict.fromkeys((layers, 1)) if layers >= 1 else ():
            grads = grads_before or head_grad + (layers - i) * block_grad
            # zero2 frees a block's gathered parameters once its gradients are reduced.
            gathered = pipe_buffers + (i * mean_gather_unit + edge * dt.gathered if keeps_gathered
                                       else comm - pipe_buffers)
            candidate = phase(grads, others + forward_saved + i * (mean_block + copies_per_block),
                              recompute + transient + gathered + reduce_buffer)
            if sum(candidate.values()) > sum(worst.values()):
                worst = candidate
        return worst

    phases["backward"] = walk(acts, all_grads)
    if forwards_first and all_grads:
        # The first backward finds no gradients; the later ones every gradient and one
        # micro-batch less in flight.
        phases["backward"] = walk(acts, 0.0)
        later = walk(acts - one_micro - held_loss, all_grads)
        if sum(later.values()) > sum(phases["backward"].values()):
            phases["backward"] = later
    # The fake quantizers keep their last scales and zero points on the modules until the next forward.
    qparams = layers * (qat_activation_bytes(model, tokens, sa, compression, checkpointed=True)
                        + qat_weight_bytes(model, sa, compression, kept=False))
    # DeepSpeed's step converts the shard's 16-bit gradients to fp32 for the optimizer
    # (stage_1_and_2.py, step: single_grad_partition ... .to(single_partition_of_fp32_groups[i].dtype)).
    fp32_grad_shard = 0.0
    if sixteen and states.stack == "deepspeed" and not states.grads_in_fp32(s):
        fp32_grad_shard = local_params * 4 / (group if s.dp_strategy in ("zero1", "zero2") else 1)
    phases["optimizer"] = phase(grad_bytes, qparams, pipe_buffers + fp32_grad_shard)

    peak_phase = max(phases, key=lambda name: sum(phases[name].values()))
    breakdown = {k: int(v) for k, v in phases[peak_phase].items()}
    peak = sum(breakdown.values())
    frag = int(peak * CUDA_FRAGMENTATION) if device != "cpu" else 0
    return MemoryEstimate(peak_bytes=peak, peak_phase=peak_phase, breakdown=breakdown,
                          fragmentation_bytes=frag, host_bytes=host, notes=notes,
                          buffers={name: int(nbytes) for name, (_, nbytes) in buffers.items()})


def _traced_memory(model: PlanModel, s: Strategy, seq_len: int, device: str,
                   optimizer_state_bytes: int, state_dtype: str = "",
                   states: StackStates = TORCH_STATES) -> MemoryEstimate:
    """A user module measured on fake tensors (plan/trace.py). Its measured step peak at
    micro-batch 1 splits into the model states alive at that peak and the rest (activations
    and temporaries); the states are re-computed for the layout's sharding, the rest grows
    with the micro-batch and (linearly: flash attention keeps no T x T matrix) the sequence."""
    t = model.traced
    key = "fp32" if s.precision == "fp32" else "bf16"
    scale = seq_len / t.seq_len
    states_at_peak = t.param_bytes + t.peak_grad_bytes.get(key, t.grad_bytes) + t.optimizer_bytes
    dynamic_one = max(0, t.peak_bytes.get(key, states_at_peak) - states_at_peak) * scale
    acts = t.activation_bytes_per_sequence[key] * scale * s.micro_batch
    temporaries = max(0.0, dynamic_one - t.activation_bytes_per_sequence[key] * scale)
    params, grads, optim = model_state_bytes(t.n_params, s, optimizer_state_bytes, states=states)
    if state_dtype in LOW_BIT_FORMATS:
        # A traced module's tensor shapes are not kept: planned as if every tensor were quantized.
        block, value_bytes, _ = LOW_BIT_FORMATS[state_dtype]
        optim = t.n_params * 2 * (value_bytes + 4 / block)
    # The peak comes early in backward, before most gradients exist (unless they persist).
    if s.dp_strategy not in ("ddp", "zero1") and s.grad_accum == 1 and t.grad_bytes:
        grads *= t.peak_grad_bytes.get(key, t.grad_bytes) / t.grad_bytes
    if s.dp_strategy in ("zero2", "fsdp", "hsdp"):
        # a user module is sharded as one unit: the whole model is gathered for compute
        temporaries += t.n_params * (2 if s.precision != "fp32" else 4)
    host = 0
    if s.offload:
        host, params, grads, optim = int(params + grads + optim), 0.0, 0.0, 0.0
    breakdown = {"parameters": int(params), "gradients": int(grads), "optimizer_state": int(optim),
                 "activations": int(acts), "temporaries": int(temporaries)}
    peak = sum(breakdown.values())
    frag = int(peak * CUDA_FRAGMENTATION) if device != "cpu" else 0
    return MemoryEstimate(peak_bytes=peak, peak_phase="backward", breakdown=breakdown, fragmentation_bytes=frag,
                          host_bytes=host, notes=["traced module: measured on fake tensors at micro-batch 1 and 2"])
