"""Profiling: chrome traces with the slipstream/* label contract, unchanged math, memory timeline."""

import json
from pathlib import Path

import pytest
import torch

from slipstream.config import load_config
from slipstream.config.schema import ProfileConfig
from slipstream.errors import UserError
from slipstream.observe.profiling import StepProfiler
from slipstream.perf.profiling import profile_run
from slipstream.train.lm import train_lm

# Shorter than tiny_overrides' 12 steps: steps 1-2 are wait + warm-up, 3-5 are profiled
# (with the default profile.start_step and steps), and step 4 evaluates.
SHORT = ["--train.max_steps=6", "--train.eval_interval=4", "--metrics.memory_breakdown=false",
         "--logging.tensorboard=false", "--checkpoint.save_final=false"]


def _losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]


def _events(trace_file):
    return json.loads(trace_file.read_text(encoding="utf-8"))["traceEvents"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir):
    """One unprofiled and one profiled run of the same short job (shared: each takes seconds)."""
    out = {}
    for name, extra in (("plain", []), ("profiled", ["--profile.enabled=true", "--profile.memory_timeline=true"])):
        base = tmp_path_factory.mktemp(name)
        overrides = [
            "--model.preset=tiny", f"--data.dir={data_dir}", f"--run.dir={base / 'run'}",
            "--train.micro_batch_size=4", "--train.seq_len=32", "--train.eval_steps=2", "--optim.warmup_steps=3",
            "--logging.log_interval=1", "--logging.progress=false", "--train.deterministic=true", *SHORT, *extra,
        ]
        out[name] = train_lm(load_config(None, overrides))
    return out


def test_profiled_run_writes_a_chrome_trace_with_the_label_contract(runs):
    summary = runs["profiled"]
    assert len(summary["trace_files"]) == 1
    trace_file = Path(summary["trace_files"][0])
    assert trace_file == Path(summary["run_dir"]) / "traces" / "rank0.json"
    ranges = [e["name"] for e in _events(trace_file) if e.get("cat") == "user_annotation"]
    assert ranges.count("slipstream/data") == 3  # one micro-batch in each of the 3 profiled steps
    for label in ("forward", "backward", "optimizer"):
        assert ranges.count(f"slipstream/{label}") == 3
    assert ranges.count("slipstream/eval") == 1  # step 4
    assert any(n.startswith("ProfilerStep#") for n in ranges)


def test_trace_holds_exactly_the_profiled_steps(runs):
    events = _events(Path(runs["profiled"]["trace_files"][0]))
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert len(steps) == ProfileConfig().steps
    # Each profiled step is one range on the CPU timeline (no duplicates from the warm-up).
    cpu_ranges = [e for e in events if e.get("name", "").startswith("ProfilerStep#") and e.get("ph") == "X"
                  and e.get("cat") == "user_annotation"]
    assert len(cpu_ranges) == ProfileConfig().steps


def test_profiling_does_not_change_the_losses(runs):
    plain, profiled = _losses(Path(runs["plain"]["run_dir"])), _losses(Path(runs["profiled"]["run_dir"]))
    assert len(plain) == 6
    assert plain == profiled  # exact: the profiler only observes
    assert "trace_files" not in runs["plain"]


def test_memory_timeline_is_written_when_enabled(runs):
    timeline = Path(runs["profiled"]["run_dir"]) / "memory_timeline_rank0.json"
    times, sizes = json.loads(timeline.read_text(encoding="utf-8"))
    assert len(times) > 0 and len(sizes) > 0


def test_nvtx_needs_cuda(tmp_path):
    with pytest.raises(UserError, match="profile.nvtx"):
        StepProfiler(ProfileConfig(enabled=True, nvtx=True), torch.device("cpu"), tmp_path)


def test_profile_run_returns_a_top_ops_table(tiny_overrides, capsys):
    cfg = load_config(None, tiny_overrides + ["--profile.start_step=2", "--logging.tensorboard=false"])
    result = profile_run(cfg, steps=2)
    assert result["summary"]["steps"] == 4  # start_step + steps: one unprofiled step after the window
    assert "Self CPU" in result["top_ops"] and "aten::" in result["top_ops"]
    events = _events(Path(result["trace_files"][0]))
    assert len({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}) == 2
    out = capsys.readouterr().out
    assert result["trace_files"][0] in out and "aten::" in out


def test_step_profiler_window_and_partial_trace(tmp_path):
    """Labels only inside the window; a run ending inside it still gets the steps so far."""
    cfg = ProfileConfig(enabled=True, start_step=2, steps=3, profile_memory=False)
    profiler = StepProfiler(cfg, torch.device("cpu"), tmp_path, rank=1)
    assert not profiler.labels_active
    x = torch.randn(8, 8)
    with profiler:
        for step in range(3):  # wait 0, warm-up 1, then 2 of the 3 profiled steps
            assert profiler.labels_active
            with profiler.label("forward"):
                x = x @ x.T / 8
            if step < 2:  # as the trainer: the last step is ended by stop()
                profiler.step()
    assert not profiler.labels_active
    assert profiler.trace_files == [tmp_path / "traces" / "rank1.json"]
    steps = {e["name"] for e in _events(profiler.trace_files[0]) if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#1", "ProfilerStep#2"}
    assert "aten::mm" in profiler.top_ops_table(5)


def test_step_profiler_closes_after_its_window(tmp_path):
    profiler = StepProfiler(ProfileConfig(enabled=True, start_step=2, steps=1), torch.device("cpu"), tmp_path)
    with profiler:
        profiler.step()  # warm-up
        assert profiler.labels_active
        profiler.step()  # the profiled step: trace written, profiler released
        assert not profiler.labels_active and profiler.trace_files
        profiler.step()  # later steps are no-ops
