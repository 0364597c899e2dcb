"""`slipstream tune lr` and `slipstream tune batch` end to end through `slipstream.cli.main` on the
tiny model: a real range-test training watched through its metrics.jsonl, real trials confirming
the planned micro-batch, the noise scale measured on the LM job; bad inputs are clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slipstream.cli import main
from slipstream.tune.lr_finder import sweep_lrs

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")


@pytest.fixture
def one_thread(monkeypatch):
    """The trial processes and this one use one thread each: two cores, often shared."""
    import torch

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield ["--train.threads=1", "--train.device=cpu"]
    torch.set_num_threads(threads)


@pytest.mark.timeout(180)
def test_tune_lr_sweeps_the_lm_job_and_plots_it(tiny_overrides, one_thread, tmp_path, capsys):
    plot = tmp_path / "out" / "lr.png"
    steps = 40
    code = main(["tune", "lr", "--config", TINY, "--steps", str(steps), "--min-lr", "1e-5", "--max-lr", "3",
                 "--plot", str(plot), "--json", *tiny_overrides, *one_thread])
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads(printed)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and result["plot"] == str(plot)
    assert not list(plot.parent.glob(".*"))  # no temporary file left beside it
    n = result["steps_run"]
    assert 10 <= n <= steps and len(result["losses"]) == n
    assert result["lrs"] == pytest.approx(sweep_lrs(steps, 1e-5, 3)[:n])
    # The losses are the training's own (metrics.jsonl of the run directory the overrides named),
    # trained at the swept lrs: each record's lr is the next step's (read after the scheduler moved).
    logged = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["loss"] for r in logged][:n] == pytest.approx(result["losses"])
    assert [r["lr"] for r in logged][:n - 1] == pytest.approx(sweep_lrs(steps, 1e-5, 3)[1:n])
    # The lr really swept: the byte-level model learns between 1e-5 and 3, then breaks.
    assert 1e-5 < result["suggested_lr"] < 3 and result["min_loss"] < result["losses"][0] - 0.3
    assert result["min_loss_lr_over_10"] == pytest.approx(result["min_loss_lr"] / 10)
    assert result["divergence_lr"] is None or result["divergence_lr"] > result["suggested_lr"]
    for key in ("smoothed", "divergence_reason", "stopped_early", "stop_reason", "notes", "min_lr", "max_lr"):
        assert key in result

    code = main(["tune", "lr", "--config", TINY, "--steps", "20", "--plot", str(plot), *tiny_overrides])
    assert code == 2 and "already exists" in capsys.readouterr().err  # never overwritten without --force

    # Again in the same run directory: only the new sweep's steps are read, not the earlier
    # run's metrics.jsonl (which the new run moves into history/).
    code = main(["tune", "lr", "--config", TINY, "--steps", "12", "--min-lr", "1e-4", "--max-lr", "1e-3", "--json",
                 *tiny_overrides, *one_thread])
    again = json.loads(capsys.readouterr().out)
    assert code == 0 and again["steps_run"] == 12 and again["lrs"][0] == pytest.approx(1e-4)
    assert (tmp_path / "run" / "history" / "1" / "metrics.jsonl").is_file()


@pytest.mark.timeout(240)
def test_tune_batch_confirms_the_planned_micro_batch_and_measures_the_noise_scale(tiny_overrides, one_thread, capsys):
    # seq 32 (the overrides): the plan puts 32 at 13.8 MiB and 64 at 26.1 MiB, so 20 MiB is
    # answered by a mid-range power of two.
    code = main(["tune", "batch", "--config", TINY, "--memory-gib", "0.02", "--noise-rounds", "6", "--noise-k", "4",
                 "--json", *tiny_overrides, *one_thread])
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads(printed)
    budget = int(0.02 * 2**30)
    assert result["budget_bytes"] == budget and result["device"] == "cpu"
    planned = result["planned_micro_batch"]
    assert 4 <= planned <= 256 and planned & (planned - 1) == 0
    plan = {row["micro_batch"]: row for row in result["plan"]}
    assert plan[planned]["planned_bytes"] <= budget < plan[2 * planned]["planned_bytes"]
    # Confirmed by real steps: within one power of two of the plan, and every try recorded.
    assert result["micro_batch"] in (planned, planned // 2)
    assert result["tries"][0]["micro_batch"] == planned and result["tries"][-1]["status"] == "ok"
    for t in result["tries"]:
        assert t["planned_bytes"] == plan[t["micro_batch"]]["planned_bytes"] and t["measured_bytes"] > 0
    assert result["tries"][-1]["measured_bytes"] <= budget
    assert 0.8 < result["tries"][-1]["measured_bytes"] / result["tries"][-1]["planned_bytes"] < 1.25

    noise = result["noise"]
    assert (noise["b_small"], noise["b_big"], noise["rounds"]) == (4, 16, 6)  # the config's micro-batch, k = 4
    assert noise["grad_sq_norm"] > 0 and noise["trace_cov"] > 0 and noise["b_simple"] > 0
    assert noise["b_simple_tokens"] == pytest.approx(noise["b_simple"] * 32)
    rec = result["recommendation"]
    assert rec["global_batch"] == rec["micro_batch"] * rec["grad_accum_steps"] * result["dp"]
    assert rec["lr_rule"] == "sqrt" and rec["current_global_batch"] == 4
    assert rec["lr"] == pytest.approx(1e-3 * (rec["global_batch"] / 4) ** 0.5)


@pytest.mark.parametrize("argv, message", [
    (["lr", "--min-lr", "1e-2", "--max-lr", "1e-3"], "--min-lr"),
    (["lr", "--min-lr", "0"], "--min-lr"),
    (["lr", "--steps", "3"], "--steps"),
    (["batch", "--memory-gib", "0"], "--memory-gib"),
    (["batch", "--memory-gib", "-2"], "--memory-gib"),
    (["batch", "--noise-k", "1"], "--noise-k"),
])
def test_bad_inputs_are_clear_errors(argv, message, capsys):
    code = main(["tune", *argv, "--config", TINY, "--train.device=cpu"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and message in err, err


def test_a_config_is_required(capsys):
    assert main(["tune", "lr"]) == 2 and "--config" in capsys.readouterr().err
    assert main(["tune", "batch"]) == 2 and "--config" in capsys.readouterr().err
