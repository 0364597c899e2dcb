"""parallel.cp_attention = ring: torch's own ring attention as the context-parallel kernel.

The all-gather kernel (context_parallel.py) gives every rank the keys and values of the whole
sequence. Ring attention keeps them sharded: each rank holds its own K/V chunk, and over cp
steps the chunks travel around the cp group (rank r sends to r + 1) while every step runs
torch's fused attention kernel on the local queries and the chunk at hand; the partial outputs
are merged by their log-sum-exp. The backward runs the same ring and sends each K/V gradient
home. Nothing here implements that: torch does, in
torch.distributed.tensor.experimental._context_parallel (`_templated_ring_attention`), behind
its DTensor dispatcher: an SDPA call on query/key/value DTensors sharded on the sequence dim
(dim 2) of the cp mesh dispatches its fused op (flash, memory-efficient or cuDNN, whichever
torch's SDPA picks) to the ring version of it.

So the kernel wraps this rank's q, k, v (already the rank's tokens: the trainer split the batch)
as such DTensors, calls SDPA with is_causal and takes the local output. torch's
`context_parallel()` context manager is not used: it also shards buffers in place, and slipstream's
batches arrive split.

How torch's ring reads the layout: with `enable_load_balance` every rank's shard is two chunks of
2 x cp, rank r holding chunks r and 2cp - 1 - r (its head-tail layout, `_HeadTailLoadBalancer`),
which is exactly parallel.cp_load_balance's; without it rank r holds chunk r of cp. Its
`rotate_method` is set to all-to-all, the ring proper (torch's default all-gathers K/V once per
layer, which is what cp_attention = allgather does already). Both are fields of one process-wide
object (`_cp_options`) that torch reads at every forward and backward call, so each kernel sets
them to its own before each of its calls (two kernels of one process may differ: `RingAttention.ring`).

What it sends per layer and micro-batch (torch's _templated_ring_attention[_backward]): forward,
cp - 1 hops of this rank's K and V (repeated to n_head heads, below) to the next rank; backward,
cp - 1 such K/V hops again and cp hops of their gradients, in fp32 (torch's `convert_to_f32`);
activation checkpointing repeats the forward's.

Limits (refused before any work, config/load.check_cp_attention_rules and context_parallel.
check_context_parallel): CUDA only (torch's ring calls CUDA's fused SDPA ops, which have no CPU
kernels), is_causal without a mask, no attention dropout (the ring's backward replays every step
with the last step's random state), no activation offload (its pinned copies cannot take the
DTensors the ring saves), and chunks of a multiple of 32 tokens (CUDA's memory-efficient kernel
pads its log-sum-exp to 32 queries, which torch's merge cannot take). GQA: torch's ring hands
K/V to each step's fused op as they are, and not every fused kernel takes fewer K/V heads than
query heads, so K/V are repeated to the query heads first (the ring then carries n_head /
n_kv_head times the bytes of the K/V shards). Under torch.compile the ring runs eagerly, a graph
break (`RingAttention.ring` says why), so compile.fullgraph is refused with it.

These are private torch APIs; they are looked up by name and a missing one is a UserError that
names the torch needed and the fix (--parallel.cp_attention=allgather).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.nn.attention import SDPBackend, sdpa_kernel

from slipstream.errors import UserError

# Where torch keeps its context-parallel attention: the _context_parallel package (torch 2.13),
# and the older module path that torch keeps as an alias of it.
_TORCH_CP_MODULES = ("torch.distributed.tensor.experimental._context_parallel._attention",
                     "torch.distributed.tensor.experimental._attention")
# What the kernel uses of it. `_enable_context_parallel_dispatcher` (routes SDPA on DTensors to
# the ring without the context manager) came with pytorch PR 164500 (October 2025), so torch 2.10
# and later have it; tested here on torch 2.13.
_TORCH_CP_NAMES = ("_enable_context_parallel_dispatcher", "_cp_options", "_RotateMethod")


def torch_ring_attention() -> ModuleType:
    """torch's context-parallel attention module, or a UserError when this torch lacks what the
    ring kernel uses."""
    for name in _TORCH_CP_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        options = getattr(module, "_cp_options", None)
        if (all(hasattr(module, n) for n in _TORCH_CP_NAMES) and hasattr(options, "enable_load_balance")
                and hasattr(options, "rotate_method") and hasattr(module._RotateMethod, "ALL_TO_ALL")):
            return module
    raise UserError(f"parallel.cp_attention = ring needs torch's context-parallel dispatcher "
                    f"(torch.distributed.tensor.experimental: _enable_context_parallel_dispatcher, _cp_options; "
                    f"torch >= 2.10), which this torch {torch.__version__} does not have. Use "
                    "--parallel.cp_attention=allgather, or a newer torch")


def fused_causal_attention(q, k, v, scale=None):
    """Causal SDPA on sequence-sharded DTensors, restricted to the fused kernels that torch's CP
    dispatcher turns into ring attention: the math kernel would run on the DTensors as ordinary
    ops, not as the ring, so torch must raise instead of falling back to it."""
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


class RingAttention:
    """The attention kernel of one cp group (set as each block's `attn.attend`): called like
    F.scaled_dot_product_attention on this rank's (B, H, T / cp, D) queries, keys and values."""

    def __init__(self, cp_mesh, load_balance: bool):
        self.torch_cp = torch_ring_attention()
        # Process-wide, the same for every kernel: the DTensor dispatcher for SDPA's fused ops.
        self.torch_cp._enable_context_parallel_dispatcher()
        self.mesh, self.load_balance = cp_mesh, load_balance
        # The SDPA call on the DTensors; on CPU (whose SDPA lowers to an op torch's ring does not
        # handle) a test routes it to the flash or memory-efficient op, with CPU kernels registered
        # for them.
        self.sdpa = fused_causal_attention

    def __call__(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or not is_causal:
            raise UserError("parallel.cp_attention = ring supports causal attention without an explicit mask only "
                            "(torch's ring attention takes is_causal); use --parallel.cp_attention=allgather")
        if dropout_p > 0:
            raise UserError(f"parallel.cp_attention = ring got attention dropout {dropout_p:g}, which torch's ring "
                            "backward does not replay; set --model.dropout=0 or --parallel.cp_attention=allgather")
        if enable_gqa and k.shape[1] != q.shape[1]:
            groups = q.shape[1] // k.shape[1]  # query head h reads K/V head h // groups, as SDPA's enable_gqa
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return self.ring(q, k, v, scale)

    # Eager even inside a compiled block. torch's ring branches on the rank (which K/V chunk a
    # step uses), so each rank traces a different graph, and the min-cut partitioner (Inductor's,
    # aot_eager's) then recomputes a forward K/V send in the backward on some ranks and not on
    # others: with torch 2.13 a cp group of 4 deadlocked so (gloo, tests/distributed/
    # test_ring_attention.py's compiled case without this). Eager, every rank sends in program order.
    @torch.compiler.disable
    def ring(self, q, k, v, scale):
        q, k, v = (DTensor.from_local(t, self.mesh, [Shard(2)], run_check=False) for t in (q, k, v))
        self.set_torch_options()
        # Communicates: cp - 1 K/V sends around the cp ring forward; the backward's ring sends K/V
        # cp - 1 times and their gradients cp times (torch's _templated_ring_attention[_backward]).
        out = self.sdpa(q, k, v, scale=scale)
        if out.requires_grad:
            # A hook on the output runs when autograd reaches this call's backward, just before
            # torch's ring backward reads the options: a later kernel may have set its own since.
            out.register_hook(lambda grad: self.set_torch_options())
        return out.to_local()

    def set_torch_options(self) -> None:
        """This kernel's layout and exchange in torch's process-wide ring options."""
        self.torch_cp._cp_options.enable_load_balance = self.load_balance
        self.torch_cp._cp_options.rotate_method = self.torch_cp._RotateMethod.ALL_TO_ALL
