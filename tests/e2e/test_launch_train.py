"""`slipstream launch local --nproc 2 -- train ...` end to end, against one process.

With sequential sampling, rank r of W reads windows r, r+W, r+2W, ... of the epoch order,
so W ranks with micro-batch B see exactly the windows one process sees with micro-batch
W*B: the logged losses must agree (fp32 sums in another order: ~1e-6, not bitwise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.config.load import load_config
from slipstream.train.lm import train_lm

COMMON = ["--model.preset=tiny", "--train.seq_len=32", "--train.max_steps=6", "--data.sampling=sequential",
          "--train.eval_interval=3", "--train.eval_steps=2", "--optim.warmup_steps=2", "--logging.log_interval=1",
          "--logging.progress=false", "--logging.tensorboard=false", "--train.deterministic=true",
          "--metrics.memory_breakdown=false"]


def _launch(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    return subprocess.run([sys.executable, "-m", "slipstream", "launch", "local", "--nproc", "2", "--", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def _records(run_dir: Path) -> tuple[list[float], list[float]]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if "loss" in r], [r["val_loss"] for r in lines if "val_loss" in r]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir) -> tuple[list[float], list[float]]:
    """One process with the global batch: 8 sequences."""
    run = tmp_path_factory.mktemp("single") / "run"
    train_lm(load_config(None, COMMON + [f"--data.dir={data_dir}", f"--run.dir={run}", "--train.micro_batch_size=8"]))
    return _records(run)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy, extra", [
    ("fsdp", ["--train.micro_batch_size=4"]),
    # DDP with accumulation: no_sync on the first micro-batch, all-reduce on the second.
    ("ddp", ["--train.micro_batch_size=2", "--train.grad_accum_steps=2", "--logging.rank_logs=true"]),
])
def test_launch_local_trains_like_one_process(strategy, extra, reference, data_dir, tmp_path):
    run = tmp_path / "run"
    proc = _launch(["train", *COMMON, *extra, f"--data.dir={data_dir}", f"--run.dir={run}",
                    f"--parallel.dp_strategy={strategy}"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"parallel: {strategy} on 2 process(es)" in proc.stdout
    assert proc.stdout.count("run summary") == 1  # only rank 0 reports
    losses, val_losses = _records(run)
    ref_losses, ref_val = reference
    assert len(losses) == len(ref_losses) == 6
    # Measured max relative difference: ~2e-7; bound 10x above or more.
    for got, want in zip(losses, ref_losses):
        assert got == pytest.approx(want, rel=5e-6)
    if strategy == "fsdp":  # evaluation reads micro_batch_size sequences per rank: same val batches only here
        assert val_losses == pytest.approx(ref_val, rel=5e-6)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["dp_strategy"] == strategy
    assert summary["tokens"] == 6 * 8 * 32  # the whole job's tokens, not one rank's
    assert summary["tokens_per_s_per_device"] == pytest.approx(summary["tokens_per_s"] / 2)
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    meta = json.loads((Path(summary["checkpoint"]) / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["optimizer_layout"]["dp_strategy"] == strategy
    if strategy == "ddp":
        for rank in (0, 1):
            rank_log = [json.loads(line) for line in (run / "logs" / f"rank{rank}.jsonl").read_text().splitlines()]
            assert [r["rank"] for r in rank_log] == [rank] * 6
            assert all("local_loss" in r for r in rank_log)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("extra, rel", [
    # FSDP mixed precision: bf16 compute, fp32 gradient reduction (measured max 5.3e-4).
    (["--parallel.param_dtype=bf16", "--parallel.reduce_dtype=fp32"], 1e-2),
    # CPU offload of parameters, gradients and optimizer state: the same fp32 math (measured 1.7e-7).
    (["--parallel.offload=true"], 5e-6),
    # Every single-device switch composes in the fixed order AC -> compile -> FSDP (measured 1.9e-7).
    (["--activations.checkpointing=full", "--compile.scope=blocks"], 1e-4),
], ids=["mixed-precision", "offload", "ac-compile"])
def test_fsdp_options_compose(extra, rel, reference, data_dir, tmp_path):
    run = tmp_path / "run"
    proc = _launch(["train", *COMMON, "--train.micro_batch_size=4", *extra, f"--data.dir={data_dir}",
                    f"--run.dir={run}", "--parallel.dp_strategy=fsdp"], timeout=360)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    losses, _ = _records(run)
    assert losses == pytest.approx(reference[0], rel=rel)


@pytest.mark.timeout(120)
def test_resuming_with_another_world_size_or_strategy_is_a_clear_error(data_dir, tmp_path):
    run = tmp_path / "run"
    train_lm(load_config(None, COMMON + [f"--data.dir={data_dir}", f"--run.dir={run}", "--train.max_steps=2",
                                         "--train.micro_batch_size=4"]))
    proc = _launch(["train", *COMMON, f"--data.dir={data_dir}", f"--run.dir={run}", "--train.micro_batch_size=4",
                    "--parallel.dp_strategy=ddp", "--checkpoint.resume=auto"])
    assert proc.returncode != 0
    assert "parallel.dp_strategy: none -> ddp" in proc.stderr and "processes: 1 -> 2" in proc.stderr
