"""Muon for the hidden layers' weight matrices, AdamW for every other parameter, as one optimizer.

Muon (Keller Jordan, 2024; torch.optim.Muon) keeps one momentum buffer per matrix and steps
along that momentum orthogonalized by a few Newton-Schulz iterations: every direction of the
matrix moves by about the same amount, whatever the gradient's spectrum. It is made for the
matrices of hidden layers; embeddings, output heads, norm gains and biases train better with
AdamW (and torch's Muon takes 2-D tensors only), so one run uses both:

    hidden_matrices(model)       the parameters Muon takes (the rule below)
    build_muon_with_adamw(...)   the trainer's optimizer for optim.optimizer = muon
    MuonWithAdamW                one torch Optimizer over a torch Muon and a torch AdamW

Which parameters are hidden matrices: the 2-D ones, except those of an nn.Embedding and those
with a part of their dotted name that contains "emb" or is "head", "*_head", "classifier" or
"router". In slipstream's transformer: the attention q/k/v/o and MLP up/gate/down projections
(and MoE shared experts'). The token and position embeddings, the output head (tied or not),
norms, biases, MoE routers and the 3-D expert weights go to AdamW. A user nn.Module trained
through the Python Trainer follows the same rule: name its output layer `head` or `*_head`. A model
without any hidden matrix is refused (Muon would train nothing), and one whose every 2-D weight is a
hidden matrix gets a note (its input and output layers are stepped by Muon too).

Learning rate: with muon_adjust_lr = match_rms_adamw (the default) each matrix's step is
scaled by 0.2 x sqrt(max(rows, cols)), which gives the update the RMS of a typical AdamW
update (Moonshot, "Muon is Scalable for LLM Training", 2025): AdamW's lr and weight decay carry
over, so optim.muon_lr = 0 means optim.lr. Weight decay is decoupled (p -= lr x wd x p), as in
AdamW. Newton-Schulz needs each whole matrix, so the matrices must not be sharded (zero1, zero2,
fsdp, hsdp and tensor parallelism are refused at config load); ddp and pipeline stages hold
whole matrices.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

import torch
import torch.nn as nn

from slipstream.config.schema import OptimConfig
from slipstream.errors import UserError

# A part of a parameter's dotted name that marks an input or output layer, not a hidden one.
_EDGE_PART = re.compile(r".*emb.*|head|.*_head|classifier|router")


def _edge_params(model: nn.Module) -> set[int]:
    """ids of the parameters owned by embedding modules (whatever they are called)."""
    return {id(p) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
            for p in m.parameters(recurse=False)}


def hidden_matrices(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, param) of the trainable parameters Muon takes, in the model's order (see the module
    doc for the rule). A tied parameter counts as an edge when any of its names is one."""
    names: dict[int, list[str]] = {}
    params: dict[int, torch.Tensor] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        params[id(param)] = param
    edge = _edge_params(model)
    hidden = []
    for key, param in params.items():
        if not param.requires_grad or param.dim() != 2 or key in edge:
            continue
        if any(_EDGE_PART.fullmatch(part) for name in names[key] for part in name.split(".")):
            continue
        hidden.append((names[key][0], param))
    return hidden


def build_muon_with_adamw(model: nn.Module, groups: list[dict[str, Any]], o: OptimConfig) -> MuonWithAdamW:
    """Muon over the model's hidden matrices, AdamW (o.implementation) over the rest of `groups`
    (the trainer's param groups: decay for matrices, none for biases and norms, split by mesh)."""
    hidden = hidden_matrices(model)
    if not hidden:  # Muon would step nothing: optim.optimizer = muon would silently be AdamW
        raise UserError(f"optim.optimizer = muon found no hidden-layer weight matrix in {_model_name(model)} (a "
                        "trainable 2-D parameter outside embeddings and layers named head, *_head, classifier or "
                        "router), so Muon would train nothing; use --optim.optimizer=adamw")
    for name, param in hidden:
        if hasattr(param, "device_mesh"):
            raise UserError(f"optim.optimizer = muon orthogonalizes each whole matrix, but '{name}' is sharded over "
                            "ranks (a DTensor); use --parallel.dp_strategy=ddp without tensor parallelism, or "
                            "--optim.optimizer=adamw")
    taken = {id(param) for _, param in hidden}
    # A group left empty is dropped: DCP's state-dict functions allow at most one empty group.
    rest = [dict(g, params=kept) for g in groups if (kept := [p for p in g["params"] if id(p) not in taken])]
    muon = torch.optim.Muon([param for _, param in hidden], lr=o.muon_lr or o.lr, weight_decay=o.weight_decay,
                            momentum=o.muon_momentum, nesterov=True, ns_steps=o.muon_ns_steps,
                            adjust_lr_fn=o.muon_adjust_lr)
    adamw = None
    if rest:
        from slipstream.optimize.optimizers import make_adamw

        adamw = make_adamw(rest, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                           implementation=o.implementation)
    return MuonWithAdamW(muon, adamw)


def layer_rule_note(model: nn.Module) -> str:
    """A note when Muon takes every trainable 2-D weight of a whole model ("" otherwise): no
    embedding or output layer was recognized, so its input and output layers are Muon's too.
    (A pipeline stage may hold blocks only: its edges are on other ranks.)"""
    if getattr(model, "pipeline", None) is not None:
        return ""
    matrices = sum(1 for p in model.parameters() if p.requires_grad and p.dim() == 2)
    if matrices != len(hidden_matrices(model)):
        return ""
    return (f"note: optim.optimizer = muon steps every 2-D weight of {_model_name(model)} with Muon, its input and "
            "output layers too (Muon is made for hidden layers); to train them with AdamW, name the output layer "
            "`head` (or `*_head`, `classifier`) and take the inputs through an nn.Embedding")


def _model_name(model: nn.Module) -> str:
    """The class of the user's module inside DDP's and torch.compile's wrappers."""
    while type(model).__name__ in ("DistributedDataParallel", "OptimizedModule"):
        model = model.module if hasattr(model, "module") else model._orig_mod
    return type(model).__name__


class MuonWithAdamW(torch.optim.Optimizer):
    """A torch Muon and a torch AdamW behind one Optimizer: step, zero_grad, state_dict and
    load_state_dict act on both; param_groups lists AdamW's groups, then Muon's.

    param_groups and state are read through to the two optimizers every time (never copied),
    so an LR scheduler sets each group's lr from that group's own base lr, and loading a
    checkpoint into the two (DCP loads `optimizers` one by one, which gives them new group
    dicts) leaves nothing stale here. state_dict() has torch's layout: the groups and the
    parameter numbering of AdamW, then Muon, as one optimizer over all parameters would have.
    AdamW comes first so that param_groups[0]["lr"] (what the trainer logs) is optim.lr's.
    """

    def __init__(self, muon: torch.optim.Optimizer | None, adamw: torch.optim.Optimizer | None):
        # torch's Optimizer.__init__ would build param_groups and state of its own; only the
        # hook tables its methods need are set here.
        self.optimizers: dict[str, torch.optim.Optimizer] = {
            name: opt for name, opt in (("adamw", adamw), ("muon", muon)) if opt is not None}
        if not self.optimizers:
            raise ValueError("MuonWithAdamW needs at least one of its two optimizers")
        self.defaults: dict[str, Any] = {}
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()

    @property
    def muon(self) -> torch.optim.Optimizer | None:
        return self.optimizers.get("muon")

    @property
    def adamw(self) -> torch.optim.Optimizer | None:
        return self.optimizers.get("adamw")

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [group for opt in self.optimizers.values() for group in opt.param_groups]

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:  # type: ignore[override]
        """param -> its state (a fresh dict over both optimizers' live per-param dicts)."""
        merged: dict[torch.Tensor, dict[str, Any]] = {}
        for opt in self.optimizers.values():
            merged.update(opt.state)
        return merged

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("MuonWithAdamW's groups are fixed: build it again with the new parameters")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers.values():
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Each optimizer gets its groups (by position, as torch matches them) and their state,
        whatever the keys are (indices, or parameter names after DCP)."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"the optimizer state has {len(groups)} parameter groups, this Muon + AdamW optimizer "
                             f"{len(self.param_groups)}: it was saved by another optimizer or model")
        start = 0
        for opt in self.optimizers.values():
            own = groups[start:start + len(opt.param_groups)]
            start += len(own)
            keys = {key for group in own for key in group["params"]}
            opt.load_state_dict({"state": {k: v for k, v in state_dict["state"].items() if k in keys},
                                 "param_groups": own})
