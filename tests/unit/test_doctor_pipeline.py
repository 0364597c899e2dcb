"""slipstream doctor sees the pipeline: the pipeline_bubble finding.

One real pipeline (pp 2, 1F1B, 2 micro-batches: a planned bubble of 1/3) on the tiny model,
launched once with the profiler on; the doctor reads its two traces. Hand-made traces with
known numbers check the measurement itself (CPU: gloo's send/recv ranges; CUDA: NCCL's
SendRecv kernels) and that a trace without a pipeline never gets the finding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.config.load import load_config
from slipstream.perf.doctor import PIPELINE_BUBBLE_MIN, RunContext, diagnose, suggested_overrides
from slipstream.perf.trace import analyze, load_trace

SRC = str(Path(__file__).resolve().parents[2] / "src")
JOB = ["--model.preset=tiny", "--model.n_layer=4", "--train.seq_len=32", "--train.micro_batch_size=8",
       "--train.max_steps=5", "--parallel.pp=2", "--parallel.pp_schedule=1f1b", "--parallel.pp_microbatches=2",
       "--profile.enabled=true", "--profile.start_step=3", "--profile.steps=2", "--logging.log_interval=1",
       "--logging.progress=false", "--logging.tensorboard=false", "--metrics.memory_breakdown=false",
       "--train.eval_steps=1", "--checkpoint.save_final=false"]


def _slipstream(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": SRC}
    proc = subprocess.run([sys.executable, "-m", "slipstream", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, f"slipstream {' '.join(args)}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory, data_dir) -> dict:
    """The pp2 run's directory, its job overrides and `slipstream doctor --json` on its traces."""
    run = tmp_path_factory.mktemp("pp2") / "run"
    job = JOB + [f"--data.dir={data_dir}", f"--run.dir={run}"]
    _slipstream("launch", "local", "--nproc", "2", "--", "train", *job)
    traces = [str(run / "traces" / f"rank{r}.json") for r in (0, 1)]
    doctor = json.loads(_slipstream("doctor", "--trace", *traces, "--json").stdout)
    return {"run": run, "job": job, "doctor": doctor}


def test_a_real_pipeline_gets_the_bubble_finding_with_each_ranks_share(pipelined):
    doctor = pipelined["doctor"]
    finding = next((f for f in doctor["findings"] if f["rule"] == "pipeline_bubble"), None)
    assert finding is not None, [f["rule"] for f in doctor["findings"]]
    numbers = finding["numbers"]
    # JSON keys are strings: one entry per rank, each a share strictly inside (0, 1)
    assert set(numbers["share"]) == set(numbers["pp_bubble"]) == {"0", "1"}
    for rank in ("0", "1"):
        assert 0 < numbers["share"][rank] < 1 and 0 < numbers["pp_bubble"][rank] < 1
        # the wait lies inside the pipeline range, which lies inside the step
        assert 0 < numbers["pp_wait_us"][rank] < numbers["pipeline_us"][rank] < numbers["step_us"][rank]
        assert numbers["share"][rank] < numbers["pp_bubble"][rank]
    assert finding["severity"] == max(numbers["share"].values()) >= PIPELINE_BUBBLE_MIN
    assert finding["rank"] == int(max(numbers["share"], key=numbers["share"].get))
    # the planned bubble is the run's own (metrics.jsonl), reported next to the measured shares
    records = [json.loads(line) for line in (pipelined["run"] / "metrics.jsonl").read_text().splitlines()]
    planned = [r["pp_bubble_planned"] for r in records if "pp_bubble_planned" in r]
    assert planned and numbers["planned"] == pytest.approx(planned[-1]) == pytest.approx(1 / 3)
    assert "planned bubble 33%" in finding["evidence"] and "rank 0" in finding["evidence"]
    assert "rank 1" in finding["evidence"]
    # the trace summaries carry the same measurement
    for trace in doctor["traces"]:
        assert trace["shares"]["pp_wait"] == pytest.approx(numbers["share"][str(trace["rank"])])


def test_the_bubble_overrides_are_valid_config(pipelined):
    doctor = pipelined["doctor"]
    (finding,) = [f for f in doctor["findings"] if f["rule"] == "pipeline_bubble"]
    # 2 -> 4 micro-batches (4 divides the 8 sequences of a step) and a zero-bubble schedule
    assert finding["overrides"] == ["--parallel.pp_microbatches=4", "--parallel.pp_schedule=zbv"]
    assert set(finding["overrides"]) <= set(doctor["suggested_overrides"])
    cfg = load_config(None, pipelined["job"] + finding["overrides"])
    assert (cfg.parallel.pp_microbatches, cfg.parallel.pp_schedule) == (4, "zbv")


def test_the_wait_is_not_reported_again_as_idle_or_communication(pipelined):
    doctor = pipelined["doctor"]
    for trace in doctor["traces"]:
        # the idle rule counts idle time outside the pipeline's wait (a CPU trace has no copies)
        wait_idle = trace["pp_wait_us"] - trace["pp_wait_comm_us"]
        assert wait_idle > 0 and trace["long_idle_us"] <= trace["idle_us"] - wait_idle + 1


# ---------------------------------------------------------------------------- hand-made traces


def _x(name, cat, ts, dur, tid=1, pid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid, "tid": tid}


def _write(path: Path, events: list[dict]) -> Path:
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def _cpu_step(pipeline: bool) -> list[dict]:
    """One 900 µs step: data 0-100, forward 100-300, a recv waited on 300-700 (compute 400-450
    inside it), a send 700-750, backward 750-900; with `pipeline` 100-900 is slipstream/pipeline."""
    events = [
        _x("ProfilerStep#3", "user_annotation", 0, 900),
        _x("slipstream/data", "user_annotation", 0, 100),
        _x("aten::linear", "cpu_op", 100, 200),
        _x("c10d::recv_", "cpu_op", 300, 10),
        _x("gloo:recv", "user_annotation", 305, 395),
        _x("aten::add", "cpu_op", 400, 50),
        _x("c10d::send", "cpu_op", 700, 5),
        _x("gloo:send", "user_annotation", 702, 48),
        _x("autograd::engine::evaluate_function: AddmmBackward0", "cpu_op", 750, 150),
    ]
    if pipeline:
        events.append(_x("slipstream/pipeline", "user_annotation", 100, 800))
    return events


def test_cpu_trace_measures_the_transfer_wait_inside_the_pipeline(tmp_path):
    a = analyze(load_trace(_write(tmp_path / "rank0.json", _cpu_step(pipeline=True))))
    # in a transfer (300-310 post, 305-700 recv, 700-750 send) with no compute: 300-400, 450-700, 700-750
    assert (a.pipeline_us, a.pp_wait_us, a.pp_transfers_per_step) == (800, 400, 2)
    assert a.pp_wait_comm_us == 15  # the posting ops 300-310 and 700-705 count as exposed communication
    assert a.share(a.pp_wait_us) == pytest.approx(4 / 9) and a.pp_bubble == pytest.approx(0.5)
    assert a.long_idle_us == 0  # 0-100 is the data wait, the rest of the idle time is the pipeline's wait
    assert [(g.offset_us, g.dur_us) for g in a.gaps] == [(0, 100)]

    report = diagnose([a], run=RunContext(pp_bubble_planned=0.25))
    f = report.finding("pipeline_bubble")
    assert f is not None and f.severity == pytest.approx(4 / 9) and f.numbers["planned"] == 0.25
    assert "planned bubble 25%" in f.evidence and f.overrides == []  # no config known: no overrides
    assert report.finding("idle") is None and report.finding("comm_exposed") is None


def test_no_pipeline_range_no_finding_even_with_send_and_recv(tmp_path):
    a = analyze(load_trace(_write(tmp_path / "rank0.json", _cpu_step(pipeline=False))))
    assert a.pipeline_us is None and a.pp_wait_us is None and a.pp_bubble is None
    assert diagnose([a]).finding("pipeline_bubble") is None
    assert a.long_idle_us > 0  # without a pipeline the wait is plain idle time


def test_a_small_bubble_does_not_fire(tmp_path):
    events = [_x("ProfilerStep#0", "user_annotation", 0, 1000), _x("slipstream/pipeline", "user_annotation", 0, 1000),
              _x("aten::mm", "cpu_op", 0, 900), _x("gloo:recv", "user_annotation", 900, 100)]
    a = analyze(load_trace(_write(tmp_path / "rank1.json", events)))
    assert a.share(a.pp_wait_us) == pytest.approx(0.1) and 0.1 < PIPELINE_BUBBLE_MIN
    assert diagnose([a]).finding("pipeline_bubble") is None


def test_cuda_trace_measures_sendrecv_kernels_in_the_device_copy_of_the_range(tmp_path):
    events = [
        _x("ProfilerStep#1", "user_annotation", 0, 2000),
        _x("slipstream/pipeline", "user_annotation", 0, 1000),  # host: launches only
        _x("slipstream/pipeline", "gpu_user_annotation", 200, 1600, pid=0, tid=7),  # device copy
        _x("ampere_sgemm_128x64", "kernel", 200, 600, pid=0, tid=7),
        _x("ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)", "kernel", 700, 700, pid=0, tid=20),
        _x("ampere_sgemm_128x64", "kernel", 1400, 400, pid=0, tid=7),
        _x("ncclDevKernel_AllReduce_Sum_f32", "kernel", 1850, 100, pid=0, tid=20),  # dp: not the pipeline's
    ]
    a = analyze(load_trace(_write(tmp_path / "rank0.json", events)))
    assert a.device == "cuda"
    # SendRecv 700-1400 minus the gemm until 800: 600 µs of the 1600 µs device range
    assert (a.pipeline_us, a.pp_wait_us, a.pp_transfers_per_step) == (1600, 600, 1)
    assert a.share(a.pp_wait_us) == pytest.approx(0.3)
    assert a.comm_exposed_us == 700 and a.pp_wait_comm_us == 600  # comm_exposed keeps only the all-reduce


def test_overrides_double_the_micro_batches_or_the_accumulation_and_stay_valid():
    from slipstream.perf.doctor import _pipeline_overrides

    base = ["--model.preset=tiny", "--model.n_layer=4", "--train.seq_len=32", "--parallel.pp=2"]
    cases = [
        # (job, expected overrides)
        (["--train.micro_batch_size=8", "--parallel.pp_microbatches=2"],
         ["--parallel.pp_microbatches=4", "--parallel.pp_schedule=zbv"]),
        # 12 sequences, 4 micro-batches: 8 does not divide 12, the next count that does is 12
        (["--train.micro_batch_size=12", "--parallel.pp_microbatches=4"],
         ["--parallel.pp_microbatches=12", "--parallel.pp_schedule=zbv"]),
        # one sequence per micro-batch already: more sequences per step
        (["--train.micro_batch_size=4"], ["--train.grad_accum_steps=2", "--parallel.pp_schedule=zbv"]),
        (["--train.micro_batch_size=4", "--parallel.pp_microbatches=4", "--train.grad_accum_steps=1"],
         ["--train.grad_accum_steps=2", "--parallel.pp_microbatches=8", "--parallel.pp_schedule=zbv"]),
        # 2 blocks for 2 ranks: no room for 2 stages per rank, only more micro-batches
        (["--model.n_layer=2", "--train.micro_batch_size=8", "--parallel.pp_microbatches=2"],
         ["--parallel.pp_microbatches=4"]),
        # already zero-bubble: no schedule switch
        (["--parallel.pp_schedule=zbv", "--train.micro_batch_size=8", "--parallel.pp_microbatches=2"],
         ["--parallel.pp_microbatches=4"]),
    ]
    for job, want in cases:
        cfg = load_config(None, base + job)
        got = _pipeline_overrides(cfg, world=2)
        assert got == want, job
        load_config(None, base + job + got)  # valid config


def test_the_run_dir_beside_the_traces_gives_the_config_and_the_planned_bubble(tmp_path):
    from slipstream.config.load import config_to_toml
    from slipstream.perf.doctor import run_doctor

    run = tmp_path / "run"
    (run / "traces").mkdir(parents=True)
    trace = _write(run / "traces" / "rank0.json", _cpu_step(pipeline=True))
    job = ["--model.preset=tiny", "--model.n_layer=4", "--train.seq_len=32", "--parallel.pp=2",
           "--train.micro_batch_size=8", "--parallel.pp_microbatches=2"]
    (run / "config.toml").write_text(config_to_toml(load_config(None, job)))
    (run / "metrics.jsonl").write_text('{"step": 1, "pp_bubble": 0.5, "pp_bubble_planned": 0.3333}\n{"step": 1, "val'
                                       '\n{"step": 2, "pp_bubble": 0.4, "pp_bubble_planned": 0.3}\n')
    (run / "summary.json").write_text(json.dumps({"world_size": 2}))
    out = run_doctor([str(trace)])
    (f,) = [f for f in out["findings"] if f["rule"] == "pipeline_bubble"]
    assert f["numbers"]["planned"] == 0.3  # the last record's, a cut-off line skipped
    assert f["overrides"] == ["--parallel.pp_microbatches=4", "--parallel.pp_schedule=zbv"]
    assert suggested_overrides(diagnose([analyze(load_trace(trace))])) == ["--data.num_workers=2", "--data.prefetch=2"]
