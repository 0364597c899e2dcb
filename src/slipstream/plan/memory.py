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

Activation bytes per block were derived from what autograd keeps for backward in
slipstream's transformer and checked against MemTracker (tests/unit/test_plan_memory.py):

  saved per block, n = tokens in the micro-batch, d = width, F = MLP width, r = bytes of
  the residual stream (fp32 under autocast), a = bytes of matmul outputs (2 under bf16)
    residual stream      2 n d r        the block's input and the mid-block residual
    norm outputs         n d (4 | a x consumers)   one fp32 tensor shared by the matmuls, or
                                        under autocast one low-precision copy per matmul
    rmsnorm              + n d 4 per norm (the normalized input, composite kernel)
    norm statistics      n 4 (rms) or 2 n 4 (layer norm) per norm
    q, k, v              n (d + 2 d_kv) a
    attention output     n d a + n heads 4 (the softmax log-sum-exp; flash kernels keep no T x T matrix)
    MLP                  2 n F a (gelu: up output, gelu output; relu2: relu output, its square), 4 n F a (swiglu)
  activation checkpointing: full keeps only the block input; selective keeps the outputs of
  the matmuls and attention plus the block input.
  autocast keeps a low-precision copy of every weight its matmuls saved (2 bytes per matmul
  parameter), freed as backward goes past the layer; checkpointed blocks keep none.

Mixture of experts (plan/experts.py): an MoE block's MLP is not split by tp and sees the n
tokens of its micro-batch routed to top_k experts each (k n rows, spread evenly):
    router               2 n E 4        fp32 logits and scores
    routing              k n 32         the picks, the sort order and its token index (int64), the weights
    dispatched rows      k n d r        the token copies the experts take (sent to their ranks under ep)
    experts              4 k n h a (swiglu), 2 k n h a (gelu, relu2), h = moe_expert_hidden
    combine              2 k n d a      the experts' outputs, and placed back per token to be weighed
    shared experts       as an MLP of moe_shared_experts x h
  selective keeps the router's logits, the shared experts' matmul outputs and, unless the
  experts run as one grouped GEMM (model.moe_gemm = grouped: not a matmul the policy saves),
  the experts' (k n h a x 2 | 1, k n d a); it re-runs the dispatch. A backward also holds the
  dispatch buffers of the gradients (2 k n d r). Checked against autograd on moe-tiny
  (tests/unit/test_plan_memory.py). Its parameters: the
  router and the shared experts whole on every tp rank, E / ep routed experts, sharded over the
  dp / ep ranks holding the same experts (Strategy.expert_shard_group).

Soft-capped logits (model.logit_softcap) keep their tanh for backward: tokens x vocabulary in the
compute dtype, alive until the loss's gradient has passed it; the fused loss instead holds one more
chunk of fp32 logits in its backward (the cap's derivative).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from slipstream.models.flops import param_count
from slipstream.plan.experts import Experts, experts_of
from slipstream.plan.space import PlanModel, Strategy

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

    @property
    def total_bytes(self) -> int:
        return self.peak_bytes + self.fragmentation_bytes

    def to_record(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "total_bytes": self.total_bytes, "peak_phase": self.peak_phase,
                "fragmentation_bytes": self.fragmentation_bytes, "host_bytes": self.host_bytes,
                "breakdown": dict(self.breakdown), "notes": list(self.notes)}


@dataclass(frozen=True)
class _Dtypes:
    residual: int      # residual stream, norm inputs, embeddings
    compute: int       # matmul inputs/outputs, attention
    autocast: bool     # low-precision copies made per op (weights cached, norm outputs per consumer)
    gathered: int      # FSDP all-gathered parameters
    reduce: int        # gradient reduction


def _dtypes(s: Strategy) -> _Dtypes:
    low = s.precision != "fp32"
    # Sharded strategies run low precision as FSDP mixed precision (parameters gathered in
    # bf16, gradients reduced in fp32): no autocast, so the residual stream is low precision too.
    fsdp_mp = low and s.dp_strategy in ("zero2", "fsdp", "hsdp") and s.fsdp_mixed
    if fsdp_mp:
        return _Dtypes(residual=2, compute=2, autocast=False, gathered=2, reduce=4)
    return _Dtypes(residual=4, compute=2 if low else 4, autocast=low, gathered=4, reduce=4)


def block_activation_bytes(model: PlanModel, tokens: int, s: Strategy, mode: str | None = None,
                           moe: bool = False) -> int:
    """Bytes one transformer block saves for backward for `tokens` tokens on this GPU
    (moe: a block with experts, of a model that has them)."""
    cfg, dt = model.cfg, _dtypes(s)
    ex = experts_of(model) if moe else None
    mode = s.ac if mode is None else mode
    d, n, tp = cfg.d_model, tokens, s.tp
    # Sequence parallel splits the residual/norm tensors over tp ranks too; without it they are replicated.
    seq_split = tp if (tp > 1 and s.sequence_parallel) else 1
    r, a = dt.residual, dt.compute
    block_input = n * d * r // seq_split
    if mode == "full":
        return block_input
    head_dim = d // cfg.n_head
    kv = (cfg.n_kv_head or cfg.n_head) * head_dim
    hidden = _mlp_hidden(model)
    swiglu = cfg.mlp == "swiglu"
    qkv = n * (d + 2 * kv) * a // tp
    attention = n * d * a // tp + n * cfg.n_head * 4 // tp
    projections = n * d * a // seq_split                    # o_proj and down_proj outputs (selective keeps them)
    mlp_inner = n * hidden * a // tp
    if mode == "selective":
        if ex is not None:
            return block_input + qkv + attention + projections + _moe_saved(ex, cfg, n, s, "selective")
        return block_input + qkv + attention + projections * 2 + mlp_inner * (2 if swiglu else 1)
    stats = n * 4 * (1 if cfg.norm == "rmsnorm" else 2) // seq_split
    rms_extra = n * d * 4 // seq_split if cfg.norm == "rmsnorm" else 0
    if dt.autocast:
        norm_outs = n * d * a * 3 // seq_split + n * d * a * (2 if swiglu else 1) // seq_split
    else:
        norm_outs = 2 * n * d * r // seq_split
    residual_mid = n * d * r // seq_split
    mlp = mlp_inner * (4 if swiglu else 2) if ex is None else _moe_saved(ex, cfg, n, s, "none")
    return block_input + residual_mid + norm_outs + 2 * (stats + rms_extra) + qkv + attention + mlp


def _moe_saved(ex: Experts, cfg, n: int, s: Strategy, mode: str) -> int:
    """What an MoE layer saves for backward for the n tokens of its micro-batch (module doc)."""
    dt = _dtypes(s)
    d, r, a = cfg.d_model, dt.residual, dt.compute
    n_up = 2 if cfg.mlp == "swiglu" else 1
    routed = n * ex.top_k
    shared_inner = n * ex.shared_hidden * a
    if mode == "selective":
        # the matmuls' outputs: router logits, the shared experts' and (matmul per expert) the experts'
        experts = 0 if cfg.moe_gemm == "grouped" else routed * ex.hidden * a * n_up + routed * d * a
        return n * ex.n * a + experts + (shared_inner * n_up + n * d * a if ex.shared_hidden else 0)
    router = 2 * n * ex.n * 4
    routing = routed * 32
    rows = routed * d * r
    inner = routed * ex.hidden * a * 2 * n_up
    combine = 2 * routed * d * a
    return router + routing + rows + inner + combine + shared_inner * 2 * n_up


def _mlp_hidden(model: PlanModel) -> int:
    from slipstream.models.transformer import mlp_hidden

    return mlp_hidden(model.cfg)


def _stage_layers(model: PlanModel, s: Strategy) -> int:
    return math.ceil(model.cfg.n_layer / s.pp)


def in_flight_microbatches(s: Strategy) -> float:
    """Micro-batches whose activations the busiest pipeline stage holds at once."""
    if s.pp == 1:
        return 1.0
    m = s.grad_accum
    if s.pp_schedule in ("gpipe", "looped-bfs"):
        return float(m)   # every micro-batch's forward before the first backward
    if s.pp_schedule == "dualpipev":
        return float(min(s.pp + 1, m))   # DeepSeek-V3 report, table 2: PP + 1 (1F1B: PP)
    in_flight = float(min(s.pp, m))      # 1f1b, and zbv (Qi et al. 2024: 1F1B's peak)
    if s.pp_schedule in ("interleaved-1f1b", "interleaved-zero-bubble"):
        # Narayanan et al. 2021 (section 2.2.2): interleaving holds (1 + (p-1)/(p v)) x 1F1B's activations.
        in_flight *= 1 + (s.pp - 1) / (s.pp * s.pp_virtual)
    return in_flight


def estimate_memory(model: PlanModel, s: Strategy, seq_len: int, device: str = "cuda",
                    optimizer_state_bytes: int = 4, optimizer: str = "adamw") -> MemoryEstimate:
    """Predicted peak memory per GPU of one training step of `model` laid out as `s`.

    seq_len: tokens per sequence; s.micro_batch sequences go through each forward.
    optimizer_state_bytes: bytes per Adam moment (4 fp32, 2 bf16).
    optimizer: adamw, or muon (optim.optimizer): one fp32 momentum buffer per hidden-matrix
    parameter instead of two moments (a traced user module is planned with AdamW's state).
    device: "cuda" adds the allocator's fragmentation margin; "cpu" does not.
    """
    if model.traced is not None:
        return _traced_memory(model, s, seq_len, device, optimizer_state_bytes)
    cfg, dt = model.cfg, _dtypes(s)
    pc = param_count(cfg)
    ex = experts_of(model)
    shard_grad, group = s.shards()[1], s.state_shard_group
    layers = _stage_layers(model, s)
    notes: list[str] = []

    # ---- parameters per GPU: this stage's blocks (split by tp, experts by ep) + embedding / head
    block_params = (pc.attn + pc.mlp) / s.tp + pc.norm
    vocab_params = pc.embedding - (cfg.max_seq_len * cfg.d_model if cfg.position == "learned" else 0)
    pos_params = pc.embedding - vocab_params
    first_stage = vocab_params / s.tp + pos_params
    last_stage = (pc.head or (vocab_params if s.pp > 1 else 0)) / s.tp + cfg.d_model
    edge = first_stage + last_stage if s.pp == 1 else max(first_stage, last_stage)
    if s.pp == 1 and cfg.tie_embeddings:
        edge = first_stage + cfg.d_model
    n_moe = ex.stage_layers(layers) if ex else 0     # the busiest stage's blocks with experts
    stage_blocks, experts = layers * block_params, 0.0
    if ex:
        # Dense blocks split by tp; an MoE block's attention by tp, its router and shared experts
        # whole, its routed experts E / ep. The largest block sizes the FSDP buffers.
        dense_block = (pc.attn + ex.dense_mlp) / s.tp + pc.norm
        expert_block = ex.routed_params / s.ep
        moe_block = pc.attn / s.tp + pc.norm + ex.other_params + expert_block
        stage_blocks = (layers - n_moe) * dense_block + n_moe * moe_block
        experts = n_moe * expert_block
        block_params = moe_block if n_moe == layers else max(dense_block, moe_block)
        notes.append(f"mixture of experts: {n_moe} of this stage's {layers} blocks hold {ex.n // s.ep} of "
                     f"{ex.n} experts each; tokens are planned as spread evenly over the experts")
    local_params = stage_blocks + edge

    def sharded(count: float, is_sharded: bool) -> float:
        return count / group if is_sharded else count

    param_bytes, grad_bytes, optim_bytes = model_state_bytes(local_params, s, optimizer_state_bytes)
    if experts and s.ep > 1:
        # The routed experts shard over the dp / ep ranks that hold the same ones (FSDP), or not
        # at all (DDP, ep = dp): per GPU, E / ep experts / (dp / ep) = E / dp under FSDP.
        dense = model_state_bytes(local_params - experts, s, optimizer_state_bytes)
        expert = model_state_bytes(experts, s, optimizer_state_bytes, shard_group=s.expert_shard_group)
        param_bytes, grad_bytes, optim_bytes = (a + b for a, b in zip(dense, expert))
    if optimizer == "muon":  # one moment instead of two for the matrices Muon steps
        optim_bytes -= model_state_bytes(muon_matrix_params(model, layers, n_moe, s), s, optimizer_state_bytes)[2] / 2
    host = 0
    if s.offload:
        host = int(param_bytes + grad_bytes + optim_bytes)
        param_bytes = grad_bytes = optim_bytes = 0
        notes.append("offload: sharded parameters, gradients and optimizer state live in host memory")

    # ---- activations of one micro-batch on this GPU
    tokens = s.micro_batch * seq_len // s.cp
    per_block = block_activation_bytes(model, tokens, s)
    stage_acts = layers * per_block
    if n_moe:
        stage_acts = (layers - n_moe) * per_block + n_moe * block_activation_bytes(model, tokens, s, moe=True)
    seq_split = s.tp if (s.tp > 1 and s.sequence_parallel) else 1
    final_norm = tokens * cfg.d_model * (dt.residual + (dt.compute if dt.autocast else dt.residual)) // seq_split
    if cfg.norm == "rmsnorm":
        final_norm += tokens * cfg.d_model * 4 // seq_split
    in_flight = in_flight_microbatches(s)
    acts = (stage_acts + final_norm) * in_flight

    # Autocast keeps a bf16 copy of each weight a saved matmul needs (blocks without AC).
    weight_copies = 0.0
    if dt.autocast and s.ac == "none":
        matmul_per_block = (pc.active_matmul - vocab_params) / cfg.n_layer / s.tp
        if ex:  # every weight of the stage's blocks: an MoE block casts all of its local experts
            matmul_per_block = stage_blocks / layers
        weight_copies = layers * matmul_per_block * dt.compute + vocab_params / s.tp * dt.compute

    # ---- the loss: logits (tokens x vocab) and their fp32 log-softmax (on the last stage;
    # with a pipeline we add it to the busiest stage, which errs on the safe side)
    v_local = vocab_params // cfg.d_model / s.tp
    if s.fused_loss:
        chunk = min(s.loss_chunk, tokens)
        loss_fwd = chunk * v_local * 4 * 2
        loss_bwd = chunk * v_local * 4 * 2 + tokens * cfg.d_model * 4
        notes.append("fused loss: logits exist one chunk at a time")
    else:
        low_logits = tokens * v_local * dt.compute if dt.compute != 4 else 0   # before the fp32 upcast
        loss_fwd = low_logits + 2 * tokens * v_local * 4     # fp32 logits and their log-softmax
        # backward of the log-softmax: its saved output, the incoming gradient and the outgoing
        # one (the low-precision logits are gone by then; their gradient comes after these go)
        loss_bwd = 3 * tokens * v_local * 4

    if cfg.logit_softcap > 0:
        if s.fused_loss:  # the forward caps each chunk in place; the backward holds the cap's derivative
            loss_bwd += chunk * v_local * 4
        else:  # the tanh of the logits, saved until the loss's gradient has passed the cap
            loss_fwd += tokens * v_local * dt.compute
            loss_bwd += tokens * v_local * dt.compute

    # ---- gathered parameters and communication buffers
    gather_unit = block_params * dt.gathered
    mean_gather_unit = stage_blocks / layers * dt.gathered if n_moe else gather_unit   # per block of the stage
    # zero2 keeps the gathered parameters from forward to backward; so does FSDP under a
    # pipeline (as torchtitan runs it), or every micro-batch would gather them again.
    keeps_gathered = s.dp_strategy == "zero2" or (s.pp > 1 and s.dp_strategy in ("fsdp", "hsdp"))
    comm = 0.0
    if s.dp_strategy in ("fsdp", "hsdp") and not keeps_gathered:
        comm = 2 * gather_unit                        # the block being computed and the prefetched next one
    elif keeps_gathered:
        comm = layers * mean_gather_unit + edge * dt.gathered   # parameters stay gathered between forward and backward
    reduce_buffer = block_params * dt.reduce if s.dp_strategy in ("zero2", "fsdp", "hsdp") else 0.0
    # DDP/zero1 gradients are views into the all-reduce buckets and never freed; with
    # accumulation every gradient exists from the second micro-batch on.
    persistent_grads = s.dp_strategy in ("ddp", "zero1") or s.grad_accum > 1
    # Under a pipeline, FSDP reduces gradients only after the last micro-batch (torch's
    # pipelining stages turn gradient sync off before it): the unsharded gradients accumulate.
    if keeps_gathered and s.pp > 1:
        grad_bytes += local_params * dt.reduce

    def phase(grads: float, activations: float, temporaries: float) -> dict[str, float]:
        return {"parameters": param_bytes, "gradients": grads, "optimizer_state": optim_bytes,
                "activations": activations, "temporaries": temporaries}

    all_grads = grad_bytes if persistent_grads else 0.0
    phases = {"forward": phase(all_grads, acts + weight_copies, loss_fwd + comm)}
    # Backward: the loss's gradient first, then down the blocks: block i's activations go as
    # its gradients arrive, while its backward temporaries (and recomputation) are alive.
    head_grad = sharded((pc.head or vocab_params) / s.tp, shard_grad) * 4 if s.pp == 1 else 0.0
    block_grad = sharded(block_params, shard_grad) * 4
    transient = _block_backward_transient(model, tokens, s)
    # A checkpointed block's backward first recomputes what it did not keep.
    recompute = block_activation_bytes(model, tokens, s, mode="none") - per_block if s.ac != "none" else 0
    mean_block = per_block
    if n_moe:
        # The walk goes down the stage's blocks at their mean; the largest MoE block's backward
        # (and recompute) is the one alive at each point.
        expert_grads = experts / s.expert_shard_group if shard_grad else experts
        block_grad = (sharded(stage_blocks - experts, shard_grad) + expert_grads) / layers * 4
        transient = max(transient, _block_backward_transient(model, tokens, s, moe=True))
        if s.ac != "none":
            recompute = max(recompute, block_activation_bytes(model, tokens, s, mode="none", moe=True)
                            - block_activation_bytes(model, tokens, s, moe=True))
        mean_block = stage_acts / layers
    other_micro = acts - (stage_acts + final_norm)          # other in-flight micro-batches stay
    worst = phase(all_grads or head_grad, acts + weight_copies, loss_bwd + comm + reduce_buffer)
    copies_per_block = weight_copies / max(layers, 1)
    # Blocks 1..i still hold their activations. The total is linear in i, so its highest point
    # is at one end: checking i = layers, then i = 1, finds the same peak as walking every
    # block, in constant time (a config with a million layers is refused in microseconds).
    for i in dict.fromkeys((layers, 1)) if layers >= 1 else ():
        grads = all_grads or head_grad + (layers - i) * block_grad
        # zero2 frees a block's gathered parameters once its gradients are reduced.
        gathered = i * mean_gather_unit + edge * dt.gathered if keeps_gathered else comm
        candidate = phase(grads, other_micro + i * (mean_block + copies_per_block),
                          recompute + transient + gathered + reduce_buffer)
        if sum(candidate.values()) > sum(worst.values()):
            worst = candidate
    phases["backward"] = worst
    phases["optimizer"] = phase(grad_bytes, 0.0, 0.0)

    peak_phase = max(phases, key=lambda name: sum(phases[name].values()))
    breakdown = {k: int(v) for k, v in phases[peak_phase].items()}
    peak = sum(breakdown.values())
    frag = int(peak * CUDA_FRAGMENTATION) if device != "cpu" else 0
    return MemoryEstimate(peak_bytes=peak, peak_phase=peak_phase, breakdown=breakdown,
                          fragmentation_bytes=frag, host_bytes=host, notes=notes)


def _traced_memory(model: PlanModel, s: Strategy, seq_len: int, device: str,
                   optimizer_state_bytes: int) -> MemoryEstimate:
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
    params, grads, optim = model_state_bytes(t.n_params, s, optimizer_state_bytes)
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


def muon_matrix_params(model: PlanModel, layers: int, n_moe: int, s: Strategy) -> float:
    """Parameters of this stage that Muon steps (optimize/muon.py): the blocks' attention and MLP
    weight matrices, an MoE block's shared experts (not its router or routed experts), split by tp."""
    cfg = model.cfg
    bare = param_count(dataclasses.replace(cfg, bias=False))  # weights only: biases stay on AdamW
    shared = bare.mlp - bare.experts // bare.moe_layers - cfg.d_model * cfg.moe_experts if bare.moe_layers else 0
    return ((layers - n_moe) * (bare.attn + bare.dense_mlp) + n_moe * (bare.attn + shared)) / s.tp


def model_state_bytes(params: float, s: Strategy, optimizer_state_bytes: int = 4,
                      shard_group: int | None = None) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer state) bytes per GPU for the `params` parameters of
    this GPU's part of the model: fp32 parameters and gradients (low precision runs through
    autocast or FSDP mixed precision, so there is no separate master copy) and AdamW's two
    moments, each divided by the shard group where the strategy shards it (`shard_group`
    overrides it: experts shard over the ranks that hold the same experts)."""
    shard_opt, shard_grad, shard_param = s.shards()
    group = s.state_shard_group if shard_group is None else shard_group
    return (params * 4 / (group if shard_param else 1),
            params * 4 / (group if shard_grad else 1),
            params * 2 * optimizer_state_bytes / (group if shard_opt else 1))


def _block_backward_transient(model: PlanModel, tokens: int, s: Strategy, moe: bool = False) -> int:
    """Gradients of activations alive while one block is differentiated, beyond what the block
    already saved: the MLP's inner gradient (gelu: one n x F tensor; swiglu: two, the gate's
    and the up projection's) next to the residual stream's gradient and its copy. An MoE
    block's: its k n routed rows' inner gradients (whole: not split by tp), the shared
    experts', and the dispatch buffers of the rows' gradients (sent and received)."""
    cfg, dt = model.cfg, _dtypes(s)
    n_up = 2 if cfg.mlp == "swiglu" else 1
    ex = experts_of(model) if moe else None
    if ex is not None:
        routed = tokens * ex.top_k
        inner = (routed * ex.hidden + tokens * ex.shared_hidden) * dt.compute * n_up
        return inner + 2 * routed * cfg.d_model * dt.residual + 2 * tokens * cfg.d_model * dt.residual
    inner = tokens * _mlp_hidden(model) * dt.compute // s.tp * n_up
    return inner + 2 * tokens * cfg.d_model * dt.residual
