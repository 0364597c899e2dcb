"""Streaming from an S3-compatible server started here (moto): `slipstream data prepare`, an
upload, then `slipstream train --data.streaming=true` from s3://: a straight run, a run
SIGKILLed after a checkpoint and resumed (the losses equal the straight run's exactly), and
two data-parallel ranks reading disjoint chunks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.background import Background

SRC = str(Path(__file__).resolve().parents[2] / "src")
URL = "s3://e2e-stream/prepared"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_env(tmp_path_factory, corpus_file):
    """A moto S3 server holding the corpus prepared in chunks of 4096 tokens at URL; yields
    the environment that points the processes at it."""
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_EC2_METADATA_DISABLED": "true"}
    env.pop("SLIPSTREAM_INJECT_FAULT", None)
    out = tmp_path_factory.mktemp("s3data") / "prepared"
    proc = subprocess.run([sys.executable, "-m", "slipstream", "data", "prepare", "--input", str(corpus_file),
                           "--out", str(out), "--val-fraction", "0.1", "--workers", "1", "--chunk-tokens", "4096",
                           "--quiet"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import boto3

    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    client.create_bucket(Bucket="e2e-stream")
    for f in out.iterdir():
        client.upload_file(str(f), "e2e-stream", f"prepared/{f.name}")
    yield env
    server.stop()


def _args(run: Path, cache: Path, steps: int = 12) -> list[str]:
    return ["--model.preset=tiny", f"--data.dir={URL}", "--data.streaming=true", f"--data.cache_dir={cache}",
            "--data.cache_bytes=65536", "--data.readahead=2", f"--run.dir={run}", f"--train.max_steps={steps}",
            "--train.micro_batch_size=4", "--train.seq_len=32", "--train.eval_interval=6", "--train.eval_tokens=1024",
            "--optim.warmup_steps=3", "--logging.log_interval=1", "--logging.progress=false",
            "--logging.tensorboard=false", "--train.deterministic=true", "--metrics.memory_breakdown=false",
            "--checkpoint.interval=4", "--checkpoint.resume=auto", "--checkpoint.async_save=false",
            "--train.threads=1"]


def _train(env, args, launch=None, timeout=180, fault=""):
    env = {**env, "SLIPSTREAM_INJECT_FAULT": fault} if fault else env
    cmd = [sys.executable, "-m", "slipstream", *(launch or []), "train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(run) if "loss" in r}


def _val(run: Path) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in _records(run) if "val_loss" in r}


@pytest.fixture(scope="module")
def jobs(request, s3_env, tmp_path_factory):
    """The straight run and the two data-parallel ranks' run depend on no other: when the first test
    asks, both start (side by side when both tests are selected; tests/e2e/background.py). name ->
    (run dir, cache dir, its Background)."""
    selected = {item.name for item in request.session.items if item.path == Path(__file__)}
    wanted = {"straight": bool(selected - {"test_two_data_parallel_ranks_stream_disjoint_chunks"}),
              "dp2": "test_two_data_parallel_ranks_stream_disjoint_chunks" in selected}
    started = {}
    for name in (n for n, want in wanted.items() if want):
        root = tmp_path_factory.mktemp(name)
        run, cache = root / "run", root / "cache"
        if name == "straight":
            cmd, timeout = [sys.executable, "-m", "slipstream", "train", *_args(run, cache)], 180
        else:
            args = _args(run, cache, steps=6) + ["--parallel.dp_strategy=ddp", "--data.cache_bytes=1048576"]
            cmd, timeout = [sys.executable, "-m", "slipstream", "launch", "local", "--nproc", "2", "--", "train",
                            *args], 220
        started[name] = (run, cache, Background(cmd, env=s3_env, timeout=timeout))
    return started


@pytest.fixture(scope="module")
def straight(jobs) -> Path:
    run, _, job = jobs["straight"]
    proc = job.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.mark.timeout(120)
def test_streams_from_s3_and_evaluates(straight):
    losses = _losses(straight)
    assert sorted(losses) == list(range(1, 13)) and all(0 < v < 10 for v in losses.values())
    assert sorted(_val(straight)) == [6, 12]
    config = (straight / "config.toml").read_text()
    assert URL in config and "streaming = true" in config


@pytest.mark.timeout(180)
def test_a_killed_streaming_run_resumes_exactly(s3_env, straight, tmp_path):
    run, cache = tmp_path / "run", tmp_path / "cache"
    env = {**s3_env, "SLIPSTREAM_INJECT_FAULT": "stall@10"}  # holds the run at step 10: killed there
    proc = subprocess.Popen([sys.executable, "-m", "slipstream", "train", *_args(run, cache)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "checkpoints" / "step_00000008" / "COMPLETE").exists():
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint at step 8"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    resumed = _train(s3_env, _args(run, cache))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step_00000008" in resumed.stdout
    assert _losses(run) == _losses(straight)
    assert _val(run) == _val(straight)


@pytest.mark.timeout(240)
def test_two_data_parallel_ranks_stream_disjoint_chunks(jobs):
    run, cache, job = jobs["dp2"]
    proc = job.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(_losses(run)) == list(range(1, 7))
    (root,) = [p for p in cache.iterdir() if p.is_dir()]
    # dp rank r is local rank r here: one folder per process
    chunks = [{p.name for p in (root / f"train-rank{r}-local{r}").iterdir() if p.name.endswith(".chunk")} for r in (0, 1)]
    assert chunks[0] and chunks[1] and not chunks[0] & chunks[1]
