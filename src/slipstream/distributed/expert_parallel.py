"""Expert parallelism and the MoE layers' statistics across ranks.

    ep ranks (consecutive data-parallel ranks) split each MoE layer's experts: rank j holds
    experts [j E/ep, (j+1) E/ep), as a DTensor sharded on dim 0 over the `ep` mesh dim (so DCP
    reshards them between ep degrees). One layer's forward on a rank:

      tokens sorted by expert --(all-to-all: counts)--> how many rows each rank receives
        --(all-to-all: rows)--> received rows, grouped by source rank, then expert
        -> re-sorted expert-major -> local experts (grouped GEMM) -> back in arrival order
        --(all-to-all: rows)--> the results, in the order they were sent

    Gradients: each rank's loss is its own tokens' mean; the expert weights collect the
    contributions of every ep rank's tokens (through the all-to-all's backward), so their
    gradient is scaled by 1/ep here, and the data-parallel reduction over the ranks that hold
    the same experts (dp/ep of them: FSDP over `dp_mod_ep`) averages the rest: 1/dp overall,
    exactly one process's gradient of the mean over the global batch.

Every MoE layer (ep = 1 too) also gets `reduce_counts`: the per-expert token counts are summed
over the ranks that hold other tokens of the batch (data parallel, context parallel), so the
auxiliary loss's f and the balancing bias are the whole batch's, as in one process.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from slipstream.config.schema import Config
from slipstream.errors import UserError
from slipstream.models.moe import GroupedExperts, MoE, expert_ffn


def apply_expert_parallel(model: nn.Module, parallel, cfg: Config) -> nn.Module:
    """Wire every MoE layer of `model` (a whole model or a pipeline stage) to the job's ranks."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        return model
    token_dims = _token_mesh_dims(parallel)
    if token_dims:
        for layer in layers:
            layer.reduce_counts = CountReducer(token_dims)
    ep = parallel.dims.ep
    if ep > 1:
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = parallel.ep_mesh["ep"]
        for layer in layers:
            experts = layer.experts
            for name, param in list(experts.named_parameters(recurse=False)):
                # Each rank keeps its own experts (no communication: every rank holds the same full
                # values, or none yet on the meta device).
                sharded = distribute_tensor(param.data, mesh, [Shard(0)], src_data_rank=None)
                setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
            experts.compute = ExpertDispatch(mesh.get_group(), ep, experts.n_experts)
    return model


def shard_experts_for_fsdp(block: nn.Module, parallel, options: dict[str, Any]) -> None:
    """FSDP over the ranks that hold the same experts (dp_mod_ep), before the block's own unit
    (which then leaves them alone). With ep = 1 the experts stay in the block's unit."""
    if parallel.dims.ep == 1:
        return
    from torch.distributed.fsdp import fully_shard

    for module in block.modules():
        if isinstance(module, GroupedExperts):
            fully_shard(module, **{**options, "mesh": parallel.ep_mesh["dp_mod_ep"]})


class CountReducer:
    """Sums a layer's per-expert counts over the ranks that see other tokens of the batch."""

    def __init__(self, mesh_dims: list[tuple[Any, int]]):
        self.mesh_dims = mesh_dims  # (mesh, dim) pairs; a multi-dim group is reduced one dim at a time

    def __call__(self, counts: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        for mesh, dim in self.mesh_dims:
            counts = funcol.all_reduce(counts, "sum", (mesh, dim))  # communicates: E integers
        return funcol.wait_tensor(counts)


def _token_mesh_dims(parallel) -> list[tuple[Any, int]]:
    """The (mesh, dim) pairs over which ranks hold different tokens of an MoE layer's batch: the
    data-parallel dims (with cp folded in). Tensor-parallel ranks hand the layer the same tokens."""
    if parallel.mesh is None or parallel.dims.dp * parallel.dims.cp == 1:
        return []
    mesh = parallel.dp_mesh
    return [(mesh, dim) for dim in range(mesh.ndim) if mesh.size(dim) > 1]


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `scale` (the expert weights' 1/ep)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class ExpertDispatch:
    """GroupedExperts.compute under expert parallelism (see the module doc)."""

    def __init__(self, group, ep: int, n_experts: int):
        self.group, self.ep, self.n_experts = group, ep, n_experts
        self.local = n_experts // ep
        self.received_rows = 0  # rows this rank computed since the last read (the doctor's skew)

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, w_up, w_gate, w_down, gemm: str,
                 activation: str = "gelu") -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

        ep, local = self.ep, self.local
        # How many rows of each of its local experts every rank will receive, by source rank.
        received_counts = all_to_all_single(counts, None, None, self.group)  # communicates: E integers
        received_counts = received_counts.view(ep, local)
        send = counts.view(ep, local).sum(dim=1).tolist()  # host sync: the split sizes
        receive = received_counts.sum(dim=1).tolist()  # host sync (same wait as above)
        rows = all_to_all_single_autograd(x, receive, send, self.group)  # communicates: the routed rows
        # Arrival order is (source rank, local expert); the grouped GEMM wants expert-major.
        block = torch.repeat_interleave(torch.arange(ep * local, device=x.device), received_counts.flatten())
        expert_major = torch.argsort((block % local) * ep + block // local, stable=True)
        weights = [_ScaleGrad.apply(w.to_local(), 1.0 / ep) if w is not None else None
                   for w in (w_up, w_gate, w_down)]
        y = expert_ffn(rows[expert_major], received_counts.sum(dim=0), *weights, gemm=gemm, activation=activation)
        self.received_rows += rows.shape[0]
        back = torch.empty_like(y).index_copy(0, expert_major, y)  # arrival order again
        return all_to_all_single_autograd(back, send, receive, self.group)  # communicates: the results


def check_expert_parallel(cfg: Config, dims) -> None:
    """The expert-parallel rules that need the degrees (before joining the process group)."""
    if dims.ep == 1:
        return
    if dims.cp > 1:
        raise UserError("parallel.ep > 1 with parallel.cp > 1 is not supported; set --parallel.cp=1 "
                        "(or --parallel.ep=1)")
    if dims.strategy in ("ddp", "zero1") and dims.dp != dims.ep:
        raise UserError(f"parallel.ep = {dims.ep} with dp_strategy = {dims.strategy} needs ep = the data-parallel "
                        f"degree ({dims.dp}): the ranks holding the same experts are averaged by FSDP; use "
                        "--parallel.dp_strategy=fsdp (or hsdp)")
    if dims.strategy == "zero1":
        raise UserError("parallel.ep > 1 with dp_strategy = zero1 is not supported; use ddp or fsdp")
    if cfg.optim.offload:
        raise UserError("parallel.ep > 1 with optim.offload is not supported (the offloaded optimizer keeps plain "
                        "copies of whole parameters); use --parallel.dp_strategy=fsdp --parallel.offload=true")
    if cfg.parallel.local_sgd_period:
        raise UserError("parallel.ep > 1 with parallel.local_sgd_period: local SGD averages every parameter over the "
                        "data-parallel ranks, and expert-parallel ranks hold different experts; set "
                        "--parallel.local_sgd_period=0")
