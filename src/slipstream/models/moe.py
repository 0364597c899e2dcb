"""Mixture of experts: the MLP of a block becomes n routed experts (+ optional shared ones).

    tokens -> router scores -> top_k experts per token (+ per-expert bias: picks only)
           -> [capacity: drop what an expert cannot take] -> sort by expert
           -> experts (one grouped GEMM, or a matmul per expert) -> weigh -> sum per token
           (+ shared experts on every token)

Balancing: the auxiliary loss (Switch/GShard: n_experts x sum_i f_i P_i, f = the fraction of
routed assignments expert i got, P = its mean router probability), the router z-loss (ST-MoE)
and the auxiliary-loss-free bias (DeepSeek-V3: after each step an expert's bias moves toward
balance; it changes which experts are picked, never how much they weigh). The two losses reach
the router by adding their gradient in backward at the layer's output (`AddAuxLossGrad`), so
they need no path to the training loss: a pipeline stage or an activation-checkpointed block
trains them where it computes them.

No parallelism here. Two attributes are the seams a technique applied from outside replaces:
`MoE.reduce_counts` (sums the per-expert token counts over the ranks that hold other tokens of
the batch, so f and the bias are those of the whole batch, as in one process) and
`GroupedExperts.compute` (expert parallelism sends the tokens to the ranks holding their
experts and back).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from slipstream.config.schema import ModelConfig
from slipstream.models.transformer import relu2


def is_moe_layer(cfg: ModelConfig, index: int) -> bool:
    """Whether block `index` has experts: after the first moe_first_dense, every moe_every-th."""
    return cfg.moe_experts > 0 and index >= cfg.moe_first_dense and (index - cfg.moe_first_dense) % cfg.moe_every == 0


def moe_layer_count(cfg: ModelConfig) -> int:
    """Blocks with experts (closed form: the planner counts absurd depths in constant time)."""
    if cfg.moe_experts == 0 or cfg.n_layer <= cfg.moe_first_dense:
        return 0
    return -(-(cfg.n_layer - cfg.moe_first_dense) // cfg.moe_every)


def expert_hidden(cfg: ModelConfig) -> int:
    from slipstream.models.transformer import mlp_hidden

    return cfg.moe_expert_hidden or mlp_hidden(cfg)


# --- the expert computation ---------------------------------------------------------------------

_GROUPED_OK: dict[tuple[str, torch.dtype], bool] = {}


@torch.compiler.disable  # an eager probe, never traced
def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs for this device and dtype (probed once with a tiny exact case:
    torch 2.13 runs it on CPU in fp32 and bf16; CUDA needs bf16 on Hopper or newer)."""
    key = (device.type if device.type != "cuda" else f"cuda{torch.cuda.get_device_capability(device)}", dtype)
    if key not in _GROUPED_OK:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                a = torch.ones(16, 16, device=device, dtype=dtype)
                b = torch.ones(2, 16, 16, device=device, dtype=dtype)
                offs = torch.tensor([8, 16], device=device, dtype=torch.int32)
                ok = bool((torch._grouped_mm(a, b, offs=offs) == 16).all())  # host sync: once per process
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _GROUPED_OK[key] = ok
    return _GROUPED_OK[key]


# Eager under torch.compile: the split sizes change with the routing, and a compiled graph would be
# recompiled for every new set of them.
@torch.compiler.disable
def _matmul_per_expert(x: torch.Tensor, counts: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (N, in) sorted by expert, counts (E,), w (E, out, in) -> (N, out): one matmul per expert."""
    pieces = torch.split(x, counts.tolist())  # host sync: the split sizes
    # Every expert's matmul runs, an empty one too: its weights then get a (zero) gradient on every rank.
    return torch.cat([F.linear(piece, w[e]) for e, piece in enumerate(pieces)])


class _ContiguousGrad(torch.autograd.Function):
    """Identity; hands backward a contiguous gradient (torch._grouped_mm's backward rejects the
    broadcast gradient a plain .sum() produces, torch 2.13)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _grouped(x: torch.Tensor, counts: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    offs = torch.cumsum(counts, 0, dtype=torch.int32)  # where each expert's rows end
    return _ContiguousGrad.apply(torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))


def expert_ffn(x: torch.Tensor, counts: torch.Tensor, w_up: torch.Tensor, w_gate: torch.Tensor | None,
               w_down: torch.Tensor, gemm: str = "auto", activation: str = "gelu") -> torch.Tensor:
    """The experts' MLPs on tokens sorted by expert: x (N, d), counts (E,) tokens per expert in
    order, weights (E, out, in) as nn.Linear stores them. SwiGLU when w_gate is given, else
    `activation` (gelu, relu, or relu2: relu(up x)^2), as the dense MLP of that model.mlp.
    gemm: grouped (one torch._grouped_mm per matrix), loop (a matmul per expert) or auto."""
    # Autocast does not cover torch._grouped_mm (nor the loop's inputs, which arrive in fp32 from
    # the norm): the experts run in the autocast dtype, like the dense MLP's matmuls.
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    if x.dtype != w_up.dtype:
        w_up, w_down = w_up.to(x.dtype), w_down.to(x.dtype)
        w_gate = w_gate.to(x.dtype) if w_gate is not None else None
    # torch._grouped_mm needs rows aligned to 16 bytes: the model width and the expert width.
    aligned = all(width * x.element_size() % 16 == 0 for width in (x.shape[-1], w_up.shape[1]))
    if gemm == "grouped" and not aligned:
        raise ValueError(f"model.moe_gemm = grouped needs d_model ({x.shape[-1]}) and the expert width "
                         f"({w_up.shape[1]}) to be multiples of {16 // x.element_size()} in {x.dtype}; use auto or loop")
    # Inductor's grouped GEMM takes bf16 only (torch 2.13): a compiled fp32 model loops over the experts.
    compilable = not torch.compiler.is_compiling() or x.dtype == torch.bfloat16
    grouped = gemm == "grouped" or (gemm == "auto" and aligned and compilable
                                    and grouped_mm_supported(x.device, x.dtype))
    mm = _grouped if grouped else _matmul_per_expert
    if w_gate is not None:
        h = F.silu(mm(x, counts, w_gate)) * mm(x, counts, w_up)
    elif activation == "relu2":
        h = relu2(mm(x, counts, w_up))
    elif activation == "relu":
        h = F.relu(mm(x, counts, w_up))
    else:
        h = F.gelu(mm(x, counts, w_up), approximate="tanh")
    return mm(h, counts, w_down)


class GroupedExperts(nn.Module):
    """n experts' weights as 3-D tensors, expert-major (E, out, in): the layout of a grouped GEMM,
    of expert-parallel sharding (dim 0) and of Hugging Face's fused expert weights."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, d, h = cfg.moe_experts, cfg.d_model, expert_hidden(cfg)
        self.n_experts = E
        self.gemm = cfg.moe_gemm
        self.activation = cfg.mlp
        self.w_up = nn.Parameter(torch.empty(E, h, d))
        self.w_gate = nn.Parameter(torch.empty(E, h, d)) if cfg.mlp == "swiglu" else None
        self.w_down = nn.Parameter(torch.empty(E, d, h))
        # How the sorted tokens meet their experts: here, all experts are local. Expert parallelism
        # replaces it with a dispatch to the ranks that hold them (distributed/expert_parallel.py).
        self.compute: Callable[..., torch.Tensor] = expert_ffn

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.compute(x, counts, self.w_up, self.w_gate, self.w_down, self.gemm, activation=self.activation)


class AddAuxLossGrad(torch.autograd.Function):
    """Identity on the layer output; its backward also starts the gradient of `aux` (scaled like
    the training loss: 1 / micro-batches per step), so the balancing losses train the router
    without being added to the loss the loop sees."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


_UNCOUNTED = [0]  # > 0 inside `not_counted()`


@contextlib.contextmanager
def not_counted():
    """Forwards that are not training steps (a pipeline stage's shape inference on its first
    micro-batch) leave the statistics and the balancing bias alone."""
    _UNCOUNTED[0] += 1
    try:
        yield
    finally:
        _UNCOUNTED[0] -= 1


def _in_backward() -> bool:
    """True while autograd runs a backward: activation checkpointing recomputes the forward there,
    and a recomputed forward must not count its tokens a second time."""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """A drop-in MLP: (B, T, d) -> (B, T, d) through the top_k of n experts per token."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        from slipstream.models.transformer import MLP

        E = cfg.moe_experts
        self.n_experts, self.top_k = E, cfg.moe_top_k
        self.router_kind, self.norm_topk, self.route_scale = cfg.moe_router, cfg.moe_norm_topk, cfg.moe_route_scale
        self.aux_coef, self.z_coef, self.bias_rate = cfg.moe_aux_loss, cfg.moe_z_loss, cfg.moe_bias_rate
        self.capacity_factor = None if cfg.moe_dropless else cfg.moe_capacity_factor
        self.router = nn.Linear(cfg.d_model, E, bias=False)
        self.experts = GroupedExperts(cfg)
        self.shared = (MLP(cfg, hidden=cfg.moe_shared_experts * expert_hidden(cfg))
                       if cfg.moe_shared_experts else None)
        # The auxiliary-loss-free balancing bias: saved with the model, updated outside the gradient.
        self.register_buffer("expert_bias", torch.zeros(E), persistent=True)
        # Seams for techniques applied from outside (see the module doc string).
        self.reduce_counts: Callable[[torch.Tensor], torch.Tensor] = lambda counts: counts
        self.aux_grad_scale = 1.0  # the training loop's loss scale per micro-batch (1 / micro-batches)
        self.stats = MoEStats()

    def reset_state(self) -> None:
        """Fresh balancing bias and statistics (the model's init calls it after allocation)."""
        self.expert_bias.zero_()
        self.stats = MoEStats()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        tokens = x.reshape(-1, d)
        N, E, k = tokens.shape[0], self.n_experts, self.top_k
        logits = self.router(tokens)
        logits = logits.float() if logits.element_size() < 4 else logits  # routing in fp32 at least (autocast)
        scores = logits.sigmoid() if self.router_kind == "sigmoid" else logits.softmax(dim=-1)
        # The bias only decides which experts are picked (DeepSeek-V3); the weights come from the scores.
        chosen = torch.topk(scores.detach() + self.expert_bias, k, dim=-1).indices  # (N, k)
        weights = scores.gather(-1, chosen)
        if self.router_kind == "sigmoid" or self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights * self.route_scale
        assigned = chosen.reshape(-1)  # (N k,) token-major
        counts = torch.bincount(assigned, minlength=E)  # this rank's routed assignments per expert
        counting = self.training and torch.is_grad_enabled()  # a training forward (not evaluation)
        # The whole batch's counts (a collective under data parallelism): training only.
        global_counts = self.reduce_counts(counts) if counting else counts

        order = torch.argsort(assigned, stable=True)  # expert-major; tokens keep their order inside an expert
        kept_counts = counts
        if self.capacity_factor is not None and self.training:  # evaluation and generation are dropless
            order, kept_counts = self._drop_over_capacity(assigned, counts, N)
        y = self.experts(tokens[order // k], kept_counts)  # (kept, d), sorted by expert
        # Back to (token, slot) order; dropped assignments contribute nothing (their token keeps
        # only the residual and the shared experts).
        per_slot = y.new_zeros(N * k, d).index_copy(0, order, y)
        out = (per_slot.view(N, k, d) * weights.to(y.dtype).unsqueeze(-1)).sum(dim=1)
        if self.shared is not None:
            out = out + self.shared(tokens)

        if counting:
            aux = self._balancing_losses(logits, scores, global_counts, N * k)
            if aux is not None:
                out = AddAuxLossGrad.apply(out, aux, self.aux_grad_scale)
            if not _in_backward() and not _UNCOUNTED[0]:
                self.stats.add(global_counts, assigned.numel() - order.numel(), N * k, self._last_losses)
        return out.view(B, T, d)

    def _drop_over_capacity(self, assigned: torch.Tensor, counts: torch.Tensor, n_tokens: int):
        """Keep at most `capacity` assignments per expert: first choices before second choices
        (GShard), earlier tokens first within a choice. Returns the kept assignments (indices into
        the token-major (token, slot) list) in expert-major order, and the kept counts."""
        E, k = self.n_experts, self.top_k
        capacity = math.ceil(self.capacity_factor * n_tokens * k / E)
        index = torch.arange(assigned.numel(), device=assigned.device)
        slot, token = index % k, index // k
        by_priority = torch.argsort((assigned * k + slot) * n_tokens + token)  # (expert, slot, token): unique keys
        starts = torch.cumsum(counts, 0) - counts
        rank_in_expert = index - starts[assigned[by_priority]]
        kept = by_priority[rank_in_expert < capacity]
        kept = kept[torch.argsort(assigned[kept] * assigned.numel() + kept)]  # the dropless order, minus the dropped
        return kept, torch.bincount(assigned[kept], minlength=E)

    def _balancing_losses(self, logits: torch.Tensor, scores: torch.Tensor, global_counts: torch.Tensor,
                          assignments: int) -> torch.Tensor | None:
        """coef x aux loss + coef x z-loss of this micro-batch (None when both are off)."""
        self._last_losses = (0.0, 0.0)
        total = None
        if self.aux_coef > 0:
            # f: the whole batch's share of assignments per expert (no gradient); P: this rank's
            # mean probability per expert. Data-parallel ranks average their gradients, so the mean
            # of their P is the whole batch's P: the gradient equals one process's.
            f = global_counts.float() / global_counts.sum().clamp(min=1)
            probs = scores if self.router_kind == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
            aux = self.n_experts * (f * probs.mean(dim=0)).sum()
            total = self.aux_coef * aux
            self._last_losses = (aux.detach(), 0.0)
        if self.z_coef > 0:
            z = torch.logsumexp(logits, dim=-1).square().mean()
            total = self.z_coef * z if total is None else total + self.z_coef * z
            self._last_losses = (self._last_losses[0], z.detach())
        return total

    @torch.no_grad()
    def end_step(self) -> None:
        """After an optimizer step: move the balancing bias toward balance (with moe_bias_rate) from
        the step's whole-batch counts (equal on every rank, so the biases stay equal)."""
        counts = self.stats.take_step_counts()
        if self.bias_rate > 0 and counts is not None:
            load = counts.float()
            self.expert_bias += self.bias_rate * torch.sign(load.mean() - load)


class MoEStats:
    """What one MoE layer saw since the last log (device tensors; read at log intervals only)."""

    def __init__(self):
        self.step_counts: torch.Tensor | None = None     # whole-batch assignments per expert, this step
        self.counts: torch.Tensor | None = None          # ... since the last log
        self.dropped = 0.0
        self.assignments = 0.0
        self.aux: Any = 0.0
        self.z: Any = 0.0
        self.calls = 0

    @torch.no_grad()
    def add(self, counts: torch.Tensor, dropped: Any, assignments: int, losses) -> None:
        counts = counts.detach()
        self.step_counts = counts.clone() if self.step_counts is None else self.step_counts + counts
        self.counts = counts.clone() if self.counts is None else self.counts + counts
        self.dropped = self.dropped + dropped
        self.assignments += assignments
        self.aux = self.aux + losses[0]
        self.z = self.z + losses[1]
        self.calls += 1

    def take_step_counts(self) -> torch.Tensor | None:
        counts, self.step_counts = self.step_counts, None
        return counts

    def take(self) -> dict[str, Any] | None:
        """The interval's numbers (host values: a sync, at log intervals only), then reset."""
        if self.counts is None:
            return None
        counts = self.counts.double()
        load = counts / counts.sum().clamp(min=1)  # host sync below: a log interval
        out = {"load": [round(v, 6) for v in load.tolist()],
               "imbalance": float(counts.max() / counts.mean().clamp(min=1e-12)),
               "dropped": float(self.dropped) / max(1.0, self.assignments),
               "aux_loss": float(self.aux) / self.calls, "z_loss": float(self.z) / self.calls}
        step_counts = self.step_counts
        self.__init__()
        self.step_counts = step_counts
        return out


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """(block name, layer) for every MoE layer of a model, a pipeline stage or any wrapper of them."""
    def block_name(name: str) -> str:  # without wrappers' names (DDP, compile, activation checkpointing)
        name = name.removesuffix(".mlp").replace("._orig_mod", "").replace("._checkpoint_wrapped_module", "")
        return name[name.find("blocks."):] if "blocks." in name else name

    return [(block_name(name), m) for name, m in model.named_modules() if isinstance(m, MoE)]
