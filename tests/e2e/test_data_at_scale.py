"""Issue 16's "done" path end to end: `slipstream data prepare --input docs.parquet`, then
training that streams those shards (data.streaming) at model-parallel layouts.

The ranks of one model-parallel group must read the same batch: a pipeline (pp 2) and a
context-parallel (cp 2) job, each one data-parallel rank, log the losses of one process
streaming the same folder, within the pipeline tests' bound (5e-6 relative).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from slipstream.config.load import load_config
from slipstream.train.lm import train_lm
from tests.e2e.background import Background

SRC = str(Path(__file__).resolve().parents[2] / "src")
COMMON = ["--model.preset=tiny", "--model.n_layer=4", "--model.n_head=4", "--train.seq_len=32",
          "--train.max_steps=4", "--train.micro_batch_size=4", "--train.deterministic=true",
          "--train.eval_interval=2", "--train.eval_tokens=256", "--optim.warmup_steps=2",
          "--logging.log_interval=1", "--logging.progress=false", "--logging.tensorboard=false",
          "--metrics.memory_breakdown=false", "--checkpoint.interval=0", "--checkpoint.save_final=false",
          "--data.streaming=true", "--data.readahead=2"]
REL = 5e-6


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": SRC}


@pytest.fixture(scope="module")
def parquet_data(tmp_path_factory) -> Path:
    """Documents in a Parquet file with two row groups, prepared by the CLI in small chunks."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("parquet")
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "value", "import", "class", "for", "in", "if", "else", "(", ")", ":"]
    docs = [" ".join(rng.choice(words, size=int(rng.integers(20, 120)))) for _ in range(400)]
    pq.write_table(pa.table({"id": list(range(len(docs))), "body": docs}), root / "docs.parquet", row_group_size=200)
    out = root / "prepared"
    proc = subprocess.run([sys.executable, "-m", "slipstream", "data", "prepare", "--input", str(root / "docs.parquet"),
                           "--text-field", "body", "--out", str(out), "--chunk-tokens", "4096", "--val-fraction", "0.1",
                           "--workers", "2", "--quiet"], capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["documents"] == len(docs) and manifest["chunk_tokens"] == 4096
    assert sum(len(s["chunk_sha256"]) for s in manifest["splits"]["train"]["shards"]) >= 4  # several chunks to stream
    return out


def _losses(run: Path, key: str = "loss") -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in records if r.get(key) is not None}


@pytest.fixture(scope="module")
def single(parquet_data, tmp_path_factory) -> Path:
    """One process streaming the prepared Parquet data (in this process, one thread like a rank)."""
    run = tmp_path_factory.mktemp("single") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_lm(load_config(None, [*COMMON, f"--data.dir={parquet_data}", f"--run.dir={run}",
                                    f"--data.cache_dir={run.parent / 'cache'}"]))
    finally:
        torch.set_num_threads(threads)
    assert len(_losses(run)) == 4 and len(_losses(run, "val_loss")) == 2
    return run


LAYOUTS = {"pp2": ["--parallel.pp=2", "--parallel.pp_schedule=1f1b"],
           "cp2": ["--parallel.cp=2", "--parallel.dp_strategy=fsdp"]}


@pytest.fixture(scope="module")
def launched(parquet_data, tmp_path_factory, request) -> dict[str, tuple[Path, Background]]:
    """The selected layouts' jobs, started side by side (tests/e2e/background.py); the single-process
    reference trains in this process meanwhile (requested after this fixture)."""
    selected = [item.callspec.id for item in request.session.items if item.path == Path(__file__)
                and item.originalname == "test_model_parallel_ranks_stream_the_same_batch"]
    jobs = {}
    for name in selected:
        root = tmp_path_factory.mktemp(f"launch-{name}")
        cmd = [sys.executable, "-m", "slipstream", "launch", "local", "--nproc", "2", "--", "train", *COMMON,
               f"--data.dir={parquet_data}", f"--run.dir={root / 'run'}", f"--data.cache_dir={root / 'cache'}",
               *LAYOUTS[name]]
        jobs[name] = (root, Background(cmd, env=_env(), timeout=300))
    return jobs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_model_parallel_ranks_stream_the_same_batch(launched, single, layout):
    root, job = launched[layout]
    proc, run = job.result(), root / "run"
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for key in ("loss", "val_loss"):
        got, want = _losses(run, key), _losses(single, key)
        assert got.keys() == want.keys(), key
        for step, value in got.items():
            assert value == pytest.approx(want[step], rel=REL), f"{key} at step {step}"
    # Each process streamed into a cache folder of its own (two ranks of one group never evict each other's chunks).
    assert len([p for p in (root / "cache").rglob("*") if p.is_dir()]) >= 2
