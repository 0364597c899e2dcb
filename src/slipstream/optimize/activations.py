"""Activation memory: recompute or offload what the backward pass needs.

Applied from outside the model: each transformer block in `model.blocks` is replaced by a
wrapper around it, the way torchtitan's `apply_ac` does it. The model code knows nothing.

    none       keep every activation (fastest, most memory)
    full       recompute each wrapped block in backward; only its input is kept
    selective  per-op: keep the outputs of matmuls and attention, recompute the cheap
               pointwise ops (norms, activations, residual adds) in backward
    offload    keep every activation, but in CPU memory (pinned on CUDA), copied back
               for backward

The wrappers come from torch (`checkpoint_wrapper`, and `ActivationWrapper` for offload).
They add a `_checkpoint_wrapped_module.` level to parameter names, but they register
state-dict hooks that remove it again, and DCP's `get_state_dict` strips it as well, so
checkpoints keep the original keys and load into models with or without AC.

Apply activation checkpointing BEFORE torch.compile, so that compile traces the
checkpointed regions (see slipstream.optimize.compile).
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper, checkpoint_wrapper
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from slipstream.errors import UserError
from slipstream.models.transformer import block_slots

MODES = ("none", "full", "selective", "offload")


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 1) -> nn.Module:
    """Wrap the blocks of `model` (in place) for activation checkpointing; returns `model`.

    `every` applies to "full" only: block i is checkpointed when i % every == 0, so every=2
    recomputes half the blocks (a memory/compute trade-off between none and full).
    "selective" and "offload" wrap every block.
    """
    if mode not in MODES:
        raise UserError(f"unknown activation checkpointing mode {mode!r}; valid: {', '.join(MODES)}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise UserError(f"activation checkpointing 'every' must be an integer >= 1 (1 = every block), got {every!r}")
    if mode == "none":
        return model
    slots = block_slots(model)
    if any(isinstance(block, ActivationWrapper) for _, block in slots):
        raise UserError("activation checkpointing is already applied to this model; apply it once")
    if _is_compiled(model) or any(_is_compiled(block) for _, block in slots):
        # Wrapping compiled blocks would put the checkpoint outside the compiled code, and
        # compile would never see the recomputation.
        raise UserError("apply activation checkpointing before torch.compile, not after")

    for i, block in slots:  # i: the block's index in the whole model (a pipeline stage holds some)
        if mode == "full" and int(i) % every == 0:
            # Non-reentrant checkpoint: works with keyword args, with torch.compile and with
            # parameters that do not require grad; the RNG state is saved so dropout
            # recomputes the same mask.
            model.blocks[i] = checkpoint_wrapper(block, preserve_rng_state=True)
        elif mode == "selective":
            # context_fn is called on every forward: each call gets fresh caching contexts.
            context_fn = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
            model.blocks[i] = checkpoint_wrapper(block, context_fn=context_fn, preserve_rng_state=True)
        elif mode == "offload":
            model.blocks[i] = OffloadActivations(block)
    return model


def _is_compiled(module: nn.Module) -> bool:
    # In-place `module.compile()` stores the compiled callable here (torch.compile(module)
    # would instead return an OptimizedModule wrapper, which has no `.blocks`).
    return getattr(module, "_compiled_call_impl", None) is not None


# --- selective: which ops to keep --------------------------------------------------------

def _ops_to_save() -> set:
    """ATen ops whose outputs selective AC keeps: the compute-heavy ones.

    nn.Linear never reaches the policy as `aten.linear`: linear is a composite op that is
    decomposed before dispatch, into addmm (with bias) or mm on the input flattened to 2-D,
    so those two cover it (checked: the tiny model's blocks show addmm, the Llama ones mm).
    SDPA appears as the backend kernel that actually runs (flash / efficient / cudnn on
    CUDA, flash_for_cpu on CPU). Names are looked up so an op missing from an older
    torch build is simply skipped.
    """
    names = (
        "mm", "addmm", "bmm", "baddbmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    )
    return {getattr(torch.ops.aten, name) for name in names if hasattr(torch.ops.aten, name)}


_SAVE_OPS = _ops_to_save()


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    # `op` is an overload (aten.mm.default); compare its packet (aten.mm) with the set.
    # Under torch.compile the policy can also see non-ATen operators: they have no packet.
    if getattr(op, "overloadpacket", None) in _SAVE_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


# --- offload -------------------------------------------------------------------------------

class OffloadActivations(ActivationWrapper):
    """Runs the wrapped block with its saved-for-backward tensors moved to CPU memory.

    torch's own `offload_wrapper` always asks for pinned memory, which does not exist on a
    CPU-only machine; here we pin only when the activations are on CUDA (pinned memory makes
    the device-to-host copy asynchronous). On a CPU device nothing moves: save_on_cpu keeps
    CPU tensors as they are. Subclassing ActivationWrapper gives the same state-dict hooks
    (original keys) as checkpoint_wrapper.
    """

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        with torch.autograd.graph.save_on_cpu(pin_memory=x.device.type == "cuda"):
            return self._checkpoint_wrapped_module(x, *args, **kwargs)


# --- measurement ---------------------------------------------------------------------------

def activation_memory_bytes(model: nn.Module, batch_fn: Callable[[], Any]) -> int:
    """Bytes of activations one forward pass keeps alive for backward, on the model's device.

    `batch_fn()` returns the model's input (a tensor, or a tuple of positional args). We run
    one forward with grad enabled, keep its output (and so the autograd graph) alive, and
    count every storage that the forward allocated and that is still alive afterwards,
    except the output itself. Each storage is counted once, however many views share it.

    Why not just a saved_tensors_hooks pack hook: only the innermost hooks see a saved
    tensor, and checkpoint and save_on_cpu install their own hooks, while selective AC keeps
    its saved matmul outputs in a cache that no hook sees. Counting what stays alive sees
    all of these: the inputs that full AC keeps, the outputs that selective AC caches, and
    for offload only what stays on the training device (copies moved to CPU memory have
    another device and are not counted; on a CPU device nothing moves, so offload counts
    the same as none).
    Run it on an eager model (before compile); parameters and inputs are never counted.
    """
    device = next(model.parameters()).device
    inputs = batch_fn()
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    # Storages that exist before the forward are not its activations: parameters, buffers,
    # inputs, and every view of them (views share their base's storage).
    existing = [*model.parameters(), *model.buffers(), *(a for a in args if isinstance(a, torch.Tensor))]
    with torch.enable_grad(), _StorageRecorder(existing) as recorder:
        output = model(*args)
    gc.collect()  # free whatever only reference cycles still hold, so only real references count
    output_storages = {StorageWeakRef(t.untyped_storage()) for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)}
    total = 0
    for ref, (nbytes, storage_device) in recorder.storages.items():
        if not ref.expired() and ref not in output_storages and storage_device == device:
            total += nbytes
    del output
    return total


class _StorageRecorder(TorchDispatchMode):
    """Records (with weak references) the storage of every tensor an ATen op returns.

    Weak references keep no memory alive; they also keep a freed storage's identity from
    being reused, so one storage is one dict entry. Views return their base's storage and
    add nothing. The storages of `existing` tensors are skipped.
    """

    def __init__(self, existing: list[torch.Tensor]):
        super().__init__()
        self.storages: dict[StorageWeakRef, tuple[int, torch.device]] = {}
        self._before = {StorageWeakRef(t.untyped_storage()) for t in existing}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                if ref not in self._before and ref not in self.storages:
                    self.storages[ref] = (storage.nbytes(), t.device)
        return out

