"""`slipstream train --data.mixture...` end to end: two prepared sources mixed 0.7 / 0.3.

One straight CLI run is the reference for everything else: its records carry the tokens per
source, a resume from its step-3 checkpoint logs the same losses, a resume with new weights
says so and logs them, and a `launch local --nproc 2 --parallel.tp=2` run (both tensor-parallel
ranks read the same batch) logs its losses within 1e-5. A two-rank data-parallel job resumes
from rank 0's loader state (it holds every rank's position in every source) exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from slipstream.data import prepare_dataset
from tests.e2e.background import Jobs

ROOT = Path(__file__).resolve().parents[2]
MICRO, SEQ, STEPS = 4, 32, 6
COMMON = ["--model.preset=tiny", f"--train.seq_len={SEQ}", f"--train.max_steps={STEPS}",
          f"--train.micro_batch_size={MICRO}", "--data.sampling=sequential", "--train.deterministic=true",
          "--train.eval_interval=3", "--train.eval_tokens=256", "--optim.warmup_steps=2", "--logging.log_interval=1",
          "--logging.progress=false", "--logging.tensorboard=false", "--metrics.memory_breakdown=false",
          "--checkpoint.interval=3", "--checkpoint.async_save=false"]


def _command(args: list[str], launch: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    return [sys.executable, "-m", "slipstream", *(launch + ["--"] if launch else []), "train", *COMMON, *args], env


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def _run(args: list[str], launch: list[str] | None = None) -> str:
    cmd, env = _command(args, launch)
    return _ok(subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env))


def _records(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def mixture_args(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("sources")
    args = []
    for i, (name, alphabet, weight) in enumerate([("a", "abcdefghij ", 0.7), ("b", "0123456789+", 0.3)]):
        raw = root / f"raw_{name}"
        raw.mkdir()
        rng = np.random.default_rng(i)
        for d in range(30):
            (raw / f"{d}.txt").write_text("".join(rng.choice(list(alphabet), size=400)))
        prepare_dataset([str(raw)], "byte", str(root / name), val_fraction=0.2, num_workers=1, progress=False)
        args += [f"--data.sources.{name}={root / name}", f"--data.mixture.{name}={weight}"]
    return args


LAUNCH2 = ["launch", "local", "--nproc", "2"]
# Every run of this module that depends on no other: name -> (overrides after the mixture's, launch).
JOBS = {
    "straight": ([], None),
    # both tensor-parallel ranks read the same batch
    "tp2": (["--parallel.tp=2", "--checkpoint.interval=0", "--checkpoint.save_final=false"], LAUNCH2),
    # each data-parallel rank reads its own sequences
    "dp2": (["--train.micro_batch_size=2", "--parallel.dp_strategy=ddp"], LAUNCH2),
}
READS = {"test_mixture_logs_tokens_per_source_and_resumes_exactly": ["straight"],
         "test_tensor_parallel_ranks_read_the_same_mixed_batch": ["straight", "tp2"],
         "test_two_data_parallel_ranks_resume_from_rank0s_state": ["dp2"]}


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory, mixture_args):
    """name -> (run dir, its process's stdout). The selected tests' runs start when the first test
    asks, two at a time (tests/e2e/background.py: a launch keeps 2 cores only about half busy)."""
    selected = {name for item in request.session.items if item.path == Path(__file__)
                for name in READS.get(item.name, [])}
    runs, commands = {}, {}
    for name, (overrides, launch) in JOBS.items():
        if name in selected:
            runs[name] = tmp_path_factory.mktemp(name) / "run"
            cmd, env = _command([*mixture_args, f"--run.dir={runs[name]}", *overrides], launch)
            commands[name] = (cmd, env, 200)
    started = Jobs(commands)
    yield lambda name: (runs[name], _ok(started.result(name)))
    started.close()


@pytest.fixture(scope="module")
def straight(jobs) -> Path:
    return jobs("straight")[0]


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in _records(run)]


@pytest.mark.timeout(200)
def test_mixture_logs_tokens_per_source_and_resumes_exactly(straight, mixture_args, tmp_path):
    records = _records(straight)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert r["data/tokens/a"] + r["data/tokens/b"] == r["tokens"] == r["step"] * MICRO * SEQ
        assert r["data/weight/a"] == pytest.approx(0.7) and r["data/weight/b"] == pytest.approx(0.3)
    assert records[-1]["data/tokens/a"] > records[-1]["data/tokens/b"] > 0
    evals = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert any("val_loss" in r for r in evals)
    config = (straight / "config.toml").read_text()
    assert "[data.mixture]" in config and "a = 0.7" in config

    # Resume from the step-3 checkpoint: the same batches, so the same losses and counts.
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000006")
    out = _run([*mixture_args, f"--run.dir={resumed}", "--checkpoint.resume=auto"])
    assert "resumed from" in out and "weights changed" not in out
    assert _losses(resumed) == pytest.approx(_losses(straight), rel=1e-6)  # fp32, one process: same sums
    assert [r["data/tokens/a"] for r in _records(resumed)] == [r["data/tokens/a"] for r in records]

    # New weights on resume: allowed, printed, and logged from the next step on.
    reweighted = tmp_path / "reweighted"
    shutil.copytree(resumed, reweighted)
    shutil.rmtree(reweighted / "checkpoints" / "step_00000006")
    args = [a.replace("mixture.a=0.7", "mixture.a=0.1").replace("mixture.b=0.3", "mixture.b=0.9") for a in mixture_args]
    out = _run([*args, f"--run.dir={reweighted}", "--checkpoint.resume=auto"])
    assert "data.mixture weights changed on resume: {'a': 0.7, 'b': 0.3} -> {'a': 0.1, 'b': 0.9}" in out
    after = _records(reweighted)
    assert [r["data/weight/b"] for r in after] == pytest.approx([0.3] * 3 + [0.9] * 3)
    assert after[2]["data/tokens/a"] == records[2]["data/tokens/a"]  # the counts carry over


@pytest.mark.timeout(200)
def test_tensor_parallel_ranks_read_the_same_mixed_batch(straight, jobs):
    run, out = jobs("tp2")
    assert "tp 2]" in out
    records = _records(run)
    assert len(records) == STEPS
    assert [r["loss"] for r in records] == pytest.approx(_losses(straight), rel=1e-5)
    assert [r["data/tokens/b"] for r in records] == [r["data/tokens/b"] for r in _records(straight)]


@pytest.mark.timeout(200)
def test_two_data_parallel_ranks_resume_from_rank0s_state(jobs, mixture_args, tmp_path):
    """Each rank reads its own sequences; the checkpoint holds rank 0's loader state, which
    knows every rank's position in every source: the resumed job logs the straight job's losses."""
    run, _ = jobs("dp2")
    records = _records(run)
    assert [r["data/tokens/a"] + r["data/tokens/b"] for r in records] == [r["tokens"] for r in records]
    assert records[-1]["tokens"] == STEPS * 2 * 2 * SEQ  # both ranks' sequences
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000006")
    out = _run([*mixture_args, f"--run.dir={resumed}", "--train.micro_batch_size=2", "--parallel.dp_strategy=ddp",
                "--checkpoint.resume=auto"], LAUNCH2)
    assert "resumed from" in out
    assert _losses(resumed) == pytest.approx(_losses(run), rel=1e-6)
