"""`slipstream report` and `slipstream compare` on two real tiny training runs, through the CLI
(slipstream.cli.main, in this process: the runs and the commands share one torch import).

Run A is plain; run B changes optim.lr and profiles two steps, so the page has every kind of
data a single-process run can have (a trace for the doctor included).
"""

from __future__ import annotations

import json

import pytest

from slipstream.cli import main
from slipstream.report.run_sections import SECTION_KEYS
from tests.e2e.test_cli import ROOT
from tests.unit.test_report_runs import PLOT_SECTIONS, assert_self_contained, section_html

TRAIN = ["train", "--config", str(ROOT / "configs" / "tiny.toml"), "--train.max_steps=8", "--train.eval_interval=4",
         "--train.eval_steps=1", "--logging.log_interval=2", "--logging.progress=false", "--logging.tensorboard=false",
         "--checkpoint.interval=0"]  # one save, the final one: a stall marker at step 8


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, data_dir):
    root = tmp_path_factory.mktemp("report-runs")
    a, b = root / "lr-1e-3", root / "lr-3e-3"
    assert main([*TRAIN, f"--data.dir={data_dir}", f"--run.dir={a}"]) == 0
    assert main([*TRAIN, f"--data.dir={data_dir}", f"--run.dir={b}", "--optim.lr=0.003", "--profile.enabled=true",
                 "--profile.start_step=2", "--profile.steps=2"]) == 0
    return a, b


def test_report_of_two_real_runs(two_runs, tmp_path, capsys):
    out = tmp_path / "report.html"
    assert main(["report", *map(str, two_runs), "--out", str(out), "--title", "lr sweep"]) == 0
    assert str(out) in capsys.readouterr().out
    html = out.read_text()
    page = assert_self_contained(html)
    assert list(page.figures) == list(SECTION_KEYS)
    for key in PLOT_SECTIONS:
        if key not in ("ranks", "experts"):  # single-process, dense runs: those say so instead
            assert page.figures[key], f"section {key} has no figure"
    assert not page.figures["ranks"] and not page.figures["experts"]
    assert "lr-1e-3 train" in section_html(html, "loss") and "lr-3e-3 val" in section_html(html, "loss")
    assert ">checkpoint save</text>" in section_html(html, "loss")  # the final save, as a marker (legend)
    diff = section_html(html, "config-diff")
    assert "optim.lr" in diff and "profile.enabled" in diff
    assert "lr sweep" in html and "lr-3e-3" in section_html(html, "doctor")

    # an existing --out is refused (exit 2, one line) and kept; --force replaces it
    out.write_text("keep me")
    assert main(["report", str(two_runs[0]), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "already exists" in err and "--force" in err
    assert out.read_text() == "keep me"
    assert main(["report", str(two_runs[0]), "--out", str(out), "--force"]) == 0
    assert "data-section" in out.read_text()


def test_compare_two_real_runs(two_runs, tmp_path, capsys):
    latest = tmp_path / "latest"
    latest.symlink_to(two_runs[1], target_is_directory=True)  # runs/latest is a link to the newest run
    assert main(["compare", str(two_runs[0]), str(latest)]) == 0
    text = capsys.readouterr().out
    assert "B: lr-3e-3" in text  # named after the run the link points to
    assert "optim.lr" in text and "0.001" in text and "0.003" in text and "B/A" in text
    assert main(["compare", *map(str, two_runs), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {r["metric"]: r for r in result["metrics"]}
    summaries = [json.loads((p / "summary.json").read_text()) for p in two_runs]
    assert rows["final_loss"]["a"] == summaries[0]["final_loss"] and rows["final_loss"]["b"] == summaries[1]["final_loss"]
    assert rows["tokens_per_s"]["ratio"] == pytest.approx(summaries[1]["tokens_per_s"] / summaries[0]["tokens_per_s"])
    assert f"{rows['final_loss']['ratio']:.3f}x" in text


def test_bad_input_exits_2_with_a_clear_message(two_runs, tmp_path, capsys):
    (tmp_path / "not-a-run").mkdir()
    assert main(["report", str(tmp_path / "not-a-run"), "--out", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not-a-run" in err and "run directory" in err
    assert not (tmp_path / "r.html").exists()
    assert main(["report", str(two_runs[0]), "--out", str(two_runs[0] / "config.toml"), "--force"]) == 2
    assert "inside the input" in capsys.readouterr().err
    assert main(["compare", str(two_runs[0]), str(tmp_path / "not-a-run")]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_report_without_out_writes_report_html_here(two_runs, tmp_path, monkeypatch):
    """`slipstream report runs/latest` (the issue's command) writes ./report.html, and a second
    call refuses to replace it."""
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(two_runs[0])]) == 0
    assert "data-section" in (tmp_path / "report.html").read_text()
    assert main(["report", str(two_runs[0])]) == 2
