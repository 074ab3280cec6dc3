"""Headless Chromium for the browser tests: Debian's `chromium` and `chromium-driver` (.ci/run and `make test`
install them), driven by selenium. Nothing is downloaded: both paths are given, so Selenium Manager never runs."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator

ARTIFACTS_DIR_ENV = "SEGSERVE_TEST_ARTIFACTS"
"""Where browser tests also save their screenshots (a git-ignored folder; unset = the test's tmp_path only)."""


@contextlib.contextmanager
def headless_chromium(width: int = 1400, height: int = 900) -> Iterator:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert browser and driver, "install Debian's chromium and chromium-driver (make test does, as root)"
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     f"--window-size={width},{height}", "--force-device-scale-factor=1"):
        options.add_argument(argument)
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must never reach the network
    session = webdriver.Chrome(options=options, service=Service(executable_path=driver))
    try:
        yield session
    finally:
        session.quit()
