"""Pruning during training (the [sparsity] section): masks on the blocks' linears.

    sparsity.method = magnitude   the smallest |w| zeroed, per layer (scope = layer: every layer
                                  reaches the target) or with one threshold over all pruned
                                  weights (scope = global)
    sparsity.method = 2:4         exactly two zeros in every block of four consecutive weights
                                  along the input dimension (torchao's N:M mask_creator)
    sparsity.method = heads       whole attention heads, the smallest by the L2 norm of their
                                  weights (q rows, k/v rows without GQA, o_proj columns)
    sparsity.method = channels    whole MLP hidden channels, the smallest by the L2 norm of their
                                  weights (up/gate rows, down_proj columns)

The masks are computed by the libraries: torch.nn.utils.prune's L1Unstructured (per layer, and
over the concatenated weights for scope = global, as prune.global_unstructured does),
LnStructured (heads and channels, over a matrix with one row per head/channel) and torchao's
mask_creator (2:4).

Where the masks live, and why not prune's reparametrization. Each pruned tensor gets a
persistent bool buffer `<name>_mask` on its module (prune's buffer name), and the parameter
itself stays the one parameter, under its own name, with its pruned entries exactly zero:
  - the optimizer sees `weight` (not prune's `weight_orig`); a tensor hook multiplies its
    gradient by the mask (prune's reparametrization gives weight_orig the same masked
    gradient), so clipping and the logged norm count live weights only, and `apply()` puts
    the pruned entries back to zero after every optimizer step (AdamW's momentum and weight
    decay would move them);
  - checkpoints (DCP) save the weights and the masks with the model state, and resume is exact:
    the masks are recomputed only on the schedule's steps, from the step count;
  - parameter names are unchanged, so init (name rules), optimizer groups, tensor-parallel
    plans and a plain model loading the checkpoint (generate, eval, export) all work as for a
    dense model, and the weights they load are already the masked ones;
  - the forward has no hook: a compiled block is the dense one (a mask update, in place, never
    recompiles); prune's forward pre-hook would also leave a computed `weight` attribute behind
    every linear, a full unsharded copy under FSDP2.
Costs: one bool mask per pruned weight (1 byte per weight) and one multiply per pruned weight
per step. FSDP/HSDP/zero2, tensor and pipeline parallelism are refused (config/sparsity_rules.py):
their weights are shards between steps, the masks whole tensors.

Speed: the masked weights are dense tensors with zeros; no sparse kernel runs, on any device
(2:4's sparse matmul, torchao sparsify_ with SemiSparseWeightConfig, needs CUDA sm80+ and is an
inference-time conversion). The loss of the masked model is the loss of a dense model with the
same weights, bit for bit.

How weights are ranked (sparsity.criterion, methods magnitude and 2:4): by abs(w), or by Wanda's
score abs(w_ij) x ||X_j||_2 (Sun et al. 2023, "A Simple and Effective Pruning Approach for Large
Language Models", https://arxiv.org/abs/2306.11695, eq. 1), where ||X_j||_2 is the L2 norm of
input feature j over the calibration tokens (forward pre-hooks on the pruned linears, the model
in eval mode without gradients). As in the paper, weights compete within each output row (its
"per output" comparison group), and 2:4 keeps the two highest scores of every four. Unlike the
paper's reference code, all norms come from one pass over the model before pruning (not block
by block through the already-pruned blocks), and the count per row is rounded (not floored),
as torch.nn.utils.prune rounds an amount. torchao's
WandaSparsifier computes the same score but ranks over the whole layer and keeps its masks in
parametrizations and observers (module swaps); here the score feeds the same mask buffers as
magnitude. Calibration data come from the caller (the language-model job: fixed windows of the
train split, identical on every rank and after resume, so every rank computes the same masks).

Pruning a dense checkpoint. A run that resumes a checkpoint saved without masks (a dense
training) starts its masks at all ones and prunes at once, at the schedule's sparsity for the
resumed step (`SparsitySchedule.from_dense`): one-shot pruning of a trained model, then
fine-tuning. `slipstream checkpoint prune` does the one shot without training.

The schedule (Zhu & Gupta 2017, "To prune, or not to prune", https://arxiv.org/abs/1710.01878,
eq. 1): s_t = s_f (1 - (1 - (t - t0) / (t1 - t0))^3) for t0 <= t <= t1, recomputed every
`sparsity.every` steps (and at t1); 0 before t0, s_f after t1.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable

import torch
import torch.nn as nn
from torch.nn.utils import prune

from slipstream.config.schema import SparsityConfig
from slipstream.errors import UserError
from slipstream.models.transformer import MLP, Attention, Block

MASK = "_mask"  # buffer suffix: weight -> weight_mask, as torch.nn.utils.prune names it
_said_dense_math = False


# --- the schedule -------------------------------------------------------------------------

def pruning_step(step: int, cfg: SparsityConfig) -> bool:
    """Whether new masks are computed before optimizer step `step` (the number of steps done)."""
    if step < cfg.start_step:
        return False
    if cfg.end_step <= cfg.start_step:
        return step == cfg.start_step
    return step <= cfg.end_step and ((step - cfg.start_step) % cfg.every == 0 or step == cfg.end_step)


def sparsity_at(step: int, cfg: SparsityConfig) -> float:
    """The schedule's sparsity in force after the masks of step `step` (Zhu & Gupta's cubic, held
    constant between pruning steps)."""
    t0, t1 = cfg.start_step, cfg.end_step
    if step < t0:
        return 0.0
    if t1 <= t0 or step >= t1:
        return cfg.target
    last = t0 + (step - t0) // cfg.every * cfg.every  # the latest pruning step
    return cfg.target * (1.0 - (1.0 - (last - t0) / (t1 - t0)) ** 3)


# --- where the masks are ------------------------------------------------------------------

def _blocks(model: nn.Module) -> list[Block]:
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    if not blocks:
        raise UserError("sparsity works on slipstream transformers (their blocks' linears); for your own model "
                        "use torch.nn.utils.prune yourself, or set --sparsity.method=none")
    return blocks


def _head_tensors(attn: Attention) -> tuple[list[tuple[nn.Module, str, int]], int]:
    """(module, tensor name, dim along which the heads lie) of one attention, and its head width."""
    rows = [(attn.q_proj, "weight", 0), (attn.o_proj, "weight", 1)]
    if attn.n_kv_head == attn.n_head:  # GQA: a k/v head serves several query heads, kept whole
        rows += [(attn.k_proj, "weight", 0), (attn.v_proj, "weight", 0)]
    rows += [(m, "bias", 0) for m, _, dim in list(rows) if dim == 0 and m.bias is not None]
    return rows, attn.head_dim


def _channel_tensors(mlp: MLP) -> list[tuple[nn.Module, str, int]]:
    rows = [(mlp.up_proj, "weight", 0), (mlp.down_proj, "weight", 1)]
    if mlp.gate_proj is not None:
        rows.append((mlp.gate_proj, "weight", 0))
    return rows + [(m, "bias", 0) for m, _, dim in list(rows) if dim == 0 and m.bias is not None]


def _mlps(model: nn.Module) -> list[MLP]:
    return [b.mlp for b in _blocks(model) if isinstance(b.mlp, MLP)]


def _pruned_tensors(model: nn.Module, method: str) -> list[tuple[nn.Module, str]]:
    if method == "heads":
        return [(m, n) for b in _blocks(model) for m, n, _ in _head_tensors(b.attn)[0]]
    if method == "channels":
        return [(m, n) for mlp in _mlps(model) for m, n, _ in _channel_tensors(mlp)]
    return [(m, "weight") for b in _blocks(model) for m in b.modules() if isinstance(m, nn.Linear)]


def masked_tensors(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, parameter name) of every tensor that apply_sparsity gave a mask."""
    return [(m, name[: -len(MASK)]) for m in model.modules() for name, _ in m.named_buffers(recurse=False)
            if name.endswith(MASK) and isinstance(getattr(m, name[: -len(MASK)], None), nn.Parameter)]


def _mask_grad(module: nn.Module, name: str):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        return grad * getattr(module, name + MASK)  # looked up per call: a checkpoint load copies into it
    return hook


def apply_sparsity(model: nn.Module, cfg: SparsityConfig) -> nn.Module:
    """Give the pruned tensors of `model` their masks (all ones: pruning starts on the schedule,
    `SparsitySchedule.update`) and their gradients the mask. In place; before compile and data
    parallelism."""
    if cfg.method == "none":
        return model
    for module, name in register_masks(model, cfg):
        getattr(module, name).register_hook(_mask_grad(module, name))
    _say_dense_math_once(cfg.method, masked_tensors(model)[0][0].weight.device)
    return model


def register_masks(model: nn.Module, cfg: SparsityConfig) -> list[tuple[nn.Module, str]]:
    """The `<name>_mask` buffers (all ones) of the tensors `cfg.method` prunes; returns them.
    Also for loading a checkpoint's masks (export); none for method none."""
    if cfg.method == "none":
        return []
    tensors = _pruned_tensors(model, cfg.method)
    if cfg.method == "heads" and round(cfg.target * _blocks(model)[0].attn.n_head) < 1:
        raise UserError(f"sparsity.target = {cfg.target} of {_blocks(model)[0].attn.n_head} heads prunes no head "
                        "(the count is rounded); raise the target or use --sparsity.method=magnitude")
    if cfg.method == "channels" and not tensors:
        raise UserError("sparsity.method = channels needs dense MLP blocks (mixture-of-experts layers have none)")
    for module, name in tensors:
        param = getattr(module, name)
        if param.is_meta:
            raise UserError("sparsity needs the model's weights (it is still on the meta device); "
                            "dp_strategy fsdp/hsdp/zero2 are not supported with sparsity")
        if cfg.method == "2:4" and param.shape[-1] % 4:
            raise UserError(f"sparsity.method = 2:4 needs input widths divisible by 4; {type(module).__name__} "
                            f"has {param.shape[-1]}; use --sparsity.method=magnitude")
        module.register_buffer(name + MASK, torch.ones_like(param, dtype=torch.bool))
    return tensors


def _say_dense_math_once(method: str, device: torch.device) -> None:
    global _said_dense_math
    if _said_dense_math or method != "2:4":
        return
    _said_dense_math = True
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        where = ("on CPU (the 2:4 sparse matmul needs CUDA sm80+)" if device.type != "cuda"
                 else "(torchao's 2:4 sparse matmul is an inference conversion, not used in training)")
        print(f"sparsity 2:4: the masked weights run as dense matmuls {where}")


# --- computing the masks ------------------------------------------------------------------

def _ones(t: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(t)


@torch.no_grad()
def compute_masks(model: nn.Module, cfg: SparsityConfig, sparsity: float,
                  norms: dict[nn.Module, torch.Tensor] | None = None) -> None:
    """New masks at `sparsity` (a fraction of the weights, heads or channels), from the current
    weights (pruned entries are zero, hence the smallest: masks only grow), then apply them.
    criterion = wanda: `norms` are input_norms() of the same model."""
    if cfg.criterion == "wanda":
        if norms is None:
            raise ValueError("sparsity.criterion = wanda needs the input norms of the pruned linears (input_norms)")
        _wanda_masks(model, cfg, sparsity, norms)
    elif cfg.method == "2:4":
        from torchao.sparsity.utils import mask_creator  # 2 kept of every 4 along the last (input) dim

        for module, name in masked_tensors(model):
            getattr(module, name + MASK).copy_(mask_creator(getattr(module, name), N=2, M=4).bool())
    elif cfg.method == "magnitude" and cfg.scope == "layer":
        for module, name in masked_tensors(model):
            w = getattr(module, name)
            getattr(module, name + MASK).copy_(prune.L1Unstructured(sparsity).compute_mask(w, _ones(w)).bool())
    elif cfg.method == "magnitude":  # one threshold over every pruned weight: prune.global_unstructured's way
        tensors = masked_tensors(model)
        flat = torch.cat([getattr(m, n).detach().flatten() for m, n in tensors])
        masks = prune.L1Unstructured(sparsity).compute_mask(flat, _ones(flat)).bool()
        for (module, name), mask in zip(tensors, masks.split([getattr(m, n).numel() for m, n in tensors])):
            getattr(module, name + MASK).copy_(mask.view_as(getattr(module, name)))
    elif cfg.method == "heads":
        for block in _blocks(model):
            tensors, width = _head_tensors(block.attn)
            _prune_rows(tensors, block.attn.n_head, width, sparsity)
    else:  # channels
        for mlp in _mlps(model):
            _prune_rows(_channel_tensors(mlp), mlp.down_proj.in_features, 1, sparsity)
    apply_masks(model)


def _wanda_masks(model: nn.Module, cfg: SparsityConfig, sparsity: float,
                 norms: dict[nn.Module, torch.Tensor]) -> None:
    """Wanda's masks: score abs(w_ij) x ||X_j||, the lowest round(sparsity x in_features) scores of
    every output row zeroed (2:4: the two lowest of every four, by torchao's mask_creator)."""
    from torchao.sparsity.utils import mask_creator

    for module, name in masked_tensors(model):
        w = getattr(module, name)
        score = w.detach().abs().float() * norms[module].to(w.device)[None, :]
        if cfg.method == "2:4":
            mask = mask_creator(score, N=2, M=4).bool()
        else:
            mask = torch.ones_like(score, dtype=torch.bool)
            k = round(sparsity * score.shape[1])  # torch.nn.utils.prune's rounding of an amount
            if k:
                mask.scatter_(1, score.topk(k, dim=1, largest=False).indices, False)
        getattr(module, name + MASK).copy_(mask)


@torch.no_grad()
def input_norms(model: nn.Module, inputs: Iterable[torch.Tensor], eot_id: int | None = None,
                parallel: Any = None) -> dict[nn.Module, torch.Tensor]:
    """{masked linear: the L2 norm of each of its input features over every token of `inputs`}
    (Wanda's ||X_j||_2), measured on the model as it is (one pass, all blocks at once; the
    reference code prunes block by block, feeding each block the pruned blocks' outputs).

    The model runs in eval mode without gradients, as training runs it: with document masks
    under data.packing = document (`eot_id`), and up to the final hidden states only (the head
    is never pruned, and vocabulary-wide logits are what a fused loss avoids). Compiled code
    runs eagerly here: hooks added after compilation never run inside an existing graph.
    Call it on the plain module, not a DDP wrapper (whose forward would broadcast buffers).
    `parallel` (several data-parallel ranks): each rank runs its 1/world of the inputs and one
    all-reduce sums the squares, so every rank gets the same norms by construction."""
    from slipstream.models.doc_mask import DocumentMask, doc_ids_after

    linears = [m for m, name in masked_tensors(model) if name == "weight"]
    squares = {m: torch.zeros(m.in_features, device=m.weight.device) for m in linears}

    def accumulate(module: nn.Module, args: tuple) -> None:
        x = args[0].detach().float()
        squares[module] += x.reshape(-1, x.shape[-1]).square().sum(0)

    rank, world = (parallel.dp_rank, parallel.dims.dp) if parallel is not None else (0, 1)
    handles = [m.register_forward_pre_hook(accumulate) for m in linears]
    was_training, seen = model.training, 0
    model.eval()  # no dropout: the norms of the weights' real inputs
    try:
        with torch.compiler.set_stance("force_eager"):
            for i, x in enumerate(inputs):
                seen += 1
                if i % world != rank:
                    continue
                doc_ids = DocumentMask(doc_ids_after(x, eot_id)) if eot_id is not None else None
                model(x, return_hidden=True, doc_ids=doc_ids)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    if not seen:
        raise UserError("sparsity.criterion = wanda got no calibration data (the train split is empty); "
                        "use --sparsity.criterion=magnitude")
    if world > 1:
        flat = torch.cat([squares[m] for m in linears])
        flat = parallel.sum(flat)  # a collective: every rank's sums of squares -> the job's
        squares = dict(zip(linears, flat.split([m.in_features for m in linears])))
    return {m: s.sqrt() for m, s in squares.items()}


@contextlib.contextmanager
def without_masks(model: nn.Module):
    """The mask buffers out of the model's state dict for the duration (loading a dense checkpoint,
    which has none), reset to all ones: nothing pruned until the next compute_masks. The same
    tensors stay registered (re-registered non-persistent), so a DDP wrapper's buffer list holds."""
    tensors = masked_tensors(model)
    for module, name in tensors:
        module.register_buffer(name + MASK, getattr(module, name + MASK).fill_(True), persistent=False)
    try:
        yield
    finally:
        for module, name in tensors:
            module.register_buffer(name + MASK, getattr(module, name + MASK), persistent=True)


def _prune_rows(tensors: list[tuple[nn.Module, str, int]], units: int, width: int, sparsity: float) -> None:
    """Zero whole units (heads of `width` rows/columns, or channels): one row per unit holding all
    its weights, ranked by L2 norm with prune.LnStructured."""
    def per_unit(t: torch.Tensor, dim: int) -> torch.Tensor:  # (units, everything else of that unit)
        t = t.detach().movedim(dim, 0)
        return t.reshape(units, -1)

    rows = torch.cat([per_unit(getattr(m, n), dim) for m, n, dim in tensors if n == "weight"], dim=1)
    keep = prune.LnStructured(sparsity, n=2, dim=0).compute_mask(rows, _ones(rows))[:, 0].bool()
    keep = keep.repeat_interleave(width)
    for module, name, dim in tensors:
        mask = getattr(module, name + MASK)
        mask.copy_(keep.view(-1, *([1] * (mask.dim() - 1))).movedim(0, dim).expand_as(mask))


@torch.no_grad()
def apply_masks(model: nn.Module) -> None:
    """Pruned entries back to zero (after an optimizer step moved them)."""
    for module, name in masked_tensors(model):
        getattr(module, name).mul_(getattr(module, name + MASK))


@torch.no_grad()
def fold_masks(model: nn.Module) -> nn.Module:
    """weight * mask into the weights and the mask buffers removed: the plain model an export
    writes (the weights under their own names)."""
    for module, name in masked_tensors(model):
        getattr(module, name).mul_(getattr(module, name + MASK))
        delattr(module, name + MASK)
    return model


def measured_sparsity(model: nn.Module) -> tuple[dict[str, float], float]:
    """({parameter name: fraction of exact zeros}, the fraction over all of them) of the masked
    weights, measured from the weights themselves."""
    names = {id(m): n for n, m in model.named_modules()}
    per, zeros, total = {}, 0, 0
    for module, name in masked_tensors(model):
        w = getattr(module, name)
        z = int((w == 0).sum())
        per[f"{names[id(module)]}.{name}"] = z / w.numel()
        zeros, total = zeros + z, total + w.numel()
    return per, zeros / max(total, 1)


class SparsitySchedule:
    """The trainer's per-step hook: `update(step)` before a step computes new masks on the
    schedule's steps (from the step count alone: a resumed run needs no state beyond the masks
    its checkpoint holds); `apply()` after it zeroes what the optimizer moved.

    calibration: criterion = wanda: the inputs whose activation norms rank the weights (the same
    on every rank), and the plain module to run them through (not a data-parallel wrapper).
    from_dense: set by a resume from a checkpoint without masks; the next update() prunes at the
    schedule's sparsity for that step even off the schedule's steps (one shot), then clears it."""

    def __init__(self, model: nn.Module, cfg: SparsityConfig, calibration: Iterable[torch.Tensor] | None = None,
                 calibration_model: nn.Module | None = None, eot_id: int | None = None, parallel: Any = None):
        if cfg.criterion == "wanda" and calibration is None:
            raise UserError("sparsity.criterion = wanda needs calibration inputs: the language-model job takes them "
                            "from its train split; with your own model and Trainer pass JobInfo(calibration=...), "
                            "or use --sparsity.criterion=magnitude")
        self.model, self.cfg, self.calibration = model, cfg, calibration
        self.calibration_model = calibration_model or model
        self.eot_id, self.parallel = eot_id, parallel
        self.from_dense = False
        self.pruned_at: int | None = None  # the step whose masks are in force (idempotent update)

    @classmethod
    def attach(cls, model: nn.Module, cfg: SparsityConfig, calibration: Iterable[torch.Tensor] | None = None,
               calibration_model: nn.Module | None = None, eot_id: int | None = None,
               parallel: Any = None) -> SparsitySchedule | None:
        return None if cfg.method == "none" else cls(model, cfg, calibration, calibration_model, eot_id, parallel)

    def update(self, step: int) -> None:
        """Called before step `step + 1` (and again before an evaluation at `step`: the second call
        finds the masks of this step in force and does nothing). A pruning step at sparsity 0
        (the cubic's start) changes no mask and is skipped; so is a repeat. Whether a step prunes
        depends on the step count alone (and, once, on from_dense), never on what ran before in
        this process, so a resumed run prunes exactly where the uninterrupted one did."""
        sparsity = sparsity_at(step, self.cfg)
        due = pruning_step(step, self.cfg) or (self.from_dense and sparsity > 0)
        if due and sparsity > 0 and self.pruned_at != step:
            self.prune(sparsity)
            self.pruned_at = step
        self.from_dense = False

    def prune(self, sparsity: float) -> None:
        """New masks at `sparsity` now (Wanda: the calibration inputs run through the model first)."""
        norms = (input_norms(self.calibration_model, self.calibration, self.eot_id, self.parallel)
                 if self.cfg.criterion == "wanda" else None)
        compute_masks(self.model, self.cfg, sparsity, norms)

    def apply(self) -> None:
        apply_masks(self.model)


# --- the accelerated 2:4 kernel (inference) ----------------------------------------------

def use_sparse_kernel(model: nn.Module) -> nn.Module:
    """The blocks' 2:4-sparse linears converted to torchao's semi-structured sparse weights
    (torch.sparse SparseSemiStructuredTensor: the sparse tensor-core matmul, which skips the
    zeros), for inference (`slipstream generate --sparse-kernel`). Needs CUDA compute capability
    8.0+ and fp16/bf16 weights (the model is cast to bf16), and weights that are 2:4 already
    (a run with sparsity.method = 2:4, or `checkpoint prune --method 2:4`): the conversion keeps
    two values of every four, so it would silently drop live weights of any other pattern."""
    linears = [m for b in _blocks(model) for m in b.modules() if type(m) is nn.Linear]
    for m in linears:
        w = m.weight.detach()
        if w.shape[-1] % 4 or ((w.reshape(-1, 4) != 0).sum(1) > 2).any():
            raise UserError("--sparse-kernel needs 2:4 weights (at most two nonzeros in every four inputs), and this "
                            "checkpoint's are not: train with --sparsity.method=2:4 or prune it with `slipstream "
                            "checkpoint prune DIR --out NEW --method 2:4`, or drop --sparse-kernel")
    device = next(model.parameters()).device
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 0):
        where = f"{device}" if device.type != "cuda" else f"a GPU of capability {torch.cuda.get_device_capability(device)}"
        raise UserError(f"--sparse-kernel runs the 2:4 semi-structured sparse matmul, which needs a CUDA GPU of compute "
                        f"capability 8.0 or newer (A100, H100, ...); this is {where}. Drop --sparse-kernel: the "
                        "masked weights then run as dense matmuls with the same result")
    from torchao.sparsity import semi_sparse_weight, sparsify_

    model.to(torch.bfloat16)  # the sparse tensor cores take fp16 / bf16 (and int8) only
    for block in _blocks(model):
        sparsify_(block, semi_sparse_weight(), filter_fn=lambda m, _fqn="": type(m) is nn.Linear)
    return model

