"""A published run as the planner's inputs: its model (plan_model), its parallel layout
(plan_strategy) and the GPU to plan its cluster with (plan_gpu). Apart from the run records
(plan/published.py, plan/published_more.py): the one place that interprets them.
"""

from __future__ import annotations

from slipstream.config.schema import ModelConfig
from slipstream.errors import UserError
from slipstream.plan.published import PublishedRun
from slipstream.plan.space import ATTENTION_IMPLEMENTATIONS, PlanModel, Strategy

# The planner's names of the data-parallel strategies (plan.space.DP_STRATEGIES): DeepSpeed ZeRO-3
# shards like FSDP; an unstated strategy over several ranks is plain DDP.
_DP_STRATEGY_NAMES = {"zero3": "fsdp", None: "ddp"}
# The planner's compute dtype for a stated precision. fp8 runs (Float8 on the linears) are planned
# at the bf16 rate (the planner has no fp8 training model); "mixed-16bit" (Megatron 2021 / 2022,
# "mixed precision") as fp16: Megatron-LM's examples of the time train with --fp16
# (examples/pretrain_gpt3_175B.sh). bf16 and fp16 plan at the same tensor-core rate.
_PLAN_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp8": "bf16", "mixed-16bit": "fp16"}
# Sequences per optimizer step where the source states none: 4 micro-batches per pipeline stage
# per data-parallel rank (a pipeline kept busy), as the report planned them before issue 19.
_UNSTATED_BATCH_MICROBATCHES_PER_STAGE = 4


def plan_model(run: PublishedRun) -> PlanModel:
    """The run's model as a transformer config: its shape and the architecture options it states.

    Options the run leaves unset keep the historic reading: a swiglu MLP means a Llama block
    (RoPE, RMSNorm, no biases), anything else a GPT-2 block (learned positions, LayerNorm, biases).
    The learned position table is sized to the run's sequence length."""
    if not run.n_layer:
        raise UserError(f"published run {run.name!r} states model-state memory only, no model shape: "
                        "there is no transformer to plan; pick a run with a shape (n_layer > 0)")
    llama = run.mlp == "swiglu"
    cfg = ModelConfig(preset="llama-8b" if llama else "gpt2", n_layer=run.n_layer, d_model=run.d_model,
                      n_head=run.n_head, n_kv_head=run.n_kv_head or 0, d_ff=run.d_ff or 0,
                      vocab_size=run.vocab_size, max_seq_len=run.seq_len, mlp=run.mlp,
                      tie_embeddings=run.tie_embeddings,
                      position=run.position or ("rope" if llama else "learned"),
                      rotary_fraction=run.rotary_fraction,
                      norm=run.norm or ("rmsnorm" if llama else "layernorm"),
                      bias=(not llama) if run.bias is None else run.bias,
                      parallel_block=run.parallel_block, embedding_norm=run.embedding_norm,
                      # a mixture of experts in every block, each expert as wide as d_ff
                      moe_experts=run.n_experts, moe_top_k=run.experts_top_k or 2)
    return PlanModel(run.name, cfg)


def _virtual_stages(run: PublishedRun) -> int:
    """Stages per pipeline rank of an interleaved schedule whose source does not state them: the
    fewest (above one) that split each rank's blocks evenly, else 2 (the historic default). A
    105-layer model on 35 stages gets 3 chunks of one block, not 2 uneven ones."""
    if run.virtual_stages:
        return run.virtual_stages
    per_rank = run.n_layer // run.pp if run.n_layer % run.pp == 0 else 0
    return next((v for v in range(2, per_rank + 1) if per_rank % v == 0), 2)


def plan_strategy(run: PublishedRun) -> Strategy:
    """The run's parallel layout as a planner Strategy: degrees, micro-batch and gradient
    accumulation, schedule, activation checkpointing, precision, sequence parallelism, the
    stated pipeline split and the attention implementation.

    Unstated values: micro-batch 1; global batch 4 micro-batches per pipeline stage per
    data-parallel rank; schedule 1F1B; attention flash; sequence parallelism on with tp > 1."""
    dp_strategy = _DP_STRATEGY_NAMES.get(run.dp_strategy, run.dp_strategy) if run.dp > 1 else "none"
    micro = run.micro_batch or 1
    global_batch = run.global_batch or run.dp * micro * max(run.pp, 1) * _UNSTATED_BATCH_MICROBATCHES_PER_STAGE
    accum = max(1, global_batch // (run.dp * micro))
    schedule = (run.pp_schedule or "1f1b").lower()
    schedule = "interleaved-1f1b" if "interleaved" in schedule else ("gpipe" if "gpipe" in schedule else "1f1b")
    virtual = _virtual_stages(run) if schedule == "interleaved-1f1b" else 1
    if run.precision not in _PLAN_PRECISION:
        raise UserError(f"published run {run.name!r}: precision {run.precision!r} has no planner dtype; "
                        f"use one of {', '.join(_PLAN_PRECISION)}")
    if run.attention is not None and run.attention not in ATTENTION_IMPLEMENTATIONS:
        raise UserError(f"published run {run.name!r}: attention {run.attention!r} is not one of "
                        f"{', '.join(ATTENTION_IMPLEMENTATIONS)}")
    sequence_parallel = run.tp > 1 if run.sequence_parallel is None else (run.sequence_parallel and run.tp > 1)
    return Strategy(dp_strategy=dp_strategy, dp=run.dp, tp=run.tp, pp=run.pp, cp=run.cp, ep=run.ep,
                    sequence_parallel=sequence_parallel, micro_batch=micro, grad_accum=accum,
                    ac=run.activation_checkpointing or "none", precision=_PLAN_PRECISION[run.precision],
                    pp_schedule=schedule, pp_virtual=virtual, pp_layers=run.pp_layers,
                    attention=run.attention or "flash", fused_loss=run.fused_loss)


def plan_gpu(run: PublishedRun) -> str:
    """The GPU name to plan the run's cluster with (plan.hardware.make_cluster("8x<name>")).
    torchtitan's 96 GB HBM2e H100 plans as the H100: capacity does not enter the predicted speed."""
    return run.gpu.replace("-96GB", "")
