"""Pipeline parallelism: a slipstream Transformer cut into stages, run by torch's schedules.

    (the stages themselves, their split and placement: distributed/pipeline_stages.py)
    build_pipeline       a rank's stages + torch.distributed.pipelining's PipelineStage and schedule
    pipeline_step        one forward/backward over the global batch (replaces fwd/bwd x grad_accum)
    pipeline_grad_norm   the global gradient norm over every stage (for clipping and the guards)
    PipelineModel        a rank's stages as one module under the unsplit names (optimizer, checkpoints)
    pipeline_sequence_losses   evaluation through the stages, per-sequence losses on every pp rank
    apply_pipeline_parallel    the parallelize chain's first step: split, then the chain per stage

The model code (models/transformer.py) knows nothing of this: a stage holds the original
submodules under their original names (`tok_emb`, `blocks.3`, `lm_head`), so the parameter names
of every stage are those of the unsplit model and checkpoints match across pp degrees.

Tied embeddings (GPT-2): the first stage's table and the last stage's head are one parameter in
one process. Here the head always holds its own copy (on another rank, or on the same rank under
a V schedule, where FSDP could not shard one parameter in two stages' units); after each step both
copies get the sum of their gradients, so they take identical updates and stay equal, and the
gradient norm counts the table once.

Loss scaling: the schedules' own `scale_grads` divides each stage's gradients by the number of
micro-batches after the step. We never let the schedule scale: the loss of each micro-batch is
divided by the number of micro-batches before its backward (scale_grads=False), which gives the
single process's mean over the global batch, and the sum of the micro-batch losses is the logged
(mean) loss.

Data parallelism across pipeline replicas: FSDP/HSDP shard each stage (torch's stages drive its
gradient reduction); with dp_strategy ddp the stages stay plain modules and their gradients are
averaged over the data-parallel ranks once the schedule has run (torch 2.13's DDP reducer cannot
follow the multi-stage and GPipe schedules: it asserts on its first bucket rebuild).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from slipstream.config.schema import ModelConfig
from slipstream.distributed.pipeline_stages import (ONE_STAGE_PER_RANK, SCHEDULES, TransformerStage, build_stage_modules,
                                                    check_schedule, named_parameters, split_layers, split_stages,
                                                    stage_costs, stage_indices, stage_rank)
from slipstream.errors import UserError
from slipstream.models.transformer import Transformer

# --- 4. schedule and step --------------------------------------------------------------------------

@dataclass
class Pipeline:
    """One pp rank's part of the pipeline."""
    schedule: Any                      # a torch.distributed.pipelining schedule
    modules: list[TransformerStage]    # this rank's stage modules, in the schedule's order
    stages: list[Any]                  # their PipelineStage wrappers (submod: the module, or its DDP wrapper)
    n_microbatches: int
    pp_group: Any = None               # the process group of the pipeline's ranks
    last_rank: int = 0                 # the pp rank (in pp_group) holding the last stage: it has the loss
    tied: bool = False                 # tied embeddings: the head's copy and the table sum their gradients
    tied_group: Any = None             # the group of the 2 ranks holding the copies (None: both here, or neither)
    dp_group: Any = None               # dp_strategy ddp: gradients are averaged over this group after a step
    busy_s: float = 0.0                # host time this rank spent in its stages' forward/backward chunks
    step_s: float = 0.0                # wall time of the schedule's steps (busy_s / step_s: 1 - bubble)
    planned_bubble: float | None = None  # the planner's idle share for this schedule and micro-batch count
    has_first: bool = field(init=False)
    has_last: bool = field(init=False)

    def __post_init__(self) -> None:
        self.has_first = any(m.is_first for m in self.modules)
        self.has_last = any(m.is_last for m in self.modules)
        for stage in self.stages:
            _time_chunks(stage, self)

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return named_parameters(self.modules)

    @property
    def tied_copy(self) -> nn.Parameter | None:
        """The head's copy of a tied embedding on this rank (its gradient is the table's, counted
        with the first stage), else None."""
        if not self.tied or not self.has_last:
            return None
        return next(m for m in self.modules if m.is_last).lm_head.weight

    def take_bubble(self) -> float | None:
        """This rank's idle share of the pipeline steps since the last call (1 - busy / wall)."""
        bubble = 1.0 - self.busy_s / self.step_s if self.step_s > 0 else None
        self.busy_s = self.step_s = 0.0
        return bubble

    def sequence_losses(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The Evaluator's sequence_loss_fn: per-sequence losses through the stages (model unused)."""
        return pipeline_sequence_losses(self, inputs, targets)

    def batch_loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The Evaluator's loss_fn for plain validation batches: their mean loss through the stages."""
        return pipeline_sequence_losses(self, *batch).mean()

    def interval_record(self, parallel) -> dict[str, float | None]:
        """The log's pipeline numbers: `pp_bubble`, the ranks' mean idle share of the schedule's wall
        time since the last log (CPU only: there the stages' host time is their compute time), and
        `pp_bubble_planned`, the planner's formula. A collective: every rank calls it."""
        bubble = self.take_bubble()
        if self.stages[0].device.type != "cpu" or bubble is None:
            return {"pp_bubble": None, "pp_bubble_planned": self.planned_bubble}
        measured = parallel.mean(torch.tensor(bubble)).item()  # all-reduce + host sync, at the log only
        return {"pp_bubble": measured, "pp_bubble_planned": self.planned_bubble}


def _time_chunks(stage: Any, pipe: Pipeline) -> None:
    """Add the host time of every forward / backward chunk the schedule runs on `stage` to
    pipe.busy_s (the rest of a step is waiting for other stages: the bubble). On CPU the ops run
    synchronously, so this is compute time; on CUDA it would be launch time (not reported)."""
    import time

    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        method = getattr(stage, name, None)
        if method is None:
            continue

        def timed(*args, _method=method, **kwargs):
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                pipe.busy_s += time.perf_counter() - start

        setattr(stage, name, timed)


def build_schedule(name: str, stages: list[Any], n_microbatches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Any:
    """torch's schedule `name` over this rank's PipelineStages. loss_fn(logits, targets) is the mean
    loss of one micro-batch; the schedule backpropagates loss_fn / n_microbatches (see the module
    doc: scale_grads=False), so gradients are those of the mean over the global batch."""
    import torch.distributed.pipelining.schedules as schedules

    check_schedule(name, len(stages))
    if n_microbatches < 1:
        raise UserError(f"parallel.pp_microbatches = {n_microbatches}: need at least 1")
    n_stages = stages[0].num_stages

    def scaled_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(output, target) / n_microbatches

    cls = getattr(schedules, SCHEDULES[name])
    first_arg = stages[0] if name in ONE_STAGE_PER_RANK else stages
    try:
        return cls(first_arg, n_microbatches=n_microbatches, loss_fn=scaled_loss, scale_grads=False)
    except ValueError as e:  # torch's own checks (micro-batches vs stages, rounds)
        raise UserError(f"parallel.pp_schedule = {name!r} cannot run {n_microbatches} micro-batches over "
                        f"{n_stages} stages: {e}; set parallel.pp_microbatches to a multiple of the stage "
                        f"count ({n_stages}) or pick another schedule") from e


def assemble_pipeline(cfg: ModelConfig, schedule: str, modules: list[TransformerStage], parts: list[nn.Module],
                      indices: list[int], n_stages: int, pp_group: dist.ProcessGroup, n_microbatches: int,
                      loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                      device: str | torch.device) -> Pipeline:
    """torch's PipelineStages over `parts` (the stage modules as the rest of the chain left them:
    themselves, sharded in place by FSDP, or wrapped by DDP) and the schedule that runs them."""
    from torch.distributed.pipelining import PipelineStage

    stages = [PipelineStage(part, index, n_stages, torch.device(device), group=pp_group)
              for part, index in zip(parts, indices)]
    for stage in stages:
        _metadata_forward_not_counted(stage)
    pp_size = dist.get_world_size(pp_group)
    return Pipeline(build_schedule(schedule, stages, n_microbatches, loss_fn), modules, stages, n_microbatches,
                    pp_group=pp_group, last_rank=stage_rank(schedule, n_stages - 1, pp_size),
                    tied=cfg.tie_embeddings, tied_group=_tied_group(cfg, schedule, pp_group, n_stages))


def build_pipeline(cfg: ModelConfig, schedule: str, pp_group: dist.ProcessGroup, n_microbatches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                   virtual_stages: int = 1, layers: list[int] | None = None, seq_len: int | None = None,
                   device: str | torch.device = "cpu", seed: int = 0) -> Pipeline:
    """This rank's stages of `cfg`'s Transformer over `pp_group`, and the schedule that runs them.
    layers: the user's layers per stage (parallel.pp_layers), default balanced by stage_costs."""
    check_schedule(schedule, virtual_stages)
    pp_rank, pp_size = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    n_stages = pp_size * virtual_stages
    splits = split_layers(cfg.n_layer, n_stages, layers, stage_costs(cfg, seq_len or cfg.max_seq_len))
    indices = stage_indices(schedule, pp_rank, pp_size, virtual_stages)
    modules = build_stage_modules(cfg, indices, splits, device, seed)
    return assemble_pipeline(cfg, schedule, modules, modules, indices, n_stages, pp_group, n_microbatches,
                             loss_fn, device)


def _tied_group(cfg: ModelConfig, schedule: str, pp_group: dist.ProcessGroup, n_stages: int):
    """Tied embeddings with the embedding and the head on two ranks: the group of those two ranks
    on them (each copy must get the sum of both gradients), else None."""
    pp_size = dist.get_world_size(pp_group)
    owners = (stage_rank(schedule, 0, pp_size), stage_rank(schedule, n_stages - 1, pp_size))
    if not cfg.tie_embeddings or owners[0] == owners[1]:
        return None  # untied, or both copies on one rank (V): summed without communication
    if pp_size == 2:
        return pp_group if dist.get_rank(pp_group) in owners else None
    if dist.get_rank(pp_group) not in owners:
        return None
    ranks = dist.get_process_group_ranks(pp_group)
    # communicates: creates a group of the 2 owners (only they call it: local synchronization)
    return dist.new_group([ranks[owners[0]], ranks[owners[1]]], use_local_synchronization=True)


def _metadata_forward_not_counted(stage) -> None:
    """The stage's first step runs one extra forward to learn its output shapes: MoE layers must
    not count its tokens (or, on a later stage, the placeholder activations it feeds them)."""
    from slipstream.models.moe import not_counted

    for name in ("_forward_metadata_inference", "_shape_inference"):  # torch 2.13 / older
        infer = getattr(stage, name, None)
        if infer is not None:
            def uncounted(*args, _infer=infer, **kwargs):
                with not_counted():
                    return _infer(*args, **kwargs)

            setattr(stage, name, uncounted)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def sum_tied_embedding_grads(pipe: Pipeline) -> None:
    """Make both copies of a tied embedding hold the sum of the embedding's and the head's gradient
    (what the single parameter gets in one process). Under FSDP both copies are sharded alike over
    the same data-parallel ranks, so summing the local shards sums the tables."""
    if not pipe.tied:
        return
    copies = [m.tok_emb.weight for m in pipe.modules if m.is_first] + [m.lm_head.weight for m in pipe.modules if m.is_last]
    for weight in copies:
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        elif hasattr(weight.grad, "placements") and weight.grad.placements != weight.placements:
            # tensor parallel: the table's gradient may come replicated where the table is sharded;
            # both copies' local shards must line up row for row before they are summed.
            weight.grad = weight.grad.redistribute(weight.device_mesh, weight.placements)
    if len(copies) == 2:  # both on this rank (V schedules)
        total = copies[0].grad + copies[1].grad
        for weight in copies:
            weight.grad.copy_(total)
    elif pipe.tied_group is not None:
        dist.all_reduce(_local(copies[0].grad), group=pipe.tied_group)  # communicates: the tied table's gradient, 2 pp ranks


def average_over_data_parallel(pipe: Pipeline) -> None:
    """dp_strategy ddp under a pipeline: every gradient of this rank's stages averaged over the
    data-parallel ranks of the same stages, in one flat buffer (as DDP's buckets would)."""
    if pipe.dp_group is None:
        return
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    # Expert-parallel weights (DTensors over the ep ranks) differ by rank and are complete already
    # (distributed/expert_parallel.py): only the replicated parameters are averaged.
    grads = [p.grad for p in named_parameters(pipe.modules).values()
             if p.grad is not None and not hasattr(p.grad, "device_mesh")]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=pipe.dp_group)  # communicates: all gradients, dp ranks
    for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(averaged)


def pipeline_step(pipe: Pipeline, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor:
    """One forward + backward of the global batch (B, T), split into pipe.n_microbatches micro-batches:
    the pipeline's replacement of `fwd/bwd x grad_accum`. inputs are read on the rank of the first
    stage, targets on the rank of the last (pass None elsewhere). Gradients accumulate into .grad
    (zero them before). Returns the mean loss over the micro-batches, on every pp rank."""
    import time

    for name, batch, needed in (("inputs", inputs, pipe.has_first), ("targets", targets, pipe.has_last)):
        if needed and (batch is None or batch.shape[0] % pipe.n_microbatches):
            size = None if batch is None else batch.shape[0]
            raise UserError(f"the pipeline's global batch ({name}: {size} sequences) must be divisible by "
                            f"parallel.pp_microbatches = {pipe.n_microbatches}; change train.micro_batch_size "
                            f"x grad_accum_steps or pp_microbatches")
    args = (inputs,) if pipe.has_first else ()
    if targets is not None:
        targets = targets.contiguous()  # lm_loss views them flat; a (B, T+1) window's slice is not (no copy if it is)
    losses: list[torch.Tensor] = []
    # Newer torch can skip concatenating the last stage's outputs (we only need the losses); an
    # older step() would pass the unknown keyword on to the model, so ask only where it exists.
    extra = {"return_outputs": False} if "return_outputs" in inspect.signature(pipe.schedule.step).parameters else {}
    start = time.perf_counter()
    # communicates: activations forward and gradients backward between the pp ranks (send/recv)
    pipe.schedule.step(*args, target=targets if pipe.has_last else None, losses=losses, **extra)
    pipe.step_s += time.perf_counter() - start
    sum_tied_embedding_grads(pipe)
    average_over_data_parallel(pipe)
    if pipe.has_last:
        from slipstream.distributed.data_parallel import full_value

        # each is already divided by n_microbatches (loss parallel: a replicated DTensor, no communication)
        loss = torch.stack([full_value(loss).detach().float() for loss in losses]).sum()
    else:
        loss = torch.zeros((), device=pipe.stages[0].device)
    return _from_last_stage(pipe, loss)


def _from_last_stage(pipe: Pipeline, tensor: torch.Tensor) -> torch.Tensor:
    """The last stage's `tensor` on every pp rank (the guards and the logs then agree)."""
    if dist.get_world_size(pipe.pp_group) == 1:
        return tensor
    src = dist.get_global_rank(pipe.pp_group, pipe.last_rank)
    dist.broadcast(tensor, src=src, group=pipe.pp_group)  # communicates: a few floats from the last stage, pp ranks
    return tensor


def pipeline_grad_norm(pipe: Pipeline, params: list[nn.Parameter]) -> torch.Tensor:
    """The global L2 norm of the gradients of every stage, on every pp rank: each rank's sum of
    squares (a tied embedding's second copy left out), summed over the pp group."""
    from slipstream.distributed.data_parallel import full_value, total_grad_norm

    copy = pipe.tied_copy
    grads = [p.grad for p in params if p.grad is not None and p is not copy]
    norm = full_value(total_grad_norm(grads)) if grads else torch.zeros(())
    squares = norm.float().square().to(pipe.stages[0].device)
    dist.all_reduce(squares, group=pipe.pp_group)  # communicates: one float per pp rank
    return squares.sqrt()


# --- 5. the rank's model and evaluation ------------------------------------------------------------

class PipelineModel(nn.Module):
    """One rank's stages seen as one module under the unsplit model's names (`tok_emb`,
    `blocks.3`, `lm_head`): what the optimizer, checkpoints, exports and the memory probe see.
    Its children are the stage modules' own submodules (the same objects), so it holds no second
    copy of anything. It is never called: the pipeline's schedule runs the stages."""

    def __init__(self, pipe: Pipeline):
        super().__init__()
        self.blocks = nn.ModuleDict()
        for module in pipe.modules:
            for name, child in module.named_children():
                if name == "blocks":
                    self.blocks.update(child)  # the same block objects, under their whole-model indices
                elif name not in self._modules:
                    setattr(self, name, child)
        self.cfg = pipe.modules[0].cfg
        self.__dict__["pipeline"] = pipe  # not a submodule: the stages' parameters are reached once, above

    def forward(self, *args, **kwargs):
        raise UserError("a pipelined model runs through its schedule (pipeline_step), not by calling it")


@torch.no_grad()
def pipeline_sequence_losses(pipe: Pipeline, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean token losses (B,) of a batch, on every pp rank: the stages run one after
    the other (evaluation needs no overlap), each rank passing its stage's output on; the last
    stage scores the batch and the losses are sent to every pp rank. Any batch size works.
    (Under loss parallelism the caller's context makes the cross-entropy run on vocabulary shards.)"""
    import torch.nn.functional as F

    from slipstream.distributed.data_parallel import full_value

    pp_size = dist.get_world_size(pipe.pp_group)
    me = dist.get_rank(pipe.pp_group)
    by_index = {stage.stage_index: module for module, stage in zip(pipe.modules, pipe.stages)}
    n_stages = pipe.stages[0].num_stages
    schedule = _schedule_name(pipe)
    B = inputs.shape[0]
    hidden = None
    for index in range(n_stages):
        owner = stage_rank(schedule, index, pp_size)
        if owner != me:
            continue
        previous = stage_rank(schedule, index - 1, pp_size) if index > 0 else me
        if previous != me:
            hidden = _recv_tensor(pipe, previous, inputs.device)
        out = by_index[index](inputs if index == 0 else hidden)
        if index == n_stages - 1:
            logits = out.float()
            losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
            losses = full_value(losses).view(targets.shape).mean(dim=1)
            break
        hidden = out.float()
        following = stage_rank(schedule, index + 1, pp_size)
        if following != me:
            _send_tensor(pipe, hidden, following)
    if not pipe.has_last:
        losses = torch.zeros(B, device=inputs.device)
    return _from_last_stage(pipe, losses)


def _send_tensor(pipe: Pipeline, tensor: torch.Tensor, to: int) -> None:
    """An fp32 tensor of any shape to pp rank `to`: its shape first (the stream's length depends on
    sequence parallelism and the batch), then the values."""
    dst = dist.get_global_rank(pipe.pp_group, to)
    shape = torch.tensor(list(tensor.shape) + [0] * (4 - tensor.dim()), dtype=torch.int64, device=tensor.device)
    dist.send(shape, dst=dst, group=pipe.pp_group)  # communicates: 4 ints to the next stage's pp rank
    dist.send(tensor.contiguous(), dst=dst, group=pipe.pp_group)  # communicates: the stage's output


def _recv_tensor(pipe: Pipeline, source: int, device: torch.device) -> torch.Tensor:
    src = dist.get_global_rank(pipe.pp_group, source)
    shape = torch.zeros(4, dtype=torch.int64, device=device)
    dist.recv(shape, src=src, group=pipe.pp_group)  # communicates: the shape, from the previous stage's pp rank
    tensor = torch.empty([int(n) for n in shape.tolist() if n], device=device)  # host sync: the shape
    dist.recv(tensor, src=src, group=pipe.pp_group)  # communicates: the previous stage's output
    return tensor


def _schedule_name(pipe: Pipeline) -> str:
    return next(name for name, cls in SCHEDULES.items() if type(pipe.schedule).__name__ == cls)


# --- 6. the parallelize chain's pipeline step --------------------------------------------------------

def apply_pipeline_parallel(model: Transformer, parallel: Any, cfg: Any,
                            parallelize_stage: Callable[[nn.Module], nn.Module]) -> PipelineModel:
    """Cut `model` (meta: initialized from cfg.train.seed as one process would; or real) into this
    rank's stages over the mesh's pp dim, run the rest of the chain on each stage
    (`parallelize_stage`: AC, compile, FSDP/DDP), and return the rank's PipelineModel."""
    from slipstream.config.dims import PP_SPLIT_BACKWARD, pp_layers, pp_microbatches, virtual_stages
    from slipstream.models.transformer import lm_loss

    if not isinstance(model, Transformer):
        raise UserError(f"parallel.pp > 1 splits a slipstream Transformer into stages (its `blocks`, with the "
                        f"embedding first and the head last); {type(model).__name__} has no such split. Build the "
                        "pipeline yourself with torch.distributed.pipelining, or set --parallel.pp=1")
    p = cfg.parallel
    v = virtual_stages(p)
    pp_group = parallel.mesh.get_group("pp")
    pp_rank, pp_size = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    n_stages = pp_size * v
    splits = split_layers(model.cfg.n_layer, n_stages, pp_layers(p), stage_costs(model.cfg, cfg.train.seq_len))
    indices = stage_indices(p.pp_schedule, pp_rank, pp_size, v)
    modules = split_stages(model, indices, splits, parallel.device, seed=cfg.train.seed)
    if p.pp_schedule in PP_SPLIT_BACKWARD and cfg.compile.scope != "off":
        # The zero-bubble schedules take input gradients with retain_graph (the weight gradients
        # follow later); a compiled backward that donates its buffers refuses that.
        import torch._functorch.config as functorch_config

        functorch_config.donated_buffer = False
    parts = [parallelize_stage(module) for module in modules]
    pipe = assemble_pipeline(model.cfg, p.pp_schedule, modules, parts, indices, n_stages, pp_group,
                             pp_microbatches(cfg), lm_loss, parallel.device)
    from slipstream.plan.timing import pipeline_bubble

    pipe.planned_bubble = pipeline_bubble(p.pp_schedule, pp_size, v, pp_microbatches(cfg))
    if parallel.dims.strategy == "ddp" and parallel.dims.dp > 1:
        pipe.dp_group = parallel.dp_mesh.get_group()  # see the module doc: no DDP wrapper under a pipeline
    return PipelineModel(pipe)
