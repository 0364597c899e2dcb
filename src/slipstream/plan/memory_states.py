"""The model states per GPU: parameters, gradients and optimizer state, as each training stack
keeps them (StackStates, state_buffers), Muon's single momentum, and torchao's low-bit optimizer
states. Apart from the activations (plan/memory_activations.py) and the step's walk
(plan/memory.py), which reads them per pipeline rank.

Model states as the training stack keeps them (StackStates, state_buffers; MemoryEstimate.buffers
names each): slipstream's trainer (torch) keeps fp32 parameters and gradients under autocast, and
FSDP2's MixedPrecisionPolicy gathers bf16 units from sharded fp32 ones and reduce-scatters in its
reduce dtype. Megatron-LM and DeepSpeed put the model itself in 16 bits: 16-bit weights and
gradients (fp32 with fp32 gradient accumulation, Megatron's default under bf16), the fp32 master
copy and moments sharded over dp under zero1 / zero2 (Megatron's distributed optimizer, DeepSpeed
ZeRO-1), the gradients sharded too under DeepSpeed ZeRO-2, with its reduce buckets in backward.
Checked against emulations of both on the fake process group (plan/accuracy_cases.py, stack_cases;
plan/accuracy_measure.py runs them).

Low-bit optimizer states (optim.state_dtype int8 / int4): torchao's block-quantized moments,
tensor by tensor (low_bit_optimizer_bytes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from slipstream.errors import UserError
from slipstream.models.flops import param_count
from slipstream.plan.hardware import STACKS
from slipstream.plan.space import PlanModel, Strategy
from slipstream.plan.stages import RankPart

# DeepSpeed ZeRO-1/2's reduce bucket ("ipg buffer"): reduce_bucket_size elements in the 16-bit dtype,
# allocated by backward() (a second one with overlap_comm: "Use double buffers to avoid data access
# conflict when overlap_comm is enabled"); default reduce_bucket_size 5e8 elements
# (deepspeed/runtime/zero/stage_1_and_2.py, DeepSpeedZeroOptimizer.backward; constants.py:
# ZERO_OPTIMIZATION_REDUCE_BUCKET_SIZE_DEFAULT = 500000000).
DEEPSPEED_REDUCE_BUCKET_ELEMENTS = 500_000_000


@dataclass(frozen=True)
class StackStates:
    """How the training stack keeps a mixed-precision step's model states (`plan --stack`).

    torch      slipstream's trainer: fp32 parameters and gradients (autocast; DDP / ZeroRedundancyOptimizer),
               FSDP2 with MixedPrecisionPolicy (param_dtype bf16, reduce_dtype: `reduce_dtype`) for
               zero2 / fsdp / hsdp: sharded fp32 parameters and gradients, gathered bf16 units.
    megatron   Megatron-LM: the model in bf16 / fp16 (Float16Module), a contiguous gradient buffer
               (fp32 main grads with fp32_grad_accum), and for zero1 / zero2 its distributed
               optimizer: fp32 master weights and moments sharded over dp, gradients whole.
    deepspeed  DeepSpeed ZeRO-1 / 2: 16-bit weights, 16-bit gradients (ZeRO-2: sharded), fp32
               master weights and moments sharded, the reduce buckets in backward.

    fp32_grad_accum: gradients accumulated in fp32 (Megatron accumulate_allreduce_grads_in_fp32,
    DeepSpeed data_types.grad_accum_dtype fp32); None: the stack's default (Megatron: on for bf16,
    where its arguments.py turns it on; off for fp16. DeepSpeed: off).
    bucket_mb: DeepSpeed's reduce_bucket_size in MiB (None: 5e8 elements); overlap_comm: a second one.
    """

    stack: str = "torch"
    fp32_grad_accum: bool | None = None
    reduce_dtype: str = "fp32"
    bucket_mb: float | None = None
    overlap_comm: bool = False

    def __post_init__(self) -> None:
        if self.stack not in STACKS:
            raise UserError(f"unknown training stack {self.stack!r}; use one of {', '.join(STACKS)} (--stack).")
        if self.reduce_dtype not in ("fp32", "bf16", "fp16"):
            raise UserError(f"FSDP reduce dtype {self.reduce_dtype!r}: use fp32, bf16 or fp16 (parallel.reduce_dtype).")

    def keeps_16bit_model(self, s: Strategy) -> bool:
        """Whether this stack runs `s` with the model itself in 16 bits (not FSDP2, not autocast)."""
        return self.stack != "torch" and s.precision != "fp32" and s.dp_strategy in ("none", "ddp", "zero1", "zero2")

    @classmethod
    def of_cluster(cls, cluster) -> StackStates:
        """The states of `cluster`'s stack (hardware.Cluster: stack, --bucket-mb, and DeepSpeed's
        overlap_comm, whose second bucket follows --overlap-grad-reduce)."""
        return cls(cluster.stack, bucket_mb=cluster.bucket_mb,
                   overlap_comm=cluster.stack == "deepspeed" and cluster.overlaps_grad_reduce)

    def zero_optimizer(self, s: Strategy) -> bool:
        """Whether this stack runs `s` through its own ZeRO (Megatron's distributed optimizer, DeepSpeed
        ZeRO-1/2), whatever the precision: the weights stay whole, nothing is gathered per unit (not FSDP)."""
        return self.stack != "torch" and s.dp_strategy in ("zero1", "zero2")

    def grads_in_fp32(self, s: Strategy) -> bool:
        if self.fp32_grad_accum is not None:
            return self.fp32_grad_accum
        return self.stack == "megatron" and s.precision == "bf16"


TORCH_STATES = StackStates()


def state_buffers(params: float, s: Strategy, states: StackStates = TORCH_STATES, optimizer_state_bytes: int = 4,
                  shard_group: int | None = None) -> dict[str, tuple[str, float]]:
    """The model-state buffers per GPU of `params` parameters, by name: (category, bytes).

    torch (and FSDP strategies on any stack, and fp32 ddp): fp32 weights and gradients and the two
    moments, each divided by the shard group where the strategy shards it. fp32 zero1 / zero2 on
    Megatron / DeepSpeed runs their own ZeRO (StackStates.zero_optimizer): weights whole, moments
    sharded (Megatron 8 + 8 / d; DeepSpeed 8 + 12 / d, ZeRO-2 4 + 16 / d). A stack that keeps the
    model in 16 bits (StackStates.keeps_16bit_model) keeps, per parameter (d: the shard group):
        16-bit weights 2; gradients 2 (4 with fp32 accumulation), / d under DeepSpeed ZeRO-2;
        fp32 master weights 4 and moments 2 x optimizer_state_bytes, / d under zero1 / zero2;
        Megatron fp16 with 16-bit gradients: the optimizer's own fp32 main gradients 4 (/ d).
    The ZeRO paper's 2 + 2 + 12 / d (ZeRO-1) and 2 + (2 + 12) / d (ZeRO-2) bytes (Rajbhandari et al.
    2020, Figure 1: "P_os: 2 Psi + 2 Psi + K Psi / N_d", "P_os+g: 2 Psi + (2 + K) Psi / N_d", caption:
    "K=12 based on mixed-precision training with Adam optimizer"), and Megatron-LM's (README, "Distributed
    Optimizer": "fp16 param, fp16 grads | 20 | 4 + 16/d; bf16 param, fp32 grads | 18 | 6 + 12/d";
    "when using bf16 model params, however, the distributed optimizer's fp32 main grads are the same
    as the model's fp32 grads, and so the grads in this case are not distributed")."""
    shard_opt, shard_grad, shard_param = s.shards()
    group = s.state_shard_group if shard_group is None else shard_group
    moments = params * 2 * optimizer_state_bytes / (group if shard_opt else 1)
    if states.zero_optimizer(s) and not states.keeps_16bit_model(s):
        # fp32 on Megatron / DeepSpeed ZeRO: weights whole, moments sharded. Megatron README ("fp32 param,
        # fp32 grads | 16 | 8 + 8/d"): no master copy, gradients whole (its zero2 is its zero1). DeepSpeed
        # (runtime/zero/stage_1_and_2.py, DeepSpeedZeroOptimizer.__init__: "A partition of the fp32 master
        # weights ... single_partition_of_fp32_groups ... .clone().float().detach()") clones its shard even
        # in fp32, and ZeRO-2 partitions the gradients: 4 + 4 + 12 / d (ZeRO-1), 4 + 16 / d (ZeRO-2).
        deepspeed = states.stack == "deepspeed"
        buffers = {"weights (fp32)": ("parameters", params * 4),
                   "gradients (fp32)": ("gradients", params * 4 / (group if deepspeed and s.dp_strategy == "zero2"
                                                                   else 1))}
        if deepspeed:
            buffers["master weights (fp32)"] = ("optimizer_state", params * 4 / group)
        buffers["Adam moments"] = ("optimizer_state", moments)
        return buffers
    if not states.keeps_16bit_model(s):
        return {"weights (fp32)": ("parameters", params * 4 / (group if shard_param else 1)),
                "gradients (fp32)": ("gradients", params * 4 / (group if shard_grad else 1)),
                "Adam moments": ("optimizer_state", moments)}
    low = s.precision
    fp32_grads = states.grads_in_fp32(s)
    # DeepSpeed's ZeRO-2 partitions the gradients; Megatron has no ZeRO-2 (its distributed
    # optimizer keeps the whole gradient buffer), so its zero2 is its zero1.
    grad_group = group if (states.stack == "deepspeed" and s.dp_strategy == "zero2") else 1
    master_group = group if shard_opt else 1
    buffers = {f"weights ({low})": ("parameters", params * 2),
               ("gradients (fp32)" if fp32_grads else f"gradients ({low})"):
                   ("gradients", params * (4 if fp32_grads else 2) / grad_group),
               "master weights (fp32)": ("optimizer_state", params * 4 / master_group)}
    if states.stack == "megatron" and not fp32_grads:
        buffers["master gradients (fp32)"] = ("optimizer_state", params * 4 / master_group)
    buffers["Adam moments"] = ("optimizer_state", moments)
    return buffers


def stack_reduce_bucket_bytes(s: Strategy, states: StackStates) -> float:
    """DeepSpeed's reduce buckets alive in backward (16-bit; DEEPSPEED_REDUCE_BUCKET_ELEMENTS);
    Megatron's buckets are views into its gradient buffer, torch's are planned with the gradients."""
    if not (states.zero_optimizer(s) and states.stack == "deepspeed"):
        return 0.0
    elem = 2 if states.keeps_16bit_model(s) else 4   # fp32 runs reduce fp32 gradients
    one = states.bucket_mb * 2**20 if states.bucket_mb is not None else DEEPSPEED_REDUCE_BUCKET_ELEMENTS * elem
    return one * (2 if states.overlap_comm else 1)


def muon_matrix_params(model: PlanModel, layers: int, n_moe: int, s: Strategy) -> float:
    """Parameters of this stage that Muon steps (optimize/muon.py): the blocks' attention and MLP
    weight matrices, an MoE block's shared experts (not its router or routed experts), split by tp."""
    cfg = model.cfg
    bare = param_count(dataclasses.replace(cfg, bias=False))  # weights only: biases stay on AdamW
    shared = bare.mlp - bare.experts // bare.moe_layers - cfg.d_model * cfg.moe_experts if bare.moe_layers else 0
    return ((layers - n_moe) * (bare.attn + bare.dense_mlp) + n_moe * (bare.attn + shared)) / s.tp


# ---------------------------------------------------------------- low-bit optimizer states

# torchao.optim (0.18) quantizes a moment only when its tensor has at least this many values and
# a multiple of the block size; smaller tensors keep plain moments in the param dtype. Source:
# torchao/optim/adam.py, _AdamBase._new_buffer ("follow bitsandbytes, only quantize tensors >= 4096
# values"); block sizes: the defaults of AdamW8bit (block_size=256) and AdamW4bit (128) there;
# codes: subclass_8bit.py (one uint8 per value, a 256-entry fp32 code book per tensor) and
# subclass_4bit.py (two 4-bit codes per uint8, a 16-entry fp32 code book); one fp32 scale per
# block (torch.zeros(numel // block_size)). optimize/optimizers.py builds the optimizer from these.
LOW_BIT_MIN_NUMEL = 4096
LOW_BIT_FORMATS = {  # state_dtype: (block size, bytes per quantized value, code-book entries)
    "int8": (256, 1.0, 256),
    "int4": (128, 0.5, 16),
}


def low_bit_quantized(numel: int, state_dtype: str) -> bool:
    """Whether torchao stores the moments of a tensor of `numel` values quantized."""
    return numel >= LOW_BIT_MIN_NUMEL and numel % LOW_BIT_FORMATS[state_dtype][0] == 0


def low_bit_state_bytes(numel: int, state_dtype: str, param_bytes: int = 4) -> int:
    """Bytes of one parameter's state under torchao's low-bit AdamW: two moments (codes, one fp32
    scale per block and the code book; or plain param-dtype tensors below the size threshold) and
    the fp32 step counter."""
    if not low_bit_quantized(numel, state_dtype):
        return 2 * numel * param_bytes + 4
    block, value_bytes, codebook = LOW_BIT_FORMATS[state_dtype]
    return 2 * (int(numel * value_bytes) + 4 * (numel // block) + 4 * codebook) + 4


_LOW_BIT_CACHE: dict[tuple[str, str], tuple[float, int, int, int]] = {}


def low_bit_optimizer_bytes(model: PlanModel, part: RankPart, state_dtype: str, piped: bool = False) -> int:
    """Optimizer-state bytes of one rank's whole (unsharded, tp = 1) parameters under torchao's
    low-bit AdamW, tensor by tensor: the model's parameter shapes come from building it on the
    meta device (no memory). Blocks are counted at the mean block's bytes (exact where the blocks
    are alike); the copy of a tied table a pipeline's last stage holds (piped) is counted there too."""
    key = (repr(model.cfg), state_dtype)
    if key not in _LOW_BIT_CACHE:
        import torch

        from slipstream.models.transformer import Transformer

        with torch.device("meta"):
            net = Transformer(model.cfg)
        blocks = embedding = head = 0
        for name, param in net.named_parameters():   # a tied table once, under tok_emb
            nbytes = low_bit_state_bytes(param.numel(), state_dtype)
            if name.startswith("blocks."):
                blocks += nbytes
            elif name.startswith(("final_norm.", "lm_head.")):
                head += nbytes
            else:
                embedding += nbytes
        tied = net.lm_head.weight is net.tok_emb.weight
        _LOW_BIT_CACHE[key] = (blocks / model.cfg.n_layer, embedding, head,
                               low_bit_state_bytes(net.tok_emb.weight.numel(), state_dtype) if tied else 0)
    per_block, embedding, head, tied_table = _LOW_BIT_CACHE[key]
    return int(part.blocks * per_block + part.embedding * embedding + part.head * (head + piped * tied_table))


def model_state_bytes(params: float, s: Strategy, optimizer_state_bytes: int = 4,
                      shard_group: int | None = None, states: StackStates = TORCH_STATES) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer state) bytes per GPU for the `params` parameters of
    this GPU's part of the model, as `states.stack` keeps them (state_buffers): on slipstream's own
    trainer fp32 parameters and gradients (low precision runs through autocast or FSDP mixed
    precision, so there is no separate master copy) and AdamW's two moments, each divided by the
    shard group where the strategy shards it (`shard_group` overrides it: experts shard over the
    ranks that hold the same experts)."""
    totals = dict.fromkeys(("parameters", "gradients", "optimizer_state"), 0.0)
    for category, nbytes in state_buffers(params, s, states, optimizer_state_bytes, shard_group).values():
        totals[category] += nbytes
    return totals["parameters"], totals["gradients"], totals["optimizer_state"]
