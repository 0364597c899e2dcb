"""A real headless browser for the report tests: Debian's chromium driven through Selenium, and the
static check that a page is self-contained.

The browser and driver are the system packages at fixed paths, given to Selenium explicitly, so
Selenium Manager never looks for (or downloads) a browser or driver; `start_chromium` fails if it
is ever asked. When they are missing, the test setup installs them with `.ci/install-chromium`
(apt), as CI does before `make test`.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
INSTALLER = Path(__file__).resolve().parents[1] / ".ci" / "install-chromium"
# A page that takes longer than this to load, or a script longer to run, is a hung browser: the
# test fails instead of waiting for pytest's own timeout (or hanging CI).
PAGE_LOAD_TIMEOUT_S = 60
SCRIPT_TIMEOUT_S = 30


def _version(binary: Path) -> str:
    """The version number a browser or driver prints ("Chromium 150.0.7871.100 built on ...")."""
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60).stdout
    match = re.search(r"\d+(?:\.\d+){2,3}", out)
    return match.group(0) if match else out.strip()


def ensure_chromium() -> None:
    """Install chromium + chromedriver when either is missing (raises if the installer fails), and
    check that the driver is the browser's own version (a chromium upgraded without its driver
    fails every session with a less plain message)."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        proc = subprocess.run([str(INSTALLER)], capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"{INSTALLER} failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    browser, driver = _version(CHROMIUM), _version(CHROMEDRIVER)
    if browser != driver:
        raise RuntimeError(f"{CHROMEDRIVER} is version {driver} but {CHROMIUM} is {browser}; install both from "
                           f"one package version: run {INSTALLER} (apt-get install chromium chromium-driver)")


@contextlib.contextmanager
def _no_selenium_manager():
    """Selenium Manager downloads browsers and drivers it finds missing: with the paths given it is
    never asked, and this makes sure (no network in CI but package registries)."""
    from selenium.webdriver.common.selenium_manager import SeleniumManager

    def refuse(*args, **kwargs):
        raise AssertionError("Selenium Manager was asked for a browser or driver; give both paths explicitly")

    original = SeleniumManager.binary_paths
    SeleniumManager.binary_paths = refuse
    try:
        yield
    finally:
        SeleniumManager.binary_paths = original


def start_chromium(width: int = 1400, height: int = 1000):
    """A headless Chrome session with the browser console (driver.get_log("browser")) and its
    requests (`requested_urls`) captured. The caller quits it (driver.quit(), in a fixture's
    teardown), which also ends the browser's processes and removes its temporary profile."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    ensure_chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    # --no-sandbox: CI containers run as root, where Chrome's sandbox refuses to start;
    # --disable-dev-shm-usage: a container's small /dev/shm crashes tabs of long pages.
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}"):
        options.add_argument(arg)
    # browser: the console; performance: DevTools events, whose Network.requestWillBeSent lists
    # every request, file:// ones included (the page's resource timing only lists network fetches).
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    with _no_selenium_manager():
        driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        driver.set_page_load_timeout(PAGE_LOAD_TIMEOUT_S)
        driver.set_script_timeout(SCRIPT_TIMEOUT_S)
    except BaseException:
        driver.quit()
        raise
    return driver


def requested_urls(driver) -> list[str]:
    """Every URL the browser requested since the last call (the page itself included)."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def full_page_screenshot(driver, path: Path, width: int = 1400, max_height: int = 20000) -> bytes:
    """A PNG of the page, `width` CSS pixels wide and as tall as the page (at most max_height),
    saved at `path`. The viewport itself is resized (a window size would include the browser's
    own frame), so the PNG is exactly that many pixels; the size is restored afterwards, also on
    an error (the session serves the next test)."""
    try:
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                               {"width": width, "height": 800, "deviceScaleFactor": 1, "mobile": False})
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                               {"width": width, "height": min(height, max_height), "deviceScaleFactor": 1,
                                "mobile": False})
        png = driver.get_screenshot_as_png()
    finally:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    path.write_bytes(png)
    return png


# ---------------------------------------------------------------------------- self-contained


# Attributes whose value the browser fetches, or navigates to, by itself.
URL_ATTRIBUTES = {"src", "href", "xlink:href", "srcset", "imagesrcset", "data", "poster", "background", "action",
                  "formaction", "manifest", "codebase", "archive", "ping", "lowsrc", "dynsrc", "longdesc", "cite"}
# Elements that load or run something whatever their attributes say: a report page has none.
FETCHING_TAGS = {"script", "link", "iframe", "frame", "frameset", "object", "embed", "applet", "base", "portal"}
_CSS_URL = re.compile(r"url\(\s*(['\"]?)(.*?)\1\s*\)", re.I | re.S)


def _inline(target: str) -> bool:
    """An anchor on the page or inline data: nothing is fetched."""
    return target.strip().lower().startswith(("#", "data:"))


def _css_references(css: str, stylesheet: bool = True) -> list[str]:
    """url()s to elsewhere; in a stylesheet (or style attribute) also @import, image-set() and
    escapes (which could spell url( otherwise)."""
    found = [f"url({target})" for _, target in _CSS_URL.findall(css) if not _inline(target)]
    lowered = css.lower()
    return found + [f"CSS {what}" for what in ("@import", "image-set(", "\\") if stylesheet and what in lowered]


class _References(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)  # &#104;ttp is http
        self.found: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag, attrs):
        self._in_style = tag == "style"
        values = dict(attrs)
        if tag in FETCHING_TAGS:
            self.found.append(f"<{tag}>")
        if tag == "meta" and (values.get("http-equiv") or "").lower() == "refresh":
            self.found.append("<meta http-equiv=refresh>")
        for name, value in attrs:
            value = value or ""
            if name in ("srcset", "imagesrcset"):
                targets = [candidate.split()[0] for candidate in value.split(",") if candidate.split()]
            else:
                targets = [value] if name in URL_ATTRIBUTES else []
            self.found += [f"<{tag} {name}={target!r}>" for target in targets if not _inline(target)]
            # style, fill, clip-path, marker-end, filter, mask ...: any attribute may hold url()
            self.found += [f"<{tag} {name}>: {ref}" for ref in _css_references(value, stylesheet=name == "style")]

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        self._in_style = False

    def handle_endtag(self, tag):
        self._in_style = False

    def handle_data(self, data):
        if self._in_style:
            self.found += [f"<style>: {ref}" for ref in _css_references(data)]


def external_references(page: str) -> list[str]:
    """Everything in an HTML page that would make a browser fetch or load something from outside
    the page: URL attributes (src, href, srcset, data, poster, ...) that are not an #anchor or
    data:, url() in styles and presentation attributes, @import, image-set(), scripts, links,
    frames, objects and embeds, <base> and a meta refresh. [] for a self-contained page."""
    parser = _References()
    parser.feed(page)
    parser.close()
    return parser.found
