"""`slipstream report` pages opened in a real headless browser (Debian's chromium via Selenium),
from file:// as a user opens them: a run of a real training, a tuning study and a ladder result.

Each page must load without console errors, show every section with content, draw every figure
at a visible size, and fetch nothing: the page is self-contained (checked in the HTML and in the
browser's own list of fetched resources)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from tests.browser import full_page_screenshot, requested_urls, start_chromium
from tests.unit.test_report_study import PRUNED_STUDY, make_study

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="session")
def browser():
    driver = start_chromium()
    yield driver
    driver.quit()


def assert_self_contained(page: str) -> None:
    """Nothing in the HTML can make the browser fetch: every src/href is an anchor or inline
    data, and there are no scripts, stylesheets or url()s pointing elsewhere."""
    for target in re.findall(r"""\b(?:src|href)\s*=\s*["']?([^"'\s>]*)""", page, flags=re.I):
        assert target.startswith(("#", "data:")), f"link to {target!r}"
    for target in re.findall(r"""url\(\s*["']?([^"')]*)""", page, flags=re.I):
        assert target.startswith(("#", "data:")), f"url({target!r})"
    for tag in ("<script", "<link", "<iframe", "<img", "@import"):
        assert tag not in page.lower(), tag


def check_in_browser(driver, path: Path, shot: Path) -> list[str]:
    """Open the page, check what a reader sees, save a screenshot; returns the section keys."""
    page = path.read_text(encoding="utf-8")
    assert_self_contained(page)
    expected = re.findall(r'<section id="[^"]+" data-section="([^"]+)"', page)
    driver.get_log("browser"), requested_urls(driver)  # drop what earlier pages logged
    driver.get(path.as_uri())
    assert driver.execute_script("return document.readyState") == "complete"

    severe = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    assert not severe, severe
    # Nothing fetched: no network resource, and no request but the page's own and its inline
    # data: images (a colorbar is embedded as a PNG in its SVG).
    assert driver.execute_script("return performance.getEntriesByType('resource').length") == 0
    assert [url for url in requested_urls(driver) if not url.startswith("data:")] == [path.as_uri()]

    sections = driver.execute_script("""
        return Array.from(document.querySelectorAll('section[data-section]')).map(s => ({
            key: s.dataset.section, height: s.getBoundingClientRect().height,
            content: s.querySelectorAll('figure, table, p, pre').length,
            text: s.innerText.length - s.querySelector('h2').innerText.length}));""")
    assert [s["key"] for s in sections] == expected and expected
    for s in sections:
        assert s["content"] > 0 and s["text"] > 0 and s["height"] > 0, s

    figures = driver.execute_script("""
        return Array.from(document.querySelectorAll('figure[data-figure]')).map(f => {
            const svg = f.querySelector('svg'); const r = svg ? svg.getBoundingClientRect() : null;
            return {name: f.dataset.figure, width: r ? r.width : 0, height: r ? r.height : 0}; });""")
    assert len(figures) == page.count("<figure data-figure=")
    for f in figures:
        assert f["width"] > 50 and f["height"] > 50, f

    png = full_page_screenshot(driver, shot, max_height=4000)
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000 and shot.read_bytes() == png
    return expected


def _slipstream(*argv: str) -> str:
    """`slipstream ARGV` in this process (a tune trial is still a real subprocess); its stdout."""
    from slipstream.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    assert code == 0, err.getvalue()[-3000:]
    return out.getvalue()


def _report(tmp_path: Path, name: str, inputs: list[Path]) -> Path:
    """`slipstream report INPUTS --out tmp/NAME.html`: the page a user opens."""
    out = tmp_path / f"{name}.html"
    _slipstream("report", *map(str, inputs), "--out", str(out))
    return out


@pytest.mark.timeout(120)
def test_run_report_of_a_real_training_in_the_browser(browser, tmp_path, data_dir):
    run_dir = tmp_path / "run"
    _slipstream("train", "--config", str(ROOT / "configs" / "tiny.toml"), f"--run.dir={run_dir}",
                f"--data.dir={data_dir}", "--train.eval_tokens=4096", "--logging.progress=false")
    keys = check_in_browser(browser, _report(tmp_path, "run", [run_dir]), tmp_path / "run.png")
    assert {"runs", "loss", "lr", "throughput", "memory", "environment", "config"} <= set(keys)


@pytest.mark.timeout(180)
def test_study_report_of_a_real_tune_hparams_study_in_the_browser(browser, tmp_path, data_dir, monkeypatch):
    """A 2-trial `slipstream tune hparams` study of 6-step trainings (each trial reports its val
    loss at steps 3 and 6), opened as `slipstream report STUDY_DIR` shows it."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the trial processes inherit it: no more threads than cores
    folder = tmp_path / "tune-tiny"
    _slipstream("tune", "hparams", "--config", str(ROOT / "configs" / "tiny.toml"), "--trials", "2",
                "--train.max_steps=6", "--train.eval_interval=3", "--train.eval_tokens=2048",
                "--logging.tensorboard=false", f"--data.dir={data_dir}", f"--tune.dir={folder}")
    page = _report(tmp_path, "study", [folder])
    keys = check_in_browser(browser, page, tmp_path / "study.png")
    assert keys == ["study", "study-trials", "study-history", "study-intermediate", "study-parallel",
                    "study-importance"]
    html = page.read_text(encoding="utf-8")
    assert html.count("at step 6</td>") == 2  # both trials' last val loss, read from the study


def test_study_with_pruned_and_failed_trials_in_the_browser(browser, tmp_path):
    folder = make_study(tmp_path / "tune-demo", PRUNED_STUDY)
    keys = check_in_browser(browser, _report(tmp_path, "pruned", [folder]), tmp_path / "pruned.png")
    assert "study-intermediate" in keys and "study-importance" in keys


def test_ladder_report_in_the_browser(browser, tmp_path):
    ladders = [ROOT / "benchmarks" / "ladder-memory-cpu-tiny.json", ROOT / "benchmarks" / "ladder-speed-cpu-tiny.json"]
    keys = check_in_browser(browser, _report(tmp_path, "ladder", ladders), tmp_path / "ladder.png")
    assert keys == ["ladder-memory-cpu-tiny", "ladder-speed-cpu-tiny"]


def test_the_checks_catch_a_page_that_fetches_errs_or_is_empty(browser, tmp_path):
    """The checks above are not vacuous: external references, a script error, a fetched file
    and an empty section are each caught."""
    for bad in ('<img src="https://example.invalid/x.png">', '<script>throw new Error("x")</script>',
                '<link rel="stylesheet" href="style.css">', '<div style="background: url(x.png)">'):
        with pytest.raises(AssertionError):
            assert_self_contained(f"<html><body>{bad}</body></html>")

    full_page_screenshot(browser, tmp_path / "pixel.png", max_height=200)
    fetches = tmp_path / "fetches.html"
    fetches.write_text('<html><body><img src="pixel.png"><img src="http://127.0.0.1:9/x.png">'
                       '<script>console.error("broken")</script></body></html>')
    requested_urls(browser)
    browser.get(fetches.as_uri())
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert browser.execute_script("return performance.getEntriesByType('resource').length") == 1  # the http one
    assert requested_urls(browser) == [fetches.as_uri(), (tmp_path / "pixel.png").as_uri(), "http://127.0.0.1:9/x.png"]

    empty = tmp_path / "empty.html"
    empty.write_text('<!DOCTYPE html><html><body><section id="a" data-section="a"><h2>A</h2></section></body></html>')
    with pytest.raises(AssertionError, match="'key': 'a'"):
        check_in_browser(browser, empty, tmp_path / "empty.png")
