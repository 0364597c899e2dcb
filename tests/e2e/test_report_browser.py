"""`slipstream report` pages opened in a real headless browser (Debian's chromium via Selenium),
from file:// as a user opens them: a run of a real training, a tuning study and a ladder result.

Each page must load without console errors, show every section with content, draw every figure
at a visible size, and fetch nothing: the page is self-contained (checked in the HTML and in the
browser's own list of fetched resources)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.report.ladder import ladder_sections
from slipstream.report.page import render_page, write_page
from slipstream.report.study import study_sections
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


def test_ladder_report_in_the_browser(browser, tmp_path):
    sections = (ladder_sections(ROOT / "benchmarks" / "ladder-memory-cpu-tiny.json")
                + ladder_sections(ROOT / "benchmarks" / "ladder-speed-cpu-tiny.json"))
    path = write_page(tmp_path / "ladder.html", render_page("ladders", sections))
    keys = check_in_browser(browser, path, tmp_path / "ladder.png")
    assert keys == ["ladder-memory-cpu-tiny", "ladder-speed-cpu-tiny"]


def test_study_report_in_the_browser(browser, tmp_path):
    folder = make_study(tmp_path / "tune-demo", PRUNED_STUDY)
    path = write_page(tmp_path / "study.html", render_page("study", study_sections(folder)))
    keys = check_in_browser(browser, path, tmp_path / "study.png")
    assert keys == ["study", "study-trials", "study-history", "study-intermediate", "study-parallel",
                    "study-importance"]


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
