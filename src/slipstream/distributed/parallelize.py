"""The one ordered chain that turns a model into the model a rank trains.

    [pipeline split] -> fp8 | QAT -> sparsity masks -> tensor/sequence parallel -> context parallel -> expert parallel
        -> activation checkpointing -> compile -> FSDP/HSDP or DDP -> materialize + init

`parallelize(model, parallel, cfg)` is called once, by the Trainer. Each step is one
`apply_*` function that sees the model the previous step produced; model code knows none of
this. The model may arrive on the meta device (with `init_model`): a sharded model (zero2,
fsdp, hsdp) is then allocated shard by shard at the very end, so no rank ever holds all of it;
a replicated one is materialized before the first step, since every rank holds all of it anyway.

Precision autocast, the loss scaler and the optimizer variants act on the training step, not
on the model: they live in the trainer and optimize/.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn

from slipstream.config.dims import REPLICATED, SHARDED
from slipstream.config.schema import Config
from slipstream.distributed.mesh import Parallel
from slipstream.errors import UserError
from slipstream.models.moe import MoE


def parallelize(model: nn.Module, parallel: Parallel, cfg: Config,
                init_model: Callable[[nn.Module], Any] | None = None, device=None) -> nn.Module:
    """Apply every configured technique to `model`, in the documented order.

    init_model: for a model on the meta device, the function that allocates and initializes it
    (it must write only a rank's own shards of sharded parameters; see
    distributed.data_parallel.materialize_sharded). device: where this rank trains (default: the
    job's device for this rank)."""
    dims, device = parallel.dims, device or parallel.device
    if dims.pp > 1:
        # Pipeline parallelism first: it cuts the model into this rank's stages (initialized
        # from the seed as one process would), and every later step applies to each stage as
        # it would to a whole model.
        from slipstream.distributed.pipeline_parallel import apply_pipeline_parallel

        return apply_pipeline_parallel(model, parallel, cfg,
                                       lambda stage: _parallelize_part(stage, parallel, cfg, device))
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and init_model is None:
        raise UserError("the model is on the meta device; pass init_model= (a function that materializes "
                        "and initializes it) or build it on a real device")
    if not on_meta:
        model = model.to(device)
    elif dims.strategy not in SHARDED:
        # One device or DDP: this rank holds the whole model anyway. Materialize now, so every
        # step below sees real parameters, as with a model built on a device.
        init_model(model)
        model = model.to(device)  # an init function may build on the host: train where the batches are
        on_meta = False
    model = _parallelize_part(model, parallel, cfg, device)
    if on_meta:  # last, after sharding: each rank allocates only its own shards of the parameters
        init_model(model)
    return model


def _parallelize_part(model: nn.Module, parallel: Parallel, cfg: Config, device) -> nn.Module:
    """The chain after the pipeline split, for a whole model or one pipeline stage."""
    dims = parallel.dims
    # fp8 replaces nn.Linear modules with torchao's Float8Linear: before any step that hooks or
    # wraps a module (tensor parallel's styles register hooks on the linears themselves; with
    # fp8 they are torchao's float8 styles, which cast to fp8 before their all-gathers).
    if cfg.precision.fp8:
        from slipstream.optimize.precision import apply_fp8

        model = apply_fp8(model, device, tp=dims.tp)
    # Quantization-aware training swaps the blocks' linears too (torchao's FakeQuantizedLinear),
    # at the same place and for the same reason; the two are exclusive (config/load.py refuses
    # both at once, and QAT with tensor parallelism: its fake quantizers compute their scales
    # over the whole weight, not a DTensor shard). AC, compile and FSDP then wrap the swapped
    # modules like any nn.Linear.
    if cfg.quant.qat != "none":
        from slipstream.optimize.qat import apply_qat

        model = apply_qat(model, cfg.quant)
    # Sparsity masks after the linears are swapped (a swap would drop their buffers) and before
    # everything that wraps or shards them: compile sees plain linears (the masks are applied to
    # the weights between steps, not in the forward), DDP replicates the masks with the model.
    # Refused with tp, pp and FSDP2 (config/sparsity_rules.py: whole masks, sharded weights).
    if cfg.sparsity.method != "none":
        model = apply_sparsity(model, parallel, cfg)

    # Model parallelism inside the layer next: it splits the linears (tp) and the attention
    # (cp) that activation checkpointing, compile and data parallelism then wrap.
    if dims.tp > 1:
        model = apply_tensor_parallel(model, parallel, cfg)
        if cfg.parallel.async_tp:  # before compile: Inductor reads the switch when it compiles the blocks
            from slipstream.distributed.tensor_parallel import enable_async_tp

            enable_async_tp(parallel.tp_mesh)
    if dims.cp > 1:
        model = apply_context_parallel(model, parallel, cfg)
    # Mixture of experts: the experts split over the ep ranks (all-to-all dispatch), and every MoE
    # layer's token counts summed over the data-parallel ranks (the whole batch's balance).
    if any(isinstance(m, MoE) for m in model.modules()):
        from slipstream.distributed.expert_parallel import apply_expert_parallel

        model = apply_expert_parallel(model, parallel, cfg)

    # AC before compile, so compile traces the recompute regions (selective AC is then a
    # compiler-visible policy, not a graph break).
    if cfg.activations.checkpointing != "none":
        model = apply_activation_checkpointing(model, cfg)

    # Compile before data parallelism: FSDP's hooks and DDP's buckets stay outside the
    # compiled graphs (per block with scope = blocks, one graph per FSDP unit).
    if cfg.compile.scope != "off":
        model = apply_compile(model, cfg)

    if cfg.parallel.sync_batchnorm:
        from slipstream.distributed.data_parallel import apply_sync_batchnorm

        model = apply_sync_batchnorm(model, parallel)

    if dims.strategy in REPLICATED and dims.pp == 1:  # a pipeline's stages average their own (pipeline_parallel)
        from slipstream.distributed.data_parallel import apply_ddp

        model = apply_ddp(model, cfg, parallel)  # broadcasts rank 0's parameters to every rank
    elif dims.strategy in SHARDED:
        from slipstream.distributed.data_parallel import apply_fsdp

        model = apply_fsdp(model, cfg, parallel)
    return model


def apply_tensor_parallel(model: nn.Module, parallel: Parallel, cfg: Config) -> nn.Module:
    from slipstream.distributed.tensor_parallel import apply_tensor_parallel as split_over_tp
    from slipstream.distributed.tensor_parallel import check_model_splits, check_tensor_parallel
    from slipstream.distributed.pipeline_stages import TransformerStage
    from slipstream.models.transformer import Transformer

    check_tensor_parallel(cfg, parallel.dims.tp)
    if isinstance(model, (Transformer, TransformerStage)):  # a user model's own plan decides what it splits
        check_model_splits(model.cfg, parallel.dims.tp)
    return split_over_tp(model, parallel.tp_mesh, cfg)


def apply_context_parallel(model: nn.Module, parallel: Parallel, cfg: Config) -> nn.Module:
    from slipstream.distributed.context_parallel import ContextParallel, check_context_parallel
    from slipstream.distributed.context_parallel import apply_context_parallel as split_the_sequence

    check_context_parallel(cfg, parallel.dims.cp, parallel.dims.tp, parallel.device)
    return split_the_sequence(model, ContextParallel(parallel.cp_mesh, cfg.parallel.cp_load_balance,
                                                     kernel=cfg.parallel.cp_attention))


def apply_sparsity(model: nn.Module, parallel: Parallel, cfg: Config) -> nn.Module:
    from slipstream.config.sparsity_rules import check_sparsity_rules
    from slipstream.optimize.sparsity import apply_sparsity as register_masks

    check_sparsity_rules(cfg)  # a Config built in code was never loaded
    if parallel.dims.strategy in SHARDED:  # dp_strategy = auto may have resolved to one
        raise UserError(f"sparsity.method = {cfg.sparsity.method} does not work with dp_strategy = "
                        f"{parallel.dims.strategy}: FSDP2 holds only a shard of each weight between steps, the "
                        "masks are whole tensors; use --parallel.dp_strategy=ddp (or zero1, none)")
    return register_masks(model, cfg.sparsity)


def _has_blocks(model: nn.Module) -> bool:
    # A whole transformer's ModuleList, or a pipeline stage's ModuleDict of its blocks.
    return isinstance(getattr(model, "blocks", None), (nn.ModuleList, nn.ModuleDict))


def apply_activation_checkpointing(model: nn.Module, cfg: Config) -> nn.Module:
    if not _has_blocks(model):
        raise UserError("activations.checkpointing works on models with a `blocks` nn.ModuleList "
                        "(slipstream transformers); for your own model apply torch.utils.checkpoint "
                        "inside it, or set --activations.checkpointing=none")
    from slipstream.optimize.activations import apply_activation_checkpointing as wrap_blocks

    return wrap_blocks(model, cfg.activations.checkpointing, every=cfg.activations.every)


def apply_compile(model: nn.Module, cfg: Config) -> nn.Module:
    from slipstream.optimize.compile import apply_compile as compile_in_place
    from slipstream.optimize.compile import configure_compile_cache

    if cfg.compile.scope == "blocks" and not _has_blocks(model):
        raise UserError("compile.scope = blocks needs a model with a `blocks` nn.ModuleList; "
                        "use --compile.scope=model for your own model")
    configure_compile_cache(cfg.compile.cache_dir or None)
    return compile_in_place(model, cfg.compile.scope, mode=cfg.compile.mode, fullgraph=cfg.compile.fullgraph)
