"""AdamW variants that trade speed for memory, each usable from the trainer as one switch.

    make_adamw             torch AdamW with a chosen implementation (for-loop / foreach / fused),
                           or AdamWBf16State when state_dtype="bf16" (moments stored in bf16),
                           or torchao's AdamW8bit / AdamW4bit when state_dtype="int8" / "int4"
                           (block-quantized moments: low_bit_adamw)
    OptimizerInBackward    one AdamW per parameter, stepped from the backward pass, so the
                           gradients of the whole model never exist at the same time
    CPUOffloadOptimizer    fp32 master weights + Adam state on the CPU; the device holds only
                           the model's params and grads

Memory per parameter (fp32 params, plain AdamW): 4 param + 4 grad + 8 state bytes.
bf16 state saves 4 bytes, int8 about 6, int4 about 7 (plan.memory_states.low_bit_state_bytes),
in-backward saves most of the 4 grad bytes, CPU offload moves the 8 state bytes (plus a 4-byte
fp32 master and a 4-byte grad buffer) off the device.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from slipstream.errors import UserError

IMPLEMENTATIONS = ("auto", "for-loop", "foreach", "fused")
STATE_DTYPES = ("fp32", "bf16", "int8", "int4")
LOW_BIT_STATE_DTYPES = ("int8", "int4")
# Hyperparameters a scheduler (or the trainer) may change between steps; the wrappers below
# copy them from their public param_groups into the optimizers that do the work.
_HYPERPARAMS = ("lr", "betas", "eps", "weight_decay")


# --- helpers ---------------------------------------------------------------------------------

def _as_groups(params_or_groups: Iterable[Any]) -> list[dict[str, Any]]:
    """A list of params or of param-group dicts -> a list of group dicts (like torch.optim does)."""
    items = [params_or_groups] if isinstance(params_or_groups, torch.Tensor) else list(params_or_groups)
    if items and isinstance(items[0], dict):
        # A group's "params" may be one tensor; list() of a tensor would iterate its rows.
        return [dict(group, params=[group["params"]] if isinstance(group["params"], torch.Tensor)
                     else list(group["params"])) for group in items]
    return [{"params": items}]


def _check_choice(value: str, choices: tuple[str, ...], what: str) -> None:
    if value not in choices:
        raise UserError(f"{what} = '{value}' is not valid; use one of: {', '.join(choices)}")


def _fused_ok(params: list[torch.Tensor]) -> bool:
    """torch's fused AdamW kernels exist for floating params on cpu and cuda."""
    return all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)


def make_adamw(params_or_groups: Iterable[Any], lr: float, betas: tuple[float, float], eps: float,
               weight_decay: float, implementation: str = "auto", state_dtype: str = "fp32"
               ) -> torch.optim.Optimizer:
    """AdamW over params or param groups (groups may override weight_decay, lr, ...).

    implementation: for-loop (one param at a time), foreach (batched kernels), fused (one kernel
    per dtype/device: the fastest on CPU and CUDA), auto (fused where supported, else foreach).
    state_dtype: fp32 (torch AdamW, moments in the param dtype), bf16 (AdamWBf16State), or int8 /
    int4 (torchao's block-quantized AdamW8bit / AdamW4bit: low_bit_adamw; implementation for-loop
    runs its per-parameter update eagerly, auto and fused compile it, foreach is refused).
    """
    _check_choice(implementation, IMPLEMENTATIONS, "optimizer implementation")
    _check_choice(state_dtype, STATE_DTYPES, "optimizer state dtype")
    groups = _as_groups(params_or_groups)
    if state_dtype == "bf16":
        # A fused/foreach version would upcast all moments at once and give back the memory saved.
        if implementation not in ("auto", "for-loop"):
            raise UserError(f"optimizer implementation '{implementation}' is not available with bf16 "
                            "optimizer state (it has its own for-loop implementation); use auto or for-loop")
        return AdamWBf16State(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if state_dtype in LOW_BIT_STATE_DTYPES:
        return low_bit_adamw(groups, state_dtype, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                             implementation=implementation)
    flags = adamw_flags(implementation, [p for g in groups for p in g["params"]])
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **flags)


def adamw_flags(implementation: str, params: list[torch.Tensor]) -> dict[str, bool]:
    """torch.optim.AdamW's foreach/fused arguments for an implementation name."""
    _check_choice(implementation, IMPLEMENTATIONS, "optimizer implementation")
    if implementation == "auto":
        implementation = "fused" if _fused_ok(params) else "foreach"
    return {"for-loop": {"foreach": False, "fused": False},
            "foreach": {"foreach": True, "fused": False},
            "fused": {"foreach": False, "fused": True}}[implementation]


def _state_tensors(optimizer: Any) -> list[torch.Tensor]:
    """Every tensor in optimizer.state, each once."""
    seen, tensors = set(), []
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and id(value) not in seen:
                seen.add(id(value))
                tensors.append(value)
    return tensors


def torch_optimizers(optimizer: Any) -> Any:
    """The torch optimizer(s) behind one of ours, for APIs that take torch optimizers (DCP's
    state-dict functions, MemTracker): the optimizer in backward is one AdamW per parameter,
    MuonWithAdamW (optimize/muon.py) a Muon and an AdamW."""
    inner = getattr(optimizer, "optimizers", None)
    if isinstance(inner, dict):
        return list(inner.values())
    if type(optimizer).__name__ in ("PostLocalSGDOptimizer", "ZeroRedundancyOptimizer"):
        # Local SGD wraps the optimizer that holds the state; ZeRO-1's local optimizer holds
        # this rank's partition of it.
        return optimizer.optim
    return optimizer


def tensor_storage_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor really holds. A wrapper subclass (torchao's quantized optimizer states) only
    appears to have its dtype and shape: its bytes are those of the plain tensors inside it
    (codes, block scales, the code book), found through __tensor_flatten__."""
    if type(tensor) is not torch.Tensor and hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(tensor_storage_bytes(getattr(tensor, name)) for name in names)
    if hasattr(tensor, "to_local"):  # a DTensor: this rank's shard
        return tensor_storage_bytes(tensor.to_local())
    return tensor.numel() * tensor.element_size()


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes held in optimizer.state (moments and step counters; quantized moments by the bytes of
    their codes, scales and code book). For CPUOffloadOptimizer this is the CPU-side Adam state;
    its fp32 master weights and grad buffers are not counted."""
    return sum(tensor_storage_bytes(t) for t in _state_tensors(optimizer))


def optimizer_state_devices(optimizer: Any) -> set[str]:
    """Devices of the optimizer-state tensors, e.g. {"cuda:0"}. Note that torch's for-loop and
    foreach AdamW keep the scalar `step` on the CPU even for CUDA params."""
    return {str(t.device) for t in _state_tensors(optimizer)}


# --- AdamW with bf16 moments -----------------------------------------------------------------

class AdamWBf16State(torch.optim.Optimizer):
    """AdamW whose moments (exp_avg, exp_avg_sq) are stored in bfloat16: half the state memory.

    The math is torch.optim.AdamW's (decoupled weight decay, bias correction), done in fp32
    one parameter at a time: upcast the moments, update, round them back to bf16. So the extra
    memory at any moment is a few fp32 copies of one parameter, never of the whole model.

    Precision: bf16 keeps 8 significant bits, so each stored moment is rounded to ~0.4%
    relative. For exp_avg_sq the per-step change is a (1 - beta2) fraction; with beta2 = 0.999
    that is 0.1%, below the rounding step, so v can stall (neither grow nor decay) while
    gradients are steady. beta2 <= 0.99 (this project defaults to 0.95) keeps the per-step change
    above the rounding step. Stochastic rounding would fix it, but needs its own random stream
    saved in checkpoints for exact resume; not done here.
    Not supported: amsgrad, maximize, tensor lr, sparse or complex grads.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2):
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid AdamW hyperparameters: lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    # `step` lives on the CPU as in torch's for-loop AdamW: reading it is no device sync.
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
                state["step"] += 1
                step = state["step"].item()

                # fp32 working copies. .float() returns the tensor itself when it already is fp32,
                # so an fp32 param is updated in place and a bf16 one is written back once below.
                param = p.float()
                grad = p.grad.float()
                exp_avg = state["exp_avg"].float()
                exp_avg_sq = state["exp_avg_sq"].float()

                # The same operations, in the same order, as torch's for-loop AdamW.
                if weight_decay != 0:
                    param.mul_(1 - lr * weight_decay)  # decoupled: never enters the moments
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias_correction1 = 1 - beta1**step
                bias_correction2 = 1 - beta2**step
                denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
                param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)

                state["exp_avg"].copy_(exp_avg)  # round to nearest bf16
                state["exp_avg_sq"].copy_(exp_avg_sq)
                if param is not p:
                    p.copy_(param)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # Optimizer.load_state_dict casts every state tensor to its param's dtype; put the moments
        # back to bf16 (exact: they were bf16 values when saved).
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(torch.bfloat16)


# --- AdamW with int8 / int4 moments (torchao) ----------------------------------------------------

def low_bit_adamw(params_or_groups: Iterable[Any], state_dtype: str, lr: float, betas: tuple[float, float],
                  eps: float, weight_decay: float, implementation: str = "auto") -> torch.optim.Optimizer:
    """torchao's AdamW8bit (state_dtype int8) or AdamW4bit (int4): AdamW whose two moments are
    stored block-quantized (Dettmers et al. 2022, arXiv:2110.02861; Li et al. 2023,
    arXiv:2309.01507): about 1/4 and 1/8 of fp32's moment bytes. The update itself runs in fp32
    per parameter (dequantize, update, requantize).

    Small tensors stay in full precision: a parameter with fewer than 4096
    elements, or a count that is not a multiple of the block size (256 for int8, 128 for int4),
    keeps plain moments in its own dtype (norm weights and biases, typically).
    plan/memory_states.py's low_bit_state_bytes counts exactly this, and the planner plans with it.

    implementation: for-loop runs torchao's per-parameter update eagerly (no compilation: the
    quickest start, the slowest step); auto and fused run it as torchao does, compiled per
    parameter shape by torch.compile (a C++ compiler on CPU; the first step compiles). foreach
    has no meaning here and is refused.
    lr stays a Python float in param_groups, as for every other optimizer here (schedulers, the
    in-backward and offload wrappers and the metrics log set and read it); the step hands torchao
    the fp32 tensor it wants.
    """
    _check_choice(state_dtype, LOW_BIT_STATE_DTYPES, "low-bit optimizer state dtype")
    if implementation not in ("auto", "for-loop", "fused"):
        raise UserError(f"optimizer implementation '{implementation}' is not available with {state_dtype} "
                        "optimizer state (torchao's update runs one parameter at a time); use auto, fused "
                        "(compiled) or for-loop (eager)")
    try:
        import torchao.optim
    except ImportError as exc:
        raise UserError(f"optim.state_dtype = {state_dtype} uses torchao's low-bit AdamW, but torchao is not "
                        f"installed ({exc}); run `pip install torchao`, or use optim.state_dtype = fp32 or bf16"
                        ) from exc
    base = torchao.optim.AdamW8bit if state_dtype == "int8" else torchao.optim.AdamW4bit
    return _low_bit_class(base)(_as_groups(params_or_groups), lr=lr, betas=betas, eps=eps,
                                weight_decay=weight_decay, compiled=implementation != "for-loop")


_LOW_BIT_CLASSES: dict[type, type] = {}
_MOMENTS = {"exp_avg": True, "exp_avg_sq": False, "max_exp_avg_sq": False}  # moment: signed codes


def _low_bit_class(base: type) -> type:
    """`base` (a torchao low-bit AdamW) with float learning rates and an eager mode; made once per
    base so that pickling and isinstance checks see one class."""
    if base in _LOW_BIT_CLASSES:
        return _LOW_BIT_CLASSES[base]

    class LowBitAdamW(base):
        def __init__(self, params, *, compiled: bool = True, **hyper):
            super().__init__(params, **hyper)
            self.compiled = compiled
            self.state_dtype = "int8" if "8bit" in base.__name__ else "int4"

        def add_param_group(self, param_group: dict) -> None:
            # torchao turns lr into a tensor here; keep the float every other optimizer has.
            torch.optim.Optimizer.add_param_group(self, param_group)

        @torch.no_grad()
        def step(self, closure=None):
            lrs = [group["lr"] for group in self.param_groups]
            for group in self.param_groups:
                # torchao's step refuses a float lr (a compiled graph would specialize on its value).
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32)
            try:
                if self.compiled:
                    return super().step(closure)
                with torch.compiler.set_stance("force_eager"):
                    return super().step(closure)
            finally:
                for group, lr in zip(self.param_groups, lrs):
                    group["lr"] = lr

        def state_dict(self) -> dict[str, Any]:
            # Checkpoints hold each quantized moment as its plain codes and block scales (the code
            # book is a constant of the format): DCP's staging and loading handle plain tensors
            # only (torchao's subclasses lack e.g. new_empty), and the bits round-trip exactly.
            state_dict = super().state_dict()
            state = {}
            for index, entry in state_dict["state"].items():
                entry = dict(entry)  # the packed state's values are the live per-param dicts
                for key in _MOMENTS:
                    if hasattr(entry.get(key), "codes"):
                        # Under the moment's own name: DCP's flat form keys the state by the live
                        # state's names and rebuilds nested dicts ("...exp_avg.codes").
                        entry[key] = {"codes": entry[key].codes, "scale": entry[key].scale}
                state[index] = entry
            return {"state": state, "param_groups": state_dict["param_groups"]}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            # Optimizer.load_state_dict casts every state tensor to its param's dtype: a bf16
            # param's fp32 block scales would lose bits. So the moments are rebuilt from the
            # saved tensors, matched to params the way Optimizer.load_state_dict matches them.
            saved_moments = {}
            for saved_group, group in zip(state_dict["param_groups"], self.param_groups):
                for index, param in zip(saved_group["params"], group["params"]):
                    entry = state_dict["state"].get(index, {})
                    saved_moments[param] = {key: entry[key] for key in _MOMENTS if isinstance(entry.get(key), dict)}
            super().load_state_dict(state_dict)
            for param, entry in self.state.items():
                for key, signed in _MOMENTS.items():
                    if isinstance(entry.get(key), dict):
                        saved, moment = saved_moments[param][key], self._new_buffer(param, signed)
                        moment.codes.copy_(saved["codes"].to(moment.codes.device, torch.uint8).view_as(moment.codes))
                        moment.scale.copy_(saved["scale"].to(moment.scale.device).view_as(moment.scale))
                        entry[key] = moment

    LowBitAdamW.__name__ = LowBitAdamW.__qualname__ = f"LowBit{base.__name__}"
    _LOW_BIT_CLASSES[base] = LowBitAdamW
    return LowBitAdamW


# --- optimizer step inside backward ------------------------------------------------------------

def named_param_groups(model: nn.Module, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Param groups (e.g. trainer.param_groups(model, wd)) -> the same groups with
    (name, param) pairs, as OptimizerInBackward wants. Tied params take their first name."""
    names: dict[torch.Tensor, str] = {}
    for name, param in model.named_parameters():  # yields a tied param once, under its first name
        names[param] = name  # tensors hash by identity
    return [dict(group, params=[(names[p], p) for p in group["params"]]) for group in groups]


class OptimizerInBackward:
    """AdamW stepped from each parameter's post-accumulate-grad hook during backward.

    Each parameter gets its own AdamW; as soon as autograd has finished its gradient, the hook
    steps that optimizer and frees the gradient. So at most a few gradients are alive at once
    instead of all of them (saves the gradient memory: 4 bytes/param in fp32).

    named_groups: [{"params": [(name, param), ...], "weight_decay": ...}, ...]
                  (see named_param_groups); the names key state_dict().
    Usage in a training step:
        opt.set_lr(lr)                        # a torch scheduler can't drive many optimizers
        for i in range(accum):
            opt.step_enabled = i == accum - 1 # accumulate grads, step on the last backward only
            loss_i.backward()                 # the optimizer steps in here
        grad_norm = opt.take_grad_norm()      # norm of the grads that were stepped on

    Gradient clipping by global norm is impossible: the norm is known only after every
    gradient exists, and by then most params have been updated. grad_clip > 0 is refused.
    The hooks are attached on construction; detach() removes them.
    """

    def __init__(self, named_groups: list[dict[str, Any]], lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, implementation: str = "auto", state_dtype: str = "fp32",
                 grad_clip: float = 0.0):
        if grad_clip > 0:
            raise UserError("gradient clipping needs the global gradient norm, which is only known after the "
                            "whole backward, but the in-backward optimizer has already stepped by then; "
                            "set optim.grad_clip=0 with optim.in_backward")
        _check_choice(implementation, IMPLEMENTATIONS, "optimizer implementation")
        self.param_groups: list[dict[str, Any]] = []  # public hyperparameters, like a torch optimizer's
        self.params: dict[str, torch.Tensor] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self._group_of: dict[str, dict[str, Any]] = {}
        for named_group in named_groups:
            group = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                     **{k: v for k, v in named_group.items() if k != "params"}, "params": []}
            for name, param in named_group["params"]:
                if name in self.params:
                    raise ValueError(f"parameter '{name}' appears twice in the param groups")
                group["params"].append(param)
                self.params[name] = param
                self._group_of[name] = group
                self.optimizers[name] = make_adamw([param], group["lr"], group["betas"], group["eps"],
                                                   group["weight_decay"], implementation, state_dtype)
            self.param_groups.append(group)
        self.step_enabled = True
        self._grad_norm_sq: torch.Tensor | None = None
        self._handles: list[Any] = []
        self.attach()

    def attach(self) -> None:
        if not self._handles:
            self._handles = [param.register_post_accumulate_grad_hook(self._make_hook(name))
                             for name, param in self.params.items()]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _make_hook(self, name: str):
        optimizer, group = self.optimizers[name], self._group_of[name]

        def hook(param: torch.Tensor) -> None:
            if not self.step_enabled or param.grad is None:
                return  # accumulating: leave the grad to be summed with the next micro-batch's
            for key in _HYPERPARAMS:
                optimizer.param_groups[0][key] = group[key]
            # The squared norm stays on the device (no sync); take_grad_norm() sums it up.
            norm_sq = torch.linalg.vector_norm(param.grad, dtype=torch.float32).square()
            self._grad_norm_sq = norm_sq if self._grad_norm_sq is None else self._grad_norm_sq + norm_sq
            optimizer.step()
            param.grad = None  # the point of it all: this grad's memory is free before the next one exists

        return hook

    def set_lr(self, lr: float) -> None:
        for group in self.param_groups:
            group["lr"] = lr

    def take_grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the grads stepped on since the last call (a device tensor), then reset."""
        norm_sq, self._grad_norm_sq = self._grad_norm_sq, None
        if norm_sq is None:
            return torch.zeros((), device=next(iter(self.params.values())).device)
        return norm_sq.sqrt()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop grads left over, e.g. from a backward with step_enabled off that was never followed
        by a stepping one."""
        for param in self.params.values():
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """param -> its Adam state, like torch.optim.Optimizer.state (a fresh dict, read-only use)."""
        return {p: self.optimizers[name].state[p] for name, p in self.params.items()
                if p in self.optimizers[name].state}

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """parameter name -> that parameter's AdamW state_dict."""
        return {name: optimizer.state_dict() for name, optimizer in self.optimizers.items()}

    def load_state_dict(self, state_dict: dict[str, dict[str, Any]]) -> None:
        missing = sorted(set(self.optimizers) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(self.optimizers))
        if missing or unexpected:
            raise ValueError(f"optimizer state does not match the parameters: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        for name, optimizer in self.optimizers.items():
            optimizer.load_state_dict(state_dict[name])


# --- CPU-offloaded optimizer step -------------------------------------------------------------

def _wait_for_copies(devices: set[torch.device]) -> None:
    """Block the host until queued device<->host copies have landed."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        elif device.type != "cpu" and hasattr(torch, "accelerator"):
            torch.accelerator.synchronize(device)


class CPUOffloadOptimizer(torch.optim.Optimizer):
    """AdamW whose fp32 master weights and Adam state live in CPU memory.

    For models whose optimizer state does not fit on the device. step():
        grads device -> CPU (async into pinned buffers on CUDA)
        -> AdamW on the CPU master weights (fused on CPU: the fastest CPU kernel)
        -> updated weights CPU -> device (async; the next forward waits for them in stream order)
    param_groups are the device params' groups, so LR schedulers drive it as usual; their
    hyperparameters are copied into the CPU optimizer (self.inner) at each step.

    optimizer.state maps each device param to the *CPU* state of its master: the same dicts as
    self.inner.state, no device tensors. It must not be empty, because
    torch.distributed.checkpoint.get_state_dict runs a zero-lr "initializing" step on an
    optimizer whose state is empty, which would advance the step counts and decay the moments
    on every checkpoint save.
    state_dict() is the CPU optimizer's plus each param's fp32 master ("master_param"): with
    bf16 device params the master holds bits the params lack, and DCP loads the optimizer
    before the model, so the master can't be rebuilt from the params on resume.
    On a CPU device the "offload" is a second CPU copy; the code path is the same.
    """

    def __init__(self, params_or_groups: Iterable[Any], lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, implementation: str = "auto", state_dtype: str = "fp32"):
        super().__init__(_as_groups(params_or_groups), dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        # (device param, fp32 CPU master, CPU grad buffer) for every param, in group order.
        self._slots: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        master_groups = []
        for group in self.param_groups:
            masters = []
            for p in group["params"]:
                # Pinned memory makes the copies truly async on CUDA (pinning raises on CPU-only builds).
                pin = p.device.type == "cuda"
                master = torch.empty(p.shape, dtype=torch.float32, device="cpu", pin_memory=pin)
                master.copy_(p.detach())
                grad_buffer = torch.empty(p.shape, dtype=torch.float32, device="cpu", pin_memory=pin)
                self._slots.append((p, master, grad_buffer))
                masters.append(master)
            master_groups.append(dict(group, params=masters))
        self._devices = {p.device for p, _, _ in self._slots}
        self.inner = make_adamw(master_groups, lr, betas, eps, weight_decay, implementation, state_dtype)

    def _mirror_hyperparams(self) -> None:
        for group, inner_group in zip(self.param_groups, self.inner.param_groups):
            for key in _HYPERPARAMS:
                inner_group[key] = group[key]

    def _link_state(self) -> None:
        self.state = defaultdict(dict)
        for p, master, _ in self._slots:
            if master in self.inner.state:
                self.state[p] = self.inner.state[master]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for p, master, grad_buffer in self._slots:
            if p.grad is None:
                master.grad = None  # AdamW skips params without a grad; so do we
            else:
                grad_buffer.copy_(p.grad, non_blocking=True)
                master.grad = grad_buffer
        _wait_for_copies(self._devices)  # the CPU must not read a grad before its copy has landed
        self._mirror_hyperparams()
        self.inner.step()
        for p, master, _ in self._slots:
            if master.grad is not None:
                p.copy_(master, non_blocking=True)
        self._link_state()
        return loss

    def state_dict(self) -> dict[str, Any]:
        self._mirror_hyperparams()  # a scheduler may have changed lr since the last step
        state_dict = self.inner.state_dict()
        state = dict(state_dict["state"])
        for index, (_, master, _) in enumerate(self._slots):
            # A new dict: the inner state_dict's values are the live per-param state dicts.
            state[index] = {**state.get(index, {}), "master_param": master}
        # The groups as the schedulers see them (e.g. their initial_lr): the flat checkpoint form
        # keys every entry of this optimizer's own groups by parameter name.
        groups = [{**inner_group, **{key: value for key, value in group.items() if key != "params"}}
                  for group, inner_group in zip(self.param_groups, state_dict["param_groups"])]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _wait_for_copies(self._devices)  # a pending async copy may still be reading the masters
        # Saved state is keyed by whatever the saved groups list (indices, or names after DCP),
        # matched to our params by position, as Optimizer.load_state_dict does.
        saved_keys = [key for group in state_dict["param_groups"] for key in group["params"]]
        if len(saved_keys) != len(self._slots):
            raise ValueError(f"optimizer state has {len(saved_keys)} params, this optimizer {len(self._slots)}")
        inner_state = {}
        for key, (p, master, _) in zip(saved_keys, self._slots):
            saved = dict(state_dict["state"].get(key, {}))
            saved_master = saved.pop("master_param", None)
            # No saved master (state from a plain AdamW): start from the current device weights.
            master.copy_(saved_master if saved_master is not None else p.detach())
            if saved:
                inner_state[key] = saved
        self.inner.load_state_dict({"state": inner_state, "param_groups": state_dict["param_groups"]})
        for group, saved_group in zip(self.param_groups, state_dict["param_groups"]):
            group.update({key: saved_group[key] for key in _HYPERPARAMS if key in saved_group})
        self._link_state()
