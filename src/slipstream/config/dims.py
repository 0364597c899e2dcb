"""Parallel degrees as config-level facts: which strategies shard, which replicate, and the
validated degrees (`ParallelDims`) a config gives on a world size.

Bottom layer (beside the schema): the planner (plan/) sizes layouts with these, and
distributed/mesh.py builds the process group and device mesh from them. Nothing here
touches torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass

from slipstream.config.schema import Config, ParallelConfig
from slipstream.errors import UserError

SHARDED = ("zero2", "fsdp", "hsdp")   # FSDP2 fully_shard strategies
REPLICATED = ("ddp", "zero1")         # DistributedDataParallel strategies
# Pipeline schedules that run one stage per pp rank, and the V schedules that run exactly two
# (rank r holds stages r and 2 pp - 1 - r); the others loop pp_virtual_stages stages per rank.
PP_ONE_STAGE = ("gpipe", "1f1b")
PP_V_SHAPED = ("zbv", "dualpipev")
# The zero-bubble schedules: each backward runs as an input-gradient pass, later a weight-gradient pass.
PP_SPLIT_BACKWARD = ("interleaved-zero-bubble", "zbv", "dualpipev")


@dataclass(frozen=True)
class ParallelDims:
    """Validated degrees; their product is the world size."""

    strategy: str
    dp_replicate: int
    dp_shard: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches one step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_mesh_dims(self) -> tuple[tuple[str, int], ...]:
        """The data-parallel dims of the mesh (what DDP replicates over and FSDP shards over)."""
        if self.strategy == "hsdp":
            return (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard))
        if self.strategy in SHARDED:
            return (("dp_shard", self.dp_shard),)
        return (("dp_replicate", self.dp_replicate),)

    @property
    def mesh_dims(self) -> tuple[tuple[str, int], ...]:
        """Every dim of the mesh, outermost first (the planner's order): pp, data parallel, cp,
        then tp innermost, so the ranks of one tensor-parallel group are consecutive (one node)
        and a pipeline's point-to-point traffic crosses the slowest links only once per stage."""
        return (((("pp", self.pp),) if self.pp > 1 else ()) + self.dp_mesh_dims
                + ((("cp", self.cp),) if self.cp > 1 else ()) + ((("tp", self.tp),) if self.tp > 1 else ()))

    @property
    def same_batch(self) -> int:
        """Ranks that read the same batch (one tp x cp x pp group); each batch is counted once."""
        return self.tp * self.cp * self.pp

    def dp_rank(self, rank: int) -> int:
        """Which data-parallel slice a global rank reads: the ranks of one tp x cp group, and the
        stages of one pipeline (pp is the outermost mesh dim), share it."""
        return (rank // (self.tp * self.cp)) % self.dp

    def pp_rank(self, rank: int) -> int:
        """Which pipeline rank (outermost mesh dim) a global rank is."""
        return rank // (self.dp * self.cp * self.tp)


def resolve_parallel_dims(p: ParallelConfig, world_size: int, local_world_size: int = 1) -> ParallelDims:
    """Turn the config's degrees into a consistent set, or explain which one does not fit."""
    other = p.tp * p.pp * p.cp
    if world_size % other:
        raise UserError(f"parallel.tp x pp x cp = {p.tp} x {p.pp} x {p.cp} = {other} does not divide the world "
                        f"size {world_size}; choose degrees whose product divides it")
    dp = world_size // other
    strategy = p.dp_strategy
    if strategy == "auto":
        # Tensor parallelism composes with FSDP (not DDP): with tp the data-parallel dims shard.
        # Context-parallel ranks average their gradients like data-parallel ones: FSDP over both.
        strategy = ("fsdp" if p.cp > 1 else "none") if dp == 1 else "fsdp" if p.tp > 1 else "ddp"
    replicate, shard = p.dp_replicate, p.dp_shard
    if strategy == "none":
        if dp > 1:
            raise UserError(f"parallel.dp_strategy = none, but {world_size} processes were launched; choose "
                            "ddp, zero1, zero2, fsdp or hsdp (or launch one process)")
        replicate, shard = _check_fixed("none", replicate, shard, 1, 1)
    elif strategy in REPLICATED:
        replicate, shard = _check_fixed(strategy, replicate, shard, dp, 1)
    elif strategy in ("zero2", "fsdp"):
        replicate, shard = _check_fixed(strategy, replicate, shard, 1, dp)
    else:  # hsdp: shard inside a node, replicate across nodes, unless told otherwise
        if replicate and shard:
            pass
        elif shard:
            replicate = dp // shard if dp % shard == 0 else 0
        elif replicate:
            shard = dp // replicate if dp % replicate == 0 else 0
        else:
            # A node's ranks minus its tp / cp / pp groups: the shard group stays inside the node.
            shard = min(max(1, local_world_size // other), dp)
            replicate = dp // shard if dp % shard == 0 else 0
        if replicate * shard != dp:
            raise UserError(f"hsdp needs parallel.dp_replicate x dp_shard = {dp} (the data-parallel degree: world "
                            f"{world_size} / (tp x pp x cp)); got dp_replicate = {p.dp_replicate or 'auto'}, "
                            f"dp_shard = {p.dp_shard or 'auto'}. Set both so their product is {dp}")
    if dp % p.ep:
        raise UserError(f"parallel.ep = {p.ep} must divide the data-parallel degree {dp}")
    return ParallelDims(strategy, replicate, shard, p.tp, p.pp, p.cp, p.ep)


def virtual_stages(p: ParallelConfig) -> int:
    """Pipeline stages per pp rank: parallel.pp_virtual_stages, or the schedule's natural count."""
    if p.pp_virtual_stages:
        return p.pp_virtual_stages
    return 1 if p.pp_schedule in PP_ONE_STAGE else 2


def pp_layers(p: ParallelConfig) -> list[int] | None:
    """parallel.pp_layers as a list of ints (None: balance the split)."""
    text = p.pp_layers.strip()
    if not text:
        return None
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise UserError(f"parallel.pp_layers = {p.pp_layers!r}: give blocks per stage as comma-separated integers, "
                        "e.g. \"4,4,3,3\" (or leave it empty to balance the stages)") from None


def check_pipeline_config(cfg: Config) -> None:
    """The pipeline rules that need only the config (checked when it is loaded)."""
    p = cfg.parallel
    if p.pp == 1:
        return
    v = virtual_stages(p)
    if p.pp_schedule in PP_ONE_STAGE and v != 1:
        raise UserError(f"parallel.pp_schedule = {p.pp_schedule} runs exactly 1 stage per rank, got "
                        f"parallel.pp_virtual_stages = {v}; set it to 1 (or 0) or use interleaved-1f1b")
    if p.pp_schedule in PP_V_SHAPED and v != 2:
        raise UserError(f"parallel.pp_schedule = {p.pp_schedule} runs exactly 2 stages per rank (a V), got "
                        f"parallel.pp_virtual_stages = {v}; set it to 2 (or 0)")
    stages = p.pp * v
    if stages > cfg.model.n_layer:
        raise UserError(f"{stages} pipeline stages (parallel.pp {p.pp} x {v} per rank) for a model of "
                        f"{cfg.model.n_layer} layers: every stage needs at least one block; lower parallel.pp or "
                        "pp_virtual_stages")
    layers = pp_layers(p)
    if layers is not None and (len(layers) != stages or min(layers) < 1 or sum(layers) != cfg.model.n_layer):
        raise UserError(f"parallel.pp_layers = {p.pp_layers!r} must give {stages} stages (pp x virtual stages) "
                        f"of at least one block each, adding up to model.n_layer = {cfg.model.n_layer}")
    sequences = cfg.train.micro_batch_size * cfg.train.grad_accum_steps
    micro = pp_microbatches(cfg)
    if sequences % micro:
        raise UserError(f"parallel.pp_microbatches = {micro} must divide the sequences one data-parallel rank "
                        f"processes per step (train.micro_batch_size x grad_accum_steps = {sequences})")
    # torch's own minimums (its other schedules check their rounds when built, on every rank alike).
    least = {"1f1b": p.pp, "dualpipev": stages}.get(p.pp_schedule, 1)
    if micro < least:
        raise UserError(f"parallel.pp_schedule = {p.pp_schedule} needs at least {least} micro-batches, got "
                        f"parallel.pp_microbatches = {micro}; raise train.micro_batch_size x grad_accum_steps "
                        f"(now {sequences}) or pp_microbatches to at least {least}")
    if cfg.train.fused_loss:
        raise UserError("train.fused_loss with parallel.pp > 1: the last stage computes the plain loss; "
                        "set --train.fused_loss=false")
    if cfg.optim.in_backward:
        raise UserError("optim.in_backward with parallel.pp > 1: the pipeline's schedule runs the backward; "
                        "set --optim.in_backward=false")
    if cfg.precision.autocast == "fp16":
        raise UserError("fp16 loss scaling with parallel.pp > 1 is not supported; use --precision.autocast=bf16")
    if cfg.compile.scope == "model":
        raise UserError("compile.scope = model with parallel.pp > 1: each rank holds stages, not the model; "
                        "use --compile.scope=blocks")
    if cfg.activations.checkpointing == "offload":
        raise UserError("activations.checkpointing = offload with parallel.pp > 1 is not supported; "
                        "use full or selective")
    if p.pp_schedule in PP_SPLIT_BACKWARD and cfg.activations.checkpointing == "selective":
        # Measured on torch 2.13: their input-gradient pass, then weight-gradient pass, run the
        # saved selective-checkpoint values twice ("Trying to backward an extra time").
        raise UserError(f"activations.checkpointing = selective with parallel.pp_schedule = {p.pp_schedule} (a "
                        "zero-bubble schedule, which splits each backward in two) is not supported; use "
                        "--activations.checkpointing=full or a 1f1b / interleaved-1f1b schedule")


def pp_microbatches(cfg: Config) -> int:
    """parallel.pp_microbatches, or one sequence per micro-batch (the smallest bubble)."""
    return cfg.parallel.pp_microbatches or cfg.train.micro_batch_size * cfg.train.grad_accum_steps


def _check_fixed(strategy: str, replicate: int, shard: int, want_replicate: int, want_shard: int) -> tuple[int, int]:
    for name, given, want in (("dp_replicate", replicate, want_replicate), ("dp_shard", shard, want_shard)):
        if given not in (0, want):
            raise UserError(f"parallel.{name} = {given} does not fit dp_strategy = {strategy}, which needs "
                            f"{name} = {want} here; leave it at 0 (derived) or choose dp_strategy = hsdp")
    return want_replicate, want_shard


def check_low_bit_state(cfg: Config, strategy: str, tp: int) -> None:
    """optim.state_dtype = int8 / int4 (torchao's low-bit AdamW) runs where the parameters are
    plain tensors and the optimizer is slipstream's own: one process, ddp, pp, optim.offload,
    optim.in_backward. ZeRO-1 builds torch's AdamW inside ZeroRedundancyOptimizer; FSDP2 and
    tensor parallelism hand the optimizer DTensors, which torchao supports but slipstream has not
    tested (nor their checkpoints): refused rather than run untested."""
    dtype = cfg.optim.state_dtype
    if dtype not in ("int8", "int4"):
        return
    if strategy == "zero1":
        raise UserError(f"optim.state_dtype = {dtype} cannot be combined with dp_strategy = zero1 (ZeRO-1 shards "
                        "torch's plain AdamW state); use --parallel.dp_strategy=ddp with the low-bit state (it "
                        "is already about 1/4 or 1/8 of fp32's), or --optim.state_dtype=fp32")
    if strategy in SHARDED or tp > 1:
        where = f"dp_strategy = {strategy}" if strategy in SHARDED else f"parallel.tp = {tp}"
        raise UserError(f"optim.state_dtype = {dtype} (torchao's low-bit AdamW) with {where} (DTensor parameters) "
                        "is not supported yet; use --optim.state_dtype=bf16 with sharding, or "
                        "--parallel.dp_strategy=ddp (or a single process) with the low-bit state")


def check_compatibility(cfg: Config, dims: ParallelDims) -> None:
    """Combinations that cannot work, refused before any work starts."""
    s, p = dims.strategy, cfg.parallel
    if s not in SHARDED and (p.param_dtype != "none" or p.reduce_dtype != "none" or p.offload):
        raise UserError(f"parallel.param_dtype, reduce_dtype and offload are FSDP settings; with dp_strategy = {s} "
                        "use precision.autocast, parallel.comm_hook and optim.offload instead")
    if dims.tp > 1 and s not in ("none", "fsdp", "hsdp"):
        raise UserError(f"parallel.tp > 1 composes with dp_strategy none, fsdp or hsdp (FSDP2 shards the "
                        f"tensor-parallel DTensors over the data-parallel dims); got {s}. Use --parallel.dp_strategy=fsdp")
    if dims.cp > 1 and s not in ("ddp", "fsdp", "hsdp"):
        raise UserError(f"parallel.cp > 1: the context-parallel ranks average their gradients like data-parallel "
                        f"ranks, which dp_strategy = {s} does not do; use --parallel.dp_strategy=fsdp (or ddp)")
    if dims.pp > 1 and s not in ("none", "ddp", "fsdp", "hsdp"):
        raise UserError(f"parallel.pp > 1 runs with dp_strategy none, ddp, fsdp or hsdp over the pipeline replicas; "
                        f"got {s}. Use --parallel.dp_strategy=fsdp (or ddp)")
    if dims.pp > 1 and dims.cp > 1:
        raise UserError("parallel.pp > 1 does not compose with parallel.cp yet; set --parallel.cp=1 "
                        "(or --parallel.pp=1)")
    if dims.pp > 1 and (p.local_sgd_period or p.comm_hook != "none" or p.static_graph or p.find_unused_parameters):
        # Under a pipeline the stages are not DDP modules: their gradients are averaged after the
        # schedule (distributed/pipeline_parallel.py), so DDP's own settings would do nothing.
        raise UserError("parallel.local_sgd_period, comm_hook, static_graph and find_unused_parameters are DDP "
                        "settings, which parallel.pp > 1 does not use (the stages' gradients are averaged after "
                        "the schedule); leave them at their defaults")
    if dims.cp > 1 and dims.tp > 1 and s == "ddp":
        raise UserError("parallel.cp and parallel.tp together need dp_strategy = fsdp or hsdp")
    if p.async_tp:
        # Inductor's micro-pipeline pass rewrites the all-gather -> matmul and matmul ->
        # reduce-scatter pairs of sequence parallelism inside compiled graphs: without tp, SP or
        # compile there is nothing for it to overlap, and the switch would silently do nothing.
        missing = [what for what, ok in (("--parallel.tp > 1", dims.tp > 1),
                                         ("--parallel.sequence_parallel=true", p.sequence_parallel),
                                         ("--compile.scope=blocks (or model)", cfg.compile.scope != "off")) if not ok]
        if missing:
            raise UserError("parallel.async_tp overlaps sequence parallelism's all-gathers and reduce-scatters with "
                            f"the matmuls inside compiled graphs; it needs {', '.join(missing)}, or set "
                            "--parallel.async_tp=false")
    check_low_bit_state(cfg, s, dims.tp)
    if s == "none":
        return
    if cfg.optim.in_backward:
        raise UserError(f"optim.in_backward steps each parameter before data parallelism has reduced its gradient; "
                        f"it cannot be combined with dp_strategy = {s}. Use fsdp/zero2 to save gradient memory")
    if s in SHARDED:
        if p.comm_hook != "none" or p.local_sgd_period:
            raise UserError(f"parallel.comm_hook and parallel.local_sgd_period are DDP features; dp_strategy = {s} "
                            "reduces gradients with FSDP (use parallel.reduce_dtype=bf16 to compress them)")
        if cfg.optim.offload:
            raise UserError(f"optim.offload is the single-device/DDP optimizer offload; with dp_strategy = {s} use "
                            "--parallel.offload=true (FSDP CPU offload)")
        if cfg.precision.autocast == "fp16":
            raise UserError(f"fp16 loss scaling is not supported with dp_strategy = {s}; use "
                            "--precision.autocast=bf16 or --parallel.param_dtype=bf16")
        if cfg.optim.state_dtype != "fp32" and p.offload:
            raise UserError("optim.state_dtype = bf16 with parallel.offload is not supported; choose one")
    else:
        if p.static_graph and cfg.train.grad_accum_steps > 1:
            raise UserError("parallel.static_graph cannot be combined with train.grad_accum_steps > 1 (DDP's static "
                            "graph does not support no_sync); drop one of them")
        if p.local_sgd_period and s != "ddp":
            raise UserError("parallel.local_sgd_period needs dp_strategy = ddp")
        if p.local_sgd_period and p.comm_hook != "none":
            raise UserError("local SGD installs its own communication hook; set parallel.comm_hook = none")
        if s == "zero1" and (cfg.optim.offload or cfg.optim.state_dtype != "fp32"):
            raise UserError("zero1 shards the plain AdamW state; it cannot be combined with optim.offload or "
                            "optim.state_dtype = bf16")
