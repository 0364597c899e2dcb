"""Worker for tests/distributed/test_sharded_dropout.py: dropout masks under tp / sp / cp, one launch.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/distributed/dropout_worker.py OUT_DIR

Per scenario of SCENARIOS[N], every rank writes OUT_DIR/<name>/rank<r>.pt with
  masks: per dropout site, the keep-masks of two training-mode forwards on the same batch:
         emb, block<i>.attn and block<i>.mlp (the residual dropouts after attention and after the
         MLP) are read off nn.Dropout's output (zero = dropped); attn<i> are the real masks of
         scaled_dot_product_attention, drawn again from the same generator state by a probe
         (AttentionMasks; test_sharded_dropout checks the probe against the real op);
  ac:    the loss and every gradient (full tensors) of one step per activations.checkpointing
         mode (none, full, selective), each from the same generator state;
and rank 0 of a `fit` scenario also a short training run (OUT_DIR/<name>/run/metrics.jsonl).

seeds: "rank" seeds every rank's generators differently before the Trainer is built (as nothing
guarantees for the Python API), so equal masks on the replicated stream prove that the tp step
handed its group one generator state; "same" seeds them alike, so different masks on a sharded
activation prove the per-rank stream, not a difference of seeds.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tests.distributed import tp_worker as tpw

DROPOUT = 0.2
FIT_STEPS = 24
FIT_MICRO = 8
AC_MODES = ("none", "full", "selective")


def scenario(name: str, tp: int, cp: int = 1, sp: bool = False, strategy: str = "none", seeds: str = "same",
             fit: bool = False):
    return dict(name=name, tp=tp, cp=cp, sp=sp, strategy=strategy, seeds=seeds, fit=fit)


SCENARIOS = {
    2: [scenario("tp2", 2, seeds="rank", fit=True), scenario("tp2_sp", 2, sp=True),
        scenario("cp2", 1, cp=2, strategy="fsdp")],
    # cp2 x tp2 without SP: residual masks shared inside each tp group, different across cp;
    # fsdp2 x tp2 + SP: the data-parallel ranks are left alone (seeded alike: the same masks).
    4: [scenario("cp2_tp2", 2, cp=2, strategy="fsdp", seeds="rank"),
        scenario("fsdp2_tp2_sp", 2, sp=True, strategy="fsdp")],
}


def overrides(sc: dict, run_dir: Path, ac: str = "none", steps: int = tpw.STEPS) -> list[str]:
    return [*tpw.COMMON, *tpw.GPT2, f"--run.dir={run_dir}", f"--model.dropout={DROPOUT}",
            f"--parallel.tp={sc['tp']}", f"--parallel.cp={sc['cp']}", f"--parallel.dp_strategy={sc['strategy']}",
            f"--parallel.sequence_parallel={str(sc['sp']).lower()}", "--parallel.loss_parallel=false",
            f"--train.micro_batch_size={tpw.MICRO}", f"--activations.checkpointing={ac}", f"--train.max_steps={steps}"]


class AttentionMasks(TorchFunctionMode):
    """Records the dropout mask of every scaled_dot_product_attention call with dropout_p > 0.

    Entered around the whole forward, so it is the outermost mode: under cp it sees the call
    the context-parallel attention finally makes (local queries, gathered keys). The mask is
    drawn again from the same generator state, with uniform attention (zero queries and keys)
    and the identity as values: the output is then keep / (T_k (1 - p)), zero where dropped."""

    def __init__(self):
        super().__init__()
        self.masks: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        p = kwargs.get("dropout_p", 0.0)
        if func is F.scaled_dot_product_attention and p > 0:
            q, k = args[0], args[1]
            B, H, Tq, Tk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
            state = torch.get_rng_state()
            probe = F.scaled_dot_product_attention(q.new_zeros(B, H, Tq, 1), q.new_zeros(B, H, Tk, 1),
                                                   torch.eye(Tk).expand(B, H, Tk, Tk), dropout_p=p)
            torch.set_rng_state(state)  # the real call draws the very same mask
            self.masks.append(probe != 0)
        return func(*args, **kwargs)


def seed_generators(sc: dict, rank: int) -> None:
    torch.manual_seed(1000 + rank if sc["seeds"] == "rank" else 1000)


def trainer_for(cfg, dataset=None):
    from slipstream import Trainer
    from slipstream.models.transformer import build_model

    return Trainer(build_model(cfg.model, "cpu", seed=tpw.MODEL_SEED), dataset or tpw.make_dataset(),
                   tpw.lm_batch_loss, config=cfg)


def capture_masks(cfg, sc: dict, rank: int) -> dict[str, list[torch.Tensor]]:
    from slipstream.distributed.data_parallel import unwrap

    seed_generators(sc, rank)
    trainer = trainer_for(cfg)
    model = unwrap(trainer.model)
    masks: dict[str, list[torch.Tensor]] = {}

    def record(name):
        return lambda module, args, out: masks.setdefault(name, []).append(out.detach() != 0)

    model.emb_dropout.register_forward_hook(record("emb"))
    for i, block in enumerate(model.blocks):
        calls = []  # the block's one nn.Dropout runs twice per forward: after attention, then after the MLP

        def residual(module, args, out, i=i, calls=calls):
            calls.append(None)
            record(f"block{i}.{'attn' if len(calls) % 2 else 'mlp'}")(module, args, out)

        block.dropout.register_forward_hook(residual)
    x = torch.randint(0, tpw.VOCAB, (tpw.MICRO, tpw.SEQ_LEN), generator=torch.Generator().manual_seed(1))
    cp = getattr(model, "context_parallel", None)
    if cp is not None:
        x = cp.shard_batch(x)  # this rank's tokens, as the trainer feeds them
    trainer.model.train()
    for _ in range(2):  # two steps: new masks each time
        probe = AttentionMasks()
        with torch.no_grad(), probe:
            trainer.model(x)
        for i, mask in enumerate(probe.masks):
            masks.setdefault(f"attn{i}", []).append(mask)
    return masks


def one_step(cfg) -> dict:
    """Loss and full gradients of one step, from a fixed generator state."""
    from slipstream.distributed.data_parallel import unwrap

    trainer = trainer_for(cfg)
    model = unwrap(trainer.model)
    calls = []  # attention forwards: twice per block when AC really recomputes the blocks in backward
    for block in model.blocks:
        getattr(block, "_checkpoint_wrapped_module", block).attn.register_forward_pre_hook(
            lambda module, args: calls.append(None))
    torch.manual_seed(1234)  # the same masks are drawn with and without AC, and on every rank alike
    loss, _, _ = trainer.accumulate_gradients(iter(trainer.train_loader))
    named = {n.replace("._checkpoint_wrapped_module", ""): p  # AC's wrapper level
             for n, p in model.named_parameters()}
    # Communicates: full_state gathers every sharded gradient (DTensor full_tensor) over the mesh.
    return {"loss": float(loss), "grads": tpw.full_state({n: p.grad for n, p in named.items()}),
            "attn_calls": len(calls)}


def counting_dataset() -> torch.utils.data.Dataset:
    """Sequences that count up (mod VOCAB) from a random start: learnable, so a loss that falls
    shows the dropout-masked model trains (the random tokens of tp_worker have nothing to learn)."""
    starts = torch.randint(0, tpw.VOCAB, (tpw.N_SAMPLES, 1), generator=torch.Generator().manual_seed(0))
    tokens = (starts + torch.arange(tpw.SEQ_LEN + 1)) % tpw.VOCAB
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def run_scenarios(out_dir: Path) -> int:
    """Every scenario of SCENARIOS[world], leaving the process group up (tests/distributed/shared_worker.py
    runs other workers' scenarios after these). 1 if any failed."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    from slipstream.config import load_config
    from slipstream.distributed.mesh import usable_cores

    torch.set_num_threads(max(1, usable_cores() // world))  # one machine: share its cores

    failed = False
    for sc in SCENARIOS[world]:
        where = out_dir / sc["name"]
        where.mkdir(parents=True, exist_ok=True)
        try:
            result = {"masks": capture_masks(load_config(None, overrides(sc, where / "masks")), sc, rank)}
            result["ac"] = {ac: one_step(load_config(None, overrides(sc, where / f"ac_{ac}", ac))) for ac in AC_MODES}
            torch.save(result, where / f"rank{rank}.pt")
            if sc["fit"]:
                cfg = load_config(None, overrides(sc, where / "run", steps=FIT_STEPS)
                                  + [f"--train.micro_batch_size={FIT_MICRO}"])
                trainer_for(cfg, counting_dataset()).fit()
        except Exception:
            failed = True
            (where / f"error_rank{rank}.txt").write_text(traceback.format_exc())
            traceback.print_exc()
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    from slipstream.distributed.mesh import shutdown

    failed = run_scenarios(Path(argv[0]))
    shutdown()
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
