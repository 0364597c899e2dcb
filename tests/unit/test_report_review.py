"""Regression tests of the review of `slipstream report` (runs) and `slipstream compare`.

Each test plants what a real run directory can hold and the report got wrong: the last records of
a long run (thinned away), a run that diverged (its loss logged as null), files that link out of
the run folder, early stopping, a --out that cannot be written. Hand-written run folders, no
training and few plots: the whole file takes a few seconds.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from slipstream.cli import main
from slipstream.errors import UserError
from slipstream.report import runs
from slipstream.report.build import write_report
from slipstream.report.compare import compare_runs, comparison_json, format_comparison
from slipstream.report.runs import _Thinned, read_run, run_numbers


def _run_dir(folder: Path, records: list[dict], summary: dict | None = None, policy: str = "none") -> Path:
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(f'[stability]\npolicy = "{policy}"\n')
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if summary is not None:
        (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def _interval(step: int, loss: float | None = 3.0, **extra) -> dict:
    return {"step": step, "loss": loss, "step_time_s": 0.1, "tokens_per_s": 1000.0, "tokens": 64 * step, **extra}


def test_thinning_keeps_the_last_record():
    kept = _Thinned(limit=100)
    for i in range(1001):
        kept.append(i)
    assert kept.items[-1] == 1000 and len(kept.items) <= 101


def test_a_long_crashed_run_reports_its_last_step_loss_val_loss_and_saves(tmp_path, monkeypatch):
    # No summary.json (the run crashed): every final number comes from the records, which are thinned.
    monkeypatch.setattr(runs, "MAX_POINTS", 50)
    monkeypatch.setattr(runs, "MAX_EVENTS", 10)
    records = []
    for step in range(1, 1002):
        records.append(_interval(step, loss=10 - step / 1000, **{"moe/blocks.0/load": [step, 1.0]}))
        if step % 3 == 0:
            records += [{"step": step, "val_loss": 9 - step / 10_000}, {"step": step, "checkpoint_stall_s": 0.5}]
    run = read_run(_run_dir(tmp_path / "long", records))
    numbers = run_numbers(run)
    assert numbers["steps"] == 1001 and numbers["tokens"] == 64 * 1001
    assert numbers["final_loss"] == pytest.approx(10 - 1.001)
    assert numbers["final_val_loss"] == pytest.approx(9 - 999 / 10_000)  # the last eval, not the 10th
    assert len(run.intervals) <= 51 and len(run.evals) <= 11 and run.evals[-1]["step"] == 999
    assert run.stall_totals == (333, pytest.approx(166.5), 0.5)  # every save counted, not only those listed
    assert run.moe_load_step == 1001 and run.moe_loads["blocks.0"][0] == 1001


def test_a_diverged_run_has_a_nan_final_loss_and_no_ratio(tmp_path):
    # The trainer logs a NaN loss as null and stops (no guard: stability.policy "none").
    good = _run_dir(tmp_path / "good", [_interval(5, 4.0), _interval(10, 3.0)],
                    {"final_loss": 3.0, "tokens_per_s": 0.0, "mfu": None})
    bad = _run_dir(tmp_path / "bad", [_interval(5, 4.0), _interval(10, 3.5), _interval(15, None)])
    result = compare_runs(good, bad)
    rows = {r["metric"]: r for r in result["metrics"]}
    assert math.isnan(rows["final_loss"]["b"]) and rows["final_loss"]["delta"] is None
    assert rows["final_loss"]["ratio"] is None
    assert rows["tokens_per_s"]["ratio"] is None  # A's 0 tokens/s: no division by zero
    assert any("diverged" in note and "step 15" in note for note in result["b"]["notes"])
    assert "nan" in format_comparison(result).split("final loss")[1].splitlines()[0]
    strict = json.loads(comparison_json(result), parse_constant=lambda c: pytest.fail(f"bare {c} in --json"))
    assert strict["metrics"][0]["b"] == "nan"

    # With a stability guard, null means "every step of the interval was dropped", not divergence.
    guarded = _run_dir(tmp_path / "guarded", [_interval(5, 4.0), _interval(10, None)], policy="skip")
    assert run_numbers(read_run(guarded))["final_loss"] == 4.0


def test_files_linking_out_of_the_run_folder_are_not_read(tmp_path):
    secret = tmp_path / "credentials.toml"
    secret.write_text('token = "SECRET-123"\n')
    (tmp_path / "outside.json").write_text(json.dumps({"hostname": "SECRET-123"}))
    run = _run_dir(tmp_path / "run", [_interval(5)])
    (run / "config.toml").unlink()
    (run / "config.toml").symlink_to(secret)
    (run / "env.json").symlink_to(tmp_path / "outside.json")
    (run / "logs").mkdir()
    (run / "logs" / "rank0.jsonl").symlink_to(secret)
    (run / "kept").mkdir()
    (run / "kept" / "summary.json").write_text(json.dumps({"final_loss": 2.5}))
    (run / "summary.json").symlink_to(Path("kept") / "summary.json")  # a link inside the folder is fine
    latest = tmp_path / "latest"
    latest.symlink_to(run)  # runs/latest: the run folder itself may be a link

    data = read_run(latest)
    assert data.name == "run" and data.config_text is None and data.env == {} and not data.rank_logs
    assert run_numbers(data)["final_loss"] == 2.5
    assert sum("links to a file outside the run directory" in n for n in data.notes) == 3
    other = _run_dir(tmp_path / "other", [_interval(5)])
    assert "SECRET" not in format_comparison(compare_runs(latest, other))
    with pytest.raises(UserError, match="inside the input"):
        write_report([latest], latest / "report.html")


def test_early_stopping_is_a_line_on_the_loss_plot_and_in_compare(tmp_path):
    from slipstream.report.run_sections import loss_section, overview_section

    stop = {"step": 10, "best_val_loss": 3.2, "best_step": 5, "reason": "val_loss did not improve for 1 evaluation"}
    stopped = read_run(_run_dir(tmp_path / "stopped", [_interval(5), _interval(10), {"step": 5, "val_loss": 3.2},
                                                        {"step": 10, "val_loss": 3.3}],
                                {"final_loss": 3.0, "stopped_early": stop}))
    plot = "".join(loss_section([stopped]).parts)
    assert ">stopped early</text>" in plot  # the line's legend entry (SVG text stays text)
    assert "stopped early at step 10" in "".join(overview_section([stopped]).parts)
    plain = _run_dir(tmp_path / "plain", [_interval(5)])
    text = format_comparison(compare_runs(plain, stopped.path))
    assert "B stopped early at step 10: val_loss did not improve" in text


def test_an_out_that_cannot_be_written_exits_2(tmp_path, capsys):
    run = _run_dir(tmp_path / "run", [_interval(5)])
    out = tmp_path / ("x" * 300 + ".html")  # longer than a file name may be
    assert main(["report", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --out") and "could not be written" in err and not os.path.exists(tmp_path / "x")


def test_a_tiny_planned_to_measured_ratio_keeps_its_digits():
    from slipstream.report.run_memory import _ratio_text

    assert _ratio_text(3.7e-3, 0.898) == "0.00412x" and _ratio_text(6.0, 5.0) == "1.2x" and _ratio_text(1, 0) == "-"


def test_mfu_agrees_with_the_runs_tokens_per_s(tmp_path):
    # summary.json's "mfu" is the mean of the intervals' (0.05 here); at the run's 1,800 tokens/s the
    # intervals' FLOPs-per-token / peak (1e-5 per token/s) says 1.8 %.
    records = [_interval(5, mfu=0.01, tokens_per_s=1000.0), _interval(10, mfu=0.09, tokens_per_s=9000.0)]
    run = read_run(_run_dir(tmp_path / "run", records, {"tokens_per_s": 1800.0, "mfu": 0.05}))
    assert run_numbers(run)["mfu"] == pytest.approx(0.018)


def test_rank_memory_is_one_kind_of_peak_for_every_rank(tmp_path):
    from slipstream.report.run_memory import _rank_memory, ranks_section

    # Rank 1 has no step peak (no memory probe ran there): every rank's device peak is drawn instead of
    # rank 0's 5 MiB step peak beside rank 1's 400 MiB resident set, which read as an 80x imbalance.
    ranks = [{"rank": 0, "step_peak_bytes": 5 << 20, "mem_peak_bytes": 400 << 20},
             {"rank": 1, "step_peak_bytes": None, "mem_peak_bytes": 410 << 20}]
    run = read_run(_run_dir(tmp_path / "run", [_interval(5)], {"world_size": 2, "ranks": ranks}))
    assert _rank_memory(run) == ({0: 400 << 20, 1: 410 << 20}, "device peak")
    assert ">device peak memory per rank</text>" in "".join(ranks_section([run]).parts)


def test_a_one_interval_run_is_visible_and_absent_data_is_said_plainly(tmp_path, monkeypatch):
    from slipstream.report import run_sections
    from slipstream.report.page import Section

    drawn = []
    monkeypatch.setattr(run_sections, "figure", lambda fig, name, caption="": drawn.append(fig) or "")
    short = read_run(_run_dir(tmp_path / "short", [_interval(5)]))  # crashed after its first log
    run_sections.loss_section([short])
    by_step, by_tokens = drawn[0].axes
    # its one point is drawn as a marker (a line of one point draws nothing)
    assert [line.get_marker() for line in by_step.get_lines() + by_tokens.get_lines()] == [".", "."]
    from slipstream.report.run_plots import pyplot

    pyplot().close(drawn[0])
    section = Section("experts", "Experts")
    run_sections.lacking(section, [short, short], [], "mixture-of-experts layers")
    assert "No mixture-of-experts layers in any of these runs." in section.parts[0]  # was "None ... has no ..."


def test_one_folder_given_twice_keeps_its_name():
    from slipstream.report.runs import unique_names

    a, b = Path("/runs/a"), Path("/other/b")
    assert unique_names([a, a, b]) == ["a (1)", "a (2)", "b"]  # was "//runs/a (1)", ..., "//other/b (3)"
    assert unique_names([Path("/x/a"), Path("/y/a"), b]) == ["x/a", "y/a", "other/b"]


def test_a_resumed_run_still_running_is_not_reported_at_its_old_summary(tmp_path):
    # The first part ended at step 10 (summary.json); the resumed part has logged up to step 20 so far.
    records = [_interval(5, 4.0), _interval(10, 3.5), _interval(15, 3.2), _interval(20, 3.0)]
    summary = {"steps": 10, "final_loss": 3.5, "tokens": 640, "tokens_per_s": 1000.0, "device": "cpu",
               "memory": {"peak_bytes": 5 << 20}}
    run = read_run(_run_dir(tmp_path / "run", records, summary))
    numbers = run_numbers(run)
    assert (numbers["steps"], numbers["final_loss"], numbers["tokens"]) == (20, 3.0, 64 * 20)
    assert numbers["step_peak_bytes"] == 5 << 20  # what stays true of the run is kept
    assert any("metrics.jsonl goes on to step 20" in note for note in run.notes)


def test_expert_loads_of_a_foreign_record_are_bounded_in_layers(tmp_path):
    loads = {f"moe/layer{i}/load": [0.5, 0.5] for i in range(runs.MAX_MOE_LAYERS + 50)}  # no imbalance keys
    run = read_run(_run_dir(tmp_path / "run", [_interval(5, **loads)]))
    assert len(run.moe_loads) == runs.MAX_MOE_LAYERS  # was every layer of the line: one heatmap row each


def test_a_config_difference_table_is_bounded(tmp_path):
    from slipstream.report.run_info import MAX_DIFF_ROWS, config_diff_section

    a = read_run(_run_dir(tmp_path / "a", [_interval(5)]))
    b = read_run(_run_dir(tmp_path / "b", [_interval(5)]))
    b.config = {"x": {f"k{i}": i for i in range(MAX_DIFF_ROWS + 100)}}  # a foreign config.toml of many keys
    html = "".join(config_diff_section([a, b]).parts)
    assert html.count("<tr>") == MAX_DIFF_ROWS + 1 and f"the first {MAX_DIFF_ROWS} are listed" in html
    from slipstream.report.compare import MAX_SHOWN

    side = {"name": "a", "path": "a", "notes": []}
    result = {"a": side, "b": side, "metrics": [],
              "config_differences": [{"key": f"x.k{i}", "a": i, "b": None} for i in range(MAX_SHOWN + 100)]}
    text = format_comparison(result)  # the terminal too: the first MAX_SHOWN, and how many more
    assert f"x.k{MAX_SHOWN - 1} " in text and f"x.k{MAX_SHOWN} " not in text and "and 100 more" in text
