"""Worker for tests/distributed/test_user_tp_plan.py: a user nn.Module split by its own
`tensor_parallel_plan`, trained by the Trainer at tp 2.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/distributed/user_tp_worker.py OUT_DIR

Per scenario: one optimizer step by hand (loss, every gradient and every parameter after AdamW,
gathered to full tensors) into OUT_DIR/<name>/step.pt, a 4-step fit() whose metrics.jsonl rank 0
writes into OUT_DIR/<name>/run, and the layout the plan produced into OUT_DIR/<name>/layout.json.
OUT_DIR/incomplete_plan.json holds the error a plan that leaves a parameter whole gets.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, WIDTH, HIDDEN, SEQ_LEN, N_SAMPLES, MICRO, STEPS, SEED = 32, 16, 64, 8, 16, 2, 4, 3
SCENARIOS = {
    "plain": ["--parallel.sequence_parallel=false", "--parallel.loss_parallel=false"],
    "sp_loss": ["--parallel.sequence_parallel=true", "--parallel.loss_parallel=true"],
}


class TinyLM(nn.Module):
    """A user's model: embedding, one residual MLP, a norm and an untied head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.emb(tokens)
        h = h + self.down(F.gelu(self.up(h)))
        return self.head(self.norm(h))

    def tensor_parallel_plan(self, sequence_parallel: bool, loss_parallel: bool):
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

        from slipstream.distributed.tensor_parallel import ReplicateParallel

        stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream between the splits
        return {
            "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
            "up": ColwiseParallel(input_layouts=stream),
            "down": RowwiseParallel(output_layouts=stream),
            "norm": SequenceParallel() if sequence_parallel else ReplicateParallel(),
            "head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                    use_local_output=not loss_parallel),
        }


class IncompletePlan(TinyLM):
    def tensor_parallel_plan(self, sequence_parallel: bool, loss_parallel: bool):
        plan = super().tensor_parallel_plan(sequence_parallel, loss_parallel)
        del plan["norm"]  # the norm's weight and bias stay plain tensors: refused
        return plan


def build(cls=TinyLM) -> nn.Module:
    torch.manual_seed(SEED)
    return cls()


def make_dataset():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (N_SAMPLES, SEQ_LEN + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def loss_fn(model, batch):
    logits = model(batch[0])
    return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten())


def overrides(run_dir, tp: int, extra: list[str]) -> list[str]:
    return [f"--run.dir={run_dir}", f"--parallel.tp={tp}", "--parallel.dp_strategy=none",
            f"--train.micro_batch_size={MICRO}", f"--train.seq_len={SEQ_LEN}", f"--train.max_steps={STEPS}",
            "--train.deterministic=true", "--train.eval_steps=0", "--optim.warmup_steps=1", "--optim.lr=0.01",
            "--optim.eps=1e-6", "--logging.progress=false", "--logging.tensorboard=false",
            "--logging.log_interval=1", "--metrics.memory_breakdown=false", "--checkpoint.interval=0",
            "--checkpoint.save_final=false", "--parallel.timeout_s=60", "--parallel.init_timeout_s=60", *extra]


def full_state(tensors):
    from slipstream.distributed.data_parallel import full_value

    return {name: full_value(t.detach()).float().clone() for name, t in tensors.items()}


def run(cfg):
    """One step by hand, then a fresh fit(); returns the step's tensors and the fit's trainer."""
    from slipstream import Trainer

    trainer = Trainer(build(), make_dataset(), loss_fn, config=cfg)
    loss, _, _ = trainer.accumulate_gradients(iter(trainer.train_loader))
    named = dict(trainer.model.named_parameters())
    grads = full_state({n: p.grad for n, p in named.items()})
    trainer.optimizer_step(loss)
    step = {"loss": float(loss), "grads": grads, "params": full_state(named)}
    trainer = Trainer(build(), make_dataset(), loss_fn, config=cfg)
    head_out = []
    trainer.model.head.register_forward_hook(lambda m, args, out: head_out.append(
        [str(p) for p in out.placements] + [out.to_local().shape[-1]] if hasattr(out, "placements")
        else [out.shape[-1]]))
    trainer.fit()
    trainer.head_out = head_out[-1]
    return step, trainer


def layout(trainer):
    out = {n: {"placements": [str(pl) for pl in p.placements] if hasattr(p, "placements") else None,
               "local_shape": list(p.to_local().shape if hasattr(p, "to_local") else p.shape)}
           for n, p in trainer.model.named_parameters()}
    out["_head_out"] = trainer.head_out
    return out


def run_scenarios(out_dir: Path) -> int:
    """Every scenario and the incomplete plan, leaving the process group up
    (tests/distributed/shared_worker.py runs other workers' scenarios after these). 1 if any failed."""
    from slipstream.config import load_config
    from slipstream.errors import UserError

    rank, failed = int(os.environ["RANK"]), False
    for name, extra in SCENARIOS.items():
        where = out_dir / name
        try:
            step, trainer = run(load_config(None, overrides(where / "run", 2, extra)))
            if rank == 0:
                torch.save(step, where / "step.pt")
                (where / "layout.json").write_text(json.dumps(layout(trainer), indent=1))
        except Exception:
            failed = True
            where.mkdir(parents=True, exist_ok=True)
            (where / f"error_rank{rank}.txt").write_text(traceback.format_exc())
    try:
        from slipstream import Trainer

        Trainer(build(IncompletePlan), make_dataset(), loss_fn,
                config=load_config(None, overrides(out_dir / "incomplete" / "run", 2, SCENARIOS["plain"])))
        message = None
    except UserError as e:
        message = str(e)
    if rank == 0:
        (out_dir / "incomplete_plan.json").write_text(json.dumps({"error": message}))
    return 1 if failed else 0


def main(out_dir: Path) -> int:
    from slipstream.distributed.mesh import shutdown

    failed = run_scenarios(out_dir)
    shutdown()
    return failed


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
