"""Measure a user nn.Module for the planner on fake tensors: no real memory, any size.

    model = trace_module("mypkg.models:make_lm", vocab=32000, seq_len=2048)
    model.traced.flops_per_token, model.traced.activation_bytes_per_sequence["bf16"]

`--model package.module:function` names a factory that returns an nn.Module mapping token
ids (B, T) int64 to logits (B, T, V) (slipstream's Transformer, an HF causal LM, your own
model). We import the factory and call it inside PyTorch's FakeTensorMode, so every
parameter is a FakeTensor: it has a shape, dtype and device but no storage, and every op
on it computes only the output's metadata. A 70B model traces in seconds on a laptop.

If the factory declares parameters named `vocab_size`/`vocab` or `seq_len`/`max_seq_len`
(without being required to), they are passed the planner's vocabulary and sequence length.

What we measure, all on fake CPU tensors:
- n_params: unique trainable parameters (tied weights counted once);
- flops_per_token: FlopCounterMode around forward + backward of the next-token loss
  (`cross_entropy(logits.float().view(-1, V), targets)`) at batch 1 and seq_len, / seq_len.
  CPU attention (`_scaled_dot_product_flash_attention_for_cpu`, which torch's counter does
  not know) is counted with torch's formulas for the CUDA kernels: the full T x T (no causal
  discount), and a backward of 2.5x the forward (flash attention recomputes the scores), so
  slipstream's Transformer measures ~2-3% above models.flops (which counts backward as 2x);
- memory: one training step (forward, backward, fused AdamW step, zero_grad(set_to_none=True)),
  forward + backward tracked by PyTorch's MemTracker, after a first unmeasured step so the
  optimizer state exists, at micro-batch 1 and 2, in fp32 and under
  `torch.autocast("cpu", dtype=torch.bfloat16)`:

      activation_bytes_per_sequence = peak(2) - peak(1)
      fixed_bytes = peak(1) - activation_bytes_per_sequence - params - grads - optimizer state  (>= 0)
      peak_bytes = peak(1)

  where peak(b) is the highest tracked total of the forward and backward at micro-batch b
  (the optimizer step adds nothing that grows with the batch; fused AdamW makes no
  temporaries, so its peak is params + grads + optimizer state). A micro-batch b step peaks
  at peak_bytes + (b - 1) * activation_bytes_per_sequence (`TracedModule.step_peak_bytes`),
  and at most at params + grads + optimizer state + b * activations + fixed_bytes: gradients
  are None between steps, and a step usually peaks early in backward, before most gradients
  exist (fixed_bytes is then clamped to 0 and `peak_grad_bytes` says how many existed).
  Autocast's low-precision weight copies are counted in the bf16 numbers.

Bytes are MemTracker's (tensor storages; CUDA's allocator adds fragmentation and kernel
workspaces on top, which the planner's memory model accounts for). Forward code that
depends on tensor values (`.item()`, `nonzero`, boolean masks, data-dependent Python
branches) cannot run on fake tensors: such a model gets a UserError naming the op.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed._tools.mem_tracker import _TOTAL_KEY
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from slipstream.config.schema import ModelConfig
from slipstream.errors import UserError
from slipstream.memtrack import PeakMemTracker
from slipstream.plan.space import PlanModel

PRECISIONS = ("fp32", "bf16")
SPEC_FORMAT = "package.module:function"


@dataclass(frozen=True)
class TracedModule:
    """What the planner knows about a user nn.Module, measured on fake tensors (module doc).

    Bytes are for one process holding the whole model (no sharding), as MemTracker tracked
    them; activation_bytes_per_sequence and fixed_bytes are per precision ("fp32", "bf16").
    """

    spec: str
    seq_len: int                       # the sequence length the trace ran at
    vocab: int                         # the logits' last dimension (the model's own vocabulary)
    n_params: int                      # unique trainable parameters, tied counted once
    flops_per_token: float             # training (fwd + bwd) FLOPs per token at seq_len, measured
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes_per_sequence: dict[str, int]   # {"fp32": ..., "bf16": ...}
    fixed_bytes: dict[str, int]                     # batch-independent temporaries, per precision
    notes: tuple[str, ...] = ()
    # Measured at micro-batch 1, per precision: the step's peak (forward + backward) and the
    # gradient bytes live at that peak (less than grad_bytes when the peak comes before
    # backward has made every gradient; then fixed_bytes is clamped to 0 and
    # params + grads + optimizer + b * activations + fixed overestimates by the difference).
    peak_bytes: dict[str, int] = field(default_factory=dict)
    peak_grad_bytes: dict[str, int] = field(default_factory=dict)

    def step_peak_bytes(self, micro_batch: int, precision: str = "fp32") -> int:
        """Tracked peak of one unsharded training step at `micro_batch` sequences of seq_len
        (precision "fp32", or "bf16"/"fp16" for autocast)."""
        key = "fp32" if precision == "fp32" else "bf16"
        acts = self.activation_bytes_per_sequence[key]
        if key in self.peak_bytes:
            return self.peak_bytes[key] + (micro_batch - 1) * acts
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + micro_batch * acts + self.fixed_bytes[key]


def trace_module(spec: str, vocab: int, seq_len: int) -> PlanModel:
    """Import the factory `spec` names, build its module on fake tensors and measure it."""
    if vocab < 1 or seq_len < 1:
        raise UserError(f"tracing {spec} needs vocab >= 1 and seq_len >= 1, got vocab {vocab}, seq_len {seq_len}")
    factory = load_factory(spec)
    with _quiet_fake_tensor_log():
        return _trace(factory, spec, vocab, seq_len)


def _trace(factory: Callable[..., Any], spec: str, vocab: int, seq_len: int) -> PlanModel:
    fake_mode = FakeTensorMode()
    notes: list[str] = []
    model = _build(factory, spec, vocab, seq_len, fake_mode)
    model.train()

    params = list(model.parameters())  # each tensor once, however often it is shared (tied weights)
    n_params = sum(p.numel() for p in params if p.requires_grad)
    if n_params == 0:
        raise UserError(f"{spec} returned a module without trainable parameters; the planner plans training")

    with fake_mode, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimizer, implementation = _adamw([p for p in params if p.requires_grad])
        if implementation != "fused":
            notes.append(f"AdamW ran as {implementation} (fused AdamW failed on fake tensors); its temporaries "
                         "count as optimizer state")
        # First step: counts the FLOPs and creates the optimizer state; not measured for memory.
        with FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION_FLOPS) as counter:
            out_vocab = _forward_backward(model, spec, vocab, seq_len, batch=1, autocast=False, first=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        flops_per_token = counter.get_total_flops() / seq_len
        if out_vocab < vocab:
            notes.append(f"the model's logits have {out_vocab} entries per token, fewer than the planner's vocabulary "
                         f"({vocab}); pass the model's vocabulary to the planner")

        try:
            fp32 = [_measure_step(model, optimizer, vocab, seq_len, b, autocast=False) for b in (1, 2)]
        except Exception as exc:
            raise UserError(f"{spec} ran at micro-batch 1 but measuring a training step at micro-batches 1 and 2 "
                            f"failed: {type(exc).__name__}: {_first_line(exc)}") from exc
        try:
            bf16 = [_measure_step(model, optimizer, vocab, seq_len, b, autocast=True) for b in (1, 2)]
        except Exception as exc:  # noqa: BLE001 - any failure of the autocast variant falls back to fp32
            optimizer.zero_grad(set_to_none=True)
            bf16 = fp32
            notes.append(f"bf16 autocast failed on fake tensors ({type(exc).__name__}: {_first_line(exc)}); "
                         "the bf16 numbers are the fp32 ones")

    state = fp32[0]
    param_bytes, grad_bytes, optimizer_bytes = state.param_bytes, state.grad_bytes, state.optimizer_bytes
    persistent = param_bytes + grad_bytes + optimizer_bytes
    acts: dict[str, int] = {}
    fixed: dict[str, int] = {}
    for name, (one, two) in zip(PRECISIONS, (fp32, bf16)):
        acts[name] = max(0, two.fb_peak - one.fb_peak)
        fixed[name] = max(0, one.fb_peak - acts[name] - persistent)
    missing = persistent - (fp32[0].fb_peak - acts["fp32"])
    if missing > 0.01 * fp32[0].fb_peak:
        notes.append(f"the step peaks before backward has made every gradient: params + grads + optimizer state + "
                     f"micro_batch x activations overestimates the peak by up to {missing / 2**20:.0f} MiB "
                     "(peak_bytes holds the measured peak)")

    traced = TracedModule(spec=spec, seq_len=seq_len, vocab=out_vocab, n_params=n_params,
                          flops_per_token=float(flops_per_token), param_bytes=param_bytes, grad_bytes=grad_bytes,
                          optimizer_bytes=optimizer_bytes, activation_bytes_per_sequence=acts, fixed_bytes=fixed,
                          notes=tuple(notes), peak_bytes={n: m[0].fb_peak for n, m in zip(PRECISIONS, (fp32, bf16))},
                          peak_grad_bytes={n: m[0].peak_grad_bytes for n, m in zip(PRECISIONS, (fp32, bf16))})
    # The planner branches on `traced`; the config only fills PlanModel's required field.
    cfg = ModelConfig(preset="gpt-mini", n_layer=1, n_head=1, d_model=64, vocab_size=out_vocab, max_seq_len=seq_len)
    return PlanModel(name=spec, cfg=cfg, traced=traced)


# --- the factory ---------------------------------------------------------------------------

def load_factory(spec: str) -> Callable[..., Any]:
    """The callable `package.module:function` names (the current directory is importable)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr or ":" in attr or "/" in module_name or module_name.endswith(".py"):
        raise UserError(f"--model '{spec}' is not a factory reference; write it as '{SPEC_FORMAT}' "
                        "(a Python module path, a colon, and a function returning an nn.Module), "
                        "e.g. 'mypkg.models:make_lm'")
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"cannot import module '{module_name}' of --model '{spec}': {type(exc).__name__}: {exc}. "
                        f"Run from the directory that holds the package, or install it (expected '{SPEC_FORMAT}')") from exc
    except Exception as exc:
        raise UserError(f"importing module '{module_name}' of --model '{spec}' failed: "
                        f"{type(exc).__name__}: {exc}") from exc
    finally:
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(cwd)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n, v in vars(module).items() if not n.startswith("_") and callable(v)
                            and getattr(v, "__module__", None) == module.__name__)
            hint = f" Callables there: {', '.join(public[:12])}" if public else ""
            raise UserError(f"module '{module_name}' has no attribute '{attr}' (from --model '{spec}').{hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserError(f"'{spec}' is not callable (it is of type {type(obj).__name__}); --model '{SPEC_FORMAT}' must name "
                        "a function (or class) that returns an nn.Module")
    return obj


def _factory_kwargs(factory: Callable[..., Any], vocab: int, seq_len: int) -> dict[str, int]:
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}
    kwargs = {}
    for name, value in (("vocab_size", vocab), ("vocab", vocab), ("seq_len", seq_len), ("max_seq_len", seq_len)):
        p = parameters.get(name)
        if p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            kwargs[name] = value
    return kwargs


def _build(factory: Callable[..., Any], spec: str, vocab: int, seq_len: int, fake_mode: FakeTensorMode) -> nn.Module:
    """Call the factory with every tensor fake (on CPU), and check what comes back."""
    kwargs = _factory_kwargs(factory, vocab, seq_len)
    try:
        with _fake_construction(fake_mode), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = factory(**kwargs)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"calling the factory {spec}({', '.join(f'{k}={v}' for k, v in kwargs.items())}) on fake "
                        f"tensors failed: {type(exc).__name__}: {_first_line(exc)}. The planner builds the model "
                        "inside torch's FakeTensorMode (no memory): the factory must not need real tensor values "
                        "(e.g. loading weights from a file)") from exc
    if not isinstance(model, nn.Module):
        raise UserError(f"{spec} returned an object of type {type(model).__name__}, not a torch.nn.Module; the factory must return "
                        "the model (token ids (B, T) -> logits (B, T, V))")
    _make_fake_cpu(model, fake_mode)
    return model


@contextlib.contextmanager
def _fake_construction(fake_mode: FakeTensorMode) -> Iterator[None]:
    """FakeTensorMode, with every device but meta mapped to CPU, and module conversions
    (to_empty, .to, .cuda) allowed: nn.Module._apply swaps fake parameters with
    torch.utils.swap_tensors, which refuses a tensor that the fake mode's memo still
    references weakly; we drop that memo (it only maps real tensors to their fakes) first."""
    original_swap = torch.utils.swap_tensors

    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        fake_mode.fake_tensor_converter.meta_converter.tensor_memo.clear()
        return original_swap(t1, t2)

    torch.utils.swap_tensors = swap_tensors
    try:
        with fake_mode, _CpuDevices():
            yield
    finally:
        torch.utils.swap_tensors = original_swap


def _cpu_device(device: Any) -> Any:
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError):
        return device
    return device if dev.type in ("cpu", "meta") else torch.device("cpu")


class _CpuDevices(TorchFunctionMode):
    """Keeps a factory's tensors on CPU (or meta): `.cuda()`, `.to("cuda")` and
    `device="cuda"` become CPU, so a factory written for a GPU traces on any machine."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cuda, getattr(torch.Tensor, "xpu", None), getattr(torch.Tensor, "mps", None)):
            return args[0]
        if "device" in kwargs and kwargs["device"] is not None:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, torch.device, int)):
            args = (args[0], _cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


def _make_fake_cpu(model: nn.Module, fake_mode: FakeTensorMode) -> None:
    """Every parameter and buffer a fake CPU tensor: meta ones (a factory that built on the
    meta device) get fake storage, real ones are converted; tied parameters stay tied."""
    converted: dict[int, torch.Tensor] = {}

    def convert(t: torch.Tensor, is_param: bool) -> torch.Tensor:
        if isinstance(t, FakeTensor) and t.device.type == "cpu":
            return t
        if id(t) not in converted:
            with fake_mode:
                if isinstance(t, FakeTensor) or t.device.type != "cpu":
                    new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
                else:
                    new = fake_mode.from_tensor(t, static_shapes=True)
            if is_param:
                new = nn.Parameter(new, requires_grad=t.requires_grad)
            converted[id(t)] = new
        return converted[id(t)]

    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = convert(p, True)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = convert(b, False)


# --- the step -------------------------------------------------------------------------------

def _adamw(params: list[torch.Tensor]) -> tuple[torch.optim.Optimizer, str]:
    """AdamW as slipstream runs it on CPU and CUDA (fused), or foreach where fused fails."""
    for implementation, flags in (("fused", {"fused": True}), ("foreach", {"foreach": True, "fused": False}),
                                  ("for-loop", {"foreach": False, "fused": False})):
        try:
            optimizer = torch.optim.AdamW(params, lr=1e-4, **flags)
        except (RuntimeError, ValueError):
            continue
        return optimizer, implementation
    raise UserError("AdamW cannot be built for these parameters")  # pragma: no cover - for-loop always builds


def _loss_of(output: Any) -> torch.Tensor | None:
    """The logits in a model's output: a tensor, an HF ModelOutput (.logits), a dict or a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, dict) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"]
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def _forward_backward(model: nn.Module, spec: str, vocab: int, seq_len: int, batch: int, autocast: bool,
                      first: bool = False) -> int:
    """Forward + next-token loss + backward on fake token ids; returns the logits' width.
    On the first call, failures become UserErrors that say what the planner gave the model."""
    idx = torch.randint(0, vocab, (batch, seq_len), dtype=torch.long)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with context:
        try:
            output = model(idx)
        except Exception as exc:
            if not first:
                raise
            raise UserError(_forward_error(spec, vocab, seq_len, batch, exc)) from exc
        logits = _loss_of(output)
        if first:
            if logits is None:
                raise UserError(f"{spec}'s forward returned an object of type {type(output).__name__}; the planner expects token ids "
                                f"(B, T) -> logits (B, T, V) (a tensor, or an output with .logits)")
            if logits.dim() != 3 or tuple(logits.shape[:2]) != (batch, seq_len):
                raise UserError(f"{spec}'s forward gave logits of shape {tuple(logits.shape)} for token ids of shape "
                                f"({batch}, {seq_len}); the planner expects token ids (B, T) -> logits (B, T, V)")
        V = logits.shape[-1]
        targets = torch.randint(0, V, (batch, seq_len), dtype=torch.long)
        loss = F.cross_entropy(logits.float().view(-1, V), targets.view(-1))
    try:
        loss.backward()
    except Exception as exc:
        if not first:
            raise
        raise UserError(f"backward of {spec} failed on fake tensors: {type(exc).__name__}: {_first_line(exc)}") from exc
    return int(V)


def _forward_error(spec: str, vocab: int, seq_len: int, batch: int, exc: Exception) -> str:
    message = (f"{spec}'s forward failed on the planner's input: model(idx) with idx int64 token ids of shape "
               f"({batch}, {seq_len}) in [0, {vocab}) (fake tensors on CPU). The planner expects a module that maps "
               f"token ids (B, T) to logits (B, T, V). Error: {type(exc).__name__}: {_first_line(exc)}")
    name = type(exc).__name__
    if "DataDependent" in name or "DynamicOutputShape" in name or "UnsupportedOperator" in name:
        message += (". The forward needs tensor values (e.g. .item(), nonzero, boolean masks) or an op without a "
                    "fake-tensor implementation, which cannot run on fake tensors")
    return message


@dataclass(frozen=True)
class _StepMemory:
    fb_peak: int          # highest tracked bytes of the forward and backward
    peak_grad_bytes: int  # gradient bytes live at that peak
    param_bytes: int
    grad_bytes: int       # when backward ended: every gradient exists
    optimizer_bytes: int


def _bytes_by_reftype(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for dev_snap in snapshot.values():
        for reftype, nbytes in dev_snap.items():
            name = getattr(reftype, "value", reftype)
            out[name] = out.get(name, 0) + nbytes
    return out


def _measure_step(model: nn.Module, optimizer: torch.optim.Optimizer, vocab: int, seq_len: int, batch: int,
                  autocast: bool) -> _StepMemory:
    """Tracked forward + backward of one micro-batch, then the (untracked) optimizer step."""
    tracker = PeakMemTracker()  # the stock tracker costs (modules x ops): see slipstream/memtrack.py
    # Parameters, buffers, optimizer state exist before the step: counted from the start.
    tracker.track_external(model, optimizer)
    with tracker:
        _forward_backward(model, "", vocab, seq_len, batch, autocast)
        end = _bytes_by_reftype(tracker.get_tracker_snapshot("current"))
    peak = _bytes_by_reftype(tracker.get_tracker_snapshot("peak"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return _StepMemory(fb_peak=peak.get(_TOTAL_KEY, 0), peak_grad_bytes=peak.get("Gradient", 0), param_bytes=end.get("Parameter", 0),
                       grad_bytes=end.get("Gradient", 0), optimizer_bytes=end.get("Optstate", 0))


def _sdpa_cpu_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:  # type: ignore[no-untyped-def]
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_cpu_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,  # type: ignore[no-untyped-def]
                             **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


_CPU_ATTENTION_FLOPS: dict[Any, Any] = {}
for _name, _formula in (("_scaled_dot_product_flash_attention_for_cpu", _sdpa_cpu_flops),
                        ("_scaled_dot_product_flash_attention_for_cpu_backward", _sdpa_cpu_backward_flops)):
    _op = getattr(torch.ops.aten, _name, None)
    if _op is not None:
        _CPU_ATTENTION_FLOPS[_op] = _formula


@contextlib.contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """FakeTensorMode logs a traceback for every op that fails; we report failures as UserErrors."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
