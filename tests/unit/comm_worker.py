"""Worker for tests/unit/test_observe_comm.py: collectives of known sizes under CommCounter.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/unit/comm_worker.py OUT_DIR

Writes OUT_DIR/rank<R>.json: each case's CommCounter rows and by_dim view, and the summary's
`comm` (measured and planned) of two short Trainer runs on a tiny GPT-2: tp2 (sequence and loss
parallel) and cp2 (FSDP over the cp ranks).
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(out_dir: str) -> None:
    from torch.distributed._functional_collectives import all_gather_tensor_autograd, all_reduce
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from slipstream.observe.comm import CommCounter, mesh_groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # joins the job
    rank = dist.get_rank()
    # A (1, 2) mesh with cp folded into the data-parallel dim, as a cp2 run on 2 ranks has it:
    # cp, dp_shard_cp and the world are one process group.
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_shard", "cp"))
    flat = mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
    groups = mesh_groups(mesh, flat)
    cases = {}

    with CommCounter(groups) as c:  # every c10d kind, known sizes (world 2)
        dist.all_reduce(torch.ones(1000))                                      # communicates: 4000 B
        dist.all_gather_into_tensor(torch.empty(200), torch.ones(100))         # communicates: 800 B gathered
        dist.reduce_scatter_tensor(torch.empty(300), torch.ones(600))          # communicates: 2400 B scattered
        dist.broadcast(torch.ones(10, dtype=torch.float64), src=0)             # communicates: 80 B
        dist.all_to_all_single(torch.empty(8), torch.ones(8))                  # communicates: 32 B
        if rank == 0:
            dist.send(torch.ones(7, dtype=torch.int32), dst=1)                 # communicates: 28 B
        else:
            dist.recv(torch.empty(7, dtype=torch.int32), src=0)                # communicates: 28 B
    cases["c10d"] = c

    with CommCounter(groups) as c:  # functional collectives and DTensor on the cp mesh
        all_reduce(torch.ones(50), "sum", flat.get_group()).wait()             # communicates: 200 B
        t = torch.ones(3, 4, requires_grad=True)
        gathered = all_gather_tensor_autograd(t, 0, mesh.get_group("cp"))       # communicates: 96 B gathered
        gathered.sum().backward()                                              # communicates: 96 B reduce-scattered
        d = distribute_tensor(torch.ones(4, 6), mesh["cp"], [Shard(0)])       # communicates: 96 B scattered
        d.redistribute(mesh["cp"], [Replicate()]).to_local()                   # communicates: 96 B gathered
        # An op on a Partial DTensor: DTensor's dispatch reduces the input itself (as the gradient
        # norm and the optimizer do with the norms' partial gradients under sequence parallel).
        partial = DTensor.from_local(torch.ones(6), mesh["cp"], [Partial()])
        torch.exp(partial).to_local()                                          # communicates: 24 B all-reduced
        dist.all_reduce(torch.ones(5), group=flat.get_group())                 # communicates: 20 B (c10d -> dp)
    cases["functional"] = c

    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))     # communicates: broadcasts the weights
    for _ in range(2):  # iteration 2 rebuilds the buckets (and broadcasts their order): not steady yet
        ddp(torch.ones(2, 8)).sum().backward()
    with CommCounter(groups) as c:  # DDP's C++ reducer: one bucket all-reduce of the 72 gradients
        ddp(torch.ones(2, 8)).sum().backward()
    cases["ddp"] = c

    with CommCounter(groups) as c:  # nothing: the counter must not invent traffic
        torch.ones(3) + 1
    cases["none"] = c

    result = {name: {"rows": c.collectives(), "by_dim": c.by_dim(), "summary": c.summary()}
              for name, c in cases.items()}
    result["groups"] = groups
    for name, layout in RUNS.items():  # the trainer's metrics.comm_volume against the planner
        result[name] = train(layout, Path(out_dir, name))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    from slipstream.distributed.mesh import shutdown

    shutdown()  # leaves the process group


# Tiny GPT-2 (learned positions, LayerNorm with biases, tied embeddings); 2 steps: step 2 is counted.
VOCAB, SEQ_LEN, MICRO = 64, 32, 2
COMMON = ["--model.preset=tiny", f"--model.vocab_size={VOCAB}", f"--train.seq_len={SEQ_LEN}",
          f"--train.micro_batch_size={MICRO}", "--train.max_steps=2", "--train.eval_steps=0",
          "--optim.warmup_steps=1", "--logging.progress=false", "--logging.tensorboard=false",
          "--metrics.memory_breakdown=true", "--metrics.comm_volume=true", "--checkpoint.save_final=false",
          "--parallel.timeout_s=60", "--parallel.init_timeout_s=60"]
RUNS = {"tp2": ["--parallel.tp=2", "--parallel.dp_strategy=none", "--parallel.sequence_parallel=true",
                "--parallel.loss_parallel=true"],
        "cp2": ["--parallel.cp=2", "--parallel.dp_strategy=fsdp"]}


def train(layout: list[str], run_dir: Path) -> dict:
    """One short fit; returns its summary's `comm` (the memory tracker runs on the same step)."""
    from slipstream import Trainer
    from slipstream.config import load_config
    from slipstream.models.transformer import build_model, lm_loss

    cfg = load_config(None, [*COMMON, *layout, f"--run.dir={run_dir}"])
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (16, SEQ_LEN + 1), generator=g)
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    trainer = Trainer(build_model(cfg.model, "cpu", seed=1), data, lambda m, b: lm_loss(m(b[0]), b[1]), config=cfg)
    summary = trainer.fit()
    return {"comm": summary.get("comm"), "memory_measured": summary.get("memory") is not None}


if __name__ == "__main__":
    main(sys.argv[1])
