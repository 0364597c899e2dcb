"""Fault injection: every guarantee of the fault-tolerance section, on CPU.

Faults are injected through SLIPSTREAM_INJECT_FAULT (slipstream.resilience.runtime), into
real `slipstream train` processes: NaN and spiking losses, a stalled step, a killed rank.
SIGTERM/SIGINT, kill -9 during a save and damaged checkpoints live in
tests/adversarial/test_held_cases.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.resilience.preemption import EXIT_PREEMPTED
from slipstream.resilience.watchdog import EXIT_HANG
from tests.e2e.background import Background

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _common(data_dir, steps=12):
    return ["--model.preset=tiny", f"--data.dir={data_dir}", f"--train.max_steps={steps}",
            "--train.micro_batch_size=4", "--train.seq_len=32", "--train.eval_steps=0", "--optim.warmup_steps=3",
            "--logging.log_interval=1", "--logging.progress=false", "--logging.tensorboard=false",
            "--train.deterministic=true", "--metrics.memory_breakdown=false"]


def _command(args, fault="", launch=None) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    env.pop("SLIPSTREAM_INJECT_FAULT", None)
    if fault:
        env["SLIPSTREAM_INJECT_FAULT"] = fault
    return [sys.executable, "-m", "slipstream", *(launch or []), "train", *args], env


def _run(args, fault="", launch=None, timeout=180):
    cmd, env = _command(args, fault, launch)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def _start(args, fault="", launch=None, timeout=180) -> Background:
    """_run, started now and awaited by result()."""
    cmd, env = _command(args, fault, launch)
    return Background(cmd, env=env, timeout=timeout)


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(run) if "loss" in r and "guard_event" not in r}


@pytest.mark.timeout(120)
def test_a_time_trigger_saves_without_a_step_interval(data_dir, tmp_path):
    run = tmp_path / "run"
    proc = _run(_common(data_dir) + [f"--run.dir={run}", "--checkpoint.interval_minutes=0.00001",
                                     "--checkpoint.keep_last=20", "--checkpoint.save_final=false"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert len(saved) >= 6  # a save is due after every step at this interval (one may still be in flight)
    stalls = [r["checkpoint_stall_s"] for r in _records(run) if "checkpoint_stall_s" in r]
    assert len(stalls) >= 6 and all(s >= 0 for s in stalls)


@pytest.mark.timeout(120)
def test_nan_and_spike_are_skipped_and_logged(data_dir, tmp_path):
    run = tmp_path / "run"
    proc = _run(_common(data_dir, steps=20) + [f"--run.dir={run}", "--stability.policy=skip"],
                fault="nan@5,spike@16")
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = [r for r in _records(run) if "guard_event" in r]
    assert [(e["step"], e["guard_event"], e["action"]) for e in events] == [
        (5, "nonfinite_loss", "skip"), (16, "spike", "skip")]
    assert events[0]["loss"] == "nan" and events[1]["loss"] > 2 * events[1]["median"]
    losses = _losses(run)
    assert len(losses) == 20 and losses[5] is None and losses[16] is None  # dropped steps have no loss to log
    assert all(v == v and v < 10 for s, v in losses.items() if s not in (5, 16))  # finite: no poisoned update


@pytest.mark.timeout(120)
def test_skip_works_with_fp16_loss_scaling(data_dir, tmp_path):
    """The guard drops the update after the scaler has unscaled the gradients: the scaler must
    still be updated, or the next step's unscale_ fails."""
    run = tmp_path / "run"
    proc = _run(_common(data_dir) + [f"--run.dir={run}", "--stability.policy=skip", "--precision.autocast=fp16"],
                fault="nan@5")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["step"] for r in _records(run) if "guard_event" in r] == [5]


@pytest.mark.timeout(120)
def test_stop_policy_ends_the_run_after_k_events(data_dir, tmp_path):
    proc = _run(_common(data_dir) + [f"--run.dir={tmp_path / 'run'}", "--stability.policy=stop",
                                     "--stability.max_events=2"], fault="nan@3,nan@4")
    assert proc.returncode == 2
    assert "error:" in proc.stderr and "2" in proc.stderr


@pytest.mark.timeout(120)
def test_rollback_reloads_the_last_checkpoint_and_skips_the_bad_batches(data_dir, tmp_path):
    run = tmp_path / "run"
    proc = _run(_common(data_dir) + [f"--run.dir={run}", "--stability.policy=rollback", "--checkpoint.interval=4"],
                fault="nan@6")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rolled back from step 6 to step_00000004" in proc.stdout
    records = _records(run)
    assert [r["step"] for r in records if "guard_event" in r] == [6]
    assert json.loads((run / "summary.json").read_text())["steps"] == 12


@pytest.mark.timeout(120)
def test_a_stalled_step_dumps_stacks_and_exits_for_a_restart(data_dir, tmp_path):
    run = tmp_path / "run"
    proc = _run(_common(data_dir) + [f"--run.dir={run}", "--resilience.watchdog_s=2"], fault="stall@4", timeout=90)
    assert proc.returncode == EXIT_HANG, proc.stderr[-2000:]
    dump = (run / "hang_rank0.txt").read_text()
    assert "inject" in dump  # the stalled frame is in the dump


LAUNCH2 = ["launch", "local", "--nproc", "2", "--"]


def _args2(data_dir):
    return _common(data_dir) + ["--checkpoint.interval=4", "--checkpoint.resume=auto", "--parallel.dp_strategy=ddp"]


@pytest.fixture(scope="module")
def first_jobs(tmp_path_factory, data_dir) -> dict[str, tuple[Path, Background]]:
    """The straight job and the preempted one (SIGUSR1 reaches rank 1 only, in step 6; asynchronous
    saves, the default) do not depend on each other: started side by side (tests/e2e/background.py)."""
    runs = {name: tmp_path_factory.mktemp(name) / "run" for name in ("straight2", "preempted")}
    return {"straight2": (runs["straight2"], _start(_args2(data_dir) + [f"--run.dir={runs['straight2']}"],
                                                    launch=LAUNCH2, timeout=240)),
            "preempted": (runs["preempted"], _start(_args2(data_dir) + [f"--run.dir={runs['preempted']}"],
                                                    fault="sigusr1@6@1", launch=LAUNCH2, timeout=240))}


@pytest.fixture(scope="module")
def straight2(first_jobs) -> Path:
    run, job = first_jobs["straight2"]
    proc = job.result()
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run


@pytest.fixture(scope="module")
def preempted(first_jobs) -> tuple[Path, subprocess.CompletedProcess]:
    run, job = first_jobs["preempted"]
    return run, job.result()


@pytest.fixture(scope="module")
def rerun_with_a_killed_rank(preempted, data_dir) -> subprocess.CompletedProcess:
    """The preempted job run again, in which rank 1 dies in step 11: one launch for both tests below
    (the rerun of the preemption test, the restart of the killed-rank test)."""
    run, _ = preempted
    launch = ["launch", "local", "--nproc", "2", "--max-restarts", "1", "--"]
    return _run(_args2(data_dir) + [f"--run.dir={run}", "--checkpoint.async_save=false"], fault="crash@11@1",
                launch=launch, timeout=240)


@pytest.mark.timeout(300)
def test_preemption_of_a_launched_job_saves_on_every_rank_and_resumes(straight2, preempted, rerun_with_a_killed_rank):
    """SIGUSR1 reaches one rank only; the ranks agree, save step 6 and exit 75; the rerun resumes."""
    run, proc = preempted
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr[-3000:]  # the ranks' code, not torchrun's 1
    assert (run / "checkpoints" / "step_00000006" / "COMPLETE").exists()
    proc = rerun_with_a_killed_rank
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("resumed from ")[1].split()[0].endswith("step_00000006")  # its first attempt
    assert _losses(run) == _losses(straight2)


@pytest.mark.timeout(300)
def test_a_killed_rank_restarts_the_group_and_resumes(straight2, preempted, rerun_with_a_killed_rank):
    """world 2, rank 1 dies in step 11; `launch local --max-restarts 1` starts both ranks again and
    they resume from the step-8 checkpoint: 3 steps lost, less than one interval (4). Saves are
    synchronous here; with asynchronous saves the bound is one interval plus one save's write time.
    (The job is the preempted one's rerun, which resumed at step 6 and saved step 8.)"""
    run, _ = preempted
    proc = rerun_with_a_killed_rank
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "injected crash at step 11 on rank 1" in proc.stdout + proc.stderr
    assert "restarting all ranks" in proc.stdout
    assert proc.stdout.split("resumed from ")[-1].split()[0].endswith("step_00000008")  # after the restart
    assert _losses(run) == _losses(straight2)


@pytest.mark.timeout(120)
def test_a_user_error_is_not_retried(data_dir, tmp_path):
    """Also `launch local` passing on a failing command's exit code: the override reached train
    untouched and train refused it (exit 2)."""
    proc = _run(["--no.such=1"], launch=["launch", "local", "--nproc", "2", "--max-restarts", "2", "--"], timeout=100)
    assert proc.returncode == 2 and "restarting" not in proc.stdout
    assert "no.such" in proc.stdout + proc.stderr


@pytest.mark.timeout(150)
def test_a_stalled_rank_stops_the_job_with_its_stack_dump(data_dir, tmp_path):
    """Rank 1 stops making progress: its watchdog dumps the stacks and exits 124; torchrun stops
    rank 0 (blocked in the next collective) and the launch fails instead of hanging."""
    run = tmp_path / "run"
    proc = _run(_args2(data_dir) + [f"--run.dir={run}", "--resilience.watchdog_s=3"], fault="stall@5@1",
                launch=LAUNCH2, timeout=120)
    assert proc.returncode != 0
    assert f"exitcode  : {EXIT_HANG}" in proc.stderr, proc.stderr[-3000:]
    assert "inject" in (run / "hang_rank1.txt").read_text()
