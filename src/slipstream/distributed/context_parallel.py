"""Context parallelism: the sequence of every batch split over the `cp` ranks of the mesh.

Each cp rank holds T / cp tokens of every sequence, so every activation of the model is 1/cp
per rank; attention is the one place where tokens meet. parallel.cp_attention picks how.

allgather (the default, any device): each rank all-gathers the keys
and values of the whole sequence over the cp group (as Llama 3's context parallelism does:
K/V are n_kv_head / n_head of the size of the queries, and their all-gather overlaps nothing
here but is exact) and computes attention for its own queries with the causal mask of their
global positions. The all-gather is torch's autograd-aware functional collective: its backward
reduce-scatters the gradients of K and V back to the ranks that own them.

ring (CUDA): torch's ring attention (distributed/ring_attention.py): the K/V shards travel
around the cp group while each step runs a fused SDPA kernel; no rank holds the whole sequence's
keys and values. Its limits (the causal mask only, no dropout, no activation offload, chunks of a
multiple of 32 tokens) are config/load.check_cp_attention_rules.

Load balancing (parallel.cp_load_balance): under a causal mask the last tokens attend to the
most keys, so contiguous pieces would give the last rank the most work. The sequence is cut
into 2 x cp chunks and rank r holds chunks r and 2cp - 1 - r: one early, one late, the same
work on every rank. Positions (RoPE tables and learned positions) are those of the full
sequence: the model is called with `positions=`.

The batch is split by the trainer (`shard_batch`, dim 1 of every (B, T) tensor); each
attention module's kernel (`attn.attend`, scaled_dot_product_attention by default) is replaced
by the context-parallel one, so the model code knows nothing of this. Gradients of the replicated parameters are averaged over
the cp ranks with the data-parallel ones: FSDP shards over the flattened (dp_shard, cp) mesh,
DDP reduces over (dp_replicate, cp).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from slipstream.config.load import check_cp_attention_rules, ring_needs_cuda
from slipstream.config.schema import Config
from slipstream.distributed.ring_attention import RingAttention, torch_ring_attention
from slipstream.errors import UserError
from slipstream.runtime import resolve_device


def check_context_parallel(cfg: Config, cp: int, tp: int, device: torch.device | None = None) -> None:
    """What context parallelism cannot split (before any work starts). device: the run's, if
    known (else resolved from train.device)."""
    if cp <= 1:
        return
    p = cfg.parallel
    if p.cp_attention == "ring":
        check_ring_attention(cfg, device)
    pieces = 2 * cp if p.cp_load_balance else cp
    sp = tp if (tp > 1 and p.sequence_parallel) else 1
    if cfg.train.seq_len % (pieces * sp):
        what = f"2 x cp{' x tp' if sp > 1 else ''}" if p.cp_load_balance else f"cp{' x tp' if sp > 1 else ''}"
        raise UserError(f"parallel.cp = {cp}: train.seq_len = {cfg.train.seq_len} must be divisible by {what} = "
                        f"{pieces * sp} (the sequence is cut into {pieces} equal chunks"
                        f"{', each split again over tp by sequence parallel' if sp > 1 else ''})")
    if cfg.model.position == "alibi":  # also refused when the config loads (config/load.py)
        raise UserError(f"model.position = alibi with parallel.cp = {cp} is not supported (the ALiBi bias of a "
                        "sequence chunk depends on where the query and key chunks sit in the sequence); use "
                        "--parallel.cp=1, or --model.position=rope")
    if cfg.model.dropout > 0 and cfg.compile.scope != "off":
        # As under tp (check_tensor_parallel): the per-rank dropout streams break the compiled graphs.
        raise UserError(f"model.dropout > 0 with compile.scope = {cfg.compile.scope} and parallel.cp > 1 is not "
                        "supported yet (the per-rank dropout streams cannot be traced); set --compile.scope=off "
                        "or --model.dropout=0")


def check_ring_attention(cfg: Config, device: torch.device | None = None) -> None:
    """parallel.cp_attention = ring: the config rules (again: a Config built in code was never
    loaded), a CUDA device and a torch that has the ring."""
    check_cp_attention_rules(cfg)
    device = device if device is not None else resolve_device(cfg.train.device)
    if device.type != "cuda":
        raise ring_needs_cuda(f"this run's device ({device.type})")
    torch_ring_attention()


def chunk_order(cp: int, rank: int, load_balance: bool) -> list[int]:
    """The chunks of the sequence (of 2cp when balanced, cp otherwise) that `rank` holds, in order."""
    return [rank, 2 * cp - 1 - rank] if load_balance else [rank]


def local_positions(seq_len: int, cp: int, rank: int, load_balance: bool, device=None) -> torch.Tensor:
    """Positions in the full sequence of the tokens `rank` holds."""
    pieces = 2 * cp if load_balance else cp
    size = seq_len // pieces
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device)
                      for c in chunk_order(cp, rank, load_balance)])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, load_balance: bool) -> torch.Tensor:
    """This rank's tokens of a (B, T, ...) tensor."""
    pieces = 2 * cp if load_balance else cp
    chunks = x.chunk(pieces, dim=1)
    return torch.cat([chunks[c] for c in chunk_order(cp, rank, load_balance)], dim=1)


class ContextParallel:
    """The cp rank's view of the job: splits batches, knows its positions, and its attention
    kernel `attend` (kernel: parallel.cp_attention)."""

    def __init__(self, cp_mesh, load_balance: bool, kernel: str = "allgather"):
        self.mesh, self.load_balance = cp_mesh, load_balance
        self.cp, self.rank = cp_mesh.size(), cp_mesh.get_local_rank()
        self.group = cp_mesh.get_group()
        if kernel == "allgather":
            self.attend = self.allgather_attention
        elif kernel == "ring":
            self.attend = RingAttention(cp_mesh, load_balance)
        else:
            raise UserError(f"parallel.cp_attention = {kernel!r}: use allgather or ring")
        self.kernel = kernel

    def shard_batch(self, batch: Any) -> Any:
        """Every tensor of a batch with a sequence dimension (dim 1) cut to this rank's tokens."""
        if isinstance(batch, torch.Tensor):
            if batch.dim() < 2:
                return batch
            pieces = 2 * self.cp if self.load_balance else self.cp
            if batch.shape[1] % pieces:
                raise UserError(f"parallel.cp = {self.cp} cuts every sequence into {pieces} equal chunks; this batch "
                                f"has length {batch.shape[1]}. Feed sequences whose length is divisible by {pieces}")
            return shard_sequence(batch, self.cp, self.rank, self.load_balance)
        if isinstance(batch, (tuple, list)):
            return type(batch)(self.shard_batch(b) for b in batch)
        if isinstance(batch, dict):
            return {k: self.shard_batch(v) for k, v in batch.items()}
        return batch

    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """Average over the cp ranks (e.g. per-sequence losses, each rank holding equal shares)."""
        import torch.distributed as dist

        out = tensor.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)  # communicates: once per evaluation batch
        return out / self.cp

    def positions(self, local_len: int, device) -> torch.Tensor:
        return local_positions(local_len * self.cp, self.cp, self.rank, self.load_balance, device)

    def gather_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """(B, H, T/cp, D) of every rank -> (B, H, T, D) in sequence order (autograd-aware)."""
        import torch.distributed._functional_collectives as fc

        # all_gather_tensor_autograd is deprecated in newer torch; the same op under its new name.
        gather = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
        # Communicates: all-gather over the cp group (backward: reduce-scatter of the gradient).
        gathered = gather(t.contiguous(), gather_dim=2, group=self.group)
        pieces = 2 * self.cp if self.load_balance else self.cp
        per_rank = len(chunk_order(self.cp, 0, self.load_balance))
        chunks = gathered.chunk(self.cp * per_rank, dim=2)  # rank-major: rank r's chunks in its order
        where = {}
        for r in range(self.cp):
            for i, c in enumerate(chunk_order(self.cp, r, self.load_balance)):
                where[c] = chunks[r * per_rank + i]
        return torch.cat([where[c] for c in range(pieces)], dim=2)

    def allgather_attention(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                            enable_gqa=False):
        """Causal attention of this rank's queries over the whole sequence's keys and values."""
        if attn_mask is not None or not is_causal:
            raise UserError("context parallelism supports causal attention without an explicit mask only")
        k_all, v_all = self.gather_sequence(k), self.gather_sequence(v)
        q_pos = self.positions(q.shape[2], q.device)
        allowed = q_pos[:, None] >= torch.arange(k_all.shape[2], device=q.device)[None, :]
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=allowed, dropout_p=dropout_p,
                                              scale=scale, enable_gqa=enable_gqa)


def apply_context_parallel(model: nn.Module, cp: ContextParallel) -> nn.Module:
    """Call the model with its tokens' global positions and the context-parallel attention."""
    from slipstream.models.transformer import Transformer

    if not isinstance(model, Transformer):
        raise UserError(f"parallel.cp > 1 needs to know where a model's attention and positions are; slipstream "
                        f"knows it for its own transformers, not for {type(model).__name__}. Use --parallel.cp=1")
    def with_positions(module, args, kwargs):
        return args, {**kwargs, "positions": cp.positions(args[0].shape[1], args[0].device)}

    model.register_forward_pre_hook(with_positions, with_kwargs=True)
    # The kernel itself, not a mode around the forward: activation checkpointing re-runs a
    # block's forward during backward and finds the same attention again, and a compiled
    # checkpoint region traces a plain call (entering a mode there is a side effect it refuses).
    for block in model.blocks:
        block.attn.attend = cp.attend
    model.context_parallel = cp  # the trainer splits batches with it
    from slipstream.distributed.sharded_dropout import shard_dropout_rng

    shard_dropout_rng(model, cp.mesh, stream_sharded=True)  # every activation is sequence-sharded: a mask per rank
    return model
