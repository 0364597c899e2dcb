"""`slipstream tune system` without subprocesses: a fake run_trial stands in for the trials."""

from __future__ import annotations

import argparse
import json
import statistics
import tomllib
from pathlib import Path

import pytest

from slipstream.config.load import load_config
from slipstream.errors import UserError
from slipstream.cli.plan import add_tune_arguments, cmd_tune_system
from slipstream.plan.timing import DEFAULT_EFFICIENCY
from slipstream.plan.tune import (MIN_TRIAL_S, failure_reason, format_report, gpu_short_name, read_trial,
                                  subprocess_trials, tune_system, write_winner_config)

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "tiny.toml")
# A fixed vocabulary (no data needed) and the CPU even where CUDA exists: the plan is the same everywhere.
OVERRIDES = ["--model.vocab_size=257", "--train.seq_len=32", "--train.device=cpu"]


class FakeTrials:
    """Measured numbers by the planner's rank (whatever layouts it ranks first): the current
    layout (no overrides) runs at 20k tokens/s, the planner's first fails, its second times
    out, its third runs fast."""

    def __init__(self):
        self.calls: list[tuple[dict, float]] = []
        self.layouts: list[dict] = []

    def __call__(self, layout: dict, timeout_s: float) -> dict:
        self.calls.append((layout, timeout_s))
        if not layout:
            return {"tokens_per_s": 20_000.0, "peak_bytes": 3_000_000}
        self.layouts.append(layout)
        rank = len(self.layouts)
        if rank == 1:
            return {"error": "RuntimeError: out of memory"}
        if rank == 2:
            return {"error": f"timed out after {timeout_s:.0f}s", "timed_out": True}
        return {"tokens_per_s": 50_000.0, "peak_bytes": 2_800_000}


@pytest.fixture(scope="module")
def tuned():
    fake = FakeTrials()
    return tune_system(CONFIG, OVERRIDES, budget_s=120, top=3, steps=10, run_trial=fake), fake


def test_winner_is_the_fastest_successful_trial(tuned):
    result, _ = tuned
    labels = [r["label"] for r in result["candidates"]]
    assert labels[0] == "current" and len(labels) == len(set(labels)) == 4
    assert result["winner"]["layout"] == labels[3]
    assert result["winner"]["overrides"] == _fake_layouts(tuned)[2]
    assert result["speedup"] == pytest.approx(50_000 / 20_000)
    assert result["global_batch"] == 4 and result["seq_len"] == 32 and result["precision"] == "fp32"
    json.dumps(result)  # JSON-ready as it is


def _fake_layouts(tuned) -> list[dict]:
    return tuned[1].layouts


def test_failed_trials_keep_their_reason(tuned):
    result, _ = tuned
    failed, timeout, winner = result["candidates"][1:4]
    assert failed["status"] == "failed" and "out of memory" in failed["reason"] and failed["measured"] is None
    assert timeout["status"] == "timeout" and "timed out" in timeout["reason"]
    text = format_report(result)
    assert "out of memory" in text and f"winner: {winner['label']}" in text and "2.50x" in text


def test_efficiency_is_the_median_ratio_and_predictions_are_positive(tuned):
    result, _ = tuned
    ok = [r for r in result["candidates"] if r["status"] == "ok"]
    assert len(ok) == 2
    ratios = [r["measured"]["tokens_per_s"] / r["predicted"]["tokens_per_s"] for r in ok]
    assert result["efficiency"] == pytest.approx(DEFAULT_EFFICIENCY * statistics.median(ratios))
    for r in result["candidates"]:
        assert r["predicted"]["tokens_per_s"] > 0 and r["predicted"]["peak_bytes"] > 0
    for r in ok:
        expected = 100 * (r["measured"]["tokens_per_s"] / r["predicted"]["tokens_per_s"] - 1)
        assert r["error_pct"] == pytest.approx(expected)


def test_budget_is_split_evenly(tuned):
    result, fake = tuned
    assert len(fake.calls) == 4
    assert [timeout for _, timeout in fake.calls] == [30.0] * 4
    assert result["trial_timeout_s"] == 30.0 and not result["notes"]


def test_small_budget_runs_fewer_trials_current_first():
    fake = FakeTrials()
    result = tune_system(CONFIG, OVERRIDES, budget_s=2 * MIN_TRIAL_S + 1, top=3, steps=10, run_trial=fake)
    assert [r["label"] for r in result["candidates"]][0] == "current" and len(result["candidates"]) == 2
    assert "allows 2 of 4 trials" in result["notes"][0]
    assert result["winner"]["label"] == "current"  # the other one failed
    assert "keep it" in format_report(result)


def test_current_layout_is_not_tried_twice():
    fake = FakeTrials()
    top = tune_system(CONFIG, OVERRIDES, budget_s=600, top=1, steps=10, run_trial=FakeTrials())
    best = top["candidates"][1]["overrides"]             # make the planner's favourite the current layout
    current_is_top = [*OVERRIDES, *(f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in best.items())]
    result = tune_system(CONFIG, current_is_top, budget_s=600, top=2, steps=10, run_trial=fake)
    layouts = [r["layout"] for r in result["candidates"]]
    assert layouts[0] == top["candidates"][1]["layout"] and len(layouts) == len(set(layouts)) == 3


def test_a_crashing_trial_does_not_stop_the_tuner():
    def broken(layout, timeout_s):
        raise ValueError("boom")

    result = tune_system(CONFIG, OVERRIDES, budget_s=60, top=1, steps=10, run_trial=broken)
    assert all(r["status"] == "failed" and "boom" in r["reason"] for r in result["candidates"])
    assert result["winner"] is None and result["efficiency"] is None
    assert "no trial succeeded" in format_report(result)


def test_measured_memory_over_the_machine_is_not_a_winner():
    def huge(layout, timeout_s):
        return {"tokens_per_s": 90_000.0 if layout else 10_000.0, "peak_bytes": 2**60 if layout else 1000}

    result = tune_system(CONFIG, OVERRIDES, budget_s=60, top=1, steps=10, run_trial=huge)
    assert result["candidates"][1]["status"] == "too big"
    assert result["winner"]["label"] == "current"


def test_write_config_round_trips(tuned, tmp_path):
    result, _ = tuned
    out = write_winner_config(result, tmp_path / "tuned" / "best.toml")
    data = tomllib.loads(out.read_text())
    assert not Path(data["extends"]).is_absolute()
    cfg = load_config(out)
    won = result["winner"]["overrides"]
    assert (cfg.train.micro_batch_size, cfg.train.grad_accum_steps, cfg.train.fused_loss) == (
        won["train.micro_batch_size"], won["train.grad_accum_steps"], won["train.fused_loss"])
    assert cfg.model.vocab_size == 257 and cfg.train.seq_len == 32  # the user's overrides travel along
    assert cfg.model.preset == "tiny" and cfg.train.max_steps == load_config(CONFIG).train.max_steps
    assert [p.name for p in out.parent.iterdir()] == ["best.toml"]  # no temporary file left behind


def test_read_trial_skips_warm_up_and_memory_steps(tmp_path):
    lines = [{"step": 1, "tokens_per_s": 10.0}, {"step": 2, "tokens_per_s": 20.0, "mem_step_peak_bytes": 5},
             {"step": 3, "tokens_per_s": 100.0}, {"step": 4, "tokens_per_s": 110.0}, {"step": 5, "tokens_per_s": 90.0}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    (tmp_path / "summary.json").write_text(json.dumps({"tokens_per_s": 50.0, "mem_peak_bytes": 9,
                                                       "memory": {"peak_bytes": 5}}))
    assert read_trial(tmp_path) == {"tokens_per_s": 100.0, "peak_bytes": 5}
    (tmp_path / "summary.json").write_text(json.dumps({"ranks": [{"step_peak_bytes": 5}, {"step_peak_bytes": 7}],
                                                       "memory": {"peak_bytes": 5}}))
    assert read_trial(tmp_path)["peak_bytes"] == 7  # the highest rank


@pytest.mark.parametrize("kwargs, message", [
    (dict(config_path=str(ROOT / "configs" / "missing.toml")), "does not exist"),
    (dict(config_path=""), "needs --config"),
    (dict(top=0), "--top"),
    (dict(nproc=0), "--nproc"),
    (dict(steps=3), "--steps"),
    (dict(budget_s=MIN_TRIAL_S - 1), f"at least {MIN_TRIAL_S:g}s"),
    (dict(overrides=["--model.preset=llama-70b", "--model.vocab_size=32000", "--train.seq_len=32",
                     "--train.device=cpu"]), "nothing fits"),
])
def test_bad_input_is_a_user_error(kwargs, message):
    args = dict(config_path=CONFIG, overrides=OVERRIDES, budget_s=120, run_trial=FakeTrials()) | kwargs
    with pytest.raises(UserError, match=message):
        tune_system(**args)


def test_cli_entry_point_rejects_a_bad_budget():
    args = add_tune_arguments(argparse.ArgumentParser()).parse_args(["--config", CONFIG, "--budget", "soon"])
    with pytest.raises(UserError, match="--budget"):
        cmd_tune_system(args, OVERRIDES)


def test_failure_reason_finds_the_cause_under_torchrun():
    torchrun = ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
                "E1202 api.py:1002] failed (exitcode: 1) local_rank: 0\n"
                "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
                "============================================================\nslipstream FAILED\n"
                "  exitcode  : 1 (pid: 4347)\n============================================================\n")
    assert failure_reason(torchrun, 1).startswith("torch.OutOfMemoryError: CUDA out of memory")
    assert failure_reason("note: x\nerror: model.d_model = 7 must be divisible\n", 2).startswith("error: model.d_model")
    assert failure_reason("", 1) == "exit code 1"


def test_subprocess_trial_is_killed_at_its_timeout(tmp_path):
    run_trial = subprocess_trials(CONFIG, OVERRIDES, nproc=1, steps=4, work_dir=tmp_path)
    result = run_trial({}, 0.3)  # not even torch imports that fast
    assert result["timed_out"] and "timed out" in result["error"]


@pytest.mark.parametrize("device_name, short", [
    ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H200", "H200"), ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
    ("Tesla T4", "T4"), ("a100_80gb", "A100"), ("Some Future GPU", None),
])
def test_local_gpu_names_map_to_planner_names(device_name, short):
    assert gpu_short_name(device_name) == short
