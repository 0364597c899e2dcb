"""Worker for tests/distributed/test_data_parallel.py: many Trainer runs in one torchrun launch.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/distributed/dp_worker.py OUT_DIR [NAME ...]

Runs every scenario of SCENARIOS[N] (or only the named ones) one after the other in the same
process group and writes, per scenario and rank, OUT_DIR/<name>/rank<R>.json (and, for
scenarios with `snapshots`, rank<R>.pt: this rank's flat parameter vector after every step).
Rank 0's Trainer writes metrics.jsonl and the checkpoints into OUT_DIR/<name>/run.

The pytest side imports this module for the shared builders (config, model, data), so the
single-process references are built exactly like the distributed runs.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

VOCAB = 64
SEQ_LEN = 16
N_SAMPLES = 64    # divisible by every world x micro-batch used here, so no rank ever sits a sample out
MICRO = 2         # per-rank micro-batch of every distributed run
STEPS = 6
CKPT_INTERVAL = 3
MODEL_SEED = 7

# Every run, distributed or reference, differs from this only in strategy, micro-batch,
# accumulation, run dir and the scenario's own extras.
COMMON = [
    "--model.preset=tiny", f"--model.vocab_size={VOCAB}", f"--train.seq_len={SEQ_LEN}",
    f"--train.max_steps={STEPS}", "--train.deterministic=true", "--train.eval_steps=0",
    "--optim.warmup_steps=1", "--optim.lr=0.01", "--optim.eps=1e-6", "--logging.progress=false", "--logging.tensorboard=false",
    "--logging.log_interval=1", "--metrics.memory_breakdown=false", f"--checkpoint.interval={CKPT_INTERVAL}",
    "--parallel.timeout_s=60", "--parallel.init_timeout_s=60",
]


def scenario(name: str, strategy: str, accum: int = 1, extra: tuple[str, ...] = (), kind: str = "fit",
             snapshots: bool = False) -> dict[str, Any]:
    """kind: fit (one run), resume (crash after step 3, resume to step 6), dataset (a raw Dataset
    handed to the Trainer instead of an explicitly sharded loader), bytes (fit, then check_sharded_bytes)."""
    return dict(name=name, strategy=strategy, accum=accum, extra=list(extra), kind=kind, snapshots=snapshots)


POWERSGD = ("--parallel.comm_hook=powersgd", "--parallel.powersgd_start_step=2", "--parallel.powersgd_rank=1")
LOCAL_SGD_START, LOCAL_SGD_PERIOD = 2, 2
LOCAL_SGD = (f"--parallel.local_sgd_period={LOCAL_SGD_PERIOD}", f"--parallel.local_sgd_start_step={LOCAL_SGD_START}")
BYTES = ("--train.max_steps=1", "--checkpoint.interval=0", "--checkpoint.save_final=false")
# Wanda pruning at step 2 (issue 21): each rank runs half of the calibration batches and one
# all-reduce sums the input norms; the masks must equal one process's over all of them.
WANDA = ("--sparsity.method=magnitude", "--sparsity.criterion=wanda", "--sparsity.target=0.5",
         "--sparsity.start_step=2")

SCENARIOS: dict[int, list[dict[str, Any]]] = {
    2: [
        scenario("ddp", "ddp", snapshots=True),
        scenario("zero1", "zero1"),
        scenario("zero2", "zero2"),
        scenario("fsdp", "fsdp"),
        scenario("ddp_accum2", "ddp", accum=2),
        scenario("zero2_accum2", "zero2", accum=2),
        scenario("fsdp_accum2", "fsdp", accum=2),
        scenario("hook_fp16", "ddp", extra=("--parallel.comm_hook=fp16",), snapshots=True),
        scenario("hook_bf16", "ddp", extra=("--parallel.comm_hook=bf16",), snapshots=True),
        scenario("hook_powersgd", "ddp", extra=POWERSGD, snapshots=True),
        scenario("local_sgd", "ddp", extra=LOCAL_SGD, snapshots=True),
        scenario("resume_ddp", "ddp", kind="resume"),
        scenario("resume_zero1", "zero1", kind="resume"),
        scenario("resume_zero2", "zero2", kind="resume"),
        scenario("resume_fsdp", "fsdp", kind="resume"),
        # Local SGD averages during steps 3 and 5: the step-3 checkpoint holds every rank's parameters.
        scenario("resume_local_sgd", "ddp", extra=LOCAL_SGD, kind="resume"),
        scenario("dataset_ddp", "ddp", kind="dataset"),
        scenario("wanda_ddp", "ddp", extra=WANDA),
        # Sharding really shards (issue 12): each rank's bytes of parameters, gradients and Adam
        # moments against one process's, checked in this worker (check_sharded_bytes).
        scenario("bytes_zero1", "zero1", kind="bytes", extra=BYTES),
        scenario("bytes_zero2", "zero2", kind="bytes", extra=BYTES),
        scenario("bytes_fsdp", "fsdp", kind="bytes", extra=BYTES),
    ],
    4: [
        scenario("ddp", "ddp"),
        scenario("fsdp", "fsdp"),
        scenario("hsdp", "hsdp", extra=("--parallel.dp_shard=2",)),
        scenario("resume_hsdp", "hsdp", extra=("--parallel.dp_shard=2",), kind="resume"),
    ],
}


# --- shared builders (the pytest side uses them for the single-process references) -----------

def overrides(run_dir: Path | str, strategy: str, micro: int, accum: int = 1, extra: list[str] | tuple = ()) -> list[str]:
    return [*COMMON, f"--run.dir={run_dir}", f"--parallel.dp_strategy={strategy}",
            f"--train.micro_batch_size={micro}", f"--train.grad_accum_steps={accum}", *extra]


def make_config(run_dir, strategy: str, micro: int, accum: int = 1, extra=()):
    from slipstream.config import load_config

    return load_config(None, overrides(run_dir, strategy, micro, accum, extra))


def make_dataset() -> torch.utils.data.Dataset:
    """Deterministic random token sequences (x, y = x shifted by one)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (N_SAMPLES, SEQ_LEN + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def make_calibration() -> list[torch.Tensor]:
    """The inputs Wanda's input norms are measured on (the same on every rank and in the reference)."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (MICRO, SEQ_LEN), generator=g) for _ in range(4)]


def make_job(cfg):
    """The JobInfo a Trainer of this config needs (calibration inputs under sparsity.criterion = wanda)."""
    from slipstream.train.trainer import JobInfo

    return JobInfo(calibration=make_calibration() if cfg.sparsity.criterion == "wanda" else None)


def make_model(cfg) -> torch.nn.Module:
    """The same full weights on every rank (and in the reference process)."""
    from slipstream.models.transformer import build_model

    return build_model(cfg.model, "cpu", seed=MODEL_SEED)


def make_loader(cfg, rank: int, world: int):
    """This rank's shard of the data, exactly as documented for DatasetLoader: world W with
    micro-batch B reads the samples one process reads with micro-batch W*B."""
    from slipstream.data.loader import DatasetLoader

    return DatasetLoader(make_dataset(), batch_size=cfg.train.micro_batch_size, shuffle=True, seed=cfg.train.seed,
                         drop_last=True, rank=rank, world_size=world)


def lm_batch_loss(model, batch):
    from slipstream.models.transformer import lm_loss

    return lm_loss(model(batch[0]), batch[1])


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """All parameters of a plain (or DDP-wrapped) model as one fp32 vector, in named order."""
    from slipstream.distributed.data_parallel import unwrap

    return torch.cat([p.detach().reshape(-1).float().clone() for _, p in unwrap(model).named_parameters()])


class Crash(RuntimeError):
    """Raised by the loss function to kill a run in the middle of a step."""


class Recorder:
    """A loss function that can snapshot the parameters before each training micro-batch and
    crash at a given training call (the same call on every rank, before any collective)."""

    def __init__(self, snapshots: bool = False, crash_at_call: int | None = None):
        self.snapshots = snapshots
        self.crash_at_call = crash_at_call
        self.calls = 0
        self.params: list[torch.Tensor] = []

    def __call__(self, model, batch):
        if model.training:
            self.calls += 1
            if self.crash_at_call is not None and self.calls == self.crash_at_call:
                raise Crash(f"crash at training call {self.calls}")
            if self.snapshots:
                self.params.append(flat_params(model))
        return lm_batch_loss(model, batch)


# --- sharding really shards ------------------------------------------------------------------

def _local_bytes(tensors) -> int:
    """Bytes this rank holds of `tensors` (a DTensor counts its local shard only)."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)


def check_sharded_bytes(trainer, strategy: str, rank: int, world: int) -> dict[str, Any]:
    """One more forward/backward after fit() on every rank, measuring this rank's share of the
    model state: parameters between forward and backward (gathered or not), parameters at rest,
    gradients and Adam moments; all ranks' shares against one process's totals. Raises when a
    strategy keeps whole what it promises to shard (or shards what it keeps whole)."""
    import torch.distributed as dist

    model, opt = trainer.model, trainer.optimizer
    opt = getattr(opt, "optim", opt)  # ZeRO-1: the local optimizer holds this rank's partition
    x, y = next(iter(make_loader(trainer.cfg, rank, world)))
    model.zero_grad(set_to_none=True)
    loss = lm_batch_loss(model, (x, y))
    mine = {"gathered": _local_bytes(model.parameters())}
    loss.backward()
    mine["grads"] = _local_bytes(p.grad for p in model.parameters() if p.grad is not None)
    mine["params"] = _local_bytes(model.parameters())
    mine["moments"] = _local_bytes(s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq") if k in s)
    model.zero_grad(set_to_none=True)
    ranks: list[Any] = [None] * world
    dist.all_gather_object(ranks, mine)

    plain = make_model(trainer.cfg)  # what one process holds
    full = _local_bytes(plain.parameters())
    blocks = _local_bytes(p for b in plain.blocks for p in b.parameters())
    largest = max(p.numel() * p.element_size() for p in plain.parameters())
    totals = {"gathered": full, "grads": full, "params": full, "moments": 2 * full}
    # The blocks are FSDP units resharded after forward under fsdp; the root unit (embeddings,
    # final norm, head) is not. zero2 reshards no unit after forward.
    gathered = {"zero1": full, "zero2": full, "fsdp": full - blocks + blocks // world}[strategy]
    sharded = {"zero1": {"moments"}, "zero2": {"grads", "params", "moments"},
               "fsdp": {"grads", "params", "moments"}}[strategy]
    for key, total in totals.items():
        got = [r[key] for r in ranks]
        if key == "gathered":
            want = f"{gathered} on every rank"
            ok = got == [gathered] * world
        elif key in sharded:
            # Every byte on exactly one rank; ZeRO-1 assigns whole parameters (at most the largest
            # one's moments of imbalance), FSDP splits every parameter's rows (all even here).
            slack = 2 * largest if strategy == "zero1" else 0
            want = f"1/{world} of {total} (sum {total}, at most {total // world + slack} per rank)"
            ok = sum(got) == total and max(got) <= total // world + slack
        else:
            want = f"all {total} on every rank"
            ok = got == [total] * world
        if not ok:
            raise AssertionError(f"{strategy} at world {world}: per-rank {key} bytes {got}, expected {want}")
    return {"ranks": ranks, "single_process": totals}


# --- the worker --------------------------------------------------------------------------------

def _run_scenario(sc: dict[str, Any], out: Path, rank: int, world: int) -> dict[str, Any]:
    from slipstream import Trainer

    run_dir = out / sc["name"] / "run"
    result: dict[str, Any] = {"name": sc["name"], "rank": rank, "world": world}

    def build(extra=(), recorder: Recorder | None = None):
        cfg = make_config(run_dir, sc["strategy"], MICRO, sc["accum"], [*sc["extra"], *extra])
        data = make_dataset() if sc["kind"] == "dataset" else make_loader(cfg, rank, world)
        trainer = Trainer(make_model(cfg), data, recorder or lm_batch_loss, config=cfg, job=make_job(cfg))
        return trainer

    if sc["kind"] == "resume":
        # Leg 1: killed inside step 4 (the checkpoint of step 3 exists); same config as the straight run.
        first = build(recorder=Recorder(crash_at_call=CKPT_INTERVAL * sc["accum"] + 1))
        try:
            first.fit()
        except Crash:
            result["crashed_at_step"] = first.step
        else:
            raise AssertionError("leg 1 did not crash")
        del first
        trainer = build(extra=("--checkpoint.resume=auto",))
        summary = trainer.fit()
        result["steps_this_run"] = summary["steps_this_run"]
    else:
        recorder = Recorder(snapshots=sc["snapshots"])
        trainer = build(recorder=recorder)
        loader = trainer.train_loader
        result["loader"] = {"type": type(loader).__name__, "rank": getattr(loader, "rank", None),
                            "world_size": getattr(loader, "world_size", None)}
        summary = trainer.fit()
        if sc["kind"] == "bytes":
            result["bytes"] = check_sharded_bytes(trainer, sc["strategy"], rank, world)
        if sc["snapshots"]:
            recorder.params.append(flat_params(trainer.model))  # after the last step
            # params[k] = this rank's parameters after step k (k = 0: the initial weights)
            torch.save(torch.stack(recorder.params), out / sc["name"] / f"rank{rank}.pt")
    result["summary"] = {k: summary.get(k) for k in ("steps", "final_loss", "checkpoint", "run_dir",
                                                       "world_size", "dp_strategy")}
    result["model_type"] = type(trainer.model).__name__
    result["optimizer_type"] = type(trainer.optimizer).__name__
    hook_state = getattr(trainer.model, "slipstream_hook_state", None)
    if hook_state is not None:
        result["hook_state"] = {"type": type(hook_state).__name__, "iter": getattr(hook_state, "iter", None)}
    # The process group's view of the mesh this run used.
    result["mesh"] = dict(zip(trainer.parallel.mesh.mesh_dim_names, trainer.parallel.mesh.shape)) \
        if trainer.parallel.mesh is not None else None
    return result


def run_scenarios(out: Path, only: set[str] = frozenset()) -> int:
    """Every scenario of SCENARIOS[world] (or only the named ones), leaving the process group up
    (tests/distributed/shared_worker.py runs other workers' scenarios after these). 1 if any failed."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ.setdefault("SLIPSTREAM_CACHE_DIR", str(out / "cache"))
    failed = 0
    for sc in SCENARIOS[world]:
        if only and sc["name"] not in only:
            continue
        (out / sc["name"]).mkdir(parents=True, exist_ok=True)
        try:
            result = _run_scenario(sc, out, rank, world)
        except Exception as e:  # record it and go on: every rank fails alike in these scenarios
            failed += 1
            result = {"name": sc["name"], "rank": rank, "error": f"{type(e).__name__}: {e}",
                      "traceback": traceback.format_exc()}
            print(f"rank {rank}: scenario {sc['name']} failed:\n{result['traceback']}", file=sys.stderr, flush=True)
        path = out / sc["name"] / f"rank{rank}.json"
        path.write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
        if dist.is_initialized():
            dist.barrier()
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    from slipstream.distributed.mesh import shutdown

    failed = run_scenarios(Path(argv[0]), set(argv[1:]))
    shutdown()
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
