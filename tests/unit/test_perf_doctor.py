"""slipstream doctor on real torch.profiler traces with planted problems.

Each trace is recorded here on CPU with the same schedule the trainer uses (1 warm-up,
3 active steps) and the trainer's record_function labels. The test measures what it
planted (sleep time, step time, op counts) with its own clock and checks that the doctor
names the problem and reports matching numbers.
"""

from __future__ import annotations

import gzip
import json
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from slipstream.errors import UserError
from slipstream.perf.doctor import diagnose, run_doctor, suggested_overrides
from slipstream.perf.trace import analyze, load_and_analyze, load_trace

# Our traces hold one profiling cycle; torch warns that a cycle's end clears its events.
pytestmark = pytest.mark.filterwarnings("ignore:.*Profiler clears events")

ACTIVE = 3  # profiled steps; one warm-up step before them is not recorded

# ~7 ms of matmul work per step (one thread): small next to the planted 30 ms sleeps, so
# the planted problem still dominates when other processes slow the matmuls down.
A = torch.randn(512, 512) / 512**0.5


def _matmul_work(n: int = 4) -> None:
    x = A
    for _ in range(n):
        x = torch.tanh(x @ A)


def _record(path: Path, body) -> list[dict[str, float]]:
    """Run body(i, clock) for warm-up + ACTIVE steps under the profiler; export to path.

    Returns the measurements of the active steps: {"step": wall seconds of the body,
    plus whatever the body stored into its clock dict}.
    """
    measured = []
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=ACTIVE),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for i in range(1 + ACTIVE):
            clock: dict[str, float] = {}
            t0 = time.perf_counter()
            body(i, clock)
            clock["step"] = time.perf_counter() - t0
            if i >= 1:
                measured.append(clock)
            prof.step()
    assert path.exists()
    return measured


def _data(clock, sleep_s: float = 0.0):
    t0 = time.perf_counter()
    with record_function("slipstream/data"):
        if sleep_s:
            time.sleep(sleep_s)
        batch = torch.randn(64, 512)
    clock["data"] = clock.get("data", 0.0) + time.perf_counter() - t0
    return batch


def _forward_backward(batch, n: int = 4):
    with record_function("slipstream/forward"):
        _matmul_work(n)
        y = batch.sum()
    with record_function("slipstream/optimizer"):
        A.mul_(1.0)
    return y


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    # One intra-op thread: on a busy 2-core machine a second thread makes every matmul wait
    # for its preempted sibling, and the compute time would swing far more.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield _record_all(tmp_path_factory.mktemp("traces"))
    finally:
        torch.set_num_threads(threads)


def _record_all(d: Path) -> dict:
    out = {}

    def healthy(i, clock):
        _forward_backward(_data(clock))

    def sleepy_loader(i, clock):
        _forward_backward(_data(clock, sleep_s=0.03))

    def syncing(i, clock):
        batch = _data(clock)
        with record_function("slipstream/data"):
            torch.ones(1).item()  # the data pipeline reading a CPU tensor: no device sync
        y = _forward_backward(batch)
        for _ in range(5):
            (y * 2).item()  # a host-device sync point each

    def tiny_ops(i, clock):
        batch = _data(clock)
        t0 = time.perf_counter()
        with record_function("slipstream/forward"):
            x = torch.ones(8)
            for _ in range(500):
                x = x + 1
        clock["loop"] = time.perf_counter() - t0
        del batch

    def slow_rank(i, clock):
        _forward_backward(_data(clock))
        t0 = time.perf_counter()
        time.sleep(0.03)  # outside every label: a rank that is simply slower
        clock["extra"] = time.perf_counter() - t0

    for name, body in [("healthy", healthy), ("sleepy", sleepy_loader), ("sync", syncing), ("tiny", tiny_ops)]:
        path = d / f"{name}.json"
        out[name] = (path, _record(path, body))
    ranks = d / "ranks"
    ranks.mkdir()
    out["rank0"] = (ranks / "rank0.json", _record(ranks / "rank0.json", healthy))
    out["rank1"] = (ranks / "rank1.json", _record(ranks / "rank1.json", slow_rank))
    return out


def _report(path: Path):
    return diagnose([analyze(load_trace(path))])


def test_sleeping_data_loader_is_the_top_finding_with_the_planted_share(traces):
    path, measured = traces["sleepy"]
    report = _report(path)
    top = report.findings[0]
    assert top.rule == "data_wait"
    planted = sum(m["data"] for m in measured) / sum(m["step"] for m in measured)
    assert planted > 0.5  # the sleep dominates, as planted
    assert top.numbers["share"] == pytest.approx(planted, rel=0.25)
    assert f"{100 * top.severity:.0f}%" in top.title
    assert "data.num_workers" in top.fix
    assert "--data.num_workers=2" in top.overrides and "--data.prefetch=2" in top.overrides
    # The step windows match the test's own clock.
    a = report.analyses[0]
    assert len(a.steps) == ACTIVE
    assert a.step_us / 1e6 == pytest.approx(sum(m["step"] for m in measured) / ACTIVE, rel=0.25)
    # The sleep is idle host time, and the gaps are attributed to the data wait.
    assert a.idle_by_host and next(iter(a.idle_by_host)) == "slipstream/data"


def test_forced_sync_each_step_is_counted_and_named(traces):
    report = _report(traces["sync"][0])
    f = report.finding("sync")
    assert f is not None
    assert f.numbers["sync_points_per_step"] == 5  # aten::item wraps _local_scalar_dense: one point each
    assert f.numbers["sync_ops_per_step"]["aten::item"] == 5
    assert f.numbers["sync_ops_per_step"]["aten::_local_scalar_dense"] == 5
    assert "5 host-device sync points per step" in f.title
    assert "aten::item" in f.evidence and "aten::_local_scalar_dense" in f.evidence
    assert ".item()" in f.fix and "logging.log_interval" in f.fix
    assert all(st.sync_points == 5 for st in report.analyses[0].steps)


def test_tiny_op_loop_is_launch_bound_with_the_op_count(traces):
    path, measured = traces["tiny"]
    report = _report(path)
    f = report.finding("launch_bound")
    assert f is not None
    # 500 adds plus the batch's randn and the torch.ones per step.
    assert f.numbers["ops_per_step"] == 502
    assert "502 small ops per step" in f.title
    adds = next(o for o in report.analyses[0].top_ops if o["name"] == "aten::add")
    assert adds["count"] == 500 * ACTIVE
    assert f.numbers["median_op_us"] < 20
    assert f.overrides == ["--compile.scope=blocks"]
    assert "compile.scope=blocks" in f.fix
    # Nearly all adds are tiny (a busy machine may preempt a few, which then are not), and
    # the runs of tiny ops lie inside the loop the test timed.
    assert all(st.tiny_ops >= 490 for st in report.analyses[0].steps)
    loop_us = 1e6 * sum(m["loop"] for m in measured) / len(measured)
    assert 0 < f.numbers["tiny_stretch_us"] <= 1.05 * loop_us
    assert f.severity == pytest.approx(f.numbers["tiny_stretch_us"] / report.analyses[0].step_us)


def test_slow_rank_is_named(traces):
    (p0, _), (p1, m1) = traces["rank0"], traces["rank1"]
    analyses = load_and_analyze([str(p0), str(p1)])
    assert [a.rank for a in analyses] == [0, 1]
    report = diagnose(analyses)
    f = report.finding("imbalance")
    assert f is not None
    assert f.numbers["slow_rank"] == 1 and f.rank == 1
    assert "rank 1" in f.title
    assert f.numbers["step_us"][1] > f.numbers["step_us"][0]
    # The planted sleep is rank 1's idle time outside every label, and only rank 1 has it.
    planted_extra = sum(m["extra"] for m in m1) / len(m1)
    assert analyses[1].long_idle_us / 1e6 == pytest.approx(planted_extra, rel=0.25)
    idle = report.finding("idle")
    assert idle is not None and idle.rank == 1 and idle.ranks == [1]
    # The spread is at least the planted sleep's share of rank 1's step (minus the profiler's noise).
    assert f.severity >= 0.75 * planted_extra / (analyses[1].step_us / 1e6)


def test_healthy_trace_has_no_data_sync_or_launch_findings(traces):
    report = _report(traces["healthy"][0])
    rules = {f.rule for f in report.findings}
    assert not rules & {"data_wait", "sync", "launch_bound", "imbalance", "idle"}
    a = report.analyses[0]
    assert a.sync_points_per_step == 0 and a.data_wait_us is not None
    assert a.top_ops[0]["name"] in ("aten::matmul", "aten::tanh")
    # The split adds up to the step.
    for st in a.steps:
        parts = st.compute_us + st.comm_exposed_us + st.memcpy_us + st.idle_us
        assert parts == pytest.approx(st.step_us, rel=1e-3)


def test_gzipped_trace_loads_like_the_plain_one(traces, tmp_path):
    path = traces["sleepy"][0]
    gz = tmp_path / "rank0.json.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    plain, zipped = analyze(load_trace(path)), analyze(load_trace(gz))
    assert zipped.step_us == plain.step_us and zipped.data_wait_us == plain.data_wait_us


def test_trace_without_slipstream_labels_reports_unknown_data_wait(traces, tmp_path):
    data = json.loads(traces["healthy"][0].read_text())
    data["traceEvents"] = [e for e in data["traceEvents"] if not str(e.get("name", "")).startswith("slipstream/")]
    path = tmp_path / "foreign.json"
    path.write_text(json.dumps(data))
    report = _report(path)
    a = report.analyses[0]
    assert a.data_wait_us is None and any("data wait is unknown" in n for n in a.notes)
    assert report.finding("data_wait") is None
    assert "data wait unknown" in report.to_text()


def test_bad_inputs_are_user_errors(traces, tmp_path):
    not_json = tmp_path / "notes.json"
    not_json.write_text("hello, this is not a trace\n")
    with pytest.raises(UserError, match="not a chrome trace"):
        load_trace(not_json)

    truncated = tmp_path / "truncated.json"
    text = traces["healthy"][0].read_text()
    truncated.write_text(text[: len(text) // 2])
    with pytest.raises(UserError, match="truncated"):
        load_trace(truncated)

    no_events = tmp_path / "other.json"
    no_events.write_text(json.dumps({"name": "something else"}))
    with pytest.raises(UserError, match="without 'traceEvents'"):
        load_trace(no_events)

    no_steps = tmp_path / "nosteps.json"
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _matmul_work(1)
    prof.export_chrome_trace(str(no_steps))
    with pytest.raises(UserError, match="no steps: .*schedule.*slipstream profile"):
        load_trace(no_steps)

    with pytest.raises(UserError, match="does not exist"):
        load_trace(tmp_path / "missing.json")
    fake_gz = tmp_path / "fake.json.gz"
    fake_gz.write_text("{}")
    with pytest.raises(UserError, match="not gzip"):
        load_trace(fake_gz)


def test_report_text_json_and_overrides(traces):
    report = diagnose(load_and_analyze([str(traces["sleepy"][0])]))
    text = report.to_text()
    assert "1. [" in text and "data wait is" in text and "--data.num_workers=2" in text
    d = json.loads(json.dumps(report.to_dict()))
    assert d["findings"][0]["rule"] == "data_wait"
    assert d["suggested_overrides"] == suggested_overrides(report)
    assert suggested_overrides(report)[:2] == ["--data.num_workers=2", "--data.prefetch=2"]


def test_run_doctor_with_trace_files_prints_json(traces, capsys):
    out = run_doctor([str(traces["sync"][0])], as_json=True)
    printed = json.loads(capsys.readouterr().out)
    assert printed["findings"][0]["rule"] == out["findings"][0]["rule"]
    assert any(f["rule"] == "sync" for f in printed["findings"])


def test_run_doctor_profiles_and_applies(traces, monkeypatch, capsys):
    """Without trace files run_doctor profiles the config; --apply profiles again with the fixes."""
    calls = []

    def profile_run(cfg, steps=None):
        calls.append(cfg)
        # The "fixed" run (more workers) no longer waits for data.
        name = "sleepy" if cfg.data.num_workers == 0 else "healthy"
        return {"trace_files": [str(traces[name][0])]}

    fake = types.ModuleType("slipstream.perf.profiling")
    fake.profile_run = profile_run
    monkeypatch.setitem(sys.modules, "slipstream.perf.profiling", fake)

    out = run_doctor(None, overrides=["--train.max_steps=5"], apply=True)
    assert len(calls) == 2
    assert calls[0].train.max_steps == 5 and calls[0].data.num_workers == 0
    assert calls[1].data.num_workers == 2 and calls[1].data.prefetch == 2 and calls[1].train.max_steps == 5
    applied = out["apply"]
    # The config is known: prefetch is already 2 (the default), so only the workers change.
    assert applied["overrides"][0] == "--data.num_workers=2"
    assert "--data.prefetch=2" not in applied["overrides"]
    assert applied["after"]["step_us"] < applied["before"]["step_us"]
    assert applied["after"]["tokens_per_s"] > applied["before"]["tokens_per_s"]
    text = capsys.readouterr().out
    assert "before" in text and "after" in text and "speedup" in text


def test_run_doctor_without_profiling_module_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "slipstream.perf.profiling", None)  # import fails
    with pytest.raises(UserError, match="pass trace files"):
        run_doctor(None)


def _x(name, cat, ts, dur, tid=1, pid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid, "tid": tid}


def test_cuda_trace_split_overlap_gaps_and_syncs(tmp_path):
    """A small hand-made CUDA trace (no GPU here) with known numbers, in microseconds."""
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "host"}},
        _x("ProfilerStep#7", "user_annotation", 0, 1000),
        _x("ProfilerStep#7", "gpu_user_annotation", 300, 700, pid=0, tid=7),  # device mirror: not a step
        _x("slipstream/data", "user_annotation", 0, 300),
        _x("aten::mm", "cpu_op", 300, 50),
        _x("cudaLaunchKernel", "cuda_runtime", 310, 10),
        _x("aten::item", "cpu_op", 400, 5),  # item() of a CPU tensor: no runtime sync inside, not counted
        _x("aten::_local_scalar_dense", "cpu_op", 401, 3),
        _x("aten::item", "cpu_op", 960, 30),
        _x("aten::_local_scalar_dense", "cpu_op", 961, 28),
        _x("cudaStreamSynchronize", "cuda_runtime", 965, 23),
        _x("ampere_sgemm_128x64", "kernel", 320, 380, pid=0, tid=7),  # compute 320-700
        _x("ncclDevKernel_AllReduce_Sum_f32", "kernel", 600, 300, pid=0, tid=20),  # 100 overlapped, 200 exposed
        _x("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", 900, 50, pid=0, tid=7),
    ]
    path = tmp_path / "rank3.json"
    path.write_text(json.dumps({"traceEvents": events}))
    a = analyze(load_trace(path))
    assert a.rank == 3 and a.device == "cuda" and len(a.steps) == 1 and a.steps[0].step == 7
    assert a.step_us == 1000
    assert (a.compute_us, a.comm_us, a.comm_exposed_us, a.comm_overlapped_us) == (380, 300, 200, 100)
    assert (a.memcpy_us, a.idle_us, a.data_wait_us) == (50, 370, 300)
    assert a.long_idle_us == 50  # 0-320 is idle, but 0-300 is the data wait and 300-320 is short
    assert a.sync_points_per_step == 1
    assert a.sync_ops_per_step == {"aten::item": 1, "aten::_local_scalar_dense": 1, "cudaStreamSynchronize": 1}
    first = a.gaps[0]
    assert (first.offset_us, first.dur_us) == (0, 320)
    assert first.host[0] == ("slipstream/data", 300)
    assert a.top_kernels[0]["name"] == "ampere_sgemm_128x64"

    report = diagnose([a])
    assert [f.rule for f in report.findings][:2] == ["data_wait", "comm_exposed"]
    comm = report.finding("comm_exposed")
    assert comm.severity == pytest.approx(0.2) and "come later" in comm.fix
    assert "--data.pin_memory=true" in report.finding("data_wait").overrides
    assert report.finding("sync").numbers["sync_points_per_step"] == 1


def test_review_edge_cases_are_user_errors(traces, tmp_path):
    from slipstream.perf.doctor import run_doctor
    from slipstream.perf.trace import load_and_analyze

    healthy = str(traces["healthy"][0])
    copy = tmp_path / "rank0.json"
    copy.write_text(Path(healthy).read_text())
    with pytest.raises(UserError, match="several traces claim rank 0"):
        load_and_analyze([copy, copy])
    with pytest.raises(UserError, match="is a folder"):
        load_trace(tmp_path)
    no_duration = tmp_path / "nodur.json"
    no_duration.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "ProfilerStep#1", "ts": 0}]}))
    with pytest.raises(UserError, match="no duration"):
        load_trace(no_duration)
    with pytest.raises(UserError, match="without --trace"):
        run_doctor([healthy], apply=True)
