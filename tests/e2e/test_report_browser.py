"""`slipstream report` pages opened in a real headless browser (Debian's chromium via Selenium),
from file:// as a user opens them: a run of a real training, a tuning study and a ladder result.

Each page must load without console errors, show every section with content, draw every figure
at a visible size, and fetch nothing: the page is self-contained (checked in the HTML and in the
browser's own list of fetched resources)."""

from __future__ import annotations

import contextlib
import io
import re
import time
from pathlib import Path

import pytest

from tests.browser import external_references, full_page_screenshot, requested_urls, start_chromium
from tests.unit.test_report_study import PRUNED_STUDY, make_study

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STUDY_FIGURES = {"study-history", "study-intermediate", "study-parallel", "study-importance"}


@pytest.fixture(scope="session")
def browser():
    driver = start_chromium()
    try:
        yield driver
    finally:  # also when a test failed or was interrupted: no browser process outlives the tests
        driver.quit()


def assert_self_contained(page: str) -> None:
    """Nothing in the HTML can make the browser fetch: no URL attribute but #anchors and inline
    data, no url() elsewhere, no scripts, stylesheets, frames or objects (tests/browser.py)."""
    assert external_references(page) == []


def severe_log(driver, wait_for_one: bool = False) -> list[dict]:
    """The SEVERE console entries so far. Chromium reports a failed resource load a moment after
    the load event, so the log is read until one shows up (`wait_for_one`, up to 10 s) or, when
    none is expected, once more after a short settle so a late error is not missed."""
    severe, deadline = [], time.monotonic() + (10.0 if wait_for_one else 0.5)
    while True:
        severe += [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
        if (wait_for_one and severe) or time.monotonic() >= deadline:
            return severe
        time.sleep(0.1)


def check_in_browser(driver, path: Path, shot: Path, figures: set[str] | None = None) -> list[str]:
    """Open the page, check what a reader sees, save a screenshot; returns the section keys.
    `figures`: data-figure names the page must draw (a plot silently replaced by a note fails)."""
    page = path.read_text(encoding="utf-8")
    assert_self_contained(page)
    expected = re.findall(r'<section id="[^"]+" data-section="([^"]+)"', page)
    driver.get_log("browser"), requested_urls(driver)  # drop what earlier pages logged
    driver.get(path.as_uri())
    assert driver.execute_script("return document.readyState") == "complete"

    severe = severe_log(driver)
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

    # A figure is drawn, not only sized: its SVG holds shapes and text, and what they cover (the
    # bounding box of its content, not the <svg> element's declared size) is of a visible size.
    drawn = driver.execute_script("""
        const shapes = 'path, use, rect, line, polyline, polygon, circle, image';
        return Array.from(document.querySelectorAll('figure[data-figure]')).map(f => {
            const svg = f.querySelector('svg'); const box = svg ? svg.getBBox() : {width: 0, height: 0};
            return {name: f.dataset.figure, width: box.width, height: box.height,
                    shapes: svg ? svg.querySelectorAll(shapes).length : 0,
                    texts: svg ? svg.querySelectorAll('text').length : 0}; });""")
    assert len(drawn) == page.count("<figure data-figure=")
    for f in drawn:
        assert f["width"] > 50 and f["height"] > 50 and f["shapes"] >= 5 and f["texts"] >= 1, f
    assert (figures or set()) <= {f["name"] for f in drawn}

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
    keys = check_in_browser(browser, _report(tmp_path, "run", [run_dir]), tmp_path / "run.png", figures={"loss"})
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
    keys = check_in_browser(browser, page, tmp_path / "study.png", figures=STUDY_FIGURES)
    assert keys == ["study", "study-trials", "study-history", "study-intermediate", "study-parallel",
                    "study-importance"]
    html = page.read_text(encoding="utf-8")
    assert html.count("at step 6</td>") == 2  # both trials' last val loss, read from the study


def test_study_with_pruned_and_failed_trials_in_the_browser(browser, tmp_path):
    folder = make_study(tmp_path / "tune-demo", PRUNED_STUDY)
    keys = check_in_browser(browser, _report(tmp_path, "pruned", [folder]), tmp_path / "pruned.png",
                            figures=STUDY_FIGURES)
    assert "study-intermediate" in keys and "study-importance" in keys


def test_ladder_report_in_the_browser(browser, tmp_path):
    ladders = [ROOT / "benchmarks" / "ladder-memory-cpu-tiny.json", ROOT / "benchmarks" / "ladder-speed-cpu-tiny.json"]
    keys = check_in_browser(browser, _report(tmp_path, "ladder", ladders), tmp_path / "ladder.png",
                            figures={"ladder-memory-cpu-tiny", "ladder-speed-cpu-tiny"})
    assert keys == ["ladder-memory-cpu-tiny", "ladder-speed-cpu-tiny"]


def test_the_checks_catch_a_page_that_fetches_errs_or_is_empty(browser, tmp_path):
    """The checks above are not vacuous: external references, a script error, a fetched file,
    an empty section, an empty figure and a missing one are each caught."""
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
    assert severe_log(browser, wait_for_one=True)
    assert browser.execute_script("return performance.getEntriesByType('resource').length") == 1  # the http one
    assert requested_urls(browser) == [fetches.as_uri(), (tmp_path / "pixel.png").as_uri(), "http://127.0.0.1:9/x.png"]

    # Each alone is a SEVERE console entry: an uncaught script error, a file that fails to load.
    for name, body in (("throws", "<script>undefinedFunction()</script>"), ("missing", '<img src="missing.png">')):
        (tmp_path / f"{name}.html").write_text(f"<!DOCTYPE html><html><body>{body}</body></html>")
        browser.get_log("browser")  # drop what the page before logged
        browser.get((tmp_path / f"{name}.html").as_uri())
        assert severe_log(browser, wait_for_one=True), name

    def page(body: str) -> Path:
        path = tmp_path / "page.html"
        path.write_text(f'<!DOCTYPE html><html><body><section id="a" data-section="a"><h2>A</h2>{body}</section>'
                        '</body></html>')
        return path

    with pytest.raises(AssertionError, match="'key': 'a'"):
        check_in_browser(browser, page(""), tmp_path / "empty.png")
    # An <svg> of a size but nothing drawn in it (the old check measured only the element).
    with pytest.raises(AssertionError, match="'name': 'x'"):
        check_in_browser(browser, page('<figure data-figure="x"><svg xmlns="http://www.w3.org/2000/svg" width="400" '
                                       'height="300"></svg><figcaption>x</figcaption></figure>'), tmp_path / "x.png")
    import matplotlib.pyplot as plt

    from slipstream.report.page import figure

    fig, ax = plt.subplots()
    ax.plot([1, 2, 3], [3, 1, 2])
    drawn = page(figure(fig, "drawn", "a line"))
    assert check_in_browser(browser, drawn, tmp_path / "drawn.png", figures={"drawn"}) == ["a"]
    with pytest.raises(AssertionError):  # a figure the page should have drawn but did not
        check_in_browser(browser, drawn, tmp_path / "drawn.png", figures={"drawn", "loss"})
