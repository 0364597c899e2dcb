"""Dropout under tensor and context parallelism: the same mask where an activation is
replicated, a different mask on every rank where it is sharded.

A dropout mask comes from the random generator of the activation's device. Where an activation
is replicated over a mesh dimension, its replicas hold the same values and must drop the same
ones, or they diverge: their generators must be equal. `slipstream train` seeds every rank alike
(seed_all(train.seed)); the Python API's Trainer seeds nothing, and torch seeds every process
differently at start. So the tp step hands the generator state of each tp group's first rank to
the whole group, once, when the model is split (with dropout > 0 and a replicated stream); from
then on the ranks draw the same numbers in the same order and stay equal. Where an activation is
sharded, equal generators are wrong: every shard would draw the mask of the first one, so the
mask of the whole tensor would repeat (or, for heads, correlate) shard after shard.

The rule, applied from outside the model by hooks on its modules:

    replicated over every mesh dim      the default generator, as it is (no hook)
    sharded over some mesh dims         during the module's forward the device's generator is
                                        seeded with base + the rank's index over those dims, and
                                        restored afterwards (torch.random.fork_rng); base is one
                                        number drawn from the default CPU generator, identically
                                        on every rank, so it is new at every call (every layer,
                                        every step) and the same on all ranks

What is sharded (each apply step says it for its own mesh dimension, see shard_dropout_rng):

    tp                  attention dropout (each rank computes its own heads); the embedding and
                        residual dropouts see the replicated residual stream: shared masks
    tp + sequence par.  also the embedding and residual dropouts (sequence shards)
    cp                  every dropout: the residual stream is sequence-sharded, and attention
                        works on the rank's own queries (over all keys)

So at cp2 x tp2 without sequence parallel the residual dropouts differ between the cp ranks and
agree within each tp group, while attention dropout differs on all four ranks. Data-parallel
ranks are left as they are without tp or cp: not in the index, and their generators untouched
(`slipstream train`: seeded alike, so they draw the same masks, on different data; the Python
API: seeded by torch, differently).

Why a base drawn from the default generator, and not a counter or a generator of our own:
activation checkpointing restores the default generators (the CPU one and those of the input's
devices) before it recomputes a block in backward, so the recompute draws the same base, seeds
the same streams and replays the same masks; a counter would have moved on. And checkpoints
save the default generators, so a resumed run continues the same streams. The base comes from the
CPU generator on every device: reading a CUDA number would make the host wait for the device.

At model.dropout = 0 nothing is installed, so nothing changes. In eval mode nothing is drawn.
With compile.scope the tp and cp checks refuse dropout > 0: dynamo cannot trace the hooks (the
.item(), fork_rng and manual_seed each break the graph), and a checkpointed block then falls back
to eager as a whole (measured, torch 2.13).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from slipstream.models.transformer import block_slots

# base + a rank index stays a valid 64-bit seed. (The CPU generator keeps a seed's low 32 bits:
# base + index still differs there for every index.)
_BASE_RANGE = 2**62


class _RankStreams:
    """Forward hooks of one module whose activations are sharded: a stream per rank."""

    def __init__(self):
        self.shards: list[tuple[int, int]] = []  # (this rank's index, size) per mesh dim that shards the module
        self._forks: list = []  # open fork_rng contexts, one per forward in progress (None in eval)

    def rank_index(self) -> int:
        """This rank's index over the sharding mesh dims (mixed radix: unique per shard)."""
        index, stride = 0, 1
        for rank, size in self.shards:
            index += rank * stride
            stride *= size
        return index

    def enter(self, module: nn.Module, args) -> None:
        if not module.training:  # no dropout: draw nothing, so eval leaves the generators alone
            self._forks.append(None)
            return
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        if device is None:  # the slipstream Transformer passes its activations positionally
            raise RuntimeError(f"sharded dropout: {type(module).__name__} was called without a positional tensor; "
                               "cannot tell which device's generator draws its mask")
        # The same number on ranks whose CPU generators are equal (a tp group after
        # share_generator_state; every rank under `slipstream train`), and the same again when
        # activation checkpointing recomputes this forward (it restores the generator first).
        # A CPU draw: .item() of it does not wait for any device.
        base = int(torch.randint(_BASE_RANGE, (1,)).item())
        on_cpu = device.type == "cpu"
        # Saves the CPU generator and (off CPU) only this device's; restored in leave().
        fork = torch.random.fork_rng(devices=[] if on_cpu else [device], device_type=device.type)
        fork.__enter__()
        self._forks.append(fork)
        seed = base + self.rank_index()
        if on_cpu:
            torch.default_generator.manual_seed(seed)
        else:
            device_module = torch.get_device_module(device)
            with device_module.device(device):  # manual_seed seeds the current device's generator
                device_module.manual_seed(seed)

    def leave(self, module: nn.Module, args, output) -> None:
        fork = self._forks.pop()
        if fork is not None:
            fork.__exit__(None, None, None)


def shard_dropout_rng(model: nn.Module, mesh, stream_sharded: bool) -> nn.Module:
    """Give every dropout of a slipstream Transformer whose activations `mesh` shards a mask of
    its own per rank of `mesh` (in place; see the module doc).

    Attention dropout is always sharded (heads over tp, queries over cp); the embedding and the
    blocks' residual dropouts when `stream_sharded` (sequence parallel over tp; always over cp).
    The tp and cp steps each call this for their own mesh: a module sharded over both gets one
    index over the two."""
    if model.cfg.dropout == 0:  # nothing is ever drawn: install nothing
        return model
    if not stream_sharded:  # the residual stream is replicated over `mesh`: its masks must agree
        share_generator_state(mesh)
    blocks = [block for _, block in block_slots(model)]  # a pipeline stage holds some of them
    modules = [block.attn for block in blocks]  # scaled_dot_product_attention's dropout_p
    if stream_sharded:
        embedding = [model.emb_dropout] if hasattr(model, "emb_dropout") else []
        modules += [*embedding, *(block.dropout for block in blocks)]
    for module in modules:
        streams = getattr(module, "_rank_streams", None)
        if streams is None:
            streams = module._rank_streams = _RankStreams()
            module.register_forward_pre_hook(streams.enter)
            module.register_forward_hook(streams.leave, always_call=True)  # restore even if forward raises
        streams.shards.append((mesh.get_local_rank(), mesh.size()))
    return model


def share_generator_state(mesh) -> None:
    """Every rank of `mesh` takes the default generator states (CPU, and the mesh's device's) of the
    mesh's first rank, which keeps its own: afterwards equal draws give equal numbers."""
    import torch.distributed as dist

    on_device = mesh.device_type != "cpu"
    device_module = torch.get_device_module(mesh.device_type) if on_device else None
    states = [torch.get_rng_state(), device_module.get_rng_state() if on_device else None]  # current device
    # Communicates: one broadcast over the mesh's group, once, when the model is split.
    dist.broadcast_object_list(states, group=mesh.get_group(), group_src=0)
    torch.set_rng_state(states[0])
    if on_device:
        device_module.set_rng_state(states[1])
