"""kill -9 in the middle of a checkpoint save, in one process and on one rank of two.

The fault is injected with SLIPSTREAM_INJECT_FAULT=killsave@STEP[@RANK]: the process SIGKILLs
itself once its shards of that step's save are on disk, before its manifest and COMPLETE
(checkpoint/writer.py). The guarantees: the last complete checkpoint is untouched, the cut
save never looks complete, and --checkpoint.resume=auto continues from the last complete one.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from slipstream.checkpoint.manager import list_checkpoints, verify_checkpoint
from tests.adversarial.conftest import assert_unchanged, run_cli, tree_snapshot


def _args(data_dir, run: Path, *extra: str) -> list[str]:
    return ["train", "--model.preset=tiny", f"--data.dir={data_dir}", f"--run.dir={run}", "--train.max_steps=12",
            "--train.micro_batch_size=4", "--train.seq_len=32", "--train.eval_steps=0", "--optim.warmup_steps=3",
            "--logging.log_interval=1", "--logging.progress=false", "--logging.tensorboard=false",
            "--train.deterministic=true", "--metrics.memory_breakdown=false", "--checkpoint.interval=4",
            "--checkpoint.resume=auto", *extra]


def _losses(run: Path) -> dict[int, float]:
    """{step: loss} of the training records (a resumed run first drops the records after its checkpoint)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r and "guard_event" not in r}


def _assert_cut_save(run: Path) -> None:
    """Step 4 complete and intact; step 8 cut off: shards on disk, no COMPLETE anywhere."""
    ckpts = run / "checkpoints"
    assert [p.name for p in list_checkpoints(ckpts)] == ["step_00000004"]
    assert verify_checkpoint(ckpts / "step_00000004") == []
    partial = ckpts / ".step_00000008.tmp"
    assert list((partial / "model_optim").glob("*.distcp")), "the fault fired before the shards were written"
    assert not any(p.name == "COMPLETE" for p in partial.rglob("*"))
    assert not (ckpts / "step_00000008").exists()


def _assert_resumed_from_step_4(proc, run: Path, killed: dict[int, float]) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert out.split("resumed from ")[1].split()[0].endswith("step_00000004"), out[-3000:]
    # Steps 5-8 ran twice, before the kill and again after resuming from step 4: bitwise equal.
    again = _losses(run)
    assert sorted(again) == list(range(1, 13))
    assert all(again[s] == killed[s] for s in range(1, 9)), (killed, again)
    ckpts = run / "checkpoints"
    assert [p.name for p in list_checkpoints(ckpts)] == ["step_00000004", "step_00000008", "step_00000012"]
    assert not list(ckpts.glob(".*.tmp")), "the next save removes the cut one"


@pytest.mark.timeout(400)
def test_kill_9_during_a_synchronous_save(data_dir, tmp_path):
    run = tmp_path / "run"
    data_before = tree_snapshot(data_dir)
    args = _args(data_dir, run, "--checkpoint.async_save=false")
    proc = run_cli(*args, cwd=tmp_path, env_extra={"SLIPSTREAM_INJECT_FAULT": "killsave@8"})
    assert proc.returncode == -signal.SIGKILL, (proc.stdout + proc.stderr)[-3000:]
    assert "injected kill -9 in the save of step 8 on rank 0" in proc.stdout
    _assert_cut_save(run)
    killed = _losses(run)
    assert sorted(killed) == list(range(1, 9))
    _assert_resumed_from_step_4(run_cli(*args, cwd=tmp_path), run, killed)
    assert_unchanged(data_before, tree_snapshot(data_dir))


@pytest.mark.timeout(600)
def test_one_rank_killed_during_a_save_at_world_2(data_dir, tmp_path):
    """Rank 1 dies in the (asynchronous, the default) save of step 8: the launcher ends the job
    with a non-zero exit, rank 0 never commits step 8, and the relaunch resumes from step 4."""
    run = tmp_path / "run"
    launch = ["launch", "local", "--nproc", "2", "--"]
    args = [*launch, *_args(data_dir, run, "--parallel.dp_strategy=ddp")]
    proc = run_cli(*args, cwd=tmp_path, timeout=300, env_extra={"SLIPSTREAM_INJECT_FAULT": "killsave@8@1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 2), out[-3000:]
    assert "injected kill -9 in the save of step 8 on rank 1" in out, out[-3000:]
    _assert_cut_save(run)
    killed = _losses(run)  # rank 0 may have logged a step past 8 before the launcher stopped it
    assert all(s in killed for s in range(1, 9))
    _assert_resumed_from_step_4(run_cli(*args, cwd=tmp_path, timeout=300), run, killed)
