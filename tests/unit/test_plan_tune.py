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
from slipstream.cli.tune import add_tune_arguments, cmd_tune_system
from slipstream.plan.timing import DEFAULT_EFFICIENCY
from slipstream.tune.system import (MIN_TRIAL_S, failure_reason, format_report, gpu_short_name, matches, read_trial,
                                  subprocess_trials, trainer_refusal, tune_system, write_winner_config)

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


# --- tensor / context parallel layouts (issue 13): what is proposed at --nproc 2 and 4 -----------------

def _ok(layout, timeout_s):
    return {"tokens_per_s": 1000.0, "peak_bytes": 1000}


def _degrees(record) -> tuple[int, int]:
    o = record["overrides"]
    return o["parallel.tp"], o["parallel.cp"]


def _every_layout(nproc: int, overrides: list[str]) -> list[dict]:
    """Every layout the tuner would trial for this config (a top K larger than the space)."""
    result = tune_system(CONFIG, overrides, budget_s=MIN_TRIAL_S * 400, top=300, nproc=nproc, steps=10, run_trial=_ok)
    return result["candidates"][1:]


@pytest.mark.parametrize("nproc, requested, expected", [
    (2, ["tp2", "cp2"], [(2, 1), (1, 2)]),
    (4, ["tp2", "cp2", "cp4", "cp2 tp2"], [(2, 1), (1, 2), (1, 4), (2, 2)]),
])
def test_requested_tp_and_cp_layouts_are_trialled_with_train_overrides(nproc, requested, expected):
    fake = FakeTrials()
    result = tune_system(CONFIG, OVERRIDES, budget_s=600, top=1, nproc=nproc, steps=10, run_trial=fake,
                         layouts=requested)
    current, *picked, best = result["candidates"]
    assert current["label"] == "current" and current["layout"] == f"ddp:{nproc} mb4x1"
    assert [r["requested"] for r in picked] == requested and best["requested"] is None
    assert [_degrees(r) for r in picked] == expected
    assert result["global_batch"] == 4 * nproc  # micro-batch 4 on each of the nproc data-parallel ranks
    for r in picked:
        o, (tp, cp) = r["overrides"], _degrees(r)
        dp = nproc // (tp * cp)
        # the same global batch: tp and cp ranks share one batch, only the dp ranks read different ones
        assert o["train.micro_batch_size"] * o["train.grad_accum_steps"] * dp == result["global_batch"]
        assert o["parallel.sequence_parallel"] is True and o["parallel.loss_parallel"] is True
        if tp > 1:
            assert o["train.fused_loss"] is False and o["parallel.dp_strategy"] in ("none", "fsdp", "hsdp")
            assert f"tp{tp}+sp" in r["layout"]
        if cp > 1:
            assert o["parallel.dp_strategy"] in (("fsdp", "hsdp") if tp > 1 else ("ddp", "fsdp", "hsdp"))
            assert f"cp{cp}" in r["layout"]
        if dp == 1 and cp == 1:
            assert o["parallel.dp_strategy"] == "none"  # tp2 on 2 ranks: one tensor-parallel group, no dp
        assert r["rank"] >= 1 and r["predicted"]["tokens_per_s"] > 0 and r["predicted"]["peak_bytes"] > 0
        # exactly what `slipstream train` loads and its layout checks accept on nproc processes
        assert trainer_refusal(CONFIG, OVERRIDES, o, nproc, 257) == ""
        cfg = load_config(CONFIG, [*OVERRIDES, *(f"--{k}={str(v).lower() if isinstance(v, bool) else v}"
                                                 for k, v in o.items())])
        assert (cfg.parallel.tp, cfg.parallel.cp) == (tp, cp)
    # the fake saw these overrides, in this order (current first: no overrides)
    assert [layout for layout, _ in fake.calls] == [r["overrides"] for r in result["candidates"]]


def test_every_layout_offered_at_nproc_4_is_one_the_trainer_runs():
    """tiny has 2 heads: no tp4. seq 36: tp2 splits it, cp2 cuts it into 4 chunks, but cp4 (8
    chunks) does not divide it, nor cp2 x tp2 with sequence parallel (4 chunks split over 2);
    cp2 x tp2 without sequence parallel leaves each chunk whole on its tp ranks: offered."""
    offered = _every_layout(4, ["--model.vocab_size=257", "--train.seq_len=36", "--train.device=cpu"])
    degrees = {_degrees(r) for r in offered}
    assert degrees == {(1, 1), (2, 1), (1, 2), (2, 2)}
    assert all(r["overrides"].get("parallel.sequence_parallel") is False for r in offered if _degrees(r) == (2, 2))
    for r in offered:
        assert trainer_refusal(CONFIG, ["--model.vocab_size=257", "--train.seq_len=36", "--train.device=cpu"],
                               r["overrides"], 4, 257) == ""
    # at seq 32 they all fit
    assert {_degrees(r) for r in _every_layout(4, OVERRIDES)} == {(1, 1), (2, 1), (1, 2), (1, 4), (2, 2)}


@pytest.mark.parametrize("overrides, requested, message", [
    ([], "tp4", "names no runnable layout"),                         # 2 heads
    (["--train.seq_len=36"], "cp4", "names no runnable layout"),       # 36 % (2 x 4)
    (["--train.seq_len=36"], "cp2 tp2+sp", "names no runnable layout"),   # 36 % (2 x 2 x 2)
    (["--compile.scope=blocks"], "tp2 ac:full", "activations.checkpointing = full with compile.scope"),
])
def test_a_layout_the_trainer_cannot_run_is_refused_before_any_trial(overrides, requested, message):
    with pytest.raises(UserError, match=message):
        tune_system(CONFIG, [*OVERRIDES, *overrides], budget_s=600, top=1, nproc=4, steps=10, run_trial=FakeTrials(),
                    layouts=[requested])


def test_layouts_the_trainer_refuses_with_this_config_are_skipped():
    """compile + full activation checkpointing under tp is refused by the trainer: never proposed."""
    overrides = [*OVERRIDES, "--compile.scope=blocks"]
    offered = _every_layout(2, overrides)
    assert any(_degrees(r) == (2, 1) for r in offered)
    assert not any(_degrees(r)[0] > 1 and r["overrides"]["activations.checkpointing"] == "full" for r in offered)
    assert any(r["overrides"]["activations.checkpointing"] == "full" for r in offered)  # tp1 may
    result = tune_system(CONFIG, overrides, budget_s=MIN_TRIAL_S * 400, top=300, nproc=2, steps=10, run_trial=_ok)
    assert any("refuses with this config" in n and "compile.scope" in n for n in result["notes"])
    # dropout under compile: no tp and no cp layout at all
    offered = _every_layout(2, [*overrides, "--model.dropout=0.1"])
    assert {_degrees(r) for r in offered} == {(1, 1)}


def test_exact_label_and_words():
    assert matches("tp2", "none tp2+sp mb8x1") and matches("none tp2+sp mb8x1", "none tp2+sp mb8x1")
    assert matches("fsdp cp2", "fsdp:2 cp2 mb8x1 ac:full") and matches("cp2 ac:full", "fsdp cp2 mb8x1 ac:full")
    assert not matches("tp2", "fsdp tp2+sp cp2 mb16x1")      # tp2 means cp1
    assert matches("cp2 tp2", "fsdp tp2+sp cp2 mb16x1") and matches("tp1 ddp", "ddp:2 mb4x1")
    assert not matches("ac:full", "none tp2+sp mb8x1 ac:full")  # no tp word: tp1
    assert not matches("tp2 ac:full", "none tp2+sp mb8x1 ac:selective") and not matches("", "ddp:2 mb4x1")
    # an exact label wins over a faster layout that has the same words
    result = tune_system(CONFIG, OVERRIDES, budget_s=600, top=1, nproc=2, steps=10, run_trial=_ok,
                         layouts=["tp2", "none tp2+sp mb4x2"])
    assert [r["layout"] for r in result["candidates"][1:3]] == ["none tp2+sp mb8x1", "none tp2+sp mb4x2"]


def test_requested_layouts_survive_a_short_budget_and_top_0_runs_only_them():
    result = tune_system(CONFIG, OVERRIDES, budget_s=2 * MIN_TRIAL_S, top=3, nproc=2, steps=10, run_trial=_ok,
                         layouts=["tp2"])
    assert [r["requested"] for r in result["candidates"]] == [None, "tp2"] and "allows 2 of 5" in result["notes"][0]
    result = tune_system(CONFIG, OVERRIDES, budget_s=600, top=0, nproc=2, steps=10, run_trial=_ok, layouts=["cp2"])
    assert [r["label"] for r in result["candidates"]][0] == "current" and len(result["candidates"]) == 2
    assert "plan #" in format_report(result)


def test_cli_layouts_split_on_commas_and_the_winner_runs_under_launch(tmp_path, capsys, monkeypatch):
    import slipstream.tune.system as tune

    seen = {}

    def fake_tune(config_path, overrides, budget_s, **kwargs):
        seen.update(kwargs)
        faster = lambda layout, t: {"tokens_per_s": 5000.0 if layout else 1000.0, "peak_bytes": 1000}  # noqa: E731
        return tune_system(config_path, overrides, budget_s, **{**kwargs, "run_trial": faster})

    monkeypatch.setattr(tune, "tune_system", fake_tune)
    out = tmp_path / "best.toml"
    args, extra = add_tune_arguments(argparse.ArgumentParser()).parse_known_args(
        ["--config", CONFIG, "--nproc", "2", "--top", "0", "--layouts", "tp2,cp2", "none tp2+sp mb4x2",
         "--write-config", str(out), *OVERRIDES])
    assert cmd_tune_system(args, extra) == 0
    assert seen["layouts"] == ["tp2", "cp2", "none tp2+sp mb4x2"] and seen["nproc"] == 2 and seen["top"] == 0
    assert "slipstream launch local --nproc 2 -- train --config" in capsys.readouterr().out
    cfg = load_config(out)
    assert cfg.parallel.tp == 2 and cfg.parallel.cp == 1  # the first of the equally fast: tp2 mb8x1


def test_read_trial_counts_the_job_not_one_rank(tmp_path):
    """Under tp / cp the ranks of a group share one batch: the job's tokens/s (each batch once)
    is what the planner predicts, not the per-device share."""
    lines = [{"step": s, "tokens_per_s": 900.0, "tokens_per_s_per_device": 450.0} for s in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    (tmp_path / "summary.json").write_text(json.dumps({"ranks": [{"step_peak_bytes": 5}, {"step_peak_bytes": 6}]}))
    assert read_trial(tmp_path) == {"tokens_per_s": 900.0, "peak_bytes": 6}
