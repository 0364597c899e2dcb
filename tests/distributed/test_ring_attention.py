"""parallel.cp_attention = ring on CPU: torch's own ring attention over cp groups of 2 and 4 ranks on gloo.

torch's ring (torch.distributed.tensor.experimental._context_parallel) runs each of its steps on
CUDA's fused SDPA ops (aten._scaled_dot_product_flash_attention, _efficient_attention and their
backwards), which have CUDA kernels only. Each spawned rank registers CPU kernels for them
(torch.library) that compute them with the CPU flash ops (aten._scaled_dot_product_flash_attention_
for_cpu and its backward) and return what the CUDA ops return: for flash the output, a float32
log-sum-exp of (B, H, L), max lengths and the philox seed and offset; for memory-efficient
attention (SDPA's pick for fp32 on CUDA) a log-sum-exp padded to a multiple of 32 queries as
CUDA's is (config/load.RING_QUERY_ALIGN). torch's real ring algorithm, its load-balance layout,
its merge and its backward then run on CPU. CPU SDPA lowers to the CPU flash op, which torch's CP
dispatcher does not handle, so the kernel's SDPA call (`RingAttention.sdpa`) is routed here to
the case's fused op on the DTensors, the op CUDA's SDPA calls when it picks that kernel;
tests/gpu/test_gpu_ring_attention.py runs the unrouted SDPA call on CUDA and checks which op it reached.

One spawned launch of 4 ranks (each process's imports cost more than its attention, so the two
group sizes share it) runs every case on a cp mesh of 4 and on the cp dim of a (dp 2, cp 2) mesh,
where the cp groups are ranks {0, 1} and {2, 3} of the world (torch's ring works in the group's
ranks). Each rank holds its tokens of q, k, v (parallel.cp_load_balance's layout: context_parallel.
local_positions) and runs the ring kernel's forward and backward; the test compares the output
and the q/k/v gradients with causal SDPA over the full sequence in one process (fp32, 1e-5).
It fails if the kernel falls back to anything else: every rank must have run torch's ring once
per forward and backward, the case's fused op once per ring step (cp with load balancing; rank + 1
without: the later ranks' chunks are skipped), the K/V exchange as cp - 1 all-to-all sends with
no all-gather, and its output must differ from attention over its own tokens only. One case runs
under torch.compile; the efficient cases take the shortest chunks check_cp_attention_rules lets
through; two kernels of different layouts run interleaved (torch's ring options are process-wide:
each kernel must set its own for each forward and backward); a Llama-style model (RoPE, GQA) with
the kernel applied as parallelize applies it must give one process's loss and gradients.
"""

from __future__ import annotations

import itertools
import math
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

from slipstream.config.load import RING_QUERY_ALIGN
from slipstream.distributed.context_parallel import local_positions

B, H, D = 2, 4, 16


class Case(NamedTuple):
    load_balance: bool
    n_kv: int = H
    compiled: bool = False
    fused: str = "flash"  # the fused op the SDPA call is routed to: flash or efficient (LSE padded as CUDA's)
    chunk: int = 4  # tokens per chunk of 2 x cp: T = 2 cp chunk


CASES = {
    "balanced": Case(True),
    "contiguous": Case(False),
    "balanced_gqa": Case(True, 2),
    "contiguous_gqa": Case(False, 1),
    # Under torch.compile (aot_eager: the min-cut partitioner, as Inductor's): the kernel runs its
    # ring eagerly inside the compiled function (RingAttention.ring; traced, a group of 4
    # deadlocked). CommDebugMode does not go with compile.
    "balanced_gqa_compiled": Case(True, 2, compiled=True),
    # Every ring step's queries a multiple of 32, the least check_cp_attention_rules allows: balanced
    # steps take 2 chunks or the second one (chunk 32), contiguous ones the rank's 2 chunks (chunk 16).
    "balanced_efficient": Case(True, fused="efficient", chunk=RING_QUERY_ALIGN),
    "contiguous_efficient": Case(False, fused="efficient", chunk=RING_QUERY_ALIGN // 2),
}
# Two kernels of one process, a balanced and a contiguous one, run forward, forward, backward,
# backward on the cp mesh of 4 (seeds after the cases').
INTERLEAVED = {"interleaved_balanced": Case(True), "interleaved_contiguous": Case(False)}
TOL = 1e-5
DEADLINE_S = 150  # the launch takes ~30 s on 2 busy cores; a deadlocked ring must fail, not hang


def _seed(name: str) -> int:
    return list(CASES).index(name) if name in CASES else len(CASES) + list(INTERLEAVED).index(name)


def _inputs(world: int, case: Case, seed: int) -> tuple[torch.Tensor, ...]:
    """Full-sequence q, k, v and the upstream gradient, the same on every rank and in the test."""
    g = torch.Generator().manual_seed(seed)
    T = 2 * world * case.chunk
    return (torch.randn(B, H, T, D, generator=g), torch.randn(B, case.n_kv, T, D, generator=g),
            torch.randn(B, case.n_kv, T, D, generator=g), torch.randn(B, H, T, D, generator=g))


def _cuda_sdpa_ops_on_cpu():
    """CPU kernels for CUDA's flash and memory-efficient ops and their backwards; returns
    (library, call counts per op)."""
    from torch.library import Library

    aten = torch.ops.aten
    calls = {op: {"forward": 0, "backward": 0} for op in ("flash", "efficient")}

    def flash(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        calls["flash"]["forward"] += 1
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, scale=scale)
        # CUDA's flash returns its output as a (B, L, H, D) buffer seen as (B, H, L, D), the
        # log-sum-exp as float32 (B, H, L), no cumulative lengths, and the philox seed (2,) and
        # offset () as uint64 (torch/_meta_registrations.py's meta kernel of the op).
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        seed, offset = torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64)
        return out, lse.float(), None, None, q.shape[2], k.shape[2], seed, offset, q.new_empty(0)

    def flash_backward(grad_out, q, k, v, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                       philox_seed, philox_offset, *, scale=None):
        calls["flash"]["backward"] += 1
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *(t.contiguous() for t in (grad_out, q, k, v, out, lse)), dropout_p, is_causal, scale=scale)

    def efficient(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
        calls["efficient"]["forward"] += 1
        assert attn_bias is None and compute_log_sumexp
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, scale=scale)
        # As the op's meta kernel (torch/_meta_registrations.py) has it on CUDA: the output a
        # (B, L, H, D) buffer seen as (B, H, L, D), the log-sum-exp float32 (B, H, ceil(L / 32) * 32)
        # (here inf past the queries, so a merge that read the padding would give NaN), and the
        # philox seed and offset as int64 scalars.
        L = q.shape[2]
        padded = torch.full((*lse.shape[:2], math.ceil(L / 32) * 32), float("inf"))
        padded[..., :L] = lse
        seed, offset = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
        return out.transpose(1, 2).contiguous().transpose(1, 2), padded, seed, offset

    def efficient_backward(grad_out, q, k, v, attn_bias, out, lse, philox_seed, philox_offset, dropout_p,
                           grad_input_mask, is_causal=False, *, scale=None):
        calls["efficient"]["backward"] += 1
        L = q.shape[2]
        assert lse.shape[-1] >= L, (lse.shape, L)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *(t.contiguous() for t in (grad_out, q, k, v, out, lse[..., :L])), dropout_p, is_causal, scale=scale)
        return dq, dk, dv, None

    lib = Library("aten", "IMPL")
    lib.impl("_scaled_dot_product_flash_attention", flash, "CPU")
    lib.impl("_scaled_dot_product_flash_attention_backward", flash_backward, "CPU")
    lib.impl("_scaled_dot_product_efficient_attention", efficient, "CPU")
    lib.impl("_scaled_dot_product_efficient_attention_backward", efficient_backward, "CPU")
    return lib, calls


# What CUDA's SDPA does on DTensors when it picks that kernel: its fused op (output first).
ROUTES = {
    "flash": lambda q, k, v, scale=None: torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, is_causal=True, scale=scale)[0],
    "efficient": lambda q, k, v, scale=None: torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, True, scale=scale)[0],
}

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
    lib, fused_calls = _cuda_sdpa_ops_on_cpu()
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

    def rank_inputs(size: int, case: Case, name: str, rank_in_cp: int) -> tuple[torch.Tensor, ...]:
        q, k, v, grad = _inputs(size, case, _seed(name))
        pos = local_positions(q.shape[2], size, rank_in_cp, case.load_balance)
        q, k, v, grad = (t[:, :, pos].clone() for t in (q, k, v, grad))
        return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad

    results = {}
    for (size, mesh), (name, case) in itertools.product(meshes.items(), CASES.items()):
        cp = ContextParallel(mesh, case.load_balance, kernel="ring")
        assert isinstance(cp.attend, RingAttention)
        cp.attend.sdpa = ROUTES[case.fused]
        q, k, v, grad = rank_inputs(size, case, name, cp.rank)
        for counts in (*fused_calls.values(), ring_calls):
            counts.update(forward=0, backward=0)
        gqa = case.n_kv != H
        if case.compiled:
            attend = torch.compile(lambda *qkv: cp.attend(*qkv, is_causal=True, enable_gqa=gqa), backend="aot_eager")
            out, forward_comms = attend(q, k, v), None
        else:
            with CommDebugMode() as comm:
                out = cp.attend(q, k, v, is_causal=True, enable_gqa=gqa)
            forward_comms = {str(op): n for op, n in comm.get_comm_counts().items() if n}
        out.backward(grad)
        local = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), is_causal=True, enable_gqa=gqa)
        results[f"{size}/{name}"] = {"cp_rank": cp.rank, "out": out.detach(), "dq": q.grad, "dk": k.grad,
                                     "dv": v.grad, "local": local, "ring": dict(ring_calls), "comms": forward_comms,
                                     "fused": {op: dict(n) for op, n in fused_calls.items() if any(n.values())}}
    # Built first, then run in turns: each kernel's layout must hold for its own calls, whichever
    # kernel was built or ran last.
    kernels = {name: ContextParallel(meshes[4], case.load_balance, kernel="ring") for name, case in INTERLEAVED.items()}
    inputs = {name: rank_inputs(4, case, name, kernels[name].rank) for name, case in INTERLEAVED.items()}
    outs = {}
    for name, kernel in kernels.items():
        kernel.attend.sdpa = ROUTES["flash"]
        outs[name] = kernel.attend(*inputs[name][:3], is_causal=True)
    for name, out in outs.items():
        out.backward(inputs[name][3])
        q, k, v, _ = inputs[name]
        results[f"4/{name}"] = {"cp_rank": kernels[name].rank, "out": out.detach(), "dq": q.grad, "dk": k.grad,
                                "dv": v.grad}
    results["model"] = _model_step(meshes[2])
    refused = []
    q, k, v = (t.detach() for t in inputs["interleaved_balanced"][:3])
    for kwargs in ({"attn_mask": torch.ones(1, dtype=torch.bool), "is_causal": False}, {"is_causal": False},
                   {"is_causal": True, "dropout_p": 0.1}):
        try:
            kernels["interleaved_balanced"].attend(q, k, v, **kwargs)
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
    cp.attend.sdpa = ROUTES["flash"]
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


def _reference(size: int, name: str, case: Case) -> tuple[torch.Tensor, ...]:
    """Full-sequence causal SDPA in one process: the output and the q, k, v gradients."""
    q, k, v, grad = _inputs(size, case, _seed(name))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=case.n_kv != H)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _check_against_reference(runs, size: int, name: str, case: Case) -> None:
    out, dq, dk, dv = _reference(size, name, case)
    for rank, res in enumerate(runs):
        got = res[f"{size}/{name}"]
        assert got["cp_rank"] == rank % size  # the cp dim is the mesh's innermost
        pos = local_positions(out.shape[2], size, got["cp_rank"], case.load_balance)
        for key, want in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
            err = (got[key] - want[:, :, pos]).abs().max().item()
            assert err <= TOL, (rank, key, err)


@pytest.mark.parametrize("size", CP_SIZES)
@pytest.mark.parametrize("name", list(CASES))
def test_ring_matches_full_sequence_attention(runs, size, name):
    _check_against_reference(runs, size, name, CASES[name])


@pytest.mark.parametrize("name", list(INTERLEAVED))
def test_two_kernels_with_different_layouts_in_one_process(runs, name):
    """torch's ring options are one process-wide object read at every call: a kernel built or run
    after another must not change the layout the other's forward and backward use."""
    _check_against_reference(runs, 4, name, INTERLEAVED[name])


@pytest.mark.parametrize("size", CP_SIZES)
@pytest.mark.parametrize("name", list(CASES))
def test_torch_ring_ran_its_steps_and_rotated_kv(runs, size, name):
    case = CASES[name]
    for rank, res in enumerate(runs):
        got = res[f"{size}/{name}"]
        cp_rank = got["cp_rank"]
        steps = size if case.load_balance else cp_rank + 1  # without balancing, chunks after the rank's are skipped
        assert got["ring"] == {"forward": 1, "backward": 1}, (rank, got["ring"])
        assert got["fused"] == {case.fused: {"forward": steps, "backward": steps}}, (rank, got["fused"])
        # The ring proper: K/V sent on cp - 1 times, never all-gathered (torch's default rotation).
        if not case.compiled:
            assert got["comms"] == {"c10d_functional.all_to_all_single": size - 1}, (rank, got["comms"])
        # Not local attention: every query but cp rank 0's contiguous chunk sees other ranks' keys.
        if case.load_balance or cp_rank > 0:
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
