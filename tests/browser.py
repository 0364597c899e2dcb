"""A real headless browser for the report tests: Debian's chromium driven through Selenium.

The browser and driver are the system packages at fixed paths, given to Selenium explicitly, so
Selenium Manager never looks for (or downloads) a browser. When they are missing, the test setup
installs them with `.ci/install-chromium` (apt), as CI does before `make test`.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
INSTALLER = Path(__file__).resolve().parents[1] / ".ci" / "install-chromium"


def ensure_chromium() -> None:
    """Install chromium + chromedriver when either is missing (raises if the installer fails)."""
    if CHROMIUM.exists() and CHROMEDRIVER.exists():
        return
    proc = subprocess.run([str(INSTALLER)], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{INSTALLER} failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


def start_chromium(width: int = 1400, height: int = 1000):
    """A headless Chrome session with the browser console (driver.get_log("browser")) and its
    requests (`requested_urls`) captured."""
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
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)


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
    own frame), so the PNG is exactly that many pixels."""
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": width, "height": 800, "deviceScaleFactor": 1, "mobile": False})
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": width, "height": min(height, max_height), "deviceScaleFactor": 1, "mobile": False})
    png = driver.get_screenshot_as_png()
    driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    path.write_bytes(png)
    return png
