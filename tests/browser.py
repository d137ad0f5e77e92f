"""A real headless Chromium for tests (Debian ``chromium`` + ``chromium-driver``, driven by
selenium). Missing browser: in CI (``CI`` set) the test fails, since ``.ci/run`` installs the
browser; elsewhere it is skipped with the command that installs it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def find_browser(what: str) -> tuple[str, str]:
    """(browser, driver) paths, or fail / skip the test ``what`` names."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    try:
        import selenium  # noqa: F401
    except ImportError:
        driver = None
    if browser and driver:
        return browser, driver
    why = "needs Debian chromium + chromium-driver and selenium (.ci/run installs them)"
    if os.environ.get("CI"):
        pytest.fail(f"{what} {why}; found browser={browser} driver={driver}")
    pytest.skip(f"{why}: apt-get install -y chromium chromium-driver")


@contextmanager
def headless_chrome(what: str, size: str, console_log: bool = False) -> Iterator[Any]:
    """A Chrome window of ``size`` (``"1400,1000"``); ``console_log`` keeps the page's console
    (to see uncaught errors)."""
    browser, driver = find_browser(what)
    os.environ.setdefault("SE_OFFLINE", "true")  # never let selenium download a driver
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for flag in (*FLAGS, f"--window-size={size}"):
        opts.add_argument(flag)
    if console_log:
        opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(service=Service(driver), options=opts)
    drv.set_page_load_timeout(30)
    try:
        yield drv
    finally:
        drv.quit()
