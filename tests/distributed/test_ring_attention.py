"""parallel.cp_attention = ring on CPU: torch's own ring attention over cp groups of 2 and 4 ranks on gloo.

torch's ring (torch.distributed.tensor.experimental._context_parallel) runs each of its steps on
aten._scaled_dot_product_flash_attention and its backward, ops with CUDA kernels only. Each
spawned rank registers CPU kernels for those two ops (torch.library) that compute them with the
CPU flash ops (aten._scaled_dot_product_flash_attention_for_cpu and its backward) and return
what the CUDA op returns (output, float32 log-sum-exp of (B, H, L), max lengths, the philox
seed and offset tensors): torch's real ring algorithm, its load-balance layout, its merge and
its backward then run on CPU. CPU SDPA lowers to the CPU flash op, which torch's CP dispatcher
does not handle, so the kernel's SDPA call (`RingAttention.sdpa`) is routed here to the flash
op on the DTensors, the op CUDA's SDPA calls when it picks flash; tests/gpu/test_gpu_ring_attention.py
runs the unrouted SDPA call on CUDA.

One spawned launch of 4 ranks (each process's imports cost more than its attention, so the two
group sizes share it) runs every case on a cp mesh of 4 and on the cp dim of a (dp 2, cp 2) mesh,
where the cp groups are ranks {0, 1} and {2, 3} of the world (torch's ring works in the group's
ranks). Each rank holds its tokens of q, k, v (parallel.cp_load_balance's layout: context_parallel.
local_positions) and runs the ring kernel's forward and backward; the test compares the output
and the q/k/v gradients with causal SDPA over the full sequence in one process (fp32, 1e-5).
It fails if the kernel falls back to anything else: every rank must have run torch's ring once
per forward and backward, the flash op once per ring step (cp with load balancing; rank + 1
without: the later ranks' chunks are skipped), the K/V exchange as cp - 1 all-to-all sends with
no all-gather, and its output must differ from attention over its own tokens only. One case runs
under torch.compile; a Llama-style model (RoPE, GQA) with the kernel applied as parallelize applies
it must give one process's loss and gradients.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from slipstream.distributed.context_parallel import local_positions

B, H, D = 2, 4, 16
CHUNK = 4  # tokens per chunk of 2 x cp: T = 8 cp
CASES = {  # name: (load_balance, n_kv_head, compiled)
    "balanced": (True, H, False),
    "contiguous": (False, H, False),
    "balanced_gqa": (True, 2, False),
    "contiguous_gqa": (False, 1, False),
    # Under torch.compile (aot_eager: the min-cut partitioner, as Inductor's): the kernel runs its
    # ring eagerly inside the compiled function (RingAttention.ring; traced, a group of 4
    # deadlocked). CommDebugMode does not go with compile.
    "balanced_gqa_compiled": (True, 2, True),
}
TOL = 1e-5
DEADLINE_S = 150  # the launch takes ~25 s on 2 busy cores; a deadlocked ring must fail, not hang


def _inputs(world: int, n_kv: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Full-sequence q, k, v and the upstream gradient, the same on every rank and in the test."""
    g = torch.Generator().manual_seed(seed)
    T = 2 * world * CHUNK
    return (torch.randn(B, H, T, D, generator=g), torch.randn(B, n_kv, T, D, generator=g),
            torch.randn(B, n_kv, T, D, generator=g), torch.randn(B, H, T, D, generator=g))


def _flash_shim():
    """CPU kernels for the CUDA flash op and its backward; returns (library, call counts)."""
    from torch.library import Library

    aten, calls = torch.ops.aten, {"forward": 0, "backward": 0}

    def forward(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        calls["forward"] += 1
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, scale=scale)
        # CUDA's flash returns its output as a (B, L, H, D) buffer seen as (B, H, L, D), the
        # log-sum-exp as float32 (B, H, L), no cumulative lengths, and the philox seed (2,) and
        # offset () as uint64 (torch/_meta_registrations.py's meta kernel of the op).
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        seed, offset = torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64)
        return out, lse.float(), None, None, q.shape[2], k.shape[2], seed, offset, q.new_empty(0)

    def backward(grad_out, q, k, v, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                 philox_seed, philox_offset, *, scale=None):
        calls["backward"] += 1
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *(t.contiguous() for t in (grad_out, q, k, v, out, lse)), dropout_p, is_causal, scale=scale)

    lib = Library("aten", "IMPL")
    lib.impl("_scaled_dot_product_flash_attention", forward, "CPU")
    lib.impl("_scaled_dot_product_flash_attention_backward", backward, "CPU")
    return lib, calls


def _flash_route(q, k, v, scale=None):
    """What CUDA's SDPA does on DTensors when it picks flash: the flash op (output first)."""
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, is_causal=True, scale=scale)[0]


WORLD = 4
CP_SIZES = (2, 4)


def _worker(rank: int, world: int, folder: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from slipstream.distributed.context_parallel import ContextParallel
    from slipstream.distributed.ring_attention import RingAttention, torch_ring_attention
    from slipstream.errors import UserError

    torch.set_num_threads(1)
    torch_cp = torch_ring_attention()
    lib, flash_calls = _flash_shim()
    ring_calls = {"forward": 0, "backward": 0}
    ring_forward, ring_backward = torch_cp._templated_ring_attention, torch_cp._templated_ring_attention_backward

    def count_forward(*args, **kwargs):
        ring_calls["forward"] += 1
        return ring_forward(*args, **kwargs)

    def count_backward(*args, **kwargs):
        ring_calls["backward"] += 1
        return ring_backward(*args, **kwargs)

    # torch's handlers look its ring functions up in their module at every call.
    torch_cp._templated_ring_attention, torch_cp._templated_ring_attention_backward = count_forward, count_backward
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    meshes = {4: init_device_mesh("cpu", (4,), mesh_dim_names=("cp",)),
              2: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))["cp"]}
    results = {}
    for (size, mesh), (seed, (name, (load_balance, n_kv, compiled))) in itertools.product(
            meshes.items(), enumerate(CASES.items())):
        cp = ContextParallel(mesh, load_balance, kernel="ring")
        assert isinstance(cp.attend, RingAttention)
        cp.attend.sdpa = _flash_route
        q, k, v, grad = _inputs(size, n_kv, seed)
        pos = local_positions(q.shape[2], size, cp.rank, load_balance)
        q, k, v, grad = (t[:, :, pos].clone() for t in (q, k, v, grad))
        q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
        for counts in (flash_calls, ring_calls):
            counts.update(forward=0, backward=0)
        if compiled:
            attend = torch.compile(lambda *qkv: cp.attend(*qkv, is_causal=True, enable_gqa=n_kv != H),
                                   backend="aot_eager")
            out, forward_comms = attend(q, k, v), None
        else:
            with CommDebugMode() as comm:
                out = cp.attend(q, k, v, is_causal=True, enable_gqa=n_kv != H)
            forward_comms = {str(op): n for op, n in comm.get_comm_counts().items() if n}
        out.backward(grad)
        local = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), is_causal=True,
                                               enable_gqa=n_kv != H)
        results[f"{size}/{name}"] = {"cp_rank": cp.rank, "out": out.detach(), "dq": q.grad, "dk": k.grad,
                                     "dv": v.grad, "local": local, "flash": dict(flash_calls),
                                     "ring": dict(ring_calls), "comms": forward_comms}
    results["model"] = _model_step(meshes[2])
    refused = []
    for kwargs in ({"attn_mask": torch.ones(1, dtype=torch.bool), "is_causal": False}, {"is_causal": False},
                   {"is_causal": True, "dropout_p": 0.1}):
        try:
            cp.attend(q.detach(), k.detach(), v.detach(), **kwargs)
        except UserError as e:
            refused.append(str(e))
    results["refused"] = refused
    torch.save(results, Path(folder) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    del lib


def _model_step(mesh) -> dict:
    """A Llama-style model (RoPE, GQA) with the ring kernel applied as the trainer's parallelize
    applies it, on this rank's tokens, against the same model on the whole batch in one process:
    the cp ranks' mean loss and summed gradients (each of 1/cp of the tokens) are the whole batch's."""
    import torch.distributed as dist

    from slipstream.config import load_config
    from slipstream.distributed.context_parallel import ContextParallel, apply_context_parallel
    from slipstream.models.transformer import build_model, lm_loss

    cfg = load_config(overrides=["--model.preset=llama-tiny", "--model.vocab_size=96", "--train.seq_len=32"])
    tokens = torch.randint(0, 96, (2, 33), generator=torch.Generator().manual_seed(5))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    full = build_model(cfg.model, "cpu", seed=3)
    full_loss = lm_loss(full(x), y)
    full_loss.backward()
    cp = ContextParallel(mesh, load_balance=True, kernel="ring")
    cp.attend.sdpa = _flash_route
    model = apply_context_parallel(build_model(cfg.model, "cpu", seed=3), cp)
    kernels = {type(block.attn.attend).__name__ for block in model.blocks}
    xl, yl = cp.shard_batch((x, y))
    loss = lm_loss(model(xl), yl)
    loss.backward()
    errors = {}
    for (name, p), ref in zip(model.named_parameters(), full.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=cp.group)
        errors[name] = (grad / cp.cp - ref.grad).abs().max().item()
    return {"kernels": sorted(kernels), "loss_error": abs(cp.mean(loss).item() - full_loss.item()),
            "grad_error": max(errors.values()), "local_tokens": xl.shape[1]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    """Every rank's results of the one spawned launch."""
    import torch.multiprocessing as mp

    folder = tmp_path_factory.mktemp("ring")
    launch = mp.start_processes(_worker, args=(WORLD, str(folder)), nprocs=WORLD, start_method="spawn", join=False)
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not launch.join(timeout=1):  # raises with a rank's traceback if one failed
            assert time.monotonic() < deadline, f"the ranks are still running after {DEADLINE_S} s: a deadlock?"
    finally:
        for process in launch.processes:
            if process.is_alive():
                process.kill()
    return [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


def _reference(size: int, name: str) -> tuple[torch.Tensor, ...]:
    """Full-sequence causal SDPA in one process: the output and the q, k, v gradients."""
    load_balance, n_kv, _ = CASES[name]
    q, k, v, grad = _inputs(size, n_kv, list(CASES).index(name))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=n_kv != H)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("size", CP_SIZES)
@pytest.mark.parametrize("name", list(CASES))
def test_ring_matches_full_sequence_attention(runs, size, name):
    load_balance, _, _ = CASES[name]
    out, dq, dk, dv = _reference(size, name)
    for rank, res in enumerate(runs):
        got = res[f"{size}/{name}"]
        assert got["cp_rank"] == rank % size  # the cp dim is the mesh's innermost
        pos = local_positions(out.shape[2], size, got["cp_rank"], load_balance)
        for key, want in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
            err = (got[key] - want[:, :, pos]).abs().max().item()
            assert err <= TOL, (rank, key, err)


@pytest.mark.parametrize("size", CP_SIZES)
@pytest.mark.parametrize("name", list(CASES))
def test_torch_ring_ran_its_steps_and_rotated_kv(runs, size, name):
    load_balance, _, compiled = CASES[name]
    for rank, res in enumerate(runs):
        got = res[f"{size}/{name}"]
        cp_rank = got["cp_rank"]
        steps = size if load_balance else cp_rank + 1  # without balancing, chunks after the rank's are skipped
        assert got["ring"] == {"forward": 1, "backward": 1}, (rank, got["ring"])
        assert got["flash"] == {"forward": steps, "backward": steps}, (rank, got["flash"])
        # The ring proper: K/V sent on cp - 1 times, never all-gathered (torch's default rotation).
        if not compiled:
            assert got["comms"] == {"c10d_functional.all_to_all_single": size - 1}, (rank, got["comms"])
        # Not local attention: every query but cp rank 0's contiguous chunk sees other ranks' keys.
        if load_balance or cp_rank > 0:
            assert (got["out"] - got["local"]).abs().max().item() > 0.05, rank


def test_ring_kernel_refuses_masks_and_dropout(runs):
    refused = runs[0]["refused"]
    assert len(refused) == 3, refused
    assert all("--parallel.cp_attention=allgather" in m for m in refused), refused
    assert "dropout" in refused[2]


def test_model_with_the_ring_kernel_trains_like_one_process(runs):
    for rank, res in enumerate(runs):
        got = res["model"]
        assert got["kernels"] == ["RingAttention"] and got["local_tokens"] == 16, got
        assert got["loss_error"] <= 1e-5 and got["grad_error"] <= 1e-5, (rank, got)
