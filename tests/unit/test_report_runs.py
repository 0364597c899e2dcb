"""The run report and `compare` on hand-written run directories (no training: fast).

Each run directory here is written the way the trainer writes one (config.toml from a real
resolved config, metrics.jsonl records of the trainer's shape, summary.json with "memory" and
"ranks", rank logs, a profiler trace the doctor can read), with planted numbers, so each test can
check that its section shows them, and a damaged run that it still renders with notes.
tests/e2e/test_report_cli.py does the same on real training runs through the CLI.
"""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from slipstream.errors import UserError
from slipstream.report.build import build_report, classify, write_report
from slipstream.report.compare import compare_runs, format_comparison
from slipstream.report.run_sections import SECTION_KEYS
from slipstream.report.runs import MAX_POINTS, _Thinned, config_differences, read_run

ROOT = Path(__file__).resolve().parents[2]
# Sections drawn as plots; each must hold a figure when its run has the data.
PLOT_SECTIONS = ("loss", "lr", "grad-norm", "throughput", "data-wait", "memory", "planned", "ranks", "experts",
                 "doctor")


def _config_toml(*overrides: str) -> str:
    from slipstream.config import load_config
    from slipstream.config.load import config_to_toml

    return config_to_toml(load_config(str(ROOT / "configs" / "tiny.toml"), ["--model.vocab_size=257", *overrides]))


def _trace(path: Path) -> None:
    """A CPU chrome trace of 3 steps, each waiting 5 of its 10 ms for data: the doctor's data_wait."""
    events = []
    for i in range(3):
        t = i * 10_000
        events += [{"ph": "X", "name": f"ProfilerStep#{i + 3}", "cat": "user_annotation", "ts": t, "dur": 10_000},
                   {"ph": "X", "name": "slipstream/data", "cat": "user_annotation", "ts": t, "dur": 5_000},
                   {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "ts": t + 5_000, "dur": 4_000}]
    for e in events:
        e.update(pid=1, tid=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events}))


def write_run(folder: Path, *overrides: str, loss0: float = 5.0, moe: bool = True, ranks: bool = True,
              trace: bool = True) -> Path:
    """A finished run directory with every kind of record the report draws."""
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(_config_toml(f"--run.dir={folder}", *overrides))
    (folder / "env.json").write_text(json.dumps({"torch_version": "2.13.0+cpu", "cpu_model": "Test CPU",
                                                 "devices": [], "packages": {"numpy": "2.4"}, "git_sha": "abc"}))
    records = []
    for step in range(2, 21, 2):
        record = {"step": step, "loss": loss0 - 0.05 * step, "lr": 1e-3 * (1 - step / 40), "grad_norm": 2.0 + step / 10,
                  "grad_norm_clipped": 1.0, "step_time_s": 0.05, "data_wait_s": 0.01, "tokens_per_s": 5000.0 + step,
                  "mfu": 0.04, "mem_peak_bytes": 400 << 20, "tokens": 256 * step}
        if moe:
            record.update({"moe/blocks.0/load": [0.1, 0.2, 0.3, 0.4], "moe/blocks.0/imbalance": 1.6,
                           "moe/blocks.1/load": [0.25, 0.25, 0.25, 0.25], "moe/blocks.1/imbalance": 1.0})
        records.append(record)
        if step % 10 == 0:
            records.append({"step": step, "val_loss": loss0 - 0.04 * step, "val_loss_stderr": 0.01, "val_tokens": 999})
            records.append({"step": step, "checkpoint_stall_s": 0.25})
    records.insert(5, {"step": 8, "guard_event": "spike", "action": "skip", "loss": 9.5, "grad_norm": 40.0,
                       "median": 4.6, "policy": "skip"})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = {"final_loss": loss0 - 1.0, "val_loss": loss0 - 0.8, "tokens_per_s": 5000.0, "mfu": 0.04,
               "mem_peak_bytes": 400 << 20, "steps": 20, "tokens": 5120, "wall_time_s": 3.0, "device": "cpu",
               "memory": {"peak_bytes": 5 << 20, "planned_peak_bytes": 6 << 20, "step": 2,
                          "categories": {"parameters": 1 << 20, "gradients": 1 << 20, "optimizer_state": 2 << 20,
                                         "activations": 1 << 20, "other": 0},
                          "phases": {"forward": {"peak_bytes": 4 << 20, "end_bytes": 3 << 20},
                                     "backward": {"peak_bytes": 5 << 20, "end_bytes": 3 << 20},
                                     "optimizer": {"peak_bytes": 4 << 20, "end_bytes": 4 << 20}}}}
    if ranks:
        summary.update(world_size=2, ranks=[{"rank": 0, "step_peak_bytes": 5 << 20, "mem_peak_bytes": 400 << 20},
                                            {"rank": 1, "step_peak_bytes": 6 << 20, "mem_peak_bytes": 410 << 20}])
        (folder / "logs").mkdir()
        for rank, speed in ((0, 3000.0), (1, 1500.0)):  # rank 1 is twice as slow
            lines = [{"step": s, "loss": 4.0, "step_time_s": 1.0 / speed, "tokens_per_s": speed, "rank": rank}
                     for s in (2, 4, 6)]
            (folder / "logs" / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (folder / "summary.json").write_text(json.dumps(summary))
    if trace:
        _trace(folder / "traces" / "rank0.json")
    return folder


class _Page(HTMLParser):
    """Sections (data-section), the figures and tables in each, every src/href value, and the text."""

    def __init__(self, html: str):
        super().__init__()
        self.figures: dict[str, list[str]] = {}
        self.tables: dict[str, list[str]] = {}
        self.links: list[str] = []
        self.section: str | None = None
        self.text: list[str] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "data-section" in attrs:
            self.section = attrs["data-section"]
            self.figures.setdefault(self.section, [])
            self.tables.setdefault(self.section, [])
        if "data-figure" in attrs:
            self.figures[self.section].append(attrs["data-figure"])
        if "data-table" in attrs:
            self.tables[self.section].append(attrs["data-table"])
        self.links += [v for k, v in attrs.items() if k in ("src", "href", "xlink:href") and v is not None]

    def handle_data(self, data):
        self.text.append(data)


def assert_self_contained(html: str) -> _Page:
    page = _Page(html)
    assert all(v.startswith("#") or v.startswith("data:") for v in page.links), page.links
    lowered = html.lower()
    assert "<script" not in lowered and "<link" not in lowered and "@import" not in lowered
    assert all(u.startswith("#") for u in re.findall(r"url\(\s*['\"]?([^)'\"]*)", html)), "url() to elsewhere"
    return page


def section_html(html: str, key: str) -> str:
    start = html.index(f'data-section="{key}"')
    end = html.find("<section", start)
    return html[start:end if end > 0 else len(html)]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    a = write_run(root / "base")
    b = write_run(root / "fast", "--optim.lr=0.003", loss0=4.0, moe=False, ranks=False, trace=False)
    return a, b


@pytest.fixture(scope="module")
def two_run_page(two_runs):
    return build_report(list(two_runs))


def test_every_section_with_a_figure_where_the_runs_have_data(two_run_page):
    page = assert_self_contained(two_run_page)
    assert list(page.figures) == list(SECTION_KEYS)
    for key in PLOT_SECTIONS:
        assert page.figures[key], f"section {key} has no figure"
        assert '<svg' in section_html(two_run_page, key)
    for key in ("runs", "events", "doctor", "environment", "config-diff"):
        assert page.tables[key], f"section {key} has no table"


def test_overlay_names_both_runs_and_diffs_the_changed_key(two_run_page):
    loss = section_html(two_run_page, "loss")
    assert "base train" in loss and "fast train" in loss  # one legend, both runs (SVG text stays text)
    diff = section_html(two_run_page, "config-diff")
    assert "optim.lr" in diff and "0.003" in diff
    assert "run.dir" not in re.sub(r"<p.*?</p>", "", diff)  # each run's own folder is not a difference


def test_events_are_markers_on_the_loss_plot_and_rows_in_the_table(two_run_page):
    loss = section_html(two_run_page, "loss")
    assert ">stability event</text>" in loss and ">checkpoint save</text>" in loss  # the markers' legend entries
    events = section_html(two_run_page, "events")
    assert "stability: spike" in events and "skip" in events and "training stalled 0.25 s" in events


def test_sections_show_the_planted_numbers(two_run_page):
    ranks = section_html(two_run_page, "ranks")
    assert "<td>2.00</td>" in ranks  # tokens/s max/min of the two ranks: 3000 / 1500
    experts = section_html(two_run_page, "experts")
    assert "blocks.0" in experts and "No mixture-of-experts layers" in experts
    doctor = section_html(two_run_page, "doctor")
    assert "the step waits for data" in doctor and "data.num_workers" in doctor
    planned = section_html(two_run_page, "planned")
    assert "6.0 MiB" in planned and "5.0 MiB" in planned and "1.2x" in planned  # planned / measured memory
    assert "this machine" in planned  # the step time predicted now, and labelled so
    memory = section_html(two_run_page, "memory")
    assert "optimizer state" in memory and "2.0 MiB" in memory


def test_single_process_dense_run_says_so_in_one_line(tmp_path):
    html = build_report([write_run(tmp_path / "solo", moe=False, ranks=False, trace=False)])
    page = _Page(html)
    for key, words in (("ranks", "single-process run"), ("experts", "This run has no mixture-of-experts"),
                       ("doctor", "This run has no profiler trace"), ("config-diff", "One run")):
        assert not page.figures[key] and words in section_html(html, key)
    assert page.figures["loss"] and page.figures["memory"]


def test_missing_and_garbled_files_render_with_notes(tmp_path):
    run = write_run(tmp_path / "broken", moe=False, ranks=False, trace=False)
    with open(run / "metrics.jsonl", "a") as f:
        f.write("this is not json\n[1, 2]\n{\"step\": 30, \"loss\": 3.0, \"step_ti")  # cut off by a kill
    (run / "env.json").write_text("{ not json")
    (run / "summary.json").unlink()
    (run / "config.toml").write_text("[model\nbroken = ")
    (run / "traces").mkdir()
    (run / "traces" / "rank0.json").write_text("{\"traceEvents\": [")  # a trace cut off mid-write
    html = build_report([run])
    page = assert_self_contained(html)
    assert list(page.figures) == list(SECTION_KEYS)
    text = " ".join(page.text)
    assert "3 line(s) that are not metric records were skipped" in text
    assert "env.json could not be read" in text and "summary.json is missing" in text
    assert "config.toml could not be read" in text and "the trace could not be analysed" in text
    assert page.figures["loss"] and page.figures["lr"]  # what did parse is still drawn
    assert "This run has no memory breakdown" in section_html(html, "memory")


def test_markup_in_names_and_config_values_is_escaped(tmp_path):
    evil = '<img src=x onerror="alert(1)">$5'  # `$` too: a name must never be parsed as matplotlib mathtext
    a = write_run(tmp_path / evil, moe=False, ranks=False, trace=False)
    b = write_run(tmp_path / "plain", moe=False, ranks=False, trace=False)
    text = (b / "config.toml").read_text().replace('name = "tiny"', 'name = "<script>alert(2)</script>"')
    (b / "config.toml").write_text(text)
    html = build_report([a, b], title="<b>title</b>")
    assert_self_contained(html)
    assert "<img" not in html and "<b>title" not in html
    assert "&lt;img src=x" in html and "&lt;script&gt;alert(2)" in html
    assert "run.name" in section_html(html, "config-diff")
    assert "$5 train" in section_html(html, "loss")  # the legend names the run as it is


def test_compare_prints_the_differing_key_and_ratios(two_runs):
    result = compare_runs(*two_runs)
    assert [d["key"] for d in result["config_differences"]] == ["optim.lr"]
    metrics = {m["metric"]: m for m in result["metrics"]}
    assert metrics["final_loss"]["a"] == 4.0 and metrics["final_loss"]["b"] == 3.0
    assert metrics["final_loss"]["ratio"] == pytest.approx(0.75) and metrics["final_loss"]["delta"] == -1.0
    assert metrics["step_peak_bytes"]["a"] == 6 << 20  # the largest rank's step peak
    text = format_comparison(result)
    assert "optim.lr" in text and "0.003" in text and "0.750x" in text and "-1" in text


def test_config_differences_are_dotted_and_only_what_differs():
    a = {"optim": {"lr": 1e-3, "betas": [0.9, 0.95]}, "run": {"dir": "a", "name": "x"}}
    b = {"optim": {"lr": 3e-3, "betas": [0.9, 0.95]}, "run": {"dir": "b", "name": "x"}, "new": {"key": 1}}
    assert config_differences([a, b]) == [("new.key", [None, 1]), ("optim.lr", [1e-3, 3e-3])]


def test_a_long_run_is_thinned_to_bounded_memory():
    kept = _Thinned(limit=1000)
    for i in range(100_000):
        kept.append(i)
    assert 500 <= len(kept.items) <= 1001 and kept.items[0] == 0
    assert kept.items[-1] == 99_999  # the last record is kept: the final loss, step and tokens come from it
    steps = [b - a for a, b in zip(kept.items[:-1], kept.items[1:-1])]
    assert len(set(steps)) == 1  # evenly spaced
    assert MAX_POINTS <= 100_000


def test_bad_inputs_are_user_errors(tmp_path, two_runs):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="neither a run directory"):
        classify(tmp_path / "empty")
    with pytest.raises(UserError, match="does not exist"):
        classify(tmp_path / "nope")
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(UserError, match="not a `slipstream bench ladder` result"):
        classify(tmp_path / "x.json")
    with pytest.raises(UserError, match="not a run directory"):
        read_run(tmp_path / "empty")
    out = tmp_path / "report.html"
    out.write_text("mine")
    with pytest.raises(UserError, match="already exists"):
        write_report(list(two_runs), out)
    assert out.read_text() == "mine"
    with pytest.raises(UserError, match="inside the input"):
        write_report(list(two_runs), two_runs[0] / "report.html")
    with pytest.raises(UserError, match="inside the input"):
        write_report(list(two_runs), two_runs[0] / "metrics.jsonl", force=True)
    assert (two_runs[0] / "metrics.jsonl").read_text().startswith("{")


def test_studies_and_ladders_are_dispatched_to_their_sections(tmp_path, monkeypatch, two_runs):
    import slipstream.report.run_sections as run_sections
    from slipstream.report.page import Section

    study_module = pytest.importorskip("slipstream.report.study")
    calls = []
    monkeypatch.setattr(study_module, "study_sections",
                        lambda path, prefix="study": calls.append(Path(path)) or [Section(prefix, "A study")])
    monkeypatch.setattr(run_sections, "run_sections", lambda runs: [Section("runs", ", ".join(r.name for r in runs))])
    study = tmp_path / "study"
    study.mkdir()
    (study / "study.json").write_text("{}")
    assert classify(study) == "study"
    html = build_report([study, two_runs[0], study, two_runs[1]])
    assert calls == [study, study]
    # the runs share one set of sections, at the first run's place; a second study gets its own keys
    assert list(_Page(html).figures) == ["study", "runs", "study-2"] and "base, fast" in html
    ladder = ROOT / "benchmarks" / "ladder-speed-cpu-tiny.json"
    pytest.importorskip("slipstream.report.ladder")
    if ladder.is_file():
        assert classify(ladder) == "ladder"
        assert any(_Page(build_report([ladder])).figures.values())
